r"""One status enumeration for every computation that can fail for numerical reasons (floor 1).

Under ``jit`` nothing can be raised, so a solve (``SolveInfo``), a sharpness search
(:class:`~minigeo.sharpness.SharpnessResult`) and the randomized estimators (:class:`~minigeo.curvature.EstimateInfo`,
with ``return_info=True``) report a :class:`Status`; eagerly the same status raises a
:class:`~minigeo.GeometryError` with its message (:func:`raise_for_status`), from the status the
computation already produced, never by running it again.
"""

from __future__ import annotations

import enum
from typing import Any

import jax.numpy as jnp

from ._checks import GeometryError


class Status(enum.IntEnum):
    r"""Why a result cannot be trusted (``OK``: it can), shared by every minigeo computation.

    ============================  =====  =============================================================
    member                        code   meaning
    ============================  =====  =============================================================
    ``OK``                        0      the result is what was asked for
    ``MAX_ITERATIONS``            1      an iterative solve reached ``maxiter`` before ``tol``
    ``NOT_POSITIVE_DEFINITE``     2      a matrix that must be positive definite is not (to working precision)
    ``NON_FINITE``                3      NaN or infinity met in the products, the matrix or the values
    ``INACCURATE``                4      round-off kept the true residual above ``tol``
    ``NOT_SYMMETRIC``             5      a matrix that must be symmetric is not
    ``ILL_CONDITIONED_PAIR``      6      a GL(h) pair too ill-conditioned for the requested accuracy
    ``RHO_OUT_OF_RANGE``          7      a radius :math:`\rho` outside :math:`(0, 1/\varepsilon]`
    ``UNCERTIFIED``               8      Krylov values whose residual bound exceeds the tolerance
    ============================  =====  =============================================================

    Examples
    --------
    >>> import minigeo as mg
    >>> mg.Status(2).name, int(mg.Status.UNCERTIFIED)
    ('NOT_POSITIVE_DEFINITE', 8)
    >>> mg.Status.MAX_ITERATIONS.message.split(":")[0]
    'did not converge'

    References
    ----------
    No formula from the source papers: the failure convention of the library (lineax's
    ``RESULTS`` is the model). Used from chapter 1 on.
    """

    OK = 0
    MAX_ITERATIONS = 1
    NOT_POSITIVE_DEFINITE = 2
    NON_FINITE = 3
    INACCURATE = 4
    NOT_SYMMETRIC = 5
    ILL_CONDITIONED_PAIR = 6
    RHO_OUT_OF_RANGE = 7
    UNCERTIFIED = 8

    @property
    def message(self) -> str:
        """What the status means and what to do, in one sentence."""
        return _MESSAGES[self]


_MESSAGES = {
    Status.OK: "the result is what was asked for",
    Status.MAX_ITERATIONS: (
        "did not converge: an iterative solve reached maxiter before tol, so the operator is singular or badly "
        "conditioned (add damping, or raise maxiter)"
    ),
    Status.NOT_POSITIVE_DEFINITE: (
        "not positive definite: the matrix is singular or indefinite to working precision (add damping)"
    ),
    Status.NON_FINITE: (
        "NaN or infinity met in the products, the matrix or the values (the function is not differentiable "
        "here, overflowed, or a solve with the metric failed)"
    ),
    Status.INACCURATE: (
        "round-off kept the true residual above tol (use float64, more damping or a looser tol)"
    ),
    Status.NOT_SYMMETRIC: "a matrix that must be symmetric is not, beyond round-off",
    Status.ILL_CONDITIONED_PAIR: (
        "a GL(h) pair is too ill-conditioned for the requested accuracy (loosen rtol, use float64, or take "
        "the pair out of the symmetry specification)"
    ),
    Status.RHO_OUT_OF_RANGE: "the radius rho is not in (0, 1/eps] for the parameters' dtype",
    Status.UNCERTIFIED: (
        "Krylov values whose residual bound exceeds the tolerance (raise num_iterations, loosen rtol, or "
        "pass another key)"
    ),
}


def describe(status: Any) -> str:
    """``"status 2 (NOT_POSITIVE_DEFINITE): ..."`` for a concrete status (a Python int or a 0-d array)."""
    code = int(status)
    try:
        member = Status(code)
    except ValueError:
        return f"status {code} (unknown)"
    return f"status {code} ({member.name}): {member.message}"


def raise_for_status(status: Any, who: str, *, detail: str = "") -> None:
    """Eagerly: raise :class:`GeometryError` for a concrete status other than ``OK`` (else nothing).

    ``detail`` adds what the caller knows (the numbers behind the status); the status's own message
    always comes first, so the same status reads the same everywhere.
    """
    code = int(status)
    if code == Status.OK:
        return
    raise GeometryError(f"{who}: {describe(code)}." + (f" {detail}" if detail else ""))


def first_failure(*statuses: Any) -> jnp.ndarray:
    """The first status other than ``OK`` among ``statuses`` (scalars or arrays, flattened in order), else ``OK``."""
    flat = jnp.concatenate([jnp.ravel(jnp.asarray(s, jnp.int32)) for s in statuses])
    bad = flat != Status.OK
    return jnp.where(jnp.any(bad), flat[jnp.argmax(bad)], jnp.int32(Status.OK)).astype(jnp.int32)

"""Linear solves with the checks users need (floor 1).

* :func:`solve_spd_dense`: a Cholesky solve for dense symmetric positive-definite matrices.
* :func:`solve_spd_cg`: conjugate gradients for matrix-free operators on pytrees, with a
  status (:class:`SolveInfo`) that also works under ``jit``.
(Lanczos is one recurrence, in :mod:`minigeo._eigen`: block Lanczos, with block size 1 for
stochastic Lanczos quadrature.)

Both refuse singular or indefinite systems with a message that suggests
damping, instead of returning garbage.

Damping: everywhere in minigeo, ``damping`` :math:`\\epsilon` means the operator
:math:`A + \\epsilon I` (added to the operator it is given).  It may be a Python
number, a NumPy scalar, a 0-d JAX array or a traced value; negative or NaN values
raise :class:`GeometryError` when the value is concrete (the check is skipped
under ``jit``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from ._checks import (
    GeometryError,
    check_finite,
    check_spd,
    check_square_matrix,
    is_concrete,
    is_symmetric_to_roundoff,
    symmetry_rtol,
)
from ._tree import PyTree, ravel, tree_size
from ._status import Status, raise_for_status

__all__ = [
    "SolveInfo",
    "check_solver_options",
    "solve_spd_dense",
    "solve_spd_cg",
    "add_damping",
    "check_damping",
    "symmetry_rtol",
]

#: a CG run still iterating (never returned: :attr:`SolveInfo.status` is a :class:`~minigeo.Status` code)
_RUNNING = -1


class SolveInfo(NamedTuple):
    """What happened in a linear solve (all fields are JAX scalars, also under ``jit``).

    Returned by conjugate gradients (:func:`solve_spd_cg`, ``Metric.solve``, ``sharp``,
    ``natural_gradient``) and, with the same fields, by the dense (Cholesky) and pseudo-inverse
    solvers.

    Attributes
    ----------
    converged
        ``True`` iff ``status == 0``: then the true relative residual of the returned ``x``,
        :math:`\\lVert b - Ax\\rVert/\\lVert b\\rVert` computed in the working precision (``residual``),
        is at most ``tol`` (CG; ``tol`` raised to at least the dtype's ``eps``).
    status
        A :class:`~minigeo.Status` code (``mg.Status(int(info.status))`` names it):
        ``0`` (``Status.OK``) converged; ``1`` (``Status.MAX_ITERATIONS``) reached ``maxiter`` without
        converging; ``2`` (``Status.NOT_POSITIVE_DEFINITE``) not positive definite: CG met curvature
        :math:`p^\\top A p / p^\\top p \\le \\varepsilon\\max` (of the curvatures met so far), or the
        Cholesky factorization failed or met a pivot :math:`\\le n\\varepsilon\\max|A_{ij}|` (singular or
        indefinite to working precision: add damping); ``3`` (``Status.NON_FINITE``) met non-finite values
        (NaN or infinity in the operator's products or the matrix); ``4`` (``Status.INACCURATE``) the
        recurrence reached the tolerance but the true residual stayed above ``tol`` after three
        residual replacements (round-off limits the accuracy: float32 on an ill-conditioned operator;
        use float64, more damping or a looser ``tol``); ``5`` (``Status.NOT_SYMMETRIC``, dense and
        pseudo-inverse solvers) the matrix is not symmetric: :math:`\\max|A - A^\\top| >`
        ``max(64 n, 1000) eps`` :math:`\\max|A|`.  With status 2, 3 or 5 the returned solution is NaN,
        so that it cannot be used by mistake.
    iterations
        Number of CG iterations run (0 for the dense solvers).
    residual
        The true relative residual :math:`\\lVert b - Ax\\rVert / \\lVert b\\rVert`, recomputed from the
        returned ``x`` in the working precision (0 for ``b = 0``; it differs from the exact residual of
        ``x`` by the round-off of evaluating it, about :math:`\\varepsilon\\lVert A\\rVert\\lVert x\\rVert/\\lVert b\\rVert`);
        for CG status 2 and 3, the recurrence's last residual; NaN for the dense solvers' status 2, 3
        and 5; 0 for the pseudo-inverse (not a solve: :math:`G^+ b` need not solve :math:`Gx = b`).
    curvature
        CG: the smallest Rayleigh quotient :math:`p^\\top A p / p^\\top p` met along the search
        directions.  Cholesky: the smallest pivot :math:`L_{ii}^2` (at least the smallest eigenvalue).
        Pseudo-inverse: 0.
    """

    converged: jax.Array
    status: jax.Array
    iterations: jax.Array
    residual: jax.Array
    curvature: jax.Array


def _leaves_dtype(tree: PyTree) -> Any:
    leaves = jax.tree_util.tree_leaves(tree)
    dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
    return dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(float)


def check_damping(damping: Any, who: str = "damping") -> None:
    """Raise unless ``damping`` is a scalar (number, NumPy scalar, 0-d array or tracer) that is ``>= 0``.

    The value is checked only when concrete; negative or NaN damping raises :class:`GeometryError`.
    """
    if isinstance(damping, (bool, np.bool_)) or (
        hasattr(damping, "dtype") and jnp.issubdtype(damping.dtype, jnp.bool_)
    ):
        raise GeometryError(f"{who} must be a number >= 0, got the boolean {damping!r}.")
    try:
        shape = jnp.shape(damping)
    except TypeError:
        raise GeometryError(
            f"{who} must be a number >= 0 (float, NumPy scalar or 0-d array); got {type(damping).__name__}."
        ) from None
    if shape != ():
        raise GeometryError(f"{who} must be a scalar >= 0; got an array of shape {shape}.")
    if isinstance(damping, jax.core.Tracer):
        return
    try:
        value = float(np.asarray(damping))
    except (TypeError, ValueError):
        raise GeometryError(f"{who} must be a number >= 0; got {damping!r}.") from None
    if not value >= 0 or not np.isfinite(value):  # also catches NaN
        raise GeometryError(f"{who} must be >= 0 and finite, got {value}.")


def _is_zero(damping: Any) -> bool:
    """``True`` iff ``damping`` is concretely zero (a tracer is never known to be zero)."""
    if isinstance(damping, jax.core.Tracer):
        return False
    return float(np.asarray(damping)) == 0.0


def add_damping(op: Callable[[PyTree], PyTree], damping: Any) -> Callable[[PyTree], PyTree]:
    """The operator ``v -> op(v) + damping * v`` (``damping`` may be a tracer)."""
    if _is_zero(damping):
        return op
    return lambda v: jax.tree_util.tree_map(lambda a, b: a + jnp.asarray(damping, jnp.result_type(b)) * b, op(v), v)


def solve_spd_dense(
    matrix: jax.Array,
    rhs: PyTree,
    *,
    damping: Any = 0.0,
    what: str = "the metric G",
    return_info: bool = False,
) -> PyTree | tuple[PyTree, SolveInfo]:
    """Solve ``(matrix + damping I) x = rhs`` by Cholesky; ``rhs`` is a pytree, ``matrix`` is over its flattened coordinates.

    Eagerly, a non-symmetric, singular or indefinite (damped) matrix raises
    :class:`GeometryError` (symmetry to ``max(64 n, 1000) eps`` relative to ``max |matrix|``;
    definiteness by the eigenvalues).  Under ``jit`` the same symmetry test and the Cholesky
    factorization give the status of a :class:`SolveInfo` (``return_info=True``): 5 not symmetric,
    2 the factorization failed or met a pivot :math:`L_{ii}^2 \\le n\\,\\varepsilon\\max|A_{ij}|`
    (not positive definite to working precision), 3 non-finite entries; ``x`` is then NaN, never
    a finite wrong answer (Cholesky reads one triangle only, so a non-symmetric matrix would
    otherwise give the solution of another system).

    Raises
    ------
    GeometryError
        Eagerly, for a matrix that is not square of the right size, not finite, not symmetric or
        not positive definite, an invalid ``damping``, or a non-finite ``rhs``.
    """
    check_damping(damping)
    check_finite(rhs, "the right-hand side")
    check_square_matrix(matrix, tree_size(rhs), what)
    check_finite(matrix, what)
    matrix = jnp.asarray(matrix)
    flat_rhs, unravel = ravel(rhs)
    dtype = jnp.result_type(matrix, flat_rhs)
    dtype = dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(float)
    matrix, flat_rhs = matrix.astype(dtype), flat_rhs.astype(dtype)
    damped = matrix if _is_zero(damping) else matrix + damping * jnp.eye(matrix.shape[0], dtype=dtype)
    check_spd(damped, what + ("" if _is_zero(damping) else " + damping * I"), rtol=symmetry_rtol(matrix))
    x, info = _dense_cholesky(matrix, damped, flat_rhs)
    solution = unravel(x)
    return (solution, info) if return_info else solution


def cholesky_with_pivot_test(matrix: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(L, definite, min_pivot)``: the Cholesky factor and the positive-definiteness test of minigeo.

    ``definite`` is False when the factorization failed (NaN) or a pivot
    :math:`L_{ii}^2 \\le n\\,\\varepsilon\\max|A_{ij}|` (not positive definite to working precision).
    One test for every dense solve and factor (:func:`solve_spd_dense`, the dense metrics).
    """
    n = matrix.shape[0]
    real = jnp.finfo(matrix.dtype).dtype
    eps = jnp.finfo(matrix.dtype).eps
    L = jnp.linalg.cholesky(matrix)  # NaN where it fails
    pivots = jnp.real(jnp.diagonal(L)) ** 2
    min_pivot = jnp.min(pivots) if n else jnp.asarray(jnp.inf, real)
    scale = jnp.max(jnp.abs(matrix)) if n else jnp.zeros((), real)
    return L, min_pivot > n * eps * scale, min_pivot  # NaN (failed factorization) is not definite


def _dense_cholesky(matrix: jax.Array, damped: jax.Array, b: jax.Array) -> tuple[jax.Array, SolveInfo]:
    """Cholesky solve with the traced checks of :func:`solve_spd_dense`; ``x`` is NaN unless the status is 0."""
    real = jnp.finfo(damped.dtype).dtype
    finite = jnp.all(jnp.isfinite(damped)) & jnp.all(jnp.isfinite(b))
    symmetric = is_symmetric_to_roundoff(matrix)
    L, definite, min_pivot = cholesky_with_pivot_test(damped)
    status = jnp.where(
        ~finite, Status.NON_FINITE, jnp.where(~symmetric, Status.NOT_SYMMETRIC, jnp.where(~definite, Status.NOT_POSITIVE_DEFINITE, Status.OK))
    ).astype(jnp.int32)
    ok = status == Status.OK
    x = jsl.cho_solve((L, True), b)
    x = jnp.where(ok, x, jnp.nan)
    e = _power_of_two_scale(b)  # the residual of the exactly scaled system: no underflow for a tiny b
    bs = jnp.ldexp(b, -e)
    r = bs - damped @ jnp.ldexp(x, -e)
    bb = jnp.real(jnp.vdot(bs, bs))
    residual = jnp.sqrt(jnp.real(jnp.vdot(r, r)) / jnp.where(bb > 0, bb, 1.0))
    info = SolveInfo(ok, status, jnp.zeros((), jnp.int32), residual.astype(real), min_pivot.astype(real))
    return x, info


#: Residual replacements after the recurrence claims convergence (see :func:`_cg_flat`).
_MAX_REPLACEMENTS = 3


def _cg_loop(matvec, b, x, r, k, curv, rq_max, threshold, maxiter):
    """CG iterations from ``x`` with residual ``r = b - A x`` (``p = r``) until the recurrence converges or stops.

    Scale-free: every product is taken with the **unit** search direction ``p / |p|``, so that the
    curvature ``p^T A p / p^T p`` is computed without squaring ``|p|`` (no underflow when the
    operator or the residual is tiny), and every test is relative: the residual to ``threshold``
    (``tol^2 |b|^2``), the curvature to the largest met so far.
    """
    dtype = b.dtype
    eps = jnp.finfo(dtype).eps
    rr = jnp.real(jnp.vdot(r, r))
    status0 = jnp.where(rr <= threshold, Status.OK, _RUNNING)
    status0 = jnp.where(jnp.isfinite(rr), status0, Status.NON_FINITE).astype(jnp.int32)

    def cond(state):
        return state[5] == _RUNNING

    def body(state):
        k, x, r, p, rr, _, curv, rq_max = state
        pn = jnp.sqrt(jnp.real(jnp.vdot(p, p)))
        u = p / jnp.where(pn > 0, pn, 1.0)  # the unit search direction
        Au = matvec(u)
        rq = jnp.real(jnp.vdot(u, Au))  # = p^T A p / p^T p
        curv = jnp.minimum(curv, rq)
        rq_max = jnp.maximum(rq_max, rq)
        good = rq > eps * rq_max  # p^T A p <= 0, or below round-off of the largest curvature met: not PD
        alpha = rr / (jnp.where(pn > 0, pn, 1.0) * jnp.where(good, rq, 1.0))  # the step along u
        x_new = x + alpha * u
        r_new = r - alpha * Au
        rr_new = jnp.real(jnp.vdot(r_new, r_new))
        p_new = r_new + (rr_new / rr) * p
        k1 = k + 1
        status = jnp.where(
            ~jnp.isfinite(rq) | ~jnp.isfinite(rr_new),
            Status.NON_FINITE,
            jnp.where(
                ~good,
                Status.NOT_POSITIVE_DEFINITE,
                jnp.where(rr_new <= threshold, Status.OK, jnp.where(k1 >= maxiter, Status.MAX_ITERATIONS, _RUNNING)),
            ),
        ).astype(jnp.int32)
        keep = good & jnp.isfinite(rr_new)
        x = jnp.where(keep, x_new, x)
        r = jnp.where(keep, r_new, r)
        rr = jnp.where(keep, rr_new, rr)
        p = jnp.where(keep, p_new, p)
        return k1, x, r, p, rr, status, curv, rq_max

    init = (k, x, r, r, rr, status0, curv, rq_max)
    k, x, r, _, rr, status, curv, rq_max = jax.lax.while_loop(cond, body, init)
    return k, x, rr, status, curv, rq_max


def _power_of_two_scale(b: jax.Array) -> jax.Array:
    """The exponent ``e`` with ``max|b_i| = m 2^e``, ``m`` in ``[1/2, 1)`` (clamped to the normal range; 0 for ``b = 0``).

    Scaling by ``2^-e`` is exact in floating point, so ``b 2^-e`` has largest entry in ``[1/2, 1)``
    whatever the magnitude of ``b``, and ``x = y 2^e`` undoes it exactly.
    """
    finfo = jnp.finfo(b.dtype)
    amax = jnp.max(jnp.abs(b)) if b.size else jnp.zeros((), finfo.dtype)
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0).astype(finfo.dtype))
    return jnp.clip(e, int(finfo.minexp), int(finfo.maxexp) - 1)


def _cg_flat(matvec: Callable[[jax.Array], jax.Array], b: jax.Array, tol: Any, maxiter: int):
    """Conjugate gradients from ``x0 = 0``, scaled to ``b``, with breakdown detection and residual replacement.

    Returns ``(x, SolveInfo)``.  **Scaling.**  CG runs on ``b 2^-e`` (``2^e`` the power of two of
    ``max |b_i|``, an exact scaling) and returns ``y 2^e``: no quantity it compares can under- or
    overflow because ``b`` is tiny or huge, and ``x(c b) = c x(b)`` exactly for ``c`` a power of two
    (to the rounding of ``c b`` otherwise), down to the smallest normal float.

    **Residual replacement.**  The recurrence residual drifts from the true one :math:`b - Ax` in
    finite precision (float32 on a transformer's GGN: "converged" at a true residual 5-17 times the
    tolerance).  So when the recurrence reaches the tolerance, the true residual is computed (one
    product); if it is above the tolerance, CG restarts from ``x`` with the true residual (at most
    ``_MAX_REPLACEMENTS`` times, within ``maxiter``).  If it still is, the status is
    ``Status.INACCURATE``: status ``Status.OK`` means the true relative residual, computed
    from the returned ``x``, is at most ``tol``.
    """
    real = jnp.finfo(b.dtype).dtype
    e = _power_of_two_scale(b)
    b = jnp.ldexp(b, -e)
    bb = jnp.real(jnp.vdot(b, b))
    threshold = (tol**2) * bb
    inf = jnp.asarray(jnp.inf, real)
    k, x, rr_rec, status, curv, rq_max = _cg_loop(
        matvec, b, jnp.zeros_like(b), b, jnp.zeros((), jnp.int32), inf, -inf, threshold, maxiter
    )

    def true_residual(x):
        r = b - matvec(x)
        return r, jnp.real(jnp.vdot(r, r))

    r, rr = true_residual(x)

    def cond(state):
        k, _, _, rr, _, status, _, _, n = state
        return (status == Status.OK) & ~(rr <= threshold) & (n < _MAX_REPLACEMENTS) & (k < maxiter)

    def body(state):
        k, x, r, _, _, _, curv, rq_max, n = state
        k, x, rr_rec, status, curv, rq_max = _cg_loop(matvec, b, x, r, k, curv, rq_max, threshold, maxiter)
        r, rr = true_residual(x)
        return k, x, r, rr, rr_rec, status, curv, rq_max, n + 1

    init = (k, x, r, rr, rr_rec, status, curv, rq_max, jnp.zeros((), jnp.int32))
    k, x, r, rr, rr_rec, status, curv, _, _ = jax.lax.while_loop(cond, body, init)
    scale = jnp.where(bb > 0, bb, 1.0)
    true_res = jnp.sqrt(rr / scale)
    # converged means the true residual of the returned x is within tol (NaN is not)
    status = jnp.where((status == Status.OK) & ~(rr <= threshold), Status.INACCURATE, status)
    status = status.astype(jnp.int32)
    failed = (status == Status.NOT_POSITIVE_DEFINITE) | (status == Status.NON_FINITE)
    residual = jnp.where(failed, jnp.sqrt(rr_rec / scale), true_res)
    # the curvature is that of the operator itself (the scaling of b does not change it)
    return jnp.ldexp(x, e), SolveInfo(status == Status.OK, status, k, residual.astype(real), curv.astype(real))


def solve_spd_cg(
    op: Callable[[PyTree], PyTree],
    rhs: PyTree,
    *,
    damping: Any = 0.0,
    tol: float = 1e-6,
    maxiter: int | None = None,
    what: str = "the metric G",
    return_info: bool = False,
) -> PyTree | tuple[PyTree, SolveInfo]:
    """Solve ``(op + damping I) x = rhs`` by conjugate gradients; ``x0 = 0``.

    Differentiable (``lax.custom_linear_solve``), ``jit``- and ``vmap``-compatible.
    ``rhs = 0`` gives exactly ``x = 0`` (status 0).  Every step checks the curvature
    :math:`p^\\top A p`: a non-positive value means the operator is not positive
    definite (on the Krylov space CG explored) and stops the iteration.

    **Scale-free.**  Every test is relative: the residual to ``tol |rhs|``, the curvature to the
    largest met; CG runs on ``rhs`` scaled by a power of two to largest entry in ``[1/2, 1)``,
    so ``x`` scales linearly with ``rhs`` down to the smallest normal float (a gradient of norm
    ``1e-30`` is solved as accurately as one of norm 1).

    Errors and status:

    * **Eagerly** (concrete values), a solve that did not converge, met non-positive
      curvature or non-finite values raises :class:`GeometryError` (suggesting damping);
      the true residual is checked as well.
    * **Under** ``jit`` no exception is possible: with ``return_info=True`` the result
      is ``(x, info)``, a :class:`SolveInfo` whose ``status``/``converged`` fields the
      caller checks; ``x`` is NaN when the operator was found not positive definite
      (status 2) or non-finite (status 3), and the last iterate when ``maxiter`` was
      reached (status 1) or round-off kept the true residual above tolerance (status 4).

    ``converged`` (status 0) means the true relative residual :math:`\\lVert b - Ax\\rVert/\\lVert b\\rVert`
    of the returned ``x`` (computed in the working precision, reported as ``info.residual``) is at
    most ``tol``.  When the recurrence reaches the tolerance, the true residual is computed
    (one more product); if it is above the tolerance (the recurrence drifts in float32), CG
    restarts from ``x`` with it, at most three times, and reports status 4 if it stays above:
    the status under ``jit`` is the one an eager call checks.

    ``tol`` (in ``(0, 1)``) is relative to ``|rhs|`` and is raised to at least ``eps`` of the dtype.
    ``maxiter`` (a positive int) defaults to ``10 * d``.

    Raises
    ------
    GeometryError
        If ``tol`` is not in ``(0, 1)``, ``maxiter`` is not a positive int or ``None``,
        ``damping`` is invalid or ``rhs`` is not finite; eagerly, if the solve fails (above).
    """
    check_solver_options(tol, maxiter, "conjugate gradients")
    check_damping(damping)
    check_finite(rhs, "the right-hand side")
    damped = add_damping(op, damping)
    if is_concrete(rhs):
        damped(rhs)  # one eager product: runs the value checks inside the operator (traced in the loop below)
    flat_b, unravel, maxiter, _, tol_eff, matvec = _cg_setup(damped, rhs, tol, maxiter)

    def solve(mv, b):
        return _cg_flat(mv, b, tol_eff, maxiter)

    flat_x, info = jax.lax.custom_linear_solve(matvec, flat_b, solve, symmetric=True, has_aux=True)
    failed = (info.status == Status.NOT_POSITIVE_DEFINITE) | (info.status == Status.NON_FINITE)
    flat_x = jnp.where(failed, jnp.nan, flat_x)
    solution = unravel(flat_x)
    if is_concrete(flat_x, info):
        _raise_on_cg_failure(matvec, flat_b, info, tol_eff, maxiter, what)
    return (solution, info) if return_info else solution


def check_solver_options(tol: Any, maxiter: Any, who: str) -> None:
    """Raise :class:`GeometryError` unless ``tol`` is a number in ``(0, 1)`` and ``maxiter`` a positive int or ``None``.

    The one validation of the iterative-solver options of every public entry point (``who`` names
    it in the message).  ``tol`` may be a traced value (its range is then not checked); ``maxiter``
    must be concrete (it sizes the loop).
    """
    numeric = isinstance(tol, (int, float, np.number, jax.Array, np.ndarray)) and not isinstance(tol, (bool, np.bool_))
    if not numeric or (hasattr(tol, "dtype") and not (jnp.issubdtype(tol.dtype, jnp.floating)
                                                      or jnp.issubdtype(tol.dtype, jnp.integer))):
        raise GeometryError(
            f"{who}: tol must be a number in (0, 1) (a relative residual), got {type(tol).__name__} {tol!r}."
        )
    if not isinstance(tol, jax.core.Tracer):
        try:
            if jnp.shape(tol) != ():
                raise TypeError
            value = float(np.asarray(tol))
        except (TypeError, ValueError):
            raise GeometryError(
                f"{who}: tol must be a number in (0, 1) (a relative residual), got {type(tol).__name__} {tol!r}."
            ) from None
        if not 0.0 < value < 1.0:  # also refuses NaN
            raise GeometryError(
                f"{who}: tol must be in (0, 1): it is the relative residual |b - Ax| / |b| to reach (e.g. tol=1e-6); "
                f"got tol={value!r}."
            )
    if maxiter is None:
        return
    if isinstance(maxiter, (bool, np.bool_)) or not isinstance(maxiter, (int, np.integer)) or maxiter < 1:
        raise GeometryError(
            f"{who}: maxiter must be a positive int (an iteration count) or None (the default, 10 d); got {maxiter!r}."
        )


def _cg_setup(op: Callable[[PyTree], PyTree], rhs: PyTree, tol: Any, maxiter: int | None):
    """Flat right-hand side, unravel, the effective ``maxiter``, eps, effective tolerance and flat matvec."""
    check_solver_options(tol, maxiter, "conjugate gradients")
    flat_b, unravel = ravel(rhs)
    d = flat_b.size
    maxiter = int(maxiter) if maxiter is not None else 10 * max(d, 1)
    eps = float(jnp.finfo(flat_b.dtype if jnp.issubdtype(flat_b.dtype, jnp.inexact) else float).eps)
    if not jnp.issubdtype(flat_b.dtype, jnp.inexact):
        flat_b = flat_b.astype(jnp.result_type(float))
    tol_eff = tol if isinstance(tol, jax.core.Tracer) else max(float(tol), eps)

    def matvec(x):
        return ravel(op(unravel(x)))[0].astype(flat_b.dtype)

    return flat_b, unravel, maxiter, eps, tol_eff, matvec


def check_cg_solution(
    op: Callable[[PyTree], PyTree], rhs: PyTree, info: SolveInfo, *, tol: float, maxiter: int | None, what: str
) -> None:
    """Eagerly, the errors :func:`solve_spd_cg` raises, for the ``info`` of a solve run elsewhere (e.g. compiled).

    The status already accounts for the true residual (:func:`_cg_flat`), so the solution itself is not needed.
    """
    flat_b, _, maxiter, _, tol_eff, matvec = _cg_setup(op, rhs, tol, maxiter)
    _raise_on_cg_failure(matvec, flat_b, info, tol_eff, maxiter, what)


def _cg_failure_message(matvec, b, info: SolveInfo, tol: float, maxiter: int, what: str, status: int) -> str | None:
    """The eager message of a failed CG solve, with the numbers behind its status (``None``: no detail)."""
    k = int(info.iterations)
    curv = float(info.curvature)
    if status == Status.NON_FINITE:
        return (
            f"conjugate gradients on {what} met non-finite values (NaN or infinity) after {k} iterations: the "
            "operator's products are not finite. Check the metric at these parameters."
        )
    if status == Status.NOT_POSITIVE_DEFINITE:
        u = jnp.ldexp(b, -_power_of_two_scale(b))  # scale-free: |u| >= 1/2 unless b = 0
        uu = float(jnp.real(jnp.vdot(u, u)))
        rayleigh = abs(float(jnp.real(jnp.vdot(u, matvec(u))))) / uu if uu > 0 else 1.0
        suggestion = 1e-3 * (rayleigh if np.isfinite(rayleigh) and rayleigh > 0 else 1.0)
        return (
            f"{what} is not positive definite: add damping (e.g. damping={suggestion:.3g}). Conjugate gradients did "
            f"not converge: at iteration {k} it met non-positive curvature p^T A p / p^T p = {curv:.3g} <= 0, so the "
            "operator is singular or indefinite (on the directions explored). Add damping, or use a pseudo-inverse "
            "where a singular metric is intended."
        )
    if status == Status.MAX_ITERATIONS:
        return (
            f"conjugate gradients on {what} did not converge (relative residual {float(info.residual):.3g} > "
            f"tol={tol:.3g} after {maxiter} iterations). The operator is probably singular or badly conditioned: "
            "add damping (e.g. damping=1e-3), or raise maxiter."
        )
    if status == Status.INACCURATE:
        return (
            f"conjugate gradients on {what} did not reach tol={tol:.3g}: after {k} iterations and up to three "
            f"restarts from the true residual, the true relative residual is {float(info.residual):.3g} (round-off limits "
            "the accuracy). The operator is badly conditioned for this dtype: add damping (e.g. damping=1e-3), "
            "use float64, or loosen tol."
        )


def _raise_on_cg_failure(matvec, b, info: SolveInfo, tol: float, maxiter: int, what: str) -> None:
    """Raise from the solve's status (the one :class:`Status`), with the numbers behind it; nothing if OK."""
    status = int(info.status)
    if status == Status.OK:
        return
    message = _cg_failure_message(matvec, b, info, tol, maxiter, what, status)
    if message is None:
        raise_for_status(status, f"conjugate gradients on {what}")
    raise GeometryError(f"{message} [{Status(status).name}]")

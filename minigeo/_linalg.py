"""Linear solves with the checks users need (floor 1).

Thin wrappers over ``jax.scipy``: a Cholesky solve for dense symmetric
positive-definite matrices and conjugate gradients for matrix-free operators on
pytrees.  Both refuse singular or indefinite systems with a message that
suggests damping, instead of returning garbage.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from ._checks import GeometryError, check_finite, check_spd, check_square_matrix, is_concrete
from ._tree import PyTree, ravel, tree_size, tree_vdot

__all__ = ["solve_spd_dense", "solve_spd_cg", "add_damping"]


def add_damping(op: Callable[[PyTree], PyTree], damping: float) -> Callable[[PyTree], PyTree]:
    """The operator ``v -> op(v) + damping * v``."""
    if not damping:
        return op
    return lambda v: jax.tree_util.tree_map(lambda a, b: a + damping * b, op(v), v)


def _check_damping(damping: float) -> None:
    if isinstance(damping, (int, float)) and damping < 0:
        raise GeometryError(f"damping must be >= 0, got {damping}.")


def solve_spd_dense(
    matrix: jax.Array, rhs: PyTree, *, damping: float = 0.0, what: str = "the metric G"
) -> PyTree:
    """Solve ``(matrix + damping I) x = rhs`` by Cholesky; ``rhs`` is a pytree, ``matrix`` is over its flattened coordinates."""
    _check_damping(damping)
    check_finite(rhs, "the right-hand side")
    check_square_matrix(matrix, tree_size(rhs), what)
    check_finite(matrix, what)
    flat_rhs, unravel = ravel(rhs)
    damped = matrix + damping * jnp.eye(matrix.shape[0], dtype=matrix.dtype)
    check_spd(damped, what + (" + damping * I" if damping else ""))
    cho = jsl.cho_factor(damped, lower=True)
    return unravel(jsl.cho_solve(cho, flat_rhs))


def solve_spd_cg(
    op: Callable[[PyTree], PyTree],
    rhs: PyTree,
    *,
    damping: float = 0.0,
    tol: float = 1e-6,
    maxiter: int | None = None,
    what: str = "the metric G",
) -> PyTree:
    """Solve ``(op + damping I) x = rhs`` by conjugate gradients (``jax.scipy.sparse.linalg.cg``).

    When the values are concrete (not under ``jit``), the relative residual and
    the curvature ``x^T A x`` are checked afterwards; a solve that did not
    converge, or that met zero or negative curvature, raises a
    :class:`GeometryError` suggesting damping.
    """
    _check_damping(damping)
    check_finite(rhs, "the right-hand side")
    damped = add_damping(op, damping)
    maxiter = maxiter if maxiter is not None else 10 * tree_size(rhs)
    solution, _ = jax.scipy.sparse.linalg.cg(damped, rhs, tol=tol, maxiter=maxiter)
    if is_concrete(solution):
        residual = jax.tree_util.tree_map(lambda a, b: a - b, damped(solution), rhs)
        res_norm = float(jnp.sqrt(tree_vdot(residual, residual)))
        rhs_norm = max(float(jnp.sqrt(tree_vdot(rhs, rhs))), np.finfo(np.float64).tiny)
        curvature = float(tree_vdot(solution, damped(solution)))
        if not np.isfinite(res_norm) or res_norm > 10 * tol * rhs_norm or not curvature > 0:
            raise GeometryError(
                f"conjugate gradients on {what} did not converge (relative residual "
                f"{res_norm / rhs_norm:.3g} after at most {maxiter} iterations). The operator is probably "
                "singular or indefinite: add damping (e.g. damping=1e-3), or raise maxiter."
            )
    return solution

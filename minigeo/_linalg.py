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

__all__ = ["solve_spd_dense", "solve_spd_cg", "add_damping", "lanczos_tridiagonal"]


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


def lanczos_tridiagonal(
    apply_h: Callable[[jax.Array], jax.Array],
    apply_ginv: Callable[[jax.Array], jax.Array],
    z: jax.Array,
    m: int,
) -> jax.Array:
    """Lanczos tridiagonalization of ``E = G^{-1} H`` in the ``G``-inner product, full reorthogonalization.

    ``E`` is self-adjoint for ``<u, v>_G = u^T G v`` and ``<u, E v>_G = u^T H v``, so
    each step needs one product with ``H`` and one with ``G^{-1}`` (the identity for
    the ordinary, Euclidean Lanczos).  The start vector is ``G^{-1} z`` normalized
    in the ``G``-norm, so for ``G = I`` it is ``z / |z|``.  Works on flat 1-D vectors
    and is ``jit``/``vmap``-compatible.  Returns the ``m x m`` tridiagonal matrix.
    """
    d = z.shape[0]
    q = apply_ginv(z)  # <q, q>_G = q^T G q = q^T z
    norm = jnp.sqrt(jnp.vdot(q, z))
    Q = jnp.zeros((m, d), dtype=z.dtype).at[0].set(q / norm)  # rows: the G-orthonormal basis q_i
    W = jnp.zeros((m, d), dtype=z.dtype).at[0].set(z / norm)  # rows: G q_i, so that <q_i, x>_G = q_i^T (G x)
    alphas = jnp.zeros(m, dtype=z.dtype)
    betas = jnp.zeros(m, dtype=z.dtype)

    def body(i, carry):
        Q, W, alphas, betas = carry
        h = apply_h(Q[i])  # = G (E q_i)
        alpha = jnp.vdot(Q[i], h)
        for _ in range(2):  # full reorthogonalization, twice
            h = h - W.T @ (Q @ h)
        v = apply_ginv(h)
        beta = jnp.sqrt(jnp.maximum(jnp.vdot(v, h), 0.0))
        safe = jnp.where(beta > 0, beta, 1.0)
        nxt = jnp.minimum(i + 1, m - 1)
        keep = i + 1 < m
        Q = Q.at[nxt].set(jnp.where(keep, v / safe, Q[nxt]))
        W = W.at[nxt].set(jnp.where(keep, h / safe, W[nxt]))
        return Q, W, alphas.at[i].set(alpha), betas.at[i].set(beta)

    _, _, alphas, betas = jax.lax.fori_loop(0, m, body, (Q, W, alphas, betas))
    return jnp.diag(alphas) + jnp.diag(betas[:-1], 1) + jnp.diag(betas[:-1], -1)

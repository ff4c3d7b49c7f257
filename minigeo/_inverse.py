"""Applying the inverse of a metric argument, shared by :mod:`minigeo.curvature` and :mod:`minigeo.operators` (floor 1, private).

``metric=`` of :func:`minigeo.trace_estimate`, :func:`minigeo.top_eigenvalues` and the operators'
methods is read by :func:`minigeo._metric.metric_field` (a :class:`~minigeo.Metric` or ``None``);
:func:`_metric_inverse` turns it into ``v -> G^{-1} v`` (elementwise for a diagonal metric, its
structure tag; one Cholesky factor for a dense metric, its structure tag; conjugate gradients otherwise).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl

from ._checks import GeometryError, is_concrete
from ._linalg import check_solver_options, cholesky_with_pivot_test, solve_spd_cg
from ._metric import Metric, _matrix_field
from ._tree import PyTree, ravel

MetricArg = Metric | None


def _metric_inverse(
    metric: MetricArg, params: PyTree, tol: float, maxiter: int | None, strict: bool = False
) -> Callable[[PyTree], PyTree]:
    """``v -> G^{-1} v`` for None (identity), a diagonal Metric (elementwise) or any other Metric (CG).

    ``metric`` has been read by :func:`~minigeo._metric.metric_field`.  ``strict``: a CG solve that
    did not converge gives NaN (under ``jit`` it cannot raise), so a failed solve shows up as a
    non-finite result that the eager caller reports.  ``tol`` and ``maxiter`` are validated for
    every metric (the public entry points forward theirs here).  A diagonal metric's weights are
    checked (finite, positive) whenever they are concrete, i.e. at the eager call that builds this.
    """
    check_solver_options(tol, maxiter, "the conjugate-gradient solves with the metric")
    if metric is None:
        return lambda v: v
    if metric.diagonal_fn is not None:
        w = metric.diagonal_fn(params)
        damping = metric.damping
        return lambda v: jax.tree_util.tree_map(lambda a, wi: a / (wi + damping), v, w)
    if metric.solve_fn is not None:  # a factored inverse (Kronecker factors): exact, NaN where it failed
        solve_fn, damping = metric.solve_fn, metric.damping
        return lambda v: solve_fn(params, v, damping)[0]
    if metric.matrix_fn is not None:
        return _dense_inverse(metric, params)
    if not strict:
        what = f"the {metric.name} metric"
        return lambda v: solve_spd_cg(metric.at(params), v, tol=tol, maxiter=maxiter, what=what)
    return lambda v: solve_or_nan(metric, params, v, tol, maxiter)[0]


def dense_factor(metric: Metric, params: PyTree) -> tuple[jax.Array, jax.Array]:
    """``(L, ok)``: the Cholesky factor of a dense metric plus its damping, and whether it is trustworthy.

    ``ok`` is False when the matrix is not finite, the factorization failed, or a pivot
    :math:`L_{ii}^2 \\le n\\,\\varepsilon\\max|G_{ij}|` (not positive definite to working precision):
    the test of :func:`~minigeo._linalg.solve_spd_dense`.  ``L`` is then all NaN, so every solve with it
    is NaN under ``jit``, never a finite wrong number.
    """
    G = _matrix_field(metric)(params)
    L, definite, _ = cholesky_with_pivot_test(G)
    ok = jnp.all(jnp.isfinite(G)) & definite
    return jnp.where(ok, L, jnp.nan), ok


def checked_dense_factor(metric: Metric, params: PyTree, who: str = "") -> jax.Array:
    """The factor of :func:`dense_factor`; eagerly a metric that is not positive definite raises (under ``jit`` ``L`` is NaN)."""
    L, ok = dense_factor(metric, params)
    if is_concrete(ok) and not bool(ok):
        raise GeometryError(
            f"{who + ': ' if who else ''}the {metric.name} metric is not positive definite at params to working "
            "precision (its Cholesky factorization failed or met a pivot at round-off); add damping."
        )
    return L


def _dense_inverse(metric: Metric, params: PyTree) -> Callable[[PyTree], PyTree]:
    """``v -> G^{-1} v`` by one Cholesky factor; eagerly a metric that is not positive definite raises."""
    L = checked_dense_factor(metric, params)

    def apply(v: PyTree) -> PyTree:
        flat, unravel = ravel(v)
        return unravel(jsl.cho_solve((L, True), flat.astype(L.dtype)).astype(flat.dtype))

    return apply


def solve_or_nan(metric: Metric, params: PyTree, v: PyTree, tol: float, maxiter: int | None) -> tuple[PyTree, jax.Array]:
    """``(G^{-1} v, status)`` for a metric without a diagonal or dense structure tag: through its factors
    when it has a ``solve_fn`` (KFAC / EKFAC: exact, NaN and a status where a factor is singular),
    by :func:`cg_solve_or_nan` otherwise.  The one place where such a solve is chosen."""
    if metric.solve_fn is not None:
        return metric.solve_fn(params, v, metric.damping)
    return cg_solve_or_nan(metric, params, v, tol, maxiter)


def cg_solve_or_nan(metric: Metric, params: PyTree, v: PyTree, tol: float, maxiter: int | None) -> tuple[PyTree, jax.Array]:
    """``(G^{-1} v, status)`` by conjugate gradients: NaN where the solve failed, and the solve's own status.

    Under ``jit`` a failed solve cannot raise, so its result is NaN (never a finite wrong number) and the
    status says why; eager callers raise from that status (:func:`~minigeo._status.raise_for_status`).
    """
    what = f"the {metric.name} metric"
    x, info = solve_spd_cg(metric.at(params), v, tol=tol, maxiter=maxiter, what=what, return_info=True)
    return jax.tree_util.tree_map(lambda a: jnp.where(info.converged, a, jnp.nan), x), info.status


def _compilable(metric: MetricArg) -> bool:
    """Metrics whose products may run inside a compiled loop (their checks do not need concrete values)."""
    return metric is None or metric.compiled or metric.diagonal_fn is not None or metric.solve_fn is not None


_CG_HINT = (
    "The loss is not twice differentiable here, or overflowed; with a Metric, the conjugate-gradient solves "
    "may have failed (not positive definite, or not converged within maxiter): add damping or raise maxiter."
)

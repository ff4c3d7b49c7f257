"""Applying the inverse of a metric argument, shared by :mod:`minigeo.curvature` and :mod:`minigeo.operators` (floor 1, private).

``metric=`` of :func:`minigeo.trace_estimate`, :func:`minigeo.top_eigenvalues` and the operators'
methods is ``None`` (Euclidean), a positive pytree (diagonal) or a :class:`~minigeo.Metric`;
:func:`_metric_inverse` turns it into ``v -> G^{-1} v`` and :func:`_diagnose_cg` re-raises the
precise error of a failed conjugate-gradient solve eagerly.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp

from ._checks import GeometryError, check_finite, check_same_structure, is_concrete
from ._estimators import rademacher_like
from ._linalg import check_solver_options, solve_spd_cg
from ._metric import Metric
from ._tree import PyTree

MetricArg = Union[None, PyTree, Metric]


def _metric_inverse(
    metric: MetricArg, params: PyTree, tol: float, maxiter: int | None, strict: bool = False
) -> Callable[[PyTree], PyTree]:
    """``v -> G^{-1} v`` for None (identity), a positive pytree (diagonal) or a Metric (CG).

    ``strict``: a CG solve that did not converge gives NaN (under ``jit`` it cannot raise), so a
    failed solve shows up as a non-finite result that the eager caller reports.  ``tol`` and
    ``maxiter`` are validated for every metric (the public entry points forward theirs here).
    """
    check_solver_options(tol, maxiter, "the conjugate-gradient solves with the metric")
    if metric is None:
        return lambda v: v
    if isinstance(metric, Metric):
        what = f"the {metric.name} metric"
        if not strict:
            return lambda v: solve_spd_cg(metric.at(params), v, tol=tol, maxiter=maxiter, what=what)

        def solve(v: PyTree) -> PyTree:
            x, info = solve_spd_cg(metric.at(params), v, tol=tol, maxiter=maxiter, what=what, return_info=True)
            return jax.tree_util.tree_map(lambda a: jnp.where(info.converged, a, jnp.nan), x)

        return solve
    check_same_structure(params, metric, "the diagonal metric", "params")
    if is_concrete(metric):
        check_finite(metric, "the diagonal metric")
        bad = sum(int(jnp.sum(leaf <= 0)) for leaf in jax.tree_util.tree_leaves(metric))
        if bad:
            raise GeometryError(
                f"the diagonal metric has {bad} entries <= 0: it is not positive definite. Add damping "
                "(e.g. metric + 1e-8) or take absolute values."
            )
    return lambda v: jax.tree_util.tree_map(lambda a, w: a / w, v, metric)


def _compilable(metric: MetricArg) -> bool:
    """Metrics whose products may run inside a compiled loop (their checks do not need concrete values)."""
    return not isinstance(metric, Metric) or metric.compiled


_CG_HINT = (
    "The loss is not twice differentiable here, or overflowed; with a Metric, the conjugate-gradient solves "
    "may have failed (not positive definite, or not converged within maxiter): add damping or raise maxiter."
)


def _diagnose_cg(result: jax.Array, metric: MetricArg, params: PyTree, key: jax.Array, tol: float, maxiter: Any) -> None:
    """After a non-finite compiled result with a Metric: one eager solve, which raises CG's precise error."""
    if isinstance(metric, Metric) and is_concrete(result) and not bool(jnp.all(jnp.isfinite(result))):
        probe = jax.tree_util.tree_map(lambda a: a[0], rademacher_like(key, params, 1))
        _metric_inverse(metric, params, tol, maxiter)(probe)

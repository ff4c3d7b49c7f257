r"""The curvature estimators, each written once (floor 1, private).

A curvature matrix :math:`M` (the Hessian of a loss at a point, a dataset operator's average over
batches, a GGN, a Fisher, ...) enters only through a :class:`Products`: how to multiply it.  The
three estimators, with their validation, the reading of ``metric=``, the certificate, the eager
diagnosis of a failed solve and the status under ``jit``, are written here once:

* :func:`hutchinson_trace`: :math:`\mathrm{tr}(G^{-1}M) = \mathbb E_z[(G^{-1}z)^\top M z]`;
* :func:`certified_top`: the ``k`` largest eigenvalues of :math:`G^{-1}M` by block Lanczos,
  certified (see :func:`minigeo.top_eigenvalues`);
* :func:`slq_logdet`: :math:`\log\det A` by stochastic Lanczos quadrature.

:func:`minigeo.trace_estimate`, :func:`minigeo.top_eigenvalues`, :func:`minigeo.logdet_slq` and the
methods of :class:`minigeo.CurvatureOperator` are adapters that build a :class:`Products` and call
these; a new curvature matrix is one new :class:`Products` (one constructor in
:mod:`minigeo.operators`), and every estimator works on it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, check_finite, is_concrete
from ._compile import jit_per_callable
from ._eigen import ResumableBlockLanczos, block_lanczos, certified_top_eigenvalues, default_num_products, validate_k
from ._estimators import (
    check_slq_positive,
    mean_and_standard_error,
    rademacher_like,
    slq_breakdown_tol,
    slq_quadrature,
)
from ._inverse import _CG_HINT, _compilable, _metric_inverse, cg_solve_or_nan
from ._linalg import lanczos_tridiagonal, lanczos_tridiagonal_offloaded
from ._status import Status, first_failure, raise_for_status
from ._metric import Metric, metric_field
from ._tree import PyTree, ravel, tree_size

__all__ = ["Products", "EstimateInfo", "hutchinson_trace", "certified_top", "slq_logdet", "check_num_probes"]


class EstimateInfo(NamedTuple):
    """What happened in a randomized estimate (``return_info=True``; also under ``jit``).

    Attributes
    ----------
    status : jax.Array
        An int32 :class:`~minigeo.Status` code: ``OK``; ``NON_FINITE`` (a product, or a solve with the
        metric, gave NaN or infinity); a conjugate-gradient solve's own status (``MAX_ITERATIONS``,
        ``NOT_POSITIVE_DEFINITE``, ``INACCURATE``) for a trace with a matrix-free metric;
        ``UNCERTIFIED`` (eigenvalues past the certified ones, NaN); ``NOT_POSITIVE_DEFINITE`` (an SLQ
        log-determinant of an operator that is not positive definite, NaN).  Eagerly the same
        status raises :class:`~minigeo.GeometryError`.
    num_products : int or jax.Array
        Matrix-vector products with the curvature matrix (per example batch for a dataset operator).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: jnp.sum(jnp.arange(1.0, 4.0) * x**2)
    >>> est, se, info = mg.trace_estimate(f, jnp.zeros(3), jax.random.PRNGKey(0), return_info=True)
    >>> float(est), mg.Status(int(info.status)).name, info.num_products
    (12.0, 'OK', 10)

    References
    ----------
    No formula from the source papers: the failure convention shared with ``SolveInfo``
    and :class:`~minigeo.SharpnessResult`. Chapter 4.
    """

    status: jax.Array
    num_products: Any


class Products(NamedTuple):
    """How to multiply a curvature matrix :math:`M`: all an estimator needs to know about it.

    Attributes
    ----------
    params : pytree
        The point (its structure, dtype and size :math:`d`).
    name : str
        Shown in messages (``"Hessian"``, ``"GGN"``, ...).
    terms : callable
        ``terms(probes, duals, batched) -> (u_i^T M z_i)_i`` for stacked pytree probes ``z_i`` and
        duals ``u_i`` (one pass over the data for a dataset operator).
    block_mv : callable
        ``block_mv(V) -> M V`` row by row, for a flat ``(p, d)`` block (eager: a compiled product,
        or one pass over the data).
    fixed : callable, optional
        ``fixed(metric, Z, key, m, compiled, tol=, maxiter=) -> (T, alive, M)``: ``m`` products of
        block Lanczos run as one program on the device (``compiled``: through the compile layer,
        else traced by the caller, e.g. under ``jit``); ``None`` for sources that only run eagerly
        (a pass over a dataset).
    steps : callable, optional
        Wraps the block steps of an eager Lanczos run (a progress bar).
    """

    params: PyTree
    name: str
    terms: Callable[[PyTree, PyTree, str], jax.Array]
    block_mv: Callable[[jax.Array], jax.Array]
    fixed: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] | None = None
    steps: Callable[[Iterable], Iterable] | None = None


def check_num_probes(num_probes: Any, who: str) -> None:
    if not (isinstance(num_probes, (int, np.integer)) and not isinstance(num_probes, bool) and num_probes >= 1):
        raise GeometryError(f"{who}: num_probes must be a positive int, got {num_probes!r}.")


# ---------------------------------------------------------------------------
# Hutchinson
# ---------------------------------------------------------------------------
def _duals(_key: Any, params: PyTree, metric: Metric, probes: PyTree, *, tol: float, maxiter: Any):
    """``(G^{-1} z_i, status_i)`` for every stacked probe: NaN and the solve's status where CG failed."""
    return jax.lax.map(lambda z: cg_solve_or_nan(metric, params, z, tol, maxiter), probes)


_compiled_duals = jit_per_callable(_duals, static_argnames=("tol", "maxiter"))


def hutchinson_trace(
    source: Products, key: jax.Array, metric: Any, *, num_probes: int, batched: str, tol: float, maxiter: Any,
    who: str, return_info: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""``(estimate, standard_error)`` of :math:`\mathrm{tr}(G^{-1}M)` from Rademacher probes (and the info).

    .. math:: \mathrm{tr}(G^{-1}M) = \mathbb E_z\big[(G^{-1}z)^\top M z\big].
    """
    check_num_probes(num_probes, who)
    if batched not in ("vmap", "map"):
        raise GeometryError(f"{who}: batched must be 'vmap' or 'map', got {batched!r}.")
    params = source.params
    metric = metric_field(metric, who)
    apply_inverse = _metric_inverse(metric, params, tol, maxiter)  # validates tol, maxiter, a diagonal metric
    probes = rademacher_like(key, params, num_probes)
    solve_status = jnp.int32(Status.OK)
    if metric is None:
        duals = probes
    elif metric.diagonal_fn is not None:
        duals = apply_inverse(probes)  # elementwise: the weights broadcast over the stacked probes
    else:
        run = _compiled_duals if _compilable(metric) and is_concrete(params, key) else _duals
        duals, statuses = run(metric.mv_fn, params, metric, probes, tol=tol, maxiter=maxiter)
        solve_status = first_failure(statuses)
        if is_concrete(solve_status):  # eagerly: raise from the solves' own status, before any product
            raise_for_status(solve_status, who, detail=f"A conjugate-gradient solve with the {metric.name} metric failed.")
    values = source.terms(probes, duals, batched)
    check_finite(values, f"The {source.name} products", hint=_CG_HINT)
    status = first_failure(solve_status, jnp.where(jnp.all(jnp.isfinite(values)), Status.OK, Status.NON_FINITE))
    est, se = mean_and_standard_error(values)
    if return_info:
        return est, se, EstimateInfo(status, num_probes)
    return est, se


# ---------------------------------------------------------------------------
# block Lanczos, certified
# ---------------------------------------------------------------------------
def _flat_inverse(params: PyTree, metric: Metric, v: jax.Array, tol: float, maxiter: Any) -> jax.Array:
    unravel = ravel(params)[1]
    return ravel(_metric_inverse(metric, params, tol, maxiter, strict=True)(unravel(v)))[0]


def _block_solves(_key: Any, params: PyTree, metric: Metric, V: jax.Array, *, tol: float, maxiter: Any):
    """``(G^{-1} v, status)`` for every row ``v`` of ``V`` by conjugate gradients (NaN where a solve failed)."""
    unravel = ravel(params)[1]

    def one(v: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, status = cg_solve_or_nan(metric, params, unravel(v), tol, maxiter)
        return ravel(x)[0], status

    return jax.vmap(one)(V)


_compiled_block_solves = jit_per_callable(_block_solves, static_argnames=("tol", "maxiter"))


def fixed_block_lanczos(
    flat_mv: Callable[[jax.Array], jax.Array], params: PyTree, metric: Metric | None, Z: jax.Array, key: jax.Array, *,
    m: int, tol: float, maxiter: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``m`` block Lanczos steps of ``G^{-1}M`` from the start block ``Z``: ``(T, alive, M)`` (see :func:`block_lanczos`)."""
    Ginv = None if metric is None else (lambda v: _flat_inverse(params, metric, v, tol, maxiter))
    return block_lanczos(flat_mv, Ginv, Z, m, key=key)


def certified_top(
    source: Products,
    key: jax.Array,
    metric: Any,
    *,
    k: int,
    num_iterations: int | None,
    rtol: float | None,
    tol: float,
    maxiter: Any,
    block_size: int | None,
    who: str,
    return_info: bool = False,
) -> jax.Array | tuple[jax.Array, EstimateInfo]:
    """The ``k`` largest eigenvalues of ``G^{-1}M``, certified (see :func:`minigeo.top_eigenvalues`).

    Eager and adaptive (``num_iterations=None``): the device run at the default size first (as under
    ``jit``), then one Krylov space in host memory extended block by block; a source without a device
    run (a dataset pass) starts on the host.  With ``num_iterations``: that many products, on the
    device when the source has a device run.  Under ``jit``: the device run, NaN for uncertified values.
    """
    params = source.params
    d = tree_size(params)
    flat0 = ravel(params)[0]
    p = validate_k(k, num_iterations, d, block_size)
    metric = metric_field(metric, who)
    _metric_inverse(metric, params, tol, maxiter)  # validates tol, maxiter and a diagonal metric eagerly
    Z = jax.random.normal(key, (p, d), dtype=flat0.dtype)
    restart_key = jax.random.fold_in(key, 1)
    eager = is_concrete(params, key, None if metric is None else metric.damping)
    if not eager and source.fixed is None:
        raise GeometryError(f"{who}: a pass over a dataset runs eagerly only; call it outside jax.jit.")
    compiled = _compilable(metric)
    options = dict(tol=tol, maxiter=maxiter)
    device_products = [0]
    if metric is None:
        ginv_block = None
    elif metric.diagonal_fn is not None:
        ginv_block = jax.vmap(lambda v: _flat_inverse(params, metric, v, tol, maxiter))  # elementwise
    else:
        # conjugate gradients: eagerly every solve is checked, and its own status raised (never re-run)
        def ginv_block(V: jax.Array) -> jax.Array:
            run = _compiled_block_solves if compiled else _block_solves
            X, statuses = run(metric.mv_fn, params, metric, V, **options)
            raise_for_status(first_failure(statuses), who, detail=f"A conjugate-gradient solve with the {metric.name} metric failed.")
            return X

    host: list = []  # the host run, built only when needed

    def on_host(m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        if not host:
            host.append(ResumableBlockLanczos(source.block_mv, ginv_block, Z, key=restart_key))
        return host[0].projected(m, steps=source.steps) if source.steps is not None else host[0].projected(m)

    cg_metric = metric is not None and metric.diagonal_fn is None
    # eagerly, a metric solved by CG runs on the host, where each block's solves are checked
    if source.fixed is not None and (not eager or (not cg_metric and (num_iterations is not None or compiled))):
        m0 = -(-min(d, default_num_products(k, p)) // p)
        adaptive = eager and num_iterations is None

        def projected(m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
            if adaptive and m != m0:
                return on_host(m)
            device_products[0] += m * p
            return source.fixed(metric, Z, restart_key, m, compiled and eager, **options)

    else:
        projected = on_host

    count = (lambda: device_products[0] + (host[0].products if host else 0)) if eager else None
    values, status = certified_top_eigenvalues(
        projected, d, k, p, num_iterations, rtol, eager, source.name, count, with_status=True
    )
    if return_info:
        used = count() if count is not None else -(-min(num_iterations or default_num_products(k, p), d) // p) * p
        return values, EstimateInfo(status, used)
    return values


# ---------------------------------------------------------------------------
# stochastic Lanczos quadrature
# ---------------------------------------------------------------------------
def _slq_probes(
    matvec: Callable[[jax.Array], jax.Array], key: jax.Array, *, num_probes: int, dim: int, m: int, dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-probe quadrature values and the extreme Ritz values (vectorised over Rademacher probes)."""
    probes = jax.random.rademacher(key, (num_probes, dim), dtype=dtype)
    restart_key = jax.random.fold_in(key, 1)
    rel = slq_breakdown_tol(dim, dtype)

    def one(z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return slq_quadrature(lanczos_tridiagonal(matvec, lambda v: v, z, m, key=restart_key), z, rel)

    return jax.vmap(one)(probes)


_compiled_slq_probes = jit_per_callable(_slq_probes, static_argnames=("num_probes", "dim", "m", "dtype"))


def slq_logdet(
    matvec: Callable[[jax.Array], jax.Array],
    dim: int,
    key: jax.Array,
    *,
    num_probes: int,
    num_iterations: int,
    dtype: Any,
    on_host: bool = False,
    steps: Callable[[Iterable], Iterable] | None = None,
    who: str = "logdet_slq",
    return_info: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""``(estimate, standard_error)`` of :math:`\log\det A` by stochastic Lanczos quadrature.

    ``on_host``: each probe's Lanczos basis in host memory, one product at a time (a pass over a
    dataset); otherwise every probe on the device at once (``vmap``, compiled; traceable under ``jit``).
    """
    check_num_probes(num_probes, who)
    if not (isinstance(num_iterations, (int, np.integer)) and not isinstance(num_iterations, bool) and num_iterations >= 1):
        raise GeometryError(f"{who}: num_iterations must be a positive int, got {num_iterations!r}.")
    m = min(int(num_iterations), dim)
    rel = slq_breakdown_tol(dim, dtype)
    if on_host:
        probes = jax.random.rademacher(key, (num_probes, dim), dtype=dtype)
        restart_key = jax.random.fold_in(key, 1)
        run = probes if steps is None else steps(probes)
        out = [slq_quadrature(lanczos_tridiagonal_offloaded(matvec, None, z, m, key=restart_key), z, rel) for z in run]
        values, smallest, largest = (jnp.stack(x) for x in zip(*out))
    else:
        values, smallest, largest = _compiled_slq_probes(matvec, key, num_probes=num_probes, dim=dim, m=m, dtype=dtype)
    check_slq_positive(values, smallest, largest, rel, who)
    est, se = mean_and_standard_error(values)
    if return_info:
        status = jnp.where(
            ~jnp.all(jnp.isfinite(largest)),
            Status.NON_FINITE,
            jnp.where(jnp.all(smallest > rel * largest), Status.OK, Status.NOT_POSITIVE_DEFINITE),
        ).astype(jnp.int32)
        return est, se, EstimateInfo(status, num_probes * m)
    return est, se

r"""The curvature estimators, each written once (floor 1, private).

A curvature matrix :math:`M` (the Hessian of a loss at a point, a dataset operator's average over
batches, a GGN, a Fisher, ...) enters only through a :class:`Products`: how to multiply it.  The
three estimators, with their validation, the reading of ``metric=``, the certificate, the eager
diagnosis of a failed solve and the status under ``jit``, are written here once:

* :func:`hutchinson_trace`: :math:`\mathrm{tr}(G^{-1}M) = \mathbb E_z[(G^{-1}z)^\top M z]`;
* :func:`certified_top`: the ``k`` largest eigenvalues of :math:`G^{-1}M` by block Lanczos,
  certified (see :func:`minigeo.top_eigenvalues`);
* :func:`slq_logdet`: :math:`\log\det A` by stochastic Lanczos quadrature.

:func:`minigeo.trace_estimate`, :func:`minigeo.top_eigenvalues`, :func:`minigeo.densities.logdet_slq` and the
methods of :class:`minigeo.operators.CurvatureOperator` are adapters that build a :class:`Products` and call
these; a new curvature matrix is one new :class:`Products` (one constructor in
:mod:`minigeo.operators`), and every estimator works on it.
"""

from __future__ import annotations

import functools

from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

from ._checks import GeometryError, check_finite, check_key, is_concrete
from ._compile import compiled
from ._eigen import (
    ResumableBlockLanczos,
    block_lanczos,
    certified_top_eigenvalues,
    default_num_products,
    restarted_block_lanczos,
    validate_k,
)
from ._estimators import (
    check_slq_positive,
    mean_and_standard_error,
    rademacher_like,
    slq_breakdown_tol,
    slq_quadrature,
    small_sample_factor,
)
from ._inverse import _CG_HINT, _compilable, _metric_inverse, checked_dense_factor, solve_or_nan
from ._status import Status, first_failure, raise_for_status
from ._metric import Metric, join_metric, metric_field, split_metric
from ._tree import PyTree, ravel, tree_size

__all__ = [
    "Products", "EstimateInfo", "SpectralDensity", "probe_terms", "hutchinson_trace", "certified_top", "slq_logdet", "slq_density",
    "certified_ends", "negated", "WHICH", "Eigenpairs",
    "TRACE_METHODS", "hutchpp_trace", "trace_by_method", "hutchinson_diagonal",
    "check_num_probes",
    "xtrace_trace", "DIAGONAL_METHODS", "xdiag_diagonal", "diagonal_by_method",
]


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
    >>> key = jax.random.PRNGKey(0)
    >>> est, se, info = mg.trace_estimate(f, jnp.zeros(3), key, return_info=True)
    >>> float(est), mg.Status(int(info.status)).name, info.num_products
    (12.0, 'OK', 10)

    References
    ----------
    No formula from the source papers: the failure convention shared with ``SolveInfo``
    and :class:`~minigeo.sharpness.SharpnessResult`. Chapter 4.
    """

    status: jax.Array
    num_products: Any


class Eigenpairs(NamedTuple):
    r"""Certified eigenpairs of :math:`E = G^{-1}M` (``top_eigenvalues(..., return_vectors=True)``).

    .. math:: M v_i = \lambda_i\, G v_i,\qquad v_i^\top G\, v_j = \delta_{ij}.

    Attributes
    ----------
    values : jax.Array
        The ``k`` eigenvalues, ordered as ``top_eigenvalues`` returns them (decreasing for
        ``"largest"``, increasing for ``"smallest"``).
    vectors : pytree
        The eigenvectors (Ritz vectors), a pytree structured like the parameters with a leading
        axis of length ``k`` (``vectors`` leaf ``[i]`` belongs to ``values[i]``); ``G``-orthonormal
        (Euclidean-orthonormal without a metric).  Certified as the values are: the residual
        :math:`\|Ev_i - \lambda_i v_i\|_G` of each pair is at most the Kahan bound that certified
        the values (``rtol`` times their scale).  Inside a cluster of (near-)repeated eigenvalues the
        individual vectors are any orthonormal basis of the cluster's eigenspace; only their span is
        determined.  Under ``jit``, a pair whose value is not certified is NaN (value and vector).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: 0.5 * jnp.sum(jnp.array([1.0, 4.0, 2.0]) * x**2)
    >>> pairs = mg.top_eigenvalues(f, jnp.zeros(3), jax.random.PRNGKey(0), return_vectors=True)
    >>> pairs.values.round(4), jnp.abs(pairs.vectors).round(4)
    (Array([4.], dtype=float32), Array([[0., 1., 0.]], dtype=float32))

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 (:math:`E` is self-adjoint for the
    :math:`G`-inner product, so its eigenvectors are :math:`G`-orthogonal); Parlett, *The
    Symmetric Eigenvalue Problem*, ch. 11 (Rayleigh-Ritz). Chapters 4 and 7.
    """

    values: Any
    vectors: Any


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


def _check_batched(batched: Any, who: str) -> None:
    """``batched`` says how per-probe products run: ``"vmap"`` (all at once) or ``"map"`` (one at a time)."""
    if batched not in ("vmap", "map"):
        raise GeometryError(f"{who}: batched must be 'vmap' or 'map', got {batched!r}.")


# ---------------------------------------------------------------------------
# Hutchinson
# ---------------------------------------------------------------------------
def _duals(metric_fns: Any, params: PyTree, damping: Any, probes: PyTree, *, name: str, tol: float, maxiter: Any):
    """``(G^{-1} z_i, status_i)`` for every stacked probe: NaN and the solve's status where CG failed
    (the metric as :func:`~minigeo._metric.split_metric`'s parts)."""
    metric = join_metric(metric_fns, damping, name)
    return jax.lax.map(lambda z: solve_or_nan(metric, params, z, tol, maxiter), probes)


_compiled_duals = functools.partial(compiled, _duals)


def probe_terms(mv: Callable[[PyTree], PyTree], probes: PyTree, duals: PyTree, batched: str) -> jax.Array:
    """``(u_i^T M z_i)_i`` for stacked probes ``z_i`` and duals ``u_i`` (``mv``: one product ``z -> M z``).

    The one definition of a source's ``terms`` (the Hessian at a point, a batch's product of a
    dataset operator): ``batched="vmap"`` runs every probe at once, ``"map"`` one at a time.
    """

    def one(zu: tuple[PyTree, PyTree]) -> jax.Array:
        z, u = zu
        mz = mv(z)
        return sum(jnp.vdot(a, b) for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(mz)))

    return jax.vmap(one)((probes, duals)) if batched == "vmap" else jax.lax.map(one, (probes, duals))


def hutchinson_trace(
    source: Products, key: jax.Array, metric: Any, *, num_probes: int, batched: str, tol: float, maxiter: Any,
    who: str, return_info: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""``(estimate, standard_error)`` of :math:`\mathrm{tr}(G^{-1}M)` from Rademacher probes (and the info).

    .. math:: \mathrm{tr}(G^{-1}M) = \mathbb E_z\big[(G^{-1}z)^\top M z\big].
    """
    check_num_probes(num_probes, who)
    _check_batched(batched, who)
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
        run = _compiled_duals if _compilable(metric) else _duals  # the boundary runs inline under a trace
        fns, damping, name = split_metric(metric)
        duals, statuses = run(fns, params, damping, probes, name=name, tol=tol, maxiter=maxiter)
        solve_status = first_failure(statuses)
        if is_concrete(solve_status):  # eagerly: raise from the solves' own status, before any product
            raise_for_status(solve_status, who, detail=f"A solve with the {metric.name} metric failed ({_solver_name(metric)}).")
    values = source.terms(probes, duals, batched)
    check_finite(values, f"The {source.name} products", hint=_CG_HINT)
    status = first_failure(solve_status, jnp.where(jnp.all(jnp.isfinite(values)), Status.OK, Status.NON_FINITE))
    est, se = mean_and_standard_error(values)
    if return_info:
        return est, se, EstimateInfo(status, num_probes)
    return est, se


TRACE_METHODS = ("hutchinson", "hutch++", "xtrace")


def _stacked(params: PyTree, rows: jax.Array) -> PyTree:
    """Flat rows ``(P, d)`` as a pytree like ``params`` stacked on axis 0."""
    return jax.vmap(ravel(params)[1])(rows)


def _sketch_setup(
    source: Products, key: jax.Array, metric: Any, batched: str, tol: float, maxiter: Any, who: str
) -> tuple[PyTree, int, Any, Callable[[jax.Array], jax.Array], Callable[[jax.Array], jax.Array]]:
    """What the sketching trace estimators (Hutch++, XTrace) share, checked eagerly.

    Returns ``(params, d, dtype, inverse, mv)``: ``inverse`` applies :math:`G^{-1}` row by row (the
    identity without a metric; each conjugate-gradient solve checked, one Cholesky factor for a dense
    metric), ``mv`` applies :math:`M` row by row as ``batched`` asks (:func:`_rowwise`).
    """
    _check_batched(batched, who)
    params = source.params
    metric = metric_field(metric, who)
    _metric_inverse(metric, params, tol, maxiter)  # validates tol, maxiter, a diagonal metric
    check_key(key)
    ginv = _checked_inverse_block(metric, params, tol, maxiter, who)
    inverse = (lambda V: V) if ginv is None else ginv
    return params, tree_size(params), ravel(params)[0].dtype, inverse, _rowwise(source, batched)


def hutchpp_trace(
    source: Products, key: jax.Array, metric: Any, *, num_products: int, batched: str, tol: float, maxiter: Any,
    who: str, return_info: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""Hutch++ for :math:`\mathrm{tr}(A)`, :math:`A = G^{-1}M`, with a budget of ``num_products`` products.

    A third of the budget sketches :math:`Y = AS` (Rademacher :math:`S`), orthonormalized by a
    Householder QR, :math:`Q`; a third gives :math:`\mathrm{tr}(Q^\top A Q)` exactly; the rest
    estimate :math:`\mathrm{tr}((I-P)A(I-P))`, :math:`P = QQ^\top`, by Hutchinson.  Since
    :math:`\mathrm{tr}(A) = \mathrm{tr}(PA) + \mathrm{tr}((I-P)A(I-P))` for any square :math:`A`, the
    estimate is unbiased; the standard error is the deflated probes' (conditional on the sketch).
    """
    check_num_probes(num_products, who)
    if num_products < 3:
        raise GeometryError(f"{who}: hutch++ needs a budget of at least 3 products, got {num_products}.")
    params, d, dtype, inverse, block_mv = _sketch_setup(source, key, metric, batched, tol, maxiter, who)
    s = min(num_products // 3, d)
    r = num_products - 2 * s
    k_sketch, k_probe = jax.random.split(key)
    S = jax.random.rademacher(k_sketch, (s, d), dtype=dtype)
    Y = inverse(block_mv(S))  # rows A s_i
    check_finite(Y, f"The {source.name} products", hint=_CG_HINT)
    Q = jnp.linalg.qr(Y.T)[0].T  # orthonormal rows spanning range(A S)
    exact = jnp.sum(source.terms(_stacked(params, Q), _stacked(params, inverse(Q)), batched))  # tr(Q^T A Q)
    Z = jax.random.rademacher(k_probe, (r, d), dtype=dtype)
    X = Z - (Z @ Q.T) @ Q  # (I - P) z
    values = source.terms(_stacked(params, X), _stacked(params, inverse(X)), batched)
    check_finite(values, f"The {source.name} products", hint=_CG_HINT)
    rest, se = mean_and_standard_error(values)
    se = se * small_sample_factor(r)  # the se rests on r probes: +- 2 se is a 95 % interval (issue 55)
    est = exact + rest
    if return_info:
        ok = jnp.isfinite(est) & jnp.all(jnp.isfinite(values))
        return est, se, EstimateInfo(jnp.where(ok, Status.OK, Status.NON_FINITE).astype(jnp.int32), 2 * s + r)
    return est, se


def trace_by_method(source: Products, key: jax.Array, metric: Any, *, method: str, num_probes: int, **options: Any):
    """Dispatch ``method`` (:data:`TRACE_METHODS`); ``num_probes`` is the budget of products with ``M``."""
    if method == "hutchinson":
        return hutchinson_trace(source, key, metric, num_probes=num_probes, **options)
    if method == "hutch++":
        return hutchpp_trace(source, key, metric, num_products=num_probes, **options)
    if method == "xtrace":
        return xtrace_trace(source, key, metric, num_products=num_probes, **options)
    raise GeometryError(f"{options.get('who', 'trace_estimate')}: method must be one of {TRACE_METHODS}, got {method!r}.")


def hutchinson_diagonal(
    source: Products, key: jax.Array, *, num_probes: int, who: str, return_info: bool = False
) -> tuple[PyTree, PyTree] | tuple[PyTree, PyTree, EstimateInfo]:
    r"""``(diagonal, standard_error)`` of :math:`\mathrm{diag}(M)` from Rademacher probes, as pytrees like the params.

    .. math:: \mathrm{diag}(M) = \mathbb E_z[z \odot Mz],

    unbiased; entry :math:`i` has variance :math:`\sum_{j\ne i} M_{ij}^2` per probe, so the error falls like :math:`P^{-1/2}`.
    """
    check_num_probes(num_probes, who)
    check_key(key)
    params = source.params
    d = tree_size(params)
    dtype = ravel(params)[0].dtype
    Z = jax.random.rademacher(key, (num_probes, d), dtype=dtype)
    values = Z * source.block_mv(Z)
    check_finite(values, f"The {source.name} products", hint="The loss is not twice differentiable here, or overflowed.")
    mean, se = mean_and_standard_error(values, axis=0)
    unravel = ravel(params)[1]
    if return_info:
        ok = jnp.all(jnp.isfinite(values))
        return unravel(mean), unravel(se), EstimateInfo(jnp.where(ok, Status.OK, Status.NON_FINITE).astype(jnp.int32), num_probes)
    return unravel(mean), unravel(se)


# ---------------------------------------------------------------------------
# block Lanczos, certified
# ---------------------------------------------------------------------------
def _flat_inverse(params: PyTree, metric: Metric, v: jax.Array, tol: float, maxiter: Any) -> jax.Array:
    unravel = ravel(params)[1]
    return ravel(_metric_inverse(metric, params, tol, maxiter, strict=True)(unravel(v)))[0]


def _block_solves(metric_fns: Any, params: PyTree, damping: Any, V: jax.Array, *, name: str, tol: float, maxiter: Any):
    """``(G^{-1} v, status)`` for every row ``v`` of ``V`` by conjugate gradients (NaN where a solve failed;
    the metric as :func:`~minigeo._metric.split_metric`'s parts)."""
    metric = join_metric(metric_fns, damping, name)
    unravel = ravel(params)[1]

    def one(v: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, status = solve_or_nan(metric, params, unravel(v), tol, maxiter)
        return ravel(x)[0], status

    return jax.vmap(one)(V)


_compiled_block_solves = functools.partial(compiled, _block_solves)


def fixed_block_lanczos(
    flat_mv: Callable[[jax.Array], jax.Array], params: PyTree, metric: Metric | None, Z: jax.Array, key: jax.Array, *,
    m: int, tol: float, maxiter: Any, basis: bool = False, restart: tuple | None = None, negate: bool = False,
) -> tuple[jax.Array, ...]:
    """``m`` block Lanczos steps of ``G^{-1}M`` from the start block ``Z``: ``(T, alive, M)`` (see :func:`block_lanczos`);
    ``basis``: also the basis ``Q``.  ``restart=(k, rtol, max_cycles)``: thick restarts of the same
    basis until the top ``k`` are certified (:func:`restarted_block_lanczos`); the result then ends
    with the number of cycles.  ``negate``: of ``-M`` (the smallest end; negation is exact)."""
    Ginv = None if metric is None else (lambda v: _flat_inverse(params, metric, v, tol, maxiter))
    mv = (lambda v: -flat_mv(v)) if negate else flat_mv
    if restart is not None:
        k, rtol, max_cycles = restart
        return restarted_block_lanczos(mv, Ginv, Z, m, key=key, k=k, rtol=rtol, max_cycles=max_cycles, return_basis=basis)
    return block_lanczos(mv, Ginv, Z, m, key=key, return_basis=basis)


#: Under ``jit``, the default ``top_eigenvalues`` restarts its basis at most this many times (cycles).
MAX_RESTART_CYCLES = 20


def restart_blocks(k: int, p: int, m0: int) -> int:
    """Blocks of the restarted basis under ``jit``: ``max(6, ceil(4k / p))`` (at most the default ``m0``).

    Half of them (at least ``2k`` Ritz vectors) are kept at each restart.  On the benchmark MLP
    784-256-256-10 (top 5, ``p = 5``, float32) a 30-row basis certified 10 of 10 keys with 150-225
    products in 1.3-1.9 s, against 150-225 products and 2.2-4.0 s with the 150-row basis of the
    eager default: the reorthogonalization against a smaller basis costs less.
    """
    return min(m0, max(6, -(-4 * k // p)))


def _solver_name(metric: Metric) -> str:
    return "through its factors" if metric.solve_fn is not None else "conjugate gradients"


def _solved_by_cg(metric: Metric | None) -> bool:
    """Whether ``G^{-1}`` is applied by conjugate gradients: not for ``G = I``, a diagonal metric or a
    factored one (KFAC / EKFAC: exact solves through the factors, NaN where one failed, so they run in
    the device program like the diagonal's; eagerly a CG metric runs on the host, each block checked)."""
    return metric is not None and metric.diagonal_fn is None and metric.solve_fn is None


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
    return_vectors: bool = False,
) -> Any:
    """The ``k`` largest eigenvalues of ``G^{-1}M``, certified (see :func:`minigeo.top_eigenvalues`).

    ``return_vectors``: an :class:`Eigenpairs` (the Ritz vectors as pytrees like ``params``, stacked
    on axis 0) instead of the values.

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
    traced_products: list = []  # under jit, with restarts: the products the loop ran (traced)
    # conjugate gradients: eagerly every solve is checked, and its own status raised (never re-run)
    ginv_block = _checked_inverse_block(metric, params, tol, maxiter, who)

    host: list = []  # the host run, built only when needed

    def on_host(m: int) -> tuple[jax.Array, ...]:
        if not host:
            host.append(ResumableBlockLanczos(source.block_mv, ginv_block, Z, key=restart_key))
        run = host[0].projected(m, steps=source.steps) if source.steps is not None else host[0].projected(m)
        return (*run, host[0].basis(m)) if return_vectors else run

    cg_metric = _solved_by_cg(metric)
    # eagerly, a metric solved by CG runs on the host, where each block's solves are checked
    if source.fixed is not None and (not eager or (not cg_metric and (num_iterations is not None or compiled))):
        m0 = -(-min(d, default_num_products(k, p)) // p)
        adaptive = eager and num_iterations is None
        # the default (eagerly and under jit) restarts a fixed basis until certified, in one
        # while_loop: memory restart_blocks(k, p, m0) p x d numbers whatever the products; eagerly,
        # a run its restarts did not certify is followed by the growing host basis
        restart = None
        if num_iterations is None and rtol is not None and m0 * p < d and m0 >= 2:
            restart = (int(k), float(rtol), MAX_RESTART_CYCLES)

        def projected(m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
            if adaptive and m != m0:
                return on_host(m)
            blocks = m if restart is None else restart_blocks(k, p, m)
            run = source.fixed(
                metric, Z, restart_key, blocks, compiled and eager, basis=return_vectors, restart=restart, **options
            )
            if restart is None:
                device_products[0] += blocks * p
                return tuple(run)
            *run, cycles = run
            used = blocks * p + (cycles - 1) * (blocks - max(1, blocks // 2)) * p
            if eager:
                device_products[0] += int(used)
            else:
                traced_products.append(used)
            return tuple(run)

    else:
        projected = on_host

    count = (lambda: device_products[0] + (host[0].products if host else 0)) if eager else None
    values, *vectors, status = certified_top_eigenvalues(
        projected, d, k, p, num_iterations, rtol, eager, source.name, count, with_status=True, vectors=return_vectors
    )
    if return_vectors:
        values = Eigenpairs(values, jax.vmap(ravel(params)[1])(vectors[0]))
    if return_info:
        if count is not None:
            used = count()
        elif traced_products:
            used = traced_products[-1]
        else:
            used = -(-min(num_iterations or default_num_products(k, p), d) // p) * p
        return values, EstimateInfo(status, used)
    return values


def negated(source: Products) -> Products:
    """The products of :math:`-M`: its top eigenvalues are minus the bottom ones of :math:`M`.

    The device run of :math:`-M` is the run of :math:`M` with :math:`T` negated: both start from the same
    block and span the same Krylov space, and the residual Gram matrix is unchanged.
    """
    terms = None if source.terms is None else (lambda probes, duals, batched: -source.terms(probes, duals, batched))
    fixed = None
    if source.fixed is not None:

        def fixed(metric, Z, key, m, compiled, **options):
            return source.fixed(metric, Z, key, m, compiled, negate=not options.pop("negate", False), **options)

    return source._replace(name=f"-{source.name}", terms=terms, block_mv=lambda V: -source.block_mv(V), fixed=fixed)


WHICH = ("largest", "smallest", "both")


def certified_ends(
    source: Products, key: jax.Array, metric: Any, *, which: str, return_info: bool = False, who: str,
    return_vectors: bool = False, **options: Any
) -> Any:
    """``which`` end of the spectrum of ``G^{-1}M``, certified: ``"largest"`` (decreasing), ``"smallest"``
    (increasing: the most negative first), or ``"both"``: ``(largest, smallest)`` from two runs.
    ``return_vectors``: :class:`Eigenpairs` in place of the values (the smallest end's vectors are
    those of :math:`-M`'s top values, the same eigenvectors)."""
    if which not in WHICH:
        raise GeometryError(f"{who}: which must be one of {WHICH}, got {which!r}.")
    if not isinstance(return_vectors, bool):
        raise GeometryError(f"{who}: return_vectors must be True or False, got {return_vectors!r}.")
    options.update(return_vectors=return_vectors)
    ends = []
    if which in ("largest", "both"):
        ends.append(certified_top(source, key, metric, who=who, return_info=True, **options))
    if which in ("smallest", "both"):
        values, info = certified_top(negated(source), key, metric, who=who, return_info=True, **options)
        values = values._replace(values=-values.values) if return_vectors else -values
        ends.append((values, info))
    values = ends[0][0] if len(ends) == 1 else (ends[0][0], ends[1][0])
    if not return_info:
        return values
    status = first_failure(*(info.status for _, info in ends))
    count = ends[0][1].num_products if len(ends) == 1 else ends[0][1].num_products + ends[1][1].num_products
    return values, EstimateInfo(status, count)


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

    def one(z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:  # the block recurrence with one vector
        T, alive, _ = block_lanczos(matvec, None, z[None], m, key=restart_key)
        return slq_quadrature(T, alive, z, rel)

    return jax.vmap(one)(probes)


_compiled_slq_probes = functools.partial(compiled, _slq_probes)


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
        host_mv = lambda X: matvec(X[0])[None]  # a block of one vector: one product (e.g. a dataset pass)
        out = [slq_quadrature(*ResumableBlockLanczos(host_mv, None, z[None], key=restart_key).projected(m)[:2], z, rel)
               for z in run]
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


# ---------------------------------------------------------------------------
# spectral density by stochastic Lanczos quadrature, in the G-inner product
# ---------------------------------------------------------------------------
class SpectralDensity(NamedTuple):
    r"""A spectral density estimate of :math:`E = G^{-1}M` by stochastic Lanczos quadrature.

    Probe :math:`l` gives a Gauss quadrature rule (nodes :math:`\theta_{li}`, weights
    :math:`w_{li}`) for the spectral measure of :math:`E` seen from its start vector; the estimate of
    the density :math:`\phi(\lambda) = \frac1d\sum_j \delta(\lambda - \lambda_j)` is the average of
    the rules over probes.  The default probes make every rule's weights sum to one and the average
    an unbiased estimate of :math:`\phi` (see :func:`minigeo.spectral_density`).

    Attributes
    ----------
    nodes : jax.Array
        ``(num_probes, m)`` quadrature nodes (Ritz values), per probe.
    weights : jax.Array
        ``(num_probes, m)`` quadrature weights, per probe.
    num_products : int
        Products with the curvature matrix (per example batch for a dataset operator).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: 0.5 * jnp.sum(jnp.array([1.0, 1.0, 4.0]) * x**2)
    >>> dens = mg.spectral_density(f, jnp.zeros(3), jax.random.PRNGKey(0), num_probes=4)
    >>> mean, se = dens.moments(1)   # tr(H)/d = 2 exactly: Rademacher probes, diagonal H
    >>> round(float(mean), 4)
    2.0

    References
    ----------
    Lin, Saad & Yang (2016), *Approximating spectral densities of large matrices*, Sec. 3.2;
    Ghorbani, Krishnan & Xiao (2019) for network Hessians; the invariant :math:`E = G^{-1}H` of
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1. Chapter 4.
    """

    nodes: jax.Array
    weights: jax.Array
    num_products: Any

    def density(self, grid: Any, sigma: float) -> jax.Array:
        r"""The Gaussian-broadened density on ``grid``: :math:`\frac1P\sum_{l,i} w_{li}\,\mathcal N(\lambda;\theta_{li},\sigma^2)`.

        Parameters
        ----------
        grid : array
            Points :math:`\lambda` (any shape).
        sigma : float
            Width of the Gaussian kernel, positive.

        Returns
        -------
        jax.Array
            The density at every grid point (shape of ``grid``); it integrates to about 1.

        Raises
        ------
        GeometryError
            If ``sigma`` is not a positive finite number.
        """
        if not (isinstance(sigma, (int, float, np.floating, np.integer)) and np.isfinite(sigma) and sigma > 0):
            raise GeometryError(f"SpectralDensity.density: sigma must be a positive number, got {sigma!r}.")
        g = jnp.asarray(grid, self.nodes.dtype)
        z = (g[..., None, None] - self.nodes) / sigma
        kernel = jnp.exp(-0.5 * z * z) / (sigma * np.sqrt(2.0 * np.pi))
        return jnp.mean(jnp.sum(self.weights * kernel, axis=-1), axis=-1)

    def moments(self, k: int) -> tuple[jax.Array, jax.Array]:
        r"""``(estimate, standard_error)`` of the ``k``-th moment :math:`\frac1d\mathrm{tr}(E^k)`.

        Each probe's rule integrates :math:`\lambda^k` exactly for :math:`k \le 2m - 1` (Gauss
        quadrature with :math:`m` nodes), so for those ``k`` the estimate is unbiased and its
        standard error is the spread over probes divided by :math:`\sqrt P`.

        Parameters
        ----------
        k : int
            The order, a non-negative int.

        Returns
        -------
        tuple of two jax.Array
            The estimate and its standard error (inf for one probe).

        Raises
        ------
        GeometryError
            If ``k`` is not a non-negative int.
        """
        if not (isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0):
            raise GeometryError(f"SpectralDensity.moments: k must be a non-negative int, got {k!r}.")
        return mean_and_standard_error(jnp.sum(self.weights * self.nodes**k, axis=1))


def _metric_square_root_rows(metric: Metric | None, params: PyTree, xi: jax.Array, who: str) -> jax.Array:
    """The rows ``L xi`` for a factor ``G = L L^T``: covector probes with covariance ``G`` when ``E[xi xi^T] = I``."""
    if metric is None:
        return xi
    if metric.diagonal_fn is not None:
        w = ravel(metric.diagonal_fn(params))[0] + metric.damping
        return xi * jnp.sqrt(w)
    if metric.matrix_fn is not None:
        return xi @ checked_dense_factor(metric, params, who).T
    square_root = getattr(metric.mv_fn, "square_root", None)  # KFAC / EKFAC: (G + eps I)^{1/2} by layer
    if square_root is not None:
        unravel = ravel(params)[1]
        return jax.vmap(lambda x: ravel(square_root(params, unravel(x), metric.damping))[0])(xi)
    raise GeometryError(
        f"{who}: the probes of an unbiased invariant density need a factor G = L L^T of the metric, which the "
        f"matrix-free {metric.name} metric does not give. Pass mg.metrics.dense(...), mg.metrics.diagonal(...), "
        "mg.kfac(...) or mg.ekfac(...), or pass probes= covectors drawn with covariance G (e.g. J^T xi for a GGN "
        "G = J^T J)."
    )


def _quadrature(T: jax.Array, alive: jax.Array, norm2: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """Nodes and weights of one probe's rule: ``eigh`` of the live part of ``T``; weights ``s_0i^2 |z|_{G^-1}^2 / d``."""
    both = alive[:, None] & alive[None, :]
    theta, S = jnp.linalg.eigh(jnp.where(both, T, 0.0))
    return theta, S[0] ** 2 * norm2 / d


def slq_density(
    source: Products,
    key: jax.Array,
    metric: Any,
    *,
    num_probes: int,
    num_iterations: int,
    probes: Any,
    tol: float,
    maxiter: Any,
    who: str,
    return_info: bool = False,
) -> SpectralDensity | tuple[SpectralDensity, EstimateInfo]:
    r"""The spectral density of ``G^{-1}M`` (see :func:`minigeo.spectral_density`).

    Probe :math:`l` starts Lanczos in the :math:`G`-inner product at :math:`v_l = G^{-1}z_l` for a
    covector :math:`z_l` with :math:`\mathbb E[zz^\top] = G` (default :math:`z = L\xi`, :math:`G = LL^\top`,
    Rademacher :math:`\xi`); with the Ritz decomposition :math:`T = S\Theta S^\top` of its
    :math:`m \times m` projected matrix, :math:`\mathbb E_z[z^\top G^{-1} f(E) z] = \mathrm{tr} f(E)`
    and the rule is :math:`(\theta_i,\ s_{0i}^2\,z^\top G^{-1}z / d)`.
    """
    check_key(key)
    if not (isinstance(num_iterations, (int, np.integer)) and not isinstance(num_iterations, bool) and num_iterations >= 1):
        raise GeometryError(f"{who}: num_iterations must be a positive int, got {num_iterations!r}.")
    params = source.params
    d = tree_size(params)
    flat0 = ravel(params)[0]
    dtype = flat0.dtype
    m = min(int(num_iterations), d)
    metric = metric_field(metric, who)
    _metric_inverse(metric, params, tol, maxiter)  # validates tol, maxiter and a diagonal metric eagerly
    if probes is not None:
        Z = _flat_probes(probes, params, who)
    else:
        check_num_probes(num_probes, who)
        xi = jax.random.rademacher(key, (num_probes, d), dtype=dtype)
    eager = is_concrete(params, key, None if metric is None else metric.damping, None if probes is None else Z)
    if not eager and source.fixed is None:
        raise GeometryError(f"{who}: a pass over a dataset runs eagerly only; call it outside jax.jit.")
    restart_key = jax.random.fold_in(key, 1)
    options = dict(tol=tol, maxiter=maxiter)

    def device_run(compiled):  # one probe's m products as one device program (source.fixed)
        return lambda start: source.fixed(metric, start, restart_key, m, compiled, **options)

    def host_run(block_mv, ginv_block):  # one probe's Krylov basis in host memory, block by block
        def run(start):
            lanczos = ResumableBlockLanczos(block_mv, ginv_block, start, key=restart_key)
            return lanczos.projected(m, steps=source.steps) if source.steps is not None else lanczos.projected(m)

        return run

    if eager and metric is not None and metric.matrix_fn is not None:
        # a dense metric, factored G = L L^T: Lanczos of L^-1 M L^-T in the Euclidean product is Lanczos of
        # E in the G-product (v = L^-T u), with exact triangular solves instead of conjugate gradients
        L = checked_dense_factor(metric, params, who)
        lower = lambda U: jsl.solve_triangular(L, U.T, lower=True).T  # rows L^-1 u
        upper = lambda U: jsl.solve_triangular(L.T, U.T, lower=False).T  # rows L^-T u
        starts = xi if probes is None else lower(Z)
        norm2 = jnp.sum(starts * starts, axis=1)  # z^T G^-1 z = |L^-1 z|^2 (= xi^T xi = d)
        T, alive = _per_probe(host_run(lambda U: lower(source.block_mv(upper(U))), None), starts)
    else:
        if probes is None:
            Z = _metric_square_root_rows(metric, params, xi, who)
            norm2 = jnp.full((num_probes,), float(d), dtype)  # z^T G^{-1} z = xi^T xi = d
        elif metric is None:
            norm2 = jnp.sum(Z * Z, axis=1)
        else:
            norm2 = jnp.sum(Z * jax.vmap(lambda z: _flat_inverse(params, metric, z, tol, maxiter))(Z), axis=1)
        cg_metric = _solved_by_cg(metric)
        if source.fixed is not None and not eager:  # traced (under jit): every probe in one program
            T, alive = _per_probe(device_run(False), Z, vmapped=True)
        elif source.fixed is not None and not cg_metric:
            T, alive = _per_probe(device_run(_compilable(metric)), Z)
        else:  # on the host: a pass over a dataset, or a metric solved by CG (each block's solves checked)
            ginv_block = _checked_inverse_block(metric, params, tol, maxiter, who)
            T, alive = _per_probe(host_run(source.block_mv, ginv_block), Z)
    P = T.shape[0]
    nodes, weights = _quadrature_per_probe(T, alive, norm2, d)
    check_finite(nodes, f"The {source.name} products", hint=_CG_HINT)
    check_finite(norm2, f"{who}: the probes' norms z^T G^-1 z", hint=_CG_HINT)
    result = SpectralDensity(nodes, weights, P * m)
    if return_info:
        ok = jnp.all(jnp.isfinite(nodes)) & jnp.all(jnp.isfinite(norm2))
        return result, EstimateInfo(jnp.where(ok, Status.OK, Status.NON_FINITE).astype(jnp.int32), P * m)
    return result


@functools.partial(jax.jit, static_argnums=3)
def _quadrature_per_probe(T: jax.Array, alive: jax.Array, norm2: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """The quadrature nodes and weights of every probe, in one compiled program (eagerly, op by op, a
    first call compiled a dozen small programs)."""
    return jax.vmap(lambda t, a, n: _quadrature(t, a, n, d))(T, alive, norm2)


def _per_probe(
    run: Callable[[jax.Array], tuple[jax.Array, ...]], starts: jax.Array, *, vmapped: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``(T, alive)`` of ``run(start)`` for each row of ``starts`` as a ``(1, d)`` start block, stacked on axis 0.

    ``run`` returns ``(T, alive, ...)`` as :func:`block_lanczos` does; ``vmapped``: under ``jax.vmap``
    (one traced program for every probe), else one run after another.
    """
    if vmapped:
        return jax.vmap(lambda z: run(z[None])[:2])(starts)
    runs = [run(starts[i : i + 1]) for i in range(starts.shape[0])]
    return jnp.stack([r[0] for r in runs]), jnp.stack([r[1] for r in runs])


def _flat_probes(probes: Any, params: PyTree, who: str) -> jax.Array:
    """User covector probes as a flat ``(P, d)`` array: a pytree like ``params`` stacked on axis 0, or a ``(P, d)`` array."""
    d = tree_size(params)
    leaves = jax.tree_util.tree_leaves(probes)
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    if jax.tree_util.tree_structure(probes) == p_def and all(
        jnp.ndim(a) == jnp.ndim(b) + 1 and jnp.shape(a)[1:] == jnp.shape(b) for a, b in zip(leaves, p_leaves)
    ):
        flat = jax.vmap(lambda t: ravel(t)[0])(probes)
    elif len(leaves) == 1 and jnp.ndim(leaves[0]) == 2 and jnp.shape(leaves[0])[1] == d:
        flat = jnp.asarray(leaves[0])
    else:
        raise GeometryError(
            f"{who}: probes must be a (num_probes, {d}) array or a pytree like params stacked on a leading axis."
        )
    if flat.shape[0] < 1:
        raise GeometryError(f"{who}: probes must hold at least one probe.")
    check_finite(flat, f"{who}: probes")
    return flat.astype(ravel(params)[0].dtype)


def _checked_inverse_block(metric: Metric | None, params: PyTree, tol: float, maxiter: Any, who: str):
    """``V -> G^{-1} V`` row by row for a host Lanczos run: elementwise for a diagonal metric, one Cholesky
    factor for a dense one; else each solve checked (:func:`~minigeo._inverse.solve_or_nan`: through the
    factors of a KFAC / EKFAC metric, conjugate gradients otherwise)."""
    if metric is None:
        return None
    if metric.diagonal_fn is not None:
        return jax.vmap(lambda v: _flat_inverse(params, metric, v, tol, maxiter))
    if metric.matrix_fn is not None:  # a dense metric: one Cholesky factor, exact solves (no CG)
        L = checked_dense_factor(metric, params, who)
        return lambda V: jsl.cho_solve((L, True), V.T).T

    def ginv_block(V: jax.Array) -> jax.Array:
        run = _compiled_block_solves if _compilable(metric) else _block_solves
        fns, damping, name = split_metric(metric)
        X, statuses = run(fns, params, damping, V, name=name, tol=tol, maxiter=maxiter)
        raise_for_status(first_failure(statuses), who, detail=f"A solve with the {metric.name} metric failed ({_solver_name(metric)}).")
        return X

    return ginv_block


# ---------------------------------------------------------------------------
# XTrace and XDiag (Epperly, Tropp & Webber 2024): exchangeable, leave-one-out
# ---------------------------------------------------------------------------
def _check_x_budget(num_products: Any, who: str, method: str) -> None:
    check_num_probes(num_products, who)
    if num_products < 4:
        raise GeometryError(
            f"{who}: {method} spends num_probes in two halves of at least 2 products each (a sketch and its "
            f"leave-one-out average); it needs num_probes >= 4, got {num_products}."
        )


def _rowwise(source: Products, batched: str) -> Callable[[jax.Array], jax.Array]:
    """``V -> M V`` row by row: all rows at once (``"vmap"``) or one at a time (``"map"``, less memory)."""
    if batched == "vmap":
        return source.block_mv
    return lambda V: jnp.concatenate([source.block_mv(V[i : i + 1]) for i in range(V.shape[0])])


@jax.jit
def _downdating_basis(Y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``(Q, R, S)`` for the rows ``Y`` (``m x d``): ``Y^T = QR`` (Householder) and ``S``, the columns of
    :math:`R^{-\top}` normalized, so that :math:`Q_{(i)}Q_{(i)}^\top = QQ^\top - Qs_i s_i^\top Q^\top` is the
    projector onto the span of the sketch without its column :math:`i`.

    A sketch of a matrix of rank below ``m`` has a (numerically) singular ``R``; a diagonal entry at or
    below ``eps * max|R|`` is raised to that floor (a rounding-size change of the sketch), so ``S`` stays
    finite, and the zero operator gives zero.
    """
    Q, R = jnp.linalg.qr(Y.T)  # Q: (d, m) orthonormal columns
    eps = jnp.finfo(Y.dtype).eps
    floor = eps * jnp.maximum(jnp.max(jnp.abs(R)), jnp.finfo(Y.dtype).tiny / eps)
    diag = jnp.diagonal(R)
    safe = jnp.where(jnp.abs(diag) > floor, diag, jnp.where(diag < 0, -floor, floor))
    R_safe = R.at[jnp.diag_indices(R.shape[0])].set(safe)
    S = jsl.solve_triangular(R_safe, jnp.eye(R.shape[0], dtype=Y.dtype), lower=False, trans=1)  # R^{-T}
    S = S / jnp.linalg.norm(S, axis=0, keepdims=True)
    return Q, R, S


@jax.jit
def _xtrace_estimates(Om: jax.Array, Q: jax.Array, R: jax.Array, S: jax.Array, Z: jax.Array) -> jax.Array:
    """The ``m`` leave-one-out estimates :math:`t_i` of XTrace (``xtrace_helper.m``), columns ``w_i`` of ``Om``."""
    d, m = Om.shape
    W = Q.T @ Om
    scale = (d - m + 1) / (d - jnp.sum(W * W, axis=0) + jnp.sum(S * W, axis=0) ** 2)
    H = Q.T @ Z
    HW = H @ W
    T = Z.T @ Om
    dSW = jnp.sum(S * W, axis=0)
    dSHS = jnp.sum(S * (H @ S), axis=0)
    dTW = jnp.sum(T * W, axis=0)
    dWHW = jnp.sum(W * HW, axis=0)
    dSRmHW = jnp.sum(S * (R - HW), axis=0)
    dTmHRS = jnp.sum((T - H.T @ W) * S, axis=0)
    ests = jnp.trace(H) - dSHS + (-dTW + dWHW + dSW * dSRmHW + dSW**2 * dSHS + dTmHRS * dSW) * scale
    return ests


def xtrace_trace(
    source: Products, key: jax.Array, metric: Any, *, num_products: int, batched: str, tol: float, maxiter: Any,
    who: str, return_info: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""XTrace for :math:`\mathrm{tr}(A)`, :math:`A = G^{-1}M`, with a budget of ``num_products`` products.

    With :math:`m = \lfloor \text{budget}/2 \rfloor` test vectors :math:`\omega_i` (Gaussian,
    normalized to length :math:`\sqrt d`), the sketch :math:`Y = A\Omega = QR` and :math:`Z = AQ`
    (:math:`2m` products), each :math:`i` gives the Hutch++-type estimate with the basis
    :math:`Q_{(i)}` of the sketch without column :math:`i`,

    .. math:: t_i = \mathrm{tr}(Q_{(i)}^\top A Q_{(i)}) + c_i\,\omega_i^\top (I - Q_{(i)}Q_{(i)}^\top)
              A (I - Q_{(i)}Q_{(i)}^\top)\omega_i,

    .. math:: c_i = \frac{d - m + 1}{\|(I - Q_{(i)}Q_{(i)}^\top)\omega_i\|^2},

    and the estimate is their mean, the error estimate their standard deviation over :math:`\sqrt m`.
    All :math:`t_i` come from one QR by the downdating formulas (:func:`_downdating_basis`) at
    :math:`O(dm^2)` cost, as in the reference code (``xtrace_helper.m``).  Every term uses only products
    :math:`Av` (never :math:`A^\top`), and both the splitting
    :math:`\mathrm{tr}A = \mathrm{tr}(PA) + \mathrm{tr}((I-P)A(I-P))` and the residual's unbiasedness (the
    direction of :math:`(I - Q_{(i)}Q_{(i)}^\top)\omega_i` is uniform in the complement, independent of
    :math:`Q_{(i)}`) hold for any square :math:`A`: the non-symmetric :math:`E = G^{-1}M` is estimated
    without bias, and exactly when its rank is below :math:`m`.
    """
    _check_x_budget(num_products, who, "xtrace")
    params, d, dtype, inverse, mv = _sketch_setup(source, key, metric, batched, tol, maxiter, who)
    m = min(num_products // 2, d)
    Om = jax.random.normal(key, (m, d), dtype=dtype)
    Om = float(np.sqrt(d)) * Om / jnp.linalg.norm(Om, axis=1, keepdims=True)  # uniform on the sphere, radius sqrt(d)
    Y = inverse(mv(Om))  # rows A w_i
    check_finite(Y, f"The {source.name} products", hint=_CG_HINT)
    Q, R, S = _downdating_basis(Y)
    Z = inverse(mv(Q.T)).T  # A Q, (d, m)
    check_finite(Z, f"The {source.name} products", hint=_CG_HINT)
    ests = _xtrace_estimates(Om.T, Q, R, S, Z)
    est, err = mean_and_standard_error(ests)
    err = err * small_sample_factor(m)  # the error rests on m estimates: +- 2 se is a 95 % interval (issue 55)
    if return_info:
        ok = jnp.isfinite(est) & jnp.isfinite(err)
        return est, err, EstimateInfo(jnp.where(ok, Status.OK, Status.NON_FINITE).astype(jnp.int32), 2 * m)
    return est, err


DIAGONAL_METHODS = ("hutchinson", "xdiag")


@jax.jit
def _xdiag_values(Om: jax.Array, Y: jax.Array, Q: jax.Array, S: jax.Array, Z: jax.Array) -> jax.Array:
    """The ``m`` leave-one-out diagonals :math:`d_i` of XDiag (``xdiag.m``), as rows; columns ``w_i`` of ``Om``."""
    T = Z.T @ Om  # Q^T M Om
    QS, ZS = Q @ S, Z @ S
    dST = jnp.sum(S * T, axis=0)
    values = (
        jnp.sum(Q * Z, axis=1)[None, :]  # diag(Q Q^T M)
        - (QS * ZS).T  # minus diag(Q s_i s_i^T Q^T M)
        + (Om * (Y.T - Q @ T + QS * dST[None, :])).T  # w_i o (I - Q_(i) Q_(i)^T) M w_i
    )
    return values


def xdiag_diagonal(
    source: Products, key: jax.Array, *, num_products: int, who: str, return_info: bool = False
) -> tuple[PyTree, PyTree] | tuple[PyTree, PyTree, EstimateInfo]:
    r"""XDiag for :math:`\mathrm{diag}(M)` (symmetric :math:`M`), with per-entry error estimates, as pytrees.

    With :math:`m = \lfloor \text{budget}/2 \rfloor` Rademacher vectors :math:`\omega_i`, the sketch
    :math:`Y = M\Omega = QR` and :math:`Z = M^\top Q = MQ`, the leave-one-out estimates

    .. math:: d_i = \mathrm{diag}(Q_{(i)}Q_{(i)}^\top M) + \omega_i \odot (I - Q_{(i)}Q_{(i)}^\top)M\omega_i

    (Hutchinson's diagonal of the deflated remainder with the one probe left out of the basis) are
    averaged: the formula of the reference code (``xdiag.m``).  The per-entry error estimate is the
    standard deviation of the :math:`d_i` over :math:`\sqrt m`, XTrace's error estimate applied entry
    by entry (the paper gives none for XDiag).
    """
    _check_x_budget(num_products, who, "xdiag")
    check_key(key)
    params = source.params
    d = tree_size(params)
    dtype = ravel(params)[0].dtype
    m = min(num_products // 2, d)
    Om = jax.random.rademacher(key, (m, d), dtype=dtype)
    Y = source.block_mv(Om)  # rows M w_i
    hint = "The loss is not twice differentiable here, or overflowed."
    check_finite(Y, f"The {source.name} products", hint=hint)
    Q, R, S = _downdating_basis(Y)
    Z = source.block_mv(Q.T).T  # M^T Q = M Q, (d, m)
    check_finite(Z, f"The {source.name} products", hint=hint)
    values = _xdiag_values(Om.T, Y, Q, S, Z)
    mean, err = mean_and_standard_error(values, axis=0)
    unravel = ravel(params)[1]
    if return_info:
        ok = jnp.all(jnp.isfinite(values))
        status = jnp.where(ok, Status.OK, Status.NON_FINITE).astype(jnp.int32)
        return unravel(mean), unravel(err), EstimateInfo(status, 2 * m)
    return unravel(mean), unravel(err)


def diagonal_by_method(
    source: Products, key: jax.Array, *, method: str, num_probes: int, who: str, return_info: bool = False
):
    """Dispatch ``method`` (:data:`DIAGONAL_METHODS`); ``num_probes`` is the budget of products with ``M``."""
    if method == "hutchinson":
        return hutchinson_diagonal(source, key, num_probes=num_probes, who=who, return_info=return_info)
    if method == "xdiag":
        return xdiag_diagonal(source, key, num_products=num_probes, who=who, return_info=return_info)
    raise GeometryError(f"{who}: method must be one of {DIAGONAL_METHODS}, got {method!r}.")

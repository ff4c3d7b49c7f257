r"""The drivers of :mod:`minigeo.sharpness`: :func:`adaptive_sharpness` and :func:`geodesic_sharpness`.

Each validates its arguments (eagerly, before anything is compiled), factors metric (15) once at the
base point, runs the compiled ascent of :mod:`minigeo.sharpness._ascent` over the stack of batches on
the search space of :mod:`minigeo.sharpness._blocks`, and turns the outcome into a
:class:`~minigeo.sharpness.SharpnessResult` with a ``status`` (under ``jit``) or a :class:`~minigeo.GeometryError`
(eagerly).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._batches import Batches
from .._checks import GeometryError, as_float_point, check_finite, check_key, check_same_structure, is_concrete
from .._compile import compiled
from .._pairs import _eps_that_works
from .._status import Status
from .._tree import PyTree
from ._ascent import N_RESTARTS, _auto_pgd
from ._blocks import _Geometry, _normal_like
from ._spec import (
    DEFAULT_RTOL,
    SharpnessResult,
    SymmetrySpec,
)

__all__ = ["adaptive_sharpness", "geodesic_sharpness"]


# ---------------------------------------------------------------------------
# argument checks (before anything is compiled)
# ---------------------------------------------------------------------------
def _rho_limit(dtype) -> float:
    """The largest radius accepted: ``1/eps(dtype)`` of the loss's dtype (8.4e6 in float32, 4.5e15 in float64).

    Beyond it the perturbation of a weight exceeds the weight by more than ``1/eps``, so ``w + delta``
    rounds to ``delta`` (the base point no longer enters), and squared norms of the search overflow long
    before radii like 1e200 (which used to return a meaningless ~0 with status 0).
    """
    return 1.0 / float(jnp.finfo(dtype).eps)


def _check_rho(rho: Any, dtype=None) -> None:
    """rho may be a Python or NumPy scalar, a 0-d array or a traced value (then unchecked; see ``Status.RHO_OUT_OF_RANGE``);
    with ``dtype`` (the loss's), a concrete rho must also be at most :func:`_rho_limit`."""
    if isinstance(rho, bool) or not (
        isinstance(rho, (int, float, np.integer, np.floating)) or (hasattr(rho, "shape") and jnp.shape(rho) == ())
    ):
        raise GeometryError(f"the sharpness radius rho must be a positive scalar (> 0), got {rho!r}.")
    if is_concrete(rho):
        r = float(np.asarray(rho))
        if not (np.isfinite(r) and r > 0):
            raise GeometryError(
                f"the sharpness radius rho must be > 0 and finite, got {r!r} (rho = inf would make every "
                "loss increase possible; rho <= 0 is an empty ball)."
            )
        if dtype is not None and r > _rho_limit(dtype):
            raise GeometryError(
                f"the sharpness radius rho = {r:.3g} is absurdly large for {jnp.dtype(dtype).name}: it must be at most "
                f"1/eps = {_rho_limit(dtype):.3g} (perturbations of more than 1/eps times a weight erase the weight "
                "in rounding, and the search's squared norms overflow). Typical radii are 1e-3 to 4."
            )


def _check_restarts(n_restarts: Any) -> None:
    if isinstance(n_restarts, bool) or not (isinstance(n_restarts, (int, np.integer)) and n_restarts >= 0):
        raise GeometryError(f"n_restarts must be an int >= 0, got {n_restarts!r}.")


def _as_stack(batches: Any) -> PyTree:
    """``mg.operators.batches_of(...)`` as its stack (the one batches type, issue 53); a stacked pytree unchanged."""
    return batches.stacked() if isinstance(batches, Batches) else batches


def _check_stacked(batches: PyTree, who: str) -> int:
    """The number of batches of a **stacked** ``batches``: every leaf of shape ``(num_batches, batch_size, ...)``.

    A stack has a leading batch-index axis, shared by all leaves, and each batch keeps its own
    leading example axis, so every leaf has at least two axes.  A single unstacked batch
    ``(inputs (n, ...), labels (n,))`` has a 1-D leaf and is refused: read as a stack it would be
    ``n`` batches of one example each, with no example axis, which many losses silently accept.
    """
    pairs = jax.tree_util.tree_leaves_with_path(batches)
    if not pairs:
        raise GeometryError(
            f"{who}: batches is empty: pass a pytree of arrays stacked along a leading batch-index axis."
        )
    how = (
        "Sharpness takes a stack of batches, every leaf of shape (num_batches, batch_size, ...): stack one batch "
        "with jax.tree_util.tree_map(lambda x: x[None], batch), a dataset with "
        "mg.operators.batches_of(data, batch_size, drop_remainder=True).stacked()."
    )
    for path, x in pairs:
        if jnp.ndim(x) < 2:
            name = jax.tree_util.keystr(path) or "(root)"
            raise GeometryError(
                f"{who}: batches is not stacked: its leaf {name} has shape {tuple(jnp.shape(x))}, so a batch would "
                f"have no example axis (an unstacked batch of n examples would be read as n batches of one). {how}"
            )
    sizes = {int(jnp.shape(x)[0]) for _, x in pairs}
    if len(sizes) != 1 or 0 in sizes:
        listing = ", ".join(f"{jax.tree_util.keystr(p) or '(root)'}: {jnp.shape(x)[0]}" for p, x in pairs)
        raise GeometryError(
            f"{who}: batches must be stacked along a common leading axis of length >= 1 (one entry per batch); "
            f"got leading sizes {listing}."
        )
    examples = {int(jnp.shape(x)[1]) for _, x in pairs}
    if len(examples) != 1:
        # the rule of the curvature operators: the leaves of a batch agree on their example axis.  An unstacked
        # batch (inputs (n, d), targets (n, k)) passes the two-axis rule but is read as n batches whose leaves
        # have sizes d and k on that axis (n single examples without an example axis, silently)
        listing = ", ".join(f"{jax.tree_util.keystr(p) or '(root)'}: {tuple(jnp.shape(x))}" for p, x in pairs)
        raise GeometryError(
            f"{who}: the leaves of batches disagree on the example axis (axis 1, the batch size) ({listing}), so "
            f"batches is not a stack of batches: an unstacked batch of n examples would be read as n batches of one "
            f"example without an example axis. {how} A per-batch value that is not per-example (a mask, a "
            "temperature) must be repeated along the example axis or closed over in loss_fn."
        )
    return sizes.pop()


def _struct(x: Any, drop: int = 0) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(jnp.shape(x))[drop:], jnp.result_type(x))


def _loss_dtype(loss_fn: Callable, params: PyTree, batches: PyTree, who: str):
    """Trace ``loss_fn`` on one batch (shapes only, nothing is computed) and return its dtype.

    A batch whose trailing shape does not fit the loss or the parameters fails here with a
    :class:`GeometryError` (naming the shapes) instead of a raw error from inside the compiled search.
    """
    p_struct = jax.tree_util.tree_map(_struct, params)
    b_struct = jax.tree_util.tree_map(lambda x: _struct(x, 1), batches)
    try:
        out = jax.eval_shape(loss_fn, p_struct, b_struct)
    except Exception as err:  # noqa: BLE001 - any failure of the user's loss on these shapes
        shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), b_struct)
        raise GeometryError(
            f"{who}: loss_fn(params, batch) fails on one batch of `batches` (leaf shapes {shapes} after removing "
            f"the leading batch-index axis): {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
            "Check that batches is stacked as (num_batches, batch_size, ...) and that its trailing shapes are "
            "the ones loss_fn and params expect."
        ) from err
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        got = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), out)
        raise GeometryError(
            f"{who}: loss_fn(params, batch) must return a real floating scalar; got (shape, dtype) {got}. "
            "Reduce the loss over the batch (e.g. jnp.mean)."
        )
    return out.dtype


def _check_low_precision(params: PyTree, dtype, who: str) -> None:
    """Refuse float16/bfloat16: a radius below their resolution rounds every perturbation away (sharpness 0)."""
    small = {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)}
    dtypes = {jnp.dtype(jnp.result_type(x)) for x in jax.tree_util.tree_leaves(params)} | {jnp.dtype(dtype)}
    low = sorted(d.name for d in dtypes & small)
    if low:
        raise GeometryError(
            f"{who}: params or the loss are in {', '.join(low)}, which sharpness does not support: their 8 to 11 "
            "bit mantissas round small perturbations away (a sharpness of exactly 0) and the metric's "
            "factorization has no accuracy left. Cast params and the floating batches to float32, e.g. "
            "jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)."
        )


def _check_common(loss_fn: Callable, params: PyTree, rho: Any, batches: PyTree, n_iter: int, key: Any, who: str):
    """Validate the shared arguments (before anything is compiled); return the number of batches and the loss dtype."""
    as_float_point(params, f"{who}: params")  # floating, real, non-empty
    check_key(key, f"{who}: key")
    if isinstance(n_iter, bool) or not (isinstance(n_iter, (int, np.integer)) and n_iter >= 1):
        raise GeometryError(f"n_iter must be a positive int, got {n_iter!r}.")
    _check_rho(rho)
    n = _check_stacked(batches, who)
    dtype = _loss_dtype(loss_fn, params, batches, who)
    _check_low_precision(params, dtype, who)
    _check_rho(rho, dtype)
    return n, dtype


def _rho_ok(rho: Any, dtype) -> jax.Array:
    return jnp.asarray(rho <= _rho_limit(dtype))


# ---------------------------------------------------------------------------
# the compiled search over a stack of batches, its status and error bound
# ---------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("geometry",))
def _factorize(geometry, params):
    return geometry.factors(jax.tree_util.tree_leaves(params))


def _search_batches_impl(
    loss_fn, params, fac, batches, rho, keys, *, geometry, n_iter: int, momentum: float, keep: bool, n_restarts: int
):
    # the base-point factorization ``fac`` is computed once, outside the loop over batches
    return jax.lax.map(
        lambda kb: _auto_pgd(loss_fn, geometry, params, fac, kb[1], rho, kb[0], n_iter, momentum, keep, n_restarts),
        (keys, batches),
    )


# traced at every call (never stale in what loss_fn reads), compiled once per traced program
_search_batches = functools.partial(compiled, _search_batches_impl)


def _status(pairs_ok: jax.Array, finite: jax.Array, rho_ok: jax.Array = True) -> jax.Array:
    return jnp.where(
        ~jnp.asarray(rho_ok),
        Status.RHO_OUT_OF_RANGE,
        jnp.where(~pairs_ok, Status.ILL_CONDITIONED_PAIR, jnp.where(jnp.all(finite), Status.OK, Status.NON_FINITE)),
    ).astype(jnp.int32)


def _pair_bounds(fac: list, dtype) -> list:
    """Per pair, the error bound ``cond(side) eps(dtype)`` of every head (inf where not finite)."""
    eps = float(jnp.finfo(dtype).eps)
    return [jnp.where(jnp.isfinite(f.cond), f.cond * eps, jnp.inf) for f in fac]


def _error_bound(fac: list, dtype) -> jax.Array:
    """:attr:`SharpnessResult.error_bound`: the largest per-head bound, or ``eps(dtype)`` without pairs."""
    eps = jnp.asarray(jnp.finfo(dtype).eps, dtype)
    bounds = [jnp.max(b).astype(dtype) for b in _pair_bounds(fac, dtype)]
    return jnp.max(jnp.stack(bounds + [eps]))


def _raise_if_pair_inaccurate(who: str, geometry, fac: list, dtype, rtol: float) -> None:
    """Eagerly: raise if a pair's error bound ``cond eps`` exceeds ``rtol``, naming an ``eps`` that works."""
    for j, (f, bound) in enumerate(zip(fac, _pair_bounds(fac, dtype))):
        b = np.asarray(bound)
        if (b <= rtol).all():
            continue
        name = geometry.names[j] if j < len(geometry.names) else f"pair {j}"
        bad = tuple(int(i) for i in np.argwhere(~(b <= rtol))[0]) if b.ndim else ()
        worst = float(np.max(b))
        target = rtol / float(jnp.finfo(dtype).eps)
        eps_ok = max(_eps_that_works(np.asarray(f.G), np.asarray(f.H), target), geometry.eps)
        raise GeometryError(
            f"{who}: GL(h) pair {j} ({name}) is too ill conditioned at {jnp.dtype(dtype).name} for rtol={rtol:g}: "
            f"error bound cond(side) * eps = {worst:.3g} > rtol (worst head index {bad}; condition number of a side "
            f"{worst / float(jnp.finfo(dtype).eps):.3g}, accepted up to {target:.3g}; a numerically rank deficient "
            f"pair has an infinite bound). Remedies: the relaxation eps > 0 of metric (15) (App. G.2), e.g. "
            f"mg.symmetry_spec(..., eps={eps_ok:.1g}), which makes this pair's bound <= rtol/2 but breaks exact "
            "invariance by about eps / s_min^2; float64; a looser rtol (at most the error you can accept); or a "
            "better-conditioned point. [ILL_CONDITIONED_PAIR]"
        )


def _raise_if_non_finite(who: str, per_batch, finite) -> None:
    bad = np.flatnonzero(~np.asarray(finite))
    if bad.size:
        raise GeometryError(
            f"{who}: the loss or its gradient is not finite at the base point or along the search on "
            f"batch {int(bad[0])} ({bad.size} of {np.size(finite)} batches; values {np.asarray(per_batch)[bad][:3]}). "
            "Check the loss at params (NaN/inf inputs, log of 0), use float64, or a smaller rho. [NON_FINITE]"
        )


def _check_params(params: PyTree, batches: PyTree, who: str) -> None:
    check_finite(params, f"{who}: params", hint="Sharpness of a point with non-finite weights is undefined.")
    check_finite(batches, f"{who}: batches", hint="Remove or fix the non-finite inputs.")


def _check_rtol(rtol: Any, who: str) -> None:
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.integer, np.floating)) or not 0 < rtol < 1:
        raise GeometryError(f"{who}: rtol must be a float in (0, 1), got {rtol!r}.")


def _over_batches(
    loss_fn, geometry, params, batches, rho, key, n_iter, momentum, keep, who, n_restarts, rtol=DEFAULT_RTOL
) -> SharpnessResult:
    n, dtype = _check_common(loss_fn, params, rho, batches, n_iter, key, who)
    _check_restarts(n_restarts)
    _check_rtol(rtol, who)
    eager = is_concrete(params, batches, rho, key)
    if eager:
        _check_params(params, batches, who)
    fac = _factorize(geometry, params) if geometry.pairs else []
    if eager:  # before the (expensive) search
        _raise_if_pair_inaccurate(who, geometry, fac, dtype, rtol)
    values, finite, perts = _search_batches(
        loss_fn, params, fac, batches, rho, jax.random.split(key, n), geometry=geometry, n_iter=n_iter,
        momentum=momentum, keep=bool(keep), n_restarts=int(n_restarts),
    )
    bound = _error_bound(fac, dtype)
    pairs_ok = bound <= rtol
    status = _status(pairs_ok, finite, _rho_ok(rho, dtype))
    if eager:
        _raise_if_non_finite(who, values, finite)
    return SharpnessResult(jnp.mean(values), values, perts, status, bound)


def _average_case_impl(loss_fn, params, batches, rho, keys, *, n_samples: int, fixed: tuple):
    w, treedef = jax.tree_util.tree_flatten(params)

    def one_batch(kb):
        k, batch = kb

        def sample(kk):
            pert = [
                wi if i in fixed else wi + jnp.abs(wi) * rho * zi for i, (wi, zi) in enumerate(zip(w, _normal_like(kk, w)))
            ]
            return loss_fn(jax.tree_util.tree_unflatten(treedef, pert), batch)

        base = loss_fn(params, batch)
        value = jnp.mean(jax.lax.map(sample, jax.random.split(k, n_samples))) - base
        return value, jnp.isfinite(value)

    return jax.lax.map(one_batch, (keys, batches))


_average_case = functools.partial(compiled, _average_case_impl)


def adaptive_sharpness(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    batches: PyTree,
    rho: float,
    *,
    key: jax.Array,
    kind: str = "worst",
    n_iter: int = 20,
    n_samples: int = 64,
    momentum: float = 0.75,
    spec: SymmetrySpec | None = None,
    return_perturbation: bool = False,
    n_restarts: int = N_RESTARTS,
) -> SharpnessResult:
    r"""Adaptive sharpness of ``loss_fn`` at ``params``: worst case by Auto-PGD, or the average case.

    .. math::

        S_{\max} = \max_{\lVert\delta/|w|\rVert_2 \le \rho} L(w + \delta) - L(w),\qquad
        S_{\mathrm{avg}} = \mathbb E_{z\sim\mathcal N(0,\rho^2 I)}\,L(w + |w|\odot z) - L(w),

    per batch, then averaged over batches.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch) -> scalar``.  Must be hashable (a module-level
        function or a fixed lambda), as it is a static argument of the compiled loop.
    params : pytree
        The weights :math:`w`.
    batches : pytree or Batches
        A **stack** of batches: every leaf of shape ``(num_batches, batch_size, ...)``, the leading
        batch-index axis shared by all leaves, each batch keeping its own example axis (so every leaf has
        at least two axes, and all leaves agree on the batch size, axis 1, as the leaves of a batch agree
        on the example axis in the curvature operators; a per-batch value that is not per-example is
        repeated along that axis or closed over in ``loss_fn``).  ``loss_fn`` receives one
        entry ``batch = tree_map(lambda x: x[b], batches)``; the result is averaged over batches.  Stack
        one batch with ``tree_map(lambda x: x[None], batch)``.  Or a dataset's
        ``mg.operators.batches_of(data, batch_size, drop_remainder=True)``, the batches the curvature operators
        take, which is stacked here (every batch of the same size).
    rho : float
        Radius of the adaptive L2 ball :math:`\lVert\delta/|w|\rVert_2 \le \rho`; at most ``1/eps`` of the
        loss's dtype (8.4e6 in float32, 4.5e15 in float64), beyond which ``w + delta`` no longer
        depends on ``w`` in rounding.
    key : jax.Array
        PRNG key (random start, average-case samples), e.g. ``jax.random.PRNGKey(0)``.
    kind : {"worst", "average"}, optional
        ``"worst"`` (Auto-PGD, ``n_iter`` iterations) or ``"average"`` (``n_samples`` Gaussian samples).
    n_iter : int, optional
        Auto-PGD iterations per run (worst case).
    n_samples : int, optional
        Gaussian samples (average case).
    momentum : float, optional
        Auto-PGD momentum (Croce & Hein 2020).
    spec : SymmetrySpec, optional
        Only its ``redundant`` leaves are used (held fixed, since the function does not depend on
        them); its pairs are ignored, as adaptive sharpness treats every leaf element-wise.
    return_perturbation : bool, optional
        Keep the maximizing perturbation of every batch (a full copy of the weights per batch).
    n_restarts : int, optional
        Worst case only: at most this many further Auto-PGD runs of ``n_iter`` iterations after the
        first, each from the antipode of the previous run's best point, keeping the best point of
        all; they stop once two runs in a row raised the best value by less than 0.1 % of the
        sharpness, so a call costs ``n_iter + 1`` loss gradients per run, for between
        ``min(3, n_restarts + 1)`` and ``n_restarts + 1`` runs.  ``0`` is the single run of Croce & Hein
        (2020); the default reaches >= 0.999 of the exact maximum on chapter 6's diagonal networks,
        where a single run of 20 iterations reaches 0.77 to 1.

    Returns
    -------
    SharpnessResult
        With a ``status`` (see there).

    Raises
    ------
    GeometryError
        Always (shapes and dtypes are static): ``batches`` not stacked (a leaf with fewer than two axes,
        or leaves disagreeing on the batch size: an unstacked batch ``(inputs (n, d), targets (n, k))``
        would otherwise be read as ``n`` batches) or its leaves disagreeing on the number of batches;
        ``spec`` built for params of another structure or shapes; ``loss_fn`` failing on one batch's shapes or
        not returning a real scalar; ``key`` not a PRNG key; params empty, integer or complex; params or
        loss in float16/bfloat16 (cast to float32).  Eagerly: rho not a positive finite scalar or above
        ``1/eps`` of the loss's dtype, non-finite params or batches, or a non-finite loss during the
        search.  Under ``jit`` the values cannot be checked: read ``result.status``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> loss = lambda w, b: 0.5 * jnp.sum(b * (w - 1.0) ** 2)   # minimum w = 1, curvature b
    >>> b, key = jnp.array([[1.0, 2.0, 4.0]]), jax.random.PRNGKey(0)
    >>> res = mg.adaptive_sharpness(loss, jnp.ones(3), b, 0.1, key=key)
    >>> round(float(res.sharpness), 4)   # closed form: rho^2 max(b) / 2
    0.02

    References
    ----------
    Andriushchenko et al. (2023) (adaptive sharpness, Auto-PGD); da Silva, Dangel & Oore (2025),
    *Hide & Seek*, eqs. (1) to (3), App. C.2. Chapters 6 and 7.
    """
    who = "adaptive_sharpness"
    batches = _as_stack(batches)
    if spec is not None:
        _check_spec(spec, params, who)
    geometry = _Geometry(spec, adaptive=True)
    if kind == "worst":
        return _over_batches(
            loss_fn, geometry, params, batches, rho, key, n_iter, momentum, return_perturbation, who, n_restarts
        )
    if kind != "average":
        raise GeometryError(f"adaptive_sharpness: kind must be 'worst' or 'average', got {kind!r}.")
    n, dtype = _check_common(loss_fn, params, rho, batches, n_iter, key, who)
    if isinstance(n_samples, bool) or not (isinstance(n_samples, (int, np.integer)) and n_samples >= 1):
        raise GeometryError(f"adaptive_sharpness: n_samples must be a positive int, got {n_samples!r}.")
    eager = is_concrete(params, batches, rho, key)
    if eager:
        _check_params(params, batches, who)
    values, finite = _average_case(
        loss_fn, params, batches, rho, jax.random.split(key, n), n_samples=int(n_samples), fixed=geometry.fixed
    )
    if eager:
        _raise_if_non_finite(who, values, finite)
    status = _status(jnp.asarray(True), finite, _rho_ok(rho, dtype))
    return SharpnessResult(jnp.mean(values), values, None, status, _error_bound([], dtype))


def geodesic_sharpness(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    batches: PyTree,
    spec: SymmetrySpec,
    rho: float,
    *,
    key: jax.Array,
    n_iter: int = 20,
    momentum: float = 0.75,
    return_perturbation: bool = False,
    n_restarts: int = N_RESTARTS,
    rtol: float = DEFAULT_RTOL,
    second_order: bool = True,
) -> SharpnessResult:
    r"""Worst-case geodesic sharpness on the quotient by the spec's symmetries.

    .. math:: S = \max_{\xi\ \mathrm{horizontal},\ \lVert\xi\rVert_g \le \rho} L\big(w + \xi - \tfrac12\Gamma(\xi,\xi)\big) - L(w),

    per batch, then averaged over batches: metric (15) on the GL(h) pairs of ``spec`` (exact
    geodesics on its GL(1) pairs), the adaptive norm elsewhere; Auto-PGD with Riemannian gradients and
    projection onto the horizontal ball.  Invariant under :math:`(G, H) \mapsto (GA^{-1}, HA^\top)` on
    every pair (with ``spec.eps = 0``) and under element-wise rescalings elsewhere; the spec's
    redundant leaves are not perturbed.  The metric at the base point is factored once per call (thin
    SVDs of every pair's sides at ``"highest"`` precision, shared by all batches).

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch) -> scalar``; hashable (a static argument of the compiled loop).
    params : pytree
        The weights :math:`w`.
    batches : pytree or Batches
        A stack of batches, every leaf of shape ``(num_batches, batch_size, ...)``, or
        ``mg.operators.batches_of(...)`` (see :func:`adaptive_sharpness`).
    spec : SymmetrySpec
        The symmetries, from :func:`symmetry_spec`.
    rho : float
        Radius of the geodesic ball.
    key : jax.Array
        PRNG key of the random (horizontal, equivariant) start.
    n_iter, momentum, return_perturbation, n_restarts
        As in :func:`adaptive_sharpness`.
    rtol : float, optional
        Relative accuracy, in (0, 1), required of the factorization of metric (15): a GL(h) pair is
        accepted when its error bound :math:`\mathrm{cond}(\text{side})\,\varepsilon_{\text{dtype}}` (largest
        over heads) is at most ``rtol``.  The default 1e-2 accepts float32 sides up to condition number
        8.4e4 (a ViT-B/32 moved by per-head :math:`A = I + N/8` has 3.9e4, bound 4.6e-3).
    second_order : bool, optional
        ``True`` (default): the perturbed point is the second-order geodesic
        :math:`w + \xi - \tfrac12\Gamma(\xi,\xi)` (exact geodesics on GL(1) pairs).  ``False``: a
        control without the Christoffel term, the straight line :math:`w + \xi` from the base point
        in the same horizontal direction and over the same ball (the search, the metric and the
        projection are unchanged).  The two agree to first order in :math:`\rho`; their difference
        measures what the higher-order geodesic terms contribute (chapter 7).

    Returns
    -------
    SharpnessResult
        With a ``status`` and the ``error_bound`` (see there); ``perturbation`` only if
        ``return_perturbation``.

    Raises
    ------
    GeometryError
        Eagerly: a GL(h) pair whose error bound exceeds ``rtol`` (rank-deficient pairs included; the
        message names the pair, the head, the bound, and a relaxation ``eps`` computed for this pair that
        brings its bound to ``rtol/2``), and the errors of :func:`adaptive_sharpness` (batches not
        stacked, a loss that fails on a batch's shapes, a bad key, float16/bfloat16, rho out of range).
        Under ``jit``: no exception; read ``result.status``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> G, H = jnp.array([[1.0, 0.0], [0.0, 2.0]]), jnp.array([[1.0, 1.0], [0.0, 1.0]])
    >>> params = {"G": G, "H": H}
    >>> loss = lambda p, T: 0.5 * jnp.sum((p["G"] @ p["H"].T - T) ** 2)
    >>> spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    >>> T = (params["G"] @ params["H"].T)[None]
    >>> res = mg.geodesic_sharpness(loss, params, T, spec, 0.05, key=jax.random.PRNGKey(0))
    >>> bool(res.sharpness > 0)
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eqs. (6) and (8); App. C.1, C.2 (Algorithm 1). Chapters 6 and 7.
    """
    who = "geodesic_sharpness"
    batches = _as_stack(batches)
    _check_spec(spec, params, who)
    return _over_batches(
        loss_fn, _Geometry(spec, second_order=second_order), params, batches, rho, key, n_iter, momentum, return_perturbation, who, n_restarts,
        rtol,
    )


def _check_spec(spec: Any, params: PyTree, who: str) -> None:
    if not isinstance(spec, SymmetrySpec):
        raise GeometryError(f"{who} needs a SymmetrySpec from mg.symmetry_spec(params, gl_pairs).")
    n_leaves = len(jax.tree_util.tree_leaves(params))
    if spec.num_leaves != n_leaves:
        raise GeometryError(
            f"the SymmetrySpec was built for a pytree with {spec.num_leaves} leaves, but params has {n_leaves}; "
            "build the spec from these params."
        )
    if spec.structure is not None and len(spec.leaf_shapes) == n_leaves:
        # the spec names leaves by index: params of another layout or other shapes would silently pair
        # other leaves (or fail deep in the search with a raw ValueError/TypeError)
        if jax.tree_util.tree_structure(params) != spec.structure:
            raise GeometryError(
                f"{who}: the SymmetrySpec was built for params of structure {spec.structure}, but params has structure "
                f"{jax.tree_util.tree_structure(params)}. A spec names leaves by their position; build it from these "
                "params, mg.symmetry_spec(params, ...)."
            )
        dtypes = [jnp.result_type(x) for x in jax.tree_util.tree_leaves(params)]
        built_for = jax.tree_util.tree_unflatten(
            spec.structure, [jax.ShapeDtypeStruct(s, d) for s, d in zip(spec.leaf_shapes, dtypes)]
        )
        try:
            check_same_structure(built_for, params, "params", "the params the SymmetrySpec was built for")
        except GeometryError as err:
            raise GeometryError(
                f"{who}: the SymmetrySpec does not fit params: {err} A spec names leaves by their position; build "
                "it from these params, mg.symmetry_spec(params, ...)."
            ) from None

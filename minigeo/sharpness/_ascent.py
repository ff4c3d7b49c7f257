r"""The ascent of :mod:`minigeo.sharpness`: Auto-PGD (Croce & Hein 2020) with antipodal restarts.

:class:`_AutoPGD` is the loop of Croce & Hein's Algorithm 1 as pure ``init``/``propose``/``update``
functions on a :class:`_AscentState` (normalized gradient steps with momentum, projection onto the
ball, step-size halving at the checkpoints of :func:`_checkpoints`); :func:`_antipodal_restarts`
repeats it from the antipode of the previous run's best point; :func:`_auto_pgd` runs both on one
batch over the parts of a :class:`~minigeo.sharpness._blocks._Geometry`, with its Riemannian
gradients (da Silva et al. 2025, App. C.2, Algorithm 1).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from .._tree import PyTree
from ._blocks import _sq_norm

#: Default maximum number of antipodal Auto-PGD restarts after the first run (``n_restarts`` of
#: :func:`adaptive_sharpness` and :func:`geodesic_sharpness`); the restarts stop early once two runs
#: in a row raised the best value by less than ``_RESTART_RTOL`` of the sharpness.
N_RESTARTS = 7
_RESTART_RTOL, _RESTART_PATIENCE = 1e-3, 2


def _checkpoints(n_iter: int) -> list[int]:
    """Auto-PGD checkpoints ceil(p_j * n_iter): p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)."""
    p = [0.0, 0.22]
    while p[-1] < 1.0:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return sorted({math.ceil(q * n_iter) for q in p if 0 < q <= 1.0})


def _norm(v: PyTree, dtype) -> jax.Array:
    """The Euclidean norm of a search direction (floored at the smallest normal, so that it divides safely)."""
    sq = _sq_norm(jax.tree_util.tree_leaves(v), dtype)
    return jnp.sqrt(jnp.maximum(sq, jnp.finfo(sq.dtype).tiny))


def _scale(c, v: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda p: c * p, v)


def _select(cond, a: PyTree, b: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x, y: jnp.where(cond, x, y), a, b)


class _AscentState(NamedTuple):
    """The loop state of :class:`_AutoPGD` (Croce & Hein 2020, Algorithm 1)."""

    k: jax.Array  #: iteration; 0 evaluates the start point only
    x: PyTree  #: current point
    x_prev: PyTree  #: previous point (momentum)
    f: jax.Array  #: value at x
    g: PyTree  #: (Riemannian) gradient at x
    eta: jax.Array  #: step size
    best_x: PyTree
    best_f: jax.Array
    best_g: PyTree
    succ: jax.Array  #: iterations that raised the value since the last checkpoint
    last_ck: jax.Array  #: the last checkpoint
    eta_ck: jax.Array  #: the step size at the last checkpoint
    best_ck: jax.Array  #: the best value at the last checkpoint
    finite: jax.Array  #: every value so far finite


class _AutoPGD(NamedTuple):
    r"""Auto-PGD maximization over the ball :math:`\lVert x\rVert_2 \le \rho` of a pytree ``x`` (Croce & Hein 2020).

    Normalized gradient steps :math:`z = \Pi(x + \eta g/\lVert g\rVert)`, momentum
    :math:`x' = \Pi(x + \alpha(z - x) + (1 - \alpha)(x - x_{\text{prev}}))` (:math:`\alpha = 1` at the
    first iteration), and at the checkpoints of :func:`_checkpoints` the step size halves and the
    search returns to its best point unless 75 % of the iterations since the last checkpoint raised
    the value (or neither step size nor best value changed since).  :math:`\Pi` is the projection
    onto the ball, a rescaling; with a Riemannian gradient in coordinates where the metric is
    Euclidean (see :class:`_Geometry`) this is the Riemannian Auto-PGD of da Silva et al. 2025,
    Algorithm 1.

    Pure functions in the style of optax: ``state = init(x0)``; then per iteration
    ``x = propose(state)``, evaluate ``f, g`` at ``x``, ``state = update(state, x, f, g)``.
    The first update only records the start (so the best value is never the initial ``-inf``).
    """

    rho: jax.Array  #: radius (its dtype is the search's)
    n_iter: int
    momentum: float = 0.75

    def project(self, v: PyTree) -> PyTree:
        return _scale(jnp.minimum(1.0, self.rho / _norm(v, self.rho.dtype)), v)

    def init(self, x0: PyTree, finite=True) -> _AscentState:
        none = jnp.asarray(-jnp.inf, self.rho.dtype)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, x0)
        eta0, zero = 2.0 * self.rho, jnp.zeros((), jnp.int32)
        return _AscentState(
            zero, x0, x0, none, zeros, eta0, x0, none, zeros, zero, zero, eta0, none, jnp.asarray(finite)
        )

    def propose(self, s: _AscentState) -> PyTree:
        """The next point to evaluate (the start itself at ``k = 0``)."""
        tmap, ftype = jax.tree_util.tree_map, self.rho.dtype
        step = jnp.where(s.k == 0, 0.0, s.eta) / _norm(s.g, ftype)
        z = self.project(tmap(lambda x, r: x + step * r, s.x, s.g))
        mom = jnp.where(s.k <= 1, 1.0, self.momentum).astype(ftype)  # the first iteration takes z itself
        return self.project(tmap(lambda x, zz, xp: x + mom * (zz - x) + (1 - mom) * (x - xp), s.x, z, s.x_prev))

    def update(self, s: _AscentState, x_new: PyTree, f_new: jax.Array, g_new: PyTree) -> _AscentState:
        """Record the value ``f_new`` and gradient ``g_new`` at ``x_new``; halve at a checkpoint."""
        start = s.k == 0
        # a non-finite gradient makes the next iterate, hence its value, non-finite: checking the
        # value suffices (no extra pass over every parameter's gradient per iteration)
        finite = s.finite & jnp.isfinite(f_new)
        succ = s.succ + ((f_new > s.f) & ~start).astype(jnp.int32)
        better = (f_new > s.best_f) | start
        best_x = _select(better, x_new, s.best_x)
        best_g = _select(better, g_new, s.best_g)
        best_f = jnp.where(better, f_new, s.best_f)
        at_ck = jnp.isin(s.k, jnp.asarray(_checkpoints(self.n_iter)))
        span = (s.k - s.last_ck).astype(self.rho.dtype)
        halve = at_ck & ((succ < 0.75 * span) | ((s.eta == s.eta_ck) & (best_f == s.best_ck)))
        return _AscentState(
            k=s.k + 1,
            x=_select(halve, best_x, x_new),
            x_prev=_select(halve, best_x, s.x),
            f=jnp.where(halve, best_f, f_new),
            g=_select(halve, best_g, g_new),
            eta=jnp.where(halve, s.eta / 2, s.eta),
            best_x=best_x,
            best_f=best_f,
            best_g=best_g,
            succ=jnp.where(at_ck, 0, succ),
            last_ck=jnp.where(at_ck, s.k, s.last_ck),
            eta_ck=jnp.where(at_ck, s.eta, s.eta_ck),
            best_ck=jnp.where(start, f_new, jnp.where(at_ck, best_f, s.best_ck)),
            finite=finite,
        )

    def run(self, value_and_grad: Callable, x0: PyTree, finite=True) -> tuple[PyTree, jax.Array, jax.Array]:
        """``n_iter`` iterations from ``x0`` (one ``lax`` loop, one evaluation per iteration plus the
        start's): the best point, its value, and whether every value was finite."""

        def body(_, s):
            x = self.propose(s)
            return self.update(s, x, *value_and_grad(x))

        s = jax.lax.fori_loop(0, self.n_iter + 1, body, self.init(x0, finite))
        return s.best_x, s.best_f, s.finite


def _antipodal_restarts(run: Callable, x0: PyTree, base: jax.Array, n_restarts: int, finite):
    """The best of up to ``n_restarts + 1`` runs, run 0 from ``x0`` and run r >= 1 from the antipode of
    run r - 1's best point; stop once ``_RESTART_PATIENCE`` runs in a row raised the best value by
    less than ``_RESTART_RTOL`` of ``best - base``, or at a non-finite value.

    ``run(x0, finite) -> (best_x, best_f, finite)``.  All runs are one ``lax.while_loop``, so a run is
    traced and compiled once whatever ``n_restarts``.  Returns the best point, value and finiteness.
    """

    def one_run(c):
        r, x_prev_run, x_best, f_best, fin, stall = c
        x_run, f_run, fin = run(_scale(-1.0, x_prev_run), fin)  # run 0: the antipode of the antipode of x0
        first = r == 0
        improved = first | (f_run > f_best + _RESTART_RTOL * jnp.abs(f_best - base))
        better = first | (f_run > f_best)
        return (
            r + 1,
            x_run,
            _select(better, x_run, x_best),
            jnp.where(better, f_run, f_best),
            fin,
            jnp.where(improved, 0, stall + 1),
        )

    def go_on(c):
        r, _, _, _, fin, stall = c
        return (r == 0) | ((r <= n_restarts) & (stall < _RESTART_PATIENCE) & fin)

    zero, none = jnp.zeros((), jnp.int32), jnp.asarray(-jnp.inf, base.dtype)
    _, _, best_x, best_f, finite, _ = jax.lax.while_loop(
        go_on, one_run, (zero, _scale(-1.0, x0), x0, none, finite, zero)
    )
    return best_x, best_f, finite


def _auto_pgd(
    loss_fn, geometry, params, fac, batch, rho, key, n_iter: int, momentum: float, keep: bool, n_restarts: int = 0
):
    """Auto-PGD on one batch from the base-point factorization ``fac``; returns (value, all finite, perturbation).

    The search runs on the list of per-block parts of ``geometry`` (pair sides, GL(1) rates, other
    leaves), in coordinates where the ball is Euclidean; keeping them apart (instead of one raveled
    vector) saves a copy of every parameter per iteration.  The geometry runs at "highest" matmul
    precision, the loss at the caller's.  One value-and-gradient per iteration, traced once.

    Run 0 is the single run of Croce & Hein from half the radius in the random direction of
    :meth:`_Geometry.start` (so ``n_restarts=0`` reproduces it exactly); then up to ``n_restarts``
    antipodal runs (:func:`_antipodal_restarts`).  Near a minimum the loss rises through its
    Hessian's quadratic form, which is even in the perturbation: the ascent's local maxima come in
    near-antipodal pairs whose values differ by the odd (third-order) terms, and a run ends near the
    member on its start's side.  The antipodal run tries the other member and, the quadratic part
    being even, also continues the previous run's convergence towards the top curvature direction
    with a fresh step size (each run halves its step as it stalls, which slows that convergence).
    """
    w, treedef = jax.tree_util.tree_flatten(params)
    base = loss_fn(params, batch)
    ascent = _AutoPGD(jnp.asarray(rho, base.dtype), n_iter, momentum)
    loss_at = jax.value_and_grad(
        lambda moved: loss_fn(jax.tree_util.tree_unflatten(treedef, geometry.assemble(w, moved)), batch)
    )

    def value_and_riemannian_grad(parts):
        moved, caches = geometry.perturb(w, fac, parts)
        f, grad = loss_at(moved)
        return f, geometry.riemannian(w, fac, parts, caches, moved, grad)

    v = geometry.start(key, w, fac)
    v0 = _scale(0.5 * ascent.rho / _norm(v, base.dtype), v)
    best_x, best_f, finite = _antipodal_restarts(
        lambda x0, fin: ascent.run(value_and_riemannian_grad, x0, fin), v0, base, n_restarts, jnp.isfinite(base)
    )
    perturbation = None
    if keep:
        delta = geometry.assemble(w, geometry.perturb(w, fac, best_x)[0])
        perturbation = jax.tree_util.tree_unflatten(treedef, [d - wi for d, wi in zip(delta, w)])
    return best_f - base, finite & jnp.isfinite(best_f), perturbation

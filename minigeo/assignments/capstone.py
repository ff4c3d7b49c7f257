"""Assignment 7 (chapter 7, the capstone): attention's GL(h) moves, sharpness along them, Kendall's tau."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import rankdata

from .. import models as mm
from ..models.vit import multi_head_attention, vit_move_along_symmetries
from ..sharpness import adaptive_sharpness, geodesic_sharpness
from ..stats import kendall_tau, kendall_tau_ci
from . import _kit
from ._kit import CheckReport, _close, _close_or_name, _Fail, _matches, _run, _key

_ATTN = ("W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o")

#: The tiny ViT of the sharpness check (and of the assignment notebook, which uses the same one so
#: that the check reuses the compiled search): 4 x 4 images in 2 x 2 patches, width 8, 2 heads of
#: dimension 4, one block.
TINY_VIT = mm.ViTConfig(
    image_size=4, patch_size=2, channels=1, num_classes=3, width=8, depth=1, heads=2, mlp_dim=16, gelu="tanh"
)


def _random_vit(key: jax.Array, config: mm.ViTConfig) -> dict:
    """ViT parameters in float64, every leaf random (no zero bias: b_q, b_k, b_v included; LayerNorm
    scales near 1), from one draw of a ``jax.random`` key (one compilation for every shape)."""
    shapes = jax.eval_shape(lambda: mm.init_vit(jax.random.PRNGKey(0), config, jnp.float32))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    sizes = [int(np.prod(leaf.shape)) for _, leaf in leaves]
    z = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float64))
    out, start = [], 0
    for (path, leaf), size in zip(leaves, sizes):
        x = 0.3 * z[start : start + size].reshape(leaf.shape)
        out.append(jnp.asarray(x + 1.0 if getattr(path[-1], "key", None) == "scale" else x, jnp.float64))
        start += size
    return jax.tree_util.tree_unflatten(tree, out)


def _group_elements(key: jax.Array, config: mm.ViTConfig, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Per-head A = I + scale N / sqrt(h) for the (q, k) and the (v, o) pairs (well conditioned at 1)."""
    h = config.head_dim
    N = np.asarray(jax.random.normal(key, (2 * config.depth * config.heads * h * h,), jnp.float64))
    A = np.eye(h) + scale * N.reshape(2, config.depth, config.heads, h, h) / np.sqrt(h)
    return jnp.asarray(A[0], jnp.float64), jnp.asarray(A[1], jnp.float64)


def _move(params: dict, A_qk: jax.Array, A_vo: jax.Array) -> dict:
    """The reference move (G, H) -> (G A^-1, H A^T) on both pairs of every head (chapter 7)."""
    return vit_move_along_symmetries(params, A_qk, A_vo)


def _diagnose_move(p: dict, got: dict, A_qk: jax.Array, A_vo: jax.Array) -> str | None:
    """The likely mistake of a move ``got`` that differs from the reference, or None if it does not."""
    inv, T = jnp.linalg.inv, lambda M: jnp.swapaxes(M, -1, -2)
    a, g, want = p["blocks"]["attn"], got["blocks"]["attn"], _move(p, A_qk, A_vo)["blocks"]["attn"]
    row = lambda b, M: jnp.einsum("lhe,lhef->lhf", b, M)  # b^T M, b a row
    if all(_matches(g[k], a[k]) for k in _ATTN):
        return "the attention weights did not change: apply the move to W_q, b_q, W_k, W_v, b_v and W_o."
    if _matches(g["W_q"], a["W_q"] @ T(A_qk)) and _matches(g["W_k"], a["W_k"] @ inv(A_qk)):
        return (
            "you moved by A^{-T} instead of A: G -> G A^{-1} on the query side, H -> H A^T on the key side "
            "(the logits cannot tell, the group element can)."
        )
    if _matches(g["W_q"], a["W_q"] @ A_vo) or _matches(g["W_v"], a["W_v"] @ inv(A_qk)):
        return "A_qk acts on the (query, key) pair and A_vo on the (value, output) pair: you swapped them."
    hints = {
        "W_q": [
            (a["W_q"] @ A_qk, "the query side moves by A^{-1}, not by A: G -> G A^{-1}."),
            (a["W_q"], "W_q did not move: the query side is G_qk = (W_q; b_q^T) -> G_qk A^{-1}."),
        ],
        "b_q": [
            (a["b_q"], "you forgot the query bias: b_q^T is the last row of G_qk, so b_q^T -> b_q^T A^{-1}."),
            (
                row(a["b_q"], T(inv(A_qk))),
                "b_q^T is a row of G_qk: b_q^T A^{-1} (you applied A^{-1} to the column b_q).",
            ),
        ],
        "W_k": [
            (a["W_k"] @ A_qk, "the key side moves by A^T, not by A (a missing transpose): H -> H A^T."),
            (a["W_k"] @ inv(A_qk), "the key side moves by A^T, not A^{-1}: H -> H A^T."),
        ],
        "W_v": [(a["W_v"] @ A_vo, "the value side moves by A^{-1}, not by A: G -> G A^{-1}.")],
        "b_v": [
            (a["b_v"], "you forgot the value bias: b_v^T is the last row of G_vo, so b_v^T -> b_v^T A^{-1}."),
            (
                row(a["b_v"], T(inv(A_vo))),
                "b_v^T is a row of G_vo: b_v^T A^{-1} (you applied A^{-1} to the column b_v).",
            ),
        ],
        "W_o": [
            (a["W_o"] @ A_vo, "W_o = H_vo moves by A^T, not by A (a missing transpose): W_o -> W_o A^T."),
            (
                a["W_o"] @ inv(A_vo),
                "W_o is the output side H_vo: it moves by A^T, not by A^{-1} like the value side.",
            ),
            (
                a["W_o"] @ T(inv(A_vo)),
                "W_o = H_vo moves by A^T, not by A^{-T}: the head's output is mixed W_o^T.",
            ),
            (a["W_o"], "W_o did not move: the output side is H_vo = W_o -> W_o A^T."),
        ],
    }
    for name in ("W_q", "b_q", "W_k", "W_v", "b_v", "W_o"):
        if _matches(g[name], want[name]):
            continue
        for candidate, hint in hints[name]:
            if _matches(g[name], candidate):
                return hint
        return f"{name} is not moved as (G, H) -> (G A^{{-1}}, H A^T) (G_qk = (W_q; b_q^T), H_qk = W_k, G_vo = (W_v; b_v^T), H_vo = W_o)."
    if not (_matches(g["b_k"], want["b_k"]) or _matches(g["b_k"], a["b_k"])):
        return "b_k: leave it as it is, or move it as the key side's last row, b_k -> A b_k."
    if not _matches(g["b_o"], a["b_o"]):
        return "b_o is added once, after the heads are summed: no head's A acts on it; leave it unchanged."
    others = lambda tree: jax.tree_util.tree_leaves_with_path(
        dict(tree, blocks=dict(tree["blocks"], attn=None))
    )
    if not all(_matches(x, y) for (_, x), (_, y) in zip(others(got), others(p))):
        return "only the attention weights move: leave the embeddings, LayerNorms, MLP and head unchanged."
    return None


def check_move_heads(
    fn: Callable[[dict, jax.Array, jax.Array], dict],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(params, A_qk, A_vo)``, the per-head GL(h) move of a ViT's attention, which leaves the logits unchanged.

    For head :math:`i` of a layer, with :math:`G_{qk} = \binom{W_q^i}{b_q^{i\top}}`, :math:`H_{qk} = W_k^i`,
    :math:`G_{vo} = \binom{W_v^i}{b_v^{i\top}}`, :math:`H_{vo} = W_o^i` and the group elements
    ``A_qk[l, i]``, ``A_vo[l, i]``,

    .. math:: (G, H) \mapsto (GA^{-1}, HA^\top)

    on both pairs; :math:`b_k` may stay or move as :math:`Ab_k` (the network does not depend on it),
    everything else stays.  The check moves a random float64 ViT (2 layers, 2 heads of dimension 4,
    every bias nonzero) by random :math:`A = I + N/\sqrt h`, asks for the same logits (to 1e-8) and
    compares every moved leaf with the group action.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(params, A_qk, A_vo)`` with ``params`` in
        :func:`minigeo.models.init_vit`'s layout and ``A_qk``, ``A_vo`` of shape
        ``(depth, heads, head_dim, head_dim)``; it returns the moved parameters (same layout).
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import assignments
    >>> assignments.check_move_heads(lambda params, A_qk, A_vo: params).passed
    FAIL move_heads: ...
    False

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Example A.1 and App. C.1. Assignment of chapter 7.
    """

    def body() -> str:
        config = TINY_VIT._replace(depth=2)
        key = _key(70)
        images = jax.random.normal(jax.random.fold_in(key, 2), (6, 4, 4, 1), jnp.float64)
        for trial in range(2):
            p = _random_vit(jax.random.fold_in(key, 10 + trial), config)
            A_qk, A_vo = _group_elements(jax.random.fold_in(key, 20 + trial), config)
            got = fn(p, A_qk, A_vo)
            try:
                same = jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(p) and all(
                    np.shape(x) == np.shape(y)
                    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(p))
                )
            except Exception:
                same = False
            if not same:
                raise _Fail(
                    "the moved parameters do not have the layout of params: return the whole dict, with the "
                    "moved attention leaves in place (e.g. dict(params, blocks=dict(params['blocks'], attn=a)))."
                )
            got = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), got)
            hint = _diagnose_move(p, got, A_qk, A_vo)
            z0, z1 = mm.vit_apply(p, images, config), mm.vit_apply(got, images, config)
            _close(z1, z0, "the logits after the move", hint or "The move must not change the function.")
            if hint:
                raise _Fail(
                    f"the logits are unchanged, but the move is not (G, H) -> (G A^-1, H A^T): {hint}"
                )
        return "(G, H) -> (G A^-1, H A^T) on every head's two pairs; the logits are unchanged to 1e-8."

    return _run("move_heads", body, time_limit)


def attention_model(params: dict, tokens: jax.Array) -> jax.Array:
    """Logits of the sharpness check's model: one attention block of the ViT, mean-pooled, a linear head.

    ``params = {"blocks": {"attn": ...}, "head": W}`` with the attention leaves of
    :func:`minigeo.models.init_vit` for one layer (leading axis 1) and ``W`` of shape (width, classes);
    ``tokens`` of shape (batch, tokens, width).  Its spec is ``mm.vit_symmetry_spec(params)``.
    """
    attn = jax.tree_util.tree_map(lambda x: x[0], params["blocks"]["attn"])
    return jnp.mean(multi_head_attention(tokens, attn), axis=1) @ params["head"]


def _tiny_problem():
    """The sharpness check's model (one attention block of the tiny ViT: compiles in seconds), its loss,
    2 batches of 8 sequences of 5 tokens, the search, a point moved along the orbit and one with b_k shifted."""
    key = _key(71)
    vit = _random_vit(key, TINY_VIT)
    p = {"blocks": {"attn": vit["blocks"]["attn"]}, "head": vit["head"]["kernel"]}
    kx, ky = jax.random.split(jax.random.fold_in(key, 1))
    batches = (
        jax.random.normal(kx, (2, 8, 5, TINY_VIT.width), jnp.float64),
        jax.random.randint(ky, (2, 8), 0, TINY_VIT.num_classes),
    )

    def loss_fn(params, batch):
        return mm.cross_entropy(attention_model(params, batch[0]), batch[1])

    search = dict(key=_key(72), n_iter=2, n_restarts=0)
    moved = _move(p, *_group_elements(jax.random.fold_in(key, 3), TINY_VIT, 3.0))
    attn = p["blocks"]["attn"]
    shift = jax.random.normal(jax.random.fold_in(key, 4), attn["b_k"].shape, jnp.float64)
    shifted = dict(p, blocks=dict(p["blocks"], attn=dict(attn, b_k=attn["b_k"] + shift)))
    return loss_fn, p, moved, shifted, batches, search


def _reference_pair(loss_fn, params, batches, rho, search) -> tuple[float, float]:
    spec = mm.vit_symmetry_spec(params)
    a = adaptive_sharpness(loss_fn, params, batches, rho, spec=spec, **search)
    g = geodesic_sharpness(loss_fn, params, batches, spec, rho, **search)
    return float(a.sharpness), float(g.sharpness)


def _pair(answer) -> tuple[float, float]:
    try:
        a, g = answer
        return float(np.asarray(a).reshape(())), float(np.asarray(g).reshape(()))
    except (TypeError, ValueError):
        raise _Fail(
            f"return two numbers (adaptive, geodesic), e.g. (a.sharpness, g.sharpness); got {type(answer).__name__}."
        ) from None


def check_sharpness_pair(
    fn: Callable,
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(loss_fn, params, batches, rho, search)`` = (adaptive, geodesic) sharpness of a ViT, and H1 on it.

    Both are worst-case values by Auto-PGD (``search`` holds ``key``, ``n_iter`` and ``n_restarts``),

    .. math::
        \begin{aligned}
        S_{\mathrm{ad}} &= \max_{\lVert\delta/|w|\rVert_2\le\rho} L(w + \delta) - L(w), \\
        S_{\mathrm{geo}} &= \max_{\xi\ \mathrm{horizontal},\ \lVert\xi\rVert_g\le\rho}
        L\big(w + \xi - \tfrac12\Gamma(\xi,\xi)\big) - L(w),
        \end{aligned}

    both with the ViT's spec ``mm.vit_symmetry_spec(params)`` (which holds the redundant key bias
    :math:`b_k` fixed), as in chapter 7.  On a random float64 model made of one attention block of
    the tiny ViT (``minigeo.assignments.capstone.attention_model``: 2 heads of dimension 4, every bias nonzero, a linear head;
    a whole ViT would take a minute to compile) the check compares ``fn`` with those calls at a point :math:`w` and at :math:`w` moved by per-head GL(h) elements, and asks
    that geodesic sharpness be the same at both (relative 1e-6) while adaptive sharpness changes,
    and that shifting :math:`b_k` (which changes no output) change neither.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(loss_fn, params, batches, rho, search)``; it returns
        ``(adaptive, geodesic)``, two scalars.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).
        The first call compiles two Auto-PGD searches (several seconds).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import minigeo as mg, minigeo.models as mm
    >>> from minigeo import assignments
    >>> def pair(loss_fn, params, batches, rho, search):
    ...     spec = mm.vit_symmetry_spec(params)
    ...     a = mg.adaptive_sharpness(loss_fn, params, batches, rho, spec=spec, **search)
    ...     g = mg.geodesic_sharpness(loss_fn, params, batches, spec, rho, **search)
    ...     return a.sharpness, g.sharpness
    >>> assignments.check_sharpness_pair(pair).passed  # doctest: +SKIP
    PASS sharpness_pair: ...
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eqs. (1)-(3), (6)-(8) and Sec. 4 (adaptive sharpness
    is not invariant under the symmetries). Assignment of chapter 7.
    """

    def body() -> str:
        rho = 0.1
        loss_fn, p, moved, shifted, batches, search = _tiny_problem()
        a0, g0 = _pair(fn(loss_fn, p, batches, rho, dict(search)))
        ra0, rg0 = _reference_pair(loss_fn, p, batches, rho, search)
        if _matches([a0, g0], [rg0, ra0]) and not _matches(ra0, rg0):
            raise _Fail("you swapped the two measures: return (adaptive, geodesic), in that order.")
        _close(
            a0,
            ra0,
            "adaptive sharpness",
            "Call mg.adaptive_sharpness(loss_fn, params, batches, rho, spec=spec, **search) with the ViT's "
            "spec = mm.vit_symmetry_spec(params), whose redundant leaf b_k is then held fixed; without a spec "
            "(or with the paper's Example A.1 spec, b_k on the key side) b_k takes part of the budget rho "
            "although the loss ignores it.",
        )
        a2, g2 = _pair(fn(loss_fn, shifted, batches, rho, dict(search)))
        if not abs(g2 - g0) <= 1e-6 * abs(g0):
            raise _Fail(
                f"geodesic sharpness changed from {g0:.6g} to {g2:.6g} when only b_k was shifted, which changes "
                "no output: b_k sits on the key side (the paper's Example A.1 spec). Use mm.vit_symmetry_spec, "
                "which marks b_k redundant."
            )
        _close(
            g0,
            rg0,
            "geodesic sharpness",
            "Call mg.geodesic_sharpness(loss_fn, params, batches, spec, rho, **search) with "
            "spec = mm.vit_symmetry_spec(params) and the default second_order=True (the geodesic, not the "
            "straight-line control).",
        )
        _close(a2, a0, "adaptive sharpness after shifting b_k", "b_k is redundant: pass the spec.")
        a1, g1 = _pair(fn(loss_fn, moved, batches, rho, dict(search)))
        ra1, rg1 = _reference_pair(loss_fn, moved, batches, rho, search)
        if not abs(g1 - g0) <= 1e-6 * abs(g0):
            raise _Fail(
                f"geodesic sharpness changed from {g0:.6g} to {g1:.6g} along the orbit: the same function must "
                "have the same geodesic sharpness."
            )
        _close(a1, ra1, "adaptive sharpness at the moved point", "Use the same call at every point.")
        if abs(ra1 - ra0) > 1e-3 * abs(ra0) and abs(a1 - a0) <= 1e-3 * abs(a0):
            raise _Fail(
                "adaptive sharpness did not change along the orbit: compute it at the point you are given."
            )
        return (
            f"adaptive {a0:.4g} -> {a1:.4g} along the orbit (x{a1 / a0:.3g}); geodesic {g0:.6g} -> {g1:.6g} "
            f"(relative change {abs(g1 - g0) / g0:.0e})."
        )

    return _run("sharpness_pair", body, time_limit)


def _tau_family(key: jax.Array, n: int, ties: bool) -> tuple[np.ndarray, np.ndarray]:
    """Paired measurements of n models, correlated (random sign and strength), with ties if asked."""
    k1, k2, k3 = jax.random.split(key, 3)
    x = np.asarray(jax.random.normal(k1, (n,), jnp.float64))
    c = float(jax.random.uniform(k3, (), jnp.float64, -1.5, 1.5))
    y = c * x + np.asarray(jax.random.normal(k2, (n,), jnp.float64))
    if ties:  # a few levels: many tied pairs in both lists
        x, y = np.round(2 * x) / 2, np.round(y)
    return x, y


def _tau_candidates(x: np.ndarray, y: np.ndarray) -> list[tuple[float, str]]:
    """Common wrong answers for Kendall's tau of (x, y), each with its hint: a diagnosis, not a verdict."""
    n = len(x)
    s = np.sign(x[:, None] - x[None, :]) * np.sign(y[:, None] - y[None, :])  # all i != j: each pair twice
    stable = lambda v: np.argsort(np.argsort(v, kind="stable"), kind="stable")  # ranks, ties broken by order
    spearman = "that is Spearman's rho (a correlation of ranks), not Kendall's tau"
    return [
        (
            float(np.corrcoef(x, y)[0, 1]),
            "that is Pearson's correlation of the values, not Kendall's tau of their order",
        ),
        (
            float(np.sum(s) / (n * (n - 1))),
            "you ignored ties: tau_b divides by sqrt(n_x n_y), the numbers of pairs untied in x and in y, "
            "not by the number of all pairs n(n-1)/2 (that is tau_a)",
        ),
        (float(np.corrcoef(stable(x), stable(y))[0, 1]), spearman),
        (float(np.corrcoef(rankdata(x), rankdata(y))[0, 1]), spearman),
        (float(np.sum(s) / 2), "divide the sum over pairs by the number of pairs (tau_b: by sqrt(n_x n_y))"),
        (float(np.sum(s) / (2 * n * (n - 1))), "sum over pairs i < j once (or over all i != j and halve)"),
    ]


def check_kendall_tau(
    fn: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(x, y)`` = Kendall's :math:`\tau_b`, as :func:`minigeo.stats.kendall_tau`, on families with ties.

    .. math::
        \tau_b = \frac{\sum_{i<j}\operatorname{sgn}(x_i - x_j)\operatorname{sgn}(y_i - y_j)}
        {\sqrt{\sum_{i<j}\operatorname{sgn}(x_i - x_j)^2\,\sum_{i<j}\operatorname{sgn}(y_i - y_j)^2}}.

    Compared with :func:`minigeo.stats.kendall_tau` (``scipy.stats.kendalltau``) on random families of 12 to 40
    models, with and without ties, and required to depend on the order alone: unchanged under
    increasing maps of either list, negated when one list is reversed.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(x, y)`` with two 1-D arrays of the same length; it returns a scalar.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> import numpy as np
    >>> from minigeo import assignments
    >>> assignments.check_kendall_tau(lambda x, y: np.corrcoef(x, y)[0, 1]).passed
    FAIL kendall_tau: ...
    False

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5 (Kendall's tau). Assignment of chapter 7.
    """

    def body() -> str:
        key = _key(73)
        cases = [(n, ties) for n in (12, 25, 40) for ties in (True, False)]
        for i, (n, ties) in enumerate(cases):
            x, y = _tau_family(jax.random.fold_in(key, i), n, ties)
            want = kendall_tau(x, y)
            got = fn(jnp.asarray(x), jnp.asarray(y))
            what = f"tau of {n} models{' with ties' if ties else ''}"
            try:
                _close(got, want, what, "")
            except _Fail as fail:
                hint = next((h for c, h in _tau_candidates(x, y) if _matches(got, c, 1e-6)), None)
                raise _Fail(
                    f"{fail}{hint or 'Kendall tau_b: the sum of sgn(x_i - x_j) sgn(y_i - y_j) over pairs, over sqrt(n_x n_y)'}."
                ) from None
            _close(
                fn(jnp.asarray(np.exp(x)), jnp.asarray(y + y**3)),
                want,
                f"tau after increasing maps of x and y ({n} models)",
                "Kendall's tau depends on the order alone: use signs of differences, not the values.",
            )
            _close(fn(jnp.asarray(-x), jnp.asarray(y)), -want, "tau(-x, y)", "tau(-x, y) = -tau(x, y).")
        return "tau_b matches scipy on 6 families (ties included) and depends on the order alone."

    return _run("kendall_tau", body, time_limit)


def _interval(answer, what: str) -> tuple[float, float]:
    try:
        lo, hi = answer
        return float(np.asarray(lo).reshape(())), float(np.asarray(hi).reshape(()))
    except (TypeError, ValueError):
        raise _Fail(f"{what}: return two numbers (low, high); got {type(answer).__name__}.") from None


def check_kendall_tau_bootstrap(
    fn: Callable,
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(x, y, key, n_resamples, confidence)`` = the percentile-bootstrap interval of Kendall's :math:`\tau_b`.

    Resample the :math:`n` models with replacement (index vectors :math:`I^{(b)}`, drawn with ``key``),
    compute :math:`\tau_b^{(b)} = \tau_b(x_{I^{(b)}}, y_{I^{(b)}})` on each resample (the same indices for
    both lists: a model is a pair), and return the :math:`(1-c)/2` and :math:`(1+c)/2` quantiles.  The
    check compares the interval with :func:`minigeo.stats.kendall_tau_ci` (5,000 resamples; to 0.06, the
    Monte-Carlo error of 2,000 resamples being about 0.01) on families with ties, at two levels, and
    asks that it contain :math:`\tau_b`, be reproducible given the key, and narrow when every one of
    20 models is observed three times (the same :math:`\tau_b` distribution from 60 models: width
    about :math:`1/\sqrt3` of the 20 models'; two different families of 20 and 60 models would not
    always differ that way, and failed a correct answer on about 1 instance in 20).

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(x, y, key, n_resamples, confidence)``; it returns ``(low, high)``.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> from minigeo import assignments
    >>> assignments.check_kendall_tau_bootstrap(lambda x, y, key, n, c: (-1.0, 1.0)).passed
    FAIL kendall_tau_bootstrap: ...
    False

    References
    ----------
    No formula from the source papers (da Silva, Dangel & Oore 2025, Table 1, report Kendall's tau
    without intervals; chapter 7's within-pair intervals). Assignment of chapter 7.
    """

    def body() -> str:
        key = _key(74)
        widths, first = {}, None
        for i, (n, c, confidence) in enumerate([(20, 1.0, 0.95), (20, -0.8, 0.8), (60, 1.0, 0.95)]):
            k1, k2, k3 = jax.random.split(jax.random.fold_in(key, i), 3)
            x = np.round(2 * np.asarray(jax.random.normal(k1, (n,), jnp.float64))) / 2
            y = np.round(c * x + 0.7 * np.asarray(jax.random.normal(k2, (n,), jnp.float64)), 1)
            tau = kendall_tau(x, y)
            ref = kendall_tau_ci(x, y, confidence=confidence, n_resamples=5000, seed=i)
            what = f"the {100 * confidence:g} % interval of {n} models"
            lo, hi = _interval(fn(jnp.asarray(x), jnp.asarray(y), k3, 2000, confidence), what)
            again = _interval(fn(jnp.asarray(x), jnp.asarray(y), k3, 2000, confidence), what)
            if again != (lo, hi):
                raise _Fail(
                    f"{what} changed between two calls with the same key: draw every resample from `key`."
                )
            got, want = f"[{lo:+.3f}, {hi:+.3f}]", f"[{ref.ci_low:+.3f}, {ref.ci_high:+.3f}]"
            if max(abs(lo - ref.ci_low), abs(hi - ref.ci_high)) > 0.06:
                if abs(hi - lo) < 1e-9:
                    hint = "the interval has width 0: resample with replacement (a permutation of the models has the same tau)."
                elif lo <= 0.0 <= hi and abs(tau) > 0.4 and (ref.ci_low > 0 or ref.ci_high < 0):
                    hint = (
                        "your resampled taus sit around 0: resample models, i.e. the pairs (x_i, y_i) with the same "
                        "indices for x and y; resampling the two lists independently destroys the association."
                    )
                else:
                    hint = (
                        f"take the {(1 - confidence) / 2:g} and {(1 + confidence) / 2:g} quantiles of the resampled "
                        "tau_b (the level is the argument `confidence`), resampling the n models with replacement."
                    )
                raise _Fail(f"{what} is {got}, expected about {want} (tau = {tau:+.3f}): {hint}")
            if not lo <= tau <= hi:
                raise _Fail(f"{what} {got} does not contain tau = {tau:+.3f}.")
            if first is None:
                first, widths[20] = (x, y, k3), hi - lo
        # the same 20 models, each observed three times: the resampled tau_b spread shrinks by about
        # sqrt(3) (a deterministic comparison up to Monte-Carlo error, unlike two different families)
        x, y, k3 = first
        lo, hi = _interval(fn(jnp.tile(x, 3), jnp.tile(y, 3), k3, 2000, 0.95), "the 95 % interval of 60 models")
        widths[60] = hi - lo
        if not widths[60] < 0.85 * widths[20]:
            raise _Fail(
                f"the interval does not narrow with more models: width {widths[20]:.3f} for 20 models, "
                f"{widths[60]:.3f} for the same 20 observed three times (expected about {widths[20] / 3 ** 0.5:.3f}): "
                "resample n = len(x) models, not a fixed number."
            )
        return (
            f"matches minigeo's bootstrap within Monte-Carlo error at two levels; contains tau; width "
            f"{widths[20]:.2f} with 20 models, {widths[60]:.2f} with the same 20 observed three times."
        )

    return _run("kendall_tau_bootstrap", body, time_limit)


def _expected_distinct_exact(n: int) -> float:
    """E[#distinct of n draws with replacement from n], by counting: S(n, k) k! C(n, k) sequences have
    exactly k distinct values (S the Stirling numbers of the second kind), exact in integers."""
    from fractions import Fraction
    from math import comb, factorial

    S = [[0] * (n + 1) for _ in range(n + 1)]
    S[0][0] = 1
    for i in range(1, n + 1):
        for k in range(1, i + 1):
            S[i][k] = k * S[i - 1][k] + S[i - 1][k - 1]
    total = sum(k * S[n][k] * factorial(k) * comb(n, k) for k in range(1, n + 1))
    return float(Fraction(total, n**n))


def check_bootstrap_distinct(
    fn: Callable[[int], float],
    *,
    time_limit: float | None = None,
) -> CheckReport:
    r"""Check ``fn(n)`` = the expected number of distinct models in one bootstrap resample of :math:`n` models.

    A prediction the chapter does not print: a resample draws :math:`n` indices uniformly with
    replacement from :math:`\{0,\dots,n-1\}`; the models drawn twice or more give the resample tied
    pairs.  The check's truth counts the resamples with exactly :math:`k` distinct models (Stirling
    numbers of the second kind, in exact integer arithmetic) for the chapter's 16 models and other
    :math:`n` of its seed.

    Parameters
    ----------
    fn : callable
        The student's answer, called as ``fn(n)`` with an integer; it returns a number.
    time_limit : float, optional
        Seconds before the check fails with "timed out"; default ``minigeo.assignments.TIME_LIMIT`` (120).

    Returns
    -------
    CheckReport
        Whether it passed and the one line printed (``PASS``, or ``FAIL`` with a hint); an
        exception raised by ``fn`` is reported there instead of propagating.

    Examples
    --------
    >>> from minigeo import assignments
    >>> assignments.check_bootstrap_distinct(lambda n: n).passed
    FAIL bootstrap_distinct: ...
    False

    References
    ----------
    No formula from the source papers (a count about chapter 7's bootstrap over models; Efron &
    Tibshirani 1993 for the bootstrap). Assignment of chapter 7.
    """

    def body() -> str:
        rng = np.random.default_rng(71 if _kit._GRADING_SEED is None else [71, _kit._GRADING_SEED])
        ns = [16, 2, 5, *(int(k) for k in rng.integers(3, 40, size=3))]
        for n in ns:
            truth = _expected_distinct_exact(n)
            got = fn(n)
            mistakes = [
                (float(n), "a resample has n draws, but not n distinct models: some are drawn twice or more."),
                (n * (1.0 - np.exp(-1.0)), "n (1 - 1/e) is the limit for large n; at finite n the chance that a "
                 "given model is never drawn is (1 - 1/n)^n."),
                (n * (1.0 - 1.0 / n) ** n, "that is the expected number of models left out of the resample."),
                (n / 2.0, "not half: the chance that a given model is drawn at least once is 1 - (1 - 1/n)^n."),
            ]
            _close_or_name(
                got,
                truth,
                f"the expected number of distinct models for n = {n}",
                "Sum over the models the probability that each is drawn at least once.",
                mistakes,
            )
        return "the expected number of distinct models in a resample is right."

    return _run("bootstrap_distinct", body, time_limit)

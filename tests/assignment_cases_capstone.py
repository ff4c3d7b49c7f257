"""Correct and wrong answers for assignment 7 (chapter 7, the capstone).

Gathered by tests/test_assignments.py:
{check name: (a correct answer, [(a wrong answer, words of its hint)])}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import minigeo as mg
import minigeo.models as mm

inv, T = jnp.linalg.inv, lambda M: jnp.swapaxes(M, -1, -2)


# ---------------------------------------------------------------- task 1: the per-head GL(h) move


def _row(b, M):  # b^T M for a stack of row vectors b (layers, heads, h)
    return jnp.einsum("lhe,lhef->lhf", b, M)


def _move(params, A_qk, A_vo, **change):
    a = dict(params["blocks"]["attn"])
    new = {
        "W_q": a["W_q"] @ inv(A_qk),
        "b_q": _row(a["b_q"], inv(A_qk)),
        "W_k": a["W_k"] @ T(A_qk),
        "b_k": _row(a["b_k"], T(A_qk)),  # A b_k: the key side's last row (any b_k gives the same logits)
        "W_v": a["W_v"] @ inv(A_vo),
        "b_v": _row(a["b_v"], inv(A_vo)),
        "W_o": a["W_o"] @ T(A_vo),
    }
    for name, f in change.items():  # a mistake: leaf name -> its wrong value from (a, A_qk, A_vo)
        new[name] = f(a, A_qk, A_vo)
    a.update(new)
    return dict(params, blocks=dict(params["blocks"], attn=a))


def _move_bk_fixed(params, A_qk, A_vo):  # also right: the function does not depend on b_k
    return _move(params, A_qk, A_vo, b_k=lambda a, A, B: a["b_k"])


def _wrong(**change):
    return lambda params, A_qk, A_vo: _move(params, A_qk, A_vo, **change)


# ---------------------------------------------------------------- task 2: both sharpness values


def _pair(loss_fn, params, batches, rho, search):
    spec = mm.vit_symmetry_spec(params)
    a = mg.adaptive_sharpness(loss_fn, params, batches, rho, spec=spec, **search)
    g = mg.geodesic_sharpness(loss_fn, params, batches, spec, rho, **search)
    return a.sharpness, g.sharpness


def _pair_no_spec(loss_fn, params, batches, rho, search):  # b_k perturbed by adaptive sharpness
    spec = mm.vit_symmetry_spec(params)
    a = mg.adaptive_sharpness(loss_fn, params, batches, rho, **search)
    g = mg.geodesic_sharpness(loss_fn, params, batches, spec, rho, **search)
    return a.sharpness, g.sharpness


def _pair_paper_spec(loss_fn, params, batches, rho, search):  # Example A.1: b_k on the key side
    at = lambda name: ("blocks", "attn", name)
    paper = mg.symmetry_spec(
        params,
        [
            (mg.with_bias(at("W_q"), at("b_q")), mg.with_bias(at("W_k"), at("b_k"))),
            (mg.with_bias(at("W_v"), at("b_v")), at("W_o")),
        ],
    )
    a = mg.adaptive_sharpness(loss_fn, params, batches, rho, spec=paper, **search)
    g = mg.geodesic_sharpness(loss_fn, params, batches, paper, rho, **search)
    return a.sharpness, g.sharpness


def _pair_swapped(loss_fn, params, batches, rho, search):
    a, g = _pair(loss_fn, params, batches, rho, search)
    return g, a


def _pair_straight_line(loss_fn, params, batches, rho, search):  # the control without the Christoffel term
    spec = mm.vit_symmetry_spec(params)
    a = mg.adaptive_sharpness(loss_fn, params, batches, rho, spec=spec, **search)
    g = mg.geodesic_sharpness(loss_fn, params, batches, spec, rho, second_order=False, **search)
    return a.sharpness, g.sharpness


# ---------------------------------------------------------------- task 3: Kendall's tau_b


def _pair_signs(x, y):
    sx = jnp.sign(x[:, None] - x[None, :])
    sy = jnp.sign(y[:, None] - y[None, :])
    return sx, sy


def _tau_b(x, y):
    sx, sy = _pair_signs(x, y)
    return jnp.sum(sx * sy) / jnp.sqrt(jnp.sum(sx**2) * jnp.sum(sy**2))


def _tau_a(x, y):  # ties ignored: divides by all pairs
    sx, sy = _pair_signs(x, y)
    n = x.shape[0]
    return jnp.sum(sx * sy) / (n * (n - 1))


def _pearson(x, y):
    return jnp.corrcoef(x, y)[0, 1]


def _spearman(x, y):
    rank = lambda v: jnp.argsort(jnp.argsort(v)).astype(float)
    return jnp.corrcoef(rank(x), rank(y))[0, 1]


# ---------------------------------------------------------------- task 4: the bootstrap interval


def _bootstrap(x, y, key, n_resamples, confidence):
    n = x.shape[0]
    idx = jax.random.randint(key, (n_resamples, n), 0, n)
    taus = jax.vmap(lambda i: _tau_b(x[i], y[i]))(idx)
    q = jnp.array([(1 - confidence) / 2, (1 + confidence) / 2])
    lo, hi = jnp.nanquantile(taus, q)
    return lo, hi


def _bootstrap_independent(x, y, key, n_resamples, confidence):  # the pairs broken
    n = x.shape[0]
    k1, k2 = jax.random.split(key)
    i, j = (jax.random.randint(k, (n_resamples, n), 0, n) for k in (k1, k2))
    taus = jax.vmap(lambda a, b: _tau_b(x[a], y[b]))(i, j)
    return tuple(jnp.nanquantile(taus, jnp.array([(1 - confidence) / 2, (1 + confidence) / 2])))


def _bootstrap_permutations(x, y, key, n_resamples, confidence):  # without replacement
    n = x.shape[0]
    idx = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, n_resamples))
    taus = jax.vmap(lambda i: _tau_b(x[i], y[i]))(idx)
    return tuple(jnp.nanquantile(taus, jnp.array([(1 - confidence) / 2, (1 + confidence) / 2])))


def _bootstrap_fixed_level(x, y, key, n_resamples, confidence):  # the argument `confidence` ignored
    return _bootstrap(x, y, key, n_resamples, 0.95)


def _bootstrap_random_key(x, y, key, n_resamples, confidence):  # a new key every call: not reproducible
    import numpy as np

    return _bootstrap(x, y, jax.random.PRNGKey(np.random.randint(1 << 30)), n_resamples, confidence)


CASES = {
    "check_move_heads": (
        _move,
        [
            (_wrong(W_q=lambda a, A, B: a["W_q"] @ A), "query side moves by A^{-1}, not by A"),
            (_wrong(b_q=lambda a, A, B: a["b_q"]), "forgot the query bias"),
            (_wrong(b_v=lambda a, A, B: a["b_v"]), "forgot the value bias"),
            (_wrong(b_q=lambda a, A, B: _row(a["b_q"], T(inv(A)))), "applied A^{-1} to the column b_q"),
            (_wrong(W_k=lambda a, A, B: a["W_k"] @ A), "a missing transpose"),
            (_wrong(W_o=lambda a, A, B: a["W_o"] @ B), "W_o = H_vo moves by A^T, not by A"),
            (_wrong(W_o=lambda a, A, B: a["W_o"] @ inv(B)), "not by A^{-1} like the value side"),
            (_wrong(W_o=lambda a, A, B: a["W_o"] @ T(inv(B))), "not by A^{-T}"),
            (
                _wrong(
                    W_q=lambda a, A, B: a["W_q"] @ T(A),
                    b_q=lambda a, A, B: _row(a["b_q"], T(A)),
                    W_k=lambda a, A, B: a["W_k"] @ inv(A),
                    W_v=lambda a, A, B: a["W_v"] @ T(B),
                    b_v=lambda a, A, B: _row(a["b_v"], T(B)),
                    W_o=lambda a, A, B: a["W_o"] @ inv(B),
                ),
                "you moved by A^{-T} instead of A",
            ),
            (lambda params, A_qk, A_vo: _move(params, A_vo, A_qk), "you swapped them"),
            (lambda params, A_qk, A_vo: params, "did not change"),
            (lambda params, A_qk, A_vo: params["blocks"]["attn"], "layout of params"),
        ],
    ),
    "check_sharpness_pair": (
        _pair,
        [
            (_pair_no_spec, "spec=spec"),
            (_pair_paper_spec, "Example A.1"),
            (_pair_swapped, "swapped the two measures"),
            (_pair_straight_line, "second_order=True"),
        ],
    ),
    "check_kendall_tau": (
        _tau_b,
        [
            (_pearson, "Pearson"),
            (_tau_a, "you ignored ties"),
            (_spearman, "Spearman"),
        ],
    ),
    "check_kendall_tau_bootstrap": (
        _bootstrap,
        [
            (_bootstrap_independent, "resample models, i.e. the pairs"),
            (_bootstrap_permutations, "with replacement"),
            (_bootstrap_fixed_level, "the argument `confidence`"),
            (_bootstrap_random_key, "same key"),
        ],
    ),
    # issue 54: predict, then compute
    "check_bootstrap_distinct": (
        lambda n: n * (1 - (1 - 1 / n) ** n),
        [
            (lambda n: n, "not n distinct models"),  # "a resample of the n models" read literally
            (lambda n: n * (1 - np.exp(-1.0)), "limit for large n"),
            (lambda n: n * (1 - 1 / n) ** n, "left out of the resample"),
            (lambda n: n / 2, "not half"),
        ],
    ),
}

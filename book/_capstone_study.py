"""The study of chapter 7 (the capstone) as functions, so that a test can rerun it with other seeds.

The chapter imports this file (it sits next to the notebook); ``tests/test_capstone_study.py``
reruns the same code with a second seed set at a small size. Nothing here is part of minigeo's
API: it is the chapter's experiment, written once.

* :func:`make_study` builds the data split, the model, pre-training, the fine-tuning of a family
  (``jax.vmap`` over a hyperparameter grid) and the three sharpness measurements of a family.
* :func:`group_elements` draws GL(h) moves with a *controlled* condition number,
  :func:`move_along_symmetries` applies them, :func:`h1_verdict` applies H1's rule, counting a
  refused measurement (status != 0) instead of stopping.
* :func:`seed_interval`, :func:`verdict` and :func:`coverage`: the interval over pre-training
  seeds, the rule, and the interval's coverage by simulation.
* :func:`reliability_ceiling`: the largest Kendall tau a perfect predictor can reach against a
  gap measured on a finite test set.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from scipy import stats as sps
from sklearn.datasets import load_digits

import minigeo as mg
import minigeo.models as mm

GRID = {
    "learning_rate": [3e-3, 1e-2],
    "steps": [60, 150],
    "weight_decay": [0.0, 0.5],
    "augment": [0.0, 0.3],  # standard deviation of Gaussian input noise
}
CONFIG = mm.ViTConfig(
    image_size=8, patch_size=4, channels=1, num_classes=10, width=32, depth=2, heads=4,
    mlp_dim=64, gelu="tanh",
)
MATRICES = {"W_q", "W_k", "W_v", "W_o", "kernel"}  # weight decay acts on these leaves only


def freeze_bk(grads):
    """b_k is redundant: its float32 gradient is round-off, which Adam would amplify."""
    attn = dict(grads["blocks"]["attn"], b_k=jnp.zeros_like(grads["blocks"]["attn"]["b_k"]))
    return dict(grads, blocks=dict(grads["blocks"], attn=attn))


def flat_norm(tree):
    return jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(tree)))


def make_study(
    *, config=CONFIG, grid=GRID, pretrain_steps=300, batch=32, sharp_n=512, sharp_b=64,
    n_iter=4, search_key=1,
):
    """Everything the chapter computes per seed, as closures over the data and the design."""
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    order = np.random.default_rng(0).permutation(len(X))
    n_pre, n_ft = 597, 600
    split = lambda a, b: (jnp.asarray(X[order[a:b]]), jnp.asarray(y[order[a:b]]))
    (X_pre, y_pre), (X_ft, y_ft), (X_test, y_test) = (
        split(0, n_pre), split(n_pre, n_pre + n_ft), split(n_pre + n_ft, len(X))
    )
    loss_fn = lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], config), b[1])
    apply_fn = lambda p, x: mm.vit_apply(p, x, config)
    template = jax.eval_shape(lambda: mm.init_vit(jax.random.PRNGKey(0), config))
    decay_mask = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in MATRICES, template)
    optimizer = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=1e-3, weight_decay=0.0, mask=decay_mask
    )
    combos = list(itertools.product(*grid.values()))
    M, max_steps = len(combos), max(grid["steps"])
    hp = {
        k: jnp.asarray([c[j] for c in combos], jnp.int32 if k == "steps" else jnp.float32)
        for j, k in enumerate(grid)
    }
    sharp_batches = (
        X_ft[:sharp_n].reshape(-1, sharp_b, 8, 8, 1), y_ft[:sharp_n].reshape(-1, sharp_b)
    )

    @jax.jit
    def pretrain(key):
        params = mm.init_vit(key, config)
        state = optimizer.init(params)
        state.hyperparams["learning_rate"] = jnp.asarray(2e-3)

        def step(carry, k):
            params, state = carry
            idx = jax.random.randint(k, (64,), 0, n_pre)
            grads = freeze_bk(jax.grad(loss_fn)(params, (X_pre[idx], y_pre[idx])))
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        keys = jax.random.split(key, pretrain_steps)
        (params, _), _ = jax.lax.scan(step, (params, state), keys)
        return params

    def fine_tune(w_pre, key, h):
        """One model. `key`: the family seed (shared by the grid); `h`: traced scalars."""
        k_head, k_run = jax.random.split(key)
        params = dict(w_pre, head=mm.init_vit(k_head, config)["head"])  # a new head
        state = optimizer.init(params)
        state.hyperparams["learning_rate"] = h["learning_rate"]
        state.hyperparams["weight_decay"] = h["weight_decay"]

        def step(carry, args):
            params, state = carry
            t, k = args
            k_idx, k_noise = jax.random.split(k)
            idx = jax.random.randint(k_idx, (batch,), 0, n_ft)
            x = X_ft[idx] + h["augment"] * jax.random.normal(k_noise, (batch, 8, 8, 1))
            grads = freeze_bk(jax.grad(loss_fn)(params, (x, y_ft[idx])))
            updates, new_state = optimizer.update(grads, state, params)
            keep = t < h["steps"]  # training length: no update after the model's last step
            sel = lambda new, old: jax.tree_util.tree_map(
                lambda a, b: jnp.where(keep, a, b), new, old
            )
            return (sel(optax.apply_updates(params, updates), params), sel(new_state, state)), None

        start = params
        steps = (jnp.arange(max_steps), jax.random.split(k_run, max_steps))
        (params, _), _ = jax.lax.scan(step, (params, state), steps)
        return params, start

    def evaluate(params, start):
        wrong = lambda X_, y_: (jnp.argmax(apply_fn(params, X_), -1) != y_).astype(jnp.float32)
        test_wrong, train_err = wrong(X_test, y_test), jnp.mean(wrong(X_ft, y_ft))
        test_err = jnp.mean(test_wrong)
        half = len(y_test) // 2
        grads = jax.lax.map(lambda b: freeze_bk(jax.grad(loss_fn)(params, b)), sharp_batches)
        dual = jax.vmap(  # ||w ⊙ ∇L_b|| per batch, averaged as sharpness averages its batches
            lambda g: flat_norm(jax.tree_util.tree_map(lambda w, gi: jnp.abs(w) * gi, params, g))
        )(grads)
        return {
            "train_err": train_err,
            "test_err": test_err,
            "gap": test_err - train_err,  # the reference paper's generalization gap
            "gap_a": jnp.mean(test_wrong[:half]) - train_err,  # the gap on each half of the
            "gap_b": jnp.mean(test_wrong[half:]) - train_err,  # test set (reliability)
            "gap_se": jnp.sqrt(
                test_err * (1 - test_err) / len(y_test) + train_err * (1 - train_err) / n_ft
            ),
            "train_loss": loss_fn(params, (X_ft, y_ft)),
            "dist": flat_norm(jax.tree_util.tree_map(jnp.subtract, params, start)),
            "norm": flat_norm(params),
            "dual": jnp.mean(dual),
            "bk_moved": jnp.max(
                jnp.abs(params["blocks"]["attn"]["b_k"] - start["blocks"]["attn"]["b_k"])
            ),
        }

    train_family = jax.jit(jax.vmap(fine_tune, in_axes=(None, None, 0)))
    evaluate_family = jax.jit(jax.vmap(evaluate))
    spec = mm.vit_symmetry_spec(template)
    search = dict(key=jax.random.PRNGKey(search_key), n_iter=n_iter, n_restarts=0)

    def three(p, rho):
        """Adaptive, geodesic and straight-line (no Christoffel term) sharpness of one model."""
        a = mg.adaptive_sharpness(loss_fn, p, sharp_batches, rho, spec=spec, **search)
        g = mg.geodesic_sharpness(loss_fn, p, sharp_batches, spec, rho, **search)
        s = mg.geodesic_sharpness(
            loss_fn, p, sharp_batches, spec, rho, second_order=False, **search
        )
        status = jnp.stack([a.status, g.status, s.status])
        return a.sharpness, g.sharpness, s.sharpness, status

    measure_family = jax.jit(jax.vmap(three, in_axes=(0, None)))

    def measure(fam, rho):
        """The three values per model; a refused search (status != 0) gives NaN, not a stop."""
        a, g, s, status = (np.asarray(v) for v in measure_family(fam, rho))
        out = {"adaptive": a, "geodesic": g, "straight": s}
        for j, k in enumerate(out):
            out[k] = np.where(status[:, j] == 0, out[k], np.nan)
        out["status"] = status.max(axis=1)
        return out

    def family(w_pre, family_seed):
        fam, start = train_family(w_pre, jax.random.PRNGKey(100 + family_seed), hp)
        return fam, {k: np.asarray(v) for k, v in evaluate_family(fam, start).items()}

    def moved_family(fam, r, cond, layernorm=True):
        """Every model moved by its own random group elements in float64, rounded to float32:
        attention moves of condition number ``cond`` (a number, or one per model) and, if
        ``layernorm``, LayerNorm rescalings by factors drawn uniformly from [0.3, 3]."""
        L, Hh, dh, d = config.depth, config.heads, config.head_dim, config.width
        draw = lambda: jnp.asarray(group_elements(r, (M, L, Hh, dh, dh), cond))
        with jax.enable_x64(True):
            f64 = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), fam)
            u = lambda shape: r.uniform(0.3, 3.0, shape) if layernorm else np.ones(shape)
            ln = (jnp.asarray(u((M, L, d))), jnp.asarray(u((M, d))))
            out = jax.vmap(move_along_symmetries)(f64, draw(), draw(), *ln)
            return jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), out)

    logits = jax.jit(jax.vmap(lambda p: apply_fn(p, X_test)))
    return SimpleNamespace(**{k: v for k, v in locals().items() if not k.startswith("_")})


def move_along_symmetries(params, A_qk, A_vo, d_ln2, d_final):
    """The same function: per-head GL(h) moves of both pairs, GL(1) moves of two LayerNorms."""
    return mm.vit_move_along_symmetries(params, A_qk, A_vo, ln2_scale=d_ln2, final_scale=d_final)


def group_elements(r, shape, cond):
    """Random A = U diag(s) V^T, U and V Haar-orthogonal, s geometrically spaced from 1 to
    1/cond: cond(A) = cond exactly (cond = 1: an orthogonal move)."""
    U, V = (np.linalg.qr(r.normal(size=shape))[0] for _ in range(2))
    c = np.reshape(np.asarray(cond, float), np.shape(cond) + (1,) * (len(shape) - 2 - np.ndim(cond)))
    s = c[..., None] ** -np.linspace(0.0, 1.0, shape[-1])  # one cond per leading index allowed
    return (U * s[..., None, :]) @ np.swapaxes(V, -1, -2)


def h1_verdict(orb, status, factor=2.0, tol=0.01):
    """H1's rule on the models whose every search was accepted (status 0).

    ``orb[k]``: (points, models) values of measure k; ``status``: (points, models). Returns the
    verdict, the number of refused models and the per-model spreads (largest / smallest)."""
    ok = np.all(np.asarray(status) == 0, axis=0)
    spread = {k: v[:, ok].max(0) / v[:, ok].min(0) for k, v in orb.items()}
    if ok.sum() < max(1, len(ok) // 2):  # more than half refused: the rule cannot be applied
        return "not established (searches refused)", int((~ok).sum()), spread
    good = spread["geodesic"].max() < 1 + tol and np.median(spread["adaptive"]) > factor
    return ("supported" if good else "not supported"), int((~ok).sum()), spread


def seed_interval(per_cluster, pre_seeds, level=0.95):
    """Mean over pre-training seeds of the mean over their family seeds, and a t interval with
    (pre-training seeds - 1) degrees of freedom: each pre-trained model is one independent unit."""
    v = np.asarray(per_cluster, float)
    pre = np.asarray(pre_seeds)
    means = np.array([np.nanmean(v[pre == p]) for p in np.unique(pre)])
    n = len(means)
    m = float(means.mean())
    half = sps.t.ppf((1 + level) / 2, n - 1) * means.std(ddof=1) / np.sqrt(n)
    return m, m - half, m + half


def verdict(per_cluster, pre_seeds):
    """The rule: supported if the interval over pre-training seeds excludes 0."""
    m, lo, hi = seed_interval(per_cluster, pre_seeds)
    if lo > 0 or hi < 0:
        return "supported, " + ("negative (the paper's sign)" if m < 0 else "positive")
    return "not established"


def two_level_bootstrap(v, rng, n=2000, level=0.95):
    """Percentile interval of the mean of v (pre-training seeds x family seeds): resample the
    pre-training seeds, then the family seeds within each."""
    P, F = v.shape
    i, j = rng.integers(0, P, (n, P)), rng.integers(0, F, (n, P, F))
    return np.quantile(v[i[:, :, None], j].mean(axis=(1, 2)), [(1 - level) / 2, (1 + level) / 2])


def variance_components(per_cluster, pre_seeds):
    """(between pre-training seeds, within) standard deviations of the per-cluster tau's."""
    v, pre = np.asarray(per_cluster, float), np.asarray(pre_seeds)
    groups = [v[pre == p] for p in np.unique(pre)]
    F = len(groups[0])
    s_within = np.sqrt(np.mean([g.var(ddof=1) for g in groups]))
    s_between = np.sqrt(max(np.var([g.mean() for g in groups], ddof=1) - s_within**2 / F, 0.0))
    return float(s_between), float(s_within)


def coverage(P, F, s_between, s_within, n=2000, seed=0):
    """Simulated coverage of the t interval and of the two-level bootstrap at the design P x F,
    under the nested normal model tau_pf = a_p + e_pf with the given standard deviations."""
    rng = np.random.default_rng(seed)
    hit_t = hit_b = 0
    pre = np.repeat(np.arange(P), F)
    for _ in range(n):
        v = s_between * rng.normal(size=(P, 1)) + s_within * rng.normal(size=(P, F))
        _, lo, hi = seed_interval(v.ravel(), pre)
        hit_t += lo <= 0 <= hi
        lo, hi = two_level_bootstrap(v, rng, n=400)
        hit_b += lo <= 0 <= hi
    return hit_t / n, hit_b / n


def reliability_ceiling(tau_half):
    """The largest |tau| a perfect predictor reaches against a gap whose two test-set halves
    rank the models with Kendall tau ``tau_half``: tau -> Pearson r by Greiner's relation
    r = sin(pi tau / 2), Spearman-Brown to the full test set, the square root of the reliability,
    and back to tau."""
    r_half = np.sin(np.pi * tau_half / 2)
    r_full = 2 * r_half / (1 + r_half)
    return float(2 / np.pi * np.arcsin(np.sqrt(max(r_full, 0.0))))

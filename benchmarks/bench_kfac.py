#!/usr/bin/env python
"""KFAC in minigeo against curvlinops' KFAC, side by side in one process (issue 52).

On the MLP 784-256-256-10 (tanh, batch 256, float32, type-2 factors of the mean cross-entropy) with
the same weights and data in JAX and torch, prints the median time of

* building the factors: ``mg.kfac(...)`` (eager, second call: compiled once) against
  ``KFACLinearOperator(...).compute_kronecker_factors()``;
* a product: ``jax.jit(M.mv)`` against ``op @ v``;
* a damped solve :math:`(A\\otimes B + \\lambda I)^{-1} v`, :math:`\\lambda = 10^{-3}`: ``jax.jit`` of
  ``M.with_damping(lam).solve`` (through the eigendecompositions of the factors, computed once when
  the metric is built) against ``KFACInverseLinearOperator(op, damping=lam, use_exact_damping=True)
  @ v`` (which caches its eigendecompositions after the first call);

with the ratio minigeo / curvlinops and the relative difference of the results; then the same three
rows for a token model (a transformer block's MLP without attention: two dense layers shared by 16
tokens of width 64, 64-256-64, mean pooling, a head to 10 classes; batch 64), with
``weight_sharing="expand"`` against ``kfac_approx="expand"``.  The tiny ViT of ``_harness.py`` is not
run: its per-head attention weights (three axes) and LayerNorms are not dense layers, its blocks run
in a ``lax.scan``, and ``mg.kfac`` refuses it (the script prints the message).

Peers: ``pip install -r requirements-parity.txt -r benchmarks/requirements-peers.txt``.

Usage: ``python benchmarks/bench_kfac.py [--repeats 20]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import describe_machine, median_time, mlp, n_params, tiny_vit_heads  # noqa: E402

import minigeo as mg  # noqa: E402

LAMBDA = 1e-3


def torch_median(fn, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    try:
        import torch
        from curvlinops import KFACInverseLinearOperator, KFACLinearOperator
    except ImportError as err:  # pragma: no cover
        print(f"needs torch and curvlinops ({err}): pip install -r requirements-parity.txt -r benchmarks/requirements-peers.txt")
        return 1
    torch.set_num_threads(2)
    print(describe_machine(), f"| torch {torch.__version__} (2 threads)")

    key = jax.random.PRNGKey(0)
    params, model, labels = mlp(key)
    X = jax.random.normal(jax.random.split(key, 5)[-2], (256, 784))  # the inputs _harness.mlp closes over
    assert np.allclose(np.asarray(model(params)), np.asarray(_forward(params, X)), atol=1e-5)
    print(f"\nMLP 784-256-256-10, batch 256: {n_params(params):,} parameters, float32, type-2 factors")

    # torch twin with the same weights
    layers = []
    for i, layer in enumerate(params):
        lin = torch.nn.Linear(*layer["W"].shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(layer["W"]).T.copy()))
            lin.bias.copy_(torch.from_numpy(np.asarray(layer["b"]).copy()))
        layers += [lin] + ([torch.nn.Tanh()] if i < len(params) - 1 else [])
    net = torch.nn.Sequential(*layers)
    data = [(torch.from_numpy(np.array(X)), torch.from_numpy(np.array(labels)).long())]
    loss = torch.nn.CrossEntropyLoss(reduction="mean")

    def build_torch():
        op = KFACLinearOperator(net, loss, list(net.parameters()), data, fisher_type="type-2",
                                separate_weight_and_bias=False, check_deterministic=False)
        op.compute_kronecker_factors()
        return op

    def build_jax():
        return jax.block_until_ready(mg.kfac(model, "categorical", params).with_damping(0.0))

    build_jax()
    t_build_j = median_time(lambda: mg.kronecker.kfac_factors(model, "categorical", params)[-1].B, repeats=max(3, args.repeats // 4))
    t_build_t = torch_median(build_torch, max(3, args.repeats // 4))
    op = build_torch()
    inv = KFACInverseLinearOperator(op, damping=LAMBDA, use_exact_damping=True)

    M = mg.kfac(model, "categorical", params)
    Md = M.with_damping(LAMBDA)
    r = np.random.default_rng(0)
    v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), jnp.float32), params)
    v_t = torch.cat([torch.from_numpy(np.asarray(a).copy()).ravel() for a in _torch_order(v)])

    mv = jax.jit(M.mv)
    solve = jax.jit(lambda p, u: Md.solve(p, u))
    t_mv_j = median_time(mv, params, v, repeats=args.repeats)
    t_mv_t = torch_median(lambda: op @ v_t, args.repeats)
    t_sv_j = median_time(solve, params, v, repeats=args.repeats)
    t_sv_t = torch_median(lambda: inv @ v_t, args.repeats)

    def rel(ours, theirs):
        a = np.concatenate([x.ravel() for x in _torch_order(ours)])
        b = theirs.detach().numpy().ravel()
        return np.abs(a - b).max() / np.abs(b).max()

    e_mv = rel(mv(params, v), op @ v_t)
    e_sv = rel(solve(params, v), inv @ v_t)
    print(f"  {'':28s} {'minigeo ms':>11s} {'curvlinops ms':>14s} {'ratio':>7s} {'rel. diff':>10s}")
    print(f"  {'build the factors':28s} {1e3 * t_build_j:11.2f} {1e3 * t_build_t:14.2f} {t_build_j / t_build_t:7.2f} {'':>10s}")
    print(f"  {'product (A x B) v':28s} {1e3 * t_mv_j:11.2f} {1e3 * t_mv_t:14.2f} {t_mv_j / t_mv_t:7.2f} {e_mv:10.1e}")
    print(f"  {'solve (A x B + lam I)^-1 v':28s} {1e3 * t_sv_j:11.2f} {1e3 * t_sv_t:14.2f} {t_sv_j / t_sv_t:7.2f} {e_sv:10.1e}")

    _token_rows(key, torch, KFACLinearOperator, KFACInverseLinearOperator, args.repeats)

    vit_params, logits_fn, _, (patches, _), _ = tiny_vit_heads(key)
    try:
        mg.kfac(logits_fn, "categorical", vit_params, batch=(patches, None))
        print("\ntiny ViT: handled (unexpected)")
    except mg.GeometryError as err:
        print(f"\ntiny ViT: not run; mg.kfac refuses it: {str(err)[:160]}...")
    return 0


def _token_rows(key, torch, KFACLinearOperator, KFACInverseLinearOperator, repeats):
    """The three rows for dense layers shared by tokens (KFAC-expand on both sides)."""
    N, T, D, H, C = 64, 16, 64, 256, 10
    ks = jax.random.split(jax.random.fold_in(key, 7), 5)
    params = {
        "fc1": {"W": jax.random.normal(ks[0], (D, H)) / np.sqrt(D), "b": jnp.zeros(H)},
        "fc2": {"W": jax.random.normal(ks[1], (H, D)) / np.sqrt(H), "b": jnp.zeros(D)},
        "head": {"W": jax.random.normal(ks[2], (D, C)) / np.sqrt(D), "b": jnp.zeros(C)},
    }
    X = jax.random.normal(ks[3], (N, T, D))
    labels = jax.random.randint(ks[4], (N,), 0, C)

    def model(p, x):
        h = jnp.tanh(x @ p["fc1"]["W"] + p["fc1"]["b"])
        h = x + h @ p["fc2"]["W"] + p["fc2"]["b"]
        return jnp.mean(h, axis=1) @ p["head"]["W"] + p["head"]["b"]

    names = ("fc1", "fc2", "head")
    lins = {}
    for name in names:
        lin = torch.nn.Linear(*params[name]["W"].shape)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(params[name]["W"]).T.copy()))
            lin.bias.copy_(torch.from_numpy(np.asarray(params[name]["b"]).copy()))
        lins[name] = lin

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.head = (lins[n] for n in names)

        def forward(self, x):
            return self.head((x + self.fc2(torch.tanh(self.fc1(x)))).mean(dim=1))

    net = Net()
    data = [(torch.from_numpy(np.array(X)), torch.from_numpy(np.array(labels)).long())]
    loss = torch.nn.CrossEntropyLoss(reduction="mean")
    order = lambda t: [a for n in names for a in (np.asarray(t[n]["W"]).T, np.asarray(t[n]["b"]))]

    def build_torch():
        op = KFACLinearOperator(net, loss, list(net.parameters()), data, fisher_type="type-2", kfac_approx="expand",
                                separate_weight_and_bias=False, check_deterministic=False)
        op.compute_kronecker_factors()
        return op

    batch = (X, None)
    mg.kronecker.kfac_factors(model, "categorical", params, batch=batch)
    t_build_j = median_time(lambda: mg.kronecker.kfac_factors(model, "categorical", params, batch=batch)[-1].B,
                            repeats=max(3, repeats // 4))
    t_build_t = torch_median(build_torch, max(3, repeats // 4))
    op = build_torch()
    inv = KFACInverseLinearOperator(op, damping=LAMBDA, use_exact_damping=True)
    M = mg.kfac(model, "categorical", params, batch=batch)
    Md = M.with_damping(LAMBDA)
    r = np.random.default_rng(1)
    v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), jnp.float32), params)
    v_t = torch.cat([torch.from_numpy(a.copy()).ravel() for a in order(v)])
    mv = jax.jit(M.mv)
    solve = jax.jit(lambda p, u: Md.solve(p, u))
    t_mv_j, t_mv_t = median_time(mv, params, v, repeats=repeats), torch_median(lambda: op @ v_t, repeats)
    t_sv_j, t_sv_t = median_time(solve, params, v, repeats=repeats), torch_median(lambda: inv @ v_t, repeats)

    def rel(ours, theirs):
        a = np.concatenate([x.ravel() for x in order(ours)])
        b = theirs.detach().numpy().ravel()
        return np.abs(a - b).max() / np.abs(b).max()

    print(f"\ntoken model 64-256-64 on {T} tokens, mean pooling, head to {C}; batch {N}: {n_params(params):,} parameters, "
          "KFAC-expand")
    print(f"  {'':28s} {'minigeo ms':>11s} {'curvlinops ms':>14s} {'ratio':>7s} {'rel. diff':>10s}")
    print(f"  {'build the factors':28s} {1e3 * t_build_j:11.2f} {1e3 * t_build_t:14.2f} {t_build_j / t_build_t:7.2f} {'':>10s}")
    print(f"  {'product (A x B) v':28s} {1e3 * t_mv_j:11.2f} {1e3 * t_mv_t:14.2f} {t_mv_j / t_mv_t:7.2f} "
          f"{rel(mv(params, v), op @ v_t):10.1e}")
    print(f"  {'solve (A x B + lam I)^-1 v':28s} {1e3 * t_sv_j:11.2f} {1e3 * t_sv_t:14.2f} {t_sv_j / t_sv_t:7.2f} "
          f"{rel(solve(params, v), inv @ v_t):10.1e}")


def _forward(p, X):
    h = X
    for layer in p[:-1]:
        h = jnp.tanh(h @ layer["W"] + layer["b"])
    return h @ p[-1]["W"] + p[-1]["b"]


def _torch_order(tree):
    out = []
    for t in tree:
        out += [np.asarray(t["W"]).T, np.asarray(t["b"])]
    return out


if __name__ == "__main__":
    sys.exit(main())

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
``weight_sharing="expand"`` against ``kfac_approx="expand"``; then the same rows for minigeo's
own ViT (``minigeo.models.vit``: 8x8 single-channel images, patch 2, width 64, 4 heads, 2 blocks run
by a ``lax.scan``, MLP 128, 10 classes; batch 128): its 14 dense layers (patch embedding, per-head
query/key/value and output projections, MLP, head; weights and biases), the layer norms, class
token and position embedding held fixed on both sides, against a torch twin of ``nn.Linear``
layers with the same weights (curvlinops is given only the dense parameters).

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

from _harness import describe_machine, median_time, mlp, n_params  # noqa: E402

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


def side_by_side(title, torch, ops, model, params, batch, net, data, order, repeats, seed=0):
    """Time building the factors, a product and a damped solve in minigeo (``model``, ``params``) and in
    curvlinops (``net`` on ``data``, its parameters in the order of ``order(tree)``, a list of arrays in
    torch's layout); print the three rows with the ratio and the relative difference of the results."""
    KFACLinearOperator, KFACInverseLinearOperator = ops
    loss = torch.nn.CrossEntropyLoss(reduction="mean")
    trainable = [q for q in net.parameters() if q.requires_grad]

    def build_torch():
        op = KFACLinearOperator(net, loss, trainable, data, fisher_type="type-2", kfac_approx="expand",
                                separate_weight_and_bias=False, check_deterministic=False)
        op.compute_kronecker_factors()
        return op

    mg.kronecker.kfac_factors(model, "categorical", params, batch=batch)  # compile once
    t_build_j = median_time(lambda: mg.kronecker.kfac_factors(model, "categorical", params, batch=batch)[-1].B,
                            repeats=max(3, repeats // 4))
    t_build_t = torch_median(build_torch, max(3, repeats // 4))
    op = build_torch()
    inv = KFACInverseLinearOperator(op, damping=LAMBDA, use_exact_damping=True)
    M = mg.kfac(model, "categorical", params, batch=batch)
    Md = M.with_damping(LAMBDA)
    r = np.random.default_rng(seed)
    v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), jnp.float32), params)
    v_t = torch.cat([torch.from_numpy(np.ascontiguousarray(a)).ravel() for a in order(v)])
    mv = jax.jit(M.mv)
    solve = jax.jit(lambda p, u: Md.solve(p, u))
    t_mv_j, t_mv_t = median_time(mv, params, v, repeats=repeats), torch_median(lambda: op @ v_t, repeats)
    t_sv_j, t_sv_t = median_time(solve, params, v, repeats=repeats), torch_median(lambda: inv @ v_t, repeats)

    def rel(ours, theirs):
        a = np.concatenate([np.ravel(x) for x in order(ours)])
        b = theirs.detach().numpy().ravel()
        return np.abs(a - b).max() / np.abs(b).max()

    print(f"\n{title}: {n_params(params):,} parameters in dense layers, float32, type-2 factors, KFAC-expand")
    print(f"  {'':28s} {'minigeo ms':>11s} {'curvlinops ms':>14s} {'ratio':>7s} {'rel. diff':>10s}")
    print(f"  {'build the factors':28s} {1e3 * t_build_j:11.2f} {1e3 * t_build_t:14.2f} {t_build_j / t_build_t:7.2f} {'':>10s}")
    print(f"  {'product (A x B) v':28s} {1e3 * t_mv_j:11.2f} {1e3 * t_mv_t:14.2f} {t_mv_j / t_mv_t:7.2f} "
          f"{rel(mv(params, v), op @ v_t):10.1e}")
    print(f"  {'solve (A x B + lam I)^-1 v':28s} {1e3 * t_sv_j:11.2f} {1e3 * t_sv_t:14.2f} {t_sv_j / t_sv_t:7.2f} "
          f"{rel(solve(params, v), inv @ v_t):10.1e}")


def linear(torch, W, b):
    """``torch.nn.Linear`` holding ``x @ W + b`` (``W`` of shape (in, out))."""
    lin = torch.nn.Linear(*W.shape)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(np.asarray(W).T.copy()))
        lin.bias.copy_(torch.from_numpy(np.asarray(b).copy()))
    return lin


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
    ops = (KFACLinearOperator, KFACInverseLinearOperator)

    key = jax.random.PRNGKey(0)
    params, model, labels = mlp(key)
    X = jax.random.normal(jax.random.split(key, 5)[-2], (256, 784))  # the inputs _harness.mlp closes over
    assert np.allclose(np.asarray(model(params)), np.asarray(_forward(params, X)), atol=1e-5)
    layers = []
    for i, layer in enumerate(params):
        layers += [linear(torch, layer["W"], layer["b"])] + ([torch.nn.Tanh()] if i < len(params) - 1 else [])
    data = [(torch.from_numpy(np.array(X)), torch.from_numpy(np.array(labels)).long())]
    side_by_side("MLP 784-256-256-10, batch 256", torch, ops, lambda p, _: model(p), params, (X, None),
                 torch.nn.Sequential(*layers), data, _torch_order, args.repeats)
    _token_rows(key, torch, ops, args.repeats)
    _vit_rows(key, torch, ops, args.repeats)
    return 0


def _token_rows(key, torch, ops, repeats):
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
    lins = {n: linear(torch, params[n]["W"], params[n]["b"]) for n in names}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.head = (lins[n] for n in names)

        def forward(self, x):
            return self.head((x + self.fc2(torch.tanh(self.fc1(x)))).mean(dim=1))

    data = [(torch.from_numpy(np.array(X)), torch.from_numpy(np.array(labels)).long())]
    order = lambda t: [a for n in names for a in (np.asarray(t[n]["W"]).T, np.asarray(t[n]["b"]))]
    side_by_side(f"token model 64-256-64 on {T} tokens, mean pooling, head to {C}; batch {N}", torch, ops,
                 model, params, (X, None), Net(), data, order, repeats, seed=1)


def _vit_layer_mats(d, depth):
    """The ViT's dense layers as (in, out) matrices and biases, in the model's order (per-head W_q (h, d, e)
    as the (d, h*e) matrix, W_o (h, d, e) contracting h and e as the (h*e, d) one): torch's nn.Linear."""
    out = [(d[("patch_embed", "kernel")], d[("patch_embed", "bias")])]
    for l in range(depth):
        for w in "qkv":
            W = np.asarray(d[("blocks", "attn", f"W_{w}")][l])
            out.append((W.transpose(1, 0, 2).reshape(W.shape[1], -1), np.asarray(d[("blocks", "attn", f"b_{w}")][l]).ravel()))
        Wo = np.asarray(d[("blocks", "attn", "W_o")][l])
        out.append((Wo.transpose(0, 2, 1).reshape(-1, Wo.shape[1]), d[("blocks", "attn", "b_o")][l]))
        for fc in ("fc1", "fc2"):
            out.append((d[("blocks", "mlp", fc, "kernel")][l], d[("blocks", "mlp", fc, "bias")][l]))
    out.append((d[("head", "kernel")], d[("head", "bias")]))
    return [(np.asarray(W), np.asarray(b)) for W, b in out]


def _vit_rows(key, torch, ops, repeats):
    """The three rows for minigeo's ViT (scan over blocks, per-head weights), the non-dense parameters fixed."""
    from minigeo.models import vit

    cfg = vit.ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, width=64, depth=2, heads=4, mlp_dim=128)
    full = vit.init_vit(jax.random.fold_in(key, 11), cfg)
    dense, merge = vit.vit_dense_params(full)
    every = {tuple(k.key for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(full)[0]}
    model = lambda d, x: vit.vit_apply(merge(d), x, cfg)
    ks = jax.random.split(jax.random.fold_in(key, 12), 2)
    X = jax.random.normal(ks[0], (128, 8, 8, 1))
    labels = jax.random.randint(ks[1], (128,), 0, 10)
    lins = [linear(torch, W, b) for W, b in _vit_layer_mats(dense, cfg.depth)]
    fixed = {p: torch.from_numpy(np.asarray(x).copy()) for p, x in every.items() if p not in dense}
    h, e = cfg.heads, cfg.head_dim

    def ln(z, name, l):
        scale, bias = fixed[name + ("scale",)], fixed[name + ("bias",)]
        if l is not None:
            scale, bias = scale[l], bias[l]
        return torch.nn.functional.layer_norm(z, (cfg.width,), scale, bias, cfg.ln_eps)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = torch.nn.ModuleList(lins)

        def forward(self, x):
            it = iter(self.lins)
            z = next(it)(x)
            n = z.shape[0]
            z = torch.cat([fixed[("cls_token",)].expand(n, 1, cfg.width), z], 1) + fixed[("pos_embed",)]
            for l in range(cfg.depth):
                y = ln(z, ("blocks", "ln1"), l)
                q, k, v = (next(it)(y).reshape(n, -1, h, e).transpose(1, 2) for _ in range(3))
                a = torch.softmax(q @ k.transpose(-1, -2) / e ** 0.5, dim=-1)
                z = z + next(it)((a @ v).transpose(1, 2).reshape(n, -1, h * e))
                y = torch.nn.functional.gelu(next(it)(ln(z, ("blocks", "ln2"), l)))
                z = z + next(it)(y)
            return next(it)(ln(z[:, 0], ("ln_final",), None))

    net = Net()
    patches = np.asarray(vit.patchify(X, cfg.patch_size))
    with torch.no_grad():
        diff = np.abs(net(torch.from_numpy(patches)).numpy() - np.asarray(model(dense, X))).max()
    assert diff < 1e-4, f"the torch twin differs from minigeo's ViT by {diff}"
    data = [(torch.from_numpy(patches), torch.from_numpy(np.array(labels)).long())]
    order = lambda t: [a for W, b in _vit_layer_mats(t, cfg.depth) for a in (W.T, b)]
    side_by_side("minigeo's ViT (8x8 images, patch 2, width 64, 4 heads, 2 blocks under lax.scan, MLP 128); "
                 "batch 128, layer norms and embeddings fixed", torch, ops, model, dense, (X, None), net, data,
                 order, repeats, seed=2)


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

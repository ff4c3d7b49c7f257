#!/usr/bin/env python
"""Cost of matrix-free metric products relative to one gradient, measured in one run.

For an MLP 784-256-256-10 (batch 256) and a small transformer block (batch 128,
17 tokens, width 64, 4 heads), prints the median time of

* the gradient of the mean cross-entropy (the reference),
* a GGN-vector product  (jvp -> output Hessian product -> vjp),
* an exact Fisher-vector product, and an empirical-Fisher-vector product,

and their ratios to the gradient.  Target on CPU: GGN / gradient <= 3.

Usage: ``python benchmarks/bench_metric_products.py [--repeats 20]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import cross_entropy, describe_machine, median_time, mlp, n_params, transformer_block  # noqa: E402

import minigeo as mg  # noqa: E402

TARGET = 3.0


def bench(name, params, model, labels, repeats):
    loss = cross_entropy(labels)
    grad = jax.jit(jax.grad(lambda p: loss(model(p))))
    v = jax.tree_util.tree_map(lambda x: 0.01 * x + 0.001, params)
    products = {
        "GGN": mg.ggn(model, loss),
        "Fisher": mg.fisher(model, "categorical"),
        "empirical Fisher": mg.empirical_fisher(model, lambda z: mg.categorical_likelihood().nll(z, labels)),
    }
    t_grad = median_time(grad, params, repeats=repeats)
    print(f"\n{name}: {n_params(params):,} parameters")
    print(f"  {'gradient':18s} {1e3 * t_grad:8.2f} ms   1.00x")
    ratios = {}
    for label, metric in products.items():
        t = median_time(jax.jit(metric.mv), params, v, repeats=repeats)
        ratios[label] = t / t_grad
        print(f"  {label + ' product':18s} {1e3 * t:8.2f} ms   {t / t_grad:.2f}x")
    return ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(describe_machine())
    key = jax.random.PRNGKey(0)
    worst = 0.0
    for name, (params, model, labels) in {
        "MLP 784-256-256-10, batch 256": mlp(key),
        "transformer block (width 64, 4 heads, 17 tokens), batch 128": transformer_block(key),
    }.items():
        worst = max(worst, bench(name, params, model, labels, args.repeats)["GGN"])
    verdict = "within" if worst <= TARGET else "ABOVE"
    print(f"\nworst GGN-vector product / gradient = {worst:.2f} ({verdict} the target {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

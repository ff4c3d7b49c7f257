#!/usr/bin/env python
"""Cost of Hessian-vector products and Hutchinson probes, measured in one run.

Prints, for an MLP 784-256-256-10 (batch 256) and a tiny vision transformer
(8x8 inputs, patch 2, width 64, 4 heads, 2 layers; batch 128):

* HVP time / gradient time          (targets: <= 2.5 for the MLP, <= 3.5 for the ViT)
* 10-probe Hutchinson trace / 1 HVP, probes batched with vmap and with lax.map  (target: <= 8)

XLA's CPU timings differ from process to process (see ../shared/CONVENTIONS.md), so
the script runs ``--processes`` fresh processes (default 3), each measuring its
ratios within one run, and reports every process and the median ratio.

Usage: ``python benchmarks/bench_curvature.py [--repeats 20] [--processes 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (  # noqa: E402
    cross_entropy,
    describe_machine,
    median_time,
    mlp,
    n_params,
    run_in_processes,  # noqa: E402
    tiny_vit_heads,
)

import minigeo as mg  # noqa: E402

TARGETS = {"MLP": 2.5, "ViT": 3.5}
PROBE_TARGET = 8.0


def bench(name, params, model, labels, repeats):
    loss_fn = cross_entropy(labels)
    loss = lambda p: loss_fn(model(p))
    v = jax.tree_util.tree_map(lambda x: 0.01 * x + 0.001, params)
    grad = jax.jit(jax.grad(loss))
    hvp = jax.jit(lambda p, v: mg.hvp(loss, p, v))
    key = jax.random.PRNGKey(0)
    trace_vmap = jax.jit(lambda p: mg.trace_estimate(loss, p, key, num_probes=10, batched="vmap"))
    trace_map = jax.jit(lambda p: mg.trace_estimate(loss, p, key, num_probes=10, batched="map"))
    t_grad = median_time(grad, params, repeats=repeats)
    t_hvp = median_time(hvp, params, v, repeats=repeats)
    t_vmap = median_time(trace_vmap, params, repeats=max(3, repeats // 4))
    t_map = median_time(trace_map, params, repeats=max(3, repeats // 4))
    print(f"\n{name}: {n_params(params):,} parameters")
    print(f"  gradient                 {1e3 * t_grad:8.2f} ms")
    print(f"  HVP                      {1e3 * t_hvp:8.2f} ms   {t_hvp / t_grad:.2f}x gradient")
    print(f"  10 probes (vmap)         {1e3 * t_vmap:8.2f} ms   {t_vmap / t_hvp:.2f}x HVP")
    print(f"  10 probes (lax.map)      {1e3 * t_map:8.2f} ms   {t_map / t_hvp:.2f}x HVP")
    return t_hvp / t_grad, min(t_vmap, t_map) / t_hvp


def vit_model(key):
    params, logits_fn, _, (patches, labels), _ = tiny_vit_heads(key)
    return params, lambda p: logits_fn(p, patches), labels


def measure(repeats: int) -> dict:
    print(describe_machine())
    key = jax.random.PRNGKey(0)
    return {
        "MLP": bench("MLP 784-256-256-10, batch 256", *mlp(key), repeats),
        "ViT": bench(
            "tiny ViT (8x8, patch 2, width 64, 4 heads, 2 layers), batch 128", *vit_model(key), repeats
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.repeats)))
        return 0
    runs = run_in_processes(__file__, ["--repeats", str(args.repeats)], args.processes)
    print("\n=== median over processes (each ratio measured within one process)")
    for name in ("MLP", "ViT"):
        ratios = [r[name][0] for r in runs]
        probes = [r[name][1] for r in runs]
        print(
            f"{name}: HVP/gradient {statistics.median(ratios):.2f} (runs {', '.join(f'{x:.2f}' for x in ratios)}; "
            f"target <= {TARGETS[name]}), 10 probes/HVP {statistics.median(probes):.2f} "
            f"(runs {', '.join(f'{x:.2f}' for x in probes)}; target <= {PROBE_TARGET})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Geodesic vs adaptive sharpness: time per Auto-PGD iteration on a tiny vision transformer, in one run.

The tiny ViT (8x8 inputs, patch 2, width 64, 4 heads of 16, 2 layers; batch 128) has per-head attention
weights, so every (W_Q, W_K) and (W_V, W_O) pair is a GL(16) pair of the symmetry spec.  Each measure
runs Auto-PGD with N and 2N iterations after compilation; the difference divided by N is the time per
iteration (initialization and the final evaluation cancel).  Median over ``--processes`` processes.
Target on CPU: geodesic / adaptive <= 1.3.

Usage: ``python benchmarks/bench_sharpness.py [--iters 20] [--processes 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (  # noqa: E402
    describe_machine,
    n_params,
    per_iteration,
    run_in_processes,  # noqa: E402
    tiny_vit_heads,
)

import minigeo as mg  # noqa: E402

TARGET = 1.3


def measure(iters: int) -> dict:
    params, _, loss, data, pairs = tiny_vit_heads(jax.random.PRNGKey(0))
    batches = jax.tree_util.tree_map(lambda x: x[None], data)
    spec = mg.symmetry_spec(params, pairs, eps=1e-6)
    key = jax.random.PRNGKey(1)
    t_ada = per_iteration(
        lambda n: mg.adaptive_sharpness(loss, params, batches, 0.1, key=key, n_iter=n, n_restarts=0).sharpness, iters
    )
    t_geo = per_iteration(
        lambda n: mg.geodesic_sharpness(loss, params, batches, spec, 0.1, key=key, n_iter=n, n_restarts=0).sharpness, iters
    )
    grad = jax.jit(jax.grad(loss))
    jax.block_until_ready(grad(params, data))
    t0 = time.perf_counter()
    for _ in range(10):
        jax.block_until_ready(grad(params, data))
    t_grad = (time.perf_counter() - t0) / 10
    print(describe_machine())
    print(
        f"tiny ViT with per-head attention weights: {n_params(params):,} parameters, {len(pairs)} GL(16) pairs (x4 heads)"
    )
    print(f"  gradient                  {1e3 * t_grad:8.2f} ms")
    print(f"  adaptive Auto-PGD step    {1e3 * t_ada:8.2f} ms")
    print(f"  geodesic Auto-PGD step    {1e3 * t_geo:8.2f} ms   ratio {t_geo / t_ada:.2f}")
    return {"ratio": t_geo / t_ada, "adaptive_ms": 1e3 * t_ada, "geodesic_ms": 1e3 * t_geo}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.iters)))
        return 0
    ratios = [r["ratio"] for r in run_in_processes(__file__, ["--iters", str(args.iters)], args.processes)]
    print(
        f"\ngeodesic / adaptive time per Auto-PGD iteration: median {statistics.median(ratios):.2f} "
        f"(runs {', '.join(f'{r:.2f}' for r in ratios)}; target <= {TARGET})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

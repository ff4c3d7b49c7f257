#!/usr/bin/env python
"""The spectral toolkit at ViT-B/32 size (random weights, random images): cost and agreement.

In one process, float32: the Hessian's spectral density (SLQ), its two ends (``which="both"``), the
trace by Hutchinson and by Hutch++ at the same budget, and the per-block density of one attention
layer's query weights through ``CurvatureOperator.restrict``.  Printed: wall time of each call after
a first (compiling) call, products used, the density's first moment against both trace estimates
(tr H / d, each with its standard error), and the machine (device, jax version, matmul precision).

Usage:
  python benchmarks/bench_spectral_vit.py --model b32 --batch 32     # GPU (about a minute on an H200)
  python benchmarks/bench_spectral_vit.py --model small --batch 64   # CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import describe_machine  # noqa: E402

import minigeo as mg  # noqa: E402
import minigeo.models as mm  # noqa: E402

SMALL = mm.ViTConfig(image_size=8, patch_size=4, channels=1, num_classes=10, width=32, depth=2, heads=4, mlp_dim=64)


def timed(fn):
    fn()  # compile
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["b32", "small"], default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--probes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    config = mm.vit_b32_config(num_classes=10) if args.model == "b32" else SMALL
    print(describe_machine(), f"matmul precision {jax.config.jax_default_matmul_precision or 'default'}")
    key = jax.random.PRNGKey(0)
    params = mm.init_vit(key, config)
    d = mm.vit_num_params(config)
    images = jax.random.normal(key, (args.batch, config.image_size, config.image_size, config.channels))
    labels = jax.random.randint(key, (args.batch,), 0, config.num_classes)
    batch = (images, labels)
    loss = lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], config), b[1])
    k = jax.random.PRNGKey(1)
    budget = args.probes * args.steps

    print(f"\nViT {args.model}: d = {d:,} parameters, batch {args.batch}, float32")
    print("| call | products | seconds (after compiling) | result |")
    print("|---|---|---|---|", flush=True)
    dens, t = timed(lambda: mg.spectral_density(loss, params, k, batch=batch, num_probes=args.probes,
                                                num_iterations=args.steps))
    m1, m1_se = dens.moments(1)
    print(f"| spectral_density ({args.probes} probes x {args.steps} steps) | {dens.num_products} | {t:.2f} | "
          f"tr H / d = {float(m1):.4g} ± {float(m1_se):.2g}; nodes in [{float(dens.nodes.min()):.3g}, "
          f"{float(dens.nodes.max()):.3g}] |", flush=True)
    (hi, lo), t = timed(lambda: mg.top_eigenvalues(loss, params, k, batch=batch, k=1, which="both"))
    print(f"| top_eigenvalues(k=1, which='both') | - | {t:.2f} | largest {float(hi[0]):.4g}, "
          f"smallest {float(lo[0]):.4g} |", flush=True)
    # batched="map": one probe at a time (vmap over all probes of a ViT-B/32 needs ~1.5 GB each at batch 32)
    for method in ("hutchinson", "hutch++"):
        (est, se), t = timed(lambda: mg.trace_estimate(loss, params, k, batch=batch, num_probes=budget,
                                                       method=method, batched="map"))
        print(f"| trace_estimate {method} | {budget} | {t:.2f} | tr H / d = {float(est) / d:.4g} ± "
              f"{float(se) / d:.2g} |", flush=True)

    H = mg.operators.hessian_operator(loss, params)
    sub = H.restrict([("blocks", "attn", "W_q")])  # every layer's query weights (stacked leaf)
    dsub, t_sub = timed(lambda: sub.spectral_density(k, [batch], num_probes=args.probes, num_iterations=args.steps))
    s1, s1_se = dsub.moments(1)
    print(f"| restrict({sub.name}).spectral_density | {dsub.num_products} passes | {t_sub:.2f} | "
          f"tr H_qq / d_q = {float(s1):.4g} ± {float(s1_se):.2g} |")


if __name__ == "__main__":
    main()

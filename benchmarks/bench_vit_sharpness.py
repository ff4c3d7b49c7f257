#!/usr/bin/env python
"""Geodesic vs adaptive sharpness on minigeo's vision transformer, at the capstone's small size and at ViT-B/32 shape.

In one process, for one model size and batch: the time of one Auto-PGD iteration of geodesic and of
adaptive sharpness (runs of N and 2N iterations after compilation; the difference divided by N, so
initialization and the final evaluation cancel), their ratio, the share of a geodesic iteration spent
in the quotient geometry (the perturbed point of eq. (7) and the projected Riemannian gradient of
every head and layer, given the loss gradient) and in its Sylvester solves alone, the one-off
factorization of metric (15) (thin SVDs of every pair side, once per evaluation for all batches),
the time of whole evaluations (``--batches`` batches of ``--iters`` iterations each, the ratio that
matters to a user; target <= 1.15 on a GPU at da Silva et al.'s (2025) 8 x 256), and the peak memory (GPU: the device's peak bytes in use; CPU: the
process's peak resident set).  Target: ratio <= 1.2 at ViT-B/32 shape.

Usage:
  python benchmarks/bench_vit_sharpness.py --model b32 --batch 2                # CPU (about 7 minutes)
  python benchmarks/bench_vit_sharpness.py --model b32 --batch 256 --iters 5    # GPU, da Silva et al.'s (2025) batch
  python benchmarks/bench_vit_sharpness.py --model small --batch 128 --iters 10
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import describe_machine, interleaved_per_iteration, median_time  # noqa: E402

import minigeo as mg  # noqa: E402
import minigeo.models as mm  # noqa: E402
from minigeo._pairs import _whitened_projection  # noqa: E402
from minigeo.sharpness._blocks import _Geometry  # noqa: E402

TARGET = 1.2
SMALL = mm.ViTConfig(
    image_size=8, patch_size=4, channels=1, num_classes=10, width=32, depth=2, heads=4, mlp_dim=64
)


def peak_memory() -> str:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return f"device peak {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
    return f"process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "b32"], default="b32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=1, help="batches in the whole-evaluation timing")
    args = parser.parse_args()

    config = mm.vit_b32_config() if args.model == "b32" else SMALL
    key = jax.random.PRNGKey(0)
    params = mm.init_vit(key, config)
    size = config.image_size
    images = jax.random.normal(key, (1, args.batch, size, size, config.channels))
    labels = jax.random.randint(key, (1, args.batch), 0, config.num_classes)
    batches = (images, labels)
    loss = lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], config), b[1])
    spec = mm.vit_symmetry_spec(params, eps=1e-6)
    print(describe_machine())
    print(
        f"{args.model}: {mm.vit_num_params(config):,} parameters, {config.depth} layers x {config.heads} heads "
        f"-> {2 * config.depth * config.heads} GL({config.head_dim}) pairs; batch {args.batch}"
    )

    grad = jax.jit(jax.grad(loss))
    t_grad = median_time(grad, params, (images[0], labels[0]), repeats=args.repeats, warmup=1)
    timed = interleaved_per_iteration(
        {
            "adaptive": lambda n: (
                mg.adaptive_sharpness(loss, params, batches, 0.05, key=key, n_iter=n, n_restarts=0).sharpness
            ),
            "geodesic": lambda n: (
                mg.geodesic_sharpness(loss, params, batches, spec, 0.05, key=key, n_iter=n, n_restarts=0).sharpness
            ),
        },
        args.iters,
        args.repeats,
    )
    t_ada, t_geo, ratio = timed["adaptive"], timed["geodesic"], timed["ratios"]["geodesic"]

    geometry = _Geometry(spec)
    w = jax.tree_util.tree_leaves(params)
    factors = jax.jit(geometry.factors)
    fac = factors(w)
    parts = [1e-3 * jax.random.normal(key, shape) for shape in geometry.shapes(w)]
    # the loss gradient with respect to the perturbed segments (pair sides as matrices), as in the search
    moved, _ = geometry.perturb(w, fac, parts)
    treedef = jax.tree_util.tree_structure(params)
    grad_seg = jax.jit(
        jax.grad(
            lambda m: loss(
                jax.tree_util.tree_unflatten(treedef, geometry.assemble(w, m)), (images[0], labels[0])
            )
        )
    )(moved)

    @jax.jit
    def geometry_step(
        w, fac, parts, grad_seg
    ):  # all a geodesic iteration adds around the loss's value and gradient
        moved, caches = geometry.perturb(w, fac, parts)
        return geometry.riemannian(w, fac, parts, caches, moved, grad_seg)

    solves = jax.jit(lambda fac: [_whitened_projection(f, f.gram_G, f.gram_H) for f in fac])
    t_fac = median_time(factors, w, repeats=args.repeats, warmup=1)
    t_geom = median_time(geometry_step, w, fac, parts, grad_seg, repeats=max(args.repeats, 5), warmup=1)
    t_solve = median_time(solves, fac, repeats=max(args.repeats, 5), warmup=1)

    print(f"  gradient                      {t_grad:9.4f} s")
    print(f"  adaptive Auto-PGD iteration   {t_ada:9.4f} s")
    print(
        f"  geodesic Auto-PGD iteration   {t_geo:9.4f} s   ratio {ratio:.2f} (median over {args.repeats} rounds; target <= {TARGET})"
    )
    print(
        f"  quotient geometry per iteration {t_geom:.4f} s = {100 * t_geom / t_geo:.1f} % of a geodesic iteration"
    )
    print(f"  of which Sylvester solves       {t_solve:.4f} s = {100 * t_solve / t_geo:.1f} %")
    print(f"  factorization of metric (15) (once per evaluation)  {t_fac:.4f} s")

    # whole evaluations: args.batches batches, args.iters iterations, set-up included
    ev_images = jax.random.normal(key, (args.batches, args.batch, size, size, config.channels))
    ev_labels = jax.random.randint(key, (args.batches, args.batch), 0, config.num_classes)
    ev = (ev_images, ev_labels)
    whole = {
        "adaptive": lambda: mg.adaptive_sharpness(loss, params, ev, 0.05, key=key, n_iter=args.iters, spec=spec, n_restarts=0).sharpness,
        "geodesic": lambda: mg.geodesic_sharpness(loss, params, ev, spec, 0.05, key=key, n_iter=args.iters, n_restarts=0).sharpness,
    }
    t_whole = {name: median_time(fn, repeats=args.repeats, warmup=1) for name, fn in whole.items()}
    print(
        f"  whole evaluation ({args.batches} x {args.batch}, {args.iters} iterations): adaptive {t_whole['adaptive']:.3f} s, "
        f"geodesic {t_whole['geodesic']:.3f} s, ratio {t_whole['geodesic'] / t_whole['adaptive']:.2f} (GPU target <= 1.15)"
    )
    print(f"  {peak_memory()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

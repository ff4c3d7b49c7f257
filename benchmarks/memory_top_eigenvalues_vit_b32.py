"""Memory of the default ``top_eigenvalues(k=5)`` at ViT-B/32 scale, from XLA's compiled program (issue 49).

Compiles (does not run) ``jax.jit(top_eigenvalues)`` on ViT-B/32's parameter shapes (88.2 M, float32)
and prints XLA's memory analysis: arguments, outputs and temporaries (the Krylov basis is a
temporary of the while loop).  Two losses: a diagonal quadratic over the parameters (the basis and
the recurrence alone) and, with ``--vit``, the real ViT-B/32 cross-entropy on a batch of
``--batch`` images (adds the forward-over-reverse HVP's activations).  Compile only: a few minutes on
a CPU, no device memory is used.

    JAX_PLATFORMS=cpu python benchmarks/memory_top_eigenvalues_vit_b32.py [--vit --batch 2]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

import minigeo as mg
import minigeo.models as mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vit", action="store_true", help="also the real ViT-B/32 loss")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    cfg = mm.ViTConfig(image_size=224, patch_size=32, channels=3, num_classes=1000, width=768, depth=12,
                       heads=12, mlp_dim=3072)
    shapes = jax.eval_shape(lambda key: mm.init_vit(key, cfg), jax.random.PRNGKey(0))
    d = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; ViT-B/32: d = {d:,} parameters, float32")
    print(f"one basis vector: {4 * d / 1e9:.3f} GB; the default basis for k = {args.k}: "
          f"{max(6 * args.k, 4 * args.k)} vectors = {max(6 * args.k, 4 * args.k) * 4 * d / 1e9:.2f} GB")

    def quadratic(p):
        return 0.5 * sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(p))

    losses = {"diagonal quadratic": (quadratic, None)}
    if args.vit:
        images = jax.ShapeDtypeStruct((args.batch, 224, 224, 3), jnp.float32)
        labels = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
        losses[f"ViT-B/32 cross-entropy, batch {args.batch}"] = (
            lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], cfg), b[1]), (images, labels))
    for name, (loss, batch) in losses.items():
        if batch is None:
            fn = jax.jit(lambda p, k: mg.top_eigenvalues(loss, p, k, k=args.k, return_info=True))
            compiled = fn.lower(shapes, key).compile()
        else:
            fn = jax.jit(lambda p, k, b: mg.top_eigenvalues(loss, p, k, batch=b, k=args.k, return_info=True))
            compiled = fn.lower(shapes, key, batch).compile()
        mem = compiled.memory_analysis()
        total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        print(f"{name}: arguments {mem.argument_size_in_bytes / 1e9:.2f} GB, outputs "
              f"{mem.output_size_in_bytes / 1e9:.3f} GB, temporaries {mem.temp_size_in_bytes / 1e9:.2f} GB "
              f"(= {mem.temp_size_in_bytes / (4 * d):.1f} parameter vectors); total {total / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    main()

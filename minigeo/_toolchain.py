r"""A guard against a known miscompilation of jaxlib 0.10.2's CPU backend (floor 0: imports nothing of minigeo).

jaxlib 0.10.2 routes some float32 (and float64) reductions fused with broadcasts to its
experimental YNNPACK fusions, which return wrong values once the arrays are large enough
(jax-ml/jax#39103, "jax.jit returns wrong results for vmapped matrix-vector product followed
by reduction"; jaxlib 0.10.1 is correct).  minigeo meets it wherever a batch of vector-Jacobian
products through a layer norm runs under ``jax.jit``: the gradient of
:math:`x\,(\mathrm{mean}\,x^2)^{-1/2}` for a batch of 10 cotangents of shape ``(32, 17, 8)`` came out
70-100 % wrong in float32, and K-FAC's factors of a small ViT 5-14 % wrong, while the same
computation run op by op, or in float64, was right to round-off.

:func:`avoid_ynn_fusions` turns those fusions off (``--xla_cpu_experimental_ynn_fusion_type=``,
an empty list) by adding the flag to ``XLA_FLAGS`` when the installed jaxlib is 0.10.2 and the
user has not chosen the flag.  ``minigeo`` calls it when it is imported; it takes effect only if
the CPU backend has not started yet (import minigeo before running any JAX computation, or set
the flag yourself).  :func:`cpu_reduction_canary` computes the smallest case known to fail, under
``jit`` and op by op, so a test (or a user) can check the running toolchain.
"""

from __future__ import annotations

import os

__all__ = ["YNN_FLAG", "avoid_ynn_fusions", "cpu_reduction_canary"]

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
_AFFECTED = ("0.10.2",)


def avoid_ynn_fusions(environ: dict | None = None, jaxlib_version: str | None = None) -> bool:
    """Add :data:`YNN_FLAG` to ``XLA_FLAGS`` for an affected jaxlib unless the flag is set; True if added."""
    env = os.environ if environ is None else environ
    if jaxlib_version is None:
        try:
            import jaxlib

            jaxlib_version = getattr(jaxlib, "__version__", "")
        except ImportError:  # pragma: no cover - jax needs jaxlib
            return False
    flags = env.get("XLA_FLAGS", "")
    if jaxlib_version not in _AFFECTED or "xla_cpu_experimental_ynn_fusion_type" in flags:
        return False
    env["XLA_FLAGS"] = f"{flags} {YNN_FLAG}".strip()
    return True


def cpu_reduction_canary() -> float:
    """Largest relative difference between the jitted and the op-by-op float32 result of the smallest
    computation known to be miscompiled (a batch of vjps of ``x * rsqrt(mean(x**2))``): ~1e-7 on a
    sound toolchain, ~1 on jaxlib 0.10.2 with its YNNPACK fusions on."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    r = np.random.default_rng(0)
    x = jnp.asarray(0.02 * r.normal(size=(32, 17, 8)) + 0.01, jnp.float32)
    w = jnp.asarray(r.normal(size=(10, 32, 17, 8)), jnp.float32)
    f = lambda y: y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True))

    def batched(x, w):
        _, vjp = jax.vjp(f, x)
        return jax.vmap(lambda c: vjp(c)[0])(w)

    with jax.disable_jit():
        eager = np.asarray(batched(x, w), np.float64)
    jitted = np.asarray(jax.jit(batched)(x, w), np.float64)
    return float(np.abs(jitted - eager).max() / np.abs(eager).max())

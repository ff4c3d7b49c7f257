"""The guard against jaxlib 0.10.2's CPU miscompilation (minigeo._toolchain; jax-ml/jax#39103).

Truths: the op-by-op result of the same computation (the canary), the upstream reproducer's closed
form (sum of squares of an identity matrix-vector product), and the flag logic on a scratch
environment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minigeo import _toolchain


def test_the_running_toolchain_computes_batched_reductions_right():
    """The smallest case known to be miscompiled agrees with its op-by-op value to float32 round-off
    (about 1 on jaxlib 0.10.2 without the flag that minigeo sets on import)."""
    assert _toolchain.cpu_reduction_canary() < 1e-5


@pytest.mark.parametrize("dtype, n", [(jnp.float64, 16_385), (jnp.float32, 32_769)])
def test_the_upstream_reproducer_gives_the_closed_form(dtype, n):
    """jax-ml/jax#39103: sum((I @ (i, 0, 0))**2) = i**2 for every row i, jitted, at the sizes it failed."""
    i = jnp.arange(n, dtype=dtype)
    x = jnp.stack((i, jnp.zeros_like(i), jnp.zeros_like(i)), axis=1)
    f = jax.jit(lambda x: jax.vmap(lambda row: jnp.sum((jnp.eye(3, dtype=dtype) @ row) ** 2))(x))
    # exact in float64; in float32 each square is rounded once (i**2 > 2**24)
    np.testing.assert_allclose(np.asarray(f(x), np.float64), np.arange(n, dtype=np.float64) ** 2,
                               rtol=float(jnp.finfo(dtype).eps), atol=0)


def test_the_flag_is_added_for_the_affected_jaxlib_only_and_never_overrides_the_user():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert _toolchain.avoid_ynn_fusions(env, "0.10.2")
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 " + _toolchain.YNN_FLAG
    assert not _toolchain.avoid_ynn_fusions(env, "0.10.2")  # already there: unchanged
    assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1
    chosen = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_REDUCE"}
    assert not _toolchain.avoid_ynn_fusions(chosen, "0.10.2") and "REDUCE" in chosen["XLA_FLAGS"]
    empty: dict = {}
    assert not _toolchain.avoid_ynn_fusions(empty, "0.10.1") and empty == {}
    assert _toolchain.avoid_ynn_fusions(empty, "0.10.2") and empty["XLA_FLAGS"] == _toolchain.YNN_FLAG

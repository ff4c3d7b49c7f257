"""Data parallelism: sharpness and training steps give the same numbers on a batch sharded over two
(host) devices as on one device.  Runs in a subprocess, since the device count is fixed when JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import minigeo as mg

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, optax
    jax.config.update("jax_enable_x64", True)
    import minigeo as mg, minigeo.models as mm

    assert jax.device_count() == 2, jax.devices()
    c = mm.ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=5, width=12, depth=2, heads=3, mlp_dim=16)
    params = mm.init_vit(jax.random.PRNGKey(0), c, dtype=jnp.float64)
    r = np.random.default_rng(0)
    images = jnp.asarray(r.normal(size=(2, 8, 8, 8, 1)))
    labels = jnp.asarray(r.integers(0, 5, size=(2, 8)))
    loss = lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], c), b[1])
    spec = mm.vit_symmetry_spec(params)

    mesh = mg.parallel.data_parallel_mesh()
    sharded = mg.parallel.shard_batch((images, labels), mesh, axis=1)
    assert len(sharded[0].sharding.device_set) == 2
    assert sharded[0].addressable_shards[0].data.shape == (2, 4, 8, 8, 1)
    rep = mg.parallel.replicate(params, mesh)

    key = jax.random.PRNGKey(1)
    g1 = mg.geodesic_sharpness(loss, params, (images, labels), spec, 0.05, key=key, n_iter=5)
    g2 = mg.geodesic_sharpness(loss, rep, sharded, spec, 0.05, key=key, n_iter=5)
    np.testing.assert_allclose(g2.per_batch, g1.per_batch, rtol=1e-9)
    a1 = mg.adaptive_sharpness(loss, params, (images, labels), 0.05, key=key, n_iter=5)
    a2 = mg.adaptive_sharpness(loss, rep, sharded, 0.05, key=key, n_iter=5)
    np.testing.assert_allclose(a2.per_batch, a1.per_batch, rtol=1e-9)

    opt = optax.adamw(1e-3, weight_decay=0.1)
    step = mm.make_train_step(loss, opt)
    one = (images[0], labels[0])
    p1, _, l1 = step(params, opt.init(params), one)
    p2, _, l2 = step(rep, opt.init(rep), mg.parallel.shard_batch(one, mesh))
    np.testing.assert_allclose(l2, l1, rtol=1e-12)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12), p2, p1)

    try:
        mg.parallel.shard_batch(jnp.ones((3, 2)), mesh)
    except mg.GeometryError as e:
        assert "cannot be split evenly over 2 devices" in str(e), e
    else:
        raise AssertionError("an odd batch was sharded over 2 devices")
    print("PARALLEL-OK", float(g1.sharpness), float(a1.sharpness))
    """
)


def test_sharded_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "PARALLEL-OK" in out.stdout


def test_shard_batch_errors_in_process():
    with pytest.raises(mg.GeometryError, match="has no example axis 1"):
        mg.parallel.shard_batch(jnp.ones(3), axis=1)
    with pytest.raises(mg.GeometryError, match="no devices"):
        mg.parallel.data_parallel_mesh([])

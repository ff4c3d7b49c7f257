"""Parity of minigeo.models.vit with timm's VisionTransformer (the independent reference implementation).

Needs torch, torchvision and timm (requirements-parity.txt, installed by scripts/test.sh).  Without
them the tests skip, unless MINIGEO_REQUIRE_TIMM=1 (set by scripts/test.sh), where they fail.
No weights are downloaded: the timm models are randomly initialised (pretrained=False).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

import minigeo.models as mm

if os.environ.get("MINIGEO_REQUIRE_TIMM") == "1":
    import timm
    import torch
else:
    timm = pytest.importorskip(
        "timm", reason="timm parity tests need `pip install -r requirements-parity.txt`"
    )
    torch = pytest.importorskip("torch")


def perturbed(model, seed):
    """Add noise to every parameter (timm initialises biases to 0 and LayerNorms to 1, which would hide
    a mistake in converting them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def compare(model, images_nchw, **kwargs):
    params, config = mm.vit_from_timm(model.state_dict(), **kwargs)
    with torch.no_grad():
        want = model(torch.from_numpy(images_nchw)).numpy()
    got = np.asarray(mm.vit_apply(params, jnp.asarray(images_nchw.transpose(0, 2, 3, 1)), config))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    return params, config


def test_vit_b32_logits_match_timm():
    torch.manual_seed(0)
    model = perturbed(timm.create_model("vit_base_patch32_224", pretrained=False), seed=1)
    images = np.random.default_rng(0).normal(size=(2, 3, 224, 224)).astype(np.float32)
    params, config = compare(model, images)
    assert config == mm.vit_b32_config()
    assert sum(p.numel() for p in model.parameters()) == mm.vit_num_params(config) == 88_224_232


def test_small_timm_vit_and_checkpoint_files_match(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=16,
        patch_size=4,
        in_chans=3,
        num_classes=7,
        embed_dim=48,
        depth=2,
        num_heads=4,
        mlp_ratio=2.0,
    )
    model = perturbed(model, seed=3)
    images = np.random.default_rng(1).normal(size=(3, 3, 16, 16)).astype(np.float32)
    params, config = compare(model, images, heads=4)
    assert (config.width, config.heads, config.depth, config.mlp_dim, config.num_classes) == (48, 4, 2, 96, 7)
    # the same weights read back from checkpoint files written by torch.save and safetensors
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(sd, tmp_path / "vit.pth")
    save_file(sd, str(tmp_path / "vit.safetensors"))
    for name in ("vit.pth", "vit.safetensors"):
        loaded, cfg = mm.vit_from_timm(mm.load_timm_checkpoint(tmp_path / name), heads=4)
        assert cfg == config
        for a, b in zip(jax_leaves(loaded), jax_leaves(params)):
            np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]

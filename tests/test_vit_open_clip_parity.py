"""Parity of minigeo.models.vit_from_open_clip with OpenCLIP's ``model.encode_image`` (the reference).

Needs torch, torchvision and open_clip_torch (requirements-parity.txt, installed by scripts/test.sh).
Without them the tests skip, unless MINIGEO_REQUIRE_OPEN_CLIP=1 (set by scripts/test.sh), where they
fail. No weights are downloaded: the OpenCLIP models are randomly initialised (pretrained=None) and
their parameters perturbed, so that zero biases and unit LayerNorms cannot hide a conversion mistake.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_invertible, rng

import minigeo as mg
import minigeo.models as mm

if os.environ.get("MINIGEO_REQUIRE_OPEN_CLIP") == "1":
    import open_clip
    import torch
else:
    open_clip = pytest.importorskip(
        "open_clip", reason="OpenCLIP parity tests need `pip install -r requirements-parity.txt`"
    )
    torch = pytest.importorskip("torch")

TEXT_CFG = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)  # a tiny, unused text tower


def small_clip(seed, quick_gelu, **vision):
    """A CLIP model with a small ViT image tower (random, then every parameter perturbed)."""
    torch.manual_seed(seed)
    vision_cfg = dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16, mlp_ratio=4.0)
    model = open_clip.CLIP(
        embed_dim=24, vision_cfg={**vision_cfg, **vision}, text_cfg=TEXT_CFG, quick_gelu=quick_gelu
    )
    return perturbed(model, seed + 100)


def perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def relative_error(got, want):
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def features(model, images_nchw, dtype):
    """OpenCLIP's unnormalized image features, in float32 or float64."""
    model = model.to(dtype)
    with torch.no_grad():
        return model.encode_image(torch.from_numpy(images_nchw).to(dtype)).numpy()


def minigeo_features(state_dict, images_nchw, dtype, **kwargs):
    params, config = mm.vit_from_open_clip(state_dict, dtype=dtype, **kwargs)
    images = jnp.asarray(images_nchw.transpose(0, 2, 3, 1), dtype)
    return np.asarray(mm.vit_apply(params, images, config)), params, config


@pytest.mark.parametrize(
    "act, vision, heads",
    [
        ("quick_gelu", {}, 4),  # OpenAI CLIP's activation; 64 = 4 heads of 16
        ("gelu", dict(image_size=64, patch_size=16, width=128, head_width=64), None),  # heads 128 // 64
        ("gelu", dict(no_ln_pre=True), 4),  # the CLIPA towers have no ln_pre
    ],
)
def test_small_open_clip_features_match_in_float32_and_float64(act, vision, heads):
    model = small_clip(0, quick_gelu=act == "quick_gelu", **vision)
    size = model.visual.image_size[0]
    images = rng(1).normal(size=(3, 3, size, size))
    # float32: the visual tower's own state dict
    want32 = features(model, images.astype(np.float32), torch.float32)
    got32, params, config = minigeo_features(
        model.visual.state_dict(), images.astype(np.float32), jnp.float32, act=act, heads=heads
    )
    assert got32.dtype == np.float32 and got32.shape == (3, 24)
    assert relative_error(got32, want32) <= 1e-4
    assert config.pre_norm == (not vision.get("no_ln_pre", False))
    assert (config.width, config.heads, config.depth, config.num_classes) == (
        model.visual.transformer.width,
        model.visual.transformer.resblocks[0].attn.num_heads,
        2,
        24,
    )
    assert mm.vit_num_params(config) == sum(p.numel() for p in model.visual.parameters())
    # float64: the full CLIP state dict (image tower under "visual.", text tower ignored)
    want64 = features(model, images, torch.float64)
    got64, _, _ = minigeo_features(model.state_dict(), images, jnp.float64, act=act, heads=heads)
    assert got64.dtype == np.float64
    assert relative_error(got64, want64) <= 1e-12
    # the activation is part of the function: the other one does not match
    other = "gelu" if act == "quick_gelu" else "quick_gelu"
    wrong, _, _ = minigeo_features(model.state_dict(), images, jnp.float64, act=other, heads=heads)
    assert relative_error(wrong, want64) > 1e-3


def test_vit_b32_features_match_open_clip():
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32-quickgelu", pretrained=None).eval()
    perturbed(model.visual, seed=1)  # the text tower plays no part
    images = rng(2).normal(size=(2, 3, 224, 224)).astype(np.float32)
    want = features(model, images, torch.float32)
    got, params, config = minigeo_features(model.state_dict(), images, jnp.float32, act="quick_gelu")
    assert relative_error(got, want) <= 1e-4
    assert config == mm.vit_b32_config(num_classes=512)._replace(
        ln_eps=1e-5, gelu="quick", pre_norm=True, patch_bias=False, head_bias=False
    )
    assert sum(p.numel() for p in model.visual.parameters()) == mm.vit_num_params(config) == 87_849_216
    assert params["blocks"]["attn"]["W_q"].shape == (12, 12, 768, 64)


def move_along_pairs(params, spec, r):
    """Act on every GL(h) pair that ``spec`` names: side G (weight and appended bias) by A^{-1},
    side H by A^T, one random A per layer and head."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for g_side, h_side in spec.pairs:
        weight = leaves[g_side[0]]
        batch, h = weight.shape[:-2], weight.shape[-1]
        A = jnp.stack([random_invertible(r, h) for _ in range(int(np.prod(batch)))]).reshape(batch + (h, h))
        A_inv, A_T = jnp.linalg.inv(A), jnp.swapaxes(A, -1, -2)
        for i in g_side:  # (..., n, h) weight, (..., h) bias
            leaves[i] = (
                leaves[i] @ A_inv
                if leaves[i].ndim == weight.ndim
                else jnp.einsum("...e,...ef->...f", leaves[i], A_inv)
            )
        for i in h_side:
            leaves[i] = leaves[i] @ A_T
    return jax.tree_util.tree_unflatten(treedef, leaves)


def test_moving_along_the_gl_h_symmetries_leaves_open_clip_features_unchanged():
    model = small_clip(3, quick_gelu=False)
    images = rng(4).normal(size=(2, 3, 32, 32))
    params, config = mm.vit_from_open_clip(model.state_dict(), act="gelu", heads=4, dtype=jnp.float64)
    spec = mm.vit_symmetry_spec(params)
    assert len(spec.pairs) == 2  # (q, k) and (v, o), each batched over 2 layers x 4 heads
    moved = move_along_pairs(params, spec, rng(5))
    assert float(jnp.max(jnp.abs(moved["blocks"]["attn"]["W_q"] - params["blocks"]["attn"]["W_q"]))) > 0.1
    x = jnp.asarray(images.transpose(0, 2, 3, 1))
    want = features(model, images, torch.float64)
    assert relative_error(mm.vit_apply(moved, x, config), want) <= 1e-10
    # the key bias is redundant: shifting it changes nothing either
    attn = dict(moved["blocks"]["attn"], b_k=moved["blocks"]["attn"]["b_k"] + 3.0)
    shifted = dict(moved, blocks=dict(moved["blocks"], attn=attn))
    assert relative_error(mm.vit_apply(shifted, x, config), want) <= 1e-10


@pytest.mark.parametrize(
    "vision, feature",
    [
        (dict(ls_init_value=1e-4), "LayerScale"),
        (dict(attentional_pool=True, attn_pooler_queries=4, attn_pooler_heads=2), "attentional pooler"),
        (dict(qk_norm=True), "query/key normalization"),
        (dict(scale_fc=True), "a LayerNorm inside the MLP"),
    ],
)
def test_unsupported_open_clip_options_are_named(vision, feature):
    model = small_clip(6, quick_gelu=False, **vision)
    with pytest.raises(mg.GeometryError, match="unexpected keys") as err:
        mm.vit_from_open_clip(model.state_dict(), act="gelu", heads=4)
    assert feature in str(err.value)


def test_open_clip_text_tower_and_resnet_are_rejected():
    model = small_clip(7, quick_gelu=False)
    text_only = {k: v for k, v in model.state_dict().items() if not k.startswith("visual.")}
    with pytest.raises(mg.GeometryError, match="not an OpenCLIP VisionTransformer state dict"):
        mm.vit_from_open_clip(text_only, act="gelu", heads=4)
    torch.manual_seed(0)
    resnet = open_clip.CLIP(
        embed_dim=16, vision_cfg=dict(layers=[1, 1, 1, 1], width=8, image_size=64), text_cfg=TEXT_CFG
    )
    with pytest.raises(mg.GeometryError, match="ModifiedResNet"):
        mm.vit_from_open_clip(resnet.state_dict(), act="gelu")


def test_bfloat16_checkpoints_are_widened_exactly():
    model = small_clip(8, quick_gelu=True)
    sd = {k: v.to(torch.bfloat16) for k, v in model.visual.state_dict().items()}
    params, _ = mm.vit_from_open_clip(sd, act="quick_gelu", heads=4)
    want, _ = mm.vit_from_open_clip({k: v.float() for k, v in sd.items()}, act="quick_gelu", heads=4)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, want)

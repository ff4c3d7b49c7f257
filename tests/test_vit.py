"""Tests of minigeo.models.vit: forward against a naive loop implementation, the symmetry spec,
GL(h) invariance of geodesic sharpness on the ViT, checkpoint loading and error paths."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_invertible, rng
from scipy.special import erf

import minigeo as mg
import minigeo.models as mm

TOY = mm.ViTConfig(
    image_size=8, patch_size=2, channels=1, num_classes=5, width=12, depth=2, heads=3, mlp_dim=16
)


def randomized_params(config, seed=0, dtype=jnp.float64):
    """Random parameters with every leaf perturbed (non-zero biases, non-unit LayerNorm scales)."""
    params = mm.init_vit(jax.random.PRNGKey(seed), config, dtype=dtype)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    r = rng(seed + 100)
    leaves = [x + jnp.asarray(0.3 * r.normal(size=x.shape), dtype) for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def naive_vit(params, images, c):
    """Textbook ViT in numpy float64: fused-head matrices, explicit loops over layers, heads and tokens."""
    P = jax.tree_util.tree_map(np.asarray, params)
    B = images.shape[0]
    p, dh = c.patch_size, c.head_dim
    g = c.image_size // p
    out = []
    for b in range(B):
        tokens = [P["cls_token"]]
        for i in range(g):
            for j in range(g):
                patch = images[b, i * p : (i + 1) * p, j * p : (j + 1) * p, :].reshape(
                    -1
                )  # (kh, kw, c) order
                tokens.append(patch @ P["patch_embed"]["kernel"] + P["patch_embed"].get("bias", 0.0))
        z = np.stack(tokens) + P["pos_embed"]

        def ln(x, s, t):
            mu = x.mean(-1, keepdims=True)
            return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + c.ln_eps) * s + t

        if c.pre_norm:  # OpenCLIP's ln_pre
            z = ln(z, P["ln_pre"]["scale"], P["ln_pre"]["bias"])

        for layer in range(c.depth):
            blk = jax.tree_util.tree_map(lambda x: x[layer], P["blocks"])
            a = blk["attn"]
            x = ln(z, blk["ln1"]["scale"], blk["ln1"]["bias"])
            # fused (d, d) projections as in a standard implementation, then split into heads
            Wq = np.concatenate(list(a["W_q"]), axis=1)
            Wk = np.concatenate(list(a["W_k"]), axis=1)
            Wv = np.concatenate(list(a["W_v"]), axis=1)
            Wo = np.concatenate(list(a["W_o"]), axis=1)  # (d_out, heads*dh)
            q, k, v = (
                x @ Wq + a["b_q"].reshape(-1),
                x @ Wk + a["b_k"].reshape(-1),
                x @ Wv + a["b_v"].reshape(-1),
            )
            heads = []
            for h in range(c.heads):
                sl = slice(h * dh, (h + 1) * dh)
                s = q[:, sl] @ k[:, sl].T / math.sqrt(dh)
                s = np.exp(s - s.max(-1, keepdims=True))
                heads.append((s / s.sum(-1, keepdims=True)) @ v[:, sl])
            z = z + np.concatenate(heads, axis=1) @ Wo.T + a["b_o"]
            y = (
                ln(z, blk["ln2"]["scale"], blk["ln2"]["bias"]) @ blk["mlp"]["fc1"]["kernel"]
                + blk["mlp"]["fc1"]["bias"]
            )
            if c.gelu == "quick":  # OpenAI CLIP's QuickGELU
                y = y / (1 + np.exp(-1.702 * y))
            else:
                y = 0.5 * y * (1 + erf(y / math.sqrt(2)))
            z = z + y @ blk["mlp"]["fc2"]["kernel"] + blk["mlp"]["fc2"]["bias"]
        cls = ln(z, P["ln_final"]["scale"], P["ln_final"]["bias"])[0]
        out.append(cls @ P["head"]["kernel"] + P["head"].get("bias", 0.0))
    return np.stack(out)


def test_forward_matches_naive_implementation():
    params = randomized_params(TOY)
    images = rng(1).normal(size=(3, 8, 8, 1))
    np.testing.assert_allclose(
        mm.vit_apply(params, images, TOY), naive_vit(params, images, TOY), rtol=1e-10, atol=1e-12
    )


# OpenCLIP's image tower: LayerNorm after the embedding, no patch or head bias, QuickGELU
OPEN_CLIP_TOY = TOY._replace(
    channels=3, num_classes=6, ln_eps=1e-5, gelu="quick", pre_norm=True, patch_bias=False, head_bias=False
)


def test_open_clip_switches_match_naive_implementation():
    c = OPEN_CLIP_TOY
    params = randomized_params(c, seed=7)
    assert "ln_pre" in params and "bias" not in params["patch_embed"] and "bias" not in params["head"]
    images = rng(8).normal(size=(3, 8, 8, 3))
    want = naive_vit(params, images, c)
    np.testing.assert_allclose(mm.vit_apply(params, images, c), want, rtol=1e-10, atol=1e-12)
    d = c.width
    assert mm.vit_num_params(c) == mm.vit_num_params(TOY._replace(channels=3, num_classes=6)) + 2 * d - d - 6
    # each switch changes the function
    for other in (c._replace(gelu="exact"), c._replace(ln_eps=1e-3)):
        assert float(jnp.max(jnp.abs(mm.vit_apply(params, images, other) - want))) > 1e-4
    no_pre = {k: v for k, v in params.items() if k != "ln_pre"}
    assert float(jnp.max(jnp.abs(mm.vit_apply(no_pre, images, c._replace(pre_norm=False)) - want))) > 1e-3
    # the defaults are timm's: a config built without the new fields is unchanged
    assert (TOY.pre_norm, TOY.patch_bias, TOY.head_bias, TOY.gelu) == (False, True, True, "exact")
    with pytest.raises(mg.GeometryError, match="'exact', 'tanh' or 'quick'"):
        mm.init_vit(jax.random.PRNGKey(0), c._replace(gelu="quick_gelu"))


def test_tanh_gelu_is_close_but_different():
    params = randomized_params(TOY)
    images = jnp.asarray(rng(2).normal(size=(2, 8, 8, 1)))
    exact = mm.vit_apply(params, images, TOY)
    approx = mm.vit_apply(params, images, TOY._replace(gelu="tanh"))
    assert 0 < float(jnp.max(jnp.abs(exact - approx))) < 1e-2 * float(jnp.max(jnp.abs(exact)))


def test_vit_b32_has_timms_parameter_count():
    # timm's vit_base_patch32_224 has 88,224,232 parameters
    assert mm.vit_num_params(mm.vit_b32_config()) == 88_224_232
    shapes = jax.eval_shape(lambda k: mm.init_vit(k, mm.vit_b32_config()), jax.random.PRNGKey(0))
    assert shapes["blocks"]["attn"]["W_q"].shape == (12, 12, 768, 64)
    assert shapes["pos_embed"].shape == (50, 768)


def test_spec_covers_every_attention_weight_exactly_once():
    params = mm.init_vit(jax.random.PRNGKey(0), TOY)
    spec = mm.vit_symmetry_spec(params)
    paths = [tuple(k.key for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    covered = [i for pair in spec.pairs for side in pair for i in side]
    assert len(covered) == len(set(covered))
    named = {paths[i][-1] for i in covered}
    assert named == {"W_q", "b_q", "W_k", "W_v", "b_v", "W_o"}  # b_o is shared by the heads: no symmetry
    assert all(paths[i][:2] == ("blocks", "attn") for i in covered)
    # sides: (W_q + b_q, W_k) and (W_v + b_v, W_o); the key bias is redundant (never perturbed)
    assert sorted(len(side) for pair in spec.pairs for side in pair) == [1, 1, 2, 2]
    assert [paths[i] for i in spec.redundant] == [("blocks", "attn", "b_k")]


def test_key_bias_is_redundant_and_leaves_sharpness_unchanged():
    """Adding a constant to b_k changes no logit (softmax is shift-invariant along the keys), so
    neither sharpness may change: b_k is held fixed, not appended to the key side."""
    c = TOY
    params = randomized_params(c, seed=5)
    r = rng(6)
    images = jnp.asarray(r.normal(size=(2, 4, 8, 8, 1)))
    labels = jnp.asarray(r.integers(0, c.num_classes, size=(2, 4)))
    loss = lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], c), b[1])
    shifted = jax.tree_util.tree_map(lambda x: x, params)
    attn = dict(params["blocks"]["attn"])
    attn["b_k"] = attn["b_k"] + 3.0 * jnp.asarray(r.normal(size=attn["b_k"].shape))
    shifted["blocks"] = dict(params["blocks"], attn=attn)
    np.testing.assert_allclose(
        mm.vit_apply(shifted, images[0], c), mm.vit_apply(params, images[0], c), rtol=1e-12, atol=1e-12
    )
    spec = mm.vit_symmetry_spec(params)
    kw = dict(key=jax.random.PRNGKey(1), n_iter=6)
    g1 = mg.geodesic_sharpness(loss, params, (images, labels), spec, 0.05, **kw)
    g2 = mg.geodesic_sharpness(loss, shifted, (images, labels), spec, 0.05, **kw)
    np.testing.assert_allclose(g2.per_batch, g1.per_batch, rtol=1e-6)
    a1 = mg.adaptive_sharpness(loss, params, (images, labels), 0.05, spec=spec, **kw)
    a2 = mg.adaptive_sharpness(loss, shifted, (images, labels), 0.05, spec=spec, **kw)
    np.testing.assert_allclose(a2.per_batch, a1.per_batch, rtol=1e-6)
    assert float(g1.sharpness) > 0 and float(a1.sharpness) > 0
    # paper 004's Example A.1 (b_k appended to the key side): geodesic sharpness moves with b_k
    at = lambda name: ("blocks", "attn", name)
    paper = mg.symmetry_spec(
        params,
        [
            (mg.with_bias(at("W_q"), at("b_q")), mg.with_bias(at("W_k"), at("b_k"))),
            (mg.with_bias(at("W_v"), at("b_v")), at("W_o")),
        ],
    )
    p1 = mg.geodesic_sharpness(loss, params, (images, labels), paper, 0.05, **kw)
    p2 = mg.geodesic_sharpness(loss, shifted, (images, labels), paper, 0.05, **kw)
    assert abs(float(p2.sharpness - p1.sharpness)) > 1e-3 * abs(float(p1.sharpness))


def act_per_head(params, A_qk, A_vo, d_ln2, d_final):
    """Random per-head GL(dh) elements on (q, k) and (v, o), plus GL(1) rescalings of LayerNorm channels
    that the following linear layer undoes (LN2 -> fc1 and the final LN -> head): the library's move,
    whose own test checks the unchanged logits and pair products."""
    return mm.vit_move_along_symmetries(params, A_qk, A_vo, ln2_scale=d_ln2, final_scale=d_final)


def test_geodesic_sharpness_gl_h_invariant_on_vit_adaptive_not():
    c = TOY
    params = randomized_params(c, seed=3)
    r = rng(4)
    images = jnp.asarray(r.normal(size=(2, 6, 8, 8, 1)))
    labels = jnp.asarray(r.integers(0, c.num_classes, size=(2, 6)))
    loss = lambda p, b: mm.cross_entropy(mm.vit_apply(p, b[0], c), b[1])
    shape = (c.depth, c.heads)
    A_qk = jnp.stack([random_invertible(r, c.head_dim) * 2.0 for _ in range(math.prod(shape))]).reshape(
        shape + (4, 4)
    )
    A_vo = jnp.stack([random_invertible(r, c.head_dim) * 0.5 for _ in range(math.prod(shape))]).reshape(
        shape + (4, 4)
    )
    d_ln2 = jnp.asarray(r.uniform(0.3, 3.0, size=(c.depth, c.width)))
    d_final = jnp.asarray(r.uniform(0.3, 3.0, size=c.width))
    moved = act_per_head(params, A_qk, A_vo, d_ln2, d_final)
    np.testing.assert_allclose(
        mm.vit_apply(moved, images[0], c), mm.vit_apply(params, images[0], c), rtol=1e-9, atol=1e-10
    )

    spec = mm.vit_symmetry_spec(params)
    g1 = mg.geodesic_sharpness(
        loss, params, (images, labels), spec, 0.05, key=jax.random.PRNGKey(0), n_iter=8
    )
    g2 = mg.geodesic_sharpness(loss, moved, (images, labels), spec, 0.05, key=jax.random.PRNGKey(0), n_iter=8)
    assert float(g1.sharpness) > 0
    np.testing.assert_allclose(g2.per_batch, g1.per_batch, rtol=1e-7)
    a1 = mg.adaptive_sharpness(loss, params, (images, labels), 0.05, key=jax.random.PRNGKey(0), n_iter=8)
    a2 = mg.adaptive_sharpness(loss, moved, (images, labels), 0.05, key=jax.random.PRNGKey(0), n_iter=8)
    assert abs(float(a2.sharpness - a1.sharpness)) > 1e-2 * abs(float(a1.sharpness))
    # GL(1) rescalings alone (no attention move) leave adaptive sharpness unchanged too
    only_gl1 = act_per_head(
        params,
        jnp.broadcast_to(jnp.eye(4), A_qk.shape),
        jnp.broadcast_to(jnp.eye(4), A_vo.shape),
        d_ln2,
        d_final,
    )
    a3 = mg.adaptive_sharpness(loss, only_gl1, (images, labels), 0.05, key=jax.random.PRNGKey(0), n_iter=8)
    np.testing.assert_allclose(a3.per_batch, a1.per_batch, rtol=1e-7)


def to_timm_state_dict(params, c):
    """Write minigeo's layout in timm's names (fused qkv, transposed linear weights, conv patch kernel)."""
    P = jax.tree_util.tree_map(np.asarray, params)
    d, p, C = c.width, c.patch_size, c.channels
    sd = {
        "cls_token": P["cls_token"].reshape(1, 1, d),
        "pos_embed": P["pos_embed"][None],
        "patch_embed.proj.weight": P["patch_embed"]["kernel"].reshape(p, p, C, d).transpose(3, 2, 0, 1),
        "patch_embed.proj.bias": P["patch_embed"]["bias"],
        "norm.weight": P["ln_final"]["scale"],
        "norm.bias": P["ln_final"]["bias"],
        "head.weight": P["head"]["kernel"].T,
        "head.bias": P["head"]["bias"],
    }
    for i in range(c.depth):
        b = jax.tree_util.tree_map(lambda x: x[i], P["blocks"])
        a = b["attn"]
        fused = lambda W: np.concatenate([w.T for w in W], axis=0)  # heads of (d, dh) -> (d, d) rows
        sd[f"blocks.{i}.attn.qkv.weight"] = np.concatenate(
            [fused(a["W_q"]), fused(a["W_k"]), fused(a["W_v"])]
        )
        sd[f"blocks.{i}.attn.qkv.bias"] = np.concatenate(
            [a["b_q"].reshape(-1), a["b_k"].reshape(-1), a["b_v"].reshape(-1)]
        )
        sd[f"blocks.{i}.attn.proj.weight"] = np.concatenate(list(a["W_o"]), axis=1)
        sd[f"blocks.{i}.attn.proj.bias"] = a["b_o"]
        for ours, theirs in (("ln1", "norm1"), ("ln2", "norm2")):
            sd[f"blocks.{i}.{theirs}.weight"], sd[f"blocks.{i}.{theirs}.bias"] = (
                b[ours]["scale"],
                b[ours]["bias"],
            )
        for fc in ("fc1", "fc2"):
            sd[f"blocks.{i}.mlp.{fc}.weight"] = b["mlp"][fc]["kernel"].T
            sd[f"blocks.{i}.mlp.{fc}.bias"] = b["mlp"][fc]["bias"]
    return sd


def test_converter_inverts_timm_layout_and_loads_files(tmp_path):
    c = TOY._replace(heads=3)
    params = randomized_params(c, seed=5)
    sd = to_timm_state_dict(params, c)
    back, cfg = mm.vit_from_timm(sd, heads=3, dtype=jnp.float64)
    assert cfg == c
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), back, params)
    np.savez(tmp_path / "vit.npz", **sd)
    loaded = mm.load_timm_checkpoint(tmp_path / "vit.npz")
    assert sorted(loaded) == sorted(sd)
    back2, _ = mm.vit_from_timm(loaded, heads=3, dtype=jnp.float64)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(a, b), back2, params)


def test_converter_and_loader_errors(tmp_path):
    c = TOY
    sd = to_timm_state_dict(randomized_params(c), c)
    broken = dict(sd)
    del broken["blocks.1.mlp.fc2.bias"]
    broken["blocks.1.attn.q_norm.weight"] = np.ones(4)
    with pytest.raises(mg.GeometryError, match=r"missing keys \(1\): \['blocks.1.mlp.fc2.bias'\]") as err:
        mm.vit_from_timm(broken, heads=3)
    assert "unexpected keys (1): ['blocks.1.attn.q_norm.weight']" in str(err.value)
    with pytest.raises(mg.GeometryError, match="not a timm VisionTransformer"):
        mm.vit_from_timm({"fc.weight": np.ones((2, 2))})
    with pytest.raises(mg.GeometryError, match="divisible by heads=5"):
        mm.vit_from_timm(sd, heads=5)
    with pytest.raises(mg.GeometryError, match="no file at"):
        mm.load_timm_checkpoint(tmp_path / "missing.safetensors")
    (tmp_path / "w.h5").write_bytes(b"")
    with pytest.raises(mg.GeometryError, match="unknown checkpoint format '.h5'"):
        mm.load_timm_checkpoint(tmp_path / "w.h5")


def test_model_errors():
    with pytest.raises(mg.GeometryError, match="no attention layer"):
        mm.vit_symmetry_spec({"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)}})
    with pytest.raises(mg.GeometryError, match="multiple of patch_size"):
        mm.init_vit(jax.random.PRNGKey(0), TOY._replace(patch_size=3))
    with pytest.raises(mg.GeometryError, match="divisible by heads"):
        mm.init_vit(jax.random.PRNGKey(0), TOY._replace(heads=5))
    with pytest.raises(mg.GeometryError, match="gelu must be"):
        mm.init_vit(jax.random.PRNGKey(0), TOY._replace(gelu="relu"))
    params = mm.init_vit(jax.random.PRNGKey(0), TOY)
    with pytest.raises(mg.GeometryError, match=r"channels last.*transpose\(0, 2, 3, 1\)"):
        mm.vit_apply(params, jnp.ones((2, 1, 8, 8)), TOY)


def test_training_helpers_against_closed_forms():
    logits = jnp.asarray(rng(6).normal(size=(5, 4)))
    labels = jnp.array([0, 1, 2, 3, 0])
    manual = -np.mean([jax.nn.log_softmax(logits[i])[labels[i]] for i in range(5)])
    np.testing.assert_allclose(mm.cross_entropy(logits, labels), manual, rtol=1e-12)
    with pytest.raises(mg.GeometryError, match="disagree on the batch shape"):
        mm.cross_entropy(logits, labels[:3])
    apply = lambda p, x: x
    np.testing.assert_allclose(
        mm.error_rate(apply, None, logits, labels, batch_size=2), np.mean(np.argmax(logits, -1) != labels)
    )
    # least squares by Adam with lax.scan epochs converges to the normal-equations solution
    import optax

    X = jnp.asarray(rng(7).normal(size=(64, 3)))
    y = X @ jnp.array([1.0, -2.0, 0.5])
    loss = lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2)
    opt = optax.adam(0.05)
    fit = lambda epochs, batch_size: mm.train_epochs(
        jax.random.PRNGKey(0),
        jnp.zeros(3),
        opt.init(jnp.zeros(3)),
        (X, y),
        loss_fn=loss,
        optimizer=opt,
        epochs=epochs,
        batch_size=batch_size,
    )
    w, _, losses = fit(200, 16)
    np.testing.assert_allclose(w, [1.0, -2.0, 0.5], atol=1e-3)
    assert losses.shape == (200,) and float(losses[-1]) < float(losses[0])
    with pytest.raises(mg.GeometryError, match="exceeds the 64 training examples"):
        fit(1, 100)


# ------------------------------------------------------------------ wrong timm checkpoints


def _timm_sd(heads=3):
    c = TOY._replace(heads=heads)
    params = randomized_params(c, seed=5)
    return c, params, to_timm_state_dict(params, c)


def _assert_same_params(a, b):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(x, y), a, b)


def test_converter_unwraps_training_checkpoints_and_key_prefixes():
    c, params, sd = _timm_sd()
    for wrapped in (
        {"state_dict": sd, "epoch": 3, "arch": "vit_tiny"},  # timm's train.py checkpoints
        {"model": sd, "optimizer": {}, "epoch": 3},  # DeiT's
        {"model": {"state_dict": sd}},
        {f"module.{k}": v for k, v in sd.items()},  # DistributedDataParallel
        {"state_dict": {f"_orig_mod.{k}": v for k, v in sd.items()}},  # torch.compile
    ):
        back, cfg = mm.vit_from_timm(wrapped, heads=3, dtype=jnp.float64)
        assert cfg == c
        _assert_same_params(back, params)


def test_converter_lists_a_few_missing_and_unexpected_keys_with_their_count():
    _, _, sd = _timm_sd()
    broken = {k: v for k, v in sd.items() if not k.startswith("blocks.0.")}  # 12 keys gone
    broken.update({f"blocks.{i}.attn.q_norm.weight": np.ones(4) for i in range(2)})
    with pytest.raises(mg.GeometryError) as err:
        mm.vit_from_timm(broken, heads=3)
    msg = str(err.value)
    assert "missing keys (12): ['blocks.0.norm1.weight'" in msg and "... and 4 more" in msg
    assert "unexpected keys (2): ['blocks.0.attn.q_norm.weight', 'blocks.1.attn.q_norm.weight']" in msg
    assert "timm's VisionTransformer layout" in msg and "8 + 12 * depth keys" in msg
    # block indices that are not numbers are unexpected keys, not a ValueError
    odd = dict(sd, **{"blocks.x.norm1.weight": np.ones(12)})
    with pytest.raises(mg.GeometryError, match=r"unexpected keys \(1\): \['blocks.x.norm1.weight'\]"):
        mm.vit_from_timm(odd, heads=3)


@pytest.mark.parametrize(
    "key, shape, expected",
    [
        ("blocks.0.attn.qkv.weight", (10, 12), "(36, 12)"),
        ("blocks.1.attn.qkv.bias", (35,), "(36,)"),
        ("blocks.0.attn.proj.weight", (12, 13), "(12, 12)"),
        ("blocks.1.norm1.weight", (13,), "(12,)"),
        ("blocks.1.mlp.fc1.weight", (30, 12), "(16, 12)"),
        ("cls_token", (1, 1, 7), "(1, 1, 12)"),
        ("head.weight", (5,), "(5, 12)"),
    ],
)
def test_converter_reports_wrong_shapes(key, shape, expected):
    _, _, sd = _timm_sd()
    broken = dict(sd, **{key: np.ones(shape)})
    with pytest.raises(mg.GeometryError, match="do not fit the width") as err:
        mm.vit_from_timm(broken, heads=3)
    assert f"{key} {shape} (expected {expected})" in str(err.value)


def test_converter_rejects_non_mappings_bad_kernels_and_bad_heads():
    _, _, sd = _timm_sd()
    with pytest.raises(mg.GeometryError, match="expected a state dict.*got list"):
        mm.vit_from_timm([("cls_token", np.ones(3))])
    with pytest.raises(mg.GeometryError, match=r"4-D convolution kernel"):
        mm.vit_from_timm(dict(sd, **{"patch_embed.proj.weight": np.ones((12, 1, 4))}), heads=3)
    with pytest.raises(mg.GeometryError, match="divisible by heads=0"):
        mm.vit_from_timm(sd, heads=0)
    with pytest.raises(mg.GeometryError, match="heads must be an integer"):
        mm.vit_from_timm(sd, heads=3.0)
    with pytest.raises(mg.GeometryError, match="not numeric arrays"):
        mm.vit_from_timm(dict(sd, **{"cls_token": "zeros"}), heads=3)
    # numpy integers and 0-d arrays are integers
    _, cfg = mm.vit_from_timm(sd, heads=np.int64(3))
    assert cfg.heads == 3 and type(cfg.heads) is int
    _, cfg = mm.vit_from_timm(sd, heads=jnp.asarray(3), ln_eps=np.float32(1e-6))
    assert cfg.heads == 3 and type(cfg.ln_eps) is float


def test_loader_reports_unreadable_npz_files(tmp_path):
    _, params, sd = _timm_sd()
    # a nested dict saved with np.savez is an object array: pickled, not loadable safely
    np.savez(tmp_path / "nested.npz", state_dict=np.array(sd, dtype=object))
    with pytest.raises(mg.GeometryError, match=r"pickled.*np.savez\(path, \*\*state_dict\)"):
        mm.load_timm_checkpoint(tmp_path / "nested.npz")
    (tmp_path / "garbage.npz").write_bytes(b"not a zip file")
    with pytest.raises(mg.GeometryError, match="is not a flat .npz state dict"):
        mm.load_timm_checkpoint(tmp_path / "garbage.npz")
    # a prefixed flat .npz loads and converts
    np.savez(tmp_path / "ddp.npz", **{f"module.{k}": v for k, v in sd.items()})
    back, _ = mm.vit_from_timm(mm.load_timm_checkpoint(tmp_path / "ddp.npz"), heads=3, dtype=jnp.float64)
    _assert_same_params(back, params)


def test_loader_reads_wrapped_torch_checkpoints(tmp_path):
    torch = pytest.importorskip("torch")
    _, params, sd = _timm_sd()
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}
    torch.save({"model": tensors, "epoch": 3}, tmp_path / "deit.pth")
    torch.save({"state_dict": tensors}, tmp_path / "timm.pth")
    for name in ("deit.pth", "timm.pth"):
        loaded = mm.load_timm_checkpoint(tmp_path / name)
        assert sorted(loaded) == sorted(sd)
        back, _ = mm.vit_from_timm(loaded, heads=3, dtype=jnp.float64)
        _assert_same_params(back, params)
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(mg.GeometryError, match="could not read"):
        mm.load_timm_checkpoint(tmp_path / "bad.pt")


def test_loader_reads_safetensors(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    _, params, sd = _timm_sd()
    path = tmp_path / "w.safetensors"
    safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(path))
    back, _ = mm.vit_from_timm(mm.load_timm_checkpoint(path), heads=3, dtype=jnp.float64)
    _assert_same_params(back, params)
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(mg.GeometryError, match="could not read"):
        mm.load_timm_checkpoint(tmp_path / "bad.safetensors")


# ------------------------------------------------------------------ OpenCLIP checkpoints


def to_open_clip_state_dict(params, c):
    """Write minigeo's layout in OpenCLIP's VisionTransformer names (model.visual.state_dict())."""
    P = jax.tree_util.tree_map(np.asarray, params)
    d, p, C = c.width, c.patch_size, c.channels
    sd = {
        "class_embedding": P["cls_token"],
        "positional_embedding": P["pos_embed"],
        "proj": P["head"]["kernel"],
        "conv1.weight": P["patch_embed"]["kernel"].reshape(p, p, C, d).transpose(3, 2, 0, 1),
        "ln_post.weight": P["ln_final"]["scale"],
        "ln_post.bias": P["ln_final"]["bias"],
    }
    if c.pre_norm:
        sd["ln_pre.weight"], sd["ln_pre.bias"] = P["ln_pre"]["scale"], P["ln_pre"]["bias"]
    fused = lambda W: np.concatenate([w.T for w in W], axis=0)  # heads of (d, dh) -> (d, d) rows
    for i in range(c.depth):
        b = jax.tree_util.tree_map(lambda x: x[i], P["blocks"])
        a, pre = b["attn"], f"transformer.resblocks.{i}."
        sd[pre + "attn.in_proj_weight"] = np.concatenate([fused(a["W_q"]), fused(a["W_k"]), fused(a["W_v"])])
        sd[pre + "attn.in_proj_bias"] = np.concatenate([a[n].reshape(-1) for n in ("b_q", "b_k", "b_v")])
        sd[pre + "attn.out_proj.weight"] = np.concatenate(list(a["W_o"]), axis=1)
        sd[pre + "attn.out_proj.bias"] = a["b_o"]
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            sd[pre + theirs + ".weight"], sd[pre + theirs + ".bias"] = b[ours]["scale"], b[ours]["bias"]
        for ours, theirs in (("fc1", "c_fc"), ("fc2", "c_proj")):
            sd[pre + f"mlp.{theirs}.weight"] = b["mlp"][ours]["kernel"].T
            sd[pre + f"mlp.{theirs}.bias"] = b["mlp"][ours]["bias"]
    return sd


def _open_clip_sd(pre_norm=True):
    c = OPEN_CLIP_TOY._replace(pre_norm=pre_norm)
    params = randomized_params(c, seed=9)
    return c, params, to_open_clip_state_dict(params, c)


def test_open_clip_converter_inverts_the_layout():
    c, params, sd = _open_clip_sd()
    assert len(sd) == 8 + 12 * c.depth
    back, cfg = mm.vit_from_open_clip(sd, act="quick_gelu", heads=3, dtype=jnp.float64)
    assert cfg == c
    _assert_same_params(back, params)
    assert len(mm.vit_symmetry_spec(back).pairs) == 2
    # a full CLIP state dict: the image tower under "visual.", the text tower (same names) ignored
    text = {
        k: np.zeros(1) for k in ("positional_embedding", "transformer.resblocks.0.ln_1.weight", "logit_scale")
    }
    full = {**text, **{f"visual.{k}": v for k, v in sd.items()}, "text_projection": np.ones((4, 6))}
    for wrapped in (
        full,
        {f"module.{k}": v for k, v in full.items()},  # DistributedDataParallel
        {"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in full.items()}},  # OpenCLIP's
    ):
        back, cfg = mm.vit_from_open_clip(wrapped, act="quick_gelu", heads=3, dtype=jnp.float64)
        assert cfg == c
        _assert_same_params(back, params)
    # act, eps, heads: not in the state dict, from the arguments; heads default width // 64
    _, cfg = mm.vit_from_open_clip(sd, act="gelu", ln_eps=1e-6, heads=np.int64(4))
    assert (cfg.gelu, cfg.ln_eps, cfg.heads) == ("exact", 1e-6, 4)
    with pytest.raises(mg.GeometryError, match="width 12 is not divisible by heads=0"):
        mm.vit_from_open_clip(sd, act="gelu")  # 12 // 64 = 0
    # a tower built with no_ln_pre has no ln_pre keys: pre_norm is off
    c0, params0, sd0 = _open_clip_sd(pre_norm=False)
    back0, cfg0 = mm.vit_from_open_clip(sd0, act="quick_gelu", heads=3, dtype=jnp.float64)
    assert cfg0 == c0 and not cfg0.pre_norm and "ln_pre" not in back0
    _assert_same_params(back0, params0)


def test_open_clip_converter_names_missing_and_unexpected_keys():
    _, _, sd = _open_clip_sd()
    broken = dict(sd)
    del broken["transformer.resblocks.1.mlp.c_proj.bias"], broken["ln_pre.bias"]
    broken["transformer.resblocks.0.ls_1.gamma"] = np.ones(12)  # LayerScale
    broken["attn_pool.query"] = np.ones((4, 12))  # CoCa's attentional pooler
    with pytest.raises(ValueError) as err:  # a GeometryError
        mm.vit_from_open_clip(broken, act="gelu", heads=3)
    msg = str(err.value)
    assert "missing keys (2): ['ln_pre.bias', 'transformer.resblocks.1.mlp.c_proj.bias']" in msg
    assert "unexpected keys (2): ['attn_pool.query', 'transformer.resblocks.0.ls_1.gamma']" in msg
    assert (
        "an attentional pooler" in msg
        and "LayerScale" in msg
        and "OpenCLIP's VisionTransformer layout" in msg
    )
    with pytest.raises(mg.GeometryError, match=r"no transformer.resblocks"):
        mm.vit_from_open_clip({k: v for k, v in sd.items() if "resblocks" not in k}, act="gelu", heads=3)


def test_open_clip_converter_rejects_other_checkpoints_and_settings():
    _, _, sd = _open_clip_sd()
    _, _, timm_sd = _timm_sd()
    with pytest.raises(mg.GeometryError, match="not an OpenCLIP VisionTransformer state dict"):
        mm.vit_from_open_clip(timm_sd, act="gelu")
    with pytest.raises(mg.GeometryError, match="ModifiedResNet"):
        mm.vit_from_open_clip({"visual.layer1.0.conv1.weight": np.ones((2, 2, 1, 1))}, act="gelu")
    with pytest.raises(mg.GeometryError, match="timm-backed tower"):
        mm.vit_from_open_clip({"visual.trunk.cls_token": np.ones((1, 1, 2))}, act="gelu")
    with pytest.raises(mg.GeometryError, match="act must be one of"):
        mm.vit_from_open_clip(sd, act="relu", heads=3)
    with pytest.raises(TypeError, match="act"):  # the activation is not in the weights: no default
        mm.vit_from_open_clip(sd, heads=3)
    with pytest.raises(mg.GeometryError, match="pool_type='avg' is not supported"):
        mm.vit_from_open_clip(sd, act="gelu", heads=3, pool_type="avg")
    with pytest.raises(mg.GeometryError, match="heads must be an integer"):
        mm.vit_from_open_clip(sd, act="gelu", heads=3.0)
    with pytest.raises(mg.GeometryError, match="square number of tokens"):  # 1 + 16 tokens -> 1 + 15
        mm.vit_from_open_clip(
            dict(sd, positional_embedding=sd["positional_embedding"][:-1]), act="gelu", heads=3
        )
    with pytest.raises(mg.GeometryError, match=r"4-D convolution kernel"):
        mm.vit_from_open_clip(dict(sd, **{"conv1.weight": np.ones((12, 3, 2))}), act="gelu", heads=3)
    with pytest.raises(mg.GeometryError, match="expected a state dict"):
        mm.vit_from_open_clip([("proj", np.ones(3))], act="gelu")


@pytest.mark.parametrize(
    "key, shape, expected",
    [
        ("transformer.resblocks.0.attn.in_proj_weight", (30, 12), "(36, 12)"),
        ("transformer.resblocks.1.attn.in_proj_bias", (12,), "(36,)"),
        ("transformer.resblocks.0.attn.out_proj.weight", (12, 13), "(12, 12)"),
        ("transformer.resblocks.1.mlp.c_proj.weight", (12, 17), "(12, 16)"),
        ("class_embedding", (1, 12), "(12,)"),
        ("ln_pre.weight", (13,), "(12,)"),
        ("proj", (6,), "(12, 6)"),
    ],
)
def test_open_clip_converter_reports_wrong_shapes(key, shape, expected):
    _, _, sd = _open_clip_sd()
    with pytest.raises(mg.GeometryError, match="do not fit the width") as err:
        mm.vit_from_open_clip(dict(sd, **{key: np.ones(shape)}), act="gelu", heads=3)
    assert f"{key} {shape} (expected {expected})" in str(err.value)


# ---------------------------------------------------------------------------
# vit_apply's hand-written derivatives (custom JVP rules of LayerNorm and the exact GELU) against
# autodiff through the plain formulas
# ---------------------------------------------------------------------------
def plain_vit_apply(params, images, c):
    """vit_apply as first written: LayerNorm and GELU as plain formulas, derivatives traced by JAX."""

    def ln(x, p):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + c.ln_eps) * p["scale"] + p["bias"]

    def mha(x, a):
        q = jnp.einsum("btd,hde->bhte", x, a["W_q"]) + a["b_q"][:, None, :]
        k = jnp.einsum("btd,hde->bhte", x, a["W_k"]) + a["b_k"][:, None, :]
        v = jnp.einsum("btd,hde->bhte", x, a["W_v"]) + a["b_v"][:, None, :]
        scores = jnp.einsum("bhte,bhse->bhts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], x.dtype))
        mixed = jnp.einsum("bhts,bhse->bhte", jax.nn.softmax(scores, axis=-1), v)
        return jnp.einsum("bhte,hde->btd", mixed, a["W_o"]) + a["b_o"]

    if c.gelu == "quick":
        gelu = lambda u: u * jax.nn.sigmoid(1.702 * u)
    else:
        gelu = lambda u: jax.nn.gelu(u, approximate=c.gelu == "tanh")
    dtype = params["pos_embed"].dtype
    x = mm.vit.patchify(images.astype(dtype), c.patch_size) @ params["patch_embed"]["kernel"]
    if c.patch_bias:
        x = x + params["patch_embed"]["bias"]
    cls = jnp.broadcast_to(params["cls_token"], (x.shape[0], 1, c.width))
    x = jnp.concatenate([cls, x], axis=1) + params["pos_embed"]
    if c.pre_norm:
        x = ln(x, params["ln_pre"])

    def block(z, p):
        z = z + mha(ln(z, p["ln1"]), p["attn"])
        y = gelu(ln(z, p["ln2"]) @ p["mlp"]["fc1"]["kernel"] + p["mlp"]["fc1"]["bias"])
        return z + y @ p["mlp"]["fc2"]["kernel"] + p["mlp"]["fc2"]["bias"], None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    x = ln(x[:, 0], params["ln_final"]) @ params["head"]["kernel"]
    return x + params["head"]["bias"] if c.head_bias else x


def _derivatives(apply, c, params, images, v, w, labels):
    """Logits, gradient, HVP, a third-order product, a JVP and a VJP of ``apply`` (one jitted call)."""

    def loss(p):
        z = apply(p, images, c)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], axis=1))

    hvp = lambda p, u: jax.jvp(jax.grad(loss), (p,), (u,))[1]
    f = lambda p: apply(p, images, c)
    z, jv = jax.jvp(f, (params,), (v,))
    out = {
        "logits": z,
        "grad": jax.grad(loss)(params),
        "hvp": hvp(params, v),
        "third": jax.jvp(lambda p: hvp(p, v), (params,), (w,))[1],
        "jvp": jv,
        "vjp": jax.vjp(f, params)[1](jnp.cos(z))[0],
    }
    return out


@pytest.mark.parametrize(
    "config, dtype",
    [(TOY, jnp.float64), (TOY, jnp.float32), (OPEN_CLIP_TOY, jnp.float64)],
    ids=["exact-float64", "exact-float32", "open_clip-float64"],
)
def test_derivatives_match_autodiff_of_the_plain_formulas(config, dtype):
    params = randomized_params(config, seed=3, dtype=dtype)
    images = jnp.asarray(rng(4).normal(size=(6, 8, 8, config.channels)), dtype)
    labels = jnp.asarray(rng(5).integers(0, config.num_classes, size=6))
    r = rng(6)
    v = jax.tree_util.tree_map(lambda x: jnp.asarray(r.normal(size=x.shape), dtype), params)
    w = jax.tree_util.tree_map(lambda x: jnp.asarray(r.normal(size=x.shape), dtype), params)
    args = (params, images, v, w, labels)
    got = jax.jit(_derivatives, static_argnums=(0, 1))(mm.vit_apply, config, *args)
    want = jax.jit(_derivatives, static_argnums=(0, 1))(plain_vit_apply, config, *args)
    # forward pass: bit for bit the same formulas
    np.testing.assert_array_equal(got["logits"], want["logits"])
    tol = 1e-12 if dtype == jnp.float64 else 32 * float(jnp.finfo(dtype).eps)
    for name in ("grad", "hvp", "third", "jvp", "vjp"):
        g = np.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(got[name])])
        h = np.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(want[name])])
        rel = np.max(np.abs(g - h)) / np.max(np.abs(h))
        assert rel < tol, (name, rel)


def test_layer_norm_and_gelu_derivatives_against_finite_differences():
    # the custom JVP rules on their own, against central differences in float64
    x = jnp.asarray(rng(9).normal(size=(3, 5, 7)))
    s, b = jnp.asarray(rng(10).normal(size=7)), jnp.asarray(rng(11).normal(size=7))
    dx, ds, db = (jnp.asarray(rng(12 + i).normal(size=a.shape)) for i, a in enumerate((x, s, b)))
    f = lambda x, s, b: mm.vit._layer_norm(x, {"scale": s, "bias": b}, 1e-6)
    g = lambda x, s, b: mm.vit._gelu_exact(f(x, s, b))
    h = 1e-5
    for fn in (f, g):
        fd = (fn(x + h * dx, s + h * ds, b + h * db) - fn(x - h * dx, s - h * ds, b - h * db)) / (2 * h)
        jv = jax.jvp(fn, (x, s, b), (dx, ds, db))[1]
        np.testing.assert_allclose(jv, fd, rtol=1e-7, atol=1e-8)
        # second directional derivative
        d2 = jax.jvp(lambda x, s, b: jax.jvp(fn, (x, s, b), (dx, ds, db))[1], (x, s, b), (dx, ds, db))[1]
        plus, minus = fn(x + h * dx, s + h * ds, b + h * db), fn(x - h * dx, s - h * ds, b - h * db)
        fd2 = (plus - 2 * fn(x, s, b) + minus) / h**2
        np.testing.assert_allclose(d2, fd2, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_move_along_symmetries_keeps_the_function_and_the_pair_products(dtype):
    """mm.vit_move_along_symmetries: the logits are unchanged (float64 to 1e-9, float32 to a few
    hundred eps times the condition numbers), W_q W_k^T and W_v W_o^T are unchanged per head while
    the leaves move, and wrong group-element shapes are refused."""
    c = TOY
    params = randomized_params(c, seed=5, dtype=dtype)
    r = rng(6)
    shape = (c.depth, c.heads)
    group = lambda s: jnp.asarray(
        np.stack([random_invertible(r, c.head_dim) * s for _ in range(math.prod(shape))]).reshape(
            shape + (c.head_dim, c.head_dim)
        ),
        dtype,
    )
    A_qk, A_vo = group(2.0), group(0.5)
    d_ln2 = jnp.asarray(r.uniform(0.3, 3.0, size=(c.depth, c.width)), dtype)
    d_final = jnp.asarray(r.uniform(0.3, 3.0, size=c.width), dtype)
    moved = mm.vit_move_along_symmetries(params, A_qk, A_vo, ln2_scale=d_ln2, final_scale=d_final)
    images = jnp.asarray(r.normal(size=(6, 8, 8, 1)), dtype)
    before, after = mm.vit_apply(params, images, c), mm.vit_apply(moved, images, c)
    cond = float(np.max(np.linalg.cond(np.asarray(A_qk, np.float64)))) * float(
        np.max(np.linalg.cond(np.asarray(A_vo, np.float64)))
    )
    tol = 1e-9 if dtype == jnp.float64 else 300 * float(jnp.finfo(dtype).eps) * cond
    np.testing.assert_allclose(after, before, rtol=tol, atol=tol * float(jnp.max(jnp.abs(before))))
    a, m = params["blocks"]["attn"], moved["blocks"]["attn"]
    T = lambda M: jnp.swapaxes(M, -1, -2)
    for G, H in (("W_q", "W_k"), ("W_v", "W_o")):
        np.testing.assert_allclose(m[G] @ T(m[H]), a[G] @ T(a[H]), rtol=tol, atol=tol)
        assert float(jnp.max(jnp.abs(m[G] - a[G]))) > 0.1  # the leaves did move
    with pytest.raises(mg.GeometryError, match="A_vo has shape"):
        mm.vit_move_along_symmetries(params, A_qk, A_vo[..., :2, :2])
    with pytest.raises(mg.GeometryError, match="ln2_scale has shape"):
        mm.vit_move_along_symmetries(params, A_qk, A_vo, ln2_scale=d_final)


def test_vit_dense_params_splits_the_matrix_products_from_the_rest_and_merges_back():
    """The dense parameters are exactly the weights and biases of the matrix products (the patch
    embedding, the per-head projections, the MLP, the head; listed here by hand); merge puts them back (the same tree, the same values), and a
    changed dense parameter changes the model while the others stay as they were."""
    params = mm.init_vit(jax.random.PRNGKey(3), TOY)
    params = jax.tree_util.tree_map(lambda x: x + 0.1 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), params)
    dense, merge = mm.vit_dense_params(params)
    attn = [("blocks", "attn", k) for k in ("W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o")]
    mlp = [("blocks", "mlp", f, k) for f in ("fc1", "fc2") for k in ("kernel", "bias")]
    assert set(dense) == {("patch_embed", "kernel"), ("patch_embed", "bias"), *attn, *mlp,
                          ("head", "kernel"), ("head", "bias")}
    back = merge(dense)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        assert a is b
    changed = {**dense, ("head", "bias"): dense[("head", "bias")] + 1.0}
    images = jax.random.normal(jax.random.PRNGKey(4), (2, TOY.image_size, TOY.image_size, TOY.channels))
    np.testing.assert_allclose(mm.vit_apply(merge(changed), images, TOY), mm.vit_apply(params, images, TOY) + 1.0,
                               rtol=1e-6, atol=1e-6)
    assert merge(changed)["cls_token"] is params["cls_token"]

r"""Converters from timm and OpenCLIP checkpoints to :mod:`minigeo.models.vit`'s parameter layout (chapter 7).

* :func:`load_timm_checkpoint` reads a timm checkpoint file (``.safetensors``, ``.npz`` or a PyTorch
  file) into a ``{name: numpy array}`` state dict, without network access;
* :func:`vit_from_timm` converts such a state dict (timm's ``VisionTransformer`` layout, e.g.
  ``vit_base_patch32_224``) into ``(params, config)``;
* :func:`vit_from_open_clip` converts an OpenCLIP image tower (e.g. CLIP ViT-B/32).

Every converter reads the sizes off a few arrays, checks every array's shape against them, splits
the fused attention weights into the per-head layout of :func:`~minigeo.models.init_vit`, and names
the offending keys in a :class:`~minigeo.GeometryError` when something does not fit.
"""

from __future__ import annotations

import math
import operator
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import GeometryError
from .._tree import PyTree
from .vit import ViTConfig, init_vit

__all__ = ["vit_from_timm", "vit_from_open_clip", "load_timm_checkpoint"]


# ---------------------------------------------------------------------------
# timm checkpoints
# ---------------------------------------------------------------------------
def _timm_keys(depth: int) -> list[str]:
    keys = ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    for i in range(depth):
        for name in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            keys += [f"blocks.{i}.{name}.weight", f"blocks.{i}.{name}.bias"]
    return keys + ["norm.weight", "norm.bias", "head.weight", "head.bias"]


def _numeric_arrays(sd: dict, where: str, layout: str) -> dict:
    """The state dict's values as numpy arrays; a GeometryError naming the keys whose values are not numeric arrays."""
    try:
        sd = {k: _to_numpy(v) for k, v in sd.items()}
    except Exception as err:
        raise GeometryError(f"{where}: a value is not an array ({type(err).__name__}: {err}).") from err
    not_arrays = [k for k, v in sd.items() if not np.issubdtype(v.dtype, np.number)]
    if not_arrays:
        raise GeometryError(
            f"{where}: {len(not_arrays)} value(s) are not numeric arrays: {_few(not_arrays)}. {layout}."
        )
    return sd


def _check_shapes(sd: dict, keys, want: dict, where: str, read_off: str, layout: str) -> None:
    """A GeometryError listing the arrays whose shapes do not fit the sizes read off a few of them."""
    wrong = [k for k in keys if tuple(sd[k].shape) != want[k]]
    if wrong:
        raise GeometryError(
            f"{where}: {len(wrong)} array(s) have shapes that do not fit the {read_off}: "
            + ", ".join(f"{k} {tuple(sd[k].shape)} (expected {want[k]})" for k in wrong[:6])
            + (f" ... and {len(wrong) - 6} more" if len(wrong) > 6 else "")
            + f". {layout}."
        )


def _heads_or_default(heads: Any, width: int, where: str) -> int:
    """``heads`` as a Python int (a Python int, numpy integer or 0-d integer array), or ``width // 64`` when None."""
    if heads is None:
        return width // 64
    try:
        return operator.index(heads)
    except TypeError:
        raise GeometryError(f"{where}: heads must be an integer, got {heads!r}.") from None


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; no torch import needed
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # numpy has no bfloat16: widen (exactly) to float32
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


_TIMM_LAYOUT = (
    "timm's VisionTransformer layout (e.g. vit_base_patch32_224) is: cls_token (1, 1, d), pos_embed "
    "(1, 1 + (image/patch)**2, d), patch_embed.proj.weight (d, C, p, p) and .bias (d,), for every block i "
    "blocks.{i}.norm1 (d,), .attn.qkv (3d, d), .attn.proj (d, d), .norm2 (d,), .mlp.fc1 (mlp, d), "
    ".mlp.fc2 (d, mlp), each with .weight and .bias, then norm (d,) and head (classes, d): "
    "8 + 12 * depth keys"
)
_WRAPPER_KEYS = ("state_dict", "model", "module", "model_state_dict")
_KEY_PREFIXES = ("module.", "_orig_mod.", "model.")


def _few(keys: list[str], n: int = 8) -> str:
    """``keys`` as a list repr, cut after ``n`` entries."""
    return f"{list(keys[:n])}{f' ... and {len(keys) - n} more' if len(keys) > n else ''}"


def _unwrap_state_dict(
    state_dict: Any, where: str, markers: tuple[str, ...] = ("patch_embed.proj.weight",)
) -> dict[str, Any]:
    """The flat ``{name: tensor}`` dict inside a checkpoint: unwrap ``{'state_dict': ...}``/``{'model': ...}``
    (timm's and DeiT's training checkpoints) and strip a prefix every key shares (``module.`` from
    DistributedDataParallel, ``_orig_mod.`` from ``torch.compile``)."""
    if not isinstance(state_dict, Mapping):
        raise GeometryError(
            f"{where}: expected a state dict (a mapping from parameter names to arrays), got "
            f"{type(state_dict).__name__}. Pass model.state_dict() or the result of load_timm_checkpoint."
        )
    sd = dict(state_dict)
    for _ in range(3):  # nested wrappers, e.g. {'model': {'state_dict': ...}}
        if any(m in sd for m in markers):
            break
        inner = next((sd[k] for k in _WRAPPER_KEYS if isinstance(sd.get(k), Mapping)), None)
        if inner is None:
            break
        sd = dict(inner)
    for prefix in _KEY_PREFIXES:
        if sd and all(isinstance(k, str) and k.startswith(prefix) for k in sd):
            sd = {k[len(prefix) :]: v for k, v in sd.items()}
    bad = [k for k in sd if not isinstance(k, str)]
    if bad:
        raise GeometryError(f"{where}: state dict keys must be strings, got {_few([repr(k) for k in bad])}.")
    return sd


def _expected_timm_shapes(sd: Mapping[str, np.ndarray], depth: int) -> dict[str, tuple[int, ...]]:
    """Every timm key's shape implied by the patch kernel (d, C, p, p), pos_embed, fc1 and head."""
    d, C, p, _ = sd["patch_embed.proj.weight"].shape
    n_tokens = sd["pos_embed"].shape[-2] if sd["pos_embed"].ndim >= 2 else 0
    fc1 = sd.get("blocks.0.mlp.fc1.weight")
    m = fc1.shape[0] if fc1 is not None and fc1.ndim >= 1 else 4 * d
    head = sd.get("head.weight")
    k = head.shape[0] if head is not None and head.ndim >= 1 else 0
    shapes = {
        "cls_token": (1, 1, d),
        "pos_embed": (1, n_tokens, d),
        "patch_embed.proj.weight": (d, C, p, p),
        "patch_embed.proj.bias": (d,),
        "norm.weight": (d,),
        "norm.bias": (d,),
        "head.weight": (k, d),
        "head.bias": (k,),
    }
    per_block = {
        "norm1": ((d,), (d,)),
        "attn.qkv": ((3 * d, d), (3 * d,)),
        "attn.proj": ((d, d), (d,)),
        "norm2": ((d,), (d,)),
        "mlp.fc1": ((m, d), (m,)),
        "mlp.fc2": ((d, m), (d,)),
    }
    for i in range(depth):
        for name, (w, b) in per_block.items():
            shapes[f"blocks.{i}.{name}.weight"], shapes[f"blocks.{i}.{name}.bias"] = w, b
    return shapes


# minigeo's per-block leaves <- the checkpoint's per-block names ("{}" is the block index)
_TIMM_BLOCK_NAMES = {
    "ln1": "blocks.{}.norm1",
    "qkv.weight": "blocks.{}.attn.qkv.weight",
    "qkv.bias": "blocks.{}.attn.qkv.bias",
    "out": "blocks.{}.attn.proj",
    "ln2": "blocks.{}.norm2",
    "fc1": "blocks.{}.mlp.fc1",
    "fc2": "blocks.{}.mlp.fc2",
}
_OPEN_CLIP_BLOCK_NAMES = {
    "ln1": "transformer.resblocks.{}.ln_1",
    "qkv.weight": "transformer.resblocks.{}.attn.in_proj_weight",
    "qkv.bias": "transformer.resblocks.{}.attn.in_proj_bias",
    "out": "transformer.resblocks.{}.attn.out_proj",
    "ln2": "transformer.resblocks.{}.ln_2",
    "fc1": "transformer.resblocks.{}.mlp.c_fc",
    "fc2": "transformer.resblocks.{}.mlp.c_proj",
}


def _convert_blocks(
    sd: Mapping[str, np.ndarray], names: Mapping[str, str], depth: int, d: int, heads: int
) -> dict[str, Any]:
    """The stacked ``blocks`` subtree from torch-layout blocks (``nn.Linear`` weights are ``W^T``).

    The fused (3d, d) query/key/value weight holds rows ``[q | k | v]`` in blocks of ``d``, head
    ``i`` at rows ``i·dh … (i+1)·dh`` of each block (timm's ``attn.qkv`` and
    ``nn.MultiheadAttention``'s ``in_proj_weight`` alike); the output projection's columns
    ``i·dh … (i+1)·dh`` become ``W_o^i``.
    """
    dh = d // heads

    def stack(name: str, fn=np.asarray) -> np.ndarray:
        return np.stack([fn(sd[name.format(i)]) for i in range(depth)])

    def qkv(which: int) -> tuple[np.ndarray, np.ndarray]:
        def weight(wt):  # (3d, d) -> (heads, d_in, dh)
            return wt[which * d : (which + 1) * d].reshape(heads, dh, d).transpose(0, 2, 1)

        def bias(b):
            return b[which * d : (which + 1) * d].reshape(heads, dh)

        return stack(names["qkv.weight"], weight), stack(names["qkv.bias"], bias)

    def ln(name: str) -> dict[str, np.ndarray]:
        return {"scale": stack(names[name] + ".weight"), "bias": stack(names[name] + ".bias")}

    def linear(name: str) -> dict[str, np.ndarray]:
        return {"kernel": stack(names[name] + ".weight", np.transpose), "bias": stack(names[name] + ".bias")}

    (Wq, bq), (Wk, bk), (Wv, bv) = qkv(0), qkv(1), qkv(2)
    return {
        "ln1": ln("ln1"),
        "attn": {
            "W_q": Wq,
            "b_q": bq,
            "W_k": Wk,
            "b_k": bk,
            "W_v": Wv,
            "b_v": bv,
            "W_o": stack(names["out"] + ".weight", lambda wt: wt.reshape(d, heads, dh).transpose(1, 0, 2)),
            "b_o": stack(names["out"] + ".bias"),
        },
        "ln2": ln("ln2"),
        "mlp": {"fc1": linear("fc1"), "fc2": linear("fc2")},
    }


def _checked_params(params: PyTree, config: ViTConfig, dtype: Any, where: str) -> tuple[PyTree, ViTConfig]:
    """``(params as dtype, config)`` after checking the converted tree against :func:`init_vit`'s shapes."""
    ref_shapes = jax.eval_shape(lambda k: init_vit(k, config), jax.random.PRNGKey(0))
    got = jax.tree_util.tree_map(np.shape, params)
    want = jax.tree_util.tree_map(lambda s: s.shape, ref_shapes)
    if got != want:
        raise GeometryError(f"{where}: converted shapes {got} differ from the config's {want}.")
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params), config


def vit_from_timm(
    state_dict: Mapping[str, Any],
    *,
    heads: int | None = None,
    ln_eps: float = 1e-6,
    gelu: str = "exact",
    dtype: Any = jnp.float32,
) -> tuple[PyTree, ViTConfig]:
    r"""Convert a timm ``VisionTransformer`` state dict (e.g. ``vit_base_patch32_224``) to minigeo's layout.

    .. math:: W_q^i = (\mathtt{qkv.weight}[i d_h : (i+1) d_h])^\top,\qquad W_o^i = (\mathtt{proj.weight}[:, i d_h : (i+1) d_h])^\top,

    and likewise :math:`W_k^i, W_v^i` from the second and third blocks of ``d`` rows of ``qkv.weight``.

    Parameters
    ----------
    state_dict : mapping
        A timm ``VisionTransformer`` state dict.  Values may be numpy arrays or torch tensors
        (converted without importing torch); e.g. ``vit_from_timm(timm.create_model(name).state_dict())``.
        A training checkpoint's wrapper (``{'state_dict': ...}``, ``{'model': ...}``) is unwrapped, and a
        prefix shared by every key (``module.`` from DistributedDataParallel, ``_orig_mod.`` from
        ``torch.compile``) is stripped.
    heads : int, optional
        Number of attention heads; not visible in the shapes, defaults to ``width // 64`` (timm's ViTs
        use heads of 64).
    ln_eps : float, optional
        LayerNorm epsilon.
    gelu : {"exact", "tanh", "quick"}, optional
        The MLP's activation (see :class:`~minigeo.models.ViTConfig`).
    dtype : dtype, optional
        dtype of the returned parameters.

    Returns
    -------
    tuple
        ``(params, config)``: the parameter pytree and its :class:`~minigeo.models.ViTConfig`.

    Raises
    ------
    GeometryError
        If keys are missing or unexpected (the message gives their count and the first few), or
        an array's shape does not fit the width, patch size and MLP size read off the others (the
        message lists the arrays with their expected shapes and describes timm's layout).

    Notes
    -----
    The fused ``attn.qkv.weight`` (3d, d) holds rows ``[q | k | v]`` in blocks of ``d``, head
    ``i`` at rows ``i·dh … (i+1)·dh`` of each block; it is split per head (and transposed, since
    torch stores ``W^T``).  ``attn.proj.weight``'s columns ``i·dh … (i+1)·dh`` become ``W_o^i``.
    The patch convolution (d, C, p, p) becomes a (p·p·C, d) matrix in (kh, kw, c) order.  The
    depth, width, patch size, image size and classes are read off the shapes.

    Examples
    --------
    >>> import numpy as np
    >>> import minigeo as mg
    >>> import minigeo.models as mm
    >>> try:
    ...     mm.vit_from_timm({"fc.weight": np.ones((2, 2))})
    ... except mg.GeometryError as err:
    ...     print(str(err)[:37])
    vit_from_timm: not a timm VisionTrans
    >>> # with timm installed:
    >>> # sd = timm.create_model("vit_base_patch32_224").state_dict()
    >>> # params, config = mm.vit_from_timm(sd)

    References
    ----------
    No formula from the source papers: a checkpoint converter for the pretrained ViTs of da Silva,
    Dangel & Oore (2025), *Hide & Seek*, Sec. 5.3. Taught in chapter 7, *Capstone: geodesic
    sharpness of vision transformers*.
    """
    sd = _unwrap_state_dict(state_dict, "vit_from_timm")
    if "patch_embed.proj.weight" not in sd or "pos_embed" not in sd:
        raise GeometryError(
            "vit_from_timm: not a timm VisionTransformer state dict (no 'patch_embed.proj.weight' or 'pos_embed'); "
            f"got {len(sd)} keys, {_few(sorted(sd), 12)}. {_TIMM_LAYOUT}."
        )
    sd = _numeric_arrays(sd, "vit_from_timm", _TIMM_LAYOUT)
    if sd["patch_embed.proj.weight"].ndim != 4:
        raise GeometryError(
            f"vit_from_timm: patch_embed.proj.weight has shape {sd['patch_embed.proj.weight'].shape}, expected a "
            f"4-D convolution kernel (d, C, p, p). {_TIMM_LAYOUT}."
        )
    block_ids = [k.split(".")[1] for k in sd if k.startswith("blocks.")]
    depth = 1 + max((int(i) for i in block_ids if i.isdigit()), default=-1)
    expected = _timm_keys(depth)
    missing = [k for k in expected if k not in sd]
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        raise GeometryError(
            "vit_from_timm: the state dict does not match timm's vit_base_patch32_224 layout.\n"
            f"  missing keys ({len(missing)}): {_few(missing)}\n"
            f"  unexpected keys ({len(unexpected)}): {_few(unexpected)}\n"
            "Variants with extra norms (e.g. CLIP's norm_pre or fc_norm), without a class token, or without a "
            f"classifier head (num_classes=0) are not supported. {_TIMM_LAYOUT}."
        )
    _check_shapes(
        sd,
        expected,
        _expected_timm_shapes(sd, depth),
        "vit_from_timm",
        "width, patch and MLP sizes read off patch_embed.proj.weight, pos_embed, blocks.0.mlp.fc1.weight and head.weight",
        _TIMM_LAYOUT,
    )
    d, C, p, _ = sd["patch_embed.proj.weight"].shape
    n_tokens = sd["pos_embed"].shape[-2]
    grid = math.isqrt(n_tokens - 1)
    heads = _heads_or_default(heads, d, "vit_from_timm")
    if grid * grid != n_tokens - 1 or heads <= 0 or d % heads:
        raise GeometryError(
            f"vit_from_timm: pos_embed {sd['pos_embed'].shape} needs 1 + a square number of tokens and width {d} "
            f"divisible by heads={heads}."
        )
    config = ViTConfig(
        image_size=grid * p,
        patch_size=p,
        channels=C,
        num_classes=sd["head.weight"].shape[0],
        width=d,
        depth=depth,
        heads=heads,
        mlp_dim=sd["blocks.0.mlp.fc1.weight"].shape[0] if depth else 4 * d,
        ln_eps=float(ln_eps),
        gelu=gelu,
    )
    params = {
        "patch_embed": {
            "kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0).reshape(p * p * C, d),
            "bias": sd["patch_embed.proj.bias"],
        },
        "cls_token": sd["cls_token"].reshape(d),
        "pos_embed": sd["pos_embed"].reshape(n_tokens, d),
        "blocks": _convert_blocks(sd, _TIMM_BLOCK_NAMES, depth, d, heads),
        "ln_final": {"scale": sd["norm.weight"], "bias": sd["norm.bias"]},
        "head": {"kernel": sd["head.weight"].T, "bias": sd["head.bias"]},
    }
    return _checked_params(params, config, dtype, "vit_from_timm")


# ---------------------------------------------------------------------------
# OpenCLIP checkpoints
# ---------------------------------------------------------------------------
_OPEN_CLIP_LAYOUT = (
    "OpenCLIP's VisionTransformer layout (e.g. ViT-B-32's model.visual.state_dict()) is: conv1.weight "
    "(d, C, p, p) without bias, class_embedding (d,), positional_embedding (1 + (image/patch)**2, d), "
    "optionally ln_pre (d,), for every block i transformer.resblocks.{i}.ln_1 (d,), .attn.in_proj_weight "
    "(3d, d) and .attn.in_proj_bias (3d,), .attn.out_proj (d, d), .ln_2 (d,), .mlp.c_fc (mlp, d), "
    ".mlp.c_proj (d, mlp) (LayerNorms and Linears with .weight and .bias), then ln_post (d,) and proj "
    "(d, embed_dim); a full CLIP state dict holds these under 'visual.'"
)
# unexpected keys that name an OpenCLIP option minigeo's ViT does not have
_OPEN_CLIP_UNSUPPORTED = (
    ("attn_pool", "an attentional pooler (CoCa, attentional_pool=True)"),
    ("ls_1.gamma", "LayerScale (ls_init_value)"),
    ("ls_2.gamma", "LayerScale (ls_init_value)"),
    ("attn.ln_q", "query/key normalization (qk_norm)"),
    ("attn.ln_k", "query/key normalization (qk_norm)"),
    ("attn.logit_scale", "scaled cosine attention (scaled_cosine_attn)"),
    ("attn.head_scale", "per-head scaling (scale_heads)"),
    ("attn.ln_inner", "a LayerNorm inside attention (scale_attn_inner)"),
    ("ln_attn", "a LayerNorm after attention (scale_attn)"),
    ("mlp.ln", "a LayerNorm inside the MLP (scale_fc)"),
)
_OPEN_CLIP_ACTS = {"quick_gelu": "quick", "gelu": "exact", "gelu_tanh": "tanh"}


def _open_clip_keys(depth: int, pre_norm: bool) -> list[str]:
    keys = ["conv1.weight", "class_embedding", "positional_embedding"]
    keys += ["ln_pre.weight", "ln_pre.bias"] if pre_norm else []
    for i in range(depth):
        for name in ("ln_1", "attn.out_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            keys += [f"transformer.resblocks.{i}.{name}.weight", f"transformer.resblocks.{i}.{name}.bias"]
        keys += [
            f"transformer.resblocks.{i}.attn.in_proj_weight",
            f"transformer.resblocks.{i}.attn.in_proj_bias",
        ]
    return keys + ["ln_post.weight", "ln_post.bias", "proj"]


def _expected_open_clip_shapes(sd: Mapping[str, np.ndarray], depth: int) -> dict[str, tuple[int, ...]]:
    """Every OpenCLIP key's shape implied by conv1 (d, C, p, p), positional_embedding, c_fc and proj."""
    d, C, p, _ = sd["conv1.weight"].shape
    pos = sd["positional_embedding"]
    n_tokens = pos.shape[0] if pos.ndim >= 1 else 0
    fc1 = sd.get("transformer.resblocks.0.mlp.c_fc.weight")
    m = fc1.shape[0] if fc1 is not None and fc1.ndim >= 1 else 4 * d
    proj = sd.get("proj")
    e = proj.shape[-1] if proj is not None and proj.ndim >= 1 else 0
    shapes = {
        "conv1.weight": (d, C, p, p),
        "class_embedding": (d,),
        "positional_embedding": (n_tokens, d),
        "ln_pre.weight": (d,),
        "ln_pre.bias": (d,),
        "ln_post.weight": (d,),
        "ln_post.bias": (d,),
        "proj": (d, e),
    }
    per_block = {
        "ln_1.weight": (d,),
        "ln_1.bias": (d,),
        "attn.in_proj_weight": (3 * d, d),
        "attn.in_proj_bias": (3 * d,),
        "attn.out_proj.weight": (d, d),
        "attn.out_proj.bias": (d,),
        "ln_2.weight": (d,),
        "ln_2.bias": (d,),
        "mlp.c_fc.weight": (m, d),
        "mlp.c_fc.bias": (m,),
        "mlp.c_proj.weight": (d, m),
        "mlp.c_proj.bias": (d,),
    }
    for i in range(depth):
        for name, shape in per_block.items():
            shapes[f"transformer.resblocks.{i}.{name}"] = shape
    return shapes


def vit_from_open_clip(
    state_dict: Mapping[str, Any],
    *,
    act: str,
    heads: int | None = None,
    ln_eps: float = 1e-5,
    pool_type: str = "tok",
    dtype: Any = jnp.float32,
) -> tuple[PyTree, ViTConfig]:
    r"""Convert an OpenCLIP ``VisionTransformer`` (CLIP's image tower, e.g. ViT-B/32) to minigeo's layout.

    ``vit_apply(params, images, config)`` then computes OpenCLIP's
    ``model.encode_image(images)`` (unnormalized, ``normalize=False``; images channels last): the
    patch convolution ``conv1`` (no bias), class token, position embeddings, the LayerNorm
    ``ln_pre`` (``config.pre_norm``; absent from towers built with ``no_ln_pre``), the blocks, then
    ``ln_post`` on the class token and the bias-free projection ``proj`` (d, embed_dim) as the head
    (``config.head_bias=False``, ``config.num_classes = embed_dim``).  The packed
    ``attn.in_proj_weight`` (3d, d) of ``nn.MultiheadAttention`` holds rows ``[q | k | v]`` in
    blocks of ``d``, head ``i`` at rows ``i·dh … (i+1)·dh`` of each; it is split per head into
    ``W_q, W_k, W_v`` (transposed: torch stores ``W^T``), ``attn.out_proj`` into ``W_o, b_o``, so
    :func:`vit_symmetry_spec` names the GL(dh) query-key and value-output pairs of the result.

    Depth, width, patch size, image size, MLP size and embedding size are read off the shapes,
    and so is ``ln_pre``; the activation, the heads, LayerNorm's epsilon and the pooling are not
    visible in a state dict and come from the arguments.

    Parameters
    ----------
    state_dict : mapping
        ``model.visual.state_dict()`` of an OpenCLIP model, or the full ``model.state_dict()``,
        whose keys under ``visual.`` are taken (the text tower, ``logit_scale`` and the rest are
        ignored).  Values may be numpy arrays or torch tensors (converted without importing torch;
        bfloat16 is widened to float32).  A training checkpoint's wrapper (``{'state_dict': ...}``)
        is unwrapped and a prefix shared by every key (``module.``) stripped.
    act : {"quick_gelu", "gelu", "gelu_tanh"}
        The MLP's activation, which the weights do not record, so it must be given:
        ``"quick_gelu"`` (:math:`x\,\sigma(1.702\,x)`) for OpenAI's CLIP weights
        (``pretrained="openai"``, the ``-quickgelu`` model names, and fine-tunes of them),
        ``"gelu"`` (exact erf, ``nn.GELU``) for OpenCLIP's own trainings (LAION, DataComp, ...),
        whose model configs do not set ``quick_gelu``; ``"gelu_tanh"`` for ``act_kwargs``
        ``{"approximate": "tanh"}``.
    heads : int, optional
        Number of attention heads; by default ``width // 64`` (OpenCLIP's ``head_width`` default,
        right for ViT-B/32: 768 / 64 = 12, B/16, L/14; ViT-H/14 has ``head_width`` 80, so pass
        ``heads=16``).
    ln_eps : float, optional
        LayerNorm epsilon (torch's default, used by OpenCLIP unless ``norm_kwargs`` says otherwise).
    pool_type : {"tok"}, optional
        OpenCLIP's ``vision_cfg.pool_type``: only ``"tok"`` (the class token, the default of every
        OpenCLIP ViT but the CLIPA ones) is supported.  With ``"tok"``, ``final_ln_after_pool`` makes
        no difference (LayerNorm acts on each token alone).
    dtype : dtype, optional
        dtype of the returned parameters.

    Returns
    -------
    tuple
        ``(params, config)``: minigeo's parameter pytree (:func:`~minigeo.models.init_vit`'s layout, with ``ln_pre`` and without the patch
        and head biases) and its :class:`~minigeo.models.ViTConfig` (``pre_norm`` as read off the state dict,
        ``patch_bias=False``, ``head_bias=False``, ``num_classes`` = embed_dim).

    Raises
    ------
    GeometryError
        (a ``ValueError``) If the state dict is not an OpenCLIP ViT image tower (e.g. a ResNet or
        timm-trunk tower), keys are missing or unexpected (the message names them, and names the
        OpenCLIP option that extra keys come from: attentional pooler, LayerScale, qk-norm, ...),
        an array's shape does not fit the width, patch, MLP and embedding sizes read off the others,
        the grid is not square, the width is not divisible by ``heads``, or ``act``/``pool_type``
        is unsupported.

    Notes
    -----
    OpenCLIP's zero-shot classifier is no parameter of the image tower: it is a matrix ``T`` of
    (class, embed_dim) L2-normalized text embeddings (``model.encode_text`` of the class prompts,
    averaged over templates and normalized again; ``open_clip.build_zero_shot_classifier``), and the
    logits are ``logit_scale * normalize(features) @ T.T`` with ``logit_scale =
    model.logit_scale.exp()`` (100 for trained CLIP models).  Append it to :func:`vit_apply` as in the
    example; keep ``T`` out of ``params`` so that sharpness perturbs only the image tower.

    Examples
    --------
    A tiny random state dict in OpenCLIP's layout (with torch and open_clip installed, pass
    ``open_clip.create_model("ViT-B-32", pretrained="openai").state_dict()`` and ``act="quick_gelu"``):

    >>> import numpy as np, jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> d, p, e, r = 16, 4, 8, np.random.default_rng(0)   # width, patch, embed_dim; 8x8 images
    >>> shapes = {"conv1.weight": (d, 3, p, p), "class_embedding": (d,),
    ...           "positional_embedding": (5, d), "ln_pre.weight": (d,), "ln_pre.bias": (d,),
    ...           "ln_post.weight": (d,), "ln_post.bias": (d,), "proj": (d, e),
    ...           "transformer.resblocks.0.attn.in_proj_weight": (3 * d, d),
    ...           "transformer.resblocks.0.attn.in_proj_bias": (3 * d,)}
    >>> block = "transformer.resblocks.0."
    >>> for name, (n_out, n_in) in {"ln_1": (d, 0), "attn.out_proj": (d, d), "ln_2": (d, 0),
    ...                             "mlp.c_fc": (4 * d, d), "mlp.c_proj": (d, 4 * d)}.items():
    ...     shapes[f"{block}{name}.weight"] = (n_out, n_in) if n_in else (n_out,)
    ...     shapes[f"{block}{name}.bias"] = (n_out,)
    >>> sd = {"visual." + k: r.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    >>> params, config = mm.vit_from_open_clip(sd, act="quick_gelu", heads=2)
    >>> config.num_classes, config.depth, config.heads, config.pre_norm, config.head_bias
    (8, 1, 2, True, False)
    >>> # (q, k) and (v, o), batched over layers and heads
    >>> len(mm.vit_symmetry_spec(params).pairs)
    2
    >>> images = jnp.zeros((5, 8, 8, 3))                # NHWC; OpenCLIP takes NCHW
    >>> mm.vit_apply(params, images, config).shape      # = model.encode_image(images_nchw)
    (5, 8)
    >>> T = r.normal(size=(10, e))   # the prompts of 10 classes
    >>> T /= np.linalg.norm(T, axis=1, keepdims=True)
    >>> def zero_shot_logits(params, images, logit_scale=100.0):
    ...     f = mm.vit_apply(params, images, config)
    ...     return logit_scale * (f / jnp.linalg.norm(f, axis=-1, keepdims=True)) @ T.T
    >>> zero_shot_logits(params, images).shape
    (5, 10)

    References
    ----------
    No formula from the source papers: a checkpoint converter. da Silva, Dangel & Oore (2025),
    *Hide & Seek*, Sec. 5.3.1 and Fig. 4, score 72 CLIP ViT-B/32 fine-tunes (Wortsman et al.
    2022). Taught in chapter 7, *Capstone: geodesic sharpness of vision transformers*.
    """
    where = "vit_from_open_clip"
    sd = _unwrap_state_dict(state_dict, where, markers=("conv1.weight", "visual.conv1.weight"))
    if any(isinstance(k, str) and k.startswith("visual.") for k in sd):  # a full CLIP model
        sd = {k[len("visual.") :]: v for k, v in sd.items() if isinstance(k, str) and k.startswith("visual.")}
    if act not in _OPEN_CLIP_ACTS:
        raise GeometryError(
            f"{where}: act must be one of {sorted(_OPEN_CLIP_ACTS)}, got {act!r}: 'quick_gelu' for OpenAI's "
            "CLIP weights and their fine-tunes, 'gelu' for OpenCLIP's own (LAION, DataComp) trainings."
        )
    if pool_type != "tok":
        raise GeometryError(
            f"{where}: pool_type={pool_type!r} is not supported: minigeo's ViT pools the class token "
            "('tok', the default of OpenCLIP's ViTs). Average pooling (the CLIPA models) and 'none' are not."
        )
    if "conv1.weight" not in sd or "positional_embedding" not in sd:
        hint = ""
        if any(k.startswith("trunk.") for k in sd):
            hint = " It looks like a timm-backed tower (visual.trunk.*), which this converter does not read."
        elif any(k.startswith(("layer1.", "attnpool.")) for k in sd):
            hint = " It looks like a ModifiedResNet tower (RN50 etc.), which is not a vision transformer."
        raise GeometryError(
            f"{where}: not an OpenCLIP VisionTransformer state dict (no 'conv1.weight' or 'positional_embedding', "
            f"with or without the 'visual.' prefix); got {len(sd)} keys, {_few(sorted(sd), 12)}.{hint} "
            f"{_OPEN_CLIP_LAYOUT}."
        )
    sd = _numeric_arrays(sd, where, _OPEN_CLIP_LAYOUT)
    conv = sd["conv1.weight"]
    if conv.ndim != 4 or conv.shape[2] != conv.shape[3]:
        raise GeometryError(
            f"{where}: conv1.weight has shape {conv.shape}, expected a 4-D convolution kernel (d, C, p, p) with "
            f"square patches. {_OPEN_CLIP_LAYOUT}."
        )
    block_ids = [k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.") and k.count(".") >= 3]
    depth = 1 + max((int(i) for i in block_ids if i.isdigit()), default=-1)
    pre_norm = "ln_pre.weight" in sd or "ln_pre.bias" in sd
    expected = _open_clip_keys(depth, pre_norm)
    missing = [k for k in expected if k not in sd]
    unexpected = sorted(set(sd) - set(expected))
    if depth == 0 or missing or unexpected:
        features = sorted(
            {what for k in unexpected for key, what in _OPEN_CLIP_UNSUPPORTED if f".{key}" in f".{k}"}
        )
        raise GeometryError(
            f"{where}: the state dict does not match OpenCLIP's VisionTransformer layout"
            + (" (no transformer.resblocks.* blocks)" if depth == 0 else "")
            + ".\n"
            f"  missing keys ({len(missing)}): {_few(missing)}\n"
            f"  unexpected keys ({len(unexpected)}): {_few(unexpected)}\n"
            + (
                f"The unexpected keys come from OpenCLIP options minigeo's ViT lacks: {'; '.join(features)}.\n"
                if features
                else ""
            )
            + f"{_OPEN_CLIP_LAYOUT}."
        )
    _check_shapes(
        sd,
        expected,
        _expected_open_clip_shapes(sd, depth),
        where,
        "width, patch, MLP and embedding sizes read off conv1.weight, positional_embedding, "
        "transformer.resblocks.0.mlp.c_fc.weight and proj",
        _OPEN_CLIP_LAYOUT,
    )
    d, C, p, _ = conv.shape
    n_tokens, e = sd["positional_embedding"].shape[0], sd["proj"].shape[1]
    grid = math.isqrt(max(n_tokens - 1, 0))
    heads = _heads_or_default(heads, d, where)
    if n_tokens < 2 or grid * grid != n_tokens - 1:
        raise GeometryError(
            f"{where}: positional_embedding {sd['positional_embedding'].shape} needs 1 + a square number of "
            "tokens: minigeo's ViT takes square images (OpenCLIP's non-square image_size is not supported)."
        )
    if heads <= 0 or d % heads:
        raise GeometryError(f"{where}: width {d} is not divisible by heads={heads}.")
    config = ViTConfig(
        image_size=grid * p,
        patch_size=p,
        channels=C,
        num_classes=e,
        width=d,
        depth=depth,
        heads=heads,
        mlp_dim=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        ln_eps=float(ln_eps),
        gelu=_OPEN_CLIP_ACTS[act],
        pre_norm=pre_norm,
        patch_bias=False,
        head_bias=False,
    )
    params = {
        "patch_embed": {"kernel": conv.transpose(2, 3, 1, 0).reshape(p * p * C, d)},
        "cls_token": sd["class_embedding"],
        "pos_embed": sd["positional_embedding"],
        "blocks": _convert_blocks(sd, _OPEN_CLIP_BLOCK_NAMES, depth, d, heads),
        "ln_final": {"scale": sd["ln_post.weight"], "bias": sd["ln_post.bias"]},
        "head": {"kernel": sd["proj"]},
    }
    if pre_norm:
        params["ln_pre"] = {"scale": sd["ln_pre.weight"], "bias": sd["ln_pre.bias"]}
    return _checked_params(params, config, dtype, where)


def load_timm_checkpoint(path: str | os.PathLike) -> dict[str, np.ndarray]:
    r"""Read a timm ViT checkpoint file into a ``{name: numpy array}`` state dict (no network access).

    No formula: supports ``.safetensors`` (the format of timm's Hugging Face weights; needs the
    ``safetensors`` package), ``.npz`` (``numpy.savez`` of a state dict), and ``.pth``/``.pt``/``.bin``
    (``torch.save`` of a state dict, loaded with ``weights_only=True``; needs torch).  Pass the
    result to :func:`~minigeo.models.vit_from_timm`.

    Parameters
    ----------
    path : path
        The checkpoint file.

    Returns
    -------
    dict
        ``{name: numpy array}``.

    Raises
    ------
    GeometryError
        If the file does not exist, its suffix is unknown, its package is not installed, or it cannot
        be read (e.g. an ``.npz`` holding a pickled nested dict instead of one array per key).

    Examples
    --------
    >>> import os, tempfile
    >>> import numpy as np
    >>> import minigeo.models as mm
    >>> path = os.path.join(tempfile.mkdtemp(), "vit.npz")
    >>> np.savez(path, **{"cls_token": np.zeros((1, 1, 4))})
    >>> {k: v.shape for k, v in mm.load_timm_checkpoint(path).items()}
    {'cls_token': (1, 1, 4)}

    References
    ----------
    No formula from the source papers: a checkpoint reader. Taught in chapter 7, *Capstone: geodesic
    sharpness of vision transformers*.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GeometryError(f"load_timm_checkpoint: no file at {path!r}.")
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except ValueError as err:  # pickled objects: a nested dict saved with np.savez(path, state_dict=sd)
            raise GeometryError(
                f"load_timm_checkpoint: {path!r} is not a flat .npz state dict of arrays: it holds pickled "
                f"Python objects or is not an .npz file ({err}). Save the state dict itself, one array per "
                "key: np.savez(path, **state_dict) with state_dict = {name: tensor.numpy()}."
            ) from err
        except (OSError, EOFError) as err:
            raise GeometryError(f"load_timm_checkpoint: could not read {path!r} as .npz ({err}).") from err
    if suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise GeometryError(
                "load_timm_checkpoint: reading .safetensors needs `pip install safetensors`."
            ) from e
        try:
            return dict(load_file(path))
        except Exception as err:  # a truncated or foreign file
            raise GeometryError(
                f"load_timm_checkpoint: could not read {path!r} as .safetensors ({type(err).__name__}: {err})."
            ) from err
    if suffix in (".pth", ".pt", ".bin"):
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise GeometryError(
                f"load_timm_checkpoint: reading {suffix} files needs PyTorch (`pip install torch`)."
            ) from e
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # not a torch file, or pickled objects weights_only refuses
            raise GeometryError(
                f"load_timm_checkpoint: could not read {path!r} with torch.load(weights_only=True) "
                f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}). "
                "If it is a training checkpoint with pickled extras, save only the weights: "
                "torch.save(model.state_dict(), path)."
            ) from err
        sd = _unwrap_state_dict(sd, "load_timm_checkpoint")  # {'state_dict': ...} / {'model': ...}
        return {k: _to_numpy(v) for k, v in sd.items()}
    raise GeometryError(
        f"load_timm_checkpoint: unknown checkpoint format {suffix!r}; use .safetensors, .npz, .pth, .pt or .bin."
    )

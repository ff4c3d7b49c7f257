r"""A vision transformer in plain JAX and its GL(h) symmetry specification (chapter 7).

The model is functional: :func:`init_vit` returns a parameter pytree, :func:`vit_apply`
maps ``(params, images)`` to logits.  Architecture (Dosovitskiy et al. 2021, timm's
``VisionTransformer``): non-overlapping patches embedded linearly, a class token, learned
position embeddings, ``depth`` pre-LayerNorm blocks of multi-head self-attention (with
query/key/value biases) and a GELU MLP, a final LayerNorm and a linear head on the class
token.  :func:`vit_b32_config` is ViT-B/32 (patch 32, 224², 12 layers, width 768, 12 heads
of 64; 88,224,232 parameters, the same count as timm's ``vit_base_patch32_224``).
Three config switches give OpenCLIP's image tower (:func:`~minigeo.models.vit_from_open_clip`): a LayerNorm
after the embedding (``pre_norm``), no patch-embedding bias (``patch_bias=False``) and a
bias-free projection as the head (``head_bias=False``), with QuickGELU (``gelu="quick"``) for
OpenAI's CLIP weights.

**Parameter layout.**  The blocks are stacked along a leading ``depth`` axis and run with
``lax.scan`` (one compiled block, whatever the depth).  The attention weights are stored
*per head*, the layout in which the GL(h) symmetries of da Silva et al. 2025 (Example A.1, App. C.1)
are visible:

==========  =========================  =============================================
leaf        shape                      role
==========  =========================  =============================================
``W_q``     ``(depth, heads, d, dh)``  head ``i`` computes :math:`q_i = X W_q^i + b_q^i`
``b_q``     ``(depth, heads, dh)``     (``W_k``/``b_k``, ``W_v``/``b_v`` alike)
``W_o``     ``(depth, heads, d, dh)``  output :math:`\sum_i \mathrm{softmax}(q_i k_i^\top/\sqrt{dh})\,v_i\,W_o^{i\top} + b_o`
``b_o``     ``(depth, d)``             shared by the heads: no symmetry
==========  =========================  =============================================

so that scores depend on :math:`\binom{W_q^i}{b_q^{i\top}}\binom{W_k^i}{b_k^{i\top}}^{\!\top}`
and the value path on :math:`\binom{W_v^i}{b_v^{i\top}} W_o^{i\top}`: two GL(dh) pairs per
head and layer, which :func:`vit_symmetry_spec` names for :func:`minigeo.geodesic_sharpness`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import GeometryError
from .._tree import PyTree
from ..sharpness import SymmetrySpec, symmetry_spec, with_bias

__all__ = [
    "ViTConfig",
    "vit_b32_config",
    "init_vit",
    "vit_apply",
    "vit_num_params",
    "vit_dense_params",
    "vit_symmetry_spec",
    "vit_move_along_symmetries",
]

_ATTENTION_KEYS = ("W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o")


class ViTConfig(NamedTuple):
    r"""Hyperparameters of a vision transformer (hashable: usable as a static argument).

    .. math:: d_{\mathrm{head}} = \mathrm{width}/\mathrm{heads},\qquad N_{\mathrm{patches}} = (\mathrm{image\_size}/\mathrm{patch\_size})^2.

    Parameters
    ----------
    image_size, patch_size, channels : int
        Square images of ``image_size`` pixels and ``channels`` channels, cut into square patches.
    num_classes : int
        Output size of the head.
    width, depth, heads, mlp_dim : int
        Model dimension, number of blocks, attention heads per block, MLP hidden size.
    ln_eps : float
        LayerNorm's epsilon (1e-6 in timm's ViTs, 1e-5 in OpenCLIP's).
    gelu : {"exact", "tanh", "quick"}
        ``"exact"`` is the erf GELU of timm/ViT; ``"tanh"`` is its tanh approximation
        (faster on CPU); ``"quick"`` is OpenAI CLIP's QuickGELU :math:`x\,\sigma(1.702\,x)`.
    pre_norm, patch_bias, head_bias : bool
        Default to timm's ViT; OpenCLIP's image tower sets all three the other way (see
        :func:`~minigeo.models.vit_from_open_clip`): ``pre_norm`` adds a LayerNorm (leaf ``ln_pre``)
        after the class token and position embeddings, before the first block; ``patch_bias=False``
        drops the patch embedding's bias (OpenCLIP's ``conv1`` has none); ``head_bias=False`` makes the
        head a bias-free projection of the final class token (OpenCLIP's ``proj``; ``num_classes`` is
        then its output size, the embedding dimension).

    Examples
    --------
    >>> import minigeo.models as mm
    >>> config = mm.ViTConfig(image_size=8, patch_size=4, channels=1, num_classes=10,
    ...                       width=32, depth=2, heads=4, mlp_dim=64)
    >>> config.num_patches, config.head_dim
    (4, 8)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.3 and App. C.1 (the ViT family of the
    experiments). Taught in chapter 7, *Capstone: geodesic sharpness of vision transformers*.
    """

    image_size: int = 224
    patch_size: int = 32
    channels: int = 3
    num_classes: int = 1000
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    ln_eps: float = 1e-6
    gelu: str = "exact"
    pre_norm: bool = False
    patch_bias: bool = True
    head_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def vit_b32_config(num_classes: int = 1000) -> ViTConfig:
    r"""ViT-B/32: patch 32, 224×224×3 images, 12 layers, width 768, 12 heads of 64, MLP 3072.

    No formula: the configuration ``ViTConfig(224, 32, 3, num_classes, 768, 12, 12, 3072)``.

    Parameters
    ----------
    num_classes : int, optional
        Output size of the head (1000 for ImageNet).

    Returns
    -------
    :class:`~minigeo.models.ViTConfig`
        The ViT-B/32 configuration.

    Examples
    --------
    >>> import minigeo.models as mm
    >>> mm.vit_num_params(mm.vit_b32_config())
    88224232

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.3.1 (ViT-B/32). Taught in chapter 7,
    *Capstone: geodesic sharpness of vision transformers*.
    """
    return ViTConfig(num_classes=num_classes)


def _check_config(config: ViTConfig) -> None:
    if not isinstance(config, ViTConfig):
        raise GeometryError(f"expected a ViTConfig, got {type(config).__name__}.")
    if config.image_size % config.patch_size:
        raise GeometryError(
            f"ViTConfig: image_size {config.image_size} must be a multiple of patch_size {config.patch_size}."
        )
    if config.width % config.heads:
        raise GeometryError(f"ViTConfig: width {config.width} must be divisible by heads {config.heads}.")
    if config.gelu not in ("exact", "tanh", "quick"):
        raise GeometryError(f"ViTConfig: gelu must be 'exact', 'tanh' or 'quick', got {config.gelu!r}.")


def init_vit(key: jax.Array, config: ViTConfig, dtype: Any = jnp.float32) -> PyTree:
    r"""Random parameters: truncated-normal weights (std 0.02, as timm), zero biases, unit LayerNorm scales.

    .. math:: W \sim 0.02\cdot\mathcal N_{[-2, 2]}(0, 1),\qquad b = 0,\qquad \gamma_{\mathrm{LN}} = 1.

    Parameters
    ----------
    key : jax.Array
        PRNG key.
    config : :class:`~minigeo.models.ViTConfig`
        The architecture.
    dtype : dtype, optional
        dtype of every leaf.

    Returns
    -------
    dict
        The nested parameter dict described in the module docstring (attention leaves of shape
        ``(depth, heads, ...)``).

    Raises
    ------
    GeometryError
        If ``config`` is not a :class:`~minigeo.models.ViTConfig`, ``image_size`` is not a multiple of
        ``patch_size``, ``width`` is not divisible by ``heads``, or ``gelu`` is unknown.

    Examples
    --------
    >>> import jax
    >>> import minigeo.models as mm
    >>> cfg = mm.ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10,
    ...                    width=16, depth=2, heads=2, mlp_dim=32)
    >>> params = mm.init_vit(jax.random.PRNGKey(0), cfg)
    >>> params["blocks"]["attn"]["W_q"].shape   # (depth, heads, width, head_dim)
    (2, 2, 16, 8)

    References
    ----------
    No formula from the source papers: a timm-style initialization of the ViT of da Silva, Dangel &
    Oore (2025), *Hide & Seek*, Sec. 5.3. Taught in chapter 7, *Capstone: geodesic sharpness of
    vision transformers*.
    """
    _check_config(config)
    c = config
    L, h, d, dh, m = c.depth, c.heads, c.width, c.head_dim, c.mlp_dim
    patch_dim = c.patch_size**2 * c.channels
    keys = iter(jax.random.split(key, 12))

    def w(shape):
        return 0.02 * jax.random.truncated_normal(next(keys), -2.0, 2.0, shape, dtype)

    def zeros(shape):
        return jnp.zeros(shape, dtype)

    def layer_norm(shape):
        return {"scale": jnp.ones(shape, dtype), "bias": zeros(shape)}

    attn = {
        "W_q": w((L, h, d, dh)),
        "b_q": zeros((L, h, dh)),
        "W_k": w((L, h, d, dh)),
        "b_k": zeros((L, h, dh)),
        "W_v": w((L, h, d, dh)),
        "b_v": zeros((L, h, dh)),
        "W_o": w((L, h, d, dh)),
        "b_o": zeros((L, d)),
    }
    params = {
        "patch_embed": {"kernel": w((patch_dim, d)), "bias": zeros((d,))},
        "cls_token": w((d,)),
        "pos_embed": w((c.num_patches + 1, d)),
        "blocks": {
            "ln1": layer_norm((L, d)),
            "attn": attn,
            "ln2": layer_norm((L, d)),
            "mlp": {
                "fc1": {"kernel": w((L, d, m)), "bias": zeros((L, m))},
                "fc2": {"kernel": w((L, m, d)), "bias": zeros((L, d))},
            },
        },
        "ln_final": layer_norm((d,)),
        "head": {"kernel": w((d, c.num_classes)), "bias": zeros((c.num_classes,))},
    }
    if c.pre_norm:
        params["ln_pre"] = layer_norm((d,))
    if not c.patch_bias:
        del params["patch_embed"]["bias"]
    if not c.head_bias:
        del params["head"]["bias"]
    return params


def vit_num_params(config: ViTConfig) -> int:
    r"""Number of parameters, from the shapes alone (``jax.eval_shape``: nothing is allocated).

    .. math:: d = \sum_{\text{leaves}} \prod \mathrm{shape}.

    Parameters
    ----------
    config : :class:`~minigeo.models.ViTConfig`
        The architecture.

    Returns
    -------
    int
        The number of parameters :math:`d`.

    Raises
    ------
    GeometryError
        If ``config`` is invalid (as for :func:`~minigeo.models.init_vit`).

    Examples
    --------
    >>> import minigeo.models as mm
    >>> mm.vit_num_params(mm.vit_b32_config())  # timm's vit_base_patch32_224 has the same count
    88224232

    References
    ----------
    No formula from the source papers: a parameter count. Taught in chapter 7, *Capstone: geodesic
    sharpness of vision transformers*.
    """
    shapes = jax.eval_shape(lambda k: init_vit(k, config), jax.random.PRNGKey(0))
    return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes)))


# LayerNorm and the exact GELU carry hand-written JVP rules.  The values are those of the plain
# formulas (the forward pass is bit-for-bit the same); the rules give the derivatives in the
# compact textbook form, which XLA's CPU backend turns into much less memory traffic than the
# derivatives traced through the formulas (for the tiny ViT of benchmarks/bench_peers.py:
# gradient ~35 % faster, HVP and GGN-vector product ~25 %; tests/test_vit.py checks them against
# the plain formulas, to rounding, in float32 and float64, up to third-order products).
@jax.custom_jvp
def _layer_norm_fn(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


@_layer_norm_fn.defjvp
def _layer_norm_jvp(primals, tangents):
    # y = x̂ s + b with x̂ = (x - μ) r, r = (σ² + ε)^(-1/2):
    # dy = r (dx_c - x̂ mean(dx_c x̂)) s + x̂ ds + db, dx_c = dx - mean(dx).
    x, scale, bias, eps = primals
    dx, dscale, dbias, _ = tangents
    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    r = jax.lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + eps)
    y = xc * r * scale + bias
    xhat = xc * r
    dxc = dx - jnp.mean(dx, axis=-1, keepdims=True)
    dxhat = r * (dxc - xhat * jnp.mean(dxc * xhat, axis=-1, keepdims=True))
    return y, dxhat * scale + xhat * dscale + dbias


def _layer_norm(x: jax.Array, p: Mapping[str, jax.Array], eps: float) -> jax.Array:
    return _layer_norm_fn(x, p["scale"], p["bias"], jnp.asarray(eps, x.dtype))


@jax.custom_jvp
def _gelu_exact(u: jax.Array) -> jax.Array:
    return jax.nn.gelu(u, approximate=False)


@_gelu_exact.defjvp
def _gelu_exact_jvp(primals, tangents):
    # gelu(u) = u Φ(u), gelu'(u) = Φ(u) + u φ(u); Φ as in jax.nn.gelu: erfc(-u/√2)/2.
    (u,), (du,) = primals, tangents
    erfc = jax.lax.erfc(-u * np.sqrt(0.5).astype(u.dtype))
    pdf = jnp.exp(-0.5 * u * u) * np.sqrt(0.5 / np.pi).astype(u.dtype)
    return 0.5 * u * erfc, (0.5 * erfc + u * pdf) * du


_DENSE_LEAVES = ("kernel", *_ATTENTION_KEYS)  # a weight or an attention bias
_DENSE_BIAS_OWNERS = ("patch_embed", "fc1", "fc2", "head")  # whose "bias" belongs to a dense layer


def vit_dense_params(params: PyTree) -> tuple[dict, Callable[[dict], PyTree]]:
    r"""The dense layers' parameters of a ViT, and the function that puts them back among the others.

    .. math:: 	heta = (	heta_{\mathrm{dense}}, 	heta_{\mathrm{rest}}),\qquad
              \mathrm{merge}(	heta'_{\mathrm{dense}}) = (	heta'_{\mathrm{dense}}, 	heta_{\mathrm{rest}}).

    The dense parameters are every weight and bias of a matrix product: the patch embedding, the
    per-head query, key, value and output projections and their biases, the MLP and the head; the
    rest are the layer norms, the class token and the position embedding.  This is the split that
    :func:`minigeo.kfac` / :func:`minigeo.ekfac` need (they have Kronecker factors for dense layers
    only): pass the dense parameters and let the model close over the rest, held fixed.

    Parameters
    ----------
    params : dict
        Parameters from :func:`~minigeo.models.init_vit` (or a checkpoint loader).

    Returns
    -------
    dense : dict
        ``{path: array}``, the path a tuple of the nested keys, e.g. ``("blocks", "attn", "W_q")``.
    merge : callable
        ``merge(dense)``: the full parameter dict with ``dense`` in place of the dense parameters and the
        others as in ``params``.

    Examples
    --------
    >>> import jax
    >>> import minigeo as mg
    >>> import minigeo.models as mm
    >>> cfg = mm.ViTConfig(image_size=4, patch_size=2, channels=1, num_classes=3,
    ...                    width=8, depth=1, heads=2, mlp_dim=8)
    >>> dense, merge = mm.vit_dense_params(mm.init_vit(jax.random.PRNGKey(0), cfg))
    >>> len(dense), ("blocks", "attn", "W_o") in dense, ("cls_token",) in dense
    (16, True, False)
    >>> images = jax.random.normal(jax.random.PRNGKey(1), (4, 4, 4, 1))
    >>> model = lambda d, x: mm.vit_apply(merge(d), x, cfg)
    >>> K = mg.kfac(model, "categorical", dense, batch=(images, None))
    >>> len(mg.kronecker.kronecker_eigenbasis(K))  # patch, q, k, v, o, fc1, fc2, head
    8

    References
    ----------
    Martens & Grosse (2015) (K-FAC's layers); Dosovitskiy et al. (2021) (the ViT). Chapter 7.
    """
    flat = {tuple(getattr(k, "key", k) for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    is_dense = lambda path: path[-1] in _DENSE_LEAVES or (  # noqa: E731
        path[-1] == "bias" and len(path) > 1 and path[-2] in _DENSE_BIAS_OWNERS)
    dense = {path: x for path, x in flat.items() if is_dense(path)}
    rest = {path: x for path, x in flat.items() if not is_dense(path)}

    def merge(d: dict) -> PyTree:
        out: dict = {}
        for path, x in {**rest, **d}.items():
            node = out
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = x
        return out

    return dense, merge


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
    """(B, H, W, C) images → (B, N, p·p·C) patches, row-major over the patch grid, (kh, kw, c) inside."""
    B, H, W, C = images.shape
    p = patch_size
    x = images.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, (H // p) * (W // p), p * p * C)


def multi_head_attention(x: jax.Array, a: Mapping[str, jax.Array]) -> jax.Array:
    """Self-attention of tokens ``x`` (B, T, d) with per-head weights ``a`` (one layer's slice)."""
    q = jnp.einsum("btd,hde->bhte", x, a["W_q"]) + a["b_q"][:, None, :]
    k = jnp.einsum("btd,hde->bhte", x, a["W_k"]) + a["b_k"][:, None, :]
    v = jnp.einsum("btd,hde->bhte", x, a["W_v"]) + a["b_v"][:, None, :]
    scores = jnp.einsum("bhte,bhse->bhts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], x.dtype))
    mixed = jnp.einsum("bhts,bhse->bhte", jax.nn.softmax(scores, axis=-1), v)
    return jnp.einsum("bhte,hde->btd", mixed, a["W_o"]) + a["b_o"]


def vit_apply(params: PyTree, images: jax.Array, config: ViTConfig) -> jax.Array:
    r"""Logits of the vision transformer for images of shape ``(B, H, W, C)`` (channels last).

    .. math::

        z_0 &= [x_{\mathrm{cls}};\ \mathrm{patches}\,E + b_E] + E_{\mathrm{pos}},

        z &\leftarrow z + \mathrm{MHA}(\mathrm{LN}_1 z),\quad z \leftarrow z + \mathrm{MLP}(\mathrm{LN}_2 z),

        \mathrm{logits} &= \mathrm{LN}(z)_{\mathrm{cls}} W_{\mathrm{head}} + b_{\mathrm{head}},

        \mathrm{MHA}(z) &= [\mathrm{head}_1, \dots, \mathrm{head}_h]\,W^o,\qquad
        \mathrm{head}_i = \mathrm{softmax}\Big(\tfrac{z W_q^i (z W_k^i)^\top}{\sqrt{d_{\mathrm{head}}}}\Big) z W_v^i

    (biases omitted in the attention).  With ``config.pre_norm``, :math:`z_0` is replaced by
    :math:`\mathrm{LN}_{\mathrm{pre}}(z_0)`; ``patch_bias=False`` drops :math:`b_E` and
    ``head_bias=False`` drops :math:`b_{\mathrm{head}}` (OpenCLIP's image tower, whose outputs are the
    unnormalized image features).

    Parameters
    ----------
    params : dict
        Parameters in :func:`~minigeo.models.init_vit`'s layout.
    images : array
        Shape ``(B, image_size, image_size, channels)``, channels last.
    config : :class:`~minigeo.models.ViTConfig`
        The architecture (a static argument under ``jit``).

    Returns
    -------
    jax.Array
        Logits of shape ``(B, num_classes)``, in the dtype of ``params``.

    Raises
    ------
    GeometryError
        If ``images`` does not have shape ``(B, image_size, image_size, channels)`` (e.g. NCHW).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> cfg = mm.ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10,
    ...                    width=16, depth=2, heads=2, mlp_dim=32)
    >>> params = mm.init_vit(jax.random.PRNGKey(0), cfg)
    >>> mm.vit_apply(params, jnp.zeros((5, 8, 8, 1)), cfg).shape
    (5, 10)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. C.1 (multi-head attention, head_i =
    Attention(Q W_i^Q, K W_i^K, V W_i^V)). Taught in chapter 7, *Capstone: geodesic sharpness of
    vision transformers*.
    """
    c = config
    images = jnp.asarray(images)
    expected = (c.image_size, c.image_size, c.channels)
    if images.ndim != 4 or images.shape[1:] != expected:
        raise GeometryError(
            f"vit_apply: images must have shape (batch, {c.image_size}, {c.image_size}, {c.channels}) (channels "
            f"last), got {images.shape}. For NCHW arrays (PyTorch), pass images.transpose(0, 2, 3, 1)."
        )
    dtype = params["pos_embed"].dtype
    x = patchify(images.astype(dtype), c.patch_size) @ params["patch_embed"]["kernel"]
    if c.patch_bias:
        x = x + params["patch_embed"]["bias"]
    cls = jnp.broadcast_to(params["cls_token"], (x.shape[0], 1, c.width))
    x = jnp.concatenate([cls, x], axis=1) + params["pos_embed"]
    if c.pre_norm:
        x = _layer_norm(x, params["ln_pre"], c.ln_eps)
    if c.gelu == "quick":  # OpenAI CLIP's QuickGELU
        gelu = lambda u: u * jax.nn.sigmoid(1.702 * u)
    elif c.gelu == "exact":
        gelu = _gelu_exact
    else:
        gelu = lambda u: jax.nn.gelu(u, approximate=True)

    def block(z, p):
        z = z + multi_head_attention(_layer_norm(z, p["ln1"], c.ln_eps), p["attn"])
        y = _layer_norm(z, p["ln2"], c.ln_eps)
        y = gelu(y @ p["mlp"]["fc1"]["kernel"] + p["mlp"]["fc1"]["bias"])
        return z + y @ p["mlp"]["fc2"]["kernel"] + p["mlp"]["fc2"]["bias"], None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    x = _layer_norm(x[:, 0], params["ln_final"], c.ln_eps)
    x = x @ params["head"]["kernel"]
    return x + params["head"]["bias"] if c.head_bias else x


def _attention_blocks(params: PyTree) -> list[tuple[Any, ...]]:
    """Paths of every dict in the pytree that holds the eight per-head attention leaves."""
    found: list[tuple[Any, ...]] = []

    def visit(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, Mapping):
            if all(k in node for k in _ATTENTION_KEYS):
                found.append(path)
                return
            for k, v in node.items():
                visit(v, path + (k,))

    visit(params, ())
    return found


def vit_symmetry_spec(params: PyTree, *, eps: float = 0.0) -> SymmetrySpec:
    r"""The GL(dh) symmetries of every attention layer, for :func:`~minigeo.geodesic_sharpness`.

    .. math::

        \Big(\tbinom{W_q^i}{b_q^{i\top}},\ W_k^i\Big) \to \Big(\tbinom{W_q^i}{b_q^{i\top}} A^{-1},\ W_k^i A^\top\Big),\qquad
        \Big(\tbinom{W_v^i}{b_v^{i\top}},\ W_o^i\Big) \to \Big(\tbinom{W_v^i}{b_v^{i\top}} B^{-1},\ W_o^i B^\top\Big),

    for :math:`A, B \in \mathrm{GL}(d_{\mathrm{head}})`, per head :math:`i` and layer.

    Parameters
    ----------
    params : dict
        ViT parameters in :func:`~minigeo.models.init_vit`'s layout (or any pytree holding attention
        dicts with ``W_q, b_q, W_k, b_k, W_v, b_v, W_o, b_o``).
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` of the Gram matrices of metric (15) (App. G.2).

    Returns
    -------
    SymmetrySpec
        Two pairs, (query, key) and (value, output), each batched over layers and heads; every other
        leaf treated element-wise.

    Raises
    ------
    GeometryError
        If the pytree holds no attention layer (a dict with ``W_q, b_q, W_k, b_k, W_v, b_v,
        W_o, b_o``), or the shapes do not form pairs.

    Notes
    -----
    The query and value biases are appended as in da Silva et al. 2025, Example A.1; heads and
    layers are the leading batch axes of the leaves, so each head is its own pair.  The key bias
    :math:`b_k` is **redundant**: it adds :math:`q_t^\top b_k` to every score of query :math:`t`, a
    constant along the key axis that the softmax removes, so the function does not depend on it and
    it is never perturbed.  (Example A.1 appends :math:`b_k` to the key side instead; the symmetry is
    valid, but then shifting :math:`b_k`, which changes nothing, changes metric (15) and the
    sharpness.)  Every other leaf (patch embedding, positions, LayerNorms, MLP, head, ``b_o``) gets
    the element-wise adaptive treatment (da Silva et al. 2025, App. C.1).

    Examples
    --------
    >>> import jax
    >>> import minigeo.models as mm
    >>> cfg = mm.ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10,
    ...                    width=16, depth=2, heads=2, mlp_dim=32)
    >>> spec = mm.vit_symmetry_spec(mm.init_vit(jax.random.PRNGKey(0), cfg))
    >>> len(spec.pairs)   # (q, k) and (v, o), each batched over 2 layers x 2 heads
    2

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. C.1 (symmetries 1 and 2 per head) and
    Example A.1 (biases). Taught in chapter 7, *Capstone: geodesic sharpness of vision
    transformers*.
    """
    blocks = _attention_blocks(params)
    if not blocks:
        raise GeometryError(
            "vit_symmetry_spec: the parameter pytree has no attention layer (a dict holding "
            f"{', '.join(_ATTENTION_KEYS)}), so it has no GL(h) symmetry to quotient out. Use "
            "minigeo.symmetry_spec to name the pairs of another model, or adaptive_sharpness."
        )
    pairs, redundant = [], []
    for path in blocks:
        p = lambda name: path + (name,)
        pairs.append((with_bias(p("W_q"), p("b_q")), p("W_k")))
        pairs.append((with_bias(p("W_v"), p("b_v")), p("W_o")))
        redundant.append(p("b_k"))
    return symmetry_spec(params, pairs, redundant=redundant, eps=eps)


def vit_move_along_symmetries(
    params: PyTree,
    A_qk: jax.Array,
    A_vo: jax.Array,
    *,
    ln2_scale: jax.Array | None = None,
    final_scale: jax.Array | None = None,
) -> PyTree:
    r"""Move ViT parameters along the symmetries of :func:`vit_symmetry_spec`: the same function.

    .. math::

        \Big(\tbinom{W_q^i}{b_q^{i\top}},\ W_k^i\Big) \to \Big(\tbinom{W_q^i}{b_q^{i\top}} A^{-1},\ W_k^i A^\top\Big),\qquad
        \Big(\tbinom{W_v^i}{b_v^{i\top}},\ W_o^i\Big) \to \Big(\tbinom{W_v^i}{b_v^{i\top}} B^{-1},\ W_o^i B^\top\Big),

    per head :math:`i` and layer, with the key bias moved as :math:`b_k \to A\,b_k` (it does not
    change the function either); optionally also the GL(1) rescalings of two LayerNorms,
    :math:`(\gamma, \beta) \to d\odot(\gamma, \beta)` with the next layer's input rows divided by
    :math:`d` (the MLP's first layer after ``ln2``, the head after ``ln_final``).

    Parameters
    ----------
    params : dict
        ViT parameters in :func:`init_vit`'s layout.
    A_qk, A_vo : jax.Array
        Invertible matrices of shape ``(depth, heads, head_dim, head_dim)`` for the (query, key) and
        (value, output) pairs of every head.
    ln2_scale : jax.Array, optional
        Nonzero scales of shape ``(depth, width)`` for every block's second LayerNorm.
    final_scale : jax.Array, optional
        Nonzero scales of shape ``(width,)`` for the final LayerNorm.

    Returns
    -------
    dict
        The moved parameters: ``vit_apply`` gives the same logits (up to round-off).

    Raises
    ------
    GeometryError
        If a group element's shape does not match the parameters.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> cfg = mm.ViTConfig(image_size=8, patch_size=4, channels=1, num_classes=3,
    ...                    width=8, depth=1, heads=2, mlp_dim=16)
    >>> p = mm.init_vit(jax.random.PRNGKey(0), cfg)
    >>> A = jnp.broadcast_to(2.0 * jnp.eye(4) + jnp.triu(jnp.ones((4, 4)), 1), (1, 2, 4, 4))
    >>> moved = mm.vit_move_along_symmetries(p, A, A)
    >>> x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 8, 1))
    >>> bool(jnp.allclose(mm.vit_apply(moved, x, cfg), mm.vit_apply(p, x, cfg), atol=1e-5))
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. C.1 (symmetries 1 and 2 per head) and
    Example A.1 (biases). Taught in chapter 7, *Capstone: geodesic sharpness of vision
    transformers*.
    """
    attn = params["blocks"]["attn"]
    want = tuple(jnp.shape(attn["W_q"])[:2]) + (jnp.shape(attn["W_q"])[-1],) * 2
    for name, A in (("A_qk", A_qk), ("A_vo", A_vo)):
        if tuple(jnp.shape(A)) != want:
            raise GeometryError(
                f"vit_move_along_symmetries: {name} has shape {tuple(jnp.shape(A))}; the attention needs "
                f"(depth, heads, head_dim, head_dim) = {want}."
            )
    inv, T = jnp.linalg.inv, lambda M: jnp.swapaxes(M, -1, -2)
    a = dict(attn)
    a["W_q"], a["b_q"] = a["W_q"] @ inv(A_qk), jnp.einsum("lhe,lhef->lhf", a["b_q"], inv(A_qk))
    a["W_k"], a["b_k"] = a["W_k"] @ T(A_qk), jnp.einsum("lhe,lhfe->lhf", a["b_k"], A_qk)
    a["W_v"], a["b_v"] = a["W_v"] @ inv(A_vo), jnp.einsum("lhe,lhef->lhf", a["b_v"], inv(A_vo))
    a["W_o"] = a["W_o"] @ T(A_vo)
    blocks = dict(params["blocks"], attn=a)
    out = dict(params, blocks=blocks)
    if ln2_scale is not None:
        d = jnp.asarray(ln2_scale)
        if d.shape != jnp.shape(blocks["mlp"]["fc1"]["kernel"])[:2]:
            raise GeometryError(
                f"vit_move_along_symmetries: ln2_scale has shape {d.shape}; it needs (depth, width) = "
                f"{tuple(jnp.shape(blocks['mlp']['fc1']['kernel'])[:2])}."
            )
        mlp = blocks["mlp"]
        fc1 = dict(mlp["fc1"], kernel=mlp["fc1"]["kernel"] / d[..., None])
        blocks = dict(blocks, ln2={k: v * d for k, v in blocks["ln2"].items()}, mlp=dict(mlp, fc1=fc1))
        out = dict(out, blocks=blocks)
    if final_scale is not None:
        d = jnp.asarray(final_scale)
        if d.shape != jnp.shape(params["head"]["kernel"])[:1]:
            raise GeometryError(
                f"vit_move_along_symmetries: final_scale has shape {d.shape}; it needs (width,) = "
                f"{tuple(jnp.shape(params['head']['kernel'])[:1])}."
            )
        head = dict(params["head"], kernel=params["head"]["kernel"] / d[:, None])
        out = dict(out, ln_final={k: v * d for k, v in params["ln_final"].items()}, head=head)
    return out

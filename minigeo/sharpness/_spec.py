r"""The specification types of :mod:`minigeo.sharpness`: which symmetries to quotient out, and the result.

* :class:`SymmetrySpec` (built by :func:`~minigeo.symmetry_spec`): the GL(h) pairs (a side may carry a bias,
  :func:`with_bias` / :class:`WithBias`), the element-wise GL(1) pairs and the redundant leaves of a
  parameter pytree, by leaf index;
* :class:`SharpnessResult`: what :func:`~minigeo.adaptive_sharpness` and
  :func:`~minigeo.geodesic_sharpness` return, whose ``status`` is a :class:`~minigeo.Status` code, and
  the default accuracy ``DEFAULT_RTOL``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp

from .._checks import GeometryError
from .._status import Status
from .._tree import PyTree, key_entry

Path = Sequence[Any]


Side = Tuple[int, ...]


class SymmetrySpec(NamedTuple):
    r"""Which leaves of a parameter pytree form GL(h) pairs, GL(1) pairs, or are redundant.

    GL(h) pairs ``(G, H)`` are used as :math:`GH^\top` (symmetry :math:`(G, H) \mapsto (GA^{-1}, HA^\top)`);
    element-wise GL(1) pairs ``(u, v)`` are used as ``u * v`` (e.g. diagonal networks); all other
    leaves are treated element-wise by the adaptive recipe.  ``redundant`` leaves are ones the
    network function does not depend on at all (e.g. attention's key bias): no sharpness measure
    perturbs them.  Build it with :func:`~minigeo.symmetry_spec`, which checks the paths and shapes.

    Attributes
    ----------
    pairs : tuple
        Per GL(h) pair, the leaf indices (in ``jax.tree_util.tree_leaves`` order) of each side:
        ``(weight,)``, or ``(weight, bias)`` when a bias is appended as a last row.
    num_leaves : int
        Number of leaves of the parameter pytree.
    eps : float
        Relaxation :math:`\epsilon` of metric (15) (App. G.2).
    gl1_pairs : tuple
        ``(u, v)`` leaf indices of the GL(1) pairs.
    redundant : tuple
        Indices of the leaves held fixed.
    pair_names : tuple of str
        Readable names of the GL(h) pairs (used in error messages).
    structure : jax.tree_util.PyTreeDef or None
        The pytree structure of the parameters the spec was built for; the sharpness functions refuse
        params of another structure (leaf indices would name other leaves).
    leaf_shapes : tuple
        The shape of every leaf of those parameters (in ``tree_leaves`` order); the sharpness functions
        refuse params whose leaves named by the spec have other shapes.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> params = {"b": jnp.ones(3), "G": jnp.ones((4, 2)), "H": jnp.ones((5, 2))}
    >>> spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    >>> spec.pairs, spec.num_leaves  # leaf indices in tree_leaves order: G=0, H=1, b=2
    ((((0,), (1,)),), 3)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 3.1, Sec. 5.2, Example A.1. Chapters 6 and 7.
    """

    pairs: tuple[tuple[Side, Side], ...]
    num_leaves: int
    eps: float
    gl1_pairs: tuple[tuple[int, int], ...] = ()
    redundant: tuple[int, ...] = ()
    pair_names: tuple[str, ...] = ()
    structure: Any = None
    leaf_shapes: tuple[tuple[int, ...], ...] = ()


class WithBias(NamedTuple):
    r"""One side of a GL(h) pair: a weight ``(..., n, h)`` with its bias ``(..., h)`` appended as row ``n + 1``.

    .. math:: M = \begin{pmatrix} W \\ b^\top \end{pmatrix} \in \mathbb R^{(n+1)\times h}

    Attributes
    ----------
    weight : tuple
        Path of the weight leaf.
    bias : tuple
        Path of the bias leaf.

    Examples
    --------
    >>> import minigeo as mg
    >>> side = mg.with_bias(("attn", "W_v"), ("attn", "b_v"))
    >>> isinstance(side, mg.sharpness.WithBias), side.bias
    (True, ('attn', 'b_v'))

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Example A.1 (bias appended to the weight). Chapters 6 and 7.
    """

    weight: Path
    bias: Path


def with_bias(weight: Path, bias: Path) -> WithBias:
    r"""Name a GL(h) side whose bias is appended to its weight as a last row.

    .. math:: XW_q + \mathbf 1 b_q^\top = [X\ \mathbf 1]\begin{pmatrix} W_q \\ b_q^\top \end{pmatrix},

    so the symmetry :math:`(G, H) \mapsto (GA^{-1}, HA^\top)` acts on the weight and its bias together:
    pass ``with_bias(("W_q",), ("b_q",))`` as a side in :func:`~minigeo.symmetry_spec`.

    Parameters
    ----------
    weight : tuple
        Path of the weight leaf ``(..., n, h)`` in the parameter pytree.
    bias : tuple
        Path of the bias leaf ``(..., h)``.

    Returns
    -------
    WithBias
        The two paths (lists are converted to tuples).

    Examples
    --------
    >>> import minigeo as mg
    >>> mg.with_bias(("attn", "W_q"), ("attn", "b_q"))
    WithBias(weight=('attn', 'W_q'), bias=('attn', 'b_q'))

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Example A.1. Chapters 6 and 7.
    """
    return WithBias(
        tuple(weight) if isinstance(weight, list) else weight, tuple(bias) if isinstance(bias, list) else bias
    )


_key_entry = key_entry


def symmetry_spec(
    params: PyTree,
    gl_pairs: Sequence[tuple[Path | WithBias, Path | WithBias]] = (),
    *,
    gl1_pairs: Sequence[tuple[Path, Path]] = (),
    redundant: Sequence[Path] = (),
    eps: float = 0.0,
) -> SymmetrySpec:
    r"""Name the symmetries of a parameter pytree by their paths, e.g. ``[(("attn", "W_q"), ("attn", "W_k"))]``.

    A GL(h) pair is :math:`(G, H)` used as :math:`GH^\top`; with a side given as :func:`with_bias`
    the pair is :math:`\big(\binom{W_G}{b_G^\top}, \binom{W_H}{b_H^\top}\big)`.  GL(1) pairs get the
    exact horizontal geodesics :math:`(u e^{B}, v e^{B})`.

    ``redundant`` names leaves that do not change the network function (a direction :math:`v`
    with :math:`f(w + tv) = f(w)` for all :math:`t`): attention's key bias :math:`b_k` adds
    :math:`q_i^\top b_k` to every score of query :math:`i`, which the softmax over keys removes.
    Perturbing such a leaf cannot change the loss but spends the perturbation budget and lets
    the metric depend on a coordinate the function ignores, so geodesic and adaptive sharpness
    hold them fixed.  (Da Silva et al. 2025, Example A.1, appends :math:`b_k` to the key side of the pair
    instead; that is a valid symmetry, but it makes sharpness change when :math:`b_k` is shifted.)

    Parameters
    ----------
    params : pytree
        The parameters (arrays or shape-dtype structs).
    gl_pairs : sequence of (side, side)
        GL(h) pairs; a side is a path (tuple of keys) or a :func:`with_bias`.  The two sides must have
        shapes ``(..., n, h)`` and ``(..., m, h)`` with equal ``h`` and batch (head) dimensions.
    gl1_pairs : sequence of (path, path), optional
        Element-wise pairs ``(u, v)`` of equal shape, used through ``u * v``.
    redundant : sequence of path, optional
        Leaves held fixed.
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` of metric (15) (App. G.2); breaks exact invariance if > 0.

    Returns
    -------
    SymmetrySpec
        Leaf indices of the pairs, the redundant leaves and ``eps``.

    Raises
    ------
    GeometryError
        If a path does not exist (the message lists the available paths), a leaf is used twice, the
        shapes are incompatible, or ``eps < 0``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> params = {"q": jnp.ones((4, 2)), "k": jnp.ones((3, 2)),
    ...           "b": jnp.ones(3), "bq": jnp.ones(2)}
    >>> mg.symmetry_spec(params, [(("q",), ("k",))]).pairs
    (((3,), (2,)),)
    >>> mg.symmetry_spec(params, [(mg.with_bias(("q",), ("bq",)), ("k",))]).pairs
    (((3, 1), (2,)),)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.1, eq. (10); Sec. 5.2; Example A.1; App. G.2. Chapters 6 and 7.
    """
    if isinstance(eps, (int, float)) and eps < 0:
        raise GeometryError(f"symmetry_spec: eps must be >= 0, got {eps}.")
    with_path = jax.tree_util.tree_leaves_with_path(params)
    index = {tuple(_key_entry(k) for k in path): i for i, (path, _) in enumerate(with_path)}
    leaves = [leaf for _, leaf in with_path]
    used: set[int] = set()

    def lookup(path: Path) -> int:
        key = tuple(path) if isinstance(path, (tuple, list)) else (path,)
        if key not in index:
            raise GeometryError(
                f"symmetry_spec: the parameter pytree has no leaf at {key}. Available leaves: {sorted(index, key=str)}."
            )
        i = index[key]
        if i in used:
            raise GeometryError(f"symmetry_spec: leaf {key} appears in more than one pair.")
        used.add(i)
        return i

    def side(entry: Path | WithBias) -> tuple[Side, tuple[int, ...], str]:
        if isinstance(entry, WithBias):
            wi, bi = lookup(entry.weight), lookup(entry.bias)
            W, b = leaves[wi], leaves[bi]
            if jnp.ndim(W) < 2 or jnp.shape(b) != jnp.shape(W)[:-2] + jnp.shape(W)[-1:]:
                raise GeometryError(
                    f"symmetry_spec: the bias {entry.bias} {jnp.shape(b)} cannot be appended to the weight "
                    f"{entry.weight} {jnp.shape(W)}: a weight (..., n, h) needs a bias of shape (..., h)."
                )
            shape = jnp.shape(W)[:-2] + (jnp.shape(W)[-2] + 1, jnp.shape(W)[-1])
            return (wi, bi), shape, f"{entry.weight}+bias {entry.bias}"
        i = lookup(entry)
        return (i,), jnp.shape(leaves[i]), str(tuple(entry) if isinstance(entry, (tuple, list)) else entry)

    pairs, names = [], []
    for g_entry, h_entry in gl_pairs:
        (g_side, g_shape, g_name), (h_side, h_shape, h_name) = side(g_entry), side(h_entry)
        names.append(f"{g_name} / {h_name}")
        if len(g_shape) < 2 or len(h_shape) < 2 or g_shape[-1] != h_shape[-1] or g_shape[:-2] != h_shape[:-2]:
            raise GeometryError(
                f"symmetry_spec: the pair {g_name} {g_shape} / {h_name} {h_shape} must be "
                "matrices (..., n, h) and (..., m, h) with the same h and head dimensions (used as G H^T)."
            )
        pairs.append((g_side, h_side))
    gl1 = []
    for u_path, v_path in gl1_pairs:
        ui, vi = lookup(u_path), lookup(v_path)
        if jnp.shape(leaves[ui]) != jnp.shape(leaves[vi]):
            raise GeometryError(
                f"symmetry_spec: the GL(1) pair {tuple(u_path)} {jnp.shape(leaves[ui])} / {tuple(v_path)} "
                f"{jnp.shape(leaves[vi])} must have equal shapes (used element-wise as u * v)."
            )
        gl1.append((ui, vi))
    fixed = tuple(lookup(path) for path in redundant)
    shapes = tuple(tuple(int(n) for n in jnp.shape(leaf)) for leaf in leaves)
    return SymmetrySpec(
        tuple(pairs), len(leaves), float(eps), tuple(gl1), fixed, tuple(names), jax.tree_util.tree_structure(params), shapes
    )


#: The old names of the :attr:`SharpnessResult.status` codes (until 0.5.0, with a deprecation warning:
#: ``minigeo.sharpness.__getattr__``); the codes are members of the one :class:`~minigeo.Status` enumeration.
DEPRECATED_STATUS_NAMES = {
    "STATUS_OK": "OK",
    "STATUS_SINGULAR_PAIR": "ILL_CONDITIONED_PAIR",
    "STATUS_NON_FINITE": "NON_FINITE",
    "STATUS_BAD_RHO": "RHO_OUT_OF_RANGE",
}

#: Default accuracy (relative) that :func:`~minigeo.geodesic_sharpness` requires of its factorization of metric (15).
DEFAULT_RTOL = 1e-2

class SharpnessResult(NamedTuple):
    r"""Sharpness averaged over batches, per batch, the maximizing perturbations, and a status.

    .. math:: S = \frac1B\sum_{b=1}^B S_b

    Attributes
    ----------
    sharpness : jax.Array
        The mean of ``per_batch``.
    per_batch : jax.Array
        Sharpness of every batch, shape ``(B,)``.
    perturbation : pytree or None
        The maximizing perturbation of each batch, stacked along a leading axis, when the call asked
        for it (``return_perturbation=True``; at ViT-B/32 that is 88 M numbers per batch), else ``None``.
    status : jax.Array
        int32 scalar, a :class:`~minigeo.Status` code (``mg.Status(int(result.status))`` names it):
        ``0`` (``Status.OK``), ``6`` (``Status.ILL_CONDITIONED_PAIR``: a
        GL(h) pair is so ill conditioned at its dtype that ``error_bound`` exceeds the call's ``rtol``,
        rank-deficient pairs included), ``3`` (``Status.NON_FINITE``: the
        loss or its gradient was NaN/inf at the base point or during the search) or ``7``
        (``Status.RHO_OUT_OF_RANGE``: a traced ``rho`` above ``1/eps`` of the
        loss's dtype, see :func:`~minigeo.adaptive_sharpness`).  Called eagerly,
        :func:`~minigeo.adaptive_sharpness` and :func:`~minigeo.geodesic_sharpness` raise :class:`~minigeo.GeometryError` instead;
        under ``jax.jit`` they cannot raise, so check ``result.status`` (or ``result.ok``) yourself.
    error_bound : jax.Array
        Scalar: a first-order bound on the relative error of ``sharpness`` caused by the dtype in the
        factorization of metric (15), :math:`\max_{\text{pairs, heads}} \mathrm{cond}(\text{side})\,
        \varepsilon_{\text{dtype}}` (the thin SVD of a side loses :math:`\mathrm{cond}\,\varepsilon` and the
        condition number enters the result once); :math:`\varepsilon_{\text{dtype}}` when there is no
        GL(h) pair (adaptive sharpness).  It does not include the optimization gap of Auto-PGD.
        :func:`~minigeo.geodesic_sharpness` accepts a point when ``error_bound <= rtol``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> loss = lambda p, x: jnp.sum((p["w"] * x) ** 2)
    >>> batches = jnp.ones((2, 3))  # two batches
    >>> key = jax.random.PRNGKey(0)
    >>> res = mg.adaptive_sharpness(loss, {"w": jnp.ones(3)}, batches, 0.1, key=key,
    ...                             n_iter=5)
    >>> res.per_batch.shape, res.perturbation is None, int(res.status)
    ((2,), True, 0)
    >>> bool(jnp.isclose(res.sharpness, res.per_batch.mean()))
    True
    >>> res = mg.adaptive_sharpness(loss, {"w": jnp.ones(3)}, batches, 0.1, key=key,
    ...                             n_iter=5, return_perturbation=True)
    >>> res.perturbation["w"].shape  # one maximizing perturbation per batch
    (2, 3)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. C.2 (sharpness per batch, then averaged). Chapters 6 and 7.
    """

    sharpness: jax.Array
    per_batch: jax.Array
    perturbation: PyTree = None
    status: jax.Array = Status.OK
    error_bound: jax.Array = 0.0

    @property
    def ok(self) -> jax.Array:
        """``status == 0``: every pair well conditioned and every value finite (check this under ``jit``)."""
        return jnp.asarray(self.status) == Status.OK

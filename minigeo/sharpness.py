r"""Adaptive and geodesic sharpness (floor 3, chapters 6 and 7).

**Adaptive sharpness** (Kwon et al. 2021; Andriushchenko et al. 2023) measures how much the
loss can rise under perturbations scaled by the weights' magnitudes,

.. math:: S^\rho_{\max}(w) = \max_{\lVert\delta/|w|\rVert_2 \le \rho} L(w + \delta) - L(w),

which is invariant to element-wise rescalings (GL(1) symmetries) but not to the GL(h)
symmetries of attention.  **Geodesic sharpness** (da Silva et al. 2025, eq. 6/8) maximizes over the
geodesic ball of the quotient manifold instead: horizontal velocities :math:`\xi` with
:math:`\lVert\xi\rVert_g \le \rho` under metric (15) for the GL(h) pairs named in a
:class:`SymmetrySpec`, the adaptive norm for all other weights, and the perturbed point
:math:`w + \xi - \tfrac12\Gamma(\xi,\xi)` (eq. 7).  Both maxima are found by Auto-PGD
(Croce & Hein 2020; da Silva et al. 2025, App. C.2, Algorithm 1): normalized (Riemannian) gradient
ascent with momentum 0.75, projection onto the ball, and step-size halving with restarts
from the best point at checkpoints 0, 0.22, 0.41, ... of the iterations.  Because the ascent's local
maxima near a minimum come in near-antipodal pairs (the loss rises through an even quadratic form
plus smaller odd terms), a run is followed by up to ``n_restarts`` (default 7) runs each started at
the antipode of the previous run's best point, stopping once two runs in a row gained less than
0.1 % (see ``benchmarks/validate_sharpness_optimum.py``: on chapter 6's 50 diagonal networks this
lifts the worst ratio to the exact optimum from 0.77 to above 0.99).

Both functions are jit-compiled end to end (``lax`` loops), deterministic given a PRNG key,
average over a stack of batches, and return the maximizing perturbation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, as_float_point, check_finite, check_key, is_concrete
from ._compile import jit_per_callable
from ._tree import PyTree
from .quotient import _eps_that_works, _factor_pair, _mT, _PairFrame, _whitened_projection

__all__ = [
    "SymmetrySpec",
    "WithBias",
    "with_bias",
    "symmetry_spec",
    "SharpnessResult",
    "adaptive_sharpness",
    "geodesic_sharpness",
    "kendall_tau",
]

Path = Sequence[Any]


Side = Tuple[int, ...]


class SymmetrySpec(NamedTuple):
    r"""Which leaves of a parameter pytree form GL(h) pairs, GL(1) pairs, or are redundant.

    GL(h) pairs ``(G, H)`` are used as :math:`GH^\top` (symmetry :math:`(G, H) \mapsto (GA^{-1}, HA^\top)`);
    element-wise GL(1) pairs ``(u, v)`` are used as ``u * v`` (e.g. diagonal networks); all other
    leaves are treated element-wise by the adaptive recipe.  ``redundant`` leaves are ones the
    network function does not depend on at all (e.g. attention's key bias): no sharpness measure
    perturbs them.  Build it with :func:`symmetry_spec`, which checks the paths and shapes.

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
    >>> isinstance(side, mg.WithBias), side.bias
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
    pass ``with_bias(("W_q",), ("b_q",))`` as a side in :func:`symmetry_spec`.

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


def _key_entry(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


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
    >>> params = {"q": jnp.ones((4, 2)), "k": jnp.ones((3, 2)), "b": jnp.ones(3), "bq": jnp.ones(2)}
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
    return SymmetrySpec(tuple(pairs), len(leaves), float(eps), tuple(gl1), fixed, tuple(names))


#: :attr:`SharpnessResult.status` codes: success, a GL(h) pair too ill conditioned for the requested accuracy
#: (or rank deficient), a non-finite value, a traced ``rho`` outside ``(0, 1/eps]`` of the loss's dtype.
STATUS_OK, STATUS_SINGULAR_PAIR, STATUS_NON_FINITE, STATUS_BAD_RHO = 0, 1, 2, 3

#: Default accuracy (relative) that :func:`geodesic_sharpness` requires of its factorization of metric (15).
DEFAULT_RTOL = 1e-2

#: Default maximum number of antipodal Auto-PGD restarts after the first run (``n_restarts`` of
#: :func:`adaptive_sharpness` and :func:`geodesic_sharpness`); the restarts stop early once two runs
#: in a row raised the best value by less than ``_RESTART_RTOL`` of the sharpness.
N_RESTARTS = 7
_RESTART_RTOL, _RESTART_PATIENCE = 1e-3, 2


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
        int32 scalar: ``0`` (``STATUS_OK``), ``1`` (``STATUS_SINGULAR_PAIR``: a GL(h) pair is so ill
        conditioned at its dtype that ``error_bound`` exceeds the call's ``rtol``, rank-deficient pairs
        included), ``2`` (``STATUS_NON_FINITE``, the loss or its gradient was NaN/inf at the base point or
        during the search) or ``3`` (``STATUS_BAD_RHO``, a traced ``rho`` above ``1/eps`` of the loss's
        dtype, see :func:`adaptive_sharpness`).  Called eagerly,
        :func:`adaptive_sharpness` and :func:`geodesic_sharpness` raise :class:`GeometryError` instead;
        under ``jax.jit`` they cannot raise, so check ``result.status`` (or ``result.ok``) yourself.
    error_bound : jax.Array
        Scalar: a first-order bound on the relative error of ``sharpness`` caused by the dtype in the
        factorization of metric (15), :math:`\max_{\text{pairs, heads}} \mathrm{cond}(\text{side})\,
        \varepsilon_{\text{dtype}}` (the thin SVD of a side loses :math:`\mathrm{cond}\,\varepsilon` and the
        condition number enters the result once); :math:`\varepsilon_{\text{dtype}}` when there is no
        GL(h) pair (adaptive sharpness).  It does not include the optimization gap of Auto-PGD.
        :func:`geodesic_sharpness` accepts a point when ``error_bound <= rtol``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> loss = lambda p, x: jnp.sum((p["w"] * x) ** 2)
    >>> batches = jnp.ones((2, 3))  # two batches
    >>> res = mg.adaptive_sharpness(loss, {"w": jnp.ones(3)}, batches, 0.1, key=jax.random.PRNGKey(0), n_iter=5)
    >>> res.per_batch.shape, res.perturbation is None, int(res.status)
    ((2,), True, 0)
    >>> bool(jnp.isclose(res.sharpness, res.per_batch.mean()))
    True
    >>> res = mg.adaptive_sharpness(loss, {"w": jnp.ones(3)}, batches, 0.1, key=jax.random.PRNGKey(0),
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
    status: jax.Array = STATUS_OK
    error_bound: jax.Array = 0.0

    @property
    def ok(self) -> jax.Array:
        """``status == 0``: every pair well conditioned and every value finite (check this under ``jit``)."""
        return jnp.asarray(self.status) == STATUS_OK


# ---------------------------------------------------------------------------
# the search space: one block per parameter group, in coordinates where the ball is Euclidean
# ---------------------------------------------------------------------------
def _highest(fn):
    """Run ``fn``'s products at "highest" matmul precision (traced once: no cost at run time)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return wrapped


def _side_forward(Mn: jax.Array, z: jax.Array, R: jax.Array):
    r"""One side of a pair moved along the second-order geodesic, in whitened coordinates.

    With :math:`M = \hat M R` (:math:`R = P^{1/2}`, :math:`\hat M = MP^{-1/2}`) and :math:`\xi = zR`,
    eq. (7) and (43) give :math:`M + \xi - \tfrac12\Gamma(\xi,\xi) = \hat M K_1 + z K_2` with
    :math:`u = z^\top\hat M`, :math:`c = z^\top z`, :math:`K_1 = (I - \tfrac12 c)R` and
    :math:`K_2 = (I + \tfrac12(u + u^\top))R`: two products with the tall matrices for the small
    ones and two for the result, and no product with :math:`P^{-1/2}` (whose norm is the condition number).
    """
    u, c = _mT(z) @ Mn, _mT(z) @ z
    eye = jnp.eye(Mn.shape[-1], dtype=Mn.dtype)
    K1 = (eye - 0.5 * c) @ R
    K2 = (eye + 0.5 * (u + _mT(u))) @ R
    return Mn @ K1 + z @ K2, (u, K2)


def _side_backward(Mn, z, R, gram, cache, D):
    """The chain rule of :func:`_side_forward`: the gradient in z is ``D K2^T + Mn Cs + z Cc``.

    Returns the three right factors and ``Mn^T`` times that gradient (from the small matrices
    only: the horizontal projection needs no further product with the tall matrices).
    """
    u, K2 = cache
    E1, E2 = _mT(Mn) @ D, _mT(z) @ D  # d/dK1, d/dK2
    Cc = -0.5 * (E1 @ R)  # d/dc
    Cc = Cc + _mT(Cc)
    Cs = 0.5 * (E2 @ R)  # d/du
    Cs = Cs + _mT(Cs)
    MtG = E1 @ _mT(K2) + gram @ Cs + _mT(u) @ Cc
    return (_mT(K2), Cs, Cc), MtG


def _horizontal_whitened(f: _PairFrame, gram: tuple, v: tuple, span: tuple = (None, None), tail=(None, None)) -> list:
    r"""The horizontal projection of a whitened pair vector :math:`z = (v_G + \hat GS_G + t_G,\ v_H + \hat HS_H + t_H)`.

    ``gram`` holds the products :math:`(\hat G^\top z_G, \hat H^\top z_H)` (``h x h``), from which
    :func:`~minigeo.quotient._whitened_projection` gives the corrections :math:`(c_G, c_H)`; the
    projection is :math:`(v_G + \hat G(S_G + c_G) + t_G,\ v_H + \hat H(S_H - c_H) + t_H)`.  A part
    of the vector in the span of the sides, given as ``span``, is folded into the correction (one
    product with each tall matrix); ``None`` stands for zero.
    """
    cG, cH = _whitened_projection(f, *gram)
    out = [
        v[0] + f.Gn @ (cG if span[0] is None else span[0] + cG),
        v[1] + f.Hn @ (-cH if span[1] is None else span[1] - cH),
    ]
    return [o if t is None else o + t for o, t in zip(out, tail)]


@dataclasses.dataclass(frozen=True)
class _Block:
    r"""One parameter group of the search space, in coordinates ("parts") where its metric is Euclidean.

    A block owns some ``leaves`` (indices in ``tree_leaves`` order) and ``n_parts`` arrays of the
    search.  Every operation takes the base-point leaves ``w`` and the block's base-point
    precomputation ``f = frame(w)`` (computed once per evaluation; ``None`` if none is needed):

    - ``shapes(w)``, ``noise_like(w, f)``: the parts' shapes, and the normal draws ``start`` uses;
    - ``start(w, f, noise)``: a random direction (horizontal, and equivariant under the group);
    - ``perturb(w, f, parts) -> (moved, cache)``: the perturbed point, as segments that
      ``write(out, moved)`` puts into a list of leaves;
    - ``riemannian(w, f, parts, cache, moved, grad)``: the Riemannian gradient in the parts'
      coordinates, from the gradient ``grad`` of the loss with respect to ``moved``;
    - ``tangent(w, f, parts)``: the velocity in the weights' coordinates; its metric norm is the
      parts' 2-norm (:func:`_sq_norm`), which is what makes the ball Euclidean for the ascent.

    The defaults are those of a block of one leaf and one part of its shape.  A new symmetry is a new block.
    """

    n_parts: ClassVar[int] = 1

    @property
    def leaves(self) -> tuple[int, ...]:
        raise NotImplementedError

    def frame(self, w: list) -> Any:
        return None

    def shapes(self, w: list) -> list:
        return [jnp.shape(w[self.leaves[0]])]

    def noise_like(self, w: list, f: Any) -> list:
        return [w[self.leaves[0]]]


@dataclasses.dataclass(frozen=True)
class _GLhPair(_Block):
    r"""A GL(h) pair ``(G, H)`` (used as :math:`GH^\top`) under metric (15), as two parts of the search.

    The parts are the sides in **whitened** coordinates :math:`z_G = \xi_G P^{-1/2}`,
    :math:`z_H = \xi_H Q^{-1/2}` (:math:`P = G^\top G + \epsilon I`, :math:`Q = H^\top H + \epsilon I`,
    bias rows included), where metric (15) is the Frobenius inner product; the perturbed point is
    the second-order geodesic :math:`M + \xi - \tfrac12\Gamma(\xi,\xi)` (eq. 7), the Riemannian
    gradient the horizontal projection of the gradient in ``z``.  Per side and iteration: nine
    products with the tall ``(n, h)`` matrices (four for the point, two Gram matrices of the incoming
    gradient, three for the projected gradient); the projection itself works on ``h x h`` matrices.
    """

    g: Side
    h: Side
    eps: float

    n_parts: ClassVar[int] = 2

    @property
    def leaves(self) -> tuple[int, ...]:
        return self.g + self.h

    @staticmethod
    def gather(x: list, side: Side) -> jax.Array:
        """The matrix of one side: the weight, with the bias appended as a last row if the side has one."""
        if len(side) == 1:
            return x[side[0]]
        return jnp.concatenate([x[side[0]], x[side[1]][..., None, :]], axis=-2)

    @staticmethod
    def scatter(out: list, side: Side, m: jax.Array) -> None:
        """Write a side's matrix back into its weight (and bias) slots."""
        if len(side) == 1:
            out[side[0]] = m
        else:
            out[side[0]], out[side[1]] = m[..., :-1, :], m[..., -1, :]

    def sides(self, w: list) -> tuple[jax.Array, jax.Array]:
        return self.gather(w, self.g), self.gather(w, self.h)

    def frame(self, w: list) -> _PairFrame:
        """Metric (15) at the base point, factored from thin SVDs of the sides (once per evaluation)."""
        return _factor_pair(*self.sides(w), self.eps)

    def shapes(self, w: list) -> list:
        return [jnp.shape(m) for m in self.sides(w)]  # abstract under jit: free

    def noise_like(self, w: list, f: _PairFrame) -> list:
        h = f.G.shape[-1]
        return [jax.ShapeDtypeStruct(M.shape[:-1] + (h,), M.dtype) for M in (f.G, f.H)]

    def start(self, w: list, f: _PairFrame, noise: list) -> list:
        r"""The Riemannian gradient of a random linear function :math:`\mathrm{Tr}(R^\top GH^\top)` of
        :math:`GH^\top` (which moves with the group, so the start is equivariant), with :math:`R = AB^\top`
        of rank h: two products with the tall matrices instead of an ``n x m`` draw and product per head."""
        A, B = noise
        # Euclidean gradients (R H, R^T G); whitened, before projection: g P^{1/2}, g Q^{1/2}
        gG = A @ ((_mT(B) @ f.H) @ f.P_half)
        gH = B @ ((_mT(A) @ f.G) @ f.Q_half)
        return _horizontal_whitened(f, (_mT(f.Gn) @ gG, _mT(f.Hn) @ gH), (gG, gH))

    def perturb(self, w: list, f: _PairFrame, parts: list) -> tuple[list, Any]:
        """The two moved sides as matrices (eq. 7), and what the chain rule needs."""
        G1, cG = _side_forward(f.Gn, parts[0], f.P_half)
        H1, cH = _side_forward(f.Hn, parts[1], f.Q_half)
        return [G1, H1], (cG, cH)

    def write(self, out: list, moved: list) -> None:
        self.scatter(out, self.g, moved[0])
        self.scatter(out, self.h, moved[1])

    def riemannian(self, w: list, f: _PairFrame, parts: list, cache: Any, moved: list, grad: list) -> list:
        r"""The horizontal projection of the gradient in ``z`` of the loss at the moved sides, given its
        gradient ``grad`` there: with :math:`\xi = (g_G P^{1/2}, g_H Q^{1/2})`, :math:`X` solves
        :math:`(PH^\top H)X + X(G^\top GQ) = PH^\top\xi_H - \xi_G^\top GQ` (:math:`(PQ)X + X(PQ)` for
        :math:`\epsilon = 0`) and the result is
        :math:`(g_G + GX^\top P^{-1/2},\ g_H - HXQ^{-1/2})` (see :mod:`minigeo.quotient`)."""
        (zG, zH), (DG, DH), (cG, cH) = parts, grad, cache
        (KG, CsG, CcG), GtgG = _side_backward(f.Gn, zG, f.P_half, f.gram_G, cG, DG)
        (KH, CsH, CcH), HtgH = _side_backward(f.Hn, zH, f.Q_half, f.gram_H, cH, DH)
        return _horizontal_whitened(f, (GtgG, HtgH), (DG @ KG, DH @ KH), (CsG, CsH), (zG @ CcG, zH @ CcH))

    def tangent(self, w: list, f: _PairFrame, parts: list) -> list:
        """The velocity ``(xi_G, xi_H) = (z_G P^{1/2}, z_H Q^{1/2})`` (sides as matrices)."""
        return [parts[0] @ f.P_half, parts[1] @ f.Q_half]


@dataclasses.dataclass(frozen=True)
class _GL1Pair(_Block):
    r"""An element-wise GL(1) pair ``(u, v)`` (used as ``u * v``), as one part ``b = sqrt(2) B``.

    Horizontal velocities are :math:`(\xi_u, \xi_v) = (uB, vB)` with metric :math:`2B^2 = b^2`; the
    perturbed point is the exact horizontal geodesic :math:`(ue^B, ve^B)` (da Silva et al. 2025, eq. 10).
    """

    u: int
    v: int

    @property
    def leaves(self) -> tuple[int, ...]:
        return (self.u, self.v)

    def start(self, w: list, f: None, noise: list) -> list:
        return [math.sqrt(2.0) * noise[0]]

    def perturb(self, w: list, f: None, parts: list) -> tuple[list, None]:
        B = parts[0] / math.sqrt(2.0)
        return [(w[self.u] * jnp.exp(B), w[self.v] * jnp.exp(B))], None

    def write(self, out: list, moved: list) -> None:
        out[self.u], out[self.v] = moved[0]

    def riemannian(self, w: list, f: None, parts: list, cache: None, moved: list, grad: list) -> list:
        (u1, v1), (gu, gv) = moved[0], grad[0]
        return [(gu * u1 + gv * v1) / math.sqrt(2.0)]

    def tangent(self, w: list, f: None, parts: list) -> list:
        B = parts[0] / math.sqrt(2.0)
        return [(w[self.u] * B, w[self.v] * B)]


@dataclasses.dataclass(frozen=True)
class _ElementWise(_Block):
    r"""A leaf perturbed element-wise, :math:`\delta = |w|\odot z` with the adaptive norm
    :math:`\lVert\delta/|w|\rVert_2 = \lVert z\rVert_2` (Kwon et al. 2021), as one part ``z``."""

    leaf: int

    @property
    def leaves(self) -> tuple[int, ...]:
        return (self.leaf,)

    def start(self, w: list, f: None, noise: list) -> list:
        return [noise[0]]

    def perturb(self, w: list, f: None, parts: list) -> tuple[list, None]:
        wi = w[self.leaf]
        return [wi + jnp.abs(wi) * parts[0]], None

    def write(self, out: list, moved: list) -> None:
        out[self.leaf] = moved[0]

    def riemannian(self, w: list, f: None, parts: list, cache: None, moved: list, grad: list) -> list:
        return [jnp.abs(w[self.leaf]) * grad[0]]

    def tangent(self, w: list, f: None, parts: list) -> list:
        return [jnp.abs(w[self.leaf]) * parts[0]]


def _sq_norm(parts: list, dtype) -> jax.Array:
    """The squared norm of a search direction: every block's coordinates are orthonormal for its metric."""
    return sum((jnp.sum(p * p) for p in parts), jnp.zeros((), dtype))


class _Geometry:
    """The search space of Auto-PGD: the blocks of a :class:`SymmetrySpec`, side by side.

    One block per parameter group (:class:`_GLhPair`, :class:`_GL1Pair`, :class:`_ElementWise`), each
    with the same operations on its own parts: ``frame`` (base-point precomputation), ``start``,
    ``perturb``/``write`` (the perturbed point), ``riemannian`` and ``tangent``; in every block's
    coordinates the norm of the ball is Euclidean, so the search sees one list of arrays ("parts",
    GL(h) pairs first, then GL(1) pairs, then element-wise leaves), the ball projection is a
    rescaling, and a new symmetry is a new block.  The redundant leaves of the spec belong to no
    block: they are never perturbed.

    Hashable by its spec's content: a static argument of the compiled search, shared by equal geometries.
    """

    def __init__(self, spec: SymmetrySpec | None, *, adaptive: bool = False):
        """The geometry of ``spec``'s symmetries; ``adaptive=True`` keeps only its redundant leaves
        (held fixed) and treats every other leaf element-wise (adaptive sharpness)."""
        use_pairs = spec is not None and not adaptive
        self.pairs = spec.pairs if use_pairs else ()
        self.gl1 = spec.gl1_pairs if use_pairs else ()
        self.eps = spec.eps if use_pairs else 0.0
        self.names = spec.pair_names if use_pairs else ()
        self.fixed = tuple(spec.redundant) if spec is not None else ()
        self._paired = [_GLhPair(g, h, self.eps) for g, h in self.pairs] + [_GL1Pair(u, v) for u, v in self.gl1]

    def _key(self) -> tuple:
        return (self.pairs, self.gl1, self.eps, self.fixed)

    def __hash__(self) -> int:  # a static argument of the compiled loop: equal geometries share a compilation
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Geometry) and self._key() == other._key()

    def blocks(self, w: list) -> list:
        """The GL(h) pairs, the GL(1) pairs, then every leaf in none of them (and not redundant) element-wise."""
        taken = {i for b in self._paired for i in b.leaves} | set(self.fixed)
        return self._paired + [_ElementWise(i) for i in range(len(w)) if i not in taken]

    def _split(self, w: list, fac: list, *lists: list):
        """Per block: the block, its frame, and its slice of each list of parts (or segments)."""
        blocks = self.blocks(w)
        frames = list(fac) + [None] * (len(blocks) - len(fac))
        k = 0
        for b, f in zip(blocks, frames):
            yield (b, f, *(x[k : k + b.n_parts] for x in lists))
            k += b.n_parts

    @_highest
    def factors(self, w: list) -> list[_PairFrame]:
        """Per-pair factorizations of metric (15) at the base point, from thin SVDs of the sides
        (constant during the search, computed once per evaluation for all batches)."""
        return [b.frame(w) for b in self._paired[: len(self.pairs)]]

    def shapes(self, w: list) -> list[tuple[int, ...]]:
        """The shapes of the parts: pair sides (bias rows included), GL(1) rates, other leaves."""
        return [s for b in self.blocks(w) for s in b.shapes(w)]

    @_highest
    def perturb(self, w: list, fac: list, parts: list) -> tuple[list, list]:
        """The perturbed weights, segment by segment like ``parts`` (pair sides as matrices, GL(1)
        pairs as tuples ``(u', v')``), and each block's cache for :meth:`riemannian`;
        :meth:`assemble` turns the segments into the list of leaves."""
        out, caches = [], []
        for b, f, p in self._split(w, fac, parts):
            moved, cache = b.perturb(w, f, p)
            out += moved
            caches.append(cache)
        return out, caches

    def assemble(self, w: list, moved: list) -> list:
        """The list of leaves from the segments of :meth:`perturb` (redundant leaves unperturbed).

        Called inside the differentiated loss, so the gradient arrives per segment: a pair side's
        gradient is one matrix, with no concatenation of weight and bias gradients."""
        out: list = [None] * len(w)
        for i in self.fixed:
            out[i] = w[i]
        for b, _, m in self._split(w, [], moved):
            b.write(out, m)
        return out

    @_highest
    def riemannian(self, w: list, fac: list, parts: list, caches: list, moved: list, grad: list) -> list:
        """The Riemannian gradient, in the search coordinates, of ``loss(perturb(parts))``, given the
        Euclidean gradient ``grad`` of the loss with respect to the segments ``moved`` of :meth:`perturb`."""
        out = []
        for (b, f, p, m, g), cache in zip(self._split(w, fac, parts, moved, grad), caches):
            out += b.riemannian(w, f, p, cache, m, g)
        return out

    @_highest
    def start(self, key: jax.Array, w: list, fac: list) -> list:
        """An equivariant random start, every block's from its share of one normal draw (a separate
        threefry per leaf multiplies XLA's compile time).  The draw is laid out as before the blocks
        existed, so that a key gives the same start: the first array of every one-array block (GL(1),
        element-wise), then every GL(h) pair's first array, then every pair's second."""
        split = list(self._split(w, fac))
        likes = [b.noise_like(w, f) for b, f in split]
        order = sorted((j, len(like), i) for i, like in enumerate(likes) for j in range(len(like)))
        draws = _normal_like(key, [likes[i][j] for j, _, i in order])
        noise: list[list] = [[None] * len(like) for like in likes]
        for (j, _, i), d in zip(order, draws):
            noise[i][j] = d
        return [p for (b, f), n in zip(split, noise) for p in b.start(w, f, n)]


def _normal_like(key: jax.Array, like: list) -> list:
    """Standard normal arrays shaped like ``like`` (arrays or ShapeDtypeStructs), from a single draw."""
    sizes = [math.prod(jnp.shape(x)) for x in like]
    dtype = jnp.result_type(*[x.dtype for x in like]) if like else jnp.float32
    flat = jax.random.normal(key, (sum(sizes),), dtype)
    out, start = [], 0
    for x, n in zip(like, sizes):
        out.append(flat[start : start + n].reshape(jnp.shape(x)).astype(x.dtype))
        start += n
    return out


def _checkpoints(n_iter: int) -> list[int]:
    """Auto-PGD checkpoints ceil(p_j * n_iter): p_0 = 0, p_1 = 0.22, p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)."""
    p = [0.0, 0.22]
    while p[-1] < 1.0:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
    return sorted({math.ceil(q * n_iter) for q in p if 0 < q <= 1.0})


def _rho_limit(dtype) -> float:
    """The largest radius accepted: ``1/eps(dtype)`` of the loss's dtype (8.4e6 in float32, 4.5e15 in float64).

    Beyond it the perturbation of a weight exceeds the weight by more than ``1/eps``, so ``w + delta``
    rounds to ``delta`` (the base point no longer enters), and squared norms of the search overflow long
    before radii like 1e200 (which used to return a meaningless ~0 with status 0).
    """
    return 1.0 / float(jnp.finfo(dtype).eps)


def _check_rho(rho: Any, dtype=None) -> None:
    """rho may be a Python or NumPy scalar, a 0-d array or a traced value (then unchecked; see ``STATUS_BAD_RHO``);
    with ``dtype`` (the loss's), a concrete rho must also be at most :func:`_rho_limit`."""
    if isinstance(rho, bool) or not (
        isinstance(rho, (int, float, np.integer, np.floating)) or (hasattr(rho, "shape") and jnp.shape(rho) == ())
    ):
        raise GeometryError(f"the sharpness radius rho must be a positive scalar (> 0), got {rho!r}.")
    if is_concrete(rho):
        r = float(np.asarray(rho))
        if not (np.isfinite(r) and r > 0):
            raise GeometryError(
                f"the sharpness radius rho must be > 0 and finite, got {r!r} (rho = inf would make every "
                "loss increase possible; rho <= 0 is an empty ball)."
            )
        if dtype is not None and r > _rho_limit(dtype):
            raise GeometryError(
                f"the sharpness radius rho = {r:.3g} is absurdly large for {jnp.dtype(dtype).name}: it must be at most "
                f"1/eps = {_rho_limit(dtype):.3g} (perturbations of more than 1/eps times a weight erase the weight "
                "in rounding, and the search's squared norms overflow). Typical radii are 1e-3 to 4."
            )


def _check_restarts(n_restarts: Any) -> None:
    if isinstance(n_restarts, bool) or not (isinstance(n_restarts, (int, np.integer)) and n_restarts >= 0):
        raise GeometryError(f"n_restarts must be an int >= 0, got {n_restarts!r}.")


def _check_stacked(batches: PyTree, who: str) -> int:
    """The number of batches of a **stacked** ``batches``: every leaf of shape ``(num_batches, batch_size, ...)``.

    A stack has a leading batch-index axis, shared by all leaves, and each batch keeps its own
    leading example axis, so every leaf has at least two axes.  A single unstacked batch
    ``(inputs (n, ...), labels (n,))`` has a 1-D leaf and is refused: read as a stack it would be
    ``n`` batches of one example each, with no example axis, which many losses silently accept.
    """
    pairs = jax.tree_util.tree_leaves_with_path(batches)
    if not pairs:
        raise GeometryError(
            f"{who}: batches is empty: pass a pytree of arrays stacked along a leading batch-index axis."
        )
    how = (
        "Sharpness takes a stack of batches, every leaf of shape (num_batches, batch_size, ...): stack one batch "
        "with jax.tree_util.tree_map(lambda x: x[None], batch), a dataset with "
        "mg.batches_of(data, batch_size, drop_remainder=True).stacked(); give a per-batch scalar the shape "
        "(num_batches, 1)."
    )
    for path, x in pairs:
        if jnp.ndim(x) < 2:
            name = jax.tree_util.keystr(path) or "(root)"
            raise GeometryError(
                f"{who}: batches is not stacked: its leaf {name} has shape {tuple(jnp.shape(x))}, so a batch would "
                f"have no example axis (an unstacked batch of n examples would be read as n batches of one). {how}"
            )
    sizes = {int(jnp.shape(x)[0]) for _, x in pairs}
    if len(sizes) != 1 or 0 in sizes:
        listing = ", ".join(f"{jax.tree_util.keystr(p) or '(root)'}: {jnp.shape(x)[0]}" for p, x in pairs)
        raise GeometryError(
            f"{who}: batches must be stacked along a common leading axis of length >= 1 (one entry per batch); "
            f"got leading sizes {listing}."
        )
    return sizes.pop()


def _struct(x: Any, drop: int = 0) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(jnp.shape(x))[drop:], jnp.result_type(x))


def _loss_dtype(loss_fn: Callable, params: PyTree, batches: PyTree, who: str):
    """Trace ``loss_fn`` on one batch (shapes only, nothing is computed) and return its dtype.

    A batch whose trailing shape does not fit the loss or the parameters fails here with a
    :class:`GeometryError` (naming the shapes) instead of a raw error from inside the compiled search.
    """
    p_struct = jax.tree_util.tree_map(_struct, params)
    b_struct = jax.tree_util.tree_map(lambda x: _struct(x, 1), batches)
    try:
        out = jax.eval_shape(loss_fn, p_struct, b_struct)
    except Exception as err:  # noqa: BLE001 - any failure of the user's loss on these shapes
        shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), b_struct)
        raise GeometryError(
            f"{who}: loss_fn(params, batch) fails on one batch of `batches` (leaf shapes {shapes} after removing "
            f"the leading batch-index axis): {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
            "Check that batches is stacked as (num_batches, batch_size, ...) and that its trailing shapes are "
            "the ones loss_fn and params expect."
        ) from err
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        got = jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), out)
        raise GeometryError(
            f"{who}: loss_fn(params, batch) must return a real floating scalar; got (shape, dtype) {got}. "
            "Reduce the loss over the batch (e.g. jnp.mean)."
        )
    return out.dtype


def _check_low_precision(params: PyTree, dtype, who: str) -> None:
    """Refuse float16/bfloat16: a radius below their resolution rounds every perturbation away (sharpness 0)."""
    small = {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)}
    dtypes = {jnp.dtype(jnp.result_type(x)) for x in jax.tree_util.tree_leaves(params)} | {jnp.dtype(dtype)}
    low = sorted(d.name for d in dtypes & small)
    if low:
        raise GeometryError(
            f"{who}: params or the loss are in {', '.join(low)}, which sharpness does not support: their 8 to 11 "
            "bit mantissas round small perturbations away (a sharpness of exactly 0) and the metric's "
            "factorization has no accuracy left. Cast params and the floating batches to float32, e.g. "
            "jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)."
        )


def _check_common(loss_fn: Callable, params: PyTree, rho: Any, batches: PyTree, n_iter: int, key: Any, who: str):
    """Validate the shared arguments (before anything is compiled); return the number of batches and the loss dtype."""
    as_float_point(params, f"{who}: params")  # floating, real, non-empty
    check_key(key, f"{who}: key")
    if isinstance(n_iter, bool) or not (isinstance(n_iter, (int, np.integer)) and n_iter >= 1):
        raise GeometryError(f"n_iter must be a positive int, got {n_iter!r}.")
    _check_rho(rho)
    n = _check_stacked(batches, who)
    dtype = _loss_dtype(loss_fn, params, batches, who)
    _check_low_precision(params, dtype, who)
    _check_rho(rho, dtype)
    return n, dtype


def _rho_ok(rho: Any, dtype) -> jax.Array:
    return jnp.asarray(rho <= _rho_limit(dtype))


# ---------------------------------------------------------------------------
# the ascent: Auto-PGD as pure init/propose/update functions on a NamedTuple state
# ---------------------------------------------------------------------------
def _norm(v: PyTree, dtype) -> jax.Array:
    """The Euclidean norm of a search direction (floored at the smallest normal, so that it divides safely)."""
    sq = _sq_norm(jax.tree_util.tree_leaves(v), dtype)
    return jnp.sqrt(jnp.maximum(sq, jnp.finfo(sq.dtype).tiny))


def _scale(c, v: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda p: c * p, v)


def _select(cond, a: PyTree, b: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x, y: jnp.where(cond, x, y), a, b)


class _AscentState(NamedTuple):
    """The loop state of :class:`_AutoPGD` (Croce & Hein 2020, Algorithm 1)."""

    k: jax.Array  #: iteration; 0 evaluates the start point only
    x: PyTree  #: current point
    x_prev: PyTree  #: previous point (momentum)
    f: jax.Array  #: value at x
    g: PyTree  #: (Riemannian) gradient at x
    eta: jax.Array  #: step size
    best_x: PyTree
    best_f: jax.Array
    best_g: PyTree
    succ: jax.Array  #: iterations that raised the value since the last checkpoint
    last_ck: jax.Array  #: the last checkpoint
    eta_ck: jax.Array  #: the step size at the last checkpoint
    best_ck: jax.Array  #: the best value at the last checkpoint
    finite: jax.Array  #: every value so far finite


class _AutoPGD(NamedTuple):
    r"""Auto-PGD maximization over the ball :math:`\lVert x\rVert_2 \le \rho` of a pytree ``x`` (Croce & Hein 2020).

    Normalized gradient steps :math:`z = \Pi(x + \eta g/\lVert g\rVert)`, momentum
    :math:`x' = \Pi(x + \alpha(z - x) + (1 - \alpha)(x - x_{\text{prev}}))` (:math:`\alpha = 1` at the
    first iteration), and at the checkpoints of :func:`_checkpoints` the step size halves and the
    search returns to its best point unless 75 % of the iterations since the last checkpoint raised
    the value (or neither step size nor best value changed since).  :math:`\Pi` is the projection
    onto the ball, a rescaling; with a Riemannian gradient in coordinates where the metric is
    Euclidean (see :class:`_Geometry`) this is the Riemannian Auto-PGD of da Silva et al. 2025,
    Algorithm 1.

    Pure functions in the style of optax: ``state = init(x0)``; then per iteration
    ``x = propose(state)``, evaluate ``f, g`` at ``x``, ``state = update(state, x, f, g)``.
    The first update only records the start (so the best value is never the initial ``-inf``).
    """

    rho: jax.Array  #: radius (its dtype is the search's)
    n_iter: int
    momentum: float = 0.75

    def project(self, v: PyTree) -> PyTree:
        return _scale(jnp.minimum(1.0, self.rho / _norm(v, self.rho.dtype)), v)

    def init(self, x0: PyTree, finite=True) -> _AscentState:
        none = jnp.asarray(-jnp.inf, self.rho.dtype)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, x0)
        eta0, zero = 2.0 * self.rho, jnp.zeros((), jnp.int32)
        return _AscentState(
            zero, x0, x0, none, zeros, eta0, x0, none, zeros, zero, zero, eta0, none, jnp.asarray(finite)
        )

    def propose(self, s: _AscentState) -> PyTree:
        """The next point to evaluate (the start itself at ``k = 0``)."""
        tmap, ftype = jax.tree_util.tree_map, self.rho.dtype
        step = jnp.where(s.k == 0, 0.0, s.eta) / _norm(s.g, ftype)
        z = self.project(tmap(lambda x, r: x + step * r, s.x, s.g))
        mom = jnp.where(s.k <= 1, 1.0, self.momentum).astype(ftype)  # the first iteration takes z itself
        return self.project(tmap(lambda x, zz, xp: x + mom * (zz - x) + (1 - mom) * (x - xp), s.x, z, s.x_prev))

    def update(self, s: _AscentState, x_new: PyTree, f_new: jax.Array, g_new: PyTree) -> _AscentState:
        """Record the value ``f_new`` and gradient ``g_new`` at ``x_new``; halve at a checkpoint."""
        start = s.k == 0
        # a non-finite gradient makes the next iterate, hence its value, non-finite: checking the
        # value suffices (no extra pass over every parameter's gradient per iteration)
        finite = s.finite & jnp.isfinite(f_new)
        succ = s.succ + ((f_new > s.f) & ~start).astype(jnp.int32)
        better = (f_new > s.best_f) | start
        best_x = _select(better, x_new, s.best_x)
        best_g = _select(better, g_new, s.best_g)
        best_f = jnp.where(better, f_new, s.best_f)
        at_ck = jnp.isin(s.k, jnp.asarray(_checkpoints(self.n_iter)))
        span = (s.k - s.last_ck).astype(self.rho.dtype)
        halve = at_ck & ((succ < 0.75 * span) | ((s.eta == s.eta_ck) & (best_f == s.best_ck)))
        return _AscentState(
            k=s.k + 1,
            x=_select(halve, best_x, x_new),
            x_prev=_select(halve, best_x, s.x),
            f=jnp.where(halve, best_f, f_new),
            g=_select(halve, best_g, g_new),
            eta=jnp.where(halve, s.eta / 2, s.eta),
            best_x=best_x,
            best_f=best_f,
            best_g=best_g,
            succ=jnp.where(at_ck, 0, succ),
            last_ck=jnp.where(at_ck, s.k, s.last_ck),
            eta_ck=jnp.where(at_ck, s.eta, s.eta_ck),
            best_ck=jnp.where(start, f_new, jnp.where(at_ck, best_f, s.best_ck)),
            finite=finite,
        )

    def run(self, value_and_grad: Callable, x0: PyTree, finite=True) -> tuple[PyTree, jax.Array, jax.Array]:
        """``n_iter`` iterations from ``x0`` (one ``lax`` loop, one evaluation per iteration plus the
        start's): the best point, its value, and whether every value was finite."""

        def body(_, s):
            x = self.propose(s)
            return self.update(s, x, *value_and_grad(x))

        s = jax.lax.fori_loop(0, self.n_iter + 1, body, self.init(x0, finite))
        return s.best_x, s.best_f, s.finite


def _antipodal_restarts(run: Callable, x0: PyTree, base: jax.Array, n_restarts: int, finite):
    """The best of up to ``n_restarts + 1`` runs, run 0 from ``x0`` and run r >= 1 from the antipode of
    run r - 1's best point; stop once ``_RESTART_PATIENCE`` runs in a row raised the best value by
    less than ``_RESTART_RTOL`` of ``best - base``, or at a non-finite value.

    ``run(x0, finite) -> (best_x, best_f, finite)``.  All runs are one ``lax.while_loop``, so a run is
    traced and compiled once whatever ``n_restarts``.  Returns the best point, value and finiteness.
    """

    def one_run(c):
        r, x_prev_run, x_best, f_best, fin, stall = c
        x_run, f_run, fin = run(_scale(-1.0, x_prev_run), fin)  # run 0: the antipode of the antipode of x0
        first = r == 0
        improved = first | (f_run > f_best + _RESTART_RTOL * jnp.abs(f_best - base))
        better = first | (f_run > f_best)
        return (
            r + 1,
            x_run,
            _select(better, x_run, x_best),
            jnp.where(better, f_run, f_best),
            fin,
            jnp.where(improved, 0, stall + 1),
        )

    def go_on(c):
        r, _, _, _, fin, stall = c
        return (r == 0) | ((r <= n_restarts) & (stall < _RESTART_PATIENCE) & fin)

    zero, none = jnp.zeros((), jnp.int32), jnp.asarray(-jnp.inf, base.dtype)
    _, _, best_x, best_f, finite, _ = jax.lax.while_loop(
        go_on, one_run, (zero, _scale(-1.0, x0), x0, none, finite, zero)
    )
    return best_x, best_f, finite


def _auto_pgd(
    loss_fn, geometry, params, fac, batch, rho, key, n_iter: int, momentum: float, keep: bool, n_restarts: int = 0
):
    """Auto-PGD on one batch from the base-point factorization ``fac``; returns (value, all finite, perturbation).

    The search runs on the list of per-block parts of ``geometry`` (pair sides, GL(1) rates, other
    leaves), in coordinates where the ball is Euclidean; keeping them apart (instead of one raveled
    vector) saves a copy of every parameter per iteration.  The geometry runs at "highest" matmul
    precision, the loss at the caller's.  One value-and-gradient per iteration, traced once.

    Run 0 is the single run of Croce & Hein from half the radius in the random direction of
    :meth:`_Geometry.start` (so ``n_restarts=0`` reproduces it exactly); then up to ``n_restarts``
    antipodal runs (:func:`_antipodal_restarts`).  Near a minimum the loss rises through its
    Hessian's quadratic form, which is even in the perturbation: the ascent's local maxima come in
    near-antipodal pairs whose values differ by the odd (third-order) terms, and a run ends near the
    member on its start's side.  The antipodal run tries the other member and, the quadratic part
    being even, also continues the previous run's convergence towards the top curvature direction
    with a fresh step size (each run halves its step as it stalls, which slows that convergence).
    """
    w, treedef = jax.tree_util.tree_flatten(params)
    base = loss_fn(params, batch)
    ascent = _AutoPGD(jnp.asarray(rho, base.dtype), n_iter, momentum)
    loss_at = jax.value_and_grad(
        lambda moved: loss_fn(jax.tree_util.tree_unflatten(treedef, geometry.assemble(w, moved)), batch)
    )

    def value_and_riemannian_grad(parts):
        moved, caches = geometry.perturb(w, fac, parts)
        f, grad = loss_at(moved)
        return f, geometry.riemannian(w, fac, parts, caches, moved, grad)

    v = geometry.start(key, w, fac)
    v0 = _scale(0.5 * ascent.rho / _norm(v, base.dtype), v)
    best_x, best_f, finite = _antipodal_restarts(
        lambda x0, fin: ascent.run(value_and_riemannian_grad, x0, fin), v0, base, n_restarts, jnp.isfinite(base)
    )
    perturbation = None
    if keep:
        delta = geometry.assemble(w, geometry.perturb(w, fac, best_x)[0])
        perturbation = jax.tree_util.tree_unflatten(treedef, [d - wi for d, wi in zip(delta, w)])
    return best_f - base, finite & jnp.isfinite(best_f), perturbation


@functools.partial(jax.jit, static_argnames=("geometry",))
def _factorize(geometry, params):
    return geometry.factors(jax.tree_util.tree_leaves(params))


def _search_batches_impl(
    loss_fn, params, fac, batches, rho, keys, *, geometry, n_iter: int, momentum: float, keep: bool, n_restarts: int
):
    # the base-point factorization ``fac`` is computed once, outside the loop over batches
    return jax.lax.map(
        lambda kb: _auto_pgd(loss_fn, geometry, params, fac, kb[1], rho, kb[0], n_iter, momentum, keep, n_restarts),
        (keys, batches),
    )


# traced at every call (never stale in what loss_fn reads), compiled once per traced program
_search_batches = jit_per_callable(
    _search_batches_impl, static_argnames=("geometry", "n_iter", "momentum", "keep", "n_restarts")
)


def _status(pairs_ok: jax.Array, finite: jax.Array, rho_ok: jax.Array = True) -> jax.Array:
    return jnp.where(
        ~jnp.asarray(rho_ok),
        STATUS_BAD_RHO,
        jnp.where(~pairs_ok, STATUS_SINGULAR_PAIR, jnp.where(jnp.all(finite), STATUS_OK, STATUS_NON_FINITE)),
    ).astype(jnp.int32)


def _pair_bounds(fac: list, dtype) -> list:
    """Per pair, the error bound ``cond(side) eps(dtype)`` of every head (inf where not finite)."""
    eps = float(jnp.finfo(dtype).eps)
    return [jnp.where(jnp.isfinite(f.cond), f.cond * eps, jnp.inf) for f in fac]


def _error_bound(fac: list, dtype) -> jax.Array:
    """:attr:`SharpnessResult.error_bound`: the largest per-head bound, or ``eps(dtype)`` without pairs."""
    eps = jnp.asarray(jnp.finfo(dtype).eps, dtype)
    bounds = [jnp.max(b).astype(dtype) for b in _pair_bounds(fac, dtype)]
    return jnp.max(jnp.stack(bounds + [eps]))


def _raise_if_pair_inaccurate(who: str, geometry, fac: list, dtype, rtol: float) -> None:
    """Eagerly: raise if a pair's error bound ``cond eps`` exceeds ``rtol``, naming an ``eps`` that works."""
    for j, (f, bound) in enumerate(zip(fac, _pair_bounds(fac, dtype))):
        b = np.asarray(bound)
        if (b <= rtol).all():
            continue
        name = geometry.names[j] if j < len(geometry.names) else f"pair {j}"
        bad = tuple(int(i) for i in np.argwhere(~(b <= rtol))[0]) if b.ndim else ()
        worst = float(np.max(b))
        target = rtol / float(jnp.finfo(dtype).eps)
        eps_ok = max(_eps_that_works(np.asarray(f.G), np.asarray(f.H), target), geometry.eps)
        raise GeometryError(
            f"{who}: GL(h) pair {j} ({name}) is too ill conditioned at {jnp.dtype(dtype).name} for rtol={rtol:g}: "
            f"error bound cond(side) * eps = {worst:.3g} > rtol (worst head index {bad}; condition number of a side "
            f"{worst / float(jnp.finfo(dtype).eps):.3g}, accepted up to {target:.3g}; a numerically rank deficient "
            f"pair has an infinite bound). Remedies: the relaxation eps > 0 of metric (15) (App. G.2), e.g. "
            f"mg.symmetry_spec(..., eps={eps_ok:.1g}), which makes this pair's bound <= rtol/2 but breaks exact "
            "invariance by about eps / s_min^2; float64; a looser rtol (at most the error you can accept); or a "
            "better-conditioned point."
        )


def _raise_if_non_finite(who: str, per_batch, finite) -> None:
    bad = np.flatnonzero(~np.asarray(finite))
    if bad.size:
        raise GeometryError(
            f"{who}: the loss or its gradient is not finite at the base point or along the search on "
            f"batch {int(bad[0])} ({bad.size} of {np.size(finite)} batches; values {np.asarray(per_batch)[bad][:3]}). "
            "Check the loss at params (NaN/inf inputs, log of 0), use float64, or a smaller rho."
        )


def _check_params(params: PyTree, batches: PyTree, who: str) -> None:
    check_finite(params, f"{who}: params", hint="Sharpness of a point with non-finite weights is undefined.")
    check_finite(batches, f"{who}: batches", hint="Remove or fix the non-finite inputs.")


def _check_rtol(rtol: Any, who: str) -> None:
    if isinstance(rtol, bool) or not isinstance(rtol, (int, float, np.integer, np.floating)) or not 0 < rtol < 1:
        raise GeometryError(f"{who}: rtol must be a float in (0, 1), got {rtol!r}.")


def _over_batches(
    loss_fn, geometry, params, batches, rho, key, n_iter, momentum, keep, who, n_restarts, rtol=DEFAULT_RTOL
) -> SharpnessResult:
    n, dtype = _check_common(loss_fn, params, rho, batches, n_iter, key, who)
    _check_restarts(n_restarts)
    _check_rtol(rtol, who)
    eager = is_concrete(params, batches, rho, key)
    if eager:
        _check_params(params, batches, who)
    fac = _factorize(geometry, params) if geometry.pairs else []
    if eager:  # before the (expensive) search
        _raise_if_pair_inaccurate(who, geometry, fac, dtype, rtol)
    values, finite, perts = _search_batches(
        loss_fn, params, fac, batches, rho, jax.random.split(key, n), geometry=geometry, n_iter=n_iter,
        momentum=momentum, keep=bool(keep), n_restarts=int(n_restarts),
    )
    bound = _error_bound(fac, dtype)
    pairs_ok = bound <= rtol
    status = _status(pairs_ok, finite, _rho_ok(rho, dtype))
    if eager:
        _raise_if_non_finite(who, values, finite)
    return SharpnessResult(jnp.mean(values), values, perts, status, bound)


def _average_case_impl(loss_fn, params, batches, rho, keys, *, n_samples: int, fixed: tuple):
    w, treedef = jax.tree_util.tree_flatten(params)

    def one_batch(kb):
        k, batch = kb

        def sample(kk):
            pert = [
                wi if i in fixed else wi + jnp.abs(wi) * rho * zi for i, (wi, zi) in enumerate(zip(w, _normal_like(kk, w)))
            ]
            return loss_fn(jax.tree_util.tree_unflatten(treedef, pert), batch)

        base = loss_fn(params, batch)
        value = jnp.mean(jax.lax.map(sample, jax.random.split(k, n_samples))) - base
        return value, jnp.isfinite(value)

    return jax.lax.map(one_batch, (keys, batches))


_average_case = jit_per_callable(_average_case_impl, static_argnames=("n_samples", "fixed"))


def adaptive_sharpness(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    batches: PyTree,
    rho: float,
    *,
    key: jax.Array,
    kind: str = "worst",
    n_iter: int = 20,
    n_samples: int = 64,
    momentum: float = 0.75,
    spec: SymmetrySpec | None = None,
    return_perturbation: bool = False,
    n_restarts: int = N_RESTARTS,
) -> SharpnessResult:
    r"""Adaptive sharpness of ``loss_fn`` at ``params``: worst case by Auto-PGD, or the average case.

    .. math::

        S_{\max} = \max_{\lVert\delta/|w|\rVert_2 \le \rho} L(w + \delta) - L(w),\qquad
        S_{\mathrm{avg}} = \mathbb E_{z\sim\mathcal N(0,\rho^2 I)}\,L(w + |w|\odot z) - L(w),

    per batch, then averaged over batches.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch) -> scalar``.  Must be hashable (a module-level
        function or a fixed lambda), as it is a static argument of the compiled loop.
    params : pytree
        The weights :math:`w`.
    batches : pytree
        A **stack** of batches: every leaf of shape ``(num_batches, batch_size, ...)``, the leading
        batch-index axis shared by all leaves, each batch keeping its own example axis (so every leaf has
        at least two axes; a per-batch scalar has shape ``(num_batches, 1)``).  ``loss_fn`` receives one
        entry ``batch = tree_map(lambda x: x[b], batches)``; the result is averaged over batches.  Stack
        one batch with ``tree_map(lambda x: x[None], batch)``, a dataset with
        ``mg.batches_of(data, batch_size, drop_remainder=True).stacked()``.
    rho : float
        Radius of the adaptive L2 ball :math:`\lVert\delta/|w|\rVert_2 \le \rho`; at most ``1/eps`` of the
        loss's dtype (8.4e6 in float32, 4.5e15 in float64), beyond which ``w + delta`` no longer
        depends on ``w`` in rounding.
    key : jax.Array
        PRNG key (random start, average-case samples), e.g. ``jax.random.PRNGKey(0)``.
    kind : {"worst", "average"}, optional
        ``"worst"`` (Auto-PGD, ``n_iter`` iterations) or ``"average"`` (``n_samples`` Gaussian samples).
    n_iter : int, optional
        Auto-PGD iterations per run (worst case).
    n_samples : int, optional
        Gaussian samples (average case).
    momentum : float, optional
        Auto-PGD momentum (Croce & Hein 2020).
    spec : SymmetrySpec, optional
        Only its ``redundant`` leaves are used (held fixed, since the function does not depend on
        them); its pairs are ignored, as adaptive sharpness treats every leaf element-wise.
    return_perturbation : bool, optional
        Keep the maximizing perturbation of every batch (a full copy of the weights per batch).
    n_restarts : int, optional
        Worst case only: at most this many further Auto-PGD runs of ``n_iter`` iterations after the
        first, each from the antipode of the previous run's best point, keeping the best point of
        all; they stop once two runs in a row raised the best value by less than 0.1 % of the
        sharpness, so a call costs ``n_iter + 1`` loss gradients per run, for between
        ``min(3, n_restarts + 1)`` and ``n_restarts + 1`` runs.  ``0`` is the single run of Croce & Hein
        (2020); the default reaches >= 0.999 of the exact maximum on chapter 6's diagonal networks,
        where a single run of 20 iterations reaches 0.77 to 1.

    Returns
    -------
    SharpnessResult
        With a ``status`` (see there).

    Raises
    ------
    GeometryError
        Always (shapes and dtypes are static): ``batches`` not stacked (a leaf with fewer than two axes)
        or its leaves disagreeing on the number of batches; ``loss_fn`` failing on one batch's shapes or
        not returning a real scalar; ``key`` not a PRNG key; params empty, integer or complex; params or
        loss in float16/bfloat16 (cast to float32).  Eagerly: rho not a positive finite scalar or above
        ``1/eps`` of the loss's dtype, non-finite params or batches, or a non-finite loss during the
        search.  Under ``jit`` the values cannot be checked: read ``result.status``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> loss = lambda w, b: 0.5 * jnp.sum(b * (w - 1.0) ** 2)        # minimum at w = 1, curvature b
    >>> res = mg.adaptive_sharpness(loss, jnp.ones(3), jnp.array([[1.0, 2.0, 4.0]]), 0.1, key=jax.random.PRNGKey(0))
    >>> round(float(res.sharpness), 4)                               # closed form: rho^2 max(b) / 2
    0.02

    References
    ----------
    Andriushchenko et al. (2023) (adaptive sharpness, Auto-PGD); da Silva, Dangel & Oore (2025),
    *Hide & Seek*, eqs. (1) to (3), App. C.2. Chapters 6 and 7.
    """
    who = "adaptive_sharpness"
    if spec is not None:
        _check_spec(spec, params, who)
    geometry = _Geometry(spec, adaptive=True)
    if kind == "worst":
        return _over_batches(
            loss_fn, geometry, params, batches, rho, key, n_iter, momentum, return_perturbation, who, n_restarts
        )
    if kind != "average":
        raise GeometryError(f"adaptive_sharpness: kind must be 'worst' or 'average', got {kind!r}.")
    n, dtype = _check_common(loss_fn, params, rho, batches, n_iter, key, who)
    if isinstance(n_samples, bool) or not (isinstance(n_samples, (int, np.integer)) and n_samples >= 1):
        raise GeometryError(f"adaptive_sharpness: n_samples must be a positive int, got {n_samples!r}.")
    eager = is_concrete(params, batches, rho, key)
    if eager:
        _check_params(params, batches, who)
    values, finite = _average_case(
        loss_fn, params, batches, rho, jax.random.split(key, n), n_samples=int(n_samples), fixed=geometry.fixed
    )
    if eager:
        _raise_if_non_finite(who, values, finite)
    status = _status(jnp.asarray(True), finite, _rho_ok(rho, dtype))
    return SharpnessResult(jnp.mean(values), values, None, status, _error_bound([], dtype))


def geodesic_sharpness(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    params: PyTree,
    batches: PyTree,
    spec: SymmetrySpec,
    rho: float,
    *,
    key: jax.Array,
    n_iter: int = 20,
    momentum: float = 0.75,
    return_perturbation: bool = False,
    n_restarts: int = N_RESTARTS,
    rtol: float = DEFAULT_RTOL,
) -> SharpnessResult:
    r"""Worst-case geodesic sharpness on the quotient by the spec's symmetries.

    .. math:: S = \max_{\xi\ \mathrm{horizontal},\ \lVert\xi\rVert_g \le \rho} L\big(w + \xi - \tfrac12\Gamma(\xi,\xi)\big) - L(w),

    per batch, then averaged over batches: metric (15) on the GL(h) pairs of ``spec`` (exact
    geodesics on its GL(1) pairs), the adaptive norm elsewhere; Auto-PGD with Riemannian gradients and
    projection onto the horizontal ball.  Invariant under :math:`(G, H) \mapsto (GA^{-1}, HA^\top)` on
    every pair (with ``spec.eps = 0``) and under element-wise rescalings elsewhere; the spec's
    redundant leaves are not perturbed.  The metric at the base point is factored once per call (thin
    SVDs of every pair's sides at ``"highest"`` precision, shared by all batches).

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch) -> scalar``; hashable (a static argument of the compiled loop).
    params : pytree
        The weights :math:`w`.
    batches : pytree
        A stack of batches, every leaf of shape ``(num_batches, batch_size, ...)`` (see
        :func:`adaptive_sharpness`).
    spec : SymmetrySpec
        The symmetries, from :func:`symmetry_spec`.
    rho : float
        Radius of the geodesic ball.
    key : jax.Array
        PRNG key of the random (horizontal, equivariant) start.
    n_iter, momentum, return_perturbation, n_restarts
        As in :func:`adaptive_sharpness`.
    rtol : float, optional
        Relative accuracy, in (0, 1), required of the factorization of metric (15): a GL(h) pair is
        accepted when its error bound :math:`\mathrm{cond}(\text{side})\,\varepsilon_{\text{dtype}}` (largest
        over heads) is at most ``rtol``.  The default 1e-2 accepts float32 sides up to condition number
        8.4e4 (a ViT-B/32 moved by per-head :math:`A = I + N/8` has 3.9e4, bound 4.6e-3).

    Returns
    -------
    SharpnessResult
        With a ``status`` and the ``error_bound`` (see there); ``perturbation`` only if
        ``return_perturbation``.

    Raises
    ------
    GeometryError
        Eagerly: a GL(h) pair whose error bound exceeds ``rtol`` (rank-deficient pairs included; the
        message names the pair, the head, the bound, and a relaxation ``eps`` computed for this pair that
        brings its bound to ``rtol/2``), and the errors of :func:`adaptive_sharpness` (batches not
        stacked, a loss that fails on a batch's shapes, a bad key, float16/bfloat16, rho out of range).
        Under ``jit``: no exception; read ``result.status``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> params = {"G": jnp.array([[1.0, 0.0], [0.0, 2.0]]), "H": jnp.array([[1.0, 1.0], [0.0, 1.0]])}
    >>> loss = lambda p, T: 0.5 * jnp.sum((p["G"] @ p["H"].T - T) ** 2)
    >>> spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    >>> T = (params["G"] @ params["H"].T)[None]
    >>> res = mg.geodesic_sharpness(loss, params, T, spec, 0.05, key=jax.random.PRNGKey(0))
    >>> bool(res.sharpness > 0)
    True

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eqs. (6) and (8); App. C.1, C.2 (Algorithm 1). Chapters 6 and 7.
    """
    who = "geodesic_sharpness"
    _check_spec(spec, params, who)
    return _over_batches(
        loss_fn, _Geometry(spec), params, batches, rho, key, n_iter, momentum, return_perturbation, who, n_restarts,
        rtol,
    )


def _check_spec(spec: Any, params: PyTree, who: str) -> None:
    if not isinstance(spec, SymmetrySpec):
        raise GeometryError(f"{who} needs a SymmetrySpec from mg.symmetry_spec(params, gl_pairs).")
    n_leaves = len(jax.tree_util.tree_leaves(params))
    if spec.num_leaves != n_leaves:
        raise GeometryError(
            f"the SymmetrySpec was built for a pytree with {spec.num_leaves} leaves, but params has {n_leaves}; "
            "build the spec from these params."
        )


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    r"""Kendall's rank correlation :math:`\tau_b` of two sequences (``scipy.stats.kendalltau``).

    .. math:: \tau = \frac{2}{M(M-1)}\sum_{i<j}\operatorname{sign}(x_i - x_j)\operatorname{sign}(y_i - y_j)\quad\text{(without ties; } \tau_b \text{ corrects for ties)}

    Parameters
    ----------
    x, y : sequence of float
        Paired values, e.g. sharpness and generalization gap of :math:`M` models.

    Returns
    -------
    float
        :math:`\tau_b \in [-1, 1]`.

    Raises
    ------
    GeometryError
        If the lengths differ or are below 2.

    Examples
    --------
    >>> import minigeo as mg
    >>> round(mg.kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]), 6)
    0.666667

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5 (Kendall's tau, first display). Chapters 6 and 7.
    """
    from scipy.stats import kendalltau

    x, y = list(map(float, x)), list(map(float, y))
    if len(x) != len(y) or len(x) < 2:
        raise GeometryError(
            f"kendall_tau needs two sequences of the same length >= 2; got lengths {len(x)} and {len(y)}."
        )
    return float(kendalltau(x, y).statistic)

r"""The search space of the sharpness ascent: one block per parameter group (:class:`_Geometry`).

Auto-PGD (:mod:`minigeo.sharpness._ascent`) searches a list of arrays ("parts") in which the ball of
the sharpness is Euclidean.  Each symmetry kind is one :class:`_Block` subclass that maps its parts to
the perturbed weights and back:

* :class:`_GLhPair`: a GL(h) pair under metric (15), parts in whitened coordinates, moved along the
  second-order geodesic (the factorization comes from :mod:`minigeo._pairs`);
* :class:`_GL1Pair`: an element-wise GL(1) pair, moved along its exact horizontal geodesic;
* :class:`_ElementWise`: any other leaf, perturbed element-wise with the adaptive norm.

:class:`_Geometry` puts the blocks of a :class:`~minigeo.sharpness.SymmetrySpec` side by side.  **Adding a
symmetry kind = adding one** :class:`_Block` **subclass here and registering it in** :class:`_Geometry`
(in ``__init__``, from the spec's field for that kind); the ascent and the drivers need no change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._pairs import _factor_pair, _mT, _PairFrame, _whitened_projection
from ._spec import Side, SymmetrySpec


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
    second_order: bool = True

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
        r"""The two moved sides as matrices (eq. 7), and what the chain rule needs.

        With ``second_order=False`` (the control without the Christoffel term) the moved sides are
        the straight line :math:`M + \xi = \hat M R + zR`."""
        if not self.second_order:
            return [(f.Gn + parts[0]) @ f.P_half, (f.Hn + parts[1]) @ f.Q_half], None
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
        if not self.second_order:  # straight line: the gradient in z is D R^T
            gG, gH = grad[0] @ _mT(f.P_half), grad[1] @ _mT(f.Q_half)
            return _horizontal_whitened(f, (_mT(f.Gn) @ gG, _mT(f.Hn) @ gH), (gG, gH))
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
    second_order: bool = True

    @property
    def leaves(self) -> tuple[int, ...]:
        return (self.u, self.v)

    def start(self, w: list, f: None, noise: list) -> list:
        return [math.sqrt(2.0) * noise[0]]

    def perturb(self, w: list, f: None, parts: list) -> tuple[list, None]:
        B = parts[0] / math.sqrt(2.0)
        if not self.second_order:  # the straight line (u + uB, v + vB)
            return [(w[self.u] * (1.0 + B), w[self.v] * (1.0 + B))], None
        return [(w[self.u] * jnp.exp(B), w[self.v] * jnp.exp(B))], None

    def write(self, out: list, moved: list) -> None:
        out[self.u], out[self.v] = moved[0]

    def riemannian(self, w: list, f: None, parts: list, cache: None, moved: list, grad: list) -> list:
        (u1, v1), (gu, gv) = moved[0], grad[0]
        if not self.second_order:
            u1, v1 = w[self.u], w[self.v]
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

    def __init__(self, spec: SymmetrySpec | None, *, adaptive: bool = False, second_order: bool = True):
        """The geometry of ``spec``'s symmetries; ``adaptive=True`` keeps only its redundant leaves
        (held fixed) and treats every other leaf element-wise (adaptive sharpness);
        ``second_order=False`` moves the pairs along straight lines (no Christoffel term)."""
        use_pairs = spec is not None and not adaptive
        self.pairs = spec.pairs if use_pairs else ()
        self.gl1 = spec.gl1_pairs if use_pairs else ()
        self.eps = spec.eps if use_pairs else 0.0
        self.names = spec.pair_names if use_pairs else ()
        self.fixed = tuple(spec.redundant) if spec is not None else ()
        self.second_order = bool(second_order)
        self._paired = [_GLhPair(g, h, self.eps, self.second_order) for g, h in self.pairs] + [
            _GL1Pair(u, v, self.second_order) for u, v in self.gl1
        ]

    def _key(self) -> tuple:
        return (self.pairs, self.gl1, self.eps, self.fixed, self.second_order)

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

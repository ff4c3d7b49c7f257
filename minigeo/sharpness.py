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

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, check_finite, is_concrete
from ._tree import PyTree
from .quotient import _factor_pair, _mT, _PairFrame, _raise_if_singular, _whitened_projection

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
    """Which leaves of a parameter pytree form GL(h) pairs ``(G, H)`` (used as ``G H^T``), which form
    element-wise GL(1) pairs ``(u, v)`` (used as ``u * v``, e.g. diagonal networks), and, implicitly,
    that all other leaves are treated element-wise by the adaptive recipe.

    ``redundant`` holds leaves the network function does not depend on at all (e.g. attention's
    key bias): no sharpness measure perturbs them.

    Build it with :func:`symmetry_spec`, which checks the paths and shapes.  ``pairs`` holds,
    per GL(h) pair, the leaf indices (in ``jax.tree_util.tree_leaves`` order) of each side:
    ``(weight,)`` or ``(weight, bias)`` when a bias is appended as a last row (da Silva et al. 2025,
    Example A.1).  ``gl1_pairs`` holds ``(u, v)`` leaf indices.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 3.1, Sec. 5.2 and Example A.1. Taught in
    chapters 6, *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic sharpness of
    vision transformers*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> params = {"b": jnp.ones(3), "G": jnp.ones((4, 2)), "H": jnp.ones((5, 2))}
    >>> spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    >>> spec.pairs, spec.num_leaves  # leaf indices in tree_leaves order: G=0, H=1, b=2
    ((((0,), (1,)),), 3)
    """

    pairs: tuple[tuple[Side, Side], ...]
    num_leaves: int
    eps: float
    gl1_pairs: tuple[tuple[int, int], ...] = ()
    redundant: tuple[int, ...] = ()
    pair_names: tuple[str, ...] = ()


class WithBias(NamedTuple):
    """One side of a GL(h) pair: a weight ``(..., n, h)`` with its bias ``(..., h)`` appended as row ``n + 1``.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Example A.1 (biases appended to the weight
    matrix). Taught in chapters 6, *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic
    sharpness of vision transformers*.

    Examples
    --------
    >>> import minigeo as mg
    >>> side = mg.with_bias(("attn", "W_v"), ("attn", "b_v"))
    >>> isinstance(side, mg.WithBias), side.bias
    (True, ('attn', 'b_v'))
    """

    weight: Path
    bias: Path


def with_bias(weight: Path, bias: Path) -> WithBias:
    r"""Name a GL(h) side whose bias is appended to its weight, :math:`\binom{W}{b^\top}` (da Silva et al. 2025, Example A.1).

    Attention computes :math:`XW_q + \mathbf 1 b_q^\top = [X\ \mathbf 1]\binom{W_q}{b_q^\top}`, so
    the GL(h) symmetry :math:`(G, H) \mapsto (GA^{-1}, HA^\top)` acts on the weight and its bias
    together: pass ``with_bias(("W_q",), ("b_q",))`` as a side in :func:`symmetry_spec`.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Example A.1. Taught in chapters 6,
    *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic sharpness of vision
    transformers*.

    Examples
    --------
    >>> import minigeo as mg
    >>> mg.with_bias(("attn", "W_q"), ("attn", "b_q"))
    WithBias(weight=('attn', 'W_q'), bias=('attn', 'b_q'))
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
    r"""Name the GL(h) pairs of a parameter pytree by their paths, e.g. ``[(("attn", "W_q"), ("attn", "W_k"))]``.

    Each pair's arrays must have shapes ``(..., n, h)`` and ``(..., m, h)`` with equal
    ``h`` and batch (head) dimensions.  A side given as :func:`with_bias` ``(weight, bias)``
    appends the bias ``(..., h)`` to its weight as a last row, so the pair is
    :math:`\big(\binom{W_G}{b_G^\top}, \binom{W_H}{b_H^\top}\big)` (da Silva et al. 2025, Example A.1).
    ``gl1_pairs`` name leaves ``(u, v)`` of equal shape used through ``u * v``: they get the
    exact horizontal geodesics :math:`(u e^{B}, v e^{B})` of da Silva et al. 2025, eq. (10).  ``eps`` is
    the relaxation of App. G.2.

    ``redundant`` names leaves that do not change the network function (a direction :math:`v`
    with :math:`f(w + tv) = f(w)` for all :math:`t`): attention's key bias :math:`b_k` adds
    :math:`q_i^\top b_k` to every score of query :math:`i`, which the softmax over keys removes.
    Perturbing such a leaf cannot change the loss but spends the perturbation budget and lets
    the metric depend on a coordinate the function ignores, so geodesic and adaptive sharpness
    hold them fixed.  (Da Silva et al. 2025, Example A.1, appends :math:`b_k` to the key side of the pair
    instead; that is a valid symmetry, but it makes sharpness change when :math:`b_k` is shifted.)

    Raises
    ------
    GeometryError
        If a path does not exist (the message lists the available paths), a leaf is
        used twice, or the shapes are incompatible.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.2, Example A.1 and App. G.2 (relaxation).
    Taught in chapters 6, *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic
    sharpness of vision transformers*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> params = {"q": jnp.ones((4, 2)), "k": jnp.ones((3, 2)), "b": jnp.ones(3), "bq": jnp.ones(2)}
    >>> mg.symmetry_spec(params, [(("q",), ("k",))]).pairs
    (((3,), (2,)),)
    >>> mg.symmetry_spec(params, [(mg.with_bias(("q",), ("bq",)), ("k",))]).pairs
    (((3, 1), (2,)),)
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


#: :attr:`SharpnessResult.status` codes: success, a numerically singular GL(h) pair, a non-finite value.
STATUS_OK, STATUS_SINGULAR_PAIR, STATUS_NON_FINITE = 0, 1, 2

#: Default maximum number of antipodal Auto-PGD restarts after the first run (``n_restarts`` of
#: :func:`adaptive_sharpness` and :func:`geodesic_sharpness`); the restarts stop early once two runs
#: in a row raised the best value by less than ``_RESTART_RTOL`` of the sharpness.
N_RESTARTS = 7
_RESTART_RTOL, _RESTART_PATIENCE = 1e-3, 2


class SharpnessResult(NamedTuple):
    """Sharpness averaged over batches, per batch, the maximizing perturbations, and a status.

    ``perturbation`` is the maximizing perturbation of each batch, stacked along a leading axis,
    when the call asked for it (``return_perturbation=True``; at ViT-B/32 that is 88 M numbers per
    batch), else ``None``.

    ``status`` is an int32 scalar: ``0`` (``STATUS_OK``), ``1`` (``STATUS_SINGULAR_PAIR``, a
    GL(h) pair is numerically rank deficient at its dtype, so metric (15) is undefined there) or
    ``2`` (``STATUS_NON_FINITE``, the loss or its gradient was NaN/inf at the base point or
    during the search).  Called eagerly, :func:`adaptive_sharpness` and :func:`geodesic_sharpness`
    raise :class:`GeometryError` instead of returning a bad status; under ``jax.jit`` they cannot
    raise, so check ``result.status`` (or ``result.ok``) yourself.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. C.2 (sharpness averaged over batches).
    Taught in chapters 6, *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic
    sharpness of vision transformers*.

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
    """

    sharpness: jax.Array
    per_batch: jax.Array
    perturbation: PyTree = None
    status: jax.Array = STATUS_OK

    @property
    def ok(self) -> jax.Array:
        """``status == 0``: every pair well conditioned and every value finite (check this under ``jit``)."""
        return jnp.asarray(self.status) == STATUS_OK


# ---------------------------------------------------------------------------
# the geometry of the perturbation, on flat lists of leaves
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


class _Geometry:
    """The search space of Auto-PGD: coordinates in which the norm of the ball is Euclidean.

    The search runs on a list of arrays ("parts"): for each GL(h) pair, its two sides as
    matrices (bias row included) in **whitened** coordinates ``z = xi P^{-1/2}`` and
    ``xi Q^{-1/2}`` (metric (15) becomes the Frobenius inner product); for each GL(1) pair
    ``(u, v)``, ``b = sqrt(2) B`` where ``B`` is the common log-rate of its horizontal velocities
    (``xi_u = u B``, ``xi_v = v B``; metric ``2 B^2 = b^2``); for every other leaf, ``z`` with
    ``xi = |w| z`` (the adaptive norm).  So the norm is the parts' joint 2-norm, the ball projection
    a rescaling, and the Riemannian gradient the gradient in these coordinates followed by the
    horizontal projection of each pair.

    Per pair side and iteration the geometry costs nine products with the tall ``(n, h)``
    matrices: four for the perturbed point (eq. 7), two Gram matrices of the incoming gradient
    and three for the projected Riemannian gradient; the projection itself (a Sylvester solve)
    works on ``h x h`` matrices only.
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
        self.paired = (
            {i for p in self.pairs for side in p for i in side} | {i for p in self.gl1 for i in p} | set(self.fixed)
        )

    def _key(self) -> tuple:
        return (self.pairs, self.gl1, self.eps, self.fixed)

    def __hash__(self) -> int:  # a static argument of the compiled loop: equal geometries share a compilation
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Geometry) and self._key() == other._key()

    @staticmethod
    def gather(x: list, side: Side) -> jax.Array:
        """The matrix of one pair side: the weight, with the bias appended as a last row if the side has one."""
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

    def matrices(self, x: list) -> list[tuple[jax.Array, jax.Array]]:
        return [(self.gather(x, g), self.gather(x, h)) for g, h in self.pairs]

    def others(self, w: list) -> list[int]:
        return [i for i in range(len(w)) if i not in self.paired]

    @_highest
    def factors(self, w: list) -> list[_PairFrame]:
        """Per-pair factorizations of metric (15) at the base point, from thin SVDs of the sides
        (constant during the search, computed once per evaluation for all batches)."""
        return [_factor_pair(G, H, self.eps) for G, H in self.matrices(w)]

    def shapes(self, w: list) -> list[tuple[int, ...]]:
        """The shapes of the parts: pair sides (bias rows included), GL(1) rates, other leaves."""
        sides = [jnp.shape(m) for G, H in self.matrices(w) for m in (G, H)]  # abstract under jit: free
        return sides + [jnp.shape(w[u]) for u, _ in self.gl1] + [jnp.shape(w[i]) for i in self.others(w)]

    # -- the perturbed point and the Riemannian gradient ------------------------------------
    @_highest
    def perturb(self, w: list, fac: list, parts: list) -> tuple[list, list]:
        """The perturbed weights, segment by segment like ``parts``: eq. (7) on the pair sides (as
        matrices, bias rows included), eq. (10) on GL(1) pairs (a tuple ``(u', v')``) and
        ``w + |w| z`` elsewhere; :meth:`assemble` turns them into the list of leaves."""
        out: list = []
        caches = []
        for j, f in enumerate(fac):
            G1, cG = _side_forward(f.Gn, parts[2 * j], f.P_half)
            H1, cH = _side_forward(f.Hn, parts[2 * j + 1], f.Q_half)
            out += [G1, H1]
            caches.append((cG, cH))
        k = 2 * len(self.pairs)
        for j, (ui, vi) in enumerate(self.gl1):  # exact horizontal geodesic, da Silva et al. 2025 eq. (10)
            B = parts[k + j] / math.sqrt(2.0)
            out.append((w[ui] * jnp.exp(B), w[vi] * jnp.exp(B)))
        k += len(self.gl1)
        for j, i in enumerate(self.others(w)):
            out.append(w[i] + jnp.abs(w[i]) * parts[k + j])
        return out, caches

    def assemble(self, w: list, moved: list) -> list:
        """The list of leaves from the segments of :meth:`perturb` (the pair sides' bias rows split off).

        Called inside the differentiated loss, so the gradient arrives per segment: a pair side's
        gradient is one matrix, with no concatenation of weight and bias gradients."""
        out: list = [None] * len(w)
        for i in self.fixed:  # redundant directions: never perturbed
            out[i] = w[i]
        for j, (gs, hs) in enumerate(self.pairs):
            self.scatter(out, gs, moved[2 * j])
            self.scatter(out, hs, moved[2 * j + 1])
        k = 2 * len(self.pairs)
        for j, (ui, vi) in enumerate(self.gl1):
            out[ui], out[vi] = moved[k + j]
        k += len(self.gl1)
        for j, i in enumerate(self.others(w)):
            out[i] = moved[k + j]
        return out

    @_highest
    def riemannian(self, w: list, fac: list, parts: list, caches: list, moved: list, grad: list) -> list:
        r"""The Riemannian gradient, in the search coordinates, of ``loss(perturb(parts))``, given the
        Euclidean gradient ``grad`` of the loss with respect to the segments ``moved`` of :meth:`perturb`.

        On a pair, the gradient in whitened coordinates is projected onto the horizontal space:
        with :math:`\xi = (g_G P^{1/2}, g_H Q^{1/2})`, :math:`X` solves
        :math:`(PQ)X + X(PQ) = PH^\top\xi_H - \xi_G^\top GQ` and the result is
        :math:`(g_G + GX^\top P^{-1/2},\ g_H - HXQ^{-1/2})` (see :mod:`minigeo.quotient`).
        """
        out = []
        for j, (f, (cG, cH)) in enumerate(zip(fac, caches)):
            zG, zH, DG, DH = parts[2 * j], parts[2 * j + 1], grad[2 * j], grad[2 * j + 1]
            (KG, CsG, CcG), GtgG = _side_backward(f.Gn, zG, f.P_half, f.gram_G, cG, DG)
            (KH, CsH, CcH), HtgH = _side_backward(f.Hn, zH, f.Q_half, f.gram_H, cH, DH)
            corrG, corrH = _whitened_projection(f, GtgG, HtgH)
            out.append(DG @ KG + f.Gn @ (CsG + corrG) + zG @ CcG)
            out.append(DH @ KH + f.Hn @ (CsH - corrH) + zH @ CcH)
        k = 2 * len(self.pairs)
        for j in range(len(self.gl1)):
            (u1, v1), (gu, gv) = moved[k + j], grad[k + j]
            out.append((gu * u1 + gv * v1) / math.sqrt(2.0))
        k += len(self.gl1)
        for j, i in enumerate(self.others(w)):
            out.append(jnp.abs(w[i]) * grad[k + j])
        return out

    @_highest
    def start(self, key: jax.Array, w: list, fac: list) -> list:
        r"""An equivariant random start: random ``z`` for element-wise leaves and GL(1) pairs, and for
        each GL(h) pair the Riemannian gradient of a random linear function
        :math:`\mathrm{Tr}(R^\top GH^\top)` of :math:`GH^\top` (which moves with the group), with
        :math:`R = AB^\top` of rank h so that drawing it and applying it cost two products with
        the tall matrices instead of an ``n x m`` draw and product per head.  One draw for all
        leaves: a separate threefry per leaf multiplies XLA's compile time."""
        others = self.others(w)
        h_dims = [f.G.shape[-1] for f in fac]
        like = [w[u] for u, _ in self.gl1] + [w[i] for i in others]
        like += [jax.ShapeDtypeStruct(f.G.shape[:-1] + (h,), f.G.dtype) for f, h in zip(fac, h_dims)]
        like += [jax.ShapeDtypeStruct(f.H.shape[:-1] + (h,), f.H.dtype) for f, h in zip(fac, h_dims)]
        draws = _normal_like(key, like)
        n_el = len(self.gl1) + len(others)
        As, Bs = draws[n_el : n_el + len(fac)], draws[n_el + len(fac) :]
        parts = []
        for f, A, B in zip(fac, As, Bs):
            # Euclidean gradients (R H, R^T G) of Tr(R^T G H^T) with R = A B^T; in whitened
            # coordinates the Riemannian gradient before projection is g P^{1/2} (resp. g Q^{1/2}),
            # and G = Gn P^{1/2}, H = Hn Q^{1/2}
            gG = A @ ((_mT(B) @ f.H) @ f.P_half)
            gH = B @ ((_mT(A) @ f.G) @ f.Q_half)
            corrG, corrH = _whitened_projection(f, _mT(f.Gn) @ gG, _mT(f.Hn) @ gH)
            parts += [gG + f.Gn @ corrG, gH - f.Hn @ corrH]
        parts += [math.sqrt(2.0) * d for d in draws[: len(self.gl1)]]
        parts += draws[len(self.gl1) : n_el]
        return parts


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


def _check_rho(rho: Any) -> None:
    """rho may be a Python or NumPy scalar, a 0-d array or a traced value (then unchecked)."""
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


def _check_restarts(n_restarts: Any) -> None:
    if isinstance(n_restarts, bool) or not (isinstance(n_restarts, (int, np.integer)) and n_restarts >= 0):
        raise GeometryError(f"n_restarts must be an int >= 0, got {n_restarts!r}.")


def _check_common(rho: Any, batches: PyTree, n_iter: int) -> int:
    _check_rho(rho)
    if isinstance(n_iter, bool) or not (isinstance(n_iter, (int, np.integer)) and n_iter >= 1):
        raise GeometryError(f"n_iter must be a positive int, got {n_iter!r}.")
    leaves = jax.tree_util.tree_leaves(batches)
    if not leaves:
        raise GeometryError(
            "batches is empty: pass a pytree of arrays stacked along a leading batch-index axis."
        )
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes or 0 in sizes:
        raise GeometryError(
            f"batches must be stacked along a common leading axis of length >= 1 (one entry per batch); got leading sizes {sizes}."
        )
    return sizes.pop()


def _auto_pgd(
    loss_fn, geometry, params, fac, batch, rho, key, n_iter: int, momentum: float, keep: bool, n_restarts: int = 0
):
    """Auto-PGD on one batch from the base-point factorization ``fac``; returns (value, all finite, perturbation).

    Run 0 is the single run of Croce & Hein from the random start of :meth:`_Geometry.start` (so
    ``n_restarts=0`` reproduces it exactly); then up to ``n_restarts`` more runs of ``n_iter``
    iterations each, every one from the **antipode** ``-x`` of the previous run's best point, keeping
    the best point of all, until ``_RESTART_PATIENCE`` runs in a row raised the best value by less
    than ``_RESTART_RTOL`` of the sharpness.  Near a minimum the loss rises through its Hessian's
    quadratic form, which is even in the perturbation: the ascent's local maxima come in
    near-antipodal pairs whose values differ by the odd (third-order) terms, and a run ends near the
    member on its start's side.  The antipodal run tries the other member and, the quadratic part
    being even, also continues the previous run's convergence towards the top curvature direction
    with a fresh step size (each run halves its step as it stalls, which slows that convergence).
    """
    w, treedef = jax.tree_util.tree_flatten(params)
    base = loss_fn(params, batch)
    ftype = base.dtype
    rho = jnp.asarray(rho, ftype)
    loss_at = jax.value_and_grad(
        lambda moved: loss_fn(jax.tree_util.tree_unflatten(treedef, geometry.assemble(w, moved)), batch)
    )

    # The search runs on the list of per-segment arrays (pair sides, GL(1) rates, other leaves)
    # in coordinates where the ball is Euclidean; see _Geometry.  Keeping the segments apart
    # (instead of one raveled vector) saves a copy of every parameter per iteration.  The
    # geometry runs at "highest" matmul precision; the loss at the caller's.
    tmap = jax.tree_util.tree_map

    def value_and_riemannian_grad(parts):
        moved, caches = geometry.perturb(w, fac, parts)
        f, grad = loss_at(moved)
        return f, geometry.riemannian(w, fac, parts, caches, moved, grad)

    def norm(v):
        sq = sum((jnp.sum(p * p) for p in v), jnp.zeros((), ftype))
        return jnp.sqrt(jnp.maximum(sq, jnp.finfo(sq.dtype).tiny))

    def scale(c, v):
        return [c * p for p in v]

    def project(v):
        return scale(jnp.minimum(1.0, rho / norm(v)), v)

    def where(cond, a, b):
        return tmap(lambda x, y: jnp.where(cond, x, y), a, b)

    def random_start(k):
        v = geometry.start(k, w, fac)
        return scale(0.5 * rho / norm(v), v)

    checkpoints = jnp.zeros(n_iter + 1, dtype=bool).at[jnp.asarray(_checkpoints(n_iter))].set(True)
    eta0 = 2.0 * rho
    none = jnp.asarray(-jnp.inf, ftype)

    # Iteration k = 1..n_iter of Auto-PGD is loop step k; step 0 only evaluates the start point,
    # which always becomes the first best point (so the result is never the initial -inf).
    # One value-and-gradient per step, traced once: the Riemannian gradient at the new point is
    # carried to the next step (and the best point's kept for restarts), so no forward pass is repeated.
    def body(k, s):
        start = k == 0
        rg = s["g"]
        step = jnp.where(start, 0.0, s["eta"]) / norm(rg)
        z = project(tmap(lambda x, r: x + step * r, s["x"], rg))
        mom = jnp.where(k <= 1, 1.0, momentum).astype(ftype)  # the first iteration takes z itself
        x_new = project(
            tmap(lambda x, zz, xp: x + mom * (zz - x) + (1 - mom) * (x - xp), s["x"], z, s["x_prev"])
        )
        f_new, g_new = value_and_riemannian_grad(x_new)
        # a non-finite gradient makes the next iterate, hence its value, non-finite: checking the
        # value suffices (no extra pass over every parameter's gradient per iteration)
        finite = s["finite"] & jnp.isfinite(f_new)
        succ = s["succ"] + ((f_new > s["f"]) & ~start).astype(jnp.int32)
        better = (f_new > s["best_f"]) | start
        best_x = where(better, x_new, s["best_x"])
        best_g = where(better, g_new, s["best_g"])
        best_f = jnp.where(better, f_new, s["best_f"])
        at_ck = checkpoints[k]
        span = (k - s["last_ck"]).astype(ftype)
        halve = at_ck & ((succ < 0.75 * span) | ((s["eta"] == s["eta_ck"]) & (best_f == s["best_ck"])))
        return dict(
            x=where(halve, best_x, x_new),
            x_prev=where(halve, best_x, s["x"]),
            f=jnp.where(halve, best_f, f_new),
            g=where(halve, best_g, g_new),
            eta=jnp.where(halve, s["eta"] / 2, s["eta"]),
            best_x=best_x,
            best_f=best_f,
            best_g=best_g,
            succ=jnp.where(at_ck, 0, succ),
            last_ck=jnp.where(at_ck, k, s["last_ck"]),
            eta_ck=jnp.where(at_ck, s["eta"], s["eta_ck"]),
            best_ck=jnp.where(start, f_new, jnp.where(at_ck, best_f, s["best_ck"])),
            finite=finite,
        )

    def run(v0, finite):
        """One Auto-PGD run of n_iter iterations from v0: its best point, value and finiteness."""
        zeros = [jnp.zeros_like(p) for p in v0]
        state = dict(
            x=v0,
            x_prev=v0,
            f=none,
            g=zeros,
            eta=eta0,
            best_x=v0,
            best_f=none,
            best_g=zeros,
            succ=jnp.zeros((), jnp.int32),
            last_ck=jnp.zeros((), jnp.int32),
            eta_ck=eta0,
            best_ck=none,
            finite=finite,
        )
        s = jax.lax.fori_loop(0, n_iter + 1, body, state)
        return s["best_x"], s["best_f"], s["finite"]

    # All runs in one loop, so the run is traced and compiled once whatever n_restarts; run r >= 1
    # starts at the antipode of run r - 1's best point, run 0 at the random start (the antipode of
    # its antipode, exactly).  Stop after n_restarts + 1 runs, or once _RESTART_PATIENCE runs in a
    # row raised the best value by less than _RESTART_RTOL of the sharpness, or at a non-finite value.
    def one_run(c):
        r, x_prev_run, x_best, f_best, fin, stall = c
        x_run, f_run, fin = run(scale(-1.0, x_prev_run), fin)
        first = r == 0
        improved = first | (f_run > f_best + _RESTART_RTOL * jnp.abs(f_best - base))
        better = first | (f_run > f_best)
        return (
            r + 1,
            x_run,
            where(better, x_run, x_best),
            jnp.where(better, f_run, f_best),
            fin,
            jnp.where(improved, 0, stall + 1),
        )

    def go_on(c):
        r, _, _, _, fin, stall = c
        return (r == 0) | ((r <= n_restarts) & (stall < _RESTART_PATIENCE) & fin)

    v0 = random_start(key)
    zero = jnp.zeros((), jnp.int32)
    _, _, best_x, best_f, finite, _ = jax.lax.while_loop(
        go_on, one_run, (zero, scale(-1.0, v0), v0, none, jnp.isfinite(base), zero)
    )
    perturbation = None
    if keep:
        delta = geometry.assemble(w, geometry.perturb(w, fac, best_x)[0])
        perturbation = jax.tree_util.tree_unflatten(treedef, [d - wi for d, wi in zip(delta, w)])
    return best_f - base, finite & jnp.isfinite(best_f), perturbation


@functools.partial(jax.jit, static_argnames=("geometry",))
def _factorize(geometry, params):
    return geometry.factors(jax.tree_util.tree_leaves(params))


@functools.partial(jax.jit, static_argnames=("loss_fn", "geometry", "n_iter", "momentum", "keep", "n_restarts"))
def _search_batches(
    loss_fn, geometry, params, fac, batches, rho, keys, n_iter: int, momentum: float, keep: bool, n_restarts: int
):
    # the base-point factorization ``fac`` is computed once, outside the loop over batches
    return jax.lax.map(
        lambda kb: _auto_pgd(loss_fn, geometry, params, fac, kb[1], rho, kb[0], n_iter, momentum, keep, n_restarts),
        (keys, batches),
    )


def _status(pairs_ok: jax.Array, finite: jax.Array) -> jax.Array:
    return jnp.where(
        ~pairs_ok, STATUS_SINGULAR_PAIR, jnp.where(jnp.all(finite), STATUS_OK, STATUS_NON_FINITE)
    ).astype(jnp.int32)


def _raise_if_pair_singular(who: str, geometry, fac) -> None:
    for j, f in enumerate(fac):
        name = geometry.names[j] if j < len(geometry.names) else f"pair {j}"
        _raise_if_singular(f, f"{who}: GL(h) pair {j} ({name})")


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


def _over_batches(
    loss_fn, geometry, params, batches, rho, key, n_iter, momentum, keep, who, n_restarts
) -> SharpnessResult:
    n = _check_common(rho, batches, n_iter)
    _check_restarts(n_restarts)
    eager = is_concrete(params, batches, rho, key)
    if eager:
        _check_params(params, batches, who)
    fac = _factorize(geometry, params) if geometry.pairs else []
    if eager:  # before the (expensive) search
        _raise_if_pair_singular(who, geometry, fac)
    values, finite, perts = _search_batches(
        loss_fn, geometry, params, fac, batches, rho, jax.random.split(key, n), n_iter, momentum, bool(keep),
        int(n_restarts),
    )
    pairs_ok = jnp.all(jnp.stack([jnp.all(f.ok) for f in fac])) if fac else jnp.asarray(True)
    status = _status(pairs_ok, finite)
    if eager:
        _raise_if_non_finite(who, values, finite)
    return SharpnessResult(jnp.mean(values), values, perts, status)


@functools.partial(jax.jit, static_argnames=("loss_fn", "n_samples", "fixed"))
def _average_case(loss_fn, params, batches, rho, keys, n_samples: int, fixed: tuple):
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
    r"""Adaptive sharpness: worst case by Auto-PGD, or the average case :math:`\mathbb E_{z\sim\mathcal N(0,\rho^2 I)}L(w + |w|\odot z) - L(w)`.

    Parameters
    ----------
    loss_fn
        ``loss_fn(params, batch) -> scalar``.  Must be hashable (a module-level
        function or a fixed lambda), as it is a static argument of the compiled loop.
    params
        The weights :math:`w` (a pytree).
    batches
        A pytree whose leaves are stacked along a leading axis, one entry per batch;
        the result is averaged over batches (Andriushchenko et al. 2023).
    rho
        Radius of the adaptive L2 ball :math:`\lVert\delta/|w|\rVert_2 \le \rho`.
    key
        PRNG key (random start, average-case samples).
    kind
        ``"worst"`` (Auto-PGD, ``n_iter`` iterations) or ``"average"`` (``n_samples`` Gaussian samples).
    spec
        Optional :class:`SymmetrySpec`: only its ``redundant`` leaves are used (held fixed, since
        the function does not depend on them); its pairs are ignored, as adaptive sharpness treats
        every leaf element-wise.
    return_perturbation
        Keep the maximizing perturbation of every batch (a full copy of the weights per batch).
    n_restarts
        Worst case only: at most this many further Auto-PGD runs of ``n_iter`` iterations after the
        first, each from the antipode of the previous run's best point, keeping the best point of
        all; they stop once two runs in a row raised the best value by less than 0.1 % of the
        sharpness, so a call costs ``n_iter + 1`` loss gradients per run, for between
        ``min(3, n_restarts + 1)`` and ``n_restarts + 1`` runs.  ``0`` is the single run of Croce & Hein (2020), as before this
        option existed; the default reaches >= 0.999 of the exact maximum on chapter 6's diagonal
        networks, where a single run of 20 iterations reaches 0.77 to 1.

    Returns
    -------
    SharpnessResult
        With a ``status`` (see there).

    Raises
    ------
    GeometryError
        Eagerly: rho not a positive finite scalar, non-finite params or batches, or a non-finite
        loss during the search.  Under ``jit`` the values cannot be checked: read ``result.status``.

    References
    ----------
    Andriushchenko et al. (2023) (adaptive sharpness); the baseline of da Silva, Dangel & Oore
    (2025), *Hide & Seek*, Sec. 5; Auto-PGD of Croce & Hein (2020). Taught in chapters 6,
    *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic sharpness of vision
    transformers*.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> loss = lambda w, b: 0.5 * jnp.sum(b * (w - 1.0) ** 2)        # minimum at w = 1, curvature b
    >>> res = mg.adaptive_sharpness(loss, jnp.ones(3), jnp.array([[1.0, 2.0, 4.0]]), 0.1, key=jax.random.PRNGKey(0))
    >>> round(float(res.sharpness), 4)                               # closed form: rho^2 max(b) / 2
    0.02
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
    n = _check_common(rho, batches, n_iter)
    if isinstance(n_samples, bool) or not (isinstance(n_samples, (int, np.integer)) and n_samples >= 1):
        raise GeometryError(f"adaptive_sharpness: n_samples must be a positive int, got {n_samples!r}.")
    eager = is_concrete(params, batches, rho, key)
    if eager:
        _check_params(params, batches, who)
    values, finite = _average_case(loss_fn, params, batches, rho, jax.random.split(key, n), int(n_samples), geometry.fixed)
    if eager:
        _raise_if_non_finite(who, values, finite)
    status = _status(jnp.asarray(True), finite)
    return SharpnessResult(jnp.mean(values), values, None, status)


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
) -> SharpnessResult:
    r"""Worst-case geodesic sharpness on the quotient by the spec's symmetries (da Silva et al. 2025, eq. 8, Algorithm 1).

    Maximizes :math:`L(w + \xi - \tfrac12\Gamma(\xi,\xi)) - L(w)` over horizontal :math:`\xi` with
    :math:`\lVert\xi\rVert_g \le \rho` (metric (15) on the GL(h) pairs of ``spec``, the adaptive
    norm elsewhere) by Auto-PGD with Riemannian gradients and projection onto the
    horizontal ball.  Invariant under :math:`(G, H) \mapsto (GA^{-1}, HA^\top)` on every pair
    (with ``spec.eps = 0``) and under element-wise rescalings elsewhere; the spec's redundant
    leaves are not perturbed.

    The metric at the base point is factored once per call (thin SVDs of every pair's sides, at
    ``"highest"`` matmul precision, shared by all batches); the search itself runs at the caller's
    precision for the loss and ``"highest"`` for the geometry.  ``n_iter``, ``momentum``,
    ``return_perturbation`` and ``n_restarts`` (antipodal restarts of the ascent) are as in
    :func:`adaptive_sharpness`.

    Returns
    -------
    SharpnessResult
        With a ``status`` (see there); ``perturbation`` only if ``return_perturbation``.

    Raises
    ------
    GeometryError
        Eagerly: a GL(h) pair numerically rank deficient at its dtype (the message names the pair,
        the head and the remedy: ``eps > 0``, float64, a better-conditioned point), rho not a
        positive finite scalar, non-finite params or batches, a non-finite loss.  Under ``jit``:
        no exception; read ``result.status``.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eqs. (6) and (8); App. C.1 and C.2 (Algorithm 1).
    Taught in chapters 6, *Quotient-manifold geodesic sharpness* and 7, *Capstone: geodesic
    sharpness of vision transformers*.

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
    """
    who = "geodesic_sharpness"
    _check_spec(spec, params, who)
    return _over_batches(
        loss_fn, _Geometry(spec), params, batches, rho, key, n_iter, momentum, return_perturbation, who, n_restarts
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
    r"""Kendall's rank correlation :math:`\tau` of two sequences (``scipy.stats.kendalltau``, tau-b).

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5 (rank correlation of sharpness with the
    generalization gap). Taught in chapters 6, *Quotient-manifold geodesic sharpness* and 7,
    *Capstone: geodesic sharpness of vision transformers*.

    Examples
    --------
    >>> import minigeo as mg
    >>> round(mg.kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]), 6)
    0.666667
    """
    from scipy.stats import kendalltau

    x, y = list(map(float, x)), list(map(float, y))
    if len(x) != len(y) or len(x) < 2:
        raise GeometryError(
            f"kendall_tau needs two sequences of the same length >= 2; got lengths {len(x)} and {len(y)}."
        )
    return float(kendalltau(x, y).statistic)

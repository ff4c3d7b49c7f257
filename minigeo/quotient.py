r"""Quotient geometry of GL(h) and GL(1) symmetries (floor 2, chapter 6).

Attention scores depend on the query/key weights only through :math:`W_Q W_K^\top`, and
the value/output path only through :math:`W_V W_O^\top`: for a pair
:math:`(G, H) \in \mathbb R^{n\times h}\times\mathbb R^{m\times h}` used as :math:`GH^\top`, every
:math:`A \in GL(h)` gives the same function at :math:`(GA^{-1}, HA^\top)` (paper 004, Sec. 5.2).
Element-wise rescalings :math:`(u, v) \mapsto (au, v/a)` (diagonal networks, the scalar toy
model) are the GL(1) case.  Sharpness should be measured on the quotient by these
symmetries; this module provides its Riemannian geometry for paper 004's metric (15)

.. math:: \langle\eta, \zeta\rangle_{(G,H)} = \mathrm{Tr}\big((G^\top G)^{-1}\eta_G^\top\zeta_G\big) + \mathrm{Tr}\big((H^\top H)^{-1}\eta_H^\top\zeta_H\big),

relaxed to :math:`G^\top G + \epsilon I` (App. G.2), with the **vertical** directions
:math:`(-G\Omega, H\Omega^\top)` (the orbit), the metric-orthogonal **horizontal projection**,
the Riemannian gradient, and the geodesic correction :math:`\Gamma(\xi,\xi)` of eq. (43).

**The horizontal projection, derived.**  :math:`\xi^{\mathrm H} = (\xi_G + G\Lambda, \xi_H - H\Lambda^\top)` is
orthogonal to every vertical vector iff :math:`H^\top\eta_H Q^{-1} = P^{-1}\eta_G^\top G` with
:math:`P = G^\top G`, :math:`Q = H^\top H`; substituting gives the Sylvester equation

.. math:: A X + X A = B,\qquad X = \Lambda^\top,\quad A = PQ,\quad B = P H^\top\xi_H - \xi_G^\top G Q.

Paper 004 (Sec. 5.2) prints :math:`A\Lambda + \Lambda A^\top = B` for :math:`\Lambda` itself; read
literally that is a different equation (:math:`A` is not symmetric) and its solution does not
give a horizontal vector.  Since :math:`A = P^{1/2}(P^{1/2}QP^{1/2})P^{-1/2}` is diagonalizable
with positive eigenvalues, the equation is solved through one symmetric eigendecomposition
(``jnp.linalg.eigh``), batched over heads and ``jit``-compatible.

All functions accept leading batch dimensions (e.g. one pair per attention head):
``G`` of shape ``(..., n, h)`` and ``H`` of shape ``(..., m, h)``.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp

from ._checks import GeometryError, check_finite, is_concrete

__all__ = [
    "gl_metric",
    "vertical_vector",
    "horizontal_projection",
    "riemannian_gradient",
    "christoffel_quadratic",
    "geodesic_step",
    "gl1_metric",
    "gl1_horizontal_projection",
    "gl1_geodesic",
]

Pair = Tuple[jax.Array, jax.Array]


def _mT(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _check_pair(point: Pair, what: str = "point") -> tuple[jax.Array, jax.Array]:
    if not (isinstance(point, (tuple, list)) and len(point) == 2):
        raise GeometryError(f"{what} must be a pair (G, H) of arrays; got {type(point).__name__}.")
    G, H = jnp.asarray(point[0]), jnp.asarray(point[1])
    if G.ndim < 2 or H.ndim < 2:
        raise GeometryError(
            f"{what}: G and H must be matrices (..., n, h) and (..., m, h); got shapes {G.shape}, {H.shape}."
        )
    if G.shape[-1] != H.shape[-1] or G.shape[:-2] != H.shape[:-2]:
        raise GeometryError(
            f"{what}: G {G.shape} and H {H.shape} must share the symmetry dimension h (last axis) and the batch "
            "dimensions; for attention, G = W_Q and H = W_K of one head (n, h) and (m, h)."
        )
    return G, H


def _check_like(point: Pair, vec: Pair, what: str) -> tuple[jax.Array, jax.Array]:
    G, H = _check_pair(point)
    vG, vH = _check_pair(vec, what)
    if vG.shape != G.shape or vH.shape != H.shape:
        raise GeometryError(
            f"{what} has shapes ({vG.shape}, {vH.shape}) but the point has ({G.shape}, {H.shape})."
        )
    return vG, vH


def _grams(G: jax.Array, H: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    if isinstance(eps, (int, float)) and eps < 0:
        raise GeometryError(f"eps (the relaxation G^T G + eps I) must be >= 0, got {eps}.")
    h = G.shape[-1]
    eye = jnp.eye(h, dtype=G.dtype)
    P = _mT(G) @ G + eps * eye
    Q = _mT(H) @ H + eps * eye
    if is_concrete(P, Q):
        for name, M in (("G^T G", P), ("H^T H", Q)):
            ev = _map_matrices(jnp.linalg.eigvalsh, M)
            if bool(jnp.any(ev[..., 0] <= 1e-12 * jnp.maximum(ev[..., -1], 1e-300))):
                raise GeometryError(
                    f"{name} (+ eps I) is singular: the pair is not of full column rank h (paper 004, Assumption 5.1). "
                    "Use the relaxation eps > 0 (e.g. eps=1e-6), App. G.2."
                )
    return P, Q


class PairFactors(NamedTuple):
    """Quantities of metric (15) at a point that do not depend on the tangent vectors (computed once, reused)."""

    G: jax.Array
    H: jax.Array
    P: jax.Array
    Q: jax.Array
    P_inv: jax.Array
    Q_inv: jax.Array
    V: jax.Array  # PQ = V diag(d) V^{-1}
    V_inv: jax.Array
    d: jax.Array


def _map_matrices(fn, *arrays: jax.Array):
    """Apply ``fn`` to one matrix (or matrix tuple) at a time over the leading batch axes, with ``lax.map``.

    Batched LAPACK calls (``eigh``, ``inv``) over many heads and layers have been seen to hang
    XLA's CPU runtime (jax 0.10, e.g. a (12, 12, 65, 65) ``eigh`` at ViT-B/32 shape); one matrix
    at a time is safe and, for these small matrices, as fast.
    """
    batch = arrays[0].shape[:-2]
    if not batch:
        return fn(*arrays)
    flat = [a.reshape((-1,) + a.shape[-2:]) for a in arrays]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(flat))
    return jax.tree_util.tree_map(lambda o: o.reshape(batch + o.shape[1:]), out)


def _powers(M: jax.Array):
    """``M^{1/2}``, ``M^{-1/2}`` and ``M^{-1}`` of one symmetric positive definite matrix, from one ``eigh``."""
    w, U = jnp.linalg.eigh(M)
    r = jnp.sqrt(w)[None, :]
    return (U * r) @ U.T, (U / r) @ U.T, (U / w[None, :]) @ U.T


def _pq_basis(P_half: jax.Array, P_mhalf: jax.Array, Q: jax.Array):
    """PQ = V diag(d) V^{-1} through the symmetric matrix P^{1/2} Q P^{1/2}."""
    d, V0 = jnp.linalg.eigh(P_half @ Q @ P_half)
    return P_half @ V0, V0.T @ P_mhalf, d


def _factor_one(P: jax.Array, Q: jax.Array):
    P_half, P_mhalf, P_inv = _powers(P)
    Q_inv = _powers(Q)[2]
    return (P_inv, Q_inv, *_pq_basis(P_half, P_mhalf, Q))


def pair_factors(G: jax.Array, H: jax.Array, eps: float = 0.0) -> PairFactors:
    """Factorize metric (15) at (G, H): Gram matrices, their inverses, and the eigendecomposition of PQ."""
    P, Q = _grams(G, H, eps)
    P_inv, Q_inv, V, V_inv, d = _map_matrices(_factor_one, P, Q)
    return PairFactors(G, H, P, Q, P_inv, Q_inv, V, V_inv, d)


class WhitenedFactors(NamedTuple):
    """Metric (15) at (G, H) in whitened coordinates ``z = xi P^{-1/2}`` (G side), ``xi Q^{-1/2}`` (H side).

    In these coordinates the metric is the Euclidean (Frobenius) inner product, so norms and
    the Auto-PGD updates of :mod:`minigeo.sharpness` are element-wise; ``P^{1/2}``,
    ``P^{-1/2}`` (and the same for ``Q``) convert, and the eigendecomposition of ``PQ``
    solves the Sylvester equation of the horizontal projection.
    """

    G: jax.Array
    H: jax.Array
    P: jax.Array
    Q: jax.Array
    P_half: jax.Array
    P_mhalf: jax.Array
    Q_half: jax.Array
    Q_mhalf: jax.Array
    V: jax.Array  # PQ = V diag(d) V^{-1}
    V_inv: jax.Array
    d: jax.Array


def _whiten_one(P: jax.Array, Q: jax.Array):
    P_half, P_mhalf, _ = _powers(P)
    Q_half, Q_mhalf, _ = _powers(Q)
    return (P_half, P_mhalf, Q_half, Q_mhalf, *_pq_basis(P_half, P_mhalf, Q))


def whitened_factors(G: jax.Array, H: jax.Array, eps: float = 0.0) -> WhitenedFactors:
    """Factorize metric (15) at (G, H) for whitened coordinates (square roots of the Gram matrices, eigenbasis of PQ)."""
    P, Q = _grams(G, H, eps)
    return WhitenedFactors(G, H, P, Q, *_map_matrices(_whiten_one, P, Q))


def sylvester_with(f: PairFactors | WhitenedFactors, B: jax.Array) -> jax.Array:
    """Solve (PQ) X + X (PQ) = B through the eigendecomposition PQ = V diag(d) V^{-1}."""
    C = f.V_inv @ B @ f.V
    return f.V @ (C / (f.d[..., :, None] + f.d[..., None, :])) @ f.V_inv


def metric_with(f: PairFactors, eta: Pair, zeta: Pair) -> jax.Array:
    """Metric (15) from precomputed factors."""
    a = jnp.trace(f.P_inv @ (_mT(eta[0]) @ zeta[0]), axis1=-2, axis2=-1)
    b = jnp.trace(f.Q_inv @ (_mT(eta[1]) @ zeta[1]), axis1=-2, axis2=-1)
    return jnp.sum(a + b)


def horizontal_with(f: PairFactors, xi: Pair) -> Pair:
    """Horizontal projection from precomputed factors: solve (PQ) X + X (PQ) = P H^T xi_H - xi_G^T G Q."""
    xG, xH = xi
    B = f.P @ _mT(f.H) @ xH - _mT(xG) @ f.G @ f.Q
    X = sylvester_with(f, B)
    return xG + f.G @ _mT(X), xH - f.H @ X


def christoffel_with(f: PairFactors, xi: Pair) -> Pair:
    """Gamma(xi, xi) of eq. (43) from precomputed factors."""

    def part(M, S_inv, x):
        A = _mT(x) @ M  # x^T M + M^T x = A + A^T: one product with the tall matrices instead of two
        return -x @ (S_inv @ (A + _mT(A))) + M @ (S_inv @ (_mT(x) @ x))

    return part(f.G, f.P_inv, xi[0]), part(f.H, f.Q_inv, xi[1])


def gl_metric(point: Pair, eta: Pair, zeta: Pair, *, eps: float = 0.0, kind: str = "inv") -> jax.Array:
    r"""The GL(h)-invariant metric of paper 004: eq. (15) (``kind="inv"``) or the "mix" metric (34).

    ``"inv"``: :math:`\mathrm{Tr}((G^\top G)^{-1}\eta_G^\top\zeta_G) + \mathrm{Tr}((H^\top H)^{-1}\eta_H^\top\zeta_H)`;
    ``"mix"``: :math:`\mathrm{Tr}((H^\top H)\eta_G^\top\zeta_G) + \mathrm{Tr}((G^\top G)\eta_H^\top\zeta_H)`.
    Summed over batch (head) dimensions.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (15) and the mix metric of App. F.2, eq.
    (34). Taught in chapter 6, *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G, H = 2 * jnp.eye(2), jnp.eye(2)
    >>> float(mg.gl_metric((G, H), (jnp.eye(2), jnp.zeros((2, 2))), (jnp.eye(2), jnp.zeros((2, 2)))))  # Tr(I/4)
    0.5
    """
    G, H = _check_pair(point)
    eG, eH = _check_like(point, eta, "eta")
    zG, zH = _check_like(point, zeta, "zeta")
    if kind == "inv":
        return metric_with(pair_factors(G, H, eps), (eG, eH), (zG, zH))
    P, Q = _grams(G, H, eps)
    if kind == "mix":
        a = jnp.trace(Q @ (_mT(eG) @ zG), axis1=-2, axis2=-1)
        b = jnp.trace(P @ (_mT(eH) @ zH), axis1=-2, axis2=-1)
    else:
        raise GeometryError(f"gl_metric: kind must be 'inv' (eq. 15) or 'mix' (eq. 34), got {kind!r}.")
    return jnp.sum(a + b)


def vertical_vector(point: Pair, omega: jax.Array) -> Pair:
    r"""The vertical (orbit) direction :math:`(-G\Omega, H\Omega^\top)` for :math:`\Omega \in \mathbb R^{h\times h}`.

    It is the velocity of :math:`t \mapsto (G e^{-t\Omega}, H e^{t\Omega^\top})`; :math:`GH^\top` does not change.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 3.3 and App. B.3 (the vertical space is the
    tangent space of the orbit). Taught in chapter 6, *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> vG, vH = mg.vertical_vector((jnp.eye(2), jnp.ones((3, 2))), jnp.array([[0.0, 1.0], [0.0, 0.0]]))
    >>> (vG @ jnp.ones((3, 2)).T + jnp.eye(2) @ vH.T).round(6)   # d(G H^T) = 0
    Array([[0., 0., 0.],
           [0., 0., 0.]], dtype=float32)
    """
    G, H = _check_pair(point)
    omega = jnp.asarray(omega)
    if omega.shape != G.shape[:-2] + (G.shape[-1], G.shape[-1]):
        raise GeometryError(
            f"vertical_vector: omega must have shape {G.shape[:-2] + (G.shape[-1], G.shape[-1])}, got {omega.shape}."
        )
    return -G @ omega, H @ _mT(omega)


def horizontal_projection(point: Pair, xi: Pair, *, eps: float = 0.0) -> Pair:
    r"""The metric-orthogonal projection of a tangent vector onto the horizontal space (metric (15)).

    :math:`\xi^{\mathrm H} = (\xi_G + G\Lambda, \xi_H - H\Lambda^\top)` with :math:`\Lambda^\top` solving
    :math:`(PQ)X + X(PQ) = PH^\top\xi_H - \xi_G^\top GQ` (see the module notes for the derivation
    and the difference to the equation printed in paper 004).  Idempotent; the
    removed part is vertical; the result is orthogonal to every vertical vector.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.2 (the horizontal space and its Sylvester
    equation, after eq. (15)) and App. B.3. Taught in chapter 6, *Quotient-manifold geodesic
    sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point = (jnp.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]), jnp.array([[1.0, 1.0], [0.0, 1.0]]))
    >>> xi = mg.vertical_vector(point, jnp.array([[0.3, -1.0], [0.5, 0.2]]))
    >>> [float(jnp.abs(x).max()) < 1e-5 for x in mg.horizontal_projection(point, xi)]  # vertical -> 0
    [True, True]
    """
    G, H = _check_pair(point)
    xG, xH = _check_like(point, xi, "xi")
    out = horizontal_with(pair_factors(G, H, eps), (xG, xH))
    check_finite(out, "horizontal_projection", hint="The pair is (nearly) rank deficient: use eps > 0.")
    return out


def riemannian_gradient(point: Pair, egrad: Pair, *, eps: float = 0.0) -> Pair:
    r"""Riemannian gradient for metric (15): :math:`(\nabla_G\,(G^\top G + \epsilon I),\; \nabla_H\,(H^\top H + \epsilon I))`.

    ``egrad`` is the Euclidean gradient :math:`(\nabla_G f, \nabla_H f)`.  For a function of
    :math:`GH^\top` only, the result is horizontal.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. B.5 (Riemannian gradient for metric (15)).
    Taught in chapter 6, *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.riemannian_gradient((2 * jnp.eye(2), jnp.eye(2)), (jnp.eye(2), jnp.eye(2)))[0]
    Array([[4., 0.],
           [0., 4.]], dtype=float32)
    """
    G, H = _check_pair(point)
    gG, gH = _check_like(point, egrad, "egrad")
    P, Q = _grams(G, H, eps)
    return gG @ P, gH @ Q


def christoffel_quadratic(point: Pair, xi: Pair, *, eps: float = 0.0) -> Pair:
    r"""The geodesic correction :math:`\Gamma(\xi, \xi)` of metric (15), paper 004 eq. (43)/(16).

    For the G part :math:`-\xi_G P^{-1}(\xi_G^\top G + G^\top\xi_G) + G P^{-1}\xi_G^\top\xi_G` with
    :math:`P = G^\top G (+\epsilon I)`, and likewise for H.  Geodesics satisfy
    :math:`\ddot\gamma + \Gamma(\dot\gamma, \dot\gamma) = 0`.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (16) and App. eq. (43). Taught in chapter 6,
    *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> [x.round(4).tolist() for x in mg.christoffel_quadratic((jnp.array([[2.0]]), jnp.array([[1.0]])), (jnp.array([[1.0]]), jnp.zeros((1, 1))))]
    [[[-0.5]], [[0.0]]]
    """
    G, H = _check_pair(point)
    xG, xH = _check_like(point, xi, "xi")
    return christoffel_with(pair_factors(G, H, eps), (xG, xH))


def geodesic_step(point: Pair, xi: Pair, *, eps: float = 0.0) -> Pair:
    r"""Second-order approximation of the geodesic :math:`\gamma_\xi(1) \approx x + \xi - \tfrac12\Gamma(\xi,\xi)` (paper 004, eq. 7).

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (7) (second-order geodesic), used in eq. (8);
    App. B.6. Taught in chapter 6, *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G1, H1 = mg.geodesic_step((jnp.array([[2.0]]), jnp.array([[1.0]])), (jnp.array([[1.0]]), jnp.zeros((1, 1))))
    >>> round(float(G1[0, 0]), 4)   # exact geodesic 2 exp(1/2) = 3.2974
    3.25
    """
    G, H = _check_pair(point)
    xG, xH = _check_like(point, xi, "xi")
    cG, cH = christoffel_quadratic(point, xi, eps=eps)
    return G + xG - 0.5 * cG, H + xH - 0.5 * cH


# ---------------------------------------------------------------------------
# GL(1): element-wise rescaling symmetry (u, v) -> (a u, v / a)
# ---------------------------------------------------------------------------
def _check_elementwise(point: Pair, vec: Pair | None = None, what: str = "xi") -> tuple:
    if not (isinstance(point, (tuple, list)) and len(point) == 2):
        raise GeometryError(
            f"GL(1): point must be a pair (u, v) of same-shape arrays; got {type(point).__name__}."
        )
    u, v = jnp.asarray(point[0]), jnp.asarray(point[1])
    if u.shape != v.shape:
        raise GeometryError(
            f"GL(1): u {u.shape} and v {v.shape} must have the same shape (one scale per entry)."
        )
    if is_concrete(u, v) and bool(jnp.any(u == 0) | jnp.any(v == 0)):
        raise GeometryError(
            "GL(1): the metric 1/u^2 is undefined where u or v is 0; move away from zero weights."
        )
    if vec is None:
        return u, v
    a, b = jnp.asarray(vec[0]), jnp.asarray(vec[1])
    if a.shape != u.shape or b.shape != v.shape:
        raise GeometryError(
            f"GL(1): {what} has shapes ({a.shape}, {b.shape}) but the point has ({u.shape}, {v.shape})."
        )
    return u, v, a, b


def gl1_metric(point: Pair, eta: Pair, zeta: Pair) -> jax.Array:
    r"""Metric (15) for :math:`h = 1`, element-wise: :math:`\sum \eta_u\zeta_u/u^2 + \eta_v\zeta_v/v^2` (adaptive sharpness' norm).

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.1 and App. D (metric (15) for h = 1).
    Taught in chapter 6, *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> float(mg.gl1_metric((jnp.array([2.0]), jnp.array([1.0])), (jnp.array([2.0]), jnp.array([1.0])), (jnp.array([2.0]), jnp.array([1.0]))))
    2.0
    """
    u, v, a, b = _check_elementwise(point, eta, "eta")
    _, _, c, d = _check_elementwise(point, zeta, "zeta")
    return jnp.sum(a * c / u**2 + b * d / v**2)


def gl1_horizontal_projection(point: Pair, xi: Pair) -> Pair:
    r"""Horizontal projection for :math:`(u, v) \mapsto (au, v/a)`: equalize :math:`\xi_u/u` and :math:`\xi_v/v`.

    Vertical directions are :math:`(-u\omega, v\omega)`; the projection removes the one with
    :math:`\omega = \tfrac12(\xi_v/v - \xi_u/u)`.

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.1 and App. D. Taught in chapter 6,
    *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.gl1_horizontal_projection((jnp.array([1.0]), jnp.array([1.0])), (jnp.array([1.0]), jnp.array([-1.0])))
    (Array([0.], dtype=float32), Array([0.], dtype=float32))
    """
    u, v, a, b = _check_elementwise(point, xi)
    omega = 0.5 * (b / v - a / u)
    return a + u * omega, b - v * omega


def gl1_geodesic(point: Pair, xi: Pair, t: float = 1.0) -> Pair:
    r"""Exact geodesic of the GL(1) metric: :math:`u(t) = u\,e^{t\,\xi_u/u}`, :math:`v(t) = v\,e^{t\,\xi_v/v}` (paper 004, eq. 10, App. D).

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (10) and App. D (exact GL(1) geodesics).
    Taught in chapter 6, *Quotient-manifold geodesic sharpness*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> u1, _ = mg.gl1_geodesic((jnp.array([2.0]), jnp.array([1.0])), (jnp.array([1.0]), jnp.array([0.0])))
    >>> round(float(u1[0]), 4)
    3.2974
    """
    u, v, a, b = _check_elementwise(point, xi)
    return u * jnp.exp(t * a / u), v * jnp.exp(t * b / v)

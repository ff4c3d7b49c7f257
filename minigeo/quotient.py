r"""Quotient geometry of GL(h) and GL(1) symmetries (floor 2, chapter 6).

Attention scores depend on the query/key weights only through :math:`W_Q W_K^\top`, and
the value/output path only through :math:`W_V W_O^\top`: for a pair
:math:`(G, H) \in \mathbb R^{n\times h}\times\mathbb R^{m\times h}` used as :math:`GH^\top`, every
:math:`A \in GL(h)` gives the same function at :math:`(GA^{-1}, HA^\top)` (da Silva et al. 2025, Sec. 5.2).
Element-wise rescalings :math:`(u, v) \mapsto (au, v/a)` (diagonal networks, the scalar toy
model) are the GL(1) case.  Sharpness should be measured on the quotient by these
symmetries; this module provides its Riemannian geometry for da Silva et al.'s (2025) metric (15)

.. math:: \langle\eta, \zeta\rangle_{(G,H)} = \mathrm{Tr}\big((G^\top G)^{-1}\eta_G^\top\zeta_G\big) + \mathrm{Tr}\big((H^\top H)^{-1}\eta_H^\top\zeta_H\big),

relaxed to :math:`G^\top G + \epsilon I` (App. G.2), with the **vertical** directions
:math:`(-G\Omega, H\Omega^\top)` (the orbit), the metric-orthogonal **horizontal projection**,
the Riemannian gradient, and the geodesic correction :math:`\Gamma(\xi,\xi)` of eq. (43).

**The horizontal projection, derived.**  :math:`\xi^{\mathrm H} = (\xi_G + G\Lambda, \xi_H - H\Lambda^\top)` is
orthogonal to every vertical vector iff :math:`H^\top\eta_H Q^{-1} = P^{-1}\eta_G^\top G` with
:math:`P = G^\top G`, :math:`Q = H^\top H`; substituting gives the Sylvester equation

.. math:: A X + X A = B,\qquad X = \Lambda^\top,\quad A = PQ,\quad B = P H^\top\xi_H - \xi_G^\top G Q.

Da Silva et al. 2025 (Sec. 5.2) prints :math:`A\Lambda + \Lambda A^\top = B` for :math:`\Lambda` itself; read
literally that is a different equation (:math:`A` is not symmetric) and its solution does not
give a horizontal vector.

**With the relaxation** :math:`\epsilon > 0`, :math:`P = G^\top G + \epsilon I` and :math:`Q = H^\top H + \epsilon I`
in the metric, but the vertical directions :math:`(-G\Omega, H\Omega^\top)` keep the bare sides, so
the orthogonality condition is the same, :math:`H^\top\eta_H Q^{-1} = P^{-1}\eta_G^\top G`, and substituting
:math:`\eta` gives, with :math:`P_0 = G^\top G`, :math:`Q_0 = H^\top H`,

.. math:: (PQ_0)\,X + X\,(P_0Q) = P H^\top\xi_H - \xi_G^\top G Q,\qquad X = \Lambda^\top.

Substituting the relaxed Gram matrices into :math:`A = PQ` on both sides (as the paper's App. G.2
suggests, and as minigeo did before) solves a different equation: its map leaves horizontal
vectors alone but is not a projection (not idempotent, result not horizontal; 2e-3 to 0.25 off
for :math:`\epsilon` from 1e-2 to 1 at unit-scale 6x3 pairs).  In whitened coordinates
:math:`\hat G^\top\hat G = P^{-1/2}P_0P^{-1/2} = C_G \ne I`, and in the bases below the equation becomes
:math:`S_G\hat X + \hat X S_H = b^\top\Sigma - \Sigma a^\top` with the symmetric positive definite
:math:`S_G = \Sigma Z^\top C_G Z\Sigma`, :math:`S_H = \Sigma W^\top C_H W\Sigma`, solved in their
eigenbases (computed as SVDs of :math:`C^{1/2}Z\Sigma`, :math:`C^{1/2}W\Sigma`, never as ``eigh`` of
the products); see ``minigeo._pairs._whitened_projection``.  For :math:`\epsilon = 0` this is the diagonal solve below.

**Numerics: sides, not Gram matrices.**  :math:`A = PQ` is diagonalizable with positive
eigenvalues, but forming :math:`P = G^\top G` squares the condition number: in float32 an ``eigh``
of :math:`P` has no correct digit left once :math:`\mathrm{cond}(G) \gtrsim 3\cdot 10^3`, which a
ViT-B/32 moved along its own symmetry reaches.  Every function here therefore factors the tall
sides by thin SVDs, writes :math:`G = \hat G P^{1/2}` with
:math:`\hat G` of orthonormal columns, and solves the Sylvester equation in the basis of the SVD
:math:`Q^{1/2}P^{1/2} = W\Sigma Z^\top`, where it is diagonal with bounded coefficients
:math:`\sigma_i\sigma_j/(\sigma_i^2+\sigma_j^2) \le \tfrac12`.  The condition number then enters
once, through a final product with :math:`P^{1/2}`.  Rank is judged on the singular values of the
sides relative to the dtype (``minigeo._pairs._singular_value_cutoff``); a numerically rank-deficient pair
raises :class:`GeometryError` when the values are concrete.  All products run at
``"highest"`` matmul precision whatever the global default (TF32 on NVIDIA GPUs would otherwise
cost three to four digits).

All functions accept leading batch dimensions (e.g. one pair per attention head):
``G`` of shape ``(..., n, h)`` and ``H`` of shape ``(..., m, h)``.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, check_finite, is_concrete
from ._pairs import (  # the factored metric (15), shared with minigeo.sharpness
    _check_eps,
    _eps_that_works,
    _factor_pair,
    _mT,
    _PairFrame,
    _singular_value_cutoff,
    _whitened_projection,
)

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


def _raise_if_singular(f: _PairFrame, who: str) -> None:
    """Eagerly: raise if a pair is numerically rank deficient at its dtype (da Silva et al. 2025, Assumption 5.1)."""
    if not is_concrete(f.ok):
        return
    ok = np.asarray(f.ok)
    if ok.all():
        return
    bad = tuple(int(i) for i in np.argwhere(~ok)[0]) if ok.ndim else ()
    cond = float(np.max(np.asarray(f.cond)[~ok])) if ok.ndim else float(f.cond)
    n, m, h = f.G.shape[-2], f.H.shape[-2], f.G.shape[-1]
    cut = 1 / _singular_value_cutoff(max(n, m), h, f.G.dtype)
    eps_ok = _eps_that_works(np.asarray(f.G), np.asarray(f.H), cut)
    raise GeometryError(
        f"{who}: the pair (G, H) is numerically rank deficient at {f.G.dtype} (batch index {bad}; "
        f"condition number of a side {cond:.3g}, cut-off {cut:.3g}): "
        "metric (15) needs full column rank h (da Silva et al. 2025, Assumption 5.1). Use the relaxation eps > 0 "
        f"(eps={eps_ok:.1g} is enough for this pair: relaxed condition numbers at most half the cut-off; App. G.2), "
        "float64, or a better-conditioned point."
    )


def _frame(point: Pair, eps, who: str) -> _PairFrame:
    G, H = _check_pair(point)
    f = _factor_pair(G, H, eps)
    _raise_if_singular(f, who)
    return f


def _nan_unless_ok(f: _PairFrame, out):
    """Under ``jit`` (no exception possible): NaN wherever the pair is numerically rank deficient,
    so that a meaningless number never passes for a result (eagerly, :func:`_raise_if_singular` raised)."""
    if isinstance(out, tuple):
        return tuple(jnp.where(f.ok[..., None, None], x, jnp.nan) for x in out)
    return jnp.where(jnp.all(f.ok), out, jnp.nan)


def _metric_with(f: _PairFrame, eta: Pair, zeta: Pair) -> jax.Array:
    """Metric (15) from a frame: the Frobenius product of the whitened vectors ``eta P^{-1/2}``, ``zeta P^{-1/2}``."""
    with jax.default_matmul_precision("highest"):
        a = jnp.sum((eta[0] @ f.P_mhalf) * (zeta[0] @ f.P_mhalf))
        b = jnp.sum((eta[1] @ f.Q_mhalf) * (zeta[1] @ f.Q_mhalf))
        return a + b


def _horizontal_with(f: _PairFrame, xi: Pair) -> Pair:
    """Horizontal projection from a frame, through the whitened coordinates (:func:`_whitened_projection`)."""
    with jax.default_matmul_precision("highest"):
        zG, zH = xi[0] @ f.P_mhalf, xi[1] @ f.Q_mhalf
        cG, cH = _whitened_projection(f, _mT(f.Gn) @ zG, _mT(f.Hn) @ zH)
        return xi[0] + f.Gn @ (cG @ f.P_half), xi[1] - f.Hn @ (cH @ f.Q_half)


def _christoffel_with(f: _PairFrame, xi: Pair) -> Pair:
    r"""Gamma(xi, xi) of eq. (43) from a frame: with :math:`z = \xi P^{-1/2}`, :math:`\Gamma_G = (\hat G z^\top z - z(z^\top\hat G + \hat G^\top z))P^{1/2}`."""

    def part(Mn, R, Rm, x):
        z = x @ Rm
        u = _mT(z) @ Mn
        return (Mn @ (_mT(z) @ z) - z @ (u + _mT(u))) @ R

    with jax.default_matmul_precision("highest"):
        return part(f.Gn, f.P_half, f.P_mhalf, xi[0]), part(f.Hn, f.Q_half, f.Q_mhalf, xi[1])


def gl_metric(point: Pair, eta: Pair, zeta: Pair, *, eps: float = 0.0, kind: str = "inv") -> jax.Array:
    r"""The GL(h)-invariant metric at a pair ``(G, H)``: eq. (15) (``kind="inv"``) or the "mix" metric (34).

    .. math::

        \text{inv:}\quad \mathrm{Tr}\big(P^{-1}\eta_G^\top\zeta_G\big) + \mathrm{Tr}\big(Q^{-1}\eta_H^\top\zeta_H\big),\qquad
        \text{mix:}\quad \mathrm{Tr}\big(Q\,\eta_G^\top\zeta_G\big) + \mathrm{Tr}\big(P\,\eta_H^\top\zeta_H\big),

    with :math:`P = G^\top G + \epsilon I`, :math:`Q = H^\top H + \epsilon I`.

    Parameters
    ----------
    point : tuple of two arrays
        The pair ``(G, H)`` of shapes ``(..., n, h)`` and ``(..., m, h)`` (leading batch axes, e.g. heads).
    eta, zeta : tuple of two arrays
        Tangent vectors at ``point``, shaped like ``point``.
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` of the Gram matrices (App. G.2); 0 keeps the exact GL(h) invariance.
    kind : {"inv", "mix"}, optional
        Metric (15) or metric (34).

    Returns
    -------
    jax.Array
        The scalar inner product, summed over the batch (head) axes.

    Raises
    ------
    GeometryError
        If the shapes do not match, ``kind`` is unknown, ``eps < 0``, or (eagerly) a side is numerically
        rank deficient; under ``jit`` the result is NaN instead.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G, H = 2 * jnp.eye(2), jnp.eye(2)
    >>> xi = (jnp.eye(2), jnp.zeros((2, 2)))
    >>> float(mg.quotient.gl_metric((G, H), xi, xi))   # Tr(I/4)
    0.5

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (15); App. F.2, eq. (34). Chapter 6.
    """
    G, H = _check_pair(point)
    eG, eH = _check_like(point, eta, "eta")
    zG, zH = _check_like(point, zeta, "zeta")
    if kind == "inv":
        f = _frame((G, H), eps, "gl_metric")
        return _nan_unless_ok(f, _metric_with(f, (eG, eH), (zG, zH)))
    if kind == "mix":
        f = _frame((G, H), eps, "gl_metric")
        with jax.default_matmul_precision("highest"):
            P, Q = _mT(f.P_half) @ f.P_half, _mT(f.Q_half) @ f.Q_half
            a = jnp.trace(Q @ (_mT(eG) @ zG), axis1=-2, axis2=-1)
            b = jnp.trace(P @ (_mT(eH) @ zH), axis1=-2, axis2=-1)
        return _nan_unless_ok(f, jnp.sum(a + b))
    else:
        raise GeometryError(f"gl_metric: kind must be 'inv' (eq. 15) or 'mix' (eq. 34), got {kind!r}.")
    return jnp.sum(a + b)


def vertical_vector(point: Pair, omega: jax.Array) -> Pair:
    r"""The vertical (orbit) direction at ``(G, H)`` generated by :math:`\Omega \in \mathbb R^{h\times h}`.

    .. math:: v(\Omega) = (-G\Omega,\; H\Omega^\top) = \tfrac{d}{dt}\big(Ge^{-t\Omega}, He^{t\Omega^\top}\big)\big|_{t=0},

    along which :math:`GH^\top` does not change.

    Parameters
    ----------
    point : tuple of two arrays
        The pair ``(G, H)`` of shapes ``(..., n, h)`` and ``(..., m, h)``.
    omega : array
        :math:`\Omega`, of shape ``(..., h, h)`` (one per batch element).

    Returns
    -------
    tuple of two arrays
        ``(-G @ omega, H @ omega^T)``, shaped like ``point``.

    Raises
    ------
    GeometryError
        If ``point`` is not a pair of matrices with a common ``h`` or ``omega`` has the wrong shape.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point = (jnp.eye(2), jnp.ones((3, 2)))
    >>> vG, vH = mg.quotient.vertical_vector(point, jnp.array([[0.0, 1.0], [0.0, 0.0]]))
    >>> (vG @ jnp.ones((3, 2)).T + jnp.eye(2) @ vH.T).round(6)   # d(G H^T) = 0
    Array([[0., 0., 0.],
           [0., 0., 0.]], dtype=float32)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 3.3 and App. B.3 (vertical space). Chapter 6.
    """
    G, H = _check_pair(point)
    omega = jnp.asarray(omega)
    if omega.shape != G.shape[:-2] + (G.shape[-1], G.shape[-1]):
        raise GeometryError(
            f"vertical_vector: omega must have shape {G.shape[:-2] + (G.shape[-1], G.shape[-1])}, got {omega.shape}."
        )
    with jax.default_matmul_precision("highest"):
        return -G @ omega, H @ _mT(omega)


def horizontal_projection(point: Pair, xi: Pair, *, eps: float = 0.0) -> Pair:
    r"""The metric-orthogonal projection of a tangent vector onto the horizontal space of metric (15).

    .. math::

        \xi^{\mathrm H} &= (\xi_G + G\Lambda,\; \xi_H - H\Lambda^\top),

        (PH^\top H)X + X(G^\top GQ) &= PH^\top\xi_H - \xi_G^\top GQ,\qquad X = \Lambda^\top,

    with :math:`P = G^\top G + \epsilon I`, :math:`Q = H^\top H + \epsilon I` (for :math:`\epsilon = 0`:
    :math:`(PQ)X + X(PQ)`; the module notes derive it and compare with the equation printed in the
    paper).  For every :math:`\epsilon \ge 0` it is the orthogonal projection for the (relaxed) metric:
    idempotent; the removed part is vertical; the result is orthogonal to every vertical vector.
    Computed from thin SVDs of the sides at ``"highest"`` precision: relative error
    :math:`O(\mathrm{cond}(G)\,\varepsilon_{\mathrm{dtype}})`, not :math:`O(\mathrm{cond}(G)^2\varepsilon_{\mathrm{dtype}})`.

    Parameters
    ----------
    point : tuple of two arrays
        The pair ``(G, H)`` of shapes ``(..., n, h)`` and ``(..., m, h)`` (leading batch axes, e.g. heads).
    xi : tuple of two arrays
        The tangent vector, shaped like ``point``.
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` (App. G.2); needed for (nearly) rank-deficient sides.

    Returns
    -------
    tuple of two arrays
        :math:`\xi^{\mathrm H}`, shaped like ``point``.

    Raises
    ------
    GeometryError
        If the shapes do not match, ``eps < 0``, or the pair is numerically rank deficient at its dtype
        (relaxed smallest singular value of a side below :math:`10\sqrt{\max(n,h)}\,\varepsilon\,s_{\max}`)
        and the values are concrete; use ``eps > 0``, float64 or a better-conditioned point.  Under
        ``jit`` nothing is raised: the result is NaN for every rank-deficient pair (head).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G = jnp.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    >>> point = (G, jnp.array([[1.0, 1.0], [0.0, 1.0]]))
    >>> xi = mg.quotient.vertical_vector(point, jnp.array([[0.3, -1.0], [0.5, 0.2]]))
    >>> # a vertical vector projects to 0
    >>> [float(jnp.abs(x).max()) < 1e-5 for x in mg.quotient.horizontal_projection(point, xi)]
    [True, True]

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.2 (horizontal space and its Sylvester
    equation) and App. B.3. Chapter 6.
    """
    G, H = _check_pair(point)
    xG, xH = _check_like(point, xi, "xi")
    f = _frame((G, H), eps, "horizontal_projection")
    out = _nan_unless_ok(f, _horizontal_with(f, (xG, xH)))
    check_finite(out, "horizontal_projection", hint="The pair is (nearly) rank deficient: use eps > 0.")
    return out


def riemannian_gradient(point: Pair, egrad: Pair, *, eps: float = 0.0) -> Pair:
    r"""The Riemannian gradient for metric (15): the inverse metric applied to the Euclidean gradient.

    .. math:: \operatorname{grad} f = \big(\nabla_G f\,(G^\top G + \epsilon I),\; \nabla_H f\,(H^\top H + \epsilon I)\big).

    For a function of :math:`GH^\top` only, the result is horizontal (for every :math:`\epsilon \ge 0`).

    Parameters
    ----------
    point : tuple of two arrays
        The pair ``(G, H)`` of shapes ``(..., n, h)`` and ``(..., m, h)``.
    egrad : tuple of two arrays
        The Euclidean gradient :math:`(\nabla_G f, \nabla_H f)`, shaped like ``point``.
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` (App. G.2).

    Returns
    -------
    tuple of two arrays
        The Riemannian gradient, shaped like ``point``.

    Raises
    ------
    GeometryError
        If the shapes do not match or ``eps < 0``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point, egrad = (2 * jnp.eye(2), jnp.eye(2)), (jnp.eye(2), jnp.eye(2))
    >>> mg.quotient.riemannian_gradient(point, egrad)[0]
    Array([[4., 0.],
           [0., 4.]], dtype=float32)

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, App. B.5 (Riemannian gradient), for metric (15). Chapter 6.
    """
    G, H = _check_pair(point)
    gG, gH = _check_like(point, egrad, "egrad")
    _check_eps(eps)
    eye = jnp.eye(G.shape[-1], dtype=G.dtype)
    with jax.default_matmul_precision("highest"):
        return gG @ (_mT(G) @ G + eps * eye), gH @ (_mT(H) @ H + eps * eye)


def christoffel_quadratic(point: Pair, xi: Pair, *, eps: float = 0.0) -> Pair:
    r"""The geodesic correction :math:`\Gamma(\xi, \xi)` of metric (15).

    .. math:: \Gamma_G(\xi,\xi) = -\xi_G P^{-1}(\xi_G^\top G + G^\top\xi_G) + G P^{-1}\xi_G^\top\xi_G,\qquad P = G^\top G + \epsilon I,

    and likewise for H with :math:`Q = H^\top H + \epsilon I`; geodesics satisfy
    :math:`\ddot\gamma + \Gamma(\dot\gamma, \dot\gamma) = 0` (exact for the relaxed metric too:
    :math:`\epsilon I` does not depend on the point).

    Parameters
    ----------
    point : tuple of two arrays
        The pair ``(G, H)`` of shapes ``(..., n, h)`` and ``(..., m, h)``.
    xi : tuple of two arrays
        The velocity, shaped like ``point``.
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` (App. G.2).

    Returns
    -------
    tuple of two arrays
        :math:`(\Gamma_G, \Gamma_H)`, shaped like ``point``.

    Raises
    ------
    GeometryError
        If the shapes do not match, ``eps < 0``, or (eagerly) a side is numerically rank deficient;
        under ``jit`` the result is NaN instead.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point = (jnp.array([[2.0]]), jnp.array([[1.0]]))
    >>> xi = (jnp.array([[1.0]]), jnp.zeros((1, 1)))
    >>> [x.round(4).tolist() for x in mg.quotient.christoffel_quadratic(point, xi)]
    [[[-0.5]], [[0.0]]]

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (16); App. H.2, eq. (43). Chapter 6.
    """
    G, H = _check_pair(point)
    xG, xH = _check_like(point, xi, "xi")
    f = _frame((G, H), eps, "christoffel_quadratic")
    return _nan_unless_ok(f, _christoffel_with(f, (xG, xH)))


def geodesic_step(point: Pair, xi: Pair, *, eps: float = 0.0) -> Pair:
    r"""The second-order approximation of the geodesic of metric (15) from ``point`` with velocity ``xi``.

    .. math:: \gamma_\xi(1) \approx x + \xi - \tfrac12\Gamma(\xi,\xi)

    with :math:`\Gamma` from :func:`christoffel_quadratic`.

    Parameters
    ----------
    point : tuple of two arrays
        The pair ``(G, H)`` of shapes ``(..., n, h)`` and ``(..., m, h)``.
    xi : tuple of two arrays
        The initial velocity, shaped like ``point``.
    eps : float, optional
        Relaxation :math:`\epsilon \ge 0` (App. G.2).

    Returns
    -------
    tuple of two arrays
        The moved pair :math:`(G_1, H_1)`.

    Raises
    ------
    GeometryError
        As :func:`christoffel_quadratic`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point = (jnp.array([[2.0]]), jnp.array([[1.0]]))
    >>> G1, H1 = mg.quotient.geodesic_step(point, (jnp.array([[1.0]]), jnp.zeros((1, 1))))
    >>> round(float(G1[0, 0]), 4)   # exact geodesic 2 exp(1/2) = 3.2974
    3.25

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, eq. (7), used in eq. (8); App. B.6. Chapter 6.
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
    r"""Metric (15) for :math:`h = 1`, element-wise (the norm behind adaptive sharpness).

    .. math:: g\big((\eta_u, \eta_v), (\zeta_u, \zeta_v)\big) = \sum_i \frac{\eta_{u,i}\zeta_{u,i}}{u_i^2} + \frac{\eta_{v,i}\zeta_{v,i}}{v_i^2}.

    Parameters
    ----------
    point : tuple of two arrays
        ``(u, v)`` of the same shape, used as ``u * v``; no entry may be 0.
    eta, zeta : tuple of two arrays
        Tangent vectors, shaped like ``point``.

    Returns
    -------
    jax.Array
        The scalar inner product.

    Raises
    ------
    GeometryError
        If the shapes differ or (eagerly) an entry of ``u`` or ``v`` is 0.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> u = (jnp.array([2.0]), jnp.array([1.0]))
    >>> float(mg.quotient.gl1_metric(u, u, u))
    2.0

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.1, eq. (9); App. D, eq. (22). Chapter 6.
    """
    u, v, a, b = _check_elementwise(point, eta, "eta")
    _, _, c, d = _check_elementwise(point, zeta, "zeta")
    return jnp.sum(a * c / u**2 + b * d / v**2)


def gl1_horizontal_projection(point: Pair, xi: Pair) -> Pair:
    r"""The horizontal projection for the rescaling :math:`(u, v) \mapsto (au, v/a)`: equalize :math:`\xi_u/u` and :math:`\xi_v/v`.

    .. math:: \xi^{\mathrm H} = (\xi_u + u\omega,\; \xi_v - v\omega),\qquad \omega = \tfrac12\big(\xi_v/v - \xi_u/u\big),

    removing the vertical direction :math:`(-u\omega, v\omega)` (orthogonal for :func:`~minigeo.quotient.gl1_metric`).

    Parameters
    ----------
    point : tuple of two arrays
        ``(u, v)`` of the same shape; no entry may be 0.
    xi : tuple of two arrays
        The tangent vector, shaped like ``point``.

    Returns
    -------
    tuple of two arrays
        :math:`\xi^{\mathrm H}`, with :math:`\xi^{\mathrm H}_u/u = \xi^{\mathrm H}_v/v`.

    Raises
    ------
    GeometryError
        If the shapes differ or (eagerly) an entry of ``u`` or ``v`` is 0.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point = (jnp.array([1.0]), jnp.array([1.0]))
    >>> mg.quotient.gl1_horizontal_projection(point, (jnp.array([1.0]), jnp.array([-1.0])))
    (Array([0.], dtype=float32), Array([0.], dtype=float32))

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.1 (above eq. (10)); App. D (horizontal space). Chapter 6.
    """
    u, v, a, b = _check_elementwise(point, xi)
    omega = 0.5 * (b / v - a / u)
    return a + u * omega, b - v * omega


def gl1_geodesic(point: Pair, xi: Pair, t: float = 1.0) -> Pair:
    r"""The exact geodesic of the GL(1) metric :func:`~minigeo.quotient.gl1_metric`.

    .. math:: u(t) = u\,e^{t\,\xi_u/u},\qquad v(t) = v\,e^{t\,\xi_v/v}.

    Parameters
    ----------
    point : tuple of two arrays
        ``(u, v)`` of the same shape; no entry may be 0.
    xi : tuple of two arrays
        The initial velocity, shaped like ``point`` (horizontal if :math:`\xi_u/u = \xi_v/v`).
    t : float, optional
        The time at which to evaluate the geodesic.

    Returns
    -------
    tuple of two arrays
        :math:`(u(t), v(t))`.

    Raises
    ------
    GeometryError
        If the shapes differ or (eagerly) an entry of ``u`` or ``v`` is 0.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> point = (jnp.array([2.0]), jnp.array([1.0]))
    >>> u1, _ = mg.quotient.gl1_geodesic(point, (jnp.array([1.0]), jnp.array([0.0])))
    >>> round(float(u1[0]), 4)
    3.2974

    References
    ----------
    da Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5.1, eq. (10); App. D. Chapter 6.
    """
    u, v, a, b = _check_elementwise(point, xi)
    return u * jnp.exp(t * a / u), v * jnp.exp(t * b / v)

r"""Factored metric (15) of a GL(h) pair, shared by :mod:`minigeo.quotient` and :mod:`minigeo.sharpness` (floor 1, private).

A pair ``(G, H)`` used as :math:`GH^\top` carries metric (15) of da Silva et al. (2025); this module factors
it from thin SVDs of the sides (:class:`_PairFrame`, :func:`_factor_pair`; never from Gram matrices, which
square the condition number), solves the horizontal projection's Sylvester equation in whitened
coordinates (:func:`_whitened_projection`), and names a relaxation ``eps`` that makes an ill-conditioned
pair usable (:func:`_eps_that_works`).  The derivations are in the notes of :mod:`minigeo.quotient`,
whose public functions, like the search space of :mod:`minigeo.sharpness`, are written on these frames.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, is_concrete


def _mT(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _map_matrices(fn, *arrays: jax.Array):
    """Apply ``fn`` to one matrix (or matrix tuple) at a time over the leading batch axes, with ``lax.map``.

    Batched LAPACK calls (``eigh``, ``svd``) over many heads and layers have been seen to hang
    XLA's CPU runtime (jax 0.10, e.g. a (12, 12, 65, 65) ``eigh`` at ViT-B/32 shape); one matrix
    at a time is safe and, for these small matrices, as fast.
    """
    batch = arrays[0].shape[:-2]
    if not batch:
        return fn(*arrays)
    flat = [a.reshape((-1,) + a.shape[-2:]) for a in arrays]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(flat))
    return jax.tree_util.tree_map(lambda o: o.reshape(batch + o.shape[1:]), out)


def _check_eps(eps) -> None:
    if is_concrete(eps):
        e = np.asarray(eps)
        if e.ndim != 0 or not np.isfinite(e) or e < 0:
            raise GeometryError(f"eps (the relaxation G^T G + eps I) must be a finite scalar >= 0, got {eps!r}.")


def _singular_value_cutoff(n: int, h: int, dtype) -> float:
    r"""Relative cut-off below which a side's singular values count as zero at this ``dtype``.

    :math:`10\sqrt{\max(n, h)}\,\varepsilon_{\mathrm{dtype}}`: the size of the round-off that a
    backward-stable SVD of an ``n x h`` matrix leaves on its singular values, relative to the largest,
    with a safety factor 10.  A side whose smallest singular value (with the relaxation,
    :math:`\sqrt{s_{\min}^2 + \epsilon}`) falls below ``cutoff * s_max`` is numerically rank deficient.
    """
    return 10.0 * math.sqrt(max(n, h)) * float(jnp.finfo(dtype).eps)


class _PairFrame(NamedTuple):
    r"""Metric (15) at a pair ``(G, H)``, factored from the **sides** (one thin SVD each), never from their Gram matrices.

    With :math:`G = U S V^\top` and :math:`P = G^\top G + \epsilon I = V(S^2 + \epsilon)V^\top`,
    the frame holds :math:`\hat G = GP^{-1/2}` (orthonormal columns when :math:`\epsilon = 0`),
    :math:`P^{\pm 1/2}`, :math:`\hat G^\top\hat G`, the same for ``H``, and the SVD
    :math:`Q^{1/2}P^{1/2} = W\,\mathrm{diag}(\sigma)\,Z^\top` that diagonalizes :math:`PQ` (its
    eigenvalues are :math:`\sigma^2`).  Gram matrices would square the condition number (a float32
    ``eigh`` of :math:`G^\top G` loses every digit once :math:`\mathrm{cond}(G) \gtrsim 3\cdot 10^3`);
    the SVD of the tall side loses only :math:`\mathrm{cond}(G)\,\varepsilon`.  Every horizontal
    projection and geodesic below is written with :math:`\hat G`, :math:`\hat H`, ``Z``, ``W`` and
    :math:`\sigma` so that the condition number enters once (through the final product with
    :math:`P^{1/2}`), see :func:`minigeo.quotient.horizontal_projection`.

    ``ok`` is ``True`` where both sides have full numerical rank at their dtype (the relaxed smallest
    singular value above ``_singular_value_cutoff * s_max``); ``cond`` is the larger of the two
    sides' (relaxed) condition numbers.  Both have the pair's batch (head) shape.
    """

    G: jax.Array
    H: jax.Array
    Gn: jax.Array
    Hn: jax.Array
    P_half: jax.Array
    P_mhalf: jax.Array
    Q_half: jax.Array
    Q_mhalf: jax.Array
    gram_G: jax.Array
    gram_H: jax.Array
    Z: jax.Array
    W: jax.Array
    sigma: jax.Array
    ok: jax.Array
    cond: jax.Array
    # eps > 0 only (None for eps = 0): the bases that diagonalize the Sylvester equation of the relaxed metric
    LG: jax.Array | None = None
    LH: jax.Array | None = None
    AG: jax.Array | None = None
    AH: jax.Array | None = None
    dG: jax.Array | None = None
    dH: jax.Array | None = None


def _side_factors(M: jax.Array, eps):
    n, h = M.shape
    Qm, Rm = jnp.linalg.qr(M)  # thin QR of the tall side, then the SVD of its h x h factor
    U, s, Vt = jnp.linalg.svd(Rm)
    r = jnp.sqrt(s * s + eps)  # singular values of P^{1/2}
    V = Vt.T
    r_safe = jnp.where(r > 0, r, 1.0)
    c = s / r_safe
    cutoff = _singular_value_cutoff(n, h, M.dtype) * jnp.max(s)
    ok = jnp.all(jnp.isfinite(s)) & (jnp.min(r) > cutoff) & (jnp.min(r) > 0)
    cond = jnp.max(r) / jnp.maximum(jnp.min(r), jnp.finfo(M.dtype).tiny)
    return Qm @ ((U * c) @ Vt), (V * r) @ Vt, (V / r_safe) @ Vt, (V * (c * c)) @ Vt, (V * c) @ Vt, ok, cond


def _frame_one(G: jax.Array, H: jax.Array, eps, relaxed: bool):
    with jax.default_matmul_precision("highest"):
        Gn, P_half, P_mhalf, gram_G, root_G, ok_G, cond_G = _side_factors(G, eps)
        Hn, Q_half, Q_mhalf, gram_H, root_H, ok_H, cond_H = _side_factors(H, eps)
        W, sigma, Zt = jnp.linalg.svd(Q_half @ P_half)
        Z = Zt.T
        out = (Gn, Hn, P_half, P_mhalf, Q_half, Q_mhalf, gram_G, gram_H, Z, W, sigma,
               ok_G & ok_H, jnp.maximum(cond_G, cond_H))
        if not relaxed:
            return out
        # S_G = (C_G^{1/2} Z Sigma)^T (C_G^{1/2} Z Sigma), S_H likewise with W (notes of minigeo.quotient): factored
        # by SVDs of the h x h roots, never by eigh of the products (that would square their condition)
        ZS, WS = Z * sigma, W * sigma
        _, tG, EGt = jnp.linalg.svd(root_G @ ZS)
        _, tH, EHt = jnp.linalg.svd(root_H @ WS)
        EG, EH = EGt.T, EHt.T
        return out + (ZS @ EG, WS @ EH, W @ EG, Z @ EH, tG * tG, tH * tH)


@functools.partial(jax.jit, static_argnames="relaxed")
def _pair_frame(G: jax.Array, H: jax.Array, eps: jax.Array, relaxed: bool) -> _PairFrame:
    return _PairFrame(G, H, *_map_matrices(lambda g, hh: _frame_one(g, hh, eps, relaxed), G, H))


def _factor_pair(G: jax.Array, H: jax.Array, eps=0.0) -> _PairFrame:
    """Factor metric (15) at ``(G, H)`` from thin SVDs of the sides (see :class:`_PairFrame`); batched over heads.

    Compiled once per shape and dtype, so eager calls in a loop cost no more than the factorization.
    A concrete ``eps == 0`` takes the unrelaxed path; any other ``eps`` (a traced one included) also
    factors the Sylvester equation of the relaxed metric (``LG`` ... ``dH``)."""
    _check_eps(eps)
    relaxed = not (is_concrete(eps) and float(np.asarray(eps)) == 0.0)
    return _pair_frame(G, H, jnp.asarray(eps, G.dtype), relaxed)


def _eps_that_works(G: np.ndarray, H: np.ndarray, target_cond: float) -> float:
    r"""The smallest relaxation :math:`\epsilon` (rounded up, with a factor 2 of margin in the condition number)
    for which both sides' relaxed condition numbers :math:`\sqrt{(s_{\max}^2 + \epsilon)/(s_{\min}^2 + \epsilon)}`
    are at most ``target_cond``, for every head of the pair (singular values in float64)."""
    c2 = (0.5 * target_cond) ** 2
    need = 0.0
    for M in (G, H):
        M = np.asarray(M, np.float64).reshape((-1,) + np.shape(M)[-2:])
        for m in M:
            sv = np.linalg.svd(m, compute_uv=False)
            # never below s_max^2 / c2: positive even where float64 finds the side well conditioned
            need = max(need, (sv[0] ** 2 / c2 - sv[-1] ** 2) / (1.0 - 1.0 / c2), sv[0] ** 2 / c2)
    if not need > 0:
        return float(np.finfo(np.float64).tiny)
    mant, expo = f"{need:.0e}".split("e")
    return (int(mant) + 1) * 10.0 ** int(expo)  # one digit, rounded up


def _whitened_projection(f: _PairFrame, GtG: jax.Array, HtH: jax.Array):
    r"""Horizontal projection in whitened coordinates ``z = xi P^{-1/2}`` (G side), ``xi Q^{-1/2}`` (H side).

    For a whitened vector ``(gG, gH)``, ``GtG = Gn^T gG`` and ``HtH = Hn^T gH`` (h x h).  Returns the two h x h corrections ``(cG, cH)``:
    the projection is ``(gG + Gn cG, gH - Hn cH)``.  With :math:`a = Z^\top g_G^\top\hat G Z`,
    :math:`b = W^\top\hat H^\top g_H W`, the Sylvester equation of the notes of :mod:`minigeo.quotient` becomes
    diagonal in these bases: :math:`Y_{ij} = (\sigma_i\sigma_j b_{ij} - \sigma_j^2 a_{ij})/(\sigma_i^2+\sigma_j^2)`,
    :math:`c_G = Z Y^\top Z^\top`, :math:`c_H = W\,\Sigma Y\Sigma^{-1} W^\top`; every factor is
    bounded, so no condition number is amplified.

    With :math:`\epsilon > 0` (frame fields ``LG`` ... ``dH``), :math:`\hat G^\top\hat G \ne I` and the
    equation is :math:`S_G\hat X + \hat X S_H = b^\top\Sigma - \Sigma a^\top` with
    :math:`S_G = E_G D_G E_G^\top`, :math:`S_H = E_H D_H E_H^\top` (notes of :mod:`minigeo.quotient`):
    :math:`K = (E_G^\top(b^\top\Sigma - \Sigma a^\top)E_H)_{ij}/(d_{G,i} + d_{H,j})`,
    :math:`c_G = Z\Sigma E_G K E_H^\top Z^\top`, :math:`c_H = W\Sigma E_H K^\top E_G^\top W^\top`.
    For :math:`\epsilon = 0`, :math:`E = I` and :math:`D = \Sigma^2`, which is the formula above.
    """
    if f.dG is not None:
        denom = f.dG[..., :, None] + f.dH[..., None, :]
        denom = jnp.where(denom > 0, denom, 1.0)
        K = (_mT(f.AG) @ _mT(HtH) @ f.LH - _mT(f.LG) @ GtG @ f.AH) / denom
        return f.LG @ K @ _mT(f.AH), f.LH @ _mT(K) @ _mT(f.AG)
    s = f.sigma
    si, sj = s[..., :, None], s[..., None, :]
    denom = si * si + sj * sj
    denom = jnp.where(denom > 0, denom, 1.0)
    a = _mT(f.Z) @ _mT(GtG) @ f.Z
    b = _mT(f.W) @ HtH @ f.W
    Y = (si * sj * b - sj * sj * a) / denom
    Yh = (si * si * b - si * sj * a) / denom
    return f.Z @ _mT(Y) @ _mT(f.Z), f.W @ Yh @ _mT(f.W)

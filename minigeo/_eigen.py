r"""Block Lanczos in the ``G``-inner product, Rayleigh-Ritz and a certificate that counts multiplicity (floor 1).

Shared by :func:`minigeo.top_eigenvalues` and :meth:`minigeo.operators.CurvatureOperator.top_eigenvalues`
(issue 31: single-vector Lanczos keeps only one copy of a repeated eigenvalue, and a per-value
residual bound cannot see the missing copies).

* One recurrence, written once as small step functions (matfree's pattern): :func:`_gram_schmidt`,
  :func:`_restart_covectors` and :func:`_finish_restarts` (the pending block ``G``-orthonormalized,
  broken columns restarted), :func:`_absorb` (a block step after its product with ``H``: the rows of
  ``T`` and the residual) and :func:`_rescale` (the breakdown scale).  The products with ``H`` and
  ``G^{-1}`` are the drivers' own; two drivers run the steps:
* :func:`block_lanczos`: ``m`` block steps with a block of ``p`` vectors, on the device (one
  compiled ``fori_loop``; each block step is one batched, ``vmap``-ed product with ``H`` and one
  with ``G^{-1}``);
* :class:`ResumableBlockLanczos`: the same steps, compiled one by one and driven from Python with the
  basis in host memory, extendable block by block, for products that a compiled loop cannot call
  (a pass over a dataset, an eager solve with the metric; the adaptive eager path).
* :func:`ritz_certificate`: Rayleigh-Ritz on the projected matrix and the Kahan bound of the
  leading Ritz values; :func:`certified_top_eigenvalues`: validation, the adaptive loop, NaN under
  ``jit`` and the eager error.

The recurrence.  ``E = G^{-1}H`` is self-adjoint for ``<u, v>_G = u^T G v``.  The basis rows ``Q``
are ``G``-orthonormal and ``W = G Q`` (``W is Q`` when ``G = I``), so ``<q_i, x>_G = w_i^T x =
q_i^T (G x)``.  A block step multiplies the current block ``Q_j`` by ``H`` (``H Q_j = G E Q_j``),
records the rows ``(H Q_j) Q^T`` of the projected matrix ``T = Q H Q^T`` (so ``T`` is the exact
Rayleigh quotient of the basis up to round-off, not a recurrence that round-off can bend), removes
the basis components twice (full reorthogonalization: first against the blocks ``j - 1`` and ``j``,
which hold all of ``H Q_j`` but the residual in exact arithmetic, then against every filled block,
which removes the round-off; each pass reads each block once), applies ``G^{-1}`` and
``G``-orthonormalizes the residual block column by column (Gram-Schmidt, twice).  A residual column below
``breakdown_tol * scale`` is a breakdown (an invariant subspace, e.g. a low-rank Hessian): it is
replaced by a random vector ``G``-orthogonal to the basis and to the rest of the block (or, once the
basis spans the whole space, by a zero row marked dead); the random covectors of a block's broken
columns are projected first and mapped by ``G^{-1}`` in one batched product (projections are linear,
so the pair ``(G^{-1} r, r)`` stays a pair while it is orthogonalized against the block).  After the last block, ``E Y - Y Theta`` for the Ritz vectors
``Y = Q^T S`` is the last residual block times the last ``p`` rows of ``S``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, check_finite
from ._status import Status

__all__ = [
    "block_lanczos",
    "ResumableBlockLanczos",
    "ritz_certificate",
    "certified_top_eigenvalues",
    "default_block_size",
    "default_num_products",
]


def default_block_size(k: int) -> int:
    """``k``: a block of ``k`` random vectors has a component in every eigenspace of rank up to ``k``,
    so the ``k`` largest are found with their multiplicity (``1`` for ``k = 1``).

    It was ``k + 2`` (2 oversampled) until issue 30: on the benchmark MLPs ``p = k`` certifies the top
    5 with the same default number of block steps, in 150 products instead of 210
    (``benchmarks/bench_eig_speed.py``).
    """
    return int(k)


def default_num_products(k: int, p: int) -> int:
    """The default Krylov dimension (products with ``E``): ``max(30, 4k, 30 p)``.

    The benchmark MLP 784-256-256-10 (float32, clustered top five, ``p = 7``) needs 27 block steps
    (189 products) to certify its top 5 at ``rtol = 1e-2``; 12 block steps did not.  With the
    default ``p = 5`` the 30 steps (150 products) certify it under ``jit``.
    """
    return max(30, 4 * k, 30 * p)


def _breakdown_tol(d: int, dtype: Any, breakdown_tol: float | None) -> float:
    eps = float(np.finfo(np.dtype(dtype)).eps)
    return float(breakdown_tol) if breakdown_tol is not None else 10.0 * float(np.sqrt(d)) * eps


# ---------------------------------------------------------------------------
# the recurrence, as small step functions (one definition for both drivers below)
# ---------------------------------------------------------------------------
def _gram_schmidt(V: jax.Array, Hc: jax.Array, tol: Any, scale: jax.Array, euclid: bool):
    """``G``-orthonormalize the rows of ``(V, Hc = G V)`` among themselves (already ``G``-orthogonal to the
    basis), twice per column: ``(Qn, Wn, broke)``; a column below ``tol * scale`` is a breakdown, left a
    zero row (:func:`_restart_covectors` and :func:`_finish_restarts` replace it).  NaN is not a
    breakdown: it propagates into ``T``."""
    p, d = V.shape

    def column(i, carry):
        Qn, Wn, broke = carry
        v, h = V[i], Hc[i]
        for _ in range(2):  # against the new rows so far (zero rows beyond i), twice
            c = Qn @ h
            v = v - Qn.T @ c
            h = v if euclid else h - Wn.T @ c  # G = I: V is Hc and Wn is Qn, computed once
        nrm = jnp.sqrt(jnp.maximum(jnp.vdot(v, h), 0.0))
        br = nrm <= tol * scale
        safe = jnp.where(nrm > 0, nrm, 1.0)
        Qn = Qn.at[i].set(jnp.where(br, 0.0, v / safe))
        Wn = Qn if euclid else Wn.at[i].set(jnp.where(br, 0.0, h / safe))
        return Qn, Wn, broke.at[i].set(br)

    zeros = jnp.zeros((p, d), V.dtype)
    return jax.lax.fori_loop(0, p, column, (zeros, zeros, jnp.zeros(p, bool)))


def _restart_covectors(Q, W, Qn, Wn, broke, key, row0, tol):
    """Random covectors for the broken columns (row ``row0 + i`` draws ``fold_in(key, row0 + i)``), with
    their components along the basis and the new block removed (twice): ``(R, ok)``; ``ok`` False where
    nothing is left (the basis already spans everything)."""
    p, d = Qn.shape
    R = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, row0 + i), (d,), dtype=Qn.dtype))(jnp.arange(p))
    r0 = jnp.linalg.norm(R, axis=1)
    for _ in range(2):
        R = R - (R @ Q.T) @ W
        R = R - (R @ Qn.T) @ Wn
    ok = broke & (jnp.linalg.norm(R, axis=1) > tol * r0)
    return jnp.where(ok[:, None], R, 0.0), ok


def _finish_restarts(Qn, Wn, R, RV, broke, ok, tol, euclid: bool):
    """The broken columns replaced by the restart pairs ``(RV = G^{-1} R, R)``, ``G``-orthonormalized
    against the new block column by column (twice): ``(Qn, Wn, alive)``.  Products are linear, so
    projecting a pair keeps ``RV = G^{-1} R``; a pair with nothing left is a dead zero row."""

    def column(i, carry):
        Qn, Wn, alive = carry
        v, h = RV[i], R[i]
        n0 = jnp.sqrt(jnp.maximum(jnp.vdot(v, h), 0.0))
        for _ in range(2):
            c = Qn @ h
            v = v - Qn.T @ c
            h = v if euclid else h - Wn.T @ c
        nr = jnp.sqrt(jnp.maximum(jnp.vdot(v, h), 0.0))
        good = ok[i] & (nr > tol * n0)
        safe = jnp.where(nr > 0, nr, 1.0)
        Qn = Qn.at[i].set(jnp.where(broke[i], jnp.where(good, v / safe, 0.0), Qn[i]))
        Wn = Qn if euclid else Wn.at[i].set(jnp.where(broke[i], jnp.where(good, h / safe, 0.0), Wn[i]))
        return Qn, Wn, alive.at[i].set(~broke[i] | good)

    return jax.lax.fori_loop(0, Qn.shape[0], column, (Qn, Wn, jnp.ones(Qn.shape[0], bool)))


def _project_out(X, Q, W, lo, hi, p: int):
    """Classical Gram-Schmidt of the rows of ``X`` against the blocks ``lo .. hi - 1`` of the basis:
    ``(X - C W, C)``, the coefficients ``C = X Q^T`` (``(rows, N)``, zero outside those blocks), reading
    each block once (the preallocated basis is not read past the filled blocks; issue 30)."""

    def block(b, carry):
        acc, C = carry
        Qb = jax.lax.dynamic_slice_in_dim(Q, b * p, p)
        Wb = jax.lax.dynamic_slice_in_dim(W, b * p, p)
        Cb = X @ Qb.T
        return acc + Cb @ Wb, jax.lax.dynamic_update_slice_in_dim(C, Cb, b * p, 1)

    zeros = (jnp.zeros_like(X), jnp.zeros((X.shape[0], Q.shape[0]), X.dtype))
    acc, C = jax.lax.fori_loop(lo, hi, block, zeros)
    return X - acc, C


def _absorb(Hraw, Q, W, T, j, first, tol, p: int):
    """Block step ``j`` after its product ``Hraw = H Q_j``: ``(T, Hres, A)``, the rows and columns ``j`` of
    ``T = Q H Q^T``, the residual block (round-off set to 0) and the diagonal block ``A`` of ``T``.

    "Twice is enough", with a cheap first pass: in exact arithmetic ``H Q_j`` lies in the span of the
    blocks ``j - 1``, ``j`` and the residual, so a first pass against those two blocks removes all but
    round-off and one pass against every filled block removes that (the first step after a thick
    restart, ``j == first > 0``, couples to every kept Ritz vector: a full first pass).  ``T``'s rows
    are the sum of the two passes' coefficients: ``H Q_j Q^T`` up to round-off."""
    s = j * p
    Hres, C = _project_out(Hraw, Q, W, jnp.where(j == first, 0, jnp.maximum(j - 1, 0)), j + 1, p)
    Hres, C2 = _project_out(Hres, Q, W, 0, j + 1, p)
    C = C + C2
    T = jax.lax.dynamic_update_slice(T, C, (s, 0))
    T = jax.lax.dynamic_update_slice(T, C.T, (0, s))
    # a residual at round-off (an invariant subspace) is set to 0 before G^{-1}: a CG solve on
    # rounding noise may fail, and the column is a breakdown either way
    rn = jnp.linalg.norm(Hres, axis=1)
    keep = (rn > tol * jnp.max(jnp.linalg.norm(Hraw, axis=1))) | jnp.isnan(rn)
    return T, jnp.where(keep[:, None], Hres, 0.0), jax.lax.dynamic_slice_in_dim(C, s, p, axis=1)


def _rescale(scale, A, Vres, Hres):
    """The breakdown scale after a block step: the largest of the old one, ``|A|`` and the residual's ``G``-norms (NaN propagates)."""
    res2 = jnp.sum(Vres * Hres, axis=1)
    return jnp.maximum(scale, jnp.maximum(jnp.max(jnp.abs(A)), jnp.sqrt(jnp.max(jnp.maximum(res2, 0.0)))))


def _start_scale(V0, Z):
    return jnp.sqrt(jnp.max(jnp.maximum(jnp.sum(V0 * Z, axis=1), 0.0)))


# ---------------------------------------------------------------------------
# device recurrence
# ---------------------------------------------------------------------------
def block_lanczos(
    apply_h: Callable[[jax.Array], jax.Array],
    apply_ginv: Callable[[jax.Array], jax.Array] | None,
    Z: jax.Array,
    m: int,
    *,
    key: jax.Array,
    breakdown_tol: float | None = None,
    return_basis: bool = False,
    resume: tuple | None = None,
    return_state: bool = False,
) -> tuple[jax.Array, ...]:
    """``m`` block Lanczos steps of ``E = G^{-1}H`` from the start covectors ``Z`` (``(p, d)``), on the device.

    ``apply_h`` and ``apply_ginv`` act on one flat vector (``None``: ``G = I``); they are ``vmap``-ed
    over the block.  The start block is ``G^{-1} Z`` ``G``-orthonormalized.  Returns
    ``(T, alive, M)``: the ``(m p, m p)`` projected matrix ``T = Q H Q^T``, the ``(m p,)`` mask of
    live basis rows (dead rows only once the basis spans all ``d`` dimensions) and the ``(p, p)``
    ``G``-Gram matrix ``M = R G R^T`` of the last residual block ``R`` (for the certificate);
    ``return_basis``: also the ``(m p, d)`` ``G``-orthonormal basis ``Q`` (for Ritz vectors).
    ``jit``-compatible: ``m`` and the shapes are static.  One compiled ``fori_loop`` over the step
    functions above (:class:`ResumableBlockLanczos` drives the same functions from Python).

    ``resume``: a thick restart (:func:`restarted_block_lanczos`): ``(Q, W, T, alive, scale, V, H, j0,
    start_scale)``, the first ``j0`` blocks of the basis already filled (kept Ritz vectors, with their
    block of ``T``; ``j0`` may be traced) and the pending residual block ``(V, H)`` (``H`` the
    covectors, ``V = G^{-1}H``), orthogonal to them; steps ``j0 .. m - 1`` run (``start_scale``: the
    breakdown scale of block 0).  ``return_state``: the result ends with that state after the run
    (``W`` is ``Q`` when ``G = I``).
    """
    p, d = Z.shape
    dtype = Z.dtype
    tol = _breakdown_tol(d, dtype, breakdown_tol)
    N = m * p
    hb = jax.vmap(apply_h)
    euclid = apply_ginv is None
    gb = (lambda X: X) if euclid else jax.vmap(apply_ginv)

    def orthonormalize(V, Hc, Q, W, row0, scale):
        """The pending block ``G``-orthonormalized; broken columns restarted (one batched ``G^{-1}``, only
        when a column broke down)."""
        Qn, Wn, broke = _gram_schmidt(V, Hc, tol, scale, euclid)

        def restart(_):
            R, ok = _restart_covectors(Q, W, Qn, Wn, broke, key, row0, tol)
            return _finish_restarts(Qn, Wn, R, gb(R), broke, ok, tol, euclid)

        return jax.lax.cond(jnp.any(broke), restart, lambda _: (Qn, Wn, jnp.ones(p, bool)), None)

    Q = jnp.zeros((N, d), dtype)
    W = None if euclid else jnp.zeros((N, d), dtype)  # G = I: the basis is carried once
    V0 = gb(Z) if resume is None else None
    start_scale = None if resume is not None else _start_scale(V0, Z)
    alive = jnp.zeros(N, bool)
    T = jnp.zeros((N, N), dtype)
    scale0 = jnp.zeros((), dtype)
    first = 0
    if resume is not None:
        Q, W, T, alive, scale0, V0, Z, first, start_scale = resume
        W = None if euclid else W

    # One loop body: G-orthonormalize the pending block (the start block at j = 0, else the last
    # residual) into block j, then run block step j.  So orthonormalization and the products with H
    # and G^{-1} are traced and compiled once each, and the residual left pending after the last step
    # is the one the certificate needs.
    def body(j, carry):
        Q, W, T, alive, scale, Vp, Hp = carry
        # the start block's breakdown test is relative to its own size; later ones to H's scale so far
        Qn, Wn, al = orthonormalize(Vp, Hp, Q, Q if euclid else W, j * p, jnp.where(j == 0, start_scale, scale))
        Q = jax.lax.dynamic_update_slice_in_dim(Q, Qn, j * p, 0)
        W = None if euclid else jax.lax.dynamic_update_slice_in_dim(W, Wn, j * p, 0)
        alive = jax.lax.dynamic_update_slice_in_dim(alive, al, j * p, 0)
        T, Hres, A = _absorb(hb(Qn), Q, Q if euclid else W, T, j, first, tol, p)  # Qn is block j: H Q_j = G E Q_j
        Vres = gb(Hres)
        return Q, W, T, alive, _rescale(scale, A, Vres, Hres), Vres, Hres

    Q, W, T, alive, scale, Vres, Hres = jax.lax.fori_loop(first, m, body, (Q, W, T, alive, scale0, V0, Z))
    M = Vres @ Hres.T
    out = (0.5 * (T + T.T), alive, 0.5 * (M + M.T))
    if return_basis:
        out = (*out, Q)
    if return_state:
        out = (*out, (Q, Q if euclid else W, T, alive, scale, Vres, Hres))
    return out


def restarted_block_lanczos(
    apply_h: Callable[[jax.Array], jax.Array],
    apply_ginv: Callable[[jax.Array], jax.Array] | None,
    Z: jax.Array,
    m: int,
    *,
    key: jax.Array,
    k: int,
    rtol: Any,
    max_cycles: int,
    keep_blocks: int | None = None,
    return_basis: bool = False,
) -> tuple[jax.Array, ...]:
    """Thick-restarted block Lanczos: cycles of a fixed ``(m p, d)`` basis until the top ``k`` are certified.

    Cycle 0 is :func:`block_lanczos` from ``Z``.  While the leading ``k`` Ritz values are not
    certified to ``rtol`` (Kahan's bound, :func:`ritz_certificate`) and fewer than ``max_cycles``
    cycles ran, the basis is restarted (Wu & Simon's thick restart, in blocks): its leading
    ``keep_blocks * p`` Ritz vectors ``Y = S^T Q`` are kept as the first blocks, with their block
    ``diag(theta)`` of ``T``; the pending residual block (orthogonal to the whole old basis, hence
    to ``Y``) is the next block, and block steps fill the rest.  The kept vectors' products lie in the
    span of ``Y`` and that block (``E Y = Y Theta + R S_{last}``), so ``E Q^T = Q^T T`` up to the last
    residual block still holds and the certificate is the same theorem.  One ``lax.while_loop`` whose
    body is one :func:`block_lanczos` (the products are traced and compiled once): ``jit``-compatible,
    memory ``m p x d`` numbers (twice with a metric) whatever the cycles.  Returns ``(T, alive, M,
    cycles)`` (and the basis ``Q`` before ``cycles`` with ``return_basis``); products with ``H``:
    ``m p + (cycles - 1) (m - keep_blocks) p``.
    """
    p, d = Z.shape
    dtype = Z.dtype
    N = m * p
    lb = max(1, m // 2) if keep_blocks is None else keep_blocks
    L = lb * p
    euclid = apply_ginv is None
    V0 = Z if euclid else jax.vmap(apply_ginv)(Z)
    start_scale = _start_scale(V0, Z)
    zeros_basis = jnp.zeros((N, d), dtype)
    W0 = jnp.zeros((0,), dtype) if euclid else zeros_basis  # G = I: no second basis
    M0 = jnp.zeros((p, p), dtype)

    def certified(T, alive, M):
        theta, bounds, valid = ritz_certificate(T, alive, M, k)
        ok, _ = _accepted(theta, bounds, valid, T, rtol)
        return jnp.all(ok) | ~jnp.all(jnp.isfinite(T))

    def thick(Q, W, T, alive):
        """The restarted basis: the leading L Ritz vectors (G-orthonormal) written over the first L rows
        of Q (in place; later rows are overwritten by the cycle's block steps before they are read),
        their block diag(theta) of T.  At cycle 0 (T = 0, nothing alive) every kept row is 0."""
        big = 2.0 * (N * jnp.max(jnp.abs(T)) + 1.0)
        both = alive[:, None] & alive[None, :]
        theta, S = jnp.linalg.eigh(jnp.where(both, T, 0.0) + jnp.diag(jnp.where(alive, 0.0, -big)))
        theta, S = theta[::-1][:L], S[:, ::-1][:, :L]
        kept = theta > -big / 2
        Qn = Q.at[:L].set(jnp.where(kept[:, None], S.T @ Q, 0.0))
        Wn = W if euclid else W.at[:L].set(jnp.where(kept[:, None], S.T @ W, 0.0))
        Tn = jnp.zeros_like(T).at[:L, :L].set(jnp.diag(jnp.where(kept, theta, 0.0)))
        return Qn, Wn, Tn, jnp.zeros_like(alive).at[:L].set(kept)

    def cond(carry):
        cycle, T, alive, M = carry[:4]
        return (cycle == 0) | ((cycle < max_cycles) & ~certified(T, alive, M))

    def body(carry):
        cycle, T, alive, M, Q, W, scale, V, H = carry
        Qn, Wn, Tn, alive_n = thick(Q, W, T, alive)  # G = I: W is a placeholder (the basis is not carried twice)
        first = jnp.where(cycle == 0, 0, lb)
        cycle_key = jax.lax.cond(cycle == 0, lambda: key, lambda: jax.random.fold_in(key, cycle))
        T, alive, M, (Q, W, _, _, scale, V, H) = block_lanczos(
            apply_h, apply_ginv, Z, m, key=cycle_key, return_state=True,
            resume=(Qn, Qn if euclid else Wn, Tn, alive_n, scale, V, H, first, start_scale),
        )
        return cycle + 1, T, alive, M, Q, W if not euclid else W0, scale, V, H

    init = (jnp.zeros((), jnp.int32), jnp.zeros((N, N), dtype), jnp.zeros(N, bool), M0, zeros_basis, W0,
            jnp.zeros((), dtype), V0, Z)
    cycles, T, alive, M, Q, *_ = jax.lax.while_loop(cond, body, init)
    return (T, alive, M, Q, cycles) if return_basis else (T, alive, M, cycles)


# ---------------------------------------------------------------------------
# the same recurrence driven from Python, its basis in host memory
# ---------------------------------------------------------------------------
_gram_schmidt_c = jax.jit(_gram_schmidt, static_argnames=("euclid",))
_restart_covectors_c = jax.jit(_restart_covectors)
_finish_restarts_c = jax.jit(_finish_restarts, static_argnames=("euclid",))
_absorb_c = jax.jit(_absorb, static_argnames=("p",), donate_argnums=(3,))
_rescale_c = jax.jit(_rescale)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def _write_block(Q, W, alive, Qn, Wn, al, row0):
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, row0, 0)
    return put(Q, Qn), (None if W is None else put(W, Wn)), put(alive, al)


@functools.partial(jax.jit, static_argnames=("rows",))
def _grown(Q, W, T, alive, *, rows: int):
    """The host buffers with zero rows (and columns of ``T``) added up to ``rows``."""
    more = rows - Q.shape[0]
    pad = lambda x: jnp.pad(x, [(0, more)] + [(0, 0)] * (x.ndim - 1))
    return pad(Q), (None if W is None else pad(W)), jnp.pad(T, [(0, more), (0, more)]), pad(alive)


@functools.partial(jax.jit, static_argnames=("n",))
def _projected(T, alive, Vres, Hres, *, n: int):
    """``(T, alive, M)`` of the first ``n`` rows, symmetrized (as :func:`block_lanczos` returns them)."""
    M = Vres @ Hres.T
    return 0.5 * (T[:n, :n] + T[:n, :n].T), alive[:n], 0.5 * (M + M.T)


def _host_device() -> Any:
    """The CPU device (host memory); the default device where the CPU backend is off (``JAX_PLATFORMS=cuda``)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


class ResumableBlockLanczos:
    """:func:`block_lanczos`'s step functions driven from Python, the basis in host memory, extendable:
    ``projected(m)`` runs only the block steps not run yet (growing ``m`` until certified costs the
    final ``m p`` products).

    ``apply_h_block`` and ``apply_ginv_block`` map a ``(p, d)`` block to a ``(p, d)`` block (one
    batched product, e.g. one pass over a dataset, run eagerly); ``apply_ginv_block=None`` is ``G = I``
    (the basis stored once).  The same steps, hence the same numbers and the same random restart
    vectors as :func:`block_lanczos` for the same ``key``.  The basis lives on the CPU (host memory,
    buffers doubled as it grows); the blocks go to the default device for the products.
    """

    def __init__(
        self,
        apply_h_block: Callable[[jax.Array], jax.Array],
        apply_ginv_block: Callable[[jax.Array], jax.Array] | None,
        Z: jax.Array,
        *,
        key: jax.Array,
        breakdown_tol: float | None = None,
    ) -> None:
        self.p, self.d = Z.shape
        self.dtype = np.dtype(Z.dtype)
        self.tol = _breakdown_tol(self.d, self.dtype, breakdown_tol)
        self.key = jax.device_put(key, _host_device())
        self.hb, self.gb = apply_h_block, apply_ginv_block
        self.euclid = apply_ginv_block is None
        self.products = 0  # products with H (vectors)
        self.blocks = 0  # block steps run
        self._cap = 0  # the buffers grow to m blocks at the first projected(m)
        empty = self._host(np.zeros((0, self.d), self.dtype))
        self._Q, self._W = empty, (None if self.euclid else empty)
        self._T, self._alive = self._host(np.zeros((0, 0), self.dtype)), self._host(np.zeros(0, bool))
        self.scale = jax.device_put(jnp.zeros((), self.dtype), _host_device())
        Zh = self._host(Z)
        V0 = self._ginv(Zh)
        self._start_scale = _start_scale(V0, Zh)
        self._pending = (V0, Zh)  # the block to orthonormalize next: the start block, then each residual

    @staticmethod
    def _host(x: Any) -> jax.Array:
        return jax.device_put(jnp.asarray(x), _host_device())

    @staticmethod
    def _out(x: jax.Array) -> jax.Array:
        return jax.device_put(x, jax.devices()[0])

    def _ginv(self, X: jax.Array) -> jax.Array:
        return X if self.gb is None else self._host(jnp.asarray(self.gb(self._out(X)), self.dtype))

    def _grow(self, rows: int) -> None:
        """Room for ``rows`` basis rows (zero rows are never read)."""
        if rows > self._cap:
            self._Q, self._W, self._T, self._alive = _grown(self._Q, self._W, self._T, self._alive, rows=rows)
            self._cap = rows

    def projected(
        self, m: int, *, steps: Callable[[range], Iterable[int]] = lambda r: r
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run up to block step ``m``; return ``(T, alive, M)`` as :func:`block_lanczos` does."""
        p = self.p
        self._grow(p << (m - 1).bit_length())  # room for a power of two of blocks: each size compiles the steps once
        for j in steps(range(self.blocks, m)):
            W = self._Q if self.euclid else self._W
            V, Hc = self._pending
            Qn, Wn, broke = _gram_schmidt_c(V, Hc, self.tol, self._start_scale if j == 0 else self.scale, euclid=self.euclid)
            al = jnp.ones(p, bool)
            if bool(jnp.any(broke)):  # breakdown: restart the broken columns (one batched G^{-1})
                R, ok = _restart_covectors_c(self._Q, W, Qn, Wn, broke, self.key, j * p, self.tol)
                Qn, Wn, al = _finish_restarts_c(Qn, Wn, R, self._ginv(R), broke, ok, self.tol, euclid=self.euclid)
            self._Q, self._W, self._alive = _write_block(self._Q, self._W, self._alive, Qn, None if self.euclid else Wn,
                                                         self._host(al), j * p)
            Hraw = self._host(jnp.asarray(self.hb(self._out(Qn)), self.dtype))  # Qn is block j: H Q_j
            self.products += p
            self._T, Hres, A = _absorb_c(Hraw, self._Q, self._Q if self.euclid else self._W, self._T, j, 0, self.tol, p=p)
            Vres = self._ginv(Hres)
            self.scale = _rescale_c(self.scale, A, Vres, Hres)
            self._pending = (Vres, Hres)
            self.blocks = j + 1
        if m > self.blocks:  # pragma: no cover - the loop above ran them
            raise AssertionError
        return tuple(map(self._out, _projected(self._T, self._alive, *self._res_at(m), n=m * p)))

    def basis(self, m: int) -> jax.Array:
        """The ``G``-orthonormal basis rows ``Q`` of the first ``m`` block steps (``(m p, d)``), for Ritz vectors."""
        return self._out(self._Q[: m * self.p])

    def _res_at(self, m: int) -> tuple[jax.Array, jax.Array]:
        if m != self.blocks:
            raise GeometryError(f"Lanczos: the residual of block {m} is gone; {self.blocks} blocks were run.")
        return self._pending


# ---------------------------------------------------------------------------
# Rayleigh-Ritz and the certificate (shared by the function and the operator)
# ---------------------------------------------------------------------------
def ritz_certificate(
    T: jax.Array, alive: jax.Array, M: jax.Array, k: int, return_vectors: bool = False
) -> tuple[jax.Array, ...]:
    r"""The top ``k`` Ritz values of ``T`` and the Kahan bounds of their leading sets.

    ``bounds[i] = ||E Y_i - Y_i Theta_i||_2`` (``G``-norm) for the ``G``-orthonormal Ritz vectors
    ``Y_i`` of the ``i + 1`` largest Ritz values.  By Kahan's theorem the ``i + 1`` values match
    ``i + 1`` eigenvalues of ``E`` **counted with multiplicity** within ``bounds[i]``.  Dead rows of
    ``T`` are pushed below the spectrum.  Returns ``(theta, bounds, valid)``, ``valid`` False where a
    value comes from a dead row (fewer live directions than ``k``).  ``return_vectors``: also the
    ``(m p, k)`` eigenvectors ``S`` of ``T`` (the Ritz vectors are ``Q^T S``).
    """
    N = T.shape[0]
    p = M.shape[0]
    big = 2.0 * (N * jnp.max(jnp.abs(T)) + 1.0)
    both = alive[:, None] & alive[None, :]
    Tm = jnp.where(both, T, 0.0) + jnp.diag(jnp.where(alive, 0.0, -big))
    theta, S = jnp.linalg.eigh(Tm)
    theta, S = theta[::-1][:k], S[:, ::-1][:, :k]
    Sl = S[N - p :]
    B = Sl.T @ M @ Sl  # the G-Gram matrix of the residuals E y_i - theta_i y_i
    bounds = jnp.stack([jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(B[: i + 1, : i + 1])[-1], 0.0)) for i in range(k)])
    if return_vectors:
        return theta, bounds, theta > -big / 2, S
    return theta, bounds, theta > -big / 2


def _accepted(theta: jax.Array, bounds: jax.Array, valid: jax.Array, T: jax.Array, rtol: float) -> tuple[jax.Array, jax.Array]:
    """Whether each leading set is certified: ``bounds[i] <= rtol * max_{j <= i} |theta_j|`` (or round-off)."""
    eps = jnp.finfo(T.dtype).eps
    floor = 10.0 * np.sqrt(T.shape[0]) * eps * jnp.max(jnp.abs(jnp.where(jnp.isfinite(T), T, 0.0)))
    scale = jax.lax.cummax(jnp.abs(theta))
    allowed = jnp.maximum(rtol * scale, floor)
    ok = jax.lax.cummin(((bounds <= allowed) & valid).astype(jnp.int32)) > 0  # a leading set: once one fails, the rest fail
    return ok, allowed


@functools.partial(jax.jit, static_argnames=("k",))
def _certify(
    T: jax.Array, alive: jax.Array, M: jax.Array, Q: jax.Array | None, rtol: Any, certify: Any, *, k: int
) -> tuple[Any, ...]:
    """Rayleigh-Ritz, the certificate and the status in one compiled program (eagerly, op by op, they
    compiled some 50 small programs for every new size of ``T``).  Returns ``(values, Y, status, theta,
    bounds, ok, allowed)``: ``values`` are the certified Ritz values (NaN where not certified; with
    ``certify`` False only dead rows are NaN), ``Y`` the Ritz vectors ``S^T Q`` (``None`` without
    ``Q``; NaN rows where ``values`` is NaN)."""
    theta, bounds, valid, *S = ritz_certificate(T, alive, M, k, return_vectors=Q is not None)
    ok, allowed = _accepted(theta, bounds, valid, T, rtol)  # certify is traced: one program for both
    ok, allowed = jnp.where(certify, ok, valid), jnp.where(certify, allowed, jnp.inf)
    values = jnp.where(ok, theta, jnp.nan)
    Y = None if Q is None else jnp.where(jnp.isnan(values)[:, None], jnp.nan, S[0].T @ Q)  # G-orthonormal rows
    status = jnp.where(
        ~jnp.all(jnp.isfinite(T)), Status.NON_FINITE, jnp.where(jnp.all(jnp.isfinite(values)), Status.OK, Status.UNCERTIFIED)
    ).astype(jnp.int32)
    return values, Y, status, theta, bounds, ok, allowed


#: What the last eager call of :func:`certified_top_eigenvalues` ran (for benchmarks): block steps, products.
last_run: dict = {}


def certified_top_eigenvalues(
    projected: Callable[[int], tuple[jax.Array, jax.Array, jax.Array]],
    d: int,
    k: Any,
    p: int,
    num_iterations: Any,
    rtol: Any,
    eager: bool,
    what: str,
    count_products: Callable[[], int] | None = None,
    with_status: bool = False,
    vectors: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
    """The top-``k`` Ritz values of ``projected(m) -> (T, alive, M)`` (``m`` block steps of ``p``), certified.

    ``num_iterations`` counts products with ``E`` (the Krylov dimension, rounded up to whole blocks);
    ``None`` starts at :func:`default_num_products` and, when ``eager``, grows by 1.5x until the
    top ``k`` are certified or the basis spans all ``d`` dimensions.  Uncertified values raise when
    ``eager`` and are NaN otherwise (``rtol=None``: no certification).  ``with_status``: also return
    the :class:`~minigeo.Status` (``NON_FINITE`` for a non-finite projected matrix, ``UNCERTIFIED``
    when a value is NaN for want of a certificate, else ``OK``).  ``vectors``: ``projected(m)``
    returns ``(T, alive, M, Q)`` with the basis ``Q`` (``(m p, d)``), and the result gains the
    ``(k, d)`` Ritz vectors ``Y = S^T Q`` after the values (``G``-orthonormal; a row is NaN where its
    value is: only certified pairs are returned).
    """

    if rtol is not None and not (isinstance(rtol, (int, float, np.floating)) and rtol > 0):
        raise GeometryError(f"top_eigenvalues: rtol must be positive or None, got {rtol!r}.")
    n = min(num_iterations, d) if num_iterations is not None else min(d, default_num_products(k, p))
    m = max(1, -(-n // p))
    while True:
        run = projected(m)
        T, alive, M = run[:3]
        check_finite(T, "The Lanczos projected matrix", hint=f"The {what} products are not finite.")
        certified, Y, status, theta, bounds, ok, allowed = _certify(
            T, alive, M, run[3] if vectors else None, 1.0 if rtol is None else rtol, rtol is not None, k=k
        )
        if eager:
            last_run.update(blocks=m, block_size=p, products=count_products() if count_products is not None else m * p)
        head = (certified,) if Y is None else (certified, Y)
        result = (*head, status) if with_status else (head[0] if Y is None else head)
        if rtol is None or not eager or bool(jnp.all(ok)):
            return result
        if num_iterations is None and m * p < d:
            m = max(m + 1, -(-3 * m // 2))
            continue
        worst = int(jnp.argmin(ok))
        used = count_products() if count_products is not None else m * p
        raise GeometryError(
            f"top_eigenvalues: after {m} block Lanczos steps ({used} products, block size {p}) the top "
            f"{worst + 1} eigenvalues of the {what} are not certified: the residual bound of the leading "
            f"{worst + 1} Ritz values, {float(bounds[worst]):.3g}, exceeds rtol={rtol:g} x their scale "
            f"(allowed {float(allowed[worst]):.3g}); Ritz values {np.asarray(theta).round(6).tolist()}. Pass "
            "num_iterations=None (adaptive), a larger num_iterations, or a larger rtol. [UNCERTIFIED]"
        )


def validate_k(k: Any, num_iterations: Any, d: int, block_size: Any) -> int:
    """Check ``k``, ``num_iterations`` and ``block_size``; return the block size ``p`` (at most ``d``)."""
    if num_iterations is not None and not (
        isinstance(num_iterations, (int, np.integer)) and not isinstance(num_iterations, bool) and num_iterations >= 1
    ):
        raise GeometryError(f"top_eigenvalues: num_iterations must be a positive int or None, got {num_iterations!r}.")
    limit = min(int(num_iterations), d) if num_iterations is not None else d
    if not (isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 1 <= k <= limit):
        raise GeometryError(
            f"top_eigenvalues: k must be an int between 1 and num_iterations={limit} (at most the {d} parameters); "
            f"got {k!r}."
        )
    if block_size is None:
        p = default_block_size(int(k))
    elif isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool) and block_size >= 1:
        p = int(block_size)
    else:
        raise GeometryError(f"top_eigenvalues: block_size must be a positive int or None, got {block_size!r}.")
    return min(p, d, limit)

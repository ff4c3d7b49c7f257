r"""Block Lanczos in the ``G``-inner product, Rayleigh-Ritz and a certificate that counts multiplicity (floor 1).

Shared by :func:`minigeo.top_eigenvalues` and :meth:`minigeo.operators.CurvatureOperator.top_eigenvalues`
(issue 31: single-vector Lanczos keeps only one copy of a repeated eigenvalue, and a per-value
residual bound cannot see the missing copies).

* :func:`block_lanczos`: ``m`` block steps with a block of ``p`` vectors, on the device (one
  compiled ``fori_loop``; each block step is one batched, ``vmap``-ed product with ``H`` and one
  with ``G^{-1}``).
* :class:`ResumableBlockLanczos`: the same recurrence with the basis in host memory (NumPy),
  extendable block by block (the adaptive eager path and the dataset operators).
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
replaced by a random vector ``G``-orthogonal to the basis (or, once the basis spans the whole
space, by a zero row marked dead).  After the last block, ``E Y - Y Theta`` for the Ritz vectors
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
    ``jit``-compatible: ``m`` and the shapes are static.

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
    g1 = (lambda x: x) if euclid else apply_ginv

    def orthonormalize(V, Hc, Q, W, row0, scale):
        """G-orthonormalize the rows of (V, Hc = G V), already G-orthogonal to the basis (Q, W)."""

        def column(i, carry):
            Qn, Wn, alive = carry
            v, h = V[i], Hc[i]
            for _ in range(2):  # against the new rows so far (zero rows beyond i), twice
                c = Qn @ h
                v = v - Qn.T @ c
                h = v if euclid else h - Wn.T @ c  # G = I: V is Hc and Wn is Qn, computed once
            nrm = jnp.sqrt(jnp.maximum(jnp.vdot(v, h), 0.0))
            broke = nrm <= tol * scale  # NaN is not a breakdown: it propagates into T

            def restart(_):
                r = jax.random.normal(jax.random.fold_in(key, row0 + i), (d,), dtype=dtype)
                r0 = jnp.linalg.norm(r)
                for _ in range(2):
                    r = r - W.T @ (Q @ r)
                    r = r - Wn.T @ (Qn @ r)
                rv = g1(r)
                nr = jnp.sqrt(jnp.maximum(jnp.vdot(rv, r), 0.0))
                ok = jnp.linalg.norm(r) > tol * r0  # else the basis already spans everything
                safe = jnp.where(nr > 0, nr, 1.0)
                return jnp.where(ok, rv / safe, 0.0), jnp.where(ok, r / safe, 0.0), ok

            def normalize(_):
                safe = jnp.where(nrm > 0, nrm, 1.0)
                return v / safe, h / safe, jnp.asarray(True)

            q, w, ok = jax.lax.cond(broke, restart, normalize, None)
            if euclid:
                Qn = Qn.at[i].set(q)
                return Qn, Qn, alive.at[i].set(ok)
            return Qn.at[i].set(q), Wn.at[i].set(w), alive.at[i].set(ok)

        zeros = jnp.zeros((p, d), dtype)
        return jax.lax.fori_loop(0, p, column, (zeros, zeros, jnp.zeros(p, bool)))

    # The basis is preallocated (static shapes), but a pass over it reads only the blocks filled so far
    # (a loop over blocks with a traced trip count), and once: with the whole (m p, d) basis in one
    # matrix product, zero rows included, four passes per block step made the basis reads, not the
    # products with H, the cost of a run (issue 30).
    def project_out(X, Q, W, lo, hi):
        """Classical Gram-Schmidt of the rows of X against the blocks lo..hi-1: (X - C W, C), with the
        coefficients C = X Q^T ((rows, m p), zero outside those blocks), reading each block once."""

        def block(b, carry):
            acc, C = carry
            Qb = jax.lax.dynamic_slice_in_dim(Q, b * p, p)
            Wb = Qb if euclid else jax.lax.dynamic_slice_in_dim(W, b * p, p)
            Cb = X @ Qb.T
            return acc + Cb @ Wb, jax.lax.dynamic_update_slice_in_dim(C, Cb, b * p, 1)

        acc, C = jax.lax.fori_loop(lo, hi, block, (jnp.zeros_like(X), jnp.zeros((X.shape[0], N), dtype)))
        return X - acc, C

    Q = jnp.zeros((N, d), dtype)
    W = None if euclid else jnp.zeros((N, d), dtype)
    V0 = gb(Z) if resume is None else None
    start_scale = None if resume is not None else jnp.sqrt(jnp.max(jnp.maximum(jnp.sum(V0 * Z, axis=1), 0.0)))
    alive = jnp.zeros(N, bool)
    T = jnp.zeros((N, N), dtype)

    def step(j, Q, W, T, scale):
        s = j * p
        Qj = jax.lax.dynamic_slice_in_dim(Q, s, p)
        Hraw = hb(Qj)  # = G E Q_j
        # "twice is enough", with a cheap first pass: in exact arithmetic H Q_j lies in the span of the
        # blocks j - 1, j and the residual, so the first pass (against those two blocks) removes all but
        # round-off, and one pass against every filled block removes that.  T's rows are the sum of the
        # two passes' coefficients: H Q_j Q^T up to round-off (later blocks' entries are filled at
        # their own step, by symmetry).
        # the first step after a thick restart couples to every kept Ritz vector: a full first pass
        Hres, C = project_out(Hraw, Q, W, jnp.where(j == first, 0, jnp.maximum(j - 1, 0)), j + 1)
        Hres, C2 = project_out(Hres, Q, W, 0, j + 1)
        C = C + C2
        T = jax.lax.dynamic_update_slice(T, C, (s, 0))
        T = jax.lax.dynamic_update_slice(T, C.T, (0, s))
        # a residual at round-off (an invariant subspace) is set to 0 before G^{-1}: a CG solve on
        # rounding noise may fail, and the column is a breakdown either way
        rn = jnp.linalg.norm(Hres, axis=1)
        Hres = jnp.where((rn > tol * jnp.max(jnp.linalg.norm(Hraw, axis=1)))[:, None] | jnp.isnan(rn)[:, None], Hres, 0.0)
        Vres = gb(Hres)
        res2 = jnp.sum(Vres * Hres, axis=1)
        A = jax.lax.dynamic_slice_in_dim(C, s, p, axis=1)
        scale = jnp.maximum(scale, jnp.maximum(jnp.max(jnp.abs(A)), jnp.sqrt(jnp.max(jnp.maximum(res2, 0.0)))))
        return T, Hres, Vres, scale

    # One loop body: G-orthonormalize the pending block (the start block at j = 0, else the last
    # residual) into block j, then run block step j.  So orthonormalization and the products with H
    # and G^{-1} are traced and compiled once each (a start block orthonormalized before the loop and
    # a last step after it compiled them twice), and the residual left pending after the last step is
    # the one the certificate needs.
    def body(j, carry):
        Q, W, T, alive, scale, Vp, Hp = carry
        # the start block's breakdown test is relative to its own size; later ones to H's scale so far
        Qn, Wn, al = orthonormalize(Vp, Hp, Q, Q if euclid else W, j * p, jnp.where(j == 0, start_scale, scale))
        Q = jax.lax.dynamic_update_slice_in_dim(Q, Qn, j * p, 0)
        W = None if euclid else jax.lax.dynamic_update_slice_in_dim(W, Wn, j * p, 0)
        alive = jax.lax.dynamic_update_slice_in_dim(alive, al, j * p, 0)
        T, Hres, Vres, scale = step(j, Q, W, T, scale)
        return Q, W, T, alive, scale, Vres, Hres

    scale0 = jnp.zeros((), dtype)
    first = 0
    if resume is not None:
        Q, W, T, alive, scale0, V0, Z, first, start_scale = resume
        W = None if euclid else W
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
    start_scale = jnp.sqrt(jnp.max(jnp.maximum(jnp.sum(V0 * Z, axis=1), 0.0)))
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
# host recurrence
# ---------------------------------------------------------------------------
class ResumableBlockLanczos:
    """:func:`block_lanczos` with the basis in host memory, extendable: ``projected(m)`` runs only the
    block steps not run yet (growing ``m`` until certified costs the final ``m p`` products).

    ``apply_h_block`` and ``apply_ginv_block`` map a ``(p, d)`` block to a ``(p, d)`` block (one
    batched product, e.g. one pass over a dataset); ``apply_ginv_block=None`` is ``G = I`` (the basis
    stored once).  The same random restart vectors as :func:`block_lanczos` for the same ``key``.
    ``steps`` wraps the range of block steps (e.g. in a progress bar).
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
        self.key = key
        self.hb, self.gb = apply_h_block, apply_ginv_block
        self.products = 0  # products with H (vectors)
        self._Q = np.zeros((0, self.d), self.dtype)
        self._W = self._Q
        self.n = 0  # rows of the basis filled
        self.alive: list[bool] = []
        self._T = np.zeros((0, 0), self.dtype)
        self.blocks = 0  # block steps run
        self.scale = 0.0
        Zh = np.asarray(Z, self.dtype)
        V0 = self._ginv(Zh)
        start_scale = float(np.sqrt(max(float(np.max(np.sum(V0 * Zh, axis=1))), 0.0)))
        self._append(*self._orthonormalize(V0, Zh, start_scale))
        self._res: tuple[np.ndarray, np.ndarray] | None = None

    def _ginv(self, X: np.ndarray) -> np.ndarray:
        return X if self.gb is None else np.asarray(self.gb(jnp.asarray(X)), self.dtype)

    def _append(self, Qn: np.ndarray, Wn: np.ndarray, alive: list[bool]) -> None:
        need = self.n + Qn.shape[0]
        if need > self._Q.shape[0]:  # grow the host buffers by doubling
            cap = max(need, 2 * self._Q.shape[0], 8 * self.p)
            grow = lambda buf: np.concatenate([buf[: self.n], np.zeros((cap - self.n, self.d), self.dtype)])
            self._Q = grow(self._Q)
            self._W = self._Q if self.gb is None else grow(self._W)
        self._Q[self.n : need] = Qn
        if self.gb is not None:
            self._W[self.n : need] = Wn
        self.n = need
        self.alive.extend(alive)

    def _orthonormalize(self, V: np.ndarray, Hc: np.ndarray, scale: float):
        Q, W = self._Q[: self.n], self._W[: self.n]
        p, d = V.shape
        Qn, Wn, alive = np.zeros((p, d), self.dtype), np.zeros((p, d), self.dtype), []
        for i in range(p):
            v, h = V[i].copy(), Hc[i].copy()
            for _ in range(2):
                c = Qn[:i] @ h
                h = h - Wn[:i].T @ c
                v = v - Qn[:i].T @ c
            nrm = float(np.sqrt(max(float(v @ h), 0.0))) if np.isfinite(v @ h) else float("nan")
            if nrm <= self.tol * scale:  # breakdown: restart from a random vector (NaN propagates)
                r = np.asarray(jax.random.normal(jax.random.fold_in(self.key, self.n + i), (d,), dtype=self.dtype))
                r0 = float(np.linalg.norm(r))
                for _ in range(2):
                    r = r - W.T @ (Q @ r)
                    r = r - Wn[:i].T @ (Qn[:i] @ r)
                ok = float(np.linalg.norm(r)) > self.tol * r0
                if ok:
                    rv = self._ginv(r[None])[0]
                    nr = float(np.sqrt(max(float(rv @ r), 0.0)))
                    nr = nr if nr > 0 else 1.0
                    Qn[i], Wn[i] = rv / nr, r / nr
                alive.append(ok)
            else:
                safe = nrm if nrm > 0 else 1.0
                Qn[i], Wn[i] = v / safe, h / safe
                alive.append(True)
        return Qn, Wn, alive

    def projected(
        self, m: int, *, steps: Callable[[range], Iterable[int]] = lambda r: r
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run up to block step ``m``; return ``(T, alive, M)`` as :func:`block_lanczos` does."""
        p = self.p
        for j in steps(range(self.blocks, m)):
            if self._res is not None:  # the residual of the previous block becomes the next block
                Vres, Hres = self._res
                self._append(*self._orthonormalize(Vres, Hres, self.scale))
            s = j * p
            Q, W = self._Q[: self.n], self._W[: self.n]
            Hraw = np.asarray(self.hb(jnp.asarray(Q[s : s + p])), self.dtype)
            self.products += p
            lo = max(s - p, 0)  # as block_lanczos: a pass against blocks j - 1 and j, then one against all
            C = np.zeros((p, self.n), self.dtype)
            C[:, lo : s + p] = Hraw @ Q[lo : s + p].T
            Hres = Hraw - C[:, lo : s + p] @ W[lo : s + p]
            C2 = Hres @ Q.T  # (p, n)
            Hres = Hres - C2 @ W
            C += C2
            T = np.zeros((self.n, self.n), self.dtype)
            T[: self._T.shape[0], : self._T.shape[1]] = self._T
            T[s : s + p, :] = C
            T[:, s : s + p] = C.T
            self._T = T
            rn = np.linalg.norm(Hres, axis=1)
            with np.errstate(invalid="ignore"):
                Hres[rn <= self.tol * np.max(np.linalg.norm(Hraw, axis=1))] = 0.0  # round-off: see block_lanczos
            Vres = self._ginv(Hres)
            res2 = np.sum(Vres * Hres, axis=1)
            with np.errstate(invalid="ignore"):
                sizes = np.array([self.scale, np.max(np.abs(C[:, s : s + p])), np.sqrt(max(float(np.max(res2)), 0.0))])
            self.scale = float(np.max(sizes[np.isfinite(sizes)], initial=0.0))
            if not (np.all(np.isfinite(C)) and np.all(np.isfinite(res2))):
                self.scale = float("nan")
            self._res = (Vres, Hres)
            self.blocks = j + 1
        if m > self.blocks:  # pragma: no cover - the loop above ran them
            raise AssertionError
        n = m * p
        Vres, Hres = self._res_at(m)
        M = Vres @ Hres.T
        T = self._T[:n, :n]
        return jnp.asarray(0.5 * (T + T.T)), jnp.asarray(np.asarray(self.alive[:n], bool)), jnp.asarray(0.5 * (M + M.T))

    def basis(self, m: int) -> jax.Array:
        """The ``G``-orthonormal basis rows ``Q`` of the first ``m`` block steps (``(m p, d)``), for Ritz vectors."""
        return jnp.asarray(self._Q[: m * self.p])

    def _res_at(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        if m != self.blocks:
            raise GeometryError(f"Lanczos: the residual of block {m} is gone; {self.blocks} blocks were run.")
        assert self._res is not None
        return self._res


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

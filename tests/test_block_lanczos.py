"""The block Lanczos recurrence itself (``minigeo._eigen``), against dense linear algebra.

``block_lanczos`` (device) and ``ResumableBlockLanczos`` (host) must return a ``G``-orthonormal
basis ``Q`` and the exact Rayleigh quotient ``T = Q H Q^T`` up to round-off, with a repeated
eigenvalue, a large condition number and a non-identity metric, in float32 and float64.  Issue 30
changed how the basis is reorthogonalized (each pass reads only the filled blocks; the first pass is
against the last two blocks): these tests hold what must not change.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minigeo._eigen import ResumableBlockLanczos, block_lanczos


def _problem(seed: int, d: int = 48):
    """A symmetric H with a fourfold top eigenvalue, condition ~1e4, and an SPD metric G (cond ~1e2)."""
    r = np.random.default_rng(seed)
    U = np.linalg.qr(r.standard_normal((d, d)))[0]
    lam = np.concatenate([[10.0] * 4, np.geomspace(5.0, 1e-3, d - 4)]) * r.choice([-1.0, 1.0], d)
    lam[:4] = 10.0
    H = (U * lam) @ U.T
    V = np.linalg.qr(r.standard_normal((d, d)))[0]
    G = (V * np.geomspace(1.0, 100.0, d)) @ V.T
    return H, G


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("metric", [False, True])
def test_basis_is_orthonormal_and_T_is_the_rayleigh_quotient(dtype, metric):
    H, G = _problem(0)
    d, p, m = H.shape[0], 3, 7
    Hj, Gj = jnp.asarray(H, dtype), jnp.asarray(G, dtype)
    Ginv = jnp.asarray(np.linalg.inv(G), dtype)
    apply_ginv = (lambda v: Ginv @ v) if metric else None
    Gm = G if metric else np.eye(d)
    Z = jax.random.normal(jax.random.PRNGKey(1), (p, d), dtype)
    run = jax.jit(lambda Z: block_lanczos(lambda v: Hj @ v, apply_ginv, Z, m, key=jax.random.PRNGKey(2), return_basis=True))
    T, alive, M, Q = (np.asarray(x, np.float64) if x.dtype != bool else np.asarray(x) for x in run(Z))
    eps = float(jnp.finfo(dtype).eps)
    cond_g = np.linalg.cond(Gm)
    assert alive.all()
    np.testing.assert_allclose(Q @ Gm @ Q.T, np.eye(m * p), atol=50 * eps * cond_g)
    # the Rayleigh quotient of the computed basis, formed in float64
    np.testing.assert_allclose(T, Q @ H @ Q.T, atol=50 * eps * cond_g * np.abs(H).max() * np.sqrt(d))
    # block tridiagonal up to round-off: blocks two or more apart are zero in exact arithmetic
    far = np.abs(np.subtract.outer(np.arange(m * p) // p, np.arange(m * p) // p)) >= 2
    assert np.abs(T[far]).max() <= 50 * eps * cond_g * np.abs(H).max() * np.sqrt(d)
    # the residual Gram matrix M is that of E Q_last - (projections), computed densely
    E = np.linalg.solve(Gm, H)
    R = Q[-p:] @ E.T - T[-p:] @ Q  # rows: E q_i minus its components in the basis
    np.testing.assert_allclose(M, R @ Gm @ R.T, atol=100 * eps * cond_g * np.abs(H).max() ** 2 * d)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_host_recurrence_matches_device(dtype):
    H, G = _problem(3)
    d, p, m = H.shape[0], 4, 6
    Hj = jnp.asarray(H, dtype)
    Z = jax.random.normal(jax.random.PRNGKey(4), (p, d), dtype)
    key = jax.random.PRNGKey(5)
    T_dev, alive_dev, M_dev = block_lanczos(lambda v: Hj @ v, None, Z, m, key=key)
    host = ResumableBlockLanczos(lambda X: X @ Hj.T, None, Z, key=key)
    T_host, alive_host, M_host = host.projected(m)
    eps = float(jnp.finfo(dtype).eps)
    tol = 1e3 * eps * np.abs(H).max()
    np.testing.assert_allclose(np.asarray(T_host, np.float64), np.asarray(T_dev, np.float64), atol=tol)
    np.testing.assert_array_equal(np.asarray(alive_host), np.asarray(alive_dev))
    np.testing.assert_allclose(np.asarray(M_host, np.float64), np.asarray(M_dev, np.float64), atol=tol * np.abs(H).max())
    assert host.products == m * p


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("metric", [False, True])
def test_host_and_device_drivers_run_one_recurrence_through_breakdowns(dtype, metric):
    """One recurrence, two drivers (issue 53): the host driver (products from Python, the basis in host
    memory, grown in steps) and the compiled loop give the same T, live rows and residual Gram matrix,
    also when the Krylov space closes and with a metric G.  H and G are block diagonal (3 + 7) and the
    start block lives in the first 3 coordinates: the Krylov space closes after one block, all three
    columns are restarted with random vectors (which then decide T: the same vectors in both drivers),
    and the rows past d = 10 are dead.  Both give a G-orthonormal basis whose Rayleigh quotient is T."""
    r = np.random.default_rng(11)
    d, p, m = 10, 3, 5  # 15 rows > d: the last rows must die

    def blocks(make):
        out = np.zeros((d, d))
        out[:3, :3], out[3:, 3:] = make(3), make(7)
        return out

    def spd(n, cond):
        U = np.linalg.qr(r.standard_normal((n, n)))[0]
        return (U * np.geomspace(1.0, cond, n)) @ U.T

    H = blocks(lambda n: (lambda A: A + A.T)(r.standard_normal((n, n))))
    G = blocks(lambda n: spd(n, 10.0)) if metric else np.eye(d)
    Hj, Ginv = jnp.asarray(H, dtype), jnp.asarray(np.linalg.inv(G), dtype)
    Z = jnp.zeros((p, d), dtype).at[:, :3].set(jax.random.normal(jax.random.PRNGKey(12), (p, 3), dtype))
    key = jax.random.PRNGKey(13)
    apply_ginv = (lambda v: Ginv @ v) if metric else None
    T_dev, alive_dev, M_dev, Q_dev = block_lanczos(lambda v: Hj @ v, apply_ginv, Z, m, key=key, return_basis=True)
    host = ResumableBlockLanczos(lambda X: X @ Hj.T, (lambda X: X @ Ginv.T) if metric else None, Z, key=key)
    host.projected(2)  # grown in two calls, as the adaptive path does
    T_host, alive_host, M_host = host.projected(m)
    Q_host = host.basis(m)
    eps = float(jnp.finfo(dtype).eps)
    scale = np.abs(H).max() * np.linalg.cond(G)
    np.testing.assert_array_equal(np.asarray(alive_host), np.asarray(alive_dev))
    assert np.asarray(alive_dev).sum() == d
    np.testing.assert_allclose(np.asarray(T_host, np.float64), np.asarray(T_dev, np.float64), atol=1e3 * eps * scale)
    np.testing.assert_allclose(np.asarray(M_host, np.float64), np.asarray(M_dev, np.float64), atol=1e3 * eps * scale**2)
    for T, alive, Q in ((T_dev, alive_dev, Q_dev), (T_host, alive_host, Q_host)):
        live = np.asarray(alive)
        Ql, Tl = np.asarray(Q, np.float64)[live], np.asarray(T, np.float64)[np.ix_(live, live)]
        np.testing.assert_allclose(Ql @ G @ Ql.T, np.eye(d), atol=1e3 * eps * np.linalg.cond(G))
        np.testing.assert_allclose(Tl, Ql @ H @ Ql.T, atol=1e3 * eps * scale)
        assert not np.asarray(Q, np.float64)[~live].any()  # dead rows are zero
    assert host.products == m * p


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_invariant_subspace_restarts_and_spans_everything(dtype):
    """A rank-5 H: the Krylov space closes after two blocks of 3; the restarts keep the basis
    orthonormal, T stays the Rayleigh quotient, and once the basis spans all d = 12 directions the
    remaining rows are dead."""
    r = np.random.default_rng(7)
    d, p, m = 12, 3, 5
    B = r.standard_normal((d, 5))
    H = B @ B.T
    Hj = jnp.asarray(H, dtype)
    Z = jax.random.normal(jax.random.PRNGKey(8), (p, d), dtype)
    T, alive, M, Q = block_lanczos(lambda v: Hj @ v, None, Z, m, key=jax.random.PRNGKey(9), return_basis=True)
    T, Q, alive = np.asarray(T, np.float64), np.asarray(Q, np.float64), np.asarray(alive)
    eps = float(jnp.finfo(dtype).eps)
    assert alive.sum() == d and not alive[d:].any()
    Ql = Q[alive]
    np.testing.assert_allclose(Ql @ Ql.T, np.eye(d), atol=100 * eps)
    np.testing.assert_allclose(T[np.ix_(alive, alive)], Ql @ H @ Ql.T, atol=100 * eps * np.abs(H).max() * d)
    np.testing.assert_allclose(np.sort(np.linalg.eigvalsh(T[np.ix_(alive, alive)])), np.linalg.eigvalsh(H),
                               atol=100 * eps * np.abs(H).max() * d)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("metric", [False, True])
def test_products_are_traced_once(metric, dtype):
    """All ``m`` block steps run inside one loop: ``apply_h`` is traced once (a last step after the loop
    traced, and compiled, it twice), and the basis stays ``m p`` rows."""
    H, G = _problem(5, d=24)
    Hj, Ginv = jnp.asarray(H, dtype), jnp.asarray(np.linalg.inv(G), dtype)
    traces = {"h": 0, "g": 0}

    def apply_h(v):
        traces["h"] += 1
        return Hj @ v

    def apply_ginv(v):
        traces["g"] += 1
        return Ginv @ v

    p, m = 2, 5
    Z = jax.random.normal(jax.random.PRNGKey(1), (p, 24), dtype)
    T, alive, M, Q = jax.jit(
        lambda Z: block_lanczos(apply_h, apply_ginv if metric else None, Z, m, key=jax.random.PRNGKey(2), return_basis=True)
    )(Z)
    assert traces["h"] == 1
    # G^{-1}: the start block, then in the loop the residual block and a restart vector (the start
    # block orthonormalized before the loop and a last step after it added two more)
    assert traces["g"] == (3 if metric else 0)
    assert Q.shape == (m * p, 24) and T.shape == (m * p, m * p)
    # the last step's residual is the one the certificate uses: M = R G R^T
    Gm = G if metric else np.eye(24)
    E = np.linalg.solve(Gm, H)
    Qn, Tn = np.asarray(Q, np.float64), np.asarray(T, np.float64)
    R = Qn[-p:] @ E.T - Tn[-p:] @ Qn
    # float64 as before; float32 scaled by its eps, the metric's condition number and d
    atol = 1e-10 * np.abs(H).max() ** 2 if dtype == jnp.float64 else 100 * float(jnp.finfo(dtype).eps) * np.linalg.cond(Gm) * np.abs(H).max() ** 2 * 24
    np.testing.assert_allclose(np.asarray(M, np.float64), R @ Gm @ R.T, atol=atol)


# ---------------------------------------------------------------------------
# thick restarts (issue 49): a fixed basis, restarted until certified, in one while_loop
# ---------------------------------------------------------------------------
def _clustered(seed: int, d: int = 200):
    """A top cluster (a double eigenvalue, then gaps of 1 %) above a dense bulk: one short cycle cannot certify it."""
    r = np.random.default_rng(seed)
    U = np.linalg.qr(r.standard_normal((d, d)))[0]
    lam = np.concatenate([[10.0, 10.0, 9.9, 9.8, 9.7, 9.6], r.uniform(-9.0, 9.4, d - 6)])
    return (U * lam) @ U.T


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("metric", [False, True])
def test_restarted_lanczos_certifies_the_top_values_with_a_fixed_basis(dtype, metric):
    from minigeo._eigen import restarted_block_lanczos, ritz_certificate

    H = _clustered(3)
    d, p, m, k = H.shape[0], 5, 6, 5
    r = np.random.default_rng(4)
    w = r.uniform(0.5, 2.0, d) if metric else np.ones(d)  # a diagonal metric G = diag(w)
    Hj, wj = jnp.asarray(H, dtype), jnp.asarray(w, dtype)
    apply_ginv = (lambda v: v / wj) if metric else None
    Z = jax.random.normal(jax.random.PRNGKey(0), (p, d), dtype)
    eps = float(jnp.finfo(dtype).eps)
    rtol = 1e-3 if dtype == jnp.float32 else 1e-8
    run = jax.jit(lambda Z: restarted_block_lanczos(
        lambda v: Hj @ v, apply_ginv, Z, m, key=jax.random.PRNGKey(1), k=k, rtol=rtol, max_cycles=200, return_basis=True))
    T, alive, M, Q, cycles = run(Z)
    assert int(cycles) > 1  # one cycle of 30 products does not certify this cluster: the restarts did
    theta, bounds, valid = ritz_certificate(T, alive, M, k)
    assert bool(jnp.all(valid)) and bool(jnp.all(bounds <= rtol * jnp.abs(theta[0]) + 100 * eps * 10))
    # truth: the top eigenvalues of G^{-1}H, dense; the Ritz values are within the Kahan bound of them
    s = 1 / np.sqrt(w)
    truth = np.sort(np.linalg.eigvalsh(s[:, None] * H * s[None, :]))[::-1][:k]
    np.testing.assert_allclose(np.asarray(theta, np.float64), truth, atol=float(bounds[-1]) + 1e3 * eps * 10)
    # the basis is still G-orthonormal and T its Rayleigh quotient, after the restarts
    Qn = np.asarray(Q, np.float64)
    np.testing.assert_allclose(Qn @ (w[:, None] * Qn.T), np.eye(m * p), atol=1e3 * eps)
    np.testing.assert_allclose(np.asarray(T, np.float64), Qn @ H @ Qn.T, atol=1e4 * eps * 10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_jitted_default_top_eigenvalues_restart_until_certified(dtype):
    """Issue 49: under jit the default left the last values NaN (uncertified); now it restarts until certified."""
    import minigeo as mg

    H = _clustered(5, d=300)
    lam = np.linalg.eigvalsh(H)
    Hj = jnp.asarray(H, dtype)
    f = lambda x: 0.5 * x @ (Hj @ x)
    x0 = jnp.zeros(H.shape[0], dtype)
    run = jax.jit(lambda x, key: mg.top_eigenvalues(f, x, key, k=5, which="both", return_info=True))
    rtol = 1e-2  # the default
    for seed in range(3):
        (top, bottom), info = run(x0, jax.random.PRNGKey(seed))
        assert int(info.status) == 0 and bool(jnp.all(jnp.isfinite(top))) and bool(jnp.all(jnp.isfinite(bottom)))
        np.testing.assert_allclose(np.asarray(top, np.float64), lam[::-1][:5], atol=2 * rtol * 10)
        np.testing.assert_allclose(np.asarray(bottom, np.float64), lam[:5], atol=2 * rtol * 10)
        assert int(info.num_products) <= 2 * (30 + 19 * 15)  # within the restart budget

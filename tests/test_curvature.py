"""Tests of minigeo.curvature against jax.hessian, closed forms, eq. (16) of paper 000 and invariances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import flatten, random_invertible, random_spd, rng

import minigeo as mg
from minigeo import reparam


def small_net(seed=0, n=10, hidden=4):
    r = rng(seed)
    X = jnp.asarray(r.normal(size=(n, 3)))
    y = jnp.asarray(r.normal(size=n))
    params = {
        "W": jnp.asarray(r.normal(size=(3, hidden))),
        "b": jnp.asarray(0.1 * r.normal(size=hidden)),
        "v": jnp.asarray(r.normal(size=hidden) / 2),
    }
    model = lambda p: jnp.tanh(X @ p["W"] + p["b"]) @ p["v"]
    loss = lambda p: 0.5 * jnp.mean((model(p) - y) ** 2) + 0.01 * jnp.sum(p["W"] ** 2)
    return params, model, loss


def test_hvp_and_hessian_match_jax_hessian():
    params, _, loss = small_net()
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    H_ref = np.asarray(jax.hessian(lambda q: loss(unravel(q)))(flat))
    np.testing.assert_allclose(mg.hessian(loss, params), H_ref, rtol=1e-10, atol=1e-12)
    for seed in range(3):
        v = jax.tree_util.tree_map(lambda x: jnp.asarray(rng(seed).normal(size=x.shape)), params)
        np.testing.assert_allclose(
            flatten(mg.hvp(loss, params, v)), H_ref @ flatten(v), rtol=1e-10, atol=1e-12
        )
    jitted = jax.jit(lambda p, v: mg.hvp(loss, p, v))(params, params)
    np.testing.assert_allclose(flatten(jitted), H_ref @ flat, rtol=1e-10)


# ---------------------------------------------------------------------------
# Christoffel symbols
# ---------------------------------------------------------------------------


def test_christoffel_polar_closed_form():
    r_, a = 1.7, 0.4
    Gamma = np.asarray(
        mg.christoffel_symbols(mg.metrics.dense(lambda x: jnp.diag(jnp.array([1.0, x[0] ** 2]))), jnp.array([r_, a]))
    )
    expected = np.zeros((2, 2, 2))
    expected[0, 1, 1] = -r_  # Gamma^r_{aa}
    expected[1, 0, 1] = expected[1, 1, 0] = 1 / r_  # Gamma^a_{ra}
    np.testing.assert_allclose(Gamma, expected, atol=1e-14)


def test_christoffel_inverse_square_metric():
    """The metric diag(1/G^2, 1/H^2) on coordinates (G, H): Gamma^1_11 = -1/G, Gamma^2_22 = -1/H, others 0."""
    x = jnp.array([0.7, 2.5])
    Gamma = np.asarray(mg.christoffel_symbols(mg.metrics.dense(lambda p: jnp.diag(1.0 / p**2)), x))
    expected = np.zeros((2, 2, 2))
    expected[0, 0, 0] = -1 / 0.7
    expected[1, 1, 1] = -1 / 2.5
    np.testing.assert_allclose(Gamma, expected, atol=1e-14)
    # Euclidean metric in Cartesian coordinates: all zero
    np.testing.assert_allclose(mg.christoffel_symbols(mg.metrics.dense(lambda p: jnp.eye(3)), jnp.ones(3)), 0.0, atol=1e-15)


def random_metric_field(r, d):
    B = jnp.asarray(r.normal(size=(d, d, d)) / d)
    S = random_spd(r, d)

    def metric(x):
        M = S + jnp.einsum("ijk,k->ij", B, jnp.sin(x))
        return M @ M.T + 0.5 * jnp.eye(d)

    return metric


@pytest.mark.parametrize("seed", range(3))
def test_christoffel_transformation_law_eq16(seed):
    r = rng(seed)
    d = 3
    metric = mg.metrics.dense(random_metric_field(r, d))
    phi = reparam.compose(reparam.softplus(), reparam.affine(random_invertible(r, d)))
    theta = jnp.asarray(r.uniform(0.5, 2.0, size=d))
    psi = phi.forward(theta)
    Gamma = mg.christoffel_symbols(metric, theta)
    Gamma_psi = mg.christoffel_symbols(mg.transform_metric_field(phi, metric), psi)
    J = phi.jacobian(theta)  # d psi / d theta
    Jinv = phi.inverse_jacobian(psi)  # d theta / d psi
    d2theta = jax.hessian(phi.inverse)(psi)  # [o, i, j] = d^2 theta^o / d psi^i d psi^j
    expected = jnp.einsum("omn,ko,mi,nj->kij", Gamma, J, Jinv, Jinv) + jnp.einsum("oij,ko->kij", d2theta, J)
    np.testing.assert_allclose(Gamma_psi, expected, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------
# Riemannian Hessian and the endomorphism
# ---------------------------------------------------------------------------


def test_riemannian_hessian_is_a_bilinear_form_everywhere():
    """Away from critical points only the Christoffel-corrected Hessian follows J^-T H J^-1 (polar case)."""
    f = lambda x: jnp.sin(x[0]) * x[1] + x[0] ** 2
    euclid = jnp.eye(2)
    phi = reparam.polar()
    theta = jnp.array([0.8, 1.3])
    psi = phi.forward(theta)
    f_psi = mg.transform_function(phi, f)
    G_psi = mg.transform_metric_field(phi, euclid)
    H_theta = mg.riemannian_hessian(f, euclid, theta)  # Euclidean in Cartesian: plain Hessian
    np.testing.assert_allclose(H_theta, mg.hessian(f, theta), atol=1e-14)
    expected = mg.transform_bilinear(phi, theta, H_theta)
    np.testing.assert_allclose(mg.riemannian_hessian(f_psi, G_psi, psi), expected, rtol=1e-9, atol=1e-12)
    # the plain autodiff Hessian in polar coordinates is not the transformed one (not a critical point)
    assert np.max(np.abs(np.asarray(mg.hessian(f_psi, psi)) - np.asarray(expected))) > 1e-2


@pytest.mark.parametrize("seed", range(4))
def test_endomorphism_invariants_under_random_reparametrizations(seed):
    r = rng(seed + 10)
    d = 3
    metric = mg.metrics.dense(random_metric_field(r, d) if seed % 2 else (lambda x: jnp.eye(d)))
    c = jnp.asarray(r.normal(size=d))
    f = lambda x: jnp.sum(jnp.cos(x + c)) + jnp.prod(x) + jnp.sum(x**4) / 4
    phi = reparam.compose(
        reparam.log() if seed < 2 else reparam.softplus(),
        reparam.affine(random_invertible(r, d), jnp.asarray(r.normal(size=d))),
    )
    theta = jnp.asarray(r.uniform(0.5, 2.0, size=d))
    psi = phi.forward(theta)
    f_psi, metric_psi = mg.transform_function(phi, f), mg.transform_metric_field(phi, metric)
    H, G = mg.riemannian_hessian(f, metric, theta), metric.dense(theta)
    H_psi, G_psi = mg.riemannian_hessian(f_psi, metric_psi, psi), metric_psi.dense(psi)
    np.testing.assert_allclose(
        mg.endomorphism_eigenvalues(H_psi, G_psi), mg.endomorphism_eigenvalues(H, G), rtol=1e-8, atol=1e-10
    )
    np.testing.assert_allclose(
        mg.endomorphism_trace(H_psi, G_psi), mg.endomorphism_trace(H, G), rtol=1e-8, atol=1e-10
    )
    s1, l1 = mg.endomorphism_slogdet(H, G)
    s2, l2 = mg.endomorphism_slogdet(H_psi, G_psi)
    assert s1 == s2
    np.testing.assert_allclose(l2, l1, rtol=1e-8, atol=1e-10)
    # the endomorphism itself transforms as J E J^-1
    np.testing.assert_allclose(
        mg.hessian_endomorphism(f_psi, metric_psi, psi),
        mg.transform_endomorphism(phi, theta, mg.hessian_endomorphism(f, metric, theta)),
        rtol=1e-8,
        atol=1e-10,
    )
    # ... while the bilinear Hessian's trace is not invariant
    assert abs(float(jnp.trace(H_psi) - jnp.trace(H))) > 1e-3


def test_endomorphism_helpers_match_numpy():
    r = rng(20)
    d = 5
    G = np.asarray(random_spd(r, d, cond=30.0))
    A = r.normal(size=(d, d))
    H = A + A.T
    E = np.linalg.solve(G, H)
    eig_ref = np.sort(np.linalg.eigvals(E).real)
    np.testing.assert_allclose(
        mg.endomorphism_eigenvalues(jnp.asarray(H), jnp.asarray(G)), eig_ref, rtol=1e-9, atol=1e-10
    )
    np.testing.assert_allclose(mg.endomorphism_trace(jnp.asarray(H), jnp.asarray(G)), np.trace(E), rtol=1e-10)
    sign, logdet = mg.endomorphism_slogdet(jnp.asarray(H), jnp.asarray(G))
    s_ref, l_ref = np.linalg.slogdet(E)
    assert float(sign) == s_ref
    np.testing.assert_allclose(logdet, l_ref, rtol=1e-10)


# ---------------------------------------------------------------------------
# matrix-free estimators vs dense
# ---------------------------------------------------------------------------


def test_hutchinson_trace_vs_dense():
    """Statistical tolerance: with 4000 probes the estimate must lie within 5 standard errors of the exact trace.

    (The standard error is itself estimated from the probes; the seed is fixed, so the test is deterministic.)
    """
    params, model, loss = small_net(1)
    H = np.asarray(mg.hessian(loss, params))
    diag_w = jax.tree_util.tree_map(lambda x: 0.5 + x**2, params)
    G_diag = np.diag(flatten(diag_w))
    G_metric = mg.ggn(model, lambda z: 0.5 * jnp.mean((z - 1.0) ** 2)).with_damping(0.1)
    G_dense = np.asarray(G_metric.dense(params))
    cases = [
        (None, np.trace(H)),
        (mg.metrics.diagonal(diag_w), np.trace(np.linalg.solve(G_diag, H))),
        (G_metric, np.trace(np.linalg.solve(G_dense, H))),
    ]
    for metric, exact in cases:
        probes = 4000 if metric is not G_metric else 400
        est, se = mg.trace_estimate(
            loss, params, jax.random.PRNGKey(0), metric=metric, num_probes=probes, tol=1e-10
        )
        assert abs(float(est) - exact) < 5 * float(se) + 1e-9, (metric, float(est), exact, float(se))
        assert float(se) < 0.2 * abs(exact) + 1e-3
    # reproducible given the key; lax.map path equal to vmap path
    a = mg.trace_estimate(loss, params, jax.random.PRNGKey(3), num_probes=8)
    b = mg.trace_estimate(loss, params, jax.random.PRNGKey(3), num_probes=8, batched="map")
    np.testing.assert_allclose(a[0], b[0], rtol=1e-12)
    np.testing.assert_allclose(
        a[0], mg.trace_estimate(loss, params, jax.random.PRNGKey(3), num_probes=8)[0], rtol=0
    )


def test_lanczos_top_eigenvalues_vs_dense():
    params, model, loss = small_net(2)
    d = flatten(params).size
    H = mg.hessian(loss, params)
    diag_w = jax.tree_util.tree_map(lambda x: 0.5 + x**2, params)
    G_metric = mg.ggn(model, lambda z: 0.5 * jnp.mean((z - 1.0) ** 2)).with_damping(0.1)
    for metric, G in [
        (None, jnp.eye(d)),
        (mg.metrics.diagonal(diag_w), jnp.diag(flatten(diag_w))),
        (G_metric, G_metric.dense(params)),
    ]:
        exact = np.sort(np.asarray(mg.endomorphism_eigenvalues(H, G)))[::-1][:3]
        full = mg.top_eigenvalues(
            loss, params, jax.random.PRNGKey(1), k=3, metric=metric, num_iterations=d, tol=1e-12
        )
        np.testing.assert_allclose(full, exact, rtol=1e-6, atol=1e-8)
        # with fewer iterations the top eigenvalue is already accurate
        short = mg.top_eigenvalues(
            loss, params, jax.random.PRNGKey(1), k=1, metric=metric, num_iterations=15, tol=1e-12
        )
        np.testing.assert_allclose(short, exact[:1], rtol=1e-4)


# ---------------------------------------------------------------------------
# error paths
# ---------------------------------------------------------------------------


def test_curvature_errors():
    params, model, loss = small_net(3)
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):
        mg.christoffel_symbols(mg.metrics.dense(lambda x: jnp.diag(jnp.array([1.0, -1.0]))), jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):
        mg.endomorphism_eigenvalues(jnp.eye(2), jnp.diag(jnp.array([1.0, 0.0])))
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):
        mg.hessian_endomorphism(lambda x: jnp.sum(x**2), mg.metrics.dense(lambda x: -jnp.eye(2)), jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.hessian(lambda x: jnp.sum(jnp.sqrt(x)), jnp.array([1.0, -1.0]))
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.trace_estimate(lambda x: jnp.sum(jnp.sqrt(x)), jnp.array([1.0, -1.0]), jax.random.PRNGKey(0))
    with pytest.raises(mg.GeometryError, match=r"max_size=5"):
        mg.hessian(loss, params, max_size=5)
    with pytest.raises(mg.GeometryError, match=r"<= 0"):
        mg.trace_estimate(
            loss, params, jax.random.PRNGKey(0), metric=mg.metrics.diagonal(jax.tree_util.tree_map(jnp.zeros_like, params))
        )
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.trace_estimate(loss, params, jax.random.PRNGKey(0), metric=mg.metrics.diagonal({"W": params["W"]}))
    with pytest.raises(mg.GeometryError, match=r"num_probes"):
        mg.trace_estimate(loss, params, jax.random.PRNGKey(0), num_probes=0)
    with pytest.raises(mg.GeometryError, match=r"batched"):
        mg.trace_estimate(loss, params, jax.random.PRNGKey(0), batched="pmap")
    with pytest.raises(mg.GeometryError, match=r"k must be"):
        mg.top_eigenvalues(loss, params, jax.random.PRNGKey(0), k=100)
    with pytest.raises(mg.GeometryError, match=r"1-D coordinate"):
        mg.christoffel_symbols(mg.metrics.dense(lambda x: jnp.eye(4)), jnp.ones((2, 2)))
    with pytest.raises(mg.GeometryError, match=r"3x3 matrix"):
        mg.riemannian_hessian(lambda x: jnp.sum(x**2), mg.metrics.dense(lambda x: jnp.eye(2)), jnp.ones(3))
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.hvp(loss, params, {"W": params["W"]})


def _clustered_quadratic(dtype, d=400, seed=0):
    """A quadratic whose Hessian has a clustered top (1, 0.99, ..., 0.95) above a bulk in [0, 0.9]:
    the case where 30 Lanczos steps leave the 5th eigenvalue several per cent off."""
    r = np.random.default_rng(seed)
    lam = np.concatenate([np.linspace(1.0, 0.95, 6), r.uniform(0.0, 0.9, d - 6)])
    Q, _ = np.linalg.qr(r.normal(size=(d, d)))
    A = jnp.asarray((Q * lam) @ Q.T, dtype)
    return (lambda x: 0.5 * x @ (A @ x)), jnp.zeros(d, dtype), np.sort(lam)[::-1]


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_top_eigenvalues_are_certified_by_their_residual_bounds(dtype):
    f, x0, lam = _clustered_quadratic(dtype)
    key = jax.random.PRNGKey(0)
    # an explicit short run: the raw Ritz values are several per cent off, and it raises instead
    raw = mg.top_eigenvalues(f, x0, key, k=5, num_iterations=12, rtol=None)
    assert np.max(np.abs(np.asarray(raw, np.float64) - lam[:5]) / lam[:5]) > 0.01
    with pytest.raises(mg.GeometryError, match="not certified"):
        mg.top_eigenvalues(f, x0, key, k=5, num_iterations=12)
    # under jit: NaN for every uncertified value, never the wrong number
    jitted = jax.jit(lambda x: mg.top_eigenvalues(f, x, key, k=5, num_iterations=12))(x0)
    ok = np.isfinite(np.asarray(jitted))
    assert not ok.all()
    np.testing.assert_allclose(np.asarray(jitted)[ok], np.asarray(raw)[ok])
    # the adaptive default is within 1 % (the certificate: rtol x the spectrum's scale)
    got = np.asarray(mg.top_eigenvalues(f, x0, key, k=5), np.float64)
    assert np.all(np.abs(got - lam[:5]) <= 1e-2 * lam[0])
    assert got.dtype == np.float64 and mg.top_eigenvalues(f, x0, key, k=5).dtype == dtype


def test_top_eigenvalues_rejects_bad_iteration_settings():
    f, x0, _ = _clustered_quadratic(jnp.float64, d=20)
    with pytest.raises(mg.GeometryError, match="num_iterations must be"):
        mg.top_eigenvalues(f, x0, jax.random.PRNGKey(0), num_iterations=0)
    with pytest.raises(mg.GeometryError, match="rtol must be"):
        mg.top_eigenvalues(f, x0, jax.random.PRNGKey(0), rtol=0.0)
    with pytest.raises(mg.GeometryError, match="k must be"):
        mg.top_eigenvalues(f, x0, jax.random.PRNGKey(0), k=21)
    # k up to d with the adaptive default: exact at m = d
    np.testing.assert_allclose(
        mg.top_eigenvalues(f, x0, jax.random.PRNGKey(0), k=20), np.sort(np.linalg.eigvalsh(jax.hessian(f)(x0)))[::-1], atol=1e-10
    )

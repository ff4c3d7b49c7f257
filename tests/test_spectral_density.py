"""Spectral densities (SLQ in the G-inner product) and both ends of the spectrum (issue 36).

Truths: the dense eigenvalues of E = G^{-1}H (``jnp.linalg.eigvals`` of the dense matrices from
``jax.hessian``), their moments tr(E^k)/d, and the chart-invariance of E at a critical point.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minigeo as mg
from helpers import random_spd, rng

DTYPES = [jnp.float64, jnp.float32]


def _loss(S):
    """A non-quadratic loss with a critical point at 0 and Hessian S there."""
    def f(u):
        return 0.5 * u @ S @ u + jnp.sum(u) ** 3 + 0.1 * jnp.sum(u**4)
    return f


def _problem(dtype, d=12, seed=0):
    r = rng(seed)
    Q, _ = np.linalg.qr(r.normal(size=(d, d)))
    lam = np.concatenate([[-2.0, -2.0, -2.0], np.linspace(-0.5, 4.0, d - 3)])  # a triple negative eigenvalue
    S = jnp.asarray(Q @ np.diag(lam) @ Q.T, dtype)
    G = jnp.asarray(random_spd(r, d, cond=20.0), dtype)
    w = jnp.asarray(r.uniform(0.5, 3.0, size=d), dtype)
    return _loss(S), jnp.zeros(d, dtype), S, G, w


def _dense_E(S, Gmat):
    return S if Gmat is None else jnp.linalg.solve(Gmat, S)


def _metrics(G, w):
    return {"euclidean": (None, None), "diagonal": (mg.metrics.diagonal(w), jnp.diag(w)), "dense": (mg.metrics.dense(G), G)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["euclidean", "diagonal", "dense"])
def test_moments_match_dense_traces_within_three_standard_errors(dtype, kind):
    f, x, S, G, w = _problem(dtype)
    metric, Gmat = _metrics(G, w)[kind]
    E = np.asarray(_dense_E(S, Gmat), np.float64)
    d = E.shape[0]
    dens = mg.spectral_density(f, x, jax.random.PRNGKey(1), metric=metric, num_probes=60, num_iterations=6)
    eps = float(jnp.finfo(dtype).eps)
    for k in range(1, 5):  # 6 nodes integrate degree <= 11 exactly
        truth = np.trace(np.linalg.matrix_power(E, k)) / d
        est, se = (float(a) for a in dens.moments(k))
        scale = np.max(np.abs(np.linalg.eigvals(E).real)) ** k
        assert abs(est - truth) <= 3 * se + 1e3 * eps * scale, (k, est, truth, se)
    # every probe's weights sum to one (the default probes: z^T G^-1 z = d)
    np.testing.assert_allclose(np.asarray(dens.weights.sum(axis=1)), 1.0, rtol=1e3 * eps)
    m0, se0 = dens.moments(0)
    assert abs(float(m0) - 1.0) < 1e3 * eps
    assert dens.num_products == 60 * 6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["euclidean", "diagonal", "dense"])
def test_d_iterations_reproduce_the_eigenvalues(dtype, kind):
    f, x, S, G, w = _problem(dtype)
    metric, Gmat = _metrics(G, w)[kind]
    lam = np.sort(np.linalg.eigvals(np.asarray(_dense_E(S, Gmat), np.float64)).real)
    d = lam.size
    dens = mg.spectral_density(f, x, jax.random.PRNGKey(2), metric=metric, num_probes=3, num_iterations=d, tol=1e-12)
    eps = float(jnp.finfo(dtype).eps)
    scale = np.max(np.abs(lam))
    for nodes, weights in zip(np.asarray(dens.nodes), np.asarray(dens.weights)):
        # every node that carries weight is an eigenvalue (a chance small weight may hide one)
        heavy = nodes[weights > 1e2 * eps]
        assert np.all(np.min(np.abs(heavy[:, None] - lam[None, :]), axis=1) < 1e4 * eps * scale)
        assert weights[np.abs(nodes - lam[0]) < 1e4 * eps * scale].sum() > 0  # the triple eigenvalue is seen
    # d steps span everything (restarts after the Krylov space of the probe closes): every eigenvalue is a node
    nodes = np.asarray(dens.nodes).ravel()
    assert np.all(np.min(np.abs(lam[:, None] - nodes[None, :]), axis=1) < 1e4 * eps * scale)


def _chart(d, dtype, seed=3):
    """theta = phi(vartheta): a nonlinear diffeomorphism with phi(0) = 0."""
    r = rng(seed)
    A = jnp.asarray(np.eye(d) + 0.3 * r.normal(size=(d, d)) / np.sqrt(d), dtype)
    b = jnp.asarray(r.uniform(0.2, 0.6, size=d), dtype)
    return lambda t: A @ (t + b * jnp.tanh(t) ** 2 + 0.5 * jnp.sin(t))


def test_density_of_E_is_invariant_with_transported_probes_and_the_hessian_s_is_not():
    f, x, S, G, _ = _problem(jnp.float64)
    d = x.size
    phi = _chart(d, jnp.float64)
    y = jnp.zeros(d)  # phi(0) = 0: the same critical point
    J = jax.jacfwd(phi)(y)
    f2 = lambda t: f(phi(t))
    metric2 = mg.metrics.dense(lambda t: jax.jacfwd(phi)(t).T @ G @ jax.jacfwd(phi)(t))
    Z = jax.random.normal(jax.random.PRNGKey(4), (5, d), jnp.float64) @ jnp.linalg.cholesky(G).T  # covariance G
    Z2 = Z @ J  # covectors: z' = J^T z, row by row
    key = jax.random.PRNGKey(5)
    one = mg.spectral_density(f, x, key, metric=mg.metrics.dense(G), probes=Z, num_iterations=8, tol=1e-13)
    two = mg.spectral_density(f2, y, key, metric=metric2, probes=Z2, num_iterations=8, tol=1e-13)
    np.testing.assert_allclose(np.asarray(two.nodes), np.asarray(one.nodes), atol=1e-8 * float(jnp.max(jnp.abs(one.nodes))))
    np.testing.assert_allclose(np.asarray(two.weights), np.asarray(one.weights), atol=1e-8)
    grid = jnp.linspace(-3, 5, 50)
    np.testing.assert_allclose(np.asarray(two.density(grid, 0.2)), np.asarray(one.density(grid, 0.2)), atol=1e-8)
    # the plain Hessian's density moves with the chart (its mean, tr H / d, is not invariant)
    h1 = mg.spectral_density(f, x, key, num_probes=20, num_iterations=8).moments(1)[0]
    h2 = mg.spectral_density(f2, y, key, num_probes=20, num_iterations=8).moments(1)[0]
    assert abs(float(h1) - float(h2)) > 0.05 * abs(float(h1)) + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_density_under_jit_equals_eager_and_reports_a_status(dtype):
    f, x, S, G, w = _problem(dtype)
    metric = mg.metrics.diagonal(w)
    key = jax.random.PRNGKey(6)
    eager = mg.spectral_density(f, x, key, metric=metric, num_probes=4, num_iterations=5)
    jitted, info = jax.jit(
        lambda p: mg.spectral_density(f, p, key, metric=metric, num_probes=4, num_iterations=5, return_info=True)
    )(x)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(jitted.nodes), np.asarray(eager.nodes), atol=1e3 * eps * 4)
    np.testing.assert_allclose(np.asarray(jitted.weights), np.asarray(eager.weights), atol=1e3 * eps)
    assert mg.Status(int(info.status)) == mg.Status.OK


def test_density_is_gaussian_broadened_rules_and_integrates_to_one():
    f, x, S, G, w = _problem(jnp.float64)
    dens = mg.spectral_density(f, x, jax.random.PRNGKey(7), num_probes=3, num_iterations=6)
    grid = jnp.linspace(-8.0, 10.0, 4001)
    sigma = 0.3
    rho = np.asarray(dens.density(grid, sigma))
    manual = np.zeros_like(rho)
    for nodes, weights in zip(np.asarray(dens.nodes), np.asarray(dens.weights)):
        for t, c in zip(nodes, weights):
            manual += c * np.exp(-0.5 * ((np.asarray(grid) - t) / sigma) ** 2) / (sigma * np.sqrt(2 * np.pi))
    np.testing.assert_allclose(rho, manual / 3, rtol=1e-12, atol=1e-15)
    assert abs(np.trapezoid(rho, np.asarray(grid)) - 1.0) < 1e-6


def test_operator_density_over_batches_equals_the_function_on_all_data():
    r = rng(8)
    X = jnp.asarray(r.normal(size=(30, 4)))
    Y = jnp.asarray(r.normal(size=(30,)))
    loss = lambda wb, batch: jnp.mean((jnp.tanh(batch[0] @ wb["w"]) @ wb["a"] - batch[1]) ** 2)
    params = {"w": jnp.asarray(r.normal(size=(4, 3))), "a": jnp.asarray(r.normal(size=(3,)))}
    H = mg.operators.hessian_operator(loss, params)
    key = jax.random.PRNGKey(9)
    batches = [(X[:10], Y[:10]), (X[10:], Y[10:])]
    op = H.spectral_density(key, batches, num_probes=3, num_iterations=6)
    fn = mg.spectral_density(loss, params, key, batch=(X, Y), num_probes=3, num_iterations=6)
    np.testing.assert_allclose(np.asarray(op.nodes), np.asarray(fn.nodes), atol=1e-9)
    np.testing.assert_allclose(np.asarray(op.weights), np.asarray(fn.weights), atol=1e-9)
    assert op.num_products == fn.num_products == 18


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["euclidean", "diagonal"])
def test_smallest_eigenvalues_with_multiplicity(dtype, kind):
    f, x, S, G, w = _problem(dtype)
    metric, Gmat = _metrics(G, w)[kind]
    lam = np.sort(np.linalg.eigvals(np.asarray(_dense_E(S, Gmat), np.float64)).real)
    eps = float(jnp.finfo(dtype).eps)
    key = jax.random.PRNGKey(10)
    low = mg.top_eigenvalues(f, x, key, k=3, metric=metric, which="smallest")
    tol = 1e-2 * np.max(np.abs(lam[:3])) + 1e3 * eps
    np.testing.assert_allclose(np.asarray(low), lam[:3], atol=tol)
    high, low2 = mg.top_eigenvalues(f, x, key, k=2, metric=metric, which="both")
    np.testing.assert_allclose(np.asarray(high), lam[::-1][:2], atol=1e-2 * lam[-1] + 1e3 * eps)
    np.testing.assert_allclose(np.asarray(low2), lam[:2], atol=tol)
    # the same under jit, with a status
    vals, info = jax.jit(
        lambda p: mg.top_eigenvalues(f, p, key, k=3, metric=metric, which="smallest", num_iterations=12, return_info=True)
    )(x)
    assert mg.Status(int(info.status)) == mg.Status.OK
    np.testing.assert_allclose(np.asarray(vals), lam[:3], atol=tol)


def test_smallest_over_a_dataset_equals_dense():
    r = rng(11)
    X = jnp.asarray(r.normal(size=(20, 3)))
    loss = lambda w, x: jnp.mean(jnp.sin(x @ w) * jnp.cos(x @ w[::-1]))
    w0 = jnp.asarray(r.normal(size=3))
    lam = np.linalg.eigvalsh(np.asarray(jax.hessian(lambda w: loss(w, X))(w0)))
    H = mg.operators.hessian_operator(loss, w0)
    got = H.top_eigenvalues(jax.random.PRNGKey(0), [X[:8], X[8:]], k=2, which="smallest")
    np.testing.assert_allclose(np.asarray(got), lam[:2], atol=1e-2 * np.max(np.abs(lam[:2])))


def test_bad_input_raises():
    f, x, S, G, w = _problem(jnp.float64)
    key = jax.random.PRNGKey(0)
    ggn_like = mg.Metric(lambda p, v: G @ v)  # matrix-free: no factor to draw the probes
    with pytest.raises(mg.GeometryError, match="probes="):
        mg.spectral_density(f, x, key, metric=ggn_like)
    Z = jax.random.normal(key, (2, x.size)) @ jnp.linalg.cholesky(G).T
    dens = mg.spectral_density(f, x, key, metric=ggn_like, probes=Z, num_iterations=4)  # with probes it works
    assert dens.nodes.shape == (2, 4)
    with pytest.raises(mg.GeometryError, match="probes must be"):
        mg.spectral_density(f, x, key, probes=jnp.ones((2, x.size + 1)))
    with pytest.raises(mg.GeometryError, match="num_iterations"):
        mg.spectral_density(f, x, key, num_iterations=0)
    with pytest.raises(mg.GeometryError, match="num_probes"):
        mg.spectral_density(f, x, key, num_probes=0)
    with pytest.raises(mg.GeometryError):
        mg.spectral_density(f, x, 3)
    with pytest.raises(mg.GeometryError, match="not positive definite"):
        mg.spectral_density(f, x, key, metric=mg.metrics.dense(-G))
    with pytest.raises(mg.GeometryError, match="sigma"):
        dens.density(jnp.zeros(3), 0.0)
    with pytest.raises(mg.GeometryError, match="non-negative int"):
        dens.moments(-1)
    with pytest.raises(mg.GeometryError, match="which"):
        mg.top_eigenvalues(f, x, key, which="middle")
    with pytest.raises(mg.GeometryError, match="bare callable|Metric"):
        mg.spectral_density(f, x, key, metric=lambda p: G)

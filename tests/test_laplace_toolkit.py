"""The Laplace toolkit: posterior, linearized (GLM) predictive and the evidence-maximizing prior precision.

Truth: Bayesian linear regression, where the Laplace posterior, the GLM predictive and the Laplace
evidence are exact and have closed forms; dense ``jax.jacfwd`` for a nonlinear model; scipy's scalar
optimizer on the evidence for the prior precision.  float64 to round-off and float32 with tolerances
scaled by ``eps`` and the conditioning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from helpers import rng

import minigeo as mg

DTYPES = [jnp.float64, jnp.float32]


def _tol(dtype, cond=1.0):
    return 1e-10 if dtype == jnp.float64 else 50 * float(jnp.finfo(dtype).eps) * cond


def _blr(seed=0, n=30, d=4, noise=0.5, alpha=2.0, dtype=jnp.float64):
    r = rng(seed)
    X = r.normal(size=(n, d)) * np.array([1.0, 2.0, 0.5, 1.5][:d])
    w_true = r.normal(size=d)
    y = X @ w_true + noise * r.normal(size=n)
    A = X.T @ X / noise**2 + alpha * np.eye(d)  # posterior precision
    mu = np.linalg.solve(A, X.T @ y / noise**2)
    nll = lambda w, b: 0.5 * jnp.sum((b[1] - b[0] @ w) ** 2) / noise**2 + 0.5 * n * jnp.log(2 * jnp.pi * noise**2)
    batch = (jnp.asarray(X, dtype), jnp.asarray(y, dtype))
    return dict(X=X, y=y, A=A, mu=mu, noise=noise, alpha=alpha, nll=nll, batch=batch, n=n, d=d)


def _exact_log_evidence(X, y, noise, alpha):
    K = noise**2 * np.eye(len(y)) + X @ X.T / alpha
    _, logdet = np.linalg.slogdet(K)
    return -0.5 * (y @ np.linalg.solve(K, y) + logdet + len(y) * np.log(2 * np.pi))


def _joint(nll, alpha, d):
    # -log p(D | w) - log N(w; 0, alpha^-1 I)
    return lambda w, b: nll(w, b) + 0.5 * alpha * jnp.sum(w**2) - 0.5 * d * jnp.log(alpha / (2 * jnp.pi))


@pytest.mark.parametrize("dtype", DTYPES)
def test_laplace_posterior_is_the_exact_posterior_of_bayesian_linear_regression(dtype):
    P = _blr(dtype=dtype)
    mu = jnp.asarray(P["mu"], dtype)
    post = mg.laplace_posterior(_joint(P["nll"], P["alpha"], P["d"]), mu, batch=P["batch"])
    cov = np.linalg.inv(P["A"])
    cond = np.linalg.cond(P["A"])
    assert post.covariance().dtype == dtype
    np.testing.assert_allclose(post.precision, P["A"], rtol=_tol(dtype, cond))
    np.testing.assert_allclose(post.covariance(), cov, rtol=_tol(dtype, cond), atol=_tol(dtype, cond) * np.abs(cov).max())
    np.testing.assert_allclose(post.marginal_variance(), np.diag(cov), rtol=_tol(dtype, cond))
    # the same Gaussian from the likelihood's Hessian plus the prior's precision on the diagonal
    post2 = mg.laplace_posterior(P["nll"], mu, batch=P["batch"], prior_precision=P["alpha"])
    np.testing.assert_allclose(post2.covariance(), cov, rtol=_tol(dtype, cond), atol=_tol(dtype, cond) * np.abs(cov).max())
    # and from the GGN (squared error: GGN = Hessian of the likelihood)
    ggn = mg.ggn(lambda w, x: x @ w, lambda z, y: 0.5 * jnp.sum((y - z) ** 2) / P["noise"] ** 2, batch=P["batch"])
    post3 = mg.laplace_posterior(P["nll"], mu, batch=P["batch"], curvature=ggn, prior_precision=P["alpha"])
    np.testing.assert_allclose(post3.precision, P["A"], rtol=_tol(dtype, cond))


def test_laplace_posterior_samples_have_its_mean_and_covariance():
    P = _blr(seed=1)
    post = mg.laplace_posterior(P["nll"], jnp.asarray(P["mu"]), batch=P["batch"], prior_precision=P["alpha"])
    n = 40_000
    S = np.asarray(post.sample(jax.random.PRNGKey(0), n))
    cov = np.linalg.inv(P["A"])
    se = np.sqrt(np.diag(cov) / n)
    assert np.all(np.abs(S.mean(0) - P["mu"]) < 4.5 * se)
    emp = np.cov(S.T)
    assert np.linalg.norm(emp - cov) / np.linalg.norm(cov) < 0.05  # ~ sqrt(2/n) * d
    # pytrees: the samples are shaped like the parameters, with a leading sample axis
    tree = mg.laplace_posterior(lambda p: 0.5 * (jnp.sum(p["a"] ** 2) + 4 * p["b"] ** 2), {"a": jnp.zeros(2), "b": jnp.zeros(())})
    s = tree.sample(jax.random.PRNGKey(1), 5)
    assert s["a"].shape == (5, 2) and s["b"].shape == (5,)
    np.testing.assert_allclose(tree.marginal_variance()["b"], 0.25, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_glm_predictive_is_exact_for_a_linear_model(dtype):
    P = _blr(seed=2, dtype=dtype)
    post = mg.laplace_posterior(P["nll"], jnp.asarray(P["mu"], dtype), batch=P["batch"], prior_precision=P["alpha"])
    Xt = rng(3).normal(size=(7, P["d"]))
    pred = mg.glm_predictive(lambda w, x: x @ w, post, jnp.asarray(Xt, dtype))
    cov = np.linalg.inv(P["A"])
    cond = np.linalg.cond(P["A"])
    np.testing.assert_allclose(pred.mean, Xt @ P["mu"], rtol=_tol(dtype, cond), atol=_tol(dtype, cond))
    np.testing.assert_allclose(pred.covariance, np.einsum("ni,ij,nj->n", Xt, cov, Xt), rtol=_tol(dtype, cond))
    assert pred.covariance.shape == (7,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_glm_predictive_of_a_nonlinear_model_matches_the_dense_jacobian(dtype):
    r = rng(4)
    params = {"W": jnp.asarray(r.normal(size=(3, 5)), dtype), "V": jnp.asarray(r.normal(size=(5, 3)), dtype)}
    model = lambda p, x: jnp.tanh(x @ p["W"]) @ p["V"]  # (N, 3) outputs
    X = jnp.asarray(r.normal(size=(6, 3)), dtype)
    post = mg.laplace_posterior(lambda p: 0.5 * sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(p)), params, prior_precision=0.5)
    pred = mg.glm_predictive(model, post, X)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    J = np.asarray(jax.jacfwd(lambda q: model(unravel(q), X))(flat), np.float64)  # (N, K, d)
    cov = np.linalg.inv(np.asarray(post.precision, np.float64))
    want = np.einsum("nkd,de,nle->nkl", J, cov, J)
    assert pred.covariance.shape == (6, 3, 3)
    np.testing.assert_allclose(pred.covariance, want, rtol=_tol(dtype, 10), atol=_tol(dtype, 10) * np.abs(want).max())
    np.testing.assert_allclose(pred.mean, model(params, X), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_optimized_prior_precision_maximizes_the_laplace_evidence(dtype):
    P = _blr(seed=5, dtype=dtype)
    mu = jnp.asarray(P["mu"], dtype)
    res = mg.optimize_prior_precision(P["nll"], mu, batch=P["batch"])
    assert int(res.status) == 0

    def neg_log_z(log_alpha):  # independent path: laplace_log_marginal_likelihood of the full joint
        a = float(np.exp(log_alpha))
        return -float(mg.laplace_log_marginal_likelihood(_joint(P["nll"], a, P["d"]), jnp.asarray(P["mu"]), batch=P["batch"]).log_z)

    P64 = _blr(seed=5)
    P["nll"], P["batch"] = P64["nll"], P64["batch"]
    best = scipy.optimize.minimize_scalar(neg_log_z, bracket=(-5.0, 3.0), tol=1e-12)
    tol = 1e-6 if dtype == jnp.float64 else 1e-3
    np.testing.assert_allclose(float(res.prior_precision), np.exp(best.x), rtol=tol)
    np.testing.assert_allclose(float(res.log_z), -best.fun, rtol=tol)
    # gamma counts the well-determined directions: between 0 and d
    assert 0 < float(res.effective_num_params) < P["d"]


def test_alternating_refit_and_fixed_point_finds_the_exact_evidence_maximum():
    """MacKay's scheme: refit the MAP at alpha, re-estimate alpha, repeat -> argmax of the exact evidence."""
    P = _blr(seed=6, n=25, d=4)
    X, y, s2 = P["X"], P["y"], P["noise"] ** 2
    alpha = 1.0
    for _ in range(200):
        w = np.linalg.solve(X.T @ X / s2 + alpha * np.eye(P["d"]), X.T @ y / s2)
        new = float(mg.optimize_prior_precision(P["nll"], jnp.asarray(w), batch=P["batch"], init=alpha).prior_precision)
        if abs(new - alpha) < 1e-13 * alpha:
            break
        alpha = new
    best = scipy.optimize.minimize_scalar(lambda la: -_exact_log_evidence(X, y, P["noise"], np.exp(la)), bracket=(-5, 3), tol=1e-12)
    np.testing.assert_allclose(alpha, np.exp(best.x), rtol=1e-6)


def test_optimize_prior_precision_under_jit_reports_a_status():
    P = _blr(seed=7)
    mu = jnp.asarray(P["mu"])
    eager = mg.optimize_prior_precision(P["nll"], mu, batch=P["batch"])
    jitted = jax.jit(lambda m, b: mg.optimize_prior_precision(P["nll"], m, batch=b))(mu, P["batch"])
    np.testing.assert_allclose(jitted.prior_precision, eager.prior_precision, rtol=1e-12)
    assert int(jitted.status) == 0
    stuck = jax.jit(lambda m, b: mg.optimize_prior_precision(P["nll"], m, batch=b, max_iterations=2, init=1e3))(mu, P["batch"])
    assert int(stuck.status) == int(mg.Status.MAX_ITERATIONS)


def test_bad_inputs_raise_clear_errors():
    P = _blr(seed=8)
    mu = jnp.asarray(P["mu"])
    with pytest.raises(mg.GeometryError, match="init must be a positive"):
        mg.optimize_prior_precision(P["nll"], mu, batch=P["batch"], init=0.0)
    with pytest.raises(mg.GeometryError, match="equals the prior mean"):
        mg.optimize_prior_precision(P["nll"], mu, batch=P["batch"], prior_mean=mu)
    with pytest.raises(mg.GeometryError, match="prior_mean has"):
        mg.optimize_prior_precision(P["nll"], mu, batch=P["batch"], prior_mean=jnp.zeros(3))
    with pytest.raises(mg.GeometryError, match="iterations"):
        mg.optimize_prior_precision(P["nll"], mu, batch=P["batch"], max_iterations=2, init=1e3)
    saddle = lambda w: 0.5 * (w[0] ** 2 - 3.0 * w[1] ** 2)  # indefinite likelihood curvature
    with pytest.raises(mg.GeometryError, match="not a minimum of the joint"):
        mg.optimize_prior_precision(saddle, jnp.array([1.0, 0.1]))
    with pytest.raises(mg.GeometryError, match="not a strict minimum"):
        mg.laplace_posterior(saddle, jnp.zeros(2))
    with pytest.raises(mg.GeometryError, match="not finite|non-finite|NaN"):
        mg.laplace_posterior(lambda w: jnp.sum(jnp.sqrt(w) ** 2 * jnp.nan), jnp.ones(2))
    post = mg.laplace_posterior(lambda w: 0.5 * jnp.sum(w**2), jnp.zeros(2))
    with pytest.raises(mg.GeometryError, match=r"shape \(N,\) or \(N, K\)"):
        mg.glm_predictive(lambda w, x: jnp.sum(x @ w), post, jnp.ones((4, 2)))
    with pytest.raises(mg.GeometryError):
        post.sample(jnp.zeros(3), 2)  # not a PRNG key

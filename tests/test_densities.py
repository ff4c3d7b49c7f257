"""Tests of minigeo.densities: normalization by quadrature, (non-)equivariance of modes, exact Laplace evidence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_invertible, random_spd, rng

import minigeo as mg
from minigeo import reparam

# Gamma(3, 1) on (0, inf): mode 2
log_gamma3 = lambda t: 2 * jnp.log(t[0]) - t[0] - jnp.log(2.0)
euclid1 = jnp.eye(1)


def test_normalization_under_both_rules_by_quadrature():
    phi = reparam.log()
    psi = jnp.linspace(-12.0, 5.0, 40001)
    dpsi = psi[1] - psi[0]
    lebesgue = jax.vmap(lambda p: jnp.exp(mg.transform_log_density(log_gamma3, phi)(p[None])))(psi)
    np.testing.assert_allclose(jnp.sum(lebesgue) * dpsi, 1.0, rtol=1e-6)  # density w.r.t. d psi
    G_psi = mg.transform_metric_field(phi, euclid1)
    # volume-form density in psi: the theta density as a plain function, integrated against dV = |det G|^1/2 dpsi
    q_vol = jax.vmap(
        lambda p: jnp.exp(mg.log_density_wrt_volume(mg.transform_function(phi, log_gamma3), G_psi)(p[None]))
    )(psi)
    dV = jax.vmap(lambda p: jnp.exp(mg.log_volume_element(G_psi, p[None])))(psi)
    np.testing.assert_allclose(jnp.sum(q_vol * dV * dV) * dpsi, 1.0, rtol=1e-6)
    # and q^G transforms as a plain function: q^G_psi(psi) = q^G_theta(phi^{-1}(psi)) = q(theta) (G = I in theta)
    np.testing.assert_allclose(
        mg.log_density_wrt_volume(mg.transform_log_density(log_gamma3, phi), G_psi)(jnp.array([0.3])),
        log_gamma3(jnp.exp(jnp.array([0.3]))),
        rtol=1e-12,
    )


@pytest.mark.parametrize("seed", range(4))
def test_mode_equivariance_under_random_reparametrizations(seed):
    r = rng(seed)
    first = reparam.log() if seed % 2 == 0 else reparam.softplus()
    phi = reparam.compose(
        first,
        reparam.affine(jnp.asarray([[r.uniform(0.5, 2.0) * r.choice([-1, 1])]]), jnp.asarray([r.normal()])),
    )
    theta_mode = 2.0
    log_q_leb = mg.transform_log_density(log_gamma3, phi)
    G_psi = mg.transform_metric_field(phi, euclid1)
    log_q_vol = mg.log_density_wrt_volume(log_q_leb, G_psi)
    grid_theta = jnp.linspace(0.05, 12.0, 200001)
    grid_psi = jax.vmap(lambda t: phi.forward(t[None]))(grid_theta)[:, 0]
    leb_vals = jax.vmap(lambda p: log_q_leb(p[None]))(grid_psi)
    vol_vals = jax.vmap(lambda p: log_q_vol(p[None]))(grid_psi)
    mode_leb = float(grid_theta[jnp.argmax(leb_vals)])
    mode_vol = float(grid_theta[jnp.argmax(vol_vals)])
    assert abs(mode_vol - theta_mode) < 1e-3  # equivariant: the same point
    assert abs(mode_leb - theta_mode) > 0.1  # the Lebesgue mode moves


def test_transform_log_density_closed_form():
    log_normal = lambda t: -0.5 * jnp.sum(t**2) - 0.5 * jnp.log(2 * jnp.pi)
    a, b = -2.5, 0.7
    phi = reparam.affine(jnp.array([[a]]), jnp.array([b]))
    psi = jnp.array([1.3])
    expected = -0.5 * ((1.3 - b) / a) ** 2 - 0.5 * np.log(2 * np.pi) - np.log(abs(a))
    np.testing.assert_allclose(mg.transform_log_density(log_normal, phi)(psi), expected, rtol=1e-12)


def test_volume_element_and_jeffreys():
    np.testing.assert_allclose(
        mg.log_volume_element(mg.metrics.dense(lambda x: jnp.diag(jnp.array([1.0, x[0] ** 2]))), jnp.array([3.0, 1.0])),
        np.log(3.0),
        rtol=1e-12,
    )
    # Jeffreys prior for a Bernoulli: 1 / (pi sqrt(t (1 - t))) is uniform (1/pi) under the Fisher volume form
    fisher = mg.metrics.dense(lambda t: jnp.array([[1.0 / (t[0] * (1 - t[0]))]]))
    log_jeffreys = lambda t: -jnp.log(jnp.pi) - 0.5 * jnp.log(t[0] * (1 - t[0]))
    for t in [0.1, 0.5, 0.93]:
        np.testing.assert_allclose(
            mg.log_density_wrt_volume(log_jeffreys, fisher)(jnp.array([t])), -np.log(np.pi), rtol=1e-12
        )


# ---------------------------------------------------------------------------
# Laplace evidence
# ---------------------------------------------------------------------------


def test_laplace_is_exact_for_bayesian_linear_regression():
    r = rng(1)
    n, d, sigma, alpha = 30, 4, 0.5, 2.0
    X = jnp.asarray(r.normal(size=(n, d)))
    y = jnp.asarray(r.normal(size=n))

    def neg_log_joint(w):  # normalized Gaussian likelihood and Gaussian prior N(0, 1/alpha)
        nll = 0.5 * jnp.sum((X @ w - y) ** 2) / sigma**2 + 0.5 * n * jnp.log(2 * jnp.pi * sigma**2)
        nlp = 0.5 * alpha * jnp.sum(w**2) - 0.5 * d * jnp.log(alpha / (2 * jnp.pi))
        return nll + nlp

    A = X.T @ X / sigma**2 + alpha * jnp.eye(d)
    w_map = jnp.linalg.solve(A, X.T @ y / sigma**2)
    C = sigma**2 * np.eye(n) + np.asarray(X @ X.T) / alpha  # marginal covariance of y
    exact = (
        -0.5 * np.asarray(y) @ np.linalg.solve(C, np.asarray(y)) - 0.5 * np.linalg.slogdet(2 * np.pi * C)[1]
    )
    ev = mg.laplace_log_marginal_likelihood(neg_log_joint, w_map)
    np.testing.assert_allclose(ev.log_z, exact, rtol=1e-10)
    np.testing.assert_allclose(ev.log_z, -ev.neg_log_joint + ev.rest, rtol=1e-12)
    assert ev.num_params == d
    # the GGN of the likelihood plus the prior precision gives the same (the model is linear)
    ggn = mg.ggn(lambda w: X @ w, lambda z: 0.5 * jnp.sum((z - y) ** 2) / sigma**2)
    np.testing.assert_allclose(
        mg.laplace_log_marginal_likelihood(neg_log_joint, w_map, curvature=ggn, prior_precision=alpha).log_z,
        exact,
        rtol=1e-10,
    )
    # stochastic Lanczos quadrature: exact Lanczos (num_iterations = d) makes each probe's quadrature exact
    slq = mg.laplace_log_marginal_likelihood(
        neg_log_joint, w_map, method="slq", key=jax.random.PRNGKey(0), num_probes=200, num_iterations=d
    )
    assert abs(float(slq.log_z) - exact) < 4 * 0.5 * float(slq.logdet_se) + 1e-6


def test_geometry_aware_evidence_is_invariant():
    r = rng(2)
    d = 3
    A = random_spd(r, d)
    mu = jnp.asarray(r.uniform(0.5, 2.0, size=d))
    L = lambda t: 0.5 * (t - mu) @ A @ (t - mu) + jnp.sum((t - mu) ** 4)  # minimum at mu (positive)
    phi = reparam.compose(reparam.softplus(), reparam.affine(random_invertible(r, d)))
    psi_star = phi.forward(mu)
    L_psi = mg.transform_function(phi, L)
    ev_theta = mg.laplace_log_marginal_likelihood(L, mu)
    naive = mg.laplace_log_marginal_likelihood(L_psi, psi_star)
    aware = mg.laplace_log_marginal_likelihood(
        L_psi, psi_star, metric=mg.transform_metric_field(phi, jnp.eye(d))
    )
    via_theta = mg.laplace_log_marginal_likelihood(L_psi, psi_star, reparametrization=phi)
    np.testing.assert_allclose(aware.log_z, ev_theta.log_z, rtol=1e-10)
    np.testing.assert_allclose(via_theta.log_z, ev_theta.log_z, rtol=1e-10)
    np.testing.assert_allclose(naive.neg_log_joint, ev_theta.neg_log_joint, rtol=1e-12, atol=1e-14)  # both ~0
    # the naive value is off by log |det J|
    _, logdet_J = np.linalg.slogdet(np.asarray(phi.jacobian(mu)))
    np.testing.assert_allclose(naive.log_z - ev_theta.log_z, logdet_J, rtol=1e-8)
    assert abs(float(naive.log_z - ev_theta.log_z)) > 1e-2


def test_weight_norm_round_trip_and_evidence():
    r = rng(3)
    theta = {"W": jnp.asarray(r.normal(size=(3, 2))), "b": jnp.asarray(r.normal(size=2))}
    wn = mg.weight_norm("W")
    psi = wn.split(theta)
    np.testing.assert_allclose(psi["W"]["r"], np.linalg.norm(np.asarray(theta["W"]), axis=0), rtol=1e-12)
    np.testing.assert_allclose(wn.merge(psi)["W"], theta["W"], rtol=1e-12)
    scaled = {**psi, "W": {"r": psi["W"]["r"], "eta": 3.0 * psi["W"]["eta"]}}
    np.testing.assert_allclose(wn.merge(scaled)["W"], theta["W"], rtol=1e-12)  # eta's scale is redundant
    X = jnp.asarray(r.normal(size=(20, 3)))
    y = jnp.asarray(r.normal(size=(20, 2)))
    L = lambda p: (
        0.5 * jnp.sum((X @ p["W"] + p["b"] - y) ** 2)
        + 0.5 * sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(p))
    )
    theta_star = {"W": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    for _ in range(3):  # Newton to the MAP (quadratic: exact)
        flat, unravel = jax.flatten_util.ravel_pytree(theta_star)
        flat = flat - jnp.linalg.solve(
            mg.hessian(L, theta_star), jax.flatten_util.ravel_pytree(jax.grad(L)(theta_star))[0]
        )
        theta_star = unravel(flat)
    L_psi = lambda q: L(wn.merge(q))
    ev = mg.laplace_log_marginal_likelihood(L, theta_star)
    ev_wn = mg.laplace_log_marginal_likelihood(L_psi, wn.split(theta_star), reparametrization=wn)
    np.testing.assert_allclose(ev_wn.log_z, ev.log_z, rtol=1e-10)
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):  # eta's scale is a flat direction
        mg.laplace_log_marginal_likelihood(L_psi, wn.split(theta_star))


def test_slq_logdet_vs_dense():
    """SLQ with 200 probes and 25 Lanczos steps on a 60x60 SPD matrix (condition 100):
    within 4 standard errors plus 1e-3 (the Lanczos quadrature bias) of slogdet."""
    A = random_spd(rng(4), 60, cond=100.0)
    est, se = mg.densities.logdet_slq(lambda v: A @ v, 60, jax.random.PRNGKey(1), num_probes=200, num_iterations=25)
    exact = np.linalg.slogdet(np.asarray(A))[1]
    assert abs(float(est) - exact) < 4 * float(se) + 1e-3, (float(est), exact, float(se))


def test_density_errors():
    saddle = lambda t: t[0] ** 2 - t[1] ** 2
    with pytest.raises(mg.GeometryError, match=r"GGN.*prior_precision"):
        mg.laplace_log_marginal_likelihood(saddle, jnp.zeros(2))
    with pytest.raises(mg.GeometryError, match=r"GGN.*prior_precision"):
        mg.laplace_log_marginal_likelihood(saddle, jnp.zeros(2), method="slq", key=jax.random.PRNGKey(0))
    # a positive prior precision fixes it
    assert np.isfinite(
        float(mg.laplace_log_marginal_likelihood(saddle, jnp.zeros(2), prior_precision=3.0).log_z)
    )
    with pytest.raises(mg.GeometryError, match=r"needs a PRNG key"):
        mg.laplace_log_marginal_likelihood(saddle, jnp.zeros(2), method="slq")
    with pytest.raises(mg.GeometryError, match=r"method must be"):
        mg.laplace_log_marginal_likelihood(saddle, jnp.zeros(2), method="exact")
    with pytest.raises(mg.GeometryError, match=r"Reparametrization"):
        mg.laplace_log_marginal_likelihood(saddle, jnp.zeros(2), reparametrization=lambda x: x)
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):
        mg.log_volume_element(mg.metrics.dense(lambda x: -jnp.eye(2)), jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"not in the parameter pytree"):
        mg.weight_norm(["W", "V"]).split({"W": jnp.ones((2, 2))})
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.laplace_log_marginal_likelihood(lambda t: jnp.sum(jnp.log(t)), jnp.array([-1.0]))
    with pytest.raises(mg.GeometryError, match=r"num_probes"):
        mg.densities.logdet_slq(lambda v: v, 3, jax.random.PRNGKey(0), num_probes=0)


def test_weight_norm_zero_column_is_an_error():
    """Before: a zero column gave eta = NaN silently."""
    wn = mg.weight_norm("W")
    with pytest.raises(mg.GeometryError, match=r"zero column.*units \[0\]"):
        wn.split({"W": jnp.array([[0.0, 1.0], [0.0, 2.0]])})
    with pytest.raises(mg.GeometryError, match=r"zero column"):
        wn.merge({"W": {"r": jnp.ones(2), "eta": jnp.array([[1.0, 0.0], [1.0, 0.0]])}})

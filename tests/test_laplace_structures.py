"""Laplace posteriors with full, K-FAC, EKFAC, diagonal and last-layer structure (issue 52, item 3).

One interface for every structure (``log_det_precision``, ``covariance``, ``covariance_mv``,
``marginal_variance``, ``sample``), the GLM predictive and MacKay's prior tuning for each.

Truths, all built here independently of the code under test: the dense structured precision (the
KFAC / EKFAC metric's ``dense`` matrix, the diagonal of the exact Fisher, the principal sub-block of
the exact Fisher at the flat positions computed by ``flat_index`` below) inverted with numpy in
float64; dense ``jax.jacfwd`` Jacobians for :math:`J\\Sigma J^\\top`; scipy's scalar minimizer on the
closed-form Laplace evidence :math:`\\log Z(\\alpha)` of the structured matrix's eigenvalues (numpy
``eigvalsh`` in float64) and its derivative. float64 to round-off, float32 with tolerances scaled
by ``eps`` and the conditioning.
"""

from __future__ import annotations

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from helpers import rng

import minigeo as mg

DTYPES = [jnp.float64, jnp.float32]
STRUCTURES = ["full", "kfac", "ekfac", "diag", "last"]
LAST = [(1, "W"), (1, "b")]  # the selectors of the last layer of `mlp`


def eps(dtype):
    return float(jnp.finfo(dtype).eps)


def mlp(seed=0, sizes=(3, 5, 4), n=12, dtype=jnp.float64):
    r = rng(seed)
    params = [
        {"W": jnp.asarray(r.normal(size=(m, k)) / np.sqrt(m), dtype), "b": jnp.asarray(0.3 * r.normal(size=k), dtype)}
        for m, k in zip(sizes[:-1], sizes[1:])
    ]
    X = jnp.asarray(r.normal(size=(n, sizes[0])), dtype)
    y = jnp.asarray(r.integers(0, sizes[-1], size=n))

    def model(p, x):
        h = jnp.tanh(x @ p[0]["W"] + p[0]["b"])
        return h @ p[1]["W"] + p[1]["b"]

    def nll(p):  # categorical, summed over the examples (the curvatures use reduction="sum")
        z = model(p, X)
        return -jnp.sum(jax.nn.log_softmax(z)[jnp.arange(n), y])

    return params, model, X, nll


def flat_index(params):
    """Each leaf's positions in the flattened (ravel_pytree) parameters, as a pytree of int arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    offsets = np.cumsum([0] + [x.size for x in leaves])
    return jax.tree_util.tree_unflatten(treedef, [np.arange(o, o + x.size).reshape(x.shape) for o, x in zip(offsets, leaves)])


def last_index(params):
    idx = flat_index(params)[1]
    return np.sort(np.concatenate([idx["W"].ravel(), idx["b"].ravel()]))


def curvature(which, model, params, X):
    if which in ("kfac", "ekfac"):
        return getattr(mg, which)(model, "categorical", params, batch=(X, None), reduction="sum")
    return mg.fisher(model, "categorical", batch=(X, None), reduction="sum")


def posterior(which, nll, params, M, alpha):
    if which == "last":
        return mg.laplace_posterior(nll, params, curvature=M, prior_precision=alpha, paths=LAST)
    structure = {"ekfac": "kfac"}.get(which, which)
    return mg.laplace_posterior(nll, params, curvature=M, prior_precision=alpha, structure=structure)


def structured_curvature(which, M, params):
    """The dense structured likelihood curvature in float64 (the truth), and the positions it covers."""
    p64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
    C = np.asarray(M.dense(p64), np.float64)
    if which == "diag":
        return np.diag(np.diag(C)), None
    if which == "last":
        S = last_index(params)
        return C[np.ix_(S, S)], S
    return C, None  # full: the Fisher; kfac / ekfac: the Kronecker-factored matrix


def structured_covariance(which, M, params, alpha):
    """The dense d x d covariance of the structured posterior (zeros outside a last-layer selection)."""
    C, S = structured_curvature(which, M, params)
    cov = np.linalg.inv(C + alpha * np.eye(len(C)))
    if S is None:
        return cov, C
    d = jax.flatten_util.ravel_pytree(params)[0].size
    full = np.zeros((d, d))
    full[np.ix_(S, S)] = cov
    return full, C


def flat64(tree):
    return np.asarray(jax.flatten_util.ravel_pytree(tree)[0], np.float64)


# ---------------------------------------------------------------------------
# (1) one interface: covariance, covariance_mv, marginal_variance, log_det_precision, sample
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", STRUCTURES)
def test_every_structure_has_one_interface_that_matches_the_dense_structured_posterior(which, dtype):
    params, model, X, nll = mlp(1, dtype=dtype)
    M = curvature(which, model, params, X)
    alpha = 0.5
    post = posterior(which, nll, params, M, alpha)
    assert int(post.status) == 0
    cov, C = structured_covariance(which, M, params, alpha)
    cond = np.linalg.cond(C + alpha * np.eye(len(C)))
    tol = 1e-12 if dtype == jnp.float64 else 10 * eps(dtype) * cond
    scale = np.abs(cov).max()
    got = np.asarray(post.covariance(), np.float64)
    assert got.shape == cov.shape and post.covariance().dtype == dtype
    np.testing.assert_allclose(got, cov, rtol=0, atol=tol * scale)
    # covariance_mv: Sigma v, shaped like the parameters, for random v
    r = rng(2)
    for _ in range(3):
        v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape), dtype), params)
        out = post.covariance_mv(v)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
        want = cov @ flat64(v)
        np.testing.assert_allclose(flat64(out), want, rtol=0, atol=tol * np.abs(want).max())
    # the marginal variances: diag Sigma, exactly 0 outside a selection
    mv = flat64(post.marginal_variance())
    np.testing.assert_allclose(mv, np.diag(cov), rtol=0, atol=tol * scale)
    if which == "last":
        outside = np.setdiff1d(np.arange(len(mv)), last_index(params))
        assert np.all(mv[outside] == 0) and np.all(flat64(post.covariance_mv(v))[outside] == 0)
    # log det of the precision
    logdet = np.linalg.slogdet(C + alpha * np.eye(len(C)))[1]
    np.testing.assert_allclose(float(post.log_det_precision()), logdet, rtol=0, atol=(tol + 1e-13) * len(C) * 10)
    # samples: pytrees with a leading axis; a last-layer sample moves the last layer only
    draws = post.sample(jax.random.PRNGKey(0), 3)
    assert [a.shape for a in jax.tree_util.tree_leaves(draws)] == [(3, *a.shape) for a in jax.tree_util.tree_leaves(params)]
    if which == "last":
        for a, b in zip(jax.tree_util.tree_leaves(draws[0]), jax.tree_util.tree_leaves(params[0])):
            assert np.all(np.asarray(a) == np.asarray(b)[None])
        assert np.all(np.asarray(draws[1]["W"]) != np.asarray(params[1]["W"])[None])


def test_last_layer_samples_have_the_sub_block_covariance():
    params, model, X, nll = mlp(3)
    M = curvature("full", model, params, X)
    post = posterior("last", nll, params, M, 0.5)
    n = 40_000
    draws = post.sample(jax.random.PRNGKey(4), n)
    steps = np.asarray(jax.vmap(lambda t: jax.flatten_util.ravel_pytree(t)[0])(draws)) - flat64(params)
    cov, _ = structured_covariance("last", M, params, 0.5)
    emp = steps.T @ steps / n
    assert np.abs(emp - cov).max() < 5 * np.sqrt(2.0 / n) * np.abs(np.diag(cov)).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_last_layer_is_the_principal_sub_block_of_the_exact_hessian_and_takes_sub_arrays(dtype):
    params, model, X, nll = mlp(5, dtype=dtype)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    H = np.asarray(jax.hessian(lambda q: nll(unravel(q)))(flat), np.float64)  # curvature=None: the Hessian
    S = last_index(params)
    alpha = 2.0
    post = mg.laplace_posterior(nll, params, prior_precision=alpha, paths=LAST)
    want = H[np.ix_(S, S)] + alpha * np.eye(len(S))
    tol = 1e-12 if dtype == jnp.float64 else 50 * eps(dtype)
    np.testing.assert_allclose(np.asarray(post.precision), want, rtol=0, atol=tol * np.abs(want).max())
    np.testing.assert_array_equal(np.asarray(post.selection), S)
    # a sub-array selector: row 2 of the output weights (the weights out of hidden unit 2)
    sub = mg.laplace_posterior(nll, params, prior_precision=alpha, paths=[((1, "W"), (2,))])
    S2 = flat_index(params)[1]["W"][2]
    np.testing.assert_array_equal(np.asarray(sub.selection), S2)
    want2 = H[np.ix_(S2, S2)] + alpha * np.eye(len(S2))
    np.testing.assert_allclose(np.asarray(sub.precision), want2, rtol=0, atol=tol * np.abs(want2).max())
    # a single leaf path, through the evidence too: d = |S|
    ev = mg.laplace_log_marginal_likelihood(nll, params, prior_precision=alpha, paths=[(1, "b")])
    assert ev.num_params == 4


# ---------------------------------------------------------------------------
# (2) the GLM predictive J Sigma J^T for every structure, K outputs and one, eager and under jit
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outputs", ["K", "scalar"])
@pytest.mark.parametrize("which", STRUCTURES)
def test_glm_predictive_is_j_sigma_jt_for_every_structure(which, outputs, dtype):
    params, model, X, nll = mlp(6, dtype=dtype)
    M = curvature(which, model, params, X)
    alpha = 0.5
    post = posterior(which, nll, params, M, alpha)
    f = model if outputs == "K" else (lambda p, x: model(p, x)[:, 1])
    Xt = jnp.asarray(rng(7).normal(size=(5, 3)), dtype)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    J = np.asarray(jax.jacfwd(lambda q: f(unravel(q), Xt))(flat), np.float64)  # (N, K, d) or (N, d)
    cov = np.asarray(post.covariance(), np.float64)  # the posterior's own dense Sigma
    want = np.einsum("nkd,de,nle->nkl", J, cov, J) if outputs == "K" else np.einsum("nd,de,ne->n", J, cov, J)
    # the truth also against the independently built structured covariance
    truth, C = structured_covariance(which, M, params, alpha)
    cond = np.linalg.cond(C + alpha * np.eye(len(C)))
    tol = 1e-12 if dtype == jnp.float64 else 10 * eps(dtype) * cond
    np.testing.assert_allclose(cov, truth, rtol=0, atol=tol * np.abs(truth).max())
    for pred in (mg.glm_predictive(f, post, Xt), jax.jit(lambda p, x: mg.glm_predictive(f, p, x))(post, Xt)):
        assert pred.covariance.shape == ((5, 4, 4) if outputs == "K" else (5,)) and pred.covariance.dtype == dtype
        np.testing.assert_allclose(np.asarray(pred.covariance, np.float64), want, rtol=0, atol=tol * np.abs(want).max())
        np.testing.assert_allclose(pred.mean, f(params, Xt), rtol=0, atol=tol)


@pytest.mark.parametrize("which", STRUCTURES)
def test_every_posterior_is_returned_from_jit_with_its_status(which):
    params, model, X, nll = mlp(8)
    M = curvature(which, model, params, X)
    eager = posterior(which, nll, params, M, 0.5)
    jitted = jax.jit(lambda p: posterior(which, nll, p, M, 0.5))(params)
    assert type(jitted) is type(eager) and int(jitted.status) == 0
    np.testing.assert_allclose(flat64(jitted.marginal_variance()), flat64(eager.marginal_variance()), rtol=1e-12)
    np.testing.assert_allclose(float(jitted.log_det_precision()), float(eager.log_det_precision()), rtol=1e-12)


# ---------------------------------------------------------------------------
# (3) prior tuning and evidence per structure against the closed form of the structured matrix
# ---------------------------------------------------------------------------
def _log_z(alpha, lam, s, value):
    d = len(lam)
    return -value - 0.5 * alpha * s + 0.5 * d * np.log(alpha) - 0.5 * np.sum(np.log(lam + alpha))


def _dlog_z(alpha, lam, s):
    return -0.5 * s + 0.5 * len(lam) / alpha - 0.5 * np.sum(1.0 / (lam + alpha))


def _tune(which, nll, params, M, **kw):
    if which == "last":
        return mg.optimize_prior_precision(nll, params, curvature=M, paths=LAST, **kw)
    return mg.optimize_prior_precision(nll, params, curvature=M, structure={"ekfac": "kfac"}.get(which, which), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", STRUCTURES)
def test_tuned_prior_precision_maximizes_the_structured_evidence(which, dtype):
    params, model, X, nll = mlp(9, dtype=dtype)
    M = curvature(which, model, params, X)
    res = _tune(which, nll, params, M)
    assert int(res.status) == 0
    C, S = structured_curvature(which, M, params)
    lam = np.maximum(np.linalg.eigvalsh(C), 0.0)  # every curvature here is PSD: clip numpy's round-off
    theta = flat64(params) if S is None else flat64(params)[S]
    s = float(theta @ theta)
    value = float(nll(jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)))
    best = scipy.optimize.minimize_scalar(lambda la: -_log_z(np.exp(la), lam, s, value), bracket=(-5.0, 3.0), tol=1e-14)
    a = float(res.prior_precision)
    tol = 1e-10 if dtype == jnp.float64 else 200 * eps(dtype)
    # brute force locates the maximum of a flat function to ~sqrt(eps) in alpha, exactly in value
    np.testing.assert_allclose(a, np.exp(best.x), rtol=max(tol, 1e-7))
    np.testing.assert_allclose(float(res.log_z), -best.fun, rtol=tol, atol=tol)
    # the root of d log Z / d alpha (closed form, bracketed): alpha to round-off
    root = scipy.optimize.brentq(lambda b: _dlog_z(b, lam, s), 1e-8, 1e8, xtol=1e-300, rtol=4 * np.finfo(float).eps)
    np.testing.assert_allclose(a, root, rtol=tol)
    # the stationarity condition d log Z / d alpha = 0 at the returned alpha, relative to its terms
    scale = 0.5 * s + 0.5 * len(lam) / a
    assert abs(_dlog_z(a, lam, s)) < 10 * tol * scale, (_dlog_z(a, lam, s), scale)
    assert 0 < float(res.effective_num_params) < len(lam)
    # the same evidence from the structured posterior of the joint at alpha
    d = len(lam)

    def joint(p):
        sel = jax.flatten_util.ravel_pytree(p)[0] if S is None else jax.flatten_util.ravel_pytree(p)[0][S]
        return nll(p) + 0.5 * a * jnp.sum(sel**2) - 0.5 * d * jnp.log(a / (2 * jnp.pi))

    kw = dict(paths=LAST) if which == "last" else dict(structure={"ekfac": "kfac"}.get(which, which))
    ev = mg.laplace_log_marginal_likelihood(joint, params, curvature=M, prior_precision=a, **kw)
    assert ev.num_params == d
    np.testing.assert_allclose(float(ev.log_z), float(res.log_z), rtol=tol, atol=tol * abs(value))
    # and the dense formula with the structured matrix
    want = -float(joint(jax.tree_util.tree_map(lambda t: t.astype(jnp.float64), params))) + 0.5 * d * np.log(
        2 * np.pi
    ) - 0.5 * np.linalg.slogdet(C + a * np.eye(d))[1]
    np.testing.assert_allclose(float(ev.log_z), want, rtol=tol, atol=tol * abs(value))


@pytest.mark.parametrize("which", STRUCTURES)
def test_prior_tuning_under_jit_reports_a_status(which):
    params, model, X, nll = mlp(10)
    M = curvature(which, model, params, X)
    eager = _tune(which, nll, params, M)
    jitted = jax.jit(lambda p: _tune(which, nll, p, M))(params)
    assert int(jitted.status) == 0
    np.testing.assert_allclose(float(jitted.prior_precision), float(eager.prior_precision), rtol=1e-12)
    stuck = jax.jit(lambda p: _tune(which, nll, p, M, max_iterations=2, init=1e3))(params)
    assert int(stuck.status) == int(mg.Status.MAX_ITERATIONS)


# ---------------------------------------------------------------------------
# (4) bad input raises a clear GeometryError
# ---------------------------------------------------------------------------
def test_structured_laplace_bad_inputs_raise():
    params, model, X, nll = mlp(11)
    F = curvature("full", model, params, X)
    K = curvature("kfac", model, params, X)
    for call in (
        lambda **kw: mg.laplace_posterior(nll, params, curvature=K, prior_precision=1.0, **kw),
        lambda **kw: mg.optimize_prior_precision(nll, params, curvature=K, **kw),
        lambda **kw: mg.laplace_log_marginal_likelihood(nll, params, curvature=K, prior_precision=1.0, **kw),
    ):
        with pytest.raises(mg.GeometryError, match="structure must be one of"):
            call(structure="kron")
        for structure in ("kfac", "diag"):
            with pytest.raises(mg.GeometryError, match="combines with structure='full' only"):
                call(structure=structure, paths=LAST)
        with pytest.raises(mg.GeometryError, match="no leaf at"):
            call(paths=[(2, "W")])
    with pytest.raises(mg.GeometryError, match="needs curvature=mg.kfac"):
        mg.optimize_prior_precision(nll, params, structure="kfac")
    with pytest.raises(mg.GeometryError, match="mg.kfac or mg.ekfac"):
        mg.optimize_prior_precision(nll, params, curvature=F, structure="kfac")
    with pytest.raises(mg.GeometryError, match="mg.kfac or mg.ekfac"):
        mg.laplace_log_marginal_likelihood(nll, params, curvature=F, prior_precision=1.0, structure="kfac")
    # a negative prior precision, for every structure
    for kw in (dict(structure="kfac"), dict(structure="diag"), dict(paths=LAST)):
        with pytest.raises(mg.GeometryError, match="prior_precision must be finite and >= 0"):
            mg.laplace_posterior(nll, params, curvature=K if kw.get("structure") == "kfac" else F, prior_precision=-1.0, **kw)
    # singular without a prior: the last layer of a one-example Fisher
    one = (params, model, X[:1], nll)
    F1 = curvature("full", one[1], params, one[2])
    with pytest.raises(mg.GeometryError, match="not a strict minimum"):
        mg.laplace_posterior(nll, params, curvature=F1, paths=LAST)
    status = jax.jit(lambda p: mg.laplace_posterior(nll, p, curvature=F1, paths=LAST).status)(params)
    assert int(status) == mg.Status.NOT_POSITIVE_DEFINITE
    # init <= 0, and the selected entries at the prior mean
    with pytest.raises(mg.GeometryError, match="init must be a positive"):
        mg.optimize_prior_precision(nll, params, curvature=K, structure="kfac", init=0.0)
    zero_last = [params[0], jax.tree_util.tree_map(jnp.zeros_like, params[1])]
    with pytest.raises(mg.GeometryError, match="equals the prior mean"):
        mg.optimize_prior_precision(nll, zero_last, curvature=F, paths=LAST)
    # a structured evidence with an option it does not support
    with pytest.raises(mg.GeometryError, match="only with method='dense'"):
        mg.laplace_log_marginal_likelihood(nll, params, curvature=F, prior_precision=1.0, paths=LAST, method="slq",
                                           key=jax.random.PRNGKey(0))
    # glm_predictive of something that is not a posterior; covariance_mv of a wrong shape
    with pytest.raises(mg.GeometryError, match="posterior must come from mg.laplace_posterior"):
        mg.glm_predictive(model, {"mean": params}, X)
    post = posterior("kfac", nll, params, K, 1.0)
    with pytest.raises(mg.GeometryError, match="shaped like the parameters"):
        post.covariance_mv(params[0])
    for which in ("diag", "last"):
        with pytest.raises(mg.GeometryError, match="shaped like the parameters"):
            posterior(which, nll, params, F, 1.0).covariance_mv(params[0])

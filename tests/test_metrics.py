"""Tests of minigeo.metrics against dense autodiff constructions, closed forms and transformation laws."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dense_jacobian, flatten, random_invertible, random_spd, rng

import minigeo as mg
from minigeo import reparam
from minigeo.metrics import dense as dense_metric

N, D_IN, HIDDEN, K = 6, 3, 5, 4


def mlp_problem(seed: int = 0):
    r = rng(seed)
    params = {
        "W1": jnp.asarray(r.normal(size=(D_IN, HIDDEN)) / np.sqrt(D_IN)),
        "b1": jnp.asarray(0.1 * r.normal(size=HIDDEN)),
        "W2": jnp.asarray(r.normal(size=(HIDDEN, K)) / np.sqrt(HIDDEN)),
        "b2": jnp.asarray(0.1 * r.normal(size=K)),
    }
    X = jnp.asarray(r.normal(size=(N, D_IN)))
    labels = jnp.asarray(r.integers(0, K, size=N))
    targets = jnp.asarray(r.normal(size=(N, K)))

    def model(p):
        return jnp.tanh(X @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]

    return params, model, labels, targets


def jacobian_rows(model, params):
    """Dense Jacobian of the flattened outputs w.r.t. the flattened params (jax.jacrev), shape (N*K, d)."""
    return np.asarray(dense_jacobian(model, params))


def random_tangent(params, seed):
    r = rng(seed)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(r.normal(size=x.shape)), params)


def cross_entropy(labels):
    return lambda z: jnp.mean(mg.categorical_likelihood().nll(z, labels))


def all_metrics(params, model, labels, targets):
    d = flatten(params).size
    r = rng(99)
    G_fixed = random_spd(r, d)
    return {
        "euclidean": mg.euclidean(),
        "diagonal": mg.metrics.diagonal(jax.tree_util.tree_map(lambda x: 1.0 + x**2, params)),
        "dense": dense_metric(lambda p: G_fixed),
        "pullback": mg.pullback(model, mg.euclidean()),
        "ggn": mg.ggn(model, cross_entropy(labels)),
        "fisher": mg.fisher(model, "categorical"),
        "fisher_gauss": mg.fisher(model, mg.gaussian_likelihood(0.5)),
        "mc_fisher": mg.fisher(model, "categorical", mc_samples=3, key=jax.random.PRNGKey(0)),
        "empirical_fisher": mg.empirical_fisher(model, lambda z: mg.categorical_likelihood().nll(z, labels)),
    }


@pytest.mark.parametrize(
    "name",
    [
        "euclidean",
        "diagonal",
        "dense",
        "pullback",
        "ggn",
        "fisher",
        "fisher_gauss",
        "mc_fisher",
        "empirical_fisher",
    ],
)
def test_mv_equals_dense_times_v_and_is_symmetric(name):
    params, model, labels, targets = mlp_problem()
    metric = all_metrics(params, model, labels, targets)[name]
    G = np.asarray(metric.dense(params))
    np.testing.assert_allclose(G, G.T, atol=1e-12)
    for seed in range(3):
        v = random_tangent(params, seed)
        np.testing.assert_allclose(flatten(metric.mv(params, v)), G @ flatten(v), rtol=1e-10, atol=1e-12)
    # positive semi-definite
    assert np.linalg.eigvalsh(G).min() > -1e-10


def test_pullback_matches_jacobian_construction_and_pushforward_identity():
    params, model, _, _ = mlp_problem(1)
    J = jacobian_rows(model, params)
    Gz = np.asarray(random_spd(rng(3), N * K))
    out_metric = lambda z, u: jnp.reshape(Gz @ jnp.ravel(u), u.shape)
    metric = mg.pullback(model, mg.Metric(out_metric))
    np.testing.assert_allclose(metric.dense(params), J.T @ Gz @ J, rtol=1e-9, atol=1e-12)
    # <f_* u, f_* v>_{G_z} = <u, v>_{f^* G_z}
    u, v = random_tangent(params, 4), random_tangent(params, 5)
    fu, fv = mg.pushforward(model, params, u), mg.pushforward(model, params, v)
    np.testing.assert_allclose(jnp.ravel(fu) @ Gz @ jnp.ravel(fv), metric.inner(params, u, v), rtol=1e-10)


def test_ggn_matches_jacobian_and_output_hessian():
    params, model, labels, targets = mlp_problem(2)
    loss = lambda z: jnp.mean(jnp.sum(jnp.sin(z) ** 2 + (z - targets) ** 4, axis=-1))  # arbitrary smooth loss
    J = jacobian_rows(model, params)
    z = model(params)
    H = np.asarray(jax.hessian(lambda f: loss(f.reshape(z.shape)))(jnp.ravel(z)))
    np.testing.assert_allclose(mg.ggn(model, loss).dense(params), J.T @ H @ J, rtol=1e-9, atol=1e-12)


def test_fisher_matches_closed_form_and_ggn():
    params, model, labels, targets = mlp_problem(3)
    J = jacobian_rows(model, params)
    p = np.asarray(jax.nn.softmax(model(params), axis=-1))
    blocks = [np.diag(pi) - np.outer(pi, pi) for pi in p]
    F_out = np.zeros((N * K, N * K))
    for n, b in enumerate(blocks):
        F_out[n * K : (n + 1) * K, n * K : (n + 1) * K] = b
    F_exact = J.T @ F_out @ J / N
    F = mg.fisher(model, "categorical").dense(params)
    np.testing.assert_allclose(F, F_exact, rtol=1e-9, atol=1e-12)
    # GGN of the mean cross-entropy equals the Fisher (softmax is the canonical link)
    np.testing.assert_allclose(mg.ggn(model, cross_entropy(labels)).dense(params), F, rtol=1e-9, atol=1e-12)
    # Gaussian with fixed sigma: Fisher = J^T J / (sigma^2 N) = GGN of the mean Gaussian NLL
    sigma = 0.5
    Fg = mg.fisher(model, mg.gaussian_likelihood(sigma)).dense(params)
    np.testing.assert_allclose(Fg, J.T @ J / sigma**2 / N, rtol=1e-9, atol=1e-12)
    gauss_nll = lambda z: jnp.mean(mg.gaussian_likelihood(sigma).nll(z, targets))
    np.testing.assert_allclose(mg.ggn(model, gauss_nll).dense(params), Fg, rtol=1e-9, atol=1e-12)
    # reduction="sum" is N times larger
    np.testing.assert_allclose(mg.fisher(model, reduction="sum").dense(params), N * F, rtol=1e-10)


def test_fisher_is_the_hessian_of_the_kl_bregman_divergence():
    """Pullback of the Hessian of the Bregman divergence of logsumexp (= KL between softmaxes) is the Fisher."""
    params, model, labels, _ = mlp_problem(4)

    def bregman_hessian_mv(z0, u):
        def breg(z):
            phi = lambda w: jnp.sum(jax.nn.logsumexp(w, axis=-1))
            return (phi(z) - phi(z0) - jnp.vdot(jax.grad(phi)(z0), z - z0)) / N

        return jax.jvp(jax.grad(breg), (z0,), (u,))[1]

    G = mg.pullback(model, mg.Metric(bregman_hessian_mv)).dense(params)
    np.testing.assert_allclose(G, mg.fisher(model).dense(params), rtol=1e-9, atol=1e-12)


def test_empirical_fisher_matches_per_example_gradients():
    params, model, labels, _ = mlp_problem(5)
    per_example = lambda p: mg.categorical_likelihood().nll(model(p), labels)
    grads = np.asarray(dense_jacobian(per_example, params))  # (N, d)
    EF = mg.empirical_fisher(model, lambda z: mg.categorical_likelihood().nll(z, labels)).dense(params)
    np.testing.assert_allclose(EF, grads.T @ grads / N, rtol=1e-9, atol=1e-12)
    # and it differs from the Fisher away from a perfect fit
    assert np.linalg.norm(EF - mg.fisher(model).dense(params)) > 1e-3 * np.linalg.norm(EF)


def test_mc_fisher_converges_to_exact():
    """Monte-Carlo Fisher error shrinks like 1/sqrt(S): relative Frobenius error < 0.1 at S = 4000.

    The statistical tolerance: at S = 4000 the standard error of each entry is ~1.5 % of the
    Fisher's scale for this problem; 0.1 leaves a wide margin, and the error at S = 4000 must also
    be below the error at S = 40 (seeded, deterministic).
    """
    params, model, _, _ = mlp_problem(6)
    F = np.asarray(mg.fisher(model).dense(params))
    errs = []
    for s in (40, 4000):
        F_mc = np.asarray(mg.fisher(model, mc_samples=s, key=jax.random.PRNGKey(1)).dense(params))
        errs.append(np.linalg.norm(F_mc - F) / np.linalg.norm(F))
    assert errs[1] < 0.1
    assert errs[1] < errs[0]


def test_gaussian_mc_fisher_converges():
    params, model, _, _ = mlp_problem(7)
    lik = mg.gaussian_likelihood(2.0)
    F = np.asarray(mg.fisher(model, lik).dense(params))
    F_mc = np.asarray(mg.fisher(model, lik, mc_samples=4000, key=jax.random.PRNGKey(2)).dense(params))
    assert np.linalg.norm(F_mc - F) / np.linalg.norm(F) < 0.1


# ---------------------------------------------------------------------------
# automatic transformation under autodiff (paper 000, Sec. 3.4)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["affine", "elementwise"])
def test_ggn_transforms_automatically_and_diagonal_only_elementwise(kind):
    params, model, labels, _ = mlp_problem(8)
    d = flatten(params).size
    r = rng(10)
    if kind == "affine":
        phi = reparam.affine(random_invertible(r, d))
    else:
        scales = jax.tree_util.tree_map(lambda x: jnp.asarray(r.uniform(0.5, 3.0, size=x.shape)), params)
        phi = reparam.scale(scales)
    psi = phi.forward(params)
    loss = cross_entropy(labels)
    G_theta = mg.ggn(model, loss).dense(params)
    G_psi_autodiff = mg.ggn(lambda q: model(phi.inverse(q)), loss).dense(psi)
    # The GGN of this overparametrized net is only positive semi-definite, so use the bilinear rule
    # (the same formula as the metric rule, without the positive-definiteness check).
    G_psi_rule = mg.transform_bilinear(phi, params, G_theta)
    np.testing.assert_allclose(G_psi_autodiff, G_psi_rule, rtol=1e-7, atol=1e-10)
    # the diagonal approximation transforms automatically only for element-wise maps
    diag_autodiff = np.diag(np.diag(G_psi_autodiff))
    diag_rule = np.asarray(mg.transform_bilinear(phi, params, jnp.diag(jnp.diag(G_theta))))
    gap = np.linalg.norm(diag_autodiff - diag_rule) / np.linalg.norm(diag_rule)
    if kind == "elementwise":
        assert gap < 1e-10
    else:
        assert gap > 1e-2


def test_empirical_fisher_transforms_automatically():
    params, model, labels, _ = mlp_problem(9)
    phi = reparam.scale(2.5)
    per_ex = lambda z: mg.categorical_likelihood().nll(z, labels)
    EF = mg.empirical_fisher(model, per_ex).dense(params)
    EF_psi = mg.empirical_fisher(lambda q: model(phi.inverse(q)), per_ex).dense(phi.forward(params))
    np.testing.assert_allclose(EF_psi, np.asarray(EF) / 2.5**2, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------
# damping, solves, jit/vmap
# ---------------------------------------------------------------------------


def test_damping_and_solves():
    params, model, labels, _ = mlp_problem(11)
    G = mg.ggn(model, cross_entropy(labels))
    d = flatten(params).size
    Gd = G.with_damping(0.1)
    np.testing.assert_allclose(
        Gd.dense(params), np.asarray(G.dense(params)) + 0.1 * np.eye(d), rtol=1e-10, atol=1e-12
    )
    rhs = random_tangent(params, 12)
    exact = np.linalg.solve(np.asarray(Gd.dense(params)), flatten(rhs))
    np.testing.assert_allclose(flatten(Gd.solve(params, rhs, method="dense")), exact, rtol=1e-8)
    np.testing.assert_allclose(flatten(Gd.solve(params, rhs, tol=1e-12)), exact, rtol=1e-6)
    # the undamped GGN of an overparametrized net (44 params, N*(K-1) = 18 output dofs) is singular
    with pytest.raises(mg.GeometryError, match=r"singular.*damping"):
        G.solve(params, rhs, method="dense")
    with pytest.raises(mg.GeometryError, match=r"did not converge.*damping"):
        G.solve(params, rhs)
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):
        G.check_positive_definite(params)
    Gd.check_positive_definite(params)


def test_metric_as_metriclike_in_coords():
    params, model, labels, _ = mlp_problem(13)
    G = mg.ggn(model, cross_entropy(labels)).with_damping(0.5)
    omega = random_tangent(params, 14)
    np.testing.assert_allclose(
        flatten(mg.sharp(G.at(params), omega, tol=1e-12)),
        flatten(G.solve(params, omega, tol=1e-12)),
        rtol=1e-6,
    )


def test_jit_and_vmap():
    params, model, labels, _ = mlp_problem(15)
    for metric in [
        mg.ggn(model, cross_entropy(labels)),
        mg.fisher(model),
        mg.fisher(model, mc_samples=2, key=jax.random.PRNGKey(0)),
    ]:
        v = random_tangent(params, 16)
        eager = metric.mv(params, v)
        jitted = jax.jit(metric.mv)(params, v)
        np.testing.assert_allclose(flatten(jitted), flatten(eager), rtol=1e-12)
        vs = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[random_tangent(params, s) for s in range(3)])
        batched = jax.vmap(metric.mv, in_axes=(None, 0))(params, vs)
        np.testing.assert_allclose(
            flatten(jax.tree_util.tree_map(lambda x: x[1], batched)),
            flatten(metric.mv(params, random_tangent(params, 1))),
            rtol=1e-12,
        )


def test_float32_products():
    params, model, labels, _ = mlp_problem(17)
    p32 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    v32 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), random_tangent(params, 18))
    out = mg.fisher(lambda p: model(p).astype(jnp.float32)).mv(p32, v32)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(out))


# ---------------------------------------------------------------------------
# error paths
# ---------------------------------------------------------------------------


def test_metric_errors():
    params, model, labels, _ = mlp_problem(19)
    with pytest.raises(mg.GeometryError, match=r"<= 0.*damping"):
        mg.metrics.diagonal(jax.tree_util.tree_map(jnp.zeros_like, params)).mv(params, params)
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.metrics.diagonal({"W1": jnp.ones((D_IN, HIDDEN))}).mv(params, params)
    with pytest.raises(mg.GeometryError, match=r"44x44 matrix is needed"):
        dense_metric(lambda p: jnp.eye(3)).mv(params, params)
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.euclidean().mv(params, {"W1": params["W1"]})
    with pytest.raises(mg.GeometryError, match=r"unknown likelihood"):
        mg.fisher(model, "poisson")
    with pytest.raises(mg.GeometryError, match=r"leading batch axis"):
        mg.fisher(lambda p: jnp.sum(model(p))).mv(params, params)
    with pytest.raises(mg.GeometryError, match=r"one loss per example"):
        mg.empirical_fisher(model, lambda z: jnp.mean(z)).mv(params, params)
    with pytest.raises(mg.GeometryError, match=r"PRNG key"):
        mg.fisher(model, mc_samples=10)
    with pytest.raises(mg.GeometryError, match=r"reduction"):
        mg.fisher(model, reduction="max").mv(params, params)
    with pytest.raises(mg.GeometryError, match=r"sigma must be > 0"):
        mg.gaussian_likelihood(0.0)
    with pytest.raises(mg.GeometryError, match=r"damping must be >= 0"):
        mg.euclidean().with_damping(-1.0)
    with pytest.raises(mg.GeometryError, match=r"callable mv_fn"):
        mg.Metric("not callable")
    with pytest.raises(mg.GeometryError, match=r"method must be"):
        mg.euclidean().solve(params, params, method="lu")
    with pytest.raises(mg.GeometryError, match=r"max_size=10"):
        mg.euclidean().dense(params, max_size=10)
    with pytest.raises(mg.GeometryError, match=r"pullback: metric= got a str"):
        mg.pullback(model, "euclidean")
    with pytest.raises(mg.GeometryError, match=r"mg.Metric\(lambda params, v"):
        mg.pullback(model, lambda z, u: u)
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.euclidean().solve(params, jax.tree_util.tree_map(lambda x: x * jnp.nan, params))


# ---------------------------------------------------------------------------
# no caching on user closures; one meaning of damping; silent failures
# ---------------------------------------------------------------------------


def test_dense_reads_current_state():
    """Before the fix the lru_cache on the metric returned the stale matrix."""
    state = {"scale": 1.0}
    G = dense_metric(lambda p: state["scale"] * jnp.eye(2))
    np.testing.assert_allclose(G.dense(jnp.zeros(2)), np.eye(2))
    state["scale"] = 5.0
    np.testing.assert_allclose(G.dense(jnp.zeros(2)), 5.0 * np.eye(2))


def test_dense_does_not_keep_metrics_alive():
    """A training loop making a metric per step must not grow memory: nothing keeps the closures alive."""
    import gc
    import weakref

    refs = []
    for step in range(20):
        data = jnp.full((3,), float(step))
        mv = lambda p, v, data=data: jax.tree_util.tree_map(lambda a: (1.0 + jnp.sum(data) ** 2) * a, v)
        refs.append(weakref.ref(mv))
        mg.Metric(mv, "per-step").dense(jnp.zeros(2))
        del mv
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


DAMPINGS = [0.25, jnp.asarray(0.25), np.float32(0.25), np.float64(0.25)]


@pytest.mark.parametrize("damping", DAMPINGS, ids=["float", "jax0d", "np.float32", "np.float64"])
def test_damping_types_and_meaning(damping):
    params, model, labels, _ = mlp_problem(21)
    G = mg.ggn(model, cross_entropy(labels))
    d = flatten(params).size
    G_dense = np.asarray(G.dense(params))
    np.testing.assert_allclose(G.with_damping(damping).dense(params), G_dense + 0.25 * np.eye(d), rtol=1e-6, atol=1e-7)
    # with_damping replaces, it does not accumulate
    assert float(G.with_damping(3.0).with_damping(damping).damping) == 0.25
    # natural_gradient adds damping to the metric's own operator: equal to with_damping on an undamped G
    g = random_tangent(params, 22)
    a = mg.natural_gradient(G, params, g, damping=damping, tol=1e-12)
    b = G.with_damping(damping).solve(params, g, tol=1e-12)
    np.testing.assert_allclose(flatten(a), flatten(b), rtol=1e-7)
    np.testing.assert_allclose(flatten(a), np.linalg.solve(G_dense + 0.25 * np.eye(d), flatten(g)), rtol=1e-6)
    c = mg.natural_gradient(G.with_damping(0.5), params, g, damping=damping, solver="dense")
    np.testing.assert_allclose(flatten(c), np.linalg.solve(G_dense + 0.75 * np.eye(d), flatten(g)), rtol=1e-8)
    # traced damping under jit (no value check, no boolean conversion)
    jitted = jax.jit(lambda lam: mg.natural_gradient(G, params, g, damping=lam, tol=1e-12))(jnp.asarray(damping))
    np.testing.assert_allclose(flatten(jitted), flatten(a), rtol=1e-8)
    jd = jax.jit(lambda lam: G.with_damping(lam).dense(params))(jnp.asarray(damping))
    np.testing.assert_allclose(jd, G_dense + 0.25 * np.eye(d), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [-0.1, jnp.asarray(-0.1), np.float32(-0.1), float("nan"), jnp.asarray(jnp.nan)])
def test_negative_or_nan_damping_refused(bad):
    G = mg.euclidean()
    with pytest.raises(mg.GeometryError, match=r"damping must be >= 0"):
        G.with_damping(bad)
    with pytest.raises(mg.GeometryError, match=r"damping must be >= 0"):
        mg.natural_gradient(G, jnp.ones(2), jnp.ones(2), damping=bad)
    with pytest.raises(mg.GeometryError, match=r"damping must be >= 0"):
        mg.sharp(jnp.eye(2), jnp.ones(2), damping=bad)


def test_metric_silent_failures_are_errors():
    with pytest.raises(mg.GeometryError, match=r"batch is empty"):  # was ZeroDivisionError
        mg.fisher(lambda w: jnp.zeros((0, 2)) @ jnp.diag(w)).dense(jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"batch is empty"):
        mg.empirical_fisher(lambda w: jnp.zeros((0, 2)) @ jnp.diag(w), lambda z: jnp.sum(z, -1)).mv(
            jnp.ones(2), jnp.ones(2)
        )
    nonsym = dense_metric(lambda p: jnp.array([[1.0, 0.5], [0.0, 1.0]]))
    for call in (
        lambda: nonsym.mv(jnp.zeros(2), jnp.ones(2)),
        lambda: nonsym.solve(jnp.zeros(2), jnp.ones(2)),
        lambda: nonsym.solve(jnp.zeros(2), jnp.ones(2), method="dense"),
    ):
        with pytest.raises(mg.GeometryError, match=r"not symmetric: max \|G - G\^T\| = 0.5"):
            call()
    X = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.5, 2.0]])
    G = mg.ggn(lambda w: X @ w, lambda z: 0.5 * jnp.sum(z**2))
    with pytest.raises(mg.GeometryError, match=r"dtype int.*floating point"):  # was TypeError from jvp
        G.dense(jnp.array([1, 2]))
    with pytest.raises(mg.GeometryError, match=r"empty"):
        G.dense(jnp.zeros(0))
    with pytest.raises(mg.GeometryError, match=r"params contains 1 non-finite"):
        G.dense(jnp.array([jnp.nan, 1.0]))
    with pytest.raises(mg.GeometryError, match=r"params contains 1 non-finite"):
        G.solve(jnp.array([jnp.nan, 1.0]), jnp.ones(2))
    # lists of numbers are converted (was TypeError: '@' with a list)
    np.testing.assert_allclose(G.dense([1.0, 2.0]), X.T @ X, rtol=1e-12)
    np.testing.assert_allclose(G.mv([1.0, 2.0], [1.0, 0.0]), X.T @ X[:, 0], rtol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_dense_and_solve_float32(dtype):
    """Dense metric and both solvers in each dtype; float32 metrics built by products pass the symmetry check."""
    params, model, labels, _ = mlp_problem(23)
    p = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    G = mg.ggn(lambda q: model(q).astype(dtype), cross_entropy(labels)).with_damping(0.5)
    Gd = np.asarray(G.dense(p), np.float64)
    G64 = np.asarray(mg.ggn(model, cross_entropy(labels)).with_damping(0.5).dense(params))
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(Gd, G64, atol=100 * eps * np.abs(G64).max())
    rhs = jax.tree_util.tree_map(lambda x: x.astype(dtype), random_tangent(params, 24))
    exact = np.linalg.solve(G64, np.asarray(flatten(rhs), np.float64))
    cond = np.linalg.cond(G64)
    for method in ("dense", "cg"):
        x = G.solve(p, rhs, method=method, tol=10 * eps)
        err = np.abs(np.asarray(flatten(x), np.float64) - exact).max() / np.abs(exact).max()
        assert err < 100 * eps * cond, (method, err)


# ---------------------------------------------------------------------------
# one metric type: as_metric, and a Metric accepted by the matrix-field functions
# ---------------------------------------------------------------------------
def _polar(x):
    return jnp.diag(jnp.array([1.0, 0.5 + x[0] ** 2, 2.0 + jnp.sin(x[1])]))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_as_metric_every_kind_gives_the_same_field(dtype):
    x = jnp.asarray([1.3, 0.4, -0.2], dtype)
    v = jnp.asarray([0.3, -1.0, 2.0], dtype)
    G = np.asarray(_polar(x))
    M = mg.metrics.as_metric(_polar, kind="matrix_field")
    np.testing.assert_allclose(M.dense(x), G, rtol=10 * jnp.finfo(dtype).eps)
    np.testing.assert_allclose(mg.metrics.as_metric(jnp.asarray(G, dtype)).mv(x, v), G @ np.asarray(v), rtol=1e-6)
    P = mg.metrics.as_metric(lambda p, u: _polar(p) @ u, kind="product")
    np.testing.assert_allclose(P.mv(x, v), G @ np.asarray(v), rtol=1e-6)
    O = mg.metrics.as_metric(lambda u: jnp.asarray(G, dtype) @ u, kind="operator")
    np.testing.assert_allclose(O.dense(x), G, rtol=1e-6)
    assert mg.metrics.as_metric(M) is M
    np.testing.assert_allclose(mg.metrics.as_metric(None).mv(x, v), v)


def test_as_metric_refuses_ambiguous_or_bad_input():
    with pytest.raises(mg.GeometryError, match="ambiguous"):
        mg.metrics.as_metric(_polar)
    with pytest.raises(mg.GeometryError, match="kind must be"):
        mg.metrics.as_metric(_polar, kind="field")
    with pytest.raises(mg.GeometryError, match="square"):
        mg.metrics.as_metric(jnp.ones((2, 3)))
    with pytest.raises(mg.GeometryError, match="symmetric"):
        mg.metrics.as_metric(jnp.array([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(mg.GeometryError, match="cannot make a metric"):
        mg.metrics.as_metric("fisher")


def test_matrix_field_functions_accept_a_metric():
    """christoffel_symbols, riemannian_hessian, hessian_endomorphism, log_volume_element,
    log_density_wrt_volume, the Laplace evidence and gram_matrix give the same with a dense metric
    (its matrix differentiated directly) and with a matrix-free Metric of the same products (its
    matrix built from d products)."""
    x = jnp.asarray([1.3, 0.4, -0.2])
    M = mg.metrics.as_metric(_polar, kind="matrix_field")
    _polar_products = mg.Metric(lambda p, v: _polar(p) @ v, "polar (products)")
    f = lambda y: jnp.sum(jnp.sin(y) * y**2)
    np.testing.assert_allclose(mg.christoffel_symbols(M, x), mg.christoffel_symbols(_polar_products, x), rtol=1e-12)
    np.testing.assert_allclose(mg.riemannian_hessian(f, M, x), mg.riemannian_hessian(f, _polar_products, x), rtol=1e-12)
    np.testing.assert_allclose(mg.hessian_endomorphism(f, M, x), mg.hessian_endomorphism(f, _polar_products, x), rtol=1e-12)
    np.testing.assert_allclose(mg.log_volume_element(M, x), mg.log_volume_element(_polar_products, x), rtol=1e-12)
    log_q = lambda y: -0.5 * jnp.sum(y**2)
    np.testing.assert_allclose(
        mg.log_density_wrt_volume(log_q, M)(x), mg.log_density_wrt_volume(log_q, _polar_products)(x), rtol=1e-12
    )
    loss = lambda y: 0.5 * jnp.sum((y - 1.0) ** 2 * jnp.arange(1.0, 4.0))
    ev_M = mg.laplace_log_marginal_likelihood(loss, x, metric=M)
    ev_f = mg.laplace_log_marginal_likelihood(loss, x, metric=_polar_products)
    np.testing.assert_allclose(ev_M.log_z, ev_f.log_z, rtol=1e-12)
    phi = lambda xi: jnp.array([jnp.sin(2 * xi[0]), jnp.sin(xi[0]), xi[1]])
    np.testing.assert_allclose(
        mg.gram_matrix(phi, M, jnp.array([0.3, 0.1])), mg.gram_matrix(phi, _polar_products, jnp.array([0.3, 0.1])), rtol=1e-12
    )

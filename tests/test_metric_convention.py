"""One way to pass a metric (issue 30, item 5).

Every function that takes a metric field reads ``metric=`` the same way: a :class:`Metric`,
``None`` (Euclidean) or a constant square matrix.  A bare callable (``x -> G(x)`` or ``v -> G v``?)
or a pytree of weights (a diagonal?) is refused with the constructor to use.  Each accepted form
is checked against an independent truth: the dense formula, or the same metric written another way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minigeo as mg

DTYPES = [jnp.float64, jnp.float32]


def _polar_matrix(x):
    return jnp.diag(jnp.stack([jnp.ones_like(x[0]), x[0] ** 2]))


def _field_calls(metric):
    """Every public function that takes a metric field, called with ``metric`` on a small problem."""
    x = jnp.array([2.0, 0.3])
    f = lambda q: q[0] * jnp.cos(q[1]) + 0.3 * q[1] ** 2
    key = jax.random.PRNGKey(0)
    return {
        "christoffel_symbols": lambda: mg.christoffel_symbols(metric, x),
        "riemannian_hessian": lambda: mg.riemannian_hessian(f, metric, x),
        "hessian_endomorphism": lambda: mg.hessian_endomorphism(f, metric, x),
        "gram_matrix": lambda: mg.gram_matrix(lambda p: p, metric, x),
        "log_volume_element": lambda: mg.log_volume_element(metric, x),
        "log_density_wrt_volume": lambda: mg.log_density_wrt_volume(lambda q: -jnp.sum(q**2), metric)(x),
        "laplace_log_marginal_likelihood": lambda: mg.laplace_log_marginal_likelihood(
            lambda q: 0.5 * jnp.sum((q - x) ** 2 * jnp.array([1.0, 3.0])), x, metric=metric
        ),
        "transform_metric_field": lambda: mg.transform_metric_field(mg.reparam.log(), metric),
        "pullback": lambda: mg.pullback(lambda p: p, metric),
        "trace_estimate": lambda: mg.trace_estimate(f, x, key, metric=metric),
        "top_eigenvalues": lambda: mg.top_eigenvalues(f, x, key, metric=metric, rtol=None, num_iterations=2),
        "operator.trace_estimate": lambda: mg.hessian_operator(lambda p, b: f(p) * jnp.mean(b), x).trace_estimate(
            key, [jnp.ones(2)], metric=metric
        ),
        "operator.top_eigenvalues": lambda: mg.hessian_operator(lambda p, b: f(p) * jnp.mean(b), x).top_eigenvalues(
            key, [jnp.ones(2)], metric=metric, rtol=None, num_iterations=2
        ),
    }


@pytest.mark.parametrize("name", sorted(_field_calls(None)))
@pytest.mark.parametrize(
    "bad, says",
    [
        (_polar_matrix, "a callable"),
        (lambda v: 2.0 * v, "a callable"),
        (jnp.array([1.0, 4.0]), "an array of shape (2,)"),
        ({"w": jnp.ones(2)}, "a dict"),
    ],
    ids=["matrix-field", "product", "weights", "dict"],
)
def test_every_field_function_refuses_what_it_would_have_to_guess(name, bad, says):
    with pytest.raises(mg.GeometryError) as err:
        _field_calls(bad)[name]()
    message = str(err.value)
    assert says in message and "mg.dense_metric(lambda x: G(x))" in message and "mg.metrics.diagonal(w)" in message


@pytest.mark.parametrize("dtype", DTYPES)
def test_metric_matrix_and_dense_metric_agree_with_the_closed_form(dtype):
    # polar coordinates of the Euclidean plane: Gamma^r_aa = -r, Gamma^a_ra = 1/r, log sqrt det G = log r
    x = jnp.array([2.0, 0.3], dtype=dtype)
    polar = mg.dense_metric(_polar_matrix)
    Gamma = mg.christoffel_symbols(polar, x)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(Gamma[0, 1, 1], -2.0, rtol=10 * eps)
    np.testing.assert_allclose(Gamma[1, 0, 1], 0.5, rtol=10 * eps)
    np.testing.assert_allclose(mg.log_volume_element(polar, x), np.log(2.0), rtol=10 * eps)
    # the same field built by transforming the Euclidean metric (None, a matrix, a Metric): one answer
    for euclid in (None, jnp.eye(2, dtype=dtype), mg.euclidean(), mg.dense_metric(jnp.eye(2, dtype=dtype))):
        moved = mg.transform_metric_field(mg.reparam.polar(), euclid)
        assert isinstance(moved, mg.Metric)
        np.testing.assert_allclose(moved.dense(x), _polar_matrix(x), rtol=100 * eps, atol=100 * eps)
        np.testing.assert_allclose(mg.christoffel_symbols(moved, x), Gamma, rtol=1e3 * eps, atol=1e3 * eps)
    # a constant matrix is the constant field: no Christoffel term, so the Riemannian Hessian is the Hessian
    f = lambda q: jnp.sum(jnp.sin(q) * q)
    for constant in (None, 3.0 * jnp.eye(2, dtype=dtype), mg.dense_metric(3.0 * jnp.eye(2, dtype=dtype))):
        np.testing.assert_allclose(mg.riemannian_hessian(f, constant, x), mg.hessian(f, x), rtol=10 * eps)
        assert float(jnp.max(jnp.abs(mg.christoffel_symbols(constant, x)))) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_diagonal_metric_is_inverted_elementwise_exactly(dtype):
    # E = G^{-1} H with H = diag(h) and G = diag(w): tr E = sum h / w, eigenvalues h / w (no CG involved)
    h = jnp.array([1.0, 2.0, 3.0, 5.0], dtype=dtype)
    w = jnp.array([2.0, 0.5, 3.0, 1.25], dtype=dtype)
    f = lambda q: 0.5 * jnp.sum(h * q**2)
    x = jnp.ones(4, dtype=dtype)
    key = jax.random.PRNGKey(3)
    G = mg.metrics.diagonal(w)
    est, se = mg.trace_estimate(f, x, key, metric=G, num_probes=4)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(est, float(jnp.sum(h / w)), rtol=10 * eps)  # Rademacher probes: exact, se 0
    assert float(se) <= 10 * eps * float(jnp.sum(h / w))
    top = mg.top_eigenvalues(f, x, key, k=2, metric=G)
    np.testing.assert_allclose(top, [4.0, 4.0], rtol=1e-2)  # h / w = (0.5, 4, 1, 4): a double eigenvalue
    # damping is added to the weights: (w + lambda)
    est_damped, _ = mg.trace_estimate(f, x, key, metric=G.with_damping(0.5), num_probes=4)
    np.testing.assert_allclose(est_damped, float(jnp.sum(h / (w + 0.5))), rtol=10 * eps)
    # the operator method reads the metric the same way
    op = mg.hessian_operator(lambda q, b: f(q) * jnp.mean(b), x)
    est_op, _ = op.trace_estimate(key, [jnp.ones(3, dtype=dtype)], metric=G, num_probes=4)
    np.testing.assert_allclose(est_op, est, rtol=10 * eps)
    # the weights are checked eagerly
    with pytest.raises(mg.GeometryError, match="<= 0"):
        mg.trace_estimate(f, x, key, metric=mg.metrics.diagonal(-w))


def test_bare_callables_keep_their_one_meaning_in_the_pointwise_rules():
    # at one point a bare callable is a linear map v -> G v: the same answer as the matrix and the Metric
    G = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    v, w = jnp.array([1.0, -2.0]), jnp.array([0.3, 0.7])
    as_map, as_metric = (lambda u: G @ u), mg.dense_metric(G)
    theta = jnp.array([0.4, 1.3])
    for form, kw in ((G, {}), (as_map, {}), (as_metric, {"at": theta})):
        np.testing.assert_allclose(mg.inner(form, v, w, **kw), v @ G @ w, rtol=1e-12)
        np.testing.assert_allclose(mg.flat(form, v, **kw), G @ v, rtol=1e-12)
        np.testing.assert_allclose(mg.sharp(form, v, tol=1e-12, **kw), np.linalg.solve(G, v), rtol=1e-9)


def test_pullback_takes_a_metric_on_the_outputs():
    f = lambda w: jnp.array([w[0] * w[1], w[1]])
    w = jnp.array([1.0, 2.0])
    J = jax.jacfwd(f)(w)
    M = jnp.array([[3.0, 1.0], [1.0, 2.0]])
    for out in (M, mg.dense_metric(M), mg.Metric(lambda z, u: M @ u)):
        np.testing.assert_allclose(mg.pullback(f, out).dense(w), J.T @ M @ J, rtol=1e-12)
    np.testing.assert_allclose(mg.pullback(f, None).dense(w), J.T @ J, rtol=1e-12)

"""One way to call minigeo (issue 30): one way to pass a metric (item 5), one way to pass data
(item 2), one failure convention under ``jit`` (item 6), and each estimator written once (item 7).

Metrics.  Every function that takes a metric field reads ``metric=`` the same way: a :class:`Metric`,
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
from helpers import compiles_during

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
        "operator.trace_estimate": lambda: mg.operators.hessian_operator(lambda p, b: f(p) * jnp.mean(b), x).trace_estimate(
            key, [jnp.ones(2)], metric=metric
        ),
        "operator.top_eigenvalues": lambda: mg.operators.hessian_operator(lambda p, b: f(p) * jnp.mean(b), x).top_eigenvalues(
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
    assert says in message and "mg.metrics.dense(lambda x: G(x))" in message and "mg.metrics.diagonal(w)" in message


@pytest.mark.parametrize("dtype", DTYPES)
def test_metric_matrix_and_dense_metric_agree_with_the_closed_form(dtype):
    # polar coordinates of the Euclidean plane: Gamma^r_aa = -r, Gamma^a_ra = 1/r, log sqrt det G = log r
    x = jnp.array([2.0, 0.3], dtype=dtype)
    polar = mg.metrics.dense(_polar_matrix)
    Gamma = mg.christoffel_symbols(polar, x)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(Gamma[0, 1, 1], -2.0, rtol=10 * eps)
    np.testing.assert_allclose(Gamma[1, 0, 1], 0.5, rtol=10 * eps)
    np.testing.assert_allclose(mg.log_volume_element(polar, x), np.log(2.0), rtol=10 * eps)
    # the same field built by transforming the Euclidean metric (None, a matrix, a Metric): one answer
    for euclid in (None, jnp.eye(2, dtype=dtype), mg.euclidean(), mg.metrics.dense(jnp.eye(2, dtype=dtype))):
        moved = mg.transform_metric_field(mg.reparam.polar(), euclid)
        assert isinstance(moved, mg.Metric)
        np.testing.assert_allclose(moved.dense(x), _polar_matrix(x), rtol=100 * eps, atol=100 * eps)
        np.testing.assert_allclose(mg.christoffel_symbols(moved, x), Gamma, rtol=1e3 * eps, atol=1e3 * eps)
    # a constant matrix is the constant field: no Christoffel term, so the Riemannian Hessian is the Hessian
    f = lambda q: jnp.sum(jnp.sin(q) * q)
    for constant in (None, 3.0 * jnp.eye(2, dtype=dtype), mg.metrics.dense(3.0 * jnp.eye(2, dtype=dtype))):
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
    op = mg.operators.hessian_operator(lambda q, b: f(q) * jnp.mean(b), x)
    est_op, _ = op.trace_estimate(key, [jnp.ones(3, dtype=dtype)], metric=G, num_probes=4)
    np.testing.assert_allclose(est_op, est, rtol=10 * eps)
    # the weights are checked eagerly
    with pytest.raises(mg.GeometryError, match="<= 0"):
        mg.trace_estimate(f, x, key, metric=mg.metrics.diagonal(-w))


def test_bare_callables_keep_their_one_meaning_in_the_pointwise_rules():
    # at one point a bare callable is a linear map v -> G v: the same answer as the matrix and the Metric
    G = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    v, w = jnp.array([1.0, -2.0]), jnp.array([0.3, 0.7])
    as_map, as_metric = (lambda u: G @ u), mg.metrics.dense(G)
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
    for out in (M, mg.metrics.dense(M), mg.Metric(lambda z, u: M @ u)):
        np.testing.assert_allclose(mg.pullback(f, out).dense(w), J.T @ M @ J, rtol=1e-12)
    np.testing.assert_allclose(mg.pullback(f, None).dense(w), J.T @ J, rtol=1e-12)


# ---------------------------------------------------------------------------
# one calling convention for data: f(params, batch), the closure form f(params) kept (item 2)
# ---------------------------------------------------------------------------
def _regression(dtype, n=12, d=4, seed=0):
    r = np.random.default_rng(seed)
    X = jnp.asarray(r.normal(size=(n, d)), dtype)
    y = jnp.asarray(r.normal(size=n), dtype)
    w = jnp.asarray(r.normal(size=d), dtype)
    loss = lambda p, b: jnp.mean(jnp.tanh(b[0] @ p) ** 2 - b[1] * (b[0] @ p)) + 0.1 * jnp.sum(p**4)
    return loss, w, (X, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_argument_equals_the_closure_and_the_dense_truth(dtype):
    loss, w, batch = _regression(dtype)
    closure = lambda p: loss(p, batch)
    H = jax.hessian(closure)(w)  # the independent truth
    eps = float(jnp.finfo(dtype).eps)
    tol = 100 * eps * float(jnp.max(jnp.abs(H)))
    v = jnp.ones_like(w)
    np.testing.assert_allclose(mg.hvp(loss, w, v, batch=batch), H @ v, atol=tol)
    np.testing.assert_allclose(mg.hvp(loss, w, v, batch=batch), mg.hvp(closure, w, v), atol=tol)
    np.testing.assert_allclose(mg.hessian(loss, w, batch=batch), H, atol=tol)
    key = jax.random.PRNGKey(1)
    est_b, _ = mg.trace_estimate(loss, w, key, batch=batch, num_probes=6)
    est_c, _ = mg.trace_estimate(closure, w, key, num_probes=6)
    np.testing.assert_allclose(est_b, est_c, rtol=100 * eps)
    top_b = mg.top_eigenvalues(loss, w, key, batch=batch, k=2)
    np.testing.assert_allclose(top_b, np.sort(np.linalg.eigvalsh(np.asarray(H, np.float64)))[::-1][:2], rtol=1e-2)
    ev_b = mg.laplace_log_marginal_likelihood(lambda p, b: loss(p, b) + 2.0 * jnp.sum(p**2), w, batch=batch)
    ev_c = mg.laplace_log_marginal_likelihood(lambda p: closure(p) + 2.0 * jnp.sum(p**2), w)
    np.testing.assert_allclose(ev_b.log_z, ev_c.log_z, rtol=100 * eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_metrics_take_the_batch_as_the_operators_do(dtype):
    r = np.random.default_rng(3)
    X = jnp.asarray(r.normal(size=(6, 3)), dtype)
    t = jnp.asarray(r.integers(0, 2, size=6))
    w = jnp.asarray(r.normal(size=(3, 2)), dtype)
    model = lambda p, x: x @ p
    xent = lambda z, y: jnp.mean(-jax.nn.log_softmax(z)[jnp.arange(z.shape[0]), y])
    per_example = lambda z, y: -jax.nn.log_softmax(z)[jnp.arange(z.shape[0]), y]
    batch = (X, t)
    eps = float(jnp.finfo(dtype).eps)
    # the GGN J^T H_z J from dense Jacobians: the independent truth
    J = jax.jacfwd(lambda p: model(p, X))(w).reshape(X.shape[0] * 2, -1)
    Hz = jax.hessian(lambda z: xent(z.reshape(-1, 2), t))(model(w, X).reshape(-1))
    truth = J.T @ Hz @ J
    for G in (
        mg.ggn(model, xent, batch=batch),
        mg.ggn(lambda p: model(p, X), lambda z: xent(z, t)),
        mg.operators.ggn_operator(model, xent, w).as_metric(batch),
        mg.fisher(model, "categorical", batch=batch),  # = GGN for softmax cross-entropy
    ):
        np.testing.assert_allclose(G.dense(w), truth, atol=100 * eps * float(jnp.max(jnp.abs(truth))))
    ef_b = mg.empirical_fisher(model, per_example, batch=batch).dense(w)
    ef_c = mg.empirical_fisher(lambda p: model(p, X), lambda z: per_example(z, t)).dense(w)
    np.testing.assert_allclose(ef_b, ef_c, rtol=100 * eps)
    with pytest.raises(mg.GeometryError, match="a batch must be a pair"):
        mg.ggn(model, xent, batch=X)


def test_a_loop_over_batches_compiles_once():
    loss, w, _ = _regression(jnp.float64)
    r = np.random.default_rng(9)
    counts = []
    for step in range(4):
        batch = (jnp.asarray(r.normal(size=(12, 4))), jnp.asarray(r.normal(size=12)))
        out, n = compiles_during(mg.hvp, loss, w, jnp.ones(4), batch=batch)
        np.testing.assert_allclose(out, jax.hessian(lambda p: loss(p, batch))(w) @ jnp.ones(4), rtol=1e-10)
        counts.append(n)
    assert counts[1:] == [0, 0, 0], counts


# ---------------------------------------------------------------------------
# one failure convention (item 6): one Status, raised eagerly, reported under jit
# ---------------------------------------------------------------------------
def test_one_status_enumeration_is_shared():
    """One vocabulary (issue 53): no module keeps its own names for the Status codes; the old public
    ``mg.sharpness.STATUS_*`` names resolve to the members with a DeprecationWarning until 0.5.0."""
    import re
    from pathlib import Path

    assert [s.name for s in mg.Status][:3] == ["OK", "MAX_ITERATIONS", "NOT_POSITIVE_DEFINITE"]
    assert len({int(s) for s in mg.Status}) == len(mg.Status)
    assert all(s.message for s in mg.Status)
    aliases = []
    for path in sorted(Path(mg.__file__).parent.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*\w+\s*=\s*Status\.\w+\s*$", line):  # NAME = Status.MEMBER
                aliases.append(f"{path.name}:{n}: {line.strip()}")
    assert not aliases, aliases
    old = {"STATUS_OK": "OK", "STATUS_SINGULAR_PAIR": "ILL_CONDITIONED_PAIR", "STATUS_NON_FINITE": "NON_FINITE",
           "STATUS_BAD_RHO": "RHO_OUT_OF_RANGE"}
    for name, member in old.items():
        with pytest.warns(DeprecationWarning, match=f"Status.{member}"):
            assert getattr(mg.sharpness, name) is mg.Status[member]
    with pytest.raises(AttributeError):
        mg.sharpness.STATUS_TYPO


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimators_report_a_status_under_jit_and_raise_it_eagerly(dtype):
    f = lambda x: 0.5 * jnp.sum(jnp.arange(1.0, 7.0, dtype=dtype) * x**2)
    x0 = jnp.zeros(6, dtype)
    key = jax.random.PRNGKey(0)
    indefinite = mg.Metric(lambda p, v: -v, "indefinite")
    # a trace whose CG solves meet negative curvature: NaN and NOT_POSITIVE_DEFINITE under jit, the same eagerly
    est, se, info = jax.jit(lambda x: mg.trace_estimate(f, x, key, metric=indefinite, return_info=True))(x0)
    assert np.isnan(float(est)) and int(info.status) == mg.Status.NOT_POSITIVE_DEFINITE
    with pytest.raises(mg.GeometryError, match="NOT_POSITIVE_DEFINITE"):
        mg.trace_estimate(f, x0, key, metric=indefinite)
    with pytest.raises(mg.GeometryError, match="NOT_POSITIVE_DEFINITE"):
        mg.top_eigenvalues(f, x0, key, metric=indefinite)
    # too few Krylov products: UNCERTIFIED (NaN) under jit, the same name eagerly
    values, info = jax.jit(lambda x: mg.top_eigenvalues(f, x, key, k=3, num_iterations=3, block_size=1, return_info=True))(x0)
    assert int(info.status) == mg.Status.UNCERTIFIED and np.isnan(np.asarray(values)).any()
    with pytest.raises(mg.GeometryError, match="UNCERTIFIED"):
        mg.top_eigenvalues(f, x0, key, k=3, num_iterations=3, block_size=1)
    # an SLQ log-determinant of an indefinite operator
    diag = jnp.arange(-1.0, 5.0, dtype=dtype)
    est, _, info = jax.jit(lambda k: mg.densities.logdet_slq(lambda v: diag * v, 6, k, dtype=dtype, return_info=True))(key)
    assert np.isnan(float(est)) and int(info.status) == mg.Status.NOT_POSITIVE_DEFINITE
    # and success: OK, with the products counted
    est, _, info = mg.trace_estimate(f, x0, key, num_probes=7, return_info=True)
    assert int(info.status) == mg.Status.OK and info.num_products == 7
    np.testing.assert_allclose(est, 21.0, rtol=10 * float(jnp.finfo(dtype).eps))


# ---------------------------------------------------------------------------
# each estimator written once (item 7): the function and the operator method agree
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_functions_and_operator_methods_are_one_implementation(dtype):
    loss, w, batch = _regression(dtype)
    op = mg.operators.hessian_operator(loss, w, examples=lambda b: b[0].shape[0])
    key = jax.random.PRNGKey(4)
    eps = float(jnp.finfo(dtype).eps)
    G = mg.metrics.diagonal(jnp.linspace(0.5, 2.0, w.size, dtype=dtype))
    for metric in (None, G):
        f_est, f_se = mg.trace_estimate(loss, w, key, batch=batch, metric=metric, num_probes=5)
        o_est, o_se = op.trace_estimate(key, [batch], metric=metric, num_probes=5)
        np.testing.assert_allclose(o_est, f_est, rtol=1e3 * eps)
        np.testing.assert_allclose(o_se, f_se, rtol=1e3 * eps, atol=1e3 * eps)
        f_top = mg.top_eigenvalues(loss, w, key, batch=batch, metric=metric, k=2)
        o_top = op.top_eigenvalues(key, [batch], metric=metric, k=2)
        np.testing.assert_allclose(o_top, f_top, rtol=1e-2)
    H = mg.hessian(loss, w, batch=batch)
    shift = 1.0 - float(jnp.min(jnp.linalg.eigvalsh(H)))  # H + shift I is positive definite
    f_ld, _ = mg.densities.logdet_slq(lambda v: H @ v + shift * v, w.size, key, num_iterations=w.size, dtype=dtype)
    o_ld, _ = op.logdet_slq(key, [batch], damping=shift, num_iterations=w.size)
    exact = float(np.linalg.slogdet(np.asarray(H, np.float64) + shift * np.eye(w.size))[1])
    for ld in (f_ld, o_ld):
        np.testing.assert_allclose(ld, exact, rtol=0.3)  # SLQ sampling error only (probes), same for both
    np.testing.assert_allclose(o_ld, f_ld, rtol=1e3 * eps)

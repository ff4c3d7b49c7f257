"""Exact diagonals of the GGN, the Fisher and the empirical Fisher (issue 36): the references for
the Hutchinson ``diagonal_estimate`` where the output dimension is small.

Truths: the dense matrices built here independently, ``J`` by ``jax.jacfwd`` over the flattened
parameters and the output-space Hessians by ``jax.hessian`` (the Fisher's output block as the Hessian
of the log-partition ``logsumexp``), on a small MLP with three outputs; the metrics' own dense
matrices (one normalisation for the metric and its diagonal); the Hutchinson estimates within their
standard errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compiles_during
from jax.flatten_util import ravel_pytree

import minigeo as mg

DTYPES = [jnp.float64, jnp.float32]
N, D_IN, HIDDEN, C = 6, 3, 4, 3


def mlp(p, x):
    return jnp.tanh(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]


def cross_entropy(z, y):  # mean loss of the batch
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1))


def per_example_cross_entropy(z, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1)[:, 0]


def squared_error(z, t):  # mean loss of the batch
    return 0.5 * jnp.mean(jnp.sum((z - t) ** 2, axis=1))


def per_example_squared_error(z, t):
    return 0.5 * jnp.sum((z - t) ** 2, axis=1)


def problem(dtype, seed=0):
    r = np.random.default_rng(seed)
    shapes = {"W1": (D_IN, HIDDEN), "b1": (HIDDEN,), "W2": (HIDDEN, C), "b2": (C,)}
    params = {k: jnp.asarray(r.normal(size=s), dtype) for k, s in shapes.items()}
    X = jnp.asarray(r.normal(size=(N, D_IN)), dtype)
    labels = jnp.asarray(r.integers(0, C, size=N))
    targets = jnp.asarray(r.normal(size=(N, C)), dtype)
    return params, X, labels, targets


# -- the dense truths, built without minigeo ---------------------------------------------------
def jacobian(params, X):
    theta, unravel = ravel_pytree(params)
    return jax.jacfwd(lambda t: mlp(unravel(t), X).reshape(-1))(theta)  # (N C, d)


@functools.partial(jax.jit, static_argnums=2)
def dense_ggn(params, X, loss, t):
    J = jacobian(params, X)
    z = mlp(params, X)
    H = jax.hessian(lambda zf: loss(zf.reshape(z.shape), t))(z.reshape(-1))
    return J.T @ H @ J


@functools.partial(jax.jit, static_argnums=(2, 3))
def dense_fisher(params, X, likelihood, sigma=1.0):
    J = jacobian(params, X)
    z = mlp(params, X)
    if likelihood == "categorical":  # Hessian of the log-partition = diag(p) - p p^T, per example
        blocks = jax.vmap(jax.hessian(jax.scipy.special.logsumexp))(z)
    else:
        blocks = jnp.broadcast_to(jnp.eye(C, dtype=z.dtype) / sigma**2, (N, C, C))
    return J.T @ jax.scipy.linalg.block_diag(*blocks) @ J / N


@functools.partial(jax.jit, static_argnums=2)
def dense_empirical_fisher(params, X, per_example_loss, t):
    theta, unravel = ravel_pytree(params)
    G = jax.jacfwd(lambda q: per_example_loss(mlp(unravel(q), X), t))(theta)  # (N, d) per-example gradients
    return G.T @ G / N


def flat(tree):
    return ravel_pytree(tree)[0]


def tolerance(dtype, reference):
    """Relative 1e-10 in float64; in float32 a multiple of eps times the problem's scale."""
    scale = float(jnp.max(jnp.abs(reference)))
    return (1e-10 if dtype == jnp.float64 else 20 * float(jnp.finfo(dtype).eps)) * scale


def cases(dtype):
    """(name, exact diagonal, dense truth in float64, the metric of the library) for every matrix."""
    params, X, labels, targets = problem(dtype)
    p64, X64 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), (params, X))
    t64 = targets.astype(jnp.float64)
    return [
        (
            "GGN, cross-entropy",
            mg.metrics.ggn_diagonal(mlp, cross_entropy, params, batch=(X, labels)),
            dense_ggn(p64, X64, cross_entropy, labels),
            mg.ggn(mlp, cross_entropy, batch=(X, labels)),
        ),
        (
            "GGN, squared error",
            mg.metrics.ggn_diagonal(mlp, squared_error, params, batch=(X, targets)),
            dense_ggn(p64, X64, squared_error, t64),
            mg.ggn(mlp, squared_error, batch=(X, targets)),
        ),
        (
            "Fisher, categorical",
            mg.metrics.fisher_diagonal(mlp, params, "categorical", batch=(X, labels)),
            dense_fisher(p64, X64, "categorical"),
            mg.fisher(mlp, "categorical", batch=(X, labels)),
        ),
        (
            "Fisher, gaussian sigma = 2",
            mg.metrics.fisher_diagonal(mlp, params, mg.gaussian_likelihood(2.0), batch=(X, targets)),
            dense_fisher(p64, X64, "gaussian", sigma=2.0),
            mg.fisher(mlp, mg.gaussian_likelihood(2.0), batch=(X, targets)),
        ),
        (
            "empirical Fisher, cross-entropy",
            mg.metrics.empirical_fisher_diagonal(mlp, per_example_cross_entropy, params, batch=(X, labels)),
            dense_empirical_fisher(p64, X64, per_example_cross_entropy, labels),
            mg.empirical_fisher(mlp, per_example_cross_entropy, batch=(X, labels)),
        ),
        (
            "empirical Fisher, squared error",
            mg.metrics.empirical_fisher_diagonal(mlp, per_example_squared_error, params, batch=(X, targets)),
            dense_empirical_fisher(p64, X64, per_example_squared_error, t64),
            mg.empirical_fisher(mlp, per_example_squared_error, batch=(X, targets)),
        ),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_diagonals_equal_the_dense_matrices(dtype):
    params = problem(dtype)[0]
    for name, diag, dense, metric in cases(dtype):
        assert jax.tree_util.tree_structure(diag) == jax.tree_util.tree_structure(params), name
        assert all(a.shape == b.shape and a.dtype == dtype for a, b in zip(
            jax.tree_util.tree_leaves(diag), jax.tree_util.tree_leaves(params))), name
        truth = jnp.diag(dense)
        np.testing.assert_allclose(flat(diag), truth, rtol=0, atol=tolerance(dtype, truth), err_msg=name)
        # the metric and its diagonal share one normalisation ("mean" over the batch)
        of_metric = jnp.diag(metric.dense(params)).astype(jnp.float64)
        np.testing.assert_allclose(flat(diag), of_metric, rtol=0, atol=tolerance(dtype, truth), err_msg=name)


def test_reduction_sum_is_n_times_mean_and_the_fisher_never_negative():
    params, X, labels, targets = problem(jnp.float64)
    for fn in (
        lambda red: mg.metrics.fisher_diagonal(mlp, params, batch=(X, labels), reduction=red),
        lambda red: mg.metrics.empirical_fisher_diagonal(mlp, per_example_squared_error, params, batch=(X, targets),
                                                 reduction=red),
    ):
        np.testing.assert_allclose(flat(fn("sum")), N * flat(fn("mean")), rtol=1e-12)
    # at a point where p is near one-hot, diag(p) - p p^T has tiny entries: a sum of squares stays >= 0
    big = jax.tree_util.tree_map(lambda a: 30.0 * a, params)
    assert bool(jnp.all(flat(mg.metrics.fisher_diagonal(mlp, big, batch=(X, labels))) >= 0))


def test_a_categorical_likelihood_on_several_outputs_per_example():
    """Outputs of shape (N, 2, C): the factor of the per-example Fisher by its eigendecomposition."""
    params, X, _, _ = problem(jnp.float64)
    model = lambda p, x: jnp.stack([mlp(p, x), mlp(p, 2.0 * x)], axis=1)  # (N, 2, C)
    got = mg.metrics.fisher_diagonal(model, params, batch=(X, jnp.zeros(N)))

    @jax.jit
    def truth_of(params):
        theta, unravel = ravel_pytree(params)
        J = jax.jacfwd(lambda t: model(unravel(t), X).reshape(-1))(theta)
        log_partition = lambda zn: jnp.sum(jax.scipy.special.logsumexp(zn.reshape(2, C), axis=1))
        blocks = jax.vmap(jax.hessian(log_partition))(model(params, X).reshape(N, 2 * C))
        return jnp.diag(J.T @ jax.scipy.linalg.block_diag(*blocks) @ J / N)

    truth = truth_of(params)
    np.testing.assert_allclose(flat(got), truth, rtol=0, atol=tolerance(jnp.float64, truth))


def test_the_hutchinson_estimates_agree_within_their_standard_errors():
    params, X, labels, targets = problem(jnp.float64)
    key, P = jax.random.PRNGKey(3), 4000
    z0 = mlp(params, X)

    def linearized_loss(p):  # its Hessian at params is exactly the GGN J^T H_z J
        dz = jax.jvp(lambda q: mlp(q, X), (params,), (jax.tree_util.tree_map(jnp.subtract, p, params),))[1]
        return cross_entropy(z0 + dz, labels)

    pairs = [
        (mg.metrics.ggn_diagonal(mlp, cross_entropy, params, batch=(X, labels)),
         mg.diagonal_estimate(linearized_loss, params, key, num_probes=P)),
        (mg.metrics.fisher_diagonal(mlp, params, batch=(X, labels)),
         mg.operators.fisher_operator(mlp, params).diagonal_estimate(key, [(X, labels)], num_probes=P)),
        (mg.metrics.empirical_fisher_diagonal(mlp, per_example_squared_error, params, batch=(X, targets)),
         mg.operators.empirical_fisher_operator(mlp, per_example_squared_error, params).diagonal_estimate(
             key, [(X, targets)], num_probes=P)),
    ]
    for exact, (mean, se) in pairs:
        exact, mean, se = flat(exact), flat(mean), flat(se)
        z = (mean - exact) / jnp.maximum(se, 1e-12 * jnp.max(jnp.abs(exact)))
        assert float(jnp.max(jnp.abs(z))) < 4.5, z
        assert 0.5 < float(jnp.sqrt(jnp.mean(z[se > 0] ** 2))) < 1.5  # calibrated, not loose


@pytest.mark.parametrize("dtype", DTYPES)
def test_under_jit_equal_to_eager(dtype):
    params, X, labels, targets = problem(dtype)
    calls = [
        lambda p, b: mg.metrics.ggn_diagonal(mlp, cross_entropy, p, batch=b),
        lambda p, b: mg.metrics.fisher_diagonal(mlp, p, batch=b),
        lambda p, b: mg.metrics.empirical_fisher_diagonal(mlp, per_example_cross_entropy, p, batch=b),
    ]
    for fn in calls:
        eager, jitted = flat(fn(params, (X, labels))), flat(jax.jit(fn)(params, (X, labels)))
        np.testing.assert_allclose(jitted, eager, rtol=0, atol=tolerance(dtype, eager))


WIDTH = 1.0  # a notebook-style global, read by the model


def model_reading_a_global(p, x):
    return mlp(p, WIDTH * x)


def test_never_stale_a_changed_global_is_read_at_the_next_call():
    global WIDTH
    params, X, labels, targets = problem(jnp.float64)
    calls = [
        lambda m: mg.metrics.ggn_diagonal(m, cross_entropy, params, batch=(X, labels)),
        lambda m: mg.metrics.fisher_diagonal(m, params, batch=(X, labels)),
        lambda m: mg.metrics.empirical_fisher_diagonal(m, per_example_squared_error, params, batch=(X, targets)),
    ]
    try:
        for fn in calls:
            WIDTH = 1.0
            first = flat(fn(model_reading_a_global))
            WIDTH = 3.0
            second = flat(fn(model_reading_a_global))
            truth = flat(fn(lambda p, x: mlp(p, 3.0 * x)))
            np.testing.assert_allclose(second, truth, rtol=1e-12)
            assert not np.allclose(first, second)
    finally:
        WIDTH = 1.0


LOSS_SCALE = 1.0  # a notebook-style global, read by the per-example loss


def scaled_squared_error(z, t):
    return LOSS_SCALE * per_example_squared_error(z, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_example", [True, False])
def test_second_call_on_new_data_compiles_nothing_and_reads_the_loss_global(per_example, dtype):
    """The compiled diagonal is reused for new data of the same shapes (both paths: one example per
    backward pass, and the whole batch when the model closes over its data); a global read by the
    loss is read afresh: the empirical Fisher's diagonal scales with its square."""
    global LOSS_SCALE
    params, X, labels, targets = problem(dtype)
    X2, t2 = X[::-1] + 0.5, targets[::-1]

    def calls(X, labels, targets):
        if per_example:
            return [
                lambda: mg.metrics.ggn_diagonal(mlp, cross_entropy, params, batch=(X, labels)),
                lambda: mg.metrics.fisher_diagonal(mlp, params, batch=(X, labels)),
                lambda: mg.metrics.empirical_fisher_diagonal(mlp, scaled_squared_error, params, batch=(X, targets)),
            ]
        model = lambda p: mlp(p, X)  # noqa: E731
        return [
            lambda: mg.metrics.ggn_diagonal(model, lambda z: cross_entropy(z, labels), params),
            lambda: mg.metrics.fisher_diagonal(model, params),
            lambda: mg.metrics.empirical_fisher_diagonal(model, lambda z: scaled_squared_error(z, targets), params),
        ]

    try:
        first = [flat(c()) for c in calls(X, labels, targets)]
        for c, before in zip(calls(X2, labels, t2), first):
            out, n = compiles_during(c)
            assert n == 0
            assert flat(out).dtype == dtype
            assert not np.allclose(flat(out), before)  # today's data, not the first call's
        LOSS_SCALE = 2.0
        scaled = flat(calls(X, labels, targets)[2]())
        # a gain of 2 on the loss scales every gradient by exactly 2 (a power of two): the squares by 4
        np.testing.assert_allclose(scaled, 4.0 * first[2], rtol=10 * float(jnp.finfo(dtype).eps))
    finally:
        LOSS_SCALE = 1.0


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda p, X, y, t: mg.metrics.ggn_diagonal(mlp, per_example_cross_entropy, p, batch=(X, y)),
         "must return a scalar"),
        (lambda p, X, y, t: mg.metrics.empirical_fisher_diagonal(mlp, cross_entropy, p, batch=(X, y)),
         "one loss per example"),
        (lambda p, X, y, t: mg.metrics.fisher_diagonal(lambda q: jnp.sum(mlp(q, X)), p), "leading batch axis"),
        (lambda p, X, y, t: mg.metrics.fisher_diagonal(lambda q: mlp(q, X[:0]), p), "the batch is empty"),
        (lambda p, X, y, t: mg.metrics.fisher_diagonal(mlp, p, "poisson", batch=(X, y)), "unknown likelihood"),
        (lambda p, X, y, t: mg.metrics.fisher_diagonal(mlp, p, batch=(X, y), reduction="max"), "reduction"),
        (lambda p, X, y, t: mg.metrics.empirical_fisher_diagonal(mlp, per_example_squared_error, p, batch=(X, t),
                                                         reduction="none"), "reduction"),
        (lambda p, X, y, t: mg.metrics.ggn_diagonal(mlp, cross_entropy, p, batch=X), "must be a pair"),
        (lambda p, X, y, t: mg.metrics.ggn_diagonal(mlp, cross_entropy, {"W1": jnp.ones((3, 4), int)}, batch=(X, y)),
         "must be floating point"),
        (lambda p, X, y, t: mg.metrics.fisher_diagonal(mlp, {**p, "b2": jnp.full(C, jnp.nan)}, batch=(X, y)),
         "non-finite"),
    ],
)
def test_bad_input_raises_a_clear_error(call, says):
    params, X, labels, targets = problem(jnp.float64)
    with pytest.raises(mg.GeometryError, match=says):
        call(params, X, labels, targets)


# -- with a batch, each backward pass sees one example ---------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_with_a_batch_each_example_is_differentiated_alone_and_both_paths_agree(dtype):
    """With ``batch`` the model is traced on one example at a time (N passes of one example, not N passes
    of the whole batch: the O(N^2 d) cost of before); the closure path gives the same diagonal."""
    params, X, labels, targets = problem(dtype)
    seen = []

    def recording_mlp(p, x):
        seen.append(x.shape)
        return mlp(p, x)

    for name, batched, closed in [
        ("empirical Fisher",
         lambda: mg.metrics.empirical_fisher_diagonal(recording_mlp, per_example_cross_entropy, params, batch=(X, labels)),
         lambda: mg.metrics.empirical_fisher_diagonal(lambda p: mlp(p, X), lambda z: per_example_cross_entropy(z, labels),
                                              params)),
        ("Fisher", lambda: mg.metrics.fisher_diagonal(recording_mlp, params, batch=(X, labels)),
         lambda: mg.metrics.fisher_diagonal(lambda p: mlp(p, X), params)),
    ]:
        seen.clear()
        first = flat(batched())
        assert (1, D_IN) in seen and all(s in {(1, D_IN), (N, D_IN)} for s in seen), (name, seen)
        np.testing.assert_allclose(first, flat(closed()), rtol=tolerance(dtype, first), atol=tolerance(dtype, first),
                                   err_msg=name)


def test_a_model_that_couples_its_examples_keeps_the_whole_batch_path_without_batch():
    """Batch statistics couple the examples: with the data closed over, the diagonal is sum_n (J_n^T g_n)^2
    through the whole batch's forward pass (dense truth), which differs from the one-example gradients."""
    params, X, labels, _ = problem(jnp.float64)

    def normalized(p, x):  # standardizes the hidden layer over the batch
        h = jnp.tanh(x @ p["W1"] + p["b1"])
        h = (h - jnp.mean(h, axis=0)) / jnp.sqrt(jnp.var(h, axis=0) + 0.1)
        return h @ p["W2"] + p["b2"]

    theta, unravel = ravel_pytree(params)
    G = jax.jacfwd(lambda q: per_example_cross_entropy(normalized(unravel(q), X), labels))(theta)
    truth = np.sum(np.asarray(G) ** 2, axis=0) / N
    closed = flat(mg.metrics.empirical_fisher_diagonal(lambda p: normalized(p, X),
                                               lambda z: per_example_cross_entropy(z, labels), params))
    np.testing.assert_allclose(closed, truth, rtol=1e-10, atol=1e-14)
    assert not np.allclose(truth, flat(mg.metrics.empirical_fisher_diagonal(normalized, per_example_cross_entropy, params,
                                                                     batch=(X, labels))))

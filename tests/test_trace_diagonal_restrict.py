"""Hutch++ traces, Hutchinson diagonals and operators restricted to a block of leaves (issue 36).

Truths: dense traces and diagonals of matrices with known spectra; ``jax.hessian`` sub-blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minigeo as mg
from helpers import decaying_quadratic as _decaying, rng

DTYPES = [jnp.float64, jnp.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_hutchpp_beats_hutchinson_by_four_on_a_k_minus_two_spectrum(dtype):
    f, x, A = _decaying(80, dtype)
    truth = float(jnp.trace(A.astype(jnp.float64)))
    errors = {"hutchinson": [], "hutch++": []}
    for i in range(15):
        for method in errors:
            est, se = mg.trace_estimate(f, x, jax.random.PRNGKey(i), num_probes=30, method=method)
            errors[method].append(abs(float(est) - truth))
    assert np.median(errors["hutch++"]) <= 0.25 * np.median(errors["hutchinson"]), errors


@pytest.mark.parametrize("dtype", DTYPES)
def test_hutchpp_is_unbiased_with_a_metric_and_its_error_is_calibrated(dtype):
    f, x, A = _decaying(30, dtype, seed=1, power=1.0)
    w = jnp.asarray(rng(2).uniform(0.5, 2.0, size=30), dtype)
    truth = float(jnp.trace(A / w[:, None]))
    ests, ses = [], []
    for i in range(40):
        est, se = mg.trace_estimate(f, x, jax.random.PRNGKey(i), num_probes=12, method="hutch++", metric=mg.metrics.diagonal(w))
        ests.append(float(est))
        ses.append(float(se))
    ests = np.asarray(ests)
    # the mean over 40 independent runs is within 4 of its standard errors of the truth
    assert abs(ests.mean() - truth) <= 4 * ests.std(ddof=1) / np.sqrt(40) + 1e2 * float(jnp.finfo(dtype).eps) * truth
    # the reported error (deflated probes) is the right order: median within a factor 3 of the spread
    assert np.median(ses) / ests.std(ddof=1) < 3 and ests.std(ddof=1) / np.median(ses) < 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_hutchpp_exact_when_the_sketch_spans_the_range(dtype):
    """Rank 2 Hessian, sketch of 2: the deflated remainder is zero, the estimate exact to rounding.

    Rounding: the sketch's orthonormal basis carries a relative error of about eps * cond(U)^2
    (the condition number of A S on its range), the trace and the remainder's scale is |U|_F^2.
    """
    r = rng(3)
    U = jnp.asarray(r.normal(size=(10, 2)), dtype)
    U64 = np.asarray(U, np.float64)  # the truth from the same (rounded) entries
    f = lambda x: 0.5 * jnp.sum((U.T @ x) ** 2)
    est, se = mg.trace_estimate(f, jnp.zeros(10, dtype), jax.random.PRNGKey(0), num_probes=7, method="hutch++")
    assert est.dtype == dtype
    truth = np.sum(U64**2)
    tol = 10 * float(jnp.finfo(dtype).eps) * np.linalg.cond(U64) ** 2 * truth
    assert abs(float(est) - truth) < tol and float(se) < tol, (float(est) - truth, float(se), tol)


def test_hutchpp_under_jit_and_over_a_dataset():
    r = rng(4)
    X, Y = jnp.asarray(r.normal(size=(24, 5))), jnp.asarray(r.normal(size=24))
    loss = lambda w, b: jnp.mean((jnp.tanh(b[0] @ w) - b[1]) ** 2)
    w0 = jnp.asarray(r.normal(size=5))
    key = jax.random.PRNGKey(5)
    fn, _ = mg.trace_estimate(loss, w0, key, batch=(X, Y), num_probes=9, method="hutch++")
    jitted, _, info = jax.jit(lambda w: mg.trace_estimate(loss, w, key, batch=(X, Y), num_probes=9, method="hutch++", return_info=True))(w0)
    op, _ = mg.operators.hessian_operator(loss, w0).trace_estimate(key, [(X[:12], Y[:12]), (X[12:], Y[12:])], num_probes=9, method="hutch++")
    np.testing.assert_allclose([float(jitted), float(op)], float(fn), rtol=1e-9)
    assert mg.Status(int(info.status)) == mg.Status.OK and info.num_products == 9


@pytest.mark.parametrize("dtype", DTYPES)
def test_diagonal_estimate_is_unbiased_and_its_error_falls_like_root_m(dtype):
    r = rng(6)
    B = r.normal(size=(12, 12))
    A = jnp.asarray(B @ B.T / 12 + np.diag(r.uniform(0, 2, 12)), dtype)
    f = lambda x: 0.5 * x @ A @ x
    x = jnp.zeros(12, dtype)
    truth = np.asarray(jnp.diag(A), np.float64)
    errs = {}
    for m in (8, 128):
        runs = np.stack([np.asarray(mg.diagonal_estimate(f, x, jax.random.PRNGKey(i), num_probes=m)[0]) for i in range(30)])
        errs[m] = np.sqrt(np.mean((runs - truth) ** 2))
        # unbiased: the mean over 30 runs within 4 standard errors, entry by entry
        assert np.all(np.abs(runs.mean(0) - truth) <= 4 * runs.std(0, ddof=1) / np.sqrt(30) + 1e2 * float(jnp.finfo(dtype).eps))
    assert 2.0 < errs[8] / errs[128] < 8.0  # sqrt(16) = 4
    # the per-entry standard error matches the predicted sqrt(sum_{j != i} A_ij^2 / m)
    diag, se = mg.diagonal_estimate(f, x, jax.random.PRNGKey(99), num_probes=400)
    predicted = np.sqrt((np.sum(np.asarray(A, np.float64) ** 2, 1) - truth**2) / 400)
    np.testing.assert_allclose(np.asarray(se), predicted, rtol=0.25)


def test_diagonal_over_a_dataset_equals_the_function_and_pytrees_round_trip():
    r = rng(7)
    X = jnp.asarray(r.normal(size=(16, 3)))
    params = {"w": jnp.asarray(r.normal(size=(3, 2))), "b": jnp.asarray(r.normal(size=2))}
    loss = lambda p, x: jnp.mean(jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2, axis=1))
    key = jax.random.PRNGKey(8)
    fn, fse = mg.diagonal_estimate(loss, params, key, batch=X, num_probes=6)
    op, ose = mg.operators.hessian_operator(loss, params).diagonal_estimate(key, [X[:8], X[8:]], num_probes=6)
    for a, b in zip(jax.tree_util.tree_leaves((fn, fse)), jax.tree_util.tree_leaves((op, ose))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-9, atol=1e-12)
    assert jax.tree_util.tree_structure(fn) == jax.tree_util.tree_structure(params)


@pytest.mark.parametrize("dtype", DTYPES)
def test_restrict_equals_the_dense_sub_block_and_every_method_works_on_it(dtype):
    r = rng(9)
    X = jnp.asarray(r.normal(size=(20, 3)), dtype)
    params = {"l1": {"w": jnp.asarray(r.normal(size=(3, 4)), dtype), "b": jnp.asarray(r.normal(size=4), dtype)},
              "l2": {"w": jnp.asarray(r.normal(size=(4, 2)), dtype)}}
    loss = lambda p, x: jnp.mean(jnp.sum(jnp.tanh(jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"]) ** 2, axis=1))
    # the truth: jax.hessian in float64 at the same (rounded) point and data
    as64 = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), t)
    X64 = as64(X)
    flat, unravel = jax.flatten_util.ravel_pytree(as64(params))
    Hfull = np.asarray(jax.hessian(lambda v: loss(unravel(v), X64))(flat))
    # indices of l1/w in the flat vector (ravel_pytree order: l1/b, l1/w, l2/w)
    sl = slice(4, 16)
    # Hessian-vector products through two tanh layers: no cancellation, a relative error of a few eps
    tol = 100 * float(jnp.finfo(dtype).eps) * np.abs(Hfull[sl, sl]).max()
    H = mg.operators.hessian_operator(loss, params)
    sub = H.restrict([("l1", "w")])
    d = 12
    basis = [{("l1", "w"): jnp.eye(d, dtype=dtype)[i].reshape(3, 4)} for i in range(d)]
    columns = [sub.dataset_mv(e, [X]) for e in basis]
    assert all(c[("l1", "w")].dtype == dtype for c in columns)
    dense = np.stack([np.asarray(jax.flatten_util.ravel_pytree(c)[0], np.float64) for c in columns])
    np.testing.assert_allclose(dense, Hfull[sl, sl], atol=tol)
    top = sub.top_eigenvalues(jax.random.PRNGKey(0), [X], k=2)  # certified to the default rtol=1e-2
    np.testing.assert_allclose(np.asarray(top), np.sort(np.linalg.eigvalsh(Hfull[sl, sl]))[::-1][:2], rtol=1e-2)
    dens = sub.spectral_density(jax.random.PRNGKey(1), [X], num_probes=2, num_iterations=d)
    assert abs(float(dens.moments(1)[0]) - np.trace(Hfull[sl, sl]) / d) < 0.5 * np.abs(np.diag(Hfull[sl, sl])).max()
    # at other parameters: only the kept leaves move
    moved = sub.at({("l1", "w"): 2 * params["l1"]["w"]})
    p2 = {"l1": {"w": 2 * params["l1"]["w"], "b": params["l1"]["b"]}, "l2": params["l2"]}
    H2 = np.asarray(jax.hessian(lambda v: loss(unravel(v), X64))(jax.flatten_util.ravel_pytree(as64(p2))[0]))[sl, sl]
    np.testing.assert_allclose(np.asarray(moved.dataset_mv(basis[0], [X])[("l1", "w")], np.float64).ravel(), H2[:, 0],
                               atol=100 * float(jnp.finfo(dtype).eps) * np.abs(H2).max())
    with pytest.raises(mg.GeometryError, match="no leaf at"):
        H.restrict([("l3", "w")])


def test_bad_methods_and_budgets_raise():
    f, x, A = _decaying(6, jnp.float64)
    key = jax.random.PRNGKey(0)
    with pytest.raises(mg.GeometryError, match="method"):
        mg.trace_estimate(f, x, key, method="xtrace++")
    with pytest.raises(mg.GeometryError, match="at least 3"):
        mg.trace_estimate(f, x, key, num_probes=2, method="hutch++")
    with pytest.raises(mg.GeometryError, match="num_probes"):
        mg.diagonal_estimate(f, x, key, num_probes=0)
    with pytest.raises(mg.GeometryError):
        mg.diagonal_estimate(f, x, 0)

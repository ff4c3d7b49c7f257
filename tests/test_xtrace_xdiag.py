"""XTrace traces and XDiag diagonals (Epperly, Tropp & Webber 2024; issue 36).

Truths: dense traces and diagonals of matrices with known spectra (also of the non-symmetric
E = G^{-1}H); the leave-one-out definition of XTrace evaluated naively in float64 numpy (one QR per
left-out vector) on the same test vectors; the zero variance of an exactly low-rank operator.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import minigeo as mg
from minigeo._estimators import small_sample_factor
from helpers import decaying_quadratic as _decaying, random_spd, rng

DTYPES = [jnp.float64, jnp.float32]


def _naive_xtrace(E, key, budget):
    """XTrace by its definition: for each i, a fresh QR of the sketch without column i (float64)."""
    d = E.shape[0]
    m = budget // 2
    Om = np.asarray(jax.random.normal(key, (m, d), dtype=jnp.float64))  # the estimator's test vectors
    Om = (np.sqrt(d) * Om / np.linalg.norm(Om, axis=1, keepdims=True)).T
    Y = E @ Om
    ests = []
    for i in range(m):
        Qi = np.linalg.qr(np.delete(Y, i, axis=1))[0]
        x = Om[:, i] - Qi @ (Qi.T @ Om[:, i])
        ests.append(np.trace(Qi.T @ E @ Qi) + (d - m + 1) / (x @ x) * (x @ E @ x))
    ests = np.asarray(ests)
    return ests.mean(), ests.std(ddof=1) / np.sqrt(m)


def _naive_xdiag(A, key, budget):
    """XDiag by its definition: d_i = diag(P_i A) + w_i o (I - P_i) A w_i, P_i from a fresh QR (float64)."""
    d = A.shape[0]
    m = budget // 2
    Om = np.asarray(jax.random.rademacher(key, (m, d), dtype=jnp.float64)).T  # the estimator's test vectors
    Y = A @ Om
    rows = []
    for i in range(m):
        Qi = np.linalg.qr(np.delete(Y, i, axis=1))[0]
        P = Qi @ Qi.T
        rows.append(np.diag(P @ A) + Om[:, i] * (Y[:, i] - P @ Y[:, i]))
    rows = np.asarray(rows)
    return rows.mean(0), rows.std(0, ddof=1) / np.sqrt(m)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xtrace_beats_hutchinson_by_four_on_a_k_minus_two_spectrum(dtype):
    f, x, A = _decaying(80, dtype)
    truth = float(jnp.trace(A.astype(jnp.float64)))
    errors = {"hutchinson": [], "xtrace": []}
    for i in range(15):
        for method in errors:
            est, se = mg.trace_estimate(f, x, jax.random.PRNGKey(i), num_probes=30, method=method)
            assert est.dtype == dtype
            errors[method].append(abs(float(est) - truth))
    assert np.median(errors["xtrace"]) <= 0.25 * np.median(errors["hutchinson"]), errors


@pytest.mark.parametrize("kind", ["euclidean", "diagonal", "dense"])
def test_xtrace_equals_its_leave_one_out_definition_also_for_non_symmetric_e(kind):
    """The downdating formulas (one QR) against m separate QRs, for H and for E = G^-1 H."""
    r = rng(11)
    f, x, A = _decaying(15, jnp.float64, seed=12, power=1.0)
    w, G = r.uniform(0.5, 2.0, 15), np.asarray(random_spd(r, 15, cond=10.0))
    metric, Gm = {
        "euclidean": (None, np.eye(15)),
        "diagonal": (mg.metrics.diagonal(jnp.asarray(w)), np.diag(w)),
        "dense": (mg.metrics.dense(jnp.asarray(G)), G),
    }[kind]
    E = np.linalg.solve(Gm, np.asarray(A))
    key = jax.random.PRNGKey(3)
    est, err = mg.trace_estimate(f, x, key, num_probes=11, method="xtrace", metric=metric, tol=1e-13)  # m = 5
    truth_est, truth_err = _naive_xtrace(E, key, 11)
    # the paper's error estimate (spread of the m = 5 leave-one-out estimates over sqrt m), widened by the
    # Student-t factor of its 5 samples so that est +- 2 err is a 95 % interval (issue 55)
    truth_err *= small_sample_factor(5)
    np.testing.assert_allclose([float(est), float(err)], [truth_est, truth_err], rtol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xtrace_is_unbiased_with_a_metric_and_its_error_estimate_is_calibrated(dtype):
    """E = W^-1 A is not symmetric; a dense metric (CG solves) is checked against the definition above."""
    f, x, A = _decaying(30, dtype, seed=1, power=2.0)
    w = jnp.asarray(rng(2).uniform(0.5, 2.0, size=30), dtype)
    metric, Gm = mg.metrics.diagonal(w), np.diag(np.asarray(w, np.float64))
    truth = float(np.trace(np.linalg.solve(Gm, np.asarray(A, np.float64))))
    ests, errs = [], []
    for i in range(40):
        est, err = mg.trace_estimate(f, x, jax.random.PRNGKey(i), num_probes=12, method="xtrace", metric=metric)
        ests.append(float(est))
        errs.append(float(err))
    ests = np.asarray(ests)
    spread = ests.std(ddof=1)
    # unbiased: the mean over 40 independent runs is within 4 of its standard errors of the truth
    assert abs(ests.mean() - truth) <= 4 * spread / np.sqrt(40) + 1e3 * float(jnp.finfo(dtype).eps) * truth
    # the error estimate (spread of the m leave-one-out estimates) is the right order: within a factor 3
    assert np.median(errs) / spread < 3 and spread / np.median(errs) < 3, (np.median(errs), spread)
    # and it is XTrace's spread: below half of Hutchinson's at the same budget (its standard error, 40 keys)
    hutch = np.median([float(mg.trace_estimate(f, x, jax.random.PRNGKey(i), num_probes=12, metric=metric)[1])
                       for i in range(40)])
    assert spread < 0.5 * hutch, (spread, hutch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [8, 13])
def test_xtrace_exact_for_an_operator_of_rank_below_half_the_budget(dtype, budget):
    """Rank 3 < m = 4 or 6: every leave-one-out basis spans the range, the estimate is exact to rounding.

    Rounding: the basis carries a relative error of about eps * cond(U)^2; the trace scale is |U|_F^2.
    """
    U = jnp.asarray(rng(3).normal(size=(20, 3)), dtype)
    U64 = np.asarray(U, np.float64)
    f = lambda x: 0.5 * jnp.sum((U.T @ x) ** 2)
    est, err, info = mg.trace_estimate(f, jnp.zeros(20, dtype), jax.random.PRNGKey(0), num_probes=budget,
                                       method="xtrace", return_info=True)
    truth = np.sum(U64**2)
    tol = 100 * float(jnp.finfo(dtype).eps) * np.linalg.cond(U64) ** 2 * truth
    assert abs(float(est) - truth) < tol and float(err) < tol, (float(est) - truth, float(err), tol)
    assert info.num_products == 2 * (budget // 2) and mg.Status(int(info.status)) == mg.Status.OK


def test_xtrace_of_an_exactly_singular_sketch_is_exact_not_nan():
    """The zero operator and a rank-one one: R of the sketch has exactly zero (or rounding-size) pivots."""
    est, err = mg.trace_estimate(lambda x: 0.0 * jnp.sum(x**2), jnp.zeros(6), jax.random.PRNGKey(0), num_probes=8,
                                 method="xtrace")
    assert float(est) == 0.0 and float(err) == 0.0
    u = jnp.asarray([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # tr(u u^T) = 2; a sign probe gives 0 or 4
    est, err = mg.trace_estimate(lambda x: 0.5 * (u @ x) ** 2, jnp.zeros(6), jax.random.PRNGKey(0), num_probes=8,
                                 method="xtrace")
    assert abs(float(est) - 2.0) < 1e-12 and float(err) < 1e-12, (float(est), float(err))


def test_xtrace_and_xdiag_under_jit_and_over_a_dataset():
    r = rng(4)
    X, Y = jnp.asarray(r.normal(size=(24, 5))), jnp.asarray(r.normal(size=24))
    loss = lambda w, b: jnp.mean((jnp.tanh(b[0] @ w) - b[1]) ** 2)
    w0 = jnp.asarray(r.normal(size=5))
    key = jax.random.PRNGKey(5)
    halves = [(X[:12], Y[:12]), (X[12:], Y[12:])]
    H = mg.operators.hessian_operator(loss, w0)
    fn, fe = mg.trace_estimate(loss, w0, key, batch=(X, Y), num_probes=9, method="xtrace")
    jitted, je, info = jax.jit(
        lambda w: mg.trace_estimate(loss, w, key, batch=(X, Y), num_probes=9, method="xtrace", return_info=True)
    )(w0)
    op, oe = H.trace_estimate(key, halves, num_probes=9, method="xtrace")
    np.testing.assert_allclose([float(jitted), float(op)], float(fn), rtol=1e-9)
    np.testing.assert_allclose([float(je), float(oe)], float(fe), rtol=1e-7)
    assert mg.Status(int(info.status)) == mg.Status.OK and info.num_products == 8
    dfn, dse = mg.diagonal_estimate(loss, w0, key, batch=(X, Y), num_probes=6, method="xdiag")
    djit = jax.jit(lambda w: mg.diagonal_estimate(loss, w, key, batch=(X, Y), num_probes=6, method="xdiag")[0])(w0)
    dop, dose = H.diagonal_estimate(key, halves, num_probes=6, method="xdiag")
    np.testing.assert_allclose(np.asarray(djit), np.asarray(dfn), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dop), np.asarray(dfn), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(dose), np.asarray(dse), rtol=1e-7, atol=1e-12)
    # a one-shot iterator cannot be passed twice
    with pytest.raises(mg.GeometryError, match="one-shot iterator"):
        H.trace_estimate(key, iter(halves), num_probes=9, method="xtrace", max_batches=2)
    with pytest.raises(mg.GeometryError, match="one-shot iterator"):
        H.diagonal_estimate(key, iter(halves), num_probes=6, method="xdiag", max_batches=2)


SCALE = 1.0  # a notebook-style global, read by the loss


def test_never_stale_a_changed_global_is_read_at_the_next_call():
    global SCALE
    f0, x, A = _decaying(10, jnp.float64)
    f = lambda v: SCALE * f0(v)
    key = jax.random.PRNGKey(7)
    try:
        SCALE = 1.0
        t1 = float(mg.trace_estimate(f, x, key, num_probes=8, method="xtrace")[0])
        d1 = np.asarray(mg.diagonal_estimate(f, x, key, num_probes=8, method="xdiag")[0])
        SCALE = 3.0
        t3 = float(mg.trace_estimate(f, x, key, num_probes=8, method="xtrace")[0])
        d3 = np.asarray(mg.diagonal_estimate(f, x, key, num_probes=8, method="xdiag")[0])
    finally:
        SCALE = 1.0
    np.testing.assert_allclose(t3, 3 * t1, rtol=1e-10)  # same key: the estimate is linear in the operator
    np.testing.assert_allclose(d3, 3 * d1, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(t3, _naive_xtrace(3 * np.asarray(A), key, 8)[0], rtol=1e-9)


def test_xdiag_equals_its_leave_one_out_definition():
    f, x, A = _decaying(12, jnp.float64, seed=13, power=1.0)
    key = jax.random.PRNGKey(4)
    diag, err = mg.diagonal_estimate(f, x, key, num_probes=11, method="xdiag")  # m = 5
    truth, truth_err = _naive_xdiag(np.asarray(A), key, 11)
    np.testing.assert_allclose(np.asarray(diag), truth, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(np.asarray(err), truth_err, rtol=1e-7, atol=1e-13)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xdiag_is_unbiased_its_error_falls_with_the_budget_and_beats_hutchinson(dtype):
    f, x, A = _decaying(40, dtype, seed=5, power=2.0)
    truth = np.asarray(jnp.diag(A), np.float64)
    rms = {}
    for method, budget in [("xdiag", 8), ("xdiag", 32), ("hutchinson", 32)]:
        runs, ses = [], []
        for i in range(20):
            diag, se = mg.diagonal_estimate(f, x, jax.random.PRNGKey(i), num_probes=budget, method=method)
            assert diag.dtype == dtype and diag.shape == (40,)
            runs.append(np.asarray(diag, np.float64))
            ses.append(np.asarray(se, np.float64))
        runs = np.stack(runs)
        rms[method, budget] = np.sqrt(np.mean((runs - truth) ** 2))
        if method == "xdiag":
            # unbiased: the mean over 20 runs within 5 standard errors, entry by entry
            bound = 5 * runs.std(0, ddof=1) / np.sqrt(20) + 1e2 * float(jnp.finfo(dtype).eps)
            assert np.all(np.abs(runs.mean(0) - truth) <= bound)
            # the per-entry error estimate has the order of the actual error
            ratio = np.sqrt(np.mean(np.stack(ses) ** 2)) / rms[method, budget]
            assert 1 / 4 < ratio < 4, ratio
    assert rms["xdiag", 32] < 0.5 * rms["xdiag", 8], rms
    assert rms["xdiag", 32] <= 0.25 * rms["hutchinson", 32], rms


def test_xdiag_returns_pytrees_like_the_params_and_is_exact_for_low_rank():
    U = jnp.asarray(rng(8).normal(size=(7, 2)))
    params = {"a": jnp.zeros((2, 2)), "b": jnp.zeros(3)}
    flat = lambda p: jnp.concatenate([p["a"].ravel(), p["b"]])
    f = lambda p: 0.5 * jnp.sum((U.T @ flat(p)) ** 2)
    diag, se = mg.diagonal_estimate(f, params, jax.random.PRNGKey(0), num_probes=8, method="xdiag")  # m = 4 > 2
    assert jax.tree_util.tree_structure(diag) == jax.tree_util.tree_structure(params)
    assert jax.tree_util.tree_structure(se) == jax.tree_util.tree_structure(params)
    np.testing.assert_allclose(np.asarray(flat(diag)), np.sum(np.asarray(U) ** 2, axis=1), rtol=1e-10, atol=1e-12)
    assert float(jnp.max(flat(se))) < 1e-10


def test_bad_budgets_and_methods_raise():
    f, x, A = _decaying(6, jnp.float64)
    key = jax.random.PRNGKey(0)
    with pytest.raises(mg.GeometryError, match="num_probes >= 4"):
        mg.trace_estimate(f, x, key, num_probes=3, method="xtrace")
    with pytest.raises(mg.GeometryError, match="num_probes >= 4"):
        mg.diagonal_estimate(f, x, key, num_probes=3, method="xdiag")
    with pytest.raises(mg.GeometryError, match="num_probes"):
        mg.trace_estimate(f, x, key, num_probes=4.0, method="xtrace")
    with pytest.raises(mg.GeometryError, match="xtrace"):  # the message lists the methods
        mg.trace_estimate(f, x, key, method="xtrace++")
    with pytest.raises(mg.GeometryError, match="xdiag"):
        mg.diagonal_estimate(f, x, key, method="hutch++")
    with pytest.raises(mg.GeometryError, match="batched"):
        mg.trace_estimate(f, x, key, num_probes=8, method="xtrace", batched="loop")
    with pytest.raises(mg.GeometryError):
        mg.diagonal_estimate(f, x, 0, num_probes=8, method="xdiag")

"""Dataset curvature operators: batch-by-batch products, one-pass Hutchinson, offloaded Lanczos.

Independent truths: the full-batch matrices built densely (``jax.hessian``/``jax.jacfwd``
on all examples at once), minigeo's full-batch estimators with the same keys, and the
device Lanczos.  float64 and float32 (tolerances scaled by the dtype's epsilon).
"""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import minigeo as mg
from minigeo._eigen import ResumableBlockLanczos, block_lanczos
from minigeo._estimators import rademacher_like
from helpers import compiles_during

N, D_IN, H, C = 37, 3, 5, 4  # 37 examples: batches of 10 leave a remainder of 7


def _mlp(params, x):
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]


def _setup(dtype=jnp.float64, n=N, seed=0):
    r = np.random.default_rng(seed)
    params = {
        "w1": jnp.asarray(r.normal(size=(D_IN, H)) / np.sqrt(D_IN), dtype),
        "b1": jnp.asarray(0.1 * r.normal(size=H), dtype),
        "w2": jnp.asarray(r.normal(size=(H, C)) / np.sqrt(H), dtype),
    }
    X = jnp.asarray(r.normal(size=(n, D_IN)), dtype)
    y = jnp.asarray(r.integers(0, C, size=n))
    return params, X, y


def _xent(z, t):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), t[:, None], axis=1))


def _per_example_xent(z, t):
    return -jnp.take_along_axis(jax.nn.log_softmax(z), t[:, None], axis=1)[:, 0]


def _loss(params, batch):
    return _xent(_mlp(params, batch[0]), batch[1])


def _operators(params):
    return {
        "hessian": mg.operators.hessian_operator(_loss, params),
        "ggn": mg.operators.ggn_operator(_mlp, _xent, params),
        "fisher": mg.operators.fisher_operator(_mlp, params),
        "empirical_fisher": mg.operators.empirical_fisher_operator(_mlp, _per_example_xent, params),
    }


def _dense_full_batch(kind, params, X, y):
    """The dataset matrix built densely on all examples at once (independent of minigeo)."""
    flat, unravel = ravel_pytree(params)
    if kind == "hessian":
        return jax.hessian(lambda f: _loss(unravel(f), (X, y)))(flat)
    z = _mlp(params, X)
    J = jax.jacfwd(lambda f: _mlp(unravel(f), X))(flat)  # (N, C, d)
    p = jax.nn.softmax(z)
    if kind in ("ggn", "fisher"):  # categorical: the output Hessian of the NLL equals the Fisher
        Hz = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(p)
        return jnp.einsum("nci,ncd,ndj->ij", J, Hz, J) / X.shape[0]
    g = p - jax.nn.one_hot(y, C, dtype=p.dtype)  # per-example output gradients
    Jg = jnp.einsum("nci,nc->ni", J, g)
    return Jg.T @ Jg / X.shape[0]


KINDS = ["hessian", "ggn", "fisher", "empirical_fisher"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_dataset_mv_equals_the_full_batch_matrix(kind, dtype):
    params, X, y = _setup(dtype)
    op = _operators(params)[kind]
    M = np.asarray(_dense_full_batch(kind, params, X, y), np.float64)
    v = jax.tree_util.tree_map(lambda x: jnp.ones_like(x) * 0.5, params)
    got = ravel_pytree(op.dataset_mv(v, mg.operators.batches_of((X, y), 10)))[0]
    want = M @ np.asarray(ravel_pytree(v)[0], np.float64)
    eps = float(jnp.finfo(dtype).eps)
    tol = 200 * eps * np.linalg.norm(M, 2) * np.linalg.norm(np.asarray(ravel_pytree(v)[0]))
    assert np.linalg.norm(np.asarray(got, np.float64) - want) <= tol
    assert got.dtype == dtype


def test_uneven_batches_are_weighted_by_their_sizes():
    """An unweighted mean of batch matrices would be wrong: 37 = 10 + 10 + 10 + 7."""
    params, X, y = _setup()
    op = _operators(params)["ggn"]
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    whole = ravel_pytree(op.mv(v, (X, y)))[0]
    split = ravel_pytree(op.dataset_mv(v, mg.operators.batches_of((X, y), 10)))[0]
    np.testing.assert_allclose(split, whole, rtol=1e-12, atol=1e-13)
    parts = [ravel_pytree(op.mv(v, b))[0] for b in mg.operators.batches_of((X, y), 10)]
    assert float(jnp.max(jnp.abs(sum(parts) / len(parts) - whole))) > 1e-6  # the naive mean differs


def test_hutchinson_in_one_pass_equals_the_full_batch_estimate_with_the_same_probes():
    params, X, y = _setup()
    key = jax.random.PRNGKey(3)
    op = mg.operators.hessian_operator(_loss, params)
    est, se = op.trace_estimate(key, mg.operators.batches_of((X, y), 10), num_probes=7)
    ref, ref_se = mg.trace_estimate(lambda p: _loss(p, (X, y)), params, key, num_probes=7)
    np.testing.assert_allclose([est, se], [ref, ref_se], rtol=1e-11)
    est_map, _ = op.trace_estimate(key, mg.operators.batches_of((X, y), 10), num_probes=7, batched="map")
    np.testing.assert_allclose(est_map, est, rtol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_hutchinson_agrees_with_the_exact_trace_within_its_standard_error(kind):
    params, X, y = _setup()
    exact = float(jnp.trace(_dense_full_batch(kind, params, X, y)))
    est, se = _operators(params)[kind].trace_estimate(jax.random.PRNGKey(0), mg.operators.batches_of((X, y), 8), num_probes=200)
    assert abs(float(est) - exact) <= 4 * float(se)
    assert 0 < float(se) < 0.2 * abs(exact)


def test_invariant_trace_with_a_metric_from_another_operator():
    """tr(G^-1 H) with G the GGN of one fixed batch, damped: equals the dense tr(G^-1 H)."""
    params, X, y = _setup()
    ops = _operators(params)
    G = ops["ggn"].as_metric((X, y)).with_damping(0.1)
    Gd = _dense_full_batch("ggn", params, X, y) + 0.1 * jnp.eye(ravel_pytree(params)[0].size)
    Hd = _dense_full_batch("hessian", params, X, y)
    exact = float(mg.endomorphism_trace(Hd, Gd))
    est, se = ops["hessian"].trace_estimate(jax.random.PRNGKey(1), mg.operators.batches_of((X, y), 10), metric=G, num_probes=300, tol=1e-10)
    assert abs(float(est) - exact) <= 4 * float(se)
    ref, _ = mg.trace_estimate(lambda p: _loss(p, (X, y)), params, jax.random.PRNGKey(1), metric=G, num_probes=300, tol=1e-10)
    np.testing.assert_allclose(est, ref, rtol=1e-8)


def test_failed_cg_in_the_dataset_trace_raises_its_own_error():
    """The probes' CG solves run inside lax.map and cannot raise: a solve stopped by maxiter used to give a
    silently inexact trace; now it is NaN inside and, eagerly, CG's own error."""
    params, X, y = _setup()
    ops = _operators(params)
    G = ops["ggn"].as_metric((X, y)).with_damping(1e-3)  # ill-conditioned: 2 CG steps cannot converge
    with pytest.raises(mg.GeometryError, match="did not converge"):
        ops["hessian"].trace_estimate(jax.random.PRNGKey(1), mg.operators.batches_of((X, y), 10), metric=G, maxiter=2)
    indefinite = mg.Metric(lambda p, v: jax.tree_util.tree_map(lambda a: -a, v), "indefinite")
    with pytest.raises(mg.GeometryError, match="not positive definite"):
        ops["hessian"].trace_estimate(jax.random.PRNGKey(1), mg.operators.batches_of((X, y), 10), metric=indefinite)


@pytest.mark.parametrize("kind", KINDS)
def test_top_eigenvalues_match_the_dense_spectrum(kind):
    params, X, y = _setup()
    d = ravel_pytree(params)[0].size
    exact = np.sort(np.linalg.eigvalsh(np.asarray(_dense_full_batch(kind, params, X, y))))[::-1][:3]
    got = _operators(params)[kind].top_eigenvalues(jax.random.PRNGKey(0), mg.operators.batches_of((X, y), 10), k=3, num_iterations=d)
    np.testing.assert_allclose(got, exact, rtol=1e-8, atol=1e-10 * abs(exact[0]))


def test_top_eigenvalues_of_the_endomorphism_with_a_diagonal_metric():
    params, X, y = _setup()
    d = ravel_pytree(params)[0].size
    w = jax.tree_util.tree_map(lambda x: 1.0 + jnp.abs(x), params)
    Hd = _dense_full_batch("hessian", params, X, y)
    exact = np.sort(np.asarray(mg.endomorphism_eigenvalues(Hd, jnp.diag(ravel_pytree(w)[0]))))[::-1][:2]
    op = mg.operators.hessian_operator(_loss, params)
    got = op.top_eigenvalues(jax.random.PRNGKey(0), mg.operators.batches_of((X, y), 10), k=2, metric=mg.metrics.diagonal(w), num_iterations=d)
    np.testing.assert_allclose(got, exact, rtol=1e-8)
    ref = mg.top_eigenvalues(lambda p: _loss(p, (X, y)), params, jax.random.PRNGKey(0), k=2, metric=mg.metrics.diagonal(w), num_iterations=d)
    np.testing.assert_allclose(got, ref, rtol=1e-8)


def test_low_rank_ggn_top_eigenvalues_with_breakdown_restarts():
    """3 examples x 4 outputs (softmax: rank 3 each): a GGN of rank <= 9 in d = 35; Lanczos breaks down."""
    params, X, y = _setup(n=3)
    d = ravel_pytree(params)[0].size
    M = np.asarray(_dense_full_batch("ggn", params, X, y))
    exact = np.sort(np.linalg.eigvalsh(M))[::-1]
    assert exact[9] < 1e-12 * exact[0]  # rank-deficient
    got = mg.operators.ggn_operator(_mlp, _xent, params).top_eigenvalues(jax.random.PRNGKey(0), [(X[:2], y[:2]), (X[2:], y[2:])], k=12, num_iterations=20)
    assert d > 20
    np.testing.assert_allclose(got, exact[:12], atol=1e-10 * exact[0])


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_one_vector_lanczos_on_the_host_equals_the_device_run(dtype):
    """SLQ's one-vector runs (block size 1 of the one recurrence): host basis = device basis."""
    r = np.random.default_rng(4)
    U = r.normal(size=(40, 4))
    A = jnp.asarray(U @ U.T + np.diag(r.uniform(0, 0.1, 40)), dtype)
    G = jnp.asarray(r.uniform(1, 3, 40), dtype)
    z = jnp.asarray(r.normal(size=40), dtype)
    eps = float(jnp.finfo(dtype).eps)
    key = jax.random.PRNGKey(2)
    for ginv in (None, lambda v: v / G):
        T_dev, alive, _ = block_lanczos(lambda v: A @ v, ginv, z[None], 12, key=key)
        gb = None if ginv is None else (lambda X: X / G)
        T_host, alive_h, _ = ResumableBlockLanczos(lambda X: X @ A.T, gb, z[None], key=key).projected(12)
        ev_dev, ev_host = np.linalg.eigvalsh(np.asarray(T_dev, np.float64)), np.linalg.eigvalsh(np.asarray(T_host, np.float64))
        np.testing.assert_allclose(ev_host, ev_dev, atol=1e3 * eps * float(ev_dev[-1]))
        # T is tridiagonal up to round-off: a one-vector Krylov space couples only neighbours
        off = np.abs(np.triu(np.asarray(T_dev, np.float64), 2)).max()
        assert off < 1e3 * eps * float(ev_dev[-1])
        assert T_host.dtype == dtype and bool(jnp.all(alive)) and bool(jnp.all(alive_h))


def test_one_vector_host_lanczos_propagates_nan():
    T, _, _ = ResumableBlockLanczos(lambda X: X * jnp.nan, None, jnp.ones((1, 5)), key=jax.random.PRNGKey(0)).projected(3)
    assert bool(jnp.all(jnp.isnan(jnp.diag(T))))


def test_the_issue_case_a_10_probe_trace_over_2048_examples_in_batches():
    """Issue 20: a 10-probe trace over a 2048-example set in batches of 256 (float32)."""
    params, X, y = _setup(jnp.float32, n=2048, seed=1)
    key = jax.random.PRNGKey(0)
    op = mg.operators.ggn_operator(_mlp, _xent, params)
    est, se = op.trace_estimate(key, mg.operators.batches_of((X, y), 256), num_probes=10)
    _, n = compiles_during(op.trace_estimate, key, mg.operators.batches_of((X, y), 256), num_probes=10)
    assert n == 0  # all 8 batches, and a second pass: one program
    G = mg.metrics.ggn(lambda p: _mlp(p, X), lambda z: _xent(z, y))
    ref = jnp.mean(jax.vmap(lambda z: ravel_pytree(z)[0] @ ravel_pytree(G.mv(params, z))[0])(rademacher_like(key, params, 10)))
    assert abs(float(est) - float(ref)) <= 100 * float(jnp.finfo(jnp.float32).eps) * abs(float(ref))


def test_no_recompilation_over_batches_passes_and_points():
    params, X, y = _setup()
    op = mg.operators.ggn_operator(_mlp, _xent, params)
    data = mg.operators.batches_of((X, y), 10, drop_remainder=True)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    op.dataset_mv(v, data)
    _, n = compiles_during(op.dataset_mv, v, data)
    moved = op.at(jax.tree_util.tree_map(lambda x: 1.1 * x, params))
    _, n_moved = compiles_during(moved.dataset_mv, v, data)
    _, n_fresh = compiles_during(mg.operators.ggn_operator(_mlp, _xent, params).dataset_mv, v, data)  # a new operator
    assert (n, n_moved, n_fresh) == (0, 0, 0)


def test_progress_bars_show_on_request_and_accept_a_tqdm_like_class(capsys):
    params, X, y = _setup()
    op = mg.operators.hessian_operator(_loss, params)
    data = mg.operators.batches_of((X, y), 10)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    op.dataset_mv(v, data)
    assert capsys.readouterr().err == ""  # off by default
    op.dataset_mv(v, data, progress=True)
    assert "4/4" in capsys.readouterr().err

    seen = []

    class Recorder:
        def __init__(self, iterable, desc, total):
            seen.append((desc, total))
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

    op.trace_estimate(jax.random.PRNGKey(0), data, num_probes=2, progress=Recorder)
    op.top_eigenvalues(jax.random.PRNGKey(0), data, num_iterations=3, rtol=None, progress=Recorder)
    assert seen == [("Hessian trace", 4), ("Hessian Lanczos", 3)]
    with pytest.raises(mg.GeometryError, match="tqdm-like"):
        op.dataset_mv(v, data, progress="yes")
    from tqdm.std import tqdm

    buf = io.StringIO()
    op.dataset_mv(v, data, progress=lambda it, **kw: tqdm(it, file=buf, **kw))
    assert "Hessian product" in buf.getvalue()


def test_batches_of_cuts_consecutive_batches():
    data = (jnp.arange(10.0)[:, None], jnp.arange(10))
    b = mg.operators.batches_of(data, 4)
    assert len(b) == 3 and [int(x[1][0]) for x in b] == [0, 4, 8]
    np.testing.assert_array_equal(jnp.concatenate([x[1] for x in b]), data[1])
    assert len(mg.operators.batches_of(data, 4, drop_remainder=True)) == 2
    assert int(b[-1][1][0]) == 8
    with pytest.raises(IndexError):
        b[3]


def test_bad_inputs_raise_clear_errors():
    params, X, y = _setup()
    op = mg.operators.ggn_operator(_mlp, _xent, params)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    with pytest.raises(mg.GeometryError, match="different numbers of examples"):
        mg.operators.batches_of((X, y[:5]), 4)
    with pytest.raises(mg.GeometryError, match="batch_size must be a positive int"):
        mg.operators.batches_of((X, y), 0)
    with pytest.raises(mg.GeometryError, match="no batch"):
        mg.operators.batches_of((X[:3], y[:3]), 4, drop_remainder=True)
    with pytest.raises(mg.GeometryError, match="one-shot iterator"):
        op.top_eigenvalues(jax.random.PRNGKey(0), (b for b in mg.operators.batches_of((X, y), 10)))
    with pytest.raises(mg.GeometryError, match="dataset is empty"):
        op.dataset_mv(v, [])
    with pytest.raises(mg.GeometryError, match="pair"):
        op.mv(v, X)
    with pytest.raises(mg.GeometryError, match="empty"):
        op.mv(v, (X[:0], y[:0]))
    with pytest.raises(mg.GeometryError):
        op.mv({"w1": v["w1"]}, (X, y))
    with pytest.raises(mg.GeometryError, match="num_probes"):
        op.trace_estimate(jax.random.PRNGKey(0), [(X, y)], num_probes=0)
    with pytest.raises(mg.GeometryError, match="batched"):
        op.trace_estimate(jax.random.PRNGKey(0), [(X, y)], batched="loop")
    with pytest.raises(mg.GeometryError, match="k must be"):
        op.top_eigenvalues(jax.random.PRNGKey(0), [(X, y)], k=0)
    with pytest.raises(mg.GeometryError, match="non-finite"):
        mg.operators.hessian_operator(_loss, jax.tree_util.tree_map(lambda x: x * jnp.nan, params))
    with pytest.raises(mg.GeometryError, match="likelihood"):
        mg.operators.fisher_operator(_mlp, params, likelihood="poisson")
    with pytest.raises(mg.GeometryError, match="callable"):
        mg.operators.CurvatureOperator(None, params, "x")
    bad = mg.operators.hessian_operator(lambda p, b: jnp.sum(p["w1"]) / 0.0 * jnp.sum(p["w2"] ** 2), params)
    with pytest.raises(mg.GeometryError, match="non-finite"):
        bad.trace_estimate(jax.random.PRNGKey(0), [(X, y)], num_probes=2)
    with pytest.raises(mg.GeometryError, match="non-finite"):
        bad.dataset_mv(v, [(X, y)])


def test_operator_lanczos_certifies_its_eigenvalues():
    """A too-short explicit run raises; the adaptive default (None) certifies and matches the dense spectrum."""
    params, X, y = _setup()
    op = mg.operators.hessian_operator(_loss, params)
    data = mg.operators.batches_of((X, y), 10)
    with pytest.raises(mg.GeometryError, match="not certified"):
        op.top_eigenvalues(jax.random.PRNGKey(0), data, k=3, num_iterations=3)
    exact = np.sort(np.linalg.eigvalsh(np.asarray(_dense_full_batch("hessian", params, X, y))))[::-1][:3]
    got = op.top_eigenvalues(jax.random.PRNGKey(0), data, k=3)
    assert np.all(np.abs(np.asarray(got) - exact) <= 1e-2 * abs(exact[0]))


def test_dataset_slq_equals_the_full_batch_slq_with_the_same_probes_and_the_dense_logdet():
    params, X, y = _setup()
    d = ravel_pytree(params)[0].size
    op = mg.operators.ggn_operator(_mlp, _xent, params)
    lam = 0.5
    key = jax.random.PRNGKey(5)
    est, se = op.logdet_slq(key, mg.operators.batches_of((X, y), 10), damping=lam, num_probes=8, num_iterations=d)
    G = mg.metrics.ggn(lambda p: _mlp(p, X), lambda z: _xent(z, y))
    unravel = ravel_pytree(params)[1]
    matvec = lambda v: ravel_pytree(G.mv(params, unravel(v)))[0] + lam * v
    ref, ref_se = mg.densities.logdet_slq(matvec, d, key, num_probes=8, num_iterations=d, dtype=jnp.float64)
    np.testing.assert_allclose([est, se], [ref, ref_se], rtol=1e-9)
    exact = float(jnp.linalg.slogdet(_dense_full_batch("ggn", params, X, y) + lam * jnp.eye(d))[1])
    assert abs(float(est) - exact) <= 4 * float(se) + 1e-8 * abs(exact)


def test_dataset_slq_refuses_a_singular_operator_and_bad_settings():
    params, X, y = _setup(n=3)  # a GGN of rank <= 9 in d = 35: singular without damping
    op = mg.operators.ggn_operator(_mlp, _xent, params)
    data = [(X, y)]
    with pytest.raises(mg.GeometryError, match="not positive definite"):
        op.logdet_slq(jax.random.PRNGKey(0), data, num_probes=2, num_iterations=35)
    with pytest.raises(mg.GeometryError, match="damping"):
        op.logdet_slq(jax.random.PRNGKey(0), data, damping=-1.0)
    with pytest.raises(mg.GeometryError, match="num_probes"):
        op.logdet_slq(jax.random.PRNGKey(0), data, num_probes=0)
    with pytest.raises(mg.GeometryError, match="one-shot iterator"):
        op.logdet_slq(jax.random.PRNGKey(0), iter(data))
    est, se = op.logdet_slq(jax.random.PRNGKey(0), data, damping=1.0, num_probes=2, num_iterations=35)
    assert np.isfinite(float(est)) and np.isfinite(float(se))

"""Eigenvectors of ``top_eigenvalues`` and per-head (sub-array) restriction (issue 36).

Truths: ``scipy.linalg.eigh(H, G)`` of dense pencils with known (repeated, negative) spectra, and
``jax.hessian`` sub-blocks in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import minigeo as mg
from helpers import rng

DTYPES = [jnp.float64, jnp.float32]
RTOL = {jnp.float64: 1e-8, jnp.float32: 1e-4}


def _pencil(d, eigs, dtype, seed=0, metric=True):
    """``H = G^{1/2} Q diag(eigs) Q^T G^{1/2}``-like pencil with E = G^{-1}H of spectrum ``eigs``."""
    r = rng(seed)
    Q, _ = np.linalg.qr(r.normal(size=(d, d)))
    w = r.uniform(0.3, 3.0, size=d) if metric else np.ones(d)
    w = np.asarray(jnp.asarray(w, dtype), np.float64)
    G = np.diag(w)  # a diagonal metric: solved elementwise
    if metric == "dense":  # a dense one: Cholesky-solved
        B = r.normal(size=(d, d)) / np.sqrt(d) + np.eye(d)
        G = np.asarray(jnp.asarray(B @ B.T + 0.5 * np.eye(d), dtype), np.float64)
    L = np.linalg.cholesky(G)
    H = L @ Q @ np.diag(eigs) @ Q.T @ L.T  # G^{-1}H = L^{-T} (Q diag Q^T) L^T: spectrum eigs
    H = 0.5 * (H + H.T)
    Hj = jnp.asarray(H, dtype)
    f = lambda x: 0.5 * x @ Hj @ x
    met = mg.metrics.diagonal(jnp.asarray(w, dtype)) if metric else None
    met = mg.metrics.dense(jnp.asarray(G, dtype)) if metric == "dense" else met
    return f, jnp.zeros(d, dtype), np.asarray(Hj, np.float64), np.asarray(jnp.asarray(G, dtype), np.float64), met


def _check_pairs(pairs, H, G, dtype, rtol):
    lam = np.asarray(pairs.values, np.float64)
    V = np.asarray(pairs.vectors, np.float64)  # (k, d)
    scale = np.abs(scipy.linalg.eigh(H, G, eigvals_only=True)).max()
    # residual: H v - lambda G v (the certificate bounds it by rtol x scale; round-off adds a few eps)
    R = V @ H - lam[:, None] * (V @ G)
    tol = (rtol + 100 * float(jnp.finfo(dtype).eps)) * scale * np.linalg.norm(G, 2)
    assert np.max(np.linalg.norm(R, axis=1)) <= tol, (np.linalg.norm(R, axis=1), tol)
    # G-orthonormal
    np.testing.assert_allclose(V @ G @ V.T, np.eye(len(lam)), atol=100 * float(jnp.finfo(dtype).eps) * len(H))
    return lam, V


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", [False, True, "dense"])
def test_vectors_match_dense_eigh(dtype, metric):
    eigs = np.linspace(-1.0, 3.0, 12) ** 3
    f, x, H, G, met = _pencil(12, eigs, dtype, metric=metric)
    key = jax.random.PRNGKey(0)
    pairs = mg.top_eigenvalues(f, x, key, k=3, metric=met, num_iterations=12, rtol=RTOL[dtype], return_vectors=True)
    assert isinstance(pairs, mg.curvature.Eigenpairs) and pairs.vectors.shape == (3, 12) and pairs.vectors.dtype == dtype
    lam, V = _check_pairs(pairs, H, G, dtype, RTOL[dtype])
    w, U = scipy.linalg.eigh(H, G)
    np.testing.assert_allclose(lam, w[::-1][:3], rtol=10 * RTOL[dtype], atol=1e-3 * RTOL[dtype])
    # simple eigenvalues: each vector is +-the dense one (G-orthonormal columns of U)
    overlap = np.abs(np.sum((V @ G) * U[:, ::-1][:, :3].T, axis=1))
    np.testing.assert_allclose(overlap, 1.0, atol=1e3 * RTOL[dtype])
    # the default return is unchanged: the values alone
    plain = mg.top_eigenvalues(f, x, key, k=3, metric=met, num_iterations=12, rtol=RTOL[dtype])
    assert isinstance(plain, jax.Array)
    np.testing.assert_allclose(np.asarray(plain), np.asarray(pairs.values))


@pytest.mark.parametrize("dtype", DTYPES)
def test_triple_eigenvalue_vectors_span_the_eigenspace(dtype):
    eigs = np.array([5.0, 5.0, 5.0, 2.0, 1.5, 1.0, 0.5, 0.25, 0.0, -1.0, -1.0, -3.0])
    f, x, H, G, met = _pencil(len(eigs), eigs, dtype, seed=3)
    pairs = mg.top_eigenvalues(f, x, jax.random.PRNGKey(1), k=3, metric=met, num_iterations=12, rtol=RTOL[dtype], return_vectors=True)
    lam, V = _check_pairs(pairs, H, G, dtype, RTOL[dtype])
    np.testing.assert_allclose(lam, 5.0, rtol=10 * RTOL[dtype])
    w, U = scipy.linalg.eigh(H, G)
    Us = U[:, np.abs(w - 5.0) < 1e-3]  # the eigenspace, G-orthonormal columns
    assert Us.shape[1] == 3
    # every vector lies in the eigenspace: v = Us Us^T G v
    resid = V.T - Us @ (Us.T @ G @ V.T)
    assert np.abs(resid).max() < 1e3 * RTOL[dtype], np.abs(resid).max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_smallest_end_vectors_and_both(dtype):
    eigs = np.array([-4.0, -4.0, -1.0, 0.5, 1.0, 2.0, 3.0, 3.5, 6.0, 7.0, 0.0, 0.25])
    f, x, H, G, met = _pencil(len(eigs), eigs, dtype, seed=5)
    key = jax.random.PRNGKey(2)
    pairs = mg.top_eigenvalues(f, x, key, k=3, metric=met, which="smallest", num_iterations=12, rtol=RTOL[dtype], return_vectors=True)
    lam, V = _check_pairs(pairs, H, G, dtype, RTOL[dtype])
    np.testing.assert_allclose(lam, [-4.0, -4.0, -1.0], rtol=10 * RTOL[dtype])
    top, bottom = mg.top_eigenvalues(f, x, key, k=2, metric=met, which="both", num_iterations=12, rtol=RTOL[dtype], return_vectors=True)
    _check_pairs(top, H, G, dtype, RTOL[dtype])
    _check_pairs(bottom, H, G, dtype, RTOL[dtype])
    np.testing.assert_allclose(np.asarray(top.values), [7.0, 6.0], rtol=10 * RTOL[dtype])
    np.testing.assert_allclose(np.asarray(bottom.values), [-4.0, -4.0], rtol=10 * RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_vectors_under_jit_are_pytrees_and_match_eager(dtype):
    eigs = np.array([4.0, 3.0, 2.0, 1.0, 0.5, 0.25])
    _, _, H, _, _ = _pencil(6, eigs, dtype, seed=7, metric=False)
    Hj = jnp.asarray(H, dtype)
    f = lambda p: 0.5 * jnp.concatenate([p["a"].ravel(), p["b"]]) @ Hj @ jnp.concatenate([p["a"].ravel(), p["b"]])
    params = {"a": jnp.zeros((2, 2), dtype), "b": jnp.zeros(2, dtype)}
    key = jax.random.PRNGKey(0)
    run = lambda p: mg.top_eigenvalues(f, p, key, k=2, num_iterations=6, return_vectors=True, return_info=True)
    (pairs, info), (eager, _) = jax.jit(run)(params), run(params)
    assert int(info.status) == 0
    assert pairs.vectors["a"].shape == (2, 2, 2) and pairs.vectors["b"].shape == (2, 2)
    flat = np.concatenate([np.asarray(pairs.vectors["a"]).reshape(2, 4), np.asarray(pairs.vectors["b"])], axis=1)
    np.testing.assert_allclose(np.abs(flat @ H @ flat.T), np.diag([4.0, 3.0]), atol=1e3 * float(jnp.finfo(dtype).eps))
    np.testing.assert_allclose(np.asarray(pairs.values), np.asarray(eager.values), rtol=100 * float(jnp.finfo(dtype).eps))


def test_uncertified_pairs_are_nan_under_jit():
    eigs = np.linspace(0.0, 1.0, 12) ** 0.5
    f, x, H, G, _ = _pencil(12, eigs, jnp.float64, metric=False)
    run = jax.jit(lambda x: mg.top_eigenvalues(f, x, jax.random.PRNGKey(0), k=3, num_iterations=3, rtol=1e-12,
                                               return_vectors=True, return_info=True))
    pairs, info = run(x)
    assert mg.Status(int(info.status)) == mg.Status.UNCERTIFIED
    bad = np.isnan(np.asarray(pairs.values))
    assert bad.any() and np.all(np.isnan(np.asarray(pairs.vectors)[bad]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_operator_vectors_over_a_dataset(dtype):
    r = rng(11)
    X = jnp.asarray(r.normal(size=(30, 5)), dtype)
    loss = lambda w, x: 0.5 * jnp.mean((x @ w) ** 2)
    H = mg.operators.hessian_operator(loss, jnp.zeros(5, dtype))
    truth = np.asarray(X, np.float64).T @ np.asarray(X, np.float64) / 30
    pairs = H.top_eigenvalues(jax.random.PRNGKey(0), mg.operators.batches_of(X, 10), k=2, num_iterations=12, rtol=RTOL[dtype], return_vectors=True)
    _check_pairs(pairs, truth, np.eye(5), dtype, RTOL[dtype])
    bottom = H.top_eigenvalues(jax.random.PRNGKey(0), [X], k=1, which="smallest", num_iterations=12, rtol=RTOL[dtype], return_vectors=True)
    _check_pairs(bottom, truth, np.eye(5), dtype, RTOL[dtype])


# ---------------------------------------------------------------------------
# per-head restriction
# ---------------------------------------------------------------------------
def _stacked_model(dtype, seed=0):
    """A loss with a leaf stacked (layers, heads, a, b), like a ViT's per-head attention weights."""
    r = rng(seed)
    params = {
        "attn": {"W_q": jnp.asarray(r.normal(size=(2, 3, 4, 2)), dtype),
                 "b_q": jnp.asarray(r.normal(size=(2, 3, 2)), dtype)},
        "out": jnp.asarray(r.normal(size=(6,)), dtype),
    }
    X = jnp.asarray(r.normal(size=(7, 4)), dtype)

    def loss(p, x):
        z = jnp.einsum("ni,lhij->nlhj", x, p["attn"]["W_q"]) + p["attn"]["b_q"]
        z = jnp.tanh(z).reshape(x.shape[0], -1)
        return jnp.mean(jnp.sin(z[:, :6] @ p["out"]) ** 2 + 0.1 * jnp.sum(z**2, axis=1))

    return loss, params, X


def _dense_block(loss, params, X, index_sets):
    """The float64 ``jax.hessian`` sub-block on the flat indices of ``index_sets`` [(path, index), ...]."""
    as64 = lambda t: jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), t)
    p64, X64 = as64(params), as64(X)
    flat, unravel = jax.flatten_util.ravel_pytree(p64)
    Hfull = np.asarray(jax.hessian(lambda v: loss(unravel(v), X64))(flat))
    # flat position of every entry: ravel an index-valued pytree
    pos = unravel(jnp.arange(flat.size, dtype=jnp.float64))
    idx = []
    for path, index in index_sets:
        leaf = pos
        for k in path:
            leaf = leaf[k]
        idx.append(np.asarray(leaf[index] if index is not None else leaf).ravel().astype(int))
    idx = np.concatenate(idx)
    return Hfull[np.ix_(idx, idx)]


@pytest.mark.parametrize("dtype", [jnp.float64, pytest.param(jnp.float32, marks=pytest.mark.slow)])
def test_per_head_restriction_equals_the_dense_sub_block(dtype):
    loss, params, X = _stacked_model(dtype)
    Wq, bq = ("attn", "W_q"), ("attn", "b_q")
    sel = [(bq, (1, 2)), (Wq, (1, 2))]  # layer 1, head 2
    truth = _dense_block(loss, params, X, [(Wq, (1, 2)), (bq, (1, 2))])  # ravel order of the keys: W_q, b_q
    tol = 100 * float(jnp.finfo(dtype).eps) * np.abs(truth).max()
    op = mg.operators.hessian_operator(loss, params).restrict(sel)
    assert set(op.params) == {bq + ((1, 2),), Wq + ((1, 2),)}
    np.testing.assert_array_equal(np.asarray(op.params[Wq + ((1, 2),)]), np.asarray(params["attn"]["W_q"][1, 2]))
    assert "attn/W_q[1, 2]" in op.name
    flat0, unravel = jax.flatten_util.ravel_pytree(op.params)
    d = flat0.size
    assert d == 10
    cols = np.stack([np.asarray(jax.flatten_util.ravel_pytree(op.dataset_mv(unravel(e), [X]))[0], np.float64)
                     for e in jnp.eye(d, dtype=dtype)])
    np.testing.assert_allclose(cols, truth, atol=tol)
    # the function form with paths=, eagerly and under jit
    key = jax.random.PRNGKey(0)
    top = mg.top_eigenvalues(loss, params, key, batch=X, k=2, num_iterations=d, paths=sel)
    np.testing.assert_allclose(np.asarray(top), np.linalg.eigvalsh(truth)[::-1][:2], rtol=1e-2)
    jitted = jax.jit(lambda p: mg.top_eigenvalues(loss, p, key, batch=X, k=2, num_iterations=d, paths=sel))(params)
    np.testing.assert_allclose(np.asarray(jitted), np.linalg.eigvalsh(truth)[::-1][:2], rtol=1e-2)
    est, se = mg.trace_estimate(loss, params, key, batch=X, num_probes=200, paths=sel)
    assert abs(float(est) - np.trace(truth)) <= 4 * float(se) + tol
    diag, dse = mg.diagonal_estimate(loss, params, key, batch=X, num_probes=400, paths=sel)
    flat_diag = np.asarray(jax.flatten_util.ravel_pytree(diag)[0], np.float64)
    flat_se = np.asarray(jax.flatten_util.ravel_pytree(dse)[0], np.float64)
    assert np.all(np.abs(flat_diag - np.diag(truth)) <= 5 * flat_se + tol)
    dens = mg.spectral_density(loss, params, key, batch=X, num_probes=2, num_iterations=d, paths=sel)
    # d Lanczos steps: the nodes are eigenvalues of the block
    ev = np.linalg.eigvalsh(truth)
    nodes = np.asarray(dens.nodes, np.float64).ravel()
    gaps = np.min(np.abs(nodes[:, None] - ev[None, :]), axis=1)
    assert gaps.max() <= 1e4 * float(jnp.finfo(dtype).eps) * np.abs(ev).max(), gaps
    # another head: a different block (and not its neighbour's)
    other = _dense_block(loss, params, X, [(Wq, (0, 1)), (bq, (0, 1))])
    top2 = mg.top_eigenvalues(loss, params, key, batch=X, k=1, num_iterations=d, paths=[(bq, (0, 1)), (Wq, (0, 1))])
    np.testing.assert_allclose(np.asarray(top2), np.linalg.eigvalsh(other)[-1:], rtol=1e-2)
    # a whole leaf next to a sub-array of another, and a leading-axis (whole layer) index
    mixed = mg.operators.hessian_operator(loss, params).restrict([("out",), (Wq, (0,))])
    assert mixed.params[Wq + ((0,),)].shape == (3, 4, 2)


def test_bad_paths_and_indices_raise_naming_the_path_and_the_valid_ones():
    loss, params, X = _stacked_model(jnp.float64)
    H = mg.operators.hessian_operator(loss, params)
    Wq = ("attn", "W_q")
    with pytest.raises(mg.GeometryError, match=r"no leaf at \('attn', 'W_k'\).*attn/W_q \(2, 3, 4, 2\)"):
        H.restrict([("attn", "W_k")])
    with pytest.raises(mg.GeometryError, match=r"index \(0, 3\) is out of range for the leaf attn/W_q of shape \(2, 3, 4, 2\).*0\.\.2"):
        H.restrict([(Wq, (0, 3))])
    with pytest.raises(mg.GeometryError, match="out of range"):
        H.restrict([(Wq, (0, 0, 0, 0, 0))])
    with pytest.raises(mg.GeometryError, match="out of range"):
        H.restrict([(Wq, (-1, 0))])
    with pytest.raises(mg.GeometryError, match="overlap"):
        H.restrict([(Wq, (0, 1)), (Wq, (0,))])
    with pytest.raises(mg.GeometryError, match="overlap"):
        H.restrict([Wq, (Wq, (1, 1))])
    with pytest.raises(mg.GeometryError, match="top_eigenvalues: .*no leaf at"):
        mg.top_eigenvalues(loss, params, jax.random.PRNGKey(0), batch=X, paths=[("nope",)])
    with pytest.raises(mg.GeometryError, match="no paths given"):
        H.restrict([])
    with pytest.raises(mg.GeometryError, match="return_vectors"):
        mg.top_eigenvalues(loss, params, jax.random.PRNGKey(0), batch=X, return_vectors="yes")

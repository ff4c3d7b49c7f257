"""Issue 31, items 4-6: explicit batch rules, input errors, low precision, rho bounds, accuracy-based GL(h) rule."""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rng

import minigeo as mg


# ---------------------------------------------------------------------------
# item 4: the example count of a batch, finite passes
# ---------------------------------------------------------------------------
def _masked_problem():
    """A dict batch whose first leaf (in tree order) is a shared mask, not per-example."""
    r = rng(0)
    X = jnp.asarray(r.normal(size=(6, 3)))
    mask = jnp.asarray([1.0, 0.5, 2.0])  # shared by every example; sorts first ("a_mask" < "x")
    loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ (b["a_mask"] * w)) ** 2)
    batches = [{"a_mask": mask, "x": X[:4]}, {"a_mask": mask, "x": X[4:]}]
    D = np.diag(np.asarray(mask))
    truth = D @ np.asarray(X).T @ np.asarray(X) @ D / 6  # the dataset-mean Hessian
    return loss, batches, truth


def test_batch_leaves_disagreeing_on_examples_raise_naming_them():
    loss, batches, _ = _masked_problem()
    H = mg.operators.hessian_operator(loss, jnp.zeros(3))
    with pytest.raises(mg.GeometryError, match=r"disagree.*\['a_mask'\]: 3.*\['x'\]: 4.*examples="):
        H.dataset_mv(jnp.ones(3), batches)
    with pytest.raises(mg.GeometryError, match=r"disagree"):
        H.trace_estimate(jax.random.PRNGKey(0), batches)
    with pytest.raises(mg.GeometryError, match=r"scalar.*examples="):
        H.mv(jnp.ones(3), {"t": jnp.asarray(1.0), "x": jnp.ones((2, 3))})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_examples_rule_gives_the_dataset_mean(dtype):
    """With examples= the batches are weighted 4 : 2 (the old first-leaf rule weighted them 3 : 3)."""
    loss, batches, truth = _masked_problem()
    batches = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), batches)
    H = mg.operators.hessian_operator(loss, jnp.zeros(3, dtype), examples=lambda b: b["x"].shape[0])
    v = jnp.asarray([1.0, -2.0, 0.5], dtype)
    tol = 50 * float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(H.dataset_mv(v, batches), truth @ np.asarray(v, np.float64), rtol=tol, atol=tol)
    est, _ = H.trace_estimate(jax.random.PRNGKey(0), batches, num_probes=200)
    assert abs(float(est) - np.trace(truth)) < 0.5 * np.trace(truth)  # Hutchinson, 200 probes
    with pytest.raises(mg.GeometryError, match=r"examples\(batch\) must return"):
        mg.operators.hessian_operator(loss, jnp.zeros(3), examples=lambda b: 0.5).dataset_mv(jnp.ones(3), batches)
    with pytest.raises(mg.GeometryError, match=r"examples must be None or a function"):
        mg.operators.hessian_operator(loss, jnp.zeros(3), examples=4)


def _endless(X):
    for i in itertools.count():
        yield X[2 * (i % 2) : 2 * (i % 2) + 2]


def test_endless_batches_raise_eagerly_and_max_batches_bounds_a_pass():
    X = jnp.asarray(rng(1).normal(size=(4, 3)))
    H = mg.operators.hessian_operator(lambda w, x: 0.5 * jnp.mean((x @ w) ** 2), jnp.zeros(3))
    v = jnp.ones(3)
    t0 = time.perf_counter()
    for call in (
        lambda: H.dataset_mv(v, _endless(X)),
        lambda: H.dataset_mv(v, lambda: _endless(X)),
        lambda: H.trace_estimate(jax.random.PRNGKey(0), _endless(X)),
        lambda: H.top_eigenvalues(jax.random.PRNGKey(0), lambda: _endless(X)),
        lambda: H.logdet_slq(jax.random.PRNGKey(0), lambda: _endless(X), damping=1.0),
    ):
        with pytest.raises(mg.GeometryError, match=r"no length.*max_batches"):
            call()
    assert time.perf_counter() - t0 < 30.0  # it ends (the old code never did); generous on a shared CPU
    # a generator with max_batches: exactly that many batches, with a sized progress bar
    seen = []

    class Bar:
        def __init__(self, it, desc, total):
            seen.append(total)
            self.it = it

        def __iter__(self):
            return iter(self.it)

    out = H.dataset_mv(v, _endless(X), max_batches=2, progress=Bar)
    np.testing.assert_allclose(out, np.asarray(X).T @ np.asarray(X) @ np.ones(3) / 4, rtol=1e-5)
    assert seen == [2]
    ev = H.top_eigenvalues(jax.random.PRNGKey(0), lambda: _endless(X), max_batches=2, k=1)
    np.testing.assert_allclose(ev[0], np.linalg.eigvalsh(np.asarray(X).T @ np.asarray(X) / 4)[-1], rtol=1e-2)
    with pytest.raises(mg.GeometryError, match=r"max_batches must be"):
        H.dataset_mv(v, [X], max_batches=0)


def test_sized_sequences_still_work_without_max_batches():
    X = jnp.asarray(rng(2).normal(size=(5, 3)))
    H = mg.operators.hessian_operator(lambda w, x: 0.5 * jnp.mean((x @ w) ** 2), jnp.zeros(3))
    want = np.asarray(X).T @ np.asarray(X) @ np.ones(3) / 5
    for source in (mg.operators.batches_of(X, 2), [X[:2], X[2:]], lambda: mg.operators.batches_of(X, 3), (X[:1], X[1:])):
        np.testing.assert_allclose(H.dataset_mv(jnp.ones(3), source), want, rtol=1e-5)


def test_batches_stacked_form():
    b = mg.operators.batches_of((jnp.arange(12.0).reshape(6, 2), jnp.arange(6)), 3).stacked()
    assert b[0].shape == (2, 3, 2) and b[1].shape == (2, 3)
    np.testing.assert_array_equal(b[1][1], [3, 4, 5])
    with pytest.raises(mg.GeometryError, match=r"drop_remainder"):
        mg.operators.batches_of(jnp.arange(5.0), 2).stacked()
    assert mg.operators.batches_of(jnp.arange(5.0), 2, drop_remainder=True).stacked().shape == (2, 2)


# ---------------------------------------------------------------------------
# item 4: sharpness takes stacked batches only
# ---------------------------------------------------------------------------
def _regression():
    r = rng(3)
    X = jnp.asarray(r.normal(size=(8, 3)))
    w = jnp.asarray(r.normal(size=3))
    y = X @ w + 0.1 * jnp.asarray(r.normal(size=8))
    loss = lambda p, b: jnp.mean((b[0] @ p - b[1]) ** 2)
    return loss, w, X, y


def test_unstacked_batch_is_refused_with_how_to_stack():
    loss, w, X, y = _regression()
    key = jax.random.PRNGKey(0)
    for call in (
        lambda: mg.adaptive_sharpness(loss, w, (X, y), 0.1, key=key, n_iter=2),
        lambda: mg.adaptive_sharpness(loss, w, (X, y), 0.1, key=key, kind="average", n_samples=2),
        lambda: mg.geodesic_sharpness(loss, w, (X, y), mg.symmetry_spec(w), 0.1, key=key, n_iter=2),
    ):
        with pytest.raises(mg.GeometryError, match=r"not stacked.*\[1\] has shape \(8,\).*x\[None\].*stacked\(\)"):
            call()
    # the stacked forms: one batch, or a dataset cut into batches
    one = mg.adaptive_sharpness(loss, w, (X[None], y[None]), 0.1, key=key, n_iter=2)
    two = mg.adaptive_sharpness(loss, w, mg.operators.batches_of((X, y), 4).stacked(), 0.1, key=key, n_iter=2)
    assert one.per_batch.shape == (1,) and two.per_batch.shape == (2,) and bool(one.ok) and bool(two.ok)


# ---------------------------------------------------------------------------
# item 5: dtype, key and shape mistakes are GeometryErrors naming the argument
# ---------------------------------------------------------------------------
def test_sharpness_key_and_shape_errors():
    loss, w, X, y = _regression()
    b = (X[None], y[None])
    for bad in (0, 1.5, None, jnp.zeros(2), jnp.zeros((3, 2), jnp.uint32)):
        with pytest.raises(mg.GeometryError, match=r"key must be"):
            mg.adaptive_sharpness(loss, w, b, 0.1, key=bad, n_iter=2)
    assert bool(mg.adaptive_sharpness(loss, w, b, 0.1, key=jax.random.key(0), n_iter=2).ok)  # typed keys work
    with pytest.raises(mg.GeometryError, match=r"loss_fn\(params, batch\) fails.*\(8, 4\).*trailing shapes"):
        mg.adaptive_sharpness(loss, w, (jnp.ones((1, 8, 4)), y[None]), 0.1, key=jax.random.PRNGKey(0))
    with pytest.raises(mg.GeometryError, match=r"real floating scalar"):
        mg.adaptive_sharpness(lambda p, bb: bb[0] @ p, w, b, 0.1, key=jax.random.PRNGKey(0))
    with pytest.raises(mg.GeometryError, match=r"key must be"):
        H = mg.operators.hessian_operator(lambda p, x: jnp.mean((x @ p) ** 2), w)
        H.trace_estimate(3, [X])
    with pytest.raises(mg.GeometryError, match=r"key must be"):
        mg.trace_estimate(lambda p: jnp.sum(p**4), w, 3)


@pytest.mark.parametrize("bad", [np.arange(3), jnp.ones(3, jnp.float32), jnp.ones(3, jnp.complex128)])
def test_tangent_dtype_mistakes_name_the_argument(bad):
    p = jnp.ones(3, jnp.float64)
    f = lambda x: jnp.sum(x**3)
    with pytest.raises(mg.GeometryError, match=r"the vector v has dtype .*(params|theta) has dtype float64"):
        mg.hvp(f, p, bad)
    with pytest.raises(mg.GeometryError, match=r"the vector v has dtype"):
        mg.transform_vector(mg.reparam.log(), p, bad)
    with pytest.raises(mg.GeometryError, match=r"vector v has (the complex )?dtype"):
        mg.ggn(lambda x: x, lambda z: jnp.sum(z**2)).mv(p, bad)
    with pytest.raises(mg.GeometryError, match=r"v has dtype"):
        mg.operators.hessian_operator(lambda q, x: jnp.mean((x @ q) ** 2), p).dataset_mv(bad, [jnp.ones((2, 3))])
    # the right dtype (and a Python float on a scalar point) still works
    np.testing.assert_allclose(mg.hvp(f, p, jnp.ones(3)), 6 * np.ones(3))
    np.testing.assert_allclose(mg.hvp(lambda x: x**3, jnp.asarray(2.0), 1.0), 12.0)


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.complex128])
def test_complex_params_refused(dtype):
    p = jnp.ones(3, dtype)
    for call in (
        lambda: mg.trace_estimate(lambda w: jnp.sum(jnp.abs(w) ** 2), p, jax.random.PRNGKey(0)),
        lambda: mg.operators.hessian_operator(lambda w, x: jnp.sum(jnp.abs(w) ** 2), p),
        lambda: mg.euclidean().mv(p, p),
        lambda: mg.adaptive_sharpness(lambda w, b: jnp.sum(jnp.abs(w * b) ** 2), p, jnp.ones((1, 1, 3)), 0.1,
                                      key=jax.random.PRNGKey(0)),
    ):
        with pytest.raises(mg.GeometryError, match=r"complex dtype"):
            call()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_sharpness_refused_with_cast_advice(dtype):
    """bf16/f16 used to return 0 with status 0 at rho = 1e-3 (adaptive) and NotImplementedError (geodesic)."""
    params = {"G": jnp.eye(3, 2, dtype=dtype) + 0.1, "H": jnp.eye(4, 2, dtype=dtype) + 0.2}
    loss = lambda p, T: jnp.sum((p["G"] @ p["H"].T - T[0]) ** 2)
    T = jnp.ones((1, 1, 3, 4), dtype)
    spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    with pytest.raises(mg.GeometryError, match=r"float16|bfloat16.*float32"):
        mg.adaptive_sharpness(loss, params, T, 1e-3, key=jax.random.PRNGKey(0), n_iter=2)
    with pytest.raises(mg.GeometryError, match=r"Cast params.*float32"):
        mg.geodesic_sharpness(loss, params, T, spec, 1e-3, key=jax.random.PRNGKey(0), n_iter=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_absurd_rho_refused_eagerly_and_flagged_under_jit(dtype):
    loss = lambda w, b: 0.5 * jnp.sum(b[0] * (w - 1.0) ** 2)
    from minigeo.sharpness import _rho_limit

    w, b = jnp.ones(3, dtype), jnp.ones((1, 1, 3), dtype)
    limit = _rho_limit(dtype)
    assert limit == pytest.approx(1 / float(jnp.finfo(dtype).eps))
    for rho in (1e200 if dtype == jnp.float64 else 1e30, 2 * limit):
        with pytest.raises(mg.GeometryError, match=r"rho = .* at most 1/eps"):
            mg.adaptive_sharpness(loss, w, b, rho, key=jax.random.PRNGKey(0), n_iter=2)
    run = jax.jit(lambda r: mg.adaptive_sharpness(loss, w, b, r, key=jax.random.PRNGKey(0), n_iter=2).status)
    assert int(run(jnp.asarray(2 * limit, dtype))) == mg.Status.RHO_OUT_OF_RANGE
    assert int(run(jnp.asarray(0.1, dtype))) == 0
    # within the bound, the closed form rho^2 max(b) / 2 (= 0.5 rho^2 here)
    res = mg.adaptive_sharpness(loss, w, b, 0.1, key=jax.random.PRNGKey(0), n_iter=20)
    np.testing.assert_allclose(res.sharpness, 0.5 * 0.1**2, rtol=1e-3)


# ---------------------------------------------------------------------------
# item 6: an accuracy-based GL(h) rule
# ---------------------------------------------------------------------------
def _side_with_cond(r, n, h, cond):
    U = np.linalg.qr(r.normal(size=(n, h)))[0]
    V = np.linalg.qr(r.normal(size=(h, h)))[0]
    return U @ np.diag(np.geomspace(1.0, 1.0 / cond, h)) @ V.T


def _tall_pair(cond, n=1000, h=4, seed=5):
    """An attention-like pair (G, H) with n = 1000 rows (old float32 cut-off: cond 2.6e4) and side cond ``cond``."""
    r = rng(seed)
    X = jnp.asarray(r.normal(size=(1, 6, n)) / np.sqrt(n))
    T = jnp.asarray(r.normal(size=(1, 6, 6)))
    params = {"G": jnp.asarray(_side_with_cond(r, n, h, cond)), "H": jnp.asarray(_side_with_cond(r, n, h, 3.0))}

    def loss(p, b):
        X, T = b
        with jax.default_matmul_precision("highest"):
            s = X @ p["G"] @ p["H"].T @ X.T
        return jnp.mean((jax.nn.softmax(s * 3.0, axis=-1) - jax.nn.softmax(T, axis=-1)) ** 2) * 100

    return params, loss, (X, T)


def test_float32_pair_at_cond_4e4_accepted_and_accurate():
    """Side cond 4e4 at n = 1000: the old cut-off (10 sqrt(n) eps, i.e. cond 2.6e4) refused it; the
    error bound cond * eps = 4.8e-3 meets rtol = 1e-2, and the float32 value agrees with float64."""
    params, loss, batches = _tall_pair(4e4)
    spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    kw = dict(key=jax.random.PRNGKey(0), n_iter=6, n_restarts=0)
    g64 = mg.geodesic_sharpness(loss, params, batches, spec, 0.1, **kw)
    c32 = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t)
    g32 = mg.geodesic_sharpness(loss, c32(params), c32(batches), spec, 0.1, **kw)
    bound = float(g32.error_bound)
    assert int(g32.status) == 0 and 3e-3 < bound < 1e-2, bound
    assert float(g64.error_bound) < 1e-10
    np.testing.assert_allclose(float(g32.sharpness), float(g64.sharpness), rtol=max(bound, 1e-4))
    # under jit: status and bound, no exception
    jitted = jax.jit(lambda p: mg.geodesic_sharpness(loss, p, c32(batches), spec, 0.1, **kw))(c32(params))
    assert int(jitted.status) == 0 and float(jitted.error_bound) == pytest.approx(bound, rel=1e-3)


def test_refusal_names_an_eps_that_works():
    """cond 3e5 in float32: bound 3.6e-2 > rtol; the message names an eps, and that eps is accepted."""
    params, loss, batches = _tall_pair(3e5)
    c32 = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), t)
    params, batches = c32(params), c32(batches)
    spec = mg.symmetry_spec(params, [(("G",), ("H",))])
    kw = dict(key=jax.random.PRNGKey(0), n_iter=3, n_restarts=0)
    with pytest.raises(mg.GeometryError, match=r"too ill conditioned.*error bound.*eps=") as err:
        mg.geodesic_sharpness(loss, params, batches, spec, 0.1, **kw)
    eps = float(str(err.value).split("eps=")[1].split(")")[0])
    assert 0 < eps < 1e-2
    relaxed = mg.symmetry_spec(params, [(("G",), ("H",))], eps=eps)
    res = mg.geodesic_sharpness(loss, params, batches, relaxed, 0.1, **kw)
    assert int(res.status) == 0 and float(res.error_bound) <= 0.5e-2 * 1.01
    # a looser rtol accepts the unrelaxed pair and reports its bound
    loose = mg.geodesic_sharpness(loss, params, batches, spec, 0.1, rtol=0.05, **kw)
    assert 1e-2 < float(loose.error_bound) <= 0.05 and int(loose.status) == 0
    # under jit the refusal is a status
    st = jax.jit(lambda p: mg.geodesic_sharpness(loss, p, batches, spec, 0.1, **kw).status)(params)
    assert int(st) == mg.Status.ILL_CONDITIONED_PAIR
    for bad in (0.0, 1.0, -1e-3, "1e-2", True):
        with pytest.raises(mg.GeometryError, match=r"rtol must be"):
            mg.geodesic_sharpness(loss, params, batches, spec, 0.1, rtol=bad, **kw)


def test_adaptive_error_bound_is_the_dtype_eps():
    loss, w, X, y = _regression()
    for dtype in (jnp.float32, jnp.float64):
        res = mg.adaptive_sharpness(loss, w.astype(dtype), (X[None].astype(dtype), y[None].astype(dtype)), 0.1,
                                    key=jax.random.PRNGKey(0), n_iter=2)
        assert float(res.error_bound) == pytest.approx(float(jnp.finfo(dtype).eps))


@pytest.mark.slow
@pytest.mark.parametrize("cond", [3e4])
def test_tiny_vit_moved_heads_float32_matches_float64(cond):
    """A tiny ViT whose (q, k) heads are moved by A with cond(A) = 3e4: the float32 geodesic sharpness of
    the moved point agrees with the float64 value of the original point to 5e-3, with status 0."""
    import minigeo.models as mm

    cfg = mm.ViTConfig(image_size=4, patch_size=2, channels=1, num_classes=3, width=8, depth=1, heads=2, mlp_dim=8)
    p64 = mm.init_vit(jax.random.PRNGKey(0), cfg, dtype=jnp.float64)
    r = rng(0)
    shape = (cfg.depth, cfg.heads, cfg.head_dim, cfg.head_dim)
    U, V = np.linalg.qr(r.normal(size=shape))[0], np.linalg.qr(r.normal(size=shape))[0]
    A = (U * np.geomspace(1.0, 1.0 / cond, shape[-1])[..., None, :]) @ np.swapaxes(V, -1, -2)
    a = {k: np.asarray(v) for k, v in p64["blocks"]["attn"].items()}
    a["W_q"], a["W_k"] = a["W_q"] @ np.linalg.inv(A), a["W_k"] @ np.swapaxes(A, -1, -2)
    a["b_q"] = np.einsum("lhe,lhef->lhf", a["b_q"], np.linalg.inv(A))
    moved = dict(p64, blocks=dict(p64["blocks"], attn={k: jnp.asarray(v) for k, v in a.items()}))
    batches = (jnp.asarray(r.normal(size=(1, 4, 4, 4, 1))), jnp.asarray(r.integers(0, 3, size=(1, 4))))

    def loss(p, b):
        with jax.default_matmul_precision("highest"):
            return mm.cross_entropy(mm.vit_apply(p, b[0], cfg), b[1])

    spec = mm.vit_symmetry_spec(p64)
    kw = dict(key=jax.random.PRNGKey(0), n_iter=5, n_restarts=0)
    g64 = mg.geodesic_sharpness(loss, p64, batches, spec, 0.1, **kw)
    c32 = lambda t: jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.float64 else x, t)
    g32 = mg.geodesic_sharpness(loss, c32(moved), c32(batches), spec, 0.1, **kw)
    assert int(g32.status) == 0 and float(g32.error_bound) < 1e-2
    np.testing.assert_allclose(float(g32.sharpness), float(g64.sharpness), rtol=5e-3)

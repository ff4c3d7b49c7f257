"""Issue 30: minigeo never returns a stale value, never keeps a caller's data alive, and one calling
convention (``loss_fn(params, batch)`` or a closure) is as fast as plain eager JAX.

Truth: the same computation done fresh with plain JAX (``jax.jvp(jax.grad(f))``, dense
``jax.hessian``, ``numpy.linalg``) after the state the user's function reads has changed; weak
references for what is kept alive; jax.monitoring's compile events for what is recompiled.
Each stale-state case below failed on the identity/fingerprint cache this replaces.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import minigeo as mg
from helpers import compiles_during

DTYPES = [jnp.float64, jnp.float32]


def fresh_hvp(f, p, v):
    return jax.jvp(jax.grad(f), (p,), (v,))[1]


def close(a, b, dtype):
    tol = 100 * float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------
# every kind of state a notebook function reads
# ---------------------------------------------------------------------------
_STATE = {"scale": 1.0}
_G_SCALE = 1.0


def _deep3(p):
    return _G_SCALE * jnp.sum(p**3)


def _deep2(p):
    return _deep3(p)


def _deep1(p):
    return _deep2(p)


class _Holder:
    scale = 1.0


@dataclasses.dataclass
class _Config:
    scale: float = 1.0


class _CallableLoss:
    def __init__(self):
        self.scale = 1.0

    def __call__(self, p):
        return self.scale * jnp.sum(p**3)

    def loss(self, p):
        return self.scale * jnp.sum(p**3)


def _cases():
    """(name, f, mutate): f reads some state; mutate() changes it in place (no rebinding of f)."""
    global _G_SCALE
    cases = []

    def set_global():
        global _G_SCALE
        _G_SCALE = 5.0

    cases.append(("global three calls deep", lambda p: _deep1(p), set_global))

    cases.append(("class attribute", lambda p: _Holder.scale * jnp.sum(p**3), lambda: setattr(_Holder, "scale", 5.0)))
    ns = types.SimpleNamespace(scale=1.0)
    cases.append(("SimpleNamespace attribute", lambda p: ns.scale * jnp.sum(p**3), lambda: setattr(ns, "scale", 5.0)))
    cfg = _Config()
    cases.append(("dataclass field", lambda p: cfg.scale * jnp.sum(p**3), lambda: setattr(cfg, "scale", 5.0)))
    obj = _CallableLoss()
    cases.append(("bound method's object", obj.loss, lambda: setattr(obj, "scale", 5.0)))
    obj2 = _CallableLoss()
    cases.append(("callable object", obj2, lambda: setattr(obj2, "scale", 5.0)))
    d = {"scale": jnp.asarray(1.0)}
    cases.append(("dict entry replaced", lambda p: d["scale"] * jnp.sum(p**3), lambda: d.__setitem__("scale", jnp.asarray(5.0))))
    lst = [jnp.asarray(1.0)]
    cases.append(("list entry replaced", lambda p: lst[0] * jnp.sum(p**3), lambda: lst.__setitem__(0, jnp.asarray(5.0))))
    arr = np.ones(3)
    cases.append(("NumPy array mutated in place", lambda p: jnp.sum(arr * p**3), lambda: arr.__setitem__(slice(None), 5.0)))
    z = {"v": 0.0}
    z = {"v": 0.0}
    cases.append(("0.0 -> -0.0", lambda p: jnp.sum(p**3) * jnp.arctan(1.0 / jnp.asarray(z["v"])), lambda: z.__setitem__("v", -0.0)))
    cases.append(("module dict read by a helper", lambda p: _STATE["scale"] * jnp.sum(p**3), lambda: _STATE.__setitem__("scale", 5.0)))
    return cases


def _reset():
    global _G_SCALE
    _G_SCALE = 1.0
    _Holder.scale = 1.0
    _STATE["scale"] = 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", range(11))
def test_hvp_follows_every_kind_of_state(index, dtype):
    _reset()
    name, f, mutate = _cases()[index]
    p = jnp.asarray([1.0, 2.0, -1.0], dtype)
    v = jnp.ones(3, dtype)
    close(mg.hvp(f, p, v), fresh_hvp(f, p, v), dtype)
    mutate()
    after = mg.hvp(f, p, v)
    close(after, fresh_hvp(f, p, v), dtype)
    _reset()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [0, 4, 6, 8])
def test_dense_metric_matrix_follows_state_its_product_reads(index, dtype):
    """Metric.dense compiles once per traced program: after the state changes it is the fresh Hessian."""
    _reset()
    name, f, mutate = _cases()[index]
    G = mg.Metric(lambda p, v: fresh_hvp(f, p, v), "Hessian of " + name)
    p = jnp.asarray([1.0, 2.0, -1.0], dtype)
    close(G.dense(p), jax.hessian(f)(p), dtype)
    mutate()
    close(G.dense(p), jax.hessian(f)(p), dtype)
    _reset()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [0, 3, 6, 8, 9])
def test_dense_hessian_and_riemannian_hessian_follow_state(index, dtype):
    """mg.hessian, christoffel_symbols and riemannian_hessian compile once per traced program: after
    the state that f (or the metric field) reads changes, each is the fresh dense computation."""
    _reset()
    name, f, mutate = _cases()[index]
    p = jnp.asarray([1.0, 2.0, -1.0], dtype)
    # a metric field that reads the same state through f: G(x) = I + diag(x^2) * f(x)^2 / (1 + f(x)^2)
    Gfn = lambda x: jnp.eye(3, dtype=x.dtype) + jnp.diag(x**2) * f(x) ** 2 / (1 + f(x) ** 2)
    metric = mg.metrics.dense(Gfn)

    def fresh():
        G = Gfn(p)
        dG = jax.jacfwd(Gfn)(p)
        A = jnp.transpose(dG, (0, 2, 1)) + dG - jnp.transpose(dG, (2, 0, 1))
        Gamma = 0.5 * jnp.einsum("kl,lij->kij", jnp.linalg.inv(G), A)
        H = jax.hessian(f)(p)
        return H, Gamma, H - jnp.einsum("kij,k->ij", Gamma, jax.grad(f)(p))

    for _ in range(2):
        H, Gamma, R = fresh()
        close(mg.hessian(f, p), H, dtype)
        close(mg.christoffel_symbols(metric, p), Gamma, dtype)
        close(mg.riemannian_hessian(f, metric, p), R, dtype)
        mutate()
    _reset()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index", [0, 3, 6, 8, 9])
def test_top_eigenvalues_and_trace_follow_state(index, dtype):
    """The certificate, the probes and the mean and standard error are compiled programs of their
    arrays only: after the state f reads changes, the certified top eigenvalue and the Hutchinson
    trace are those of the fresh dense Hessian (diagonal here, so every Rademacher probe is exact)."""
    _reset()
    name, f, mutate = _cases()[index]
    p = jnp.asarray([1.0, 2.0, -1.0], dtype)
    key = jax.random.PRNGKey(3)
    for _ in range(2):
        H = np.asarray(jax.hessian(f)(p), np.float64)
        close(mg.top_eigenvalues(f, p, key, k=1), np.linalg.eigvalsh(H)[-1:], dtype)
        est, _ = mg.trace_estimate(f, p, key, num_probes=4)
        close(est, np.trace(H), dtype)
        mutate()
    _reset()


def test_signed_zero_closed_over_as_a_python_float():
    """1/(-0.0) = -inf: a program keyed on 0.0 == -0.0 would return the +0.0 answer."""
    state = {"z": 0.0}
    f = lambda p: jnp.sum(p**2) * jnp.arctan(1.0 / jnp.asarray(state["z"]))
    p, v = jnp.ones(2), jnp.ones(2)
    np.testing.assert_allclose(mg.hvp(f, p, v), fresh_hvp(f, p, v))
    state["z"] = -0.0
    out = mg.hvp(f, p, v)
    np.testing.assert_allclose(out, fresh_hvp(f, p, v))
    assert float(out[0]) < 0


def test_boolean_mask_on_a_closed_over_array_runs_as_in_plain_jax():
    X = jnp.asarray([1.0, -2.0, 3.0, -4.0])
    f = lambda p: jnp.sum((X[X > 0] * p) ** 2)  # the mask's size is concrete: plain JAX runs it
    p, v = jnp.ones(2), jnp.ones(2)
    np.testing.assert_allclose(mg.hvp(f, p, v), fresh_hvp(f, p, v))


# ---------------------------------------------------------------------------
# metrics: one object never mixes old and new state between its methods
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_metric_mv_solve_and_natural_gradient_all_follow_a_changed_closure(dtype):
    state = {"s": 1.0}
    G = mg.Metric(lambda p, v: state["s"] * jnp.asarray([1.0, 2.0, 4.0], dtype) * v, "diag")
    p, g = jnp.zeros(3, dtype), jnp.ones(3, dtype)
    for s in (1.0, 10.0):
        state["s"] = s
        diag = s * np.array([1.0, 2.0, 4.0])
        close(G.mv(p, g), diag, dtype)
        close(G.solve(p, g), 1 / diag, dtype)
        close(mg.natural_gradient(G, p, g), 1 / diag, dtype)


def test_transformed_metric_field_reads_a_global_of_its_product():
    state = {"c": 1.0}
    G = mg.Metric(lambda p, v: state["c"] * v, "scaled identity")
    phi = mg.reparam.scale(jnp.asarray([1.0, 0.5]))
    Gpsi = mg.transform_metric_field(phi, G)
    psi = phi.forward(jnp.ones(2))
    v = jnp.ones(2)
    before = np.asarray(Gpsi.mv(psi, v))
    state["c"] = 3.0
    np.testing.assert_allclose(Gpsi.mv(psi, v), 3.0 * before, rtol=1e-12)


def test_adaptive_sharpness_of_a_loss_reading_a_rebound_global():
    """Adaptive worst-case sharpness of c |w|^2 at w = (1, 1) in the adaptive L2 ball |delta / w| <= rho:
    the ascent direction is (1, 1)/sqrt(2), so S = 2 c ((1 + rho/sqrt 2)^2 - 1)."""
    state = {"c": 0.1}
    loss = lambda p, b: state["c"] * jnp.sum(p**2) + 0.0 * jnp.sum(b)
    params = jnp.ones(2)
    batches = jnp.zeros((1, 3))
    rho = 0.1
    for c in (0.1, 1.0):
        state["c"] = c
        out = mg.adaptive_sharpness(loss, params, batches, rho, key=jax.random.PRNGKey(0), n_iter=10)
        exact = 2 * c * ((1 + rho / np.sqrt(2)) ** 2 - 1)
        np.testing.assert_allclose(float(out.sharpness), exact, rtol=1e-3)


def test_one_operator_gives_consistent_answers_after_a_global_changes():
    state = {"a": jnp.asarray([1.0, 2.0, 3.0, 4.0])}
    loss = lambda w, x: 0.5 * jnp.sum(state["a"] * w**2) * jnp.mean(x)
    op = mg.operators.hessian_operator(loss, jnp.zeros(4))
    data = [jnp.ones((2,)), jnp.ones((2,))]
    key = jax.random.PRNGKey(0)
    for a in ([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]):
        state["a"] = jnp.asarray(a)
        top = op.top_eigenvalues(key, data, k=1)
        np.testing.assert_allclose(np.asarray(top), [max(a)], rtol=1e-8)
        np.testing.assert_allclose(np.asarray(op.dataset_mv(jnp.ones(4), data)), a, rtol=1e-12)
        est, _ = op.trace_estimate(key, data, num_probes=20)
        np.testing.assert_allclose(float(est), sum(a), rtol=1e-12)  # Rademacher probes: exact on a diagonal


# ---------------------------------------------------------------------------
# the spectral estimators: a notebook global, rebound between two calls
# ---------------------------------------------------------------------------
_NB_A = None  # a notebook cell's global matrix, read by the loss below at every call


def _nb_loss(p):
    """The user's loss, defined once: H(p) = _NB_A + diag(p)."""
    return 0.5 * p @ _NB_A @ p + jnp.sum(p**3) / 6


@pytest.fixture
def notebook_global():
    """``set(A)`` rebinds the global ``_NB_A`` (a notebook re-running a cell); reset afterwards."""

    def set_global(A):
        global _NB_A
        _NB_A = jnp.asarray(A)

    yield set_global
    set_global(np.zeros((4, 4)))


_NB_P = [1.0, 2.0, -1.0, 0.5]
# diagonal: Rademacher probes give exact diagonals and moments; distinct eigenvalues of A + diag(p)
_NB_DIAGONALS = [np.diag([1.0, 2.0, 4.0, 8.0]), np.diag([10.0, -3.0, 7.0, 0.5])]


def test_spectral_density_follows_a_rebound_global(notebook_global):
    f = lambda p: _nb_loss(p)
    p = jnp.asarray(_NB_P)
    key = jax.random.PRNGKey(0)
    for A in _NB_DIAGONALS:
        notebook_global(A)
        dens = mg.spectral_density(f, p, key, num_probes=2, num_iterations=4)
        H = np.asarray(jax.hessian(f)(p))  # dense truth, fresh
        for k in (1, 2, 3):
            truth = np.trace(np.linalg.matrix_power(H, k)) / 4
            np.testing.assert_allclose(float(dens.moments(k)[0]), truth, rtol=1e-10, atol=1e-12)
        # 4 steps in dimension 4: the nodes are the eigenvalues
        np.testing.assert_allclose(np.sort(np.asarray(dens.nodes), axis=1), np.tile(np.linalg.eigvalsh(H), (2, 1)), atol=1e-9)


def test_diagonal_estimate_follows_a_rebound_global(notebook_global):
    f = lambda p: _nb_loss(p)
    p = jnp.asarray(_NB_P)
    key = jax.random.PRNGKey(1)
    for A in _NB_DIAGONALS:
        notebook_global(A)
        diag, se = mg.diagonal_estimate(f, p, key, num_probes=3)
        np.testing.assert_allclose(np.asarray(diag), np.diag(np.asarray(jax.hessian(f)(p))), rtol=1e-12)
        assert float(jnp.max(se)) < 1e-12


def test_hutchpp_trace_follows_a_rebound_global(notebook_global):
    """A budget of 3d products sketches all of R^d: Hutch++ is exact, for any symmetric H."""
    f = lambda p: _nb_loss(p)
    p = jnp.asarray(_NB_P)
    key = jax.random.PRNGKey(2)
    r = np.random.default_rng(0)
    for scale in (1.0, 10.0):
        B = r.normal(size=(4, 4))
        notebook_global(scale * (B + B.T))
        est, se = mg.trace_estimate(f, p, key, num_probes=12, method="hutch++")
        H = np.asarray(jax.hessian(f)(p))
        np.testing.assert_allclose(float(est), np.trace(H), rtol=1e-10, atol=1e-10 * np.abs(H).max())


# the Laplace toolkit: the same loss, A rebound between calls; A + diag(p) positive definite
_NB_SPD = [np.diag([1.0, 2.0, 4.0, 8.0]), np.diag([10.0, 3.0, 7.0, 0.5]) + 0.5]


@pytest.mark.parametrize("dtype", DTYPES)
def test_laplace_toolkit_follows_a_rebound_global(notebook_global, dtype):
    f = lambda p: _nb_loss(p)
    p = jnp.asarray(_NB_P, dtype)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(5, 4)), dtype)
    model = lambda q, inputs: jnp.tanh(inputs @ q) + 0.1 * (inputs @ _NB_A @ q)  # reads the global too
    tol = 1000 * float(jnp.finfo(dtype).eps)
    for A in _NB_SPD:
        notebook_global(np.asarray(A, dtype))
        H = np.asarray(jax.hessian(f)(p), np.float64)  # fresh dense truths
        post = mg.laplace_posterior(f, p, prior_precision=0.5)
        np.testing.assert_allclose(np.asarray(post.precision), H + 0.5 * np.eye(4), rtol=tol, atol=tol)
        J = np.asarray(jax.jacfwd(lambda q: model(q, x))(p), np.float64)
        pred = mg.glm_predictive(model, post, x)
        np.testing.assert_allclose(np.asarray(pred.mean), np.asarray(model(p, x)), rtol=tol, atol=tol)
        S = J @ np.linalg.inv(H + 0.5 * np.eye(4)) @ J.T
        np.testing.assert_allclose(np.asarray(pred.covariance), np.diag(S), rtol=10 * tol, atol=10 * tol)
        ev = mg.laplace_log_marginal_likelihood(f, p)
        truth = -float(f(p)) + 2 * np.log(2 * np.pi) - 0.5 * np.linalg.slogdet(H)[1]
        np.testing.assert_allclose(float(ev.log_z), truth, rtol=tol, atol=tol)
        # MacKay's fixed point with the curvature of the rebound loss: alpha = gamma / |p|^2
        opt = mg.optimize_prior_precision(f, p)
        lam = np.linalg.eigvalsh(H)
        a = float(opt.prior_precision)
        np.testing.assert_allclose(a, np.sum(lam / (lam + a)) / float(np.sum(np.asarray(p, np.float64) ** 2)), rtol=100 * tol)


# ---------------------------------------------------------------------------
# nothing kept alive; one compilation across per-step closures
# ---------------------------------------------------------------------------
def _mlp_problem(seed=0, n=16, d=6, h=5, c=3):
    r = np.random.default_rng(seed)
    params = {"W": jnp.asarray(r.normal(size=(d, h))), "V": jnp.asarray(r.normal(size=(h, c)))}
    model = lambda p, x: jnp.tanh(x @ p["W"]) @ p["V"]

    def loss(p, batch):
        x, y = batch
        return -jnp.mean(jax.nn.log_softmax(model(p, x))[jnp.arange(x.shape[0]), y])

    batches = [(jnp.asarray(r.normal(size=(n, d))), jnp.asarray(r.integers(0, c, size=n))) for _ in range(10)]
    return params, model, loss, batches


def test_per_batch_metrics_keep_no_batch_alive_and_compile_once():
    params, model, loss, batches = _mlp_problem()
    ce = lambda z, y: -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(z.shape[0]), y])
    g = jax.grad(lambda p: loss(p, batches[0]))(params)
    refs, compiles = [], []
    for step in range(10):
        x = jnp.asarray(np.random.default_rng(100 + step).normal(size=batches[0][0].shape))
        y = batches[step][1]
        G = mg.ggn(lambda p, x=x: model(p, x), lambda z, y=y: ce(z, y))
        (_, n1) = compiles_during(G.mv, params, g)
        (_, n2) = compiles_during(G.with_damping(1e-3).solve, params, g, tol=1e-8)
        (nat, n3) = compiles_during(mg.natural_gradient, G.with_damping(1e-3), params, g, tol=1e-11)
        if step:
            compiles.append(n1 + n2 + n3)
        refs.append(weakref.ref(x))
        dense = np.asarray(G.dense(params)) + 1e-3 * np.eye(ravel_pytree(params)[0].size)
        np.testing.assert_allclose(ravel_pytree(nat)[0], np.linalg.solve(dense, np.asarray(ravel_pytree(g)[0])), rtol=1e-5)
        del G, x, nat
    gc.collect()
    assert sum(r() is not None for r in refs) <= 1
    assert compiles[1:] == [0] * len(compiles[1:]), compiles


@pytest.mark.parametrize("how", ["lambda", "partial", "tree Partial", "bound method", "float"])
def test_per_step_callables_share_one_compilation(how):
    params, model, loss, batches = _mlp_problem()
    v = jax.tree_util.tree_map(jnp.ones_like, params)

    class Trainer:
        def __init__(self, batch):
            self.batch = batch

        def loss(self, p):
            return loss(p, self.batch)

    make = {
        "lambda": lambda i, b: (lambda p: loss(p, b)),
        "partial": lambda i, b: functools.partial(loss, batch=b),
        "tree Partial": lambda i, b: jax.tree_util.Partial(loss, batch=b),
        "bound method": lambda i, b: Trainer(b).loss,
        "float": lambda i, b: (lambda p: (1.0 + 0.1 * i) * loss(p, b)),
    }[how]
    compiles = []
    for i, b in enumerate(batches[:5]):
        f = make(i, b)
        out, n = compiles_during(mg.hvp, f, params, v)
        compiles.append(n)
        ref = fresh_hvp(f, params, v)
        for a, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-12)
    assert compiles[1:] == [0, 0, 0, 0], compiles


_METRIC_SCALE = {"c": 1.0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimators_with_a_matrix_free_metric_follow_the_state_its_product_reads(dtype):
    """Issue 49: the metric travels to the compiled CG duals and Lanczos as its callables (traced per
    call) and its damping (an argument); a global its product reads is read at every call."""
    d = 12
    h = jnp.asarray(np.linspace(1.0, 3.0, d), dtype)  # H = diag(h)
    w = jnp.asarray(np.linspace(0.5, 2.0, d), dtype)
    f = lambda x: 0.5 * jnp.sum(h * x**2)
    G = mg.Metric(lambda p, v: _METRIC_SCALE["c"] * w * v, "scaled")  # matrix-free: CG solves
    x0 = jnp.zeros(d, dtype)
    key = jax.random.PRNGKey(0)
    eps = float(jnp.finfo(dtype).eps)
    for c in (1.0, 4.0, 0.5):
        _METRIC_SCALE["c"] = c
        E = np.asarray(h, np.float64) / (c * np.asarray(w, np.float64))  # G^{-1}H, diagonal
        est, _ = mg.trace_estimate(f, x0, key, metric=G, num_probes=4, tol=1e-12, maxiter=200)
        np.testing.assert_allclose(float(est), E.sum(), rtol=1e3 * eps)  # diagonal: exact with Rademacher probes
        top = mg.top_eigenvalues(f, x0, key, k=2, metric=G, num_iterations=d, tol=1e-12, maxiter=200)
        np.testing.assert_allclose(np.asarray(top, np.float64), np.sort(E)[::-1][:2], rtol=1e4 * eps)
    _METRIC_SCALE["c"] = 1.0

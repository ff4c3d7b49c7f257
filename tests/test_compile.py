"""Repeated eager calls compile once (issue 20): minigeo._compile.jit_per_callable and its users.

Truths: the number of XLA compilations (jax.monitoring's backend-compile event), jax.jvp / dense
references for the values, garbage collection (weak references), and rebinding a variable the
function reads (the result must follow it, never a stale compilation).
"""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

import minigeo as mg
import minigeo.models as mm
from minigeo._compile import jit_per_callable, one_trace_per_call

_COMPILES = [0]


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_listener)


def compiles_during(fn, *args, **kwargs):
    """(result, number of XLA compilations while running fn)."""
    before = _COMPILES[0]
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, _COMPILES[0] - before


DTYPES = [jnp.float64, jnp.float32]


def quadratic_problem(dtype, n=6, seed=0):
    r = np.random.default_rng(seed)
    a = r.normal(size=(n, n))
    A = jnp.asarray(a @ a.T + n * np.eye(n), dtype)
    b = jnp.asarray(r.normal(size=n), dtype)
    loss = lambda p: 0.5 * p["w"] @ A @ p["w"] + jnp.sum(jnp.sin(p["w"] * b)) + jnp.sum(p["c"] ** 4)
    params = {"w": jnp.asarray(r.normal(size=n), dtype), "c": jnp.asarray(r.normal(size=2), dtype)}
    return loss, params


def tol(dtype):
    return 100 * float(jnp.finfo(dtype).eps)


# ---------------------------------------------------------------------------
# the helper itself
# ---------------------------------------------------------------------------
def test_traces_every_call_and_compiles_once_per_program():
    traced, derived = [], []

    def impl(f, x):
        derived.append(1)
        return 2.0 * f(x)

    def counted(h):
        def user(x):
            traced.append(1)
            return h(x)

        return user

    run = jit_per_callable(impl)
    f = counted(lambda x: jnp.sum(x**2))
    np.testing.assert_allclose(run(f, jnp.ones(3)), 6.0)
    n_derived = len(derived)
    _, n = compiles_during(run, f, 2.0 * jnp.ones(3))
    # the user's function traced again (never stale); the work neither traced nor compiled again
    assert n == 0 and len(traced) == 3 and len(derived) == n_derived
    _, n = compiles_during(run, f, jnp.ones(4))  # a new shape compiles
    assert n >= 1
    g = counted(lambda x: jnp.sum(x**3))  # a new program compiles, and gives its own value
    np.testing.assert_allclose(run(g, jnp.ones(3)), 6.0)
    np.testing.assert_allclose(run(g, 2 * jnp.ones(3)), 48.0)
    with one_trace_per_call():  # inside one public call: one trace per function and shapes
        before = len(traced)
        for _ in range(3):
            run(g, jnp.ones(3))
        assert len(traced) == before + 1


def test_rebinding_a_closure_or_global_variable_recompiles_never_stale():
    run = jit_per_callable(lambda f, x: f(x))
    scale = jnp.asarray(1.0)
    f = lambda x: scale * jnp.sum(x)
    np.testing.assert_allclose(run(f, jnp.ones(2)), 2.0)
    scale = jnp.asarray(5.0)  # closure cell rebound
    np.testing.assert_allclose(run(f, jnp.ones(2)), 10.0)
    global _GLOBAL_DATA
    _GLOBAL_DATA = jnp.asarray([1.0, 2.0])
    g = lambda x: jnp.sum(_GLOBAL_DATA * x)
    np.testing.assert_allclose(run(g, jnp.ones(2)), 3.0)
    _GLOBAL_DATA = jnp.asarray([10.0, 20.0])  # global rebound
    np.testing.assert_allclose(run(g, jnp.ones(2)), 30.0)

    def helper(x):  # a global read one call deeper
        return jnp.sum(_GLOBAL_DATA * x)

    h = lambda x: helper(x) + 0.0
    np.testing.assert_allclose(run(h, jnp.ones(2)), 30.0)
    _GLOBAL_DATA = jnp.asarray([100.0, 200.0])
    np.testing.assert_allclose(run(h, jnp.ones(2)), 300.0)


_GLOBAL_DATA = None


@pytest.mark.parametrize("how", ["default", "closure"])
def test_per_step_closures_share_one_compilation_and_nothing_is_kept_alive(how):
    """A training loop making ``lambda p: loss(p, batch)`` per step: the batch is an argument, not a constant."""
    run = jit_per_callable(lambda f, x: f(x))
    refs, compiles = [], []

    def make(data):
        if how == "default":
            return lambda x, data=data: jnp.sum(data * x)
        return lambda x: jnp.sum(data * x)

    for step in range(5):
        data = jnp.full((3,), float(step))
        f = make(data)
        out, n = compiles_during(run, f, jnp.ones(3))
        np.testing.assert_allclose(out, 3.0 * step)  # each step its own data, never the first step's
        compiles.append(n)
        refs.append((weakref.ref(f), weakref.ref(data)))
        del f, data
    gc.collect()
    assert compiles[0] >= 1 and compiles[1:] == [0, 0, 0, 0]
    assert all(r() is None and d() is None for r, d in refs)
    assert run.cache_size() == 1


def test_untraceable_function_runs_op_by_op():
    """Python control flow on a closed-over array cannot be traced: the call still gives the eager answer."""
    run = jit_per_callable(lambda f, x: f(x))
    flag = jnp.asarray(1.0)
    f = lambda x: jnp.sum(x) if flag > 0 else -jnp.sum(x)
    np.testing.assert_allclose(run(f, jnp.ones(2)), 2.0)
    flag = jnp.asarray(-1.0)
    np.testing.assert_allclose(run(f, jnp.ones(2)), -2.0)


def test_bound_methods_of_two_instances_give_their_own_values_and_share_one_program():
    class Model:
        def __init__(self, a):
            self.a = jnp.asarray(a)

        def loss(self, x):
            return self.a * jnp.sum(x)

    run = jit_per_callable(lambda f, x: f(x))
    m1, m2 = Model(2.0), Model(3.0)
    np.testing.assert_allclose(run(m1.loss, jnp.ones(2)), 4.0)
    _, n = compiles_during(run, m1.loss, jnp.ones(2))  # a new bound-method object each access
    assert n == 0
    out, n = compiles_during(run, m2.loss, jnp.ones(2))
    np.testing.assert_allclose(out, 6.0)
    assert n == 0  # the same program, another constant
    ref = weakref.ref(m1)
    del m1
    gc.collect()
    assert ref() is None  # the cache holds no instance


def test_traced_arguments_run_inline():
    run = jit_per_callable(lambda f, x: f(x))
    out = jax.jit(lambda x: run(lambda y: jnp.sum(y**2), x))(jnp.ones(3))
    np.testing.assert_allclose(out, 3.0)
    assert run.cache_size() == 0
    np.testing.assert_allclose(jax.vmap(lambda x: run(jnp.sum, x))(jnp.ones((4, 3))), 3.0 * np.ones(4))


# ---------------------------------------------------------------------------
# the public functions: second eager call compiles nothing, values right
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_hvp_second_eager_call_compiles_nothing(dtype):
    loss, params = quadratic_problem(dtype)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    mg.hvp(loss, params, v)
    out, n = compiles_during(mg.hvp, loss, params, v)
    assert n == 0
    ref = jax.jvp(jax.grad(loss), (params,), (v,))[1]
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=tol(dtype), atol=tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_trace_and_eigenvalues_second_eager_call_compile_nothing(dtype):
    loss, params = quadratic_problem(dtype)
    key = jax.random.PRNGKey(0)
    H = np.asarray(mg.hessian(loss, params), np.float64)
    calls = {
        "trace": lambda: mg.trace_estimate(loss, params, key, num_probes=500)[0],
        "trace, diagonal metric": lambda: mg.trace_estimate(
            loss, params, key, metric=mg.metrics.diagonal(jax.tree_util.tree_map(lambda a: jnp.full_like(a, 2.0), params))
        )[0],
        "eigenvalues, fixed": lambda: mg.top_eigenvalues(loss, params, key, k=2, num_iterations=8),
        "eigenvalues, adaptive": lambda: mg.top_eigenvalues(loss, params, key, k=2),
    }
    for name, call in calls.items():
        first = call()
        second, n = compiles_during(call)
        assert n == 0, name
        np.testing.assert_array_equal(first, second)
    lam = np.sort(np.linalg.eigvalsh(H))[::-1]
    np.testing.assert_allclose(calls["eigenvalues, fixed"](), lam[:2], rtol=1e-3 if dtype == jnp.float32 else 1e-9)
    est, se = mg.trace_estimate(loss, params, key, num_probes=500)
    assert abs(float(est) - np.trace(H)) < 5 * float(se) + tol(dtype) * np.abs(H).sum()


def test_metric_products_second_eager_call_compile_nothing():
    r = np.random.default_rng(3)
    X = jnp.asarray(r.normal(size=(20, 4)))
    y = jnp.asarray(r.integers(0, 3, size=20))
    model = lambda p: jnp.tanh(X @ p["W"]) @ p["V"]
    ce = lambda z: -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(20), y])
    per_example = lambda z: -jax.nn.log_softmax(z)[jnp.arange(20), y]
    params = {"W": jnp.asarray(r.normal(size=(4, 5))), "V": jnp.asarray(r.normal(size=(5, 3)))}
    v = jax.tree_util.tree_map(lambda a: jnp.asarray(r.normal(size=a.shape)), params)
    metrics = {
        "GGN": mg.ggn(model, ce),
        "Fisher": mg.fisher(model, "categorical"),
        "empirical Fisher": mg.empirical_fisher(model, per_example),
        "damped GGN": mg.ggn(model, ce).with_damping(0.5),
    }
    for name, G in metrics.items():
        first = G.mv(params, v)
        second, n = compiles_during(G.mv, params, v)
        assert n == 0, name
        dense = np.asarray(G.dense(params))  # op by op under vmap: an independent route
        np.testing.assert_allclose(
            jax.flatten_util.ravel_pytree(second)[0], dense @ np.asarray(jax.flatten_util.ravel_pytree(v)[0]), rtol=1e-10
        )
        for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
            np.testing.assert_array_equal(a, b)


_SCALE = {"model": 1.0, "loss": 1.0}  # read by the model and the loss below, changed between calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_ggn_traces_model_and_loss_in_one_program_and_follows_both_globals(dtype, monkeypatch):
    """The GGN product calls two user functions; one make_jaxpr traces both and the joint program is
    split per call (minigeo._compile._trace_users).  Each part must be the right function: the
    product follows a change of the model's global and of the loss's global (dense J^T H J truth),
    and a new value of either reuses the compilation (hoisted scalars are arguments)."""
    import minigeo._compile as compile_layer

    r = np.random.default_rng(5)
    X = jnp.asarray(r.normal(size=(7, 3)), dtype)
    model = lambda p: _SCALE["model"] * jnp.tanh(X @ p["W"])
    loss = lambda z: _SCALE["loss"] * jnp.sum(jnp.cos(z) + z**4) / 4
    params = {"W": jnp.asarray(r.normal(size=(3, 2)), dtype)}
    v = {"W": jnp.asarray(r.normal(size=(3, 2)), dtype)}
    traces = []
    joint = compile_layer._trace_users
    monkeypatch.setattr(compile_layer, "_trace_users", lambda users, plan: traces.append(len(plan)) or joint(users, plan))

    def truth():
        flat, unravel = jax.flatten_util.ravel_pytree(params)
        J = jax.jacfwd(lambda f: model(unravel(f)).ravel())(flat)
        z = model(params)
        H = jax.hessian(lambda u: loss(u.reshape(z.shape)))(z.ravel())
        return J.T @ H @ J @ jax.flatten_util.ravel_pytree(v)[0]

    G = mg.ggn(model, loss)
    G.mv(params, v)
    for scales in [(1.0, 1.0), (2.0, 1.0), (2.0, 0.5), (0.3, 3.0)]:
        _SCALE["model"], _SCALE["loss"] = scales
        got, n = compiles_during(G.mv, params, v)
        assert n == 0, scales
        np.testing.assert_allclose(jax.flatten_util.ravel_pytree(got)[0], truth(), rtol=tol(dtype), atol=tol(dtype))
    assert traces and all(t == 2 for t in traces)  # model and loss: one trace of both per call
    _SCALE["model"], _SCALE["loss"] = 1.0, 1.0


def test_metric_is_a_pytree_whose_damping_changes_without_recompiling():  # noqa: D103
    G = mg.ggn(lambda w: jnp.array([[1.0, 0.0], [1.0, 1.0]]) @ w, lambda z: 0.5 * jnp.sum(z**2))
    assert jax.tree_util.tree_leaves(G.with_damping(2.0)) == [2.0]
    mv = jax.jit(lambda G, p, v: G.mv(p, v))
    for lam in (0.0, 0.5, 3.0):
        np.testing.assert_allclose(mv(G.with_damping(lam), jnp.zeros(2), jnp.ones(2)), np.array([3.0, 2.0]) + lam)
    assert mv._cache_size() == 1


def test_vit_hvp_second_eager_call_compiles_nothing():
    """The block scan was recompiled at every eager call (20x the jitted time on the tiny ViT)."""
    cfg = mm.ViTConfig(image_size=4, patch_size=2, channels=1, num_classes=3, width=8, depth=2, heads=2, mlp_dim=16)
    params = mm.init_vit(jax.random.PRNGKey(0), cfg)
    images = jax.random.normal(jax.random.PRNGKey(1), (5, 4, 4, 1))
    labels = jnp.array([0, 1, 2, 0, 1])
    loss = lambda p: mm.cross_entropy(mm.vit_apply(p, images, cfg), labels)
    v = jax.tree_util.tree_map(jnp.ones_like, params)
    mg.hvp(loss, params, v)
    out, n = compiles_during(mg.hvp, loss, params, v)
    assert n == 0
    ref = jax.jit(lambda p, v: jax.jvp(jax.grad(loss), (p,), (v,))[1])(params, v)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_failed_cg_inside_compiled_trace_still_raises_its_own_error():
    """With a Metric, the compiled probe loop cannot raise: the eager caller re-runs one solve, which does."""
    indefinite = mg.Metric(lambda p, v: jax.tree_util.tree_map(lambda a: a * jnp.array([1.0, -1.0, 1.0]), v), "indefinite")
    loss = lambda p: jnp.sum(p**2)
    with pytest.raises(mg.GeometryError, match="not positive definite"):
        mg.trace_estimate(loss, jnp.ones(3), jax.random.PRNGKey(0), metric=indefinite)
    with pytest.raises(mg.GeometryError, match="not positive definite"):
        mg.top_eigenvalues(loss, jnp.ones(3), jax.random.PRNGKey(0), metric=indefinite, num_iterations=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_boundary_keeps_a_table_per_rule(dtype):
    """Every module compiles through ``_compile.compiled`` (issue 53), and each rule keeps its own
    least-recently-used table: 17 new programs of one rule (the GGN diagonal at 17 sizes, through
    ``run_work``) do not evict the Hessian-vector product's program, whose next eager call compiles
    nothing; the diagonal's programs are counted under its own rule, not under ``run_work``."""
    from minigeo import _compile
    from minigeo.curvature import _hvp
    from minigeo.metrics import _ggn_diagonal

    f = lambda x: jnp.sum(jnp.sin(x) * x)  # noqa: E731
    x = jnp.linspace(0.1, 1.0, 5, dtype=dtype)
    first = mg.hvp(f, x, jnp.ones_like(x))
    n_hvp = _compile.cache_size(_hvp)
    before = _compile.cache_size(_ggn_diagonal)
    n_run_work = _compile.cache_size(_compile.run_work)  # other modules' plain run_work calls (the assignment kit)
    for k in range(17):
        mg.metrics.ggn_diagonal(lambda p: 2.0 * p, lambda z: 0.5 * jnp.sum(z**2), jnp.ones(k + 1, dtype))
    assert _compile.cache_size(_ggn_diagonal) == min(before + 17, 16)  # its own table, at most 16 kept
    assert _compile.cache_size(_compile.run_work) == n_run_work
    assert _compile.cache_size(_hvp) == n_hvp >= 1
    again, n = compiles_during(mg.hvp, f, x, jnp.ones_like(x))
    assert n == 0
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))
    # and the answers are right: the diagonal of J^T J for z = 2 p is 4
    np.testing.assert_allclose(mg.metrics.ggn_diagonal(lambda p: 2.0 * p, lambda z: 0.5 * jnp.sum(z**2), jnp.ones(3, dtype)),
                               4.0 * np.ones(3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_rules_keep_no_user_function_or_data_alive(dtype):
    """A compiled entry keeps the rebuilt work, never the user's functions of the call that compiled it:
    a GGN metric and a GGN diagonal built per step around a model that closes over that step's data
    leave neither the model nor the data alive (the rebuild closures once held the first call's users)."""
    import gc
    import weakref

    models, datas = [], []
    for step in range(5):
        X = jnp.full((4, 2), float(step + 1), dtype)
        model = lambda w, X=X: X @ w  # noqa: E731
        models.append(weakref.ref(model))
        datas.append(weakref.ref(X))
        loss = lambda z: 0.5 * jnp.sum(z**2)  # noqa: E731
        out = mg.ggn(model, loss).mv(jnp.ones(2, dtype), jnp.ones(2, dtype))
        np.testing.assert_allclose(out, np.asarray(X).T @ np.asarray(X) @ np.ones(2), rtol=10 * float(jnp.finfo(dtype).eps))
        mg.metrics.ggn_diagonal(model, loss, jnp.ones(2, dtype))
        del model, X, loss
    gc.collect()
    assert [r() is None for r in models] == [True] * 5
    assert [r() is None for r in datas] == [True] * 5

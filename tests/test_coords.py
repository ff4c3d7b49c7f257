"""Tests of minigeo.coords and minigeo.reparam against closed forms, dense autodiff and invariances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dense_jacobian, flatten, random_invertible, random_positive_reparam, random_spd, rng
from hypothesis import given, settings
from hypothesis import strategies as st

import minigeo as mg
from minigeo import reparam

# ---------------------------------------------------------------------------
# built-in reparametrizations: closed-form Jacobians and round trips
# ---------------------------------------------------------------------------


def closed_form_cases():
    r = rng(0)
    theta_pos = jnp.asarray(r.uniform(0.2, 3.0, size=4))
    A = random_invertible(r, 4)
    b = jnp.asarray(r.normal(size=4))
    xy = jnp.asarray([0.7, -1.3])
    x, y = xy
    rad = jnp.hypot(x, y)
    return [
        ("log", reparam.log(), theta_pos, jnp.diag(1.0 / theta_pos)),
        ("softplus", reparam.softplus(), theta_pos, jnp.diag(1.0 / (1.0 - jnp.exp(-theta_pos)))),
        ("scale", reparam.scale(60.0), theta_pos, 60.0 * jnp.eye(4)),
        ("affine", reparam.affine(A, b), theta_pos, A),
        ("polar", reparam.polar(), xy, jnp.array([[x / rad, y / rad], [-y / rad**2, x / rad**2]])),
    ]


@pytest.mark.parametrize(
    "name,phi,theta,expected", closed_form_cases(), ids=lambda c: c if isinstance(c, str) else ""
)
def test_jacobian_matches_closed_form(name, phi, theta, expected):
    np.testing.assert_allclose(phi.jacobian(theta), expected, rtol=1e-12, atol=1e-12)
    # The inverse Jacobian at psi is the matrix inverse of J (computed here by numpy).
    psi = phi.forward(theta)
    np.testing.assert_allclose(
        phi.inverse_jacobian(psi), np.linalg.inv(np.asarray(expected)), rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize(
    "name,phi,theta,expected", closed_form_cases(), ids=lambda c: c if isinstance(c, str) else ""
)
def test_round_trip(name, phi, theta, expected):
    np.testing.assert_allclose(phi.inverse(phi.forward(theta)), theta, rtol=1e-12)
    phi.check_inverse(theta)
    inv = phi.inverted()
    np.testing.assert_allclose(inv.forward(phi.forward(theta)), theta, rtol=1e-12)


def test_closed_form_values():
    np.testing.assert_allclose(reparam.log().forward(jnp.array([1.0, np.e])), [0.0, 1.0])
    np.testing.assert_allclose(reparam.softplus().inverse(jnp.array([0.0])), [np.log(2.0)])
    np.testing.assert_allclose(reparam.polar().forward(jnp.array([0.0, 2.0])), [2.0, np.pi / 2])
    np.testing.assert_allclose(reparam.polar().inverse(jnp.array([2.0, np.pi])), [-2.0, 0.0], atol=1e-15)
    # softplus^{-1} stays accurate for large and tiny arguments
    np.testing.assert_allclose(
        reparam.softplus().forward(jnp.array([50.0, 1e-8])), [50.0, np.log(np.expm1(1e-8))], rtol=1e-12
    )


def test_compose_is_chain_rule():
    r = rng(1)
    A = random_invertible(r, 3)
    theta = jnp.asarray(r.uniform(0.5, 2.0, size=3))
    f, g = reparam.log(), reparam.affine(A)
    fg = reparam.compose(f, g)
    np.testing.assert_allclose(fg.forward(theta), A @ jnp.log(theta), rtol=1e-12)
    np.testing.assert_allclose(fg.jacobian(theta), A @ jnp.diag(1 / theta), rtol=1e-12)
    v = jnp.asarray(r.normal(size=3))
    omega = jnp.asarray(r.normal(size=3))
    G = random_spd(r, 3)
    np.testing.assert_allclose(
        mg.transform_vector(fg, theta, v),
        mg.transform_vector(g, f.forward(theta), mg.transform_vector(f, theta, v)),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        mg.transform_covector(fg, theta, omega),
        mg.transform_covector(g, f.forward(theta), mg.transform_covector(f, theta, omega)),
        rtol=1e-10,
    )
    np.testing.assert_allclose(
        mg.transform_metric(fg, theta, G),
        mg.transform_metric(g, f.forward(theta), mg.transform_metric(f, theta, G)),
        rtol=1e-10,
    )


# ---------------------------------------------------------------------------
# transformation rules against dense references
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_rules_match_dense_formulas(seed):
    r = rng(seed)
    n = 4
    phi = random_positive_reparam(r, n)
    theta = jnp.asarray(r.uniform(0.3, 2.0, size=n))
    J = np.asarray(dense_jacobian(phi.forward, theta))
    Jinv = np.linalg.inv(J)
    v = jnp.asarray(r.normal(size=n))
    omega = jnp.asarray(r.normal(size=n))
    G = random_spd(r, n)
    B = jnp.asarray(r.normal(size=(n, n)))
    E = jnp.asarray(r.normal(size=(n, n)))
    np.testing.assert_allclose(mg.transform_vector(phi, theta, v), J @ v, rtol=1e-10)
    np.testing.assert_allclose(
        mg.transform_covector(phi, theta, omega), np.linalg.solve(J.T, omega), rtol=1e-9
    )
    np.testing.assert_allclose(mg.transform_metric(phi, theta, G), Jinv.T @ G @ Jinv, rtol=1e-9)
    np.testing.assert_allclose(mg.transform_bilinear(phi, theta, B), Jinv.T @ B @ Jinv, rtol=1e-9)
    np.testing.assert_allclose(mg.transform_endomorphism(phi, theta, E), J @ E @ Jinv, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_matrix_free_rules_match_dense(seed):
    r = rng(seed)
    n = 5
    phi = random_positive_reparam(r, n)
    theta = jnp.asarray(r.uniform(0.3, 2.0, size=n))
    G = random_spd(r, n)
    E = jnp.asarray(r.normal(size=(n, n)))
    u = jnp.asarray(r.normal(size=n))
    G_hat = mg.transform_metric(phi, theta, G)
    G_hat_mv = mg.transform_metric(phi, theta, lambda v: G @ v)
    np.testing.assert_allclose(G_hat_mv(u), G_hat @ u, rtol=1e-9)
    B_hat_mv = mg.transform_bilinear(phi, theta, lambda v: -G @ v)
    np.testing.assert_allclose(B_hat_mv(u), -G_hat @ u, rtol=1e-9)
    E_hat = mg.transform_endomorphism(phi, theta, E)
    E_hat_mv = mg.transform_endomorphism(phi, theta, lambda v: E @ v)
    np.testing.assert_allclose(E_hat_mv(u), E_hat @ u, rtol=1e-9, atol=1e-12)


def test_gradient_transforms_as_covector_chain_rule():
    r = rng(5)
    n = 3
    phi = random_positive_reparam(r, n)
    theta = jnp.asarray(r.uniform(0.3, 2.0, size=n))

    def loss(t):
        return jnp.sum(jnp.sin(t) * t**2) + jnp.prod(t)

    grad_theta = jax.grad(loss)(theta)
    grad_psi = jax.grad(mg.transform_function(phi, loss))(phi.forward(theta))
    np.testing.assert_allclose(mg.transform_covector(phi, theta, grad_theta), grad_psi, rtol=1e-10)
    # transform_function: same value at corresponding points
    np.testing.assert_allclose(mg.transform_function(phi, loss)(phi.forward(theta)), loss(theta), rtol=1e-12)


def test_riemannian_gradient_transforms_as_vector():
    """G^{-1} grad L is a vector: sharp in psi of the transformed objects = J (sharp in theta)."""
    r = rng(6)
    n = 3
    phi = random_positive_reparam(r, n)
    theta = jnp.asarray(r.uniform(0.3, 2.0, size=n))
    G = random_spd(r, n)
    omega = jnp.asarray(r.normal(size=n))
    lhs = mg.sharp(mg.transform_metric(phi, theta, G), mg.transform_covector(phi, theta, omega))
    rhs = mg.transform_vector(phi, theta, mg.sharp(G, omega))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9)


def test_metric_field_polar_closed_form():
    field = mg.transform_metric_field(reparam.polar(), jnp.eye(2))
    for r_, a in [(2.0, 0.3), (0.5, -2.0), (3.0, 3.0)]:
        np.testing.assert_allclose(field.dense(jnp.array([r_, a])), np.diag([1.0, r_**2]), atol=1e-12)
    # agrees with transform_metric pointwise for a non-constant metric field
    metric_fn = lambda t: jnp.array([[2.0 + t[0] ** 2, t[0] * t[1]], [t[0] * t[1], 1.0 + t[1] ** 2]])
    theta = jnp.array([0.4, 1.1])
    phi = reparam.polar()
    np.testing.assert_allclose(
        mg.transform_metric_field(phi, mg.metrics.dense(metric_fn)).dense(phi.forward(theta)),
        mg.transform_metric(phi, theta, metric_fn(theta)),
        rtol=1e-12,
    )


# ---------------------------------------------------------------------------
# invariances: the rules preserve pairings, the naive rules do not
# ---------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6))
def test_invariance_under_random_reparametrizations(seed, n):
    r = rng(seed)
    phi = random_positive_reparam(r, n)
    theta = jnp.asarray(r.uniform(0.3, 2.0, size=n))
    v, w, omega = (jnp.asarray(r.normal(size=n)) for _ in range(3))
    G = random_spd(r, n)
    v_hat, w_hat = mg.transform_vector(phi, theta, v), mg.transform_vector(phi, theta, w)
    omega_hat = mg.transform_covector(phi, theta, omega)
    G_hat = mg.transform_metric(phi, theta, G)
    np.testing.assert_allclose(mg.pair(omega_hat, v_hat), mg.pair(omega, v), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(mg.inner(G_hat, v_hat, w_hat), mg.inner(G, v, w), rtol=1e-8, atol=1e-10)


def test_naive_rules_break_invariance():
    """Treating a covector as a vector (or not transforming G) changes the numbers."""
    theta = jnp.array([2.0, 0.5])
    phi = reparam.log()
    v = jnp.array([1.0, 1.0])
    omega = jnp.array([1.0, -3.0])
    G = jnp.eye(2)
    v_hat = mg.transform_vector(phi, theta, v)
    naive_omega = mg.transform_vector(phi, theta, omega)  # wrong rule J omega
    assert abs(float(mg.pair(naive_omega, v_hat) - mg.pair(omega, v))) > 1.0
    assert abs(float(mg.inner(G, v_hat, v_hat) - mg.inner(G, v, v))) > 0.5  # G not transformed


def test_pytree_points():
    r = rng(7)
    theta = {
        "w": jnp.asarray(r.uniform(0.5, 2.0, size=(2, 3))),
        "b": jnp.asarray(r.uniform(0.5, 2.0, size=(3,))),
    }
    n = 9
    phi = reparam.compose(reparam.softplus(), reparam.affine(random_invertible(r, n)))
    v = jax.tree_util.tree_map(lambda t: jnp.asarray(r.normal(size=t.shape)), theta)
    omega = jax.tree_util.tree_map(lambda t: jnp.asarray(r.normal(size=t.shape)), theta)
    G = random_spd(r, n)
    J = np.asarray(dense_jacobian(phi.forward, theta))
    np.testing.assert_allclose(phi.jacobian(theta), J, rtol=1e-10)
    v_hat = mg.transform_vector(phi, theta, v)
    assert jax.tree_util.tree_structure(v_hat) == jax.tree_util.tree_structure(theta)
    np.testing.assert_allclose(flatten(v_hat), J @ flatten(v), rtol=1e-10)
    np.testing.assert_allclose(
        flatten(mg.transform_covector(phi, theta, omega)), np.linalg.solve(J.T, flatten(omega)), rtol=1e-9
    )
    G_hat = mg.transform_metric(phi, theta, G)
    np.testing.assert_allclose(mg.inner(G_hat, v_hat, v_hat), mg.inner(G, v, v), rtol=1e-9)
    # musical isomorphisms on pytrees
    np.testing.assert_allclose(flatten(mg.sharp(G, mg.flat(G, v))), flatten(v), rtol=1e-9)
    # scale by a pytree of factors
    c = jax.tree_util.tree_map(lambda t: 2.0 + jnp.zeros_like(t), theta)
    np.testing.assert_allclose(flatten(reparam.scale(c).forward(theta)), 2.0 * flatten(theta))


# ---------------------------------------------------------------------------
# pushforward / pullback through non-invertible maps
# ---------------------------------------------------------------------------


def test_pushforward_and_pullback_match_jacobian():
    r = rng(8)
    W = jnp.asarray(r.normal(size=(3, 5)))

    def net(w):
        return jnp.tanh(W @ w) ** 2

    x = jnp.asarray(r.normal(size=5))
    v = jnp.asarray(r.normal(size=5))
    omega = jnp.asarray(r.normal(size=3))
    Jf = np.asarray(jax.jacrev(net)(x))
    np.testing.assert_allclose(mg.pushforward(net, x, v), Jf @ v, rtol=1e-10)
    np.testing.assert_allclose(mg.pullback_covector(net, x, omega), Jf.T @ omega, rtol=1e-10)
    # duality: (f^* omega)(v) = omega(f_* v)
    np.testing.assert_allclose(
        mg.pair(mg.pullback_covector(net, x, omega), v), mg.pair(omega, mg.pushforward(net, x, v)), rtol=1e-10
    )


# ---------------------------------------------------------------------------
# musical isomorphisms
# ---------------------------------------------------------------------------


def test_flat_sharp_dense_and_matrix_free():
    r = rng(9)
    n = 6
    G = random_spd(r, n, cond=100.0)
    v = jnp.asarray(r.normal(size=n))
    omega = jnp.asarray(r.normal(size=n))
    np.testing.assert_allclose(mg.flat(G, v), G @ v, rtol=1e-12)
    np.testing.assert_allclose(mg.sharp(G, omega), np.linalg.solve(G, omega), rtol=1e-9)
    np.testing.assert_allclose(
        mg.sharp(lambda u: G @ u, omega, tol=1e-12), np.linalg.solve(G, omega), rtol=1e-7
    )
    np.testing.assert_allclose(
        mg.sharp(G, omega, damping=0.5), np.linalg.solve(G + 0.5 * np.eye(n), omega), rtol=1e-9
    )
    np.testing.assert_allclose(
        mg.sharp(lambda u: G @ u, omega, damping=0.5, tol=1e-12),
        np.linalg.solve(G + 0.5 * np.eye(n), omega),
        rtol=1e-7,
    )
    np.testing.assert_allclose(mg.flat(G, mg.sharp(G, omega)), omega, rtol=1e-9)
    # a singular metric works with damping
    P = jnp.diag(jnp.array([1.0, 0.0, 2.0]))
    np.testing.assert_allclose(mg.sharp(P, jnp.ones(3), damping=1.0), [0.5, 1.0, 1 / 3], rtol=1e-12)


# ---------------------------------------------------------------------------
# jit and vmap compatibility
# ---------------------------------------------------------------------------


def test_jit_and_vmap():
    r = rng(10)
    phi = reparam.polar()
    thetas = jnp.asarray(r.normal(size=(7, 2))) + 3.0
    vs = jnp.asarray(r.normal(size=(7, 2)))
    G = random_spd(r, 2)
    eager = jnp.stack([mg.transform_vector(phi, t, v) for t, v in zip(thetas, vs)])
    batched = jax.vmap(lambda t, v: mg.transform_vector(phi, t, v))(thetas, vs)
    jitted = jax.jit(jax.vmap(lambda t, v: mg.transform_covector(phi, t, v)))(thetas, vs)
    np.testing.assert_allclose(batched, eager, rtol=1e-12)
    np.testing.assert_allclose(jitted[0], mg.transform_covector(phi, thetas[0], vs[0]), rtol=1e-12)
    metric_jit = jax.jit(lambda t: mg.transform_metric(phi, t, G))
    np.testing.assert_allclose(metric_jit(thetas[1]), mg.transform_metric(phi, thetas[1], G), rtol=1e-12)
    sharp_jit = jax.jit(lambda w: mg.sharp(G, w))
    np.testing.assert_allclose(sharp_jit(vs[0]), np.linalg.solve(G, vs[0]), rtol=1e-9)
    sharp_cg_jit = jax.jit(lambda w: mg.sharp(lambda u: G @ u, w, tol=1e-12))
    np.testing.assert_allclose(sharp_cg_jit(vs[0]), np.linalg.solve(G, vs[0]), rtol=1e-7)
    grad_of_transformed = jax.jit(jax.grad(lambda t: jnp.sum(mg.transform_vector(phi, t, vs[0]) ** 2)))
    assert np.all(np.isfinite(grad_of_transformed(thetas[0])))


def test_float32_stays_float32():
    # x64 is on in the tests; explicitly float32 inputs must still give float32 outputs.
    theta = jnp.array([1.0, 2.0], dtype=jnp.float32)
    out = mg.transform_covector(reparam.log(), theta, jnp.ones(2, dtype=jnp.float32))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, [1.0, 2.0], rtol=1e-6)
    vec = mg.transform_vector(reparam.polar(), theta, jnp.ones(2, dtype=jnp.float32))
    assert vec.dtype == jnp.float32


# ---------------------------------------------------------------------------
# the singularity check is relative to the dtype and to each coordinate's scale
# ---------------------------------------------------------------------------
SPREADS = {
    "float64": (jnp.float64, [(1e-3, 1e3), (1e-5, 1e5), (1e-9, 1e9), (1e-100, 1e100)]),
    "float32": (jnp.float32, [(1e-3, 1e3), (1e-5, 1e5), (1e-9, 1e9), (1e-15, 1e15)]),
}


@pytest.mark.parametrize("dtype_name", sorted(SPREADS))
def test_log_jacobian_is_invertible_at_widely_spread_theta(dtype_name):
    # diag(1/theta) is invertible whenever theta is finite and positive, however spread its entries;
    # a condition-number test (smallest / largest singular value) called it "singular".
    dtype, spreads = SPREADS[dtype_name]
    rtol = 1e-12 if dtype == jnp.float64 else 2e-6
    phi = reparam.log()
    for lo, hi in spreads:
        theta_np = np.array([lo, 1.0, hi, np.sqrt(hi)])
        theta = jnp.asarray(theta_np, dtype)
        v = jnp.asarray([1.0, -2.0, 0.5, 3.0], dtype)
        J = phi.jacobian(theta)
        Jinv = phi.inverse_jacobian(phi.forward(theta))
        assert J.dtype == dtype and Jinv.dtype == dtype
        np.testing.assert_allclose(np.diag(J), 1.0 / theta_np, rtol=rtol)
        np.testing.assert_allclose(np.diag(Jinv), theta_np, rtol=rtol)
        np.testing.assert_allclose(mg.transform_vector(phi, theta, v), np.asarray(v) / theta_np, rtol=rtol)
        np.testing.assert_allclose(mg.transform_covector(phi, theta, v), np.asarray(v) * theta_np, rtol=rtol)
        G = jnp.eye(4, dtype=dtype)
        np.testing.assert_allclose(np.diag(mg.transform_metric(phi, theta, G)), theta_np**2, rtol=rtol)
        E = jnp.diag(jnp.asarray([1.0, 2.0, 3.0, 4.0], dtype))
        np.testing.assert_allclose(mg.transform_endomorphism(phi, theta, E), E, rtol=rtol)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_affine_with_widely_spread_scales_is_invertible(dtype):
    s = 1e9 if dtype == jnp.float64 else 1e5
    A = jnp.asarray([[1 / s, 0.0], [0.0, s]], dtype)
    phi = reparam.affine(A)
    theta = jnp.asarray([2.0, 3.0], dtype)
    np.testing.assert_allclose(phi.inverse(phi.forward(theta)), theta, rtol=1e-6)
    np.testing.assert_allclose(mg.transform_vector(phi, theta, theta), [2.0 / s, 3.0 * s], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_truly_singular_jacobians_still_raise(dtype):
    cube = mg.Reparametrization(lambda t: t**3, jnp.cbrt, name="cube")
    with pytest.raises(mg.GeometryError, match=r"Jacobian of cube is singular"):
        cube.jacobian(jnp.asarray([0.0, 1.0], dtype))  # a zero row
    with pytest.raises(mg.GeometryError, match=r"Jacobian of cube is singular"):
        cube.jacobian(jnp.asarray([0.0, 1e-3, 1e3], dtype))
    # dependent rows, hidden behind very different row scales: rescaling does not make it invertible
    fold = mg.Reparametrization(
        lambda t: jnp.stack([1e-6 * (t[0] + t[1]), 1e6 * (t[0] + t[1])]), lambda p: p, name="fold"
    )
    with pytest.raises(mg.GeometryError, match=r"Jacobian of fold is singular"):
        fold.jacobian(jnp.asarray([1.0, 2.0], dtype))
    with pytest.raises(mg.GeometryError, match=r"singular"):
        reparam.affine(jnp.asarray([[1e-6, 2e-6], [1e6, 2e6]], dtype))
    # nearly dependent rows: singular to float32's precision, invertible in float64
    near = jnp.asarray([[1.0, 1.0], [1.0, 1.0 + 1e-9]], jnp.float64)
    reparam.affine(near)
    with pytest.raises(mg.GeometryError, match=r"singular"):
        reparam.affine(jnp.asarray([[1.0, 1.0], [1.0, 1.0 + 1e-9]], jnp.float32))


@pytest.mark.parametrize(
    "c", [np.float32(2.0), np.float64(2.0), jnp.asarray(2.0), jnp.asarray(2.0, jnp.float32), 2],
    ids=["np.float32", "np.float64", "0-d jax", "0-d jax float32", "int"],
)
def test_scale_accepts_numpy_and_0d_jax_scalars(c):
    phi = reparam.scale(c)
    np.testing.assert_allclose(phi.forward(jnp.asarray([1.0, 3.0])), [2.0, 6.0])
    np.testing.assert_allclose(phi.inverse(jnp.asarray([2.0])), [1.0])
    np.testing.assert_allclose(phi.jacobian(jnp.asarray([1.0, 3.0])), 2.0 * np.eye(2))


# ---------------------------------------------------------------------------
# the transformation rules take the one Metric type (a field, evaluated at a point)
# ---------------------------------------------------------------------------
def _ggn_field(dtype):
    """A non-constant metric field: the GGN of a small tanh net, a :class:`Metric`, and its dense truth."""
    r = rng(21)
    X = jnp.asarray(r.normal(size=(5, 3)), dtype)
    y = jnp.asarray(r.normal(size=(5,)), dtype)
    model = lambda p: jnp.tanh(X @ p[:3]) * p[3] + p[4]
    loss = lambda z: 0.5 * jnp.mean((z - y) ** 2)
    metric = mg.ggn(model, loss)

    def dense(p):  # J^T H_z J by jacfwd, independent of minigeo's products
        J = jax.jacfwd(model)(p)
        return J.T @ jax.hessian(loss)(model(p)) @ J

    theta = jnp.asarray(r.normal(size=5), dtype) + 1.0
    return metric, dense, theta, r


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_rules_accept_a_metric_field_at_a_point(dtype):
    metric, dense, theta, r = _ggn_field(dtype)
    G = dense(theta) + 0.3 * jnp.eye(5, dtype=dtype)  # the GGN is rank <= 5: damp it
    damped = metric.with_damping(0.3)
    u, v = (jnp.asarray(r.normal(size=5), dtype) for _ in range(2))
    tol = 200 * float(jnp.finfo(dtype).eps) * float(np.linalg.cond(np.asarray(G, np.float64)))
    np.testing.assert_allclose(mg.inner(damped, u, v, at=theta), u @ G @ v, rtol=tol, atol=tol)
    np.testing.assert_allclose(mg.flat(damped, v, at=theta), G @ v, rtol=tol, atol=tol)
    x, info = mg.sharp(damped, v, at=theta, tol=10 * float(jnp.finfo(dtype).eps), return_info=True)
    assert bool(info.converged)
    np.testing.assert_allclose(x, np.linalg.solve(np.asarray(G, np.float64), np.asarray(v, np.float64)), rtol=tol)
    # sharp's damping adds to the metric's own: G + (0.3 + 0.2) I
    G2 = G + 0.2 * jnp.eye(5, dtype=dtype)
    np.testing.assert_allclose(
        mg.sharp(damped, v, at=theta, damping=0.2, tol=10 * float(jnp.finfo(dtype).eps)),
        np.linalg.solve(np.asarray(G2, np.float64), np.asarray(v, np.float64)),
        rtol=tol,
    )
    assert mg.flat(damped, v, at=theta).dtype == dtype
    # the transformation rules evaluate the field at theta: same as the dense rule on G(theta)
    phi = reparam.affine(random_invertible(r, 5).astype(dtype), jnp.zeros(5, dtype))
    transformed = mg.transform_metric(phi, theta, damped)
    truth = mg.transform_metric(phi, theta, G)
    basis = jnp.eye(5, dtype=dtype)
    np.testing.assert_allclose(jax.vmap(transformed)(basis).T, truth, rtol=tol, atol=tol * float(jnp.max(jnp.abs(truth))))
    bil = mg.transform_bilinear(phi, theta, damped)
    np.testing.assert_allclose(jax.vmap(bil)(basis).T, truth, rtol=tol, atol=tol * float(jnp.max(jnp.abs(truth))))


def test_a_metric_field_needs_its_point():
    metric, _, theta, _ = _ggn_field(jnp.float64)
    for call in (
        lambda: mg.inner(metric, theta, theta),
        lambda: mg.flat(metric, theta),
        lambda: mg.sharp(metric.with_damping(1.0), theta),
    ):
        with pytest.raises(mg.GeometryError, match="at=params"):
            call()


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["float64", "float32"])
def test_transform_metric_field_of_a_metric_is_a_metric(dtype):
    # the Euclidean metric in polar coordinates is diag(1, r^2) (closed form), damping included
    polar = reparam.polar()
    psi = jnp.array([2.0, 0.3], dtype)
    G_psi = mg.transform_metric_field(polar, mg.euclidean())
    assert isinstance(G_psi, mg.Metric)
    eps = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(G_psi.dense(psi), np.diag([1.0, 4.0]), atol=20 * eps)
    # a damped field: J^{-T} (G + lam I) J^{-1} = (1 + lam) diag(1, r^2) for G = I
    damped = mg.transform_metric_field(polar, mg.euclidean().with_damping(0.5))
    np.testing.assert_allclose(damped.dense(psi), 1.5 * np.diag([1.0, 4.0]), atol=40 * eps)
    assert float(damped.damping) == 0.0
    # and a non-constant field against the dense-field rule, then its Christoffel symbols
    metric, dense, theta, r = _ggn_field(dtype)
    phi = reparam.compose(reparam.log(), reparam.affine(random_invertible(r, 5).astype(dtype), jnp.zeros(5, dtype)))
    point = jnp.abs(theta) + 0.5
    psi5 = phi.forward(point)
    as_metric = mg.transform_metric_field(phi, metric.with_damping(0.1))
    as_matrix = mg.transform_metric_field(phi, mg.metrics.dense(lambda t: dense(t) + 0.1 * jnp.eye(5, dtype=dtype)))
    truth = as_matrix.dense(psi5)
    tol = 500 * eps
    np.testing.assert_allclose(as_metric.dense(psi5), truth, rtol=tol, atol=tol * float(jnp.max(jnp.abs(truth))))
    if dtype == jnp.float64:
        np.testing.assert_allclose(
            mg.christoffel_symbols(as_metric, psi5), mg.christoffel_symbols(as_matrix, psi5), rtol=1e-8, atol=1e-10
        )


def test_damping_of_a_metric_field_is_traced_in_sharp():
    # a jitted caller of sharp(Metric) takes the metric as an argument: new damping, no new trace
    metric, dense, theta, r = _ggn_field(jnp.float64)
    traces = []

    @jax.jit
    def solve(G, w):
        traces.append(1)
        return mg.sharp(G, w, at=theta, tol=1e-12, return_info=True)

    w = jnp.asarray(r.normal(size=5))
    for lam in (0.1, 0.7):
        x, info = solve(metric.with_damping(lam), w)
        assert int(info.status) == 0
        np.testing.assert_allclose(x, np.linalg.solve(dense(theta) + lam * np.eye(5), w), rtol=1e-8)
    assert len(traces) == 1


def test_metric_fields_accept_a_constant_matrix():
    # a constant matrix is a flat metric: zero Christoffel symbols, Riemannian Hessian = Hessian
    r = rng(22)
    G = random_spd(r, 3)
    x = jnp.asarray(r.normal(size=3))
    np.testing.assert_allclose(mg.christoffel_symbols(G, x), np.zeros((3, 3, 3)), atol=1e-14)
    f = lambda z: jnp.sum(jnp.sin(z) * z**2)
    np.testing.assert_allclose(mg.riemannian_hessian(f, G, x), jax.hessian(f)(x), rtol=1e-12)
    np.testing.assert_allclose(
        mg.hessian_endomorphism(f, G, x), np.linalg.solve(G, jax.hessian(f)(x)), rtol=1e-10
    )
    np.testing.assert_allclose(mg.log_volume_element(G, x), 0.5 * np.linalg.slogdet(G)[1], rtol=1e-12)

"""Tests of minigeo.quotient: horizontal projection from its definition, invariance, Christoffel by autodiff, exact GL(1) geodesics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_invertible, rng

import minigeo as mg


def random_pair(r, n=5, m=4, h=3, batch=()):
    G = jnp.asarray(r.normal(size=batch + (n, h)))
    H = jnp.asarray(r.normal(size=batch + (m, h)))
    return G, H


def random_tangent(r, point):
    return tuple(jnp.asarray(r.normal(size=x.shape)) for x in point)


@pytest.mark.parametrize("batch", [(), (4,)])
def test_horizontal_projection_against_its_definition(batch):
    r = rng(0)
    point = random_pair(r, batch=batch)
    xi = random_tangent(r, point)
    xh = mg.horizontal_projection(point, xi)
    G, H = point
    # (1) the removed part is vertical: xi - xh = (-G Omega, H Omega^T) for some Omega
    dG, dH = xi[0] - xh[0], xi[1] - xh[1]
    Omega = -jnp.linalg.pinv(G) @ dG
    np.testing.assert_allclose(dG, -G @ Omega, atol=1e-10)
    np.testing.assert_allclose(dH, H @ jnp.swapaxes(Omega, -1, -2), atol=1e-10)
    # (2) the result is metric-orthogonal to random vertical vectors (per head)
    for seed in range(3):
        omega = jnp.asarray(rng(seed + 10).normal(size=batch + (3, 3)))
        v = mg.vertical_vector(point, omega)
        np.testing.assert_allclose(mg.gl_metric(point, xh, v), 0.0, atol=1e-10)
    # (3) idempotent
    xhh = mg.horizontal_projection(point, xh)
    for a, b in zip(xhh, xh):
        np.testing.assert_allclose(a, b, atol=1e-10)


def test_sylvester_as_printed_in_paper_is_not_horizontal():
    """Paper 004 prints A Lam + Lam A^T = B for the horizontal vector (xi_G + G Lam, xi_H - H Lam^T).

    Read literally (A = G^T G H^T H is not symmetric), its solution is not orthogonal to the vertical space;
    minigeo solves A X + X A = B for X = Lam^T instead (derivation in minigeo/quotient.py).
    """
    r = rng(1)
    point = random_pair(r)
    G, H = point
    xi = random_tangent(r, point)
    P, Q = G.T @ G, H.T @ H
    A = P @ Q
    B = P @ H.T @ xi[1] - xi[0].T @ G @ Q
    literal = jax.scipy.linalg.solve_sylvester(A, A.T, B)
    x_lit = (xi[0] + G @ literal, xi[1] - H @ literal.T)
    omega = jnp.asarray(rng(2).normal(size=(3, 3)))
    assert abs(float(mg.gl_metric(point, x_lit, mg.vertical_vector(point, omega)))) > 1e-3
    # the corrected equation, solved by a maintained routine, agrees with minigeo's eigendecomposition solve
    X = jax.scipy.linalg.solve_sylvester(A, A, B)
    ours = mg.horizontal_projection(point, xi)
    np.testing.assert_allclose(ours[0], xi[0] + G @ X.T, atol=1e-9)
    np.testing.assert_allclose(ours[1], xi[1] - H @ X, atol=1e-9)


@pytest.mark.parametrize("kind", ["inv", "mix"])
def test_metric_invariant_under_group_action(kind):
    r = rng(3)
    point = random_pair(r)
    eta, zeta = random_tangent(r, point), random_tangent(r, point)
    A = random_invertible(r, 3)
    Ainv = jnp.linalg.inv(A)
    act = lambda p: (p[0] @ Ainv, p[1] @ A.T)  # linear in (G, H): also the action on tangent vectors
    np.testing.assert_allclose(
        mg.gl_metric(act(point), act(eta), act(zeta), kind=kind),
        mg.gl_metric(point, eta, zeta, kind=kind),
        rtol=1e-10,
    )
    # the Euclidean metric is not invariant
    euc = lambda a, b: jnp.sum(a[0] * b[0]) + jnp.sum(a[1] * b[1])
    assert abs(float(euc(act(eta), act(zeta)) - euc(eta, zeta))) > 1e-3
    # horizontal vectors map to horizontal vectors
    xh = mg.horizontal_projection(point, eta)
    moved = mg.horizontal_projection(act(point), act(xh))
    for a, b in zip(moved, act(xh)):
        np.testing.assert_allclose(a, b, atol=1e-9)


def flat_metric(shapes):
    """Metric (15) as a dense matrix over flattened (G, H) coordinates (row-major vec)."""
    (n, h), (m, _) = shapes

    def metric(x):
        G = x[: n * h].reshape(n, h)
        H = x[n * h :].reshape(m, h)
        Pinv = jnp.linalg.inv(G.T @ G)
        Qinv = jnp.linalg.inv(H.T @ H)
        # Tr(P^-1 a^T b) = sum_ij a_ij b_ik (P^-1)_jk -> row-major vec: kron(I_n, P^-1)
        return jax.scipy.linalg.block_diag(jnp.kron(jnp.eye(n), Pinv), jnp.kron(jnp.eye(m), Qinv))

    return metric


def test_christoffel_quadratic_matches_autodiff_christoffel_symbols():
    r = rng(4)
    n, m, h = 3, 2, 2
    point = random_pair(r, n, m, h)
    xi = random_tangent(r, point)
    x = jnp.concatenate([point[0].ravel(), point[1].ravel()])
    v = jnp.concatenate([xi[0].ravel(), xi[1].ravel()])
    Gamma = mg.christoffel_symbols(flat_metric(((n, h), (m, h))), x)
    expected = jnp.einsum("kij,i,j->k", Gamma, v, v)
    cG, cH = mg.christoffel_quadratic(point, xi)
    np.testing.assert_allclose(jnp.concatenate([cG.ravel(), cH.ravel()]), expected, rtol=1e-8, atol=1e-10)
    # and the metric itself
    np.testing.assert_allclose(
        v @ flat_metric(((n, h), (m, h)))(x) @ v, mg.gl_metric(point, xi, xi), rtol=1e-10
    )


def test_riemannian_gradient():
    r = rng(5)
    point = random_pair(r)
    T = jnp.asarray(r.normal(size=(5, 4)))
    f = lambda G, H: jnp.sum(jnp.sin(G @ H.T) * T)  # depends on G H^T only: GL(h)-invariant
    egrad = jax.grad(f, argnums=(0, 1))(*point)
    rgrad = mg.riemannian_gradient(point, egrad)
    for seed in range(3):
        zeta = random_tangent(rng(seed + 20), point)
        df = jnp.sum(egrad[0] * zeta[0]) + jnp.sum(egrad[1] * zeta[1])
        np.testing.assert_allclose(mg.gl_metric(point, rgrad, zeta), df, rtol=1e-9)
    proj = mg.horizontal_projection(point, rgrad)
    for a, b in zip(proj, rgrad):
        np.testing.assert_allclose(a, b, atol=1e-9)  # horizontal already


def test_geodesic_step_is_second_order():
    """|exact geodesic - second-order step| = O(t^3): halving t divides the error by ~8 (ODE reference by RK4)."""
    r = rng(6)
    point = random_pair(r, 3, 3, 2)
    xi = mg.horizontal_projection(point, random_tangent(r, point))

    def rhs(state):
        (G, H), (dG, dH) = state
        cG, cH = mg.christoffel_quadratic((G, H), (dG, dH))
        return (dG, dH), (-cG, -cH)

    def geodesic(t, steps=400):
        state = (point, xi)
        hstep = t / steps
        add = lambda a, b, c: jax.tree_util.tree_map(lambda x, y: x + c * y, a, b)
        for _ in range(steps):
            k1 = rhs(state)
            k2 = rhs(add(state, k1, hstep / 2))
            k3 = rhs(add(state, k2, hstep / 2))
            k4 = rhs(add(state, k3, hstep))
            state = jax.tree_util.tree_map(
                lambda s, a, b, c, d: s + hstep / 6 * (a + 2 * b + 2 * c + d), state, k1, k2, k3, k4
            )
        return state[0]

    errs = []
    for t in [0.2, 0.1]:
        exact = geodesic(t)
        approx = mg.geodesic_step(point, tuple(t * x for x in xi))
        errs.append(float(sum(jnp.linalg.norm(a - b) for a, b in zip(exact, approx))))
    assert 5.0 < errs[0] / errs[1] < 11.0, errs


def test_gl1_geodesic_is_exact_and_projection():
    u, v = jnp.array([2.0, -0.5, 1.3]), jnp.array([0.7, 1.1, -2.0])
    xi = (jnp.array([0.3, 0.2, -0.4]), jnp.array([-0.1, 0.5, 0.3]))

    # ODE: u'' = u'^2 / u (Christoffel -1/u of the metric 1/u^2), solved by RK4
    def rk4(x0, dx0, t=1.0, steps=2000):
        x, dx, hs = x0, dx0, t / steps
        f = lambda x, dx: (dx, dx**2 / x)
        for _ in range(steps):
            a1, b1 = f(x, dx)
            a2, b2 = f(x + hs / 2 * a1, dx + hs / 2 * b1)
            a3, b3 = f(x + hs / 2 * a2, dx + hs / 2 * b2)
            a4, b4 = f(x + hs * a3, dx + hs * b3)
            x, dx = x + hs / 6 * (a1 + 2 * a2 + 2 * a3 + a4), dx + hs / 6 * (b1 + 2 * b2 + 2 * b3 + b4)
        return x

    u1, v1 = mg.gl1_geodesic((u, v), xi)
    np.testing.assert_allclose(u1, rk4(u, xi[0]), rtol=1e-9)
    np.testing.assert_allclose(v1, rk4(v, xi[1]), rtol=1e-9)
    xh = mg.gl1_horizontal_projection((u, v), xi)
    np.testing.assert_allclose(xh[0] / u, xh[1] / v, rtol=1e-12)  # horizontal: equal relative rates
    vert = (-u * 0.7, v * 0.7)
    np.testing.assert_allclose(mg.gl1_metric((u, v), xh, vert), 0.0, atol=1e-12)
    # invariance of the GL(1) metric under (a u, v / a)
    a = jnp.array([3.0, 0.2, -1.5])
    np.testing.assert_allclose(
        mg.gl1_metric((a * u, v / a), (a * xi[0], xi[1] / a), (a * xi[0], xi[1] / a)),
        mg.gl1_metric((u, v), xi, xi),
        rtol=1e-12,
    )


def test_jit_and_relaxation():
    r = rng(7)
    point = random_pair(r, batch=(3,))
    xi = random_tangent(r, point)
    eager = mg.horizontal_projection(point, xi, eps=1e-6)
    jitted = jax.jit(lambda p, x: mg.horizontal_projection(p, x, eps=1e-6))(point, xi)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    # a rank-deficient pair needs the relaxation
    G = jnp.ones((4, 2))
    H = jnp.asarray(r.normal(size=(3, 2)))
    with pytest.raises(mg.GeometryError, match=r"eps > 0"):
        mg.horizontal_projection((G, H), (G, H))
    out = mg.horizontal_projection((G, H), (G + 0.1, H), eps=1e-3)
    assert all(np.isfinite(np.asarray(x)).all() for x in out)


def test_quotient_errors():
    G, H = jnp.ones((3, 2)), jnp.ones((4, 3))
    with pytest.raises(mg.GeometryError, match=r"share the symmetry dimension"):
        mg.gl_metric((G, H), (G, H), (G, H))
    G, H = jnp.eye(3)[:, :2], jnp.eye(4)[:, :2]
    with pytest.raises(mg.GeometryError, match=r"xi has shapes"):
        mg.horizontal_projection((G, H), (jnp.ones((5, 2)), H))
    with pytest.raises(mg.GeometryError, match=r"kind must be"):
        mg.gl_metric((G, H), (G, H), (G, H), kind="euclid")
    with pytest.raises(mg.GeometryError, match=r">= 0"):
        mg.christoffel_quadratic((G, H), (G, H), eps=-1.0)
    with pytest.raises(mg.GeometryError, match=r"omega must have shape"):
        mg.vertical_vector((G, H), jnp.ones((3, 3)))
    with pytest.raises(mg.GeometryError, match=r"pair \(G, H\)"):
        mg.geodesic_step(G, (G, H))
    with pytest.raises(mg.GeometryError, match=r"same shape"):
        mg.gl1_geodesic((jnp.ones(2), jnp.ones(3)), (jnp.ones(2), jnp.ones(3)))
    with pytest.raises(mg.GeometryError, match=r"zero weights"):
        mg.gl1_horizontal_projection((jnp.array([0.0, 1.0]), jnp.ones(2)), (jnp.ones(2), jnp.ones(2)))

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
    xh = mg.quotient.horizontal_projection(point, xi)
    G, H = point
    # (1) the removed part is vertical: xi - xh = (-G Omega, H Omega^T) for some Omega
    dG, dH = xi[0] - xh[0], xi[1] - xh[1]
    Omega = -jnp.linalg.pinv(G) @ dG
    np.testing.assert_allclose(dG, -G @ Omega, atol=1e-10)
    np.testing.assert_allclose(dH, H @ jnp.swapaxes(Omega, -1, -2), atol=1e-10)
    # (2) the result is metric-orthogonal to random vertical vectors (per head)
    for seed in range(3):
        omega = jnp.asarray(rng(seed + 10).normal(size=batch + (3, 3)))
        v = mg.quotient.vertical_vector(point, omega)
        np.testing.assert_allclose(mg.quotient.gl_metric(point, xh, v), 0.0, atol=1e-10)
    # (3) idempotent
    xhh = mg.quotient.horizontal_projection(point, xh)
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
    assert abs(float(mg.quotient.gl_metric(point, x_lit, mg.quotient.vertical_vector(point, omega)))) > 1e-3
    # the corrected equation, solved by a maintained routine, agrees with minigeo's eigendecomposition solve
    X = jax.scipy.linalg.solve_sylvester(A, A, B)
    ours = mg.quotient.horizontal_projection(point, xi)
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
        mg.quotient.gl_metric(act(point), act(eta), act(zeta), kind=kind),
        mg.quotient.gl_metric(point, eta, zeta, kind=kind),
        rtol=1e-10,
    )
    # the Euclidean metric is not invariant
    euc = lambda a, b: jnp.sum(a[0] * b[0]) + jnp.sum(a[1] * b[1])
    assert abs(float(euc(act(eta), act(zeta)) - euc(eta, zeta))) > 1e-3
    # horizontal vectors map to horizontal vectors
    xh = mg.quotient.horizontal_projection(point, eta)
    moved = mg.quotient.horizontal_projection(act(point), act(xh))
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
    Gamma = mg.christoffel_symbols(mg.metrics.dense(flat_metric(((n, h), (m, h)))), x)
    expected = jnp.einsum("kij,i,j->k", Gamma, v, v)
    cG, cH = mg.quotient.christoffel_quadratic(point, xi)
    np.testing.assert_allclose(jnp.concatenate([cG.ravel(), cH.ravel()]), expected, rtol=1e-8, atol=1e-10)
    # and the metric itself
    np.testing.assert_allclose(
        v @ flat_metric(((n, h), (m, h)))(x) @ v, mg.quotient.gl_metric(point, xi, xi), rtol=1e-10
    )


def test_riemannian_gradient():
    r = rng(5)
    point = random_pair(r)
    T = jnp.asarray(r.normal(size=(5, 4)))
    f = lambda G, H: jnp.sum(jnp.sin(G @ H.T) * T)  # depends on G H^T only: GL(h)-invariant
    egrad = jax.grad(f, argnums=(0, 1))(*point)
    rgrad = mg.quotient.riemannian_gradient(point, egrad)
    for seed in range(3):
        zeta = random_tangent(rng(seed + 20), point)
        df = jnp.sum(egrad[0] * zeta[0]) + jnp.sum(egrad[1] * zeta[1])
        np.testing.assert_allclose(mg.quotient.gl_metric(point, rgrad, zeta), df, rtol=1e-9)
    proj = mg.quotient.horizontal_projection(point, rgrad)
    for a, b in zip(proj, rgrad):
        np.testing.assert_allclose(a, b, atol=1e-9)  # horizontal already


def test_geodesic_step_is_second_order():
    """|exact geodesic - second-order step| = O(t^3): halving t divides the error by ~8 (ODE reference by RK4)."""
    r = rng(6)
    point = random_pair(r, 3, 3, 2)
    xi = mg.quotient.horizontal_projection(point, random_tangent(r, point))

    def rhs(state):
        (G, H), (dG, dH) = state
        cG, cH = mg.quotient.christoffel_quadratic((G, H), (dG, dH))
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
        approx = mg.quotient.geodesic_step(point, tuple(t * x for x in xi))
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

    u1, v1 = mg.quotient.gl1_geodesic((u, v), xi)
    np.testing.assert_allclose(u1, rk4(u, xi[0]), rtol=1e-9)
    np.testing.assert_allclose(v1, rk4(v, xi[1]), rtol=1e-9)
    xh = mg.quotient.gl1_horizontal_projection((u, v), xi)
    np.testing.assert_allclose(xh[0] / u, xh[1] / v, rtol=1e-12)  # horizontal: equal relative rates
    vert = (-u * 0.7, v * 0.7)
    np.testing.assert_allclose(mg.quotient.gl1_metric((u, v), xh, vert), 0.0, atol=1e-12)
    # invariance of the GL(1) metric under (a u, v / a)
    a = jnp.array([3.0, 0.2, -1.5])
    np.testing.assert_allclose(
        mg.quotient.gl1_metric((a * u, v / a), (a * xi[0], xi[1] / a), (a * xi[0], xi[1] / a)),
        mg.quotient.gl1_metric((u, v), xi, xi),
        rtol=1e-12,
    )


def test_jit_and_relaxation():
    r = rng(7)
    point = random_pair(r, batch=(3,))
    xi = random_tangent(r, point)
    eager = mg.quotient.horizontal_projection(point, xi, eps=1e-6)
    jitted = jax.jit(lambda p, x: mg.quotient.horizontal_projection(p, x, eps=1e-6))(point, xi)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    # a rank-deficient pair needs the relaxation
    G = jnp.ones((4, 2))
    H = jnp.asarray(r.normal(size=(3, 2)))
    with pytest.raises(mg.GeometryError, match=r"eps > 0"):
        mg.quotient.horizontal_projection((G, H), (G, H))
    out = mg.quotient.horizontal_projection((G, H), (G + 0.1, H), eps=1e-3)
    assert all(np.isfinite(np.asarray(x)).all() for x in out)


def test_quotient_errors():
    G, H = jnp.ones((3, 2)), jnp.ones((4, 3))
    with pytest.raises(mg.GeometryError, match=r"share the symmetry dimension"):
        mg.quotient.gl_metric((G, H), (G, H), (G, H))
    G, H = jnp.eye(3)[:, :2], jnp.eye(4)[:, :2]
    with pytest.raises(mg.GeometryError, match=r"xi has shapes"):
        mg.quotient.horizontal_projection((G, H), (jnp.ones((5, 2)), H))
    with pytest.raises(mg.GeometryError, match=r"kind must be"):
        mg.quotient.gl_metric((G, H), (G, H), (G, H), kind="euclid")
    with pytest.raises(mg.GeometryError, match=r">= 0"):
        mg.quotient.christoffel_quadratic((G, H), (G, H), eps=-1.0)
    with pytest.raises(mg.GeometryError, match=r"omega must have shape"):
        mg.quotient.vertical_vector((G, H), jnp.ones((3, 3)))
    with pytest.raises(mg.GeometryError, match=r"pair \(G, H\)"):
        mg.quotient.geodesic_step(G, (G, H))
    with pytest.raises(mg.GeometryError, match=r"same shape"):
        mg.quotient.gl1_geodesic((jnp.ones(2), jnp.ones(3)), (jnp.ones(2), jnp.ones(3)))
    with pytest.raises(mg.GeometryError, match=r"zero weights"):
        mg.quotient.gl1_horizontal_projection((jnp.array([0.0, 1.0]), jnp.ones(2)), (jnp.ones(2), jnp.ones(2)))


# ---------------------------------------------------------------------------
# float32 lane: conditioning enters once, rank is judged relative to the dtype
# ---------------------------------------------------------------------------
def side_with_cond(r, n, h, cond):
    """An n x h matrix with singular values spread geometrically from 1 to 1/cond."""
    U, _ = np.linalg.qr(r.normal(size=(n, h)))
    V, _ = np.linalg.qr(r.normal(size=(h, h)))
    return (U * np.geomspace(1.0, 1.0 / cond, h)) @ V.T


def to(dtype, tree):
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), tree)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("cond", [1e2, 1e3, 1e4])
def test_quotient_functions_lose_at_most_cond_times_eps(dtype, cond):
    """Against a float64 reference, the relative error of the projection, metric and geodesic step is
    O(cond(G) eps), not O(cond(G)^2 eps) as through Gram matrices (the old float32 projection was
    1e-2 off in the metric norm at cond 1e3; the bound below is 5e-4 there)."""
    r = rng(40)
    point64 = (side_with_cond(r, 64, 8, cond), side_with_cond(r, 48, 8, 10.0))
    xi64 = (r.normal(size=(64, 8)), r.normal(size=(48, 8)))
    point, xi = to(dtype, point64), to(dtype, xi64)
    point64, xi64 = to(jnp.float64, point64), to(jnp.float64, xi64)
    tol = 4.0 * cond * float(jnp.finfo(dtype).eps) + 1e-13

    def rel_metric_norm(got, ref):
        d = tuple(jnp.asarray(g, jnp.float64) - e for g, e in zip(got, ref))
        return float(jnp.sqrt(mg.quotient.gl_metric(point64, d, d) / mg.quotient.gl_metric(point64, ref, ref)))

    ref = mg.quotient.horizontal_projection(point64, xi64)
    assert rel_metric_norm(mg.quotient.horizontal_projection(point, xi), ref) <= tol
    m64 = mg.quotient.gl_metric(point64, xi64, xi64)
    assert abs(float(mg.quotient.gl_metric(point, xi, xi)) - float(m64)) <= tol * float(m64)
    step64 = tuple(0.1 * x for x in ref)
    step = to(dtype, step64)
    for got, want in zip(mg.quotient.geodesic_step(point, step), mg.quotient.geodesic_step(point64, step64)):
        err = float(jnp.linalg.norm(jnp.asarray(got, jnp.float64) - want) / jnp.linalg.norm(want))
        assert err <= tol
    for got, want in zip(mg.quotient.christoffel_quadratic(point, step), mg.quotient.christoffel_quadratic(point64, step64)):
        err = float(jnp.linalg.norm(jnp.asarray(got, jnp.float64) - want) / jnp.linalg.norm(want))
        assert err <= 10 * tol
    # the projection is still a projection in the low precision
    once = mg.quotient.horizontal_projection(point, xi)
    twice = mg.quotient.horizontal_projection(point, once)
    assert rel_metric_norm(twice, to(jnp.float64, once)) <= tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_singular_pair_rejected_ill_conditioned_accepted(dtype):
    """Two identical columns make G rank deficient: rejected in either precision (the cut-off is relative
    to the dtype's eps, not a fixed 1e-12 on Gram eigenvalues); cond 1e4 at ViT-B/32's n = 769 is
    merely ill conditioned and accepted; eps > 0 makes the rank-deficient pair usable."""
    r = rng(41)
    G = r.normal(size=(6, 3))
    G[:, 1] = G[:, 0]
    H = r.normal(size=(5, 3))
    xi = (r.normal(size=(6, 3)), r.normal(size=(5, 3)))
    point, xi = to(dtype, (G, H)), to(dtype, xi)
    for call in (
        lambda: mg.quotient.gl_metric(point, xi, xi),
        lambda: mg.quotient.horizontal_projection(point, xi),
        lambda: mg.quotient.christoffel_quadratic(point, xi),
    ):
        with pytest.raises(mg.GeometryError, match=r"numerically rank deficient at float(32|64).*eps > 0"):
            call()
    out = mg.quotient.horizontal_projection(point, xi, eps=1e-4)
    assert all(bool(jnp.isfinite(x).all()) for x in out)
    big = to(dtype, (side_with_cond(r, 769, 64, 1e4), side_with_cond(r, 769, 64, 3.0)))
    big_xi = to(dtype, (r.normal(size=(769, 64)), r.normal(size=(769, 64))))
    assert np.isfinite(float(mg.quotient.gl_metric(big, big_xi, big_xi)))
    # the cut-off scales with the dtype
    cut32 = mg.quotient._singular_value_cutoff(769, 64, jnp.float32)
    cut64 = mg.quotient._singular_value_cutoff(769, 64, jnp.float64)
    assert 1e-5 < cut32 < 1e-4 and cut64 < 1e-12


def test_jitted_frame_reports_rank_instead_of_raising():
    """Under jit the values are unknown at trace time: the frame carries ``ok`` and no error is raised."""
    from minigeo.quotient import _factor_pair

    G = jnp.ones((4, 2))
    H = jnp.asarray(rng(42).normal(size=(3, 2)))
    f = jax.jit(_factor_pair)(G, H)
    assert not bool(f.ok)
    assert bool(jax.jit(_factor_pair)(G + jnp.eye(4, 2), H).ok)
    # the public functions cannot raise under jit: NaN for the rank-deficient head, never a number
    Gb = jnp.stack([G, G + jnp.eye(4, 2)])
    Hb = jnp.stack([H, H])
    out = jax.jit(mg.quotient.horizontal_projection)((Gb, Hb), (Gb, Hb))
    assert np.isnan(np.asarray(out[0][0])).all() and np.isfinite(np.asarray(out[0][1])).all()
    assert np.isnan(float(jax.jit(mg.quotient.gl_metric)((Gb, Hb), (Gb, Hb), (Gb, Hb))))
    assert np.isnan(np.asarray(jax.jit(mg.quotient.christoffel_quadratic)((Gb, Hb), (Gb, Hb))[1][0])).all()


def test_quotient_products_run_at_highest_precision():
    """Every dot_general in the quotient functions runs at HIGHEST precision, whatever the global
    default (TF32 on NVIDIA GPUs cost three to four digits of the invariance)."""
    r = rng(43)
    point = random_pair(r, batch=(2,))
    xi = random_tangent(r, point)
    for fn in (
        lambda p, x: mg.quotient.horizontal_projection(p, x),
        lambda p, x: mg.quotient.geodesic_step(p, x),
        lambda p, x: mg.quotient.gl_metric(p, x, x),
        lambda p, x: mg.quotient.riemannian_gradient(p, x),
    ):
        with jax.default_matmul_precision("bfloat16"):
            text = str(jax.make_jaxpr(fn)(point, xi))
        n_dots = text.count("dot_general[")
        assert n_dots > 0 and text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == n_dots


# ---------------------------------------------------------------------------
# the relaxed metric (eps > 0): the projection against dense linear algebra
# ---------------------------------------------------------------------------
def dense_horizontal_projector(G, H, eps):
    """The metric-orthogonal projector onto the complement of the vertical space, by dense linear algebra.

    Metric (15) relaxed, ``Tr((G^T G + eps I)^{-1} a^T b) + ...``, as a matrix ``M`` on ``vec(xi_G, xi_H)``
    (row-major), the vertical space as the image ``V`` of ``Omega -> (-G Omega, H Omega^T)``, and the
    projector ``I - V (V^T M V)^{-1} V^T M``; independent of minigeo's Sylvester solve."""
    G, H = np.asarray(G, np.float64), np.asarray(H, np.float64)
    (n, h), m = G.shape, H.shape[0]
    P, Q = G.T @ G + eps * np.eye(h), H.T @ H + eps * np.eye(h)
    M = np.zeros(((n + m) * h,) * 2)
    M[: n * h, : n * h] = np.kron(np.eye(n), np.linalg.inv(P))
    M[n * h :, n * h :] = np.kron(np.eye(m), np.linalg.inv(Q))
    basis = np.eye(h * h).reshape(h * h, h, h)
    V = np.stack([np.concatenate([(-G @ E).ravel(), (H @ E.T).ravel()]) for E in basis], axis=1)
    return M, V, np.eye(M.shape[0]) - V @ np.linalg.solve(V.T @ M @ V, V.T @ M)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("eps", [0.0, 1e-2, 1.0])
def test_relaxed_horizontal_projection_against_dense(dtype, eps):
    """For eps > 0 the projection is the metric-orthogonal projection of the relaxed metric: equal to the
    dense projector, idempotent, orthogonal to every vertical vector (the relaxed Gram matrices substituted
    into the eps = 0 Sylvester equation gave none of these: 2e-3 to 0.25 off at eps = 1e-2 to 1)."""
    r = rng(50)
    tol = 100 * float(jnp.finfo(dtype).eps)
    for _ in range(3):
        point64 = random_pair(r, n=6, m=5, h=3)
        xi64 = random_tangent(r, point64)
        M, V, Pi = dense_horizontal_projector(*point64, eps)
        point, xi = to(dtype, point64), to(dtype, xi64)
        out = mg.quotient.horizontal_projection(point, xi, eps=eps)
        got = np.concatenate([np.asarray(x, np.float64).ravel() for x in out])
        want = Pi @ np.concatenate([np.asarray(x).ravel() for x in xi64])
        np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max())
        twice = mg.quotient.horizontal_projection(point, out, eps=eps)
        for a, b in zip(twice, out):
            np.testing.assert_allclose(a, b, atol=tol * float(jnp.abs(b).max()))
        scale = np.sqrt(got @ M @ got)
        np.testing.assert_allclose((V.T @ M @ got) / (np.linalg.norm(V, axis=0) * scale), 0.0, atol=tol)


def test_relaxed_projection_batched_traced_eps_and_riemannian_gradient():
    """Per head in a batch, with eps traced under jit (the general path, also right at eps = 0), and the
    Riemannian gradient of a function of G H^T is horizontal for the relaxed metric too."""
    r = rng(51)
    point = random_pair(r, batch=(2,))
    xi = random_tangent(r, point)
    proj = jax.jit(lambda p, x, e: mg.quotient.horizontal_projection(p, x, eps=e))
    for eps in (0.0, 0.3):
        out = proj(point, xi, eps)
        for k in range(2):
            _, _, Pi = dense_horizontal_projector(point[0][k], point[1][k], eps)
            want = Pi @ np.concatenate([np.asarray(x[k]).ravel() for x in xi])
            got = np.concatenate([np.asarray(x[k]).ravel() for x in out])
            np.testing.assert_allclose(got, want, atol=1e-12)
    G, H = random_pair(r)
    R = jnp.asarray(r.normal(size=(G.shape[0], H.shape[0])))
    egrad = jax.grad(lambda p: jnp.sum(jnp.sin(R * (p[0] @ p[1].T))))((G, H))
    rg = mg.quotient.riemannian_gradient((G, H), egrad, eps=0.3)
    for a, b in zip(mg.quotient.horizontal_projection((G, H), rg, eps=0.3), rg):
        np.testing.assert_allclose(a, b, atol=1e-12)

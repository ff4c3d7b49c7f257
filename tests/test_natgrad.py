"""Tests of minigeo.natgrad: paper 002's worked examples, Moore-Penrose conditions, Theorem 1 and 2."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import flatten, random_spd, rng

import minigeo as mg

# ---------------------------------------------------------------------------
# paper 002, App. A.2 and A.3 (exact numbers)
# ---------------------------------------------------------------------------


def test_appendix_a2_gram_and_parametrization_dependence():
    """Paper 002, App. A.2.

    As printed, f(theta) = -(theta - pi/4) and xi_2 = pi/2 do not map to the origin (phi(pi/2) = (0, 1)).
    The consistent choice, which reproduces the paper's psi(theta) = (-sin 2 theta, sin theta) and
    coordinate vector (-2, 1), is xi_2 = pi and f(theta) = pi - theta (on a domain containing pi).
    """
    phi = lambda xi: jnp.array([jnp.sin(2 * xi[0]), jnp.sin(xi[0])])
    np.testing.assert_allclose(
        phi(jnp.array([jnp.pi / 2])), [0.0, 1.0], atol=1e-15
    )  # the printed xi_2 misses 0
    f = lambda th: jnp.pi - th
    psi = lambda th: phi(f(th))
    np.testing.assert_allclose(
        psi(jnp.array([0.3])), [-np.sin(0.6), np.sin(0.3)], rtol=1e-12
    )  # eq. after (54)
    xi1, th1 = jnp.array([0.0]), jnp.array([0.0])
    np.testing.assert_allclose(phi(xi1), [0.0, 0.0], atol=1e-15)
    np.testing.assert_allclose(psi(th1), [0.0, 0.0], atol=1e-15)  # psi(theta_1) = phi(xi_2) = phi(xi_1)
    G_xi = mg.gram_matrix(phi, None, xi1)
    G_th = mg.gram_matrix(psi, None, th1)
    np.testing.assert_allclose(G_xi, [[5.0]], rtol=1e-14)  # eq. (51)
    np.testing.assert_allclose(G_th, [[5.0]], rtol=1e-14)
    # coordinate vectors (2, 1) and (-2, 1), eqs. (50) and (55)
    np.testing.assert_allclose(mg.pushforward(phi, xi1, jnp.ones(1)), [2.0, 1.0], rtol=1e-14)
    np.testing.assert_allclose(mg.pushforward(psi, th1, jnp.ones(1)), [-2.0, 1.0], rtol=1e-14)
    loss = lambda z: (z[0] - 0.5) ** 2 + (z[1] - 0.8) ** 2
    on_model = []
    for pmap, x, G in [(phi, xi1, G_xi), (psi, th1, G_th)]:
        y = mg.natural_parameter_gradient(G, jax.grad(lambda q: loss(pmap(q)))(x))
        on_model.append(mg.pushforward(pmap, x, y))
        # eq. (52)/(56): (1/5) dL/dxi * coordinate vector
        np.testing.assert_allclose(
            on_model[-1],
            jax.grad(lambda q: loss(pmap(q)))(x)[0] / 5 * mg.pushforward(pmap, x, jnp.ones(1)),
            rtol=1e-12,
        )
    assert np.linalg.norm(on_model[0] - on_model[1]) > 0.1  # parametrization dependent at the singular point


def test_appendix_a3_exact_values():
    phi = lambda xi: jnp.array([xi[0] + xi[1], 0.0])
    f = lambda th: jnp.array([2 * th[0], th[1]])
    psi = lambda th: phi(f(th))
    loss = lambda z: z[0] ** 2
    theta = jnp.array([1.0, 1.0])
    xi = f(theta)
    np.testing.assert_allclose(xi, [2.0, 1.0])
    G_xi = mg.gram_matrix(phi, None, xi)
    G_th = mg.gram_matrix(psi, None, theta)
    np.testing.assert_allclose(G_xi, [[1, 1], [1, 1]])
    np.testing.assert_allclose(G_th, [[4, 2], [2, 1]])
    grad_xi = jax.grad(lambda q: loss(phi(q)))(xi)
    grad_th = jax.grad(lambda q: loss(psi(q)))(theta)
    np.testing.assert_allclose(grad_xi, [6.0, 6.0])
    np.testing.assert_allclose(grad_th, [12.0, 6.0])
    y_xi = mg.natural_parameter_gradient(G_xi, grad_xi)
    y_theta = mg.pushforward(
        f, theta, mg.natural_parameter_gradient(G_th, grad_th)
    )  # df_theta of the theta-gradient
    np.testing.assert_allclose(y_xi, [3.0, 3.0], rtol=1e-12)
    np.testing.assert_allclose(y_theta, [4.8, 1.2], rtol=1e-12)
    np.testing.assert_allclose(mg.pushforward(phi, xi, y_theta - y_xi), [0.0, 0.0], atol=1e-12)


# ---------------------------------------------------------------------------
# Moore-Penrose conditions
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_moore_penrose_conditions(seed):
    r = rng(seed)
    d, rank = 7, 3
    B = r.normal(size=(d, rank))
    A = jnp.asarray(B @ B.T)  # singular PSD, like an overparametrized Gram matrix
    P = np.asarray(mg.moore_penrose_inverse(A))
    A = np.asarray(A)
    np.testing.assert_allclose(A @ P @ A, A, atol=1e-10)
    np.testing.assert_allclose(P @ A @ P, P, atol=1e-10)
    np.testing.assert_allclose(A @ P, (A @ P).T, atol=1e-10)
    np.testing.assert_allclose(P @ A, (P @ A).T, atol=1e-10)
    # and it is numpy's pseudo-inverse
    np.testing.assert_allclose(P, np.linalg.pinv(A, hermitian=True), atol=1e-10)
    # invertible case: the ordinary inverse
    S = np.asarray(random_spd(r, 4))
    np.testing.assert_allclose(mg.moore_penrose_inverse(jnp.asarray(S)), np.linalg.inv(S), rtol=1e-9)


# ---------------------------------------------------------------------------
# Theorem 1 and Theorem 2
# ---------------------------------------------------------------------------


def random_parametrization(r, d, m, rank=None):
    """phi(xi) = C tanh(B xi + c), with B of the given rank (rank < min(d, m): non-proper points)."""
    k = rank if rank is not None else min(d, m)
    B = jnp.asarray(r.normal(size=(m, k)) @ r.normal(size=(k, d)) / np.sqrt(d))
    C = jnp.asarray(r.normal(size=(m, m)) / np.sqrt(m))
    c = jnp.asarray(r.normal(size=m))
    return lambda xi: C @ jnp.tanh(B @ xi + c)


@pytest.mark.parametrize("d,m,rank", [(6, 3, None), (2, 4, None), (5, 4, 2), (3, 3, 1)])
def test_theorem1_pushforward_is_metric_projection(d, m, rank):
    r = rng(d * 10 + m)
    phi = random_parametrization(r, d, m, rank)
    g = np.asarray(random_spd(r, m, cond=20.0))
    target = jnp.asarray(r.normal(size=m))
    loss = lambda z: jnp.sum(jnp.sin(z - target)) + 0.5 * jnp.sum(z**2)
    xi = jnp.asarray(r.normal(size=d))
    z = phi(xi)
    G = mg.gram_matrix(phi, jnp.asarray(g), xi)
    y = mg.natural_parameter_gradient(G, jax.grad(lambda q: loss(phi(q)))(xi))
    lhs = mg.pushforward(phi, xi, y)
    ambient = np.linalg.solve(g, np.asarray(jax.grad(loss)(z)))  # grad^Z L = g^{-1} dL
    J = np.asarray(jax.jacfwd(phi)(xi))
    rhs = mg.span_projection(jnp.asarray(J), jnp.asarray(g), jnp.asarray(ambient))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-7, atol=1e-9)
    # independent check of the projection: residual g-orthogonal to every coordinate vector
    np.testing.assert_allclose(J.T @ g @ (ambient - np.asarray(rhs)), 0.0, atol=1e-9)
    if np.linalg.matrix_rank(J) == m:  # proper and open in Z: the natural gradient is the ambient one
        np.testing.assert_allclose(lhs, ambient, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_theorem2_pushforward_invariant_under_random_diffeomorphisms(seed):
    """psi = phi o f: d psi_theta G_theta^+ grad_theta = d phi_xi G_xi^+ grad_xi, although the parameter vectors differ."""
    r = rng(100 + seed)
    d, m = 5, 3  # overparametrized: Gram matrices are singular
    phi = random_parametrization(r, d, m)
    A = jnp.asarray(r.normal(size=(d, d)) / np.sqrt(d) + 2 * np.eye(d))
    f = lambda th: A @ th + 0.3 * jnp.sinh(th)  # a random nonlinear diffeomorphism near theta
    psi = lambda th: phi(f(th))
    loss = lambda z: jnp.sum((z - 1.0) ** 2) + jnp.sum(z**3) / 3
    theta = jnp.asarray(0.3 * r.normal(size=d))
    xi = f(theta)
    y_xi = mg.natural_parameter_gradient(mg.gram_matrix(phi, None, xi), jax.grad(lambda q: loss(phi(q)))(xi))
    y_th = mg.natural_parameter_gradient(
        mg.gram_matrix(psi, None, theta), jax.grad(lambda q: loss(psi(q)))(theta)
    )
    np.testing.assert_allclose(
        mg.pushforward(psi, theta, y_th), mg.pushforward(phi, xi, y_xi), rtol=1e-8, atol=1e-10
    )
    # ... but not on parameter space (Def. 6): df y_theta != y_xi
    assert np.linalg.norm(mg.pushforward(f, theta, y_th) - y_xi) > 1e-3


# ---------------------------------------------------------------------------
# matrix-free natural gradient and optax
# ---------------------------------------------------------------------------


def regression_problem(seed=0, n=8, hidden=6):
    r = rng(seed)
    X = jnp.asarray(r.normal(size=(n, 2)))
    y = jnp.asarray(r.normal(size=(n, 1)))
    params = {
        "W1": jnp.asarray(r.normal(size=(2, hidden))),
        "b1": jnp.zeros(hidden),
        "W2": jnp.asarray(r.normal(size=(hidden, 1)) / hidden),
    }
    model = lambda p: jnp.tanh(X @ p["W1"] + p["b1"]) @ p["W2"]
    loss = lambda z: 0.5 * jnp.mean((z - y) ** 2)
    return params, model, loss


def test_matrix_free_natural_gradient_matches_dense_solves():
    params, model, loss = regression_problem()
    G = mg.ggn(model, loss)
    grad = jax.grad(lambda p: loss(model(p)))(params)
    lam = 1e-2
    dense = np.linalg.solve(np.asarray(G.dense(params)) + lam * np.eye(flatten(params).size), flatten(grad))
    for solver in ["cg", "dense", "pinv"]:
        out = mg.natural_gradient(G, params, grad, damping=lam, solver=solver, tol=1e-12)
        assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
        np.testing.assert_allclose(flatten(out), dense, rtol=1e-6)
    # undamped pinv = Moore-Penrose natural parameter gradient; its pushforward is the projection
    y = mg.natural_gradient(G, params, grad, solver="pinv")
    np.testing.assert_allclose(
        flatten(y),
        np.linalg.pinv(np.asarray(G.dense(params)), hermitian=True) @ flatten(grad),
        rtol=1e-6,
        atol=1e-10,
    )
    # damping -> 0 converges to the pseudo-inverse direction in function space
    small = mg.natural_gradient(G, params, grad, damping=1e-9, solver="dense")
    np.testing.assert_allclose(
        mg.pushforward(model, params, small), mg.pushforward(model, params, y), rtol=1e-4, atol=1e-8
    )
    # jit
    jitted = jax.jit(lambda p, g: mg.natural_gradient(G, p, g, damping=lam, tol=1e-12))(params, grad)
    np.testing.assert_allclose(flatten(jitted), dense, rtol=1e-6)


def test_precondition_by_metric_is_natural_gradient_descent():
    params, model, loss = regression_problem(1)
    G = mg.ggn(model, loss)
    opt = optax.chain(mg.precondition_by_metric(G, damping=1e-3, solver="dense"), optax.sgd(0.5))
    state = opt.init(params)
    grad = jax.grad(lambda p: loss(model(p)))(params)
    updates, state = opt.update(grad, state, params)
    expected = jax.tree_util.tree_map(
        lambda x: -0.5 * x, mg.natural_gradient(G, params, grad, damping=1e-3, solver="dense")
    )
    np.testing.assert_allclose(flatten(updates), flatten(expected), rtol=1e-10)
    # (G + lambda I)^{-1} g is a descent direction: small natural-gradient steps decrease the loss monotonically.
    p, st, losses = params, opt.init(params), [float(loss(model(params)))]
    step = optax.chain(mg.precondition_by_metric(G, damping=1e-3, solver="dense"), optax.sgd(0.1))
    st = step.init(p)
    for _ in range(5):
        u, st = step.update(jax.grad(lambda q: loss(model(q)))(p), st, p)
        p = optax.apply_updates(p, u)
        losses.append(float(loss(model(p))))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---------------------------------------------------------------------------
# error paths
# ---------------------------------------------------------------------------


def test_natgrad_errors():
    params, model, loss = regression_problem(2)
    G = mg.ggn(model, loss)
    grad = jax.grad(lambda p: loss(model(p)))(params)
    # A singular metric without damping: CG cannot solve G x = b for b outside the range of G ...
    outside = jax.tree_util.tree_map(lambda x: jnp.ones_like(x), params)
    with pytest.raises(mg.GeometryError, match=r"singular: use damping > 0"):
        mg.natural_gradient(G, params, outside)
    # ... while a gradient always lies in range(G) = range(J^T): CG started at 0 then converges to the
    # minimum-norm solution, the Moore-Penrose natural parameter gradient.
    np.testing.assert_allclose(
        mg.pushforward(model, params, mg.natural_gradient(G, params, grad, tol=1e-10)),
        mg.pushforward(model, params, mg.natural_gradient(G, params, grad, solver="pinv")),
        rtol=1e-5,
        atol=1e-9,
    )
    with pytest.raises(mg.GeometryError, match=r"did not converge"):
        mg.natural_gradient(G, params, grad, damping=1e-6, maxiter=2)  # non-convergence
    with pytest.raises(mg.GeometryError, match=r"not positive definite.*damping"):
        mg.natural_gradient(G, params, grad, solver="dense")
    with pytest.raises(mg.GeometryError, match=r"pytree structure"):
        mg.natural_gradient(G, params, {"W1": grad["W1"]}, damping=1.0)
    with pytest.raises(mg.GeometryError, match=r"solver must be"):
        mg.natural_gradient(G, params, grad, solver="qr")
    with pytest.raises(mg.GeometryError, match=r"needs a minigeo Metric"):
        mg.natural_gradient(jnp.eye(3), params, grad)
    with pytest.raises(mg.GeometryError, match=r"3x3 matrix is needed"):
        mg.natural_parameter_gradient(jnp.eye(2), jnp.ones(3))
    with pytest.raises(mg.GeometryError, match=r"non-finite"):
        mg.natural_parameter_gradient(jnp.eye(2), jnp.array([1.0, jnp.nan]))
    with pytest.raises(mg.GeometryError, match=r"square"):
        mg.moore_penrose_inverse(jnp.ones((2, 3)))
    with pytest.raises(mg.GeometryError, match=r"\(m, d\) matrix"):
        mg.span_projection(jnp.ones((3, 2)), None, jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"not positive definite"):
        mg.gram_matrix(lambda xi: xi, mg.metrics.dense(lambda z: -jnp.eye(2)), jnp.ones(2))
    with pytest.raises(mg.GeometryError, match=r"needs params"):
        mg.precondition_by_metric(G).update(grad, ())
    with pytest.raises(mg.GeometryError, match=r"max_size=3"):
        mg.gram_matrix(lambda xi: xi, None, jnp.ones(5), max_size=3)


def test_natural_gradient_validates_inputs():
    G = mg.ggn(lambda w: jnp.array([[1.0, 0.0], [1.0, 1.0]]) @ w, lambda z: 0.5 * jnp.sum(z**2))
    with pytest.raises(mg.GeometryError, match=r"params contains 1 non-finite"):  # was a silent number
        mg.natural_gradient(G, jnp.array([jnp.nan, 1.0]), jnp.ones(2), damping=1.0)
    with pytest.raises(mg.GeometryError, match=r"empty"):
        mg.natural_gradient(G, jnp.zeros(0), jnp.zeros(0))
    with pytest.raises(mg.GeometryError, match=r"floating point"):
        mg.natural_gradient(G, jnp.array([1, 2]), jnp.array([1, 0]))
    np.testing.assert_allclose(  # lists are converted
        mg.natural_gradient(G, [1.0, 2.0], [1.0, 0.0], tol=1e-12),
        mg.natural_gradient(G, jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]), tol=1e-12),
        rtol=1e-12,
    )


def test_precondition_by_metric_under_jit_traced_damping():
    G = mg.metrics.diagonal(jnp.array([2.0, 4.0]))
    step = jax.jit(
        lambda lam, g: mg.precondition_by_metric(G, damping=lam).update(g, (), jnp.zeros(2))[0]
    )
    np.testing.assert_allclose(step(jnp.asarray(2.0), jnp.array([4.0, 6.0])), [1.0, 1.0], rtol=1e-10)

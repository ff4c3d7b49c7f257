"""Solvers that never report a wrong answer as right (issue 31, items 2 and 3).

* Conjugate gradients is scaled to its right-hand side: the solution scales linearly with ``b``
  down to the smallest normal float (exactly for powers of two), in float32 and float64.
* ``converged`` (status 0) implies the true relative residual ``|b - Ax| / |b| <= tol``, checked
  against a float64 evaluation on random SPD operators of several condition numbers, under ``jit``.
* ``tol`` in (0, 1) and ``maxiter`` a positive int are validated at every public entry point.
* Dense (Cholesky) and pseudo-inverse solves check symmetry, also under ``jit`` (status 5 / NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_spd, rng

import minigeo as mg
from minigeo._linalg import solve_spd_cg

DTYPES = [jnp.float64, jnp.float32]


def eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def tiny(dtype) -> float:
    return float(jnp.finfo(dtype).tiny)


def spd_problem(seed: int, d: int, cond: float):
    """A random SPD matrix with eigenvalues geomspace(1, cond) and a random rhs (float64)."""
    A = np.asarray(random_spd(rng(seed), d, cond=cond))
    b = rng(seed + 1000).normal(size=d)
    return A, b


def rel_residual(A64: np.ndarray, b, x) -> float:
    """|b - A x| / |b| in float64 (after scaling both by max |b|, so that tiny b do not underflow)."""
    b64 = np.asarray(b, np.float64)
    s = np.max(np.abs(b64))
    return float(np.linalg.norm(b64 / s - A64 @ (np.asarray(x, np.float64) / s)) / np.linalg.norm(b64 / s))


# ---------------------------------------------------------------------------
# 1. CG scaled to its right-hand side
# ---------------------------------------------------------------------------
def _scales(dtype):
    # as small as the normal range permits: |x| ~ |b| / 100 stays normal
    return [1e-30, 1e-100, 1e-250, 1e-300] if dtype == jnp.float64 else [1e-14, 1e-19, 1e-21, 1e-30, 1e-34]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cg_solution_scales_linearly_with_rhs_under_jit(dtype):
    """Before the fix, float32: b * 1e-14 stopped as 'not positive definite' (the curvature p^T A p
    underflowed), b * 1e-19 'converged' to a wrong x, b * 1e-21 returned 0 with status 0."""
    A64, b64 = spd_problem(0, 20, cond=100.0)
    A, b = jnp.asarray(A64, dtype), jnp.asarray(b64, dtype)
    truth = np.linalg.solve(A64, np.asarray(b, np.float64))
    solve = jax.jit(lambda rhs: solve_spd_cg(lambda v: A @ v, rhs, tol=1e-5, return_info=True))
    x1, info1 = solve(b)
    assert int(info1.status) == mg.Status.OK
    for s in _scales(dtype):
        assert s * np.abs(b64).max() / 100 > tiny(dtype)  # the answer itself is a normal number
        xs, info = solve(b * jnp.asarray(s, dtype))
        assert int(info.status) == mg.Status.OK and bool(info.converged), (s, info)
        assert float(info.residual) <= 1e-5
        err = np.linalg.norm(np.asarray(xs, np.float64) / s - truth) / np.linalg.norm(truth)
        assert err <= 1e-5 * 100 * 10, (s, err)  # tol * cond (* margin), as for b itself
    # a power of two scales exactly: bitwise the same solution
    k = -60 if dtype == jnp.float32 else -1000
    xp, info = solve(jnp.ldexp(b, k))
    assert int(info.status) == mg.Status.OK
    np.testing.assert_array_equal(np.asarray(jnp.ldexp(xp, -k)), np.asarray(x1))
    # and a huge one
    big = 1e30 if dtype == jnp.float32 else 1e300
    xb, info = solve(b * jnp.asarray(big, dtype))
    assert int(info.status) == mg.Status.OK
    np.testing.assert_allclose(np.asarray(xb, np.float64) / big, truth, rtol=0, atol=1e-2 * np.abs(truth).max())


def test_natural_gradient_of_a_tiny_float32_gradient():
    """The issue's report: natural_gradient of a float32 gradient of norm ~1e-19 'converged' with
    relative error 0.61, at 1e-21 returned 0, at 1e-14 raised 'not positive definite'."""
    r = rng(1)
    X = jnp.asarray(r.normal(size=(40, 20)), jnp.float32)
    G = mg.ggn(lambda w: X @ w, lambda z: 0.5 * jnp.sum(z**2))
    p = jnp.zeros(20, jnp.float32)
    g = r.normal(size=20)
    X64 = np.asarray(X, np.float64)
    truth = np.linalg.solve(X64.T @ X64, g)
    cond = np.linalg.cond(X64.T @ X64)
    jitted = jax.jit(lambda q: mg.natural_gradient(G, p, q, return_info=True))
    for s in [1.0, 1e-14, 1e-19, 1e-21, 1e-30]:
        gs = jnp.asarray(g * s, jnp.float32)
        x = mg.natural_gradient(G, p, gs)  # eagerly: raises unless status 0
        err = np.linalg.norm(np.asarray(x, np.float64) / s - truth) / np.linalg.norm(truth)
        assert err <= 10 * 1e-6 * cond + 100 * eps(jnp.float32) * cond, (s, err)
        xj, info = jitted(gs)
        assert int(info.status) == mg.Status.OK
        np.testing.assert_allclose(np.asarray(xj, np.float64) / s, np.asarray(x, np.float64) / s, rtol=1e-5)


def test_cg_scale_free_in_the_operator():
    """A tiny operator (1e-20 A) in float32: p^T A p / p^T p is taken with unit directions, no underflow."""
    A64, b64 = spd_problem(2, 15, cond=10.0)
    A = jnp.asarray(A64 * 1e-20, jnp.float32)
    b = jnp.asarray(b64, jnp.float32)
    x, info = jax.jit(lambda rhs: solve_spd_cg(lambda v: A @ v, rhs, tol=1e-5, return_info=True))(b)
    assert int(info.status) == mg.Status.OK
    np.testing.assert_allclose(np.asarray(x, np.float64) * 1e-20, np.linalg.solve(A64, b64), rtol=1e-3)


def test_zero_rhs_is_zero_with_status_ok():
    A = jnp.asarray(random_spd(rng(3), 5), jnp.float32)
    zero = jnp.zeros(5, jnp.float32)
    cg = lambda b: solve_spd_cg(lambda v: A @ v, b, return_info=True)
    dense = lambda b: mg.sharp(A, b, return_info=True)
    for run in (jax.jit(cg), dense, jax.jit(dense)):
        x, info = run(zero)
        assert int(info.status) == mg.Status.OK and bool(info.converged)
        assert np.array_equal(np.asarray(x), np.zeros(5)) and float(info.residual) == 0.0


# ---------------------------------------------------------------------------
# 2. converged implies the stated true relative residual
# ---------------------------------------------------------------------------
_CASES = {
    jnp.float64: [(c, t) for c in (1e1, 1e3, 1e5) for t in (1e-4, 1e-8, 1e-12)],
    jnp.float32: [(c, t) for c in (1e1, 1e2, 1e3) for t in (1e-3, 1e-4, 1e-5, 1e-6)],
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_converged_implies_true_residual_within_tol(dtype):
    """Before the fix a solve was 'converged' at a true residual up to 10 tol (or 100 eps |Ax|/|b|):
    float32, cond 1e3, tol 1e-5 gave status 0 at true residuals of 1.1-1.6 tol."""
    d = 60
    solve = jax.jit(lambda A, b, tol: solve_spd_cg(lambda v: A @ v, b, tol=tol, maxiter=20 * d, return_info=True))
    seen_ok = seen_inaccurate = 0
    for i, (cond, tol) in enumerate(_CASES[dtype]):
        for seed in range(3):
            A64, b64 = spd_problem(10 * i + seed, d, cond)
            A, b = jnp.asarray(A64, dtype), jnp.asarray(b64, dtype)
            A64 = np.asarray(A, np.float64)  # the operator as the solver sees it
            x, info = solve(A, b, jnp.asarray(tol, dtype))
            true = rel_residual(A64, b, x)
            status = int(info.status)
            assert status in (mg.Status.OK, mg.Status.INACCURATE, mg.Status.MAX_ITERATIONS)
            assert bool(info.converged) == (status == mg.Status.OK)
            if status == mg.Status.OK:
                seen_ok += 1
                assert float(info.residual) <= max(tol, eps(dtype))  # the stated residual
                # the true residual, in float64, of the returned x: within tol up to the round-off of
                # evaluating it in the working precision (about eps |A| |x| / |b|; tiny in float64)
                x64, bn = np.asarray(x, np.float64), np.linalg.norm(np.asarray(b, np.float64))
                slack = eps(dtype) * np.linalg.norm(A64, 2) * np.linalg.norm(x64) / bn
                assert true <= tol + slack, (cond, tol, true, slack)
                if slack <= 0.05 * tol:
                    assert true <= 1.05 * tol, (cond, tol, true)
            else:
                seen_inaccurate += 1
                assert true > 0.5 * tol  # not a false alarm
    assert seen_ok >= len(_CASES[dtype])  # most cases converge
    if dtype == jnp.float32:
        assert seen_inaccurate > 0  # tol = 1e-6 at cond 1e3 is below float32's attainable accuracy


def test_inaccurate_status_raises_eagerly():
    A64, b64 = spd_problem(5, 60, 1e3)
    A, b = jnp.asarray(A64, jnp.float32), jnp.asarray(b64, jnp.float32)
    x, info = jax.jit(lambda rhs: solve_spd_cg(lambda v: A @ v, rhs, tol=1e-7, return_info=True))(b)
    assert int(info.status) == mg.Status.INACCURATE and not bool(info.converged)
    with pytest.raises(mg.GeometryError, match="round-off"):
        solve_spd_cg(lambda v: A @ v, b, tol=1e-7)


# ---------------------------------------------------------------------------
# 3. tol and maxiter validated everywhere
# ---------------------------------------------------------------------------
_BAD = [
    (dict(tol=2.0), "tol"),
    (dict(tol=1.0), "tol"),
    (dict(tol=-1), "tol"),
    (dict(tol=0.0), "tol"),
    (dict(tol=float("nan")), "tol"),
    (dict(tol="1e-6"), "tol"),
    (dict(tol=True), "tol"),
    (dict(maxiter=2.7), "maxiter"),
    (dict(maxiter=0), "maxiter"),
    (dict(maxiter=-3), "maxiter"),
    (dict(maxiter=True), "maxiter"),
]


def _entries():
    G = mg.metrics.diagonal(jnp.array([1.0, 2.0, 3.0]))
    p = jnp.ones(3)
    g = jnp.array([1.0, 2.0, 3.0])
    f = lambda x: 0.5 * jnp.sum(jnp.arange(1.0, 4.0) * x**2)
    key = jax.random.PRNGKey(0)
    op = mg.operators.hessian_operator(lambda w, x: 0.5 * jnp.mean(jnp.sum(x * w, axis=1) ** 2), p)
    data = [jnp.eye(3)]
    return {
        "natural_gradient": lambda **kw: mg.natural_gradient(G, p, g, **kw),
        "natural_gradient dense": lambda **kw: mg.natural_gradient(G, p, g, solver="dense", **kw),
        "Metric.solve": lambda **kw: G.solve(p, g, **kw),
        "Metric.solve dense": lambda **kw: G.solve(p, g, method="dense", **kw),
        "sharp operator": lambda **kw: mg.sharp(lambda v: 2.0 * v, g, **kw),
        "sharp matrix": lambda **kw: mg.sharp(jnp.eye(3), g, **kw),
        "sharp Metric": lambda **kw: mg.sharp(G, g, at=p, **kw),
        "precondition_by_metric": lambda **kw: mg.precondition_by_metric(G, **kw),
        "trace_estimate": lambda **kw: mg.trace_estimate(f, p, key, metric=G, num_probes=2, **kw),
        "trace_estimate no metric": lambda **kw: mg.trace_estimate(f, p, key, num_probes=2, **kw),
        "top_eigenvalues": lambda **kw: mg.top_eigenvalues(f, p, key, metric=G, num_iterations=3, **kw),
        "operator trace_estimate": lambda **kw: op.trace_estimate(key, data, metric=G, num_probes=2, **kw),
        "operator top_eigenvalues": lambda **kw: op.top_eigenvalues(key, data, metric=G, num_iterations=3, **kw),
        "solve_spd_cg": lambda **kw: solve_spd_cg(lambda v: 2.0 * v, g, **kw),
    }


@pytest.mark.parametrize("bad, name", _BAD)
def test_tol_and_maxiter_are_validated_everywhere(bad, name):
    """Before the fix tol=2.0, tol=-1 and maxiter=2.7 were accepted (maxiter silently truncated)."""
    for entry, call in _entries().items():
        with pytest.raises(mg.GeometryError, match=name) as err:
            call(**bad)
        assert "(0, 1)" in str(err.value) or "positive int" in str(err.value), entry


@pytest.mark.slow
def test_valid_tol_and_maxiter_still_work():
    for entry, call in _entries().items():
        call(tol=np.float32(1e-5), maxiter=np.int64(50))


# ---------------------------------------------------------------------------
# 4. dense solves: symmetry and definiteness also under jit
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_sharp_refuses_a_non_symmetric_matrix_under_jit(dtype):
    """Before the fix: under jit, [0.5, 0.5] with converged=True (Cholesky reads one triangle)."""
    A = jnp.array([[2.0, 0.0], [3.0, 2.0]], dtype)  # lower triangle of an SPD matrix; A^T != A
    b = jnp.array([1.0, 1.0], dtype)
    x, info = jax.jit(lambda A, b: mg.sharp(A, b, return_info=True))(A, b)
    assert int(info.status) == mg.Status.NOT_SYMMETRIC and not bool(info.converged)
    assert np.all(np.isnan(np.asarray(x)))
    x = jax.jit(lambda A, b: mg.sharp(A, b))(A, b)  # without info: NaN, never a finite wrong answer
    assert np.all(np.isnan(np.asarray(x)))
    with pytest.raises(mg.GeometryError, match="not symmetric"):
        mg.sharp(A, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_solves_report_indefinite_and_singular_under_jit(dtype):
    b = jnp.array([1.0, 1.0], dtype)
    for A in (jnp.diag(jnp.array([3.0, -1.0], dtype)), jnp.array([[1.0, 1.0], [1.0, 1.0]], dtype)):
        x, info = jax.jit(lambda A, b: mg.sharp(A, b, return_info=True))(A, b)
        assert int(info.status) == mg.Status.NOT_POSITIVE_DEFINITE and not bool(info.converged)
        assert np.all(np.isnan(np.asarray(x)))
        with pytest.raises(mg.GeometryError, match="not positive definite"):
            mg.sharp(A, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_solve_info_reports_the_true_residual(dtype):
    A64 = np.asarray(random_spd(rng(7), 8, cond=50.0))
    A = jnp.asarray(A64, dtype)
    b = jnp.asarray(rng(8).normal(size=8), dtype)
    for run in (lambda A, b: mg.sharp(A, b, return_info=True), jax.jit(lambda A, b: mg.sharp(A, b, return_info=True))):
        x, info = run(A, b)
        assert int(info.status) == mg.Status.OK and bool(info.converged)
        true = rel_residual(np.asarray(A, np.float64), b, x)
        assert float(info.residual) <= 100 * eps(dtype) * 50 and true <= 100 * eps(dtype) * 50
        np.testing.assert_allclose(np.asarray(x, np.float64), np.linalg.solve(np.asarray(A, np.float64), np.asarray(b, np.float64)), rtol=100 * eps(dtype) * 50)
        # smallest Cholesky pivot: at least the smallest eigenvalue
        assert float(info.curvature) >= np.linalg.eigvalsh(np.asarray(A, np.float64))[0] * (1 - 1e-3)


def test_metric_and_natural_gradient_dense_paths_report_symmetry_under_jit():
    Ans = jnp.array([[2.0, 0.0], [3.0, 2.0]])
    p, g = jnp.zeros(2), jnp.ones(2)
    metric = lambda A: mg.metrics.dense(lambda q: A)
    for solve in (
        lambda A, g: metric(A).solve(p, g, method="dense", return_info=True),
        lambda A, g: mg.natural_gradient(metric(A), p, g, solver="dense", return_info=True),
        lambda A, g: mg.natural_gradient(metric(A), p, g, solver="pinv", return_info=True),
    ):
        x, info = jax.jit(solve)(Ans, g)
        assert int(info.status) == mg.Status.NOT_SYMMETRIC and not bool(info.converged)
        assert np.all(np.isnan(np.asarray(x)))
        with pytest.raises(mg.GeometryError, match="not symmetric"):
            solve(Ans, g)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pseudo_inverse_entry_points_check_symmetry(dtype):
    """Before the fix moore_penrose_inverse used the lower triangle of a non-symmetric matrix."""
    A = jnp.array([[1.0, 2.0], [0.0, 1.0]], dtype)
    g = jnp.array([1.0, 1.0], dtype)
    with pytest.raises(mg.GeometryError, match="Gram matrix is not symmetric"):
        mg.moore_penrose_inverse(A)
    with pytest.raises(mg.GeometryError, match="Gram matrix is not symmetric"):
        mg.natural_parameter_gradient(A, g)
    assert np.all(np.isnan(np.asarray(jax.jit(mg.moore_penrose_inverse)(A))))
    assert np.all(np.isnan(np.asarray(jax.jit(mg.natural_parameter_gradient)(A, g))))
    # symmetric to round-off (a Gram matrix J^T J computed in dtype) is accepted, also under jit
    J = jnp.asarray(rng(9).normal(size=(5, 3)), dtype)
    gram = J.T @ J
    gram = gram.at[0, 1].add(2 * eps(dtype) * float(jnp.abs(gram).max()))
    P = np.asarray(jax.jit(mg.moore_penrose_inverse)(gram), np.float64)
    np.testing.assert_allclose(P, np.linalg.pinv(np.asarray(gram, np.float64)), rtol=1e3 * eps(dtype), atol=1e3 * eps(dtype) * np.abs(P).max())
    mg.natural_parameter_gradient(gram, g[:1].repeat(3))

"""A dense metric is solved by one Cholesky factor everywhere, eagerly and under ``jit``.

The truth is SciPy's generalized symmetric eigensolver ``eigh(H, G)`` and ``np.linalg.solve``. A
metric that is not positive definite raises eagerly and gives NaN under ``jit``, never a finite
wrong number. Before, ``top_eigenvalues(..., metric=dense)`` under ``jit`` raised JAX's
TracerBoolConversionError, and the other estimators solved a dense metric by conjugate gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg as sl
from helpers import rng

import minigeo as mg
from minigeo import GeometryError
from minigeo._inverse import _metric_inverse
from minigeo._metric import metric_field

DTYPES = [jnp.float64, jnp.float32]
D = 12


def problem(dtype, condition):
    r = rng(7)
    A = r.normal(size=(D, D))
    H = A @ A.T
    U, _ = np.linalg.qr(r.normal(size=(D, D)))
    G = U @ np.diag(np.geomspace(1.0, 1.0 / condition, D)) @ U.T
    G = (G + G.T) / 2
    Hj, Gj = jnp.asarray(H, dtype), jnp.asarray(G, dtype)
    return (lambda p: 0.5 * p @ Hj @ p), mg.metrics.dense(lambda p: Gj), H, G


def tolerance(dtype, condition):
    return 100 * float(jnp.finfo(dtype).eps) * condition


@pytest.mark.parametrize("dtype", DTYPES)
def test_metric_inverse_of_a_dense_metric_is_the_exact_solve_under_jit(dtype):
    condition = 1e6 if dtype == jnp.float64 else 1e2
    _, metric, _, G = problem(dtype, condition)
    v = jnp.asarray(rng(1).normal(size=D), dtype)
    p0 = jnp.zeros(D, dtype)
    solve = jax.jit(lambda p, v: _metric_inverse(metric_field(metric, "test"), p, 1e-10, None)(v))
    x = np.asarray(solve(p0, v), np.float64)
    want = np.linalg.solve(G, np.asarray(v, np.float64))
    assert x.dtype == np.float64 and solve(p0, v).dtype == dtype
    np.testing.assert_allclose(x, want, rtol=tolerance(dtype, condition), atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_eigenvalues_with_a_dense_metric_under_jit_are_the_generalized_eigenvalues(dtype):
    condition = 1e7 if dtype == jnp.float64 else 1e2
    f, metric, H, G = problem(dtype, condition)
    exact = np.sort(sl.eigh(H, G, eigvals_only=True))[::-1][:2]
    key, p0 = jax.random.PRNGKey(0), jnp.zeros(D, dtype)
    eager = np.asarray(mg.top_eigenvalues(f, p0, key, k=2, metric=metric), np.float64)
    jitted = np.asarray(jax.jit(lambda p: mg.top_eigenvalues(f, p, key, k=2, metric=metric))(p0), np.float64)
    rtol = max(1e-2 if dtype == jnp.float32 else 1e-8, tolerance(dtype, condition))
    np.testing.assert_allclose(eager, exact, rtol=rtol)
    np.testing.assert_allclose(jitted, exact, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_dense_metric_that_is_not_positive_definite_raises_eagerly_and_is_nan_under_jit(dtype):
    f, _, _, G = problem(dtype, 10.0)
    indefinite = jnp.asarray(G - 2 * np.eye(D) * np.max(np.linalg.eigvalsh(G)), dtype)
    metric = mg.metrics.dense(lambda p: indefinite)
    key, p0 = jax.random.PRNGKey(0), jnp.zeros(D, dtype)
    with pytest.raises(GeometryError, match="not positive definite"):
        mg.top_eigenvalues(f, p0, key, k=2, metric=metric)
    with pytest.raises(GeometryError, match="not positive definite"):
        mg.trace_estimate(f, p0, key, num_probes=8, metric=metric)
    top = jax.jit(lambda p: mg.top_eigenvalues(f, p, key, k=2, metric=metric))(p0)
    trace = jax.jit(lambda p: mg.trace_estimate(f, p, key, num_probes=8, metric=metric))(p0)
    assert np.all(np.isnan(np.asarray(top)))
    assert np.all(np.isnan(np.asarray(jax.tree_util.tree_leaves(trace)[0])))


def test_trace_with_a_dense_metric_under_jit_is_unbiased_within_its_standard_error():
    f, metric, H, G = problem(jnp.float64, 1e5)
    exact = float(np.trace(np.linalg.solve(G, H)))
    key, p0 = jax.random.PRNGKey(3), jnp.zeros(D)
    estimate, se = jax.jit(lambda p: mg.trace_estimate(f, p, key, num_probes=400, metric=metric))(p0)
    assert abs(float(estimate) - exact) < 4 * float(se)

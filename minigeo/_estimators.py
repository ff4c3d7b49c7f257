"""Helpers of the randomized estimators (floor 1): Rademacher probes, mean and standard error, SLQ quadrature."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, check_finite, check_key, is_concrete
from ._tree import PyTree

__all__ = ["rademacher_like", "mean_and_standard_error", "small_sample_factor", "slq_breakdown_tol", "slq_quadrature", "check_slq_positive"]


def rademacher_like(key: jax.Array, params: PyTree, num: int) -> PyTree:
    """``num`` Rademacher probes shaped like ``params`` (stacked on a leading axis).

    Each 32-bit random word supplies 32 signs, so the random-number generation
    costs 1/32 of drawing one number per coordinate (it dominates the cost of
    probing cheap models otherwise).  ``key`` must be a PRNG key (else :class:`GeometryError`).
    """
    check_key(key)
    return _rademacher_like(key, params, num)


# one compiled program per structure and count (op by op, eagerly, a first call compiled some 30
# small programs)
@functools.partial(jax.jit, static_argnums=2)
def _rademacher_like(key: jax.Array, params: PyTree, num: int) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(key, len(leaves))
    shifts = jnp.arange(32, dtype=jnp.uint32)
    probes = []
    for k, x in zip(keys, leaves):
        size = int(jnp.size(x))
        words = jax.random.bits(k, (num, -(-size // 32)), dtype=jnp.uint32)
        bits = (words[..., None] >> shifts) & jnp.uint32(1)
        signs = (2 * bits.reshape(num, -1)[:, :size].astype(jnp.result_type(x)) - 1).reshape(
            (num,) + jnp.shape(x)
        )
        probes.append(signs)
    return jax.tree_util.tree_unflatten(treedef, probes)


def mean_and_standard_error(values: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """The mean of per-probe ``values`` over ``axis`` and its standard error ``std(ddof=1) / sqrt(n)``.

    ``n`` is the number of probes, ``values.shape[axis]``; for one probe the error is inf.  Per-probe
    scalars ``(n,)`` give two scalars; per-probe vectors ``(n, d)`` give one mean and error per entry.

    >>> import jax.numpy as jnp
    >>> values = jnp.asarray([[1.0, 5.0], [3.0, 5.0]])  # two probes of two entries
    >>> mean, se = mean_and_standard_error(values)
    >>> mean.tolist(), jnp.round(se, 6).tolist()
    ([2.0, 5.0], [1.0, 0.0])
    """
    return _mean_and_standard_error(values, axis)


@functools.partial(jax.jit, static_argnums=1)
def _mean_and_standard_error(values: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    n = values.shape[axis]
    mean = jnp.mean(values, axis=axis)
    se = jnp.std(values, axis=axis, ddof=1) / jnp.sqrt(n) if n > 1 else jnp.full_like(mean, jnp.inf)
    return mean, se


#: The two-sided level of an interval ``estimate +- 2 se`` for a Gaussian estimate: Phi(2) - Phi(-2) = 95.45 %.
TWO_SE_LEVEL = 0.9544997361036416


@functools.lru_cache(maxsize=None)
def small_sample_factor(n: int) -> float:
    """``t_{n-1}(q) / 2``, ``q = (1 + 0.9545) / 2``: widens a standard error from ``n`` samples so that
    ``estimate +- 2 se`` is the Student-t interval of the Gaussian ``+- 2 sigma`` level (95.45 %).

    A standard deviation from ``n`` samples is itself uncertain when ``n`` is small: with ``n = 2``
    the plain ``+- 2 se`` interval covers about 70 % of runs instead of 95 %.  The factor is 6.98 for
    ``n = 2``, 2.26 for 3, 1.32 for 6, 1.10 for 15 and tends to 1; ``inf`` for ``n <= 1`` (no spread
    to measure).  ``benchmarks/bench_trace_coverage.py`` measures the coverage it gives.
    """
    if n <= 1:
        return float("inf")
    from scipy.stats import t  # jax depends on scipy; imported here, on first use

    return float(t.ppf(0.5 + TWO_SE_LEVEL / 2, n - 1) / 2.0)


def slq_breakdown_tol(dim: int, dtype) -> float:
    """``10 sqrt(d) eps``: Ritz values below this times the largest show a singular operator."""
    return 10.0 * float(np.sqrt(dim)) * float(jnp.finfo(dtype).eps)


def slq_quadrature(
    T: jax.Array, alive: jax.Array, z: jax.Array, rel: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gauss quadrature ``|z|^2 sum_k tau_k^2 log(lambda_k)`` of ``z^T log(A) z`` from the Lanczos matrix ``T``.

    ``T`` and its live-row mask ``alive`` are a one-vector run of the block Lanczos recurrence
    (:func:`minigeo._eigen.block_lanczos` with ``p = 1``) started at ``z / |z|``.  A dead row (the
    basis spans every direction) is decoupled and given the largest ``|T|`` entry as its value: its
    eigenvector has a zero first component, so it carries no weight.  Returns ``(value, smallest
    Ritz value, largest |Ritz value|)``; the value is NaN unless the smallest Ritz value exceeds
    ``rel`` times the largest (a positive-definite operator).
    """
    both = alive[:, None] & alive[None, :]
    fill = jnp.max(jnp.abs(jnp.where(jnp.isfinite(T), T, 0.0)))
    evals, evecs = jnp.linalg.eigh(jnp.where(both, T, 0.0) + jnp.diag(jnp.where(alive, 0.0, fill)))
    top = jnp.max(jnp.abs(evals))
    positive = evals[0] > rel * top
    value = jnp.vdot(z, z) * jnp.sum(evecs[0] ** 2 * jnp.log(jnp.where(evals > 0, evals, 1.0)))
    return jnp.where(positive, value, jnp.nan), evals[0], top


def check_slq_positive(values: jax.Array, smallest: jax.Array, largest: jax.Array, rel: float, who: str) -> None:
    """Raise (concrete values only) when a probe's Ritz values show a singular or indefinite operator."""
    if not is_concrete(values, smallest):
        return
    check_finite(largest, f"{who}: the Lanczos Ritz values", hint="The operator's products are not finite.")
    worst = int(jnp.argmin(smallest / largest))
    lo, hi = float(smallest[worst]), float(largest[worst])
    if not lo > rel * hi:
        state = "indefinite" if lo < -rel * hi else "singular (to working precision)"
        raise GeometryError(
            f"{who}: the operator is not positive definite: it is {state} (smallest Ritz value {lo:.3g}, "
            f"largest {hi:.3g}; non-positive or below {rel:.1e} x largest). At a point that is not a strict "
            "minimum use a GGN/Fisher curvature, or add prior precision (damping)."
        )

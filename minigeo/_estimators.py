"""Helpers of the randomized estimators (floor 1): Rademacher probes, mean and standard error."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._tree import PyTree

__all__ = ["rademacher_like", "mean_and_standard_error"]


def rademacher_like(key: jax.Array, params: PyTree, num: int) -> PyTree:
    """``num`` Rademacher probes shaped like ``params`` (stacked on a leading axis).

    Each 32-bit random word supplies 32 signs, so the random-number generation
    costs 1/32 of drawing one number per coordinate (it dominates the cost of
    probing cheap models otherwise).
    """
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


def mean_and_standard_error(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The mean of per-probe ``values`` and its standard error ``std(ddof=1) / sqrt(n)`` (inf for one probe)."""
    n = values.shape[0]
    se = jnp.std(values, ddof=1) / jnp.sqrt(n) if n > 1 else jnp.asarray(jnp.inf, values.dtype)
    return jnp.mean(values), se

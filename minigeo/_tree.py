"""Small pytree helpers shared by the modules (floor 1)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ._checks import GeometryError

PyTree = Any

__all__ = ["PyTree", "ravel", "tree_vdot", "tree_size", "check_dense_size", "DEFAULT_MAX_DENSE_SIZE"]

#: Largest number of coordinates for which a dense d x d matrix is built by default.
DEFAULT_MAX_DENSE_SIZE = 4096


def ravel(tree: PyTree) -> tuple[jax.Array, Callable[[jax.Array], PyTree]]:
    """Flatten a pytree of arrays into one 1-D array; return it with the inverse map.

    The order is the one of :func:`jax.flatten_util.ravel_pytree`; every dense
    matrix in minigeo (Jacobians, metrics, Hessians) uses this order.
    """
    return ravel_pytree(tree)


def tree_vdot(a: PyTree, b: PyTree) -> jax.Array:
    """Euclidean pairing ``sum_i a_i b_i`` of two pytrees of the same structure."""
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: jnp.vdot(x, y), a, b))
    return sum(leaves[1:], leaves[0]) if leaves else jnp.asarray(0.0)


def tree_size(tree: PyTree) -> int:
    """Number of scalar coordinates in a pytree of arrays."""
    return int(sum(jnp.size(x) for x in jax.tree_util.tree_leaves(tree)))


def check_dense_size(size: int, max_size: int, what: str) -> None:
    """Refuse to build a dense ``size x size`` matrix above ``max_size`` coordinates."""
    if size > max_size:
        raise GeometryError(
            f"{what} would be a dense {size}x{size} matrix ({size * size:,} entries), above the "
            f"limit max_size={max_size}. Use the matrix-free functions instead, or pass a larger "
            "max_size if you really want the dense matrix."
        )


def key_entry(k: Any) -> Any:
    """The plain key of one ``tree_leaves_with_path`` entry: a dict key, a sequence index or an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k

r"""Restriction of a curvature matrix to a block of the parameters: leaves, or sub-arrays of leaves.

Shared by :meth:`minigeo.operators.CurvatureOperator.restrict` and the ``paths=`` argument of
:func:`minigeo.top_eigenvalues`, :func:`minigeo.trace_estimate`, :func:`minigeo.diagonal_estimate`
and :func:`minigeo.spectral_density` (one implementation).

A **selector** is either

* a *path*: a tuple of keys as in ``jax.tree_util.tree_leaves_with_path`` (``("blocks", "attn",
  "W_q")``), or a single key (a path of length one): the whole leaf; or
* a pair ``(path, index)`` with ``index`` a tuple of non-negative ints: the sub-array
  ``leaf[index]`` (the leading ``len(index)`` axes fixed), e.g. ``(("blocks", "attn", "W_q"),
  (0, 2))`` for layer 0, head 2 of a leaf stacked as ``(layers, heads, ...)``.

The restricted parameters are the dict ``{key: sub-array}``, ``key`` the path for a whole leaf and
``path + (index,)`` for a sub-array.  With :math:`\iota` the affine embedding that writes the
selected entries into the full point (every other entry fixed at its value), the restricted loss is
:math:`f\circ\iota` and its Hessian the principal sub-block :math:`H_{SS}` (:math:`\iota` is
affine, so no gradient term); a product with the restricted operator is
:math:`(M\,\iota_0(v_S))_S`, :math:`\iota_0` the zero-padding.  The indices enter the traced
program as arrays (``lax.dynamic_update_slice``), so another head reuses the compiled program.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError
from ._tree import PyTree, key_entry

__all__ = ["Restriction", "restriction"]


class Restriction(NamedTuple):
    """A parsed set of selectors on a parameter pytree (see the module docstring)."""

    sub: dict  # {key: the selected sub-array of params}
    embed: Callable[[dict, list], PyTree]  # embed(sub, base_leaves) -> full pytree
    extract: Callable[[PyTree], dict]  # full pytree -> {key: sub-array}
    name: str  # "blocks/attn/W_q[0, 2], ..."


def _is_index(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in x)


def _as_selectors(paths: Any) -> list:
    if isinstance(paths, (str, int)) or (isinstance(paths, tuple) and paths and not isinstance(paths[0], (tuple, list))):
        return [paths]  # one path
    return list(paths)


def _label(path: tuple) -> str:
    return "/".join(str(k) for k in path)


def _start(idx: np.ndarray, ndim: int) -> list:
    """The start indices of a sub-array, as int32 array entries (not literals: one program per shape)."""
    full = jnp.asarray(np.concatenate([idx, np.zeros(ndim - idx.shape[0], np.int32)]))
    return [full[i] for i in range(ndim)]


def restriction(params: PyTree, paths: Any, who: str) -> Restriction:
    """Parse ``paths`` (selectors) against ``params``; :class:`GeometryError` names a bad one and the valid ones."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    available = {tuple(key_entry(k) for k in path): i for i, (path, _) in enumerate(flat)}
    leaves = [x for _, x in flat]
    treedef = jax.tree_util.tree_structure(params)
    listing = ", ".join(f"{_label(p)} {tuple(np.shape(leaves[i]))}" for p, i in sorted(available.items(), key=lambda t: str(t[0])))
    if paths is None:
        raise GeometryError(f"{who}: no paths given; the leaves (with shapes) are: {listing}.")
    selectors = _as_selectors(paths)
    if not selectors:
        raise GeometryError(f"{who}: no paths given; the leaves (with shapes) are: {listing}.")
    chosen: list = []  # (key, leaf index, index tuple or None)
    for sel in selectors:
        as_path = tuple(sel) if isinstance(sel, (tuple, list)) else (sel,)
        if as_path in available:
            path, index = as_path, None
        elif isinstance(sel, (tuple, list)) and len(sel) == 2 and _is_index(sel[1]):
            path = tuple(sel[0]) if isinstance(sel[0], (tuple, list)) else (sel[0],)
            index = tuple(int(i) for i in sel[1])
        else:
            raise GeometryError(
                f"{who}: the parameters have no leaf at {sel!r} (a path is a tuple of keys; a sub-array is "
                f"(path, index) with index a tuple of ints). The leaves (with shapes) are: {listing}."
            )
        if path not in available:
            raise GeometryError(f"{who}: the parameters have no leaf at {path}. The leaves (with shapes) are: {listing}.")
        shape = np.shape(leaves[available[path]])
        if index is not None:
            if len(index) == 0 or len(index) > len(shape) or any(not 0 <= i < n for i, n in zip(index, shape)):
                valid = " x ".join(f"0..{n - 1}" for n in shape)
                raise GeometryError(
                    f"{who}: index {index} is out of range for the leaf {_label(path)} of shape {tuple(shape)}: "
                    f"give 1 to {len(shape)} non-negative ints, each below its axis length ({valid})."
                )
        for other, j, oidx in chosen:
            if j == available[path] and (
                index is None or oidx is None or index[: len(oidx)] == oidx[: len(index)]
            ):
                raise GeometryError(
                    f"{who}: the selections {other} and {path if index is None else path + (index,)} of the leaf "
                    f"{_label(path)} overlap; select each entry at most once."
                )
        chosen.append((path if index is None else path + (index,), available[path], index))

    keys = [c[0] for c in chosen]
    if len(set(keys)) != len(keys):  # pragma: no cover - overlaps are caught above
        raise GeometryError(f"{who}: a path is given twice.")
    # the indices as arrays: constants of the traced program (arguments of the compiled one), so the
    # program of one head serves every head
    starts = {c[0]: None if c[2] is None else np.asarray(c[2], np.int32) for c in chosen}

    def take(leaf: jax.Array, key: Any) -> jax.Array:
        idx = starts[key]
        if idx is None:
            return leaf
        n = idx.shape[0]
        start = _start(idx, leaf.ndim)
        return jax.lax.dynamic_slice(leaf, start, (1,) * n + leaf.shape[n:]).reshape(leaf.shape[n:])

    def put(leaf: jax.Array, key: Any, value: jax.Array) -> jax.Array:
        idx = starts[key]
        if idx is None:
            return jnp.asarray(value, leaf.dtype).reshape(leaf.shape)
        n = idx.shape[0]
        start = _start(idx, leaf.ndim)
        return jax.lax.dynamic_update_slice(leaf, jnp.asarray(value, leaf.dtype).reshape((1,) * n + leaf.shape[n:]), start)

    def embed(sub: dict, base_leaves: list) -> PyTree:
        out = list(base_leaves)
        for key, j, _ in chosen:
            out[j] = put(out[j], key, sub[key])
        return jax.tree_util.tree_unflatten(treedef, out)

    def extract(full: PyTree) -> dict:
        flat_full = jax.tree_util.tree_leaves(full)
        return {key: take(flat_full[j], key) for key, j, _ in chosen}

    sub = {key: take(leaves[j], key) for key, j, _ in chosen}
    name = ", ".join(_label(key[:-1]) + f"[{', '.join(map(str, key[-1]))}]" if idx is not None else _label(key) for key, _, idx in chosen)
    return Restriction(sub, embed, extract, name)


def restricted_loss(f: Callable[[PyTree], jax.Array], params: PyTree, paths: Any, who: str) -> tuple[Callable, dict]:
    """``(f o iota, sub)``: the loss of the selected entries (the others fixed at ``params``) and its point."""
    r = restriction(params, paths, who)
    base = jax.tree_util.tree_leaves(params)
    return (lambda sub: f(r.embed(sub, base))), r.sub

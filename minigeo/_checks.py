"""Input validation and the error messages users see (floor 1).

Every check here follows two rules:

* **Shape and structure checks always run**, also under ``jax.jit``: shapes and
  pytree structures are static, so a mismatch is reported at trace time.
* **Value checks** (finiteness, positive definiteness, domains) run only when
  the values are concrete.  Under ``jit`` the values are tracers and the check is
  skipped, so that minigeo functions stay ``jit``/``vmap``-compatible; call the
  function once without ``jit`` to get the diagnostics.

All errors are :class:`GeometryError` (a ``ValueError``), so that callers can
catch them without catching unrelated bugs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GeometryError",
    "is_concrete",
    "check_same_structure",
    "check_finite",
    "check_square_matrix",
    "check_spd",
]


class GeometryError(ValueError):
    """A geometric object was used where it is not valid.

    Raised for mismatched shapes or pytree structures, non-finite values,
    metrics that are not symmetric positive definite, points outside the domain
    of a reparametrization, and non-invertible maps.  The message always says
    what was wrong and how to fix it.

    References
    ----------
    No formula from the source papers: the error every validation in minigeo raises. Used in every
    chapter.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> try:
    ...     mg.sharp(-jnp.eye(2), jnp.ones(2))  # an indefinite "metric"
    ... except mg.GeometryError as err:
    ...     print("GeometryError:", str(err)[:40])
    GeometryError: ...
    """


def is_concrete(*trees: Any) -> bool:
    """Whether every leaf of ``trees`` holds concrete values (not a tracer)."""
    leaves = jax.tree_util.tree_leaves(trees)
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def _describe(tree: Any) -> str:
    shapes = jax.tree_util.tree_map(lambda x: tuple(jnp.shape(x)), tree)
    return str(shapes)


def check_same_structure(reference: Any, other: Any, what: str, reference_name: str = "the point") -> None:
    """Raise unless ``other`` has the pytree structure and leaf shapes of ``reference``.

    Parameters
    ----------
    reference, other
        Pytrees of arrays.
    what
        A short name for ``other`` used in the message (e.g. ``"the vector v"``).
    reference_name
        A short name for ``reference``.
    """
    ref_def = jax.tree_util.tree_structure(reference)
    other_def = jax.tree_util.tree_structure(other)
    if ref_def != other_def:
        raise GeometryError(
            f"{what} has pytree structure {other_def}, but {reference_name} has structure "
            f"{ref_def}. Tangent vectors, covectors and points must be pytrees of the same "
            "structure; build the object with jax.tree_util.tree_map over the point."
        )
    for path_leaf_ref, leaf_other in zip(
        jax.tree_util.tree_leaves_with_path(reference), jax.tree_util.tree_leaves(other)
    ):
        path, leaf_ref = path_leaf_ref
        if jnp.shape(leaf_ref) != jnp.shape(leaf_other):
            where = jax.tree_util.keystr(path) or "(root)"
            raise GeometryError(
                f"{what} has shape {jnp.shape(leaf_other)} at {where}, but {reference_name} has "
                f"shape {jnp.shape(leaf_ref)} there. Full shapes: {what}: {_describe(other)}, "
                f"{reference_name}: {_describe(reference)}."
            )


def check_finite(tree: Any, what: str, hint: str = "") -> None:
    """Raise if any leaf of ``tree`` holds NaN or infinity (concrete values only)."""
    if not is_concrete(tree):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        arr = np.asarray(leaf)
        if not np.issubdtype(arr.dtype, np.inexact):
            continue
        bad = ~np.isfinite(arr)
        if bad.any():
            where = jax.tree_util.keystr(path) or ""
            first = tuple(int(i) for i in np.argwhere(bad)[0]) if arr.ndim else ()
            kind = "NaN" if np.isnan(arr[bad]).any() else "infinite"
            raise GeometryError(
                f"{what}{where} contains {int(bad.sum())} non-finite value(s) ({kind}, first at "
                f"index {first}). {hint}".rstrip()
            )


def check_square_matrix(matrix: Any, size: int | None, what: str) -> None:
    """Raise unless ``matrix`` is a 2-D square array (of side ``size`` when given)."""
    shape = jnp.shape(matrix)
    if len(shape) != 2 or shape[0] != shape[1]:
        raise GeometryError(f"{what} must be a square 2-D matrix, got shape {shape}.")
    if size is not None and shape[0] != size:
        raise GeometryError(
            f"{what} has shape {shape}, but the point has {size} coordinates (after flattening "
            f"the pytree), so a {size}x{size} matrix is needed."
        )


def check_spd(matrix: Any, what: str = "the metric", rtol: float = 1e-6) -> None:
    """Raise unless a dense matrix is symmetric positive definite (concrete values only).

    Symmetry is checked to relative tolerance ``rtol``; positive definiteness by
    the smallest eigenvalue, relative to the largest.  The message gives the
    smallest eigenvalue and suggests damping ``G + λI``.
    """
    if not is_concrete(matrix):
        return
    m = np.asarray(matrix, dtype=np.float64)
    check_finite(m, what)
    scale = max(float(np.max(np.abs(m))), np.finfo(np.float64).tiny)
    asym = float(np.max(np.abs(m - m.T)))
    if asym > rtol * scale:
        raise GeometryError(
            f"{what} is not symmetric (max |G - G^T| = {asym:.3g}, max |G| = {scale:.3g}). "
            "A Riemannian metric must be symmetric; symmetrize it with (G + G.T) / 2 if the "
            "asymmetry is round-off."
        )
    eigs = np.linalg.eigvalsh(0.5 * (m + m.T))
    lam_min, lam_max = float(eigs[0]), float(eigs[-1])
    dtype = np.asarray(matrix).dtype
    eps = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64).eps
    threshold = eps * m.shape[0] * max(abs(lam_max), abs(lam_min))
    if lam_min <= threshold:
        state = "singular" if abs(lam_min) <= threshold else "indefinite"
        raise GeometryError(
            f"{what} is not positive definite: it is {state} (smallest eigenvalue {lam_min:.3g}, "
            f"largest {lam_max:.3g}). Add damping, G + λI with λ > 0 (for example "
            f"damping={1e-3 * max(abs(lam_max), 1.0):.3g}), or use a pseudo-inverse where a "
            "singular metric is intended."
        )

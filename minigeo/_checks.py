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
    "check_symmetric",
    "is_symmetric_to_roundoff",
    "check_key",
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
    _check_same_dtypes(reference, other, what, reference_name)


def _check_same_dtypes(reference: Any, other: Any, what: str, reference_name: str) -> None:
    """Raise unless every leaf of ``other`` has the (canonical) dtype of the real floating leaf of ``reference``.

    JAX's ``jvp`` and ``linearize`` need tangents of exactly the point's dtype; an integer, complex
    or differently sized floating tangent would otherwise fail deep inside JAX with a ``TypeError``.
    Python floats (weakly typed) are accepted.
    """
    for (path, leaf_ref), leaf_other in zip(
        jax.tree_util.tree_leaves_with_path(reference), jax.tree_util.tree_leaves(other)
    ):
        if isinstance(leaf_other, float):
            continue
        ref_dtype, other_dtype = jnp.result_type(leaf_ref), jnp.result_type(leaf_other)
        if not jnp.issubdtype(ref_dtype, jnp.floating) or other_dtype == ref_dtype:
            continue
        where = f" at {jax.tree_util.keystr(path)}" if path else ""
        raise GeometryError(
            f"{what} has dtype {other_dtype}{where}, but {reference_name} has dtype {ref_dtype}{' there' if path else ''}. "
            f"Tangent vectors and covectors must have the dtype of the point; convert with "
            f"jax.tree_util.tree_map(lambda a, p: jnp.asarray(a, p.dtype), {what.split()[-1]}, point)."
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
    smallest eigenvalue and suggests damping ``G + εI``.
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
            f"largest {lam_max:.3g}). Add damping, G + εI with ε > 0 (for example "
            f"damping={1e-3 * max(abs(lam_max), 1.0):.3g}), or use a pseudo-inverse where a "
            "singular metric is intended."
        )


def equilibrate(matrix: Any, iterations: int = 30) -> np.ndarray | None:
    """Row/column equilibration ``D_r M D_c`` of a concrete matrix (float64), or ``None`` if a row or
    column is zero.

    Ruiz scaling: positive diagonals ``D_r``, ``D_c`` chosen so that every row and column has largest
    entry 1.  It removes the scale of each coordinate: a diagonal matrix with finite non-zero entries
    becomes the identity however widely its entries are spread, while a singular matrix (a zero row or
    column, or linearly dependent rows) stays singular.
    """
    a = np.asarray(matrix, dtype=np.float64)
    if a.size == 0:
        return a
    if not ((np.abs(a).max(axis=1) > 0).all() and (np.abs(a).max(axis=0) > 0).all()):
        return None
    for _ in range(iterations):
        r = np.sqrt(np.abs(a).max(axis=1))
        c = np.sqrt(np.abs(a).max(axis=0))
        a = a / r[:, None] / c[None, :]
        if np.all(np.abs(r - 1) < 1e-3) and np.all(np.abs(c - 1) < 1e-3):
            break
    return a


def numerically_singular(matrix: Any, dtype: Any = None) -> tuple[bool, float, float]:
    """Whether a concrete square matrix is singular to ``dtype``'s precision, whatever its scales.

    The test is on the row/column-equilibrated matrix (see :func:`equilibrate`): singular when
    it has a zero row or column, or when its smallest singular value is at most ``n · eps(dtype)``
    times its largest, ``eps`` being that of ``dtype`` (the matrix's own dtype by default; float64
    for integers).  Rescaling a coordinate (``θ_i → c_i θ_i``) therefore never makes a matrix
    "singular"; a diagonal Jacobian ``diag(exp(x))`` passes at any finite ``x``.  Returns
    ``(singular, smallest, largest)``; for a singular matrix the last two are the extreme singular
    values of the matrix itself (for messages), otherwise ``nan``.
    """
    dtype = np.asarray(matrix).dtype if dtype is None else np.dtype(dtype)
    eps = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64).eps
    if np.size(matrix) == 0:
        return False, float("nan"), float("nan")
    eq = equilibrate(matrix)
    if eq is not None:
        sv = np.linalg.svd(eq, compute_uv=False)
        if sv[-1] > eps * np.shape(matrix)[0] * sv[0]:
            return False, float("nan"), float("nan")
    sv = np.linalg.svd(np.asarray(matrix, dtype=np.float64), compute_uv=False)
    return True, float(sv[-1]), float(sv[0])


def symmetry_rtol(matrix: Any) -> float:
    """Relative tolerance for the asymmetry of an ``n x n`` metric: ``max(64 n, 1000) * eps(dtype)``.

    Round-off in products such as ``J^T G J`` leaves an asymmetry of a few ``n eps`` of the
    matrix's dtype; an asymmetry above this tolerance is a modelling error, not round-off.
    """
    dtype = jnp.result_type(matrix)
    dtype = dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.float64
    n = int(jnp.shape(matrix)[0]) if jnp.ndim(matrix) else 1
    return float(max(64 * n, 1000) * np.finfo(dtype).eps)


def is_symmetric_to_roundoff(matrix: Any) -> jax.Array:
    """Traceable: ``max |M - M^T| <= symmetry_rtol(M) * max |M|`` (``False`` for non-finite entries).

    The test :func:`check_symmetric` makes eagerly, as a JAX boolean, so that under ``jit`` a
    non-symmetric matrix can be reported by a status or NaN instead of an exception.
    """
    m = jnp.asarray(matrix)
    if not jnp.issubdtype(m.dtype, jnp.inexact):
        m = m.astype(jnp.result_type(float))
    if m.size == 0:
        return jnp.asarray(True)
    scale = jnp.max(jnp.abs(m))
    asym = jnp.max(jnp.abs(m - m.T))
    return asym <= symmetry_rtol(matrix) * scale  # NaN compares False


def check_symmetric(matrix: Any, what: str = "the metric") -> None:
    """Raise unless a dense square matrix is symmetric to :func:`symmetry_rtol` (concrete values only)."""
    if not is_concrete(matrix):
        return
    m = np.asarray(matrix)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.size == 0 or not np.isfinite(m).all():
        return
    m = m.astype(np.float64) if np.issubdtype(m.dtype, np.integer) else m
    scale = float(np.max(np.abs(m)))
    asym = float(np.max(np.abs(m - m.T)))
    rtol = symmetry_rtol(matrix)
    if asym > rtol * max(scale, np.finfo(np.float64).tiny):
        raise GeometryError(
            f"{what} is not symmetric: max |G - G^T| = {asym:.3g}, max |G| = {scale:.3g} (relative asymmetry "
            f"{asym / max(scale, np.finfo(np.float64).tiny):.3g} > tolerance {rtol:.2g} = max(64 n, 1000) eps of "
            f"{m.dtype}). A Riemannian metric must be symmetric; symmetrize it with (G + G.T) / 2 if the asymmetry "
            "is round-off."
        )


def as_float_point(tree: Any, what: str = "params") -> Any:
    """Validate a point or tangent vector given to a metric: convert, refuse empty, integer and complex inputs.

    A (nested) Python list or tuple of numbers is converted to a floating-point array.
    An empty pytree (no coordinates), integer or boolean leaves, and complex leaves raise
    :class:`GeometryError` (differentiation and metrics need real floating-point coordinates).
    """
    leaves = jax.tree_util.tree_leaves(tree)
    if (
        isinstance(tree, (list, tuple))
        and leaves
        and all(isinstance(x, (int, float, np.number)) and not isinstance(x, (bool, np.bool_)) for x in leaves)
    ):
        arr = np.asarray(tree)
        if arr.dtype != object:
            tree = jnp.asarray(arr, dtype=jnp.result_type(float))
    pairs = jax.tree_util.tree_leaves_with_path(tree)
    if not pairs or sum(int(np.size(x)) for _, x in pairs) == 0:
        raise GeometryError(
            f"{what} is empty (it has no coordinates); a metric needs a point with at least one coordinate."
        )
    for path, leaf in pairs:
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.complexfloating):
            where = jax.tree_util.keystr(path) or ""
            raise GeometryError(
                f"{what}{where} has the complex dtype {dtype}; minigeo's geometry is real (metrics, traces and "
                "eigenvalues of real parameters). Split a complex parameter into real and imaginary parts, e.g. "
                "{'re': z.real, 'im': z.imag}."
            )
        if not jnp.issubdtype(dtype, jnp.inexact):
            where = jax.tree_util.keystr(path) or ""
            raise GeometryError(
                f"{what}{where} has dtype {dtype}; coordinates must be floating point (metrics differentiate "
                "through them). Convert with jnp.asarray(x, dtype=float)."
            )
    return tree


def check_working_precision(tree: Any, who: str, what: str = "params") -> None:
    """Raise for float16/bfloat16 leaves: the solvers, factorizations and estimators need float32 or float64.

    XLA's CPU linear algebra (QR, ``eigh``, Cholesky) has no half-precision kernels (a raw
    ``NotImplementedError``), and the 8 to 11 bit mantissas overflow or round away the sums of probes and
    the Krylov recurrences (a Hutchinson trace of ``inf``).  Dtypes are static: the check also runs
    under ``jit``.
    """
    small = {jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)}
    low = sorted({jnp.dtype(jnp.result_type(x)).name for x in jax.tree_util.tree_leaves(tree)} & {d.name for d in small})
    if low:
        raise GeometryError(
            f"{who}: {what} are in {', '.join(low)}, which this computation does not support: linear algebra (QR, "
            "eigh, Cholesky) has no half-precision kernels and 8 to 11 bit mantissas overflow or round away its "
            f"sums. Cast to float32, e.g. jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), {what})."
        )


def is_matrix(obj: Any) -> bool:
    """An array-like matrix: anything with a shape, or a nested list/tuple of real numbers (not a callable)."""
    if callable(obj):
        return False
    if hasattr(obj, "shape"):
        return True
    return isinstance(obj, (list, tuple)) and _nested_numbers(obj)


def _nested_numbers(obj: Any) -> bool:
    """A (nested) list/tuple of real numbers, e.g. ``[[1.0, 0.0], [0.0, 1.0]]``."""
    leaves = jax.tree_util.tree_leaves(obj)
    return bool(leaves) and all(
        isinstance(x, (int, float, np.number)) and not isinstance(x, (bool, np.bool_)) for x in leaves
    )


def as_array(obj: Any) -> Any:
    """Nested lists of numbers become an array (a matrix given as a list is accepted)."""
    return jnp.asarray(np.asarray(obj)) if isinstance(obj, (list, tuple)) and _nested_numbers(obj) else obj


def check_key(key: Any, what: str = "key") -> None:
    """Raise unless ``key`` is a JAX PRNG key: a typed key array of shape ``()`` (``jax.random.key``) or
    legacy raw key data, a ``uint32`` array of shape ``(2,)`` or ``(4,)`` (``jax.random.PRNGKey``).

    Shape and dtype are static, so the check also runs under ``jit``.
    """
    dtype = getattr(key, "dtype", None)
    shape = tuple(getattr(key, "shape", ()) or ())
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape == ():
            return
        raise GeometryError(
            f"{what} must be a single PRNG key, got a key array of shape {shape}; pass one key, e.g. keys[0]."
        )
    if dtype is not None and np.dtype(dtype) == np.uint32 and shape in ((2,), (4,)):
        return
    got = f"{type(key).__name__} {key!r}" if dtype is None else f"an array of dtype {dtype} and shape {shape}"
    raise GeometryError(
        f"{what} must be a JAX PRNG key, e.g. jax.random.PRNGKey(0) or jax.random.key(0); got {got}."
    )


def split_batch(batch: Any, who: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch given as a pair (the convention of the model-based metrics)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise GeometryError(
            f"{who}: a batch must be a pair (inputs, targets); got {type(batch).__name__}. For a model that "
            "takes the whole batch, close over it instead: lambda p: model(p, batch)."
        )
    return batch[0], batch[1]

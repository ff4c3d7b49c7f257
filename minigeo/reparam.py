r"""Built-in reparametrizations (floor 3, chapter 1).

Each factory returns a :class:`~minigeo.Reparametrization`
:math:`\varphi: \theta \mapsto \psi` with its inverse and a description of the
set on which it is invertible, so that points outside it raise a clear error.

==================  =====================================  ==========================
factory             :math:`\psi = \varphi(\theta)`         domain
==================  =====================================  ==========================
``log()``           :math:`\log\theta` (element-wise)      :math:`\theta > 0`
``softplus()``      :math:`\mathrm{softplus}^{-1}(\theta)`  :math:`\theta > 0`
``scale(c)``        :math:`c\,\theta`                      all, :math:`c \ne 0`
``affine(A, b)``    :math:`A\theta + b`                    all, :math:`A` invertible
``polar()``         :math:`(r, \alpha)` of :math:`(x, y)`  :math:`(x, y) \ne 0`
``compose(φ₁, φ₂)`` :math:`\varphi_2(\varphi_1(\theta))`   that of :math:`\varphi_1`
==================  =====================================  ==========================

``log`` and ``softplus`` are the two standard ways to make a positive parameter
(a variance :math:`\sigma^2`, a scale) unconstrained (Kristiadi et al. 2023, Example 1(a)):
:math:`\theta = e^\psi` and :math:`\theta = \log(1 + e^\psi)` respectively.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, check_finite, is_concrete, numerically_singular
from ._tree import PyTree, ravel
from .coords import Reparametrization

__all__ = ["log", "softplus", "scale", "affine", "polar", "compose"]


def _map(fn):
    return lambda tree: jax.tree_util.tree_map(fn, tree)


def _positive(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda t: t > 0, tree)


def log() -> Reparametrization:
    r"""Element-wise log coordinates for positive parameters.

    .. math:: \psi = \log\theta,\qquad \theta = e^{\psi},\qquad J = \mathrm{diag}(1/\theta).

    Returns
    -------
    Reparametrization
        The chart; its ``domain`` check rejects :math:`\theta \le 0`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam
    >>> reparam.log().forward(jnp.array([1.0, jnp.e]))
    Array([0., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, Example 1(a) (log-space parametrization). Chapter 1.
    """
    return Reparametrization(
        _map(jnp.log),
        _map(jnp.exp),
        name="log",
        domain=_positive,
        domain_description="log needs theta > 0",
    )


def _inverse_softplus(t: jax.Array) -> jax.Array:
    # softplus^{-1}(t) = log(exp(t) - 1) = t + log(-expm1(-t)), stable for large and small t.
    return t + jnp.log(-jnp.expm1(-t))


def softplus() -> Reparametrization:
    r"""Softplus coordinates for positive parameters: like :func:`log`, but :math:`\theta \approx \psi` for large values.

    .. math:: \theta = \log(1 + e^{\psi}),\qquad \psi = \mathrm{softplus}^{-1}(\theta) = \theta + \log(1 - e^{-\theta}).

    Returns
    -------
    Reparametrization
        The chart; its ``domain`` check rejects :math:`\theta \le 0`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam
    >>> phi = reparam.softplus()
    >>> round(float(phi.inverse(phi.forward(jnp.array([0.3])))[0]), 6)
    0.3

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, Example 1(a). Chapters 1 and 5.
    """
    return Reparametrization(
        _map(_inverse_softplus),
        _map(jax.nn.softplus),
        name="softplus",
        domain=_positive,
        domain_description="softplus coordinates need theta > 0",
    )


def scale(c: Any) -> Reparametrization:
    r"""Rescaling by a non-zero factor: a change of units (minutes to seconds is ``scale(60.0)`` on a time coefficient).

    .. math:: \psi = c\,\theta,\qquad J = \mathrm{diag}(c).

    Parameters
    ----------
    c : scalar, array or pytree
        Non-zero factor(s): a scalar, an array broadcasting against the point, or a pytree matching it.

    Returns
    -------
    Reparametrization
        The chart.

    Raises
    ------
    GeometryError
        If ``c`` is empty, not finite, or has a zero entry (checked when concrete).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam
    >>> reparam.scale(60.0).forward(jnp.array([0.5]))
    Array([30.], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (dimensional analysis, minutes to seconds); Kristiadi,
    Dangel & Hennig (2023), Sec. 3.2. Chapter 1.
    """
    leaves = jax.tree_util.tree_leaves(c)
    if not leaves:
        raise GeometryError("scale(c) needs a non-zero scalar, array or pytree c; got an empty pytree.")
    if is_concrete(c):
        check_finite(c, "scale(c): c")
        zeros = sum(int(np.sum(np.asarray(leaf) == 0)) for leaf in leaves)
        if zeros:
            raise GeometryError(
                f"scale(c): c has {zeros} zero entr{'y' if zeros == 1 else 'ies'}; scaling by zero is "
                "not invertible. Use non-zero scale factors."
            )
    single = jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(c))

    def forward(theta: PyTree) -> PyTree:
        if single:
            return jax.tree_util.tree_map(lambda t: c * t, theta)
        return jax.tree_util.tree_map(lambda ci, t: ci * t, c, theta)

    def inverse(psi: PyTree) -> PyTree:
        if single:
            return jax.tree_util.tree_map(lambda t: t / c, psi)
        return jax.tree_util.tree_map(lambda ci, t: t / ci, c, psi)

    return Reparametrization(forward, inverse, name="scale")


def affine(A: Any, b: Any = None) -> Reparametrization:
    r"""Affine coordinates with an invertible square matrix (constant Jacobian :math:`A`).

    .. math:: \psi = A\theta + b,\qquad \theta = A^{-1}(\psi - b).

    Acts on 1-D arrays, or on pytrees through their flattened coordinates (the order of
    :func:`jax.flatten_util.ravel_pytree`); ψ keeps θ's structure.

    Parameters
    ----------
    A : array
        Invertible ``(n, n)`` matrix.
    b : array, optional
        Offset of shape ``(n,)``; zero by default.

    Returns
    -------
    Reparametrization
        The chart, for points with ``n`` coordinates.

    Raises
    ------
    GeometryError
        If ``A`` is not square, ``b`` has the wrong shape, or (when concrete) ``A`` or ``b`` is not
        finite or ``A`` is singular; on use, if a point does not have ``n`` coordinates.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam
    >>> phi = reparam.affine(jnp.array([[2.0, 0.0], [1.0, 1.0]]), jnp.array([0.0, 1.0]))
    >>> phi.forward(jnp.array([1.0, 1.0]))
    Array([2., 3.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (change of coordinates and its Jacobian). Chapter 1.
    """
    A = jnp.asarray(A)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise GeometryError(f"affine(A, b): A must be a square matrix, got shape {A.shape}.")
    n = A.shape[0]
    b = jnp.zeros(n, dtype=A.dtype) if b is None else jnp.asarray(b)
    if b.shape != (n,):
        raise GeometryError(f"affine(A, b): b must have shape ({n},) to match A, got {b.shape}.")
    if is_concrete(A, b):
        check_finite(A, "affine(A, b): A")
        check_finite(b, "affine(A, b): b")
        # relative to A's dtype and to each coordinate's scale: diag(1e-9, 1e9) is invertible
        singular, smallest, largest = numerically_singular(A)
        if singular:
            raise GeometryError(
                f"affine(A, b): A is singular (smallest singular value {smallest:.3g}, largest "
                f"{largest:.3g}, even after rescaling each coordinate); an affine reparametrization "
                "needs an invertible A."
            )

    def _check_size(flat: jax.Array) -> None:
        if flat.size != n:
            raise GeometryError(
                f"affine(A, b) with a {n}x{n} matrix A acts on points with {n} coordinates; this point "
                f"has {flat.size}."
            )

    def forward(theta: PyTree) -> PyTree:
        flat, unravel = ravel(theta)
        _check_size(flat)
        return unravel(A @ flat + b)

    def inverse(psi: PyTree) -> PyTree:
        flat, unravel = ravel(psi)
        _check_size(flat)
        return unravel(jnp.linalg.solve(A, flat - b))

    return Reparametrization(forward, inverse, name="affine")


def _check_plane(x: jax.Array, what: str) -> None:
    if jnp.shape(x) != (2,):
        raise GeometryError(
            f"polar() acts on points of the plane, shape (2,); {what} has shape {jnp.shape(x)}."
        )


def polar() -> Reparametrization:
    r"""Polar coordinates of the plane; the Euclidean metric becomes :math:`\mathrm{diag}(1, r^2)`.

    .. math:: (x, y) \mapsto (r, \alpha),\qquad r = \sqrt{x^2+y^2},\quad \alpha = \mathrm{atan2}(y, x) \in (-\pi, \pi].

    Invertible away from the origin.

    Returns
    -------
    Reparametrization
        The chart, acting on points of shape ``(2,)``; its ``domain`` check rejects the origin.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam
    >>> reparam.polar().forward(jnp.array([0.0, 2.0])).round(4)
    Array([2.    , 1.5708], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (polar coordinates as an alternative chart). Chapter 1.
    """

    def forward(xy: jax.Array) -> jax.Array:
        _check_plane(xy, "theta")
        return jnp.stack([jnp.hypot(xy[0], xy[1]), jnp.arctan2(xy[1], xy[0])])

    def inverse(ra: jax.Array) -> jax.Array:
        _check_plane(ra, "psi")
        return jnp.stack([ra[0] * jnp.cos(ra[1]), ra[0] * jnp.sin(ra[1])])

    return Reparametrization(
        forward,
        inverse,
        name="polar",
        domain=lambda xy: jnp.hypot(xy[0], xy[1]) > 0,
        codomain=lambda ra: (ra[0] > 0) & (jnp.abs(ra[1]) <= jnp.pi),
        domain_description="polar coordinates are singular at the origin (x, y) = (0, 0)",
        codomain_description="polar coordinates need r > 0 and -pi <= alpha <= pi",
    )


def compose(*phis: Reparametrization) -> Reparametrization:
    r"""The composition of reparametrizations, ``phis[0]`` applied first.

    .. math:: \varphi = \varphi_n \circ \dots \circ \varphi_1,\qquad J_\varphi = J_{\varphi_n}\cdots J_{\varphi_1}\ \text{(chain rule)},

    so every rule in :mod:`minigeo.coords` composes: transforming by ``compose(f, g)`` equals
    transforming by ``f`` then by ``g``.

    Parameters
    ----------
    *phis : Reparametrization
        One or more charts, in the order they are applied.

    Returns
    -------
    Reparametrization
        The composed chart.

    Raises
    ------
    GeometryError
        If no chart is given or an argument is not a :class:`~minigeo.coords.Reparametrization`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam
    >>> phi = reparam.compose(reparam.log(), reparam.scale(2.0))  # psi = 2 log(theta)
    >>> phi.forward(jnp.array([jnp.e]))
    Array([2.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (transformation rules; the chain rule). Chapter 1.
    """
    if not phis:
        raise GeometryError("compose() needs at least one reparametrization.")
    for p in phis:
        if not isinstance(p, Reparametrization):
            raise GeometryError(f"compose() takes Reparametrization objects, got {type(p).__name__}.")

    def forward(theta: PyTree) -> PyTree:
        for p in phis:
            theta = p.forward(theta)
        return theta

    def inverse(psi: PyTree) -> PyTree:
        for p in reversed(phis):
            psi = p.inverse(psi)
        return psi

    return Reparametrization(forward, inverse, name=" ∘ ".join(p.name for p in reversed(phis)))

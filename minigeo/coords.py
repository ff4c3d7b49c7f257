r"""Coordinates, reparametrizations and the transformation rules (floor 2, chapter 1).

A reparametrization (change of coordinates) is a diffeomorphism
:math:`\varphi: \Theta \to \Psi`, :math:`\psi = \varphi(\theta)`, with Jacobian
:math:`J(\theta) = \partial\psi/\partial\theta`.  Geometric objects keep their
meaning across coordinates only if they follow the rules of Kristiadi et al. 2023, Sec. 2.2
(Kristiadi, Dangel & Hennig 2023):

=====================  ==================================  =========================
object                 rule                                minigeo
=====================  ==================================  =========================
function  h            :math:`h \circ \varphi^{-1}`        :func:`transform_function`
vector    v            :math:`J v`                          :func:`transform_vector`
covector  ω            :math:`J^{-\top} \omega`             :func:`transform_covector`
metric    G            :math:`J^{-\top} G J^{-1}`           :func:`transform_metric`
bilinear  B            :math:`J^{-\top} B J^{-1}`           :func:`transform_bilinear`
endomorphism E         :math:`J E J^{-1}`                   :func:`transform_endomorphism`
=====================  ==================================  =========================

All rules work on 1-D arrays and on pytrees of arrays.  They never form
:math:`J^{-1}` by inverting a matrix: vectors are pushed forward with ``jax.jvp``
through :math:`\varphi`, covectors pulled back with ``jax.vjp`` through
:math:`\varphi^{-1}` (whose Jacobian *is* :math:`J^{-1}`).  Dense matrices
(metrics, bilinear forms) are indexed in the order of
:func:`jax.flatten_util.ravel_pytree`.

The musical isomorphisms :func:`flat` (:math:`v \mapsto Gv`) and :func:`sharp`
(:math:`\omega \mapsto G^{-1}\omega`, by a Cholesky or conjugate-gradient solve)
turn vectors into covectors and back.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import numpy as np

from ._checks import (
    GeometryError,
    as_array as _as_array,
    check_finite,
    check_same_structure,
    check_spd,
    check_square_matrix,
    check_symmetric,
    is_concrete,
    is_matrix as _is_matrix,
)
from ._linalg import _is_zero, check_damping, check_solver_options, solve_spd_cg, solve_spd_dense
from ._metric import Metric, _matrix_field, dense, metric_field
from ._tree import DEFAULT_MAX_DENSE_SIZE, PyTree, check_dense_size, ravel, tree_size, tree_vdot

__all__ = [
    "Reparametrization",
    "transform_function",
    "transform_vector",
    "transform_covector",
    "transform_metric",
    "transform_bilinear",
    "transform_endomorphism",
    "transform_metric_field",
    "pushforward",
    "pullback_covector",
    "pair",
    "inner",
    "flat",
    "sharp",
]

#: A tensor at one point, as the pointwise rules take it (a metric, bilinear form or endomorphism at
#: ``theta``, or at the ``at=`` of :func:`inner`, :func:`flat` and :func:`sharp`): a dense ``(d, d)``
#: matrix over the flattened parameters, a linear map ``v -> T v`` on pytrees at that point (the one
#: meaning of a bare callable anywhere in minigeo; metric *fields* are :class:`~minigeo.Metric`
#: objects), or a :class:`~minigeo.Metric` field, evaluated at the point.  Kristiadi, Dangel &
#: Hennig (2023), Sec. 2.2.  Taught in chapters 1 and 2.
TensorAtPoint = Union[jax.Array, np.ndarray, Callable[[PyTree], PyTree], Metric]

Predicate = Callable[[PyTree], Any]


class Reparametrization:
    r"""A change of coordinates :math:`\psi = \varphi(\theta)` with its inverse.

    .. math:: \varphi: \Theta \to \Psi,\qquad J(\theta) = \frac{\partial\psi}{\partial\theta}\ \text{invertible on } \Theta.

    Parameters
    ----------
    forward : callable
        :math:`\varphi`, maps a point ``theta`` (array or pytree) to ``psi``.
    inverse : callable
        :math:`\varphi^{-1}`, maps ``psi`` back to ``theta``.
    name : str, optional
        Shown in error messages and plots (default: the name of ``forward``).
    domain, codomain : callable, optional
        Predicates returning a boolean array (or pytree of them) that is
        ``True`` where a point lies inside the open set on which ``forward``
        (respectively ``inverse``) is a diffeomorphism.  They are evaluated
        eagerly (not under ``jit``) and give the error message for points
        outside, e.g. ``log()`` at ``theta <= 0``.
    domain_description, codomain_description : str, optional
        Human-readable descriptions of those sets for the error messages.

    Raises
    ------
    GeometryError
        If ``forward`` or ``inverse`` is not callable; later, from the methods, if a point lies outside
        ``domain``/``codomain``, a value is not finite, or the Jacobian is not square or is singular.

    Notes
    -----
    The Jacobian :math:`J(\theta) = \partial\psi/\partial\theta` must be
    invertible on the domain; Kristiadi et al. 2023, Sec. 2.2 calls such a map a
    reparametrization.  Points and objects may be 1-D arrays or pytrees; the
    output of ``forward`` may have a different pytree structure from its input.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import Reparametrization
    >>> cube = Reparametrization(lambda t: t**3, jnp.cbrt, name="cube")
    >>> cube.forward(jnp.array([2.0]))
    Array([8.], dtype=float32)
    >>> float(cube.jacobian(jnp.array([2.0]))[0, 0])
    12.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (a reparametrization is a diffeomorphism of
    parameter space). Taught in chapter 1, *Vectors vs covectors*.
    """

    __slots__ = (
        "_forward",
        "_inverse",
        "name",
        "_domain",
        "_codomain",
        "domain_description",
        "codomain_description",
    )

    def __init__(
        self,
        forward: Callable[[PyTree], PyTree],
        inverse: Callable[[PyTree], PyTree],
        name: str | None = None,
        *,
        domain: Predicate | None = None,
        codomain: Predicate | None = None,
        domain_description: str | None = None,
        codomain_description: str | None = None,
    ) -> None:
        if not callable(forward) or not callable(inverse):
            raise GeometryError(
                "Reparametrization(forward, inverse) needs two callables: forward maps theta to "
                f"psi and inverse maps psi back; got {type(forward).__name__} and "
                f"{type(inverse).__name__}."
            )
        self._forward = forward
        self._inverse = inverse
        self.name = name or getattr(forward, "__name__", "phi")
        self._domain = domain
        self._codomain = codomain
        self.domain_description = domain_description
        self.codomain_description = codomain_description

    def __repr__(self) -> str:
        return f"Reparametrization(name={self.name!r})"

    # -- evaluation -------------------------------------------------------
    def _check_in(self, predicate: Predicate | None, x: PyTree, what: str, description: str | None) -> None:
        if predicate is None or not is_concrete(x):
            return
        inside = jax.tree_util.tree_leaves(predicate(x))
        outside = sum(int(np.size(m) - np.count_nonzero(np.asarray(m))) for m in inside)
        if outside:
            where = f" ({description})" if description else ""
            raise GeometryError(
                f"{self.name}: {outside} coordinate(s) of {what} lie outside the set where the "
                f"reparametrization is invertible{where}. Move the point inside that set, or use a "
                "reparametrization defined there."
            )

    def forward(self, theta: PyTree) -> PyTree:
        r"""Map a point to the new coordinates, :math:`\psi = \varphi(\theta)`."""
        check_finite(theta, f"{self.name}.forward: theta")
        self._check_in(self._domain, theta, "theta", self.domain_description)
        psi = self._forward(theta)
        check_finite(psi, f"{self.name}.forward(theta)", hint="The map is undefined at this point.")
        return psi

    __call__ = forward

    def inverse(self, psi: PyTree) -> PyTree:
        r"""Map a point back to the old coordinates, :math:`\theta = \varphi^{-1}(\psi)`."""
        check_finite(psi, f"{self.name}.inverse: psi")
        self._check_in(self._codomain, psi, "psi", self.codomain_description)
        theta = self._inverse(psi)
        check_finite(theta, f"{self.name}.inverse(psi)", hint="The inverse map is undefined at this point.")
        return theta

    def inverted(self) -> "Reparametrization":
        r""":math:`\varphi^{-1}` as a reparametrization from :math:`\Psi` to :math:`\Theta`."""
        return Reparametrization(
            self._inverse,
            self._forward,
            name=f"inverse({self.name})",
            domain=self._codomain,
            codomain=self._domain,
            domain_description=self.codomain_description,
            codomain_description=self.domain_description,
        )

    # -- derivatives --------------------------------------------------------
    def jvp(self, theta: PyTree, v: PyTree) -> tuple[PyTree, PyTree]:
        r"""Return :math:`(\varphi(\theta), J(\theta) v)` by forward-mode autodiff."""
        return jax.jvp(self._forward, (theta,), (v,))

    def jacobian(self, theta: PyTree, *, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> jax.Array:
        r"""Dense Jacobian :math:`J(\theta) = \partial\psi/\partial\theta` over the flattened coordinates.

        Raises :class:`GeometryError` if the Jacobian is not square, not finite, or
        singular at ``theta`` (the map is not a reparametrization there).
        """
        self.forward(theta)  # domain and finiteness checks with clear messages
        return self._dense_jacobian(self._forward, theta, "theta", max_size)

    def inverse_jacobian(self, psi: PyTree, *, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> jax.Array:
        r"""Dense :math:`J^{-1}(\psi) = \partial\theta/\partial\psi`, the Jacobian of :math:`\varphi^{-1}`."""
        self.inverse(psi)
        return self._dense_jacobian(self._inverse, psi, "psi", max_size)

    def _dense_jacobian(self, fn: Callable, x: PyTree, what: str, max_size: int) -> jax.Array:
        flat_x, unravel = ravel(x)
        check_dense_size(flat_x.size, max_size, f"The Jacobian of {self.name}")
        jac = jax.jacfwd(lambda f: ravel(fn(unravel(f)))[0])(flat_x)
        if jac.shape[0] != jac.shape[1]:
            raise GeometryError(
                f"{self.name} maps {jac.shape[1]} coordinates to {jac.shape[0]}: a reparametrization "
                "must keep the number of coordinates (its Jacobian must be square)."
            )
        check_finite(
            jac, f"The Jacobian of {self.name} at {what}", hint="The map is not differentiable there."
        )
        if is_concrete(jac) and jac.size:
            # relative to the dtype and to each coordinate's scale (row/column equilibration):
            # diag(exp(x)) at widely spread x is invertible, a zero row or dependent rows are not
            from ._checks import numerically_singular

            singular, smallest, largest = numerically_singular(jac)
            if singular:
                raise GeometryError(
                    f"The Jacobian of {self.name} is singular at this {what} (smallest singular value "
                    f"{smallest:.3g}, largest {largest:.3g}, even after rescaling each coordinate): the "
                    "map is not invertible here, so it is not a valid reparametrization at this point. "
                    "Move away from the singular point."
                )
        return jac

    def check_inverse(self, theta: PyTree, rtol: float = 1e-5, atol: float = 1e-6) -> None:
        r"""Raise unless :math:`\varphi^{-1}(\varphi(\theta)) = \theta` at ``theta`` (a sanity check for user maps)."""
        back = self.inverse(self.forward(theta))
        check_same_structure(theta, back, f"{self.name}.inverse(forward(theta))", "theta")
        for a, b in zip(jax.tree_util.tree_leaves(theta), jax.tree_util.tree_leaves(back)):
            if not np.allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol):
                err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                raise GeometryError(
                    f"{self.name}: inverse(forward(theta)) differs from theta by up to {err:.3g}; "
                    "the inverse passed to Reparametrization is not the inverse of forward."
                )


# ---------------------------------------------------------------------------
# helpers for metric-like objects
# ---------------------------------------------------------------------------
def _apply_dense(matrix: jax.Array, v: PyTree) -> PyTree:
    flat_v, unravel = ravel(v)
    return unravel(matrix @ flat_v)


def _at_point(G: TensorAtPoint, at: PyTree | None, who: str) -> TensorAtPoint:
    """A :class:`Metric` field evaluated at the point ``at`` (its operator ``v -> G(at) v``); other forms as given."""
    if not isinstance(G, Metric):
        return G
    if at is None:
        raise GeometryError(
            f"{who}: the metric is a Metric, a field theta -> G(theta); say at which point to evaluate it: "
            f"{who}(metric, ..., at=params)."
        )
    return G.at(at)


def _as_operator(obj: TensorAtPoint, point: PyTree, what: str) -> Callable[[PyTree], PyTree]:
    """``v -> G v`` for a dense matrix (checked: square, finite, symmetric) or a callable."""
    if _is_matrix(obj):
        obj = _as_array(obj)
        check_square_matrix(obj, tree_size(point), what)
        check_finite(obj, what)
        check_symmetric(obj, what)
        return lambda v: _apply_dense(obj, v)
    if callable(obj):
        return obj
    raise GeometryError(
        f"{what} must be a dense square matrix or a callable v -> G v; got {type(obj).__name__}."
    )


def _singular_hint(phi: Reparametrization) -> str:
    return (
        f"The Jacobian of {phi.name} is singular or undefined at this point, so {phi.name} is not "
        "invertible there; move the point or use another reparametrization."
    )


# ---------------------------------------------------------------------------
# transformation rules (Kristiadi et al. 2023, Sec. 2.2)
# ---------------------------------------------------------------------------
def transform_function(phi: Reparametrization, h: Callable[[PyTree], Any]) -> Callable[[PyTree], Any]:
    r"""A function in ψ-coordinates: :math:`\hat h = h \circ \varphi^{-1}` (Kristiadi et al. 2023, rule (a)).

    .. math:: \hat h(\psi) = h(\varphi^{-1}(\psi)) = h(\theta).

    Unlike the other rules this needs no point: it returns the transformed
    function itself, whose value at :math:`\psi = \varphi(\theta)` is
    :math:`h(\theta)`.

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    h : callable
        A function of a θ-point (array or pytree).

    Returns
    -------
    callable
        :math:`\hat h`, a function of a ψ-point.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam, transform_function
    >>> h_psi = transform_function(reparam.log(), lambda t: jnp.sum(t**2))
    >>> round(float(h_psi(jnp.log(jnp.array([3.0])))), 4)  # h(3) = 9
    9.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, transformation rule (a). Taught in chapter 1,
    *Vectors vs covectors*.
    """
    return lambda psi: h(phi.inverse(psi))


def transform_vector(phi: Reparametrization, theta: PyTree, v: PyTree) -> PyTree:
    r"""Push a tangent vector forward: :math:`\hat v = J(\theta)\, v` (Kristiadi et al. 2023, rule (b)).

    .. math:: \hat v = J(\theta)\,v,\qquad J(\theta) = \partial\psi/\partial\theta.

    Computed by one ``jax.jvp`` through :math:`\varphi`; the result has the
    structure of :math:`\psi = \varphi(\theta)`.

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    theta : array or pytree
        The point, in θ-coordinates.
    v : array or pytree
        The tangent vector at ``theta``, structured like ``theta``.

    Returns
    -------
    array or pytree
        :math:`J(\theta)v`, structured like :math:`\psi`.

    Raises
    ------
    GeometryError
        If ``v`` does not match ``theta`` or is not finite, ``theta`` is outside the domain, or
        (eagerly) the Jacobian is singular at ``theta``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam, transform_vector
    >>> transform_vector(reparam.log(), jnp.array([2.0]), jnp.array([1.0]))  # d log(t) = dt / t
    Array([0.5], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, rule (b); Grosse (2022), CSC2541 lecture 3
    *Metrics* (pushforward). Taught in chapter 1, *Vectors vs covectors*.
    """
    check_same_structure(theta, v, "the vector v", "theta")
    check_finite(v, "the vector v")
    psi = phi.forward(theta)
    _, jv = phi.jvp(theta, v)
    if is_concrete(psi):
        # J must be invertible at theta: J^{-1} (J v) has to exist.
        _, back = jax.jvp(phi._inverse, (psi,), (jv,))
        check_finite(back, f"transform_vector({phi.name})", hint=_singular_hint(phi))
    check_finite(jv, f"transform_vector({phi.name})", hint=_singular_hint(phi))
    return jv


def transform_covector(phi: Reparametrization, theta: PyTree, omega: PyTree) -> PyTree:
    r"""Pull a covector back to ψ-coordinates: :math:`\hat\omega = J^{-\top}\omega` (Kristiadi et al. 2023, rule (c)).

    .. math:: \hat\omega = J^{-1}(\psi)^\top\omega,\qquad \nabla_\psi (L\circ\varphi^{-1}) = J^{-1}(\psi)^\top\nabla_\theta L.

    :math:`J^{-1}(\psi)` is the Jacobian of :math:`\varphi^{-1}`, so this is one
    ``jax.vjp`` through the inverse map, with no matrix inverse.  For a gradient
    this is the chain rule.

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    theta : array or pytree
        The point, in θ-coordinates.
    omega : array or pytree
        The covector at ``theta``, structured like ``theta``.

    Returns
    -------
    array or pytree
        :math:`J^{-\top}\omega`, structured like :math:`\psi`.

    Raises
    ------
    GeometryError
        If ``omega`` does not match ``theta`` or is not finite, ``theta`` is outside the domain, or the
        result is not finite (the inverse map is singular there).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam, transform_covector
    >>> transform_covector(reparam.log(), jnp.array([2.0]), jnp.array([1.0]))  # dt = t d(log t)
    Array([2.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, rule (c); Grosse (2022), CSC2541 lecture 3
    *Metrics* (the gradient is a covector). Taught in chapter 1, *Vectors vs covectors*.
    """
    check_same_structure(theta, omega, "the covector omega", "theta")
    check_finite(omega, "the covector omega")
    psi = phi.forward(theta)
    _, inverse_vjp = jax.vjp(phi._inverse, psi)
    (out,) = inverse_vjp(omega)
    check_finite(out, f"transform_covector({phi.name})", hint=_singular_hint(phi))
    return out


def _transform_two_form(phi: Reparametrization, theta: PyTree, form: TensorAtPoint, what: str) -> TensorAtPoint:
    form = _at_point(form, theta, "transform")
    psi = phi.forward(theta)
    if _is_matrix(form):
        check_square_matrix(form, tree_size(theta), what)
        check_finite(form, what)
        jinv = phi._dense_jacobian(phi._inverse, psi, "psi", max(DEFAULT_MAX_DENSE_SIZE, form.shape[0]))
        out = jinv.T @ form @ jinv
        return 0.5 * (out + out.T) if what == "the metric G" else out
    if not callable(form):
        raise GeometryError(
            f"{what} must be a dense square matrix or a callable v -> G v; got {type(form).__name__}."
        )

    def transformed(u: PyTree) -> PyTree:
        _, jinv_u = jax.jvp(phi._inverse, (psi,), (u,))
        _, inverse_vjp = jax.vjp(phi._inverse, psi)
        return inverse_vjp(form(jinv_u))[0]

    return transformed


def transform_metric(phi: Reparametrization, theta: PyTree, metric: TensorAtPoint) -> TensorAtPoint:
    r"""Transform a metric: :math:`\hat G = J^{-\top} G\, J^{-1}` (Kristiadi et al. 2023, rule (d)).

    .. math:: \hat G(\psi) = J^{-1}(\psi)^\top\, G(\theta)\, J^{-1}(\psi),\qquad \theta = \varphi^{-1}(\psi).

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    theta : array or pytree
        The point, in θ-coordinates.
    metric : array, callable or :class:`~minigeo.Metric`
        The metric at ``theta``: a dense symmetric positive-definite ``d x d`` matrix
        (flattened coordinates), a linear map ``v -> G v`` at ``theta``, or a :class:`~minigeo.Metric`
        field (evaluated at ``theta``; for the whole field in ψ-coordinates use
        :func:`transform_metric_field`).

    Returns
    -------
    array or callable
        The metric at :math:`\psi=\varphi(\theta)`: a dense matrix for a dense ``G``, otherwise
        a callable ``u -> Ĝ u`` computed by ``jvp`` and ``vjp`` through
        :math:`\varphi^{-1}` (never forming :math:`J`).

    Raises
    ------
    GeometryError
        If a dense ``G`` is not square of the right size or not symmetric positive definite, or the
        Jacobian is singular; a ``G`` that is neither a matrix nor callable.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam, transform_metric
    >>> transform_metric(reparam.scale(2.0), jnp.array([1.0]), jnp.eye(1))  # (1/2)^2
    Array([[0.25]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, rule (d). Taught in chapters 1, *Vectors vs
    covectors* and 2, *Pullback metrics*.
    """
    if _is_matrix(metric):
        check_square_matrix(metric, tree_size(theta), "the metric G")
        check_spd(metric, "the metric G")
    return _transform_two_form(phi, theta, metric, "the metric G")


def transform_bilinear(phi: Reparametrization, theta: PyTree, B: TensorAtPoint) -> TensorAtPoint:
    r"""Transform a bilinear form (e.g. a Hessian at a critical point): :math:`\hat B = J^{-\top} B J^{-1}`.

    .. math:: \hat B(\psi) = J^{-1}(\psi)^\top\, B(\theta)\, J^{-1}(\psi).

    Same rule as :func:`~minigeo.transform_metric` but with no positive-definiteness
    requirement (Kristiadi et al. 2023, Sec. 2.2 (d) and Sec. 3.1).

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    theta : array or pytree
        The point, in θ-coordinates.
    B : array, callable or :class:`~minigeo.Metric`
        The bilinear form at ``theta``: a dense square matrix (flattened coordinates), a
        callable ``v -> B v``, or a :class:`~minigeo.Metric` (evaluated at ``theta``).

    Returns
    -------
    array or callable
        :math:`\hat B` in the same form as ``B``.

    Raises
    ------
    GeometryError
        If a dense ``B`` is not square of the right size or not finite, the Jacobian is singular, or
        ``B`` is neither a matrix nor callable.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam, transform_bilinear
    >>> transform_bilinear(reparam.scale(2.0), jnp.array([1.0]), -jnp.eye(1))
    Array([[-0.25]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 rule (d) and Sec. 3.1 (the Hessian as a bilinear
    form). Taught in chapter 4, *Invariant Hessians*.
    """
    return _transform_two_form(phi, theta, B, "the bilinear form B")


def transform_endomorphism(phi: Reparametrization, theta: PyTree, E: TensorAtPoint) -> TensorAtPoint:
    r"""Transform a (1,1)-tensor such as :math:`E = G^{-1}H`: :math:`\hat E = J E J^{-1}` (Kristiadi et al. 2023, eq. 6).

    .. math:: \hat E(\psi) = J(\theta)\, E(\theta)\, J^{-1}(\psi),\qquad \theta = \varphi^{-1}(\psi).

    Its trace, determinant and eigenvalues are invariant.

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    theta : array or pytree
        The point, in θ-coordinates.
    E : array, callable or :class:`~minigeo.Metric`
        The endomorphism at ``theta``: a dense square matrix (flattened coordinates), a
        callable ``v -> E v``, or a :class:`~minigeo.Metric` (its operator at ``theta``).

    Returns
    -------
    array or callable
        :math:`\hat E` in the same form as ``E``.

    Raises
    ------
    GeometryError
        If a dense ``E`` is not square of the right size or not finite, the Jacobian is singular, or
        ``E`` is neither a matrix nor callable.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import reparam, transform_endomorphism
    >>> E = jnp.array([[2.0, 1.0], [0.0, 3.0]])
    >>> A = jnp.array([[1.0, 2.0], [0.0, 1.0]])
    >>> E_hat = transform_endomorphism(reparam.affine(A), jnp.zeros(2), E)
    >>> float(jnp.trace(E_hat))
    5.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (6), and App. A (the Hessian endomorphism
    transforms by similarity). Taught in chapter 4, *Invariant Hessians*.
    """
    E = _at_point(E, theta, "transform_endomorphism")
    psi = phi.forward(theta)
    if _is_matrix(E):
        check_square_matrix(E, tree_size(theta), "the endomorphism E")
        check_finite(E, "the endomorphism E")
        jac = phi._dense_jacobian(phi._forward, theta, "theta", max(DEFAULT_MAX_DENSE_SIZE, E.shape[0]))
        jinv = phi._dense_jacobian(phi._inverse, psi, "psi", max(DEFAULT_MAX_DENSE_SIZE, E.shape[0]))
        return jac @ E @ jinv
    if not callable(E):
        raise GeometryError(
            f"the endomorphism E must be a dense square matrix or a callable; got {type(E).__name__}."
        )

    def transformed(u: PyTree) -> PyTree:
        _, jinv_u = jax.jvp(phi._inverse, (psi,), (u,))
        return phi.jvp(theta, E(jinv_u))[1]

    return transformed


def transform_metric_field(phi: Reparametrization, metric: Metric | jax.Array | None) -> Metric:
    r"""A metric field in ψ-coordinates: :math:`\hat G(\psi) = J^{-\top} G(\varphi^{-1}(\psi)) J^{-1}`.

    .. math:: \hat G(\psi) = J^{-1}(\psi)^\top\, G(\varphi^{-1}(\psi))\, J^{-1}(\psi).

    Differentiable in ψ, so Christoffel symbols of the transformed metric can be taken by autodiff.

    Parameters
    ----------
    phi : :class:`~minigeo.Reparametrization`
        The reparametrization :math:`\varphi`.
    metric : :class:`~minigeo.Metric`, array or None
        The metric field in θ-coordinates: a :class:`~minigeo.Metric` (e.g.
        ``mg.metrics.dense(lambda t: G(t))``), a constant square matrix, or ``None`` (Euclidean).

    Returns
    -------
    :class:`~minigeo.Metric`
        The field on ψ-coordinates.  For a dense metric (:func:`~minigeo.metrics.dense`, a matrix,
        ``None``) a dense metric whose matrix is :math:`J^{-\top}(G(\theta) + \epsilon I)J^{-1}`,
        with :math:`J^{-1}` by forward-mode autodiff of :math:`\varphi^{-1}`; otherwise matrix-free,
        ``mv(psi, u)`` :math:`= J^{-\top}(G(\theta) + \epsilon I)J^{-1}u` by one ``jvp`` and one
        ``vjp`` through :math:`\varphi^{-1}`.  The damping :math:`\epsilon I` of ``metric`` is
        transformed with it; the new metric's own damping is 0.

    Raises
    ------
    GeometryError
        If ``metric`` is not a :class:`~minigeo.Metric`, a square matrix or ``None``; when the
        result is evaluated at a ψ-point outside the codomain or where :math:`\varphi^{-1}` is not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> # the Euclidean plane in (r, angle)
    >>> G_polar = mg.transform_metric_field(mg.reparam.polar(), None)
    >>> G_polar.dense(jnp.array([2.0, 0.3])).round(6)   # diag(1, r^2)
    Array([[1., 0.],
           [0., 4.]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, rule (d), applied at every point; Sec. 3.4. Taught
    in chapter 2, *Pullback metrics*.
    """
    metric = metric_field(metric, "transform_metric_field")
    if metric is not None and metric.matrix_fn is None:
        return _transformed_metric(phi, metric)
    matrix_at = _matrix_field(metric)

    def field(psi: PyTree) -> jax.Array:
        theta = phi.inverse(psi)
        flat_psi, unravel_psi = ravel(psi)
        jinv = jax.jacfwd(lambda f: ravel(phi._inverse(unravel_psi(f)))[0])(flat_psi)
        if matrix_at is None:
            return jinv.T @ jinv
        return jinv.T @ matrix_at(theta) @ jinv

    transformed = dense(field)
    name = "euclidean" if metric is None else metric.name
    return Metric(transformed.mv_fn, f"{name} in {phi.name} coordinates", compiled=False, matrix_fn=transformed.matrix_fn)


def _transformed_metric(phi: Reparametrization, metric: Metric) -> Metric:
    """The :class:`Metric` on ψ-coordinates: ``u -> J^{-T} (G + εI) J^{-1} u`` at θ = φ⁻¹(ψ), matrix-free."""

    def mv(psi: PyTree, u: PyTree) -> PyTree:
        theta, jinv_u = jax.jvp(phi._inverse, (psi,), (u,))
        _, inverse_vjp = jax.vjp(phi._inverse, psi)
        return inverse_vjp(metric.mv(theta, jinv_u))[0]

    return Metric(mv, f"{metric.name} in {phi.name} coordinates", compiled=metric.compiled)


# ---------------------------------------------------------------------------
# pushforward and pullback through arbitrary smooth maps
# ---------------------------------------------------------------------------
def pushforward(f: Callable[[PyTree], PyTree], x: PyTree, v: PyTree) -> PyTree:
    r"""Push a tangent vector forward through any smooth map: :math:`df_x\,v = J_f(x)\,v`.

    .. math:: df_x\,v = J_f(x)\,v,\qquad J_f(x) = \partial f/\partial x.

    ``f`` need not be invertible (e.g. a network mapping parameters to outputs);
    one ``jax.jvp``, so :math:`J_f` is never formed.

    Parameters
    ----------
    f : callable
        A smooth map of a point (array or pytree).
    x : array or pytree
        The point.
    v : array or pytree
        The tangent vector at ``x``, structured like ``x``.

    Returns
    -------
    array or pytree
        :math:`J_f(x)v`, structured like ``f(x)``.

    Raises
    ------
    GeometryError
        If ``v`` is not structured like ``x``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import pushforward
    >>> f = lambda w: jnp.array([w[0] * w[1]])
    >>> pushforward(f, jnp.array([2.0, 3.0]), jnp.array([1.0, 0.0]))
    Array([3.], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (pushforward of tangent vectors); Kristiadi, Dangel &
    Hennig (2023), Sec. 2.2. Taught in chapter 1, *Vectors vs covectors*.
    """
    check_same_structure(x, v, "the vector v", "the point x")
    return jax.jvp(f, (x,), (v,))[1]


def pullback_covector(f: Callable[[PyTree], PyTree], x: PyTree, omega: PyTree) -> PyTree:
    r"""Pull a covector on the outputs of ``f`` back to its inputs: :math:`f^*\omega = J_f(x)^\top \omega`.

    .. math:: (f^*\omega)(v) = \omega(J_f(x)\,v),\qquad f^*\omega = J_f(x)^\top\omega.

    This is backpropagation: one ``jax.vjp``.

    Parameters
    ----------
    f : callable
        A smooth map of a point (array or pytree).
    x : array or pytree
        The point.
    omega : array or pytree
        A covector on the outputs, structured like ``f(x)``.

    Returns
    -------
    array or pytree
        :math:`J_f(x)^\top\omega`, structured like ``x``.

    Raises
    ------
    GeometryError
        If ``omega`` is not structured like ``f(x)``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import pullback_covector
    >>> f = lambda w: jnp.array([w[0] * w[1]])
    >>> pullback_covector(f, jnp.array([2.0, 3.0]), jnp.array([1.0]))
    Array([3., 2.], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (pullback of covectors, backpropagation); Kristiadi,
    Dangel & Hennig (2023), Sec. 2.2. Taught in chapter 1, *Vectors vs covectors*.
    """
    out, f_vjp = jax.vjp(f, x)
    check_same_structure(out, omega, "the covector omega", "f(x)")
    return f_vjp(omega)[0]


# ---------------------------------------------------------------------------
# pairings and the musical isomorphisms
# ---------------------------------------------------------------------------
def pair(omega: PyTree, v: PyTree) -> jax.Array:
    r"""The action of a covector on a vector, :math:`\omega(v) = \sum_i \omega_i v^i`; invariant under reparametrization.

    .. math:: \omega(v) = \omega^\top v = \hat\omega^\top\hat v.

    Parameters
    ----------
    omega : array or pytree
        The covector.
    v : array or pytree
        The vector, structured like ``omega``.

    Returns
    -------
    jax.Array
        The scalar :math:`\omega^\top v`.

    Raises
    ------
    GeometryError
        If ``v`` is not structured like ``omega``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import pair
    >>> float(pair(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])))
    11.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, Example 3(b) (a covector acting on a vector is
    invariant). Taught in chapter 1, *Vectors vs covectors*.
    """
    check_same_structure(omega, v, "the vector v", "the covector omega")
    return tree_vdot(omega, v)


def inner(metric: TensorAtPoint, u: PyTree, v: PyTree, *, at: PyTree | None = None) -> jax.Array:
    r"""The inner product :math:`\langle u, v\rangle_G = u^\top G v` of two vectors under a metric.

    .. math:: \langle u, v\rangle_G = u^\top G\, v.

    Parameters
    ----------
    metric : array, callable or :class:`~minigeo.Metric`
        The metric at one point: a dense symmetric ``d x d`` matrix over the flattened coordinates,
        a linear map ``v -> G v`` at that point, or a :class:`~minigeo.Metric` field evaluated at ``at``.
    u, v : array or pytree
        The two vectors, of the same structure (a list of numbers is converted to an array).
    at : pytree, optional
        The point :math:`\theta` at which a :class:`~minigeo.Metric` ``G`` is evaluated (required
        for one; unused otherwise).

    Returns
    -------
    jax.Array
        The scalar :math:`u^\top G v`.

    Raises
    ------
    GeometryError
        If ``u`` and ``v`` differ in structure, a dense ``G`` is not square of the right size,
        finite and symmetric, or ``G`` is a :class:`~minigeo.Metric` and ``at`` is missing.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import inner
    >>> v = jnp.array([1.0, 1.0])
    >>> float(inner(jnp.diag(jnp.array([1.0, 4.0])), v, v))
    5.0
    >>> import minigeo as mg
    >>> G = mg.metrics.diagonal(lambda p: p**2)                   # a metric field
    >>> float(inner(G, jnp.ones(2), jnp.ones(2), at=jnp.array([1.0, 2.0])))
    5.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2, Example 3(c) (the metric as an inner product on
    tangent spaces). Taught in chapter 1, *Vectors vs covectors*.
    """
    u, v = _as_array(u), _as_array(v)
    check_same_structure(u, v, "the vector v", "the vector u")
    return tree_vdot(u, flat(_at_point(metric, at, "inner"), v))


def flat(metric: TensorAtPoint, v: PyTree, *, at: PyTree | None = None) -> PyTree:
    r"""Lower an index, :math:`v^\flat = G v`: the covector :math:`\langle v, \cdot\rangle_G`.

    .. math:: v^\flat = G\,v,\qquad v^\flat(u) = \langle v, u\rangle_G.

    Parameters
    ----------
    metric : array, callable or :class:`~minigeo.Metric`
        The metric at one point: a dense matrix over the flattened coordinates of ``v`` (an array
        or a nested list; it must be symmetric to round-off), a linear map ``v -> G v`` at that
        point, or a :class:`~minigeo.Metric` field evaluated at ``at``.
    v : array or pytree
        The vector (a list of numbers is converted to an array).
    at : pytree, optional
        The point :math:`\theta` at which a :class:`~minigeo.Metric` ``G`` is evaluated (required
        for one; unused otherwise).

    Returns
    -------
    array or pytree
        The covector :math:`Gv`, structured like ``v``.

    Raises
    ------
    GeometryError
        If ``v`` is not finite, a dense ``G`` is not square of the right size, finite and symmetric,
        ``G v`` is not structured like ``v``, or ``G`` is a :class:`~minigeo.Metric` and ``at`` is missing.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import flat
    >>> flat(jnp.diag(jnp.array([1.0, 4.0])), jnp.array([1.0, 1.0]))
    Array([1., 4.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (index lowering by the metric). Taught in chapter 1,
    *Vectors vs covectors*.
    """
    v = _as_array(v)
    check_finite(v, "the vector v")
    out = _as_operator(_at_point(metric, at, "flat"), v, "the metric G")(v)
    check_same_structure(v, out, "G v", "the vector v")
    return out


def sharp(
    metric: TensorAtPoint,
    omega: PyTree,
    *,
    damping: Any = 0.0,
    tol: float = 1e-6,
    maxiter: int | None = None,
    return_info: bool = False,
    at: PyTree | None = None,
) -> PyTree:
    r"""Raise an index, :math:`\omega^\sharp = (G + \epsilon I)^{-1}\omega`: the vector dual to a covector.

    .. math:: \omega^\sharp = (G + \epsilon I)^{-1}\omega,\qquad \operatorname{grad} L = G^{-1}\nabla L.

    Applied to the differential :math:`\nabla L` this gives the Riemannian
    gradient :math:`G^{-1}\nabla L`.

    Parameters
    ----------
    metric : array, callable or :class:`~minigeo.Metric`
        The metric at one point: a dense symmetric positive-definite matrix (solved by Cholesky; its
        symmetry and positive definiteness are checked eagerly, by its eigenvalues, and under
        ``jit`` by a symmetry test and the Cholesky pivots, reported in the status),
        a linear map ``v -> G v`` at that point (solved by conjugate gradients, with a
        convergence check and a curvature check :math:`p^\top G p > 0` at every step),
        or a :class:`~minigeo.Metric` field evaluated at ``at`` (solved by
        :meth:`Metric.solve <minigeo.Metric.solve>` with ``method="cg"``, with the metric's own
        damping plus ``damping``).
    omega : array or pytree
        The covector (a list of numbers is converted to an array).
    damping : float or jax.Array, optional
        :math:`\epsilon \ge 0` added to the diagonal (the operator :math:`G + \epsilon I`); use it
        for singular metrics.  A number, NumPy scalar, 0-d array or traced value.
    tol : float, optional
        Conjugate-gradient relative tolerance, in ``(0, 1)`` (matrix-free only; validated always).
        ``converged`` means the true relative residual is at most ``tol``.
    maxiter : int, optional
        Conjugate-gradient iteration limit, a positive int (matrix-free only; validated always).
    return_info : bool, optional
        If ``True``, return ``(omega_sharp, info)`` with a ``SolveInfo`` (``converged``,
        ``status``, ...; see :meth:`~minigeo.Metric.solve`), the way to check a solve
        under ``jit``, where nothing can be raised.  A matrix found not positive definite
        (status 2) or, on the dense path, not symmetric (status 5) then gives NaN, never a
        finite wrong answer.
    at : pytree, optional
        The point :math:`\theta` at which a :class:`~minigeo.Metric` ``G`` is evaluated (required
        for one; unused otherwise).

    Returns
    -------
    array or pytree, or tuple
        :math:`\omega^\sharp`, structured like ``omega``; with ``return_info``, ``(omega_sharp, info)``.

    Raises
    ------
    GeometryError
        If ``omega`` is not finite, a dense ``G`` is not symmetric positive definite, (eagerly) the
        conjugate-gradient solve does not converge or finds the operator indefinite or singular,
        ``G`` is a :class:`~minigeo.Metric` and ``at`` is missing, ``tol`` is not in ``(0, 1)``, or
        ``maxiter`` is not a positive int or ``None``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from minigeo import sharp
    >>> sharp(jnp.diag(jnp.array([1.0, 4.0])), jnp.array([1.0, 4.0]))
    Array([1., 1.], dtype=float32)
    >>> import minigeo as mg
    >>> G = mg.metrics.diagonal(lambda p: p**2)
    >>> sharp(G, jnp.array([1.0, 4.0]), at=jnp.array([1.0, 2.0])).round(4)
    Array([1., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (the isomorphism :math:`\omega \mapsto G^{-1}\omega`;
    grad L is :math:`G^{-1}\nabla L`); Grosse (2022), CSC2541 lecture 3 *Metrics*. Chapter 1.
    """
    check_solver_options(tol, maxiter, "sharp")
    omega = _as_array(omega)
    check_finite(omega, "the covector omega")
    G = metric
    if isinstance(G, Metric):
        _at_point(G, at, "sharp")  # raises when the point is missing
        check_damping(damping)
        damped = G if _is_zero(damping) else G.with_damping(G.damping + damping)
        return damped.solve(at, omega, method="cg", tol=tol, maxiter=maxiter, return_info=return_info)
    if _is_matrix(G):
        return solve_spd_dense(_as_array(G), omega, damping=damping, what="the metric G", return_info=return_info)
    op = _as_operator(G, omega, "the metric G")
    return solve_spd_cg(
        op, omega, damping=damping, tol=tol, maxiter=maxiter, what="the metric G", return_info=return_info
    )

r"""Natural gradients, also for overparametrized models (floor 3, chapter 3).

For a parametrization :math:`\phi: \Xi \to \mathcal Z` of a model
:math:`\mathcal M = \phi(\Xi)` inside a Riemannian manifold :math:`(\mathcal Z, g)`,
the coordinate vectors :math:`\partial_i = d\phi_\xi(e_i)` have the **Gram matrix**
:math:`G_{ij}(\xi) = g(\partial_i, \partial_j) = (J^\top g J)_{ij}`.  When the model is
overparametrized, :math:`G` is singular and the **natural parameter gradient** uses
the Moore-Penrose inverse, :math:`G^+\nabla_\xi L` (van Oostrum et al. 2023, Def. 3).

Theorem 1 of van Oostrum et al. 2023: its pushforward :math:`d\phi_\xi\,G^+\nabla_\xi L` is the
:math:`g`-orthogonal projection of the ambient gradient :math:`\mathrm{grad}^{\mathcal Z}L`
onto :math:`\mathrm{span}\{\partial_i\}` (:func:`span_projection`), hence the natural
gradient on the model wherever the parametrization is proper.

For network-sized parameter pytrees, :func:`natural_gradient` solves
:math:`(G + \epsilon I)\,x = \nabla L` matrix-free by conjugate gradients, and
:func:`precondition_by_metric` wraps it as an optax gradient transformation.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ._checks import (
    GeometryError,
    as_float_point,
    check_finite,
    check_same_structure,
    check_spd,
    check_square_matrix,
    check_symmetric,
    is_concrete,
    is_symmetric_to_roundoff,
    symmetry_rtol,
)
from ._linalg import SolveInfo, check_damping, check_solver_options, solve_spd_dense
from ._status import Status
from ._tree import DEFAULT_MAX_DENSE_SIZE, PyTree, check_dense_size, ravel, tree_size
from ._metric import Metric, _matrix_field, metric_field

__all__ = [
    "gram_matrix",
    "moore_penrose_inverse",
    "natural_parameter_gradient",
    "span_projection",
    "natural_gradient",
    "precondition_by_metric",
]



def _flat_jacobian(param_map: Callable[[PyTree], PyTree], xi: PyTree, max_size: int) -> jax.Array:
    flat_xi, unravel = ravel(xi)
    check_dense_size(flat_xi.size, max_size, "The Jacobian of the parametrization")
    return jax.jacfwd(lambda f: ravel(param_map(unravel(f)))[0])(flat_xi)


def gram_matrix(
    param_map: Callable[[PyTree], PyTree],
    metric: Metric | jax.Array | None,
    xi: PyTree,
    *,
    max_size: int = DEFAULT_MAX_DENSE_SIZE,
) -> jax.Array:
    r"""The Gram matrix of the coordinate vectors of a parametrization :math:`\phi`.

    .. math:: G_{ij}(\xi) = g_{\phi(\xi)}\big(\partial_i(\xi), \partial_j(\xi)\big) = (J^\top g\,J)_{ij},
        \qquad \partial_i(\xi) = d\phi_\xi(e_i),\quad J = d\phi_\xi.

    Parameters
    ----------
    param_map : callable
        The parametrization :math:`\phi`, mapping a parameter pytree to a point of
        :math:`\mathcal Z` (array or pytree, flattened for the metric).
    metric : :class:`~minigeo.Metric`, array or None
        The metric :math:`g` on :math:`\mathcal Z`: a :class:`~minigeo.Metric` (e.g.
        ``mg.metrics.dense(lambda z: g(z))``), a constant square matrix, or ``None`` (Euclidean).
    xi : pytree
        The parameters.
    max_size : int, optional
        Largest number of parameter coordinates for which the dense Jacobian is built.

    Returns
    -------
    jax.Array
        The ``(d, d)`` Gram matrix over the flattened parameter coordinates.

    Raises
    ------
    GeometryError
        If the parameters exceed ``max_size``, the Jacobian is not finite, or the metric on
        :math:`\mathcal Z` is not a square symmetric positive-definite matrix of matching size.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> # van Oostrum et al. 2023, App. A.2
    >>> phi = lambda xi: jnp.array([jnp.sin(2 * xi[0]), jnp.sin(xi[0])])
    >>> mg.gram_matrix(phi, None, jnp.array([0.0]))
    Array([[5.]], dtype=float32)

    References
    ----------
    van Oostrum, Müller & Ay (2023), Sec. 2 (Gram matrix :math:`G(\xi)`). Chapter 3.
    """
    metric = metric_field(metric, "gram_matrix")
    J = _flat_jacobian(param_map, xi, max_size)
    check_finite(J, "The Jacobian of the parametrization")
    if metric is None:
        return J.T @ J
    z = param_map(xi)
    g = _matrix_field(metric)(z)
    check_square_matrix(g, J.shape[0], "the metric on Z")
    check_spd(g, "the metric on Z", rtol=symmetry_rtol(g))
    return J.T @ g @ J


def moore_penrose_inverse(matrix: jax.Array, rcond: float | None = None) -> jax.Array:
    r"""The Moore-Penrose inverse :math:`A^+` of a symmetric matrix (``jnp.linalg.pinv``, Hermitian path).

    .. math:: AA^+A = A,\qquad A^+AA^+ = A^+,\qquad (AA^+)^\top = AA^+,\qquad (A^+A)^\top = A^+A.

    The Hermitian path reads one triangle of ``matrix`` only, so a non-symmetric matrix would give
    the pseudo-inverse of another matrix: its symmetry is checked (to ``max(64 n, 1000) eps``
    relative to ``max |A|``), eagerly by an error and under ``jit`` by an all-NaN result.

    Parameters
    ----------
    matrix : array
        A symmetric ``(n, n)`` matrix, e.g. a singular Gram matrix.
    rcond : float, optional
        Singular values below ``rcond`` times the largest are treated as zero (default:
        ``10 * n * eps`` of the dtype).

    Returns
    -------
    jax.Array
        :math:`A^+`, of shape ``(n, n)``; all NaN under ``jit`` when ``matrix`` is not symmetric.

    Raises
    ------
    GeometryError
        If ``matrix`` is not square or not finite, or (eagerly) not symmetric.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.moore_penrose_inverse(jnp.array([[1.0, 1.0], [1.0, 1.0]])).round(4)
    Array([[0.25, 0.25],
           [0.25, 0.25]], dtype=float32)

    References
    ----------
    van Oostrum, Müller & Ay (2023), Sec. 2, Def. 2 (generalised inverse) and the MP inverse. Chapter 3.
    """
    check_square_matrix(matrix, None, "the Gram matrix")
    check_finite(matrix, "the Gram matrix")
    check_symmetric(matrix, "the Gram matrix")
    matrix = jnp.asarray(matrix)
    n = matrix.shape[0]
    rtol = rcond if rcond is not None else 10 * n * jnp.finfo(matrix.dtype).eps
    pinv = jnp.linalg.pinv(matrix, rtol=rtol, hermitian=True)
    if is_concrete(matrix):
        return pinv
    return jnp.where(is_symmetric_to_roundoff(matrix), pinv, jnp.nan)  # under jit: NaN, never a wrong inverse


def natural_parameter_gradient(gram: jax.Array, grad: PyTree, rcond: float | None = None) -> PyTree:
    r"""The natural parameter gradient with the Moore-Penrose inverse of the Gram matrix.

    .. math:: \tilde\nabla_\xi L = G^+(\xi)\,\nabla_\xi L.

    Among all :math:`y` with :math:`Gy = \nabla L` (when one exists) it is the one of smallest
    Euclidean norm, which is why it depends on the parametrization even though its pushforward
    does not (van Oostrum et al. 2023, Sec. 3.2).

    Parameters
    ----------
    gram : array
        The ``(d, d)`` Gram matrix over the flattened coordinates of ``grad``.
    grad : pytree
        The Euclidean gradient :math:`\nabla_\xi L` (any pytree with ``d`` entries in all).
    rcond : float, optional
        Cut-off of :func:`~minigeo.moore_penrose_inverse`.

    Returns
    -------
    pytree
        :math:`G^+\nabla_\xi L`, with the structure of ``grad``; NaN under ``jit`` when ``gram`` is
        not symmetric.

    Raises
    ------
    GeometryError
        If ``gram`` is not a square matrix matching ``grad``, either is not finite, or (eagerly)
        ``gram`` is not symmetric (to ``max(64 d, 1000) eps`` relative to ``max |G|``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G = jnp.array([[1.0, 1.0], [1.0, 1.0]])             # van Oostrum et al. 2023, App. A.3
    >>> mg.natural_parameter_gradient(G, jnp.array([6.0, 6.0])).round(4)
    Array([3., 3.], dtype=float32)

    References
    ----------
    van Oostrum, Müller & Ay (2023), Def. 3, eq. (7). Chapter 3.
    """
    flat_grad, unravel = ravel(grad)
    check_square_matrix(gram, flat_grad.size, "the Gram matrix")
    check_finite(flat_grad, "the gradient")
    return unravel(moore_penrose_inverse(gram, rcond) @ flat_grad)


def span_projection(tangents: jax.Array, metric: jax.Array | None, v: jax.Array) -> jax.Array:
    r"""The :math:`g`-orthogonal projection of ``v`` onto the span of the columns of ``tangents``.

    .. math:: \Pi v = T\,(T^\top g\,T)^+\,T^\top g\,v.

    With ``tangents`` the Jacobian :math:`J` of a parametrization (columns :math:`\partial_i`) and
    ``v`` the ambient gradient :math:`g^{-1}dL`, this is the right-hand side of Theorem 1, eq. (8).

    Parameters
    ----------
    tangents : array
        The ``(m, d)`` matrix :math:`T` whose columns span the subspace.
    metric : array or None
        The ``(m, m)`` metric :math:`g`; ``None`` means Euclidean.
    v : array
        The ``(m,)`` vector to project.

    Returns
    -------
    jax.Array
        :math:`\Pi v`, of shape ``(m,)``.

    Raises
    ------
    GeometryError
        If the shapes do not match or the Gram matrix :math:`T^\top g\,T` is not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.span_projection(jnp.array([[1.0], [0.0]]), None, jnp.array([3.0, 4.0]))
    Array([3., 0.], dtype=float32)

    References
    ----------
    van Oostrum, Müller & Ay (2023), Theorem 1, eq. (8) (pushforward = projection). Chapter 3.
    """
    tangents = jnp.asarray(tangents)
    v = jnp.asarray(v)
    if tangents.ndim != 2 or v.shape != (tangents.shape[0],):
        raise GeometryError(
            f"span_projection: tangents must be an (m, d) matrix and v an (m,) vector; got {tangents.shape} "
            f"and {v.shape}."
        )
    g = jnp.eye(tangents.shape[0], dtype=tangents.dtype) if metric is None else jnp.asarray(metric)
    check_square_matrix(g, tangents.shape[0], "the metric")
    gram = tangents.T @ g @ tangents
    return tangents @ (moore_penrose_inverse(gram) @ (tangents.T @ (g @ v)))


def natural_gradient(
    metric: Metric,
    params: PyTree,
    grad: PyTree,
    *,
    damping: Any = 0.0,
    solver: str | None = None,
    tol: float = 1e-6,
    maxiter: int | None = None,
    rcond: float | None = None,
    max_size: int = DEFAULT_MAX_DENSE_SIZE,
    return_info: bool = False,
) -> PyTree | tuple[PyTree, SolveInfo]:
    r"""The (damped) natural gradient for a :class:`~minigeo.Metric`.

    .. math:: \tilde\nabla L = (G(\theta) + \epsilon I)^{-1}\nabla L(\theta).

    Parameters
    ----------
    metric : :class:`~minigeo.Metric`
        The metric, e.g. ``mg.ggn(model, loss)`` or ``mg.fisher(model)``.
    params, grad : pytree
        The point and the gradient (pytrees of the same structure).
    damping : float or array, optional
        :math:`\epsilon \ge 0`, **added** to the metric's own operator: the solve uses
        ``metric.mv + ε I``, i.e. :math:`G + (\mu + \epsilon) I` for a metric made with
        ``with_damping(μ)``.  So for an undamped ``G``, ``natural_gradient(G, p, g, damping=ε)``
        equals ``G.with_damping(ε).solve(p, g)``.  A Python number, NumPy scalar, 0-d
        array or a traced value (e.g. a ``jit`` argument); negative or NaN values raise
        :class:`~minigeo.GeometryError` when concrete.
    solver : {"factored", "cg", "dense", "pinv"}, optional
        ``"factored"`` (the default for a metric with a factored inverse, :func:`~minigeo.kfac` and
        :func:`~minigeo.ekfac`): the exact solve through its factors; ``"cg"`` (the default
        otherwise): matrix-free conjugate gradients, for network-sized pytrees; ``"dense"``:
        Cholesky on the dense matrix; ``"pinv"``: the Moore-Penrose natural parameter gradient
        :math:`(G + \epsilon I)^+\nabla L` (dense, for singular metrics without damping).
    tol : float, optional
        CG relative tolerance, in ``(0, 1)``: ``converged`` means the true relative residual
        :math:`\lVert\nabla L - (G + \epsilon I)x\rVert / \lVert\nabla L\rVert \le` ``tol`` (raised to
        at least the dtype's ``eps``).  Scale-free: the direction scales linearly with ``grad``
        down to the smallest normal float (a float32 gradient of norm ``1e-30`` included).
    maxiter : int, optional
        CG iteration limit, a positive int (default ``10 d``).
    rcond : float, optional
        Cut-off for ``"pinv"``.
    max_size : int, optional
        Largest number of parameters for the dense solvers.
    return_info : bool, optional
        If ``True``, return ``(direction, info)`` with a ``SolveInfo`` named tuple
        (``converged``, ``status``, ``iterations``, ``residual``, ``curvature``; see
        :meth:`~minigeo.Metric.solve`): the way to check a solve under ``jit``.  ``"dense"``
        reports the symmetry test and the Cholesky pivots (status 5 or 2, with a NaN direction),
        ``"pinv"`` the symmetry test (status 5, NaN direction).

    Returns
    -------
    pytree or tuple
        The direction, with the structure of ``params``; ``(direction, info)`` if ``return_info``.

    Raises
    ------
    GeometryError
        Eagerly: if CG does not converge (typically a singular metric without
        damping), meets non-positive curvature (the metric is not positive definite),
        or the dense matrix is not positive definite: the message suggests damping or
        ``solver="pinv"``; also for non-finite parameters or gradients.  Under ``jit``
        nothing can be raised: check ``info.converged`` (``return_info=True``); a metric
        found not positive definite (or, dense, not symmetric) gives a NaN direction.  Also if
        ``metric`` is not a :class:`~minigeo.Metric`, ``solver`` is unknown, a dense solve exceeds
        ``max_size``, ``tol`` is not in ``(0, 1)`` or ``maxiter`` is not a positive int or ``None``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 0.0], [0.0, 2.0]])
    >>> G = mg.ggn(lambda w: X @ w, lambda z: 0.5 * jnp.sum(z**2))   # G = X^T X
    >>> mg.natural_gradient(G, jnp.zeros(2), jnp.array([1.0, 4.0]), solver="dense")
    Array([1., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.2 (the flow :math:`\dot\theta = -G^{-1}\nabla L`); Amari (1998). Chapter 3.
    """
    if not isinstance(metric, Metric):
        raise GeometryError(
            f"natural_gradient needs a minigeo Metric (e.g. mg.ggn(model, loss)); got {type(metric).__name__}. "
            "For a dense Gram matrix use natural_parameter_gradient(gram, grad)."
        )
    check_solver_options(tol, maxiter, "natural_gradient")
    try:
        params = as_float_point(params, "params")
        grad = as_float_point(grad, "the gradient")
        check_damping(damping)
    except GeometryError as err:
        raise GeometryError(f"natural_gradient: {err}") from None
    check_same_structure(params, grad, "the gradient", "params")
    check_finite(params, "params")
    check_finite(grad, "the gradient")
    damped = metric.with_damping(metric.damping + damping)
    if solver is None:
        solver = "cg" if metric.solve_fn is None else "factored"
    if solver == "factored":
        if metric.solve_fn is None:
            raise GeometryError(
                f"natural_gradient: solver='factored' needs a metric with a factored inverse (mg.kfac, mg.ekfac); "
                f"the {metric.name} metric has none: use solver='cg'."
            )
        return damped.solve(params, grad, method="factored", return_info=return_info)
    if solver == "cg":
        try:
            return damped.solve(params, grad, method="cg", tol=tol, maxiter=maxiter, return_info=return_info)
        except GeometryError as err:
            raise GeometryError(
                f"natural_gradient: {err} For an overparametrized model the metric is singular: use damping > 0, "
                'or solver="pinv" for the Moore-Penrose natural parameter gradient on small models.'
            ) from None
    check_dense_size(tree_size(params), max_size, f"The {metric.name} metric")
    if solver == "dense":
        return solve_spd_dense(
            damped.dense(params, max_size=max_size), grad, what=f"the {metric.name} metric", return_info=return_info
        )
    if solver != "pinv":
        raise GeometryError(
            f"natural_gradient: solver must be 'factored', 'cg', 'dense' or 'pinv', got {solver!r}."
        )
    G = damped.dense(params, max_size=max_size)
    x = natural_parameter_gradient(G, grad, rcond=rcond)
    if not return_info:
        return x
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(x))
    symmetric = is_symmetric_to_roundoff(G)
    status = jnp.where(symmetric, Status.OK, Status.NOT_SYMMETRIC).astype(jnp.int32)
    zero = jnp.zeros((), dtype)
    return x, SolveInfo(symmetric, status, jnp.zeros((), jnp.int32), jnp.where(symmetric, zero, jnp.nan), zero)


class PreconditionState(NamedTuple):
    """State of :func:`precondition_by_metric` (it keeps none)."""


def precondition_by_metric(
    metric: Metric,
    damping: Any = 1e-3,
    *,
    solver: str = "cg",
    tol: float = 1e-6,
    maxiter: int | None = None,
) -> Any:
    r"""An optax gradient transformation that preconditions updates by the (damped) metric.

    .. math:: g \mapsto (G(\theta) + \epsilon I)^{-1} g.

    Chain it with a learning rate to get natural-gradient descent:
    ``optax.chain(mg.precondition_by_metric(G, 1e-3), optax.sgd(0.1))``.
    ``update`` needs ``params``.  ``damping`` is added to the metric's own damping,
    as in :func:`natural_gradient`.  Under ``jit`` the convergence check of CG
    cannot raise; a metric found not positive definite gives NaN updates, and a
    solve that reaches ``maxiter`` gives its last iterate: check a step eagerly
    once, or call :func:`natural_gradient` with ``return_info=True``.

    Parameters
    ----------
    metric : :class:`~minigeo.Metric`
        The metric :math:`G`.
    damping : float or array, optional
        :math:`\epsilon \ge 0`, added to the metric's own damping.
    solver : {"cg", "dense", "pinv"}, optional
        As in :func:`~minigeo.natural_gradient`.
    tol : float, optional
        CG relative tolerance, in ``(0, 1)``.
    maxiter : int, optional
        CG iteration limit, a positive int.

    Returns
    -------
    optax.GradientTransformation
        ``init(params)`` and ``update(updates, state, params)``; the state is empty.

    Raises
    ------
    GeometryError
        If ``tol`` is not in ``(0, 1)`` or ``maxiter`` not a positive int or ``None``; from ``update``:
        if ``params`` is missing, or as :func:`~minigeo.natural_gradient` raises.

    Examples
    --------
    >>> import jax.numpy as jnp, optax
    >>> import minigeo as mg
    >>> G = mg.metrics.diagonal(jnp.array([2.0, 4.0]))
    >>> opt = mg.precondition_by_metric(G, damping=0.0, solver="dense")
    >>> updates, _ = opt.update(jnp.array([2.0, 4.0]), opt.init(jnp.zeros(2)), jnp.zeros(2))
    >>> updates.round(4)
    Array([1., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.2 (equivariant preconditioned gradient descent). Chapters 3 and 4.
    """
    check_solver_options(tol, maxiter, "precondition_by_metric")
    import optax  # optional dependency, imported only when used

    def init_fn(params: PyTree) -> PreconditionState:
        return PreconditionState()

    def update_fn(updates: PyTree, state: PreconditionState, params: PyTree | None = None):
        if params is None:
            raise GeometryError("precondition_by_metric: update() needs params (the metric depends on them).")
        direction = natural_gradient(
            metric, params, updates, damping=damping, solver=solver, tol=tol, maxiter=maxiter
        )
        return direction, state

    return optax.GradientTransformation(init_fn, update_fn)

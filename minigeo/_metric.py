r"""The one metric type, :class:`~minigeo.Metric`, and its converter :func:`as_metric` (floor 1, chapter 2).

A metric field :math:`\theta \mapsto G(\theta)` given by matrix-vector products, a pytree whose
only leaf is its damping; the simple fields (:func:`euclidean`, :func:`~minigeo.metrics.diagonal`, :func:`dense`);
and :func:`as_metric`, which turns a matrix, a matrix field, a product function or an operator at
one point into a :class:`~minigeo.Metric`.  It sits below every module that takes a metric
(:mod:`minigeo.coords` evaluates it at a point, :mod:`minigeo.metrics` builds the pullback family
on it, the floors above solve with it); re-exported by :mod:`minigeo.metrics` and :mod:`minigeo`.
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import (
    GeometryError,
    as_array,
    as_float_point,
    check_finite,
    check_same_structure,
    check_spd,
    check_symmetric,
    is_concrete,
    is_matrix,
    symmetry_rtol,
)
from ._compile import compiled
from ._linalg import (
    SolveInfo,
    _is_zero,
    add_damping,
    check_cg_solution,
    check_solver_options,
    check_damping,
    solve_spd_cg,
    solve_spd_dense,
)
from ._status import raise_for_status
from ._tree import DEFAULT_MAX_DENSE_SIZE, PyTree, check_dense_size, ravel, tree_size, tree_vdot

MvFn = Callable[[PyTree, PyTree], PyTree]


@dataclass(frozen=True)
class Metric:
    r"""A metric field :math:`\theta \mapsto G(\theta)` given by matrix-vector products.

    .. math:: v \mapsto (G(\theta) + \epsilon I)\,v,\qquad \langle u, v\rangle_{G(\theta)} = u^\top G(\theta)\,v.

    Parameters
    ----------
    mv_fn : callable
        ``mv_fn(params, v)`` returns :math:`G(\theta) v` (without damping).
    name : str, optional
        Shown in error messages.
    damping : float or array, optional
        :math:`\epsilon \ge 0`; :meth:`mv` returns :math:`(G + \epsilon I) v`, with :math:`G` the
        operator of ``mv_fn``.  A Python number, NumPy scalar, 0-d JAX array or a traced
        value; negative or NaN values raise :class:`GeometryError` (when concrete).
    compiled : bool, optional
        ``True`` (default): eager :meth:`mv` calls are traced afresh and compiled once per traced
        program (see *Compilation* below).  ``False``: run ``mv_fn`` op by op, for product
        functions whose value checks need concrete arrays (:func:`~minigeo.metrics.diagonal`, :func:`dense`).
    diagonal_fn : callable, optional
        A structure tag (as lineax's): ``params -> w``, the positive diagonal of :math:`G(\theta)`
        as a pytree like the parameters, when the metric is diagonal (:func:`~minigeo.metrics.diagonal`,
        :func:`euclidean`).  Solves with :math:`G + \epsilon I` are then exact and elementwise,
        :math:`v / (w + \epsilon)`, instead of conjugate gradients.
    solve_fn : callable, optional
        A structure tag: ``(params, rhs, damping) -> (x, status)`` with :math:`x = (G(\theta) +
        \epsilon I)^{-1}\,\mathrm{rhs}` exactly, for a metric with a factored inverse (the
        Kronecker-factored metrics of ``minigeo.kronecker``), and a :class:`~minigeo.Status` code
        (``x`` NaN unless it is 0).  :meth:`solve` then uses it instead of conjugate gradients.

    Raises
    ------
    GeometryError
        If ``mv_fn`` is not callable, or ``damping`` is not a scalar or (when concrete) negative or NaN.

    Notes
    -----
    **One meaning of damping** throughout minigeo: damping :math:`\epsilon` is always *added*,
    the operator :math:`G + \epsilon I`.  :meth:`with_damping` sets the metric's own damping
    (``G.with_damping(a).with_damping(b)`` has damping ``b``, not ``a + b``), and
    :func:`~minigeo.natural_gradient` ``(metric, ..., damping=c)`` solves with
    ``metric.mv + c I``, i.e. :math:`G + (\epsilon + c) I`; so for an undamped ``G``,
    ``natural_gradient(G, p, g, damping=c)`` equals ``G.with_damping(c).solve(p, g)``.

    **A pytree.**  ``damping`` is a leaf and ``mv_fn``, ``name``, ``compiled`` are static, so a
    metric can be passed to a jitted function and its damping changed without recompiling.

    **Compilation.**  Every eager :meth:`mv` and :meth:`solve` call traces ``mv_fn`` afresh, so
    whatever it reads (a global at any depth, an attribute, a dict entry, a NumPy array changed
    in place) is read now, never a stale value; the compiled program is reused whenever the
    traced program is the same, with the arrays ``mv_fn`` closes over passed as arguments.  A new
    ``Metric`` per batch therefore compiles once, and keeps no batch alive after the call (a
    transformer's GGN product run op by op would recompile its block scan at every call).

    :meth:`dense` builds the matrix afresh at every call (nothing is cached on the
    metric or its functions), so a metric whose function reads changing state gives
    the current matrix, and metrics made in a loop are garbage-collected.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G = mg.metrics.diagonal(jnp.array([1.0, 4.0]))
    >>> G.mv(jnp.zeros(2), jnp.array([1.0, 1.0]))
    Array([1., 4.], dtype=float32)
    >>> G.with_damping(0.5).dense(jnp.zeros(2))
    Array([[1.5, 0. ],
           [0. , 4.5]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2; Grosse (2022), CSC2541 lecture 3 *Metrics*
    (matrix-vector products). Chapter 2.
    """

    mv_fn: MvFn
    name: str = "metric"
    damping: float = 0.0
    compiled: bool = True
    diagonal_fn: Callable[[PyTree], PyTree] | None = None
    matrix_fn: Callable[[PyTree], jax.Array] | None = None
    solve_fn: Callable[[PyTree, PyTree, Any], tuple[PyTree, jax.Array]] | None = None

    def __post_init__(self) -> None:
        if not callable(self.mv_fn):
            raise GeometryError(f"Metric needs a callable mv_fn(params, v); got {type(self.mv_fn).__name__}.")
        check_damping(self.damping, f"{self.name}: damping")

    def mv(self, params: PyTree, v: PyTree) -> PyTree:
        r"""The damped matrix-vector product at ``params``.

        .. math:: v \mapsto (G(\theta) + \epsilon I)\,v.

        Parameters
        ----------
        params : pytree
            The point :math:`\theta`.
        v : pytree
            A tangent vector shaped like ``params``; lists of numbers are converted to arrays.

        Returns
        -------
        pytree
            :math:`(G + \epsilon I)v`, shaped like ``params``.

        Raises
        ------
        GeometryError
            For empty or integer inputs, or if ``v`` does not have the structure of ``params``.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> G = mg.metrics.diagonal(jnp.array([1.0, 4.0]))
        >>> G.with_damping(1.0).mv(jnp.zeros(2), jnp.ones(2))
        Array([2., 5.], dtype=float32)

        References
        ----------
        Grosse (2022), CSC2541 lecture 3 *Metrics* (matrix-vector products). Chapter 2.
        """
        params = as_float_point(params, "params")
        v = as_float_point(v, "the vector v")
        check_same_structure(params, v, "the vector v", "params")
        if not self.compiled:
            return add_damping(lambda u: self.mv_fn(params, u), self.damping)(v)
        if _is_zero(self.damping):
            return _compiled_mv(self.mv_fn, params, v)
        return _compiled_damped_mv(self.mv_fn, params, v, self.damping)

    def at(self, params: PyTree) -> Callable[[PyTree], PyTree]:
        r"""The linear map at a fixed point (what the rules of :mod:`minigeo.coords` apply).

        .. math:: v \mapsto (G(\theta) + \epsilon I)\,v \quad\text{at fixed }\theta.

        Parameters
        ----------
        params : pytree
            The point :math:`\theta`.

        Returns
        -------
        callable
            ``v -> self.mv(params, v)`` (a linear map at one point, as the rules of :mod:`minigeo.coords` take it).

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> mg.metrics.diagonal(jnp.array([1.0, 4.0])).at(jnp.zeros(2))(jnp.ones(2))
        Array([1., 4.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (the metric at one point). Chapter 2.
        """
        return lambda v: self.mv(params, v)

    def inner(self, params: PyTree, u: PyTree, v: PyTree) -> jax.Array:
        r"""The inner product of two tangent vectors at ``params``.

        .. math:: \langle u, v\rangle_{G(\theta)} = u^\top (G(\theta) + \epsilon I)\,v.

        Parameters
        ----------
        params : pytree
            The point :math:`\theta`.
        u, v : pytree
            Tangent vectors shaped like ``params``.

        Returns
        -------
        jax.Array
            The scalar inner product.

        Raises
        ------
        GeometryError
            If ``u`` and ``v`` do not have the structure of ``params``.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> G = mg.metrics.diagonal(jnp.array([1.0, 4.0]))
        >>> G.inner(jnp.zeros(2), jnp.ones(2), jnp.ones(2))
        Array(5., dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 2.2, Example 3(c). Chapter 2.
        """
        check_same_structure(u, v, "the vector v", "the vector u")
        return tree_vdot(u, self.mv(params, v))

    def with_damping(self, damping: Any) -> "Metric":
        r"""The same metric with damping :math:`\epsilon`.

        .. math:: G(\theta) \mapsto G(\theta) + \epsilon I.

        Replaces any previous ``with_damping`` value (it does not accumulate).

        Parameters
        ----------
        damping : float or array
            :math:`\epsilon \ge 0`: a Python number, NumPy scalar, 0-d array or a traced value.

        Returns
        -------
        :class:`~minigeo.Metric`
            A new metric with the same ``mv_fn``, ``name`` and ``compiled``.

        Raises
        ------
        GeometryError
            If ``damping`` is negative or NaN (when concrete), or not a scalar.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> G = mg.metrics.euclidean().with_damping(1.0)
        >>> float(G.with_damping(0.5).damping)   # replaces, no sum
        0.5

        References
        ----------
        No formula from the source papers (damping is a numerical device). Chapters 2 and 3.
        """
        return Metric(self.mv_fn, self.name, damping, self.compiled, self.diagonal_fn, self.matrix_fn, self.solve_fn)

    def dense(self, params: PyTree, *, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> jax.Array:
        r"""The dense ``d x d`` matrix over the flattened parameters (``ravel_pytree`` order).

        .. math:: [G(\theta) + \epsilon I]_{:, i} = (G(\theta) + \epsilon I)\,e_i,\qquad i = 1, \dots, d.

        Built from ``d`` matrix-vector products vectorised with ``vmap``, traced afresh at
        every call, so a function that reads changing state gives the current matrix; the
        compiled program is reused whenever the traced program is the same (as for every
        product of a metric built with ``compiled=True``: nothing stale, no data kept).
        :meth:`check_positive_definite` checks the result.

        Parameters
        ----------
        params : pytree
            The point :math:`\theta`.
        max_size : int, optional
            Largest number of parameters for which the matrix is built.

        Returns
        -------
        jax.Array
            The ``(d, d)`` matrix, damping included.

        Raises
        ------
        GeometryError
            Above ``max_size`` parameters, or for non-finite parameters.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> mg.metrics.diagonal(jnp.array([1.0, 4.0])).dense(jnp.zeros(2))
        Array([[1., 0.],
               [0., 4.]], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (a metric as a matrix field). Chapter 2.
        """
        params = as_float_point(params, "params")
        check_dense_size(tree_size(params), max_size, f"The {self.name} metric")
        check_finite(params, "params")
        if self.matrix_fn is not None:  # a dense metric: its own matrix, not d products
            return _matrix_field(self)(params)
        if self.compiled:  # traced afresh, compiled once per traced program (_compile.py)
            return _compiled_dense(self.mv_fn, params, self.damping)
        return _dense_matrix(self, params)

    def solve(
        self,
        params: PyTree,
        rhs: PyTree,
        *,
        method: str | None = None,
        tol: float = 1e-6,
        maxiter: int | None = None,
        max_size: int = DEFAULT_MAX_DENSE_SIZE,
        return_info: bool = False,
    ) -> PyTree | tuple[PyTree, SolveInfo]:
        r"""Solve with the damped metric: conjugate gradients (``"cg"``) or Cholesky (``"dense"``).

        .. math:: x = (G(\theta) + \epsilon I)^{-1}\,\mathrm{rhs}.

        ``rhs = 0`` gives 0.

        Parameters
        ----------
        params : pytree
            The point :math:`\theta`.
        rhs : pytree
            The right-hand side, shaped like ``params``.
        method : {"cg", "dense", "factored"}, optional
            Matrix-free conjugate gradients, Cholesky on the dense matrix, or the metric's own exact
            factored solve (its ``solve_fn``: the Kronecker factors of :func:`~minigeo.kfac` and
            :func:`~minigeo.ekfac`).  Default: ``"factored"`` when the metric has a ``solve_fn``,
            else ``"cg"``.
        tol : float, optional
            CG relative tolerance, in ``(0, 1)``: ``converged`` means the true relative residual
            :math:`\lVert \mathrm{rhs} - (G + \epsilon I)x\rVert / \lVert \mathrm{rhs}\rVert \le` ``tol``
            (raised to at least the dtype's ``eps``).  Scale-free: ``x`` scales linearly with ``rhs``
            down to the smallest normal float.
        maxiter : int, optional
            CG iteration limit, a positive int (default ``10 d``).
        max_size : int, optional
            Largest number of parameters for ``method="dense"``.
        return_info : bool, optional
            Under ``jit`` no exception can be raised: pass ``True`` to get ``(x, info)``, where
            ``info`` is a ``SolveInfo`` named tuple (``converged``, ``status``: 0 converged,
            1 ``maxiter`` reached, 2 not positive definite, 3 non-finite, 4 true residual above
            ``tol`` after residual replacement (round-off), 5 not symmetric (dense);
            ``iterations``, ``residual`` (the true relative residual), ``curvature``) to check.
            With status 2, 3 or 5 ``x`` is NaN.  ``method="dense"`` checks the symmetry of the
            matrix and its Cholesky pivots also under ``jit``.

        Returns
        -------
        pytree or tuple
            ``x`` shaped like ``params``; ``(x, info)`` if ``return_info``.

        Raises
        ------
        GeometryError
            Eagerly, if the (damped) metric is not symmetric, singular or indefinite (dense: by
            its eigenvalues; CG: by the curvature :math:`p^\top A p \le 0` met along the search
            directions), or if CG did not converge, with the advice to add damping; also for an
            unknown ``method``, mismatched structures or non-finite inputs, ``tol`` outside ``(0, 1)``
            or a ``maxiter`` that is not a positive int.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> G = mg.metrics.diagonal(jnp.array([1.0, 4.0]))
        >>> G.solve(jnp.zeros(2), jnp.array([1.0, 4.0])).round(4)
        Array([1., 1.], dtype=float32)

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 3.2 (preconditioning by :math:`G^{-1}`). Chapter 3.
        """
        check_solver_options(tol, maxiter, "Metric.solve")
        params = as_float_point(params, "params")
        rhs = as_float_point(rhs, "the right-hand side")
        check_same_structure(params, rhs, "the right-hand side", "params")
        check_finite(params, "params")
        if method is None:
            method = "cg" if self.solve_fn is None else "factored"
        if method == "factored":
            return _factored_solve(self, params, rhs, return_info)
        if method == "dense":
            return solve_spd_dense(
                self.with_damping(0.0).dense(params, max_size=max_size),
                rhs,
                damping=self.damping,
                what=f"the {self.name} metric",
                return_info=return_info,
            )
        if method == "cg":
            what = f"the {self.name} metric"
            if not (self.compiled and is_concrete(params, rhs, self.damping)):
                return solve_spd_cg(self.at(params), rhs, tol=tol, maxiter=maxiter, what=what, return_info=return_info)
            check_finite(rhs, "the right-hand side")
            x, info = _compiled_cg(self.mv_fn, params, rhs, self.damping, tol=tol, maxiter=maxiter)
            check_cg_solution(self.at(params), rhs, info, tol=tol, maxiter=maxiter, what=what)
            return (x, info) if return_info else x
        raise GeometryError(f"Metric.solve: method must be 'cg', 'dense' or 'factored', got {method!r}.")

    def check_positive_definite(self, params: PyTree, *, max_size: int = DEFAULT_MAX_DENSE_SIZE) -> None:
        r"""Raise unless the dense (damped) metric is symmetric positive definite.

        .. math:: G(\theta) + \epsilon I = (G(\theta) + \epsilon I)^\top \succ 0.

        Parameters
        ----------
        params : pytree
            The point :math:`\theta`.
        max_size : int, optional
            Largest number of parameters for which the dense matrix is built.

        Returns
        -------
        None

        Raises
        ------
        GeometryError
            If the matrix is not symmetric or not positive definite, or as :meth:`dense` raises.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> import minigeo as mg
        >>> mg.metrics.diagonal(jnp.array([1.0, 4.0])).check_positive_definite(jnp.zeros(2))

        References
        ----------
        Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (a metric is positive definite). Chapter 2.
        """
        G = self.dense(params, max_size=max_size)
        check_spd(
            G,
            f"the {self.name} metric" + (" + damping * I" if is_concrete(self.damping) and not _is_zero(self.damping) else ""),
            rtol=symmetry_rtol(G),
        )


_STATIC_FIELDS = ("mv_fn", "name", "compiled", "diagonal_fn", "matrix_fn", "solve_fn")


def _metric_flatten(metric: Metric) -> tuple[tuple[Any], tuple[Any, ...]]:
    return (metric.damping,), tuple(getattr(metric, name) for name in _STATIC_FIELDS)


def _metric_unflatten(aux: tuple[Any, ...], children: tuple[Any]) -> Metric:
    metric = object.__new__(Metric)  # no validation: jax rebuilds metrics with tracers or placeholders
    for name, value in zip((*_STATIC_FIELDS, "damping"), (*aux, children[0])):
        object.__setattr__(metric, name, value)
    return metric


jax.tree_util.register_pytree_node(Metric, _metric_flatten, _metric_unflatten)


def split_metric(metric: Metric | None) -> tuple[Any, Any, Any]:
    """``(callables, damping, name)`` of a metric for the compile layer (``None``: ``(None, None, None)``).

    A compiled entry takes the callables as its user functions (traced afresh at each eager call)
    and the damping as an argument, never the :class:`~minigeo.Metric` itself (whose pytree structure holds
    the callables): :func:`join_metric` rebuilds it inside the compiled work.
    """
    if metric is None:
        return None, None, None
    return (metric.mv_fn, metric.diagonal_fn, metric.matrix_fn, metric.solve_fn), metric.damping, metric.name


def join_metric(callables: Any, damping: Any, name: Any) -> Metric | None:
    """The metric of :func:`split_metric`'s parts (``callables`` may be the compile layer's replays)."""
    if callables is None:
        return None
    mv_fn, diagonal_fn, matrix_fn, solve_fn = callables
    return _metric_unflatten((mv_fn, name, True, diagonal_fn, matrix_fn, solve_fn), (damping,))

def _factored_solve(metric: Metric, params: PyTree, rhs: PyTree, return_info: bool) -> Any:
    """``x`` (or ``(x, info)``) of the metric's exact factored solve; eagerly a failed solve raises."""
    if metric.solve_fn is None:
        raise GeometryError(
            f"Metric.solve: method='factored' needs a metric with a factored inverse (mg.kfac, mg.ekfac); "
            f"the {metric.name} metric has none: use method='cg' or 'dense'."
        )
    if is_concrete(rhs):
        check_finite(rhs, "the right-hand side")
    x, status = metric.solve_fn(params, rhs, metric.damping)
    status = jnp.asarray(status, jnp.int32)
    if is_concrete(status) and int(status) != 0:
        raise_for_status(status, f"Metric.solve ({metric.name})", detail="add damping (metric.with_damping(1e-3)).")
    if not return_info:
        return x
    ok = status == 0
    dtype = ravel(x)[0].dtype
    info = SolveInfo(
        converged=ok,
        status=status,
        iterations=jnp.asarray(0, jnp.int32),
        residual=jnp.where(ok, jnp.asarray(0.0, dtype), jnp.asarray(jnp.nan, dtype)),
        curvature=jnp.asarray(jnp.nan, dtype),
    )
    return x, info


def _mv(mv_fn: Any, params: PyTree, v: PyTree) -> PyTree:
    return mv_fn(params, v)


def _damped_mv(mv_fn: Any, params: PyTree, v: PyTree, damping: Any) -> PyTree:
    return add_damping(lambda u: mv_fn(params, u), damping)(v)


_compiled_mv = functools.partial(compiled, _mv)
_compiled_damped_mv = functools.partial(compiled, _damped_mv)



def _cg(mv_fn: Any, params: PyTree, rhs: PyTree, damping: Any, *, tol: float, maxiter: int | None):
    """``(x, info)`` of CG on the damped product ``v -> mv_fn(params, v) + damping v``."""
    return solve_spd_cg(add_damping(lambda u: mv_fn(params, u), damping), rhs, tol=tol, maxiter=maxiter, return_info=True)


_compiled_cg = functools.partial(compiled, _cg)


def _dense_matrix(metric: Metric, params: PyTree) -> jax.Array:
    """The d x d matrix from d products vectorised with vmap (no cache: see :meth:`Metric.dense`)."""
    flat, unravel = ravel(params)
    basis = jnp.eye(flat.size, dtype=flat.dtype)
    return jax.vmap(lambda e: ravel(metric.mv(params, unravel(e)))[0])(basis).T


def _dense_impl(mv_fn: Any, params: PyTree, damping: Any) -> jax.Array:
    """The d x d matrix of the damped product ``v -> mv_fn(params, v) + damping v`` (d products, vmap)."""
    op = add_damping(lambda u: mv_fn(params, u), damping)
    flat, unravel = ravel(params)
    basis = jnp.eye(flat.size, dtype=flat.dtype)
    return jax.vmap(lambda e: ravel(op(unravel(e)))[0])(basis).T


_compiled_dense = functools.partial(compiled, _dense_impl)


# ---------------------------------------------------------------------------
# simple metrics
# ---------------------------------------------------------------------------
def euclidean() -> Metric:
    r"""The Euclidean metric: what plain gradient descent assumes.

    .. math:: G(\theta) = I.

    Returns
    -------
    :class:`~minigeo.Metric`
        The metric with ``mv(params, v) = v``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.metrics.euclidean().mv(jnp.zeros(2), jnp.array([1.0, 2.0]))
    Array([1., 2.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.2 (gradient descent implicitly assumes :math:`G = I`).
    Chapters 1 and 2.
    """
    return Metric(lambda params, v: v, "euclidean", diagonal_fn=lambda params: jax.tree_util.tree_map(jnp.ones_like, params))


def diagonal(weights: Union[PyTree, Callable[[PyTree], PyTree]]) -> Metric:
    r"""A diagonal metric with positive weights, constant or a function of the parameters.

    .. math:: G(\theta) = \mathrm{diag}\big(w(\theta)\big).

    Parameters
    ----------
    weights : pytree or callable
        A positive pytree like the parameters, or ``params -> w`` returning one.

    Returns
    -------
    :class:`~minigeo.Metric`
        The metric, with ``mv(params, v) = w * v`` leaf by leaf (``compiled=False``).

    Raises
    ------
    GeometryError
        From its products: if ``w`` does not match the parameters' structure, or (when concrete) is
        not finite or has weights :math:`\le 0`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.metrics.diagonal(lambda p: p**2).mv(jnp.array([2.0, 3.0]), jnp.ones(2))
    Array([4., 9.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 4.1 (diagonal preconditioners such as Adam's). Chapter 2.
    """
    if not callable(weights):
        weights = jax.tree_util.tree_map(jnp.asarray, weights)
    weight_fn = weights if callable(weights) else (lambda params: weights)

    def checked_weights(params: PyTree) -> PyTree:
        w = weight_fn(params)
        check_same_structure(params, w, "the diagonal weights", "params")
        if is_concrete(w):
            check_finite(w, "the diagonal weights")
            bad = sum(int(np.sum(np.asarray(x) <= 0)) for x in jax.tree_util.tree_leaves(w))
            if bad:
                raise GeometryError(
                    f"diagonal metric: {bad} weight(s) are <= 0, so the metric is not positive definite. "
                    "Use positive weights, or add damping (metric.with_damping(1e-3))."
                )
        return w

    def mv(params: PyTree, v: PyTree) -> PyTree:
        return jax.tree_util.tree_map(lambda a, b: a * b, checked_weights(params), v)

    return Metric(mv, "diagonal", compiled=False, diagonal_fn=checked_weights)


def dense(matrix_fn: Union[jax.Array, np.ndarray, Callable[[PyTree], jax.Array]]) -> Metric:
    r"""A metric given by a dense matrix field over the flattened parameters.

    .. math:: v \mapsto G(\theta)\,v,\qquad G(\theta) \in \mathbb R^{d\times d}.

    Parameters
    ----------
    matrix_fn : callable or array
        ``params -> G(params)``, a symmetric ``(d, d)`` matrix, ``d`` the number of parameters; or
        one such matrix, the constant field.

    Returns
    -------
    :class:`~minigeo.Metric`
        The metric (``compiled=False``, so its checks see concrete values).

    Raises
    ------
    GeometryError
        From its products: if the matrix has the wrong shape, is not finite, or (when concrete) is
        not symmetric: an asymmetry above ``max(64 d, 1000)`` machine epsilons relative to its
        largest entry.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> G = mg.metrics.dense(lambda p: jnp.array([[2.0, 1.0], [1.0, 2.0]]))
    >>> G.mv(jnp.zeros(2), jnp.array([1.0, 0.0]))
    Array([2., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (a metric as a positive-definite matrix field). Chapter 2.
    """

    if not callable(matrix_fn):
        if not is_matrix(matrix_fn):
            raise GeometryError(
                f"dense metric: needs a square matrix or a function params -> matrix; got {type(matrix_fn).__name__}. "
                + HOW_TO_MAKE_A_METRIC
            )
        constant = jnp.asarray(as_array(matrix_fn))
        if constant.ndim != 2 or constant.shape[0] != constant.shape[1]:
            raise GeometryError(f"dense metric: a matrix metric must be square, got shape {constant.shape}.")
        check_finite(constant, "dense metric: the matrix")
        check_symmetric(constant, "dense metric: the matrix")
        matrix_fn = lambda params: constant

    def checked_matrix(params: PyTree) -> jax.Array:
        matrix = matrix_fn(params)
        size = tree_size(params)
        if jnp.shape(matrix) != (size, size):
            raise GeometryError(
                f"dense metric: the matrix has shape {jnp.shape(matrix)}, but the parameters have {size} "
                f"coordinates, so a {size}x{size} matrix is needed (positive weights shaped like the "
                "parameters are a diagonal metric: mg.metrics.diagonal(w))."
            )
        check_finite(matrix, "dense metric: matrix_fn(params)")
        check_symmetric(matrix, "dense metric: matrix_fn(params)")
        return matrix

    def mv(params: PyTree, v: PyTree) -> PyTree:
        flat_v, unravel = ravel(v)
        return unravel(checked_matrix(params) @ flat_v)

    return Metric(mv, "dense", compiled=False, matrix_fn=checked_matrix)


_KINDS = ("matrix_field", "product", "operator")


def as_metric(obj: Any, *, kind: str | None = None) -> Metric:
    r"""The one metric type: turn any way of giving a metric into a :class:`~minigeo.Metric`.

    ================================  ==========================  ===========================================
    ``obj``                           ``kind``                    the metric field
    ================================  ==========================  ===========================================
    a :class:`~minigeo.Metric`                 (any)                       itself
    ``None``                          (any)                       :func:`~minigeo.euclidean`
    a square matrix :math:`M`         (any)                       the constant field :math:`G(\theta) = M`
    ``x -> G(x)`` (a matrix)          ``"matrix_field"``          :func:`~minigeo.metrics.dense` ``(obj)``
    ``(params, v) -> G v``            ``"product"``               ``Metric(obj)``
    ``v -> G v`` (at one point)       ``"operator"``              the constant field with that product
    ================================  ==========================  ===========================================

    A callable alone is ambiguous (``x -> G(x)`` and ``v -> G v`` both take one argument), so
    ``kind`` must say which.  Every minigeo function that takes a metric accepts a
    :class:`~minigeo.Metric`: the matrix-field functions of chapters 3 to 5 (:func:`~minigeo.christoffel_symbols`,
    :func:`~minigeo.riemannian_hessian`, :func:`~minigeo.hessian_endomorphism`, :func:`~minigeo.gram_matrix`,
    :func:`~minigeo.log_volume_element`, :func:`~minigeo.log_density_wrt_volume`,
    :func:`~minigeo.laplace_log_marginal_likelihood`) use its dense matrix, the matrix-free ones
    (:func:`~minigeo.trace_estimate`, :func:`~minigeo.top_eigenvalues`, :func:`~minigeo.natural_gradient`, the
    :mod:`~minigeo.operators`) its products, and the rules of :mod:`minigeo.coords` evaluate it at
    their point (``theta``, or ``at=params`` for :func:`~minigeo.inner`, :func:`~minigeo.flat` and
    :func:`~minigeo.sharp`).

    Parameters
    ----------
    obj : :class:`~minigeo.Metric`, None, array or callable
        A :class:`~minigeo.Metric`, ``None``, a square matrix, or a callable described by ``kind``.
    kind : {"matrix_field", "product", "operator"}, optional
        Needed for callables only.

    Returns
    -------
    :class:`~minigeo.Metric`
        The metric field.

    Raises
    ------
    GeometryError
        For a callable without ``kind``, an unknown ``kind``, a matrix that is not square, finite and
        symmetric, or an object that is none of the above.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> field = lambda x: jnp.diag(jnp.array([1.0, x[0] ** 2]))
    >>> polar = mg.metrics.as_metric(field, kind="matrix_field")
    >>> polar.dense(jnp.array([2.0, 0.3]))
    Array([[1., 0.],
           [0., 4.]], dtype=float32)
    >>> G = mg.metrics.as_metric(jnp.array([[2.0, 1.0], [1.0, 2.0]]))
    >>> G.mv(jnp.zeros(2), jnp.array([1.0, 0.0]))
    Array([2., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.2 (a metric as a positive-definite matrix field). Chapter 2.
    """
    if kind is not None and kind not in _KINDS:
        raise GeometryError(f"as_metric: kind must be one of {_KINDS} or None, got {kind!r}.")
    if isinstance(obj, Metric):
        return obj
    if obj is None:
        return euclidean()
    if is_matrix(obj):
        return dense(obj)
    if callable(obj):
        if kind == "matrix_field":
            return dense(obj)
        if kind == "product":
            return Metric(obj, "metric")
        if kind == "operator":
            return Metric(lambda params, v: obj(v), "metric (one point)")
        raise GeometryError(
            "as_metric: a callable is ambiguous; say what it computes: kind='matrix_field' (x -> G(x), a "
            "matrix), kind='product' ((params, v) -> G v) or kind='operator' (v -> G v at one point)."
        )
    raise GeometryError(
        f"as_metric: cannot make a metric from {type(obj).__name__}; pass a Metric, None, a square matrix or "
        "a callable with kind=..."
    )


#: How to turn other objects into a :class:`~minigeo.Metric` (the hint of every error about a ``metric=``).
HOW_TO_MAKE_A_METRIC = (
    "Pass a Metric, or None for the Euclidean metric: mg.metrics.dense(lambda x: G(x)) for a matrix field, "
    "mg.metrics.dense(M) (or M itself) for a constant square matrix, mg.metrics.diagonal(w) for positive "
    "weights shaped like the parameters, mg.Metric(lambda params, v: ...) for a product function, "
    "mg.metrics.as_metric(op, kind='operator') for a product v -> G v at one point."
)


def metric_field(metric: Any, who: str) -> Metric | None:
    """The one reading of every ``metric=`` argument: a :class:`~minigeo.Metric`, ``None``, or a constant square matrix.

    Anything else (a callable, a pytree of weights) raises, naming the explicit constructor: a bare
    callable would be ambiguous (``x -> G(x)`` or ``v -> G v``), a bare pytree a guess (diagonal).
    """
    if metric is None or isinstance(metric, Metric):
        return metric
    if is_matrix(metric) and jnp.ndim(metric) == 2 and jnp.shape(metric)[0] == jnp.shape(metric)[1]:
        return as_metric(metric)
    if callable(metric):
        kind = "a callable"
    elif hasattr(metric, "shape") and hasattr(metric, "dtype"):
        kind = f"an array of shape {tuple(jnp.shape(metric))} (not a square matrix)"
    else:
        kind = f"a {type(metric).__name__}"
    raise GeometryError(f"{who}: metric= got {kind}, which minigeo does not guess the meaning of. {HOW_TO_MAKE_A_METRIC}")


def _matrix_field(metric: Metric | None) -> Callable[[jax.Array], jax.Array] | None:
    """``x -> G(x) + damping I`` (or ``None``) for the dense-coordinate routines (the argument read by :func:`metric_field`).

    A dense metric's own matrix function (its structure tag), else the matrix built from products.
    """
    if metric is None:
        return None
    if metric.matrix_fn is None:
        return lambda x: metric.dense(x)
    if _is_zero(metric.damping):
        return metric.matrix_fn
    return lambda x: metric.matrix_fn(x) + metric.damping * jnp.eye(tree_size(x), dtype=ravel(x)[0].dtype)

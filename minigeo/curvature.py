r"""Curvature: Hessians, Christoffel symbols and the invariant Hessian endomorphism (floor 3, chapter 4).

The Hessian of a loss at a point is a **bilinear form**: it transforms like a
metric, :math:`\hat H = J^{-\top} H J^{-1}`, so its trace, determinant and
eigenvalues change under reparametrization (Dinh et al. 2017).  With a metric
:math:`G`, the **Hessian endomorphism** :math:`E = G^{-1}H` (the shape operator)
transforms as :math:`J E J^{-1}`, and its trace, determinant and eigenvalues are
invariant (Kristiadi et al. 2023, Sec. 3.1, App. A.2-A.3).  Away from critical points the
Hessian must include the Christoffel term of the Levi-Civita connection,
:math:`H_{ij} = \partial_i\partial_j f - \Gamma^k_{ij}\partial_k f` (Kristiadi et al. 2023, eq. 5;
blog post 001).

Dense routines work on 1-D coordinate arrays (small models); the matrix-free
:func:`trace_estimate` (Hutchinson) and :func:`top_eigenvalues` (Lanczos in the
:math:`G`-inner product) work on parameter pytrees through Hessian-vector
products.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl

from ._checks import (
    GeometryError,
    as_float_point,
    check_finite,
    check_key,
    check_same_structure,
    check_spd,
    check_square_matrix,
    check_working_precision,
    symmetry_rtol,
)
from ._compile import bind_batch, compiled, one_trace_per_call
from ._spectral import (
    Eigenpairs,
    EstimateInfo,
    Products,
    SpectralDensity,
    certified_ends,
    probe_terms,
    diagonal_by_method,
    fixed_block_lanczos,
    slq_density,
    trace_by_method,
)
from ._restrict import restricted_loss
from ._tree import DEFAULT_MAX_DENSE_SIZE, PyTree, check_dense_size, ravel, tree_size
from ._metric import Metric, _matrix_field, join_metric, metric_field, split_metric

__all__ = [
    "hvp",
    "hessian",
    "christoffel_symbols",
    "riemannian_hessian",
    "hessian_endomorphism",
    "endomorphism_eigenvalues",
    "endomorphism_trace",
    "endomorphism_slogdet",
    "trace_estimate",
    "top_eigenvalues",
    "spectral_density",
    "diagonal_estimate",
    "EstimateInfo",
    "SpectralDensity",
    "Eigenpairs",
]



def hvp(f: Callable[..., jax.Array], params: PyTree, v: PyTree, *, batch: Any = None) -> PyTree:
    r"""Hessian-vector product by forward-over-reverse autodiff.

    .. math:: v \mapsto \nabla^2 f(\theta)\,v = \tfrac{d}{dt}\nabla f(\theta + t v)\big|_{t=0}.

    Costs about two gradients; works on pytrees and under ``jit``/``vmap``.  An eager call
    traces ``f`` afresh (so it never returns a stale value of what ``f`` reads) and reuses the
    compiled program of an identical trace (see :class:`~minigeo.Metric`, *Compilation*).

    Parameters
    ----------
    f : callable
        The scalar function (loss) of a parameter pytree: ``f(params, batch)`` or ``f(params)``.
    params : pytree
        The point :math:`\theta`.
    v : pytree
        The vector, with the structure of ``params``.
    batch : pytree, optional
        The data: with ``batch``, ``f`` is called as ``f(params, batch)`` (minigeo's one calling
        convention, as in the operators and sharpness); without, ``f(params)`` (a closure).

    Returns
    -------
    pytree
        :math:`\nabla^2 f(\theta)\,v`, with the structure of ``params``.

    Raises
    ------
    GeometryError
        If ``v`` does not have the structure of ``params``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.hvp(lambda x: x[0] ** 2 * x[1], jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0]))
    Array([4., 2.], dtype=float32)
    >>> loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)   # data: an argument
    >>> batch = {"x": jnp.eye(2), "y": jnp.ones(2)}
    >>> mg.hvp(loss, jnp.zeros(2), jnp.array([1.0, 0.0]), batch=batch)
    Array([0.5, 0. ], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 (the Hessian, here used matrix-free). Chapter 4.
    """
    check_same_structure(params, v, "the vector v", "params")
    return _compiled_hvp(bind_batch(f, batch), params, v)


def _hvp(f: Callable[[PyTree], jax.Array], params: PyTree, v: PyTree) -> PyTree:
    return jax.jvp(jax.grad(f), (params,), (v,))[1]


_compiled_hvp = functools.partial(compiled, _hvp)


def hessian(
    f: Callable[..., jax.Array], params: PyTree, *, batch: Any = None, max_size: int = DEFAULT_MAX_DENSE_SIZE
) -> jax.Array:
    r"""The dense Hessian over the flattened parameters (small models only).

    .. math:: H_{ij} = \frac{\partial^2 f}{\partial\theta_i\,\partial\theta_j}(\theta).

    Parameters
    ----------
    f : callable
        The scalar function (loss) of a parameter pytree: ``f(params, batch)`` or ``f(params)``.
    params : pytree
        The point :math:`\theta`.
    batch : pytree, optional
        The data: with ``batch``, ``f`` is called as ``f(params, batch)`` (minigeo's one calling
        convention, as in the operators and sharpness); without, ``f(params)`` (a closure).
    max_size : int, optional
        Largest number of parameters for which the dense matrix is built.

    Returns
    -------
    jax.Array
        The ``(d, d)`` Hessian, ``d`` the number of parameters.

    Raises
    ------
    GeometryError
        Above ``max_size`` parameters, or if the Hessian is not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.hessian(lambda x: x[0] ** 2 * x[1], jnp.array([1.0, 2.0]))
    Array([[4., 2.],
           [2., 0.]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 (the Hessian as a bilinear form). Chapter 4.
    """
    f = bind_batch(f, batch)
    check_dense_size(tree_size(params), max_size, "The Hessian")
    H = _compiled_dense_hessian(f, params)
    _check_hessian_finite(H)
    return H


def _check_hessian_finite(H: jax.Array) -> None:
    check_finite(H, "The Hessian", hint="The loss is not twice differentiable here, or overflowed.")


def _dense_hessian(f: Callable[[PyTree], jax.Array], params: PyTree) -> jax.Array:
    flat, unravel = ravel(params)
    return jax.hessian(lambda q: f(unravel(q)))(flat)


# traced at every call (never stale), compiled once per traced program: run op by op, an eager
# jax.hessian compiles each of its small operations separately (seconds on first use)
_compiled_dense_hessian = functools.partial(compiled, _dense_hessian)


def _metric_at(metric: Metric | None, x: jax.Array) -> jax.Array:
    d = x.shape[0]
    metric_fn = _matrix_field(metric)
    if metric_fn is None:
        return jnp.eye(d, dtype=x.dtype)
    G = metric_fn(x)
    check_square_matrix(G, d, "the metric at x")
    _check_metric_value(G)
    return G


def _check_coords(x: jax.Array, who: str) -> None:
    if jnp.ndim(x) != 1:
        raise GeometryError(
            f"{who} works on 1-D coordinate arrays; got shape {jnp.shape(x)}. Flatten the point first."
        )


def christoffel_symbols(metric: Metric | jax.Array | None, x: jax.Array) -> jax.Array:
    r"""Christoffel symbols of the Levi-Civita connection of a metric field, indexed ``[k, i, j]``.

    .. math:: \Gamma^k_{ij} = \tfrac12 G^{kl}\big(\partial_i G_{lj} + \partial_j G_{li} - \partial_l G_{ij}\big),

    with the derivatives of the metric by autodiff and :math:`G^{-1}` applied by a Cholesky solve.

    Parameters
    ----------
    metric : :class:`~minigeo.Metric`, array or None
        The metric field, e.g. ``mg.metrics.dense(lambda x: G(x))`` with ``G(x)`` the dense
        ``(d, d)`` metric at the coordinates ``x``; a constant square matrix; ``None`` (Euclidean:
        all symbols 0).
    x : array
        The 1-D coordinates, of shape ``(d,)``.

    Returns
    -------
    jax.Array
        ``Gamma[k, i, j]`` :math:`= \Gamma^k_{ij}`, of shape ``(d, d, d)``.

    Raises
    ------
    GeometryError
        If ``x`` is not 1-D, the metric is not a ``(d, d)`` symmetric positive-definite matrix, or
        the symbols are not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> # the Euclidean metric in polar coordinates (r, angle)
    >>> polar = mg.metrics.dense(lambda x: jnp.diag(jnp.array([1.0, x[0] ** 2])))
    >>> Gamma = mg.christoffel_symbols(polar, jnp.array([2.0, 0.3]))
    >>> float(Gamma[0, 1, 1]), float(Gamma[1, 0, 1])              # -r and 1/r
    (-2.0, 0.5)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), eq. (5) (where :math:`\Gamma^k_{ij}` enter); Kristiadi (2023),
    *The Invariance of the Hessian* (blog post). Chapter 4.
    """
    _check_coords(x, "christoffel_symbols")
    metric = metric_field(metric, "christoffel_symbols")
    if metric is None:  # the Euclidean metric of these coordinates: constant, so every symbol is 0
        return jnp.zeros((x.shape[0],) * 3, dtype=x.dtype)
    Gamma, G = _compiled_christoffel(_matrix_field(metric), x)
    _check_metric_value(G)
    check_finite(Gamma, "The Christoffel symbols")
    return Gamma


def _christoffel(metric_fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(Gamma, G(x))``; the shape of ``G`` is checked while tracing, its values by the caller."""
    d = x.shape[0]
    G = metric_fn(x)
    check_square_matrix(G, d, "the metric at x")
    dG = jax.jacfwd(metric_fn)(x)  # dG[a, b, c] = d_c G_ab
    # A[l, i, j] = d_i G_lj + d_j G_li - d_l G_ij = dG[l, j, i] + dG[l, i, j] - dG[i, j, l]
    A = jnp.transpose(dG, (0, 2, 1)) + dG - jnp.transpose(dG, (2, 0, 1))
    cho = jsl.cho_factor(G, lower=True)
    return 0.5 * jsl.cho_solve(cho, A.reshape(d, d * d)).reshape(d, d, d), G


def _check_metric_value(G: jax.Array) -> None:
    check_spd(G, "the metric", rtol=symmetry_rtol(G))


def _riemannian_hessian(fns: tuple, x: jax.Array) -> tuple[jax.Array, ...]:
    """``(H - Gamma . grad f, autodiff H, G(x))`` in one program (``fns = (f, metric_fn)``)."""
    f, metric_fn = fns
    H = jax.hessian(f)(x)
    Gamma, G = _christoffel(metric_fn, x)
    return H - jnp.einsum("kij,k->ij", Gamma, jax.grad(f)(x)), H, G


_compiled_christoffel = functools.partial(compiled, _christoffel)
_compiled_riemannian_hessian = functools.partial(compiled, _riemannian_hessian)


def riemannian_hessian(f: Callable[[jax.Array], jax.Array], metric: Metric | jax.Array | None, x: jax.Array) -> jax.Array:
    r"""The Riemannian Hessian of ``f`` as a bilinear form in the coordinates ``x``.

    .. math:: H_{ij} = \partial_i\partial_j f - \Gamma^k_{ij}\,\partial_k f.

    It transforms exactly like a metric, :math:`J^{-\top}HJ^{-1}`, at every point,
    not only at critical points.

    Parameters
    ----------
    f : callable
        The scalar function of the 1-D coordinates.
    metric : :class:`~minigeo.Metric`, array or None
        The metric field (e.g. ``mg.metrics.dense(lambda x: G(x))``) or a constant square matrix;
        ``None`` is the Euclidean metric of these coordinates (no Christoffel term).
    x : array
        The 1-D coordinates, of shape ``(d,)``.

    Returns
    -------
    jax.Array
        The ``(d, d)`` matrix :math:`H`.

    Raises
    ------
    GeometryError
        If ``x`` is not 1-D, the metric is invalid (see :func:`~minigeo.christoffel_symbols`), or
        the Hessian is not finite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda p: p[0] * jnp.cos(p[1])   # the function x in polar coordinates
    >>> polar = mg.metrics.dense(lambda p: jnp.diag(jnp.array([1.0, p[0] ** 2])))
    >>> H = mg.riemannian_hessian(f, polar, jnp.array([2.0, 0.3]))
    >>> bool(jnp.allclose(H, 0.0, atol=1e-6))   # x is linear: its Riemannian Hessian is 0
    True

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (5); Kristiadi (2023), *The Invariance of the
    Hessian* (blog post). Chapter 4.
    """
    _check_coords(x, "riemannian_hessian")
    metric = metric_field(metric, "riemannian_hessian")
    if metric is None:
        return hessian(f, x)
    check_dense_size(x.shape[0], DEFAULT_MAX_DENSE_SIZE, "The Hessian")
    R, H, G = _compiled_riemannian_hessian((f, _matrix_field(metric)), x)
    _check_metric_value(G)
    _check_hessian_finite(H)
    check_finite(R, "The Riemannian Hessian")
    return R


def hessian_endomorphism(f: Callable[[jax.Array], jax.Array], metric: Metric | jax.Array | None, x: jax.Array) -> jax.Array:
    r"""The Hessian endomorphism (shape operator) built from the Riemannian Hessian :math:`H`.

    .. math:: E = G^{-1}H.

    Transforms as :math:`J E J^{-1}`; its trace, determinant and eigenvalues are
    invariant.  Computed by a Cholesky solve, never an explicit inverse.  For its
    invariants prefer :func:`endomorphism_eigenvalues`, :func:`endomorphism_trace`
    and :func:`endomorphism_slogdet` on ``(H, G)``, which use the symmetric
    generalized eigenproblem.

    Parameters
    ----------
    f : callable
        The scalar function of the 1-D coordinates.
    metric : :class:`~minigeo.Metric`, array or None
        The metric field (e.g. ``mg.metrics.dense(lambda x: G(x))``) or a constant square matrix;
        ``None`` is the Euclidean metric (then :math:`E = H`).
    x : array
        The 1-D coordinates, of shape ``(d,)``.

    Returns
    -------
    jax.Array
        The ``(d, d)`` matrix :math:`E` (not symmetric in general).

    Raises
    ------
    GeometryError
        As :func:`~minigeo.riemannian_hessian`.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: x[0] ** 2 + 3 * x[1] ** 2
    >>> E = mg.hessian_endomorphism(f, 2 * jnp.eye(2), jnp.zeros(2))
    >>> E.round(4)
    Array([[1., 0.],
           [0., 3.]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (6), and App. A; Kristiadi (2023), *The
    Invariance of the Hessian* (blog post). Chapter 4.
    """
    metric = metric_field(metric, "hessian_endomorphism")
    H = riemannian_hessian(f, metric, x)
    G = _metric_at(metric, x)
    return jsl.cho_solve(jsl.cho_factor(G, lower=True), H)


def _whitened(H: jax.Array, G: jax.Array) -> tuple[jax.Array, jax.Array]:
    check_square_matrix(H, None, "the Hessian H")
    check_square_matrix(G, H.shape[0], "the metric G")
    check_finite(H, "the Hessian H")
    check_spd(G, "the metric G", rtol=symmetry_rtol(G))
    L = jnp.linalg.cholesky(G)
    A = jsl.solve_triangular(L, jsl.solve_triangular(L, H, lower=True).T, lower=True).T  # L^{-1} H L^{-T}
    return 0.5 * (A + A.T), L


def endomorphism_eigenvalues(H: jax.Array, G: jax.Array) -> jax.Array:
    r"""Eigenvalues of :math:`E = G^{-1}H` (ascending) from the generalized problem :math:`Hv = \lambda Gv`.

    With :math:`G = LL^\top`, they are the eigenvalues of the symmetric
    :math:`L^{-1}HL^{-\top}`: real, and computed stably.

    Parameters
    ----------
    H : array
        The symmetric ``(d, d)`` (Riemannian) Hessian.
    G : array
        The symmetric positive-definite ``(d, d)`` metric.

    Returns
    -------
    jax.Array
        The ``d`` eigenvalues, ascending.

    Raises
    ------
    GeometryError
        If the shapes do not match, ``H`` is not finite, or ``G`` is not symmetric positive definite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> H, G = jnp.diag(jnp.array([2.0, 12.0])), jnp.diag(jnp.array([1.0, 4.0]))
    >>> mg.endomorphism_eigenvalues(H, G)
    Array([2., 3.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 and App. A.3 (invariant eigenvalues of :math:`G^{-1}H`). Chapter 4.
    """
    return jnp.linalg.eigvalsh(_whitened(H, G)[0])


def endomorphism_trace(H: jax.Array, G: jax.Array) -> jax.Array:
    r"""The invariant (Riemannian) trace of the Hessian endomorphism.

    .. math:: \mathrm{tr}(G^{-1}H) = \mathrm{tr}(L^{-1}HL^{-\top}),\qquad G = LL^\top.

    Parameters
    ----------
    H : array
        The symmetric ``(d, d)`` (Riemannian) Hessian.
    G : array
        The symmetric positive-definite ``(d, d)`` metric.

    Returns
    -------
    jax.Array
        The scalar trace.

    Raises
    ------
    GeometryError
        If the shapes do not match, ``H`` is not finite, or ``G`` is not symmetric positive definite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> H, G = jnp.diag(jnp.array([2.0, 12.0])), jnp.diag(jnp.array([1.0, 4.0]))
    >>> mg.endomorphism_trace(H, G)
    Array(5., dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 and App. A.2, eq. (18) (Riemannian trace). Chapter 4.
    """
    return jnp.trace(_whitened(H, G)[0])


def endomorphism_slogdet(H: jax.Array, G: jax.Array) -> tuple[jax.Array, jax.Array]:
    r"""Sign and log-absolute-determinant of the Hessian endomorphism :math:`G^{-1}H`.

    .. math:: \operatorname{sign}\det(G^{-1}H) = \operatorname{sign}\det H,\qquad
        \log|\det(G^{-1}H)| = \log|\det H| - \log\det G.

    Parameters
    ----------
    H : array
        The symmetric ``(d, d)`` (Riemannian) Hessian.
    G : array
        The symmetric positive-definite ``(d, d)`` metric.

    Returns
    -------
    tuple of two jax.Array
        ``(sign, logabsdet)``.

    Raises
    ------
    GeometryError
        If the shapes do not match, ``H`` is not finite, or ``G`` is not symmetric positive definite.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> H, G = jnp.diag(jnp.array([2.0, 12.0])), jnp.diag(jnp.array([1.0, 4.0]))
    >>> sign, logdet = mg.endomorphism_slogdet(H, G)
    >>> float(sign), round(float(jnp.exp(logdet)), 4)
    (1.0, 6.0)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1, eq. (7) (invariant determinant of :math:`G^{-1}H`). Chapter 4.
    """
    A, L = _whitened(H, G)
    sign, logdet_h = jnp.linalg.slogdet(H)
    return sign, logdet_h - 2.0 * jnp.sum(jnp.log(jnp.diag(L)))


# ---------------------------------------------------------------------------
# matrix-free
# ---------------------------------------------------------------------------
def trace_estimate(
    f: Callable[..., jax.Array],
    params: PyTree,
    key: jax.Array,
    *,
    batch: Any = None,
    metric: Metric | None = None,
    num_probes: int = 10,
    batched: str = "vmap",
    tol: float = 1e-6,
    maxiter: int | None = None,
    method: str = "hutchinson",
    return_info: bool = False,
    paths: Any = None,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, EstimateInfo]:
    r"""Randomized estimate of the invariant trace :math:`\mathrm{tr}(G^{-1}H)` at ``params`` (Hutchinson, Hutch++, XTrace).

    .. math:: \mathrm{tr}(G^{-1}H) = \mathbb E_z\big[(G^{-1}z)^\top H z\big]

    for Rademacher probes :math:`z`; each probe costs one Hessian-vector product and, for a
    :class:`~minigeo.Metric`, one conjugate-gradient solve.  ``method="hutch++"`` (Meyer et al.
    2021) spends a third of the same budget on a sketch :math:`Q` of the range of :math:`G^{-1}HS`,
    a third on :math:`\mathrm{tr}(Q^\top G^{-1}HQ)` exactly and the rest on Hutchinson for the
    deflated remainder: unbiased, and for a decaying spectrum far more accurate at equal cost.
    ``method="xtrace"`` (Epperly, Tropp & Webber 2024) spends half the budget on a sketch
    :math:`Y = G^{-1}H\Omega` and half on :math:`G^{-1}HQ`, and averages the :math:`m` Hutch++-type
    estimates that leave one test vector out of the sketch and use it as the probe (all from one QR):
    unbiased for the non-symmetric :math:`G^{-1}H` too (only products :math:`G^{-1}Hv` enter), exact
    when the rank is below :math:`m`, with an error estimate from the spread of the :math:`m` estimates.

    Parameters
    ----------
    f : callable
        The scalar loss of a parameter pytree: ``f(params, batch)`` or ``f(params)``.
    params : pytree
        The point.
    key : jax.Array
        PRNG key: the estimate is reproducible given the key.
    batch : pytree, optional
        The data: with ``batch``, ``f`` is called as ``f(params, batch)`` (minigeo's one calling
        convention, as in the operators and sharpness); without, ``f(params)`` (a closure).
    metric : :class:`~minigeo.Metric` or None, optional
        ``None`` (Euclidean: :math:`\mathrm{tr}\,H`) or a Metric, e.g. ``mg.metrics.diagonal(v)``
        for Adam's second-moment estimate ``v`` (solved elementwise) or a GGN (solved by CG).
    num_probes : int, optional
        The budget: Hessian-vector products (probes for Hutchinson; at least 3 for Hutch++; at least
        4 for XTrace, which uses :math:`2\lfloor\text{budget}/2\rfloor`, reported in
        ``info.num_products``); Hutchinson's standard error falls like :math:`1/\sqrt{\text{probes}}`.
    batched : {"vmap", "map"}, optional
        ``"vmap"`` (probes vectorised) or ``"map"`` (``lax.map``, less memory).
    tol : float, optional
        Relative tolerance, in ``(0, 1)``, of the conjugate-gradient solves with a Metric.
    maxiter : int, optional
        Iteration cap of those solves, a positive int.
    method : {"hutchinson", "hutch++", "xtrace"}, optional
        The estimator.  **Standard errors at small budgets.**  Hutchinson's rests on all
        :math:`P` probes.  Hutch++'s rests only on its
        :math:`r = \text{budget} - 2\lfloor\text{budget}/3\rfloor` deflated probes (given the sketch):
        1 at budget 3, 2 to 4 at budgets 4 to 8, 3 to 6 at 9 to 14, 8 at 20; XTrace's on its
        :math:`m = \lfloor\text{budget}/2\rfloor` leave-one-out estimates (their standard deviation
        over :math:`\sqrt m`, the paper's error estimate).  A spread measured from so few
        samples is itself uncertain (with 2 samples ``est +- 2 se`` covered only 60-72 % of runs), so
        both are widened by the Student-t factor :math:`t_{n-1}(0.977)/2` for the :math:`n = r` or
        :math:`m` samples they rest on (6.98 for :math:`n = 2`, 1.65 for 4, 1.10 for 15, tending to 1):
        ``est +- 2 se`` is then a 95 % interval for a Gaussian estimate, and ``inf`` when
        :math:`n = 1` (Hutch++ at budget 3).  Measured coverage of ``est +- 2 se`` (400 keys, quadratics
        of dimension 60 and 200 with flat, :math:`k^{-1}` and :math:`k^{-2}` spectra,
        ``benchmarks/bench_trace_coverage.py``): Hutch++ 88-98 % and XTrace 87-97 % at budgets 4 to 20
        (60-90 % without the factor); Hutchinson, unchanged, 78-96 % (lowest at 4 to 12 probes on a
        fast-decaying spectrum).  XTrace's error estimate still underestimates when :math:`m` approaches
        the dimension (76-84 % at :math:`m = d/2`).
    return_info : bool, optional
        Also return an :class:`~minigeo.curvature.EstimateInfo` (its :class:`~minigeo.Status`): the way to
        check the estimate under ``jit``, where nothing can be raised (a failed solve gives NaN).
    paths : optional
        The trace of the sub-block :math:`H_{SS}` on these leaves or sub-arrays (as in
        :func:`~minigeo.top_eigenvalues`); ``metric`` then lives on the block.

    Returns
    -------
    tuple of two jax.Array
        ``(estimate, standard_error)``; ``(estimate, standard_error, info)`` with ``return_info``.

    Raises
    ------
    GeometryError
        If ``num_probes`` (below 4 for XTrace), ``method``, ``batched``, ``tol`` or ``maxiter`` is
        invalid, ``key`` is not a PRNG key, ``params`` is empty, integer, complex, float16/bfloat16 or
        not finite, a diagonal metric is not positive, or (eagerly) a CG solve fails or the products
        are not finite.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: jnp.sum(jnp.arange(1.0, 4.0) * x**2)
    >>> est, se = mg.trace_estimate(f, jnp.zeros(3), jax.random.PRNGKey(0))
    >>> float(est)   # exact for a diagonal Hessian with Rademacher probes: 2 + 4 + 6
    12.0

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 and App. A.2 (the invariant trace), estimated with
    Hutchinson probes. Meyer, Musco, Musco & Woodruff (2021), *Hutch++*; Epperly, Tropp & Webber
    (2024), *XTrace: making the most of every sample in stochastic trace estimation*, SIAM J. Matrix
    Anal. Appl. (formulas checked against github.com/eepperly/XTrace, ``xtrace_helper.m``).
    Chapter 4.
    """
    params = as_float_point(params, "params")
    check_working_precision(params, "trace_estimate")
    check_key(key, "trace_estimate: key")
    check_finite(params, "params")
    f, params = _on_block(bind_batch(f, batch), params, paths, "trace_estimate")
    return trace_by_method(
        _point_products(f, params), key, metric, method=method, num_probes=num_probes, batched=batched,
        tol=tol, maxiter=maxiter, who="trace_estimate", return_info=return_info,
    )


def diagonal_estimate(
    f: Callable[..., jax.Array],
    params: PyTree,
    key: jax.Array,
    *,
    batch: Any = None,
    num_probes: int = 10,
    method: str = "hutchinson",
    return_info: bool = False,
    paths: Any = None,
) -> tuple[PyTree, PyTree] | tuple[PyTree, PyTree, EstimateInfo]:
    r"""Hutchinson or XDiag estimate of the Hessian's diagonal, with per-entry standard errors.

    .. math:: \mathrm{diag}(H) = \mathbb E_z[z \odot Hz],\qquad
              \mathrm{Var}\big[(z\odot Hz)_i\big] = \textstyle\sum_{j \ne i} H_{ij}^2

    for Rademacher :math:`z` (one Hessian-vector product per probe): unbiased, with an error falling
    like :math:`P^{-1/2}`, exact for a diagonal Hessian.  The diagonal is a chart-dependent quantity
    (for a diagonal metric :math:`w`, :math:`\mathrm{diag}(G^{-1}H) = \mathrm{diag}(H)/w`).
    ``method="xdiag"`` (Epperly, Tropp & Webber 2024): a sketch :math:`Q` of :math:`H\Omega` from half
    the budget, :math:`\mathrm{diag}(QQ^\top H)` exactly from the other half, and Hutchinson on the
    remainder with each test vector left out of the sketch in turn; far more accurate for a decaying
    spectrum, exact for rank below :math:`m = \lfloor\text{budget}/2\rfloor`.  Its error estimate is the
    spread of the :math:`m` leave-one-out diagonals over :math:`\sqrt m`, entry by entry.

    Parameters
    ----------
    f : callable
        The scalar loss of a parameter pytree: ``f(params, batch)`` or ``f(params)``.
    params : pytree
        The point.
    key : jax.Array
        PRNG key of the probes.
    batch : pytree, optional
        The data: with ``batch``, ``f`` is called as ``f(params, batch)``; without, ``f(params)``.
    num_probes : int, optional
        The budget: Hessian-vector products (probes :math:`P` for Hutchinson; at least 4 for XDiag).
    method : {"hutchinson", "xdiag"}, optional
        The estimator.
    return_info : bool, optional
        Also return an :class:`~minigeo.curvature.EstimateInfo`.
    paths : optional
        The diagonal of the sub-block on these leaves or sub-arrays only (as in
        :func:`~minigeo.top_eigenvalues`): pytrees structured like the block's dict ``{key: sub-array}``.

    Returns
    -------
    tuple of two pytrees
        ``(diagonal, standard_error)``, each structured like ``params``.

    Raises
    ------
    GeometryError
        If ``num_probes`` is not a positive int (below 4 for XDiag), ``method`` is unknown, ``key`` is
        not a PRNG key, or (eagerly) the products are not finite.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: 0.5 * jnp.sum(jnp.array([1.0, 2.0, 3.0]) * x**2)
    >>> diag, se = mg.diagonal_estimate(f, jnp.zeros(3), jax.random.PRNGKey(0), num_probes=4)
    >>> diag, se                     # a diagonal Hessian: exact, no spread
    (Array([1., 2., 3.], dtype=float32), Array([0., 0., 0.], dtype=float32))

    References
    ----------
    No formula from the source papers: Bekas, Kokiopoulou & Saad (2007), *An estimator for the
    diagonal of a matrix*; XDiag: Epperly, Tropp & Webber (2024) (``xdiag.m`` of
    github.com/eepperly/XTrace). Chapter 4.
    """
    params = as_float_point(params, "params")
    check_working_precision(params, "diagonal_estimate")
    check_key(key, "diagonal_estimate: key")
    check_finite(params, "params")
    f, params = _on_block(bind_batch(f, batch), params, paths, "diagonal_estimate")
    return diagonal_by_method(
        _point_products(f, params), key, method=method, num_probes=num_probes,
        who="diagonal_estimate", return_info=return_info,
    )


@one_trace_per_call()
def top_eigenvalues(
    f: Callable[..., jax.Array],
    params: PyTree,
    key: jax.Array,
    *,
    batch: Any = None,
    k: int = 1,
    metric: Metric | None = None,
    num_iterations: int | None = None,
    rtol: float | None = 1e-2,
    tol: float = 1e-8,
    maxiter: int | None = None,
    block_size: int | None = None,
    which: str = "largest",
    return_info: bool = False,
    return_vectors: bool = False,
    paths: Any = None,
) -> Any:
    r"""The ``k`` largest (or smallest) eigenvalues of :math:`E = G^{-1}H`, counted with multiplicity, by block Lanczos, certified.

    .. math:: \langle u, Ev\rangle_G = u^\top G\,G^{-1}H v = u^\top H v,

    so :math:`E` is self-adjoint for :math:`\langle u, v\rangle_G`.

    **Algorithm.**  Block Lanczos in the :math:`G`-inner product with full reorthogonalization,
    from a block of :math:`p` random start vectors (``block_size``; default :math:`p = k`).  Each
    block step is one batched (``vmap``-ed) product of the block with :math:`H` and one with :math:`G^{-1}` (identity, diagonal, or CG solves); the new
    block is :math:`G`-orthonormalized against the last two blocks and then once against the whole
    basis (twice in all; each pass reads only the filled blocks).  Rayleigh-Ritz on the
    projected matrix :math:`T = Q^\top H Q` (formed from the products, not from a recurrence)
    gives the Ritz values :math:`\theta_1 \ge \dots \ge \theta_k` and :math:`G`-orthonormal Ritz
    vectors :math:`Y`.  Repeated eigenvalues are the normal case in networks (symmetries,
    multi-output heads): a single start vector sees only one copy of each, a block of :math:`p`
    random vectors up to :math:`p` copies.

    **Certificate** (Kahan's theorem).  With the residual :math:`R_i = EY_i - Y_i\Theta_i` of the
    leading :math:`i` Ritz pairs (computed from the last residual block, no extra products), the
    values :math:`\theta_1, \dots, \theta_i` lie within :math:`\|R_i\|_{2,G}` of :math:`i`
    eigenvalues of :math:`E` **counted with multiplicity** (a per-value bound
    :math:`|\beta s_{mi}|` cannot tell two copies of one eigenvalue from one).  Ritz values never
    exceed the eigenvalues of the same rank (:math:`\theta_i \le \lambda_i`, Cauchy interlacing).
    The leading :math:`i` values are returned when :math:`\|R_i\| \le` ``rtol`` :math:`\cdot
    \max_{j \le i}|\theta_j|` (relative to the returned values, so a large eigenvalue elsewhere
    in the spectrum, e.g. a big negative one, does not loosen it; an absolute round-off floor
    :math:`10\sqrt{mp}\,\varepsilon\,\|T\|` applies when the returned values are 0).

    **What is guaranteed.**  Deterministically (to round-off): every returned value is within
    ``rtol`` (as above) of a distinct eigenvalue, counted with multiplicity, and is at most the
    eigenvalue of its rank.  That they are *the* :math:`k` largest (no copy above them was missed)
    holds with probability one in exact arithmetic for a random start block with
    :math:`p \ge k` (the start block has a component in every eigenspace, of rank up to :math:`p`),
    and with high probability in practice (randomized block Krylov; Musco & Musco 2015).  A
    missed copy can only hide if the start block is nearly orthogonal to an eigenspace; pass another
    ``key`` or a larger ``block_size`` to check a critical result.

    **Iterations and cost.**  ``num_iterations`` is the Krylov dimension: the number of products
    with :math:`H` (and with :math:`G^{-1}`), rounded up to whole blocks of :math:`p`; one block
    step per :math:`p` products.  ``None`` (default) runs a **thick-restarted** block Lanczos in one
    ``lax.while_loop``, eagerly and under ``jit`` alike (the same numbers): a fixed basis of
    :math:`m = \max(6, \lceil 4k/p\rceil)` blocks (at most :math:`\max(30, 4k, 30p)` products);
    while the top ``k`` are not certified, its leading half of Ritz vectors (at least :math:`2k`,
    with their block :math:`\mathrm{diag}(\theta)` of :math:`T`) is kept, the pending residual block
    continues it and new blocks fill the rest, so the run stops as soon as the certificate holds (at
    most 20 cycles).  Eagerly, a run the restarts did not certify is followed by one Krylov space in
    host memory grown by 1.5x until certified or spanning all :math:`d` dimensions (then exact); under
    ``jit`` its uncertified values are NaN (below).  On the MLP 784-256-256-10 at initialization
    (float32, clustered top five) the default certified all 5 values under ``jit`` for 10 of 10 keys
    with 150-225 products (the unrestarted 150-product run of earlier versions left the fifth NaN for
    2 of 3 keys).  With ``num_iterations`` (or a metric solved by CG, eagerly) there is no restart.
    Memory: the basis, :math:`mp \times d` numbers (twice with a metric): for the default
    :math:`\max(6p, 4k)\,d` whatever the restarts, e.g. 30 vectors for the top 5: 10.6 GB for
    ViT-B/32's 88.2 M parameters in float32; XLA's compiled program for those shapes (jax 0.10.2, CPU)
    needs 23.6 GB of temporaries in all, 67 parameter vectors (the loop's copies of the basis and the
    kept Ritz vectors; ``benchmarks/memory_top_eigenvalues_vit_b32.py``).

    Uncertified values: eagerly a :class:`~minigeo.GeometryError` (with the bound and what to
    do); under ``jit`` (no exception) every value from the first uncertified one on is **NaN**,
    never a wrong number.  ``rtol=None`` turns the certification off.

    Low-rank curvature: when the Krylov space becomes invariant (e.g. a rank-deficient Hessian),
    a residual column below :math:`10\sqrt d\,\varepsilon` times the operator's scale is a
    breakdown and is replaced by a fresh random vector orthogonal to the basis, so the eigenvalues
    returned are exact (to a few :math:`\varepsilon` of the spectrum's scale), zeros included.
    ``key`` draws the start block and the restart vectors.

    Parameters
    ----------
    f : callable
        The scalar loss of a parameter pytree: ``f(params, batch)`` or ``f(params)``.
    params : pytree
        The point.
    key : jax.Array
        PRNG key of the start block and restart vectors.
    batch : pytree, optional
        The data: with ``batch``, ``f`` is called as ``f(params, batch)`` (minigeo's one calling
        convention, as in the operators and sharpness); without, ``f(params)`` (a closure).
    k : int, optional
        How many of the largest eigenvalues (counted with multiplicity).
    metric : :class:`~minigeo.Metric` or None, optional
        ``None`` (:math:`G = I`) or a Metric (a diagonal one, ``mg.metrics.diagonal(w)``, is
        inverted elementwise; others by conjugate gradients).
    num_iterations : int, optional
        Products with :math:`H` (the Krylov dimension, capped at the number of parameters and
        rounded up to whole blocks); ``None`` adapts them (eagerly).
    rtol : float or None, optional
        Certification tolerance relative to the largest returned magnitude; ``None`` turns it off.
    tol : float, optional
        Relative tolerance of the conjugate-gradient solves with a Metric (a diagonal, dense or
        K-FAC / EKFAC metric is solved exactly, through its structure; then tol and maxiter do not apply).
    maxiter : int, optional
        Iteration cap of those solves.
    block_size : int, optional
        Start vectors :math:`p`; ``None``: :math:`k`.  Multiplicities up
        to :math:`p` are resolved; a smaller :math:`p` than :math:`k` may miss copies.
    which : {"largest", "smallest", "both"}, optional
        ``"smallest"``: the ``k`` smallest eigenvalues (the most negative first), as the largest of
        :math:`-E` (the same Krylov space, the same certificate); ``"both"``: ``(largest, smallest)``,
        two runs (twice the products).
    return_info : bool, optional
        Also return an :class:`~minigeo.curvature.EstimateInfo`: ``status`` ``UNCERTIFIED`` when values are NaN
        for want of a certificate (under ``jit``), ``NON_FINITE`` for non-finite products or a failed
        solve; ``num_products`` the products with :math:`H`.
    return_vectors : bool, optional
        Return :class:`~minigeo.curvature.Eigenpairs` ``(values, vectors)`` instead of the values: the
        eigenvectors :math:`v_i` (:math:`Hv_i = \lambda_i G v_i`), pytrees like ``params`` stacked on
        a leading axis of length ``k``, :math:`G`-orthonormal (:math:`v_i^\top G v_j = \delta_{ij}`;
        Ritz vectors :math:`Y = Q^\top S` of the same run, no extra products).  Certified with the
        values: each pair's residual :math:`\|Ev_i - \lambda_i v_i\|_G` is within the bound that
        certified the values; within a cluster of repeated eigenvalues only the span is determined.
        Under ``jit`` an uncertified pair is NaN.  Memory: the basis is returned from the device run.
    paths : optional
        Restrict :math:`H` to a block of the parameters (the principal sub-block :math:`H_{SS}`,
        every other entry fixed at ``params``): leaves as paths, e.g. ``[("blocks", "attn", "W_q")]``,
        or sub-arrays as ``(path, index)``, e.g. ``[(("blocks", "attn", "W_q"), (0, 2))]`` for layer
        0, head 2 (see :meth:`~minigeo.operators.CurvatureOperator.restrict`, the same code).  ``metric`` and the
        vectors then live on the restricted parameters, the dict ``{key: sub-array}``.

    Returns
    -------
    jax.Array or Eigenpairs
        The ``k`` largest eigenvalues, in decreasing order, repeated ones repeated (``"smallest"``:
        increasing; ``"both"``: a pair); :class:`~minigeo.curvature.Eigenpairs` with ``return_vectors`` (a pair
        of them for ``"both"``); ``(result, info)`` with ``return_info``.

    Raises
    ------
    GeometryError
        If ``k``, ``num_iterations``, ``rtol`` or ``block_size`` is invalid, ``key`` is not a PRNG key,
        ``params`` is empty, integer, complex or float16/bfloat16, the products are not finite, or
        (eagerly) a value is not certified to ``rtol``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: 0.5 * jnp.sum(jnp.array([1.0, 2.0, 3.0, 5.0, 5.0]) * x**2)
    >>> mg.top_eigenvalues(f, jnp.zeros(5), jax.random.PRNGKey(0), k=3).round(4)
    Array([5., 5., 3.], dtype=float32)
    >>> g = lambda x: 0.5 * jnp.sum(jnp.array([-2.0, -2.0, 1.0, 3.0]) * x**2)   # a saddle
    >>> key = jax.random.PRNGKey(0)
    >>> mg.top_eigenvalues(g, jnp.zeros(4), key, k=2, which="smallest").round(4)
    Array([-2., -2.], dtype=float32)
    >>> pairs = mg.top_eigenvalues(g, jnp.zeros(4), key, k=1, return_vectors=True)
    >>> pairs.values.round(4), jnp.abs(pairs.vectors).round(4)   # H v = 3 v, v = e_4
    (Array([3.], dtype=float32), Array([[0., 0., 0., 1.]], dtype=float32))
    >>> p = {"a": jnp.zeros((2, 3)), "b": jnp.zeros(1)}
    >>> h = lambda p: jnp.sum(jnp.arange(6.0).reshape(2, 3) * p["a"] ** 2)
    >>> mg.top_eigenvalues(h, p, key, paths=[("a", (0,))]).round(4)   # row 0: 2 * (0, 1, 2)
    Array([4.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.1 and App. A.3 (invariant eigenvalues), computed by
    block Lanczos in the :math:`G`-inner product (Golub & Underwood 1977); Kahan's residual bound
    (Parlett, *The Symmetric Eigenvalue Problem*, ch. 11); Musco & Musco (2015), *Randomized
    block Krylov methods for stronger and faster approximate singular value decomposition*. Chapter 4.
    """
    params = as_float_point(params, "params")
    check_working_precision(params, "top_eigenvalues")
    check_key(key, "top_eigenvalues: key")
    check_finite(params, "params")
    f, params = _on_block(bind_batch(f, batch), params, paths, "top_eigenvalues")
    return certified_ends(
        _point_products(f, params), key, metric, which=which, k=k, num_iterations=num_iterations,
        rtol=rtol, tol=tol, maxiter=maxiter, block_size=block_size, who="top_eigenvalues", return_info=return_info,
        return_vectors=return_vectors,
    )


@one_trace_per_call()
def spectral_density(
    f: Callable[..., jax.Array],
    params: PyTree,
    key: jax.Array,
    *,
    batch: Any = None,
    metric: Metric | None = None,
    num_probes: int = 10,
    num_iterations: int = 30,
    probes: Any = None,
    tol: float = 1e-8,
    maxiter: int | None = None,
    return_info: bool = False,
    paths: Any = None,
) -> SpectralDensity | tuple[SpectralDensity, EstimateInfo]:
    r"""The spectral density of :math:`E = G^{-1}H` by stochastic Lanczos quadrature, in the :math:`G`-inner product.

    .. math:: \phi(\lambda) = \frac1d\sum_{j=1}^d \delta(\lambda - \lambda_j(E)),\qquad
              \mathbb E_z\big[z^\top G^{-1} f(E)\, z\big] = \mathrm{tr} f(E)\ \text{ when }\ \mathbb E[zz^\top] = G.

    **Algorithm.**  For each probe, a covector :math:`z = L\xi` (:math:`G = LL^\top`, Rademacher
    :math:`\xi`) starts ``num_iterations`` Lanczos steps of :math:`E` in the :math:`G`-inner product
    at :math:`v = G^{-1}z` (so :math:`\mathbb E[vv^\top] = G^{-1}`).  With :math:`T = S\Theta
    S^\top` the projected matrix, the probe's Gauss rule has nodes :math:`\theta_i` and weights
    :math:`s_{0i}^2\,z^\top G^{-1}z/d` (they sum to 1: :math:`z^\top G^{-1} z = \xi^\top\xi = d`).
    Its moments :math:`\sum_i w_i\theta_i^k` are unbiased for :math:`\mathrm{tr}(E^k)/d` up to
    :math:`k = 2m - 1`.

    **Invariance.**  The eigenvalues of :math:`E` are the same in every chart, and so is the
    distribution of the probes (a Gaussian-like law with covariance :math:`G^{-1}` on tangent
    vectors): the density of :math:`E` with the metric transformed along with the parameters is
    chart-independent.  With ``probes=`` transported as covectors (:math:`z' = J^\top z` for
    :math:`\theta = \phi(\vartheta)`, :math:`J = D\phi`), the numbers agree to round-off; the
    density of the plain Hessian (``metric=None``) changes with the chart.

    **Metric.**  ``None``, a diagonal metric (``mg.metrics.diagonal``), a dense one
    (``mg.metrics.dense``, Cholesky-factored at ``params``), :func:`~minigeo.kfac` and
    :func:`~minigeo.ekfac` (:math:`(G+\epsilon I)^{1/2}\xi` through each layer's Kronecker
    eigenbasis, no :math:`d\times d` matrix) draw the probes; for another matrix-free metric pass
    ``probes=`` covectors with covariance :math:`G` (e.g. :math:`J^\top\xi` for a GGN
    :math:`J^\top J`).  Solves with :math:`G` are by conjugate gradients (``tol``, ``maxiter``) except
    for a diagonal metric and the factored solves of KFAC and EKFAC.

    Parameters
    ----------
    f : callable
        The scalar loss of a parameter pytree: ``f(params, batch)`` or ``f(params)``.
    params : pytree
        The point.
    key : jax.Array
        PRNG key of the probes (and of Lanczos restarts after a breakdown).
    batch : pytree, optional
        The data: with ``batch``, ``f`` is called as ``f(params, batch)``; without, ``f(params)``.
    metric : :class:`~minigeo.Metric` or None, optional
        ``None`` (the density of :math:`H`), a diagonal, dense, KFAC or EKFAC Metric (or any Metric
        with ``probes=``).
    num_probes : int, optional
        Probes :math:`P`; the moments' standard errors fall like :math:`1/\sqrt P`.
    num_iterations : int, optional
        Lanczos steps :math:`m` per probe (capped at :math:`d`): :math:`m` nodes, :math:`m` products.
    probes : array or pytree, optional
        Covector probes instead of drawn ones: a ``(P, d)`` array or a pytree like ``params`` stacked
        on axis 0, with covariance :math:`G` for an unbiased density.
    tol, maxiter : optional
        Tolerance and iteration cap of the conjugate-gradient solves with a non-diagonal metric.
    return_info : bool, optional
        Also return an :class:`~minigeo.curvature.EstimateInfo` (``NON_FINITE`` if a product or solve failed).
    paths : optional
        The density of the sub-block :math:`H_{SS}` on these leaves or sub-arrays (as in
        :func:`~minigeo.top_eigenvalues`); ``metric`` and ``probes`` then live on the block.

    Returns
    -------
    SpectralDensity
        Nodes and weights per probe, with ``.density(grid, sigma)`` and ``.moments(k)``;
        ``(density, info)`` with ``return_info``.

    Raises
    ------
    GeometryError
        If ``num_probes`` or ``num_iterations`` is not a positive int, ``key`` is not a PRNG key,
        ``probes`` has the wrong shape, the metric is matrix-free (and not KFAC / EKFAC) without
        ``probes``, a dense metric is not positive definite, or (eagerly) a product or solve is not finite.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda x: 0.5 * jnp.sum(jnp.array([1.0, 2.0, 2.0, 5.0]) * x**2)
    >>> key = jax.random.PRNGKey(0)
    >>> dens = mg.spectral_density(f, jnp.zeros(4), key, num_probes=3, num_iterations=4)
    >>> jnp.unique(dens.nodes.round(3))      # d iterations: the eigenvalues themselves
    Array([1., 2., 5.], dtype=float32)
    >>> round(float(dens.moments(1)[0]), 4)  # tr(H) / d, exact here
    2.5

    References
    ----------
    Lin, Saad & Yang (2016), Sec. 3.2 (SLQ densities); Ghorbani, Krishnan & Xiao (2019) (network
    Hessians); the invariant :math:`E = G^{-1}H` of Kristiadi, Dangel & Hennig (2023), Sec. 3.1. Chapter 4.
    """
    params = as_float_point(params, "params")
    check_working_precision(params, "spectral_density")
    check_key(key, "spectral_density: key")
    check_finite(params, "params")
    f, params = _on_block(bind_batch(f, batch), params, paths, "spectral_density")
    return slq_density(
        _point_products(f, params), key, metric, num_probes=num_probes, num_iterations=num_iterations,
        probes=probes, tol=tol, maxiter=maxiter, who="spectral_density", return_info=return_info,
    )


def _on_block(f: Callable[[PyTree], jax.Array], params: PyTree, paths: Any, who: str) -> tuple[Callable, PyTree]:
    """``paths=``: the loss of the selected block and its point (the code of ``CurvatureOperator.restrict``)."""
    return (f, params) if paths is None else restricted_loss(f, params, paths, who)


def _flat_hvp(f: Callable[[PyTree], jax.Array], params: PyTree, v: jax.Array) -> jax.Array:
    """``H v`` on flat vectors."""
    return ravel(_hvp(f, params, ravel(params)[1](v)))[0]


def _flat_block_hvp(f: Callable[[PyTree], jax.Array], params: PyTree, V: jax.Array) -> jax.Array:
    """``H v`` for every row ``v`` of ``V`` (one ``vmap``-ed product)."""
    return jax.vmap(lambda v: _flat_hvp(f, params, v))(V)


def _probe_terms(f: Callable[[PyTree], jax.Array], params: PyTree, probes: PyTree, duals: PyTree, *, batched: str) -> jax.Array:
    """``(u_i^T H z_i)_i`` for stacked probes ``z_i`` and duals ``u_i``."""
    return probe_terms(lambda z: _hvp(f, params, z), probes, duals, batched)


def _fixed_run(
    fns: tuple, params: PyTree, damping: Any, Z: jax.Array, key: jax.Array, *,
    name: Any, m: int, tol: float, maxiter: Any, basis: bool = False, restart: tuple | None = None, negate: bool = False,
) -> tuple[jax.Array, ...]:
    """The device block Lanczos of the Hessian of ``fns[0]`` (the loss) in the metric of ``fns[1]``
    (:func:`~minigeo._metric.split_metric`'s callables, with ``damping`` and ``name``; ``None``: G = I)."""
    f, metric_fns = fns
    return fixed_block_lanczos(
        lambda v: _flat_hvp(f, params, v), params, join_metric(metric_fns, damping, name), Z, key, m=m, tol=tol,
        maxiter=maxiter, basis=basis, restart=restart, negate=negate,
    )


_compiled_probe_terms = functools.partial(compiled, _probe_terms)
_compiled_flat_block_hvp = functools.partial(compiled, _flat_block_hvp)
_compiled_fixed_run = functools.partial(compiled, _fixed_run)


def _point_products(f: Callable[[PyTree], jax.Array], params: PyTree) -> Products:
    """The Hessian of ``f`` at ``params`` as the estimators of :mod:`minigeo._spectral` take it."""

    def terms(probes: PyTree, duals: PyTree, batched: str) -> jax.Array:
        return _compiled_probe_terms(f, params, probes, duals, batched=batched)  # inline under a trace

    def fixed(metric, Z, key, m, compiled, *, tol, maxiter, basis=False, restart=None, negate=False):
        run = _compiled_fixed_run if compiled else _fixed_run
        metric_fns, damping, name = split_metric(metric)
        return run(
            (f, metric_fns), params, damping, Z, key, name=name, m=m, tol=tol, maxiter=maxiter, basis=basis,
            restart=restart, negate=negate,
        )

    return Products(params, "Hessian", terms, lambda V: _compiled_flat_block_hvp(f, params, V), fixed)

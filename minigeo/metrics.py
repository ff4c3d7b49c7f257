r"""Metrics on parameter space, matrix-free (floor 2, chapter 2).

A :class:`Metric` gives, at a point ``params`` (a pytree), the linear map
:math:`v \mapsto G(\theta)\,v` on pytrees shaped like ``params``; for small
models it also builds the dense matrix.  Constructors:

==========================================  ==============================================================
constructor                                 :math:`G(\theta)`
==========================================  ==============================================================
:func:`euclidean`                           :math:`I`
:func:`diagonal` ``(weights)``              :math:`\mathrm{diag}(w)`
:func:`dense` ``(matrix_fn)``               any user matrix field
:func:`pullback` ``(f, metric)``            :math:`J_f^\top G_z J_f` (Grosse 2022, "pullback metric")
:func:`~minigeo.ggn` ``(model_fn, loss_fn)``         :math:`J^\top H_z J`, :math:`H_z = \nabla_z^2 \ell` (Kristiadi et al. 2023, eq. 3)
:func:`~minigeo.fisher` ``(model_fn, likelihood)``   :math:`J^\top F_z J`, :math:`F_z` the output-space Fisher (exact or Monte Carlo)
:func:`~minigeo.empirical_fisher` ``(model_fn, l)``  :math:`\frac1N\sum_n J_n^\top g_n g_n^\top J_n`, :math:`g_n = \nabla_{z_n}\ell_n` at the training targets
==========================================  ==============================================================

Products go jvp → output-space product → vjp, so the :math:`N k \times d`
Jacobian is never formed (Grosse 2022, ``pullback_mvp``/``gnhvp``).  All metrics
of the pullback family (12) of Kristiadi et al. 2023 transform correctly under
reparametrization by autodiff alone: evaluating them on ``model_fn ∘ φ⁻¹`` gives
:math:`J^{-\top} G J^{-1}`.

Exact diagonals, as references for the Hutchinson ``diagonal_estimate`` where the output
dimension is small: :func:`ggn_diagonal`, :func:`fisher_diagonal` and
:func:`empirical_fisher_diagonal` (one backward pass per example and output).

Conventions: for :func:`~minigeo.fisher` and :func:`~minigeo.empirical_fisher` the model output is
an array whose leading axis is the batch; ``reduction="mean"`` divides by the
batch size (matching a mean loss), ``"sum"`` does not.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError, as_float_point, check_finite, split_batch
from ._compile import Derived, compiled, run_work
from ._likelihood import (
    Likelihood,
    as_likelihood,
    categorical_likelihood,
    fisher_factor,
    gaussian_likelihood,
    is_categorical,
)
from ._metric import Metric, as_metric, dense, diagonal, euclidean, metric_field
from ._tree import PyTree, ravel

__all__ = [
    "Metric",
    "Likelihood",
    "euclidean",
    "diagonal",
    "dense",
    "pullback",
    "ggn",
    "fisher",
    "empirical_fisher",
    "ggn_diagonal",
    "fisher_diagonal",
    "empirical_fisher_diagonal",
    "as_metric",
    "categorical_likelihood",
    "gaussian_likelihood",
]

# ---------------------------------------------------------------------------
# the pullback family
# ---------------------------------------------------------------------------
def _linearized(f: Callable[[PyTree], PyTree], params: PyTree, v: PyTree):
    """``(f(params), J v, w -> J^T w)`` from one linearization (one forward pass, not a jvp and a vjp)."""
    z, f_lin = jax.linearize(f, params)
    transpose = jax.linear_transpose(f_lin, params)
    return z, f_lin(v), lambda w: transpose(w)[0]


def pullback(f: Callable[[PyTree], PyTree], metric: Metric | jax.Array | None) -> Metric:
    r"""The pullback of an output-space metric through ``f``.

    .. math:: (f^*G_z)(\theta) = J_f(\theta)^\top\,G_{f(\theta)}\,J_f(\theta).

    Parameters
    ----------
    f : callable
        Maps parameters to outputs (e.g. ``lambda p: model(p, X)``).
    metric : :class:`~minigeo.Metric`, array or None
        The metric on the outputs: a :class:`Metric` (its "params" are the outputs ``z``; for a
        product function ``(z, u) -> G_z u`` write ``mg.Metric(fn)``), a constant square matrix
        over the flattened outputs, or ``None`` (Euclidean, :func:`euclidean`).

    Returns
    -------
    :class:`~minigeo.Metric`
        The pullback metric on the parameters.

    Raises
    ------
    GeometryError
        If ``metric`` is not a :class:`Metric`, a square matrix or ``None`` (the message names the
        constructor to use).

    Notes
    -----
    One product costs a jvp, an output-space product and a vjp.  Pushing two
    vectors forward and taking their inner product in output space equals
    taking the inner product with the pullback metric.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> f = lambda w: jnp.array([w[0] * w[1], w[1]])
    >>> G = mg.metrics.pullback(f, mg.metrics.euclidean())
    >>> G.dense(jnp.array([1.0, 2.0]))  # J^T J with J = [[2, 1], [0, 1]]
    Array([[4., 2.],
           [2., 2.]], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (pullback metrics, ``pullback_mvp``); Kristiadi, Dangel &
    Hennig (2023), Sec. 3.4, eq. (12). Chapter 2.
    """
    return Metric(_pullback_mv(f, (metric_field(metric, "pullback") or euclidean()).mv), "pullback")


def _on_batch(model_fn: Callable, loss_fn: Callable | None, batch: Any, who: str) -> tuple[Callable, Callable | None]:
    """``model_fn(params, inputs)`` and ``loss_fn(z, targets)`` closed over a batch ``(inputs, targets)``; as given without one."""
    if batch is None:
        return model_fn, loss_fn
    inputs, targets = split_batch(batch, who)
    return (lambda p: model_fn(p, inputs)), (None if loss_fn is None else (lambda z: loss_fn(z, targets)))


def _pullback_rule(f: Callable[[PyTree], PyTree], out_mv: Callable, params: PyTree, v: PyTree) -> PyTree:
    """``J^T G_z J v`` from the output-space product ``out_mv(z, u)``."""
    z, jv, transpose = _linearized(f, params, v)
    return transpose(out_mv(z, jv))


def _pullback_mv(f: Callable[[PyTree], PyTree], out_mv: Callable[[PyTree, PyTree], PyTree]) -> Callable:
    """``(params, v) -> J^T G_z J v``: a :class:`~minigeo._compile.Derived` product (the compile layer
    traces ``f`` and ``out_mv`` alone at each eager call and derives the product on a miss)."""
    return Derived(_pullback_rule, (f, out_mv))


def _output_hvp(loss_fn: Callable, z: PyTree, u: PyTree) -> PyTree:
    """``H_z u`` of an output-space loss."""
    return jax.jvp(jax.grad(loss_fn), (z,), (u,))[1]


def ggn(model_fn: Callable[..., PyTree], loss_fn: Callable[..., jax.Array], *, batch: Any = None) -> Metric:
    r"""The generalized Gauss-Newton matrix of a model and an output-space loss.

    .. math:: G(\theta) = J(\theta)^\top H_z J(\theta),\qquad H_z = \nabla_z^2\,\ell(z)\big|_{z = f(\theta)}.

    Positive semi-definite when ``loss_fn`` is convex in the outputs.  Equal to
    the pullback of the Euclidean metric for squared error, and to the Fisher
    for softmax cross-entropy and Gaussian likelihoods with fixed variance.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> outputs`` with ``batch``; ``params -> outputs`` (the data closed
        over) without.
    loss_fn : callable
        ``loss_fn(outputs, targets) -> scalar`` with ``batch``; ``outputs -> scalar`` (targets closed
        over) without; :math:`H_z = \nabla_z^2` of it.
    batch : tuple, optional
        ``(inputs, targets)``: minigeo's one calling convention for data, as in
        :func:`~minigeo.operators.ggn_operator` (whose per-batch metric this is).

    Returns
    -------
    :class:`~minigeo.Metric`
        The GGN, named ``"GGN"``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    >>> G = mg.metrics.ggn(lambda w: X @ w, lambda z: 0.5 * jnp.sum(z**2))
    >>> G.dense(jnp.zeros(2))  # X^T X for linear least squares
    Array([[2., 1.],
           [1., 1.]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.1, eq. (3), and Sec. 3.4; Grosse (2022), CSC2541 lecture 3
    *Metrics* (Gauss-Newton, ``gnhvp``). Chapter 2.
    """

    model_fn, loss_fn = _on_batch(model_fn, loss_fn, batch, "ggn")
    return Metric(_pullback_mv(model_fn, Derived(_output_hvp, (loss_fn,))), "GGN")


def _batch_size(z: Any, who: str) -> int:
    if not hasattr(z, "shape") or jnp.ndim(z) < 1:
        raise GeometryError(
            f"{who}: model_fn must return an array with a leading batch axis, got {type(z).__name__}."
        )
    if z.shape[0] == 0:
        raise GeometryError(
            f"{who}: the batch is empty (model_fn returned outputs of shape {tuple(z.shape)}); the metric of an "
            "empty batch is undefined. Pass at least one example."
        )
    return z.shape[0]


def _scale(reduction: str, n: int, who: str) -> float:
    if reduction == "mean":
        return 1.0 / n
    if reduction == "sum":
        return 1.0
    raise GeometryError(f"{who}: reduction must be 'mean' or 'sum', got {reduction!r}.")


def _fisher_rule(model_fn: Callable, fisher_mv: Callable, params: PyTree, v: PyTree, *, reduction: str) -> PyTree:
    """``J^T F_z J v`` from the likelihood's output-space Fisher product."""
    z, jv, transpose = _linearized(model_fn, params, v)
    scale = _scale(reduction, _batch_size(z, "fisher"), "fisher")
    return transpose(scale * fisher_mv(z, jv))


def fisher(
    model_fn: Callable[..., jax.Array],
    likelihood: Union[str, Likelihood] = "categorical",
    *,
    batch: Any = None,
    reduction: str = "mean",
    mc_samples: int | None = None,
    key: jax.Array | None = None,
) -> Metric:
    r"""The Fisher information of a model with an output-space likelihood (exact or Monte Carlo).

    .. math:: F(\theta) = c\sum_n J_n^\top\, \mathbb E_{t\sim p(\cdot\mid z_n)}\big[g g^\top\big]\, J_n,
        \qquad g = \nabla_{z_n}\log p(t\mid z_n),\quad c = 1/N \text{ or } 1.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` with ``batch``, ``params -> z`` without: outputs with a
        leading batch axis (logits for ``"categorical"``, means for ``"gaussian"``).
    likelihood : {"categorical", "gaussian"} or :class:`~minigeo.Likelihood`, optional
        ``"gaussian"`` has :math:`\sigma = 1`.
    batch : tuple, optional
        ``(inputs, targets)`` (the targets are not used: the Fisher takes its targets from the model),
        as in :func:`~minigeo.operators.fisher_operator`.
    reduction : {"mean", "sum"}, optional
        ``"mean"`` divides by the batch size (matches a mean loss), ``"sum"`` does not.
    mc_samples : int, optional
        If given (with ``key``), the Monte-Carlo Fisher: targets are sampled from the model
        (``mc_samples`` per example, fixed by ``key``) and :math:`g = \nabla_z \log p(t \mid z)`;
        otherwise the exact output-space Fisher is used.
    key : jax.Array, optional
        PRNG key of the Monte-Carlo targets.

    Returns
    -------
    :class:`~minigeo.Metric`
        The Fisher metric.

    Raises
    ------
    GeometryError
        For an unknown likelihood, ``mc_samples`` without a key or not a positive int; from its
        products: an unknown ``reduction``, outputs without a batch axis, or an empty batch.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> F = mg.metrics.fisher(lambda w: w[None, :], "categorical")
    >>> F.dense(jnp.zeros(2))  # diag(p) - p p^T at p = (1/2, 1/2)
    Array([[ 0.25, -0.25],
           [-0.25,  0.25]], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.4, eq. (12); Grosse (2022), CSC2541 lecture 3 *Metrics*
    (Fisher as the pullback of the KL Hessian). Chapter 2.
    """
    lik = as_likelihood(likelihood, "fisher")
    model_fn, _ = _on_batch(model_fn, None, batch, "fisher")
    if mc_samples is None:
        return Metric(Derived(_fisher_rule, (model_fn, lik.fisher_mv), {"reduction": reduction}), f"Fisher ({lik.name})")

    if key is None or not (isinstance(mc_samples, int) and mc_samples >= 1):
        raise GeometryError("fisher: the Monte-Carlo Fisher needs mc_samples >= 1 (an int) and a PRNG key.")

    def mc_mv(params: PyTree, v: PyTree) -> PyTree:
        z, jv, transpose = _linearized(model_fn, params, v)
        n = _batch_size(z, "fisher")
        scale = _scale(reduction, n, "fisher")
        keys = jax.random.split(key, mc_samples)
        targets = jax.vmap(lambda k: lik.sample(k, jax.lax.stop_gradient(z)))(keys)  # (S, N, ...)
        scores = jax.vmap(lambda t: jax.grad(lambda zz: jnp.sum(lik.nll(zz, t)))(z))(targets)  # (S, N, ...)
        axes = tuple(range(2, scores.ndim))
        proj = jnp.sum(scores * jv[None], axis=axes, keepdims=True)  # (S, N, 1...)
        cotangent = jnp.mean(proj * scores, axis=0)
        return transpose(scale * cotangent)

    return Metric(mc_mv, f"MC Fisher ({lik.name}, {mc_samples} samples)")


def empirical_fisher(
    model_fn: Callable[..., jax.Array],
    per_example_loss_fn: Callable[..., jax.Array],
    *,
    batch: Any = None,
    reduction: str = "mean",
) -> Metric:
    r"""The "empirical Fisher": outer products of per-example output gradients at the training targets.

    .. math:: \hat F(\theta) = c\sum_n J_n^\top g_n g_n^\top J_n,\qquad g_n = \nabla_{z_n}\ell(z_n, y_n),
        \quad c = 1/N \text{ or } 1.

    The outer product of per-example gradients.  Unlike :func:`~minigeo.fisher` it does
    not sample targets from the model, and it is *not* a curvature
    approximation in general (Grosse 2022; Kunstner et al. 2019).

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` with ``batch``, ``params -> z`` without; a leading batch axis.
    per_example_loss_fn : callable
        ``per_example_loss_fn(z, targets) -> (N,)`` with ``batch``; ``z -> (N,)`` (the training
        targets closed over) without.
    batch : tuple, optional
        ``(inputs, targets)``, as in :func:`~minigeo.operators.empirical_fisher_operator`.
    reduction : {"mean", "sum"}, optional
        ``"mean"`` (default) divides by :math:`N`.

    Returns
    -------
    :class:`~minigeo.Metric`
        The empirical Fisher.

    Raises
    ------
    GeometryError
        From its products: outputs without a batch axis, an empty batch, losses not of shape
        ``(N,)``, or an unknown ``reduction``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, y = jnp.array([[1.0], [2.0]]), jnp.array([1.0, 1.0])
    >>> EF = mg.metrics.empirical_fisher(lambda w: X @ w, lambda z: 0.5 * (z - y) ** 2)
    >>> EF.dense(jnp.zeros(1))  # mean of (x (w x - y))^2 = (1 + 4) / 2
    Array([[2.5]], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (empirical Fisher vs Fisher); Kunstner et al. (2019).
    Chapter 2.
    """
    model_fn, per_example_loss_fn = _on_batch(model_fn, per_example_loss_fn, batch, "empirical_fisher")
    return Metric(Derived(_empirical_fisher_rule, (model_fn, per_example_loss_fn), {"reduction": reduction}), "empirical Fisher")


def _empirical_fisher_rule(
    model_fn: Callable, per_example_loss_fn: Callable, params: PyTree, v: PyTree, *, reduction: str
) -> PyTree:
    """``J^T (sum_n g_n g_n^T) J v / N`` (``reduction="mean"``) from per-example output gradients ``g_n``."""
    z, jv, transpose = _linearized(model_fn, params, v)
    n = _batch_size(z, "empirical_fisher")
    losses = per_example_loss_fn(z)
    if jnp.shape(losses) != (n,):
        raise GeometryError(
            f"empirical_fisher: per_example_loss_fn must return one loss per example, shape ({n},); got "
            f"{jnp.shape(losses)}. Return the unreduced losses."
        )
    g = jax.grad(lambda zz: jnp.sum(per_example_loss_fn(zz)))(z)
    axes = tuple(range(1, g.ndim))
    proj = jnp.sum(g * jv, axis=axes, keepdims=True)
    return transpose(_scale(reduction, n, "empirical_fisher") * proj * g)


# ---------------------------------------------------------------------------
# exact diagonals: references for a small output dimension
# ---------------------------------------------------------------------------
def _point(params: PyTree) -> PyTree:
    params = as_float_point(params, "params")
    check_finite(params, "params")
    return params


# ``work(params, *data)``: a Derived rule over the user's functions, which an eager call traces afresh
# (never a stale value of what they read); the rule is compiled once per traced program, the data
# passed as arguments (as the metrics' products are)
_compiled = functools.partial(compiled, run_work)


def _squares_of_rows(vjp: Callable, cotangents: PyTree, scale: Any) -> PyTree:
    r"""``scale * sum_r (J^T w_r)**2`` over the rows ``w_r`` of ``cotangents``, one vjp each (vmap)."""
    rows = jax.vmap(lambda w: vjp(w)[0])(cotangents)
    return jax.tree_util.tree_map(lambda x: scale * jnp.sum(x * x, axis=0), rows)


def _per_example_cotangents(rows: jax.Array, shape: tuple) -> jax.Array:
    """``W[(n, r)]``: zero outputs except example ``n``'s, holding ``rows[n, r]`` (``rows``: ``(N, R, C)``)."""
    n, r, c = rows.shape
    eye = jnp.eye(n, dtype=rows.dtype)
    return (eye[:, None, :, None] * rows[:, :, None, :]).reshape((n * r, *shape))


def _check_per_example_losses(loss: Callable, z: Any, n: int) -> None:
    out = jax.eval_shape(loss, z)
    if getattr(out, "shape", None) != (n,):
        raise GeometryError(
            f"empirical_fisher_diagonal: per_example_loss_fn must return one loss per example, shape ({n},); "
            f"got {getattr(out, 'shape', type(out).__name__)}. Return the unreduced losses."
        )


def _examples(
    model_fn: Callable, batch: Any, params: PyTree, who: str, with_targets: bool = True
) -> tuple[Any, Any, int] | None:
    """``(inputs, targets, N)`` when every leaf of the batch has the outputs' leading batch axis ``N``; else None.

    Then the exact diagonals differentiate each example alone (``model_fn(params, x_n[None])``,
    ``vmap``-ed over the examples): ``N`` backward passes of one example, not of the whole batch.
    """
    if batch is None:
        return None
    inputs, targets = split_batch(batch, who)
    targets = targets if with_targets else None
    n = _batch_size(jax.eval_shape(lambda p: model_fn(p, inputs), params), who)
    leaves = jax.tree_util.tree_leaves((inputs, targets))
    if not leaves or any(jnp.ndim(a) < 1 or jnp.shape(a)[0] != n for a in leaves):
        return None
    return inputs, targets, n


def _squares_over_examples(
    model_fn: Callable, rows: Callable, params: PyTree, inputs: Any, targets: Any, scale: Any
) -> PyTree:
    r"""``scale * sum_n sum_r (J_n^T w_{n,r})**2``: ``J_n`` the Jacobian of ``model_fn(params, x_n[None])``,
    the rows ``w_{n,r}`` = ``rows(z_n, t_n)`` (shape ``(R, 1, ...)``); one example per backward pass."""
    one = lambda a: a[None]

    def example(x: Any, t: Any) -> PyTree:
        z, vjp = jax.vjp(lambda p: model_fn(p, jax.tree_util.tree_map(one, x)), params)
        W = rows(z, jax.tree_util.tree_map(one, t))
        g = jax.vmap(lambda w: vjp(w)[0])(W)
        return jax.tree_util.tree_map(lambda a: jnp.sum(a * a, axis=0), g)

    per_example = jax.vmap(example)(inputs, targets)
    return jax.tree_util.tree_map(lambda a: scale * jnp.sum(a, axis=0), per_example)


def ggn_diagonal(
    model_fn: Callable[..., PyTree], loss_fn: Callable[..., jax.Array], params: PyTree, *, batch: Any = None
) -> PyTree:
    r"""The exact diagonal of the generalized Gauss-Newton matrix: a reference for few outputs.

    .. math:: \mathrm{diag}\big(J^\top H_z J\big) = \sum_{k=1}^{K} (J^\top e_k) \odot (J^\top H_z e_k)

    over the :math:`K` entries of the outputs of the whole batch, :math:`H_z = \nabla_z^2\,\ell(z)`
    at :math:`z = f(\theta)`: the diagonal of :func:`~minigeo.ggn` with the same ``model_fn``, ``loss_fn`` and
    ``batch``, at ``params`` (the arguments of :func:`~minigeo.operators.ggn_operator`).  One vector-Jacobian
    product per output entry (:math:`J^\top e_k`, ``vmap``-ed) and the dense :math:`K \times K`
    output Hessian: the cost is :math:`K` = examples :math:`\times` outputs per example backward
    passes, memory :math:`K \times d`.  Meant as a reference (for the Hutchinson estimates
    :func:`~minigeo.diagonal_estimate` and ``ggn_operator(...).diagonal_estimate``) where the output
    dimension and the batch are small.
    Valid for any loss, also one that couples examples or is not convex (then entries may be
    negative); pure and ``jit``-compatible.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> outputs`` with ``batch``; ``params -> outputs`` without.
    loss_fn : callable
        ``loss_fn(outputs, targets) -> scalar`` with ``batch``; ``outputs -> scalar`` without.
    params : pytree
        The point :math:`\theta`.
    batch : tuple, optional
        ``(inputs, targets)``, as in :func:`~minigeo.ggn`.

    Returns
    -------
    pytree
        :math:`\mathrm{diag}(G(\theta))`, shaped like ``params``.

    Raises
    ------
    GeometryError
        If ``params`` is empty, integer or not finite, ``batch`` is not a pair, or ``loss_fn`` does not
        return a scalar.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X = jnp.array([[1.0, 0.0], [1.0, 1.0]])
    >>> loss = lambda z: 0.5 * jnp.sum(z**2)
    >>> mg.metrics.ggn_diagonal(lambda w: X @ w, loss, jnp.zeros(2))  # diag(X^T X)
    Array([2., 1.], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 2.1, eq. (3) (the GGN); its diagonal, exactly. Chapter 2.
    """
    params = _point(params)
    f, loss = _on_batch(model_fn, loss_fn, batch, "ggn_diagonal")
    return _compiled(Derived(_ggn_diagonal, (f, loss)), params)


def _ggn_diagonal(f: Callable, loss: Callable, params: PyTree) -> PyTree:
    z, vjp = jax.vjp(f, params)
    z_flat, unravel_z = ravel(z)
    out = jax.eval_shape(lambda zf: loss(unravel_z(zf)), z_flat)
    if getattr(out, "shape", None) != ():
        raise GeometryError(
            f"ggn_diagonal: loss_fn must return a scalar (the loss of the batch); got shape "
            f"{getattr(out, 'shape', type(out).__name__)}. Reduce it (sum or mean) as for ggn."
        )
    hessian = jax.hessian(lambda zf: loss(unravel_z(zf)))(z_flat)  # (K, K)
    basis = jnp.eye(z_flat.size, dtype=z_flat.dtype)
    rows = jax.vmap(lambda e: ravel(vjp(unravel_z(e))[0])[0])(basis)  # rows[k] = J^T e_k
    return ravel(params)[1](jnp.sum(rows * (hessian @ rows), axis=0))


def fisher_diagonal(
    model_fn: Callable[..., jax.Array],
    params: PyTree,
    likelihood: Union[str, Likelihood] = "categorical",
    *,
    batch: Any = None,
    reduction: str = "mean",
) -> PyTree:
    r"""The exact diagonal of the Fisher information: a reference for few outputs.

    .. math:: \mathrm{diag}\,F(\theta) = c\sum_n\sum_{r} \big(J_n^\top S_n e_r\big)^{\odot 2},
        \qquad F_{z_n} = S_n S_n^\top,

    :math:`c = 1/N` or :math:`1`, with the symmetric factor :math:`S = \mathrm{diag}(\sqrt p) - p\sqrt p^{\,\top}` of
    :math:`\mathrm{diag}(p) - pp^\top` for ``"categorical"`` (closed form) and
    :math:`Q\Lambda^{1/2}` from the eigendecomposition of the output Fisher otherwise
    (:math:`I/\sigma` for ``"gaussian"``).  The metric of :func:`~minigeo.fisher` (exact, not Monte Carlo),
    with the arguments of :func:`~minigeo.operators.fisher_operator`.  One vector-Jacobian product per
    example and output (``vmap``-ed): the cost is examples :math:`\times` outputs backward passes,
    memory that many copies of ``params``.  With ``batch``, each pass differentiates one example
    alone (``model_fn(params, x_n[None])``); with the data closed over (no ``batch``), each goes
    through the whole batch's forward pass (:math:`N` times the work, but exact also for a model
    that couples its examples, e.g. by batch statistics).  Meant as a reference (for the Hutchinson estimate
    ``fisher_operator(...).diagonal_estimate``) where the output dimension is small.  A sum of
    squares, so never negative; pure and ``jit``-compatible.

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` with ``batch``, ``params -> z`` without: outputs with a
        leading batch axis (logits for ``"categorical"``, means for ``"gaussian"``).
    params : pytree
        The point :math:`\theta`.
    likelihood : {"categorical", "gaussian"} or :class:`~minigeo.Likelihood`, optional
        As in :func:`~minigeo.fisher`; a custom one must act example by example.
    batch : tuple, optional
        ``(inputs, targets)`` (the targets are not used), as in :func:`~minigeo.fisher`.
    reduction : {"mean", "sum"}, optional
        ``"mean"`` divides by the batch size (as :func:`~minigeo.fisher`), ``"sum"`` does not.

    Returns
    -------
    pytree
        :math:`\mathrm{diag}(F(\theta))`, shaped like ``params``.

    Raises
    ------
    GeometryError
        For an unknown likelihood or ``reduction``, ``params`` empty, integer or not finite, a
        ``batch`` that is not a pair, outputs without a batch axis, or an empty batch.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> d = mg.metrics.fisher_diagonal(lambda w: w[None, :], jnp.zeros(2))
    >>> d.round(6)  # p - p^2 at p = (1/2, 1/2)
    Array([0.25, 0.25], dtype=float32)

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.4, eq. (12) (the Fisher); its diagonal, exactly. Chapter 2.
    """
    lik = as_likelihood(likelihood, "fisher_diagonal")
    params = _point(params)
    f, _ = _on_batch(model_fn, None, batch, "fisher_diagonal")
    _scale(reduction, 1, "fisher_diagonal")
    examples = _examples(model_fn, batch, params, "fisher_diagonal", with_targets=False)
    if examples is not None:
        inputs, targets, n = examples
        scale = _scale(reduction, n, "fisher_diagonal")
        categorical = is_categorical(lik)
        rows = lambda z, t: jnp.swapaxes(fisher_factor(lik.fisher_mv, z, categorical)[0], 0, 1).reshape((-1, *z.shape))
        return _compiled(Derived(_squares_over_examples, (model_fn, rows)), params, inputs, targets, scale)
    rule = Derived(_fisher_diagonal, (f, lik.fisher_mv),
                   {"categorical": is_categorical(lik), "reduction": reduction})
    return _compiled(rule, params)


def _fisher_diagonal(f: Callable, fisher_mv: Callable, params: PyTree, *, categorical: bool, reduction: str) -> PyTree:
    z, vjp = jax.vjp(f, params)
    n = _batch_size(z, "fisher_diagonal")
    scale = _scale(reduction, n, "fisher_diagonal")
    factor = fisher_factor(fisher_mv, z, categorical)  # (N, C, R)
    cotangents = _per_example_cotangents(jnp.swapaxes(factor, 1, 2), z.shape)
    return _squares_of_rows(vjp, cotangents, scale)


def empirical_fisher_diagonal(
    model_fn: Callable[..., jax.Array],
    per_example_loss_fn: Callable[..., jax.Array],
    params: PyTree,
    *,
    batch: Any = None,
    reduction: str = "mean",
) -> PyTree:
    r"""The exact diagonal of the empirical Fisher: squared per-example gradients, summed or averaged.

    .. math:: \mathrm{diag}\,\hat F(\theta) = c\sum_n \big(J_n^\top g_n\big)^{\odot 2}
        = c\sum_n \big(\nabla_\theta \ell(z_n, y_n)\big)^{\odot 2},

    :math:`g_n = \nabla_{z_n}\ell(z_n, y_n)`, :math:`c = 1/N` or :math:`1`.  The metric of :func:`~minigeo.empirical_fisher`, with the arguments of
    :func:`~minigeo.operators.empirical_fisher_operator`.  One vector-Jacobian product per example
    (``vmap``-ed), memory one copy of ``params`` per example; pure and ``jit``-compatible.  With
    ``batch``, each product differentiates one example alone (``model_fn(params, x_n[None])``): the
    per-example gradients of the formula, at the cost of one batch's backward pass in all.  With the
    data closed over (no ``batch``), each goes through the whole batch's forward pass, :math:`N`
    times the work, but also defined for a model that couples its examples (batch statistics).

    Parameters
    ----------
    model_fn : callable
        ``model_fn(params, inputs) -> z`` with ``batch``, ``params -> z`` without; a leading batch axis.
    per_example_loss_fn : callable
        ``per_example_loss_fn(z, targets) -> (N,)`` with ``batch``; ``z -> (N,)`` without.
    params : pytree
        The point :math:`\theta`.
    batch : tuple, optional
        ``(inputs, targets)``, as in :func:`~minigeo.empirical_fisher`.
    reduction : {"mean", "sum"}, optional
        ``"mean"`` (default, as :func:`~minigeo.empirical_fisher`) divides by :math:`N`.

    Returns
    -------
    pytree
        :math:`\mathrm{diag}(\hat F(\theta))`, shaped like ``params``.

    Raises
    ------
    GeometryError
        If ``params`` is empty, integer or not finite, ``batch`` is not a pair, the outputs have no
        batch axis or the batch is empty, the losses are not of shape ``(N,)``, or ``reduction`` is
        unknown.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> X, y = jnp.array([[1.0], [2.0]]), jnp.array([1.0, 1.0])
    >>> loss = lambda z: 0.5 * (z - y) ** 2
    >>> mg.metrics.empirical_fisher_diagonal(lambda w: X @ w, loss, jnp.zeros(1))  # (1 + 4) / 2
    Array([2.5], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (empirical Fisher vs Fisher); Kunstner et al. (2019);
    its diagonal, exactly. Chapter 2.
    """
    params = _point(params)
    f, loss = _on_batch(model_fn, per_example_loss_fn, batch, "empirical_fisher_diagonal")
    _scale(reduction, 1, "empirical_fisher_diagonal")
    examples = _examples(model_fn, batch, params, "empirical_fisher_diagonal")
    if examples is not None:
        inputs, targets, n = examples
        _check_per_example_losses(loss, jax.eval_shape(f, params), n)
        scale = _scale(reduction, n, "empirical_fisher_diagonal")
        rows = lambda z, t: jax.grad(lambda zz: jnp.sum(per_example_loss_fn(zz, t)))(z)[None]
        return _compiled(Derived(_squares_over_examples, (model_fn, rows)), params, inputs, targets, scale)
    return _compiled(Derived(_empirical_fisher_diagonal, (f, loss), {"reduction": reduction}), params)


def _empirical_fisher_diagonal(f: Callable, loss: Callable, params: PyTree, *, reduction: str) -> PyTree:
    z, vjp = jax.vjp(f, params)
    n = _batch_size(z, "empirical_fisher_diagonal")
    _check_per_example_losses(loss, z, n)
    scale = _scale(reduction, n, "empirical_fisher_diagonal")
    g = jax.grad(lambda zz: jnp.sum(loss(zz)))(z)
    cotangents = _per_example_cotangents(g.reshape(n, 1, -1), z.shape)  # row n: g_n at example n
    return _squares_of_rows(vjp, cotangents, scale)

r"""Training and evaluation helpers for classifiers (chapter 7).

Small, jit-compiled building blocks used to train the families of models whose sharpness
chapter 7 measures: a mean cross-entropy, an error rate evaluated in batches, a
single optax step, and whole epochs run as one ``lax.scan`` over shuffled minibatches
(optionally with a data-augmentation function).  Hyperparameters that should vary between
runs without recompiling (learning rate, weight decay) belong in the optimizer state:
build the optimizer with ``optax.inject_hyperparams``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._checks import GeometryError, is_concrete
from .._tree import PyTree

__all__ = ["cross_entropy", "error_rate", "make_train_step", "train_epochs"]

Batch = tuple[jax.Array, jax.Array]


def _integer_labels(labels: jax.Array, batch_shape: tuple[int, ...], where: str, reference: str) -> jax.Array:
    """Check the labels' dtype and shape; squeeze a trailing axis of length 1 (``(n, 1) -> (n,)``)."""
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise GeometryError(
            f"{where}: labels must be integer class indices, got dtype {labels.dtype}. Convert them with "
            "labels.astype(jnp.int32); for one-hot or soft labels use jnp.argmax(labels, axis=-1) or "
            "optax.softmax_cross_entropy."
        )
    if labels.shape == tuple(batch_shape) + (1,):
        labels = labels[..., 0]  # a column of labels, (n, 1): the same as (n,)
    if labels.shape != tuple(batch_shape):
        raise GeometryError(
            f"{where}: {reference} and labels {labels.shape} disagree on the batch shape; pass one integer "
            f"label per example, shape {tuple(batch_shape)} (or {tuple(batch_shape) + (1,)})."
        )
    return labels


def _check_label_range(labels: jax.Array, num_classes: int, where: str) -> None:
    """Raise if concrete labels lie outside ``0 … num_classes - 1`` (skipped for tracers: under ``jit``)."""
    if not is_concrete(labels) or labels.size == 0:
        return
    values = np.asarray(labels)
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= num_classes:
        bad = int(np.sum((values < 0) | (values >= num_classes)))
        raise GeometryError(
            f"{where}: {bad} label(s) lie outside 0 … {num_classes - 1} (smallest {lo}, largest {hi}) for "
            f"{num_classes} classes. Labels must be class indices; check the label encoding (e.g. 1-based "
            "labels, or -1 for 'ignore') and the model's number of classes."
        )


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    r"""Mean cross-entropy of logits against integer labels.

    .. math:: L = -\frac1B\sum_{b=1}^B \log\mathrm{softmax}(z_b)_{y_b}

    Parameters
    ----------
    logits : array
        Logits of shape ``(..., C)``.
    labels : array
        Integer class indices of the logits' batch shape, e.g. ``(n,)`` for logits ``(n, C)``; a column
        ``(n, 1)`` is accepted and squeezed to ``(n,)``.

    Returns
    -------
    jax.Array
        The scalar mean loss.

    Raises
    ------
    GeometryError
        If the labels are not integers, do not match the logits' batch shape, or (when their values
        are concrete, i.e. not under ``jax.jit``) lie outside ``0 … C - 1``.  Under ``jit`` the values
        cannot be checked: an out-of-range label then gives a NaN or a wrong loss, so call the loss
        once outside ``jit`` to validate a new data set.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> float(mm.cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3])))   # log 4
    1.386294...

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (the log-likelihood :math:`\log p(t\mid z)` of outputs
    that parametrize a distribution). Chapter 7.
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 1:
        raise GeometryError(f"cross_entropy: logits must have a class axis, got shape {logits.shape}.")
    labels = _integer_labels(labels, logits.shape[:-1], "cross_entropy", f"logits {logits.shape}")
    _check_label_range(labels, logits.shape[-1], "cross_entropy")
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@functools.partial(jax.jit, static_argnames=("apply_fn", "batch_size"))
def _error_rate(
    apply_fn: Callable, params: PyTree, images: jax.Array, labels: jax.Array, batch_size: int
) -> tuple[jax.Array, jax.Array]:
    n = images.shape[0]
    pad = -n % batch_size
    x = jnp.concatenate([images, jnp.zeros((pad,) + images.shape[1:], images.dtype)])
    chunks = x.reshape((-1, batch_size) + images.shape[1:])
    logits_shape = jax.eval_shape(lambda xb: apply_fn(params, xb), chunks[0]).shape
    num_classes = logits_shape[-1]
    preds = jax.lax.map(lambda xb: jnp.argmax(apply_fn(params, xb), axis=-1), chunks).reshape(-1)[:n]
    return jnp.mean(preds != labels), jnp.asarray(num_classes, jnp.int32)


def error_rate(
    apply_fn: Callable, params: PyTree, images: jax.Array, labels: jax.Array, batch_size: int = 512
) -> jax.Array:
    r"""Fraction of misclassified examples, with ``apply_fn(params, images)`` evaluated in chunks.

    .. math:: \mathrm{err} = \frac1n\sum_{i=1}^n \big[\arg\max_c f(x_i)_c \ne y_i\big]

    The evaluation is compiled (``jax.jit``, with ``apply_fn`` and ``batch_size`` static); the function
    may also be called inside ``jit``.

    Parameters
    ----------
    apply_fn : callable
        ``apply_fn(params, images) -> logits (batch, C)``; hashable (a static argument).
    params : pytree
        The model's parameters.
    images : array
        Inputs with a leading batch axis ``n``.
    labels : array
        Integer class indices of shape ``(n,)`` (a column ``(n, 1)`` is squeezed).
    batch_size : int, optional
        Chunk size of the evaluation (the last chunk is padded).

    Returns
    -------
    jax.Array
        The error rate in ``[0, 1]``.

    Raises
    ------
    GeometryError
        If ``images`` has no batch axis, ``batch_size < 1``, the labels are not integers or not one per
        image, or (when their values are concrete, i.e. not under ``jax.jit``) lie outside ``0 … C - 1``
        for a model with ``C`` outputs.  Under ``jit`` the values cannot be checked: an out-of-range
        label then silently counts as an error.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> apply = lambda p, x: x @ p
    >>> x, y = jnp.array([[1.0, 0], [0, 1], [1, 0]]), jnp.array([0, 1, 1])
    >>> float(mm.error_rate(apply, jnp.eye(2), x, y))
    0.333333...

    References
    ----------
    No formula from the source papers (the error behind the generalization gap of da Silva, Dangel &
    Oore 2025, Sec. 5.3). Chapter 7.
    """
    images = jnp.asarray(images)
    if images.ndim < 1:
        raise GeometryError(f"error_rate: images must have a leading batch axis, got shape {images.shape}.")
    batch_size = int(batch_size)
    if batch_size < 1:
        raise GeometryError(f"error_rate: batch_size must be a positive integer, got {batch_size}.")
    labels = _integer_labels(labels, images.shape[:1], "error_rate", f"images {images.shape}")
    rate, num_classes = _error_rate(apply_fn, params, images, labels, batch_size)
    if is_concrete(labels, num_classes):
        _check_label_range(labels, int(num_classes), "error_rate")
    return rate


def make_train_step(
    loss_fn: Callable[[PyTree, Batch], jax.Array], optimizer: optax.GradientTransformation
) -> Callable:
    r"""A jitted optimizer step on ``loss_fn``: ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    .. math:: (g, s') = \mathrm{update}\big(\nabla_w L(w; \text{batch}), s, w\big),\qquad w' = w + g

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(params, batch) -> scalar``.
    optimizer : optax.GradientTransformation
        The optimizer (its ``update`` gives the step :math:`g`).

    Returns
    -------
    callable
        The jitted step; ``loss`` is the loss before the update.

    Examples
    --------
    >>> import jax.numpy as jnp, optax
    >>> import minigeo.models as mm
    >>> step = mm.make_train_step(lambda w, b: jnp.sum((w - b) ** 2), optax.sgd(0.25))
    >>> w, state, loss = step(jnp.zeros(2), optax.sgd(0.25).init(jnp.zeros(2)), jnp.ones(2))
    >>> w, float(loss)
    (Array([0.5, 0.5], dtype=float32), 2.0)

    References
    ----------
    No formula from the source papers (an optax training step). Chapter 7.
    """

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@functools.partial(jax.jit, static_argnames=("loss_fn", "optimizer", "epochs", "batch_size", "augment"))
def train_epochs(
    key: jax.Array,
    params: PyTree,
    opt_state: PyTree,
    data: Batch,
    *,
    loss_fn: Callable[[PyTree, Batch], jax.Array],
    optimizer: optax.GradientTransformation,
    epochs: int,
    batch_size: int,
    augment: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> tuple[PyTree, PyTree, jax.Array]:
    r"""Run ``epochs`` epochs of minibatch training, compiled as one ``lax.scan``.

    Each epoch shuffles ``data = (inputs, labels)`` with a fresh key and takes
    ``len(inputs) // batch_size`` steps of :func:`make_train_step` (the remainder is dropped).

    Parameters
    ----------
    key : jax.Array
        PRNG key (shuffling and augmentation).
    params : pytree
        Initial parameters.
    opt_state : pytree
        Initial optimizer state, ``optimizer.init(params)``.
    data : tuple of arrays
        ``(inputs, labels)`` with a common leading axis.
    loss_fn : callable
        ``loss_fn(params, (x, y)) -> scalar``; hashable (a static argument).
    optimizer : optax.GradientTransformation
        The optimizer (static).
    epochs : int
        Number of epochs (static).
    batch_size : int
        Minibatch size (static).
    augment : callable, optional
        ``augment(key, inputs) -> inputs``, applied to each minibatch's inputs.

    Returns
    -------
    tuple
        The final parameters, the final optimizer state, and the mean training loss of every epoch
        (shape ``(epochs,)``).

    Raises
    ------
    GeometryError
        If ``batch_size`` exceeds the number of examples.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, optax
    >>> import minigeo.models as mm
    >>> x = jnp.linspace(-1, 1, 32)[:, None]; y = 3 * x[:, 0]
    >>> loss = lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2)
    >>> opt = optax.sgd(0.5)
    >>> w0 = jnp.zeros(1)
    >>> w, _, losses = mm.train_epochs(jax.random.PRNGKey(0), w0, opt.init(w0), (x, y),
    ...                                loss_fn=loss, optimizer=opt, epochs=20, batch_size=8)
    >>> round(float(w[0]), 3), bool(losses[-1] < 1e-4)
    (3.0, True)

    References
    ----------
    No formula from the source papers (an optax training loop compiled as one scan). Chapter 7.
    """
    inputs, labels = data
    n = inputs.shape[0]
    steps = n // batch_size
    if steps == 0:
        raise GeometryError(f"train_epochs: batch_size {batch_size} exceeds the {n} training examples.")
    step = make_train_step(loss_fn, optimizer)

    def epoch(carry, k):
        params, opt_state = carry
        k_perm, k_aug = jax.random.split(k)
        idx = jax.random.permutation(k_perm, n)[: steps * batch_size].reshape(steps, batch_size)

        def one(carry, args):
            params, opt_state = carry
            i, ka = args
            x, y = inputs[i], labels[i]
            if augment is not None:
                x = augment(ka, x)
            params, opt_state, loss = step(params, opt_state, (x, y))
            return (params, opt_state), loss

        carry, losses = jax.lax.scan(one, (params, opt_state), (idx, jax.random.split(k_aug, steps)))
        return carry, jnp.mean(losses)

    (params, opt_state), losses = jax.lax.scan(epoch, (params, opt_state), jax.random.split(key, epochs))
    return params, opt_state, losses

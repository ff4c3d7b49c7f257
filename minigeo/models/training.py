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
import optax

from .._checks import GeometryError
from .._tree import PyTree

__all__ = ["cross_entropy", "error_rate", "make_train_step", "train_epochs"]

Batch = tuple[jax.Array, jax.Array]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    r"""Mean cross-entropy :math:`-\frac1B\sum_b \log\mathrm{softmax}(z_b)_{y_b}` for integer labels.

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (cross-entropy as a negative log-likelihood). Taught
    in chapter 7, *Capstone: geodesic sharpness of vision transformers*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> float(mm.cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 3])))   # log 4
    1.386294...
    """
    if logits.shape[:-1] != labels.shape:
        raise GeometryError(
            f"cross_entropy: logits {logits.shape} and labels {labels.shape} disagree on the batch shape."
        )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@functools.partial(jax.jit, static_argnames=("apply_fn", "batch_size"))
def error_rate(
    apply_fn: Callable, params: PyTree, images: jax.Array, labels: jax.Array, batch_size: int = 512
) -> jax.Array:
    """Fraction of misclassified examples, ``apply_fn(params, images)`` evaluated in chunks of ``batch_size``.

    References
    ----------
    No formula from the source papers: the test/train error behind the generalization gap of da
    Silva, Dangel & Oore (2025), *Hide & Seek*, Sec. 5. Taught in chapter 7, *Capstone: geodesic
    sharpness of vision transformers*.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo.models as mm
    >>> apply = lambda p, x: x @ p
    >>> float(mm.error_rate(apply, jnp.eye(2), jnp.array([[1.0, 0], [0, 1], [1, 0]]), jnp.array([0, 1, 1])))
    0.333333...
    """
    n = images.shape[0]
    pad = -n % batch_size
    x = jnp.concatenate([images, jnp.zeros((pad,) + images.shape[1:], images.dtype)])
    chunks = x.reshape((-1, batch_size) + images.shape[1:])
    preds = jax.lax.map(lambda xb: jnp.argmax(apply_fn(params, xb), axis=-1), chunks).reshape(-1)[:n]
    return jnp.mean(preds != labels)


def make_train_step(
    loss_fn: Callable[[PyTree, Batch], jax.Array], optimizer: optax.GradientTransformation
) -> Callable:
    """A jitted step ``(params, opt_state, batch) -> (params, opt_state, loss)`` of ``optimizer`` on ``loss_fn``.

    References
    ----------
    No formula from the source papers: an optax training step. Taught in chapter 7, *Capstone:
    geodesic sharpness of vision transformers*.

    Examples
    --------
    >>> import jax.numpy as jnp, optax
    >>> import minigeo.models as mm
    >>> step = mm.make_train_step(lambda w, b: jnp.sum((w - b) ** 2), optax.sgd(0.25))
    >>> w, state, loss = step(jnp.zeros(2), optax.sgd(0.25).init(jnp.zeros(2)), jnp.ones(2))
    >>> w, float(loss)
    (Array([0.5, 0.5], dtype=float32), 2.0)
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
    ``len(inputs) // batch_size`` steps (the remainder is dropped); ``augment(key, inputs)``,
    if given, transforms each minibatch's inputs.  Returns the final parameters and optimizer
    state and the mean training loss of every epoch.

    References
    ----------
    No formula from the source papers: an optax training loop compiled as one scan. Taught in
    chapter 7, *Capstone: geodesic sharpness of vision transformers*.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, optax
    >>> import minigeo.models as mm
    >>> x = jnp.linspace(-1, 1, 32)[:, None]; y = 3 * x[:, 0]
    >>> loss = lambda w, b: jnp.mean((b[0] @ w - b[1]) ** 2)
    >>> opt = optax.sgd(0.5)
    >>> w, _, losses = mm.train_epochs(jax.random.PRNGKey(0), jnp.zeros(1), opt.init(jnp.zeros(1)), (x, y),
    ...                                loss_fn=loss, optimizer=opt, epochs=20, batch_size=8)
    >>> round(float(w[0]), 3), bool(losses[-1] < 1e-4)
    (3.0, True)
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

"""Output-space likelihoods of the Fisher: the ``Likelihood`` type, the categorical and Gaussian ones,
and the one lookup of a likelihood given by name (floor 1.1).

Shared by :mod:`minigeo.metrics` (which re-exports the public names) and :mod:`minigeo.kronecker`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError

__all__ = [
    "Likelihood",
    "as_likelihood",
    "categorical_likelihood",
    "fisher_factor",
    "gaussian_likelihood",
    "is_categorical",
]


class Likelihood(NamedTuple):
    r"""An output-space likelihood :math:`p(t \mid z)` for the Fisher.

    .. math:: F_z = \mathbb E_{t\sim p(\cdot\mid z)}\big[\nabla_z \log p(t\mid z)\,\nabla_z \log p(t\mid z)^\top\big].

    Attributes
    ----------
    name : str
        ``"categorical"`` or ``"gaussian"``.
    fisher_mv : callable
        ``(z, u) -> F_z u`` for a batch of outputs ``z`` (leading batch axis), summed over the batch.
    sample : callable
        ``(key, z) -> t``: targets drawn from the model, one per example.
    nll : callable
        ``(z, t) -> per-example negative log-likelihoods`` (shape ``(N,)``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> lik = mg.categorical_likelihood()
    >>> lik.name
    'categorical'
    >>> # (diag(p) - p p^T) u with p = (1/2, 1/2)
    >>> lik.fisher_mv(jnp.zeros((1, 2)), jnp.array([[1.0, 0.0]])).tolist()
    [[0.25, -0.25]]

    References
    ----------
    Kristiadi, Dangel & Hennig (2023), Sec. 3.4; Grosse (2022), CSC2541 lecture 3 *Metrics* (output-space
    Fisher :math:`F_z`). Chapter 2.
    """

    name: str
    fisher_mv: Callable[[jax.Array, jax.Array], jax.Array]
    sample: Callable[[jax.Array, jax.Array], jax.Array]
    nll: Callable[[jax.Array, jax.Array], jax.Array]


def _categorical_fisher_mv(z: jax.Array, u: jax.Array) -> jax.Array:
    """``(diag(p) - p p^T) u`` per example, ``p = softmax(z)`` (:func:`fisher_diagonal` knows it)."""
    p = jax.nn.softmax(z, axis=-1)
    return p * u - p * jnp.sum(p * u, axis=-1, keepdims=True)


def categorical_likelihood() -> Likelihood:
    r"""Softmax categorical likelihood on logits ``z`` of shape ``(N, C)``; targets are integer labels.

    .. math:: F_z = \mathrm{diag}(p) - p p^\top,\qquad p = \mathrm{softmax}(z)

    per example, which is also the Hessian of the cross-entropy in the logits.

    Returns
    -------
    :class:`~minigeo.Likelihood`
        Named ``"categorical"``.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> lik = mg.metrics.categorical_likelihood()
    >>> lik.fisher_mv(jnp.zeros((1, 2)), jnp.array([[1.0, 0.0]]))  # p = (1/2, 1/2)
    Array([[ 0.25, -0.25]], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (Bregman divergence: for natural parameters of an
    exponential family, such as logits, :math:`F_z = H_z`). Chapter 2.
    """

    def sample(key: jax.Array, z: jax.Array) -> jax.Array:
        return jax.random.categorical(key, z, axis=-1)

    def nll(z: jax.Array, t: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(z, axis=-1)
        return -jnp.take_along_axis(logp, t[..., None].astype(jnp.int32), axis=-1)[..., 0]

    return Likelihood("categorical", _categorical_fisher_mv, sample, nll)


def gaussian_likelihood(sigma: float = 1.0) -> Likelihood:
    r"""Gaussian likelihood :math:`\mathcal N(t \mid z, \sigma^2 I)` with fixed :math:`\sigma`.

    .. math:: F_z = I/\sigma^2.

    Parameters
    ----------
    sigma : float, optional
        The standard deviation :math:`\sigma > 0`.

    Returns
    -------
    :class:`~minigeo.Likelihood`
        Named ``"gaussian"``.

    Raises
    ------
    GeometryError
        If ``sigma`` is not positive.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.metrics.gaussian_likelihood(2.0).fisher_mv(jnp.zeros((1, 1)), jnp.ones((1, 1)))
    Array([[0.25]], dtype=float32)

    References
    ----------
    Grosse (2022), CSC2541 lecture 3 *Metrics* (squared error: :math:`H_z = G_z = I`, Fisher =
    Gauss-Newton). Chapter 2.
    """
    if not sigma > 0:
        raise GeometryError(f"gaussian_likelihood: sigma must be > 0, got {sigma}.")

    def fisher_mv(z: jax.Array, u: jax.Array) -> jax.Array:
        return u / sigma**2

    def sample(key: jax.Array, z: jax.Array) -> jax.Array:
        return z + sigma * jax.random.normal(key, jnp.shape(z), dtype=jnp.result_type(z))

    def nll(z: jax.Array, t: jax.Array) -> jax.Array:
        sq = jnp.sum(((t - z) ** 2).reshape(z.shape[0], -1), axis=-1)
        k = int(np.prod(z.shape[1:])) if z.ndim > 1 else 1
        return 0.5 * sq / sigma**2 + 0.5 * k * jnp.log(2 * jnp.pi * sigma**2)

    return Likelihood("gaussian", fisher_mv, sample, nll)


def is_categorical(lik: Likelihood) -> bool:
    """Whether ``lik`` is minigeo's categorical likelihood (whose Fisher factor has a closed form)."""
    return lik.fisher_mv is _categorical_fisher_mv


def fisher_factor(fisher_mv: Callable, z: jax.Array, categorical: bool) -> jax.Array:
    r"""``S``, ``(N, C, R)``, with :math:`F_{z_n} = S_n S_n^\top` (``C`` entries of one example's output);
    ``categorical``: ``fisher_mv`` is minigeo's categorical one (:func:`is_categorical`; then the factor
    in closed form).  A flag, not an identity test here: inside a compiled rule ``fisher_mv`` is a stand-in
    for the user's function."""
    n, c = z.shape[0], int(np.prod(z.shape[1:]))
    if categorical and z.ndim == 2:  # closed form, no eigensolver
        p = jax.nn.softmax(z, axis=-1)
        s = jnp.sqrt(p)
        return jax.vmap(jnp.diag)(s) - p[:, :, None] * s[:, None, :]  # diag(sqrt p) - p sqrt(p)^T
    basis = jnp.eye(c, dtype=z.dtype)
    cols = jax.vmap(lambda e: fisher_mv(z, jnp.broadcast_to(e.reshape(z.shape[1:]), z.shape)))(basis)
    blocks = jnp.moveaxis(cols.reshape(c, n, c), 0, -1)  # blocks[n, :, k] = F_n e_k
    lam, q = jnp.linalg.eigh(0.5 * (blocks + jnp.swapaxes(blocks, 1, 2)))
    return q * jnp.sqrt(jnp.maximum(lam, 0.0))[:, None, :]  # a PSD factor Q sqrt(Lambda)


def as_likelihood(likelihood: Union[str, Likelihood], who: str) -> Likelihood:
    """The :class:`Likelihood` that ``likelihood`` names (``"categorical"``, ``"gaussian"``) or is."""
    if isinstance(likelihood, Likelihood):
        return likelihood
    if likelihood == "categorical":
        return categorical_likelihood()
    if likelihood == "gaussian":
        return gaussian_likelihood()
    raise GeometryError(
        f"{who}: unknown likelihood {likelihood!r}; use 'categorical', 'gaussian', or a Likelihood from "
        "categorical_likelihood() / gaussian_likelihood(sigma)."
    )

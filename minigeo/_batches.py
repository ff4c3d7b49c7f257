r"""The one batches type: an in-memory dataset cut into consecutive batches (floor 1).

:func:`batches_of` serves both kinds of consumer: the dataset operators of
:mod:`minigeo.operators` iterate over it batch by batch, and the sharpness functions of
:mod:`minigeo.sharpness` take it whole (as its stack, :meth:`Batches.stacked`).  Re-exported by
:mod:`minigeo.operators` (``mg.operators.batches_of``, ``mg.operators.Batches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import GeometryError
from ._tree import PyTree

__all__ = ["Batch", "Batches", "batches_of"]

Batch = Any


class Batches(Sequence):
    r"""An in-memory dataset cut into consecutive batches; re-iterable, with a length.

    No formula: batch :math:`i` holds examples ``i * batch_size`` to ``(i + 1) * batch_size - 1``.

    Every batch it makes satisfies the example-count rule of :class:`~minigeo.operators.CurvatureOperator`
    (every leaf has the example axis first, and they agree), and it has a length, so every pass
    over it is finite.  The sharpness functions take it too (:meth:`stacked` is the stack they
    use; every batch must then have the same size).

    Parameters
    ----------
    data : pytree of arrays
        A pytree of arrays with a common leading example axis, e.g. ``(inputs, labels)``.
    batch_size : int
        Examples per batch; the last batch holds the remainder unless ``drop_remainder``.
    drop_remainder : bool, optional
        Drop the last, smaller batch (one compiled program instead of two).

    Raises
    ------
    GeometryError
        If ``data`` has no arrays with a leading axis, the arrays disagree on the number of
        examples, ``batch_size`` is not a positive int, or no batch remains.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> b = mg.operators.batches_of((jnp.zeros((10, 3)), jnp.arange(10)), 4)
    >>> len(b), [x.shape[0] for x, _ in b]
    (3, [4, 4, 2])
    >>> data = (jnp.zeros((10, 3)), jnp.arange(10))
    >>> [x.shape for x in mg.operators.batches_of(data, 5).stacked()]
    [(2, 5, 3), (2, 5)]

    References
    ----------
    No formula from the source papers: the data side of :class:`~minigeo.operators.CurvatureOperator`.
    Taught in chapter 4, *Invariant Hessians*.
    """

    def __init__(self, data: PyTree, batch_size: int, drop_remainder: bool = False) -> None:
        leaves = jax.tree_util.tree_leaves(data)
        if not leaves or any(jnp.ndim(x) < 1 for x in leaves):
            raise GeometryError("batches_of: data must be a pytree of arrays with a leading example axis.")
        sizes = {int(jnp.shape(x)[0]) for x in leaves}
        if len(sizes) != 1:
            raise GeometryError(
                f"batches_of: the arrays of data have different numbers of examples {sorted(sizes)}; "
                "their leading axes must agree."
            )
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise GeometryError(f"batches_of: batch_size must be a positive int, got {batch_size!r}.")
        self.data, self.batch_size = data, int(batch_size)
        self.num_examples = sizes.pop()
        full, rest = divmod(self.num_examples, self.batch_size)
        self._len = full + (1 if rest and not drop_remainder else 0)
        if self._len == 0:
            raise GeometryError(
                f"batches_of: no batch: {self.num_examples} examples, batch_size {batch_size} and "
                "drop_remainder=True."
            )

    def __len__(self) -> int:
        return self._len

    def stacked(self) -> PyTree:
        """The batches stacked along a new leading axis: every leaf ``(len(self), batch_size, ...)``.

        The form :func:`~minigeo.adaptive_sharpness` and :func:`~minigeo.geodesic_sharpness` take.
        Needs equal batches: ``drop_remainder=True`` or a number of examples divisible by ``batch_size``.
        """
        if self.num_examples % self.batch_size and self._len * self.batch_size > self.num_examples:
            raise GeometryError(
                f"batches_of: cannot stack {self.num_examples} examples into batches of {self.batch_size}: the last "
                "batch is smaller. Use drop_remainder=True or a batch_size that divides the number of examples."
            )
        k, b = self._len, self.batch_size
        return jax.tree_util.tree_map(lambda x: x[: k * b].reshape((k, b) + tuple(jnp.shape(x)[1:])), self.data)

    def __getitem__(self, i: int) -> Batch:  # type: ignore[override]
        if not -self._len <= i < self._len:
            raise IndexError(f"batch {i} of {self._len}")
        start = (i % self._len) * self.batch_size
        return jax.tree_util.tree_map(lambda x: x[start : start + self.batch_size], self.data)


def batches_of(data: PyTree, batch_size: int, *, drop_remainder: bool = False) -> Batches:
    r"""Cut an in-memory dataset into consecutive batches (see :class:`~minigeo.operators.Batches`).

    No formula: batch :math:`i` holds examples ``i * batch_size`` to ``(i + 1) * batch_size - 1``.

    Parameters
    ----------
    data : pytree of arrays
        A pytree of arrays with a common leading example axis: **every** leaf is per-example (a
        leaf shared by all examples does not belong in ``data``; close over it in the loss, or
        pass your own batches with ``examples=`` to the operator).
    batch_size : int
        Examples per batch.
    drop_remainder : bool, optional
        Drop the last, smaller batch.

    Returns
    -------
    :class:`~minigeo.operators.Batches`
        A re-iterable sequence of batches (pytrees like ``data``) with a length, so that every pass over
        it is finite; the sharpness functions take it as it is (as its stack, ``.stacked()``).

    Raises
    ------
    GeometryError
        If the arrays disagree on the number of examples or ``batch_size`` is not positive.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> [int(x.sum()) for x in mg.operators.batches_of(jnp.arange(5), 2)]
    [1, 5, 4]

    References
    ----------
    No formula from the source papers: the data side of :class:`~minigeo.operators.CurvatureOperator`.
    Taught in chapter 4, *Invariant Hessians*.
    """
    return Batches(data, batch_size, drop_remainder)

r"""Data parallelism with ``jax.sharding`` (floor 1, chapter 7).

Sharpness and training are averages over examples, so they parallelize over the batch: put
each device's share of the examples on that device, replicate the parameters, and let
``jit`` (GSPMD) partition the computation and insert the cross-device sums.  Nothing in
:func:`minigeo.adaptive_sharpness`, :func:`minigeo.geodesic_sharpness` or a jitted training
step changes: they return the same numbers (up to the order of floating-point sums) on
sharded inputs.

On a CPU-only machine, test with several host devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (set before JAX starts).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._checks import GeometryError

__all__ = ["data_parallel_mesh", "shard_batch", "replicate"]

PyTree = Any


def data_parallel_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    r"""A one-axis device mesh named ``"data"`` for data parallelism.

    Parameters
    ----------
    devices : sequence of jax.Device, optional
        The devices; default all local devices.

    Returns
    -------
    jax.sharding.Mesh
        The mesh, axis ``"data"`` over ``devices``.

    Raises
    ------
    GeometryError
        If ``devices`` is empty.

    Examples
    --------
    >>> import minigeo as mg
    >>> mg.parallel.data_parallel_mesh().axis_names
    ('data',)

    References
    ----------
    No formula from the source papers (data parallelism for the paper-scale runs of da Silva, Dangel &
    Oore 2025, App. C.2). Chapter 7.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if not devices:
        raise GeometryError("data_parallel_mesh: no devices given.")
    return Mesh(np.array(devices), ("data",))


def shard_batch(batch: PyTree, mesh: Mesh | None = None, *, axis: int = 0) -> PyTree:
    r"""Split every leaf of ``batch`` along its example axis over the mesh's ``"data"`` devices.

    Use ``axis=0`` for one batch of examples and ``axis=1`` for the stacked batches
    ``(n_batches, batch_size, ...)`` taken by the sharpness functions.

    Parameters
    ----------
    batch : pytree
        Arrays with an example axis ``axis``.
    mesh : jax.sharding.Mesh, optional
        A mesh with a ``"data"`` axis; default :func:`data_parallel_mesh`.
    axis : int, optional
        The example axis.

    Returns
    -------
    pytree
        ``batch`` with every leaf placed with sharding ``PartitionSpec(None, ..., "data")``.

    Raises
    ------
    GeometryError
        If a leaf has fewer than ``axis + 1`` dimensions or its size along ``axis`` is not a
        multiple of the number of devices (pad or drop examples to fix it).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> x = mg.parallel.shard_batch(jnp.ones((4, 3)))
    >>> x.shape, x.sharding.spec
    ((4, 3), P('data',))

    References
    ----------
    No formula from the source papers (data parallelism for the paper-scale runs of da Silva, Dangel &
    Oore 2025, App. C.2). Chapter 7.
    """
    mesh = data_parallel_mesh() if mesh is None else mesh
    n = mesh.shape["data"]

    def put(x):
        x = jax.numpy.asarray(x)
        if x.ndim <= axis:
            raise GeometryError(f"shard_batch: a leaf of shape {x.shape} has no example axis {axis}.")
        if x.shape[axis] % n:
            raise GeometryError(
                f"shard_batch: {x.shape[axis]} examples along axis {axis} cannot be split evenly over {n} devices; "
                f"use a batch size that is a multiple of {n}."
            )
        spec = PartitionSpec(*([None] * axis), "data")
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(put, batch)


def replicate(tree: PyTree, mesh: Mesh | None = None) -> PyTree:
    r"""Put a full copy of every leaf (e.g. the parameters) on each device of the mesh.

    Parameters
    ----------
    tree : pytree
        The arrays to replicate.
    mesh : jax.sharding.Mesh, optional
        The mesh; default :func:`data_parallel_mesh`.

    Returns
    -------
    pytree
        ``tree`` with every leaf replicated (``PartitionSpec()``).

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> import minigeo as mg
    >>> mg.parallel.replicate({"w": jnp.ones(3)})["w"].sharding.spec
    P()

    References
    ----------
    No formula from the source papers (data parallelism for the paper-scale runs of da Silva, Dangel &
    Oore 2025, App. C.2). Chapter 7.
    """
    mesh = data_parallel_mesh() if mesh is None else mesh
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))

"""One mesh for data, sequence and FSDP parallelism, and where each array of a run lives on it.

The mesh is ``(data, seq)``: batch rows split over "data", time over "seq" (the wkv recurrence
through :func:`rwkv_jax.shard`, its state passing between the "seq" devices). With FSDP (ZeRO-3)
every parameter and optimizer-state array is split over "data" too, along its largest dimension
that "data" divides (arrays no dimension of which it divides stay whole on every device); the
step gathers each block's parameters where the block runs (:func:`gathered`), so XLA all-gathers
them one layer at a time and reduce-scatters their gradients. The same code runs in one process
or in many (``jax.distributed``): processes lie along "data" and each reads its own rows.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .. import ops
from ..shard import shard


def make_mesh(config) -> jax.sharding.Mesh:
    """The ``(data, seq)`` mesh of ``config``: every device (``data`` -1), or the first
    ``data * seq`` devices (in one process; several processes need every device)."""
    devices = jax.devices()
    data = len(devices) // config.seq if config.data == -1 else config.data
    if data < 1 or data * config.seq > len(devices) or (
            (config.data == -1 or jax.process_count() > 1)
            and data * config.seq != len(devices)):
        raise ValueError(f"the mesh data={config.data} x seq={config.seq} does not fit the "
                         f"{len(devices)} devices")
    devices = devices[:data * config.seq]
    if config.micro_batch % data:
        raise ValueError(f"micro_batch ({config.micro_batch}) must be a multiple of the mesh's "
                         f"data axis ({data})")
    if config.seq_len % config.seq:
        raise ValueError(f"seq_len ({config.seq_len}) must be a multiple of the mesh's seq axis "
                         f"({config.seq})")
    if data % jax.process_count():
        raise ValueError(f"the mesh's data axis ({data}) must be a multiple of the process count "
                         f"({jax.process_count()}): processes lie along it")
    return jax.make_mesh((data, config.seq), ("data", "seq"),
                         axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def array_sharding(mesh, shape, fsdp: bool) -> NamedSharding:
    """Where a parameter (or optimizer-state array) of ``shape`` lives: with ``fsdp`` split over
    "data" along its largest dimension that "data" divides (the first such, on ties), else
    whole on every device."""
    data = mesh.shape["data"]
    dims = [i for i, n in enumerate(shape) if n % data == 0]
    if not fsdp or data == 1 or not dims:
        return replicated(mesh)
    dim = max(dims, key=lambda i: shape[i])
    return NamedSharding(mesh, P(*(("data" if i == dim else None) for i in range(len(shape)))))


def tree_shardings(mesh, tree, fsdp: bool):
    """:func:`array_sharding` for every array of ``tree`` (arrays or shape structs)."""
    return jax.tree.map(lambda x: array_sharding(mesh, np.shape(x), fsdp), tree)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh) -> NamedSharding:
    """``[micro-batches, rows, T]`` token arrays: rows over "data", time over "seq"."""
    return NamedSharding(mesh, P(None, "data", "seq"))


def gathered(mesh, tree):
    """``tree``'s arrays whole on every device: where a block uses its parameters, so that
    FSDP gathers them there (and scatters their gradients back)."""
    if mesh.shape["data"] == 1:
        return tree
    whole = replicated(mesh)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, whole), tree)


def wkv_op(mesh, backend=None):
    """:func:`rwkv_jax.rwkv7` for the model's blocks: on one device the op itself, else
    :func:`rwkv_jax.shard` of it over the mesh's axes of more than one device."""
    op = functools.partial(ops.rwkv7, backend=backend)
    axes = dict(batch_axis="data" if mesh.shape["data"] > 1 else None,
                seq_axis="seq" if mesh.shape["seq"] > 1 else None)
    return op if mesh.size == 1 else shard(op, mesh, **axes)


def global_batch(mesh, local: np.ndarray) -> jax.Array:
    """The global ``[micro-batches, rows, T]`` array whose rows ``local`` holds this process's
    share of (processes in order along "data")."""
    shape = (local.shape[0], local.shape[1] * jax.process_count(), local.shape[2])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), local, shape)

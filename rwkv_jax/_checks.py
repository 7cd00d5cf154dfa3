"""Input validation. Every public op checks its arguments here before any backend runs, and
every message names the argument, what it got and what it needs."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _desc(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def _dims(spec: tuple[str, ...]) -> str:
    return "[" + ", ".join(spec) + "]"


def array(name, x):
    """``x`` as something with .shape and .dtype (jax arrays, tracers, numpy arrays)."""
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        if isinstance(x, (list, tuple, numbers.Number)):
            x = np.asarray(x)
        else:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return x


def floating(name, x):
    x = array(name, x)
    if not any(x.dtype == d for d in FLOAT_DTYPES):
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"got {_desc(x)}")
    return x


def shaped(name, x, spec: tuple[str, ...], sizes: dict, *, kind=floating):
    """Check ``x`` against a named shape like ('B', 'T', 'H', 'K'), binding names in ``sizes``.

    The first argument to use a dimension name fixes its size; later ones must agree.
    """
    x = kind(name, x)
    if x.ndim != len(spec):
        raise ValueError(f"{name} must be {len(spec)}-D {_dims(spec)}, got {_desc(x)}")
    for axis, (dim, size) in enumerate(zip(spec, x.shape)):
        if dim.isdigit():
            expected = int(dim)
        elif dim in sizes:
            expected = sizes[dim][0]
        else:
            sizes[dim] = (size, name)
            continue
        if size != expected:
            # A literal size speaks for itself; a named one says which argument fixed it.
            need = "" if dim.isdigit() else f" with {dim}={expected} (from {sizes[dim][1]})"
            raise ValueError(
                f"{name} must be {_dims(spec)}{need}, got {_desc(x)} "
                f"(axis {axis} is {size})")
    return x


def integer(name, x):
    x = array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype (int32), got {_desc(x)}")
    return x


def flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def scalar(name, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def positive_length(name, t):
    if t < 1:
        raise ValueError(f"{name} must have at least one time step, got T={t}")


_SIZE_NAMES = {"K": "key (head) size", "V": "value size"}


def positive_sizes(sizes: dict, dims: str):
    """Each of ``dims`` (names ``shaped`` bound in ``sizes``, e.g. "KV") at least 1: an empty
    key or value axis is a ValueError naming the argument that set it, on every backend."""
    for dim in dims:
        if dim in sizes and sizes[dim][0] < 1:
            size, name = sizes[dim]
            raise ValueError(f"{name} must have a {_SIZE_NAMES.get(dim, dim)} {dim} >= 1 (its last "
                             f"axis), got {dim}={size}")


def on_host(x) -> bool:
    """Whether this process can read every value of ``x``: anything but a tracer or a jax array
    split across processes (one this process holds only part of). Replicated arrays count: every
    process holds them whole."""
    if isinstance(x, jax.core.Tracer):
        return False
    return (not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated)


def host_values(x):
    """The values of ``x`` as a numpy array when this process can read them all (``on_host``:
    numpy arrays and scalars, lists, tuples, Python ints, jax arrays that are neither tracers nor
    split across processes), else None. Values that are None here are checked on the device
    (ops.py's guards), as under ``jit``: a host check of this process's part alone would raise
    in some processes and leave the others waiting in their next collective. Read in the array's
    own integer dtype, so an int64 value that int32 cannot hold is seen as it is."""
    if not on_host(x):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:   # replicated: read one copy
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def _listed(values, limit=8) -> str:
    values = np.asarray(values).tolist()
    return str(values) if len(values) <= limit else str(values[:limit])[:-1] + ", ...]"


def cu_seqlens(x, batch: int, total: int):
    """Validate ``cu_seqlens``: int ``[N + 1]``, B == 1, and when its values are known in Python
    (not a tracer), rising from 0 to T without decreasing. Returns it in its own integer dtype:
    the ops layer checks traced values before the cast to int32 (ops.py, ``_guard_offsets``)."""
    x = integer("cu_seqlens", x)
    if x.ndim != 1 or x.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N+1] with N >= 1 segments, got {_desc(x)}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (segments are packed along T), "
                         f"got B={batch}")
    values = host_values(x)
    if values is not None:
        decreasing = np.flatnonzero(values[1:] < values[:-1])
        if values[0] != 0 or values[-1] != total or decreasing.size:
            where = (f"; it decreases after index {decreasing[0]}" if decreasing.size else "")
            raise ValueError(f"cu_seqlens must rise from 0 to T={total} without decreasing, "
                             f"got {_listed(values)}{where}")
    return x


def indices(name, x, slots: int, *, distinct: bool):
    """Validate the values of ``x`` (an int array of pool rows) when Python can know them: each
    in ``[0, slots)``, and no two alike when ``distinct``. Traced values are left to the ops
    layer (ops.py, ``_guard_rows``). Returns ``x`` unchanged."""
    values = host_values(x)
    if values is None:
        return x
    bad = np.flatnonzero((values < 0) | (values >= slots))
    if bad.size:
        raise ValueError(f"{name} must be in [0, {slots}) (there are {slots} state rows), got "
                         f"{_listed(values)}: out of range at positions {_listed(bad)}")
    if distinct:
        unique, counts = np.unique(values, return_counts=True)
        if np.any(counts > 1):
            raise ValueError(f"{name} must be distinct (two rows cannot update one slot), got "
                             f"{_listed(values)}: repeated {_listed(unique[counts > 1])}")
    return x


def take_rows(name, pool, rows):
    """Rows ``rows`` of ``pool`` (``[S, ...]``), many rows may share one. Values known in Python
    must be in ``[0, S)`` (ValueError naming ``name``); a traced index outside it gives a NaN row
    instead of a clamped or wrapped one (DESIGN.md, "Public API")."""
    slots = pool.shape[0]
    indices(name, rows, slots, distinct=False)
    rows = jnp.asarray(rows)
    rows = jnp.where((rows >= 0) & (rows < slots), rows, slots).astype(jnp.int32)
    return jnp.asarray(pool).at[rows].get(mode="fill", fill_value=jnp.nan)

"""Data, head and sequence parallelism for the sequence ops, through ``jax.shard_map``.

    f = rwkv_jax.shard(rwkv_jax.rwkv7, mesh, batch_axis="data", seq_axis="seq")
    o, h = f(r, w, k, v, a, b, initial_state=h0)      # same signature and results as rwkv7

Batch and head parallelism need no communication: each device runs the op on its block.

Sequence parallelism passes the state across the devices of ``seq_axis``. Every recurrence here
is affine in the state: after a block of steps ``h_out = Φ(h_in) + h_local``, where ``h_local`` is
the block's final state from zero and ``Φ`` its transition (a K×K matrix per head for RWKV-7, a
decay per state entry for RWKV-6 and GLA), and every output is linear in the state too:
``o_t = o_local_t + (Φ_t h_in)^T (scale r_t)`` with ``Φ_t`` the transition up to step ``t``. So
each device

1. runs the op on its block from zero (the first block from ``initial_state``), which gives
   ``o_local`` and ``h_local``, and gets its transition together with ``p_t = Φ_t^T (scale r_t)``:
   for RWKV-6 and GLA from cumulative sums of the log decays; for RWKV-7 by running the same op
   a second time, on zero values (V = K) from the identity state: its final state is ``M``, the
   product of ``diag(exp w_t) + b_t a_t^T`` over the block, and its outputs are ``p_t``;
2. all-gathers ``(Φ, h_local)`` over ``seq_axis`` and composes them in order: the state entering
   its block (an exclusive scan) and the final state of the whole sequence;
3. adds ``h_in^T p_t`` to its outputs, which is exactly what rerunning the block from ``h_in``
   would give, without rerunning it.

Everything is ordinary differentiable JAX around the public op, so gradients are exact and any
backend works; per-device memory is that of one block (plus ``n`` states for the scan). Cost:
RWKV-7 runs its recurrence twice per block (the transition is a K×K matrix), so over ``n``
devices each does ``2/n`` of the one-device work; RWKV-6 and GLA do ``1/n`` plus elementwise
work and one ``[T/n, K] x [K, V]`` product per head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, PartitionSpec

from . import ops

# Dimension labels of each argument; "B", "T", "H" (and "C", RWKV-4's channels) are split over
# the batch, sequence and head axes, None is never split.
_TOKENS = ("B", "T", "H", None)    # [B, T, H, K] or [B, T, H, V]
_STATE = ("B", "H", None, None)    # [B or N, H, K, V]


@dataclasses.dataclass(frozen=True)
class _OpSpec:
    name: str
    arrays: dict                   # argument name -> dimension labels
    outputs: tuple                 # labels of (output, final state)
    # Sequence-parallel pass over one block, or None where it is not supported:
    # (run, arrays, start, options) -> (o_local, h_local, transition, is_matrix, p, post)
    block_pass: Optional[Callable] = None


def _exclusive_cumsum(x):
    """Along time (axis 1): the sum over the steps before t."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), jnp.cumsum(x[:, :-1], axis=1)], axis=1)


def _rwkv7_block(run, x, start, options):
    """RWKV-7: h_t = A_t h_{t-1} + k_t v_t^T with A_t = diag(exp w_t) + b_t a_t^T, a full K×K map.
    The op run on zero values from the identity state has final state M = A_T ... A_1 and
    outputs p_t = (A_t ... A_1)^T (scale r_t). A second call of the op on the same arrays (not
    one call on inputs stacked along the batch) so that no input is copied: the memory of a
    block stays that of the op plus one zero value block."""
    o, h = run(**x, initial_state=start)
    batch, _, heads, keys = x["k"].shape
    eye = jnp.broadcast_to(jnp.eye(keys, dtype=jnp.float32), (batch, heads, keys, keys))
    p, transition = run(**{**x, "v": jnp.zeros(x["k"].shape, x["v"].dtype)}, initial_state=eye)
    return o, h, transition, True, p, None


def _rwkv6_block(run, x, start, options):
    """RWKV-6: the transition is diag(exp(sum of w)); step t reads the state before its decay."""
    o, h = run(**x, initial_state=start)
    log_decay = x["w"].astype(jnp.float32)
    p = options["scale"] * x["r"].astype(jnp.float32) * jnp.exp(_exclusive_cumsum(log_decay))
    transition = jnp.exp(jnp.sum(log_decay, axis=1))[..., None]     # [B, H, K, 1]
    return o, h, transition, False, p, None


def _gla_block(run, x, start, options):
    """GLA: the decay of state entry (k, v) is exp(g + g_gamma + gk[k] + gv[v]); step t reads the
    state after its update. With reverse=True the recurrence runs from the end of the block."""
    o, h = run(**x, initial_state=start)
    reverse = options["reverse"]
    q = x["q"].astype(jnp.float32)
    scale = options["scale"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def through(y):  # log decay over the steps up to t, inclusive, in the recurrence's direction
        y = y.astype(jnp.float32)
        return jnp.flip(jnp.cumsum(jnp.flip(y, 1), 1), 1) if reverse else jnp.cumsum(y, 1)

    scalar = jnp.zeros(q.shape[:3], jnp.float32)
    if x.get("g") is not None:
        scalar = scalar + x["g"]
    if x.get("g_gamma") is not None:
        scalar = scalar + x["g_gamma"]
    per_key = scalar[..., None] + (0.0 if x.get("gk") is None else x["gk"])   # [B, T, H, K or 1]
    p = scale * q * jnp.exp(through(per_key))
    transition = jnp.exp(jnp.sum(per_key, axis=1))[..., None]     # [B, H, K or 1, 1]
    post = None
    if x.get("gv") is not None:   # per value: a factor on the outputs and on the transition
        per_value = x["gv"].astype(jnp.float32)
        post = jnp.exp(through(per_value))
        transition = transition * jnp.exp(jnp.sum(per_value, axis=1))[..., None, :]
    return o, h, transition, False, p, post


_PACKED = {"initial_state": _STATE, "cu_seqlens": (None,)}   # cu_seqlens is never split
_OPS = {
    ops.rwkv7: _OpSpec("rwkv7", {n: _TOKENS for n in "rwkvab"} | _PACKED,
                       (_TOKENS, _STATE), _rwkv7_block),
    ops.rwkv6: _OpSpec("rwkv6", {n: _TOKENS for n in "rkvw"} | {"u": ("H", None)} | _PACKED,
                       (_TOKENS, _STATE), _rwkv6_block),
    ops.gated_linear_attention: _OpSpec(
        "gated_linear_attention",
        {"q": _TOKENS, "k": _TOKENS, "v": _TOKENS, "g": ("B", "T", "H"), "g_gamma": ("H",),
         "gk": _TOKENS, "gv": _TOKENS} | _PACKED,
        (_TOKENS, _STATE), _gla_block),
    ops.rwkv4: _OpSpec("rwkv4", {"w": ("C",), "u": ("C",), "k": ("B", "T", "C"),
                                 "v": ("B", "T", "C"), "initial_state": ("B", "C", None)},
                       (("B", "T", "C"), ("B", "C", None))),
}

_ROLES = {"B": "batch_axis", "T": "seq_axis", "H": "head_axis", "C": "head_axis"}


def _unwrap(op):
    """(base op, positional args, keyword args) of ``op``, an op or a functools.partial of one."""
    args, keywords = (), {}
    while isinstance(op, functools.partial):
        args, keywords = op.args + args, {**op.keywords, **keywords}
        op = op.func
    if op not in _OPS:
        names = ", ".join(f"rwkv_jax.{spec.name}" for spec in _OPS.values())
        raise TypeError(f"op must be one of {names} (or a functools.partial of one), "
                        f"got {getattr(op, '__qualname__', type(op).__name__)}")
    return op, args, keywords


def _check_axes(mesh, spec, axes):
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    used = {}
    for role, axis in axes.items():
        if axis is None:
            continue
        if not isinstance(axis, str):
            raise TypeError(f"{role} must be a mesh axis name (str) or None, "
                            f"got {type(axis).__name__} {axis!r}")
        if axis not in mesh.axis_names:
            raise ValueError(f"{role}={axis!r} is not an axis of the mesh; its axes are "
                             f"{tuple(mesh.axis_names)}")
        if axis in used:
            raise ValueError(f"{role} and {used[axis]} both name mesh axis {axis!r}; "
                             f"each dimension needs its own axis")
        used[axis] = role
    if spec.block_pass is None and axes["seq_axis"] is not None:
        raise ValueError(f"{spec.name} supports batch_axis and head_axis (its channels) only; "
                         f"sequence parallelism (seq_axis={axes['seq_axis']!r}) is not "
                         f"implemented for it")


def _labels(dims, head_first):
    """Labels in the caller's layout: head_first swaps T and H of the per-token arrays."""
    if head_first and dims[:3] in (("B", "T", "H"), ("B", "T", "C")):
        return (dims[0], dims[2], dims[1]) + dims[3:]
    return dims


def _partition(dims, axes):
    return PartitionSpec(*(axes[_ROLES[label]] if label else None for label in dims))


def _check_divisible(op_name, name, x, partition, mesh):
    for position, axis in enumerate(partition):
        if axis is not None and x.shape[position] % mesh.shape[axis]:
            raise ValueError(
                f"{op_name}: {name} has size {x.shape[position]} on axis {position} (shape "
                f"{tuple(x.shape)}), which mesh axis {axis!r} of size {mesh.shape[axis]} does "
                f"not divide")


def _advance(transition, is_matrix, h):
    """The state after a block with this transition, from ``h``, without the block's inputs."""
    if is_matrix:
        return jnp.einsum("bhkj,bhjv->bhkv", transition, h)
    return transition * h


def _sequence_parallel(spec, base, options, arrays, axis, devices):
    """One device's share of a sequence-parallel run (inside shard_map); arrays are time-major."""
    order = list(range(devices))[::-1] if options.get("reverse", False) else list(range(devices))
    index = lax.axis_index(axis)
    arrays = dict(arrays)
    h0 = arrays.pop("initial_state", None)
    # The block that comes first in the recurrence starts from the true initial state, so its
    # outputs need no correction; the others start from zero.
    start = None if h0 is None else jnp.where(index == order[0], h0, jnp.zeros_like(h0))
    run = functools.partial(base, **{**options, "head_first": False, "output_final_state": True})
    o_local, h_local, transition, is_matrix, p, post = spec.block_pass(run, arrays, start, options)
    h_local = h_local.astype(jnp.result_type(jnp.float32, h_local.dtype))

    every_h = lax.all_gather(h_local, axis)
    every_transition = lax.all_gather(transition, axis)
    incoming = [None] * devices
    h = jnp.zeros_like(h_local)
    for j in order:
        incoming[j] = h
        h = _advance(every_transition[j], is_matrix, h) + every_h[j]
    h_in = jnp.stack(incoming)[index]

    acc = jnp.result_type(jnp.float32, p.dtype, h_in.dtype)
    correction = jnp.einsum("bthk,bhkv->bthv", p.astype(acc), h_in.astype(acc))
    if post is not None:
        correction = correction * post
    o = o_local.astype(correction.dtype) + correction
    return o.astype(o_local.dtype), h


def shard(op, mesh, *, batch_axis=None, head_axis=None, seq_axis=None):
    """Run a sequence op over the devices of ``mesh``.

    Args:
      op: :func:`rwkv_jax.rwkv7`, :func:`rwkv_jax.rwkv6`, :func:`rwkv_jax.gated_linear_attention`
        or :func:`rwkv_jax.rwkv4`, or a ``functools.partial`` of one (e.g. with ``backend=``).
      mesh: a ``jax.sharding.Mesh``.
      batch_axis: mesh axis that splits the batch ``B`` (and the state's rows).
      head_axis: mesh axis that splits the heads ``H`` (RWKV-4: the channels ``C``).
      seq_axis: mesh axis that splits time ``T``, the state passing between devices (not for
        RWKV-4, nor with ``cu_seqlens``).

    Returns:
      A function with the signature and results of ``op``. It takes global arrays; its outputs
      are split the same way (the final state over batch and heads, replicated over
      ``seq_axis``). It is differentiable and can be called inside ``jax.jit``.
    """
    base, bound_args, bound_keywords = _unwrap(op)
    spec = _OPS[base]
    axes = dict(batch_axis=batch_axis, head_axis=head_axis, seq_axis=seq_axis)
    _check_axes(mesh, spec, axes)
    signature = inspect.signature(base)

    @functools.wraps(base)
    def sharded(*args, **kwargs):
        bound = signature.bind(*bound_args, *args, **{**bound_keywords, **kwargs})
        bound.apply_defaults()
        arguments = bound.arguments
        jax.eval_shape(lambda: base(**arguments))   # the op's own validation, on global shapes
        if seq_axis is not None and arguments.get("cu_seqlens") is not None:
            raise ValueError(f"{spec.name}: cu_seqlens with seq_axis={seq_axis!r} is not "
                             f"supported (packed segments would straddle devices); split packed "
                             f"sequences over heads, or pad them into a batch for batch_axis")
        arrays = {n: jnp.asarray(arguments[n]) for n in spec.arrays if arguments[n] is not None}
        options = {n: x for n, x in arguments.items() if n not in spec.arrays}
        for n, x in arrays.items():
            dims = _labels(spec.arrays[n], options.get("head_first", False))
            _check_divisible(spec.name, n, x, _partition(dims, axes), mesh)
        result = _run(base, mesh, tuple(axes.items()), tuple(options.items()), arrays)
        return result if options["output_final_state"] else (result, None)

    sharded.__signature__ = inspect.signature(op)
    return sharded


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _run(base, mesh, axes, options, arrays):
    """shard_map of ``base`` over ``mesh`` (jitted, so that the mesh context below is legal).

    Explicit mesh axes (``jax.make_mesh``'s default) follow the caller: under ``jax.set_mesh``,
    or when the inputs already carry explicit shardings, inputs are resharded over the explicit
    axes and the outputs carry explicit shardings; plain arrays without a mesh context run with
    the axes as Auto and come back as plain (Auto) arrays, so that plain model code around the
    op keeps working. shard_map moves inputs over Auto axes itself."""
    spec, axes, options = _OPS[base], dict(axes), dict(options)
    head_first, with_state = options.get("head_first", False), options["output_final_state"]
    in_specs = {n: _partition(_labels(spec.arrays[n], head_first), axes) for n in arrays}
    out_specs = _partition(_labels(spec.outputs[0], head_first), axes)
    if with_state:
        out_specs = (out_specs, _partition(spec.outputs[1], axes))
    seq_axis = axes["seq_axis"]

    def per_device(blocks):
        if seq_axis is None:
            o, h = base(**options, **blocks)
        else:
            if head_first:  # the block pass works time-major
                blocks = {n: jnp.swapaxes(x, 1, 2) if spec.arrays[n][:2] == ("B", "T") else x
                          for n, x in blocks.items()}
            o, h = _sequence_parallel(spec, base, options, blocks, seq_axis, mesh.shape[seq_axis])
            if head_first:
                o = jnp.swapaxes(o, 1, 2)
        return (o, h) if with_state else o

    run_mesh, context = mesh, contextlib.nullcontext()
    explicit = {a for a, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit}
    if jax.sharding.get_abstract_mesh().empty:
        if any(AxisType.Explicit in jax.typeof(x).sharding.mesh.axis_types
               for x in arrays.values()):
            context = jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
        else:   # plain arrays, no mesh context: Auto axes, so the outputs are plain arrays too
            run_mesh = Mesh(mesh.devices, mesh.axis_names,
                            axis_types=(AxisType.Auto,) * len(mesh.axis_names))
            explicit = set()
    with context:
        if explicit:
            arrays = {n: jax.reshard(x, PartitionSpec(*(a if a in explicit else None
                                                        for a in in_specs[n])))
                      for n, x in arrays.items()}
        outputs = jax.shard_map(per_device, mesh=run_mesh, in_specs=(in_specs,),
                                out_specs=out_specs, check_vma=False)(arrays)
        if explicit:
            outputs = jax.tree.map(lambda o: _cotangent_sharded_as(jax.typeof(o).sharding, o),
                                   outputs)
        return outputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_sharded_as(sharding, output):
    """``output``, whose cotangent is resharded to ``sharding`` (the output's own) on the way
    back. jax 0.12 hands a cotangent of another sharding (``jnp.ones_like`` of an explicitly
    sharded output is no longer sharded like it) to the transposed shard_map as it is, which
    then fails to lower; jax 0.10 resharded it."""
    return output


def _cotangent_sharded_as_forward(sharding, output):
    return output, None


def _cotangent_sharded_as_backward(sharding, _, cotangent):
    return (jax.reshard(cotangent, sharding),)


_cotangent_sharded_as.defvjp(_cotangent_sharded_as_forward, _cotangent_sharded_as_backward)

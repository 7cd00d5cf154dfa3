"""Data, head and sequence parallelism for the sequence ops, through ``jax.shard_map``.

    f = rwkv_jax.shard(rwkv_jax.rwkv7, mesh, batch_axis="data", seq_axis="seq")
    o, h = f(r, w, k, v, a, b, initial_state=h0)      # same signature and results as rwkv7

Batch and head parallelism need no communication: each device runs the op on its block.

Sequence parallelism passes the state across the devices of ``seq_axis``. Every recurrence here
is affine in the state: after a block of steps ``h_out = Φ h_in + h_local``, where ``h_local`` is
the block's final state from zero and ``Φ`` its transition (a K×K matrix per head for RWKV-7,
``A_T ... A_1`` with ``A_t = diag(exp w_t) + b_t a_t^T``; a decay per state entry for RWKV-6
and GLA). Forward, each device

1. computes ``Φ`` and ``h_local`` of its block without its outputs: for RWKV-6 and GLA in
   closed form (``h_local`` is one ``[K, T/n] x [T/n, V]`` product per head of suffix-decayed
   keys and values, ``Φ`` the exponential of the summed log decays); for RWKV-7 by one op call
   on the values followed by K zero columns from the state ``[0 | I]``, whose final state is
   ``[h_local | Φ]``;
2. all-gathers ``(Φ, h_local)`` over ``seq_axis`` and scans them in order to the state entering
   its block (the first block in the recurrence's order starts from ``initial_state``);
3. runs the op once on its block from that state: outputs and final state are those of one
   device, and the final state of the last block is the result's.

Backward (a ``jax.custom_vjp``): the gradient of a block's inputs is the op's own backward on the
block given the state that entered it and the true gradient ``dh_T`` of the state that left it.
That gradient comes from the later blocks: the gradient reaching a block's initial state is
``Φ^T dh_T + g``, with ``g`` what the block's outputs alone send there. So each device

1. computes ``g`` of its block (RWKV-6 / GLA: one product per head of prefix-decayed queries and
   output gradients; RWKV-7: the reverse recurrence ``G_t = A_{t+1}^T G_{t+1} + (scale r_t)
   do_t^T``, ``g = A_1^T G_1``, which is the op itself on the time-reversed block with ``a`` and
   ``b`` swapped);
2. all-gathers ``Φ^T dh_out + g`` (``Φ`` kept from the forward) and scans them in reverse order
   to its ``dh_T``;
3. runs the backward of the op call saved from the forward, with ``(do, dh_T)``; the gradient it
   gives for the block's initial state is that of ``initial_state`` on the first block.

Over ``n`` devices each does about ``1/n`` of the one-device work plus the state-only passes over
its block: one matrix product per head each way for RWKV-6 and GLA, and for RWKV-7 one op call
with ``V + K`` value columns forward (two above 128 columns) and one with ``V`` columns
backward. Per-device memory is that of one block plus ``n`` transitions and states for the
scans. These passes use only the public op, so every backend runs them and gradients are
exact. A backend may replace the four passes with its own (a module function
``sequence_parallel_pieces``, see :class:`rwkv_jax.backends.triton.SequencePieces`): the triton
backend does, running its state pass and state-gradient pass from zero once each way and
correcting every chunk's state (state gradient) by the incoming state (the final state's
gradient) before its output (gradient) kernels, so that each device runs the kernels of one
device's op on ``T/n`` tokens plus the corrections: elementwise decays for RWKV-6 and GLA; for
RWKV-7, whose passes run over ``V + K`` columns (the map from the identity beside the values),
one ``K×K`` by ``K×V`` product per chunk and one ``K`` by ``K×V`` product per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, PartitionSpec

from . import backends, ops

# Dimension labels of each argument; "B", "T", "H" (and "C", RWKV-4's channels) are split over
# the batch, sequence and head axes, None is never split.
_TOKENS = ("B", "T", "H", None)    # [B, T, H, K] or [B, T, H, V]
_STATE = ("B", "H", None, None)    # [B or N, H, K, V]


@dataclasses.dataclass(frozen=True)
class _OpSpec:
    name: str
    arrays: dict                   # argument name -> dimension labels
    outputs: tuple                 # labels of (output, final state)
    # Sequence parallelism, or None where it is not supported. Both take the block's arrays
    # (time-major) and ``run``, the op with the caller's options and output_final_state=True:
    #   block_state(run, x, options) -> (transition, h_local), the block's map of the state
    #     (a [B, H, K, K] matrix if matrix_transition, else a factor broadcasting against the
    #     state) and its final state from zero;
    #   block_state_gradient(run, x, do, options) -> g, the gradient of <do, outputs> with
    #     respect to the block's initial state.
    block_state: Optional[Callable] = None
    block_state_gradient: Optional[Callable] = None
    matrix_transition: bool = False


def _state_dtype(x):
    """The state's dtype for inputs like ``x``: float32, or float64 for float64 inputs."""
    return jnp.result_type(jnp.float32, x.dtype)


def _exclusive_cumsum(x):
    """Along time (axis 1): the sum over the steps before t. Sums, never differences of sums,
    so that -inf log decays give exactly zero factors and never -inf - -inf."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), jnp.cumsum(x[:, :-1], axis=1)], axis=1)


def _suffix_cumsum(x):
    """Along time: the sum over the steps after t."""
    return jnp.flip(_exclusive_cumsum(jnp.flip(x, 1)), 1)


# The most value columns every backend takes in one call (the triton backend's largest head size).
_WIDEST_CALL = 128


def _rwkv7_state(run, x, options):
    """RWKV-7: h_t = A_t h_{t-1} + k_t v_t^T with A_t = diag(exp w_t) + b_t a_t^T, a full K×K map.
    One op call on the values followed by K zero columns, from the state [0 | I]: its final
    state is [h_local | M] with M = A_T ... A_1 (the outputs are not used). Where V + K columns
    are more than every backend takes, two calls: the values from zero, the zero columns from I
    (one call is better where the recurrence is latency-bound: one chain, twice the programs)."""
    batch, _, heads, keys = x["k"].shape
    values = x["v"].shape[-1]
    dtype = _state_dtype(x["v"])
    eye = jnp.broadcast_to(jnp.eye(keys, dtype=dtype), (batch, heads, keys, keys))
    zeros = jnp.zeros(x["k"].shape, x["v"].dtype)
    if values + keys > _WIDEST_CALL:
        _, transition = run(**{**x, "v": zeros}, initial_state=eye)
        _, h_local = run(**x, initial_state=None)
        return transition, h_local
    start = jnp.concatenate([jnp.zeros((batch, heads, keys, values), dtype), eye], axis=-1)
    _, h = run(**{**x, "v": jnp.concatenate([x["v"], zeros], axis=-1)}, initial_state=start)
    return h[..., values:], h[..., :values]


def _rwkv7_state_gradient(run, x, do, options):
    """RWKV-7: the gradient G_t of the state after step t (outputs only) follows
    G_t = A_{t+1}^T G_{t+1} + (scale r_t) do_t^T backwards in time, and g = A_1^T G_1. As
    A^T = diag(exp w) + a b^T, that is the op itself on the time-reversed block with a and b
    swapped, decays one step later (identity at the first reversed step), keys r, values do."""
    def reversed_next(y):   # [0, y_T, ..., y_2]: at reversed step of t, the values of step t + 1
        return jnp.concatenate([jnp.zeros_like(y[:, :1]), jnp.flip(y[:, 1:], 1)], axis=1)

    r = jnp.flip(x["r"], 1)
    _, g1 = run(r=r, w=reversed_next(x["w"]), k=r, v=jnp.flip(do, 1), a=reversed_next(x["b"]),
                b=reversed_next(x["a"]), initial_state=None)
    w1, a1, b1 = (x[n][:, 0].astype(g1.dtype) for n in "wab")   # [B, H, K]
    g = (jnp.exp(w1)[..., None] * g1
         + a1[..., None] * jnp.einsum("bhk,bhkv->bhv", b1, g1, precision="highest")[..., None, :])
    return options["scale"] * g


def _diagonal_recurrence(name, x, options, dtype):
    """RWKV-6 and GLA in recurrence order (GLA's reverse flips time): per step t, the key, value
    and query, the log decays per key (or a scalar per head, as a size-1 key axis) and per value
    (or None) applied before step t adds k_t v_t^T, whether the output reads the state before
    that step's decay and update (RWKV-6) or after (GLA), and the output scale."""
    flip = (lambda y: jnp.flip(y, 1)) if options.get("reverse", False) else (lambda y: y)
    f32 = lambda n: None if x.get(n) is None else flip(x[n].astype(dtype))
    if name == "rwkv6":
        return f32("k"), f32("v"), f32("r"), f32("w"), None, True, options["scale"]
    q = f32("q")
    per_key = jnp.zeros(q.shape[:3] + (1,), dtype)
    if x.get("g") is not None:
        per_key = per_key + f32("g")[..., None]
    if x.get("g_gamma") is not None:
        per_key = per_key + x["g_gamma"].astype(dtype)[:, None]
    if x.get("gk") is not None:
        per_key = per_key + f32("gk")
    scale = options["scale"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return f32("k"), f32("v"), q, per_key, f32("gv"), False, scale


def _outer_sum(left, right):
    """sum_t left_t right_t^T per batch and head: [B, T, H, K], [B, T, H, V] -> [B, H, K, V]."""
    return jnp.einsum("bthk,bthv->bhkv", left, right, precision="highest")


def _decayed(x, log_decay):
    return x if log_decay is None else x * jnp.exp(log_decay)


def _diagonal_state(name):
    """RWKV-6 / GLA: h_local = sum_t (k_t ⊙ exp(key decays after t)) (v_t ⊙ exp(value decays
    after t))^T, one product per head; every exponent is a sum of log decays, <= 0."""
    def state(run, x, options):
        dtype = _state_dtype(x["v"])
        k, v, _, per_key, per_value, _, _ = _diagonal_recurrence(name, x, options, dtype)
        suffix = lambda y: None if y is None else _suffix_cumsum(y)
        h_local = _outer_sum(_decayed(k, suffix(per_key)), _decayed(v, suffix(per_value)))
        transition = jnp.exp(jnp.sum(per_key, axis=1))[..., None]      # [B, H, K or 1, 1]
        if per_value is not None:
            transition = transition * jnp.exp(jnp.sum(per_value, axis=1))[..., None, :]
        return transition, h_local
    return state


def _diagonal_state_gradient(name):
    """RWKV-6 / GLA: g = scale sum_t (q_t ⊙ exp(key decays up to t)) (do_t ⊙ exp(value decays up
    to t))^T, up to t inclusive where the output reads the state after step t's decay."""
    def state_gradient(run, x, do, options):
        dtype = _state_dtype(x["v"])
        _, _, q, per_key, per_value, reads_before, scale = _diagonal_recurrence(
            name, x, options, dtype)
        prefix = _exclusive_cumsum if reads_before else (lambda y: jnp.cumsum(y, axis=1))
        do = do.astype(dtype)
        if options.get("reverse", False):
            do = jnp.flip(do, 1)
        return scale * _outer_sum(_decayed(q, prefix(per_key)),
                                  _decayed(do, None if per_value is None else prefix(per_value)))
    return state_gradient


_PACKED = {"initial_state": _STATE, "cu_seqlens": (None,)}   # cu_seqlens is never split
_OPS = {
    ops.rwkv7: _OpSpec("rwkv7", {n: _TOKENS for n in "rwkvab"} | _PACKED,
                       (_TOKENS, _STATE), _rwkv7_state, _rwkv7_state_gradient,
                       matrix_transition=True),
    ops.rwkv6: _OpSpec("rwkv6", {n: _TOKENS for n in "rkvw"} | {"u": ("H", None)} | _PACKED,
                       (_TOKENS, _STATE), _diagonal_state("rwkv6"),
                       _diagonal_state_gradient("rwkv6")),
    ops.gated_linear_attention: _OpSpec(
        "gated_linear_attention",
        {"q": _TOKENS, "k": _TOKENS, "v": _TOKENS, "g": ("B", "T", "H"), "g_gamma": ("H",),
         "gk": _TOKENS, "gv": _TOKENS} | _PACKED,
        (_TOKENS, _STATE), _diagonal_state("gated_linear_attention"),
        _diagonal_state_gradient("gated_linear_attention")),
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
    if spec.block_state is None and axes["seq_axis"] is not None:
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
        return jnp.einsum("bhkj,bhjv->bhkv", transition, h, precision="highest")
    return transition * h


def _advance_gradient(transition, is_matrix, dh):
    """The gradient of the state entering a block with this transition, from that of the state
    leaving it (the transpose of ``_advance``)."""
    if is_matrix:
        return jnp.einsum("bhjk,bhjv->bhkv", transition, dh, precision="highest")
    return transition * dh


def _sequence_parallel(spec, base, options, arrays, axis, devices):
    """One device's share of a sequence-parallel run (inside shard_map); arrays are time-major."""
    order = list(range(devices))[::-1] if options.get("reverse", False) else list(range(devices))
    arrays = dict(arrays)
    h0 = arrays.pop("initial_state", None)
    batch, _, heads, keys = arrays["k"].shape
    dtype = _state_dtype(arrays["v"])
    start = jnp.zeros((batch, heads, keys, arrays["v"].shape[-1]), dtype)
    if h0 is not None:   # only the block that comes first in the recurrence starts from h0
        start = jnp.where(lax.axis_index(axis) == order[0], h0.astype(dtype), start)
    # One backend for every pass of the blocks: the default per shape class (SHAPE_DEFAULTS)
    # would otherwise let the op and the state-only passes differ.
    options = {**options, "backend": backends.resolve(spec.name, options.get("backend"))[0]}
    run = functools.partial(base, **{**options, "head_first": False, "output_final_state": True})
    o, h_out = _one_pass_block(spec, run, tuple(options.items()), axis, tuple(order))(arrays, start)
    return o, lax.all_gather(h_out, axis)[order[-1]]


class _Pieces(NamedTuple):
    """A block's passes (rwkv_jax.backends.triton.SequencePieces says what each takes)."""
    state: Callable
    forward: Callable
    state_gradient: Callable
    backward: Callable
    # (x, saved, h_in) -> (o, h_out) without residuals, where cheaper than forward's.
    primal: Optional[Callable] = None


def _reference_pieces(spec, run, options):
    """The passes from the public op and the spec's state-only passes (any backend)."""
    call = lambda x, h: run(**x, initial_state=h)
    return _Pieces(
        state=lambda x: spec.block_state(run, x, options) + (None,),
        forward=lambda x, saved, h_in: jax.vjp(call, x, h_in),
        state_gradient=lambda x, pull, do: (spec.block_state_gradient(run, x, do, options), None),
        backward=lambda x, pull, saved, do, dh: pull((do, dh)),
        primal=lambda x, saved, h_in: call(x, h_in))


def _pieces(spec, run, options):
    """The backend's own passes (a module function ``sequence_parallel_pieces(op, options)``,
    kernels that share work between the state-only passes and the op) where it has them, else
    the reference."""
    name, _ = backends.resolve(spec.name, options.get("backend"))
    module = importlib.import_module(backends._BACKENDS[name].module)
    hook = getattr(module, "sequence_parallel_pieces", None)
    own = None if hook is None else hook(spec.name, options)
    return _reference_pieces(spec, run, options) if own is None else _Pieces(*own)


def _one_pass_block(spec, run, options, axis, order):
    """``block(x, start) -> (o, h_out)``: the op on this device's block from the state that truly
    enters it (``start`` plus what the earlier blocks leave), with a custom gradient.

    Forward: the block's transition and final state from zero (the pieces' ``state``), one
    all-gather, the exclusive scan for the incoming state, the op from it. Backward: the
    gradient the block's outputs alone send into its initial state (``state_gradient``), one
    all-gather, the reverse scan for the true gradient of the block's final state, and the
    backward of the forward's op call."""
    options, is_matrix = dict(options), spec.matrix_transition
    pieces = _pieces(spec, run, options)

    def entering(x, start):
        """(every block's transition, the state entering this block, the state pass's saved)."""
        transition, h_local, saved = pieces.state(x)
        leaving = _advance(transition, is_matrix, start) + h_local   # from start, not from h_in
        every_transition = lax.all_gather(transition, axis)
        every_leaving = lax.all_gather(leaving, axis)
        before, h = [None] * len(order), jnp.zeros_like(start)
        for j in order:
            before[j] = h
            h = _advance(every_transition[j], is_matrix, h) + every_leaving[j]
        return every_transition, start + jnp.stack(before)[lax.axis_index(axis)], saved

    def forward(x, start):
        every_transition, h_in, saved = entering(x, start)
        result, residuals = pieces.forward(x, saved, h_in)
        return result, (x, every_transition, residuals)

    def backward(saved, cotangents):
        x, every_transition, residuals = saved
        do, dh_out = cotangents
        index = lax.axis_index(axis)
        g, from_zero = pieces.state_gradient(x, residuals, do)
        # The gradient of this block's initial state, but for the later blocks': Φ^T dh_out + g.
        sent = _advance_gradient(every_transition[index], is_matrix, dh_out) + g
        every_sent = lax.all_gather(sent, axis)
        after, dh = [None] * len(order), jnp.zeros_like(dh_out)
        for j in reversed(order):
            after[j] = dh
            dh = _advance_gradient(every_transition[j], is_matrix, dh) + every_sent[j]
        return pieces.backward(x, residuals, from_zero, do, dh_out + jnp.stack(after)[index])

    def primal(x, start):
        if pieces.primal is None:
            return forward(x, start)[0]
        _, h_in, saved = entering(x, start)
        return pieces.primal(x, saved, h_in)

    block = jax.custom_vjp(primal)
    block.defvjp(forward, backward)
    return block


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
        if seq_axis is not None and any(backends._forward_mode(x) for x in arrays.values()):
            raise TypeError(f"{spec.name} with seq_axis={seq_axis!r} does not support "
                            f"forward-mode autodiff (jax.jvp, jax.jacfwd, jax.hessian): its "
                            f"sequence parallelism defines only a reverse-mode rule "
                            f"(custom_vjp); batch_axis and head_axis do, on backends that do")
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

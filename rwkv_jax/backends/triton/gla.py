"""The ``triton`` backend's gated linear attention and RWKV-6: one chunked kernel family
(``rwkv_jax.triton_kernels.gla``). The same layout, varlen scheme and buffers as RWKV-7
(:mod:`rwkv_jax.backends.triton.rwkv7`); RWKV-6 is the recurrence with w as the key-side log
gate, the read before the update and the bonus u on the diagonal. Also the backend's sequence
parallelism pieces (:func:`sequence_parallel_pieces`, for :mod:`rwkv_jax.shard`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import LOG_DECAY_FLOOR
from . import launch as _launch
from .common import (_UNUSED, SequencePieces, _check_head_sizes, _first_slots, _pow2_at_least,
                     _sequences, _slot_count, _slot_sequences)

_gla_kernels = _launch.kernels("gla")

# The forward: a sequential state pass over chunks of GLA_SPAN tokens that saves the state at
# the start of each (the ``states`` buffer), then two kernels parallel over those chunks: their
# scores and their outputs. The backward takes the same chunks: its state-gradient pass saves
# dH at the end of every chunk (in the slots of the saved states) and its two gradient kernels
# (K side, V side) take one chunk each, all of them at once.
GLA_SPAN = 64
# K columns per step of the in-chunk scores kernel: the widest step that spills at neither K = 64
# nor K = 128 with 4 warps (compile reports, BENCHMARKS.md).
GLA_SCORES_BLOCK_K = 16
# A call is tame when no chunk's log gates (GLA: gk + g + g_gamma; RWKV-6: w) sum below
# -GLA_TAME_SUM in any key channel: the tame path references its in-chunk factors to the chunk's
# middle, so every factor it forms, kept pairs or masked, lies within e^(+-GLA_TAME_SUM) (float32
# reaches e^88; a kept pair's product is still its own factor <= 1 times q k: no cancellation).
# Model gates sum far above it (GLA's log-sigmoid / 16: about -0.05 per token; RWKV-6's
# w = -exp(0.7 z - 1.5): about -0.3); channels that forget faster than about e^-1 per token, -inf
# and NaN take the exact build.
GLA_TAME_SUM = 64.0
# _GlaStatic fields -> values, to try other settings without editing code.
GLA_OVERRIDES: dict = {}


@dataclasses.dataclass(frozen=True)
class _GlaStatic:
    """Everything the GLA/RWKV-6 kernels are specialised on (a custom_vjp nondiff argument)."""
    scale: float
    heads: int
    k_size: int
    v_size: int
    rows: int
    has_a: bool     # a key-side log gate (GLA: gk + g + g_gamma; RWKV-6: w)
    has_b: bool     # a value-side log gate (GLA's gv)
    bonus: bool     # RWKV-6: read before the update, u on the diagonal
    reverse: bool
    precision: str  # of the matrix products: "tf32x3" for float32 inputs, else "tf32" or "bf16"
    block_v: int
    span: int            # tokens per chunk of the forward and backward (states at each start)
    scores_block_k: int  # K columns per step of the forward's scores kernel
    state_block_k: int   # K rows per program of the forward's state pass
    state_block_v: int   # V columns per program of it
    output_block_k: int  # K columns per step of the output kernel
    output_block_v: int  # V columns per program of the output kernel
    state_warps: int           # of the forward's state pass
    scores_warps: int          # of the forward's in-chunk scores
    output_warps: int          # of the forward's output kernel
    state_gradient_warps: int  # of the state-gradient pass
    key_gradient_warps: int    # of the parallel gradient kernels: the K-side one,
    value_gradient_warps: int  # the V-side one
    key_block_k: int           # K columns per step of the K-side gradient kernel,
    key_program_k: int         # per program of it (a multiple of the step)
    # The backward's gradient kernels on the tame path (their own launches): the K-side one's
    # K columns per step and per program, and the warps of each
    tame_key_block_k: int
    tame_key_program_k: int
    tame_key_gradient_warps: int
    tame_value_gradient_warps: int
    # Calls whose chunks' log gates sum to >= -GLA_TAME_SUM take the tame path
    # (False: always the exact build)
    tame: bool = True
    # The states saved at every chunk's start (and their gradients) in bfloat16, for 16-bit
    # inputs (the carried state and ht, dh0 stay float32): half their bytes, faster, with errors
    # against float64 unchanged (BENCHMARKS.md)
    bf16_states: bool = False
    # Launch order: a chunk's (or a sequence-head's) blocks fastest, so that its programs run
    # side by side and share their common tiles through L2 (K or V above 64: the output and
    # V-side kernels read q, k and the gates once per V block, the state passes k or q once
    # per block of the other side). On by default (_gla_static)
    blocks_fastest: bool = False
    # bfloat16 inputs: the sequential passes' decayed operands and the output kernel's decayed q
    # and scores rounded to the inputs' type, so that their products take 16-bit operands
    # (fla's choice; _gla_static sets it for bfloat16 calls): faster, with the output's error
    # against float64 still at fla's and the gradients' unchanged (BENCHMARKS.md)
    rounded_products: bool = False
    # Pipeline depths (the launches' num_stages) of the sequential passes' loops over chunks and
    # of the output kernel's loop over K blocks: the next iterations' loads in flight during
    # this one's products (3: the fastest measured, BENCHMARKS.md)
    sequential_stages: int = 3
    output_stages: int = 3
    # The key gates' in-chunk sums (bfloat16 gates) of the state pass, the output kernel and the
    # state-gradient pass as tensor-core products rather than scans and reductions across rows
    # (triton_kernels/common.py's row_sums): faster, with errors against float64 unchanged
    # (BENCHMARKS.md). Other gates' dtypes keep the scans.
    gate_sums_by_product: bool = True

    def __post_init__(self):
        if self.span not in (16, 32, 64):
            raise ValueError(f"GLA chunks must be 16, 32 or 64 tokens; got {self.span}")
        for step, program in ((self.key_block_k, self.key_program_k),
                              (self.tame_key_block_k, self.tame_key_program_k)):
            # (the kernel's masks take steps that tile K exactly as all inside: so must the
            # programs)
            if program % step or (self.k_size % step == 0 and self.k_size % program):
                raise ValueError(f"the K-side gradient kernel's keys per program ({program}) "
                                 f"must be a multiple of its step ({step}) and divide K "
                                 f"({self.k_size}) if the step does")

    @property
    def states_dtype(self):
        return jnp.bfloat16 if self.bf16_states else jnp.float32

    def grid(self, outer, middle, blocks):
        """A launch grid over (outer, middle, blocks) as the kernels' _program_ids take it."""
        return (outer * blocks, middle, 1) if self.blocks_fastest else (outer, middle, blocks)

    @property
    def v_blocks(self):
        return -(-self.v_size // self.block_v)

    @property
    def block_k(self):
        """K columns per block of the kernels (the state passes split K as V; the others sum
        over K in such blocks)."""
        return min(_pow2_at_least(self.k_size), 64)

    @property
    def k_blocks(self):
        return -(-self.k_size // self.block_k)

    def backward_constexprs(self, block_k=None, **more):
        return dict(self.constexprs(self.span, **more), BK=block_k or self.block_k)

    def constexprs(self, chunk, **more):
        return {**dict(scale=self.scale, HEADS=self.heads, K=self.k_size, V=self.v_size,
                    BK=_pow2_at_least(self.k_size), BV=self.block_v, C=chunk,
                    LEVELS=chunk.bit_length() - 1, ROWS=self.rows,
                    HAS_A=self.has_a, HAS_B=self.has_b, BONUS=self.bonus, REVERSE=self.reverse,
                    FLOOR=LOG_DECAY_FLOOR, PRECISION=self.precision,
                    BLOCKS_FASTEST=self.blocks_fastest), **more}


def _gla_slots(cu, rows, span):
    """_first_slots over the sequences' lengths as the kernels clamp them (so that no traced
    ``cu`` can address past the buffers), and the static buffer size."""
    start = jnp.clip(cu[:-1], 0, rows)
    lengths = jnp.clip(cu[1:], start, rows) - start
    clamped = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths).astype(jnp.int32)])
    spans, first = _first_slots(clamped, span)
    return spans, first, _slot_count(rows, cu.shape[0] - 1, span)


def _gla_on_path(static, tame, launch):
    """launch(TAME) on the path the call's log gates pick (``tame``, from the state pass), on
    the device (as RWKV-7's _on_path: each path its own compiled kernel). Without a key-side
    gate every factor is 1."""
    if not static.has_a or not static.tame:
        return launch(not static.has_a)
    return lax.cond(tame, lambda: launch(True), lambda: launch(False))


def _present(*arrays):
    """Launch inputs: an absent gate or bonus becomes a placeholder that no kernel reads."""
    return tuple(jnp.zeros((1,), jnp.float32) if x is None else x for x in arrays)


def _gla_states(static, k, v, a, b, h0, cu):
    """The state pass: the final states, the state at the start of every chunk and whether the
    call takes the tame path: no chunk's key gates sum below -GLA_TAME_SUM in any channel (the
    pass sums them per chunk for its decays; -inf and NaN take the exact path)."""
    sequences = cu.shape[0] - 1
    _, state_index, slots = _gla_slots(cu, static.rows, static.span)
    state_shape = (static.heads, static.k_size, static.v_size)
    blocks = -(-static.k_size // static.state_block_k) * -(-static.v_size // static.state_block_v)
    constexprs = static.constexprs(static.span, BK=static.state_block_k, BV=static.state_block_v,
                                   SLOTS=slots, ROUNDED=static.rounded_products,
                                   SUMS_BY_PRODUCT=static.gate_sums_by_product)
    for name in ("scale", "LEVELS", "BONUS"):
        del constexprs[name]
    ht, states, low = _launch.launch(
        _gla_kernels.gla_state_kernel, _present(k, v, a, b, h0, cu, state_index),
        (jax.ShapeDtypeStruct((sequences,) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((slots,) + state_shape, static.states_dtype),
         jax.ShapeDtypeStruct((sequences, static.heads, blocks), jnp.float32)),
        static.grid(sequences * static.heads, 1, blocks), num_warps=static.state_warps,
        num_stages=static.sequential_stages, **constexprs)
    return ht, states, jnp.min(low, initial=0.0) >= -GLA_TAME_SUM


def _gla_parallel(static, cu):
    """The parallel kernels' chunk indices: cu, each sequence's first slot, each slot's
    sequence, and the slot count."""
    spans, state_index, slots = _gla_slots(cu, static.rows, static.span)
    return (cu, state_index, _slot_sequences(spans, state_index, slots)), slots


def _gla_outputs(static, TAME, q, k, v, a, b, u, states, cu):
    """Every chunk's outputs from its saved state, all chunks at once (the exact path's scores
    from their own kernel first, the tame path's formed inside)."""
    parallel, slots = _gla_parallel(static, cu)
    constexprs = static.constexprs(static.span)
    scores = jnp.zeros((1,), jnp.float32)
    if not TAME:
        scores_constexprs = dict(constexprs, BK=min(static.scores_block_k, static.block_k))
        for name in ("V", "BV", "HAS_B", "LEVELS", "BLOCKS_FASTEST"):
            del scores_constexprs[name]
        (scores,) = _launch.launch(
            _gla_kernels.gla_scores_kernel, _present(q, k, a, u) + parallel,
            (jax.ShapeDtypeStruct((slots, static.heads, static.span, static.span),
                                  jnp.float32),),
            (slots, static.heads), num_warps=static.scores_warps, **scores_constexprs)
    (o,) = _launch.launch(
        _gla_kernels.gla_output_kernel, _present(q, k, v, a, b, u, states, scores) + parallel,
        (jax.ShapeDtypeStruct(v.shape, v.dtype),),
        static.grid(slots, static.heads, -(-static.v_size // static.output_block_v)),
        num_warps=static.output_warps, num_stages=static.output_stages,
        **dict(constexprs, TAME=TAME, BK=static.output_block_k, BV=static.output_block_v,
               ROUNDED=static.rounded_products, SUMS_BY_PRODUCT=static.gate_sums_by_product))
    return o


def _gla_forward(static, q, k, v, a, b, u, h0, cu):
    """The state pass, then the outputs on the path the call's log gates pick."""
    ht, states, tame = _gla_states(static, k, v, a, b, h0, cu)
    o = _gla_on_path(static, tame, lambda TAME: _gla_outputs(static, TAME, q, k, v, a, b, u,
                                                             states, cu))
    return o, ht, states, tame


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gla(static, q, k, v, a, b, u, h0, cu):
    o, ht, _, _ = _gla_forward(static, q, k, v, a, b, u, h0, cu)
    return o, ht


def _gla_fwd(static, q, k, v, a, b, u, h0, cu):
    o, ht, states, tame = _gla_forward(static, q, k, v, a, b, u, h0, cu)
    return (o, ht), (q, k, v, a, b, u, states, tame, cu)


def _gla_state_gradient(static, q, a, b, do, dht, cu):
    """The reverse recurrence of the state gradient: dh0, and dH at the end of every span (in
    the slot of the state saved at its start)."""
    sequences = cu.shape[0] - 1
    state_shape = (static.heads, static.k_size, static.v_size)
    _, state_index, slots = _gla_slots(cu, static.rows, static.span)
    constexprs = static.backward_constexprs(SLOTS=slots, ROUNDED=static.rounded_products,
                                            SUMS_BY_PRODUCT=static.gate_sums_by_product)
    del constexprs["LEVELS"]
    return _launch.launch(
        _gla_kernels.gla_state_gradient_kernel,
        _present(q, a, b, do, dht.astype(jnp.float32), cu, state_index),
        (jax.ShapeDtypeStruct((sequences,) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((slots,) + state_shape, static.states_dtype)),
        static.grid(sequences * static.heads, 1, static.k_blocks * static.v_blocks),
        num_warps=static.state_gradient_warps, num_stages=static.sequential_stages, **constexprs)




def _gla_key_gradients(static, TAME, q, k, v, a, b, u, do, states, dstates, cu):
    """dq, dk, da and du (per chunk), one program per (chunk, head, block of keys)."""
    parallel, slots = _gla_parallel(static, cu)
    block_k = static.tame_key_block_k if TAME else static.key_block_k
    program_k = static.tame_key_program_k if TAME else static.key_program_k
    return _launch.launch(
        _gla_kernels.gla_key_gradient_kernel, _present(q, k, v, a, b, u, do, states, dstates)
        + parallel,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32) if static.has_a else _UNUSED,
         jax.ShapeDtypeStruct((slots, static.heads, static.k_size), jnp.float32)
         if static.bonus else _UNUSED),
        static.grid(slots, static.heads, -(-static.k_size // program_k)),
        num_warps=static.tame_key_gradient_warps if TAME else static.key_gradient_warps,
        **static.backward_constexprs(block_k, KEYS=program_k, TAME=TAME))


def _gla_value_gradients(static, TAME, q, k, v, a, b, u, do, states, dstates, cu):
    """dv and db, one program per (chunk, head, block of values)."""
    parallel, slots = _gla_parallel(static, cu)
    return _launch.launch(
        _gla_kernels.gla_value_gradient_kernel, _present(q, k, v, a, b, u, do, states, dstates)
        + parallel,
        (jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(v.shape, jnp.float32) if static.has_b else _UNUSED),
        static.grid(slots, static.heads, static.v_blocks),
        num_warps=static.tame_value_gradient_warps if TAME else static.value_gradient_warps,
        **static.backward_constexprs(TAME=TAME))


def _gla_bwd(static, residuals, cotangents):
    q, k, v, a, b, u, states, tame, cu = residuals
    do, dht = cotangents
    do = do.astype(v.dtype)
    dh0, dstates = _gla_state_gradient(static, q, a, b, do, dht, cu)
    # Every input gradient, parallel over (chunk, head, block), on the path the call's log
    # gates pick: the K-side gradients summing over V in blocks, the V-side ones over K.
    inputs = (q, k, v, a, b, u, do, states, dstates, cu)
    dq, dk, da, du, dv, db = _gla_on_path(
        static, tame, lambda TAME: (_gla_key_gradients(static, TAME, *inputs)
                                 + _gla_value_gradients(static, TAME, *inputs)))
    return (dq, dk, dv, da.astype(a.dtype) if static.has_a else None,
            db.astype(b.dtype) if static.has_b else None,
            du.sum(0).astype(u.dtype) if static.bonus else None, dh0, None)


_gla.defvjp(_gla_fwd, _gla_bwd)


def _gla_warps(k_size, block_v, has_b, bf16_states):
    """Blocks and warps of each kernel: the fastest measured (BENCHMARKS.md) among those whose
    registers do not spill (compile reports, BENCHMARKS.md). 4 warps: the state pass, the scores
    and output kernels (8 with a value gate, whose tiles spill at 4), the state-gradient pass,
    and the tame path's K-side kernel, which takes every key per program in steps of 16 so that
    dO v^T is formed once per chunk and head. 8 warps: the exact path's gradient kernels (16
    keys per program on the K side), and the tame V-side kernel except at K = V = 64 and with
    bfloat16 saved states and no value gate, where 4 fit and are faster."""
    gated = 8 if has_b else 4
    block_k = min(_pow2_at_least(k_size), 64)
    # The tame V-side kernel at 4 warps where they fit (see above)
    tame_value_warps = 4 if (_pow2_at_least(k_size) * block_v <= 64 * 64
                             or bf16_states and not has_b) else 8
    return dict(state_block_k=block_k, state_block_v=block_v, output_block_k=block_k,
                output_block_v=block_v,
                state_warps=gated, scores_warps=4, output_warps=gated, state_gradient_warps=4,
                key_gradient_warps=8, value_gradient_warps=8,
                key_block_k=min(_pow2_at_least(k_size), 16),
                key_program_k=min(_pow2_at_least(k_size), 16),
                tame_key_block_k=min(_pow2_at_least(k_size), 16),
                tame_key_program_k=-(-k_size // 16) * 16, tame_key_gradient_warps=4,
                tame_value_gradient_warps=tame_value_warps)


def _gla_static(q, k, v, a, b, u, scale, reverse):
    """The kernels' static configuration for these ([B, T, H, *]) inputs."""
    batch, steps, heads, k_size = q.shape
    v_size = v.shape[-1]
    _check_head_sizes(k_size, v_size)
    # float32 anywhere (GLA's g and g_gamma make the summed key gate float32) takes tf32x3 and
    # float32 saved states: a strong g_gamma's gradient, a sum over every token and key, needs
    # them (with tf32 products its error against float64 misses the float32 contract).
    precise = any(x is not None and x.dtype == jnp.float32 for x in (q, k, v, a, b, u))
    block_v = min(_pow2_at_least(v_size), 64)
    static = _GlaStatic(
        float(scale), heads, k_size, v_size, batch * steps, a is not None, b is not None,
        u is not None, bool(reverse), "tf32x3" if precise else "tf32", block_v,
        GLA_SPAN, GLA_SCORES_BLOCK_K, bf16_states=not precise,
        # (bfloat16 only: float16's range would not hold every score, and it is more precise)
        rounded_products=not precise and q.dtype == jnp.bfloat16, blocks_fastest=True,
        **_gla_warps(k_size, block_v, b is not None, not precise))
    return dataclasses.replace(static, **GLA_OVERRIDES)


def _gla_call(q, k, v, a, b, u, *, scale, reverse, initial_state, cu_seqlens):
    """The shared path of both ops: rows layout, the static configuration, the launch."""
    batch, steps, heads, k_size = q.shape
    v_size = v.shape[-1]
    static = _gla_static(q, k, v, a, b, u, scale, reverse)
    cu, initial_state = _sequences(batch, steps, cu_seqlens, initial_state, (heads, k_size, v_size))
    rows = lambda x: None if x is None else x.reshape(batch * steps, heads, x.shape[-1])
    o, ht = _gla(static, rows(q), rows(k), rows(v), rows(a), rows(b), u, initial_state, cu)
    return o.reshape(batch, steps, heads, v_size), ht


def _key_gate(q, g, g_gamma, gk):
    """GLA's one key-side log gate: the scalar gates decay every key channel alike (summed in
    float32 before the floor, so that the floor applies to the sum); gk alone goes in as it is."""
    a = gk
    if g is not None or g_gamma is not None:
        a = jnp.zeros(q.shape, jnp.float32) if gk is None else gk.astype(jnp.float32)
        if g is not None:
            a = a + g.astype(jnp.float32)[..., None]
        if g_gamma is not None:
            a = a + g_gamma.astype(jnp.float32)[:, None]
    return a


def rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens):
    return _gla_call(r, k, v, w, None, u, scale=scale, reverse=False,
                     initial_state=initial_state, cu_seqlens=cu_seqlens)


def gated_linear_attention(q, k, v, *, g, g_gamma, gk, gv, scale, initial_state,
                           output_final_state, reverse, cu_seqlens):
    return _gla_call(q, k, v, _key_gate(q, g, g_gamma, gk), gv, None, scale=scale,
                     reverse=reverse, initial_state=initial_state, cu_seqlens=cu_seqlens)


# --- Sequence parallelism's pieces (rwkv_jax.shard) ----------------------------------------
# On one device's block of a sequence-parallel run, RWKV-6 and GLA run their own kernels once
# each way: the state pass from zero (its final state and every chunk's start state), and,
# once the state h_in entering the block is known, every chunk's state corrected by
# decay-before-the-chunk * h_in before the output kernel; the backward likewise corrects the
# state-gradient pass's dH (from a zero final gradient) by decay-after-the-chunk * dh_T before
# the gradient kernels. The correction is exact: the recurrence is affine in the state, and
# each decay is exp of a sum of log gates (floored as the kernels floor them), never of a
# difference of sums. The from-zero passes keep float32 chunk states, which are rounded to the
# kernels' stored dtype only after the correction, as one device rounds them.


def sequence_pieces(op, options):
    """SequencePieces of ``op`` ("rwkv6" or "gated_linear_attention") on the triton kernels."""
    reverse = bool(options.get("reverse", False))

    def operands(x):
        """(q, k, v, a, b, u) of the kernels, [B, T, H, *]."""
        if op == "rwkv6":
            return x["r"], x["k"], x["v"], x["w"], None, x["u"]
        a = _key_gate(x["q"], x.get("g"), x.get("g_gamma"), x.get("gk"))
        return x["q"], x["k"], x["v"], a, x.get("gv"), None

    def setup(x):
        q, k, v, a, b, u = operands(x)
        scale = options["scale"]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        static = _gla_static(q, k, v, a, b, u, scale, reverse)
        batch, steps = q.shape[:2]
        rows = lambda y: None if y is None else y.reshape(batch * steps, *y.shape[2:])
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * steps
        return static, (rows(q), rows(k), rows(v), rows(a), rows(b), u), cu

    def chunk_decays(x, static):
        """exp of each chunk's log gates before it and after it (processing order) and of the
        block's: per key [B, chunks, H, K, 1] and per value [B, chunks, H, 1, V] (1 if none)."""
        _, _, _, a, b, _ = operands(x)
        batch, steps = x["k"].shape[:2]
        chunks = -(-steps // static.span)

        def sums(gate, axis):
            if gate is None:
                return jnp.zeros((batch, chunks, 1, 1, 1), jnp.float32)
            gate = jnp.maximum(gate.astype(jnp.float32), LOG_DECAY_FLOOR)
            gate = jnp.flip(gate, 1) if reverse else gate
            gate = jnp.pad(gate, ((0, 0), (0, chunks * static.span - steps), (0, 0), (0, 0)))
            per_chunk = gate.reshape(batch, chunks, static.span, *gate.shape[2:]).sum(2)
            return jnp.expand_dims(per_chunk, axis)

        key, value = sums(a, -1), sums(b, -2)
        exclusive = lambda s: jnp.concatenate([jnp.zeros_like(s[:, :1]),
                                               jnp.cumsum(s[:, :-1], 1)], 1)
        before = lambda s: jnp.exp(exclusive(s))
        after = lambda s: jnp.exp(jnp.flip(exclusive(jnp.flip(s, 1)), 1))
        total = jnp.exp(key.sum(1)) * jnp.exp(value.sum(1))
        return before(key) * before(value), after(key) * after(value), total

    def corrected(from_zero, factors, h, static):
        """Every chunk's entry of a [slots, H, K, V] buffer plus factors * h, in the kernels'
        stored dtype (the slots past the block's chunks are never read)."""
        batch, chunks = factors.shape[:2]
        correction = (factors * h[:, None]).reshape(batch * chunks, *h.shape[1:])
        padding = ((0, from_zero.shape[0] - batch * chunks),) + ((0, 0),) * 3
        correction = jnp.pad(correction, padding)
        return (from_zero + correction).astype(static.states_dtype)

    def state(x):
        static, (q, k, v, a, b, u), cu = setup(x)
        exact = dataclasses.replace(static, bf16_states=False)
        h0 = jnp.zeros((cu.shape[0] - 1, static.heads, static.k_size, static.v_size), jnp.float32)
        ht, states, tame = _gla_states(exact, k, v, a, b, h0, cu)
        before, _, total = chunk_decays(x, static)
        return total, ht, (states, tame, before, ht)

    def forward(x, saved, h_in):
        from_zero, tame, before, ht = saved
        static, (q, k, v, a, b, u), cu = setup(x)
        states = corrected(from_zero, before, h_in, static)
        o = _gla_on_path(static, tame, lambda TAME: _gla_outputs(static, TAME, q, k, v, a, b, u,
                                                                 states, cu))
        _, _, total = chunk_decays(x, static)
        return (o.reshape(x["v"].shape), total * h_in + ht), (states, tame)

    def state_gradient(x, residuals, do):
        static, (q, k, v, a, b, u), cu = setup(x)
        exact = dataclasses.replace(static, bf16_states=False)
        rows = do.astype(x["v"].dtype).reshape(-1, *do.shape[2:])
        zero = jnp.zeros((cu.shape[0] - 1, static.heads, static.k_size, static.v_size),
                         jnp.float32)
        g, dstates = _gla_state_gradient(exact, q, a, b, rows, zero, cu)
        return g, (g, dstates)

    def backward(x, residuals, saved, do, dh_t):
        states, tame = residuals
        g, from_zero = saved
        static, _, cu = setup(x)
        _, after, total = chunk_decays(x, static)
        dstates = corrected(from_zero, after, dh_t, static)
        (q, k, v, a, b, u), pull = jax.vjp(lambda x: setup(x)[1], x)
        rows = do.astype(x["v"].dtype).reshape(-1, *do.shape[2:])
        inputs = (q, k, v, a, b, u, rows, states, dstates, cu)
        dq, dk, da, du, dv, db = _gla_on_path(
            static, tame, lambda TAME: (_gla_key_gradients(static, TAME, *inputs)
                                     + _gla_value_gradients(static, TAME, *inputs)))
        (dx,) = pull((dq, dk, dv, da.astype(a.dtype) if static.has_a else None,
                      db.astype(b.dtype) if static.has_b else None,
                      du.sum(0).astype(u.dtype) if static.bonus else None))
        return dx, total * dh_t + g

    return SequencePieces(state, forward, state_gradient, backward)

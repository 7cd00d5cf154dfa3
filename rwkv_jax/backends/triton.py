"""The ``triton`` backend: chunked RWKV-7 Triton kernels (``rwkv_jax.triton_kernels.rwkv7``).

The kernels see the batch flattened to rows ``[B * T, H, *]`` and one list of sequences,
``cu`` (``cu_seqlens``, or ``arange(B + 1) * T`` for a plain batch), so packed and plain inputs
share one code path. Every chunk's in-chunk matrices are computed once, all at once, and read
by the forward and (kept for it) the state-gradient pass. The forward saves the state every
``CHUNK * chunks_per_state`` tokens of each sequence (and U, see the kernels) for the backward,
whose state-gradient pass saves dH at every chunk's end; where each sequence's entries start
in these buffers (and the in-chunk matrices' buffer) is computed on the
device from ``cu``, and the buffers have the static size ``rows // span + N`` (an upper bound
over all length patterns): no host sync, no recompile per length pattern. The kernels clamp
every row and slot they derive from ``cu`` into these buffers (their sizes are compile-time
constants), so no value of ``cu`` reads or writes out of bounds. Launches go through
:mod:`rwkv_jax.backends._launch` (jax-triton on GPU, Triton's interpreter on CPU);
:func:`rwkv7` is a ``jax.custom_vjp``. Exact for every log decay in [-inf, 0]: the kernels that
build in-chunk matrices have two paths (tame and exact, see the kernels), and :func:`tame_path`
picks one per call on the device (one read of w, ``lax.cond``: no host sync); the backward
takes the forward's path. The two sequential passes have one path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import LOG_DECAY_FLOOR, _launch

_kernels = _launch.kernels("rwkv7")

CHUNK = 16  # tokens per chunk
LEVELS = CHUNK.bit_length() - 1  # of the in-chunk factors (triton_kernels/rwkv7.py)
MAX_HEAD_SIZE = 128
# A chunk is tame when its log decays sum to at least -TAME_SUM in every column: its A matrices'
# middle-referenced factors stay within e^(+-TAME_SUM) (the kernels' TAME path).
TAME_SUM = 16.0
# K columns at a time of the exact path's in-chunk kernel: at K=128 228 registers and no spills
# (sm_90, 4 warps); all 128 at once spilled 316 B. H100, B=8, T=4096, bf16: 5.0 ms (K=128).
EXACT_BLOCK_K = 32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_v: int            # V columns per program of the gradient kernels
    chunks_per_state: int   # the forward saves the state every this many chunks
    forward_warps: int      # of the sequential passes (forward, state gradient)
    backward_warps: int     # of the parallel gradient kernel
    stages: int | None = None
    # V columns per program of the two sequential passes (None: block_v). They read the
    # in-chunk matrices of the in-chunk kernels, so more V blocks recompute nothing.
    recurrence_block_v: int | None = None
    in_chunk_warps: int = 4  # of the two in-chunk kernels
    # Chunks per program of rwkv7_tame_in_chunk_kernel ([G, C, *] tiles, batched products),
    # and the K columns it takes at a time (its A matrices are sums over K). H100, B=8,
    # T=4096, bf16, 4 warps: K=64 0.99 ms (32 columns: 1.11), K=128 1.09 (1.19); one chunk per
    # program 1.60 at both. The exact path's kernel takes EXACT_BLOCK_K.
    in_chunk_group: int = 4
    in_chunk_block_k: int = 64
    # Of the (I - A_ab)^-1 products; None: "ieee" for float32 inputs (their contract), else
    # "tf32" (H100, bf16: 7% faster forward, error unchanged at two digits).
    inverse_precision: str | None = None
    # Calls whose every log decay is >= -TAME_SUM / CHUNK take the kernels' tame path (one
    # product per A matrix); False: every call level by level (exact for every decay either way).
    tame: bool = True
    # The tame path's gradients in one kernel (rwkv7_tame_gradient_kernel) rather than three.
    fused_tame_gradient: bool = False


def _pow2_at_least(n, floor=16):
    return max(floor, 1 << (n - 1).bit_length())


def default_config(k_size: int, v_size: int) -> KernelConfig:
    block_k, block_v = _pow2_at_least(k_size), _pow2_at_least(v_size)
    # Measured on an H100 (BENCHMARKS.md): every kernel is fastest with 4 warps at K=V=64, and
    # the gradient kernels must keep 4: with 8, Triton 3.6 miscompiles the products of dv (wrong
    # dv at K=64 and K=128; slower too). A state every 8 chunks beats every 1, 2 or 4 (fewer
    # saved states, and the span's walk costs little). The tame path's gradients in one kernel
    # up to K=64 (18.55 ms against 20.27 in three at K=V=64), in three from K=128 on (49.6
    # against 65.8 ms), as on the exact path (K=64: 35.4 against 40.5). The sequential passes
    # (which read the in-chunk matrices) at 4 warps at every head size (K=128: forward 5.29 ms,
    # state gradient 4.85, against 8.78 and 8.39 with 8 warps; V blocks of 32: 9.60 and 8.29).
    return KernelConfig(block_v=min(block_v, 64), chunks_per_state=8, forward_warps=4,
                        backward_warps=4, fused_tame_gradient=block_k <= 64)


# (K, V) -> KernelConfig, to try other settings (benchmarks/gpu_rwkv7.py) without editing code.
CONFIG_OVERRIDES: dict = {}


def _check_head_sizes(k_size, v_size):
    for name, size in (("K (the key/head size of r, w, k, a, b)", k_size),
                       ("V (the value size of v)", v_size)):
        if not 1 <= size <= MAX_HEAD_SIZE:
            raise ValueError(f"backend 'triton' supports head sizes up to {MAX_HEAD_SIZE} "
                             f"(32, 64 and 128 are the tuned ones); got {name} = {size}")


# The compile-time arguments of the two sequential passes.
_RECURRENCE = ("scale", "HEADS", "K", "V", "BK", "BV", "C", "FLOOR", "PRECISION")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels are specialised on (hashable: a custom_vjp nondiff argument)."""
    scale: float
    heads: int
    k_size: int
    v_size: int
    config: KernelConfig
    precision: str  # of the float32 matrix products: "tf32x3" for float32 inputs, else "tf32"

    @property
    def span(self):
        return CHUNK * self.config.chunks_per_state

    def constexprs(self, *names):
        """The kernels' compile-time arguments, those named."""
        every = dict(scale=self.scale, HEADS=self.heads, K=self.k_size, V=self.v_size,
                     BK=_pow2_at_least(self.k_size), BV=self.config.block_v, C=CHUNK,
                     LEVELS=LEVELS, FLOOR=LOG_DECAY_FLOOR,
                     CHUNKS_PER_STATE=self.config.chunks_per_state, PRECISION=self.precision,
                     INVERSE_PRECISION=self.config.inverse_precision or (
                         "ieee" if self.precision == "tf32x3" else "tf32"))
        return {name: every[name] for name in names}

    def grid(self, sequences):
        return (sequences * self.heads, -(-self.v_size // self.config.block_v))

    @property
    def recurrence_block_v(self):
        return self.config.recurrence_block_v or self.config.block_v

    def recurrence_launch(self, sequences):
        """The grid, warps and compile-time arguments of the two sequential passes."""
        return dict(grid=(sequences * self.heads, -(-self.v_size // self.recurrence_block_v)),
                    num_warps=self.config.forward_warps, num_stages=self.config.stages,
                    **dict(self.constexprs(*_RECURRENCE), BV=self.recurrence_block_v))


def _sequences(batch, steps, cu_seqlens, initial_state, state_shape):
    """The kernels' list of sequences ``cu`` (``cu_seqlens``, or ``arange(B + 1) * T`` for a plain
    batch) and the float32 initial state of each (zeros when None)."""
    if cu_seqlens is None:
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * steps
    else:
        cu = cu_seqlens.astype(jnp.int32)
    if initial_state is None:
        return cu, jnp.zeros((cu.shape[0] - 1,) + state_shape, jnp.float32)
    return cu, initial_state.astype(jnp.float32)


def _first_slots(cu, span):
    """Spans of ``span`` tokens of each sequence (the last may be partial), and the first slot
    of each sequence in a buffer of one entry per span."""
    spans = (cu[1:] - cu[:-1] + span - 1) // span
    return spans, jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(spans)[:-1]]).astype(
        jnp.int32)


def _slot_sequences(spans, first_slot, slots):
    """The sequence of each of ``slots`` span slots, -1 past the last span (the buffers have a
    static size). A sequence of no span shares its first slot with the next: 'right' skips it."""
    slot = jnp.arange(slots, dtype=jnp.int32)
    sequence = jnp.searchsorted(first_slot, slot, side="right").astype(jnp.int32) - 1
    return jnp.where(slot < spans.sum(), sequence, -1)


def _slot_count(rows, sequences, span):
    """A static bound on the spans of any length pattern: one buffer size, no recompile."""
    return rows // span + sequences


def tame_path(w):
    """Whether a call with log decays ``w`` takes the kernels' tame path: every log decay at
    least -TAME_SUM / CHUNK (model-range ones, >= -e^-0.5, always are) makes every chunk tame
    whatever the chunk boundaries. A traced boolean: one read of w, on the device."""
    return jnp.min(w, initial=0.0).astype(jnp.float32) * CHUNK >= -TAME_SUM


def _on_path(static, tame, launch):
    """launch(TAME) on the path ``tame`` picks, on the device: each path is its own compiled
    kernel, so neither pays the other's registers."""
    if not static.config.tame:
        return launch(False)
    return lax.cond(tame, lambda: launch(True), lambda: launch(False))


def _in_chunk_matrices(static, r, w, k, a, b, cu, tame):
    """Every chunk's [C, C] matrices ((I - A_ab)^-1, A_qb, A_ak, A_qk: triton_kernels/rwkv7.py),
    all at once, on the path ``tame`` picks: [chunk slots, heads, 4, C, C] float32, and the
    slot of each sequence's first chunk."""
    rows = r.shape[0]
    sequences = cu.shape[0] - 1
    chunks, chunk_index = _first_slots(cu, CHUNK)
    chunk_slots = _slot_count(rows, sequences, CHUNK)
    chunk_sequence = _slot_sequences(chunks, chunk_index, chunk_slots)
    inputs = (r, w, k, a, b, cu, chunk_index, chunk_sequence)
    matrices = jax.ShapeDtypeStruct((chunk_slots, static.heads, 4, CHUNK, CHUNK), jnp.float32)
    common = dict(num_warps=static.config.in_chunk_warps, num_stages=static.config.stages,
                  TOTAL_ROWS=rows, SEQUENCES=sequences, CHUNK_SLOTS=chunk_slots,
                  **static.constexprs("scale", "HEADS", "K", "BK", "C", "FLOOR", "PRECISION",
                                      "INVERSE_PRECISION"))
    block_k = lambda most: min(most, _pow2_at_least(static.k_size))
    group = static.config.in_chunk_group
    (matrices,) = _on_path(static, tame, lambda TAME: _launch.launch(
        _kernels.rwkv7_tame_in_chunk_kernel, inputs, (matrices,),
        (-(-chunk_slots // group), static.heads), GROUP=group,
        KI=block_k(static.config.in_chunk_block_k), **common) if TAME else _launch.launch(
        _kernels.rwkv7_in_chunk_kernel, inputs, (matrices,), (chunk_slots, static.heads),
        LEVELS=LEVELS, KI=block_k(EXACT_BLOCK_K), **common))
    return matrices, chunk_index


def _forward(static, r, w, k, v, a, b, h0, cu, save, tame):
    rows = r.shape[0]
    sequences = cu.shape[0] - 1
    state_shape = (sequences, static.heads, static.k_size, static.v_size)
    saved = lambda shape: jax.ShapeDtypeStruct(shape if save else (1,), jnp.float32)
    matrices, chunk_index = _in_chunk_matrices(static, r, w, k, a, b, cu, tame)
    o, ht, states, u = _launch.launch(
        _kernels.rwkv7_forward_kernel,
        (r, w, k, v, a, b, h0, matrices, cu, _first_slots(cu, static.span)[1], chunk_index),
        (jax.ShapeDtypeStruct((rows, static.heads, static.v_size), v.dtype),
         jax.ShapeDtypeStruct(state_shape, jnp.float32),
         saved((_slot_count(rows, sequences, static.span),) + state_shape[1:]),
         saved((rows, static.heads, static.v_size))),
        SAVE=save, TOTAL_ROWS=rows,
        STATE_SLOTS=_slot_count(rows, sequences, static.span) if save else 1,
        CHUNK_SLOTS=matrices.shape[0], CHUNKS_PER_STATE=static.config.chunks_per_state,
        **static.recurrence_launch(sequences))
    return o, ht, states, u, matrices


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rwkv7(static, r, w, k, v, a, b, h0, cu):
    o, ht, _, _, _ = _forward(static, r, w, k, v, a, b, h0, cu, False, tame_path(w))
    return o, ht


def _rwkv7_fwd(static, r, w, k, v, a, b, h0, cu):
    tame = tame_path(w)
    o, ht, states, u, matrices = _forward(static, r, w, k, v, a, b, h0, cu, True, tame)
    return (o, ht), (r, w, k, v, a, b, states, u, matrices, cu, tame)


def _rwkv7_bwd(static, residuals, cotangents):
    r, w, k, v, a, b, states, u, matrices, cu, tame = residuals
    do, dht = cotangents
    do = do.astype(v.dtype)
    dh0, dstates, dx = _state_gradient(static, r, w, a, b, matrices, cu, do, dht)
    return _on_path(static, tame, lambda TAME: _gradients(
        static, TAME, r, w, k, v, a, b, states, u, cu, do, dh0, dstates, dx))


def _state_gradient(static, r, w, a, b, matrices, cu, do, dht):
    """The reverse recurrence of the state gradient: dh0, dH at the end of every chunk, and dX
    (one path; outside the backward's lax.cond, so that the in-chunk matrices are freed before
    the gradient kernels run)."""
    rows = r.shape[0]
    sequences = cu.shape[0] - 1
    state_shape = (static.heads, static.k_size, static.v_size)
    return _launch.launch(
        _kernels.rwkv7_state_gradient_kernel,
        (r, w, a, b, do, dht.astype(jnp.float32), matrices, cu, _first_slots(cu, CHUNK)[1]),
        (jax.ShapeDtypeStruct((sequences,) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((_slot_count(rows, sequences, CHUNK),) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((rows, static.heads, static.v_size), jnp.float32)),
        TOTAL_ROWS=rows, CHUNK_SLOTS=_slot_count(rows, sequences, CHUNK),
        **static.recurrence_launch(sequences))


def _gradients(static, TAME, r, w, k, v, a, b, states, u, cu, do, dh0, dstates, dx):
    """Every input gradient, on the forward's path."""
    rows = r.shape[0]
    sequences = cu.shape[0] - 1
    _, chunk_index = _first_slots(cu, CHUNK)
    # One program per (span, head, V block), all at once: in three
    # kernels (none holds every tile: dv; dk, db and dw's share through them; dr, da and dw),
    # or on the tame path in one (KernelConfig.fused_tame_gradient).
    spans, state_index = _first_slots(cu, static.span)
    slots = _slot_count(rows, sequences, static.span)
    slot_sequence = _slot_sequences(spans, state_index, slots)
    v_blocks = static.grid(sequences)[1]
    # K-side gradients sum over V: with several V blocks each writes a float32 partial sum.
    partial = (rows, static.heads, static.k_size) if v_blocks == 1 else (
        (v_blocks, rows, static.heads, static.k_size))
    if v_blocks == 1:
        k_grad = lambda x: jax.ShapeDtypeStruct(partial, x.dtype)
        reduce = lambda g, x: g
    else:
        k_grad = lambda x: jax.ShapeDtypeStruct(partial, jnp.float32)
        reduce = lambda g, x: g.sum(0).astype(x.dtype)
    index = (cu, state_index, chunk_index, slot_sequence)
    dv_shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
    launch = lambda kernel, inputs, outputs, **more: _launch.launch(
        kernel, inputs, outputs, (slots, static.heads, v_blocks),
        num_warps=static.config.backward_warps, num_stages=static.config.stages,
        TOTAL_ROWS=rows, SEQUENCES=sequences, CHUNK_SLOTS=_slot_count(rows, sequences, CHUNK),
        **static.constexprs("scale", "HEADS", "K", "V", "BK", "BV", "C", "FLOOR", "PRECISION",
                            "CHUNKS_PER_STATE"), **more)
    rows_option = rows if v_blocks > 1 else 0  # (0: one V block; no recompile per length)
    if TAME and static.config.fused_tame_gradient:
        dr, dw, dk, dv, da, db = launch(
            _kernels.rwkv7_tame_gradient_kernel,
            (r, w, k, v, a, b, do, states, u, dstates, dx, *index),
            (k_grad(r), k_grad(w), k_grad(k), dv_shape, k_grad(a), k_grad(b)), ROWS=rows_option)
    else:
        paths = dict(TAME=TAME, LEVELS=LEVELS)
        (dv,) = launch(_kernels.rwkv7_value_gradient_kernel,
                       (r, w, k, a, do, dstates, dx, *index), (dv_shape,), **paths)
        dk, db, dw_part = launch(
            _kernels.rwkv7_key_gradient_kernel, (r, w, k, v, a, b, do, u, dstates, dx, *index),
            (k_grad(k), k_grad(b), jax.ShapeDtypeStruct(partial, jnp.float32)),
            ROWS=rows_option, **paths)
        dr, dw, da = launch(
            _kernels.rwkv7_query_gradient_kernel,
            (r, w, k, v, a, b, do, states, u, dstates, dx, dw_part, *index),
            (k_grad(r), k_grad(w), k_grad(a)), ROWS=rows_option, **paths)
    return (reduce(dr, r), reduce(dw, w), reduce(dk, k), dv, reduce(da, a), reduce(db, b), dh0,
            None)


_rwkv7.defvjp(_rwkv7_fwd, _rwkv7_bwd)


def rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens):
    batch, steps, heads, k_size = r.shape
    v_size = v.shape[-1]
    _check_head_sizes(k_size, v_size)
    config = CONFIG_OVERRIDES.get((k_size, v_size)) or default_config(k_size, v_size)
    # tf32 alone (10-bit mantissa) would miss the float32 contract; split products recover it.
    precise = any(x.dtype == jnp.float32 for x in (r, w, k, v, a, b))
    static = _Static(float(scale), heads, k_size, v_size, config, "tf32x3" if precise else "tf32")
    cu, initial_state = _sequences(batch, steps, cu_seqlens, initial_state, (heads, k_size, v_size))
    rows = lambda x: x.reshape(batch * steps, heads, x.shape[-1])
    o, ht = _rwkv7(static, *map(rows, (r, w, k, v, a, b)), initial_state, cu)
    return o.reshape(batch, steps, heads, v_size), ht


# ==============================================================================================
# Gated linear attention and RWKV-6: one chunked kernel family (triton_kernels/gla.py).
# The same layout, varlen scheme and buffers as RWKV-7 above; RWKV-6 is the recurrence with
# w as the key-side log gate, the read before the update and the bonus u on the diagonal.
# ==============================================================================================

from . import LOG_DECAY_FLOOR  # noqa: E402

_gla_kernels = _launch.kernels("gla")

# Tokens per chunk of the forward (its pairwise factors are built level by level, log2(chunk)
# levels); it saves the state every GLA_SPAN tokens, a multiple of its chunk. The backward's
# chunk is the span: its state-gradient pass saves dH at the end of every span (in the slots of
# the saved states) and its gradient kernels take one span each, all of them at once.
# Measured on the H100 (K=V=64, bf16, B=8, T=4096; BENCHMARKS.md): a forward chunk of 32 is
# slower for GLA (3.88 -> 4.07 ms) and for RWKV-6 with 4 warps (3.93 -> 4.29).
GLA_CHUNK = 16
GLA_SPAN = 64
# _GlaStatic fields -> values, to try other settings (benchmarks/gpu_gla.py --sweep) without
# editing code.
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
    precision: str  # of the float32 matrix products: "tf32x3" for float32 inputs, else "tf32"
    block_v: int
    chunk: int  # tokens per chunk of the forward
    span: int   # the forward saves the state every this many tokens: the backward's chunk
    forward_warps: int         # of the forward
    state_gradient_warps: int  # of the state-gradient pass
    key_gradient_warps: int    # of the parallel gradient kernels: the K-side one,
    value_gradient_warps: int  # the V-side one
    key_block_k: int           # K columns per program of the K-side gradient kernel

    def __post_init__(self):
        for chunk in (self.chunk, self.span):
            if chunk not in (16, 32, 64) or self.span % chunk:
                raise ValueError(f"GLA chunks and spans must be 16, 32 or 64 tokens, the span "
                                 f"({self.span}) a multiple of the chunk; got {chunk}")

    @property
    def v_blocks(self):
        return -(-self.v_size // self.block_v)

    @property
    def block_k(self):
        """K rows per block of the backward's kernels (which sum over K in such blocks)."""
        return min(_pow2_at_least(self.k_size), 64)

    @property
    def k_blocks(self):
        return -(-self.k_size // self.block_k)

    def backward_constexprs(self, block_k=None, **more):
        return dict(self.constexprs(self.span, **more), BK=block_k or self.block_k)

    def constexprs(self, chunk, **more):
        return dict(scale=self.scale, HEADS=self.heads, K=self.k_size, V=self.v_size,
                    BK=_pow2_at_least(self.k_size), BV=self.block_v, C=chunk,
                    LEVELS=chunk.bit_length() - 1, ROWS=self.rows,
                    HAS_A=self.has_a, HAS_B=self.has_b, BONUS=self.bonus, REVERSE=self.reverse,
                    FLOOR=LOG_DECAY_FLOOR, PRECISION=self.precision, **more)


def _gla_slots(cu, rows, span):
    """_first_slots over the sequences' lengths as the kernels clamp them (so that no traced
    ``cu`` can address past the buffers), and the static buffer size."""
    start = jnp.clip(cu[:-1], 0, rows)
    lengths = jnp.clip(cu[1:], start, rows) - start
    clamped = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths).astype(jnp.int32)])
    spans, first = _first_slots(clamped, span)
    return spans, first, _slot_count(rows, cu.shape[0] - 1, span)


def _present(*arrays):
    """Launch inputs: an absent gate or bonus becomes a placeholder that no kernel reads."""
    return tuple(jnp.zeros((1,), jnp.float32) if x is None else x for x in arrays)


def _gla_forward(static, q, k, v, a, b, u, h0, cu, save):
    sequences = cu.shape[0] - 1
    _, state_index, slots = _gla_slots(cu, static.rows, static.span)
    state_shape = (sequences, static.heads, static.k_size, static.v_size)
    o, ht, states = _launch.launch(
        _gla_kernels.gla_forward_kernel, _present(q, k, v, a, b, u, h0, cu, state_index),
        (jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(state_shape, jnp.float32),
         jax.ShapeDtypeStruct((slots,) + state_shape[1:] if save else (1,), jnp.float32)),
        (sequences * static.heads, static.v_blocks), num_warps=static.forward_warps,
        **static.constexprs(static.chunk, SLOTS=slots,
                            CHUNKS_PER_STATE=static.span // static.chunk, SAVE=save))
    return o, ht, states


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gla(static, q, k, v, a, b, u, h0, cu):
    o, ht, _ = _gla_forward(static, q, k, v, a, b, u, h0, cu, save=False)
    return o, ht


def _gla_fwd(static, q, k, v, a, b, u, h0, cu):
    o, ht, states = _gla_forward(static, q, k, v, a, b, u, h0, cu, save=True)
    return (o, ht), (q, k, v, a, b, u, states, cu)


def _gla_state_gradient(static, q, a, b, do, dht, cu):
    """The reverse recurrence of the state gradient: dh0, and dH at the end of every span (in
    the slot of the state saved at its start)."""
    sequences = cu.shape[0] - 1
    state_shape = (static.heads, static.k_size, static.v_size)
    _, state_index, slots = _gla_slots(cu, static.rows, static.span)
    return _launch.launch(
        _gla_kernels.gla_state_gradient_kernel,
        _present(q, a, b, do, dht.astype(jnp.float32), cu, state_index),
        (jax.ShapeDtypeStruct((sequences,) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((slots,) + state_shape, jnp.float32)),
        (sequences * static.heads, static.k_blocks, static.v_blocks),
        num_warps=static.state_gradient_warps, **static.backward_constexprs(SLOTS=slots))


def _gla_bwd(static, residuals, cotangents):
    q, k, v, a, b, u, states, cu = residuals
    do, dht = cotangents
    do = do.astype(v.dtype)
    dh0, dstates = _gla_state_gradient(static, q, a, b, do, dht, cu)
    spans, state_index, slots = _gla_slots(cu, static.rows, static.span)
    # Every input gradient, one program per (span, head, K or V block), all at once: the
    # K-side gradients summing over V in blocks, the V-side ones summing over K.
    inputs = _present(q, k, v, a, b, u, do, states, dstates, cu, state_index,
                      _slot_sequences(spans, state_index, slots))
    unused = jax.ShapeDtypeStruct((1,), jnp.float32)
    dq, dk, da, du = _launch.launch(
        _gla_kernels.gla_key_gradient_kernel, inputs,
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(q.shape, jnp.float32) if static.has_a else unused,
         jax.ShapeDtypeStruct((slots, static.heads, static.k_size), jnp.float32)
         if static.bonus else unused),
        (slots, static.heads, -(-static.k_size // static.key_block_k)),
        num_warps=static.key_gradient_warps, **static.backward_constexprs(static.key_block_k))
    dv, db = _launch.launch(
        _gla_kernels.gla_value_gradient_kernel, inputs,
        (jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct(v.shape, jnp.float32) if static.has_b else unused),
        (slots, static.heads, static.v_blocks), num_warps=static.value_gradient_warps,
        **static.backward_constexprs())
    return (dq, dk, dv, da.astype(a.dtype) if static.has_a else None,
            db.astype(b.dtype) if static.has_b else None,
            du.sum(0).astype(u.dtype) if static.bonus else None, dh0, None)


_gla.defvjp(_gla_fwd, _gla_bwd)


def _gla_warps(k_size, block_v):
    """The forward: measured on the H100 (B=8, T=4096, bf16; BENCHMARKS.md), 4 warps against
    8: at K=V=64 RWKV-6's 5.90 -> 3.87 ms (8 B of spills), at K=V=128 10.6 -> 7.6 ms (140-180 B
    of spills). The backward over 64-token chunks, by sm_90 compile reports only (GLA with gk
    and RWKV-6, benchmarks/compile_report.py; not timed yet), no spills at K=V=64 and 128: the
    state-gradient pass with 8 warps (204-207 registers; 4 warps spill 32 B with the prefetched
    [64, 64] tiles); the K-side gradient kernel with 8 warps and 16 keys per program (208-248
    registers; at K=64 32 keys spill 172 B, 4 warps 92 B); the V-side one with 8 warps (169-170
    registers; 4 warps spill 332 B at K=128). With a value gate (gv) the V-side kernel spills
    408 B at K=64."""
    return dict(forward_warps=4, state_gradient_warps=8, key_gradient_warps=8,
                value_gradient_warps=8, key_block_k=min(_pow2_at_least(k_size), 16))


def _gla_static(q, k, v, a, b, u, scale, reverse):
    """The kernels' static configuration for these ([B, T, H, *]) inputs."""
    batch, steps, heads, k_size = q.shape
    v_size = v.shape[-1]
    _check_head_sizes(k_size, v_size)
    precise = any(x is not None and x.dtype == jnp.float32 for x in (q, k, v, a, b, u))
    block_v = min(_pow2_at_least(v_size), 64)
    static = _GlaStatic(
        float(scale), heads, k_size, v_size, batch * steps, a is not None, b is not None,
        u is not None, bool(reverse), "tf32x3" if precise else "tf32", block_v,
        GLA_CHUNK, GLA_SPAN, **_gla_warps(k_size, block_v))
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


def rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens):
    return _gla_call(r, k, v, w, None, u, scale=scale, reverse=False,
                     initial_state=initial_state, cu_seqlens=cu_seqlens)


def gated_linear_attention(q, k, v, *, g, g_gamma, gk, gv, scale, initial_state,
                           output_final_state, reverse, cu_seqlens):
    # The scalar gates decay every key channel alike: one key-side log gate (summed in float32
    # before the floor, so that the floor applies to the sum). gk alone goes in as it is.
    a = gk
    if g is not None or g_gamma is not None:
        a = jnp.zeros(q.shape, jnp.float32) if gk is None else gk.astype(jnp.float32)
        if g is not None:
            a = a + g.astype(jnp.float32)[..., None]
        if g_gamma is not None:
            a = a + g_gamma.astype(jnp.float32)[:, None]
    return _gla_call(q, k, v, a, gv, None, scale=scale, reverse=reverse,
                     initial_state=initial_state, cu_seqlens=cu_seqlens)

"""The ``triton`` backend's RWKV-7: chunked Triton kernels (``rwkv_jax.triton_kernels.rwkv7``).

The kernels see the batch flattened to rows ``[B * T, H, *]`` and one list of sequences,
``cu`` (``cu_seqlens``, or ``arange(B + 1) * T`` for a plain batch), so packed and plain inputs
share one code path. Chunks are 64 tokens (the WY form: :func:`forward_chunk64`,
:func:`backward_chunk64_v_side`, :func:`backward_chunk64_k_side`); a call that is not
differentiated runs the 64-token forward without residuals with few sequence-heads and the
16-token forward (:func:`_forward16`) with many (``KernelConfig.inference64``). Where each
sequence's chunks start in the per-chunk buffers is computed on the device from ``cu``, and the
buffers have the static size ``rows // chunk + N`` (an upper bound over all length patterns): no host sync, no recompile per
length pattern. The kernels clamp every row and slot they derive from ``cu`` into these
buffers (their sizes are compile-time constants), so no value of ``cu`` reads or writes out of
bounds. Launches go through :mod:`rwkv_jax.backends.triton.launch` (jax-triton on GPU,
Triton's interpreter on CPU); :func:`rwkv7` is a ``jax.custom_vjp``. Exact for every log decay
in [-inf, 0]: the kernels that build in-chunk matrices have two paths (tame and exact, see the
kernels), and :func:`tame_path` picks one per call on the device (one read of w,
``lax.cond``: no host sync); the backward takes the forward's path. The sequential passes have
one path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import LOG_DECAY_FLOOR
from . import launch as _launch
from .common import (_UNUSED, SequencePieces, _check_head_sizes, _first_slots, _pow2_at_least,
                     _sequences, _slot_count, _slot_sequences)

_kernels = _launch.kernels("rwkv7")

CHUNK64 = 64  # tokens per chunk
LEVELS64 = CHUNK64.bit_length() - 1
# The plan's 16-token blocks: of the exact path's in-chunk factors and of the in-chunk inverse's
# diagonal (in_chunk.py's _wy_pairs, _wy_inverse).
BLOCK64 = 16
# A chunk is tame when its log decays sum to at least -TAME_SUM in every column: its A matrices'
# middle-referenced factors stay within e^(+-TAME_SUM / 2) (the kernels' TAME path).
TAME_SUM = 64.0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The op's kernel choices: those whose default depends on the shape (``DEFAULTS``) or that
    a benchmark sweeps. The kernels' own tuning (warps, K parts, register caps) is a keyword of
    :func:`forward_chunk64`, :func:`backward_chunk64_v_side` and :func:`backward_chunk64_k_side`
    (benchmarks/gpu_chunk64_variants.py sweeps those)."""
    # V columns per program of the state passes, outputs and V-side gradients.
    block_v: int
    # V columns per program of the two sequential passes (None: block_v). They read what the
    # in-chunk kernel wrote, so more V blocks recompute nothing.
    recurrence_block_v: int | None = None
    # Calls whose every log decay is >= -1 take the kernels' tame path (``tame_path``: one
    # product per A matrix); False: every call on the exact path (exact for every decay
    # either way).
    tame: bool = True
    # Keys per program of the K-side gradient kernel (None: K_SIDE_BLOCK_K64).
    k_side_block_k: int | None = None
    # num_stages of the forward state pass's loop over chunks, a ``for`` that Triton
    # pipelines (the next chunks' loads, which do not depend on the state, in flight in shared
    # memory during this one's products); 0: a ``while`` loop carrying the next chunk's W by
    # hand (K <= 64), not pipelined. None: forward_chunk64's default.
    state_stages: int | None = None
    # The same for the state-gradient pass's loop. None: STATE_GRADIENT_STAGES64.
    state_gradient_stages: int | None = None
    # 16-bit inputs: W, H per chunk and the decayed rows in bfloat16 (half their bytes, and W H
    # multiplies at the bfloat16 tensor-core rate); the passes still carry H in float32. U0, U,
    # the in-chunk matrices, dU and dX stay float32: U = W H + U0 cancels much of the delta
    # rule's V, and rounding any of them cost measurably more precision. float32 inputs keep
    # float32 buffers (their contract).
    bf16_residuals: bool = True
    # 16-bit inputs: dH' per chunk (the state-gradient pass's output, which the V and K sides
    # read) in bfloat16 (half its bytes).
    bf16_state_gradients: bool = True
    # A call that is not differentiated takes the 64-token forward without residuals; else the
    # 16-token forward (``_forward16``).
    inference64: bool = False


# Programs of the sequential passes below which they are latency-bound: fewer than an H100 has
# multiprocessors (132).
FEW_RECURRENCE_PROGRAMS = 132
# The defaults by shape class: what each class sets over KernelConfig's own defaults, with
# block_v = min(V rounded up to a power of two, 64) in every class (tiles of at most 64 V
# columns are what the kernels' registers are sized for). Measurements: BENCHMARKS.md.
DEFAULTS = {
    # Enough sequence-heads to fill the GPU: V blocks of block_v in every kernel; a call that is
    # not differentiated takes the 16-token forward (its in-chunk matrices cost a quarter of the
    # 64-token ones' arithmetic per token, and the GPU is full either way).
    "many": dict(),
    # Few: narrower V blocks for the latency-bound passes (twice the programs), and the 64-token
    # forward (a quarter of the 16-token one's serial steps).
    "few": dict(recurrence_block_v=32, inference64=True),
}


def default_config(k_size: int, v_size: int, streams: int = FEW_RECURRENCE_PROGRAMS
                   ) -> KernelConfig:
    """The default configuration (``DEFAULTS``) for head sizes K, V and ``streams`` =
    sequences x heads."""
    block_v = min(_pow2_at_least(v_size), 64)
    few = streams * -(-v_size // 64) < FEW_RECURRENCE_PROGRAMS and block_v >= 64
    return KernelConfig(block_v=block_v, **DEFAULTS["few" if few else "many"])


# (K, V) -> KernelConfig, to try other settings without editing code.
CONFIG_OVERRIDES: dict = {}


def _config(k_size, v_size, streams):
    """The KernelConfig of a call: CONFIG_OVERRIDES' for its head sizes, else the default."""
    return CONFIG_OVERRIDES.get((k_size, v_size)) or default_config(k_size, v_size, streams)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the op's launches are specialised on (hashable: a custom_vjp nondiff argument)."""
    scale: float
    config: KernelConfig


def tame_path(w):
    """Whether a call with log decays ``w`` takes the kernels' tame path: every log decay at
    least -TAME_SUM / CHUNK64 = -1 (model-range ones, >= -e^-0.5, always are) makes every chunk
    tame whatever the chunk boundaries. A traced boolean: one read of w, on the device."""
    return jnp.min(w, initial=0.0).astype(jnp.float32) * CHUNK64 >= -TAME_SUM


def _on_path(tame, launch):
    """launch(TAME) on the path ``tame`` picks, on the device (a traced boolean; False: the
    exact path, with no cond): each path is its own compiled kernel, so neither pays the
    other's registers."""
    if tame is False:
        return launch(False)
    return lax.cond(tame, lambda: launch(True), lambda: launch(False))


# The op: when differentiated, the forward's three kernels save what the backward reads
# (``forward_chunk64``'s residuals), no state at every step; a call that is not differentiated
# takes the forward without residuals (two kernels).
def _forward64(static, r, w, k, v, a, b, h0, cu_seqlens, residuals):
    """forward_chunk64 as the op's KernelConfig sets it."""
    config = static.config
    return forward_chunk64(r, w, k, v, a, b, scale=static.scale, initial_state=h0,
                           cu_seqlens=cu_seqlens, block_v=config.block_v, residuals=residuals,
                           exact=not config.tame, bf16_residuals=config.bf16_residuals,
                           state_stages=config.state_stages,
                           recurrence_block_v=config.recurrence_block_v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rwkv7(static, r, w, k, v, a, b, h0, cu_seqlens):
    if static.config.inference64:
        return _forward64(static, r, w, k, v, a, b, h0, cu_seqlens, False)
    return _forward16(static, r, w, k, v, a, b, h0, cu_seqlens)


def _rwkv7_fwd(static, r, w, k, v, a, b, h0, cu_seqlens):
    o, ht, saved = _forward64(static, r, w, k, v, a, b, h0, cu_seqlens, True)
    return (o, ht), (r, w, k, v, a, b, saved, cu_seqlens)


def _rwkv7_bwd(static, residuals, cotangents):
    r, w, k, v, a, b, saved, cu_seqlens = residuals
    do, dht = cotangents
    do = do.astype(v.dtype)
    config = static.config
    dv, dh0, dstates, _, dx = backward_chunk64_v_side(
        r, w, k, v, a, b, saved, do, dht, cu_seqlens=cu_seqlens, block_v=config.block_v,
        recurrence_block_v=config.recurrence_block_v, state_stages=config.state_gradient_stages,
        bf16_state_gradients=config.bf16_state_gradients)
    dr, dw, dk, da, db = backward_chunk64_k_side(
        r, w, k, v, a, b, saved, do, dstates, dx, scale=static.scale, cu_seqlens=cu_seqlens,
        block_v=config.block_v, exact=not config.tame, block_k=config.k_side_block_k)
    return dr, dw, dk, dv, da, db, dh0, None


_rwkv7.defvjp(_rwkv7_fwd, _rwkv7_bwd)


def rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens):
    batch, steps, heads, k_size = r.shape
    v_size = v.shape[-1]
    _check_head_sizes(k_size, v_size)
    cu, initial_state = _sequences(batch, steps, cu_seqlens, initial_state,
                                   (heads, k_size, v_size))
    config = _config(k_size, v_size, (cu.shape[0] - 1) * heads)
    return _rwkv7(_Static(float(scale), config), r, w, k, v, a, b, initial_state, cu_seqlens)


# The 16-token forward: every chunk's [16, 16] in-chunk matrices in a parallel kernel, then one
# sequential pass that keeps H in registers and writes the outputs (triton_kernels/rwkv7/chunk16.py).
CHUNK = 16
LEVELS = CHUNK.bit_length() - 1
# Chunks per program of the tame in-chunk kernel ([G, C, *] tiles, batched products) and its K
# columns at a time; the exact one takes 32 (all 128 at once spill).
IN_CHUNK16_GROUP = 4
IN_CHUNK16_BLOCK_K = 64
EXACT16_BLOCK_K = 32


def _forward16(static, r, w, k, v, a, b, h0, cu_seqlens):
    """(o [B, T, H, V] in v's dtype, ht [N, H, K, V] float32) of the 16-token forward, from the
    op's [B, T, H, *] inputs and float32 initial states h0; V columns per program as the
    64-token state pass's."""
    setup = _setup64(r, w, k, v, a, b, h0, cu_seqlens,
                     static.config.recurrence_block_v or static.config.block_v, chunk=CHUNK)
    r, w, k, v, a, b = setup.inputs
    c, slots, heads = setup.common, setup.chunk_slots, setup.common["HEADS"]
    common = dict(_without(c, "V", "BV"), scale=static.scale, CHUNK_SLOTS=slots)
    matrices = jax.ShapeDtypeStruct((slots, heads, 4, CHUNK, CHUNK), jnp.float32)
    # float32 inputs: "ieee" inverses (their contract); else tf32.
    in_chunk = dict(num_warps=4, SEQUENCES=setup.sequences, INVERSE_PRECISION=(
        "ieee" if c["PRECISION"] == "tf32x3" else "tf32"), **common)
    inputs = (r, w, k, a, b, *setup.index)
    (matrices,) = _on_path(tame_path(w), lambda TAME: _launch.launch(
        _kernels.rwkv7_tame_in_chunk_kernel, inputs, (matrices,),
        (-(-slots // IN_CHUNK16_GROUP), heads), GROUP=IN_CHUNK16_GROUP,
        KI=min(IN_CHUNK16_BLOCK_K, c["BK"]), **in_chunk) if TAME else _launch.launch(
        _kernels.rwkv7_in_chunk_kernel, inputs, (matrices,), (slots, heads), LEVELS=LEVELS,
        KI=min(EXACT16_BLOCK_K, c["BK"]), **in_chunk))
    o, ht = _launch.launch(
        _kernels.rwkv7_forward_kernel,
        (r, w, k, v, a, b, setup.h0, matrices, setup.cu, setup.chunk_index),
        (setup.per_row(c["V"], v.dtype), setup.states(setup.sequences)),
        (setup.sequences * heads, setup.v_blocks), num_warps=4, V=c["V"], BV=c["BV"],
        ROUNDED=False, **common)
    return o.reshape(setup.shape), ht


class _Setup64(NamedTuple):
    """What every launch of a call shares (``_setup64``), and its buffers' shapes."""
    inputs: tuple      # r, w, k, v, a, b flattened to [rows, H, *]
    cu: jax.Array
    h0: jax.Array      # [N, H, K, V] float32
    chunk_index: jax.Array
    index: tuple       # cu, chunk_index, chunk_sequence: the parallel kernels' index inputs
    sequences: int
    chunk_slots: int
    v_blocks: int
    shape: tuple       # [B, T, H, V]: of o and dv
    common: dict       # the compile-time arguments of every launch

    def per_row(self, width, dtype=jnp.float32):
        """A [rows, H, width] buffer."""
        return jax.ShapeDtypeStruct((self.common["TOTAL_ROWS"], self.common["HEADS"], width),
                                    dtype)

    def states(self, slots, dtype=jnp.float32):
        """A [slots, H, K, V] buffer of states."""
        c = self.common
        return jax.ShapeDtypeStruct((slots, c["HEADS"], c["K"], c["V"]), dtype)


def _setup64(r, w, k, v, a, b, initial_state, cu_seqlens, block_v, chunk=CHUNK64):
    """The inputs flattened to rows, ``cu`` and the initial states, the slots' index arrays of
    ``chunk``-token chunks (64; the 16-token forward's 16), and the common compile-time
    arguments."""
    batch, steps, heads, k_size = r.shape
    v_size = v.shape[-1]
    _check_head_sizes(k_size, v_size)
    cu, h0 = _sequences(batch, steps, cu_seqlens, initial_state, (heads, k_size, v_size))
    rows = batch * steps
    sequences = cu.shape[0] - 1
    flat = lambda x: x.reshape(rows, heads, x.shape[-1])
    precise = any(x.dtype == jnp.float32 for x in (r, w, k, v, a, b))
    block_v = min(block_v, _pow2_at_least(v_size))
    chunks, chunk_index = _first_slots(cu, chunk)
    chunk_slots = _slot_count(rows, sequences, chunk)
    return _Setup64(
        inputs=tuple(map(flat, (r, w, k, v, a, b))), cu=cu, h0=h0, chunk_index=chunk_index,
        index=(cu, chunk_index, _slot_sequences(chunks, chunk_index, chunk_slots)),
        sequences=sequences, chunk_slots=chunk_slots, v_blocks=-(-v_size // block_v),
        shape=(batch, steps, heads, v_size),
        common=dict(HEADS=heads, K=k_size, V=v_size, BK=_pow2_at_least(k_size), BV=block_v,
                    C=chunk, FLOOR=LOG_DECAY_FLOOR, TOTAL_ROWS=rows,
                    PRECISION="tf32x3" if precise else "tf32"))


def _residual_dtype(common, bf16_residuals):
    """The dtype of W and H per chunk between the 64-token kernels: bfloat16 for 16-bit inputs
    under ``bf16_residuals``; float32 inputs keep float32 (their tf32x3 contract)."""
    return jnp.bfloat16 if bf16_residuals and common["PRECISION"] != "tf32x3" else jnp.float32


def _without(constexprs, *names):
    return {n: x for n, x in constexprs.items() if n not in names}


def _recurrence64(setup, block_v):
    """The grid and compile-time arguments of a 64-token sequential pass (a program per
    sequence, head and block of V columns): blocks of ``block_v`` columns where set (at most
    the parallel kernels' BV), else the parallel kernels' own."""
    block_v = min(block_v or setup.common["BV"], setup.common["BV"])
    return dict(grid=(setup.sequences * setup.common["HEADS"], -(-setup.common["V"] // block_v)),
                common=dict(setup.common, BV=block_v))


# K columns per part of the in-chunk kernel's tame sums: the fewest barriers without spills
# (the exact path takes parts of 16: wider ones spill kilobytes).
IN_CHUNK_BLOCK_K64 = 64
# Registers per thread of the in-chunk kernel's tame path, by BK (none where absent): 168 lets
# three programs share an SM instead of two, which outweighs its few spills at K=64 (at K=128
# the spills cost more than the third program gains).
IN_CHUNK_MAX_REGISTERS64 = {64: 168}


def forward_chunk64(r, w, k, v, a, b, *, scale=1.0, initial_state=None, cu_seqlens=None,
                    exact=False, block_v=64, block_k_in_chunk=None, warps=None, residuals=False,
                    bf16_residuals=True, state_stages=None, recurrence_block_v=None,
                    max_registers=None):
    """RWKV-7's forward over 64-token chunks in the WY form (triton_kernels/rwkv7/): (o [B, T, H, V] in v's dtype, ht [N, H, K, V] float32) from [B, T, H, *]
    inputs, as :func:`rwkv7` takes them (``cu_seqlens`` packs sequences into B = 1 rows;
    ``initial_state`` [N, H, K, V], zeros when None). Three launches: the in-chunk kernel (W,
    U0, A_qk, A_qb, A_ak, T, the decayed rows q~, k^, b^ and e^g; tame or exact path per call on
    the device, ``tame_path``: every log decay >= -1, so that every 64-token chunk sums to
    >= -64 per channel; ``exact`` forces the exact path), the state pass (U, the state at
    every chunk's start, ht) and the outputs; or, without ``residuals`` (a call that is not
    differentiated), two: the in-chunk kernel (no T) and the state pass, which writes each
    chunk's outputs from the H and U it holds (no H per chunk or U to memory and back).
    ``block_v``: V columns per program of the state pass and the outputs (and of each U0
    product); ``recurrence_block_v``: the state pass's instead, where set (fewer columns, more
    programs, for few sequences: KernelConfig.recurrence_block_v); ``block_k_in_chunk``: K
    columns per part of the tame path's in-chunk sums (None: IN_CHUNK_BLOCK_K64; the exact
    path's: 16).
    ``warps``: those of the in-chunk kernel's tame and exact paths, the state pass and the
    outputs (a dict, keys "tame", "exact", "state", "output"; the defaults: sm_90 compile
    reports (the fewest spills) and, for "state", timing); ``max_registers``: caps on their
    registers per thread, a dict with the same keys over the defaults (None: no cap; default:
    the tame path's IN_CHUNK_MAX_REGISTERS64 at its BK). ``residuals``: also return what the
    backward reads (a dict: ``states`` [chunk slots, H, K, V], H at every chunk's start; ``u``
    and ``wy`` [B * T, H, V or K], U float32 and W; ``matrices`` [chunk slots, H, 4, 64, 64]
    float32, A_qk, A_qb, A_ak, T; ``qd``, ``kd``, ``bd`` [B * T, H, K], the decayed rows, and
    ``decay`` [chunk slots, H, K] float32, e^g). ``states``, ``wy`` and the decayed rows are
    bfloat16 for 16-bit inputs when ``bf16_residuals``
    (KernelConfig.bf16_residuals), else float32. ``state_stages``:
    num_stages of the state pass's loop over chunks, 0 for its ``while`` loop
    (KernelConfig.state_stages; None: 2). The op's forward."""
    setup = _setup64(r, w, k, v, a, b, initial_state, cu_seqlens, block_v)
    warps, max_registers = _forward_launch_options64(setup, warps, max_registers)
    buffer = _residual_dtype(setup.common, bf16_residuals)
    in_chunk = _in_chunk64(setup, scale, exact, buffer, block_k_in_chunk, residuals, warps,
                           max_registers)
    v = setup.inputs[3]
    ht, states, u, o = _state_pass64(setup, in_chunk, v, in_chunk["u0"], setup.h0, buffer,
                                     residuals, recurrence_block_v, state_stages, warps,
                                     max_registers)
    if not residuals:
        return o.reshape(setup.shape), ht
    o = _outputs64(setup, in_chunk, v, u, states, warps, max_registers)
    return o.reshape(setup.shape), ht, dict(_without(in_chunk, "u0"), states=states, u=u)


def _forward_launch_options64(setup, warps, max_registers):
    """The forward's warps and register caps per launch over their defaults: 4 warps
    everywhere (the fewest spills in the in-chunk kernel and the state pass, sm_90 compile
    reports (BENCHMARKS.md); the outputs kernel, as the V
    side's, ran slower at 8)."""
    warps = dict(dict(tame=4, exact=4, state=4, output=4), **(warps or {}))
    max_registers = dict(dict(tame=IN_CHUNK_MAX_REGISTERS64.get(setup.common["BK"])),
                         **(max_registers or {}))
    return warps, max_registers


def _in_chunk64(setup, scale, exact, buffer, block_k_in_chunk, residuals, warps, max_registers):
    """1. In-chunk: W, U0 per token, A_qk, A_qb, A_ak and T (T only with ``residuals``) per
    chunk, on the call's path; the decayed rows q~, k^, b^ and e^g per chunk, which the kernels
    below read. A dict: wy, u0, matrices, qd, kd, bd, decay."""
    common, slots, heads = setup.common, setup.chunk_slots, setup.common["HEADS"]
    block_k, block_v = common["BK"], common["BV"]
    r, w, k, v, a, b = setup.inputs
    in_chunk = lambda TAME: _launch.launch(
        _kernels.rwkv7_wy_kernel, (r, w, k, v, a, b, *setup.index),
        (setup.per_row(common["K"], buffer), setup.per_row(common["V"]),
         jax.ShapeDtypeStruct((slots, heads, 4, CHUNK64, CHUNK64), jnp.float32),
         *(setup.per_row(common["K"], buffer),) * 3,
         jax.ShapeDtypeStruct((slots, heads, common["K"]), jnp.float32)),
        (2 * slots, heads), num_warps=warps["tame" if TAME else "exact"],
        max_registers=max_registers.get("tame" if TAME else "exact"), scale=float(scale),
        TAME=TAME, LEVELS=LEVELS64,
        KI=min((block_k_in_chunk or IN_CHUNK_BLOCK_K64) if TAME else 16, block_k),
        VI=block_v,
        SEQUENCES=setup.sequences, CHUNK_SLOTS=slots,
        # float32 inputs: tf32x3 (split products, float32's precision): ten [64, 64] products
        # without tensor cores ("ieee") spill several KB.
        INVERSE_PRECISION=common["PRECISION"],
        BLOCK_LEVELS=BLOCK64.bit_length() - 1, RESIDUALS=residuals,
        **dict(common, BV=setup.v_blocks * block_v))
    outputs = _on_path(not exact and tame_path(w), in_chunk)
    return dict(zip(("wy", "u0", "matrices", "qd", "kd", "bd", "decay"), outputs))


def _state_pass64(setup, in_chunk, v, u0, h0, buffer, residuals, recurrence_block_v,
                  state_stages, warps, max_registers):
    """2. The state pass over the V columns of ``setup`` (of v, U0 and h0): (the final states,
    the state at every chunk's start and U for the backward, else unused; each chunk's outputs
    at once where not ``residuals``: no H or U to memory and back, else unused). Its loop over
    chunks is pipelined at ``state_stages`` (None: 2; its loads do not depend on H, and 2
    stages keep it within an SM's shared memory at K=128)."""
    recurrence = _recurrence64(setup, recurrence_block_v)
    if state_stages is None:
        state_stages = 2
    saved = ((setup.states(setup.chunk_slots, buffer), setup.per_row(setup.common["V"]))
             if residuals else (_UNUSED, _UNUSED))
    return _launch.launch(
        _kernels.rwkv7_wy_state_kernel,
        (in_chunk["kd"], v, in_chunk["bd"], in_chunk["decay"], in_chunk["wy"], u0, h0, setup.cu,
         setup.chunk_index, in_chunk["qd"], in_chunk["matrices"]),
        (setup.states(setup.sequences), *saved,
         _UNUSED if residuals else setup.per_row(setup.common["V"], v.dtype)),
        recurrence["grid"], num_warps=warps["state"], max_registers=max_registers.get("state"),
        num_stages=max(state_stages, 1), PIPELINED=state_stages > 0,
        CHUNK_SLOTS=setup.chunk_slots, OUTPUTS=not residuals,
        **_without(recurrence["common"], "FLOOR"))


def _outputs64(setup, in_chunk, v, u, states, warps, max_registers):
    """3. The outputs [rows, H, V], all chunks at once, from the saved states and U."""
    (o,) = _launch.launch(
        _kernels.rwkv7_wy_output_kernel,
        (in_chunk["qd"], v, u, states, in_chunk["matrices"], *setup.index),
        (setup.per_row(setup.common["V"], v.dtype),),
        (setup.chunk_slots * setup.v_blocks, setup.common["HEADS"]),
        num_warps=warps["output"], max_registers=max_registers.get("output"),
        SEQUENCES=setup.sequences, CHUNK_SLOTS=setup.chunk_slots,
        **_without(setup.common, "FLOOR"))
    return o


# Warps of the 64-token state-gradient pass at every K (as the forward's state pass: K=128 in
# two halves of 64 keys spills least at 4).
STATE_GRADIENT_WARPS64 = 4
# num_stages of its loop over chunks (0: the ``while`` loop, which carries no shared-memory
# stages: pipelining it was slower at many sequence-heads; KernelConfig.state_gradient_stages
# = 2 may pay for few long sequences, whose pass is latency-bound).
STATE_GRADIENT_STAGES64 = 0


def backward_chunk64_v_side(r, w, k, v, a, b, residuals, do, dht, *, cu_seqlens=None,
                            block_v=64, warps=None, recurrence_block_v=None, state_stages=None,
                            max_registers=None, bf16_state_gradients=False):
    """The first two kernels of the 64-token backward:
    from the inputs as :func:`forward_chunk64` took them, its ``residuals`` and the cotangents
    ``do`` [B, T, H, V] and ``dht`` [N, H, K, V] (of o and ht), (dv [B, T, H, V] in v's dtype,
    dh0 [N, H, K, V] float32, dstates [chunk slots, H, K, V]: the gradient of every chunk's end
    state (float32, or bfloat16 under ``bf16_state_gradients``), du and dx [B * T, H, V]
    float32, whatever the residuals' dtype). Two launches: the state-gradient pass (sequential,
    reverse: dH', dU, dh0) and the V-side gradients (all chunks at once: dX, dV).
    ``warps``: a dict, keys "state" (default STATE_GRADIENT_WARPS64) and "value";
    ``max_registers``: caps on their registers per thread, a dict with the same keys (default
    none);
    ``block_v`` and ``recurrence_block_v`` as :func:`forward_chunk64`'s (no ``scale``: the
    residuals' q~ carries it); ``state_stages``:
    num_stages of the state-gradient pass's loop over chunks, 0 for its ``while`` loop
    (KernelConfig.state_gradient_stages; None: STATE_GRADIENT_STAGES64).
    ``bf16_state_gradients``: dstates in bfloat16 for 16-bit inputs (float32 inputs keep
    float32; KernelConfig.bf16_state_gradients)."""
    setup = _setup64(r, w, k, v, a, b, None, cu_seqlens, block_v)
    warps = dict(dict(state=STATE_GRADIENT_WARPS64, value=4), **(warps or {}))
    max_registers = max_registers or {}
    do = do.reshape(setup.common["TOTAL_ROWS"], setup.common["HEADS"], setup.common["V"])
    dh0, dstates, du = _state_gradient_pass64(
        setup, residuals, do, dht, _residual_dtype(setup.common, bf16_state_gradients),
        recurrence_block_v, state_stages, warps, max_registers)
    dv, dx = _value_gradients64(setup, residuals, do, du, dstates, setup.inputs[3].dtype, warps,
                                max_registers)
    return dv.reshape(setup.shape), dh0, dstates, du, dx


def _state_gradient_pass64(setup, residuals, do, dht, buffer, recurrence_block_v, state_stages,
                           warps, max_registers):
    """4. The state gradient over the V columns of ``setup`` (of do and dht), each sequence from
    its last chunk: dh0, dH' per chunk (in ``buffer``'s dtype) and dU."""
    if state_stages is None:
        state_stages = STATE_GRADIENT_STAGES64
    recurrence = _recurrence64(setup, recurrence_block_v)
    return _launch.launch(
        _kernels.rwkv7_wy_state_gradient_kernel,
        (residuals["qd"], residuals["bd"], residuals["decay"], do, residuals["wy"],
         residuals["matrices"], dht.astype(jnp.float32), setup.cu, setup.chunk_index),
        (setup.states(setup.sequences), setup.states(setup.chunk_slots, buffer),
         setup.per_row(setup.common["V"])),
        recurrence["grid"], num_warps=warps["state"], max_registers=max_registers.get("state"),
        CHUNK_SLOTS=setup.chunk_slots, num_stages=max(state_stages, 1),
        PIPELINED=state_stages > 0, **_without(recurrence["common"], "FLOOR"))


def _value_gradients64(setup, residuals, do, du, dstates, dtype, warps, max_registers):
    """5. The V-side gradients, all chunks at once: dV (in ``dtype``) and dX, [rows, H, V]."""
    return _launch.launch(
        _kernels.rwkv7_wy_value_gradient_kernel,
        (residuals["kd"], do, du, dstates, residuals["matrices"], *setup.index),
        (setup.per_row(setup.common["V"], dtype), setup.per_row(setup.common["V"])),
        (setup.chunk_slots * setup.v_blocks, setup.common["HEADS"]), num_warps=warps["value"],
        max_registers=max_registers.get("value"), SEQUENCES=setup.sequences,
        CHUNK_SLOTS=setup.chunk_slots, **_without(setup.common, "FLOOR"))


# The 64-token K side: keys per program of the K-side kernel and its warps (16 keys at 4 warps:
# no spills, where 32 keys spill), and V columns per step of the dA kernel's sums and of the
# K-side kernel's state products (the dA kernel's shared memory at 32 leaves room for two).
K_SIDE_BLOCK_K64 = 16
K_SIDE_WARPS64 = 4
K_SIDE_BLOCK_V64 = 32
# Registers per thread of the K-side kernel's tame path: 168 lets three programs share an SM
# instead of two, at the price of a few spills.
K_SIDE_MAX_REGISTERS64 = 168


def backward_chunk64_k_side(r, w, k, v, a, b, residuals, do, dstates, dx, *, scale=1.0,
                            cu_seqlens=None, block_v=64, exact=False, warps=None, block_k=None,
                            max_registers=None):
    """The last kernels of the 64-token backward (kernel 6): from the inputs as
    :func:`forward_chunk64` took them, its ``residuals`` (the chunk states H and U), the
    cotangent ``do`` [B, T, H, V] of o and what :func:`backward_chunk64_v_side` returned
    (``dstates``: dH' per chunk; ``dx``: dX, which carries dU), the K-side gradients (dr, dw,
    dk, da, db), each [B, T, H, K] in the dtype of r, w, k, a, b. Two launches:
    ``rwkv7_wy_matrix_gradient_kernel`` (a program per chunk and head: the four dA [64, 64]
    summed over V once per chunk, into a [chunk slots, H, 4, 64, 64] buffer, bfloat16 for
    16-bit inputs, float32 for float32 ones, strictly lower triangular, and the diagonals of
    dA_qk and dA_qb in float32), then ``rwkv7_wy_key_gradient_kernel`` reading
    them, all chunks at once (a program per chunk, head and block of ``block_k`` keys, default
    K_SIDE_BLOCK_K64, summing the state products over all of V inside: no partial sums), on
    the tame or exact path as :func:`tame_path` picks on the device (``exact`` forces the
    exact one). ``block_v``: V columns per step of the sums over V, at most K_SIDE_BLOCK_V64;
    ``warps``: a dict, keys "tame", "exact" (default K_SIDE_WARPS64) and "dA" (8);
    ``max_registers``: caps on their registers per thread, a dict with the same keys over the
    defaults (None: no cap; default: the tame path's K_SIDE_MAX_REGISTERS64)."""
    setup = _setup64(r, w, k, v, a, b, None, cu_seqlens, block_v)
    r, w, k, v, a, b = setup.inputs
    common, slots, heads = setup.common, setup.chunk_slots, setup.common["HEADS"]
    block_k = block_k or K_SIDE_BLOCK_K64
    block_k = block_k if common["K"] % block_k == 0 else common["BK"]
    warps = dict(dict(tame=K_SIDE_WARPS64, exact=K_SIDE_WARPS64, dA=8), **(warps or {}))
    max_registers = dict(dict(tame=K_SIDE_MAX_REGISTERS64), **(max_registers or {}))
    do = do.reshape(common["TOTAL_ROWS"], heads, common["V"])
    block_v = min(common["BV"], K_SIDE_BLOCK_V64)
    dA, diagonal = _launch.launch(
        _kernels.rwkv7_wy_matrix_gradient_kernel,
        (v, residuals["u"], do, dx, *setup.index),
        (jax.ShapeDtypeStruct((slots, heads, 4, CHUNK64, CHUNK64),
                              jnp.float32 if common["PRECISION"] == "tf32x3" else jnp.bfloat16),
         jax.ShapeDtypeStruct((slots, heads, 2, CHUNK64), jnp.float32)),
        (slots, heads), num_warps=warps["dA"], max_registers=max_registers.get("dA"),
        HEADS=heads, V=common["V"], BV=block_v,
        C=CHUNK64, TOTAL_ROWS=common["TOTAL_ROWS"], SEQUENCES=setup.sequences,
        CHUNK_SLOTS=slots, PRECISION=common["PRECISION"])
    launch = lambda TAME: _launch.launch(
        _kernels.rwkv7_wy_key_gradient_kernel,
        (r, w, k, v, a, b, do, residuals["u"], dx, residuals["states"], dstates, dA, diagonal,
         *setup.index),
        tuple(setup.per_row(common["K"], x.dtype) for x in (r, w, k, a, b)),
        (slots * -(-common["K"] // block_k), heads),  # (a chunk's blocks of keys together)
        num_warps=warps["tame" if TAME else "exact"],
        max_registers=max_registers.get("tame" if TAME else "exact"),
        scale=float(scale), LEVELS=LEVELS64, TAME=TAME, SEQUENCES=setup.sequences,
        CHUNK_SLOTS=slots, **dict(common, BK=block_k, BV=block_v))
    grads = _on_path(not exact and tame_path(w), launch)
    return tuple(g.reshape(setup.shape[:3] + (common["K"],)) for g in grads)


def sequence_pieces(options):
    """SequencePieces of rwkv7 on the 64-token kernels. The transition of a block is a K×K map,
    so the state passes run over V + K columns: the values followed by K columns of zero values
    from the identity (forward; backward: zero output gradients from the identity), side by
    side as more programs of the same launch. Every chunk's state from zero and its map from the
    block's start ([H0 | M] per chunk) then give the true state as H0 + M h_in, one product per
    chunk, and U likewise per token (U = W H + U0 is linear in H); the outputs and V-side
    gradient kernels run once on the corrected buffers, which keep the single-device op's dtypes
    (16-bit states and state gradients for 16-bit inputs halve the bytes the sequential passes
    move and let two of their programs share a multiprocessor)."""
    scale = float(options["scale"])

    def setup(x):
        r, w, k, v, a, b = (x[n] for n in "rwkvab")
        config = _config(r.shape[3], v.shape[3], r.shape[0] * r.shape[2])
        return _Static(scale, config), _setup64(r, w, k, v, a, b, None, None, config.block_v)

    def widened(base, zeros_for, start):
        """(base over V + K columns from the states ``start``, the columns' values: those of
        ``zeros_for`` [rows, H, V] followed by K zero columns)."""
        keys = base.common["K"]
        wide = base._replace(h0=start, common=dict(base.common, V=base.common["V"] + keys))
        zeros = jnp.zeros(zeros_for.shape[:2] + (keys,), zeros_for.dtype)
        return wide, jnp.concatenate([zeros_for, zeros], axis=-1)

    def identity_after_zeros(base):
        """[0 | I]: [N, H, K, V + K] float32."""
        c = base.common
        shape = (base.sequences, c["HEADS"], c["K"])
        eye = jnp.broadcast_to(jnp.eye(c["K"], dtype=jnp.float32), shape + (c["K"],))
        return jnp.concatenate([jnp.zeros(shape + (c["V"],), jnp.float32), eye], axis=-1)

    def split(wide, base):
        """(the V columns, the K transition columns) of a widened buffer."""
        return wide[..., :base.common["V"]], wide[..., base.common["V"]:]

    def per_slot(base, h):
        """The [N, H, K, V] states of each chunk slot's sequence (slots past the last: any)."""
        return h[jnp.maximum(base.index[2], 0)]

    def corrected(from_zero, maps, h):
        """Each chunk's from_zero + maps h [slots, H, K, V], in float32, stored as from_zero."""
        exact = jnp.einsum("shkj,shjv->shkv", maps.astype(jnp.float32), h, precision="highest")
        return (from_zero.astype(jnp.float32) + exact).astype(from_zero.dtype)

    def per_row(x, base, h):
        """x [rows, H, K] times each row's sequence's state h [N, H, K, V] -> [rows, H, V]."""
        batch = base.sequences
        y = jnp.einsum("bthk,bhkv->bthv", x.reshape(batch, -1, *x.shape[1:]), h,
                       precision="highest")
        return y.reshape(x.shape[:2] + (h.shape[-1],))

    def state(x):
        static, base = setup(x)
        config = static.config
        warps, caps = _forward_launch_options64(base, None, None)
        buffer = _residual_dtype(base.common, config.bf16_residuals)
        in_chunk = _in_chunk64(base, static.scale, not config.tame, buffer, None, True, warps,
                               caps)
        wide, v = widened(base, base.inputs[3], identity_after_zeros(base))
        _, u0 = widened(base, in_chunk["u0"], None)
        ht, states, u, _ = _state_pass64(wide, in_chunk, v, u0, wide.h0, buffer, True,
                                         config.recurrence_block_v, config.state_stages, warps,
                                         caps)
        h_local, transition = split(ht, base)
        return transition, h_local, (in_chunk, states, u, h_local, transition)

    def forward(x, saved, h_in):
        in_chunk, states, u, h_local, transition = saved
        static, base = setup(x)
        warps, caps = _forward_launch_options64(base, None, None)
        from_zero, maps = split(states, base)
        states = corrected(from_zero, maps, per_slot(base, h_in))
        from_zero, maps = split(u, base)
        u = from_zero + per_row(maps, base, h_in)
        v = base.inputs[3]
        o = _outputs64(base, in_chunk, v, u, states, warps, caps).reshape(base.shape)
        h_out = h_local + jnp.einsum("bhkj,bhjv->bhkv", transition, h_in, precision="highest")
        return (o, h_out), dict(_without(in_chunk, "u0"), states=states, u=u)

    def state_gradient(x, residuals, do):
        static, base = setup(x)
        rows = do.astype(x["v"].dtype).reshape(base.common["TOTAL_ROWS"], *do.shape[2:])
        wide, do_wide = widened(base, rows, None)
        dh0, dstates, du = _state_gradient_pass64(
            wide, residuals, do_wide, identity_after_zeros(base),
            _residual_dtype(base.common, static.config.bf16_state_gradients),
            static.config.recurrence_block_v, static.config.state_gradient_stages,
            dict(state=STATE_GRADIENT_WARPS64), {})
        g, transposed = split(dh0, base)
        return g, (dstates, du, g, transposed)

    def backward(x, residuals, saved, do, dh_t):
        dstates, du, g, transposed = saved
        static, base = setup(x)
        config = static.config
        from_zero, maps = split(dstates, base)
        dstates = corrected(from_zero, maps, per_slot(base, dh_t))
        from_zero, maps = split(du, base)
        du = from_zero + per_row(maps, base, dh_t)
        rows = do.astype(x["v"].dtype).reshape(base.common["TOTAL_ROWS"], *do.shape[2:])
        dv, dx = _value_gradients64(base, residuals, rows, du, dstates, x["v"].dtype,
                                    dict(value=4), {})
        dr, dw, dk, da, db = backward_chunk64_k_side(
            *(x[n] for n in "rwkvab"), residuals, rows.reshape(do.shape), dstates, dx,
            scale=static.scale, exact=not config.tame, block_k=config.k_side_block_k,
            block_v=config.block_v)
        dh_in = g + jnp.einsum("bhkj,bhjv->bhkv", transposed, dh_t, precision="highest")
        grads = dict(r=dr, w=dw, k=dk, v=dv.reshape(base.shape), a=da, b=db)
        return {n: grads[n].astype(x[n].dtype) for n in x}, dh_in

    return SequencePieces(state, forward, state_gradient, backward)

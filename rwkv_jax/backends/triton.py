"""The ``triton`` backend: chunked RWKV-7 Triton kernels (``rwkv_jax.triton_kernels.rwkv7``).

The kernels see the batch flattened to rows ``[B * T, H, *]`` and one list of sequences,
``cu`` (``cu_seqlens``, or ``arange(B + 1) * T`` for a plain batch), so packed and plain inputs
share one code path. The forward saves the state every ``CHUNK * chunks_per_state`` tokens of
each sequence (and U, see the kernels) for the backward, whose state-gradient pass saves dH
at every chunk's end; where each sequence's entries start in these buffers is computed on the
device from ``cu``, and the buffers have the static size ``rows // span + N`` (an upper bound
over all length patterns): no host sync, no recompile per length pattern. The kernels clamp
every row and slot they derive from ``cu`` into these buffers (their sizes are compile-time
constants), so no value of ``cu`` reads or writes out of bounds. Launches go through
:mod:`rwkv_jax.backends._launch` (jax-triton on GPU, Triton's interpreter on CPU);
:func:`rwkv7` is a ``jax.custom_vjp``. Exact for every log decay in [-inf, 0]: each kernel is
compiled on two paths (TAME, see the kernels), and :func:`tame_path` picks one per call on the
device (one read of w, ``lax.cond``: no host sync); the backward takes the forward's path.
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


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_v: int            # V columns per program (fewer: more programs, recomputed chunk work)
    chunks_per_state: int   # the forward saves the state every this many chunks
    forward_warps: int      # of the sequential kernels (forward, state gradient)
    backward_warps: int     # of the parallel gradient kernel
    stages: int | None = None
    # Of the (I - A_ab)^-1 products; None: "ieee" for float32 inputs (their contract), else
    # "tf32" (H100, bf16: 7% faster forward, error unchanged at two digits).
    inverse_precision: str | None = None
    # Calls whose every log decay is >= -TAME_SUM / CHUNK take the kernels' tame path (one
    # product per A matrix); False: every call level by level (exact for every decay either way).
    tame: bool = True


def _pow2_at_least(n, floor=16):
    return max(floor, 1 << (n - 1).bit_length())


def default_config(k_size: int, v_size: int) -> KernelConfig:
    block_k, block_v = _pow2_at_least(k_size), _pow2_at_least(v_size)
    # Measured on an H100 at K=V=64 (BENCHMARKS.md): every kernel is fastest with 4 warps, and
    # the gradient kernel must keep 4: with 8, Triton 3.6 miscompiled its transposed products
    # there (dv wrong; it was also slower, 16.0 ms against 10.7). A state every 8 chunks beats
    # every 1, 2 or 4 (fewer saved states, and the span's walk costs little).
    warps = 8 if block_k * block_v > 64 * 64 else 4
    return KernelConfig(block_v=min(block_v, 64), chunks_per_state=8, forward_warps=warps,
                        backward_warps=4)


# (K, V) -> KernelConfig, to try other settings (benchmarks/gpu_rwkv7.py) without editing code.
CONFIG_OVERRIDES: dict = {}


def _check_head_sizes(k_size, v_size):
    for name, size in (("K (the key/head size of r, w, k, a, b)", k_size),
                       ("V (the value size of v)", v_size)):
        if not 1 <= size <= MAX_HEAD_SIZE:
            raise ValueError(f"backend 'triton' supports head sizes up to {MAX_HEAD_SIZE} "
                             f"(32, 64 and 128 are the tuned ones); got {name} = {size}")


_SHAPES = ("scale", "HEADS", "K", "V", "BK", "BV", "C", "LEVELS", "FLOOR", "PRECISION")


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


def _first_slots(cu, span):
    """Spans of ``span`` tokens of each sequence (the last may be partial), and the first slot
    of each sequence in a buffer of one entry per span."""
    spans = (cu[1:] - cu[:-1] + span - 1) // span
    return spans, jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(spans)[:-1]]).astype(
        jnp.int32)


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


def _forward(static, r, w, k, v, a, b, h0, cu, save, tame):
    rows = r.shape[0]
    sequences = cu.shape[0] - 1
    state_shape = (sequences, static.heads, static.k_size, static.v_size)
    saved = lambda shape: jax.ShapeDtypeStruct(shape if save else (1,), jnp.float32)
    o, ht, states, u = _on_path(static, tame, lambda TAME: _launch.launch(
        _kernels.rwkv7_forward_kernel,
        (r, w, k, v, a, b, h0, cu, _first_slots(cu, static.span)[1]),
        (jax.ShapeDtypeStruct((rows, static.heads, static.v_size), v.dtype),
         jax.ShapeDtypeStruct(state_shape, jnp.float32),
         saved((_slot_count(rows, sequences, static.span),) + state_shape[1:]),
         saved((rows, static.heads, static.v_size))),
        static.grid(sequences), num_warps=static.config.forward_warps,
        num_stages=static.config.stages, SAVE=save, TOTAL_ROWS=rows,
        STATE_SLOTS=_slot_count(rows, sequences, static.span) if save else 1,
        TAME=TAME, **static.constexprs(*_SHAPES, "CHUNKS_PER_STATE", "INVERSE_PRECISION")))
    return o, ht, states, u


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rwkv7(static, r, w, k, v, a, b, h0, cu):
    o, ht, _, _ = _forward(static, r, w, k, v, a, b, h0, cu, False, tame_path(w))
    return o, ht


def _rwkv7_fwd(static, r, w, k, v, a, b, h0, cu):
    tame = tame_path(w)
    o, ht, states, u = _forward(static, r, w, k, v, a, b, h0, cu, True, tame)
    return (o, ht), (r, w, k, v, a, b, states, u, cu, tame)


def _rwkv7_bwd(static, residuals, cotangents):
    r, w, k, v, a, b, states, u, cu, tame = residuals
    return _on_path(static, tame, lambda TAME: _gradients(static, TAME, r, w, k, v, a, b,
                                                          states, u, cu, *cotangents))


def _gradients(static, TAME, r, w, k, v, a, b, states, u, cu, do, dht):
    """Both backward passes, on the forward's path."""
    do = do.astype(v.dtype)
    rows = r.shape[0]
    sequences = cu.shape[0] - 1
    state_shape = (static.heads, static.k_size, static.v_size)
    # 1. The reverse recurrence of the state gradient: dH at the end of every chunk, and dX.
    _, chunk_index = _first_slots(cu, CHUNK)
    dh0, dstates, dx = _launch.launch(
        _kernels.rwkv7_state_gradient_kernel,
        (r, w, a, b, do, dht.astype(jnp.float32), cu, chunk_index),
        (jax.ShapeDtypeStruct((sequences,) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((_slot_count(rows, sequences, CHUNK),) + state_shape, jnp.float32),
         jax.ShapeDtypeStruct((rows, static.heads, static.v_size), jnp.float32)),
        static.grid(sequences), num_warps=static.config.forward_warps,
        num_stages=static.config.stages, TOTAL_ROWS=rows,
        CHUNK_SLOTS=_slot_count(rows, sequences, CHUNK), TAME=TAME,
        **static.constexprs(*_SHAPES, "INVERSE_PRECISION"))
    # 2. Every input gradient, one program per (span, head, V block), all at once.
    spans, state_index = _first_slots(cu, static.span)
    slots = _slot_count(rows, sequences, static.span)
    slot = jnp.arange(slots, dtype=jnp.int32)
    # A sequence of no span shares its first slot with the next: 'right' skips it.
    slot_sequence = jnp.searchsorted(state_index, slot, side="right").astype(jnp.int32) - 1
    slot_sequence = jnp.where(slot < spans.sum(), slot_sequence, -1)
    v_blocks = static.grid(sequences)[1]
    # K-side gradients sum over V: with several V blocks each writes a float32 partial sum.
    if v_blocks == 1:
        k_grad = lambda x: jax.ShapeDtypeStruct((rows, static.heads, static.k_size), x.dtype)
        reduce = lambda g, x: g
    else:
        k_grad = lambda x: jax.ShapeDtypeStruct((v_blocks, rows, static.heads, static.k_size),
                                                jnp.float32)
        reduce = lambda g, x: g.sum(0).astype(x.dtype)
    dr, dw, dk, dv, da, db = _launch.launch(
        _kernels.rwkv7_backward_kernel,
        (r, w, k, v, a, b, do, states, u, dstates, dx, cu, state_index, chunk_index,
         slot_sequence),
        (k_grad(r), k_grad(w), k_grad(k), jax.ShapeDtypeStruct(v.shape, v.dtype),
         k_grad(a), k_grad(b)),
        (slots, static.heads, v_blocks), num_warps=static.config.backward_warps,
        num_stages=static.config.stages,
        ROWS=rows if v_blocks > 1 else 0,  # (0: one V block; no recompile per length)
        TOTAL_ROWS=rows, SEQUENCES=sequences, CHUNK_SLOTS=_slot_count(rows, sequences, CHUNK),
        TAME=TAME, **static.constexprs(*_SHAPES, "CHUNKS_PER_STATE"))
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
    if cu_seqlens is None:
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * steps
    else:
        cu = cu_seqlens.astype(jnp.int32)
    if initial_state is None:
        initial_state = jnp.zeros((cu.shape[0] - 1, heads, k_size, v_size), jnp.float32)
    rows = lambda x: x.reshape(batch * steps, heads, x.shape[-1])
    o, ht = _rwkv7(static, *map(rows, (r, w, k, v, a, b)), initial_state.astype(jnp.float32), cu)
    return o.reshape(batch, steps, heads, v_size), ht

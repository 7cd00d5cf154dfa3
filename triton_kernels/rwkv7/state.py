"""Phase 2 of the 64-token kernels: the sequential state pass (``rwkv7_wy_state_kernel``), which
for a call that is not differentiated also writes the outputs."""

import triton
import triton.language as tl

from ..common import (INTERPRETED, clamped, dot, in_range, row_bases, rows, stored)
from .chunks import (_state, _recurrence, _chunk_bases, _wy_store, _k_part, _wy_decay)
from .outputs import (_wy_outputs)


@triton.jit
def _wy_state_half(ptr, slot, head, half: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, HALF: tl.constexpr, v_cols, v_cols_in):
    """Pointers to K rows half * HALF, ... of a [K, V] state's columns v_cols, and their mask
    (none of a half past K)."""
    k_rows = half * HALF + tl.arange(0, HALF)
    return (_state(ptr + half * HALF * V, slot, head, HEADS, K, V, HALF, v_cols),
            in_range(k_rows, K, HALF)[:, None] & v_cols_in)


@triton.jit
def _wy_state_half_product(h, half: tl.constexpr, x, x_ptr, k_base, rows_in, HEADS: tl.constexpr,
                           K: tl.constexpr, HALF: tl.constexpr, C: tl.constexpr,
                           PRECISION: tl.constexpr):
    """x + X_half H_half for a [C, K] buffer X as stored (W, or q~), H's half (K rows
    half * HALF, ...) rounded to X's dtype, as the state it would have been stored as."""
    base, tile, k_in = _k_part(half, k_base, rows_in, tl.arange(0, C), HEADS, K, HALF)
    rows_x = stored(x_ptr + base, tile, k_in)
    return dot(rows_x, h.to(rows_x.dtype), x, PRECISION)


@triton.jit
def _wy_state_update(h, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, k_base, k_tile, k_in,
                     k_cols, k_cols_in, HEADS: tl.constexpr, K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """H' = e^g H + k^T V + b^T U over the K rows k_cols (all of BK, or a half), from the
    decayed rows (``rwkv7_wy_kernel``): k^ and V multiply as stored, b^ against the
    float32 U at PRECISION (U carries the state: not rounded)."""
    decay = tl.load(_wy_decay(decay_ptr, slot, head, HEADS, K, k_cols), mask=k_cols_in,
                    other=0.0)
    h = dot(tl.trans(stored(kd_ptr + k_base, k_tile, k_in)), v, decay[:, None] * h, PRECISION)
    return dot(tl.trans(rows(bd_ptr, k_base, k_tile, k_in)), u, h, PRECISION)


@triton.jit
def _wy_state_half_update(h, half: tl.constexpr, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head,
                          k_base, rows_in, HEADS: tl.constexpr, K: tl.constexpr,
                          HALF: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """One half of H' (K rows half * HALF, ...): ``_wy_state_update`` on the half's columns."""
    base, tile, k_in = _k_part(half, k_base, rows_in, tl.arange(0, C), HEADS, K, HALF)
    k_cols = half * HALF + tl.arange(0, HALF)
    return _wy_state_update(h, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, base, tile, k_in,
                            k_cols, in_range(k_cols, K, HALF), HEADS, K, PRECISION)


@triton.jit
def _wy_state_halves_step(c, h_low, h_high, first_chunk_slot, start, end, head, v_tile, v_cols,
                          v_cols_in, kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, qd_ptr,
                          matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, HALF: tl.constexpr, C: tl.constexpr,
                          CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
                          OUTPUTS: tl.constexpr):
    """Chunk c of the state pass with H in two halves of HALF K rows (BK = 2 HALF):
    U = U0 + sum of W_half H_half; the chunk's outputs (OUTPUTS) or both halves and U stored;
    H' per half."""
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    first = start + c * C
    rows_in = (first + tl.arange(0, C) < end)[:, None]
    k_base = (first * HEADS + head) * K
    v_base = (first * HEADS + head) * V
    v_in = rows_in & v_cols_in
    if not OUTPUTS:
        pointers, mask = _wy_state_half(states_ptr, slot, head, 0, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, h_low.to(states_ptr.dtype.element_ty), mask=mask)
        pointers, mask = _wy_state_half(states_ptr, slot, head, 1, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, h_high.to(states_ptr.dtype.element_ty), mask=mask)
    u = rows(u0_ptr, v_base, v_tile, v_in)
    u = _wy_state_half_product(h_low, 0, u, wy_ptr, k_base, rows_in, HEADS, K, HALF, C,
                               PRECISION)
    u = _wy_state_half_product(h_high, 1, u, wy_ptr, k_base, rows_in, HEADS, K, HALF, C,
                               PRECISION)
    v = stored(v_ptr + v_base, v_tile, v_in)
    if OUTPUTS:
        o = _wy_state_half_product(h_low, 0, None, qd_ptr, k_base, rows_in, HEADS, K, HALF, C,
                                   PRECISION)
        o = _wy_state_half_product(h_high, 1, o, qd_ptr, k_base, rows_in, HEADS, K, HALF, C,
                                   PRECISION)
        _wy_outputs(o, v, u, matrices_ptr, slot, True, head, o_ptr, v_base, v_tile, v_in, HEADS,
                    C, PRECISION)
    else:
        _wy_store(u_ptr + v_base, v_tile, u, v_in)
    h_low = _wy_state_half_update(h_low, 0, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, k_base,
                                  rows_in, HEADS, K, HALF, C, PRECISION)
    h_high = _wy_state_half_update(h_high, 1, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head,
                                   k_base, rows_in, HEADS, K, HALF, C, PRECISION)
    return h_low, h_high


@triton.jit
def _wy_rows(wy_ptr, c, chunks, start, end, head, k_tile, k_cols_in, v_cols_in,
             HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """Chunk c's W as stored (zeros past the sequence: the last chunk's prefetch)."""
    k_base, k_in, _, _, _ = _chunk_bases(c, chunks, start, end, head, k_cols_in, v_cols_in,
                                         HEADS, K, V, C)
    return stored(wy_ptr + k_base, k_tile, k_in)


@triton.jit
def _wy_state_step(c, h, wy, first_chunk_slot, start, end, head, k_tile, k_cols_in, v_tile,
                   v_cols, v_cols_in, state_mask, kd_ptr, v_ptr, bd_ptr, decay_ptr, u0_ptr,
                   qd_ptr, matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                   CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr, OUTPUTS: tl.constexpr):
    """Chunk c of the state pass (BK <= 64) from its start state h and its W (as stored):
    U = W H + U0; the chunk's outputs (OUTPUTS) or H and U stored; returns H'."""
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    if not OUTPUTS:
        tl.store(_state(states_ptr, slot, head, HEADS, K, V, BK, v_cols),
                 h.to(states_ptr.dtype.element_ty), mask=state_mask)
    k_base, k_in, v_base, v_in = row_bases(start + c * C, end, head, k_cols_in, v_cols_in,
                                            HEADS, K, V, C, False)
    u = dot(wy, h.to(wy.dtype), rows(u0_ptr, v_base, v_tile, v_in), PRECISION)
    v = stored(v_ptr + v_base, v_tile, v_in)
    if OUTPUTS:
        qd = stored(qd_ptr + k_base, k_tile, k_in)
        _wy_outputs(dot(qd, h.to(qd.dtype), None, PRECISION), v, u, matrices_ptr, slot, True,
                    head, o_ptr, v_base, v_tile, v_in, HEADS, C, PRECISION)
    else:
        _wy_store(u_ptr + v_base, v_tile, u, v_in)
    return _wy_state_update(h, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, k_base, k_tile, k_in,
                            tl.arange(0, BK), in_range(tl.arange(0, BK), K, BK), HEADS, K,
                            PRECISION)


@triton.jit
def rwkv7_wy_state_kernel(
    kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, h0_ptr, cu_ptr, chunk_index_ptr,
    qd_ptr, matrices_ptr,                                                        # inputs
    ht_ptr, states_ptr, u_ptr, o_ptr,                                            # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr, PIPELINED: tl.constexpr,
    OUTPUTS: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks of BV): the state recurrence, chunk by chunk, carrying
    H in float32. h0, ht [N, HEADS, K, V] float32; U = W H + U0, with H rounded to W's dtype
    (as it is stored: bfloat16 W and H multiply at the bfloat16 rate). Then H' = e^g H +
    k^T V + b^T U from the decayed rows k^, b^ and e^g of ``rwkv7_wy_kernel``
    (``_wy_state_update``).

    Each chunk's H and U go either to the outputs kernel and the backward (states [chunk
    slots, HEADS, K, V]: H at the start of every chunk, in its chunk slot; u [rows, HEADS, V])
    or, for a call that is not differentiated (OUTPUTS), straight into the chunk's outputs
    O = q~ H + A_qk V + A_qb U (o [rows, HEADS, V]; q~, A_qk, A_qb of ``rwkv7_wy_kernel``),
    computed the way ``rwkv7_wy_output_kernel`` computes them: no H or U goes to memory and
    back, and the outputs need no launch of their own. The other mode's pointers are unread
    and unwritten (any array).

    PIPELINED: on the GPU the loop over chunks is a ``for`` that Triton pipelines (the launch's
    num_stages: the next chunks' loads, which do not depend on H, in flight in shared memory
    during this chunk's products); else a ``while`` (always in the interpreter, whose ``range``
    takes no run-time bound) in which, at BK <= 64, the next chunk's W is loaded
    before this chunk's products (carried in the loop, as stored) so that its latency overlaps
    the serial chain H -> U -> H'. Past 64 keys H is carried as two halves of 64 K rows
    (``_wy_state_halves_step``). sm_90 spills, 4 / 8 warps (compile reports, BENCHMARKS.md):
    see forward_chunk64."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_chunk_slot, h) = _recurrence(cu_ptr, chunk_index_ptr, h0_ptr, HEADS, K, V, BK, BV, C,
                                        TOTAL_ROWS)
    # Past 64 keys, H is carried as two halves of HALF = 64 K rows, so that only one half's
    # [C, 64] decays, k^ and b^ are live at a time (whole [C, 128] tiles spilled 280-696 B).
    HALF: tl.constexpr = 64
    if BK > HALF:
        tl.static_assert(BK == 2 * HALF)
        pointers, mask = _wy_state_half(h0_ptr, sequence, head, 0, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        h_low = tl.load(pointers, mask=mask, other=0.0)
        pointers, mask = _wy_state_half(h0_ptr, sequence, head, 1, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        h_high = tl.load(pointers, mask=mask, other=0.0)
        if INTERPRETED or not PIPELINED:
            c = 0
            while c < chunks:
                h_low, h_high = _wy_state_halves_step(
                    c, h_low, h_high, first_chunk_slot, start, end, head, v_tile, v_cols,
                    v_cols_in, kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, qd_ptr,
                    matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS, K, V, HALF, C, CHUNK_SLOTS,
                    PRECISION, OUTPUTS)
                c += 1
        else:
            for c in range(chunks):
                h_low, h_high = _wy_state_halves_step(
                    c, h_low, h_high, first_chunk_slot, start, end, head, v_tile, v_cols,
                    v_cols_in, kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, qd_ptr,
                    matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS, K, V, HALF, C, CHUNK_SLOTS,
                    PRECISION, OUTPUTS)
        pointers, mask = _wy_state_half(ht_ptr, sequence, head, 0, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, h_low, mask=mask)
        pointers, mask = _wy_state_half(ht_ptr, sequence, head, 1, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, h_high, mask=mask)
    else:
        if INTERPRETED or not PIPELINED:
            wy_next = _wy_rows(wy_ptr, 0, chunks, start, end, head, k_tile, k_cols_in,
                               v_cols_in, HEADS, K, V, C)
            c = 0
            while c < chunks:
                wy = wy_next
                wy_next = _wy_rows(wy_ptr, c + 1, chunks, start, end, head, k_tile, k_cols_in,
                                   v_cols_in, HEADS, K, V, C)
                h = _wy_state_step(c, h, wy, first_chunk_slot, start, end, head, k_tile,
                                   k_cols_in, v_tile, v_cols, v_cols_in, state_mask, kd_ptr,
                                   v_ptr, bd_ptr, decay_ptr, u0_ptr, qd_ptr, matrices_ptr,
                                   states_ptr, u_ptr, o_ptr, HEADS, K, V, BK, C, CHUNK_SLOTS,
                                   PRECISION, OUTPUTS)
                c += 1
        else:  # (no W carried by hand: the pipeline loads it ahead, with the other tiles)
            for c in range(chunks):
                wy = _wy_rows(wy_ptr, c, chunks, start, end, head, k_tile, k_cols_in,
                              v_cols_in, HEADS, K, V, C)
                h = _wy_state_step(c, h, wy, first_chunk_slot, start, end, head, k_tile,
                                   k_cols_in, v_tile, v_cols, v_cols_in, state_mask, kd_ptr,
                                   v_ptr, bd_ptr, decay_ptr, u0_ptr, qd_ptr, matrices_ptr,
                                   states_ptr, u_ptr, o_ptr, HEADS, K, V, BK, C, CHUNK_SLOTS,
                                   PRECISION, OUTPUTS)
        tl.store(_state(ht_ptr, sequence, head, HEADS, K, V, BK, v_cols), h, mask=state_mask)

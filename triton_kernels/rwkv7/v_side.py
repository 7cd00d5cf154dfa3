"""The 64-token backward's V side: the reverse state-gradient pass and the value gradients."""

import triton
import triton.language as tl

from ..common import (INTERPRETED, clamped, dot, in_range, row_bases, rows, stored)
from .chunks import (_state, _recurrence, _wy_matrix, _wy_load, _wy_chunk_program, _wy_decay,
                     WY_A_QK, WY_A_QB, WY_A_AK, WY_T)
from .state import (_wy_state_half)


# The 64-token backward: the state-gradient pass
# and the V-side gradients. Given dO and the gradient dH' of a chunk's end state:
#   dU = A_qb^T dO + b^ dH',  dX = T^T dU  (U = T X, X = a~ H + A_ak V),
#   dH = e^g dH' + q~^T dO + W^T dU  (a~^T T^T = W^T: no [C, C] matrix in the recurrence),
#   dV = A_qk^T dO + A_ak^T dX + k^ dH'.
# The K-side gradients (kernel 6, below) read dX, dH' and the forward's H and U.

@triton.jit
def _wy_du_part(du, dh, bd_ptr, k_base, k_tile, k_in, PRECISION: tl.constexpr):
    """du + b^ dH' (du None: b^ dH') over one part of the K columns (the state gradient's
    [C, KP] tiles, its [KP, BV] rows of dH'); b^ as ``rwkv7_wy_kernel`` stored it,
    against the float32 dH' at PRECISION."""
    return dot(rows(bd_ptr, k_base, k_tile, k_in), dh, du, PRECISION)


@triton.jit
def _wy_dh_part(dh, do, du, qd_ptr, decay_ptr, wy_ptr, slot, head, k_base, k_tile, k_in, k_cols,
                PART: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr,
                PRECISION: tl.constexpr):
    """e^g dH' + W^T dU + q~^T dO over one part of PART K columns (its rows of dH', k_cols):
    the gradient of the chunk's start state there. q~ and dO multiply as stored."""
    decay = tl.load(_wy_decay(decay_ptr, slot, head, HEADS, K, k_cols),
                    mask=in_range(k_cols, K, PART), other=0.0)
    dh = dot(tl.trans(stored(wy_ptr + k_base, k_tile, k_in)), du, decay[:, None] * dh,
             PRECISION)
    return dot(tl.trans(stored(qd_ptr + k_base, k_tile, k_in)), do, dh, PRECISION)


@triton.jit
def _wy_state_gradient_step(c, dh_lo, dh_hi, first_chunk_slot, start, end, head, k_tile,
                            k_cols_in, hi_cols_in, v_tile, v_cols, v_cols_in, state_mask, qd_ptr,
                            bd_ptr, decay_ptr, do_ptr, wy_ptr, matrices_ptr, dstates_ptr, du_ptr,
                            HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, C: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
                            PRECISION: tl.constexpr, HALVES: tl.constexpr):
    """Chunk c of the state-gradient pass from dH' (the gradient of its end state: dh_lo, or
    the two halves dh_lo and dh_hi of HALF K rows when HALVES): dH' stored in the chunk's slot,
    dU = b^ dH' + A_qb^T dO stored; returns dH, the gradient of its start state (the halves;
    dh_hi passed through unused without HALVES)."""
    HALF: tl.constexpr = BK // 2
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    k_base, k_in, v_base, v_in = row_bases(start + c * C, end, head, k_cols_in, v_cols_in,
                                            HEADS, K, V, C, False)
    if HALVES:
        hi_in = row_bases(start + c * C, end, head, hi_cols_in, v_cols_in, HEADS, K, V, C,
                          False)[1]
        pointers, mask = _wy_state_half(dstates_ptr, slot, head, 0, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, dh_lo.to(dstates_ptr.dtype.element_ty), mask=mask)
        pointers, mask = _wy_state_half(dstates_ptr, slot, head, 1, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, dh_hi.to(dstates_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(_state(dstates_ptr, slot, head, HEADS, K, V, BK, v_cols),
                 dh_lo.to(dstates_ptr.dtype.element_ty), mask=state_mask)
    do = stored(do_ptr + v_base, v_tile, v_in)
    # dU = b^ dH' + A_qb^T dO
    du = _wy_du_part(None, dh_lo, bd_ptr, k_base, k_tile, k_in, PRECISION)
    if HALVES:
        du = _wy_du_part(du, dh_hi, bd_ptr, k_base + HALF, k_tile, hi_in, PRECISION)
    du = dot(tl.load(_wy_matrix(matrices_ptr, slot, head, WY_A_QB, HEADS, C, True)), do, du,
             PRECISION)
    du = du.to(du_ptr.dtype.element_ty)
    tl.store(du_ptr + v_base + v_tile, du, mask=v_in)
    LOW: tl.constexpr = HALF if HALVES else BK
    dh_lo = _wy_dh_part(dh_lo, do, du, qd_ptr, decay_ptr, wy_ptr, slot, head, k_base, k_tile,
                        k_in, tl.arange(0, LOW), LOW, HEADS, K, PRECISION)
    if HALVES:
        dh_hi = _wy_dh_part(dh_hi, do, du, qd_ptr, decay_ptr, wy_ptr, slot, head, k_base + HALF,
                            k_tile, hi_in, HALF + tl.arange(0, HALF), HALF, HEADS, K, PRECISION)
    return dh_lo, dh_hi


@triton.jit
def rwkv7_wy_state_gradient_kernel(
    qd_ptr, bd_ptr, decay_ptr, do_ptr, wy_ptr, matrices_ptr, dht_ptr, cu_ptr,     # inputs
    chunk_index_ptr,
    dh0_ptr, dstates_ptr, du_ptr,                                                 # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
    PIPELINED: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks of BV): the reverse recurrence, from each sequence's
    last chunk, carrying dH in float32 (from dht [N, HEADS, K, V]). dstates [chunk slots, HEADS,
    K, V] (the backend's float32): dH' (the gradient of the chunk's end state) in every chunk's
    slot; du [rows, HEADS, V] (the backend's float32): dU, and as stored in W^T dU; dh0
    [N, HEADS, K, V] float32. wy and matrices: the forward's (``rwkv7_wy_kernel``);
    A_qb^T dO multiplies them as stored. q~, b^ and e^g: ``rwkv7_wy_kernel``'s.

    Above BK = 64, K in two halves of BK / 2 columns (dH carried as two tiles, dh_lo and
    dh_hi): every K column's decays are its own, so each half's are exact, and one half's
    [C, BK / 2] tiles are live at a time (``_wy_du_part``, then ``_wy_dh_part``, once per
    half; masked columns past K read and write nothing). A_qb^T dO is added last to dU, after
    the products with dH', and W^T dU before q~^T dO to dH: the order with the fewest spills
    (sm_90 compile reports, BENCHMARKS.md), and no W carried
    through the loop (that spilled).

    PIPELINED: on the GPU the loop over chunks is a ``for`` that Triton pipelines (num_stages:
    the earlier chunks' loads, which do not depend on dH, in flight during this chunk's
    products); else a ``while`` (always in the interpreter, whose ``range`` takes no run-time
    bound)."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_chunk_slot, dh_lo) = _recurrence(cu_ptr, chunk_index_ptr, dht_ptr, HEADS, K, V, BK,
                                            BV, C, TOTAL_ROWS)
    HALVES: tl.constexpr = BK > 64
    HALF: tl.constexpr = BK // 2
    hi_cols_in = k_cols_in
    dh_hi = 0.0  # (carried unused without HALVES)
    if HALVES:  # (the [BK, BV] tile _recurrence loaded is then replaced by the halves)
        # the halves' tiles: the same offsets, the upper half's columns HALF later in the base;
        # 64-bit offsets (each thread's then differ by constants: K=128, 4 warps, 396 -> 140 B
        # of spills with A_qb^T dO first, against 32-bit ones widened per element)
        half_cols = tl.arange(0, HALF)
        k_tile = tl.arange(0, C).to(tl.int64)[:, None] * (HEADS * K) + half_cols[None, :]
        k_cols_in = in_range(half_cols, K, HALF)[None, :]
        hi_cols_in = in_range(HALF + half_cols, K, HALF)[None, :]
        pointers, mask = _wy_state_half(dht_ptr, sequence, head, 0, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        dh_lo = tl.load(pointers, mask=mask, other=0.0)
        pointers, mask = _wy_state_half(dht_ptr, sequence, head, 1, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        dh_hi = tl.load(pointers, mask=mask, other=0.0)
    if INTERPRETED or not PIPELINED:
        c = chunks - 1
        while c >= 0:
            dh_lo, dh_hi = _wy_state_gradient_step(
                c, dh_lo, dh_hi, first_chunk_slot, start, end, head, k_tile, k_cols_in,
                hi_cols_in, v_tile, v_cols, v_cols_in, state_mask, qd_ptr, bd_ptr, decay_ptr,
                do_ptr, wy_ptr, matrices_ptr, dstates_ptr, du_ptr, HEADS, K, V, BK, C,
                CHUNK_SLOTS, PRECISION, HALVES)
            c -= 1
    else:
        for step in range(chunks):
            dh_lo, dh_hi = _wy_state_gradient_step(
                chunks - 1 - step, dh_lo, dh_hi, first_chunk_slot, start, end, head, k_tile,
                k_cols_in, hi_cols_in, v_tile, v_cols, v_cols_in, state_mask, qd_ptr, bd_ptr,
                decay_ptr, do_ptr, wy_ptr, matrices_ptr, dstates_ptr, du_ptr, HEADS, K, V, BK, C,
                CHUNK_SLOTS, PRECISION, HALVES)
    if HALVES:
        pointers, mask = _wy_state_half(dh0_ptr, sequence, head, 0, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, dh_lo, mask=mask)
        pointers, mask = _wy_state_half(dh0_ptr, sequence, head, 1, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, dh_hi, mask=mask)
    else:
        tl.store(_state(dh0_ptr, sequence, head, HEADS, K, V, BK, v_cols), dh_lo,
                 mask=state_mask)


@triton.jit
def rwkv7_wy_value_gradient_kernel(
    kd_ptr, do_ptr, du_ptr, dstates_ptr, matrices_ptr, cu_ptr, chunk_index_ptr,
    chunk_sequence_ptr,                                                          # inputs
    dv_ptr, dx_ptr,                                                              # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (chunk slots * V blocks of BV, HEADS), all chunks at once: dX = T^T dU and
    dV = A_qk^T dO + A_ak^T dX + k^ dH', from the state-gradient pass's dU and dH' (same chunk
    slot), the forward's matrices and k^ (``rwkv7_wy_kernel``). dv [rows, HEADS, V] in its
    dtype; dx [rows, HEADS, V] (the backend's float32), and as stored in dV (as the K side
    reads it).
    The matrices, dU, dO and dX multiply as stored (``dot``). An unused slot reads and writes
    nothing."""
    (slot, head, used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, k_base, k_in, v_base,
     v_in) = _wy_chunk_program(cu_ptr, chunk_index_ptr, chunk_sequence_ptr, HEADS, K, V, BK, BV,
                               C, TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    dx = dot(_wy_load(matrices_ptr, slot, used, head, WY_T, HEADS, C, True),
             stored(du_ptr + v_base, v_tile, v_in), None, PRECISION)
    dx = dx.to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + v_base + v_tile, dx, mask=v_in)
    dv = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_QK, HEADS, C, True),
             stored(do_ptr + v_base, v_tile, v_in), None, PRECISION)
    dv = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_AK, HEADS, C, True), dx, dv,
             PRECISION)
    dh = tl.load(_state(dstates_ptr, slot, head, HEADS, K, V, BK, v_cols),
                 mask=(tl.trans(k_cols_in) & v_cols_in) & used, other=0.0)
    dv = dot(rows(kd_ptr, k_base, k_tile, k_in), dh, dv, PRECISION)
    tl.store(dv_ptr + v_base + v_tile, dv.to(dv_ptr.dtype.element_ty), mask=v_in)

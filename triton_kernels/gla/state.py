"""The two sequential passes of GLA/RWKV-6, one program per (sequence, head, K block, V block): the
forward's state pass (the state at every chunk's start, the final state, the tame-path criterion)
and the backward's state-gradient pass (dH at every chunk's end, dh0)."""

import triton
import triton.language as tl

from ..common import (INTERPRETED, dot, gate_tile as _gate_tile, row_sums as _row_sums,
                      sequence_rows, stored)
from .gates import _chunk_totals, _decayed, _gate_sums, _raw_gate, _read_by_product, _to_end
from .tiles import _chunk_walk, _state_program, _state_tile, _tile


@triton.jit
def _sequential_chunk(c, carried, first_slot, start, end, head, k_cols, v_cols, x_ptr, y_ptr,
                      a_ptr, b_ptr, saved_ptr, HEADS: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                      SLOTS: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr,
                      REVERSE: tl.constexpr):
    """Chunk c of a sequential pass: the carried block (H, or dH) saved in slot first_slot + c
    of saved_ptr, then the chunk's loads as stored: the K-wide tile of x (the state pass's k,
    the state gradient's q), the V-wide tile of y (v; dO) and the gates (rows outside the
    sequence read as zeros)."""
    slot = first_slot + c
    saved, tile, state_mask = _state_tile(slot, head, k_cols, v_cols, HEADS, K, V, BK, BV)
    tl.store(saved_ptr + saved + tile, carried, mask=state_mask & (slot < SLOTS))
    first, step, count = _chunk_walk(c, start, end, C, REVERSE)
    k_base, k_off, k_in = _tile(first, step, count, head, k_cols, HEADS, K, BK, C)
    v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
    return (stored(x_ptr + k_base, k_off, k_in), stored(y_ptr + v_base, v_off, v_in),
            _raw_gate(a_ptr + k_base, k_off, k_in, HAS_A, C, BK),
            _raw_gate(b_ptr + v_base, v_off, v_in, HAS_B, C, BV))


@triton.jit
def _state_step(c, h, low, first_slot, start, end, head, k_cols, v_cols, k_ptr, v_ptr, a_ptr,
                b_ptr, states_ptr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, SLOTS: tl.constexpr,
                HAS_A: tl.constexpr, HAS_B: tl.constexpr, REVERSE: tl.constexpr,
                FLOOR: tl.constexpr, PRECISION: tl.constexpr, ROUNDED: tl.constexpr,
                BY_PRODUCT: tl.constexpr):
    """Chunk c of the state pass: the state at its start saved (``_sequential_chunk``), then
    H' = (e^{A_end} e^{B_end}^T) * H + (k e^{A_end - A})^T (v e^{B_end - B}); ``low`` lowered
    per channel to the chunk's key gates summed (the tame-path criterion). BY_PRODUCT (the
    kernel's choice, for bfloat16 gates): the key gates' sums as products (``_row_sums``,
    ``_chunk_totals``); ``low`` is then a [BK, BV] tile."""
    k, v, a_raw, b_raw = _sequential_chunk(c, h, first_slot, start, end, head, k_cols, v_cols,
                                           k_ptr, v_ptr, a_ptr, b_ptr, states_ptr, HEADS, K, V,
                                           BK, BV, C, SLOTS, HAS_A, HAS_B, REVERSE)
    if HAS_A:
        if BY_PRODUCT:
            gate = _gate_tile(a_raw, FLOOR)
            t = tl.arange(0, C)
            k_to_end = tl.exp(_row_sums(gate, t[None, :] > t[:, None], False))  # after i
            a_sum = _chunk_totals(gate, C, BV)  # [BK, BV]
            h = h * tl.exp(a_sum)
        else:
            k_to_end, a_sum = _to_end(a_raw, FLOOR)
            h = h * tl.exp(a_sum)[:, None]
        k = _decayed(k, k_to_end, ROUNDED)
        # (a NaN gate stays NaN through the floor: its sum counts as -inf here)
        low = tl.minimum(low, tl.where(a_sum == a_sum, a_sum, float("-inf")))
    if HAS_B:
        v_to_end, b_sum = _to_end(b_raw, FLOOR)
        v = _decayed(v, v_to_end, ROUNDED)
        h = h * tl.exp(b_sum)[None, :]
    return dot(tl.trans(k), v, h, PRECISION), low


@triton.jit
def gla_state_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, h0_ptr, cu_ptr, state_index_ptr,  # inputs
    ht_ptr, states_ptr, low_ptr,                                 # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr, SLOTS: tl.constexpr,
    HAS_A: tl.constexpr, HAS_B: tl.constexpr, REVERSE: tl.constexpr, FLOOR: tl.constexpr,
    PRECISION: tl.constexpr, ROUNDED: tl.constexpr, SUMS_BY_PRODUCT: tl.constexpr,
    BLOCKS_FASTEST: tl.constexpr,
):
    """One program per (sequence, head, K block, V block) (``_state_program``): the state pass
    (``_state_step`` per chunk). states [SLOTS, HEADS, K, V] float32 or bfloat16, the state at
    the start of every chunk; ht [N, HEADS, K, V] float32; low [N, HEADS, blocks] float32, the
    least sum of one chunk's key gates in one channel of the program's K block (0 without
    chunks or key gates)."""
    sequence, head, block, k_cols, v_cols = _state_program(HEADS, K, V, BK, BV, BLOCKS_FASTEST)
    start, end, chunks = sequence_rows(sequence, cu_ptr, ROWS, C)
    local, tile, state_mask = _state_tile(sequence, head, k_cols, v_cols, HEADS, K, V, BK, BV)
    first_slot = tl.load(state_index_ptr + sequence)
    h = tl.load(h0_ptr + local + tile, mask=state_mask, other=0.0)
    # (the sums by product need bfloat16 gates, and give the chunk sums as [BK, BV] tiles)
    by_product: tl.constexpr = SUMS_BY_PRODUCT and a_ptr.dtype.element_ty == tl.bfloat16
    if by_product:
        low = tl.zeros([BK, BV], tl.float32)
    else:
        low = tl.zeros([BK], tl.float32)
    if INTERPRETED:  # (whose ``range`` takes no run-time bound)
        c = 0
        while c < chunks:
            h, low = _state_step(c, h, low, first_slot, start, end, head, k_cols, v_cols, k_ptr,
                                 v_ptr, a_ptr, b_ptr, states_ptr, HEADS, K, V, BK, BV, C, SLOTS,
                                 HAS_A, HAS_B, REVERSE, FLOOR, PRECISION, ROUNDED,
                                 by_product)
            c += 1
    else:  # a ``for`` loop, which Triton pipelines: the next chunks' loads overlap this one's
        for c in range(chunks):
            h, low = _state_step(c, h, low, first_slot, start, end, head, k_cols, v_cols, k_ptr,
                                 v_ptr, a_ptr, b_ptr, states_ptr, HEADS, K, V, BK, BV, C, SLOTS,
                                 HAS_A, HAS_B, REVERSE, FLOOR, PRECISION, ROUNDED,
                                 by_product)
    tl.store(ht_ptr + local + tile, h, mask=state_mask)
    blocks: tl.constexpr = ((K + BK - 1) // BK) * ((V + BV - 1) // BV)
    if by_product:
        low = tl.min(low, axis=1)
    tl.store(low_ptr + (sequence * HEADS + head) * blocks + block, tl.min(low, axis=0))


@triton.jit
def _state_gradient_step(c, dh, first_slot, start, end, head, k_cols, v_cols, q_ptr, do_ptr,
                         a_ptr, b_ptr, dstates_ptr, scale: tl.constexpr, HEADS: tl.constexpr,
                         K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         C: tl.constexpr, SLOTS: tl.constexpr, HAS_A: tl.constexpr,
                         HAS_B: tl.constexpr, BONUS: tl.constexpr, REVERSE: tl.constexpr,
                         FLOOR: tl.constexpr, PRECISION: tl.constexpr, ROUNDED: tl.constexpr,
                         SUMS_BY_PRODUCT: tl.constexpr):
    """Chunk c of the state-gradient pass: dH at its end saved (``_sequential_chunk``), then
    dH_prev = (e^{A_C} e^{B_C}^T) * dH + (q e^R)^T (dO e^B) (SUMS_BY_PRODUCT: the key gates'
    sums as products)."""
    q, do, a_raw, b_raw = _sequential_chunk(c, dh, first_slot, start, end, head, k_cols,
                                            v_cols, q_ptr, do_ptr, a_ptr, b_ptr, dstates_ptr,
                                            HEADS, K, V, BK, BV, C, SLOTS, HAS_A, HAS_B, REVERSE)
    if SUMS_BY_PRODUCT and a_raw.dtype == tl.bfloat16:
        gate = _gate_tile(a_raw, FLOOR)
        read = _read_by_product(gate, BONUS, C)
        decay = tl.exp(_chunk_totals(gate, C, BV))
    else:
        a, A, A_end, _ = _gate_sums(a_raw, FLOOR)
        read = A - a if BONUS else A
        decay = tl.exp(A_end)[:, None]
    q = _decayed(q, scale * tl.exp(read), ROUNDED)
    if HAS_B:
        _, B, B_end, _ = _gate_sums(b_raw, FLOOR)
        do = _decayed(do, tl.exp(B), ROUNDED)
        dh = dh * tl.exp(B_end)[None, :]
    return dot(tl.trans(q), do, decay * dh, PRECISION)


@triton.jit
def gla_state_gradient_kernel(
    q_ptr, a_ptr, b_ptr, do_ptr, dht_ptr, cu_ptr, state_index_ptr,  # inputs
    dh0_ptr, dstates_ptr,                                          # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr,
    SLOTS: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, BONUS: tl.constexpr,
    REVERSE: tl.constexpr, FLOOR: tl.constexpr, PRECISION: tl.constexpr, ROUNDED: tl.constexpr,
    SUMS_BY_PRODUCT: tl.constexpr, BLOCKS_FASTEST: tl.constexpr,
):
    """One program per (sequence, head, K block, V block) (``_state_program``): each block of
    the state gradient needs only its own rows and columns (``_state_gradient_step`` per chunk,
    last to first). dh0 [N, HEADS, K, V] float32; dstates [SLOTS, HEADS, K, V] float32 or
    bfloat16, the gradient of the state at the end of every chunk (the slot of the state at its
    start)."""
    sequence, head, _, k_cols, v_cols = _state_program(HEADS, K, V, BK, BV, BLOCKS_FASTEST)
    start, end, chunks = sequence_rows(sequence, cu_ptr, ROWS, C)
    local, tile, state_mask = _state_tile(sequence, head, k_cols, v_cols, HEADS, K, V, BK, BV)
    first_slot = tl.load(state_index_ptr + sequence)
    dh = tl.load(dht_ptr + local + tile, mask=state_mask, other=0.0)
    if INTERPRETED:  # (whose ``range`` takes no run-time bound)
        c = chunks - 1
        while c >= 0:
            dh = _state_gradient_step(c, dh, first_slot, start, end, head, k_cols, v_cols, q_ptr,
                                      do_ptr, a_ptr, b_ptr, dstates_ptr, scale, HEADS, K, V, BK,
                                      BV, C, SLOTS, HAS_A, HAS_B, BONUS, REVERSE, FLOOR,
                                      PRECISION, ROUNDED, SUMS_BY_PRODUCT)
            c -= 1
    else:  # a ``for`` loop, which Triton pipelines: the next chunks' loads overlap this one's
        for done in range(chunks):
            dh = _state_gradient_step(chunks - 1 - done, dh, first_slot, start, end, head,
                                      k_cols, v_cols, q_ptr, do_ptr, a_ptr, b_ptr, dstates_ptr,
                                      scale, HEADS, K, V, BK, BV, C, SLOTS, HAS_A, HAS_B, BONUS,
                                      REVERSE, FLOOR, PRECISION, ROUNDED, SUMS_BY_PRODUCT)
    tl.store(dh0_ptr + local + tile, dh, mask=state_mask)

"""The outputs of GLA/RWKV-6, all chunks at once, from each chunk's saved state and its scores."""

import triton
import triton.language as tl

from ..common import diagonal_tile, dot, gate_tile as _gate_tile, rows, stored
from .gates import (_gate_sums, _log_gate, _middle_by_product, _middle_factors, _raw_gate,
                    _read_by_product, _strictly_lower, _value_mixes)
from .scores import _scores_offsets
from .tiles import _chunk_program, _state_tile, _tile


@triton.jit
def gla_output_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, u_ptr, states_ptr, scores_ptr, cu_ptr, state_index_ptr,
    slot_sequence_ptr,  # inputs
    o_ptr,              # output
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr,
    ROWS: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, BONUS: tl.constexpr,
    REVERSE: tl.constexpr, FLOOR: tl.constexpr, PRECISION: tl.constexpr, TAME: tl.constexpr,
    ROUNDED: tl.constexpr, SUMS_BY_PRODUCT: tl.constexpr, BLOCKS_FASTEST: tl.constexpr,
):
    """Grid (SLOTS, HEADS, V blocks; ``_program_ids``): the outputs of one chunk, all C tokens
    at once, from the state at its start (its slot of ``states``) and its scores; the read of H
    sums over K in blocks of BK. o [rows, HEADS, V].

    TAME: the scores are formed here, in the same loop over K, with the factors referenced to
    the chunk's middle (``_middle_factors``), one [C, BK] x [BK, C] product per K block.
    Otherwise they are read from ``scores`` (gla_scores_kernel, exact). ROUNDED (bfloat16
    inputs): the decayed q and the scores rounded to the inputs' type, so that their products
    with the stored states and v take 16-bit operands. SUMS_BY_PRODUCT (bfloat16 gates): the
    key gates' sums as products (``_read_by_product``, ``_middle_by_product``)."""
    slot, head, v_block, used, first, step, count = _chunk_program(
        cu_ptr, state_index_ptr, slot_sequence_ptr, ROWS, C, REVERSE, (V + BV - 1) // BV,
        BLOCKS_FASTEST)
    v_cols = v_block * BV + tl.arange(0, BV)
    v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
    t = tl.arange(0, C)
    o = tl.zeros([C, BV], tl.float32)
    if TAME:
        scores = tl.zeros([C, C], tl.float32)
        diagonal = tl.zeros([C], tl.float32)
    for block in range(triton.cdiv(K, BK)):  # (a loop, not unrolled: one block live)
        k_cols = block * BK + tl.arange(0, BK)
        k_base, k_off, k_in = _tile(first, step, count, head, k_cols, HEADS, K, BK, C)
        q = rows(q_ptr, k_base, k_off, k_in) * scale
        if TAME:
            k = rows(k_ptr, k_base, k_off, k_in)
            if BONUS:
                u = tl.load(u_ptr + head * K + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
                diagonal += tl.sum(q * u[None, :] * k, axis=1)
            else:
                diagonal += tl.sum(q * k, axis=1)
        if HAS_A:
            raw = _raw_gate(a_ptr + k_base, k_off, k_in, True, C, BK)
            if SUMS_BY_PRODUCT and raw.dtype == tl.bfloat16:
                gate = _gate_tile(raw, FLOOR)
                read = _read_by_product(gate, BONUS, C)
                if TAME:
                    row_factor, column_factor = _middle_by_product(gate, BONUS, C)
            else:
                a, A, _, _ = _gate_sums(raw, FLOOR)
                read = A - a if BONUS else A
                if TAME:
                    row_factor, column_factor = _middle_factors(a, A, BONUS, C)
            if TAME:
                scores = dot(q * row_factor, tl.trans(k * column_factor), scores, PRECISION)
            q = q * tl.exp(read)
        elif TAME:
            scores = dot(q, tl.trans(k), scores, PRECISION)
        state, block_off, state_mask = _state_tile(slot, head, k_cols, v_cols, HEADS, K, V, BK,
                                                   BV)
        h = stored(states_ptr + state, block_off, state_mask & used)
        o = dot(q.to(h.dtype) if ROUNDED else q, h, o, PRECISION)
    if TAME:
        scores = tl.where(_strictly_lower(C), scores, diagonal_tile(diagonal, C))
    else:
        scores = tl.load(
            scores_ptr + _scores_offsets(slot, head, t[:, None], t[None, :], HEADS, C),
            mask=(t[:, None] >= t[None, :]) & used, other=0.0)
    v = stored(v_ptr + v_base, v_off, v_in)
    if HAS_B:
        v = v.to(tl.float32)
        b, B, _, _ = _log_gate(b_ptr + v_base, v_off, v_in, True, FLOOR, C, BV)
        mixed, _ = _value_mixes(scores, v, v, b, C, LEVELS, PRECISION)
        diagonal = t[:, None] == t[None, :]
        o = (o * tl.exp(B) + mixed
             + tl.sum(tl.where(diagonal, scores, 0.0), axis=1)[:, None] * v)
    else:
        o = dot(scores.to(v.dtype) if ROUNDED else scores, v, o, PRECISION)
    tl.store(o_ptr + v_base + v_off, o.to(o_ptr.dtype.element_ty), mask=v_in)

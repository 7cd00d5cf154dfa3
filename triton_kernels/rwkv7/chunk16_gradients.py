"""The 16-token backward: the state-gradient pass and the gradient kernels."""

import triton
import triton.language as tl

from ..common import (INTERPRETED, PREFETCH_UP_TO, clamped, clamped_rows, dot, floored,
                      level_factors as _level, program, row_bases, rows, state_offsets)
from .chunk16 import (_decays, _load_matrix, _state_gradient_chunk, _against, A_AK, A_QK)
from .chunks import (_log_decays, _middle, _state, _recurrence, _chunk_bases)


@triton.jit
def rwkv7_state_gradient_kernel(
    r_ptr, w_ptr, a_ptr, b_ptr, do_ptr, dht_ptr, matrices_ptr, cu_ptr,     # inputs
    chunk_index_ptr,
    dh0_ptr, dstates_ptr, dx_ptr,                                         # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
    ROUNDED: tl.constexpr,
):
    """Grid as the forward's; matrices: the in-chunk kernels'. dh0 [N, HEADS, K, V]
    float32; dstates [CHUNK_SLOTS, HEADS, K, V] float32: the gradient of the state at the end
    of every chunk; dx [rows, HEADS, V] float32."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_slot, dh) = _recurrence(cu_ptr, chunk_index_ptr, dht_ptr, HEADS, K, V, BK, BV, C,
                                   TOTAL_ROWS)
    c = chunks - 1
    if BK <= PREFETCH_UP_TO:
        do_next, w_next, b_next, r_next, a_next, A_qb_t_next, inverse_t_next = \
            _state_gradient_chunk(c, chunks, start, end, first_slot, r_ptr, w_ptr, a_ptr, b_ptr,
                                  do_ptr, matrices_ptr, head, k_tile, k_cols_in, v_tile,
                                  v_cols_in, HEADS, K, V, C, CHUNK_SLOTS)
    while c >= 0:
        chunk_slot = clamped(first_slot + c, CHUNK_SLOTS)
        tl.store(_state(dstates_ptr, chunk_slot, head, HEADS, K, V, BK, v_cols), dh,
                 mask=state_mask)
        _, _, v_base, v_in, _ = _chunk_bases(c, chunks, start, end, head, k_cols_in, v_cols_in,
                                             HEADS, K, V, C)
        if BK <= PREFETCH_UP_TO:
            do, w, b, q, a, A_qb_t, inverse_t = (do_next, w_next, b_next, r_next, a_next,
                                                 A_qb_t_next, inverse_t_next)
            do_next, w_next, b_next, r_next, a_next, A_qb_t_next, inverse_t_next = \
                _state_gradient_chunk(c - 1, chunks, start, end, first_slot, r_ptr, w_ptr, a_ptr,
                                      b_ptr, do_ptr, matrices_ptr, head, k_tile, k_cols_in,
                                      v_tile, v_cols_in, HEADS, K, V, C, CHUNK_SLOTS)
        else:
            do, w, b, q, a, A_qb_t, inverse_t = _state_gradient_chunk(
                c, chunks, start, end, first_slot, r_ptr, w_ptr, a_ptr, b_ptr, do_ptr,
                matrices_ptr, head, k_tile, k_cols_in, v_tile, v_cols_in, HEADS, K, V, C,
                CHUNK_SLOTS)
        if not ROUNDED:
            do = do.to(tl.float32)
        w = floored(w.to(tl.float32), FLOOR)
        b = b.to(tl.float32)
        q = q.to(tl.float32) * scale
        a = a.to(tl.float32)
        gi, ge, g_end, to_end = _decays(w, 0)
        # dU = b^ dH + A_qb^T dO, dX = (I - A_ab)^-T dU, dH_prev = e^g dH + q~^T dO + a~^T dX
        # (dO as stored: ``_against``).
        du = tl.dot(b * tl.exp(to_end), dh, dot(_against(A_qb_t, do, ROUNDED), do, None,
                                                 PRECISION), input_precision=PRECISION)
        dx = tl.dot(inverse_t, du, input_precision=PRECISION)
        tl.store(dx_ptr + v_base + v_tile, dx, mask=v_in)
        dh = dot(tl.trans(_against(q * tl.exp(gi), do, ROUNDED)), do,
                 tl.exp(g_end)[:, None] * dh, PRECISION)
        dh = tl.dot(tl.trans(a * tl.exp(ge)), dx, dh, input_precision=PRECISION)
        c -= 1
    tl.store(_state(dh0_ptr, sequence, head, HEADS, K, V, BK, v_cols), dh, mask=state_mask)


@triton.jit
def _transposed_products(x, y, STRICT: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """x^T y for tiles held transposed ([*, C]), keeping the entries below the diagonal (and
    on it unless STRICT)."""
    index = tl.arange(0, C)
    if STRICT:
        keep = index[:, None] > index[None, :]
    else:
        keep = index[:, None] >= index[None, :]
    return tl.where(keep, tl.dot(tl.trans(x), y, input_precision=PRECISION), 0.0)


@triton.jit
def _exact_row_gradients(k, b, w, dA_qk, dA_qb, dA_ak, dA_ab, dq, da, C: tl.constexpr,
                         LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """dq, da plus their terms through the four A matrices built level by level (as
    ``_in_chunk`` builds them; q and a are their rows), from tiles held transposed ([K, C])
    and the A matrices' gradients (masked)."""
    for level in tl.static_range(LEVELS):
        row, row_strict, column, keep = _level(w, C >> (level + 1), 1, C)
        k_f = k * column
        b_f = b * column
        dq += row * tl.dot(k_f, tl.trans(tl.where(keep, dA_qk, 0.0)), tl.dot(
            b_f, tl.trans(tl.where(keep, dA_qb, 0.0)), input_precision=PRECISION),
            input_precision=PRECISION)
        da += row_strict * tl.dot(k_f, tl.trans(tl.where(keep, dA_ak, 0.0)), tl.dot(
            b_f, tl.trans(tl.where(keep, dA_ab, 0.0)), input_precision=PRECISION),
            input_precision=PRECISION)
    index = tl.arange(0, C)
    diagonal = index[:, None] == index[None, :]
    dq += (tl.sum(tl.where(diagonal, dA_qk, 0.0), axis=1)[None, :] * k
           + tl.sum(tl.where(diagonal, dA_qb, 0.0), axis=1)[None, :] * b)
    return dq, da


@triton.jit
def _exact_column_gradients(q, a, w, dA_qk, dA_qb, dA_ak, dA_ab, dk, db, C: tl.constexpr,
                            LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """dk, db plus their terms through the A matrices built level by level (k and b are their
    columns), as ``_exact_row_gradients``."""
    index = tl.arange(0, C)
    diagonal = index[:, None] == index[None, :]
    dk += tl.sum(tl.where(diagonal, dA_qk, 0.0), axis=1)[None, :] * q
    db += tl.sum(tl.where(diagonal, dA_qb, 0.0), axis=1)[None, :] * q
    for level in tl.static_range(LEVELS):
        row, row_strict, column, keep = _level(w, C >> (level + 1), 1, C)
        q_f = q * row
        a_f = a * row_strict
        dk += column * tl.dot(q_f, tl.where(keep, dA_qk, 0.0), tl.dot(
            a_f, tl.where(keep, dA_ak, 0.0), input_precision=PRECISION),
            input_precision=PRECISION)
        db += column * tl.dot(q_f, tl.where(keep, dA_qb, 0.0), tl.dot(
            a_f, tl.where(keep, dA_ab, 0.0), input_precision=PRECISION),
            input_precision=PRECISION)
    return dk, db


@triton.jit
def _span(slot_sequence_ptr, state_index_ptr, chunk_index_ptr, cu_ptr, HEADS: tl.constexpr,
          K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
          TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
          K_BLOCKS: tl.constexpr, V_BLOCK: tl.constexpr):
    """A gradient program's span (grid: span slots, HEADS, V blocks * K_BLOCKS, its V block
    counted from V_BLOCK: the K-side kernels launch one V block at a time): whether the
    slot is used, its tiles and masks, the sequence's rows, its span's chunks [c, last) (none
    for an unused slot), the head, the slot of the sequence's first chunk (for ``_dh``) and
    the first K row of its block (K_BLOCKS > 1: K = K_BLOCKS * BK; the K-side tiles and states
    are its BK rows, added to their bases)."""
    slot = tl.program_id(0)
    sequence = tl.load(slot_sequence_ptr + slot)
    used = sequence >= 0
    sequence = clamped(sequence, SEQUENCES)
    v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks = program(
        sequence, tl.program_id(1), V_BLOCK + tl.program_id(2) // K_BLOCKS, cu_ptr, HEADS, K, V,
        BK, BV, C, True)
    start, end, chunks = clamped_rows(start, end, TOTAL_ROWS, C)
    c = tl.maximum((slot - tl.load(state_index_ptr + sequence)) * CHUNKS_PER_STATE, 0)
    last = tl.where(used, tl.minimum(c + CHUNKS_PER_STATE, chunks), c)
    return (used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, c, last,
            tl.program_id(1), tl.load(chunk_index_ptr + sequence),
            (tl.program_id(2) % K_BLOCKS) * BK)


@triton.jit
def _in_chunk_gradients(do, v, u, dx, PRECISION: tl.constexpr, C: tl.constexpr):
    """The A matrices' gradients: O = q~ H + A_qk V + A_qb U and X = A_ak V + a~ H."""
    return (_transposed_products(do, v, False, C, PRECISION),
            _transposed_products(do, u, False, C, PRECISION),
            _transposed_products(dx, v, True, C, PRECISION),
            _transposed_products(dx, u, True, C, PRECISION))


@triton.jit
def _chunk_tiles(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dx_ptr, first, end,
                 head, k_tile, k_cols_in, v_tile, v_cols_in, k_first, scale, HEADS: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The tiles of the chunk from row ``first`` that the key-side gradient kernels read, with
    the A matrices' gradients (the V-side loads first: their products come first); the K-side
    tiles are the K rows from k_first."""
    k_base, k_in, v_base, v_in = row_bases(first, end, head, k_cols_in, v_cols_in, HEADS, K, V,
                                            C, True)
    k_base += k_first
    v = rows(v_ptr, v_base, v_tile, v_in)
    do = rows(do_ptr, v_base, v_tile, v_in)
    u = rows(u_ptr, v_base, v_tile, v_in)
    dx = rows(dx_ptr, v_base, v_tile, v_in)
    dA_qk, dA_qb, dA_ak, dA_ab = _in_chunk_gradients(do, v, u, dx, PRECISION, C)
    q = rows(r_ptr, k_base, k_tile, k_in) * scale
    w = _log_decays(w_ptr, k_base, k_tile, k_in, FLOOR)
    k = rows(k_ptr, k_base, k_tile, k_in)
    a = rows(a_ptr, k_base, k_tile, k_in)
    b = rows(b_ptr, k_base, k_tile, k_in)
    return k_base, k_in, v_base, v_in, v, do, u, dx, dA_qk, dA_qb, dA_ak, dA_ab, q, w, k, a, b


@triton.jit
def _store_sum(out_ptr, earlier_ptr, offsets, mask, value, ACCUMULATE: tl.constexpr):
    """Store a K-side gradient (a sum over V) of this launch's V block, plus (ACCUMULATE) the
    float32 sums of the earlier V blocks' launches."""
    if ACCUMULATE:
        value += tl.load(earlier_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dh(dstates_ptr, chunk_slot, head, state_mask, v_cols, k_first, HEADS: tl.constexpr,
        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr):
    """The saved gradient of the state at the end of the chunk in chunk_slot (its K rows from
    k_first), in float32 (saved in float32 or bfloat16: KernelConfig.bf16_saved)."""
    return tl.load(dstates_ptr + k_first * V + state_offsets(chunk_slot, head, HEADS, K, V, BK,
                                                             v_cols),
                   mask=state_mask, other=0.0).to(tl.float32)


# The gradient kernels: one program per (span slot, head, V block), all at once (see the module
# docstring), in three kernels so that none holds every tile (one kernel held 255 registers and
# spilled 636 B at K=V=64; these, sm_90, 4 warps, tame / exact: dv 96 registers, key side 255
# with 0 / 244 B of spills, query side 255 with 0 / 380 B; at K=V=128, BV=64: dv 124 (in
# pieces of 64 K rows), key side on blocks of 64 K rows 0 / 120 B, query side 0 / 452 B; the
# fused tame K-side kernel 352 B at K=64, 360 B on blocks at K=128). Their
# tiles are held transposed, [K, C] and [V, C], so that the products with the states and with
# the [C, C] matrices have K or V (64 or more) rows, which Hopper's warpgroup MMA takes from
# shared memory (fewer registers than the [C, *] orientation; blocks of 32 K rows lose it).
# Layouts: dv [rows, HEADS, V]; the K-side gradients (dr, dw, dk, da, db) [rows, HEADS, K]
# (float32 sums up to this launch's V block when it is not the last; the earlier launches' sums
# are the inputs named earlier_*: unread, any array, in the first).

@triton.jit
def rwkv7_value_gradient_kernel(
    w_ptr, k_ptr, do_ptr, dstates_ptr, dx_ptr, matrices_ptr,
    cu_ptr, state_index_ptr, chunk_index_ptr, slot_sequence_ptr,               # inputs
    dv_ptr,                                                                    # output
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
    K_PIECES: tl.constexpr, PRECISION: tl.constexpr,
):
    """dV = k^ dH + A_qk^T dO + A_ak^T dX, with the forward's A matrices (matrices: the
    in-chunk kernels', whose slots are those of dstates): one path for every decay, and none of
    the r, a tiles or products that rebuilding them took (K=V=128, BV=64, 4 warps: 255
    registers and 512 B of spills on the exact path before)."""
    (used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, c, last, head,
     first_chunk_slot, _) = _span(slot_sequence_ptr, state_index_ptr, chunk_index_ptr, cu_ptr,
                                  HEADS, K, V, BK, BV, C, TOTAL_ROWS, SEQUENCES, CHUNKS_PER_STATE,
                                  1, 0)
    while c < last:
        k_base, k_in, v_base, v_in = row_bases(start + c * C, end, head, k_cols_in, v_cols_in,
                                                HEADS, K, V, C, True)
        chunk_slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
        do = rows(do_ptr, v_base, v_tile, v_in)
        dx = rows(dx_ptr, v_base, v_tile, v_in)
        A_qk = _load_matrix(matrices_ptr, chunk_slot, used, head, A_QK, HEADS, C, False)
        A_ak = _load_matrix(matrices_ptr, chunk_slot, used, head, A_AK, HEADS, C, False)
        dv = tl.dot(dx, A_ak, tl.dot(do, A_qk, input_precision=PRECISION),
                    input_precision=PRECISION)
        for piece in tl.static_range(K_PIECES):  # BK rows of K at a time: dH's tile is halved
            k_first = piece * BK
            k = rows(k_ptr, k_base + k_first, k_tile, k_in)
            to_end = _decays(_log_decays(w_ptr, k_base + k_first, k_tile, k_in, FLOOR), 1)[3]
            dh = _dh(dstates_ptr, chunk_slot, head, state_mask, v_cols, k_first, HEADS, K, V, BK)
            dv = tl.dot(tl.trans(dh), k * tl.exp(to_end), dv, input_precision=PRECISION)
        tl.store(dv_ptr + v_base + v_tile, dv.to(dv_ptr.dtype.element_ty), mask=v_in)
        c += 1


@triton.jit
def rwkv7_key_gradient_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dstates_ptr, dx_ptr,
    earlier_dk_ptr, earlier_db_ptr,
    cu_ptr, state_index_ptr, chunk_index_ptr, slot_sequence_ptr,               # inputs
    dk_ptr, db_ptr, dw_part_ptr,                                               # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr,
    FLOOR: tl.constexpr, TAME: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
    K_BLOCKS: tl.constexpr, V_BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dk, db (the columns of the A matrices, and k^, b^ of the state's update) and their
    share of dw, dw_part (float32 always, this V block's alone: ``rwkv7_query_gradient_kernel``
    adds it to dw)."""
    (used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, c, last, head,
     first_chunk_slot, k_first) = _span(slot_sequence_ptr, state_index_ptr, chunk_index_ptr,
                                        cu_ptr, HEADS, K, V, BK, BV, C, TOTAL_ROWS, SEQUENCES,
                                        CHUNKS_PER_STATE, K_BLOCKS, V_BLOCK)
    while c < last:
        (k_base, k_in, v_base, v_in, v, do, u, dx, dA_qk, dA_qb, dA_ak, dA_ab, q, w, k, a,
         b) = _chunk_tiles(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dx_ptr,
                           start + c * C, end, head, k_tile, k_cols_in, v_tile, v_cols_in, k_first,
                           scale, HEADS, K, V, C, FLOOR, PRECISION)
        gi, ge, g_end, to_end = _decays(w, 1)
        if TAME:  # no floored decay, |gi| <= 16: the plain difference is precise, fewer registers
            to_end = g_end[:, None] - gi
        to_end = tl.exp(to_end)
        # H' = e^g H + k^T V + b^T U, with k^ = k e^(g - gi), b^ = b e^(g - gi).
        dh = _dh(dstates_ptr, clamped(first_chunk_slot + c, CHUNK_SLOTS), head, state_mask,
                 v_cols, k_first, HEADS, K, V, BK)
        dk_state = tl.dot(dh, v, input_precision=PRECISION) * to_end
        db_state = tl.dot(dh, u, input_precision=PRECISION) * to_end
        dg_end = tl.sum(dk_state * k + db_state * b, axis=1)
        if TAME:  # the factored tiles of the A matrices
            middle = _middle(gi, 1, C)
            q_f = q * tl.exp(gi - middle)
            a_f = a * tl.exp(ge - middle)
            column = tl.exp(middle - gi)
            dk = dk_state + column * tl.dot(q_f, dA_qk, tl.dot(a_f, dA_ak,
                                                                input_precision=PRECISION),
                                            input_precision=PRECISION)
            db = db_state + column * tl.dot(q_f, dA_qb, tl.dot(a_f, dA_ab,
                                                                input_precision=PRECISION),
                                            input_precision=PRECISION)
        else:
            dk, db = _exact_column_gradients(q, a, w, dA_qk, dA_qb, dA_ak, dA_ab, dk_state,
                                             db_state, C, LEVELS, PRECISION)
        # k_i, b_i enter a chunk only as x_i e^-gi_i (the e^g of k^ and b^ is in dg_end): their
        # share of the gradient of gi is -k dk - b db (dw: see the query-side kernel).
        dw = tl.cumsum(-(k * dk + b * db), axis=1, reverse=True) + dg_end[:, None]
        _store_sum(dk_ptr, earlier_dk_ptr, k_base + k_tile, k_in, dk, ACCUMULATE)
        _store_sum(db_ptr, earlier_db_ptr, k_base + k_tile, k_in, db, ACCUMULATE)
        tl.store(dw_part_ptr + k_base + k_tile, dw, mask=k_in)
        c += 1


@triton.jit
def rwkv7_query_gradient_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, states_ptr, u_ptr, dstates_ptr, dx_ptr,
    dw_part_ptr, earlier_dr_ptr, earlier_dw_ptr, earlier_da_ptr,
    cu_ptr, state_index_ptr, chunk_index_ptr, slot_sequence_ptr,               # inputs
    dr_ptr, dw_ptr, da_ptr,                                                    # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr,
    FLOOR: tl.constexpr, TAME: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
    K_BLOCKS: tl.constexpr, V_BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dr, da (the rows of the A matrices, and q~ H, a~ H) and dw, finished from the key
    side's share dw_part: the kernel that needs the state H, its saved H advanced over the
    span with the saved U."""
    (used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, c, last, head,
     first_chunk_slot, k_first) = _span(slot_sequence_ptr, state_index_ptr, chunk_index_ptr,
                                        cu_ptr, HEADS, K, V, BK, BV, C, TOTAL_ROWS, SEQUENCES,
                                        CHUNKS_PER_STATE, K_BLOCKS, V_BLOCK)
    h = tl.load(states_ptr + k_first * V + state_offsets(tl.program_id(0), head, HEADS, K, V, BK,
                                                         v_cols),
                mask=state_mask & used, other=0.0).to(tl.float32)
    while c < last:
        # e^g H adds e^g sum(H dH) to the gradient of g (first: dH's tile is then dead).
        h_dh = tl.sum(h * _dh(dstates_ptr, clamped(first_chunk_slot + c, CHUNK_SLOTS), head,
                              state_mask, v_cols, k_first, HEADS, K, V, BK), axis=1)
        (k_base, k_in, v_base, v_in, v, do, u, dx, dA_qk, dA_qb, dA_ak, dA_ab, q, w, k, a,
         b) = _chunk_tiles(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dx_ptr,
                           start + c * C, end, head, k_tile, k_cols_in, v_tile, v_cols_in, k_first,
                           scale, HEADS, K, V, C, FLOOR, PRECISION)
        gi, ge, g_end, to_end = _decays(w, 1)
        # The terms of q~ H and a~ H, and those through the four A matrices.
        dq = tl.dot(h, do, input_precision=PRECISION) * tl.exp(gi)
        da = tl.dot(h, dx, input_precision=PRECISION) * tl.exp(ge)
        if CHUNKS_PER_STATE > 1:  # H at the next chunk's start (then V and U are dead)
            to_end = tl.exp(to_end)
            h = tl.dot(k * to_end, tl.trans(v), tl.exp(g_end)[:, None] * h,
                       input_precision=PRECISION)
            h = tl.dot(b * to_end, tl.trans(u), h, input_precision=PRECISION)
        if TAME:
            middle = _middle(gi, 1, C)
            column = tl.exp(middle - gi)
            k_f = k * column
            b_f = b * column
            dq += tl.exp(gi - middle) * tl.dot(k_f, tl.trans(dA_qk), tl.dot(
                b_f, tl.trans(dA_qb), input_precision=PRECISION), input_precision=PRECISION)
            da += tl.exp(ge - middle) * tl.dot(k_f, tl.trans(dA_ak), tl.dot(
                b_f, tl.trans(dA_ab), input_precision=PRECISION), input_precision=PRECISION)
        else:
            dq, da = _exact_row_gradients(k, b, w, dA_qk, dA_qb, dA_ak, dA_ab, dq, da, C, LEVELS,
                                          PRECISION)
        # In a chunk q_t enters only as q_t e^gi_t, a_t as a_t e^ge_t, and k_i, b_i as
        # x_i e^-gi_i (their share, -k dk - b db, and the e^g of k^ and b^ are in dw_part):
        # the gradients of gi and ge are q dq (- k dk - b db) and a da, and e^g H adds
        # e^g sum(H dH) to that of g. gi_t = w_1 + ... + w_t, ge_t = gi_t - w_t, g = gi_C.
        # A log decay raised to FLOOR has gradient 0.
        dg_end = tl.exp(g_end) * h_dh
        if not TAME:  # (a tame call has no decay below FLOOR)
            floored = rows(w_ptr, k_base, k_tile, k_in) < FLOOR
        d_ge = a * da
        dw = (tl.load(dw_part_ptr + k_base + k_tile, mask=k_in, other=0.0)
              + tl.cumsum(q * dq + d_ge, axis=1, reverse=True) - d_ge + dg_end[:, None])
        if not TAME:
            dw = tl.where(floored, 0.0, dw)
        _store_sum(dr_ptr, earlier_dr_ptr, k_base + k_tile, k_in, dq * scale, ACCUMULATE)
        _store_sum(dw_ptr, earlier_dw_ptr, k_base + k_tile, k_in, dw, ACCUMULATE)
        _store_sum(da_ptr, earlier_da_ptr, k_base + k_tile, k_in, da, ACCUMULATE)
        c += 1


@triton.jit
def _tame_gradient_chunk(
    c, h, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dstates_ptr, dx_ptr,
    earlier_dr_ptr, earlier_dw_ptr, earlier_dk_ptr, earlier_da_ptr, earlier_db_ptr,
    dr_ptr, dw_ptr, dk_ptr, da_ptr, db_ptr, start, end, head, k_tile, k_cols_in, v_tile,
    v_cols_in, k_first, state_mask, v_cols, first_chunk_slot, scale: tl.constexpr,
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
    FLOOR: tl.constexpr, CHUNK_SLOTS: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Chunk c of ``rwkv7_tame_gradient_kernel``'s span: its gradients stored, H (at the
    chunk's start) advanced to the next chunk's start."""
    (k_base, k_in, v_base, v_in, v, do, u, dx, dA_qk, dA_qb, dA_ak, dA_ab, q, w, k, a,
     b) = _chunk_tiles(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dx_ptr,
                       start + c * C, end, head, k_tile, k_cols_in, v_tile, v_cols_in, k_first,
                       scale, HEADS, K, V, C, FLOOR, PRECISION)
    gi, ge, g_end, _ = _decays(w, 1)
    to_end = tl.exp(g_end[:, None] - gi)  # (|gi| <= 16: the plain difference is precise)
    dh = _dh(dstates_ptr, clamped(first_chunk_slot + c, CHUNK_SLOTS), head, state_mask,
             v_cols, k_first, HEADS, K, V, BK)
    dk_state = tl.dot(dh, v, input_precision=PRECISION) * to_end
    db_state = tl.dot(dh, u, input_precision=PRECISION) * to_end
    dg_end = tl.exp(g_end) * tl.sum(h * dh, axis=1) + tl.sum(dk_state * k + db_state * b,
                                                              axis=1)
    dq = tl.dot(h, do, input_precision=PRECISION) * tl.exp(gi)
    da = tl.dot(h, dx, input_precision=PRECISION) * tl.exp(ge)
    if CHUNKS_PER_STATE > 1:  # H at the next chunk's start (then V and U are dead)
        h = tl.dot(k * to_end, tl.trans(v), tl.exp(g_end)[:, None] * h,
                   input_precision=PRECISION)
        h = tl.dot(b * to_end, tl.trans(u), h, input_precision=PRECISION)
    middle = _middle(gi, 1, C)
    column = tl.exp(middle - gi)
    q_f = q * tl.exp(gi - middle)
    a_f = a * tl.exp(ge - middle)
    k_f = k * column
    b_f = b * column
    dq += tl.exp(gi - middle) * tl.dot(k_f, tl.trans(dA_qk), tl.dot(
        b_f, tl.trans(dA_qb), input_precision=PRECISION), input_precision=PRECISION)
    da += tl.exp(ge - middle) * tl.dot(k_f, tl.trans(dA_ak), tl.dot(
        b_f, tl.trans(dA_ab), input_precision=PRECISION), input_precision=PRECISION)
    dk = dk_state + column * tl.dot(q_f, dA_qk, tl.dot(a_f, dA_ak, input_precision=PRECISION),
                                    input_precision=PRECISION)
    db = db_state + column * tl.dot(q_f, dA_qb, tl.dot(a_f, dA_ab, input_precision=PRECISION),
                                    input_precision=PRECISION)
    d_ge = a * da
    dw = (tl.cumsum(q * dq - k * dk - b * db + d_ge, axis=1, reverse=True) - d_ge
          + dg_end[:, None])
    offsets = k_base + k_tile
    _store_sum(dr_ptr, earlier_dr_ptr, offsets, k_in, dq * scale, ACCUMULATE)
    _store_sum(dw_ptr, earlier_dw_ptr, offsets, k_in, dw, ACCUMULATE)
    _store_sum(dk_ptr, earlier_dk_ptr, offsets, k_in, dk, ACCUMULATE)
    _store_sum(da_ptr, earlier_da_ptr, offsets, k_in, da, ACCUMULATE)
    _store_sum(db_ptr, earlier_db_ptr, offsets, k_in, db, ACCUMULATE)
    return h


@triton.jit
def rwkv7_tame_gradient_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, states_ptr, u_ptr, dstates_ptr, dx_ptr,
    earlier_dr_ptr, earlier_dw_ptr, earlier_dk_ptr, earlier_da_ptr, earlier_db_ptr,
    cu_ptr, state_index_ptr, chunk_index_ptr, slot_sequence_ptr,               # inputs
    dr_ptr, dw_ptr, dk_ptr, da_ptr, db_ptr,                                    # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    CHUNKS_PER_STATE: tl.constexpr, K_BLOCKS: tl.constexpr, V_BLOCK: tl.constexpr,
    ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, PIPELINED: tl.constexpr,
):
    """The key and query gradient kernels in one, for tame calls only (their TAME path): it
    reads the inputs and dH once instead of twice. With dV in it too (before the value kernel
    read the forward's A matrices) it measured faster than three kernels at K=V=64 despite
    636 B of spills (H100, B=8, T=4096, H=64, bf16: fwd+bwd 18.55 ms against 20.27), slower at
    K=128 (65.8 ms against 49.6, 2636 B). Without dV and on blocks of 64 K rows it is faster
    at both (session 7: K=64 15.53 ms against 18.14 in two kernels, K=128 32.87 against
    36.85): the default. Same arithmetic as the two kernels' tame paths (on the same K
    blocks). PIPELINED: on the GPU its loop over the span's chunks is a ``for`` that Triton
    pipelines (the launch's num_stages: the next chunks' loads in flight during this one's
    products; KernelConfig.gradient_stages)."""
    (used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, c, last, head,
     first_chunk_slot, k_first) = _span(slot_sequence_ptr, state_index_ptr, chunk_index_ptr,
                                        cu_ptr, HEADS, K, V, BK, BV, C, TOTAL_ROWS, SEQUENCES,
                                        CHUNKS_PER_STATE, K_BLOCKS, V_BLOCK)
    h = tl.load(states_ptr + k_first * V + state_offsets(tl.program_id(0), head, HEADS, K, V, BK,
                                                         v_cols),
                mask=state_mask & used, other=0.0).to(tl.float32)
    if INTERPRETED or not PIPELINED:  # (the interpreter's ``range`` takes no run-time bound)
        while c < last:
            h = _tame_gradient_chunk(
                c, h, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dstates_ptr, dx_ptr,
                earlier_dr_ptr, earlier_dw_ptr, earlier_dk_ptr, earlier_da_ptr, earlier_db_ptr,
                dr_ptr, dw_ptr, dk_ptr, da_ptr, db_ptr, start, end, head, k_tile, k_cols_in,
                v_tile, v_cols_in, k_first, state_mask, v_cols, first_chunk_slot, scale, HEADS, K,
                V, BK, C, FLOOR, CHUNK_SLOTS, CHUNKS_PER_STATE, ACCUMULATE, PRECISION)
            c += 1
    else:
        for chunk in range(c, last):
            h = _tame_gradient_chunk(
                chunk, h, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dstates_ptr,
                dx_ptr,
                earlier_dr_ptr, earlier_dw_ptr, earlier_dk_ptr, earlier_da_ptr, earlier_db_ptr,
                dr_ptr, dw_ptr, dk_ptr, da_ptr, db_ptr, start, end, head, k_tile, k_cols_in,
                v_tile, v_cols_in, k_first, state_mask, v_cols, first_chunk_slot, scale, HEADS, K,
                V, BK, C, FLOOR, CHUNK_SLOTS, CHUNKS_PER_STATE, ACCUMULATE, PRECISION)

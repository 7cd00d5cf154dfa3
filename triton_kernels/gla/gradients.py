"""The parallel gradient kernels of GLA/RWKV-6, all chunks at once: the K-side gradients (dq, dk,
da, du) of a block of keys and the V-side ones (dv, db) of a block of values."""

import triton
import triton.language as tl

from ..common import dot, level_factors_at, rows, stored
from .gates import (_exclusive_cumsum, _log_gate, _middle_factors, _scores_diagonal,
                    _strictly_lower, _value_mixes, _value_pairs)
from .tiles import _chunk_program, _state_tile, _tile


@triton.jit
def _state_terms(dk_state, h_dh, h, v_ptr, b_ptr, v_off, v_in, dh_ptr, block, block_mask,
                 HAS_B: tl.constexpr, FLOOR: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                 PRECISION: tl.constexpr):
    """k's gradient through the state, H' = (e^{A_C} e^{B_C}^T) * H + (k e^{A_C - A})^T
    (v e^{B_C - B}), from one block of V: (v e^{B_C - B}) dH^T added to dk_state (times
    e^{A_C - A} after) and sum_v e^{B_C} H dH to h_dh (times e^{A_C} after). v (the chunk's
    tile at v_ptr), H and dH (the state block at dh_ptr) as stored."""
    v = stored(v_ptr, v_off, v_in)
    dh = tl.load(dh_ptr + block, mask=block_mask, other=0.0)
    if HAS_B:
        _, B, B_end, _ = _log_gate(b_ptr, v_off, v_in, True, FLOOR, C, BV)
        v = v.to(tl.float32) * tl.exp(B_end[None, :] - B)
        h_dh += tl.sum(h.to(tl.float32) * dh.to(tl.float32) * tl.exp(B_end)[None, :], axis=1)
    else:
        h_dh += tl.sum(h.to(tl.float32) * dh.to(tl.float32), axis=1)
    return dot(v, tl.trans(dh), dk_state, PRECISION), h_dh


@triton.jit
def _value_block(v_block, slot, head, first, step, count, k_cols, HEADS: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 C: tl.constexpr):
    """Block ``v_block`` of V columns of a chunk: its [C, BV] tile (``_tile``) and the state
    block of rows ``k_cols`` and these columns (``_state_tile``)."""
    v_cols = v_block * BV + tl.arange(0, BV)
    v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
    state, block, state_mask = _state_tile(slot, head, k_cols, v_cols, HEADS, K, V, BK, BV)
    return v_base, v_off, v_in, state, block, state_mask


@triton.jit
def gla_key_gradient_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, u_ptr, do_ptr, states_ptr, dstates_ptr,
    cu_ptr, state_index_ptr, slot_sequence_ptr,                # inputs
    dq_ptr, dk_ptr, da_ptr, du_ptr,                            # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, KEYS: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    LEVELS: tl.constexpr, ROWS: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr,
    BONUS: tl.constexpr, REVERSE: tl.constexpr, FLOOR: tl.constexpr, PRECISION: tl.constexpr,
    TAME: tl.constexpr, BLOCKS_FASTEST: tl.constexpr,
):
    """Grid (SLOTS, HEADS, K / KEYS; ``_program_ids``): every K-side gradient of one chunk's
    block of KEYS keys, in steps of BK keys. First the scores' gradient, summed over all V in
    blocks of BV (once for all the program's keys), then per step of BK keys: the read of H
    over V, the pairs (q and k of these keys only), then the state's gradients (exact path: in
    a second pass over V, after the levels; tame path: in the first). dq, dk [rows, HEADS, K];
    da [rows, HEADS, K] float32 (if HAS_A); du [SLOTS, HEADS, K] float32, each chunk's sum (if
    BONUS)."""
    slot, head, key_block, used, first, step, count = _chunk_program(
        cu_ptr, state_index_ptr, slot_sequence_ptr, ROWS, C, REVERSE, (K + KEYS - 1) // KEYS,
        BLOCKS_FASTEST)
    # Through the outputs' pairs, summed over V: the scores' gradient.
    d_scores = tl.zeros([C, C], tl.float32)
    for v_block in range((V + BV - 1) // BV):
        v_cols = v_block * BV + tl.arange(0, BV)
        v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
        v = stored(v_ptr + v_base, v_off, v_in)  # (as stored: dot's exact 16-bit products)
        do = stored(do_ptr + v_base, v_off, v_in)
        if HAS_B:
            b, B, b_end, b_kept = _log_gate(b_ptr + v_base, v_off, v_in, True, FLOOR, C, BV)
            d_scores += _value_pairs(do.to(tl.float32), v.to(tl.float32), b, C, LEVELS,
                                     PRECISION)
        else:
            d_scores = dot(do, tl.trans(v), d_scores, PRECISION)
    # The pairs whose factor is e^0 whatever the gates (GLA: i = t; RWKV-6: i = t - 1) are
    # kept out of the gate gradients and added after: their terms in q dq and k dk would
    # cancel only to rounding, which strong gates leave much larger than the gate gradient
    # itself. Only their values ([C]) stay live through the levels.
    t = tl.arange(0, C)
    diagonal = t[:, None] == t[None, :]
    d_diagonal = tl.sum(tl.where(diagonal, d_scores, 0.0), axis=1)
    if BONUS:  # dS[t, t - 1] by row t
        constant = t[:, None] == t[None, :] + 1
        d_constant_rows = tl.sum(tl.where(constant, d_scores, 0.0), axis=1)
        d_scores = tl.where(constant, 0.0, d_scores)
    # (GLA: the pairs i < t leave the diagonal out already)
    # (in_range's masks take steps of BK that tile K exactly as all inside: so must KEYS)
    tl.static_assert(KEYS % BK == 0 and (K % KEYS == 0 or K % BK != 0))
    for key_step in range(KEYS // BK):
        k_cols = key_block * KEYS + key_step * BK + tl.arange(0, BK)
        k_base, k_off, k_in = _tile(first, step, count, head, k_cols, HEADS, K, BK, C)
        # The read of H, summed over V (and on the tame path, which has no levels' tiles to
        # keep out of it, the state's terms too).
        dq = tl.zeros([C, BK], tl.float32)  # (dO e^B) H^T, times e^R below
        if TAME:
            dk_state = tl.zeros([C, BK], tl.float32)
            h_dh = tl.zeros([BK], tl.float32)
        for v_block in range((V + BV - 1) // BV):
            v_base, v_off, v_in, state, block, state_mask = _value_block(
                v_block, slot, head, first, step, count, k_cols, HEADS, K, V, BK, BV, C)
            do = stored(do_ptr + v_base, v_off, v_in)
            h = tl.load(states_ptr + state + block, mask=state_mask & used, other=0.0)
            if TAME:
                dk_state, h_dh = _state_terms(dk_state, h_dh, h, v_ptr + v_base, b_ptr + v_base,
                                              v_off, v_in, dstates_ptr + state, block,
                                              state_mask & used, HAS_B, FLOOR, C, BV, PRECISION)
            if HAS_B:
                b, B, b_end, b_kept = _log_gate(b_ptr + v_base, v_off, v_in, True, FLOOR, C, BV)
                do = do.to(tl.float32) * tl.exp(B)
            dq = dot(do, tl.trans(h), dq, PRECISION)
        q = rows(q_ptr, k_base, k_off, k_in) * scale
        k = rows(k_ptr, k_base, k_off, k_in)
        a, A, _, _ = _log_gate(a_ptr + k_base, k_off, k_in, HAS_A, FLOOR, C, BK)
        if BONUS:
            dq = dq * tl.exp(A - a)
        else:
            dq = dq * tl.exp(A)
        # (A, its total and where the floor applied are formed again after the levels: fewer
        # tiles live through them)
        # Through the scores' pairs i < t (those above left out), as _scores builds them.
        if HAS_A and TAME:  # every pair's factor at once, referenced to the middle row
            row_f, column = _middle_factors(a, A, BONUS, C)
            kept = tl.where(_strictly_lower(C), d_scores, 0.0)
            dq += row_f * dot(kept, k * column, None, PRECISION)
            dk = column * dot(tl.trans(kept), q * row_f, None, PRECISION)
        elif HAS_A:  # level by level
            dk = tl.zeros(k.shape, tl.float32)
            for level in range(LEVELS):
                row_f, row_strict, column, keep = level_factors_at(a, level, LEVELS, C)
                row_f = row_strict if BONUS else row_f
                kept = tl.where(keep, d_scores, 0.0)
                dq += row_f * dot(kept, k * column, None, PRECISION)
                dk += column * dot(tl.trans(kept), q * row_f, None, PRECISION)
        else:
            kept = tl.where(_strictly_lower(C), d_scores, 0.0)
            dq = dot(kept, k, dq, PRECISION)
            dk = dot(tl.trans(kept), q, None, PRECISION)
        # A log gate z of a factor x = y e^z has dz = x dx: dR = q dq and dA = -k dk, summed
        # in reverse over the chunk; RWKV-6's R_t = A_t - a_t takes the sum after t. That
        # exclusive sum is formed directly: an inclusive sum minus the own term would cancel
        # to rounding where that term has a factor near e^0, which swamps a strong gate's
        # gradient (and g_gamma's sum of them).
        if BONUS:
            da = _exclusive_cumsum(q * dq, True) - tl.cumsum(k * dk, axis=0, reverse=True)
        else:
            da = tl.cumsum(q * dq - k * dk, axis=0, reverse=True)
        if BONUS:  # the pairs (t, t - 1), with the rows before and after them loaded shifted
            base, off, mask = _tile(first - step, step, count + 1, head, k_cols, HEADS, K, BK, C)
            dq += d_constant_rows[:, None] * rows(k_ptr, base, off, mask & (t >= 1)[:, None])
            base, off, mask = _tile(first + step, step, count - 1, head, k_cols, HEADS, K, BK, C)
            d_constant_columns = tl.sum(tl.where(constant, d_constant_rows[:, None], 0.0), 0)
            dk += d_constant_columns[:, None] * rows(q_ptr, base, off, mask) * scale
        if not TAME:  # Through the state (after the levels, so that its tiles are not live
            # through them), in a second pass over V.
            dk_state = tl.zeros([C, BK], tl.float32)
            h_dh = tl.zeros([BK], tl.float32)
            for v_block in range((V + BV - 1) // BV):
                v_base, v_off, v_in, state, block, state_mask = _value_block(
                    v_block, slot, head, first, step, count, k_cols, HEADS, K, V, BK, BV, C)
                h = tl.load(states_ptr + state + block, mask=state_mask & used, other=0.0)
                dk_state, h_dh = _state_terms(dk_state, h_dh, h, v_ptr + v_base, b_ptr + v_base,
                                              v_off, v_in, dstates_ptr + state, block,
                                              state_mask & used, HAS_B, FLOOR, C, BV, PRECISION)
        _, A, A_end, a_kept = _log_gate(a_ptr + k_base, k_off, k_in, HAS_A, FLOOR, C, BK)
        dk_state = dk_state * tl.exp(A_end[None, :] - A)
        # k's decay to the end, A_C - A_i = a_{i+1} + ...: the sum before i, exclusive as above.
        da += _exclusive_cumsum(k * dk_state, False) + (tl.exp(A_end) * h_dh)[None, :]
        dk += dk_state
        if BONUS:
            u = tl.load(u_ptr + head * K + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
            d_bonus = d_diagonal[:, None] * u[None, :]
            dq += d_bonus * k
            dk += d_bonus * q
            du_off = (slot.to(tl.int64) * HEADS + head) * K + k_cols
            tl.store(du_ptr + du_off, tl.sum(d_diagonal[:, None] * q * k, axis=0),
                     mask=k_cols < K)
        else:
            dq += d_diagonal[:, None] * k
            dk += d_diagonal[:, None] * q
        tl.store(dq_ptr + k_base + k_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=k_in)
        tl.store(dk_ptr + k_base + k_off, dk.to(dk_ptr.dtype.element_ty), mask=k_in)
        if HAS_A:
            tl.store(da_ptr + k_base + k_off, tl.where(a_kept, da, 0.0), mask=k_in)


@triton.jit
def gla_value_gradient_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, u_ptr, do_ptr, states_ptr, dstates_ptr,
    cu_ptr, state_index_ptr, slot_sequence_ptr,                # inputs
    dv_ptr, db_ptr,                                            # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr,
    ROWS: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr, BONUS: tl.constexpr,
    REVERSE: tl.constexpr, FLOOR: tl.constexpr, PRECISION: tl.constexpr, TAME: tl.constexpr,
    BLOCKS_FASTEST: tl.constexpr,
):
    """Grid (SLOTS, HEADS, V blocks; ``_program_ids``): every V-side gradient of one chunk's
    block of BV values, the sums over K (the scores, k's part of dv through the state, the read
    of H) in blocks of BK first. dv [rows, HEADS, V]; db [rows, HEADS, V] float32 (if HAS_B)."""
    slot, head, v_block, used, first, step, count = _chunk_program(
        cu_ptr, state_index_ptr, slot_sequence_ptr, ROWS, C, REVERSE, (V + BV - 1) // BV,
        BLOCKS_FASTEST)
    v_cols = v_block * BV + tl.arange(0, BV)
    v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
    scores = tl.zeros([C, C], tl.float32)
    dv_state = tl.zeros([C, BV], tl.float32)  # (k e^{A_C - A}) dH, times e^{B_C - B} below
    o_state = tl.zeros([C, BV], tl.float32)   # (q e^R) H, times e^B below (if HAS_B)
    h_dh = tl.zeros([BV], tl.float32)         # sum_k e^{A_C} H dH, times e^{B_C} below
    for k_block in range((K + BK - 1) // BK):
        k_cols = k_block * BK + tl.arange(0, BK)
        k_base, k_off, k_in = _tile(first, step, count, head, k_cols, HEADS, K, BK, C)
        q = rows(q_ptr, k_base, k_off, k_in) * scale
        k = rows(k_ptr, k_base, k_off, k_in)
        a, A, A_end, a_kept = _log_gate(a_ptr + k_base, k_off, k_in, HAS_A, FLOOR, C, BK)
        if BONUS:
            u = tl.load(u_ptr + head * K + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
        else:
            u = tl.zeros([BK], tl.float32)  # unused
        scores += _scores_diagonal(q, k, u, BONUS, C)
        if HAS_A and TAME:  # every pair's factor at once, referenced to the middle row
            row_f, column = _middle_factors(a, A, BONUS, C)
            scores += tl.where(_strictly_lower(C),
                               dot(q * row_f, tl.trans(k * column), None, PRECISION), 0.0)
        elif HAS_A:  # _scores' levels, one at a time
            for level in range(LEVELS):
                row_f, row_strict, column, keep = level_factors_at(a, level, LEVELS, C)
                q_f = q * row_strict if BONUS else q * row_f
                scores += tl.where(keep, dot(q_f, tl.trans(k * column), None, PRECISION), 0.0)
        else:
            scores += tl.where(_strictly_lower(C),
                               dot(q, tl.trans(k), None, PRECISION), 0.0)
        state, block, state_mask = _state_tile(slot, head, k_cols, v_cols, HEADS, K, V, BK, BV)
        dh = tl.load(dstates_ptr + state + block, mask=state_mask & used, other=0.0)
        dv_state = dot(k * tl.exp(A_end[None, :] - A), dh, dv_state, PRECISION)
        if HAS_B:
            h = tl.load(states_ptr + state + block, mask=state_mask & used, other=0.0)
            R = A - a if BONUS else A
            o_state = dot(q * tl.exp(R), h, o_state, PRECISION)
            h_dh += tl.sum(tl.exp(A_end)[:, None] * h.to(tl.float32) * dh.to(tl.float32), axis=0)
    v = rows(v_ptr, v_base, v_off, v_in)
    do = rows(do_ptr, v_base, v_off, v_in)
    if HAS_B:
        b, B, B_end, b_kept = _log_gate(b_ptr + v_base, v_off, v_in, True, FLOOR, C, BV)
        # The diagonal's factor is e^0: kept out of o and dv here, and so out of dB (its terms
        # there cancel exactly).
        mixed, dv = _value_mixes(scores, do, v, b, C, LEVELS, PRECISION)
        o = o_state * tl.exp(B) + mixed
        dv_state = dv_state * tl.exp(B_end[None, :] - B)
        db = (tl.cumsum(do * o - v * dv, axis=0, reverse=True)
              + _exclusive_cumsum(v * dv_state, False) + (tl.exp(B_end) * h_dh)[None, :])
        tl.store(db_ptr + v_base + v_off, tl.where(b_kept, db, 0.0), mask=v_in)
        t = tl.arange(0, C)
        diagonal = t[:, None] == t[None, :]
        dv += dv_state + tl.sum(tl.where(diagonal, scores, 0.0), axis=1)[:, None] * do
    else:
        dv = dot(tl.trans(scores), do, dv_state, PRECISION)
    tl.store(dv_ptr + v_base + v_off, dv.to(dv_ptr.dtype.element_ty), mask=v_in)

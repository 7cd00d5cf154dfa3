"""The 64-token backward's K side: the gradients of the in-chunk matrices and of r, w, k, a, b."""

import triton
import triton.language as tl

from ..common import (chunk_tiles, dot, level_factors_at, row_bases, rows, stored)
from .chunks import (_one_chunk, _state, _wy_matrix, _wy_load, _wy_chunk_rows, _wy_log_decay_sums,
                     WY_A_QK, WY_A_QB, WY_A_AK)


# Kernel 6, the K-side gradients (parallel, per chunk, head and block of BK keys, over all of V
# inside the program): with dX (kernel 5), dH' (kernel 4) and the forward's H and U,
#   dA_qk = tril(dO V^T), dA_qb = tril(dO U^T), dA_ak = strict(dX V^T), dA_ab = strict(dX U^T),
#   dq = e^gi dO H^T + rows of A_qk, A_qb;     da = e^ge dX H^T + rows of A_ak, A_ab;
#   dk = e^(g - gi) V dH'^T + columns of A_qk, A_ak;  db likewise with U, A_qb, A_ab;
#   dw = reverse_cumsum(q dq - k dk - b db + a da) - a da + dg,
#   dg = e^g rowsum(H dH') + sum_t (k^ dk^ + b^ db^)_t  (per K channel, within the chunk).

# The dA buffer [chunk slots, HEADS, 4, C, C] of ``rwkv7_wy_matrix_gradient_kernel``: the gradients
# of A_qk, A_qb, A_ak (WY_A_QK, ... as in the forward's matrices) and A_ab in T's place, each
# strictly lower triangular; the diagonals of A_qk's and A_qb's in their own buffer
# [chunk slots, HEADS, 2, C] (float32).
WY_DA_AB = tl.constexpr(3)


@triton.jit
def _wy_diagonal(diagonal_ptr, slot, head, WHICH: tl.constexpr, HEADS: tl.constexpr,
                 C: tl.constexpr):
    """Pointers to the diagonal of A_qk's (WY_A_QK) or A_qb's (WY_A_QB) gradient in the
    diagonal buffer, [C]."""
    return diagonal_ptr + ((slot.to(tl.int64) * HEADS + head) * 2 + WHICH) * C + tl.arange(0, C)


@triton.jit
def _wy_diagonal_gradient(diagonal_ptr, slot, used, head, WHICH: tl.constexpr,
                          HEADS: tl.constexpr, C: tl.constexpr):
    """The diagonal of A_qk's (WY_A_QK) or A_qb's (WY_A_QB) gradient from the diagonal buffer,
    as a column [C, 1]."""
    return tl.load(_wy_diagonal(diagonal_ptr, slot, head, WHICH, HEADS, C), mask=used,
                   other=0.0)[:, None]


@triton.jit
def rwkv7_wy_matrix_gradient_kernel(
    v_ptr, u_ptr, do_ptr, dx_ptr, cu_ptr, chunk_index_ptr, chunk_sequence_ptr,  # inputs
    dA_ptr, diagonal_ptr,                                                        # outputs
    HEADS: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (chunk slots, HEADS): the gradients of a chunk's four A matrices, summed over all of
    V (blocks of BV) once per chunk rather than once per block of keys in the K-side kernel:
    dA_qk = tril(dO V^T), dA_qb = tril(dO U^T), dA_ak = strict(dX V^T), dA_ab = strict(dX U^T).
    Their pairs i < t are stored in dA [chunk slots, HEADS, 4, C, C] (WY_A_QK, WY_A_QB,
    WY_A_AK, WY_DA_AB) in its dtype, zeros elsewhere, so that the K-side kernel multiplies
    them as loaded; the diagonals of dA_qk and dA_qb in diagonal [chunk slots, HEADS, 2, C]
    (float32). An unused slot reads and writes nothing (its rows are all masked)."""
    slot, head, used, first, steps, rows_in = _wy_chunk_rows(
        cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C, TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    v_base = (first * HEADS + head) * V
    # (one pass over V for all four: each tile of dO, dX, V, U read once)
    dA_qk = tl.zeros([C, C], tl.float32)
    dA_qb = tl.zeros([C, C], tl.float32)
    dA_ak = tl.zeros([C, C], tl.float32)
    dA_ab = tl.zeros([C, C], tl.float32)
    for v_block in range((V + BV - 1) // BV):
        v_cols = v_block * BV + tl.arange(0, BV)
        v_in = rows_in & (v_cols < V)[None, :]
        v_tile = steps[:, None] * (HEADS * V) + v_cols[None, :]
        do = stored(do_ptr + v_base, v_tile, v_in)
        dx = stored(dx_ptr + v_base, v_tile, v_in)
        v = tl.trans(stored(v_ptr + v_base, v_tile, v_in))
        u = tl.trans(stored(u_ptr + v_base, v_tile, v_in))
        dA_qk = dot(do, v, dA_qk, PRECISION)
        dA_qb = dot(do, u, dA_qb, PRECISION)
        dA_ak = dot(dx, v, dA_ak, PRECISION)
        dA_ab = dot(dx, u, dA_ab, PRECISION)
    strict = steps[:, None] > steps[None, :]
    diagonal = steps[:, None] == steps[None, :]
    out = dA_ptr.dtype.element_ty
    tl.store(_wy_diagonal(diagonal_ptr, slot, head, WY_A_QK, HEADS, C),
             tl.sum(tl.where(diagonal, dA_qk, 0.0), axis=1), mask=used)
    tl.store(_wy_diagonal(diagonal_ptr, slot, head, WY_A_QB, HEADS, C),
             tl.sum(tl.where(diagonal, dA_qb, 0.0), axis=1), mask=used)
    tl.store(_wy_matrix(dA_ptr, slot, head, WY_A_QK, HEADS, C, False),
             tl.where(strict, dA_qk, 0.0).to(out), mask=used)
    tl.store(_wy_matrix(dA_ptr, slot, head, WY_A_QB, HEADS, C, False),
             tl.where(strict, dA_qb, 0.0).to(out), mask=used)
    tl.store(_wy_matrix(dA_ptr, slot, head, WY_A_AK, HEADS, C, False),
             tl.where(strict, dA_ak, 0.0).to(out), mask=used)
    tl.store(_wy_matrix(dA_ptr, slot, head, WY_DA_AB, HEADS, C, False),
             tl.where(strict, dA_ab, 0.0).to(out), mask=used)


@triton.jit
def _stored_dot(x, y, acc, PRECISION: tl.constexpr):
    """x @ y (+ acc) of tiles as stored: inputs in their dtype, residuals (H, dH', U, dX) in
    theirs, float32 or bfloat16. For 16-bit inputs (PRECISION not "tf32x3") a float32 tile met
    by a bfloat16 one is rounded to bfloat16, so that the product takes 16-bit operands (a
    bfloat16 residual's precision; float32's exponent range: a state cannot overflow as it
    could in float16). Float32 inputs keep float32's precision (``dot``)."""
    if PRECISION != "tf32x3" and x.dtype == tl.bfloat16 and y.dtype == tl.float32:
        y = y.to(tl.bfloat16)
    if PRECISION != "tf32x3" and y.dtype == tl.bfloat16 and x.dtype == tl.float32:
        x = x.to(tl.bfloat16)
    return dot(x, y, acc, PRECISION)


@triton.jit
def _wy_state_products(do_ptr, dx_ptr, v_ptr, u_ptr, states_ptr, dstates_ptr, slot, used, first,
                       end, head, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                       PRECISION: tl.constexpr):
    """The K-side kernel's products with the chunk's states, in one pass over V (blocks of BV),
    each tile of H and dH' read once: dO H^T and dX H^T (the reads q~ H, a~ H), V dH'^T and
    U dH'^T (k^, b^ in H'), [C, BK] each, and rowsum(H dH') ([BK]; e^g H in H')."""
    dq = tl.zeros([C, BK], tl.float32)
    da = tl.zeros([C, BK], tl.float32)
    dk = tl.zeros([C, BK], tl.float32)
    db = tl.zeros([C, BK], tl.float32)
    h_dh = tl.zeros([BK], tl.float32)
    for v_block in range((V + BV - 1) // BV):
        v_cols = v_block * BV + tl.arange(0, BV)
        _, k_cols_in, v_tile, v_cols_in = chunk_tiles(v_cols, HEADS, K, V, BK, BV, C, False)
        _, _, v_base, v_in = row_bases(first, end, head, k_cols_in, v_cols_in, HEADS, K, V, C,
                                       False)
        state_in = (tl.trans(k_cols_in) & v_cols_in) & used
        h = tl.trans(tl.load(_state(states_ptr, slot, head, HEADS, K, V, BK, v_cols),
                             mask=state_in, other=0.0))
        dh = tl.trans(tl.load(_state(dstates_ptr, slot, head, HEADS, K, V, BK, v_cols),
                              mask=state_in, other=0.0))
        dq = _stored_dot(stored(do_ptr + v_base, v_tile, v_in), h, dq, PRECISION)
        da = _stored_dot(stored(dx_ptr + v_base, v_tile, v_in), h, da, PRECISION)
        dk = _stored_dot(stored(v_ptr + v_base, v_tile, v_in), dh, dk, PRECISION)
        db = _stored_dot(stored(u_ptr + v_base, v_tile, v_in), dh, db, PRECISION)
        h_dh += tl.sum(h.to(tl.float32) * dh.to(tl.float32), axis=0)
    return dq, da, dk, db, h_dh


@triton.jit
def _gradient_dot(dA, x, PRECISION: tl.constexpr):
    """dA @ x for an A matrix's gradient as loaded from the dA buffer and a float32 tile x
    (rows or columns times their factors). Against a 16-bit dA, x in two 16-bit parts,
    its rounding and the remainder, so that both products take 16-bit operands and x keeps
    about 16 bits (x rounded once to bfloat16 doubles dw's error: past the bfloat16 contract
    in the tests' packed case). A float32 dA (float32 inputs): at PRECISION."""
    if dA.dtype == tl.float32:
        product = dot(dA, x, None, PRECISION)
    else:
        high = x.to(dA.dtype)
        product = dot(dA, high, dot(dA, (x - high.to(tl.float32)).to(dA.dtype), None,
                                    PRECISION), PRECISION)
    return product


@triton.jit
def _wy_pair_gradient(x, y, w, centered, dA, dx, dy, STRICT: tl.constexpr,
                      TAME: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr,
                      PRECISION: tl.constexpr):
    """The backward of one of ``_wy_pairs``' matrices, A_xy (x = q, or a if STRICT; y = k or
    b), for its pairs i < t (the diagonal's factor is e^0: the caller's): their terms added to
    dx (rows) and dy (columns) from dA, its gradient in the dA buffer as loaded (strictly lower
    triangular). TAME: the forward's factors, referenced to the chunk's middle row (``centered``
    = gi - m, ``_wy_log_decay_sums``), one product each, dA and its transpose multiplied as
    loaded (no [C, C] tile changed in registers: the compiler keeps dA in shared memory and
    transposes it there); else (``centered`` not read) level by level over the chunk
    (``level_factors_at``: one level's tiles live at a time, every factor <= 1, exact for
    every decay; the forward's exact path splits the same pairs' factors by 16-token blocks
    instead), each level's pairs masked in registers."""
    if TAME:
        if STRICT:
            row = tl.exp(centered - w)
        else:
            row = tl.exp(centered)
        column = tl.exp(-centered)
        dx += row * _gradient_dot(dA, y * column, PRECISION)
        dy += column * _gradient_dot(tl.trans(dA), x * row, PRECISION)
    else:
        for level in range(LEVELS):
            row, row_strict, column, keep = level_factors_at(w, level, LEVELS, C)
            if STRICT:
                row = row_strict
            kept = tl.where(keep, dA, 0.0)
            dx += row * _gradient_dot(kept, y * column, PRECISION)
            dy += column * _gradient_dot(tl.trans(kept), x * row, PRECISION)
    return dx, dy


@triton.jit
def rwkv7_wy_key_gradient_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, u_ptr, dx_ptr, states_ptr, dstates_ptr,
    dA_ptr, diagonal_ptr, cu_ptr, chunk_index_ptr, chunk_sequence_ptr,           # inputs
    dr_ptr, dw_ptr, dk_ptr, da_ptr, db_ptr,                                      # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr,
    FLOOR: tl.constexpr, TAME: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (chunk slots * ceil(K / BK), HEADS): every K-side gradient of one chunk's block of
    BK keys (BK divides K, or one block covers it), summed over all of V in blocks of BV inside
    the program, so that nothing is left for a later sum. dr, dw, dk, da, db [rows, HEADS, K]
    in their dtypes; u: the forward's U, states its H at every chunk's start, dstates dH'
    (kernel 4), dx (kernel 5), float32 or bfloat16 (``_stored_dot``), in the chunk's slot; dA
    and diagonal the A matrices' gradients (``rwkv7_wy_matrix_gradient_kernel``).

    First the four state products in one pass over V (``_wy_state_products``), then the A
    matrices one at a time (``_wy_pair_gradient``, their gradients loaded as dot operands):
    A_qk, A_ak (dk then done), A_qb (dq done), A_ab (da, db done). The diagonal of A_qk and
    A_qb (factor e^0, its own buffer) is added to dq, dk, db outside dw: its terms in
    q dq - k dk - b db cancel exactly, and would leave rounding where strong decays make dw
    small. A log decay raised to FLOOR has dw 0. Rows past the sequence's end read as zeros
    (w = 0) and are not written; an unused slot reads and writes nothing."""
    # (a chunk's blocks of keys are consecutive programs: they run together and share its
    # V-side tiles and dA in L2)
    KEY_BLOCKS: tl.constexpr = (K + BK - 1) // BK
    slot = tl.program_id(0) // KEY_BLOCKS
    k_first = tl.program_id(0) % KEY_BLOCKS * BK
    head = tl.program_id(1)
    used, first, end = _one_chunk(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C,
                                  TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    k_tile, k_cols_in, _, v_cols_in = chunk_tiles(tl.arange(0, BV), HEADS, K, V, BK, BV, C, False)
    k_base, k_in, _, _ = row_bases(first, end, head, k_cols_in, v_cols_in, HEADS, K, V, C,
                                   False)
    k_base += k_first
    offsets = k_base + k_tile
    states_ptr += k_first * V  # (the program's K rows of the [K, V] states)
    dstates_ptr += k_first * V
    dq, da, dk, db, h_dh = _wy_state_products(do_ptr, dx_ptr, v_ptr, u_ptr, states_ptr,
                                              dstates_ptr, slot, used, first, end, head, HEADS,
                                              K, V, BK, BV, C, PRECISION)
    # (The decays' sums as products for bfloat16 w, ``_wy_log_decay_sums``, and the K-side
    # tiles loaded once: each scan, reduction or reload is a trip through shared memory. sm_90,
    # K=128, 4 warps, tame: 57 -> 41 barriers, 3264 -> 2752 SASS instructions.)
    w, gi, to_end = _wy_log_decay_sums(w_ptr, k_base, k_tile, k_in, FLOOR, C, False)
    if TAME:
        _, centered, _ = _wy_log_decay_sums(w_ptr, k_base, k_tile, k_in, FLOOR, C, True)
    else:
        centered = w  # (not read)
    q = rows(r_ptr, k_base, k_tile, k_in) * scale
    k = rows(k_ptr, k_base, k_tile, k_in)
    a = rows(a_ptr, k_base, k_tile, k_in)
    b = rows(b_ptr, k_base, k_tile, k_in)
    dq *= tl.exp(gi)
    da *= tl.exp(gi - w)
    dk *= tl.exp(to_end)
    db *= tl.exp(to_end)
    # (dg per row: e^g = e^(gi + (g - gi)) in every row)
    dg = tl.exp(gi + to_end) * h_dh[None, :] + tl.sum(k * dk + b * db, axis=0)[None, :]
    # A_qk (O = q~ H + A_qk V + A_qb U) and A_ak (X = a~ H + A_ak V): dk then done.
    dq, dk = _wy_pair_gradient(q, k, w, centered,
                               _wy_load(dA_ptr, slot, used, head, WY_A_QK, HEADS, C, False),
                               dq, dk, False, TAME, C, LEVELS, PRECISION)
    da, dk = _wy_pair_gradient(a, k, w, centered,
                               _wy_load(dA_ptr, slot, used, head, WY_A_AK, HEADS, C, False),
                               da, dk, True, TAME, C, LEVELS, PRECISION)
    # (q_t enters a chunk only as q_t e^gi_t, a_t as a_t e^ge_t, k_i and b_i as x_i e^-gi_i
    # and (k^, b^) x_i e^(g - gi_i), and H as e^g H: gi_t = w_1 + ... + w_t, ge_t = gi_t - w_t;
    # d_gates sums the gradients of gi (q dq - k dk - b db) and ge (a da).)
    d_gates = -k * dk
    d_qk = _wy_diagonal_gradient(diagonal_ptr, slot, used, head, WY_A_QK, HEADS, C)
    tl.store(dk_ptr + offsets, (dk + d_qk * q).to(dk_ptr.dtype.element_ty), mask=k_in)
    # A_qb: dq then done.
    dq, db = _wy_pair_gradient(q, b, w, centered,
                               _wy_load(dA_ptr, slot, used, head, WY_A_QB, HEADS, C, False),
                               dq, db, False, TAME, C, LEVELS, PRECISION)
    d_gates += q * dq
    d_qb = _wy_diagonal_gradient(diagonal_ptr, slot, used, head, WY_A_QB, HEADS, C)
    dq += d_qk * k + d_qb * b
    tl.store(dr_ptr + offsets, (dq * scale).to(dr_ptr.dtype.element_ty), mask=k_in)
    # A_ab: da, db done.
    da, db = _wy_pair_gradient(a, b, w, centered,
                               _wy_load(dA_ptr, slot, used, head, WY_DA_AB, HEADS, C, False),
                               da, db, True, TAME, C, LEVELS, PRECISION)
    tl.store(da_ptr + offsets, da.to(da_ptr.dtype.element_ty), mask=k_in)
    tl.store(db_ptr + offsets, (db + d_qb * q).to(db_ptr.dtype.element_ty), mask=k_in)
    d_ge = a * da
    dw = tl.cumsum(d_gates - b * db + d_ge, axis=0, reverse=True) - d_ge + dg
    if not TAME:  # (a tame call has no decay below FLOOR)
        dw = tl.where(rows(w_ptr, k_base, k_tile, k_in) < FLOOR, 0.0, dw)
    tl.store(dw_ptr + offsets, dw.to(dw_ptr.dtype.element_ty), mask=k_in)

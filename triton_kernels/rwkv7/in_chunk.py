"""Phase 1 of the 64-token kernels: every chunk's in-chunk matrices in the WY form, all at once
(``rwkv7_wy_kernel``)."""

import triton
import triton.language as tl

from ..common import (dot, in_range, level_factors as _level, rows)
from .chunks import (_inverse_unit_lower, _log_decays, _one_chunk, _wy_matrix, _wy_load,
                     _wy_store, _k_part, _wy_log_decay_sums, _wy_decay, WY_A_QK, WY_A_QB, WY_A_AK,
                     WY_T)


@triton.jit
def _wy_pairs(x_ptr, y_ptr, z_ptr, w_ptr, base, rows_in, x_scale, STRICT: tl.constexpr,
              TAME: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
              KI: tl.constexpr, C: tl.constexpr, BLOCK_LEVELS: tl.constexpr,
              FLOOR: tl.constexpr, PRECISION: tl.constexpr):
    """Two [C, C] in-chunk matrices summed over K (KI columns at a time), xy and xz, from the
    chunk's rows of x (times x_scale), y, z and w: sum_k x_t y_i and x_t z_i times
    e^(gi_t - gi_i) for i <= t (A_qk, A_qb: x = q), or times e^(ge_t - gi_i) for i < t if STRICT
    (A_ak, A_ab: x = a). Each mask is applied once, to products already summed over K (masks
    of [C, C] held across the unrolled K parts cost hundreds of spilled bytes).

    TAME: one product each, factors referenced to the chunk's middle row (``_middle``; at
    C = 64 within e^(+-32) for log decays >= -1, and each kept pair's term is still its own
    factor <= 1; their exponents gi_t - m by one exact product for bf16 decays,
    ``_wy_log_decay_sums``). Operands stay float32 (tf32): the factored tiles rounded to bf16
    more than doubled the output's error against float64. Else exact for every decay, in blocks of
    BLOCK = 2^BLOCK_LEVELS rows (the plan's 16-token blocks): row block J meets the columns of
    every earlier block with the factor split at J's start s, e^(gi_t - gi_s) * e^(gi_s - gi_i),
    each <= 1 and each a sum of log decays (J's own inclusive sums; the reverse sums of i's block
    plus the totals of the blocks between), in one product per row block whose operands are zero
    outside its rows and columns (so it adds into the sums with no mask); then the diagonal blocks
    level by level inside them (``_level``, one mask per level)."""
    index = tl.arange(0, C)
    xy = tl.zeros([C, C], tl.float32)
    xz = tl.zeros([C, C], tl.float32)
    if TAME:
        for part in tl.static_range((K + KI - 1) // KI):
            part_base, tile, mask = _k_part(part, base, rows_in, index, HEADS, K, KI)
            w, relative, _ = _wy_log_decay_sums(w_ptr, part_base, tile, mask, FLOOR, C, True)
            x_f = rows(x_ptr, part_base, tile, mask) * x_scale
            if STRICT:
                x_f = x_f * tl.exp(relative - w)
            else:
                x_f = x_f * tl.exp(relative)
            column = tl.exp(-relative)
            xy = tl.dot(x_f, tl.trans(rows(y_ptr, part_base, tile, mask) * column), xy,
                        input_precision=PRECISION)
            xz = tl.dot(x_f, tl.trans(rows(z_ptr, part_base, tile, mask) * column), xz,
                        input_precision=PRECISION)
        # tl.where, not a multiplication: the entries dropped (i > t) are no factors of the math
        # and may be large (up to e^64).
        if STRICT:
            keep = index[:, None] > index[None, :]
        else:
            keep = index[:, None] >= index[None, :]
        xy = tl.where(keep, xy, 0.0)
        xz = tl.where(keep, xz, 0.0)
    else:
        BLOCK: tl.constexpr = 1 << BLOCK_LEVELS
        BLOCKS: tl.constexpr = C // BLOCK
        block = index // BLOCK
        # The diagonal blocks' sums, [BLOCKS, BLOCK, BLOCK]: batched products, one per block
        # (a quarter of the arithmetic of whole [C, C] tiles, and masks of BLOCK x BLOCK).
        inner = tl.arange(0, BLOCK)
        on_y = tl.zeros([BLOCKS, BLOCK, BLOCK], tl.float32)
        on_z = tl.zeros([BLOCKS, BLOCK, BLOCK], tl.float32)
        for part in tl.static_range((K + KI - 1) // KI):
            part_base, tile, mask = _k_part(part, base, rows_in, index, HEADS, K, KI)
            w = _log_decays(w_ptr, part_base, tile, mask, FLOOR)
            x = rows(x_ptr, part_base, tile, mask) * x_scale
            y = rows(y_ptr, part_base, tile, mask)
            z = rows(z_ptr, part_base, tile, mask)
            # Inclusive and reverse exclusive sums inside each block, every one <= 0.
            blocks = tl.reshape(w, [BLOCKS, BLOCK, KI])
            inclusive = tl.reshape(tl.cumsum(blocks, axis=1), w.shape)
            after = tl.reshape(tl.cumsum(blocks, axis=1, reverse=True), w.shape) - w
            if STRICT:
                x_f = x * tl.exp(inclusive - w)
            else:
                x_f = x * tl.exp(inclusive)
            # column exponents gi_s - gi_i of row block J (s its start), for the columns of
            # blocks before J: those of block J - 1 its reverse sums, earlier ones' plus its total
            column = after
            for J in tl.static_range(1, BLOCKS):
                factor = tl.where((block < J)[:, None], tl.exp(column), 0.0)
                x_J = tl.where((block == J)[:, None], x_f, 0.0)
                xy = tl.dot(x_J, tl.trans(y * factor), xy, input_precision=PRECISION)
                xz = tl.dot(x_J, tl.trans(z * factor), xz, input_precision=PRECISION)
                if J + 1 < BLOCKS:
                    total = tl.sum(tl.where((index == J * BLOCK + BLOCK - 1)[:, None],
                                            inclusive, 0.0), axis=0)
                    column = tl.where((block < J)[:, None], column + total[None, :], after)
            if not STRICT:  # the diagonal, factor e^0
                eye = (inner[:, None] == inner[None, :])[None, :, :]
                diagonal_y = tl.reshape(tl.sum(x * y, axis=1), [BLOCKS, BLOCK])
                diagonal_z = tl.reshape(tl.sum(x * z, axis=1), [BLOCKS, BLOCK])
                on_y += tl.where(eye, diagonal_y[:, :, None], 0.0)
                on_z += tl.where(eye, diagonal_z[:, :, None], 0.0)
            for level in tl.static_range(BLOCK_LEVELS):
                row, row_strict, column, _ = _level(w, BLOCK >> (level + 1), 0, C)
                if STRICT:
                    x_f = x * row_strict
                else:
                    x_f = x * row
                segment = inner // (BLOCK >> (level + 1))
                keep = ((segment[:, None] == segment[None, :] + 1)
                        & (segment[None, :] % 2 == 0))[None, :, :]
                x_f = tl.reshape(x_f, [BLOCKS, BLOCK, KI])
                on_y += tl.where(keep, tl.dot(x_f, tl.permute(
                    tl.reshape(y * column, [BLOCKS, BLOCK, KI]), (0, 2, 1)),
                    input_precision=PRECISION), 0.0)
                on_z += tl.where(keep, tl.dot(x_f, tl.permute(
                    tl.reshape(z * column, [BLOCKS, BLOCK, KI]), (0, 2, 1)),
                    input_precision=PRECISION), 0.0)
        # the diagonal blocks into the [C, C] sums
        blocks = tl.arange(0, BLOCKS)
        same = (blocks[:, None, None, None] == blocks[None, None, :, None])
        xy += tl.reshape(tl.where(same, on_y[:, :, None, :], 0.0), [C, C])
        xz += tl.reshape(tl.where(same, on_z[:, :, None, :], 0.0), [C, C])
    return xy, xz


@triton.jit
def _wy_inverse(lower, C: tl.constexpr, LEVELS: tl.constexpr, BLOCK_LEVELS: tl.constexpr,
                PRECISION: tl.constexpr):
    """T = (I - lower)^-1 for a strictly lower-triangular [C, C] tile (C = 2^LEVELS),
    blockwise (the plan's form): with D the diagonal BLOCK x BLOCK blocks
    (BLOCK = 2^BLOCK_LEVELS) of lower and R the rest,
    I - D - R = (I - D)(I - T_D R), so T = (I - M)^-1 T_D with T_D = (I - D)^-1 and M = T_D R.
    T_D on the blocks alone, as a batch of [C/BLOCK, BLOCK, BLOCK] tiles (``_inverse_unit_lower``,
    repeated squaring inside a block: D^BLOCK = 0; six batched products, a sixteenth of the
    arithmetic of whole [C, C] tiles); M is strictly lower by blocks, M^(C/BLOCK) = 0, so
    (I - M)^-1 = (I + M)(I + M^2)...: at C = 64, BLOCK = 16, T = (I + M)(I + M^2) T_D, the
    terms of the plan's T[J,I] = T[J,J] sum_M A_ab[J,M] T[M,I] (its four-block substitution
    expanded), four [C, C] products.

    Not repeated squaring over all 64 rows, (I + L)(I + L^2)...(I + L^32): that sums chains of
    up to 63 factors of A_ab, whose terms grow like binomials (up to C(62, 31) ~ 5e17 times
    |A_ab|^31) while T itself stays small (|T| <= 1 for the model's a = -kk, b = kk * iclr), so
    float32 loses every digit where consecutive keys are correlated (tests/
    test_triton_rwkv7_chunk64.py's correlated keys), where blockwise keeps them. Blockwise, the
    chains are at most 15 factors inside a block (as the 16-token kernels' inverse) and 3 between
    blocks, each between inverses that are themselves small.
    The blocks come out of and go back into the [C, C] tile by a reshape to
    [C/BLOCK, BLOCK, C/BLOCK, BLOCK] and a mask of its two block indices (no slicing of register
    tiles)."""
    BLOCK: tl.constexpr = 1 << BLOCK_LEVELS
    BLOCKS: tl.constexpr = C // BLOCK
    index = tl.arange(0, C)
    blocks = tl.arange(0, BLOCKS)
    same = (blocks[:, None, None, None] == blocks[None, None, :, None])  # [J, ., I, .]: J = I
    diagonal = tl.sum(tl.where(same, tl.reshape(lower, [BLOCKS, BLOCK, BLOCKS, BLOCK]), 0.0),
                      axis=2)
    inverse = tl.reshape(tl.where(same, _inverse_unit_lower(diagonal, BLOCK, PRECISION)[
        :, :, None, :], 0.0), [C, C])
    same_block = (index[:, None] >> BLOCK_LEVELS) == (index[None, :] >> BLOCK_LEVELS)
    # (I + M^2)(I + M) T_D as Y = T_D + M T_D, then Y + M^2 Y: each (I + P) X as the
    # product's accumulator X plus P X (no identity tiles)
    power = tl.dot(inverse, tl.where(same_block, 0.0, lower), input_precision=PRECISION)
    inverse = tl.dot(power, inverse, inverse, input_precision=PRECISION)
    for _ in tl.static_range(LEVELS - BLOCK_LEVELS - 1):  # C = 4 BLOCK: M^2
        power = tl.dot(power, power, input_precision=PRECISION)
        inverse = tl.dot(power, inverse, inverse, input_precision=PRECISION)
    return inverse


@triton.jit
def _wy_transform(a_ptr, k_ptr, b_ptr, w_ptr, v_ptr, wy_ptr, u0_ptr, matrices_ptr, slot, head,
                  used, steps, rows_in, k_base, v_base, HEADS: tl.constexpr, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KI: tl.constexpr,
                  VI: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr, FLOOR: tl.constexpr,
                  TAME: tl.constexpr, PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr,
                  BLOCK_LEVELS: tl.constexpr, RESIDUALS: tl.constexpr):
    """A chunk's WY transform: A_ak and A_ab, T = (I - A_ab)^-1, W = T a~ and U0 = T A_ak V;
    stores A_ak, W, U0 and, for the backward (RESIDUALS), T. A_ak goes to memory before the
    inverse and comes back after W (T A_ak, then U0 per VI columns of V): at most two [C, C]
    tiles beside the inverse's."""
    A_ak, A_ab = _wy_pairs(a_ptr, k_ptr, b_ptr, w_ptr, k_base, rows_in, 1.0, True, TAME, HEADS,
                           K, BK, KI, C, BLOCK_LEVELS, FLOOR, PRECISION)
    _wy_store(_wy_matrix(matrices_ptr, slot, head, WY_A_AK, HEADS, C, False), 0, A_ak, used)
    inverse = _wy_inverse(A_ab, C, LEVELS, BLOCK_LEVELS, INVERSE_PRECISION)
    if RESIDUALS:
        _wy_store(_wy_matrix(matrices_ptr, slot, head, WY_T, HEADS, C, False), 0, inverse, used)
    # W = T a~, a~ = a e^ge (per K column: ge is a cumulative sum down the chunk, <= 0).
    for part in tl.static_range((K + KI - 1) // KI):
        part_base, k_tile, k_in = _k_part(part, k_base, rows_in, steps, HEADS, K, KI)
        w, gi, _ = _wy_log_decay_sums(w_ptr, part_base, k_tile, k_in, FLOOR, C, False)
        decayed = rows(a_ptr, part_base, k_tile, k_in) * tl.exp(gi - w)
        _wy_store(wy_ptr + part_base, k_tile, tl.dot(inverse, decayed, input_precision=PRECISION),
                  k_in)
    # U0 = T (A_ak V) = (T A_ak) V: one [C, C] product, then one per part of V. A_ak read back
    # as this program stored it (float32: exact) once all its threads have.
    tl.debug_barrier()
    inverse_ak = tl.dot(inverse, _wy_load(matrices_ptr, slot, used, head, WY_A_AK, HEADS, C,
                                          False), input_precision=INVERSE_PRECISION)
    for part in tl.static_range(BV // VI):
        v_cols = part * VI + tl.arange(0, VI)
        v_in = rows_in & (v_cols < V)[None, :]
        v_tile = steps[:, None] * (HEADS * V) + v_cols[None, :]
        u0 = tl.dot(inverse_ak, rows(v_ptr, v_base, v_tile, v_in), input_precision=PRECISION)
        _wy_store(u0_ptr + v_base, v_tile, u0, v_in)


@triton.jit
def _wy_queries(r_ptr, k_ptr, b_ptr, w_ptr, matrices_ptr, qd_ptr, kd_ptr, bd_ptr, decay_ptr,
                slot, head, used, steps, rows_in, k_base, scale, HEADS: tl.constexpr,
                K: tl.constexpr, BK: tl.constexpr, KI: tl.constexpr, C: tl.constexpr,
                FLOOR: tl.constexpr, TAME: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_LEVELS: tl.constexpr):
    """A chunk's A_qk and A_qb, stored; then the decayed rows the later kernels read instead of
    the decays, q~ = q e^gi, k^ = k e^(g - gi), b^ = b e^(g - gi) and e^g (every factor <= 1),
    when no [C, C] tile is live (beside T they spilled 40-68 B, sm_90 4 warps)."""
    A_qk, A_qb = _wy_pairs(r_ptr, k_ptr, b_ptr, w_ptr, k_base, rows_in, scale, False, TAME,
                           HEADS, K, BK, KI, C, BLOCK_LEVELS, FLOOR, PRECISION)
    _wy_store(_wy_matrix(matrices_ptr, slot, head, WY_A_QK, HEADS, C, False), 0, A_qk, used)
    _wy_store(_wy_matrix(matrices_ptr, slot, head, WY_A_QB, HEADS, C, False), 0, A_qb, used)
    for part in tl.static_range((K + KI - 1) // KI):
        part_base, k_tile, k_in = _k_part(part, k_base, rows_in, steps, HEADS, K, KI)
        w, gi, after = _wy_log_decay_sums(w_ptr, part_base, k_tile, k_in, FLOOR, C, False)
        _wy_store(qd_ptr + part_base, k_tile,
                  rows(r_ptr, part_base, k_tile, k_in) * (scale * tl.exp(gi)), k_in)
        after = tl.exp(after)
        _wy_store(kd_ptr + part_base, k_tile, rows(k_ptr, part_base, k_tile, k_in) * after, k_in)
        _wy_store(bd_ptr + part_base, k_tile, rows(b_ptr, part_base, k_tile, k_in) * after, k_in)
        k_cols = part * KI + tl.arange(0, KI)
        tl.store(_wy_decay(decay_ptr, slot, head, HEADS, K, k_cols), tl.exp(tl.sum(w, axis=0)),
                 mask=in_range(k_cols, K, KI) & used)


@triton.jit
def rwkv7_wy_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, cu_ptr, chunk_index_ptr, chunk_sequence_ptr,
    wy_ptr, u0_ptr, matrices_ptr, qd_ptr, kd_ptr, bd_ptr, decay_ptr,            # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, KI: tl.constexpr, VI: tl.constexpr, C: tl.constexpr,
    LEVELS: tl.constexpr, FLOOR: tl.constexpr, TAME: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
    INVERSE_PRECISION: tl.constexpr, BLOCK_LEVELS: tl.constexpr, RESIDUALS: tl.constexpr,
):
    """Grid (2 * chunk slots, HEADS): two programs per 64-token chunk, side by side, one for the
    WY transform and one for the queries' matrices and the decayed rows (the two share the
    chunk's tiles through L2, each holds fewer registers live than both, and twice the programs
    hide each other's latency). wy [rows, HEADS, K]: W = T a~; u0 [rows, HEADS, V]:
    U0 = T A_ak V; matrices [chunk slots, HEADS, 4, C, C]: A_qk, A_qb, A_ak, T (``_wy_matrix``;
    the last two only the backward reads, and T is written only for it, RESIDUALS: A_ak is also
    this kernel's own scratch); qd, kd, bd [rows, HEADS, K]: the decayed rows q~ = scale r e^gi, k^
    = k e^(g - gi), b^ = b e^(g - gi), and decay [chunk slots, HEADS, K] float32: e^g, which the
    later kernels read instead of the decays. Each float32 or bfloat16, rounded once from its
    float32 value.
    Rows past the sequence's end read as zeros (w = 0) and are not stored; nor is anything of an
    unused slot.

    In passes over K (KI columns at a time: [C, KI] tiles) so that at most two [C, C] sums are
    built at once: A_ak and A_ab, then T and W, then U0 (``_wy_transform``); A_qk and A_qb, then
    the decayed rows (``_wy_queries``). Each pass rereads its K tiles (k and b twice in all),
    which costs less than holding four [C, C] sums."""
    head = tl.program_id(1)
    slot = tl.program_id(0) // 2
    used, first, end = _one_chunk(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C,
                                  TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    steps = tl.arange(0, C)
    rows_in = (first + steps < end)[:, None]
    k_base = (first * HEADS + head) * K
    v_base = (first * HEADS + head) * V
    if tl.program_id(0) % 2 == 0:
        _wy_transform(a_ptr, k_ptr, b_ptr, w_ptr, v_ptr, wy_ptr, u0_ptr, matrices_ptr, slot,
                      head, used, steps, rows_in, k_base, v_base, HEADS, K, V, BK, BV, KI, VI,
                      C, LEVELS, FLOOR, TAME, PRECISION, INVERSE_PRECISION, BLOCK_LEVELS,
                      RESIDUALS)
    else:
        _wy_queries(r_ptr, k_ptr, b_ptr, w_ptr, matrices_ptr, qd_ptr, kd_ptr, bd_ptr, decay_ptr,
                    slot, head, used, steps, rows_in, k_base, scale, HEADS, K, BK, KI, C, FLOOR,
                    TAME, PRECISION, BLOCK_LEVELS)

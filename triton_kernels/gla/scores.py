"""The exact path's in-chunk scores of GLA/RWKV-6 (S[t, i], level by level), all chunks at once;
the tame path forms its scores inside the output kernel."""

import triton
import triton.language as tl

from ..common import dot, floored, in_range, level_factors, rows
from .tiles import _chunk_program


@triton.jit
def _scores_offsets(slot, head, t, i, HEADS: tl.constexpr, C: tl.constexpr):
    """Offsets of the pairs (t, i) in chunk slot's [C, C] scores."""
    return (slot.to(tl.int64) * HEADS + head) * (C * C) + t * C + i


@triton.jit
def _block_tiles(j, first, step, count, head, k_cols, HEADS: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr):
    """``_tile`` of a chunk's rows at in-chunk positions j ([P, S]): the [P, S, BK] tile of
    columns k_cols, as a scalar offset, offsets from it and the mask."""
    return ((first * HEADS + head) * K,
            (step * j)[:, :, None] * (HEADS * K) + k_cols[None, None, :],
            (j < count)[:, :, None] & in_range(k_cols, K, BK)[None, None, :])


@triton.jit
def gla_scores_kernel(
    q_ptr, k_ptr, a_ptr, u_ptr, cu_ptr, state_index_ptr, slot_sequence_ptr,  # inputs
    scores_ptr,                                                              # output
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    C: tl.constexpr, ROWS: tl.constexpr, HAS_A: tl.constexpr, BONUS: tl.constexpr,
    REVERSE: tl.constexpr, FLOOR: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (SLOTS, HEADS), the exact path only (the tame one forms the scores inside the
    output kernel): every chunk's scores S[t, i] (i <= t, with the diagonal) into
    [SLOTS, HEADS, C, C] float32 (pairs i > t are not written), summed over K in blocks of BK.
    The pairs come level by level (module docstring), each level only as its blocks: level
    S >= 16 pairs rows (2p + 1) S + t with columns 2p S + i as a batched [C / 2S, S, S]
    product; the levels S < 16 stay inside the chunk's 16-token sub-blocks, batched
    [C / 16, 16, 16]. No [C, C] tile is held (registers: several programs per SM)."""
    slot, head, _, used, first, step, count = _chunk_program(
        cu_ptr, state_index_ptr, slot_sequence_ptr, ROWS, C, REVERSE, 1, False)  # (one block)
    SUB: tl.constexpr = 16
    NB: tl.constexpr = C // SUB
    t16 = tl.arange(0, SUB)
    within = tl.arange(0, NB)[:, None] * SUB + t16[None, :]  # [NB, 16] positions
    blocks = tl.zeros([NB, SUB, SUB], tl.float32)  # the 16-token sub-blocks on the diagonal
    for block in tl.static_range(triton.cdiv(K, BK)):
        k_cols = block * BK + tl.arange(0, BK)
        base, off, mask = _block_tiles(within, first, step, count, head, k_cols, HEADS, K, BK)
        q = tl.reshape(rows(q_ptr, base, off, mask) * scale, [C, BK])
        k = tl.reshape(rows(k_ptr, base, off, mask), [C, BK])
        if BONUS:
            u = tl.load(u_ptr + head * K + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
            diagonal = tl.sum(q * u[None, :] * k, axis=1)
        else:
            diagonal = tl.sum(q * k, axis=1)
        blocks += tl.where(t16[:, None] == t16[None, :],
                           tl.reshape(diagonal, [NB, SUB])[:, :, None], 0.0)
        if HAS_A:
            a = floored(tl.reshape(rows(a_ptr, base, off, mask), [C, BK]), FLOOR)
        for level in tl.static_range(4):  # S = 8, 4, 2, 1: within the sub-blocks
            segment = t16 // (8 >> level)
            keep = (segment[:, None] == segment[None, :] + 1) & (segment[None, :] % 2 == 0)
            if HAS_A:
                row, row_strict, column, _ = level_factors(a, 8 >> level, 0, C)
                q_f = q * row_strict if BONUS else q * row
                k_f = k * column
            else:
                q_f = q
                k_f = k
            pairs = dot(tl.reshape(q_f, [NB, SUB, BK]),
                        tl.permute(tl.reshape(k_f, [NB, SUB, BK]), (0, 2, 1)), None, PRECISION)
            blocks += tl.where(keep[None, :, :], pairs, 0.0)
    lower = t16[:, None] >= t16[None, :]
    tl.store(scores_ptr + _scores_offsets(slot, head, within[:, :, None],
                                          within[:, None, :], HEADS, C),
             blocks, mask=lower[None, :, :] & used)
    # Levels S = 16, 32, ...: rows of each odd segment against the even segment before it,
    # with the factor split at the boundary between them.
    for level in tl.static_range(NB.bit_length() - 1):
        _cross_level(slot, head, used, first, step, count, q_ptr, k_ptr, a_ptr, scores_ptr,
                     scale, HEADS, K, BK, C, SUB << level, HAS_A, BONUS, FLOOR, PRECISION)


@triton.jit
def _cross_level(slot, head, used, first, step, count, q_ptr, k_ptr, a_ptr, scores_ptr,
                 scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                 C: tl.constexpr, S: tl.constexpr, HAS_A: tl.constexpr, BONUS: tl.constexpr,
                 FLOOR: tl.constexpr, PRECISION: tl.constexpr):
    """The scores' level S (gla_scores_kernel): [C / 2S, S, S] pairs, stored."""
    P: tl.constexpr = C // (2 * S)
    even = tl.arange(0, P)[:, None] * (2 * S) + tl.arange(0, S)[None, :]  # even segments
    pairs = tl.zeros([P, S, S], tl.float32)
    for block in tl.static_range(triton.cdiv(K, BK)):
        k_cols = block * BK + tl.arange(0, BK)
        base, row_off, row_in = _block_tiles(even + S, first, step, count, head, k_cols, HEADS,
                                             K, BK)
        _, column_off, column_in = _block_tiles(even, first, step, count, head, k_cols, HEADS,
                                                K, BK)
        q = rows(q_ptr, base, row_off, row_in) * scale
        k = rows(k_ptr, base, column_off, column_in)
        if HAS_A:  # e^{R_t - A_b} and e^{A_b - A_i}, sums within each segment
            a_row = floored(rows(a_ptr, base, row_off, row_in), FLOOR)
            read = tl.cumsum(a_row, axis=1)
            q = q * tl.exp(read - a_row if BONUS else read)
            a_column = floored(rows(a_ptr, base, column_off, column_in), FLOOR)
            k = k * tl.exp(tl.cumsum(a_column, axis=1, reverse=True) - a_column)
        pairs += dot(q, tl.permute(k, (0, 2, 1)), None, PRECISION)
    tl.store(scores_ptr + _scores_offsets(slot, head, (even + S)[:, :, None],
                                          even[:, None, :], HEADS, C),
             pairs, mask=used)

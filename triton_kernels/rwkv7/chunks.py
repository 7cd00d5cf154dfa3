"""What the RWKV-7 kernels share: the chunk slots of a list of sequences (``_chunk_rows``,
``_one_chunk``), a sequential pass's program and states (``_recurrence``, ``_state``), the
in-chunk decays (``_log_decays``, ``_middle``, ``_wy_log_decay_sums``), the unit lower
triangular inverse of a block, and the layout of the buffers between the 64-token kernels
(``_wy_matrix``, ``_wy_store``, ...)."""

import triton
import triton.language as tl

from ..common import (chunk_tiles, clamped, clamped_rows, dot, floored, gate_tile, in_range,
                      program, row_bases, row_sums, rows, stored)


@triton.jit
def _inverse_unit_lower(lower, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I - lower)^-1 for a strictly lower-triangular [C, C] tile (C = 16), or [G, C, C] tiles:
    lower is nilpotent, so the inverse is (I + L)(I + L^2)(I + L^4)(I + L^8): six products,
    each X (I + P) as X + X P (the product's accumulator: no identity tile, and X's own term
    not rounded to the product's precision)."""
    index = tl.arange(0, C)
    identity = tl.where(index[:, None] == index[None, :], 1.0, 0.0)
    if len(lower.shape) == 3:
        identity = identity[None, :, :]
    inverse = identity + lower
    power = lower
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision=PRECISION)
        inverse = tl.dot(inverse, power, inverse, input_precision=PRECISION)
    return inverse


@triton.jit
def _log_decays(w_ptr, base, tile, mask, FLOOR: tl.constexpr):
    """A chunk's log decays, raised to FLOOR (e^FLOOR is 0 in float32: no result changes, and
    cumulative sums stay finite and precise, with no -inf - -inf)."""
    return floored(rows(w_ptr, base, tile, mask), FLOOR)


@triton.jit
def _middle(gi, AXIS: tl.constexpr, C: tl.constexpr):
    """The reference m of a tame chunk's factors (module docstring), its middle's cumulative
    log decays: e^(gi_t - m), e^(ge_t - m) (rows) and e^(m - gi_i) (columns) are each within
    e^(+-16)."""
    index = tl.arange(0, C)
    if AXIS == 0:
        return tl.sum(tl.where(index[:, None] == C // 2 - 1, gi, 0.0), axis=0)[None, :]
    else:
        return tl.sum(tl.where(index[None, :] == C // 2 - 1, gi, 0.0), axis=1)[:, None]


@triton.jit
def _chunk_rows(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C: tl.constexpr,
                TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr):
    """For chunk slots [G]: whether each is a chunk, its first row and its sequence's end."""
    used = slot < CHUNK_SLOTS
    sequence = tl.load(chunk_sequence_ptr + slot, mask=used, other=-1)
    used = used & (sequence >= 0)
    sequence = clamped(sequence, SEQUENCES)
    start, end, chunks = clamped_rows(tl.load(cu_ptr + sequence).to(tl.int64),
                                      tl.load(cu_ptr + sequence + 1).to(tl.int64), TOTAL_ROWS, C)
    c = slot - tl.load(chunk_index_ptr + sequence)
    used = used & (c >= 0) & (c < chunks)
    return used, start + tl.where(used, c, 0) * C, end


@triton.jit
def _one_chunk(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C: tl.constexpr,
               TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr):
    """``_chunk_rows`` of one chunk slot, as scalars: whether it is a chunk, its first row and
    the end of its rows (its first row for an unused slot: every row masked out)."""
    used, first, end = _chunk_rows(slot + tl.arange(0, 1), cu_ptr, chunk_index_ptr,
                                   chunk_sequence_ptr, C, TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    used = tl.sum(used.to(tl.int32), axis=0) > 0
    first = tl.sum(first, axis=0)
    return used, first, tl.where(used, tl.sum(end, axis=0), first)


@triton.jit
def _state(ptr, slot, head, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BK: tl.constexpr, v_cols):
    """Pointers to a [K, V] state's [BK, BV] tile: a scalar base and 32-bit offsets (a tile of
    64-bit offsets held across the loop costs 2 registers per element)."""
    k_rows = tl.arange(0, BK)
    return (ptr + (slot.to(tl.int64) * HEADS + head) * (K * V)
            + (k_rows[:, None] * V + v_cols[None, :]))


@triton.jit
def _recurrence(cu_ptr, chunk_index_ptr, carried_ptr, HEADS: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                TOTAL_ROWS: tl.constexpr):
    """A sequential pass's program (grid: sequences * HEADS, V blocks): its sequence and head,
    tiles and masks (``program``), rows [start, end) clamped to the arrays with their chunk
    count, the slot of the sequence's first chunk, and the state it starts from
    (carried: the initial state, or the final state's gradient), float32 [BK, BV]."""
    sequence = tl.program_id(0) // HEADS
    head = tl.program_id(0) % HEADS
    v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks = program(
        sequence, head, tl.program_id(1), cu_ptr, HEADS, K, V, BK, BV, C, False)
    start, end, chunks = clamped_rows(start, end, TOTAL_ROWS, C)
    carried = tl.load(_state(carried_ptr, sequence, head, HEADS, K, V, BK, v_cols),
                      mask=state_mask, other=0.0)
    return (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end,
            chunks, tl.load(chunk_index_ptr + sequence), carried)


@triton.jit
def _chunk_bases(c, chunks, start, end, head, k_cols_in, v_cols_in, HEADS: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """Chunk c's row bases and masks (``row_bases``), and whether it is one of the sequence's
    chunks: a prefetch past either end (c = chunks, or -1) masks every row out."""
    inside = (c >= 0) & (c < chunks)
    first = start + c * C
    k_base, k_in, v_base, v_in = row_bases(first, tl.where(inside, end, first), head, k_cols_in,
                                            v_cols_in, HEADS, K, V, C, False)
    return k_base, k_in, v_base, v_in, inside


# A chunk's matrices in the buffer [chunk slots, HEADS, 4, C, C] of the 64-token forward, in
# this order: the outputs read the first two, the backward all four.
#
# The buffers between the 64-token kernels are float32, or, for W, H per chunk and the decayed
# rows, bfloat16 for 16-bit inputs (forward_chunk64's bf16_residuals; each kernel takes
# either): each kernel stores them rounded to its buffer's dtype (``_wy_store``) and reads them
# as stored, so that two stored 16-bit tiles multiply at the tensor cores' bfloat16 rate
# (``dot``). The sequential passes carry H and dH in float32; only what they store is rounded.
WY_A_QK, WY_A_QB, WY_A_AK, WY_T = (tl.constexpr(i) for i in range(4))


@triton.jit
def _wy_matrix(matrices_ptr, slot, head, WHICH: tl.constexpr, HEADS: tl.constexpr,
               C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Pointers to one of a chunk's four stored matrices (WY_A_QK, ...), [C, C], or to its
    transpose (the backward's products)."""
    index = tl.arange(0, C)
    if TRANSPOSED:
        within = index[:, None] + index[None, :] * C
    else:
        within = index[:, None] * C + index[None, :]
    return matrices_ptr + ((slot.to(tl.int64) * HEADS + head) * 4 + WHICH) * (C * C) + within


@triton.jit
def _wy_load(matrices_ptr, slot, used, head, WHICH: tl.constexpr, HEADS: tl.constexpr,
             C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """One of a chunk's stored matrices (or its transpose), zeros unless ``used``."""
    return tl.load(_wy_matrix(matrices_ptr, slot, head, WHICH, HEADS, C, TRANSPOSED),
                   mask=used, other=0.0)


@triton.jit
def _wy_store(ptr, offsets, value, mask):
    """A tile into one of the buffers between the kernels, rounded to its dtype."""
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _wy_chunk_program(cu_ptr, chunk_index_ptr, chunk_sequence_ptr, HEADS: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      C: tl.constexpr, TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr,
                      CHUNK_SLOTS: tl.constexpr):
    """A parallel kernel's program (grid: chunk slots * V blocks of BV, HEADS): its slot, head,
    whether the slot is a chunk (``_one_chunk``), its V columns, the chunk's tiles and masks
    (``chunk_tiles``) and row bases (``row_bases``; no row of an unused slot). A chunk's V
    blocks are consecutive programs: they run together, so that the chunk's matrices and K-side
    tiles, which every V block reads, come from L2 after the first."""
    V_BLOCKS: tl.constexpr = (V + BV - 1) // BV
    slot = tl.program_id(0) // V_BLOCKS
    head = tl.program_id(1)
    used, first, end = _one_chunk(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C,
                                  TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    v_cols = tl.program_id(0) % V_BLOCKS * BV + tl.arange(0, BV)
    k_tile, k_cols_in, v_tile, v_cols_in = chunk_tiles(v_cols, HEADS, K, V, BK, BV, C, False)
    k_base, k_in, v_base, v_in = row_bases(first, end, head, k_cols_in, v_cols_in, HEADS, K, V,
                                            C, False)
    return (slot, head, used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, k_base, k_in,
            v_base, v_in)


@triton.jit
def _wy_chunk_rows(cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C: tl.constexpr,
                   TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr):
    """A program's chunk (grid: chunk slots, HEADS): its slot, head, whether it is a chunk,
    its first row, the steps 0..C-1 and the mask of its rows ([C, 1]; none of an unused slot)."""
    slot = tl.program_id(0)
    head = tl.program_id(1)
    used, first, end = _one_chunk(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C,
                                  TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    steps = tl.arange(0, C)
    return slot, head, used, first, steps, (first + steps < end)[:, None]


@triton.jit
def _k_part(part, base, rows_in, steps, HEADS: tl.constexpr, K: tl.constexpr,
            KI: tl.constexpr):
    """The base, offsets and mask of a chunk's [C, KI] tile of K columns part * KI, ... (its
    first row at ``base``). The offsets are those of every part (the part is in the scalar
    base) and the mask a row mask where KI divides K: one tile of each held by the program,
    not one per part and stage. The parts are those that reach into K, ceil(K / KI), not
    BK / KI: where KI divides K the mask leaves the columns past K in (K = 48, BK = 64, KI = 16
    read a fourth part out of bounds)."""
    k_cols = tl.arange(0, KI)
    return (base + part * KI, steps[:, None] * (HEADS * K) + k_cols[None, :],
            rows_in & in_range(part * KI + k_cols, K, KI)[None, :])


@triton.jit
def _wy_log_decay_sums(w_ptr, base, tile, mask, FLOOR: tl.constexpr, C: tl.constexpr,
                       FROM_MIDDLE: tl.constexpr):
    """A chunk's [C, KI] log decays (``_log_decays``, float32) and two sums of them per row:
    gi_t - m (the inclusive sums less the middle row's, ``_middle``) if FROM_MIDDLE, else gi_t
    and g - gi_t (the sum after row t, summed from the chunk's end rather than subtracted:
    precise where gi is large). For bfloat16 decays as exact products (``row_sums``: no scans
    across the tile's rows), else by scans."""
    raw = stored(w_ptr + base, tile, mask)
    index = tl.arange(0, C)
    if raw.dtype == tl.bfloat16:
        w = gate_tile(raw, FLOOR)
        if FROM_MIDDLE:
            minus = (index[None, :] <= C // 2 - 1) & (index[:, None] >= 0)  # (every row)
            after = w.to(tl.float32)  # (not used)
        else:
            minus = False
            after = row_sums(w, index[None, :] > index[:, None], False)
        return w.to(tl.float32), row_sums(w, index[None, :] <= index[:, None], minus), after
    w = floored(raw.to(tl.float32), FLOOR)
    gi = tl.cumsum(w, axis=0)
    if FROM_MIDDLE:
        return w, gi - _middle(gi, 0, C), w  # (the last not used)
    return w, gi, tl.cumsum(w, axis=0, reverse=True) - w


@triton.jit
def _wy_decay(decay_ptr, slot, head, HEADS: tl.constexpr, K: tl.constexpr, k_cols):
    """Pointers to a chunk's e^g (``rwkv7_wy_kernel``) at K columns k_cols."""
    return decay_ptr + (slot.to(tl.int64) * HEADS + head) * K + k_cols

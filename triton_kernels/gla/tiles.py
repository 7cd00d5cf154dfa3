"""Where a GLA/RWKV-6 program's chunk lies: the program ids on its grid, a chunk's rows in
processing order, and the offsets and masks of its [C, *] tiles and of a state block."""

import triton
import triton.language as tl

from ..common import in_range, sequence_rows


@triton.jit
def _chunk_walk(c, start, end, C: tl.constexpr, REVERSE: tl.constexpr):
    """Chunk c of a sequence in processing order: the row of its first position, the step
    between its rows' (+1, or -1 if REVERSE) and how many of its positions lie inside the
    sequence (none for c = -1 or past the last chunk)."""
    if REVERSE:
        first = end - 1 - c * C
        step = -1
    else:
        first = start + c * C
        step = 1
    return first, step, tl.where(c >= 0, tl.minimum(tl.maximum(end - start - c * C, 0), C), 0)


@triton.jit
def _tile(first, step, count, head, cols, HEADS: tl.constexpr, WIDTH: tl.constexpr,
          BLOCK: tl.constexpr, C: tl.constexpr):
    """The [C, BLOCK] tile of columns ``cols`` (one block of them) of a chunk of a
    [rows, HEADS, WIDTH] array: a scalar offset, 32-bit offsets from it (fewer registers than
    64-bit ones per element) and the mask."""
    t = tl.arange(0, C)
    return ((first * HEADS + head) * WIDTH, (step * t)[:, None] * (HEADS * WIDTH) + cols[None, :],
            (t < count)[:, None] & in_range(cols, WIDTH, BLOCK)[None, :])


@triton.jit
def _state_tile(slot, head, k_cols, v_cols, HEADS: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The [BK, BV] block (rows k_cols, columns v_cols) of entry ``slot`` of a
    [slots, HEADS, K, V] state buffer: a scalar offset, offsets from it and the mask."""
    return ((slot.to(tl.int64) * HEADS + head) * (K * V), k_cols[:, None] * V + v_cols[None, :],
            in_range(k_cols, K, BK)[:, None] & in_range(v_cols, V, BV)[None, :])


@triton.jit
def _program_ids(BLOCKS: tl.constexpr, BLOCKS_FASTEST: tl.constexpr):
    """A program's (outer, middle, block) on the grid (outer, middle, BLOCKS), or with
    BLOCKS_FASTEST on that grid flattened to (outer * BLOCKS, middle), the blocks fastest: the
    programs of one chunk (or sequence and head) then run side by side, and all but the first
    find the tiles they share (q, k, the gates) in L2 rather than in memory."""
    if BLOCKS_FASTEST:
        outer = tl.program_id(0) // BLOCKS
        block = tl.program_id(0) % BLOCKS
    else:
        outer = tl.program_id(0)
        block = tl.program_id(2)
    return outer, tl.program_id(1), block


@triton.jit
def _state_program(HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, BLOCKS_FASTEST: tl.constexpr):
    """A sequential pass's program (grid: sequences * HEADS, 1, K blocks * V blocks, the K
    blocks faster; ``_program_ids``): its sequence, head, block, K rows and V columns. A state block
    advances on its own rows and columns, so K is split into blocks as V is."""
    K_BLOCKS: tl.constexpr = (K + BK - 1) // BK
    stream, _, block = _program_ids(K_BLOCKS * ((V + BV - 1) // BV), BLOCKS_FASTEST)
    return (stream // HEADS, stream % HEADS, block, (block % K_BLOCKS) * BK + tl.arange(0, BK),
            (block // K_BLOCKS) * BV + tl.arange(0, BV))


@triton.jit
def _chunk_program(cu_ptr, state_index_ptr, slot_sequence_ptr, ROWS: tl.constexpr,
                   C: tl.constexpr, REVERSE: tl.constexpr, BLOCKS: tl.constexpr,
                   BLOCKS_FASTEST: tl.constexpr):
    """A parallel kernel's program (grid: SLOTS, HEADS, BLOCKS; ``_program_ids``): its chunk's
    slot, head and block, whether the slot holds a chunk, and the chunk's rows
    (``_chunk_walk``; none inside for a slot past the last chunk)."""
    slot, head, block = _program_ids(BLOCKS, BLOCKS_FASTEST)
    sequence = tl.load(slot_sequence_ptr + slot)
    used = sequence >= 0
    sequence = tl.maximum(sequence, 0)
    start, end, _ = sequence_rows(sequence, cu_ptr, ROWS, C)
    first, step, count = _chunk_walk(slot - tl.load(state_index_ptr + sequence), start, end, C,
                                     REVERSE)
    return slot, head, block, used, first, step, tl.where(used, count, 0)

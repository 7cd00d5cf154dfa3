"""Chunked kernels of gated linear attention and RWKV-6: one family, one set of kernels.

Per head, with the float32 state h [K, V], q = scale * q (RWKV-6: r), a per-key log gate
a_t (GLA: gk + g + g_gamma, summed by the caller; RWKV-6: w) and a per-value log gate b_t
(GLA's gv):

    h_t = (e^{a_t} e^{b_t}^T) * h_{t-1} + k_t v_t^T
    GLA:     o_t = h_t^T q_t                                  (read after the update)
    RWKV-6:  o_t = (h_{t-1} + diag(u) k_t v_t^T)^T q_t         (read before, bonus u)

A chunk of C tokens starting from the state H, with the in-chunk cumulative log gates
A_t = a_1 + ... + a_t, B_t likewise, the read decay R_t = A_t (GLA) or A_t - a_t (RWKV-6)
and the pairwise scores

    S[t,i] = sum_k q_t k_i e^{R_t - A_i}   (i <= t; RWKV-6: i < t, and S[t,t] = q_t . (u k_t))

is (the value gate enters each column v on its own):

    o_t = e^{B_t} (H^T (q_t e^{R_t})) + sum_i S[t,i] v_i e^{B_t - B_i}
    H'  = (e^{A_C} e^{B_C}^T) * H + (k e^{A_C - A})^T (v e^{B_C - B})

Two builds of the in-chunk pair factors e^{R_t - A_i}, chosen per call on the device by the
backend (each its own compiled kernels, TAME constexpr):
- tame (a call whose chunks' log gates all sum to >= -GLA_TAME_SUM: model gates): every factor
  referenced to the chunk's middle row m, e^{R_t - A_m} on the row operand and e^{A_m - A_i} on
  the column operand of ONE tensor-core product per K block; each lies within
  e^(+-GLA_TAME_SUM), and each kept pair's term is still its own factor <= 1 times q_t k_i.
- exact (any gates in [-inf, 0]): level by level as RWKV-7's A matrices (common.level_factors):
  at level s, rows t of each odd segment of s steps meet columns i of the even segment before
  it, with the factor split at the boundary b between them, e^{R_t - A_b} e^{A_b - A_i}, each
  <= 1 (levels s = C/2, ..., 1 cover every pair i < t once; the diagonal has the factor e^0).
The value gate's pair factors are always built level by level. The other factors are decays to
the chunk's end or from its start (<= 1). Log gates are raised to FLOOR on load (their exp is 0
in float32 either way; it keeps the sums finite and precise), and the gradient of a floored
gate is 0.

Every kernel takes chunks of C tokens (the backend's GLA_SPAN), the states saved at the start
of each chunk (slot ``state_index[n] + c`` of sequence n's chunk c, processing order) being the
interface between them. The forward: a sequential state pass per (sequence, head, K block,
V block) (H' above: one product per chunk, every factor <= 1; the final state as ht), then the
outputs per (chunk, head, V block), all chunks at once, from the chunk's saved state and its
scores (formed in the output kernel on the tame path; from the exact scores kernel before it
otherwise). The backward: a lean sequential reverse pass of the state gradient, one product
per chunk (dH_prev = (e^{A_C} e^{B_C}^T) * dH + (q e^R)^T (dO e^B), saved at every chunk's
end in the chunk's slot), parallel over blocks of K and of V; then two kernels parallel over
(chunk, head, block): the K-side gradients (dq, dk, da, du) of a block of keys, summing over V
in blocks, and the V-side ones (dv, db) of a block of values, summing over K in blocks. Their
loops over the levels are not unrolled (``level_factors_at``), so that one level's tiles are
live at a time. The sequential passes loop over chunks with ``for``, which Triton pipelines (the launch's
num_stages): the next chunks' loads are in flight during the current chunk's product.

Gate gradients: a log gate multiplies a factor x = y e^z, so dz = x dx; summed over the chunk's
factors that gives dR = q dq, dA = -k dk and the per-token gradient is their reverse cumulative
sum (exclusive for R under RWKV-6), in float32. Terms that would cancel exactly are kept out of
those sums (strong gates leave the gradient far smaller than the rounding of the cancelling
terms): the pairs whose factor is e^0 whatever the gates (GLA: i = t; RWKV-6: i = t - 1), and
the decays to the chunk's end, summed forwards (A_end - A_i = a_{i+1} + ... + a_C) instead of
as A_end minus a reverse sum.

REVERSE runs each sequence from its last token to its first (GLA's ``reverse``): chunk c's
position j is row ``end - 1 - (c * C + j)``. Sequences are rows [cu[n], cu[n+1]) of the
flattened inputs, clamped to [0, ROWS) in the kernel, and saved-state slots are masked to
[0, SLOTS), so no value of ``cu`` makes a kernel read or write out of bounds.
"""

import triton
import triton.language as tl

from .common import (INTERPRETED, clamped_rows, diagonal_tile, dot, floored,
                     gate_tile as _gate_tile, in_range, level_factors, level_factors_at,
                     row_sums as _row_sums, stored)


@triton.jit
def _segment(sequence, cu_ptr, ROWS: tl.constexpr, C: tl.constexpr):
    """Rows [start, end) of a sequence, clamped to the arrays, and its chunk count."""
    return clamped_rows(tl.load(cu_ptr + sequence).to(tl.int64),
                        tl.load(cu_ptr + sequence + 1).to(tl.int64), ROWS, C)


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
    start, end, _ = _segment(sequence, cu_ptr, ROWS, C)
    first, step, count = _chunk_walk(slot - tl.load(state_index_ptr + sequence), start, end, C,
                                     REVERSE)
    return slot, head, block, used, first, step, tl.where(used, count, 0)


@triton.jit
def _load(ptr, off, mask):
    return stored(ptr, off, mask).to(tl.float32)


@triton.jit
def _raw_gate(ptr, off, mask, HAS: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr):
    """A chunk's log gates as stored, or zeros without that gate."""
    if HAS:
        raw = stored(ptr, off, mask)
    else:
        raw = tl.zeros([C, BLOCK], tl.float32)
    return raw


@triton.jit
def _gate_sums(raw, FLOOR: tl.constexpr):
    """Log gates raised to FLOOR, their cumulative sums and total, and where the floor applied
    (there the gradient is 0)."""
    raw = raw.to(tl.float32)
    gate = floored(raw, FLOOR)
    return gate, tl.cumsum(gate, axis=0), tl.sum(gate, axis=0), raw >= FLOOR


@triton.jit
def _log_gate(ptr, off, mask, HAS: tl.constexpr, FLOOR: tl.constexpr, C: tl.constexpr,
              BLOCK: tl.constexpr):
    """A chunk's log gates (``_gate_sums``)."""
    return _gate_sums(_raw_gate(ptr, off, mask, HAS, C, BLOCK), FLOOR)


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
def _to_end(raw, FLOOR: tl.constexpr):
    """Of a chunk's stored log gates: e^{G_end - G_i} (<= 1; the gates after i, summed in
    reverse: no difference of large cumulative sums) and G_end, their sum."""
    gate = floored(raw.to(tl.float32), FLOOR)
    return tl.exp(tl.cumsum(gate, axis=0, reverse=True) - gate), tl.sum(gate, axis=0)


@triton.jit
def _shifted_add(sum_a, last_a, sum_b, last_b):
    return sum_a + last_a + sum_b, last_b


@triton.jit
def _exclusive_cumsum(x, REVERSE: tl.constexpr):
    """Sums of the rows before each row (after it if REVERSE), each formed without its own row:
    an inclusive sum minus the row would cancel to rounding where the row is large and the sum
    small (a strong gate's gradient next to a factor e^0)."""
    before, _ = tl.associative_scan((tl.zeros_like(x), x), 0, _shifted_add, reverse=REVERSE)
    return before


@triton.jit
def _strictly_lower(C: tl.constexpr):
    t = tl.arange(0, C)
    return t[:, None] > t[None, :]


@triton.jit
def _middle_factors(a, A, BONUS: tl.constexpr, C: tl.constexpr):
    """A tame chunk's key-side factors referenced to its middle row m = C/2 - 1: e^{R - A_m}
    (rows t) and e^{A_m - A} (columns i), whose product is the pair factor e^{R_t - A_i}. Each
    exponent, and each pair's, is a sum of gates of one chunk, within e^(+-GLA_TAME_SUM) on a
    tame call (the backend's criterion; float32 reaches e^88), so one tensor-core product of
    [C, BK] tiles carrying them forms every pair at once; each kept pair's term keeps its own
    rounding (no cancellation), and the pairs i > t, whose product may be large, are masked."""
    t = tl.arange(0, C)
    middle = tl.sum(tl.where(t[:, None] == C // 2 - 1, A, 0.0), axis=0)[None, :]
    R = A - a if BONUS else A
    return tl.exp(R - middle), tl.exp(middle - A)


@triton.jit
def _chunk_totals(gate, C: tl.constexpr, BV: tl.constexpr):
    """Each channel's sum over the chunk as a [BLOCK, BV] tile (row k: channel k's sum in every
    column), the gates' transpose times ones: ready to scale a state block's rows."""
    return dot(tl.trans(gate), tl.full([C, BV], 1.0, tl.float32).to(tl.bfloat16), None, "tf32")


@triton.jit
def _read_by_product(gate, BONUS: tl.constexpr, C: tl.constexpr):
    """The read decay's exponent R: the gates up to t (GLA's A), or before t (RWKV-6's A - a)."""
    t = tl.arange(0, C)
    return _row_sums(gate, t[None, :] < t[:, None] if BONUS else t[None, :] <= t[:, None], False)


@triton.jit
def _middle_by_product(gate, BONUS: tl.constexpr, C: tl.constexpr):
    """``_middle_factors`` by products: e^{R_t - A_m} and e^{A_m - A_i} (m = C/2 - 1)."""
    t = tl.arange(0, C)
    upto = t[None, :] <= t[:, None]
    middle = (t[None, :] <= C // 2 - 1) & (t[:, None] >= 0)  # (every row: the rows up to m)
    row = _row_sums(gate, t[None, :] < t[:, None] if BONUS else upto, middle)
    if BONUS:
        column = _row_sums(gate, middle, upto)
    else:
        column = -row  # (A_m - A_i = -(A_i - A_m))
    return tl.exp(row), tl.exp(column)


@triton.jit
def _scores_diagonal(q, k, u, BONUS: tl.constexpr, C: tl.constexpr):
    """The scores' diagonal as a [C, C] tile: q_t . k_t (GLA: the factor is e^0) or
    q_t . (u k_t) (RWKV-6's bonus)."""
    if BONUS:
        return diagonal_tile(tl.sum(q * u[None, :] * k, axis=1), C)
    else:
        return diagonal_tile(tl.sum(q * k, axis=1), C)


@triton.jit
def _value_mixes(pairs, x, y, b, C: tl.constexpr, LEVELS: tl.constexpr,
                 PRECISION: tl.constexpr):
    """With the value gate's factors e^{B_t - B_i} (level by level, each <= 1) and the pairs
    i < t of ``pairs`` ([C, C]): sum_i pairs[t,i] y_i e^{B_t - B_i} (rows t) and
    sum_t pairs[t,i] x_t e^{B_t - B_i} (rows i), each [C, V]; the diagonal is left out."""
    to_rows = tl.zeros(y.shape, tl.float32)
    to_columns = tl.zeros(x.shape, tl.float32)
    for level in range(LEVELS):  # one level's tiles live at a time (level_factors_at)
        row, _, column, keep = level_factors_at(b, level, LEVELS, C)
        kept = tl.where(keep, pairs, 0.0)
        to_rows += row * dot(kept, y * column, None, PRECISION)
        to_columns += column * dot(tl.trans(kept), x * row, None, PRECISION)
    return to_rows, to_columns


@triton.jit
def _value_pairs(x, y, b, C: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """sum_v x_t y_i e^{B_t - B_i} for i <= t ([C, C]; the diagonal's factor is e^0)."""
    pairs = diagonal_tile(tl.sum(x * y, axis=1), C)
    for level in range(LEVELS):  # one level's tiles live at a time (level_factors_at)
        row, _, column, keep = level_factors_at(b, level, LEVELS, C)
        pairs += tl.where(keep, dot(x * row, tl.trans(y * column), None, PRECISION),
                          0.0)
    return pairs


@triton.jit
def _decayed(x, factor, ROUNDED: tl.constexpr):
    """A stored tile times its decay factors (float32), rounded back to its stored type if
    ROUNDED (bfloat16 inputs: the sequential passes' products then take 16-bit operands)."""
    y = x.to(tl.float32) * factor
    if ROUNDED:
        y = y.to(x.dtype)
    return y


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
    start, end, chunks = _segment(sequence, cu_ptr, ROWS, C)
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
        q = tl.reshape(_load(q_ptr + base, off, mask) * scale, [C, BK])
        k = tl.reshape(_load(k_ptr + base, off, mask), [C, BK])
        if BONUS:
            u = tl.load(u_ptr + head * K + k_cols, mask=k_cols < K, other=0.0).to(tl.float32)
            diagonal = tl.sum(q * u[None, :] * k, axis=1)
        else:
            diagonal = tl.sum(q * k, axis=1)
        blocks += tl.where(t16[:, None] == t16[None, :],
                           tl.reshape(diagonal, [NB, SUB])[:, :, None], 0.0)
        if HAS_A:
            a = floored(tl.reshape(_load(a_ptr + base, off, mask), [C, BK]), FLOOR)
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
        q = _load(q_ptr + base, row_off, row_in) * scale
        k = _load(k_ptr + base, column_off, column_in)
        if HAS_A:  # e^{R_t - A_b} and e^{A_b - A_i}, sums within each segment
            a_row = floored(_load(a_ptr + base, row_off, row_in), FLOOR)
            read = tl.cumsum(a_row, axis=1)
            q = q * tl.exp(read - a_row if BONUS else read)
            a_column = floored(_load(a_ptr + base, column_off, column_in), FLOOR)
            k = k * tl.exp(tl.cumsum(a_column, axis=1, reverse=True) - a_column)
        pairs += dot(q, tl.permute(k, (0, 2, 1)), None, PRECISION)
    tl.store(scores_ptr + _scores_offsets(slot, head, (even + S)[:, :, None],
                                          even[:, None, :], HEADS, C),
             pairs, mask=used)


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
        q = _load(q_ptr + k_base, k_off, k_in) * scale
        if TAME:
            k = _load(k_ptr + k_base, k_off, k_in)
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


# ---------------------------------------------------------------------------------------------
# The backward, over chunks of C tokens that are the forward's spans: the forward saved H at the
# start of every chunk (slot ``state_index[n] + c`` of sequence n's chunk c, processing order).
# ---------------------------------------------------------------------------------------------

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
    start, end, chunks = _segment(sequence, cu_ptr, ROWS, C)
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


@triton.jit
def _state_terms(dk_state, h_dh, v, h, dh, b_ptr, v_off, v_in, HAS_B: tl.constexpr,
                 FLOOR: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                 PRECISION: tl.constexpr):
    """k's gradient through the state, H' = (e^{A_C} e^{B_C}^T) * H + (k e^{A_C - A})^T
    (v e^{B_C - B}), from one block of V: (v e^{B_C - B}) dH^T added to dk_state (times
    e^{A_C - A} after) and sum_v e^{B_C} H dH to h_dh (times e^{A_C} after). v, H and dH as
    stored."""
    if HAS_B:
        _, B, B_end, _ = _log_gate(b_ptr, v_off, v_in, True, FLOOR, C, BV)
        v = v.to(tl.float32) * tl.exp(B_end[None, :] - B)
        h_dh += tl.sum(h.to(tl.float32) * dh.to(tl.float32) * tl.exp(B_end)[None, :], axis=1)
    else:
        h_dh += tl.sum(h.to(tl.float32) * dh.to(tl.float32), axis=1)
    return dot(v, tl.trans(dh), dk_state, PRECISION), h_dh


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
            v_cols = v_block * BV + tl.arange(0, BV)
            v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
            do = stored(do_ptr + v_base, v_off, v_in)
            state, block, state_mask = _state_tile(slot, head, k_cols, v_cols, HEADS, K, V,
                                                    BK, BV)
            h = tl.load(states_ptr + state + block, mask=state_mask & used, other=0.0)
            if TAME:
                v = stored(v_ptr + v_base, v_off, v_in)
                dh = tl.load(dstates_ptr + state + block, mask=state_mask & used, other=0.0)
                dk_state, h_dh = _state_terms(dk_state, h_dh, v, h, dh, b_ptr + v_base, v_off,
                                              v_in, HAS_B, FLOOR, C, BV, PRECISION)
            if HAS_B:
                b, B, b_end, b_kept = _log_gate(b_ptr + v_base, v_off, v_in, True, FLOOR, C, BV)
                do = do.to(tl.float32) * tl.exp(B)
            dq = dot(do, tl.trans(h), dq, PRECISION)
        q = _load(q_ptr + k_base, k_off, k_in) * scale
        k = _load(k_ptr + k_base, k_off, k_in)
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
            dq += d_constant_rows[:, None] * _load(k_ptr + base, off, mask & (t >= 1)[:, None])
            base, off, mask = _tile(first + step, step, count - 1, head, k_cols, HEADS, K, BK, C)
            d_constant_columns = tl.sum(tl.where(constant, d_constant_rows[:, None], 0.0), 0)
            dk += d_constant_columns[:, None] * _load(q_ptr + base, off, mask) * scale
        if not TAME:  # Through the state (after the levels, so that its tiles are not live
            # through them), in a second pass over V.
            dk_state = tl.zeros([C, BK], tl.float32)
            h_dh = tl.zeros([BK], tl.float32)
            for v_block in range((V + BV - 1) // BV):
                v_cols = v_block * BV + tl.arange(0, BV)
                v_base, v_off, v_in = _tile(first, step, count, head, v_cols, HEADS, V, BV, C)
                v = stored(v_ptr + v_base, v_off, v_in)
                state, block, state_mask = _state_tile(slot, head, k_cols, v_cols, HEADS, K, V,
                                                        BK, BV)
                h = tl.load(states_ptr + state + block, mask=state_mask & used, other=0.0)
                dh = tl.load(dstates_ptr + state + block, mask=state_mask & used, other=0.0)
                dk_state, h_dh = _state_terms(dk_state, h_dh, v, h, dh, b_ptr + v_base, v_off,
                                              v_in, HAS_B, FLOOR, C, BV, PRECISION)
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
        q = _load(q_ptr + k_base, k_off, k_in) * scale
        k = _load(k_ptr + k_base, k_off, k_in)
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
    v = _load(v_ptr + v_base, v_off, v_in)
    do = _load(do_ptr + v_base, v_off, v_in)
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

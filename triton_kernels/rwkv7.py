"""Chunked RWKV-7 (generalized delta rule) forward and backward kernels.

Per head, with the float32 state h [K, V] and q = scale * r:

    h_t = diag(exp w_t) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T,   o_t = h_t^T q_t

A chunk of C tokens starting from the state H is, with the in-chunk cumulative log decays
gi_t = w_1 + ... + w_t (inclusive), ge_t = gi_t - w_t (exclusive), g = gi_C, and the
decayed rows  a~ = a e^ge,  q~ = q e^gi,  k^ = k e^(g - gi),  b^ = b e^(g - gi):

    A_ab[t,i] = sum_k a_t e^(ge_t - gi_i) b_i  (i < t),  A_ak likewise with k_i  (i < t)
    A_qb[t,i] = sum_k q_t e^(gi_t - gi_i) b_i  (i <= t), A_qk likewise with k_i  (i <= t)
    U  = (I - A_ab)^-1 (A_ak V + a~ H)           # u_t = h_{t-1}^T a_t, rows of U
    O  = q~ H + A_qk V + A_qb U
    H' = e^g H + k^T V + b^T U

Every exponent is a difference of cumulative log decays inside one chunk, and every factor
is at most 1 whatever the decays, so nothing overflows and underflow is harmless: log decays
are raised to FLOOR (-128, where e^w is 0 in float32; the gradient of a raised element is 0)
on load, the factors against the state are e^gi, e^ge, e^(g - gi) <= 1, and the A matrices are
built level by level (``_level``): at level S the chunk is cut into segments of S steps and
rows t of each odd segment meet columns i of the even segment just before it, with the factor
split at the boundary b between them, e^(G_t - gi_b) * e^(gi_b - gi_i), each <= 1. Levels
S = C/2, C/4, ..., 1 cover every pair i < t once; the diagonal (i = t) has no factor.

Every kernel that builds A matrices has a tame and an exact path. The tame one is for calls
whose every chunk is tame, its log decays summing to at least -16 in every column (the caller
decides on the device, for the whole call: every log decay >= -16 / C, which model-range
decays always are): one product per A matrix, its factors referenced to the chunk's middle
and so within e^(+-16) (``_middle``). The exact one builds them level by level, exact for
every decay. The gradient kernels are compiled twice, on the constexpr TAME; the in-chunk
matrices have one kernel per path. One compiled path per kernel keeps the tame one's registers
those of a kernel without the other.

Four phases, so that only the two recurrences are sequential and they build nothing per chunk:

0. in-chunk: all chunks at once, each chunk's (I - A_ab)^-1, A_qb, A_ak, A_qk (float32,
   [C, C] each: 64 floats per token and head, read by both passes, and by every V block):
   ``rwkv7_tame_in_chunk_kernel`` (GROUP chunks per program, batched products) or
   ``rwkv7_in_chunk_kernel`` (level by level, one chunk per program).
1. forward: one program per (sequence, head, block of V columns) walks its chunks in order,
   keeping H in registers: X = A_ak V + a~ H, U = (I - A_ab)^-1 X, O and H' as above, with
   e^gi, e^ge, e^(g - gi) from one cumulative sum of w; for the backward it saves H every
   CHUNKS_PER_STATE chunks and U.
2. state gradient: the same grid walks the chunks in reverse carrying dH, which needs neither
   H nor U: with dU = b^ dH + A_qb^T dO and dX = (I - A_ab)^-T dU,
   dH_prev = e^g dH + q~^T dO + a~^T dX. It saves dH at the end of every chunk and dX.
3. gradients: one program per (span of CHUNKS_PER_STATE chunks, head, V block), all at once,
   from the saved dH, dX, U (and H, advanced over the span with the saved U, where needed):
   every input gradient of its chunks, with no recurrence and no inverse. Three kernels, each
   holding part of the tiles: value gradient (dv, one path: it reads A_qk and A_ak from the
   in-chunk buffer), key gradient (dk, db and their share of dw) and query gradient (dr, da,
   dw; the one that needs H), the last two on blocks of K rows where configured (K_BLOCKS:
   all their K-side work is per K row); for tame calls one kernel does the last two by
   default (``rwkv7_tame_gradient_kernel``: fewer reads). Their tiles are held transposed
   ([K, C], [V, C]; see the kernels).

Sequences are rows [cu[n], cu[n+1]) of the flattened [rows, heads, *] inputs (fixed-length
batches are the special case cu = arange(B + 1) * T). ``state_index[n]`` is the first slot of
sequence n in the saved-state buffer (one state per span of CHUNK * CHUNKS_PER_STATE tokens),
``chunk_index[n]`` its first slot in the per-chunk dH buffer, and ``slot_sequence[s]`` the
sequence of span slot s (-1 for the slots past the last span: the buffers have a static size).

K-side gradients (r, w, k, a, b) sum over V, so with several V blocks the caller launches
their kernels once per V block (V_BLOCK): each launch after the first adds the float32 sums of
the one before (ACCUMULATE), and the last writes the gradients' dtype. That keeps one float32
buffer per gradient, in a fixed order of summation (deterministic).

Tiles are addressed as a scalar row base plus offsets within a chunk that are the same for
every chunk (computed once per program), and masks are row masks unless K or V needs padding,
which keeps registers free and loads and stores vectorised.
"""

import triton
import triton.language as tl

from .common import (INTERPRETED, PREFETCH_UP_TO, chunk_tiles, clamped, clamped_rows,
                     diagonal_tile as _diagonal, dot, floored, gate_tile, in_range,
                     level_factors as _level, level_factors_at, program, row_bases, row_sums,
                     rows, state_offsets, stored)


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
def _decays(w, AXIS: tl.constexpr):
    """Inclusive and exclusive cumulative log decays of a chunk whose steps run along AXIS, its
    total g, and g - gi (summed from the end, not subtracted: precise where gi is large)."""
    gi = tl.cumsum(w, axis=AXIS)
    return gi, gi - w, tl.sum(w, axis=AXIS), tl.cumsum(w, axis=AXIS, reverse=True) - w


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
def _in_chunk(q, k, a, b, w, C: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """The A matrices of a chunk from [C, *] tiles, level by level (``_level``; exact for every
    decay): A_qk, A_qb (i <= t, factor e^(gi_t - gi_i)) and A_ak, A_ab (i < t, factor
    e^(ge_t - gi_i)). Those a kernel does not use are not computed (dead code)."""
    A_qk = _diagonal(tl.sum(q * k, axis=1), C)
    A_qb = _diagonal(tl.sum(q * b, axis=1), C)
    A_ak = tl.zeros([C, C], tl.float32)
    A_ab = tl.zeros([C, C], tl.float32)
    for level in tl.static_range(LEVELS):
        row, row_strict, column, keep = _level(w, C >> (level + 1), 0, C)
        q_f = q * row
        a_f = a * row_strict
        k_f = tl.trans(k * column)
        b_f = tl.trans(b * column)
        A_qk += tl.where(keep, tl.dot(q_f, k_f, input_precision=PRECISION), 0.0)
        A_qb += tl.where(keep, tl.dot(q_f, b_f, input_precision=PRECISION), 0.0)
        A_ak += tl.where(keep, tl.dot(a_f, k_f, input_precision=PRECISION), 0.0)
        A_ab += tl.where(keep, tl.dot(a_f, b_f, input_precision=PRECISION), 0.0)
    return A_qk, A_qb, A_ak, A_ab


@triton.jit
def _tame_chunks(q, k, a, b, w, C: tl.constexpr, PRECISION: tl.constexpr):
    """The A matrices of G tame chunks from [G, C, *] tiles, [G, C, C] each (batched products,
    one chunk per batch entry), with their factors referenced to each chunk's middle
    (``_middle``): one product per matrix."""
    index = tl.arange(0, C)
    gi = tl.cumsum(w, axis=1)
    middle = tl.sum(tl.where(index[None, :, None] == C // 2 - 1, gi, 0.0), axis=1)[:, None, :]
    q_f = q * tl.exp(gi - middle)
    a_f = a * tl.exp(gi - w - middle)
    column = tl.exp(middle - gi)
    k_f = tl.permute(k * column, (0, 2, 1))
    b_f = tl.permute(b * column, (0, 2, 1))
    # tl.where, not a multiplication: the entries dropped (i > t) are no factors of the math
    # and may be large (up to e^16).
    lower = (index[:, None] >= index[None, :])[None, :, :]
    strict = (index[:, None] > index[None, :])[None, :, :]
    return (tl.where(lower, tl.dot(q_f, k_f, input_precision=PRECISION), 0.0),
            tl.where(lower, tl.dot(q_f, b_f, input_precision=PRECISION), 0.0),
            tl.where(strict, tl.dot(a_f, k_f, input_precision=PRECISION), 0.0),
            tl.where(strict, tl.dot(a_f, b_f, input_precision=PRECISION), 0.0))


# A chunk's [C, C] matrices in the in-chunk buffer [chunk slots, HEADS, 4, C, C] (float32), in
# this order: the state-gradient pass reads the first two, the forward all four.
INVERSE, A_QB, A_AK, A_QK = (tl.constexpr(i) for i in range(4))


@triton.jit
def _matrix(matrices_ptr, chunk_slot, head, WHICH: tl.constexpr, HEADS: tl.constexpr,
            C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Pointers to one of a chunk's matrices (INVERSE, ...), [C, C], or to its transpose; or
    to those of chunk slots [G], [G, C, C]."""
    index = tl.arange(0, C)
    if TRANSPOSED:
        within = index[:, None] + index[None, :] * C
    else:
        within = index[:, None] * C + index[None, :]
    first = ((chunk_slot.to(tl.int64) * HEADS + head) * 4 + WHICH) * (C * C)
    if len(first.shape) == 1:
        pointers = matrices_ptr + first[:, None, None] + within[None, :, :]
    else:
        pointers = matrices_ptr + first + within
    return pointers


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
def _store_matrices(matrices_ptr, slot, used, head, A_qk, A_qb, A_ak, A_ab,
                    HEADS: tl.constexpr, C: tl.constexpr, INVERSE_PRECISION: tl.constexpr):
    """A chunk's four matrices, (I - A_ab)^-1 in place of A_ab ([C, C]; or G chunks',
    [G, C, C], slot and used [G])."""
    inverse = _inverse_unit_lower(A_ab, C, INVERSE_PRECISION)
    if len(inverse.shape) == 3:
        used = used[:, None, None]
    tl.store(_matrix(matrices_ptr, slot, head, INVERSE, HEADS, C, False), inverse, mask=used)
    tl.store(_matrix(matrices_ptr, slot, head, A_QB, HEADS, C, False), A_qb, mask=used)
    tl.store(_matrix(matrices_ptr, slot, head, A_AK, HEADS, C, False), A_ak, mask=used)
    tl.store(_matrix(matrices_ptr, slot, head, A_QK, HEADS, C, False), A_qk, mask=used)


# The in-chunk matrices of every chunk, all at once, so that the two sequential passes keep only
# the state recurrence and none of their V blocks rebuilds them: (I - A_ab)^-1, A_qb, A_ak, A_qk
# into matrices [CHUNK_SLOTS, HEADS, 4, C, C] float32 (``_matrix``). Both kernels sum the A
# matrices over the K columns KI at a time (fewer registers). ``chunk_sequence[s]``: the
# sequence of chunk slot s (-1 past the last chunk; such slots and those of invalid ``cu``
# values are not written, and no pass reads them).

@triton.jit
def rwkv7_tame_in_chunk_kernel(
    r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, cu_ptr, chunk_index_ptr, chunk_sequence_ptr,  # inputs
    matrices_ptr,                                                                    # output
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    KI: tl.constexpr, GROUP: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr,
):
    """Tame calls (the TAME path). Grid (chunk slots / GROUP, HEADS): GROUP consecutive chunk
    slots (of any sequences) per program as [GROUP, C, *] tiles and batched products, GROUP
    times fewer instructions and synchronisations per chunk than one chunk per program."""
    head = tl.program_id(1)
    slot = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    used, first, end = _chunk_rows(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C,
                                   TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    row = first[:, None] + tl.arange(0, C)[None, :]
    rows_in = (used[:, None] & (row < end[:, None]))[:, :, None]
    k_base = ((row * HEADS + head) * K)[:, :, None]
    A_qk = tl.zeros([GROUP, C, C], tl.float32)
    A_qb = tl.zeros([GROUP, C, C], tl.float32)
    A_ak = tl.zeros([GROUP, C, C], tl.float32)
    A_ab = tl.zeros([GROUP, C, C], tl.float32)
    for part in tl.static_range(BK // KI):
        k_cols = part * KI + tl.arange(0, KI)
        if K % KI == 0:
            k_in = rows_in
        else:
            k_in = rows_in & (k_cols < K)[None, None, :]
        k_cols = k_cols[None, None, :]
        A_qk_part, A_qb_part, A_ak_part, A_ab_part = _tame_chunks(
            rows(r_ptr, k_base, k_cols, k_in) * scale, rows(k_ptr, k_base, k_cols, k_in),
            rows(a_ptr, k_base, k_cols, k_in), rows(b_ptr, k_base, k_cols, k_in),
            _log_decays(w_ptr, k_base, k_cols, k_in, FLOOR), C, PRECISION)
        A_qk += A_qk_part
        A_qb += A_qb_part
        A_ak += A_ak_part
        A_ab += A_ab_part
    _store_matrices(matrices_ptr, slot, used, head, A_qk, A_qb, A_ak, A_ab, HEADS, C,
                    INVERSE_PRECISION)


@triton.jit
def rwkv7_in_chunk_kernel(
    r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, cu_ptr, chunk_index_ptr, chunk_sequence_ptr,  # inputs
    matrices_ptr,                                                                    # output
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    KI: tl.constexpr, C: tl.constexpr, LEVELS: tl.constexpr, FLOOR: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr,
):
    """Every call (the exact path, level by level). Grid (chunk slots, HEADS): one chunk per
    program ([C, *] tiles: batched, the level-by-level build spills)."""
    head = tl.program_id(1)
    slot = tl.program_id(0)
    used, first, end = _one_chunk(slot, cu_ptr, chunk_index_ptr, chunk_sequence_ptr, C,
                                  TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    steps = tl.arange(0, C)
    rows_in = (first + steps < end)[:, None]
    k_base = (first * HEADS + head) * K
    A_qk = tl.zeros([C, C], tl.float32)
    A_qb = tl.zeros([C, C], tl.float32)
    A_ak = tl.zeros([C, C], tl.float32)
    A_ab = tl.zeros([C, C], tl.float32)
    for part in tl.static_range(BK // KI):
        k_cols = part * KI + tl.arange(0, KI)
        if K % KI == 0:
            k_in = rows_in
        else:
            k_in = rows_in & (k_cols < K)[None, :]
        k_tile = steps[:, None] * (HEADS * K) + k_cols[None, :]
        A_qk_part, A_qb_part, A_ak_part, A_ab_part = _in_chunk(
            rows(r_ptr, k_base, k_tile, k_in) * scale, rows(k_ptr, k_base, k_tile, k_in),
            rows(a_ptr, k_base, k_tile, k_in), rows(b_ptr, k_base, k_tile, k_in),
            _log_decays(w_ptr, k_base, k_tile, k_in, FLOOR), C, LEVELS, PRECISION)
        A_qk += A_qk_part
        A_qb += A_qb_part
        A_ak += A_ak_part
        A_ab += A_ab_part
    _store_matrices(matrices_ptr, slot, used, head, A_qk, A_qb, A_ak, A_ab, HEADS, C,
                    INVERSE_PRECISION)


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


@triton.jit
def _load_matrix(matrices_ptr, chunk_slot, inside, head, WHICH: tl.constexpr,
                 HEADS: tl.constexpr, C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """One of a chunk's matrices, zeros unless ``inside`` (a prefetch past the sequence)."""
    return tl.load(_matrix(matrices_ptr, chunk_slot, head, WHICH, HEADS, C, TRANSPOSED),
                   mask=inside, other=0.0)


@triton.jit
def _forward_chunk(c, chunks, start, end, first_chunk_slot, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr,
                   b_ptr, matrices_ptr, head, k_tile, k_cols_in, v_tile, v_cols_in,
                   HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                   CHUNK_SLOTS: tl.constexpr):
    """The forward's loads of chunk c: v, w, a, r, k, b as stored and A_ak, (I - A_ab)^-1,
    A_qk, A_qb (zeros past the last chunk)."""
    k_base, k_in, v_base, v_in, inside = _chunk_bases(c, chunks, start, end, head, k_cols_in,
                                                      v_cols_in, HEADS, K, V, C)
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    return (stored(v_ptr + v_base, v_tile, v_in), stored(w_ptr + k_base, k_tile, k_in),
            stored(a_ptr + k_base, k_tile, k_in), stored(r_ptr + k_base, k_tile, k_in),
            stored(k_ptr + k_base, k_tile, k_in), stored(b_ptr + k_base, k_tile, k_in),
            _load_matrix(matrices_ptr, slot, inside, head, A_AK, HEADS, C, False),
            _load_matrix(matrices_ptr, slot, inside, head, INVERSE, HEADS, C, False),
            _load_matrix(matrices_ptr, slot, inside, head, A_QK, HEADS, C, False),
            _load_matrix(matrices_ptr, slot, inside, head, A_QB, HEADS, C, False))


@triton.jit
def _state_gradient_chunk(c, chunks, start, end, first_chunk_slot, r_ptr, w_ptr, a_ptr, b_ptr,
                          do_ptr, matrices_ptr, head, k_tile, k_cols_in, v_tile, v_cols_in,
                          HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          C: tl.constexpr, CHUNK_SLOTS: tl.constexpr):
    """The state gradient's loads of chunk c: dO, w, b, r, a as stored and A_qb^T,
    (I - A_ab)^-T (zeros before the first chunk)."""
    k_base, k_in, v_base, v_in, inside = _chunk_bases(c, chunks, start, end, head, k_cols_in,
                                                      v_cols_in, HEADS, K, V, C)
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    return (stored(do_ptr + v_base, v_tile, v_in), stored(w_ptr + k_base, k_tile, k_in),
            stored(b_ptr + k_base, k_tile, k_in), stored(r_ptr + k_base, k_tile, k_in),
            stored(a_ptr + k_base, k_tile, k_in),
            _load_matrix(matrices_ptr, slot, inside, head, A_QB, HEADS, C, True),
            _load_matrix(matrices_ptr, slot, inside, head, INVERSE, HEADS, C, True))


@triton.jit
def _against(x, tile, ROUNDED: tl.constexpr):
    """x (float32) to multiply a tile as stored (v, dO): rounded to bfloat16 where ROUNDED and
    the tile is bfloat16, so that the product takes 16-bit operands (KernelConfig.rounded);
    else as it is (common.dot then multiplies in float32 at PRECISION)."""
    if ROUNDED and tile.dtype == tl.bfloat16:
        x = x.to(tl.bfloat16)
    return x


# The two sequential passes load every tile and matrix of a chunk first, so that their loads
# are in flight together rather than each before its product (H100, B=8, T=4096, bf16, 4 warps:
# forward 3.86 -> 2.59 ms at K=64 and 5.37 -> 4.48 at K=128, state gradient 3.45 -> 2.57 and
# 4.91 -> 4.29). Up to BK = PREFETCH_UP_TO they go further: the next chunk's loads (c + 1, or
# c - 1 in the reverse pass) are issued at the start of chunk c (``_forward_chunk``,
# ``_state_gradient_chunk``; carried as stored, bfloat16 in half the registers of float32) so
# that their latency overlaps chunk c's products (K=64: forward 3.66 -> 3.28 ms, forward+
# backward 17.37 -> 16.90, session 6's run against session 7's; sm_90, 4 warps: forward 255
# registers and no spills, as before, state gradient 226, was 210). Their tiles are [C, *]:
# held transposed ([K, C], [V, C], the state [V, K]) so that the products have V rows
# (Hopper's warpgroup MMA) they measured slower (K=128 forward 6.57 ms against 5.29, state
# gradient 6.09 against 4.85, loads not first), and at 8 warps the transposed forward failed
# with an illegal memory access (Triton 3.6).

@triton.jit
def rwkv7_forward_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, h0_ptr, matrices_ptr, cu_ptr,    # inputs
    state_index_ptr, chunk_index_ptr,
    o_ptr, ht_ptr, states_ptr, u_ptr,                                           # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, STATE_SLOTS: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    CHUNKS_PER_STATE: tl.constexpr, SAVE: tl.constexpr, PRECISION: tl.constexpr,
    ROUNDED: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks); matrices: the in-chunk kernels', whose slots
    ``chunk_index`` gives. o [rows, HEADS, V]; ht [N, HEADS, K, V] float32; if SAVE: states
    [STATE_SLOTS, HEADS, K, V] float32, the state at the start of every span, and u [rows,
    HEADS, V] float32."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_chunk_slot, h) = _recurrence(cu_ptr, chunk_index_ptr, h0_ptr, HEADS, K, V, BK, BV, C,
                                        TOTAL_ROWS)
    first_slot = tl.load(state_index_ptr + sequence)
    if BK <= PREFETCH_UP_TO:
        v_next, w_next, a_next, r_next, k_next, b_next, A_ak_next, inverse_next, A_qk_next, \
            A_qb_next = _forward_chunk(0, chunks, start, end, first_chunk_slot, r_ptr, w_ptr,
                                       k_ptr, v_ptr, a_ptr, b_ptr, matrices_ptr, head, k_tile,
                                       k_cols_in, v_tile, v_cols_in, HEADS, K, V, C, CHUNK_SLOTS)
    c = 0
    while c < chunks:  # not `for ... in range`: the interpreter cannot take a run-time bound
        if SAVE:
            if c % CHUNKS_PER_STATE == 0:
                slot = clamped(first_slot + c // CHUNKS_PER_STATE, STATE_SLOTS)
                tl.store(_state(states_ptr, slot, head, HEADS, K, V, BK, v_cols), h,
                         mask=state_mask)
        _, _, v_base, v_in, _ = _chunk_bases(c, chunks, start, end, head, k_cols_in, v_cols_in,
                                             HEADS, K, V, C)
        if BK <= PREFETCH_UP_TO:
            v, w, a, q, k, b, A_ak, inverse, A_qk, A_qb = (v_next, w_next, a_next, r_next, k_next,
                                                           b_next, A_ak_next, inverse_next,
                                                           A_qk_next, A_qb_next)
            v_next, w_next, a_next, r_next, k_next, b_next, A_ak_next, inverse_next, \
                A_qk_next, A_qb_next = _forward_chunk(
                    c + 1, chunks, start, end, first_chunk_slot, r_ptr, w_ptr, k_ptr, v_ptr,
                    a_ptr, b_ptr, matrices_ptr, head, k_tile, k_cols_in, v_tile, v_cols_in,
                    HEADS, K, V, C, CHUNK_SLOTS)
        else:
            v, w, a, q, k, b, A_ak, inverse, A_qk, A_qb = _forward_chunk(
                c, chunks, start, end, first_chunk_slot, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr,
                b_ptr, matrices_ptr, head, k_tile, k_cols_in, v_tile, v_cols_in, HEADS, K, V, C,
                CHUNK_SLOTS)
        if not ROUNDED:
            v = v.to(tl.float32)
        w = floored(w.to(tl.float32), FLOOR)
        a = a.to(tl.float32)
        q = q.to(tl.float32) * scale
        k = k.to(tl.float32)
        b = b.to(tl.float32)
        gi, ge, g_end, to_end = _decays(w, 0)
        # X = A_ak V + a~ H, U = (I - A_ab)^-1 X, O = q~ H + A_qk V + A_qb U (V as stored:
        # ``_against``).
        x = tl.dot(a * tl.exp(ge), h, dot(_against(A_ak, v, ROUNDED), v, None, PRECISION),
                   input_precision=PRECISION)
        u = tl.dot(inverse, x, input_precision=PRECISION)
        if SAVE:
            tl.store(u_ptr + v_base + v_tile, u, mask=v_in)
        o = tl.dot(q * tl.exp(gi), h, input_precision=PRECISION)
        o = dot(_against(A_qk, v, ROUNDED), v, o, PRECISION)
        o = tl.dot(A_qb, u, o, input_precision=PRECISION)
        tl.store(o_ptr + v_base + v_tile, o.to(o_ptr.dtype.element_ty), mask=v_in)
        # H' = e^g H + k^T V + b^T U.
        to_end = tl.exp(to_end)
        h = dot(tl.trans(_against(k * to_end, v, ROUNDED)), v, tl.exp(g_end)[:, None] * h,
                PRECISION)
        h = tl.dot(tl.trans(b * to_end), u, h, input_precision=PRECISION)
        c += 1
    tl.store(_state(ht_ptr, sequence, head, HEADS, K, V, BK, v_cols), h, mask=state_mask)


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


# =============================================================================================
# 64-token chunks (docs/RWKV7-CHUNK64.md): the forward in the WY form.
#
# The op's kernels at KernelConfig.chunk = 64, beside the 16-token ones above: three forward
# kernels,
#   1. rwkv7_wy_kernel (parallel, a program per chunk and head): the in-chunk matrices,
#      T = (I - A_ab)^-1, W = T a~ [C, K] and U0 = T A_ak V [C, V] per token, A_qk, A_qb,
#      A_ak and T per chunk ([chunk slots, HEADS, 4, C, C]; the last two for the backward);
#      and the decayed rows q~ = q e^gi, k^ = k e^(g - gi), b^ = b e^(g - gi) per token and
#      e^g per chunk, which every later kernel but the K side reads instead of the decays (no
#      cumulative sums or exponentials in the sequential passes, and 16-bit operands for
#      16-bit inputs);
#   2. rwkv7_wy_state_kernel (sequential, a program per sequence, head and V block): H at every
#      chunk's start, U = W H + U0 and H' = e^g H + k^T V + b^T U (no [C, C] matrix);
#   3. rwkv7_wy_output_kernel (parallel, a program per chunk, head and V block):
#      O = q~ H + A_qk V + A_qb U from the chunk's saved H.
# and the backward's (below):
#   4. rwkv7_wy_state_gradient_kernel (sequential, reverse): dH' per chunk, dU, dh0;
#   5. rwkv7_wy_value_gradient_kernel (parallel, per chunk, head and V block): dX, dV;
#   6. rwkv7_wy_key_gradient_kernel (parallel, per chunk, head and block of keys, over all of
#      V inside): dr, dw, dk, da, db.
# Chunk slots are those of the 16-token kernels' in-chunk buffer, at C = 64 (``_chunk_rows``):
# ``chunk_index[n]`` is sequence n's first, ``chunk_sequence[s]`` the sequence of slot s (-1
# past the last chunk: such slots read and write nothing).
# =============================================================================================

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
    ``_wy_log_decay_sums``). Operands stay float32 (tf32): rounding the factored tiles to bf16
    took the output's error on the interpreter from 3.3e-3 to 8.9e-3 (bf16 inputs, K=64 and
    128, T=256). Else exact for every decay, in blocks of BLOCK = 2^BLOCK_LEVELS rows (the
    plan's 16-token blocks): row block J meets the columns of every earlier block with the
    factor split at J's start s, e^(gi_t - gi_s) * e^(gi_s - gi_i), each <= 1 and each a sum of
    log decays (J's own inclusive sums; the reverse sums of i's block plus the totals of the
    blocks between), in one product per row block whose operands are zero outside its rows and
    columns (so it adds into the sums with no mask); then the diagonal blocks level by level
    inside them (``_level``, one mask per level)."""
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
    float32 loses everything where consecutive keys are correlated (numpy, float32, zero decay,
    keys at correlation 0.8: relative error of T 2e8 by squaring, 4e-5 blockwise, 1e-7 by
    substitution). Blockwise, the chains are at most 15 factors inside a block (as the 16-token
    kernels' inverse) and 3 between blocks, each between inverses that are themselves small.
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
    stores A_ak, W, U0 and, for the backward (RESIDUALS), T. A_ak goes to memory before the inverse and comes back after W
    (T A_ak, then U0 per VI columns of V): at most two [C, C] tiles beside the inverse's."""
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
    WY transform and one for the queries' matrices and the decayed rows (H100, the forward with
    its residuals: K=128 8.26 -> 7.50 ms, K=64 5.81 -> 5.62 against one program per chunk; the
    two share the chunk's tiles through L2, and each holds fewer registers live than both). wy
    [rows, HEADS, K]: W = T a~; u0 [rows, HEADS, V]: U0 = T A_ak V; matrices [chunk slots, HEADS,
    4, C, C]: A_qk, A_qb, A_ak, T (``_wy_matrix``; the last two only the backward reads, and T is
written only for it, RESIDUALS: A_ak is also this kernel's own scratch); qd,
    kd, bd [rows, HEADS, K]: the decayed rows q~ = scale r e^gi, k^ = k e^(g - gi),
    b^ = b e^(g - gi), and decay [chunk slots, HEADS, K] float32: e^g, which the later kernels
    read instead of the decays. Each float32 or bfloat16, rounded once from its float32 value.
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


@triton.jit
def _wy_decay(decay_ptr, slot, head, HEADS: tl.constexpr, K: tl.constexpr, k_cols):
    """Pointers to a chunk's e^g (``rwkv7_wy_kernel``) at K columns k_cols."""
    return decay_ptr + (slot.to(tl.int64) * HEADS + head) * K + k_cols


@triton.jit
def _wy_state_half(ptr, slot, head, half: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, HALF: tl.constexpr, v_cols, v_cols_in):
    """Pointers to K rows half * HALF, ... of a [K, V] state's columns v_cols, and their mask
    (none of a half past K)."""
    k_rows = half * HALF + tl.arange(0, HALF)
    return (_state(ptr + half * HALF * V, slot, head, HEADS, K, V, HALF, v_cols),
            in_range(k_rows, K, HALF)[:, None] & v_cols_in)


@triton.jit
def _wy_state_half_product(h, half: tl.constexpr, x, x_ptr, k_base, rows_in, HEADS: tl.constexpr,
                           K: tl.constexpr, HALF: tl.constexpr, C: tl.constexpr,
                           PRECISION: tl.constexpr):
    """x + X_half H_half for a [C, K] buffer X as stored (W, or q~), H's half (K rows
    half * HALF, ...) rounded to X's dtype, as the state it would have been stored as."""
    base, tile, k_in = _k_part(half, k_base, rows_in, tl.arange(0, C), HEADS, K, HALF)
    rows_x = stored(x_ptr + base, tile, k_in)
    return dot(rows_x, h.to(rows_x.dtype), x, PRECISION)


@triton.jit
def _wy_outputs(o, v, u, matrices_ptr, slot, used, head, o_ptr, v_base, v_tile, v_in,
                HEADS: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """O = o + A_qk V + A_qb U stored in o's rows (o: q~ H), one [C, C] matrix live at a time."""
    o = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_QK, HEADS, C, False), v, o, PRECISION)
    o = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_QB, HEADS, C, False), u, o, PRECISION)
    tl.store(o_ptr + v_base + v_tile, o.to(o_ptr.dtype.element_ty), mask=v_in)


@triton.jit
def _wy_state_update(h, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, k_base, k_tile, k_in,
                     k_cols, k_cols_in, HEADS: tl.constexpr, K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """H' = e^g H + k^T V + b^T U over the K rows k_cols (all of BK, or a half), from the
    decayed rows (``rwkv7_wy_kernel``): k^ and V multiply as stored, b^ against the
    float32 U at PRECISION (U carries the state: not rounded)."""
    decay = tl.load(_wy_decay(decay_ptr, slot, head, HEADS, K, k_cols), mask=k_cols_in,
                    other=0.0)
    h = dot(tl.trans(stored(kd_ptr + k_base, k_tile, k_in)), v, decay[:, None] * h, PRECISION)
    return dot(tl.trans(rows(bd_ptr, k_base, k_tile, k_in)), u, h, PRECISION)


@triton.jit
def _wy_state_half_update(h, half: tl.constexpr, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head,
                          k_base, rows_in, HEADS: tl.constexpr, K: tl.constexpr,
                          HALF: tl.constexpr, C: tl.constexpr, PRECISION: tl.constexpr):
    """One half of H' (K rows half * HALF, ...): ``_wy_state_update`` on the half's columns."""
    base, tile, k_in = _k_part(half, k_base, rows_in, tl.arange(0, C), HEADS, K, HALF)
    k_cols = half * HALF + tl.arange(0, HALF)
    return _wy_state_update(h, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, base, tile, k_in,
                            k_cols, in_range(k_cols, K, HALF), HEADS, K, PRECISION)


@triton.jit
def _wy_state_halves_step(c, h_low, h_high, first_chunk_slot, start, end, head, v_tile, v_cols,
                          v_cols_in, kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, qd_ptr,
                          matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, HALF: tl.constexpr, C: tl.constexpr,
                          CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
                          OUTPUTS: tl.constexpr):
    """Chunk c of the state pass with H in two halves of HALF K rows (BK = 2 HALF):
    U = U0 + sum of W_half H_half; the chunk's outputs (OUTPUTS) or both halves and U stored;
    H' per half."""
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    first = start + c * C
    rows_in = (first + tl.arange(0, C) < end)[:, None]
    k_base = (first * HEADS + head) * K
    v_base = (first * HEADS + head) * V
    v_in = rows_in & v_cols_in
    if not OUTPUTS:
        pointers, mask = _wy_state_half(states_ptr, slot, head, 0, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, h_low.to(states_ptr.dtype.element_ty), mask=mask)
        pointers, mask = _wy_state_half(states_ptr, slot, head, 1, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, h_high.to(states_ptr.dtype.element_ty), mask=mask)
    u = rows(u0_ptr, v_base, v_tile, v_in)
    u = _wy_state_half_product(h_low, 0, u, wy_ptr, k_base, rows_in, HEADS, K, HALF, C,
                               PRECISION)
    u = _wy_state_half_product(h_high, 1, u, wy_ptr, k_base, rows_in, HEADS, K, HALF, C,
                               PRECISION)
    v = stored(v_ptr + v_base, v_tile, v_in)
    if OUTPUTS:
        o = _wy_state_half_product(h_low, 0, None, qd_ptr, k_base, rows_in, HEADS, K, HALF, C,
                                   PRECISION)
        o = _wy_state_half_product(h_high, 1, o, qd_ptr, k_base, rows_in, HEADS, K, HALF, C,
                                   PRECISION)
        _wy_outputs(o, v, u, matrices_ptr, slot, True, head, o_ptr, v_base, v_tile, v_in, HEADS,
                    C, PRECISION)
    else:
        _wy_store(u_ptr + v_base, v_tile, u, v_in)
    h_low = _wy_state_half_update(h_low, 0, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, k_base,
                                  rows_in, HEADS, K, HALF, C, PRECISION)
    h_high = _wy_state_half_update(h_high, 1, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head,
                                   k_base, rows_in, HEADS, K, HALF, C, PRECISION)
    return h_low, h_high


@triton.jit
def _wy_rows(wy_ptr, c, chunks, start, end, head, k_tile, k_cols_in, v_cols_in,
             HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """Chunk c's W as stored (zeros past the sequence: the last chunk's prefetch)."""
    k_base, k_in, _, _, _ = _chunk_bases(c, chunks, start, end, head, k_cols_in, v_cols_in,
                                         HEADS, K, V, C)
    return stored(wy_ptr + k_base, k_tile, k_in)


@triton.jit
def _wy_state_step(c, h, wy, first_chunk_slot, start, end, head, k_tile, k_cols_in, v_tile,
                   v_cols, v_cols_in, state_mask, kd_ptr, v_ptr, bd_ptr, decay_ptr, u0_ptr,
                   qd_ptr, matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                   CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr, OUTPUTS: tl.constexpr):
    """Chunk c of the state pass (BK <= 64) from its start state h and its W (as stored):
    U = W H + U0; the chunk's outputs (OUTPUTS) or H and U stored; returns H'."""
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    if not OUTPUTS:
        tl.store(_state(states_ptr, slot, head, HEADS, K, V, BK, v_cols),
                 h.to(states_ptr.dtype.element_ty), mask=state_mask)
    k_base, k_in, v_base, v_in = row_bases(start + c * C, end, head, k_cols_in, v_cols_in,
                                            HEADS, K, V, C, False)
    u = dot(wy, h.to(wy.dtype), rows(u0_ptr, v_base, v_tile, v_in), PRECISION)
    v = stored(v_ptr + v_base, v_tile, v_in)
    if OUTPUTS:
        qd = stored(qd_ptr + k_base, k_tile, k_in)
        _wy_outputs(dot(qd, h.to(qd.dtype), None, PRECISION), v, u, matrices_ptr, slot, True,
                    head, o_ptr, v_base, v_tile, v_in, HEADS, C, PRECISION)
    else:
        _wy_store(u_ptr + v_base, v_tile, u, v_in)
    return _wy_state_update(h, v, u, kd_ptr, bd_ptr, decay_ptr, slot, head, k_base, k_tile, k_in,
                            tl.arange(0, BK), in_range(tl.arange(0, BK), K, BK), HEADS, K,
                            PRECISION)


@triton.jit
def rwkv7_wy_state_kernel(
    kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, h0_ptr, cu_ptr, chunk_index_ptr,
    qd_ptr, matrices_ptr,                                                        # inputs
    ht_ptr, states_ptr, u_ptr, o_ptr,                                            # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr, PIPELINED: tl.constexpr,
    OUTPUTS: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks of BV): the state recurrence, chunk by chunk, carrying
    H in float32. h0, ht [N, HEADS, K, V] float32; U = W H + U0, with H rounded to W's dtype
    (as it is stored: bfloat16 W and H multiply at the bfloat16 rate). Then H' = e^g H +
    k^T V + b^T U from the decayed rows k^, b^ and e^g of ``rwkv7_wy_kernel``
    (``_wy_state_update``).

    Each chunk's H and U go either to the outputs kernel and the backward (states [chunk
    slots, HEADS, K, V]: H at the start of every chunk, in its chunk slot; u [rows, HEADS, V])
    or, for a call that is not differentiated (OUTPUTS), straight into the chunk's outputs
    O = q~ H + A_qk V + A_qb U (o [rows, HEADS, V]; q~, A_qk, A_qb of ``rwkv7_wy_kernel``),
    computed the way ``rwkv7_wy_output_kernel`` computes them: no H or U goes to memory and
    back, and the outputs need no launch of their own. The other mode's pointers are unread
    and unwritten (any array).

    PIPELINED: on the GPU the loop over chunks is a ``for`` that Triton pipelines (the launch's
    num_stages: the next chunks' loads, which do not depend on H, in flight in shared memory
    during this chunk's products); else a ``while`` (always in the interpreter, whose ``range``
    takes no run-time bound) in which, at BK <= 64, the next chunk's W is loaded
    before this chunk's products (carried in the loop, as stored) so that its latency overlaps
    the serial chain H -> U -> H'. Past 64 keys H is carried as two halves of 64 K rows
    (``_wy_state_halves_step``). sm_90 spills, 4 / 8 warps (benchmarks/compile_report.py):
    see forward_chunk64."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_chunk_slot, h) = _recurrence(cu_ptr, chunk_index_ptr, h0_ptr, HEADS, K, V, BK, BV, C,
                                        TOTAL_ROWS)
    # Past 64 keys, H is carried as two halves of HALF = 64 K rows, so that only one half's
    # [C, 64] decays, k^ and b^ are live at a time (whole [C, 128] tiles spilled 280-696 B).
    HALF: tl.constexpr = 64
    if BK > HALF:
        tl.static_assert(BK == 2 * HALF)
        pointers, mask = _wy_state_half(h0_ptr, sequence, head, 0, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        h_low = tl.load(pointers, mask=mask, other=0.0)
        pointers, mask = _wy_state_half(h0_ptr, sequence, head, 1, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        h_high = tl.load(pointers, mask=mask, other=0.0)
        if INTERPRETED or not PIPELINED:
            c = 0
            while c < chunks:
                h_low, h_high = _wy_state_halves_step(
                    c, h_low, h_high, first_chunk_slot, start, end, head, v_tile, v_cols,
                    v_cols_in, kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, qd_ptr,
                    matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS, K, V, HALF, C, CHUNK_SLOTS,
                    PRECISION, OUTPUTS)
                c += 1
        else:
            for c in range(chunks):
                h_low, h_high = _wy_state_halves_step(
                    c, h_low, h_high, first_chunk_slot, start, end, head, v_tile, v_cols,
                    v_cols_in, kd_ptr, v_ptr, bd_ptr, decay_ptr, wy_ptr, u0_ptr, qd_ptr,
                    matrices_ptr, states_ptr, u_ptr, o_ptr, HEADS, K, V, HALF, C, CHUNK_SLOTS,
                    PRECISION, OUTPUTS)
        pointers, mask = _wy_state_half(ht_ptr, sequence, head, 0, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, h_low, mask=mask)
        pointers, mask = _wy_state_half(ht_ptr, sequence, head, 1, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, h_high, mask=mask)
    else:
        if INTERPRETED or not PIPELINED:
            wy_next = _wy_rows(wy_ptr, 0, chunks, start, end, head, k_tile, k_cols_in,
                               v_cols_in, HEADS, K, V, C)
            c = 0
            while c < chunks:
                wy = wy_next
                wy_next = _wy_rows(wy_ptr, c + 1, chunks, start, end, head, k_tile, k_cols_in,
                                   v_cols_in, HEADS, K, V, C)
                h = _wy_state_step(c, h, wy, first_chunk_slot, start, end, head, k_tile,
                                   k_cols_in, v_tile, v_cols, v_cols_in, state_mask, kd_ptr,
                                   v_ptr, bd_ptr, decay_ptr, u0_ptr, qd_ptr, matrices_ptr,
                                   states_ptr, u_ptr, o_ptr, HEADS, K, V, BK, C, CHUNK_SLOTS,
                                   PRECISION, OUTPUTS)
                c += 1
        else:  # (no W carried by hand: the pipeline loads it ahead, with the other tiles)
            for c in range(chunks):
                wy = _wy_rows(wy_ptr, c, chunks, start, end, head, k_tile, k_cols_in,
                              v_cols_in, HEADS, K, V, C)
                h = _wy_state_step(c, h, wy, first_chunk_slot, start, end, head, k_tile,
                                   k_cols_in, v_tile, v_cols, v_cols_in, state_mask, kd_ptr,
                                   v_ptr, bd_ptr, decay_ptr, u0_ptr, qd_ptr, matrices_ptr,
                                   states_ptr, u_ptr, o_ptr, HEADS, K, V, BK, C, CHUNK_SLOTS,
                                   PRECISION, OUTPUTS)
        tl.store(_state(ht_ptr, sequence, head, HEADS, K, V, BK, v_cols), h, mask=state_mask)


@triton.jit
def rwkv7_wy_output_kernel(
    qd_ptr, v_ptr, u_ptr, states_ptr, matrices_ptr, cu_ptr, chunk_index_ptr,
    chunk_sequence_ptr,                                                          # inputs
    o_ptr,                                                                       # output
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (chunk slots * V blocks of BV, HEADS): O = q~ H + A_qk V + A_qb U, all chunks at
    once, from the chunk's H saved by the state pass (in the same chunk slot) and its q~, A_qk
    and A_qb (``rwkv7_wy_kernel``). o [rows, HEADS, V] in its dtype. Each product takes its
    tiles as stored (``dot``)."""
    (slot, head, used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, k_base, k_in, v_base,
     v_in) = _wy_chunk_program(cu_ptr, chunk_index_ptr, chunk_sequence_ptr, HEADS, K, V, BK, BV,
                               C, TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    h = tl.load(_state(states_ptr, slot, head, HEADS, K, V, BK, v_cols),
                mask=(tl.trans(k_cols_in) & v_cols_in) & used, other=0.0)
    _wy_outputs(dot(stored(qd_ptr + k_base, k_tile, k_in), h, None, PRECISION),
                stored(v_ptr + v_base, v_tile, v_in), stored(u_ptr + v_base, v_tile, v_in),
                matrices_ptr, slot, used, head, o_ptr, v_base, v_tile, v_in, HEADS, C, PRECISION)


# The 64-token backward: the state-gradient pass
# and the V-side gradients. Given dO and the gradient dH' of a chunk's end state:
#   dU = A_qb^T dO + b^ dH',  dX = T^T dU  (U = T X, X = a~ H + A_ak V),
#   dH = e^g dH' + q~^T dO + W^T dU  (a~^T T^T = W^T: no [C, C] matrix in the recurrence),
#   dV = A_qk^T dO + A_ak^T dX + k^ dH'.
# The K-side gradients (kernel 6, below) read dX, dH' and the forward's H and U.

@triton.jit
def _wy_du_part(du, dh, bd_ptr, k_base, k_tile, k_in, PRECISION: tl.constexpr):
    """du + b^ dH' (du None: b^ dH') over one part of the K columns (the state gradient's
    [C, KP] tiles, its [KP, BV] rows of dH'); b^ as ``rwkv7_wy_kernel`` stored it,
    against the float32 dH' at PRECISION."""
    return dot(rows(bd_ptr, k_base, k_tile, k_in), dh, du, PRECISION)


@triton.jit
def _wy_dh_part(dh, do, du, qd_ptr, decay_ptr, wy_ptr, slot, head, k_base, k_tile, k_in, k_cols,
                PART: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr,
                PRECISION: tl.constexpr):
    """e^g dH' + W^T dU + q~^T dO over one part of PART K columns (its rows of dH', k_cols):
    the gradient of the chunk's start state there. q~ and dO multiply as stored."""
    decay = tl.load(_wy_decay(decay_ptr, slot, head, HEADS, K, k_cols),
                    mask=in_range(k_cols, K, PART), other=0.0)
    dh = dot(tl.trans(stored(wy_ptr + k_base, k_tile, k_in)), du, decay[:, None] * dh,
             PRECISION)
    return dot(tl.trans(stored(qd_ptr + k_base, k_tile, k_in)), do, dh, PRECISION)


@triton.jit
def _wy_state_gradient_step(c, dh_lo, dh_hi, first_chunk_slot, start, end, head, k_tile,
                            k_cols_in, hi_cols_in, v_tile, v_cols, v_cols_in, state_mask, qd_ptr,
                            bd_ptr, decay_ptr, do_ptr, wy_ptr, matrices_ptr, dstates_ptr, du_ptr,
                            HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                            BK: tl.constexpr, C: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
                            PRECISION: tl.constexpr, HALVES: tl.constexpr):
    """Chunk c of the state-gradient pass from dH' (the gradient of its end state: dh_lo, or
    the two halves dh_lo and dh_hi of HALF K rows when HALVES): dH' stored in the chunk's slot,
    dU = b^ dH' + A_qb^T dO stored; returns dH, the gradient of its start state (the halves;
    dh_hi passed through unused without HALVES)."""
    HALF: tl.constexpr = BK // 2
    slot = clamped(first_chunk_slot + c, CHUNK_SLOTS)
    k_base, k_in, v_base, v_in = row_bases(start + c * C, end, head, k_cols_in, v_cols_in,
                                            HEADS, K, V, C, False)
    if HALVES:
        hi_in = row_bases(start + c * C, end, head, hi_cols_in, v_cols_in, HEADS, K, V, C,
                          False)[1]
        pointers, mask = _wy_state_half(dstates_ptr, slot, head, 0, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, dh_lo.to(dstates_ptr.dtype.element_ty), mask=mask)
        pointers, mask = _wy_state_half(dstates_ptr, slot, head, 1, HEADS, K, V, HALF,
                                        v_cols, v_cols_in)
        tl.store(pointers, dh_hi.to(dstates_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(_state(dstates_ptr, slot, head, HEADS, K, V, BK, v_cols),
                 dh_lo.to(dstates_ptr.dtype.element_ty), mask=state_mask)
    do = stored(do_ptr + v_base, v_tile, v_in)
    # dU = b^ dH' + A_qb^T dO
    du = _wy_du_part(None, dh_lo, bd_ptr, k_base, k_tile, k_in, PRECISION)
    if HALVES:
        du = _wy_du_part(du, dh_hi, bd_ptr, k_base + HALF, k_tile, hi_in, PRECISION)
    du = dot(tl.load(_wy_matrix(matrices_ptr, slot, head, WY_A_QB, HEADS, C, True)), do, du,
             PRECISION)
    du = du.to(du_ptr.dtype.element_ty)
    tl.store(du_ptr + v_base + v_tile, du, mask=v_in)
    LOW: tl.constexpr = HALF if HALVES else BK
    dh_lo = _wy_dh_part(dh_lo, do, du, qd_ptr, decay_ptr, wy_ptr, slot, head, k_base, k_tile,
                        k_in, tl.arange(0, LOW), LOW, HEADS, K, PRECISION)
    if HALVES:
        dh_hi = _wy_dh_part(dh_hi, do, du, qd_ptr, decay_ptr, wy_ptr, slot, head, k_base + HALF,
                            k_tile, hi_in, HALF + tl.arange(0, HALF), HALF, HEADS, K, PRECISION)
    return dh_lo, dh_hi


@triton.jit
def rwkv7_wy_state_gradient_kernel(
    qd_ptr, bd_ptr, decay_ptr, do_ptr, wy_ptr, matrices_ptr, dht_ptr, cu_ptr,     # inputs
    chunk_index_ptr,
    dh0_ptr, dstates_ptr, du_ptr,                                                 # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
    PIPELINED: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks of BV): the reverse recurrence, from each sequence's
    last chunk, carrying dH in float32 (from dht [N, HEADS, K, V]). dstates [chunk slots, HEADS,
    K, V] (the backend's float32): dH' (the gradient of the chunk's end state) in every chunk's
    slot; du [rows, HEADS, V] (the backend's float32): dU, and as stored in W^T dU; dh0
    [N, HEADS, K, V] float32. wy and matrices: the forward's (``rwkv7_wy_kernel``);
    A_qb^T dO multiplies them as stored. q~, b^ and e^g: ``rwkv7_wy_kernel``'s.

    Above BK = 64, K in two halves of BK / 2 columns (dH carried as two tiles, dh_lo and
    dh_hi): every K column's decays are its own, so each half's are exact, and one half's
    [C, BK / 2] tiles are live at a time (``_wy_du_part``, then ``_wy_dh_part``, once per
    half; masked columns past K read and write nothing). A_qb^T dO is added last to dU, after
    the products with dH', and W^T dU before q~^T dO to dH: sm_90, bf16, spill stores at 4 / 8
    warps (all at 255 registers), K=128 44 / 216 B (on [C, 128] tiles 1720 / 912 B; A_qb^T dO
    first 140 / 356 B; q~^T dO first 164 / 240 B), K=64 none (A_qb^T dO first 0 / 232 B; on
    the one tile before, 112 / 184 B). (Carrying the previous chunk's W through the loop
    spilled: K=64 4 warps 64 -> 380 B, K=128 8 warps 828 -> 1028 B, on [C, 128] tiles.)

    PIPELINED: on the GPU the loop over chunks is a ``for`` that Triton pipelines (num_stages:
    the earlier chunks' loads, which do not depend on dH, in flight during this chunk's
    products); else a ``while`` (always in the interpreter, whose ``range`` takes no run-time
    bound)."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_chunk_slot, dh_lo) = _recurrence(cu_ptr, chunk_index_ptr, dht_ptr, HEADS, K, V, BK,
                                            BV, C, TOTAL_ROWS)
    HALVES: tl.constexpr = BK > 64
    HALF: tl.constexpr = BK // 2
    hi_cols_in = k_cols_in
    dh_hi = 0.0  # (carried unused without HALVES)
    if HALVES:  # (the [BK, BV] tile _recurrence loaded is then replaced by the halves)
        # the halves' tiles: the same offsets, the upper half's columns HALF later in the base;
        # 64-bit offsets (each thread's then differ by constants: K=128, 4 warps, 396 -> 140 B
        # of spills with A_qb^T dO first, against 32-bit ones widened per element)
        half_cols = tl.arange(0, HALF)
        k_tile = tl.arange(0, C).to(tl.int64)[:, None] * (HEADS * K) + half_cols[None, :]
        k_cols_in = in_range(half_cols, K, HALF)[None, :]
        hi_cols_in = in_range(HALF + half_cols, K, HALF)[None, :]
        pointers, mask = _wy_state_half(dht_ptr, sequence, head, 0, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        dh_lo = tl.load(pointers, mask=mask, other=0.0)
        pointers, mask = _wy_state_half(dht_ptr, sequence, head, 1, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        dh_hi = tl.load(pointers, mask=mask, other=0.0)
    if INTERPRETED or not PIPELINED:
        c = chunks - 1
        while c >= 0:
            dh_lo, dh_hi = _wy_state_gradient_step(
                c, dh_lo, dh_hi, first_chunk_slot, start, end, head, k_tile, k_cols_in,
                hi_cols_in, v_tile, v_cols, v_cols_in, state_mask, qd_ptr, bd_ptr, decay_ptr,
                do_ptr, wy_ptr, matrices_ptr, dstates_ptr, du_ptr, HEADS, K, V, BK, C,
                CHUNK_SLOTS, PRECISION, HALVES)
            c -= 1
    else:
        for step in range(chunks):
            dh_lo, dh_hi = _wy_state_gradient_step(
                chunks - 1 - step, dh_lo, dh_hi, first_chunk_slot, start, end, head, k_tile,
                k_cols_in, hi_cols_in, v_tile, v_cols, v_cols_in, state_mask, qd_ptr, bd_ptr,
                decay_ptr, do_ptr, wy_ptr, matrices_ptr, dstates_ptr, du_ptr, HEADS, K, V, BK, C,
                CHUNK_SLOTS, PRECISION, HALVES)
    if HALVES:
        pointers, mask = _wy_state_half(dh0_ptr, sequence, head, 0, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, dh_lo, mask=mask)
        pointers, mask = _wy_state_half(dh0_ptr, sequence, head, 1, HEADS, K, V, HALF, v_cols,
                                        v_cols_in)
        tl.store(pointers, dh_hi, mask=mask)
    else:
        tl.store(_state(dh0_ptr, sequence, head, HEADS, K, V, BK, v_cols), dh_lo,
                 mask=state_mask)


@triton.jit
def rwkv7_wy_value_gradient_kernel(
    kd_ptr, do_ptr, du_ptr, dstates_ptr, matrices_ptr, cu_ptr, chunk_index_ptr,
    chunk_sequence_ptr,                                                          # inputs
    dv_ptr, dx_ptr,                                                              # outputs
    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, TOTAL_ROWS: tl.constexpr,
    SEQUENCES: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (chunk slots * V blocks of BV, HEADS), all chunks at once: dX = T^T dU and
    dV = A_qk^T dO + A_ak^T dX + k^ dH', from the state-gradient pass's dU and dH' (same chunk
    slot), the forward's matrices and k^ (``rwkv7_wy_kernel``). dv [rows, HEADS, V] in its
    dtype; dx [rows, HEADS, V] (the backend's float32), and as stored in dV (as the K side
    reads it).
    The matrices, dU, dO and dX multiply as stored (``dot``). An unused slot reads and writes
    nothing."""
    (slot, head, used, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, k_base, k_in, v_base,
     v_in) = _wy_chunk_program(cu_ptr, chunk_index_ptr, chunk_sequence_ptr, HEADS, K, V, BK, BV,
                               C, TOTAL_ROWS, SEQUENCES, CHUNK_SLOTS)
    dx = dot(_wy_load(matrices_ptr, slot, used, head, WY_T, HEADS, C, True),
             stored(du_ptr + v_base, v_tile, v_in), None, PRECISION)
    dx = dx.to(dx_ptr.dtype.element_ty)
    tl.store(dx_ptr + v_base + v_tile, dx, mask=v_in)
    dv = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_QK, HEADS, C, True),
             stored(do_ptr + v_base, v_tile, v_in), None, PRECISION)
    dv = dot(_wy_load(matrices_ptr, slot, used, head, WY_A_AK, HEADS, C, True), dx, dv,
             PRECISION)
    dh = tl.load(_state(dstates_ptr, slot, head, HEADS, K, V, BK, v_cols),
                 mask=(tl.trans(k_cols_in) & v_cols_in) & used, other=0.0)
    dv = dot(rows(kd_ptr, k_base, k_tile, k_in), dh, dv, PRECISION)
    tl.store(dv_ptr + v_base + v_tile, dv.to(dv_ptr.dtype.element_ty), mask=v_in)




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

"""The 16-token kernels' forward: the in-chunk matrices of every 16-token chunk (tame and exact
paths) and the sequential forward that reads them; a call that is differentiated takes the
64-token kernels.

Two phases, so that only the recurrence is sequential and it builds nothing per chunk:

0. in-chunk: all chunks at once, each chunk's (I - A_ab)^-1, A_qb, A_ak, A_qk (float32,
   [C, C] each: 64 floats per token and head, read by every V block of the forward):
   ``rwkv7_tame_in_chunk_kernel`` (GROUP chunks per program, batched products) or
   ``rwkv7_in_chunk_kernel`` (level by level, one chunk per program).
1. forward: one program per (sequence, head, block of V columns) walks its chunks in order,
   keeping H in registers: X = A_ak V + a~ H, U = (I - A_ab)^-1 X, O and H' as above, with
   e^gi, e^ge, e^(g - gi) from one cumulative sum of w.

Sequences are rows [cu[n], cu[n+1]) of the flattened [rows, heads, *] inputs (fixed-length
batches are the special case cu = arange(B + 1) * T); ``chunk_index[n]`` is sequence n's first
slot in the in-chunk buffer.
"""

import triton
import triton.language as tl

from ..common import (PREFETCH_UP_TO, clamped, diagonal_tile as _diagonal, dot, floored,
                      level_factors as _level, rows, stored)
from .chunks import (_inverse_unit_lower, _log_decays, _chunk_rows, _one_chunk, _state,
                     _recurrence, _chunk_bases)


@triton.jit
def _decays(w, AXIS: tl.constexpr):
    """Inclusive and exclusive cumulative log decays of a chunk whose steps run along AXIS, its
    total g, and g - gi (summed from the end, not subtracted: precise where gi is large)."""
    gi = tl.cumsum(w, axis=AXIS)
    return gi, gi - w, tl.sum(w, axis=AXIS), tl.cumsum(w, axis=AXIS, reverse=True) - w


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


@triton.jit
def _matrices_over_key_parts(r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, row_bases, rows_in, scale,
                             K: tl.constexpr, BK: tl.constexpr, KI: tl.constexpr,
                             C: tl.constexpr, LEVELS: tl.constexpr, FLOOR: tl.constexpr,
                             PRECISION: tl.constexpr, TAME: tl.constexpr):
    """A_qk, A_qb, A_ak, A_ab summed over the K columns KI at a time (fewer registers), from
    rows at ``row_bases`` ([C, 1], or [G, C, 1] for G tame chunks): ``_tame_chunks`` or, for
    the exact path, ``_in_chunk``."""
    for part in tl.static_range(BK // KI):
        k_cols = part * KI + tl.arange(0, KI)
        if K % KI == 0:
            k_in = rows_in
        else:
            k_in = rows_in & (k_cols < K)
        q = rows(r_ptr, row_bases, k_cols, k_in) * scale
        k = rows(k_ptr, row_bases, k_cols, k_in)
        a = rows(a_ptr, row_bases, k_cols, k_in)
        b = rows(b_ptr, row_bases, k_cols, k_in)
        w = _log_decays(w_ptr, row_bases, k_cols, k_in, FLOOR)
        if TAME:
            p_qk, p_qb, p_ak, p_ab = _tame_chunks(q, k, a, b, w, C, PRECISION)
        else:
            p_qk, p_qb, p_ak, p_ab = _in_chunk(q, k, a, b, w, C, LEVELS, PRECISION)
        if part == 0:
            A_qk, A_qb, A_ak, A_ab = p_qk, p_qb, p_ak, p_ab
        else:
            A_qk, A_qb, A_ak, A_ab = A_qk + p_qk, A_qb + p_qb, A_ak + p_ak, A_ab + p_ab
    return A_qk, A_qb, A_ak, A_ab


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
    A_qk, A_qb, A_ak, A_ab = _matrices_over_key_parts(
        r_ptr, w_ptr, k_ptr, a_ptr, b_ptr, ((row * HEADS + head) * K)[:, :, None], rows_in,
        scale, K, BK, KI, C, 0, FLOOR, PRECISION, True)
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
    A_qk, A_qb, A_ak, A_ab = _matrices_over_key_parts(
        r_ptr, w_ptr, k_ptr, a_ptr, b_ptr,
        ((first * HEADS + head) * K + steps * (HEADS * K))[:, None], (first + steps < end)[:, None],
        scale, K, BK, KI, C, LEVELS, FLOOR, PRECISION, False)
    _store_matrices(matrices_ptr, slot, used, head, A_qk, A_qb, A_ak, A_ab, HEADS, C,
                    INVERSE_PRECISION)


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
def _against(x, tile, ROUNDED: tl.constexpr):
    """x (float32) to multiply a tile as stored (v, dO): rounded to bfloat16 where ROUNDED and
    the tile is bfloat16, so that the product takes 16-bit operands (KernelConfig.rounded);
    else as it is (common.dot then multiplies in float32 at PRECISION)."""
    if ROUNDED and tile.dtype == tl.bfloat16:
        x = x.to(tl.bfloat16)
    return x


# The forward loads every tile and matrix of a chunk first, so that their loads are in flight
# together rather than each before its product; up to BK = PREFETCH_UP_TO it issues the next
# chunk's loads at the start of this one (``_forward_chunk``; carried as stored, bfloat16 in half
# the registers of float32) so that their latency overlaps this chunk's products. Its tiles are
# [C, *]: held transposed (so that the products have V rows, for Hopper's warpgroup MMA) it was
# slower. Measurements: BENCHMARKS.md, "Decisions that shaped the kernels".

@triton.jit
def rwkv7_forward_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, h0_ptr, matrices_ptr, cu_ptr,    # inputs
    chunk_index_ptr,
    o_ptr, ht_ptr,                                                              # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, FLOOR: tl.constexpr,
    TOTAL_ROWS: tl.constexpr, CHUNK_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
    ROUNDED: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks); matrices: the in-chunk kernels', whose slots
    ``chunk_index`` gives. o [rows, HEADS, V]; ht [N, HEADS, K, V] float32."""
    (sequence, head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end, chunks,
     first_chunk_slot, h) = _recurrence(cu_ptr, chunk_index_ptr, h0_ptr, HEADS, K, V, BK, BV, C,
                                        TOTAL_ROWS)
    if BK <= PREFETCH_UP_TO:
        v_next, w_next, a_next, r_next, k_next, b_next, A_ak_next, inverse_next, A_qk_next, \
            A_qb_next = _forward_chunk(0, chunks, start, end, first_chunk_slot, r_ptr, w_ptr,
                                       k_ptr, v_ptr, a_ptr, b_ptr, matrices_ptr, head, k_tile,
                                       k_cols_in, v_tile, v_cols_in, HEADS, K, V, C, CHUNK_SLOTS)
    c = 0
    while c < chunks:  # not `for ... in range`: the interpreter cannot take a run-time bound
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

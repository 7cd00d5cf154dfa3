"""Tile addressing shared by the chunked kernels (every op family).

The kernels see inputs flattened to rows ``[rows, HEADS, *]`` and a list of sequences ``cu``
(``cu_seqlens``, or ``arange(B + 1) * T`` for a plain batch). A chunk's tiles are addressed as a
scalar row base plus offsets within a chunk that are the same for every chunk (computed once per
program), and masks are row masks unless K or V needs padding, which keeps registers free and
loads and stores vectorised.
"""

import os

import triton
import triton.language as tl

# RWKV-7's sequential passes issue the next chunk's loads before the current chunk's products up
# to this BK; beyond it the carried tiles spill (sm_90, 4 warps: the compile reports in BENCHMARKS.md).
# (GLA's sequential passes are ``for`` loops that Triton pipelines instead.)
PREFETCH_UP_TO = tl.constexpr(64)
# Whether the kernels run in Triton's interpreter (the launch helper sets TRITON_INTERPRET before
# it imports them).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def in_range(cols, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """cols < SIZE, as a constant when blocks of BLOCK tile SIZE exactly (so that loads and
    stores of whole rows can be vectorised)."""
    if SIZE % BLOCK == 0:
        inside = tl.full([BLOCK], 1, tl.int1)
    else:
        inside = cols < SIZE
    return inside


@triton.jit
def chunk_tiles(v_cols, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Offsets of a chunk's K-wide and V-wide tiles from its first row, and their column
    masks: the same for every chunk of a program. Tiles are [C, K] and [C, V], or [K, C] and
    [V, C] when TRANSPOSED."""
    k_cols = tl.arange(0, BK)
    if TRANSPOSED:
        steps = tl.arange(0, C)[None, :]
        return (k_cols[:, None] + steps * (HEADS * K), in_range(k_cols, K, BK)[:, None],
                v_cols[:, None] + steps * (HEADS * V), in_range(v_cols, V, BV)[:, None])
    else:
        steps = tl.arange(0, C)[:, None]
        return (steps * (HEADS * K) + k_cols[None, :], in_range(k_cols, K, BK)[None, :],
                steps * (HEADS * V) + v_cols[None, :], in_range(v_cols, V, BV)[None, :])


@triton.jit
def stored(ptr, offsets, mask):
    """A tile as stored, zeros where masked (bfloat16 stays so while a sequential pass carries
    it to the next chunk: half the registers of float32)."""
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def rows(ptr, base, tile, mask):
    return stored(ptr + base, tile, mask).to(tl.float32)


@triton.jit
def row_bases(first_row, end, head, k_cols_in, v_cols_in, HEADS: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Where a chunk's rows start in the K-wide and V-wide arrays, and their masks (rows past
    ``end`` read as zeros and are not written)."""
    rows_in = first_row + tl.arange(0, C) < end
    if TRANSPOSED:
        rows_in = rows_in[None, :]
    else:
        rows_in = rows_in[:, None]
    return ((first_row * HEADS + head) * K, rows_in & k_cols_in,
            (first_row * HEADS + head) * V, rows_in & v_cols_in)


@triton.jit
def state_offsets(slot, head, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, v_cols):
    k_rows = tl.arange(0, BK)
    return (slot.to(tl.int64) * HEADS + head) * (K * V) + k_rows[:, None] * V + v_cols[None, :]


@triton.jit
def program(sequence, head, v_block, cu_ptr, HEADS: tl.constexpr, K: tl.constexpr,
             V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
             TRANSPOSED: tl.constexpr):
    """A program's V columns, its chunk tiles and masks, its state tile's mask, and its
    sequence's rows [start, end) and chunk count."""
    v_cols = v_block * BV + tl.arange(0, BV)
    k_tile, k_cols_in, v_tile, v_cols_in = chunk_tiles(v_cols, HEADS, K, V, BK, BV, C,
                                                        TRANSPOSED)
    if TRANSPOSED:
        state_mask = k_cols_in & tl.trans(v_cols_in)
    else:
        state_mask = tl.trans(k_cols_in) & v_cols_in
    start = tl.load(cu_ptr + sequence).to(tl.int64)
    end = tl.load(cu_ptr + sequence + 1).to(tl.int64)
    return (v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, start, end,
            (end - start + C - 1) // C)


# ---------------------------------------------------------------------------------------------
# Bounds that hold whatever a traced array holds: no kernel reads or writes outside a buffer.
# ---------------------------------------------------------------------------------------------

@triton.jit
def clamped_rows(start, end, TOTAL_ROWS: tl.constexpr, C: tl.constexpr):
    """A sequence's rows [start, end) clamped into [0, TOTAL_ROWS] with end >= start, and its
    chunk count: invalid offsets read and write nothing out of bounds."""
    start = tl.minimum(tl.maximum(start, 0), TOTAL_ROWS)
    end = tl.minimum(tl.maximum(end, start), TOTAL_ROWS)
    return start, end, (end - start + C - 1) // C


@triton.jit
def sequence_rows(sequence, cu_ptr, TOTAL_ROWS: tl.constexpr, C: tl.constexpr):
    """Rows [start, end) of a sequence (entries ``sequence`` and ``sequence + 1`` of ``cu``),
    clamped to the arrays (``clamped_rows``), and its chunk count."""
    return clamped_rows(tl.load(cu_ptr + sequence).to(tl.int64),
                        tl.load(cu_ptr + sequence + 1).to(tl.int64), TOTAL_ROWS, C)


@triton.jit
def clamped(index, COUNT: tl.constexpr):
    """An index into a buffer of COUNT entries, clamped into it."""
    return tl.minimum(tl.maximum(index, 0), COUNT - 1)


# ---------------------------------------------------------------------------------------------
# In-chunk pairwise factors built level by level (RWKV-7, GLA / RWKV-6): every factor <= 1.
# ---------------------------------------------------------------------------------------------

@triton.jit
def level_factors(w, S: tl.constexpr, AXIS: tl.constexpr, C: tl.constexpr):
    """Level S of a chunk's exact pairwise factors (rwkv7.py's docstring): rows t of each odd
    segment of S steps meet columns i of the even segment before it. Returns e^(gi_t - gi_b) and
    e^(ge_t - gi_b) (rows) and e^(gi_b - gi_i) (columns), all <= 1 (sums of log decays within
    a segment, never differences of large cumulative sums), and keep[t, i] for those pairs."""
    if AXIS == 0:
        segments = tl.reshape(w, [C // S, S, w.shape[1]])
        inclusive = tl.reshape(tl.cumsum(segments, axis=1), w.shape)
        after = tl.reshape(tl.cumsum(segments, axis=1, reverse=True), w.shape) - w
    else:
        segments = tl.reshape(w, [w.shape[0], C // S, S])
        inclusive = tl.reshape(tl.cumsum(segments, axis=2), w.shape)
        after = tl.reshape(tl.cumsum(segments, axis=2, reverse=True), w.shape) - w
    segment = tl.arange(0, C) // S
    keep = (segment[:, None] == segment[None, :] + 1) & (segment[None, :] % 2 == 0)
    return tl.exp(inclusive), tl.exp(inclusive - w), tl.exp(after), keep


@triton.jit
def level_factors_at(a, level, LEVELS: tl.constexpr, C: tl.constexpr):
    """level_factors(a, C >> (level + 1), 0, C) for a run-time ``level`` (one branch per
    level): loops over the levels (GLA's backward and value gate, RWKV-7's 64-token K side)
    are not unrolled, so that one level's tiles are live at a time (unrolled at C = 64, the
    compiler schedules every level's factors at once and spills)."""
    row = tl.zeros(a.shape, tl.float32)
    row_strict = tl.zeros(a.shape, tl.float32)
    column = tl.zeros(a.shape, tl.float32)
    keep = tl.zeros([C, C], tl.int1)
    for candidate in tl.static_range(LEVELS):
        if level == candidate:
            row, row_strict, column, keep = level_factors(a, C >> (candidate + 1), 0, C)
    return row, row_strict, column, keep


@triton.jit
def dot(x, y, acc, PRECISION: tl.constexpr):
    """x @ y (+ acc), accumulated in float32. Operands that are both bfloat16 or both float16
    (tiles as stored: 16-bit inputs, bfloat16 saved states) multiply as they are, whatever
    PRECISION: their products are exact, at twice tf32's tensor-core rate and with half its
    operand registers. Otherwise PRECISION "bf16" rounds the operands to bfloat16 first
    (float32's exponent range, which factors such as e^(+-GLA_TAME_SUM) need; less precise than
    tf32), and any other PRECISION is tl.dot's input_precision on float32 operands ("tf32",
    "tf32x3", "ieee")."""
    if x.dtype == y.dtype and (x.dtype == tl.bfloat16 or x.dtype == tl.float16):
        if INTERPRETED:  # (Triton 3.6's interpreter multiplies 16-bit tiles wrongly: the
            # products of their values in float32 are exact)
            product = tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
        else:
            product = tl.dot(x, y, acc)
    elif PRECISION == "bf16" and INTERPRETED:
        product = tl.dot(x.to(tl.bfloat16).to(tl.float32), y.to(tl.bfloat16).to(tl.float32), acc,
                         input_precision="ieee")
    elif PRECISION == "bf16":
        product = tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16), acc)
    else:
        product = tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision=PRECISION)
    return product


# Sums of bfloat16 log gates as tensor-core products (the backend's _GlaStatic.gate_sums_by_product;
# rwkv7.py: the 64-token in-chunk kernel), instead of scans and reductions across a tile's rows:
# a [C, C] matrix of 0, 1 and -1 (which rows to add, and subtract) times the gates. The
# products are exact and the sums float32, and every sum is formed as itself (the gates after
# i, or up to the middle row), never as a difference of two cumulative sums. Only gates stored
# as bfloat16 (tested where used, `raw.dtype == tl.bfloat16`: a compile-time choice) are exact
# operands; others take the scans.

@triton.jit
def floored(gate, FLOOR: tl.constexpr):
    """Log gates below FLOOR raised to it; a NaN gate stays NaN (NaN in, NaN out). Not
    tl.maximum: on the GPU it returns the non-NaN operand, which would hide a NaN as FLOOR."""
    return tl.where(gate < FLOOR, FLOOR, gate)


@triton.jit
def gate_tile(raw, FLOOR: tl.constexpr):
    """bfloat16 log gates raised to FLOOR (``floored``), still bfloat16 (FLOOR is one)."""
    return floored(raw.to(tl.float32), FLOOR).to(tl.bfloat16)


@triton.jit
def row_sums(gate, plus, minus):
    """sum_j (plus[t, j] - minus[t, j]) gate_j for every row t, as one product ([C, BLOCK])."""
    selection = tl.where(plus, 1.0, 0.0) - tl.where(minus, 1.0, 0.0)
    return dot(selection.to(tl.bfloat16), gate, None, "tf32")


@triton.jit
def diagonal_tile(values, C: tl.constexpr):
    """A [C, C] tile with ``values`` ([C]) on its diagonal."""
    index = tl.arange(0, C)
    return tl.where(index[:, None] == index[None, :], values[:, None], 0.0)

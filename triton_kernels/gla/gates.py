"""The log gates of a GLA/RWKV-6 chunk and the factors built from them: cumulative sums (as
scans, or as products for bfloat16 gates), decays to the chunk's end, the tame path's
middle-referenced factors, the value gate's level-by-level mixes, and the decayed operands of
the sequential passes."""

import triton
import triton.language as tl

from ..common import diagonal_tile, dot, floored, level_factors_at, row_sums as _row_sums, stored


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

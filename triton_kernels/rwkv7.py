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

Every exponent is a difference of log decays inside one chunk: the factors of the A matrices
are taken relative to the chunk's middle (so each stays within e^(C/2 * |w|), and C = 16 keeps
that finite for w down to about -10), the others are at most 1. One program owns one
(sequence, head, block of V columns) and walks its chunks in order, keeping H in registers; the
forward saves H every ``CHUNKS_PER_STATE`` chunks for the backward, which walks the chunks in
reverse carrying dH, recomputing the states inside each saved span into a per-program scratch
(nothing to recompute when CHUNKS_PER_STATE == 1).

Sequences are rows [cu[n], cu[n+1]) of the flattened [rows, heads, *] inputs (fixed-length
batches are the special case cu = arange(B + 1) * T). ``state_index[n]`` is the first slot of
sequence n in the saved-state buffer, which holds one state per span of
CHUNK * CHUNKS_PER_STATE tokens.

K-side gradients (r, w, k, a, b) sum over V, so with several V blocks (ROWS > 0) each
program writes its own partial [V blocks, rows, heads, K] slice and the caller sums them.

Tiles are addressed as a scalar row base plus offsets within a chunk that are the same for
every chunk (computed once per program), and masks are row masks unless K or V needs padding,
which keeps registers free and loads and stores vectorised.
"""

import triton
import triton.language as tl


@triton.jit
def _inverse_unit_lower(lower, C: tl.constexpr, PRECISION: tl.constexpr):
    """(I - lower)^-1 for a strictly lower-triangular [C, C] tile (C = 16): lower is nilpotent,
    so the inverse is (I + L)(I + L^2)(I + L^4)(I + L^8): six matrix products."""
    index = tl.arange(0, C)
    identity = tl.where(index[:, None] == index[None, :], 1.0, 0.0)
    inverse = identity + lower
    power = lower
    for _ in tl.static_range(3):
        power = tl.dot(power, power, input_precision=PRECISION)
        inverse = tl.dot(inverse, identity + power, input_precision=PRECISION)
    return inverse


@triton.jit
def _in_range(cols, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """cols < SIZE, as a constant when blocks of BLOCK tile SIZE exactly (so that loads and
    stores of whole rows can be vectorised)."""
    if SIZE % BLOCK == 0:
        inside = tl.full([BLOCK], 1, tl.int1)
    else:
        inside = cols < SIZE
    return inside


@triton.jit
def _chunk_tiles(v_cols, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """Offsets of a chunk's K-wide and V-wide tiles from its first row, and their column
    masks: the same for every chunk of a program."""
    rows = tl.arange(0, C)[:, None]
    k_cols = tl.arange(0, BK)
    return (rows * (HEADS * K) + k_cols[None, :], _in_range(k_cols, K, BK)[None, :],
            rows * (HEADS * V) + v_cols[None, :], _in_range(v_cols, V, BV)[None, :])


@triton.jit
def _intra_chunk(q, w, k, a, b, C: tl.constexpr, PRECISION: tl.constexpr):
    """The log decays of a chunk and its A matrices (they do not depend on the state)."""
    index = tl.arange(0, C)
    gi = tl.cumsum(w, axis=0)
    ge = gi - w
    g_end = tl.sum(w, axis=0)
    # Middle of the chunk as the reference of the factored exponents of the A matrices.
    middle = tl.sum(tl.where(index[:, None] == C // 2 - 1, gi, 0.0), axis=0)[None, :]
    a_f = a * tl.exp(ge - middle)
    q_f = q * tl.exp(gi - middle)
    to_middle = tl.exp(middle - gi)
    b_f = b * to_middle
    k_f = k * to_middle
    strict = index[:, None] > index[None, :]
    causal = index[:, None] >= index[None, :]
    # tl.where, not a multiplication: masked entries may overflow to inf.
    A_ab = tl.where(strict, tl.dot(a_f, tl.trans(b_f), input_precision=PRECISION), 0.0)
    A_ak = tl.where(strict, tl.dot(a_f, tl.trans(k_f), input_precision=PRECISION), 0.0)
    A_qb = tl.where(causal, tl.dot(q_f, tl.trans(b_f), input_precision=PRECISION), 0.0)
    A_qk = tl.where(causal, tl.dot(q_f, tl.trans(k_f), input_precision=PRECISION), 0.0)
    return gi, ge, g_end, middle, a_f, q_f, b_f, k_f, A_ab, A_ak, A_qb, A_qk


@triton.jit
def _chunk_inputs(r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, first_row, end, head, k_tile,
                  k_cols_in, v_tile, v_cols_in, scale: tl.constexpr, HEADS: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, C: tl.constexpr):
    """The chunk's input tiles as float32 (zeros past ``end``), and where its rows start."""
    rows_in = (first_row + tl.arange(0, C) < end)[:, None]
    k_in = rows_in & k_cols_in
    v_in = rows_in & v_cols_in
    k_base = (first_row * HEADS + head) * K
    v_base = (first_row * HEADS + head) * V
    q = tl.load(r_ptr + k_base + k_tile, mask=k_in, other=0.0).to(tl.float32) * scale
    w = tl.load(w_ptr + k_base + k_tile, mask=k_in, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + k_base + k_tile, mask=k_in, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + k_base + k_tile, mask=k_in, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + k_base + k_tile, mask=k_in, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + v_base + v_tile, mask=v_in, other=0.0).to(tl.float32)
    return k_base, k_in, v_base, v_in, q, w, k, v, a, b


@triton.jit
def _chunk_forward(h, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, o_ptr, first_row, end, head,
                   k_tile, k_cols_in, v_tile, v_cols_in, WRITE_OUTPUT: tl.constexpr,
                   scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   C: tl.constexpr, PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr):
    """Advance the state ``h`` [BK, BV] over one chunk, writing its output rows if asked."""
    k_base, k_in, v_base, v_in, q, w, k, v, a, b = _chunk_inputs(
        r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, first_row, end, head, k_tile, k_cols_in,
        v_tile, v_cols_in, scale, HEADS, K, V, C)
    gi, ge, g_end, middle, a_f, q_f, b_f, k_f, A_ab, A_ak, A_qb, A_qk = _intra_chunk(
        q, w, k, a, b, C, PRECISION)
    inverse = _inverse_unit_lower(A_ab, C, INVERSE_PRECISION)
    x = tl.dot(a * tl.exp(ge), h, tl.dot(A_ak, v, input_precision=PRECISION),
               input_precision=PRECISION)
    u = tl.dot(inverse, x, input_precision=PRECISION)
    if WRITE_OUTPUT:
        o = tl.dot(q * tl.exp(gi), h, input_precision=PRECISION)
        o = tl.dot(A_qk, v, o, input_precision=PRECISION)
        o = tl.dot(A_qb, u, o, input_precision=PRECISION)
        tl.store(o_ptr + v_base + v_tile, o.to(o_ptr.dtype.element_ty), mask=v_in)
    to_end = tl.exp(g_end[None, :] - gi)
    h = tl.dot(tl.trans(k * to_end), v, tl.exp(g_end)[:, None] * h, input_precision=PRECISION)
    return tl.dot(tl.trans(b * to_end), u, h, input_precision=PRECISION)


@triton.jit
def _state_offsets(slot, head, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, v_cols):
    k_rows = tl.arange(0, BK)
    return (slot.to(tl.int64) * HEADS + head) * (K * V) + k_rows[:, None] * V + v_cols[None, :]


@triton.jit
def _program(cu_ptr, state_index_ptr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):
    """What a program of the grid (sequences * HEADS, V blocks) works on: its head and V
    columns, its tiles, its state's offsets and mask, its rows [start, end) and chunks, and its
    sequence's first saved-state slot."""
    sequence = tl.program_id(0) // HEADS
    head = tl.program_id(0) % HEADS
    v_cols = tl.program_id(1) * BV + tl.arange(0, BV)
    k_tile, k_cols_in, v_tile, v_cols_in = _chunk_tiles(v_cols, HEADS, K, V, BK, BV, C)
    start = tl.load(cu_ptr + sequence).to(tl.int64)
    end = tl.load(cu_ptr + sequence + 1).to(tl.int64)
    return (head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, tl.trans(k_cols_in) & v_cols_in,
            _state_offsets(sequence, head, HEADS, K, V, BK, v_cols), start, end,
            (end - start + C - 1) // C, tl.load(state_index_ptr + sequence))


@triton.jit
def rwkv7_forward_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, h0_ptr, cu_ptr, state_index_ptr,  # inputs
    o_ptr, ht_ptr, states_ptr,                                                  # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
    SAVE_STATES: tl.constexpr, PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr,
):
    """Grid (sequences * HEADS, V blocks). o [rows, HEADS, V]; ht [N, HEADS, K, V] float32;
    states [slots, HEADS, K, V] float32: the state at the start of every span (if SAVE_STATES)."""
    (head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, local, start, end, chunks,
     first_slot) = _program(cu_ptr, state_index_ptr, HEADS, K, V, BK, BV, C)
    h = tl.load(h0_ptr + local, mask=state_mask, other=0.0)
    c = 0
    while c < chunks:  # not `for ... in range`: the interpreter cannot take a run-time bound
        if SAVE_STATES:
            if c % CHUNKS_PER_STATE == 0:
                saved = _state_offsets(first_slot + c // CHUNKS_PER_STATE, head, HEADS, K, V,
                                       BK, v_cols)
                tl.store(states_ptr + saved, h, mask=state_mask)
        h = _chunk_forward(h, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, o_ptr, start + c * C,
                           end, head, k_tile, k_cols_in, v_tile, v_cols_in, True, scale, HEADS,
                           K, V, C, PRECISION, INVERSE_PRECISION)
        c += 1
    tl.store(ht_ptr + local, h, mask=state_mask)


@triton.jit
def _chunk_backward(h, dh, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr,
                    dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, first_row, end, head,
                    v_block, k_tile, k_cols_in, v_tile, v_cols_in, scale: tl.constexpr,
                    HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                    ROWS: tl.constexpr, PRECISION: tl.constexpr,
                    INVERSE_PRECISION: tl.constexpr):
    """Gradients of one chunk from its starting state ``h`` and the gradient ``dh`` of its
    final state; returns the gradient of its starting state. Each gradient term is folded in
    as soon as it exists, so that the tiles it needs can be released."""
    k_base, k_in, v_base, v_in, q, w, k, v, a, b = _chunk_inputs(
        r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, first_row, end, head, k_tile, k_cols_in,
        v_tile, v_cols_in, scale, HEADS, K, V, C)
    do = tl.load(do_ptr + v_base + v_tile, mask=v_in, other=0.0).to(tl.float32)
    gi, ge, g_end, middle, a_f, q_f, b_f, k_f, A_ab, A_ak, A_qb, A_qk = _intra_chunk(
        q, w, k, a, b, C, PRECISION)
    index = tl.arange(0, C)
    strict = index[:, None] > index[None, :]
    causal = index[:, None] >= index[None, :]
    inverse = _inverse_unit_lower(A_ab, C, INVERSE_PRECISION)
    decay_a = tl.exp(ge)
    x = tl.dot(a * decay_a, h, tl.dot(A_ak, v, input_precision=PRECISION),
               input_precision=PRECISION)
    u = tl.dot(inverse, x, input_precision=PRECISION)
    # Gradients of the log decays: d_gi of the inclusive sums, d_ge of the exclusive ones,
    # dg_end of the chunk's total; x * e^y contributes x e^y to the gradient of y.
    # H' = e^g H + k^T V + b^T U, with k^ = k e^(g - gi), b^ = b e^(g - gi)
    decay_end = tl.exp(g_end)
    dg_end = decay_end * tl.sum(h * dh, axis=1)
    to_end = tl.exp(g_end[None, :] - gi)
    dk_e = tl.dot(v, tl.trans(dh), input_precision=PRECISION)
    db_e = tl.dot(u, tl.trans(dh), input_precision=PRECISION)
    dk = dk_e * to_end
    db = db_e * to_end
    dk_e *= k * to_end
    db_e *= b * to_end
    d_gi = -(dk_e + db_e)
    dg_end += tl.sum(dk_e + db_e, axis=0)
    dv = tl.dot(k * to_end, dh, input_precision=PRECISION)
    du = tl.dot(b * to_end, dh, input_precision=PRECISION)
    # O = q~ H + A_qk V + A_qb U, with q~ = q e^gi
    decay_q = tl.exp(gi)
    dq_d = tl.dot(do, tl.trans(h), input_precision=PRECISION)
    dq = dq_d * decay_q
    d_gi += dq * q
    dh_prev = tl.dot(tl.trans(q * decay_q), do, decay_end[:, None] * dh,
                     input_precision=PRECISION)
    dA_qk = tl.where(causal, tl.dot(do, tl.trans(v), input_precision=PRECISION), 0.0)
    dv = tl.dot(tl.trans(A_qk), do, dv, input_precision=PRECISION)
    dA_qb = tl.where(causal, tl.dot(do, tl.trans(u), input_precision=PRECISION), 0.0)
    du = tl.dot(tl.trans(A_qb), do, du, input_precision=PRECISION)
    # U = (I - A_ab)^-1 X, X = A_ak V + a~ H, with a~ = a e^ge
    dx = tl.dot(tl.trans(inverse), du, input_precision=PRECISION)
    dA_ab = tl.where(strict, tl.dot(dx, tl.trans(u), input_precision=PRECISION), 0.0)
    dA_ak = tl.where(strict, tl.dot(dx, tl.trans(v), input_precision=PRECISION), 0.0)
    dv = tl.dot(tl.trans(A_ak), dx, dv, input_precision=PRECISION)
    tl.store(dv_ptr + v_base + v_tile, dv.to(dv_ptr.dtype.element_ty), mask=v_in)
    da = tl.dot(dx, tl.trans(h), input_precision=PRECISION) * decay_a
    d_ge = da * a
    dh_prev = tl.dot(tl.trans(a * decay_a), dx, dh_prev, input_precision=PRECISION)
    # The A matrices as products of the middle-referenced factors.
    dq_f = tl.dot(dA_qk, k_f, tl.dot(dA_qb, b_f, input_precision=PRECISION),
                  input_precision=PRECISION)
    dq += dq_f * tl.exp(gi - middle)
    d_gi += dq_f * q_f
    da_f = tl.dot(dA_ak, k_f, tl.dot(dA_ab, b_f, input_precision=PRECISION),
                  input_precision=PRECISION)
    da += da_f * tl.exp(ge - middle)
    d_ge += da_f * a_f
    db_f = tl.dot(tl.trans(dA_qb), q_f, tl.dot(tl.trans(dA_ab), a_f, input_precision=PRECISION),
                  input_precision=PRECISION)
    dk_f = tl.dot(tl.trans(dA_qk), q_f, tl.dot(tl.trans(dA_ak), a_f, input_precision=PRECISION),
                  input_precision=PRECISION)
    to_middle = tl.exp(middle - gi)
    db += db_f * to_middle
    dk += dk_f * to_middle
    d_gi -= db_f * b_f + dk_f * k_f
    # gi_t = sum_{j<=t} w_j, ge_t = gi_t - w_t, g = sum_j w_j.
    dw = tl.cumsum(d_gi + d_ge, axis=0, reverse=True) - d_ge + dg_end[None, :]

    if ROWS > 0:  # several V blocks: this one's partial sums of the K-side gradients
        k_base += v_block.to(tl.int64) * (ROWS * HEADS * K)
    tl.store(dr_ptr + k_base + k_tile, (dq * scale).to(dr_ptr.dtype.element_ty), mask=k_in)
    tl.store(dw_ptr + k_base + k_tile, dw.to(dw_ptr.dtype.element_ty), mask=k_in)
    tl.store(dk_ptr + k_base + k_tile, dk.to(dk_ptr.dtype.element_ty), mask=k_in)
    tl.store(da_ptr + k_base + k_tile, da.to(da_ptr.dtype.element_ty), mask=k_in)
    tl.store(db_ptr + k_base + k_tile, db.to(db_ptr.dtype.element_ty), mask=k_in)
    return dh_prev


@triton.jit
def rwkv7_backward_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr, dht_ptr, states_ptr, cu_ptr,
    state_index_ptr,                                                            # inputs
    dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, dh0_ptr, scratch_ptr,       # outputs
    scale: tl.constexpr, HEADS: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, CHUNKS_PER_STATE: tl.constexpr,
    ROWS: tl.constexpr, PRECISION: tl.constexpr, INVERSE_PRECISION: tl.constexpr,
):
    """Grid as the forward's. dr, dw, dk, da, db: [rows, HEADS, K], or float32 partial sums
    [V blocks, ROWS, HEADS, K] when ROWS > 0 (several V blocks); dv [rows, HEADS, V];
    dh0 [N, HEADS, K, V] float32; scratch: float32 [programs * V blocks, CHUNKS_PER_STATE, BK,
    BV], the chunk states of the span being differentiated (unused if CHUNKS_PER_STATE == 1)."""
    (head, v_cols, k_tile, k_cols_in, v_tile, v_cols_in, state_mask, local, start, end, chunks,
     first_slot) = _program(cu_ptr, state_index_ptr, HEADS, K, V, BK, BV, C)
    dh = tl.load(dht_ptr + local, mask=state_mask, other=0.0)
    v_block = tl.program_id(1)
    scratch_row = (tl.program_id(0) * tl.num_programs(1) + v_block).to(tl.int64) * CHUNKS_PER_STATE
    k_rows = tl.arange(0, BK)
    scratch_tile = k_rows[:, None] * BV + tl.arange(0, BV)[None, :]
    c = chunks - 1
    while c >= 0:
        if CHUNKS_PER_STATE == 1:
            saved = _state_offsets(first_slot + c, head, HEADS, K, V, BK, v_cols)
            h = tl.load(states_ptr + saved, mask=state_mask, other=0.0)
        else:
            j = c % CHUNKS_PER_STATE
            if (j == CHUNKS_PER_STATE - 1) | (c == chunks - 1):
                # Entering a span from its end: recompute the state at the start of each of
                # its chunks (up to this one) into the scratch.
                tl.debug_barrier()  # everyone is done reading the previous span's states
                span_start = c - j
                saved = _state_offsets(first_slot + span_start // CHUNKS_PER_STATE, head, HEADS,
                                       K, V, BK, v_cols)
                h = tl.load(states_ptr + saved, mask=state_mask, other=0.0)
                i = 0
                while i <= j:
                    tl.store(scratch_ptr + (scratch_row + i) * (BK * BV) + scratch_tile, h)
                    if i < j:
                        h = _chunk_forward(h, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, r_ptr,
                                           start + (span_start + i) * C, end, head, k_tile,
                                           k_cols_in, v_tile, v_cols_in, False, scale, HEADS,
                                           K, V, C, PRECISION, INVERSE_PRECISION)
                    i += 1
                tl.debug_barrier()
            h = tl.load(scratch_ptr + (scratch_row + j) * (BK * BV) + scratch_tile)
        dh = _chunk_backward(h, dh, r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr, do_ptr,
                             dr_ptr, dw_ptr, dk_ptr, dv_ptr, da_ptr, db_ptr, start + c * C, end,
                             head, v_block, k_tile, k_cols_in, v_tile, v_cols_in, scale, HEADS,
                             K, V, C, ROWS, PRECISION, INVERSE_PRECISION)
        c -= 1
    tl.store(dh0_ptr + local, dh, mask=state_mask)

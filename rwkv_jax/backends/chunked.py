"""The ``chunked`` backend: the chunked (WY / UT-transform) algorithm in plain ``jax.numpy``.

The sequence is cut into chunks of ``CHUNK_SIZE`` tokens, and a ``lax.scan`` over chunks
carries the state from one chunk boundary to the next. Inside a chunk every interaction is a
small dense matrix (matmul-heavy, so fast on CPU and TPU), batched over batch rows and heads.
It is the algorithmic twin of the Triton kernels.

RWKV-7 within one chunk, state ``S`` entering it, positions ``i, j`` in the chunk, ``G_i`` the
inclusive and ``Gx_i = G_{i-1}`` the exclusive cumulative log decay (per key channel), ``r``
already scaled. Writing ``u_i = a_i^T h_{i-1}`` (a value row), the recurrence is a gated linear
attention with two key/value pairs per step, ``(k_j, v_j)`` and ``(b_j, u_j)``:

    h_i = diag(e^{G_i}) S + sum_{j<=i} diag(e^{G_i - G_j}) (k_j v_j^T + b_j u_j^T)
    u_i = (a_i e^{Gx_i})^T S + sum_{j<i} A_ak[i,j] v_j + A_ab[i,j] u_j
    o_i = (r_i e^{G_i})^T S  + sum_{j<=i} A_qk[i,j] v_j + A_qb[i,j] u_j

with ``A_xy[i,j] = sum_k x_i y_j e^{Gx_i - G_j}`` (``x`` = ``r e^{w}`` for the ``q`` rows, so
that the exponent is ``G_i - G_j``) below the diagonal and ``A_qk[i,i] = r_i . k_i``,
``A_qb[i,i] = r_i . b_i``. The ``u`` rows solve the unit lower-triangular system
``(I - A_ab) U = A_ak V + (a e^{Gx}) S``, so ``U = u + W S`` with ``[u | W]`` from one
triangular solve (the UT transform; ``W`` is the WY factor). The chunk then maps
``S -> M S + D`` with ``M = diag(e^{G_C}) + bg^T W`` and ``D = kg^T V + bg^T u``
(``kg = k e^{G_C - G}``, ``bg`` likewise), and its outputs are ``o = (rg + A_qb W) S + A_qk V
+ A_qb u``. Gated linear attention and RWKV-6 are the same without the ``a, b`` terms.

Exact for every log decay in ``[-inf, 0]`` (DESIGN.md, numerical contract): log decays are
first floored at ``LOG_DECAY_FLOOR`` (see :func:`_floored`), and every exponent evaluated is a
difference of in-chunk cumulative log decays that is ``<= 0``. The pairwise
decays ``e^{Gx_i - G_j}`` are exact masked exponentials within sub-chunks of ``SUB_CHUNK``
tokens; between sub-chunks they factor through the cumulative decay ``P`` at the start of the
row's sub-chunk, ``e^{Gx_i - P} e^{P - G_j}``, both factors ``<= 1``.

Packed sequences (``cu_seqlens``): tokens are scattered on the device into a padded buffer
where every segment starts on a chunk boundary (its static length bounds every length
pattern, so nothing recompiles); padding tokens are inert (zero key, value, a, b and log
decay), chunks that start a segment load that segment's initial state, and final states are
gathered at segment ends.

Gradients are JAX autodiff of this code, reverse or forward mode (the triangular inverse has
its own JVP). The scan step is checkpointed: the backward stores one state per chunk and
recomputes that chunk's pieces, never one state per step. Exponents that are identically zero
are the constant 1, so that the log-decay gradients stay exact to rounding under strong decays
(see ``_pairwise_decay``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from rwkv_jax.backends import LOG_DECAY_FLOOR

CHUNK_SIZE = 32  # tokens per chunk (on CPU, 16 and 32 train alike and 64 slower)
SUB_CHUNK = 16  # tokens per sub-chunk, whose pairwise decays are exact masked exponentials


def _acc(*xs):
    """Accumulation dtype: float32, or float64 when an input is float64 (reference runs)."""
    return jnp.result_type(jnp.float32, *(x.dtype for x in xs if x is not None))


# ------------------------------------------------------------------------------------------
# Intra-chunk pieces. Arrays are [L, C, D]: one chunk of C tokens for each of L = B * H rows.
# No intermediate, gradients included, has rank 7: XLA:CPU 0.10.2 segfaults running a rank-7
# multiply-reduce with a size-1 axis (B = H = 1) in its YNNPACK fusion (jax-ml/jax#40412).
# ------------------------------------------------------------------------------------------


def _floored(log_decay):
    """Log decays below ``LOG_DECAY_FLOOR`` raised to it (DESIGN.md, numerical contract). exp of
    either is 0 in float32, so no result changes, but in-chunk cumulative sums stay finite (no
    ``-inf - -inf``) and their differences precise (``-1e9 + w`` would lose ``w``). A floored
    element's gradient is 0, as ``exp(w) * (...)`` gives it; ``where`` keeps -inf out of it.
    The test is ``w < floor``, which a NaN fails: a NaN log decay stays NaN (NaN in, NaN out)."""
    return jnp.where(log_decay < LOG_DECAY_FLOOR, LOG_DECAY_FLOOR, log_decay)


def _masked_exp(exponent, mask):
    """exp(exponent) where mask, else 0; the masked-out exponents (which may be large and
    positive) never reach exp, so neither the value nor the gradient overflows."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0.0)), 0.0)


def _cumsum(x):
    """The inclusive cumulative sum over axis 1 (the tokens of a chunk) as a parallel prefix of
    additions: XLA:GPU (jaxlib 0.11) failed to compile the reduce-window that ``jnp.cumsum``
    lowers to when fused with these kernels' neighbours at some shapes ("Failed to translate
    module to LLVM IR")."""
    return lax.associative_scan(jnp.add, x, axis=1)


def _cumulative(log_decay):
    """Inclusive and exclusive in-chunk cumulative sums over the token axis."""
    inclusive = _cumsum(log_decay)
    exclusive = jnp.concatenate([jnp.zeros_like(inclusive[:, :1]), inclusive[:, :-1]], axis=1)
    return inclusive, exclusive


def _sub_chunks(x, sub):
    """[..., L, C, D] -> [..., L * C // sub, sub, D]."""
    *lead, rows, chunk, dim = x.shape
    return x.reshape(*lead, rows * chunk // sub, sub, dim)


def _pairwise_decay(g_rows, g_cols, sub, strict):
    """Within each sub-chunk: ``exp(g_rows[i] - g_cols[j])`` for ``j < i`` (``j <= i`` unless
    ``strict``), else 0: [L * n, sub, sub, D], each exponent a difference ``<= 0``.

    The pair whose exponent is identically zero (``j = i - 1`` when ``strict``, for exclusive
    rows against inclusive columns; ``j = i`` otherwise) is the constant 1: its exponent's
    gradient cancels exactly, and computed it would leave rounding noise as large as the term
    itself in the log-decay gradients, where strong decays make the true values tiny.
    """
    offset = jnp.arange(sub)[:, None] - jnp.arange(sub)[None, :]                     # i - j
    same = (offset == (1 if strict else 0))[..., None]
    decay = _masked_exp(_sub_chunks(g_rows, sub)[:, :, None] - _sub_chunks(g_cols, sub)[:, None],
                        (offset > (1 if strict else 0))[..., None])
    return jnp.where(same, 1.0, decay)


def _across_sub_chunks(g_rows, g_cols, sub, strict):
    """For a row ``i`` in sub-chunk ``I`` and a column ``j`` in an earlier sub-chunk,
    ``exp(g_rows[i] - g_cols[j]) = row[I, i] * col[I, j]``, factored through ``p_I``, the
    inclusive cumulative decay just before sub-chunk ``I``; both factors are ``<= 1``.
    Returns ``row`` [L * n, sub, D] and ``col`` [L * n, C, D] (0 where ``j`` is not earlier).
    Factors with an identically zero exponent are the constant 1 (see :func:`_pairwise_decay`):
    the column just before ``I``, and the first row of ``I`` when rows are exclusive
    (``strict``). Needs two sub-chunks or more."""
    rows, chunk, dim = g_cols.shape
    n = chunk // sub
    before = jnp.concatenate([jnp.zeros_like(g_cols[:, :1]), g_cols[:, sub - 1:-1:sub]], axis=1)
    row = jnp.exp(_sub_chunks(g_rows, sub) - before.reshape(rows * n, 1, dim))
    if strict:
        row = jnp.where((jnp.arange(sub) == 0)[:, None], 1.0, row)
    column, start = jnp.arange(chunk)[None, :], sub * jnp.arange(n)[:, None]
    col = _masked_exp(before[:, :, None] - g_cols[:, None], (column < start - 1)[..., None])
    col = jnp.where((column == start - 1)[..., None], 1.0, col)                       # [L, n, C, D]
    return row, col.reshape(rows * n, chunk, dim)


def _decay_to_end(log_decay):
    """``exp(sum_{m > j} w_m)``: the decay from after token ``j`` to the chunk's end, as a
    suffix sum (exactly 0 in the exponent for the last token, see :func:`_pairwise_decay`)."""
    suffix = jnp.flip(_cumsum(jnp.flip(log_decay, 1)), 1)
    return jnp.exp(jnp.concatenate([suffix[:, 1:], jnp.zeros_like(suffix[:, :1])], axis=1))


def _block_diagonal(blocks, n):
    """[..., L * n, sub, sub] -> [..., L, C, C] with the blocks on the diagonal."""
    *lead, rows_n, sub, _ = blocks.shape
    # Leading axes merged, so that the gradient stays below rank 7 (see above).
    blocks = blocks.reshape(-1, n, sub, 1, sub)
    eye = jnp.eye(n, dtype=blocks.dtype)[:, None, :, None]                          # [n, 1, n, 1]
    return (blocks * eye).reshape(*lead, rows_n // n, n * sub, n * sub)


def _diagonal_blocks(matrix, sub):
    """[L, C, C] -> its [L * n, sub, sub] blocks on the diagonal."""
    rows, chunk, _ = matrix.shape
    n = chunk // sub
    blocks = jnp.diagonal(matrix.reshape(rows, n, sub, n, sub), axis1=1, axis2=3)  # [L,sub,sub,n]
    return jnp.moveaxis(blocks, -1, 1).reshape(rows * n, sub, sub)


def _decayed_scores(rows, cols, g_rows, g_cols, sub):
    """``A[x, y, l, i, j] = sum_k rows[x,l,i,k] cols[y,l,j,k] exp(g_rows[l,i,k] - g_cols[l,j,k])``
    for ``j < i``, else 0.

    ``rows``: [X, L, C, K]; ``cols``: [Y, L, C, K]; ``g_rows`` the exclusive and ``g_cols`` the
    inclusive cumulative log decays [L, C, K]. Returns [X, Y, L, C, C].
    """
    count, chunk, _ = g_cols.shape
    n = chunk // sub
    flat = lambda x: x.reshape(x.shape[0], -1, *x.shape[3:])
    decay = _pairwise_decay(g_rows, g_cols, sub, strict=True)  # [L*n, sub, sub, K]
    decayed_cols = decay * _sub_chunks(cols, sub)[:, :, None]
    within = jnp.einsum("xbk,ybjk->xybj", flat(_sub_chunks(rows, sub)), flat(decayed_cols))
    scores = _block_diagonal(within.reshape(*within.shape[:2], count * n, sub, sub), n)
    if n > 1:
        row, col = _across_sub_chunks(g_rows, g_cols, sub, strict=True)
        cols_by_block = jnp.repeat(cols, n, axis=1) * col  # [Y, L * n, C, K]
        across = jnp.einsum("xbik,ybjk->xybij", _sub_chunks(rows, sub) * row, cols_by_block)
        scores = scores + across.reshape(scores.shape)
    return scores


def _transpose(x):
    return jnp.swapaxes(x, -1, -2)


def _diagonal(values):
    """[..., C] -> [..., C, C] with ``values`` on the diagonal."""
    return values[..., :, None] * jnp.eye(values.shape[-1], dtype=values.dtype)


def _decayed_mix(scores, values, g_values, sub):
    """``out[l,i,v] = sum_{j<=i} scores[l,i,j] e^(g_values[l,i,v] - g_values[l,j,v]) values[l,j,v]``
    for a value-side decay (inclusive cumulative ``g_values`` [L, C, V]), split into sub-chunks
    like :func:`_decayed_scores`."""
    n = values.shape[1] // sub
    decay = _pairwise_decay(g_values, g_values, sub, strict=False)  # [L*n, sub, sub, V]
    out = jnp.sum(_diagonal_blocks(scores, sub)[..., None] * decay
                  * _sub_chunks(values, sub)[:, None], axis=2)                      # [L*n, sub, V]
    if n > 1:
        row, col = _across_sub_chunks(g_values, g_values, sub, strict=False)
        out = out + row * jnp.einsum("bij,bjv->biv", _sub_chunks(scores, sub),
                                     jnp.repeat(values, n, axis=0) * col)
    return out.reshape(values.shape)


@jax.custom_jvp
def _unit_lower_inverse(a):
    """``(I - a)^{-1}`` for strictly lower-triangular ``a`` [L, C, C]: forward substitution
    on the diagonal blocks of ``SUB_CHUNK`` rows, then blocks merged pairwise,
    ``[[M1, 0], [-Q, M2]]^{-1} = [[T1, 0], [T2 Q T1, T2]]``."""
    count, chunk, _ = a.shape
    size = min(SUB_CHUNK, chunk)
    blocks = _diagonal_blocks(a, size)                                              # [L*n, s, s]
    inverse = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), blocks.shape)
    for row in range(1, size):  # row i of the inverse: e_i + a[i, :i] @ inverse[:i]
        inverse = inverse.at[:, row].add(jnp.einsum("bj,bjc->bc", blocks[:, row], inverse))
    while size < chunk:
        pairs = inverse.reshape(-1, 2, size, size)
        lower_left = _diagonal_blocks(a, 2 * size)[:, size:, :size]
        first, second = pairs[:, 0], pairs[:, 1]
        zeros = jnp.zeros_like(first)
        inverse = jnp.concatenate([jnp.concatenate([first, zeros], -1),
                                   jnp.concatenate([second @ lower_left @ first, second], -1)],
                                  axis=-2)
        size *= 2
    return inverse.reshape(count, chunk, chunk)


@_unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
    # d(I - a)^{-1} = T da T, da on a's strictly lower support. Linear in da, so reverse mode
    # transposes it (da = tril(T^T dT T^T, -1)) and forward mode (jvp, hessian) works too.
    (a,), (d_a,) = primals, tangents
    inverse = _unit_lower_inverse(a)
    return inverse, inverse @ jnp.tril(d_a, -1) @ inverse


class _Chunks(NamedTuple):
    """What the cross-chunk pass needs, per chunk ([L, ...]).

    Each chunk maps its incoming state S [K, V] to ``advance(transition, S) + update`` and
    outputs ``gate * (read @ S) + intra`` ([C, V]; ``gate`` None means 1).
    """
    transition: tuple
    update: jax.Array
    read: jax.Array
    gate: Optional[jax.Array]
    intra: jax.Array


def _advance_matrix(transition, state):
    (matrix,) = transition
    return matrix @ state


def _advance_diagonal(transition, state):
    key_decay, value_decay = transition
    state = key_decay[..., :, None] * state
    return state if value_decay is None else state * value_decay[..., None, :]


def _rwkv7_chunks(r, w, k, v, a, b, sub):
    g, gx = _cumulative(w)
    g_last = g[:, -1:]
    scores = _decayed_scores(jnp.stack([r * jnp.exp(w), a]), jnp.stack([k, b]), gx, g, sub)
    a_qk = scores[0, 0] + _diagonal(jnp.sum(r * k, -1))
    a_qb = scores[0, 1] + _diagonal(jnp.sum(r * b, -1))
    a_ak, a_ab = scores[1, 0], scores[1, 1]
    # UT transform: (I - A_ab) [u | W] = [A_ak V | a e^{Gx}], unit lower triangular.
    solved = _unit_lower_inverse(a_ab) @ jnp.concatenate([a_ak @ v, a * jnp.exp(gx)], axis=-1)
    u, wy = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]
    to_end = _decay_to_end(w)
    kg, bg = k * to_end, b * to_end
    return _Chunks(transition=(_diagonal(jnp.exp(g_last[:, 0])) + _transpose(bg) @ wy,),
                   update=_transpose(kg) @ v + _transpose(bg) @ u,
                   read=r * jnp.exp(g) + a_qb @ wy, gate=None,
                   intra=a_qk @ v + a_qb @ u)


def _gated_chunks(q, k, v, key_log_decay, value_log_decay, bonus, sub):
    """Gated linear attention (read after the update) or, with ``bonus`` ([L, C, K]), RWKV-6
    (read before the update, the current token weighted by the bonus)."""
    g, gx = _cumulative(key_log_decay)
    g_last = g[:, -1:]
    if bonus is None:  # o_i reads h_i: rows decay by G_i, the diagonal has weight 1
        rows, read, on_diagonal = q * jnp.exp(key_log_decay), q * jnp.exp(g), q
    else:  # o_i reads h_{i-1}: rows decay by Gx_i, the diagonal is weighted by the bonus
        rows, read, on_diagonal = q, q * jnp.exp(gx), q * bonus
    scores = _decayed_scores(rows[None], k[None], gx, g, sub)[0, 0]
    scores = scores + _diagonal(jnp.sum(on_diagonal * k, -1))
    keys_to_end = k * _decay_to_end(key_log_decay)
    if value_log_decay is None:
        gate, intra, values_to_end, value_decay = None, scores @ v, v, None
    else:
        gv, _ = _cumulative(value_log_decay)
        gv_last = gv[:, -1:]
        gate, intra = jnp.exp(gv), _decayed_mix(scores, v, gv, sub)
        values_to_end, value_decay = v * _decay_to_end(value_log_decay), jnp.exp(gv_last[:, 0])
    return _Chunks(transition=(jnp.exp(g_last[:, 0]), value_decay),
                   update=_transpose(keys_to_end) @ values_to_end,
                   read=read, gate=gate, intra=intra)


# ------------------------------------------------------------------------------------------
# Across chunks: layout, packed segments, the scan over chunk states, outputs.
# ------------------------------------------------------------------------------------------


def _to_chunks(x, chunk):
    """[B, T, H, D] (T a multiple of ``chunk``) -> [n, B * H, C, D]."""
    batch, steps, heads, dim = x.shape
    x = x.reshape(batch, steps // chunk, chunk, heads, dim).transpose(1, 0, 3, 2, 4)
    return x.reshape(steps // chunk, batch * heads, chunk, dim)


def _from_chunks(x, batch, heads):
    """[n, B * H, C, D] -> [B, n * C, H, D]."""
    n, _, chunk, dim = x.shape
    x = x.reshape(n, batch, heads, chunk, dim).transpose(1, 0, 3, 2, 4)
    return x.reshape(batch, n * chunk, heads, dim)


class _Packing(NamedTuple):
    """Where packed segments go in the padded buffer; all computed on the device."""
    chunks: int            # static number of chunks in the buffer, enough for any pattern
    slots: jax.Array       # [T] buffer position of each token
    segment: jax.Array     # [n] the segment each chunk belongs to
    starts: jax.Array      # [n] whether the chunk starts its segment (loads its initial state)
    last_chunk: jax.Array  # [N] the last chunk of each segment
    nonempty: jax.Array    # [N] whether the segment has any token


def _packing(cu_seqlens, steps, chunk):
    segments = cu_seqlens.shape[0] - 1
    # Each segment of length L takes ceil(L / C) chunks <= (L + C - 1) / C, and never more
    # chunks than tokens: a static bound over all length patterns.
    chunks = max(1, min(steps, (steps + segments * (chunk - 1)) // chunk))
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seg_chunks = (lengths + chunk - 1) // chunk
    first_chunk = jnp.cumsum(seg_chunks) - seg_chunks
    token = jnp.arange(steps, dtype=cu_seqlens.dtype)
    seg = jnp.searchsorted(cu_seqlens, token, side="right") - 1  # skips empty segments
    slots = first_chunk[seg] * chunk + token - cu_seqlens[seg]
    index = jnp.arange(chunks, dtype=cu_seqlens.dtype)
    chunk_segment = jnp.searchsorted(first_chunk, index, side="right") - 1
    return _Packing(chunks, slots, chunk_segment, first_chunk[chunk_segment] == index,
                    first_chunk + seg_chunks - 1, lengths > 0)


def _scan_chunks(build, advance, tokens, h0, packing):
    """``lax.scan`` over chunks: each step builds its chunk's pieces, emits the chunk's outputs
    and passes the state on. The step is checkpointed, so the backward stores one state per
    chunk and recomputes that chunk's pieces; nothing per step or per pair is kept.

    ``tokens``: [n, L, C, *] arrays; ``h0``: [L, K, V], or [N, H, K, V] with packing.
    Returns (o [n, L, C, V], the state after each chunk [n, L, K, V] with packing else None,
    the last state).
    """
    resets = None if packing is None else (packing.starts, packing.segment)

    @jax.checkpoint
    def step(state, x):
        tokens, reset = x
        if reset is not None:  # a chunk that starts a segment loads that segment's state
            starts, segment = reset
            state = jnp.where(starts, h0[segment], state)
        chunk = build(*tokens, sub=SUB_CHUNK)
        o = chunk.read @ state
        o = (o if chunk.gate is None else o * chunk.gate) + chunk.intra
        state = advance(chunk.transition, state) + chunk.update
        return state, (o, None if packing is None else state)

    init = h0 if packing is None else jnp.zeros_like(h0[0])
    last, (o, states) = lax.scan(step, init, (tokens, resets))
    return o, states, last


def _run(build, advance, tokens, h0, cu_seqlens, chunk_size):
    """Run a chunked recurrence over ``tokens`` ([B, T, H, *] arrays whose zero padding is
    inert) from ``h0`` [N, H, K, V]. ``build`` maps one chunk of them, [B * H, C, *], to
    :class:`_Chunks`. Returns (o [B, T, H, V], final states [N, H, K, V])."""
    batch, steps, heads = tokens[0].shape[:3]
    if chunk_size < SUB_CHUNK or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {SUB_CHUNK}, got {chunk_size}")
    # Short inputs take a shorter chunk (still a power of two) instead of padding.
    chunk = min(chunk_size, max(SUB_CHUNK, 1 << (steps - 1).bit_length()))
    if cu_seqlens is None:
        packing = None
        length = -(-steps // chunk) * chunk
        pad = lambda x: jnp.pad(x, ((0, 0), (0, length - steps)) + ((0, 0),) * (x.ndim - 2))
    else:
        packing = _packing(cu_seqlens, steps, chunk)
        length = packing.chunks * chunk
        pad = lambda x: jnp.zeros((1, length) + x.shape[2:], x.dtype).at[:, packing.slots].set(
            x, unique_indices=True)
    flat_h0 = h0.reshape(-1, *h0.shape[2:]) if packing is None else h0
    o, states, last = _scan_chunks(build, advance, tuple(_to_chunks(pad(x), chunk) for x in tokens),
                                   flat_h0, packing)
    o = _from_chunks(o, batch, heads)
    if packing is None:
        return o[:, :steps], last.reshape(h0.shape)
    final = jnp.where(packing.nonempty[:, None, None, None], states[packing.last_chunk], h0)
    return o[:, packing.slots], final


def _initial_state(initial_state, batch, cu_seqlens, heads, keys, values, dtype):
    if initial_state is not None:
        return initial_state.astype(dtype)
    rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return jnp.zeros((rows, heads, keys, values), dtype)


# ------------------------------------------------------------------------------------------
# Backend functions (canonical signatures of rwkv_jax.backends.native).
# ------------------------------------------------------------------------------------------


def rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens,
          chunk_size=None):
    acc = _acc(r, w, k, v, a, b)
    r, k, a, b, v32 = (x.astype(acc) for x in (r, k, a, b, v))
    w = _floored(w.astype(acc))
    h0 = _initial_state(initial_state, r.shape[0], cu_seqlens, r.shape[2], r.shape[3],
                        v.shape[3], acc)
    o, h = _run(_rwkv7_chunks, _advance_matrix, (r * scale, w, k, v32, a, b), h0, cu_seqlens,
                chunk_size or CHUNK_SIZE)
    return o.astype(v.dtype), h


def rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens,
          chunk_size=None):
    acc = _acc(r, k, v, w, u)
    r, k, v32 = (x.astype(acc) for x in (r, k, v))
    w = _floored(w.astype(acc))
    h0 = _initial_state(initial_state, r.shape[0], cu_seqlens, r.shape[2], r.shape[3],
                        v.shape[3], acc)
    bonus = jnp.broadcast_to(u.astype(acc), r.shape)  # chunked like the tokens

    def build(r, k, v, w, bonus, *, sub):
        return _gated_chunks(r, k, v, w, None, bonus, sub)

    o, h = _run(build, _advance_diagonal, (r * scale, k, v32, w, bonus), h0, cu_seqlens,
                chunk_size or CHUNK_SIZE)
    return o.astype(v.dtype), h


def gated_linear_attention(q, k, v, *, g, g_gamma, gk, gv, scale, initial_state,
                           output_final_state, reverse, cu_seqlens, chunk_size=None):
    acc = _acc(q, k, v, g, g_gamma, gk, gv)
    q, k, v32 = (x.astype(acc) for x in (q, k, v))
    h0 = _initial_state(initial_state, q.shape[0], cu_seqlens, q.shape[2], q.shape[3],
                        v.shape[3], acc)
    # The scalar gates decay every key channel alike: fold them into one key-side log decay.
    key_log_decay = jnp.zeros_like(k) if gk is None else gk.astype(acc)
    if g is not None:
        key_log_decay = key_log_decay + g.astype(acc)[..., None]
    if g_gamma is not None:
        key_log_decay = key_log_decay + g_gamma.astype(acc)[:, None]
    tokens = ((q * scale, k, v32, _floored(key_log_decay))
              + (() if gv is None else (_floored(gv.astype(acc)),)))
    if reverse:
        # Backwards in time is forwards on the flipped sequence (segment order flips too).
        tokens = tuple(jnp.flip(x, axis=1) for x in tokens)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens[-1] - jnp.flip(cu_seqlens)
            h0 = jnp.flip(h0, axis=0)

    def build(q, k, v, key_log_decay, value_log_decay=None, *, sub):
        return _gated_chunks(q, k, v, key_log_decay, value_log_decay, None, sub)

    o, h = _run(build, _advance_diagonal, tokens, h0, cu_seqlens, chunk_size or CHUNK_SIZE)
    if reverse:
        o = jnp.flip(o, axis=1)
        if cu_seqlens is not None:
            h = jnp.flip(h, axis=0)
    return o.astype(v.dtype), h

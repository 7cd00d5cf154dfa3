"""The ``chunked`` backend: the chunked (WY / UT-transform) algorithm in plain ``jax.numpy``.

The sequence is cut into chunks of ``CHUNK_SIZE`` tokens. Inside a chunk every interaction is a
small dense matrix computed for all chunks at once (matmul-heavy, so fast on CPU and TPU);
across chunks a ``lax.scan`` carries one state per chunk boundary. It is the algorithmic twin
of the Triton kernels.

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

Numerical safety for any log decay ``w <= 0`` (down to -8, or exactly 0): every exponent
evaluated is a difference of in-chunk cumulative log decays that is ``<= 0``. The pairwise
decays ``e^{Gx_i - G_j}`` are exact masked exponentials within sub-chunks of ``SUB_CHUNK``
tokens; between sub-chunks they factor through the cumulative decay ``P`` at the start of the
row's sub-chunk, ``e^{Gx_i - P} e^{P - G_j}``, both factors ``<= 1``.

Packed sequences (``cu_seqlens``): tokens are scattered on the device into a padded buffer
where every segment starts on a chunk boundary (its static length bounds every length
pattern, so nothing recompiles); padding tokens are inert (zero key, value, a, b and log
decay), chunks that start a segment load that segment's initial state, and final states are
gathered at segment ends.

Gradients are JAX autodiff of this code; the pairwise decays are recomputed in the backward
(``jax.checkpoint``), and only one state per chunk is stored, never one per step.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

CHUNK_SIZE = 64  # tokens per chunk
SUB_CHUNK = 16  # tokens per sub-chunk, whose pairwise decays are exact masked exponentials


def _acc(*xs):
    """Accumulation dtype: float32, or float64 when an input is float64 (reference runs)."""
    return jnp.result_type(jnp.float32, *(x.dtype for x in xs if x is not None))


# ------------------------------------------------------------------------------------------
# Intra-chunk pieces. Arrays are [..., C, D]: any leading dims, C tokens of one chunk.
# ------------------------------------------------------------------------------------------


def _masked_exp(exponent, mask):
    """exp(exponent) where mask, else 0; the masked-out exponents (which may be large and
    positive) never reach exp, so neither the value nor the gradient overflows."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0.0)), 0.0)


def _cumulative(log_decay):
    """Inclusive and exclusive in-chunk cumulative sums over the token axis (-2)."""
    inclusive = jnp.cumsum(log_decay, axis=-2)
    exclusive = jnp.concatenate([jnp.zeros_like(inclusive[..., :1, :]), inclusive[..., :-1, :]],
                                axis=-2)
    return inclusive, exclusive


def _sub_chunks(x, sub):
    """[..., C, D] -> [..., C // sub, sub, D]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] // sub, sub, x.shape[-1])


@functools.partial(jax.checkpoint, static_argnums=(4, 5))
def _decayed_scores(rows, cols, g_rows, g_cols, sub, strict):
    """``A[x, y, ..., i, j] = sum_k rows[x,...,i,k] cols[y,...,j,k] exp(g_rows[i,k] - g_cols[j,k])``
    for ``j < i`` (``j <= i`` unless ``strict``), else 0.

    ``rows``: [X, ..., C, K]; ``cols``: [Y, ..., C, K]; ``g_rows``, ``g_cols``: [..., C, K]
    cumulative log decays with ``g_rows[i] <= g_cols[j]`` wherever ``j < i`` (or ``<=``), and
    ``p[I] = g_cols[I*sub - 1] >= g_rows[i]`` for rows ``i`` of sub-chunk ``I``. Returns
    [X, Y, ..., C, C]. Checkpointed: the [.., sub, sub, K] decays are recomputed for the
    gradient, not stored.
    """
    chunk, keys = g_cols.shape[-2:]
    sub = min(sub, chunk)
    n = chunk // sub
    # Log decay before each sub-chunk: 0 for the first, else the inclusive sum up to its start.
    before = jnp.concatenate([jnp.zeros_like(g_cols[..., :1, :]),
                              g_cols[..., sub - 1:-1:sub, :]], axis=-2)             # [..., n, K]
    # Between sub-chunks (column j before row i's sub-chunk I): e^{g_i - p_I} e^{p_I - g_j}.
    row_factor = jnp.exp(_sub_chunks(g_rows, sub) - before[..., None, :])          # [..., n, sub, K]
    earlier = (jnp.arange(chunk)[None, :] < sub * jnp.arange(n)[:, None])[..., None]  # [n, C, 1]
    col_factor = _masked_exp(before[..., :, None, :] - g_cols[..., None, :, :], earlier)
    cross = jnp.einsum("x...nik,y...njk->xy...nij", _sub_chunks(rows, sub) * row_factor,
                       cols[..., None, :, :] * col_factor)                           # [..., n, sub, C]
    # Within a sub-chunk: the exact masked exponential of each pairwise difference.
    pairs = jnp.tril(jnp.ones((sub, sub), bool), -1 if strict else 0)[..., None]
    decay = _masked_exp(_sub_chunks(g_rows, sub)[..., :, None, :]
                        - _sub_chunks(g_cols, sub)[..., None, :, :], pairs)        # [..., n, sub, sub, K]
    diagonal = jnp.einsum("x...nik,y...nijk->xy...nij", _sub_chunks(rows, sub),
                          decay * _sub_chunks(cols, sub)[:, ..., None, :, :])
    # Place each sub-chunk's block on the diagonal of the [sub, C] row strip.
    on_diagonal = jnp.eye(n, dtype=diagonal.dtype)[:, None, :, None]                # [n, 1, n, 1]
    blocks = (diagonal[..., :, :, None, :] * on_diagonal).reshape(cross.shape)
    return (cross + blocks).reshape(*cross.shape[:-3], chunk, chunk)


def _diagonal(values):
    """[..., C] -> [..., C, C] with ``values`` on the diagonal."""
    return values[..., :, None] * jnp.eye(values.shape[-1], dtype=values.dtype)


@functools.partial(jax.checkpoint, static_argnums=(3,))
def _decayed_mix(scores, values, g_values, sub):
    """``out[i, v] = sum_{j<=i} scores[i, j] exp(g_values[i, v] - g_values[j, v]) values[j, v]``
    for a value-side decay (inclusive cumulative ``g_values`` [..., C, V]), split into
    sub-chunks like :func:`_decayed_scores`."""
    chunk = values.shape[-2]
    sub = min(sub, chunk)
    n = chunk // sub
    before = jnp.concatenate([jnp.zeros_like(g_values[..., :1, :]),
                              g_values[..., sub - 1:-1:sub, :]], axis=-2)           # [..., n, V]
    row_factor = jnp.exp(_sub_chunks(g_values, sub) - before[..., None, :])        # [..., n, sub, V]
    earlier = (jnp.arange(chunk)[None, :] < sub * jnp.arange(n)[:, None])[..., None]
    col_factor = _masked_exp(before[..., :, None, :] - g_values[..., None, :, :], earlier)
    strips = _sub_chunks(scores, sub)                                               # [..., n, sub, C]
    cross = row_factor * jnp.einsum("...nij,...njv->...niv", strips,
                                    values[..., None, :, :] * col_factor)
    pairs = jnp.tril(jnp.ones((sub, sub), bool))[..., None]
    g_blocks = _sub_chunks(g_values, sub)
    decay = _masked_exp(g_blocks[..., :, None, :] - g_blocks[..., None, :, :], pairs)
    diagonal_scores = jnp.stack([strips[..., m, :, m * sub:(m + 1) * sub] for m in range(n)], -3)
    inner = jnp.einsum("...nij,...nijv,...njv->...niv", diagonal_scores, decay,
                       _sub_chunks(values, sub))
    return (cross + inner).reshape(values.shape)


class _Chunks(NamedTuple):
    """What the cross-chunk pass needs, per chunk ([B, H, n, ...]).

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
    return jnp.einsum("...kj,...jv->...kv", matrix, state)


def _advance_diagonal(transition, state):
    key_decay, value_decay = transition
    state = key_decay[..., :, None] * state
    return state if value_decay is None else state * value_decay[..., None, :]


def _rwkv7_chunks(r, w, k, v, a, b, sub):
    g, gx = _cumulative(w)
    g_last = g[..., -1:, :]
    scores = _decayed_scores(jnp.stack([r * jnp.exp(w), a]), jnp.stack([k, b]), gx, g, sub,
                             True)
    a_qk = scores[0, 0] + _diagonal(jnp.sum(r * k, -1))
    a_qb = scores[0, 1] + _diagonal(jnp.sum(r * b, -1))
    a_ak, a_ab = scores[1, 0], scores[1, 1]
    # UT transform: (I - A_ab) [u | W] = [A_ak V | a e^{Gx}], unit lower triangular.
    eye = jnp.eye(r.shape[-2], dtype=r.dtype)
    rhs = jnp.concatenate([a_ak @ v, a * jnp.exp(gx)], axis=-1)
    solved = lax.linalg.triangular_solve(eye - a_ab, rhs, left_side=True, lower=True,
                                         unit_diagonal=True)
    u, wy = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]
    to_end = jnp.exp(g_last - g)
    kg, bg = k * to_end, b * to_end
    transpose = lambda x: jnp.swapaxes(x, -1, -2)
    matrix = _diagonal(jnp.exp(g_last[..., 0, :])) + transpose(bg) @ wy
    return _Chunks(transition=(matrix,),
                   update=transpose(kg) @ v + transpose(bg) @ u,
                   read=r * jnp.exp(g) + a_qb @ wy, gate=None,
                   intra=a_qk @ v + a_qb @ u)


def _gated_chunks(q, k, v, key_log_decay, value_log_decay, bonus, sub):
    """Gated linear attention (read after the update) or, with ``bonus``, RWKV-6 (read before
    the update, the current token weighted by ``bonus`` [..., 1, K])."""
    g, gx = _cumulative(key_log_decay)
    g_last = g[..., -1:, :]
    if bonus is None:  # o_i reads h_i: rows decay by G_i, the diagonal has weight 1
        rows, read, on_diagonal = q * jnp.exp(key_log_decay), q * jnp.exp(g), q
    else:  # o_i reads h_{i-1}: rows decay by Gx_i, the diagonal is weighted by the bonus
        rows, read, on_diagonal = q, q * jnp.exp(gx), q * bonus
    scores = _decayed_scores(rows[None], k[None], gx, g, sub, True)[0, 0]
    scores = scores + _diagonal(jnp.sum(on_diagonal * k, -1))
    keys_to_end = k * jnp.exp(g_last - g)
    if value_log_decay is None:
        gate, intra, values_to_end, value_decay = None, scores @ v, v, None
    else:
        gv, _ = _cumulative(value_log_decay)
        gv_last = gv[..., -1:, :]
        gate, intra = jnp.exp(gv), _decayed_mix(scores, v, gv, sub)
        values_to_end, value_decay = v * jnp.exp(gv_last - gv), jnp.exp(gv_last[..., 0, :])
    return _Chunks(transition=(jnp.exp(g_last[..., 0, :]), value_decay),
                   update=jnp.swapaxes(keys_to_end, -1, -2) @ values_to_end,
                   read=read, gate=gate, intra=intra)


# ------------------------------------------------------------------------------------------
# Across chunks: layout, packed segments, the scan over chunk states, outputs.
# ------------------------------------------------------------------------------------------


def _to_chunks(x, chunk):
    """[B, T, H, D] (T a multiple of ``chunk``) -> [B, H, n, C, D]."""
    batch, steps, heads, dim = x.shape
    return x.reshape(batch, steps // chunk, chunk, heads, dim).transpose(0, 3, 1, 2, 4)


def _from_chunks(x):
    """[B, H, n, C, D] -> [B, n * C, H, D]."""
    batch, heads, n, chunk, dim = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(batch, n * chunk, heads, dim)


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


def _chunk_states(advance, chunks, h0, packing):
    """Scan over chunks: the state entering each chunk [B, H, n, K, V] and the last state."""
    time_major = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)
    resets = None if packing is None else (packing.starts, packing.segment)

    def step(state, x):
        transition, update, reset = x
        if reset is not None:  # a chunk that starts a segment loads that segment's state
            starts, segment = reset
            state = jnp.where(starts, h0[segment][None], state)
        return advance(transition, state) + update, state

    init = h0 if packing is None else jnp.zeros_like(h0[:1])
    xs = (jax.tree.map(time_major, chunks.transition), time_major(chunks.update), resets)
    last, states = lax.scan(step, init, xs)
    return jnp.moveaxis(states, 0, 2), last


def _run(build, advance, tokens, h0, cu_seqlens, chunk_size):
    """Run a chunked recurrence over ``tokens`` ([B, T, H, *] arrays whose zero padding is
    inert). ``build`` maps their chunked form [B, H, n, C, *] to :class:`_Chunks`.
    Returns (o [B, T, H, V], final states [N, H, K, V])."""
    steps = tokens[0].shape[1]
    # Short inputs take a shorter chunk (a multiple of the sub-chunk) instead of padding.
    chunk = min(chunk_size, -(-steps // SUB_CHUNK) * SUB_CHUNK)
    if chunk % min(SUB_CHUNK, chunk):
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")
    if cu_seqlens is None:
        packing = None
        length = -(-steps // chunk) * chunk
        pad = lambda x: jnp.pad(x, ((0, 0), (0, length - steps)) + ((0, 0),) * (x.ndim - 2))
    else:
        packing = _packing(cu_seqlens, steps, chunk)
        length = packing.chunks * chunk
        pad = lambda x: jnp.zeros((1, length) + x.shape[2:], x.dtype).at[:, packing.slots].set(
            x, unique_indices=True)
    chunks = build(*(_to_chunks(pad(x), chunk) for x in tokens))
    states, last = _chunk_states(advance, chunks, h0, packing)
    o = jnp.einsum("bhnck,bhnkv->bhncv", chunks.read, states)
    o = _from_chunks((o if chunks.gate is None else o * chunks.gate) + chunks.intra)
    if packing is None:
        return o[:, :steps], last
    # A segment's final state: its last chunk applied to the state entering that chunk.
    at_last = lambda x: None if x is None else x[0][:, packing.last_chunk]  # [H, N, ...]
    final = (advance(jax.tree.map(at_last, chunks.transition), at_last(states))
             + at_last(chunks.update))
    final = jnp.where(packing.nonempty[:, None, None, None], jnp.swapaxes(final, 0, 1), h0)
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
    r, w, k, a, b, v32 = (x.astype(acc) for x in (r, w, k, a, b, v))
    h0 = _initial_state(initial_state, r.shape[0], cu_seqlens, r.shape[2], r.shape[3],
                        v.shape[3], acc)
    build = functools.partial(_rwkv7_chunks, sub=SUB_CHUNK)
    o, h = _run(build, _advance_matrix, (r * scale, w, k, v32, a, b), h0, cu_seqlens,
                chunk_size or CHUNK_SIZE)
    return o.astype(v.dtype), h


def rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens,
          chunk_size=None):
    acc = _acc(r, k, v, w, u)
    r, k, w, v32 = (x.astype(acc) for x in (r, k, w, v))
    h0 = _initial_state(initial_state, r.shape[0], cu_seqlens, r.shape[2], r.shape[3],
                        v.shape[3], acc)
    bonus = u.astype(acc)[None, :, None, None, :]  # [1, H, 1, 1, K] against [B, H, n, C, K]

    def build(r, k, v, w):
        return _gated_chunks(r, k, v, w, None, bonus, SUB_CHUNK)

    o, h = _run(build, _advance_diagonal, (r * scale, k, v32, w), h0, cu_seqlens,
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
    tokens = (q * scale, k, v32, key_log_decay) + (() if gv is None else (gv.astype(acc),))
    if reverse:
        # Backwards in time is forwards on the flipped sequence (segment order flips too).
        tokens = tuple(jnp.flip(x, axis=1) for x in tokens)
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens[-1] - jnp.flip(cu_seqlens)
            h0 = jnp.flip(h0, axis=0)

    def build(q, k, v, key_log_decay, value_log_decay=None):
        return _gated_chunks(q, k, v, key_log_decay, value_log_decay, None, SUB_CHUNK)

    o, h = _run(build, _advance_diagonal, tokens, h0, cu_seqlens, chunk_size or CHUNK_SIZE)
    if reverse:
        o = jnp.flip(o, axis=1)
        if cu_seqlens is not None:
            h = jnp.flip(h, axis=0)
    return o.astype(v.dtype), h

"""The ``native`` backend: a ``lax.scan`` over time, the readable reference for every op.

Accumulation is float32 (float64 when given float64 inputs, which the CLI uses as its
reference). Each op is written as one time step on a batch of states; ``_scan_time`` runs it over the
sequence. For training, the scan runs in blocks of about sqrt(T) steps with ``jax.checkpoint``
around each block, so the backward stores the state only at block boundaries and recomputes
inside a block: memory O((T/C + C) * state) instead of O(T * state). Without a gradient
nothing per-step is kept.

Canonical backend signatures (every backend module follows them; inputs are validated and in
``[B, T, H, *]`` layout; ``initial_state`` is ``[N, H, K, V]`` in the caller's float dtype, cast
by each backend to its accumulation dtype, or None for zeros):

    rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens)
    rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens)
    gated_linear_attention(q, k, v, *, g, g_gamma, gk, gv, scale, initial_state,
                           output_final_state, reverse, cu_seqlens)
        -> (o [B, T, H, V] in v's dtype, final state float32 [N, H, K, V])
    rwkv4(w, u, k, v, *, initial_state, output_final_state) -> (y [B, T, C], state [B, C, 3])
    rwkv7_step(r, w, k, v, a, b, state, *, scale, state_indices)
    rwkv6_step(r, k, v, w, u, state, *, scale, state_indices) -> (o, updated state pool)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def _acc(*xs):
    """Accumulation dtype: float32, or float64 when an input is float64 (reference runs)."""
    return jnp.result_type(jnp.float32, *(x.dtype for x in xs if x is not None))


def _checkpointed_scan(step, carry, xs, length):
    """``lax.scan(step, carry, xs)`` storing the carry only every ~sqrt(length) steps for autodiff."""
    block = max(1, math.isqrt(max(length - 1, 0)) + 1)  # ceil(sqrt(length))
    full, tail = divmod(length, block)
    run_block = jax.checkpoint(lambda c, x: lax.scan(step, c, x))
    parts = []
    if full:
        blocks = jax.tree.map(lambda x: x[: full * block].reshape(full, block, *x.shape[1:]), xs)
        carry, ys = lax.scan(run_block, carry, blocks)
        parts.append(jax.tree.map(lambda y: y.reshape(full * block, *y.shape[2:]), ys))
    if tail:
        carry, ys = run_block(carry, jax.tree.map(lambda x: x[full * block:], xs))
        parts.append(ys)
    return carry, jax.tree.map(lambda *p: jnp.concatenate(p), *parts)


def _scan_time(step, h0, xs, cu_seqlens):
    """Run ``step(h, x_t) -> (h, y_t)`` over time.

    ``xs`` are ``[B, T, ...]`` arrays (or None); ``h0`` is ``[B, ...]``, or ``[N, ...]`` with
    ``cu_seqlens`` (then B == 1 and each segment restarts from its own row of ``h0``).
    Returns ``(ys [B, T, ...], final states [B or N, ...])``.
    """
    length = next(x for x in xs if x is not None).shape[1]
    xs = tuple(None if x is None else jnp.moveaxis(x, 1, 0) for x in xs)
    if cu_seqlens is None:
        h, ys = _checkpointed_scan(step, h0, xs, length)
        return jnp.moveaxis(ys, 0, 1), h

    # Packed segments: segment id of each token and whether it starts its segment. Empty
    # segments own no token, so their final state stays their initial state.
    t = jnp.arange(length, dtype=cu_seqlens.dtype)
    seg = jnp.searchsorted(cu_seqlens, t, side="right") - 1
    starts = t == cu_seqlens[seg]

    def seg_step(carry, x):
        h, finals = carry
        (s, start), x = x
        h = jnp.where(start, h0[s][None], h)
        h, y = step(h, x)
        return (h, finals.at[s].set(h[0])), y

    carry0 = (jnp.zeros_like(h0[:1]), h0)
    (_, finals), ys = _checkpointed_scan(seg_step, carry0, ((seg, starts), xs), length)
    return jnp.moveaxis(ys, 0, 1), finals


def _zeros_state(r, v, initial_state, cu_seqlens, dtype):
    if initial_state is not None:
        return initial_state.astype(dtype)
    n = r.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return jnp.zeros((n, r.shape[2], r.shape[3], v.shape[3]), dtype)


def _read(h, q):
    """o = h^T q per batch and head: h [B,H,K,V], q [B,H,K] -> [B,H,V]."""
    return jnp.einsum("bhk,bhkv->bhv", q, h)


def rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens):
    acc = _acc(r, w, k, v, a, b)

    def step(h, x):
        r, w, k, v, a, b = (y.astype(acc) for y in x)
        h = (h * jnp.exp(w)[..., None] + b[..., None] * _read(h, a)[..., None, :]
             + k[..., None] * v[..., None, :])
        return h, _read(h, r * scale)

    h0 = _zeros_state(r, v, initial_state, cu_seqlens, acc)
    o, h = _scan_time(step, h0, (r, w, k, v, a, b), cu_seqlens)
    return o.astype(v.dtype), h


def rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens):
    acc = _acc(r, k, v, w, u)
    u = u.astype(acc)

    def step(h, x):
        r, k, v, w = (y.astype(acc) for y in x)
        kv = k[..., None] * v[..., None, :]
        o = _read(h + u[:, :, None] * kv, r * scale)
        return h * jnp.exp(w)[..., None] + kv, o

    h0 = _zeros_state(r, v, initial_state, cu_seqlens, acc)
    o, h = _scan_time(step, h0, (r, k, v, w), cu_seqlens)
    return o.astype(v.dtype), h


def gated_linear_attention(q, k, v, *, g, g_gamma, gk, gv, scale, initial_state,
                           output_final_state, reverse, cu_seqlens):
    acc = _acc(q, k, v, g, g_gamma, gk, gv)
    h0 = _zeros_state(q, v, initial_state, cu_seqlens, acc)
    if reverse:
        # Running backwards in time is running forwards on the time-flipped sequence; with
        # packed segments the segment order flips too.
        flip = lambda x: None if x is None else jnp.flip(x, axis=1)
        q, k, v, g, gk, gv = map(flip, (q, k, v, g, gk, gv))
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens[-1] - jnp.flip(cu_seqlens)
            h0 = jnp.flip(h0, axis=0)
    gamma = None if g_gamma is None else g_gamma.astype(acc)

    def step(h, x):
        q, k, v, g, gk, gv = (None if y is None else y.astype(acc) for y in x)
        if g is not None or gamma is not None:
            log_decay = (0.0 if g is None else g) + (0.0 if gamma is None else gamma)
            h = h * jnp.exp(log_decay)[..., None, None]
        if gk is not None:
            h = h * jnp.exp(gk)[..., None]
        if gv is not None:
            h = h * jnp.exp(gv)[..., None, :]
        h = h + k[..., None] * v[..., None, :]
        return h, _read(h, q * scale)

    o, h = _scan_time(step, h0, (q, k, v, g, gk, gv), cu_seqlens)
    if reverse:
        o = jnp.flip(o, axis=1)
        if cu_seqlens is not None:
            h = jnp.flip(h, axis=0)
    return o.astype(v.dtype), h


def rwkv4(w, u, k, v, *, initial_state, output_final_state):
    acc = _acc(w, u, k, v)
    w, u = w.astype(acc), u.astype(acc)

    def step(state, x):
        k, v = (y.astype(acc) for y in x)
        aa, bb, pp = state[..., 0], state[..., 1], state[..., 2]
        ww = u + k
        p = jnp.maximum(pp, ww)
        e1, e2 = jnp.exp(pp - p), jnp.exp(ww - p)
        y = (e1 * aa + e2 * v) / (e1 * bb + e2)
        ww = w + pp
        p = jnp.maximum(ww, k)
        e1, e2 = jnp.exp(ww - p), jnp.exp(k - p)
        return jnp.stack([e1 * aa + e2 * v, e1 * bb + e2, p], axis=-1), y

    if initial_state is None:
        zeros = jnp.zeros(k.shape[:1] + k.shape[2:], acc)
        initial_state = jnp.stack([zeros, zeros, jnp.full_like(zeros, -1e38)], axis=-1)
    y, state = _scan_time(step, initial_state.astype(acc), (k, v), None)
    return y.astype(v.dtype), state


def rwkv7_step(r, w, k, v, a, b, state, *, scale, state_indices):
    o, h = rwkv7(r, w, k, v, a, b, scale=scale, initial_state=state[state_indices],
                 output_final_state=True, cu_seqlens=None)
    return o, state.at[state_indices].set(h.astype(state.dtype))  # float64 inputs: no warning


def rwkv6_step(r, k, v, w, u, state, *, scale, state_indices):
    o, h = rwkv6(r, k, v, w, u, scale=scale, initial_state=state[state_indices],
                 output_final_state=True, cu_seqlens=None)
    return o, state.at[state_indices].set(h.astype(state.dtype))  # float64 inputs: no warning

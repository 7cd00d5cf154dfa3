"""What the RWKV-7 and GLA/RWKV-6 launches share: the kernels' list of sequences ``cu`` and
the slot arithmetic of their per-chunk buffers (every buffer has a static size: no host sync,
no recompile per length pattern), and the head-size check."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

MAX_HEAD_SIZE = 128
_UNUSED = jax.ShapeDtypeStruct((1,), jnp.float32)  # an output a kernel's options leave out


def _pow2_at_least(n, floor=16):
    return max(floor, 1 << (n - 1).bit_length())


def _check_head_sizes(k_size, v_size):
    for name, size in (("K (the key/head size of r, w, k, a, b)", k_size),
                       ("V (the value size of v)", v_size)):
        if not 1 <= size <= MAX_HEAD_SIZE:
            raise ValueError(f"backend 'triton' supports head sizes up to {MAX_HEAD_SIZE} "
                             f"(32, 64 and 128 are the tuned ones); got {name} = {size}")


def _sequences(batch, steps, cu_seqlens, initial_state, state_shape):
    """The kernels' list of sequences ``cu`` (``cu_seqlens``, or ``arange(B + 1) * T`` for a plain
    batch) and the float32 initial state of each (zeros when None)."""
    if cu_seqlens is None:
        cu = jnp.arange(batch + 1, dtype=jnp.int32) * steps
    else:
        cu = cu_seqlens.astype(jnp.int32)
    if initial_state is None:
        return cu, jnp.zeros((cu.shape[0] - 1,) + state_shape, jnp.float32)
    return cu, initial_state.astype(jnp.float32)


def _first_slots(cu, span):
    """Spans of ``span`` tokens of each sequence (the last may be partial), and the first slot
    of each sequence in a buffer of one entry per span."""
    spans = (cu[1:] - cu[:-1] + span - 1) // span
    return spans, jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(spans)[:-1]]).astype(
        jnp.int32)


def _slot_sequences(spans, first_slot, slots):
    """The sequence of each of ``slots`` span slots, -1 past the last span (the buffers have a
    static size). A sequence of no span shares its first slot with the next: 'right' skips it."""
    slot = jnp.arange(slots, dtype=jnp.int32)
    sequence = jnp.searchsorted(first_slot, slot, side="right").astype(jnp.int32) - 1
    return jnp.where(slot < spans.sum(), sequence, -1)


def _slot_count(rows, sequences, span):
    """A static bound on the spans of any length pattern: one buffer size, no recompile."""
    return rows // span + sequences


class SequencePieces(NamedTuple):
    """What rwkv_jax.shard's one-pass sequence parallelism calls on a block (time-major
    ``[B, T, H, *]`` arrays ``x`` of the op; states float32 ``[B, H, K, V]``):

    state(x) -> (transition, h_local, saved): the block's map of the state (RWKV-7: a
      [B, H, K, K] matrix; else a factor broadcasting against it) and its final state from
      zero;
    forward(x, saved, h_in) -> ((o, h_out), residuals): the op from ``h_in``;
    state_gradient(x, residuals, do) -> (g, saved): the gradient the outputs alone send into
      the initial state;
    backward(x, residuals, saved, do, dh_T) -> (gradients of x, gradient of h_in)."""
    state: object
    forward: object
    state_gradient: object
    backward: object

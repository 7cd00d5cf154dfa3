"""Pieces shared by the RWKV-7 and RWKV-6 models: token shift, the per-head group norm, LoRA
helpers, state containers, the two ways of running a layer (whole sequences or steps on a
state pool), and the block and language model that both versions build the same way."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import _checks as checks
from .. import ops


class SizesConfig:
    """Shared part of the frozen config dataclasses: fill in the defaults of the fields left
    None, check that every size is a positive int and that heads tile the width."""

    def complete(self, defaults: dict, optional=()):
        """``optional``: fields that may stay None."""
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        kind = type(self).__name__
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{kind}.{field.name} must be a positive int, got {value!r}")
        if self.n_embd % self.head_size:
            raise ValueError(f"{kind}.n_embd={self.n_embd} must be a multiple of "
                             f"head_size={self.head_size}")

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_size


class TimeMixState(NamedTuple):
    """State of one time-mix layer: ``shift`` float32 ``[S, C]`` (the last input token of each
    row) and ``wkv`` float32 ``[S, H, K, V]`` (the recurrent state). ``S`` is the batch size in
    sequence mode, or the number of slots of a state pool in step mode."""
    shift: jax.Array
    wkv: jax.Array


class LayerState(NamedTuple):
    """State of one block: its time-mix state and the channel-mix token shift ``[S, C]``."""
    att: TimeMixState
    ffn_shift: jax.Array


def zero_layer_state(slots, n_embd, n_head, head_size) -> LayerState:
    # Three separate buffers, so that the whole state can be donated.
    shift = lambda: jnp.zeros((slots, n_embd), jnp.float32)
    wkv = jnp.zeros((slots, n_head, head_size, head_size), jnp.float32)
    return LayerState(TimeMixState(shift(), wkv), shift())


class Sequence:
    """Run layers over whole sequences (training, prefill). A state, when given, holds one row
    per batch row, or one per segment with ``cu_seqlens``; without one, every sequence starts
    from zeros.

    ``cu_seqlens`` (int ``[N + 1]``, B = 1) packs N sequences along T: the wkv op restarts its
    state at every segment, and so does the token shift (the first token of a segment sees its
    own initial shift, never the last token of the segment before it).

    ``resets`` (bool ``[B, T]``) restarts rows in place instead, keeping the batch's rows (and
    their sharding): where it is True a document begins, the token shifts see zeros before it
    and the layers make the wkv transition there annihilate the previous state
    (:meth:`at_resets`), so every document runs as if alone from a zero state."""

    def __init__(self, backend=None, wkv_op=None, cu_seqlens=None, resets=None):
        if backend is not None and wkv_op is not None:
            raise ValueError(f"pass either backend= or wkv_op= (which picks its own backend), "
                             f"got backend={backend!r} and wkv_op={wkv_op!r}")
        if resets is not None:
            if cu_seqlens is not None:
                raise ValueError("pass either cu_seqlens= (sequences packed along T, B = 1) or "
                                 "resets= (documents restarting inside each row), not both")
            resets = checks.array("resets", resets)
            if resets.dtype != jnp.bool_ or resets.ndim != 2:
                raise TypeError(f"resets must be a bool array [B, T] (True where a document "
                                f"begins), got shape {tuple(resets.shape)} and dtype "
                                f"{resets.dtype}")
        self.backend = backend
        self.wkv_op = wkv_op
        self.cu_seqlens = cu_seqlens
        self.resets = resets

    def _resets(self, x):
        """``resets`` checked against ``x [B, T, ...]``."""
        if self.resets.shape != x.shape[:2]:
            raise ValueError(f"resets must be [B, T] = {list(x.shape[:2])} (the tokens' shape), "
                             f"got shape {tuple(self.resets.shape)}")
        return jnp.asarray(self.resets)

    def at_resets(self, value, fill):
        """``value [B, T, ...]`` with ``fill`` at the reset positions (unchanged without
        resets)."""
        if self.resets is None:
            return value
        where = self._resets(value).reshape(value.shape[:2] + (1,) * (value.ndim - 2))
        return jnp.where(where, jnp.asarray(fill, value.dtype), value)

    def segments(self, x):
        """For packed ``x [1, T, C]``: (int32 offsets, traced validity or None), offsets checked
        as the wkv op checks them (invalid traced ones replaced by a harmless set)."""
        cu = checks.cu_seqlens(self.cu_seqlens, x.shape[0], x.shape[1])
        return ops._guard_offsets(cu, x.shape[1])

    def previous(self, x, shift):
        """The token before each position of ``x [B, T, C]``; ``shift [B, C]`` (``[N, C]`` when
        packed; None: zeros) precedes the first token of each row (segment)."""
        rows = x.shape[:1] if self.cu_seqlens is None else (
            checks.cu_seqlens(self.cu_seqlens, x.shape[0], x.shape[1]).shape[0] - 1,)
        if shift is not None and shift.shape != rows + x.shape[2:]:
            what = "batch row" if self.cu_seqlens is None else "segment of cu_seqlens"
            raise ValueError(f"in sequence mode the state holds one row per {what}: a token "
                             f"shift of shape {rows + x.shape[2:]} is needed, got "
                             f"{tuple(shift.shape)}")
        before = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
        if self.cu_seqlens is None:
            before = before if shift is None else before.at[:, 0].set(shift.astype(x.dtype))
            return self.at_resets(before, 0)
        cu, _ = self.segments(x)
        position = jnp.arange(x.shape[1])
        segment = jnp.searchsorted(cu[1:], position, side="right")  # cu[s] <= t < cu[s + 1]
        first = position == cu[jnp.minimum(segment, cu.shape[0] - 2)]
        start = jnp.zeros_like(x[0]) if shift is None else shift[segment].astype(x.dtype)
        return jnp.where(first[None, :, None], start[None], before)

    def keep_last(self, shift, x):
        if self.cu_seqlens is None:
            return x[:, -1].astype(jnp.float32)
        cu, ok = self.segments(x)
        last = x[0, jnp.maximum(cu[1:] - 1, 0)].astype(jnp.float32)
        # An empty segment keeps its initial shift.
        kept = jnp.zeros_like(last) if shift is None else shift.astype(jnp.float32)
        return ops._nan_unless(ok, jnp.where((cu[1:] > cu[:-1])[:, None], last, kept))

    def wkv(self, sequence_op, step_op, args, state):
        op = self.wkv_op or functools.partial(sequence_op, backend=self.backend)
        packed = {} if self.cu_seqlens is None else {"cu_seqlens": self.cu_seqlens}
        return op(*args, initial_state=state, **packed)


class Step:
    """Advance rows ``state_indices`` (default: rows ``0..B-1``) of state pools by the ``T``
    (small) tokens of ``x`` (decoding, or prefill through the step kernels).

    The token-shift pools are guarded as the wkv step op guards its pool (ops.py,
    ``_guard_rows``): known indices are checked (in ``[0, S)``, distinct); a traced index that
    is out of range or shared by two rows reads a NaN row and writes nothing, so no other slot
    of any pool changes."""
    resets = None   # steps continue their rows' states

    def __init__(self, batch, state_indices=None, backend=None):
        if state_indices is not None:
            state_indices = checks.shaped("state_indices", state_indices, ("B",),
                                          {"B": (batch, "tokens")}, kind=checks.integer)
            # Known values are checked before the int32 cast (an int64 2**32 + 1 must not wrap
            # to slot 1); the step ops check them against the pool's size.
            values = checks.host_values(state_indices)
            if values is not None and np.any((values < 0) | (values > np.iinfo(np.int32).max)):
                raise ValueError(f"state_indices must be pool rows in [0, 2**31), got "
                                 f"{values.tolist()}")
            state_indices = jnp.asarray(state_indices, jnp.int32)
        self.batch = batch
        self.indices = state_indices
        self.backend = backend

    def rows(self, shift):
        """Pool rows of the batch for a token-shift pool ``shift [S, C]``: a slice (no
        indices) or guarded int32 rows (the sentinel S for invalid traced ones)."""
        slots = shift.shape[0]
        if self.indices is None:
            if slots < self.batch:
                raise ValueError(f"state has S={slots} slots for a batch of B={self.batch}; "
                                 f"pass state_indices [B] to pick a slot per row")
            return slice(0, self.batch)
        checks.indices("state_indices", self.indices, slots, distinct=True)
        return ops._guard_rows(self.indices, slots)[0]

    def previous(self, x, shift):
        if shift.ndim != 2 or shift.shape[1] != x.shape[2] or shift.dtype != jnp.float32:
            raise ValueError(f"a token-shift pool must be float32 [S, {x.shape[2]}], got shape "
                             f"{tuple(shift.shape)} and dtype {shift.dtype}")
        rows = self.rows(shift)
        first = (shift[rows] if isinstance(rows, slice)
                 else shift.at[rows].get(mode="fill", fill_value=jnp.nan))
        return jnp.concatenate([first[:, None].astype(x.dtype), x[:, :-1]], axis=1)

    def keep_last(self, shift, x):
        last = x[:, -1].astype(jnp.float32)
        rows = self.rows(shift)
        if isinstance(rows, slice):
            return last if shift.shape[0] == self.batch else shift.at[rows].set(last)
        return shift.at[rows].set(last, mode="drop")

    def at_resets(self, value, fill):
        return value

    def wkv(self, sequence_op, step_op, args, state):
        return step_op(*args, state, state_indices=self.indices, backend=self.backend)


def check_layer_state(name, state, n_embd, n_head, head_size):
    """``state`` must be a LayerState of float32 arrays with one slot count ``S``."""
    if not isinstance(state, LayerState):
        raise TypeError(f"{name} must be a LayerState (see init_state), got {type(state).__name__}")
    slots = getattr(state.att.wkv, "shape", (None,))[0]
    needs = {"att.shift": (slots, n_embd), "att.wkv": (slots, n_head, head_size, head_size),
             "ffn_shift": (slots, n_embd)}
    got = {"att.shift": state.att.shift, "att.wkv": state.att.wkv, "ffn_shift": state.ffn_shift}
    for part, shape in needs.items():
        x_shape, x_dtype = tuple(getattr(got[part], "shape", ())), getattr(got[part], "dtype", None)
        if x_shape != shape or x_dtype != jnp.float32:
            raise ValueError(f"{name}.{part} must be float32 {list(shape)}, got shape {x_shape} "
                             f"and dtype {x_dtype}")


class GroupNormPerHead(nnx.Module):
    """The official ``ln_x``: each head's channels normalised on their own (torch
    ``GroupNorm(H, C)``), then a per-channel scale and bias. Statistics in float32."""

    def __init__(self, n_embd: int, *, eps: float = 64e-5, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((n_embd,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((n_embd,), param_dtype))

    def __call__(self, x):
        """``x [B, T, H, N]`` -> ``[B, T, H * N]`` in ``x``'s dtype."""
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = x32.var(-1, keepdims=True)
        # The width spelled out, not -1: -1 cannot be inferred from an empty batch.
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).reshape(*x.shape[:-2],
                                                                   x.shape[-2] * x.shape[-1])
        return (y * self.scale[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class ChannelMixBase(nnx.Module):
    """The two modes of a channel-mix layer, whose only state is its token shift; subclasses
    define ``run(x, shift, runner) -> (y, shift)``."""

    def __call__(self, x, shift=None, *, cu_seqlens=None, resets=None):
        """Sequence mode: ``x [B, T, C]``, ``shift [B, C]`` (the token before ``x``) or None
        for zeros. Returns ``(y [B, T, C], the last token of x as float32 [B, C])``. With
        ``cu_seqlens`` (B = 1) per packed segment: ``shift`` and the result are ``[N, C]``.
        ``resets`` (bool ``[B, T]``): zeros precede the positions where it is True."""
        return self.run(x, shift, Sequence(cu_seqlens=cu_seqlens, resets=resets))

    def step(self, x, shift, *, state_indices=None):
        """Step mode on a token-shift pool ``shift [S, C]``. Returns ``(y, updated pool)``."""
        return self.run(x, shift, Step(x.shape[0], state_indices))


def param(value, dtype) -> nnx.Param:
    return nnx.Param(jnp.asarray(value, dtype))


def lora(x, down, up, inner=None):
    """Low-rank path ``inner(x @ down) @ up`` in ``x``'s dtype."""
    h = x @ down[...].astype(x.dtype)
    if inner is not None:
        h = inner(h)
    return h @ up[...].astype(x.dtype)


def channel_ramp(n_embd: int, power: float) -> np.ndarray:
    """Init of the token-shift mixes: ``1 - (c / C) ** power`` over channels ``c`` (mixes near
    1 take mostly the previous token, near 0 mostly the current one)."""
    return 1.0 - (np.arange(n_embd) / n_embd) ** power


def check_tokens(tokens, vocab_size):
    """``tokens`` int ``[B, T]``; known values must be ids in ``[0, vocab_size)`` (a ValueError
    names the first bad one). Traced values cannot be read here: see :func:`embed`."""
    tokens = checks.array("tokens", tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
        raise TypeError(f"tokens must be an integer array [B, T], got shape {tuple(tokens.shape)} "
                        f"and dtype {tokens.dtype}")
    checks.positive_length("tokens", tokens.shape[1])
    values = checks.host_values(tokens)
    if values is not None:
        bad = np.argwhere((values < 0) | (values >= vocab_size))
        if bad.size:
            row, col = bad[0].tolist()
            raise ValueError(f"tokens must be ids in [0, {vocab_size}) (the vocabulary), got "
                             f"tokens[{row}, {col}] = {values[row, col]} ({len(bad)} bad in all)")
    return tokens


def embed(table, tokens, dtype):
    """Rows ``tokens`` of the embedding ``table [V, C]`` in ``dtype`` (gathered, then cast: a
    step reads its rows, not the whole table). A traced id outside ``[0, V)`` gives a NaN row
    (then NaN logits, and NaN in the state it feeds), never a wrapped or clamped token."""
    vocab = table.shape[0]
    rows = jnp.where((tokens >= 0) & (tokens < vocab), tokens, vocab).astype(jnp.int32)
    return table.at[rows].get(mode="fill", fill_value=jnp.nan).astype(dtype)


def _norm(config, dtype, param_dtype, rngs):
    return nnx.LayerNorm(config.n_embd, epsilon=1e-5, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)


class BlockBase(nnx.Module):
    """``x += att(ln1(x)); x += ffn(ln2(x))``, with ``ln0`` applied first in layer 0.

    A version names its layer classes (``time_mix``, ``channel_mix``) and runs its time-mix in
    :meth:`mix_time`, which passes on a ``carry`` from layer to layer (RWKV-7: the value of
    layer 0, ``v_first``; RWKV-6: nothing, None)."""
    time_mix: type
    channel_mix: type

    def __init__(self, config, layer_id: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.config = config
        self.ln0 = _norm(config, dtype, param_dtype, rngs) if layer_id == 0 else None
        self.ln1 = _norm(config, dtype, param_dtype, rngs)
        self.ln2 = _norm(config, dtype, param_dtype, rngs)
        self.att = self.time_mix(config, layer_id, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)
        self.ffn = self.channel_mix(config, layer_id, dtype=dtype, param_dtype=param_dtype,
                                    rngs=rngs)

    def mix_time(self, x, carry, state, runner):
        """``(y, carry, TimeMixState)`` of the time-mix on ``x``."""
        raise NotImplementedError

    def run(self, x, carry, state, runner):
        if self.ln0 is not None:
            x = self.ln0(x)
        y, carry, att = self.mix_time(self.ln1(x), carry, None if state is None else state.att,
                                      runner)
        x = x + y
        y, ffn_shift = self.ffn.run(self.ln2(x), None if state is None else state.ffn_shift,
                                    runner)
        return x + y, carry, LayerState(att, ffn_shift)


class LanguageModel(nnx.Module):
    """An RWKV language model: embedding, ``config.n_layer`` blocks (of the version's ``block``
    class), ``ln_out`` and the output head.

    ``model(tokens)`` gives logits ``[B, T, vocab]`` (sequence mode); ``model.step(tokens,
    state)`` advances a generation state made by ``model.init_state(slots)``. Both modes give the
    same logits on the same tokens.
    """
    block: type
    config_type: type

    def __init__(self, config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if not isinstance(config, self.config_type):
            raise TypeError(f"config must be an {self.config_type.__name__}, got "
                            f"{type(config).__name__}")
        if getattr(config, "vocab_size", None) is None:
            raise ValueError(f"a language model needs {type(config).__name__}.vocab_size")
        self.config = config
        self.emb = nnx.Embed(config.vocab_size, config.n_embd, dtype=dtype,
                             param_dtype=param_dtype,
                             embedding_init=nnx.initializers.uniform(2e-4), rngs=rngs)
        self.blocks = nnx.List([self.block(config, i, dtype=dtype, param_dtype=param_dtype,
                                           rngs=rngs) for i in range(config.n_layer)])
        self.ln_out = _norm(config, dtype, param_dtype, rngs)
        self.head = nnx.Linear(config.n_embd, config.vocab_size, use_bias=False, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)

    def init_state(self, slots: int) -> tuple[LayerState, ...]:
        """A zero state: per layer, pools of ``slots`` rows (float32)."""
        cfg = self.config
        return tuple(zero_layer_state(slots, cfg.n_embd, cfg.n_head, cfg.head_size)
                     for _ in range(cfg.n_layer))

    def __call__(self, tokens, state=None, *, return_state=False, backend=None, wkv_op=None,
                 cu_seqlens=None, resets=None):
        """Sequence mode. ``tokens`` int ``[B, T]``; ``state`` None (zeros) or one row per batch
        row (``init_state(B)`` or a state returned earlier). Returns logits ``[B, T, vocab]``,
        and the final state too when ``return_state``. ``backend`` picks the kernels;
        ``wkv_op`` replaces the version's sequence op (:func:`rwkv_jax.rwkv7`,
        :func:`rwkv_jax.rwkv6`: same signature, e.g. a ``rwkv_jax.shard`` of it).
        ``cu_seqlens`` (int ``[N + 1]``, B = 1) packs N sequences along T: each starts from its
        own row of ``state`` (``init_state(N)``), its token shifts and wkv state restart at its
        first token, and the final state has one row per sequence. ``resets`` (bool ``[B, T]``,
        not with ``cu_seqlens``) restarts documents inside the rows instead: where it is True
        a document begins, its token shifts and wkv state restart from zeros (the state's and
        the previous document's contribution gone exactly), so each document's logits are
        those of the document run alone; the batch keeps its rows.

        Token ids must lie in ``[0, vocab)``: known ones are checked (ValueError); traced ones
        (under ``jax.jit``) cannot be, and an id outside gives NaN logits for its position and
        the positions after it in its sequence."""
        x, state = self.hidden(tokens, state, backend=backend, wkv_op=wkv_op,
                               cu_seqlens=cu_seqlens, resets=resets)
        logits = self.head(x)
        return (logits, state) if return_state else logits

    def hidden(self, tokens, state=None, *, backend=None, wkv_op=None, cu_seqlens=None,
               resets=None):
        """The sequence mode up to the output head: ``(ln_out(x) [B, T, C], final state)``, for
        callers that need logits at a few positions only (prefill)."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        runner = Sequence(backend, wkv_op, cu_seqlens, resets)
        if resets is not None:
            runner._resets(tokens)
        return self.run(tokens, state, runner)

    def step(self, tokens, state, *, state_indices=None, backend=None):
        """Step mode: feed ``tokens [B, T]`` (T small, usually 1) to the rows ``state_indices``
        (default ``0..B-1``) of ``state``. Returns ``(logits [B, T, vocab], new state)``;
        donate ``state`` under ``jax.jit`` so the pools update in place. Token ids as in the
        sequence mode; an invalid traced ``state_indices`` row reads NaN and writes no slot of
        any pool."""
        if state is None:
            raise ValueError("step needs a state; make one with init_state(slots)")
        tokens = check_tokens(tokens, self.config.vocab_size)
        x, state = self.run(tokens, state, Step(tokens.shape[0], state_indices, backend))
        return self.head(x), state

    def run(self, tokens, state, runner):
        cfg = self.config
        if state is not None:
            if not isinstance(state, (tuple, list)) or len(state) != cfg.n_layer:
                got = (f"{len(state)} entries" if isinstance(state, (tuple, list))
                       else type(state).__name__)
                raise ValueError(f"state must hold one LayerState per layer ({cfg.n_layer}), "
                                 f"got {got}")
            for i, layer_state in enumerate(state):
                check_layer_state(f"state[{i}]", layer_state, cfg.n_embd, cfg.n_head,
                                  cfg.head_size)
        x = embed(self.emb.embedding[...], tokens, self.emb.dtype or self.emb.param_dtype)
        carry = None
        new_state = []
        for i, block in enumerate(self.blocks):
            x, carry, layer_state = block.run(x, carry, None if state is None else state[i],
                                              runner)
            new_state.append(layer_state)
        return self.ln_out(x), tuple(new_state)

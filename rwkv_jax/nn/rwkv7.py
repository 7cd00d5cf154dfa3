"""Flax NNX modules for the official RWKV-7 ("x070") model: time-mix, channel-mix, block and a
small language model.

Every layer runs in two modes that compute the same function:

- sequence mode, ``layer(x, ..., state=None, backend=None, wkv_op=None)``: whole sequences
  through :func:`rwkv_jax.rwkv7` (training and prefill); an optional state holds one row per
  batch row, and the final state comes back;
- step mode, ``layer.step(x, ..., state, state_indices=None, backend=None)``: a few tokens
  through :func:`rwkv_jax.rwkv7_step`, advancing the rows ``state_indices`` of state pools
  (token-shift rows and the wkv state) for generation.

Parameters keep the official names (``x_r``, ``w0``, ``w1``, ...; the linear maps are
``nnx.Linear`` with ``[in, out]`` kernels) so :mod:`rwkv_jax.nn.checkpoint` maps an official
checkpoint one to one. Parameters are float32 by default; ``dtype`` sets the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..ops import rwkv7, rwkv7_step
from .common import (BlockBase, ChannelMixBase, GroupNormPerHead, LanguageModel, LayerState,
                     Sequence, SizesConfig, Step, TimeMixState, channel_ramp, lora, param)

# w = -exp(-0.5) * sigmoid(.) keeps the per-step decay exp(w) in [exp(-0.6065), 1).
_MAX_LOG_DECAY = math.exp(-0.5)


def _lora_size(n_embd: int, factor: float) -> int:
    """The official suggestion for a LoRA width: factor * sqrt(C), rounded to a multiple of 32
    (at least 32)."""
    return max(32, int(round(factor * math.sqrt(n_embd) / 32)) * 32)


@dataclasses.dataclass(frozen=True)
class RWKV7Config(SizesConfig):
    """Sizes of an RWKV-7 model. The LoRA widths and the channel-mix width default to the
    official choices (decay and in-context rate 2.5 sqrt(C), value residual 1.7 sqrt(C), gate
    5 sqrt(C), rounded to multiples of 32; channel-mix 4 C)."""
    vocab_size: int
    n_embd: int
    n_layer: int
    head_size: int = 64
    dim_ffn: Optional[int] = None
    decay_lora: Optional[int] = None
    a_lora: Optional[int] = None
    v_lora: Optional[int] = None
    gate_lora: Optional[int] = None

    def __post_init__(self):
        self.complete(dict(dim_ffn=4 * self.n_embd, decay_lora=_lora_size(self.n_embd, 2.5),
                           a_lora=_lora_size(self.n_embd, 2.5),
                           v_lora=_lora_size(self.n_embd, 1.7),
                           gate_lora=_lora_size(self.n_embd, 5.0)))


class RWKV7TimeMix(nnx.Module):
    """The RWKV-7 time-mix (attention) layer. ``first_layer`` marks layer 0: it produces the
    value ``v_first`` that later layers mix into theirs (the value residual), so it has no
    ``v0, v1, v2`` of its own."""

    def __init__(self, config: RWKV7Config, layer_id: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        c, h, n = config.n_embd, config.n_head, config.head_size
        self.config = config
        self.first_layer = layer_id == 0
        self.dtype = dtype
        # Deeper layers start with less token shift, as in the official init.
        depth = 1.0 - layer_id / config.n_layer
        for name, power in dict(x_r=0.2, x_w=0.9, x_k=0.7, x_v=0.7, x_a=0.9, x_g=0.2).items():
            setattr(self, name, param(channel_ramp(c, power * depth), param_dtype))

        def low_rank(width):
            # Down-projections start at zero, up-projections small and orthogonal (drawn in
            # float32: the QR decomposition behind it takes no 16-bit dtype).
            up = nnx.initializers.orthogonal(scale=0.1)(rngs.params(), (width, c), jnp.float32)
            up = up.astype(param_dtype)
            return nnx.Param(jnp.zeros((c, width), param_dtype)), nnx.Param(up)

        # Decay biases spread over each head from slow (log decay ~ -0.004) to fast (~ -0.45).
        self.w0 = param(np.tile(np.linspace(-5.0, 1.0, n), h), param_dtype)
        self.w1, self.w2 = low_rank(config.decay_lora)
        self.a0 = param(np.zeros(c), param_dtype)
        self.a1, self.a2 = low_rank(config.a_lora)
        if not self.first_layer:
            self.v0 = param(np.ones(c), param_dtype)
            self.v1, self.v2 = low_rank(config.v_lora)
        self.g1, self.g2 = low_rank(config.gate_lora)
        self.k_k = param(np.full(c, 0.85), param_dtype)
        self.k_a = param(np.ones(c), param_dtype)
        self.r_k = param(np.zeros((h, n)), param_dtype)

        def linear(fan_in, fan_out, init=nnx.initializers.lecun_normal()):
            return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=dtype,
                              param_dtype=param_dtype, kernel_init=init, rngs=rngs)

        self.receptance = linear(c, c)
        self.key = linear(c, c, nnx.initializers.normal(0.1 / math.sqrt(c)))
        self.value = linear(c, c)
        self.output = linear(c, c, nnx.initializers.zeros_init())
        self.ln_x = GroupNormPerHead(c, param_dtype=param_dtype)

    def __call__(self, x, v_first=None, state: Optional[TimeMixState] = None, *, backend=None,
                 wkv_op=None, cu_seqlens=None, resets=None):
        """Sequence mode. ``x [B, T, C]``; ``v_first [B, T, C]`` from layer 0 (None in layer 0);
        ``state`` None (zeros) or one row per batch row (per segment with ``cu_seqlens``, which
        packs sequences along T with B = 1). ``wkv_op`` replaces :func:`rwkv_jax.rwkv7` (same
        signature, e.g. a ``rwkv_jax.shard`` of it). ``resets`` (bool ``[B, T]``): the token
        shift and the wkv state restart from zeros where it is True.
        Returns ``(y [B, T, C], v_first, final TimeMixState)``."""
        return self.run(x, v_first, state, Sequence(backend, wkv_op, cu_seqlens, resets))

    def step(self, x, v_first, state: TimeMixState, *, state_indices=None, backend=None):
        """Step mode: as the sequence mode, advancing rows ``state_indices`` of the pools."""
        return self.run(x, v_first, state, Step(x.shape[0], state_indices, backend))

    def run(self, x, v_first, state, runner):
        batch, steps, c = x.shape
        h, n = self.config.n_head, self.config.head_size
        x = x.astype(self.dtype)
        xx = runner.previous(x, None if state is None else state.shift) - x
        xr, xw, xk, xv, xa, xg = (x + xx * getattr(self, name)[...].astype(x.dtype)
                                  for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        r = self.receptance(xr)
        # Official: decay = exp(-exp(-softplus(-z) - 0.5)) = exp(-exp(-0.5) * sigmoid(z)).
        z = (self.w0[...].astype(jnp.float32)
             + lora(xw, self.w1, self.w2, jnp.tanh).astype(jnp.float32))
        w = (-_MAX_LOG_DECAY * jax.nn.sigmoid(z)).astype(x.dtype)
        k = self.key(xk)
        v = self.value(xv)
        if self.first_layer:
            v_first = v
        else:
            if v_first is None:
                raise ValueError("v_first (the value of layer 0) is needed by every later layer")
            mix = jax.nn.sigmoid(self.v0[...].astype(x.dtype) + lora(xv, self.v1, self.v2))
            v = v + (v_first.astype(x.dtype) - v) * mix
        a = jax.nn.sigmoid(self.a0[...].astype(x.dtype) + lora(xa, self.a1, self.a2))
        g = lora(xg, self.g1, self.g2, jax.nn.sigmoid)

        heads = lambda t: t.reshape(batch, steps, h, n)
        kk = heads(k * self.k_k[...].astype(x.dtype))
        # Unit-norm key per head (as torch F.normalize: divide by max(norm, 1e-12)).
        kk = kk / jnp.maximum(jnp.linalg.norm(kk.astype(jnp.float32), axis=-1, keepdims=True),
                              1e-12).astype(x.dtype)
        k = k * (1 + (a - 1) * self.k_a[...].astype(x.dtype))
        r, w, k, v, a = map(heads, (r, w, k, v, a))
        # At a reset, decay 0 (log decay -inf) and no a-term make the transition zero: the
        # previous state is gone exactly, whatever it held.
        o, wkv = runner.wkv(rwkv7, rwkv7_step, (r, runner.at_resets(w, -jnp.inf), k, v,
                                                runner.at_resets(-kk, 0), kk * a),
                            None if state is None else state.wkv)

        bonus = (r * k * self.r_k[...].astype(x.dtype)).sum(-1, keepdims=True) * v
        y = self.ln_x(o) + bonus.reshape(batch, steps, c)
        shift = runner.keep_last(None if state is None else state.shift, x)
        return self.output(y * g), v_first, TimeMixState(shift, wkv)


class RWKV7ChannelMix(ChannelMixBase):
    """The RWKV-7 channel-mix (feed-forward) layer:
    ``value(relu(key(x + (x_prev - x) * x_k)) ** 2)``."""

    def __init__(self, config: RWKV7Config, layer_id: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        c = config.n_embd
        self.dtype = dtype
        self.x_k = param(channel_ramp(c, (1.0 - layer_id / config.n_layer) ** 4), param_dtype)
        self.key = nnx.Linear(c, config.dim_ffn, use_bias=False, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
        self.value = nnx.Linear(config.dim_ffn, c, use_bias=False, dtype=dtype,
                                param_dtype=param_dtype,
                                kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

    def run(self, x, shift, runner):
        x = x.astype(self.dtype)
        xk = x + (runner.previous(x, shift) - x) * self.x_k[...].astype(x.dtype)
        return self.value(jnp.square(jax.nn.relu(self.key(xk)))), runner.keep_last(shift, x)


class RWKV7Block(BlockBase):
    """``x += att(ln1(x)); x += ffn(ln2(x))``, with ``ln0`` applied first in layer 0."""
    time_mix = RWKV7TimeMix
    channel_mix = RWKV7ChannelMix

    def __call__(self, x, v_first=None, state: Optional[LayerState] = None, *, backend=None,
                 wkv_op=None, cu_seqlens=None, resets=None):
        """Sequence mode (``resets``: see the time-mix); returns ``(x, v_first, final
        LayerState)``."""
        return self.run(x, v_first, state, Sequence(backend, wkv_op, cu_seqlens, resets))

    def step(self, x, v_first, state: LayerState, *, state_indices=None, backend=None):
        """Step mode on state pools; returns ``(x, v_first, updated LayerState)``."""
        return self.run(x, v_first, state, Step(x.shape[0], state_indices, backend))

    def mix_time(self, x, v_first, state, runner):
        return self.att.run(x, v_first, state, runner)


class RWKV7LM(LanguageModel):
    """A small RWKV-7 language model: embedding, blocks, ``ln_out`` and the output head.

    ``model(tokens)`` gives logits ``[B, T, vocab]`` (sequence mode); ``model.step(tokens,
    state)`` advances a generation state made by ``model.init_state(slots)``. Both modes give the
    same logits on the same tokens (see :class:`rwkv_jax.nn.common.LanguageModel`).
    """
    block = RWKV7Block
    config_type = RWKV7Config

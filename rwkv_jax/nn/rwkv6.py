"""Flax NNX modules for the official RWKV-6 ("Finch", "x060") model: time-mix, channel-mix,
block and language model.

Same two modes as the RWKV-7 modules (:mod:`rwkv_jax.nn.rwkv7`): ``layer(x, state=None,
backend=None, wkv_op=None)`` over whole sequences through :func:`rwkv_jax.rwkv6`, and
``layer.step(x, state, state_indices=None, backend=None)`` on state pools through
:func:`rwkv_jax.rwkv6_step`. Parameters keep the official names (``time_maa_x``,
``time_decay``, ``time_faaaa``, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..ops import rwkv6, rwkv6_step
from .common import (BlockBase, ChannelMixBase, GroupNormPerHead, LanguageModel, LayerState,
                     Sequence, SizesConfig, Step, TimeMixState, channel_ramp, lora, param)

# The data-dependent token shift makes five mixes, in this order.
_MIXES = ("w", "k", "v", "r", "g")


@dataclasses.dataclass(frozen=True)
class RWKV6Config(SizesConfig):
    """Sizes of an RWKV-6 model; the defaults are the official trainer's (channel-mix 3.5 C
    rounded down to a multiple of 32; token-shift LoRA 32 and decay LoRA 64, both doubled at
    C = 4096). ``vocab_size`` may stay None for layers used without :class:`RWKV6LM`. The
    released Finch models: 1.6B L=24 C=2048, 3B L=32 C=2560, 7B L=32 C=4096, 14B L=61 C=4096,
    all head size 64 and vocabulary 65536."""
    n_embd: int
    n_layer: int
    head_size: int = 64
    dim_ffn: Optional[int] = None
    mix_lora: Optional[int] = None
    decay_lora: Optional[int] = None
    vocab_size: Optional[int] = None

    def __post_init__(self):
        wide = 2 if self.n_embd == 4096 else 1
        self.complete(dict(dim_ffn=int(self.n_embd * 3.5) // 32 * 32, mix_lora=32 * wide,
                           decay_lora=64 * wide), optional=("vocab_size",))


def _linear(fan_in, fan_out, dtype, param_dtype, rngs, init=nnx.initializers.lecun_normal()):
    return nnx.Linear(fan_in, fan_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=init, rngs=rngs)


class RWKV6TimeMix(nnx.Module):
    """The RWKV-6 time-mix layer: data-dependent token shift (a 5-way LoRA on top of the static
    mixes), data-dependent decay ``-exp(time_decay + LoRA)``, bonus ``time_faaaa``, per-head
    group norm (eps 64e-5) and a SiLU gate."""

    def __init__(self, config: RWKV6Config, layer_id: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        c, h, n = config.n_embd, config.n_head, config.head_size
        self.config = config
        self.dtype = dtype
        depth = 1.0 - layer_id / config.n_layer
        self.time_maa_x = param(channel_ramp(c, depth), param_dtype)
        for name in _MIXES:
            setattr(self, f"time_maa_{name}", param(channel_ramp(c, depth), param_dtype))
        small = nnx.initializers.uniform(0.02)
        self.time_maa_w1 = param(np.zeros((c, len(_MIXES) * config.mix_lora)), param_dtype)
        self.time_maa_w2 = nnx.Param(small(rngs.params(), (len(_MIXES), config.mix_lora, c),
                                           param_dtype) - 0.01)
        # Decays spread over each head from slow to fast: exp(-exp(-6)) .. exp(-exp(-1)).
        self.time_decay = param(np.tile(np.linspace(-6.0, -1.0, n), h), param_dtype)
        self.time_decay_w1 = param(np.zeros((c, config.decay_lora)), param_dtype)
        self.time_decay_w2 = nnx.Param(small(rngs.params(), (config.decay_lora, c),
                                             param_dtype) - 0.01)
        self.time_faaaa = param(np.full((h, n), 0.5), param_dtype)
        self.receptance = _linear(c, c, dtype, param_dtype, rngs)
        self.key = _linear(c, c, dtype, param_dtype, rngs)
        self.value = _linear(c, c, dtype, param_dtype, rngs)
        self.gate = _linear(c, c, dtype, param_dtype, rngs)
        self.output = _linear(c, c, dtype, param_dtype, rngs, nnx.initializers.zeros_init())
        self.ln_x = GroupNormPerHead(c, param_dtype=param_dtype)

    def __call__(self, x, state: Optional[TimeMixState] = None, *, backend=None, wkv_op=None,
                 cu_seqlens=None, resets=None):
        """Sequence mode: ``x [B, T, C]``, ``state`` None (zeros) or one row per batch row (per
        segment with ``cu_seqlens``, which packs sequences along T with B = 1); ``wkv_op``
        replaces :func:`rwkv_jax.rwkv6`; ``resets`` (bool ``[B, T]``): the token shift and the
        wkv state restart from zeros where it is True. Returns ``(y, final TimeMixState)``."""
        return self.run(x, state, Sequence(backend, wkv_op, cu_seqlens, resets))

    def step(self, x, state: TimeMixState, *, state_indices=None, backend=None):
        """Step mode on state pools. Returns ``(y, updated TimeMixState)``."""
        return self.run(x, state, Step(x.shape[0], state_indices, backend))

    def run(self, x, state, runner):
        batch, steps, c = x.shape
        h, n = self.config.n_head, self.config.head_size
        x = x.astype(self.dtype)
        xx = runner.previous(x, None if state is None else state.shift) - x
        own = lambda p: p[...].astype(x.dtype)
        # Five LoRA corrections of the static mixes, from one shared down-projection.
        hidden = jnp.tanh((x + xx * own(self.time_maa_x)) @ own(self.time_maa_w1))
        hidden = hidden.reshape(batch, steps, len(_MIXES), self.config.mix_lora)
        extra = jnp.einsum("btid,idc->ibtc", hidden, own(self.time_maa_w2))
        xw, xk, xv, xr, xg = (x + xx * (own(getattr(self, f"time_maa_{name}")) + extra[i])
                              for i, name in enumerate(_MIXES))
        r = self.receptance(xr)
        k = self.key(xk)
        v = self.value(xv)
        g = jax.nn.silu(self.gate(xg))
        # Official decay exp(-exp(w)): our log decay is -exp(w), computed in float32.
        w = (self.time_decay[...].astype(jnp.float32)
             + lora(xw, self.time_decay_w1, self.time_decay_w2, jnp.tanh).astype(jnp.float32))
        w = -jnp.exp(w)
        heads = lambda t: t.reshape(batch, steps, h, n).astype(x.dtype)
        r, k, v, u = heads(r), heads(k), heads(v), own(self.time_faaaa)
        # At a reset, decay 0 (log decay -inf) drops the previous state from the next ones.
        o, wkv = runner.wkv(rwkv6, rwkv6_step, (r, k, v, runner.at_resets(heads(w), -jnp.inf), u),
                            None if state is None else state.wkv)
        if runner.resets is not None:
            # The output reads the state before that update, o_t = (h_{t-1} + diag(u) k_t
            # v_t^T)^T r_t: at a reset it is the bonus term alone.
            o = runner.at_resets(o, (r * u * k).sum(-1, keepdims=True) * v)
        shift = runner.keep_last(None if state is None else state.shift, x)
        return self.output(self.ln_x(o) * g), TimeMixState(shift, wkv)


class RWKV6ChannelMix(ChannelMixBase):
    """The RWKV-6 channel-mix layer:
    ``sigmoid(receptance(x_r)) * value(relu(key(x_k))^2)`` with static token-shift mixes."""

    def __init__(self, config: RWKV6Config, layer_id: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        c = config.n_embd
        self.dtype = dtype
        depth = 1.0 - layer_id / config.n_layer
        self.time_maa_k = param(channel_ramp(c, depth), param_dtype)
        self.time_maa_r = param(channel_ramp(c, depth), param_dtype)
        self.key = _linear(c, config.dim_ffn, dtype, param_dtype, rngs)
        self.receptance = _linear(c, c, dtype, param_dtype, rngs)
        self.value = _linear(config.dim_ffn, c, dtype, param_dtype, rngs,
                             nnx.initializers.zeros_init())

    def run(self, x, shift, runner):
        x = x.astype(self.dtype)
        xx = runner.previous(x, shift) - x
        xk = x + xx * self.time_maa_k[...].astype(x.dtype)
        xr = x + xx * self.time_maa_r[...].astype(x.dtype)
        kv = self.value(jnp.square(jax.nn.relu(self.key(xk))))
        return jax.nn.sigmoid(self.receptance(xr)) * kv, runner.keep_last(shift, x)


class RWKV6Block(BlockBase):
    """``x += att(ln1(x)); x += ffn(ln2(x))``, with ``ln0`` applied first in layer 0."""
    time_mix = RWKV6TimeMix
    channel_mix = RWKV6ChannelMix

    def __call__(self, x, state: Optional[LayerState] = None, *, backend=None, wkv_op=None,
                 cu_seqlens=None, resets=None):
        """Sequence mode (``resets``: see the time-mix); returns ``(x, final LayerState)``."""
        x, _, state = self.run(x, None, state, Sequence(backend, wkv_op, cu_seqlens, resets))
        return x, state

    def step(self, x, state: LayerState, *, state_indices=None, backend=None):
        """Step mode on state pools; returns ``(x, updated LayerState)``."""
        x, _, state = self.run(x, None, state, Step(x.shape[0], state_indices, backend))
        return x, state

    def mix_time(self, x, carry, state, runner):
        y, state = self.att.run(x, state, runner)
        return y, carry, state


class RWKV6LM(LanguageModel):
    """The RWKV-6 ("Finch") language model: embedding, blocks, ``ln_out`` and the output head,
    with the modes and state of :class:`rwkv_jax.nn.common.LanguageModel` (sequence mode
    through :func:`rwkv_jax.rwkv6`, step mode through :func:`rwkv_jax.rwkv6_step`).
    ``config.vocab_size`` must be set."""
    block = RWKV6Block
    config_type = RWKV6Config

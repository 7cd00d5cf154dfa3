"""Thin Linen wrappers of the bare operators, for ``flax.linen`` model code.

The modules hold no parameters: their fields fix the options (``scale``, ``head_first``,
``backend``) and calling them calls the operator, e.g.

    wkv = RWKV7(backend="native")
    o, h = wkv.apply({}, r, w, k, v, a, b)                 # rwkv_jax.rwkv7
    o, pool = wkv.apply({}, r, w, k, v, a, b, pool, method="step")   # rwkv_jax.rwkv7_step

or, inside another Linen module, ``o, h = RWKV7()(r, w, k, v, a, b)``.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn

from ..ops import gated_linear_attention, rwkv4, rwkv6, rwkv6_step, rwkv7, rwkv7_step


class RWKV7(nn.Module):
    """:func:`rwkv_jax.rwkv7` (``__call__``) and :func:`rwkv_jax.rwkv7_step` (``step``)."""
    scale: float = 1.0
    head_first: bool = False
    backend: Optional[str] = None

    def __call__(self, r, w, k, v, a, b, initial_state=None, *, output_final_state=True,
                 cu_seqlens=None):
        return rwkv7(r, w, k, v, a, b, scale=self.scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     head_first=self.head_first, backend=self.backend)

    def step(self, r, w, k, v, a, b, state, *, state_indices=None):
        return rwkv7_step(r, w, k, v, a, b, state, scale=self.scale,
                          state_indices=state_indices, backend=self.backend)


class RWKV6(nn.Module):
    """:func:`rwkv_jax.rwkv6` (``__call__``) and :func:`rwkv_jax.rwkv6_step` (``step``)."""
    scale: float = 1.0
    head_first: bool = False
    backend: Optional[str] = None

    def __call__(self, r, k, v, w, u, initial_state=None, *, output_final_state=True,
                 cu_seqlens=None):
        return rwkv6(r, k, v, w, u, scale=self.scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     head_first=self.head_first, backend=self.backend)

    def step(self, r, k, v, w, u, state, *, state_indices=None):
        return rwkv6_step(r, k, v, w, u, state, scale=self.scale, state_indices=state_indices,
                          backend=self.backend)


class RWKV4(nn.Module):
    """:func:`rwkv_jax.rwkv4`."""
    backend: Optional[str] = None

    def __call__(self, w, u, k, v, initial_state=None, *, output_final_state=True):
        return rwkv4(w, u, k, v, initial_state=initial_state,
                     output_final_state=output_final_state, backend=self.backend)


class GatedLinearAttention(nn.Module):
    """:func:`rwkv_jax.gated_linear_attention` (``scale`` None means ``K ** -0.5``)."""
    scale: Optional[float] = None
    reverse: bool = False
    head_first: bool = False
    backend: Optional[str] = None

    def __call__(self, q, k, v, *, g=None, g_gamma=None, gk=None, gv=None, initial_state=None,
                 output_final_state=True, cu_seqlens=None):
        return gated_linear_attention(
            q, k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv, scale=self.scale,
            initial_state=initial_state, output_final_state=output_final_state,
            reverse=self.reverse, cu_seqlens=cu_seqlens, head_first=self.head_first,
            backend=self.backend)

"""Names for users coming from fla (flash-linear-attention 0.6.0), in **its** conventions.

``from rwkv_jax.fla import chunk_rwkv7`` and the call is fla's: the same argument names,
order, defaults and layouts (``[B, T, H, *]``, states ``[N, H, K, V]``, every decay in log space),
returning ``(o, final_state)`` with ``None`` for a state not asked for. A module rather than
top-level aliases: fla's defaults differ from the core API's (``output_final_state=False``,
``scale=None`` meaning ``K ** -0.5``), so one name must not mean two conventions.

Each function is a thin layer over a core op (README, "Coming from fla", maps every argument):
validate what only fla has, map it, call the op. ``chunk_*`` and ``fused_recurrent_*`` are the
same math here: both run the core op's backend (``backend=``, else the environment's preference,
else the measured default), exact for every decay in ``[-inf, 0]``. fla's tuning arguments
(``chunk_size``, ``safe_gate``, ``disable_recompute``, ``lower_bound``, ``cu_seqlens_cpu``) pick
fla's kernels and change no result there, so they are checked as fla checks them and leave the
result unchanged here too.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np

from . import _checks as checks
from .ops import gated_linear_attention, rwkv6, rwkv7

__all__ = ["chunk_rwkv7", "fused_recurrent_rwkv7", "chunk_rwkv6", "fused_recurrent_rwkv6",
           "chunk_gla", "fused_recurrent_gla", "chunk_simple_gla"]


def _lead(head_first):
    return ("B", "H", "T") if checks.flag("head_first", head_first) else ("B", "T", "H")


def _scale(scale, name, x, head_first):
    """fla's ``scale``: None means ``K ** -0.5``, K the last axis of ``x``."""
    if scale is not None:
        return checks.scalar("scale", scale)
    sizes: dict = {}
    checks.shaped(name, x, _lead(head_first) + ("K",), sizes)
    checks.positive_sizes(sizes, "K")
    return float(sizes["K"][0]) ** -0.5


def _offsets(cu_seqlens, cu_seqlens_cpu):
    """fla's ``cu_seqlens``. ``cu_seqlens_cpu``, fla's host copy of it (which spares fla a
    device sync), must agree with it; the core op reads the offsets it needs by itself."""
    if cu_seqlens_cpu is None:
        return cu_seqlens
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu was given without cu_seqlens; pass the offsets as "
                         "cu_seqlens (cu_seqlens_cpu is only fla's host copy of them)")
    device = checks.integer("cu_seqlens", cu_seqlens)
    host = checks.integer("cu_seqlens_cpu", cu_seqlens_cpu)
    device_values, host_values = checks.host_values(device), checks.host_values(host)
    if tuple(host.shape) != tuple(device.shape) or (
            device_values is not None and host_values is not None
            and not np.array_equal(device_values, host_values)):
        raise ValueError(f"cu_seqlens_cpu must be a copy of cu_seqlens, got "
                         f"{host_values if host_values is not None else host.shape} for "
                         f"{device_values if device_values is not None else device.shape}")
    return cu_seqlens


def _chunk_size(chunk_size):
    """fla's tile length: None or a power of 2, as fla requires; each backend here picks its
    own."""
    if chunk_size is None:
        return
    if (isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer))
            or chunk_size < 1 or chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be None or a power of 2, got {chunk_size!r}")


def _dplr_options(safe_gate, chunk_size, disable_recompute, cp_context, lower_bound):
    """chunk_rwkv7's tuning arguments, checked as fla 0.6.0 checks them. ``lower_bound`` is
    fla's licence to use a faster tensor-core scheme (the caller promises ``lower_bound <= w``);
    fla clamps nothing with it, so neither do we: the result is that of the given ``w``."""
    checks.flag("safe_gate", safe_gate)
    checks.flag("disable_recompute", disable_recompute)
    _chunk_size(chunk_size)
    if cp_context is not None:
        raise ValueError(f"cp_context (fla's torch.distributed context parallelism) is not "
                         f"supported here, got {type(cp_context).__name__}; for sequence "
                         f"parallelism wrap the core op (rwkv_jax.rwkv7) with "
                         f"rwkv_jax.shard(..., seq_axis=...)")
    if lower_bound is not None and checks.scalar("lower_bound", lower_bound) >= 0:
        raise ValueError(f"lower_bound must be negative (w is a log decay < 0), got "
                         f"{lower_bound}")


def _state_v_first(initial_state, state_v_first, q, v, cu_seqlens, head_first):
    """``initial_state`` in fla's V-first layout ``[N, H, V, K]`` (``state_v_first=True``) as the
    core ops' ``[N, H, K, V]``; checked against that layout first, so an error names the shape
    the caller must pass."""
    if initial_state is None or not state_v_first:
        return initial_state
    sizes: dict = {}
    checks.shaped("q", q, _lead(head_first) + ("K",), sizes)
    checks.shaped("v", v, _lead(head_first) + ("V",), sizes)
    segments = None if cu_seqlens is None else checks.array("cu_seqlens", cu_seqlens)
    if segments is None:
        sizes["N"] = (sizes["B"][0], "the batch size B")
    elif segments.ndim == 1:   # other shapes: the core op's check of cu_seqlens says what is wrong
        sizes["N"] = (segments.shape[0] - 1, "cu_seqlens (number of segments)")
    initial_state = checks.shaped("initial_state", initial_state, ("N", "H", "V", "K"), sizes)
    return jnp.swapaxes(initial_state, -1, -2)


def _gla(q, k, v, initial_state, state_v_first, cu_seqlens, head_first, **options):
    """:func:`rwkv_jax.gated_linear_attention` with fla's ``state_v_first`` state layout."""
    state_v_first = checks.flag("state_v_first", state_v_first)
    initial_state = _state_v_first(initial_state, state_v_first, q, v, cu_seqlens, head_first)
    o, h = gated_linear_attention(q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                  head_first=head_first, **options)
    return o, (h if h is None or not state_v_first else jnp.swapaxes(h, -1, -2))


def _time_reversed(arrays, cu_seqlens, initial_state, head_first):
    """Inputs that run a recurrence from its last step to its first as a forward one: each of
    ``arrays`` (name -> ``[B, T, H, *]``) flipped along time. With ``cu_seqlens`` the packed
    segments then come in the opposite order: the offsets are mirrored (``T - cu[::-1]``, still
    valid exactly when they were) and the rows of ``initial_state`` reversed; the caller
    reverses the final state's rows back. Returns (arrays, cu_seqlens, initial_state)."""
    lead = _lead(head_first)
    sizes: dict = {}
    arrays = {n: checks.shaped(n, x, lead + (last,), sizes) for n, (x, last) in arrays.items()}
    time = lead.index("T")
    flipped = {n: jnp.flip(x, time) for n, x in arrays.items()}
    if cu_seqlens is None:
        return flipped, None, initial_state
    total = sizes["T"][0]
    cu_seqlens = checks.cu_seqlens(cu_seqlens, sizes["B"][0], total)
    values = checks.host_values(cu_seqlens)
    mirrored = (total - values[::-1] if values is not None else total - jnp.flip(cu_seqlens))
    if initial_state is not None:
        initial_state = jnp.flip(checks.floating("initial_state", initial_state), 0)
    return flipped, mirrored, initial_state


# --- RWKV-7 (fla.ops.rwkv7) ----------------------------------------------------------------


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False,
                cu_seqlens=None, cu_seqlens_cpu=None, safe_gate=False, chunk_size=None,
                disable_recompute=False, cp_context=None, lower_bound=None, *, head_first=False,
                backend=None):
    """fla's ``chunk_rwkv7``: :func:`rwkv_jax.rwkv7` with fla's defaults.

    ``r, w, k, a, b`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``; ``w`` is a log decay (fla's
    ``gk`` of the DPLR rule): ``h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T``,
    ``o_t = h_t^T (scale r_t)``. ``scale`` 1.0 (None: ``K ** -0.5``); ``initial_state``
    ``[N, H, K, V]``; ``output_final_state`` False. ``safe_gate``, ``chunk_size``,
    ``disable_recompute``, ``lower_bound`` are checked as fla checks them and change nothing
    (fla clamps nothing with ``lower_bound`` either); ``cp_context`` must be None.
    ``head_first`` (removed in fla) takes ``[B, H, T, *]`` inputs and outputs; ``backend``
    picks the backend.
    Returns ``(o [B, T, H, V], final_state float32 [N, H, K, V] or None)``.
    """
    _dplr_options(safe_gate, chunk_size, disable_recompute, cp_context, lower_bound)
    return rwkv7(r, w, k, v, a, b, scale=_scale(scale, "k", k, head_first),
                 initial_state=initial_state, output_final_state=output_final_state,
                 cu_seqlens=_offsets(cu_seqlens, cu_seqlens_cpu), head_first=head_first,
                 backend=backend)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None,
                          output_final_state=True, cu_seqlens=None, *, head_first=False,
                          backend=None):
    """fla's ``fused_recurrent_rwkv7``: as :func:`chunk_rwkv7`, with fla 0.6.0's own defaults
    for this name: ``scale=None``, meaning ``K ** -0.5`` (not 1.0: RWKV-7 models pass
    ``scale=1.0``), and ``output_final_state=True``."""
    return rwkv7(r, w, k, v, a, b, scale=_scale(scale, "r", r, head_first),
                 initial_state=initial_state, output_final_state=output_final_state,
                 cu_seqlens=cu_seqlens, head_first=head_first, backend=backend)


# --- RWKV-6 (fla.ops.rwkv6) ----------------------------------------------------------------


def chunk_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False,
                cu_seqlens=None, cu_seqlens_cpu=None, *, chunk_size=None, head_first=False,
                backend=None):
    """fla's ``chunk_rwkv6``: :func:`rwkv_jax.rwkv6`,
    ``o_t = (h_{t-1} + diag(u) k_t v_t^T)^T (scale r_t)``, ``h_t = diag(exp(w_t)) h_{t-1} +
    k_t v_t^T``. ``r, k, w`` ``[B, T, H, K]`` (``w`` a log decay), ``v`` ``[B, T, H, V]``, ``u``
    ``[H, K]``; ``scale`` None means ``K ** -0.5``; ``output_final_state`` False; ``chunk_size``
    (fla's keyword) None or a power of 2, ignored. Returns ``(o, final_state or None)``."""
    _chunk_size(chunk_size)
    return rwkv6(r, k, v, w, u, scale=_scale(scale, "r", r, head_first),
                 initial_state=initial_state, output_final_state=output_final_state,
                 cu_seqlens=_offsets(cu_seqlens, cu_seqlens_cpu), head_first=head_first,
                 backend=backend)


def fused_recurrent_rwkv6(r, k, v, w, u, scale=None, initial_state=None,
                          output_final_state=False, reverse=False, cu_seqlens=None, *,
                          head_first=False, backend=None):
    """fla's ``fused_recurrent_rwkv6``: :func:`chunk_rwkv6` with ``reverse``, which runs each
    sequence (each segment with ``cu_seqlens``) from its last step to its first; the initial
    state enters at the last step and the final state leaves after the first."""
    scale = _scale(scale, "k", k, head_first)
    if not checks.flag("reverse", reverse):
        return rwkv6(r, k, v, w, u, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     head_first=head_first, backend=backend)
    x, offsets, h0 = _time_reversed(dict(r=(r, "K"), k=(k, "K"), v=(v, "V"), w=(w, "K")),
                                    cu_seqlens, initial_state, head_first)
    o, h = rwkv6(**x, u=u, scale=scale, initial_state=h0, output_final_state=output_final_state,
                 cu_seqlens=offsets, head_first=head_first, backend=backend)
    o = jnp.flip(o, _lead(head_first).index("T"))
    return o, (h if h is None or offsets is None else jnp.flip(h, 0))


# --- GLA and simple GLA (fla.ops.gla, fla.ops.simple_gla) ----------------------------------


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, *, head_first=False,
              backend=None):
    """fla's ``chunk_gla``: :func:`rwkv_jax.gated_linear_attention` with ``gk=g``, a per-key log
    decay ``[B, T, H, K]`` (required), ``h_t = diag(exp(g_t)) h_{t-1} + k_t v_t^T``,
    ``o_t = h_t^T (scale q_t)``. ``scale`` None means ``K ** -0.5``; ``output_final_state``
    False; ``state_v_first=True``: ``initial_state`` and the final state are ``[N, H, V, K]``.
    Returns ``(o, final_state or None)``."""
    sizes: dict = {}
    checks.shaped("q", q, _lead(head_first) + ("K",), sizes)
    checks.shaped("g", g, _lead(head_first) + ("K",), sizes)  # named as the caller knows it
    return _gla(q, k, v, initial_state, state_v_first, _offsets(cu_seqlens, cu_seqlens_cpu),
                head_first, gk=g, scale=scale, output_final_state=output_final_state,
                backend=backend)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False, reverse=False, state_v_first=False,
                        cu_seqlens=None, *, transpose_state_layout=None, head_first=False,
                        backend=None):
    """fla's ``fused_recurrent_gla``: :func:`rwkv_jax.gated_linear_attention` with its optional
    per-key ``gk`` ``[B, T, H, K]`` and per-value ``gv`` ``[B, T, H, V]`` log decays;
    ``reverse`` runs each sequence (segment) from its last step to its first. Defaults and
    ``state_v_first`` as in :func:`chunk_gla`; ``transpose_state_layout`` is fla's deprecated
    name of ``state_v_first``."""
    if transpose_state_layout is not None:
        if checks.flag("state_v_first", state_v_first):
            raise ValueError("pass state_v_first or its deprecated name transpose_state_layout, "
                             "not both")
        warnings.warn("transpose_state_layout is deprecated (as in fla); use state_v_first",
                      DeprecationWarning, stacklevel=2)
        state_v_first = checks.flag("transpose_state_layout", transpose_state_layout)
    return _gla(q, k, v, initial_state, state_v_first, cu_seqlens, head_first, gk=gk, gv=gv,
                scale=scale, output_final_state=output_final_state, reverse=reverse,
                backend=backend)


def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                     output_final_state=False, state_v_first=False, cu_seqlens=None,
                     cu_seqlens_cpu=None, *, chunk_size=None, head_first=False, backend=None):
    """fla's ``chunk_simple_gla``: :func:`rwkv_jax.gated_linear_attention` with a per-head log
    decay, data-dependent ``g`` ``[B, T, H]`` and/or fixed ``g_gamma`` ``[H]`` (fla asks for one
    of them; given both, their sum is the log decay, as fla's kernels compute; neither: plain
    linear attention). ``chunk_size`` (fla's keyword) None or a power of 2, ignored. Defaults
    and ``state_v_first`` as in :func:`chunk_gla`."""
    _chunk_size(chunk_size)
    return _gla(q, k, v, initial_state, state_v_first, _offsets(cu_seqlens, cu_seqlens_cpu),
                head_first, g=g, g_gamma=g_gamma, scale=scale,
                output_final_state=output_final_state, backend=backend)

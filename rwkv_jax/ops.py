"""The public operators: validate, normalise the layout, pick a backend, call it.

The math of each op is in DESIGN.md and in ``rwkv_jax.backends.native``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import _checks as checks
from .backends import resolve

_TIME_MAJOR = ("B", "T", "H")
_HEAD_MAJOR = ("B", "H", "T")


def _heads(head_first, last=None):
    lead = _HEAD_MAJOR if head_first else _TIME_MAJOR
    return lead + ((last,) if last else ())


def _to_bthk(x, head_first):
    """[B, H, T, *] -> [B, T, H, *] when head_first (the backends' layout), else unchanged."""
    return x if x is None or not head_first else jnp.swapaxes(x, 1, 2)


# ---------------------------------------------------------------------------------------------
# Offsets and pool rows that are invalid only at run time (DESIGN.md, "Public API"). Values this
# process can read whole were checked by _checks; traced ones, and ones split across processes,
# are checked here, on the device, once for every backend. Invalid offsets are replaced by a
# valid set before any backend runs, and every value of the results becomes NaN. An invalid pool
# row (outside [0, S), or a slot two rows share) is sent to the sentinel slot S, which every
# backend's step reads as nothing and never writes, and its output row becomes NaN. So no kernel
# ever sees an invalid offset or index.


def _guard_offsets(cu_seqlens, total):
    """Returns (int32 offsets every backend can run on, traced validity flag or None)."""
    if checks.on_host(cu_seqlens):   # checked on the host (_checks.cu_seqlens)
        return jnp.asarray(cu_seqlens, jnp.int32), None
    cu = cu_seqlens  # compared in its own dtype: int64 values are not wrapped by the cast
    ok = (cu[0] == 0) & (cu[-1] == total) & jnp.all(cu[1:] >= cu[:-1])
    harmless = jnp.full(cu.shape, total, jnp.int32).at[0].set(0)  # one segment, then empty ones
    return jnp.where(ok, cu.astype(jnp.int32), harmless), ok


def _guard_rows(state_indices, slots):
    """Returns (int32 pool rows with the sentinel S for invalid ones, traced validity [B] or
    None). A slot named by two rows is invalid for both, so it stays untouched."""
    if checks.on_host(state_indices):   # checked on the host (_checks.indices)
        return jnp.asarray(state_indices, jnp.int32), None
    inside = (state_indices >= 0) & (state_indices < slots)
    rows = jnp.where(inside, state_indices, 0).astype(jnp.int32)
    uses = jnp.zeros((slots,), jnp.int32).at[rows].add(inside.astype(jnp.int32))
    ok = inside & (uses[rows] == 1)
    return jnp.where(ok, rows, slots), ok


def _nan_unless(ok, x):
    """``x`` where ``ok`` (a flag, or one per leading row of ``x``), NaN elsewhere."""
    if ok is None or x is None:
        return x
    ok = jnp.reshape(ok, ok.shape + (1,) * (x.ndim - ok.ndim))
    return jnp.where(ok, x, jnp.asarray(jnp.nan, x.dtype))


# --- dtypes (DESIGN.md, "Operators"): one rule for every backend --------------------------------


def _sequence_dtype(arrays):
    """The one dtype of the inputs that carry a time axis. Mixed dtypes are a TypeError naming
    them: promoting silently would run a different kernel (precision, memory) than the caller
    chose, so the caller casts explicitly."""
    dtypes = {n: x.dtype for n, x in arrays.items() if x is not None}
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(dtypes)} must share one dtype, got {got}; cast them with "
                        f".astype (mixed dtypes are not promoted)")
    return next(iter(dtypes.values()))


def _state_dtype(dtype):
    """The state's dtype: float32, or float64 for float64 inputs (jax_enable_x64)."""
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def _in_state_dtype(initial_state, dtype):
    """``initial_state`` of any floating dtype, as the state's dtype (its gradient comes back in
    the dtype it was given in)."""
    return None if initial_state is None else jnp.asarray(initial_state).astype(_state_dtype(dtype))


def _results(o, h, dtype):
    """Outputs in the inputs' dtype, the final state in the state's dtype, whatever the backend."""
    return o.astype(dtype), (None if h is None else h.astype(_state_dtype(dtype)))


def _state_and_segments(initial_state, cu_seqlens, sizes, batch, total):
    """Validate ``cu_seqlens`` and ``initial_state`` (rows: batch, or segments when packed).
    Returns (initial_state, int32 cu_seqlens or None, traced validity of cu_seqlens or None)."""
    offsets_ok = None
    if cu_seqlens is not None:
        cu_seqlens = checks.cu_seqlens(cu_seqlens, batch, total)
        sizes["N"] = (cu_seqlens.shape[0] - 1, "cu_seqlens (number of segments)")
        cu_seqlens, offsets_ok = _guard_offsets(cu_seqlens, total)
    else:
        sizes["N"] = (batch, "the batch size B")
    if initial_state is not None:
        initial_state = checks.shaped("initial_state", initial_state, ("N", "H", "K", "V"), sizes)
    return initial_state, cu_seqlens, offsets_ok


def _sequence(op, named, scale, initial_state, output_final_state, cu_seqlens, head_first,
              backend, extra=None, **options):
    """Shared path of the [B, T, H, K] sequence ops (rwkv7, rwkv6, gated_linear_attention).

    ``named``: name -> (array or None, last dim name or None for a per-token gate, optional).
    ``extra``: name -> (array or None, shape spec) for arrays that carry no time axis.
    ``options``: further keyword arguments for the backend function.
    """
    head_first = checks.flag("head_first", head_first)
    output_final_state = checks.flag("output_final_state", output_final_state)
    sizes: dict = {}
    arrays = {}
    for name, (x, last, optional) in named.items():
        if x is None and optional:
            arrays[name] = None
            continue
        arrays[name] = checks.shaped(name, x, _heads(head_first, last), sizes)
    for name, (x, spec) in (extra or {}).items():
        arrays[name] = None if x is None else checks.shaped(name, x, spec, sizes)
    batch, total = sizes["B"][0], sizes["T"][0]
    checks.positive_length("the inputs", total)
    checks.positive_sizes(sizes, "KV")
    dtype = _sequence_dtype({n: arrays[n] for n in named})
    initial_state, cu_seqlens, offsets_ok = _state_and_segments(initial_state, cu_seqlens, sizes,
                                                                batch, total)
    shape = dict(sequence_heads=sizes["N"][0] * sizes["H"][0], key=sizes["K"][0],
                 value=sizes["V"][0], dtype=dtype)
    name, fn = resolve(op, backend, dtype=dtype, shape=shape)
    arrays = {n: (_to_bthk(x, head_first) if n in named else x) for n, x in arrays.items()}
    o, h = fn(**arrays, scale=scale, initial_state=_in_state_dtype(initial_state, dtype),
              output_final_state=output_final_state, cu_seqlens=cu_seqlens, **options)
    o, h = _results(o, h, dtype)
    o, h = _nan_unless(offsets_ok, o), _nan_unless(offsets_ok, h)
    if head_first:
        o = jnp.swapaxes(o, 1, 2)
    return o, (h if output_final_state else None)


def rwkv7(r, w, k, v, a, b, *, scale=1.0, initial_state=None, output_final_state=True,
          cu_seqlens=None, head_first=False, backend=None):
    """RWKV-7 generalized delta rule.

    ``h_t = diag(exp(w_t)) h_{t-1} + b_t (a_t^T h_{t-1}) + k_t v_t^T``, ``o_t = h_t^T (scale r_t)``.

    Args:
      r, w, k, a, b: ``[B, T, H, K]`` (``[B, H, T, K]`` if ``head_first``); ``w`` is a log decay.
      v: ``[B, T, H, V]``.
      scale: multiplies ``r``.
      initial_state: ``[N, H, K, V]`` (N = B, or the number of segments with ``cu_seqlens``);
        None means zeros.
      output_final_state: return the final state (else None in its place).
      cu_seqlens: int32 ``[N+1]`` offsets of packed sequences (B must be 1).
      head_first: inputs and outputs are ``[B, H, T, *]``.
      backend: "native", "chunked", "triton", "ffi", or None for the default.

    Returns:
      ``(o, h)``: ``o`` ``[B, T, H, V]`` in ``v``'s dtype, ``h`` float32 ``[N, H, K, V]`` or None.
    """
    scale = checks.scalar("scale", scale)
    named = {n: (x, "V" if n == "v" else "K", False)
             for n, x in dict(r=r, w=w, k=k, v=v, a=a, b=b).items()}
    return _sequence("rwkv7", named, scale, initial_state, output_final_state, cu_seqlens,
                     head_first, backend)


def rwkv6(r, k, v, w, u, *, scale=1.0, initial_state=None, output_final_state=True,
          cu_seqlens=None, head_first=False, backend=None):
    """RWKV-6: ``o_t = (h_{t-1} + diag(u) k_t v_t^T)^T (scale r_t)``,
    ``h_t = diag(exp(w_t)) h_{t-1} + k_t v_t^T``.

    ``r, k, w``: ``[B, T, H, K]``; ``v``: ``[B, T, H, V]``; ``u`` (bonus): ``[H, K]``; ``w`` is a
    log decay. Options and returns as in :func:`rwkv7`.
    """
    scale = checks.scalar("scale", scale)
    named = {n: (x, "V" if n == "v" else "K", False)
             for n, x in dict(r=r, k=k, v=v, w=w).items()}
    return _sequence("rwkv6", named, scale, initial_state, output_final_state, cu_seqlens,
                     head_first, backend, extra=dict(u=(u, ("H", "K"))))


def gated_linear_attention(q, k, v, *, g=None, g_gamma=None, gk=None, gv=None, scale=None,
                           initial_state=None, output_final_state=True, reverse=False,
                           cu_seqlens=None, head_first=False, backend=None):
    """Gated recurrent linear attention, all gates in log space:

    ``h_t = (exp(g_t + g_gamma) * exp(gk_t)[:, None] * exp(gv_t)[None, :]) ⊙ h_{t-1} + k_t v_t^T``,
    ``o_t = h_t^T (scale q_t)``.

    ``q, k``: ``[B, T, H, K]``; ``v``: ``[B, T, H, V]``; optional ``g``: ``[B, T, H]``,
    ``g_gamma``: ``[H]``, ``gk``: ``[B, T, H, K]``, ``gv``: ``[B, T, H, V]``. ``scale`` defaults to
    ``K ** -0.5``; ``reverse=True`` runs from the last step to the first (per segment with
    ``cu_seqlens``). Other options and returns as in :func:`rwkv7`.
    """
    reverse = checks.flag("reverse", reverse)
    if scale is None:
        sizes: dict = {}
        checks.shaped("q", q, _heads(checks.flag("head_first", head_first), "K"), sizes)
        checks.positive_sizes(sizes, "K")
        scale = float(sizes["K"][0]) ** -0.5
    scale = checks.scalar("scale", scale)
    named = dict(q=(q, "K", False), k=(k, "K", False), v=(v, "V", False), g=(g, None, True),
                 gk=(gk, "K", True), gv=(gv, "V", True))
    return _sequence("gated_linear_attention", named, scale, initial_state, output_final_state,
                     cu_seqlens, head_first, backend, extra=dict(g_gamma=(g_gamma, ("H",))),
                     reverse=reverse)


def rwkv4(w, u, k, v, *, initial_state=None, output_final_state=True, backend=None):
    """RWKV-4 WKV with the max trick for stability.

    ``w`` (negative log decay, ``-exp(time_decay)``) and ``u`` (``time_first``): ``[C]``;
    ``k, v``: ``[B, T, C]``. The state ``[B, C, 3]`` holds ``(aa, bb, pp)``; None means
    ``(0, 0, -1e38)``. Returns ``(y [B, T, C] in v's dtype, state float32 [B, C, 3] or None)``.
    """
    output_final_state = checks.flag("output_final_state", output_final_state)
    sizes: dict = {}
    k = checks.shaped("k", k, ("B", "T", "C"), sizes)
    v = checks.shaped("v", v, ("B", "T", "C"), sizes)
    w = checks.shaped("w", w, ("C",), sizes)
    u = checks.shaped("u", u, ("C",), sizes)
    checks.positive_length("k and v", sizes["T"][0])
    dtype = _sequence_dtype(dict(k=k, v=v))
    if initial_state is not None:
        initial_state = checks.shaped("initial_state", initial_state, ("B", "C", "3"), sizes)
    _, fn = resolve("rwkv4", backend, dtype=dtype)
    y, state = fn(w, u, k, v, initial_state=_in_state_dtype(initial_state, dtype),
                  output_final_state=output_final_state)
    return _results(y, state if output_final_state else None, dtype)


def _step(op, named, extra, state, scale, state_indices, backend):
    """Shared path of the inference steps: inputs [B, T, H, *], state pool [S, H, K, V]."""
    sizes: dict = {}
    arrays = {n: checks.shaped(n, x, _heads(False, last), sizes) for n, (x, last) in named.items()}
    arrays.update({n: checks.shaped(n, x, spec, sizes) for n, (x, spec) in extra.items()})
    checks.positive_length("the inputs", sizes["T"][0])
    checks.positive_sizes(sizes, "KV")
    dtype = _sequence_dtype({n: arrays[n] for n in named})
    state = checks.shaped("state", state, ("S", "H", "K", "V"), sizes)
    if state.dtype not in (jnp.float32, _state_dtype(dtype)):
        raise TypeError(f"state must be a float32 pool [S, H, K, V] (it is updated in place; "
                        f"float64 too with float64 inputs), got dtype {state.dtype}")
    batch, slots = sizes["B"][0], sizes["S"][0]
    if state_indices is None:
        if slots < batch:
            raise ValueError(f"state has S={slots} slots for a batch of B={batch}; "
                             f"pass state_indices [B] to pick a slot per row")
        state_indices = np.arange(batch, dtype=np.int32)  # concrete: no run-time guard
    else:
        state_indices = checks.shaped("state_indices", state_indices, ("B",), sizes,
                                      kind=checks.integer)
        state_indices = checks.indices("state_indices", state_indices, slots, distinct=True)
    state_indices, rows_ok = _guard_rows(state_indices, slots)
    _, fn = resolve(op, backend, dtype=dtype)
    o, state = fn(**arrays, state=jnp.asarray(state), scale=scale, state_indices=state_indices)
    return _nan_unless(rows_ok, o.astype(dtype)), state  # the pool keeps its dtype


def rwkv7_step(r, w, k, v, a, b, state, *, scale=1.0, state_indices=None, backend=None):
    """RWKV-7 inference: advance the rows ``state_indices`` of the float32 pool ``state``
    ``[S, H, K, V]`` by the ``T`` (small) steps of ``r, w, k, v, a, b`` ``[B, T, H, *]`` (the
    pool may be float64 with float64 inputs, so that nothing is rounded to float32).

    Returns ``(o [B, T, H, V], updated pool)``; donate ``state`` so the update is in place.
    Rows of ``state_indices`` must be distinct.
    """
    scale = checks.scalar("scale", scale)
    named = {n: (x, "V" if n == "v" else "K") for n, x in dict(r=r, w=w, k=k, v=v, a=a, b=b).items()}
    return _step("rwkv7_step", named, {}, state, scale, state_indices, backend)


def rwkv6_step(r, k, v, w, u, state, *, scale=1.0, state_indices=None, backend=None):
    """RWKV-6 inference step on a state pool; see :func:`rwkv7_step` and :func:`rwkv6`."""
    scale = checks.scalar("scale", scale)
    named = {n: (x, "V" if n == "v" else "K") for n, x in dict(r=r, k=k, v=v, w=w).items()}
    return _step("rwkv6_step", named, dict(u=(u, ("H", "K"))), state, scale, state_indices,
                 backend)

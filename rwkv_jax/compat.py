"""Names for users coming from the ``rwkv_ops`` package (see DESIGN.md, "Public API")."""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp

from . import _checks as checks
from .ops import rwkv6, rwkv7

generalized_delta_rule = rwkv7
rwkv7_op = rwkv7

# rwkv_ops' KERNEL_TYPE names -> our backends.
_KERNEL_TYPES = {"native": "native", "triton": "triton", "cuda": "ffi"}


def _backend_for(kernel_type):
    if kernel_type is None:
        kernel_type = os.environ.get("KERNEL_TYPE") or None
    if kernel_type is None:
        return None
    if kernel_type not in _KERNEL_TYPES:
        raise ValueError(f"KERNEL_TYPE must be one of {sorted(_KERNEL_TYPES)}, got {kernel_type!r}")
    return _KERNEL_TYPES[kernel_type]


def get_generalized_delta_rule(head_size=64, KERNEL_TYPE=None):
    """Returns ``(fn, uses_chunked_kernel)``: ``fn`` is :func:`rwkv_jax.rwkv7` bound to the backend
    that ``KERNEL_TYPE`` ("native", "triton", "cuda"; default: the environment variable
    ``KERNEL_TYPE``, else the platform default) names."""
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        raise ValueError(f"head_size must be a positive int, got {head_size!r}")
    backend = _backend_for(KERNEL_TYPE)
    return functools.partial(rwkv7, backend=backend), backend in ("triton", "chunked")


class RWKV6_OP:
    """RWKV-6 in the ``rwkv_ops`` calling convention: ``[B, T, C]`` tensors, ``w`` raw as in the
    official CUDA kernel (decay = ``exp(-exp(w))``), ``u`` ``[H, N]`` or ``[C]``.

    ``op(r, k, v, w, u, with_state=False, init_state=None, state_map=None)`` returns ``(y, state)``
    with ``state`` float32 ``[B, H, N, N]`` when ``with_state`` else None. ``init_state`` is
    ``[n_state, H, N, N]`` (or ``[H, N, N]``) and ``state_map`` ``[B]`` picks each row's initial
    state (default: row i for n_state == B, row 0 for n_state == 1).
    """

    def __init__(self, head_size=64, max_sequence_length=4096, ops_loop=False):
        if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
            raise ValueError(f"head_size must be a positive int, got {head_size!r}")
        self.head_size = head_size
        self.max_sequence_length = max_sequence_length  # no limit here; kept for the signature
        self.backend = "native" if ops_loop else _backend_for(None)

    def __call__(self, r, k, v, w, u, with_state=False, init_state=None, state_map=None):
        n = self.head_size
        sizes: dict = {}
        r, k, v, w = (checks.shaped(name, x, ("B", "T", "C"), sizes)
                      for name, x in dict(r=r, k=k, v=v, w=w).items())
        batch, length, channels = (sizes[d][0] for d in "BTC")
        if channels % n:
            raise ValueError(f"r, k, v, w have C={channels} channels, not a multiple of "
                             f"head_size={n}")
        heads = channels // n
        u = checks.floating("u", u)
        if u.shape not in ((heads, n), (channels,)):
            raise ValueError(f"u must be [H, N] = [{heads}, {n}] or [C] = [{channels}], "
                             f"got shape {tuple(u.shape)}")
        split = lambda x: jnp.reshape(x, (batch, length, heads, n))
        log_decay = -jnp.exp(w.astype(jnp.float32))
        h0 = None
        if init_state is not None:
            init_state = checks.floating("init_state", init_state)
            if init_state.ndim == 3:
                init_state = init_state[None]
            if init_state.ndim != 4 or tuple(init_state.shape[1:]) != (heads, n, n):
                raise ValueError(f"init_state must be [n_state, H, N, N] = [n_state, {heads}, {n}, "
                                 f"{n}], got shape {tuple(init_state.shape)}")
            slots = init_state.shape[0]
            if state_map is None:
                if slots not in (1, batch):
                    raise ValueError(f"init_state has n_state={slots} rows for a batch of "
                                     f"B={batch}: pass state_map [B] to pick a row per sequence")
                state_map = jnp.zeros((batch,), jnp.int32) if slots == 1 else jnp.arange(batch)
            state_map = checks.integer("state_map", state_map)
            if state_map.shape != (batch,):
                raise ValueError(f"state_map must be [B] = [{batch}], got shape {tuple(state_map.shape)}")
            h0 = checks.take_rows("state_map", jnp.asarray(init_state, jnp.float32), state_map)
        elif state_map is not None:
            raise ValueError("state_map was given without init_state")
        y, state = rwkv6(split(r), split(k), split(v), split(log_decay), jnp.reshape(u, (heads, n)),
                         initial_state=h0, output_final_state=bool(with_state),
                         backend=self.backend)
        return jnp.reshape(y, (batch, length, channels)), state

"""Names for users coming from the ``rwkv_ops`` package (0.11.3), in **its** conventions
(DESIGN.md, "Public API"; README, "Coming from rwkv_ops", maps each name to the core op)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from . import _checks as checks
from .backends import resolve
from .ops import rwkv6, rwkv7

# rwkv_ops' KERNEL_TYPE names -> our backends.
_KERNEL_TYPES = {"native": "native", "triton": "triton", "cuda": "ffi"}
# Backends that run the chunked algorithm (see uses_chunked_kernel).
_CHUNKED = ("chunked", "triton")


def _log_decay(w):
    """rwkv_ops' raw ``w`` (decay ``exp(-exp(w))``) as the core API's log decay ``-exp(w)``,
    computed in at least float32 and returned in ``w``'s dtype. ``w = -1e9`` (its padding habit)
    gives exactly 0 (decay 1)."""
    wide = jnp.promote_types(w.dtype, jnp.float32)
    return (-jnp.exp(w.astype(wide))).astype(w.dtype)


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _freeze_mask(mask, batch, steps, head_first):
    """``mask`` [B, T] or [B, T, 1, 1] as a boolean array that broadcasts against the inputs
    ([B, T, 1, 1], or [B, 1, T, 1] when ``head_first``); True advances the state."""
    mask = checks.array("mask", mask)
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)
            or jnp.issubdtype(mask.dtype, jnp.floating)):
        raise TypeError(f"mask must be bool, integer or floating, got dtype {mask.dtype}")
    if tuple(mask.shape) not in ((batch, steps), (batch, steps, 1, 1)):
        raise ValueError(f"mask must be [B, T] = [{batch}, {steps}] or [B, T, 1, 1], "
                         f"got shape {tuple(mask.shape)}")
    values = checks.host_values(mask)   # None: traced or split across processes, not read
    if values is not None and not np.isin(values, (0, 1)).all():
        raise ValueError(f"mask must hold 0 (freeze the state) or 1 (advance it), got "
                         f"{np.unique(values)[:8].tolist()}")
    advance = jnp.reshape(jnp.asarray(mask) != 0, (batch, steps))
    return advance[:, None, :, None] if head_first else advance[:, :, None, None]


def generalized_delta_rule(r, w, k, v, a, b, initial_state=None, output_final_state=True,
                           head_first=False, chunk_size=16, mask=None, *, backend=None,
                           head_size=None):
    """RWKV-7 in the ``rwkv_ops`` convention (also ``rwkv7_op``).

    ``w`` is **raw**: the decay is ``exp(-exp(w))``, so the core op :func:`rwkv_jax.rwkv7` gets
    the log decay ``-exp(w)``. States are **value-major**, ``S[v, k]``, as in every rwkv_ops
    kernel and the official RWKV-7 code (the core op's are key-major ``h[k, v]``, their
    transpose): ``initial_state`` is ``[B, H, V, K]`` or ``[1, H, V, K]`` (shared by every
    sequence; V = K in rwkv_ops), and so is the final state. ``mask`` ``[B, T]`` (or
    ``[B, T, 1, 1]``): 1 advances the state at that step, 0 freezes it (the step runs with decay
    1 and zero ``k``, ``a``, ``b``, so the state is exactly unchanged; its output reads the
    frozen state and is padding). ``chunk_size`` is accepted for the signature and ignored (each backend picks its
    own). ``head_size`` (set by :func:`get_generalized_delta_rule`), when given, must equal ``K``.
    Returns ``(o, final_state)``, or ``o`` alone when ``output_final_state`` is False, as
    ``rwkv_ops`` does; ``o`` is ``[B, T, H, K]`` (``[B, H, T, K]`` when ``head_first``).
    """
    head_first = checks.flag("head_first", head_first)
    output_final_state = checks.flag("output_final_state", output_final_state)
    _positive_int("chunk_size", chunk_size)
    sizes: dict = {}
    lead = ("B", "H", "T") if head_first else ("B", "T", "H")
    r, w, k, v, a, b = (checks.shaped(n, x, lead + ("V" if n == "v" else "K",), sizes)
                        for n, x in dict(r=r, w=w, k=k, v=v, a=a, b=b).items())
    batch, steps = sizes["B"][0], sizes["T"][0]
    if head_size is not None and sizes["K"][0] != head_size:
        raise ValueError(f"r, w, k, a, b have K={sizes['K'][0]}, but this function was made for "
                         f"head_size={head_size}")
    if mask is not None:
        advance = _freeze_mask(mask, batch, steps, head_first)
        # A frozen step: decay 1 (raw w = -inf) and nothing added (k = a = b = 0).
        w = jnp.where(advance, w, -jnp.inf)
        k, a, b = (jnp.where(advance, x, jnp.zeros((), x.dtype)) for x in (k, a, b))
    if initial_state is not None:
        initial_state = checks.floating("initial_state", initial_state)
        heads, keys, values = sizes["H"][0], sizes["K"][0], sizes["V"][0]
        shape = tuple(initial_state.shape)
        if len(shape) != 4 or shape[0] not in (1, batch) or shape[1:] != (heads, values, keys):
            raise ValueError(f"initial_state must be value-major [B, H, V, K] = [{batch}, {heads}, "
                             f"{values}, {keys}] or [1, H, V, K] (rwkv_ops' layout), got shape "
                             f"{shape}")
        if shape[0] == 1 and batch > 1:
            initial_state = jnp.broadcast_to(initial_state, (batch,) + initial_state.shape[1:])
        initial_state = _transposed_state(initial_state)
    o, h = rwkv7(r, _log_decay(w), k, v, a, b, initial_state=initial_state,
                 output_final_state=output_final_state, head_first=head_first, backend=backend)
    return (o, _transposed_state(h)) if output_final_state else o


def _transposed_state(state):
    """rwkv_ops' value-major ``S[..., v, k]`` <-> the core ops' key-major ``h[..., k, v]``."""
    return jnp.swapaxes(jnp.asarray(state), -1, -2)


rwkv7_op = generalized_delta_rule


def _backend_for(kernel_type):
    """The backend a ``KERNEL_TYPE`` argument names (strict), or None for the default."""
    if kernel_type is None:
        return None
    if kernel_type not in _KERNEL_TYPES:
        raise ValueError(f"KERNEL_TYPE must be one of {sorted(_KERNEL_TYPES)}, got {kernel_type!r}")
    return _KERNEL_TYPES[kernel_type]


def generalized_delta_rule_inference(r, w, k, v, a, b, output_final_state=True,
                                     initial_state=None, head_first=False, chunk_size=16,
                                     mask=None, *, backend=None, head_size=None):
    """:func:`generalized_delta_rule` with the argument order of rwkv_ops 0.11.3's CUDA
    inference op, ``output_final_state`` before ``initial_state``: what
    ``get_generalized_delta_rule(KERNEL_TYPE="cuda")`` returns as its inference op there."""
    return generalized_delta_rule(r, w, k, v, a, b, initial_state, output_final_state,
                                  head_first, chunk_size, mask, backend=backend,
                                  head_size=head_size)


def uses_chunked_kernel(KERNEL_TYPE=None) -> bool:
    """Whether the backend that ``KERNEL_TYPE`` names (None: the default, as in
    :func:`get_generalized_delta_rule`) runs RWKV-7's chunked algorithm."""
    backend = _backend_for(KERNEL_TYPE)
    return (backend if backend is not None else resolve("rwkv7", None)[0]) in _CHUNKED


def get_generalized_delta_rule(head_size=None, KERNEL_TYPE=None, chunk_size=16, *,
                               HEAD_SIZE=None):
    """Returns ``(training_op, inference_op)``, as rwkv_ops 0.11.3 does: both are
    :func:`generalized_delta_rule` bound to the backend that ``KERNEL_TYPE`` ("native",
    "triton", "cuda" = our "ffi") names, strictly; without it the default (the environment
    variables ``RWKV_JAX_BACKEND`` / ``KERNEL_TYPE`` as a preference, else the measured per-op
    default). With ``KERNEL_TYPE="cuda"`` the inference op takes rwkv_ops' CUDA inference order
    (:func:`generalized_delta_rule_inference`); otherwise it is the training op itself, as in
    rwkv_ops' native and Pallas paths. Both are differentiable, states value-major ``S[v, k]``.
    Whether the backend is chunked: :func:`uses_chunked_kernel`.

    The head size is ``head_size`` or, in rwkv_ops 0.11.3's spelling, ``HEAD_SIZE`` (64 when
    neither is given); the ops check ``K`` against it. ``chunk_size`` is checked and bound to
    them, which ignore it (each backend picks its own)."""
    if head_size is not None and HEAD_SIZE is not None:
        raise TypeError(f"pass the head size once, as head_size or as HEAD_SIZE, got "
                        f"head_size={head_size!r} and HEAD_SIZE={HEAD_SIZE!r}")
    size = HEAD_SIZE if head_size is None else head_size
    size = _positive_int("head_size" if HEAD_SIZE is None else "HEAD_SIZE",
                         64 if size is None else size)
    chunk_size = _positive_int("chunk_size", chunk_size)
    backend = _backend_for(KERNEL_TYPE)
    bound = dict(backend=backend, head_size=size, chunk_size=chunk_size)
    training_op = functools.partial(generalized_delta_rule, **bound)
    if KERNEL_TYPE == "cuda":
        return training_op, functools.partial(generalized_delta_rule_inference, **bound)
    return training_op, training_op


def _is_array(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")


class RWKV6_OP:
    """RWKV-6 in the ``rwkv_ops`` calling conventions: ``[B, T, C]`` tensors, ``w`` raw as in the
    official CUDA kernel (decay = ``exp(-exp(w))``), ``u`` ``[H, N]`` or ``[C]``. States are
    key-major ``[.., N_k, N_v]`` in both forms, as in rwkv_ops' RWKV-6 kernels and the core op.

    Two forms, told apart by the first argument (arrays, or a head size):

    - the class form: ``op = RWKV6_OP(head_size=64, max_sequence_length=4096, ops_loop=False)``,
      then ``op(r, k, v, w, u, with_state=False, init_state=None, state_map=None)`` returns
      ``(y, state)`` with ``state`` float32 ``[B, H, N, N]`` when ``with_state`` else None;
    - rwkv_ops 0.11.3's direct call: ``RWKV6_OP(r, k, v, w, u, initial_state=None,
      output_final_state=False, state_map=None, head_size=None, head_first=False,
      backend=None)`` returns ``y``, or ``(y, state)`` when ``output_final_state``. The head size
      is ``head_size``, else ``N`` of a ``u`` ``[H, N]``, else 64 (rwkv_ops' default);
      ``head_first`` inputs and output are ``[B, H, T, N]``.

    ``init_state`` / ``initial_state`` is ``[n_state, H, N, N]`` (or ``[H, N, N]``) and
    ``state_map`` ``[B]`` picks each row's initial state (default: row i for n_state == B, row 0
    for n_state == 1).
    """

    def __new__(cls, *args, **kwargs):
        if (args and _is_array(args[0])) or "r" in kwargs:
            return _rwkv6_direct(*args, **kwargs)
        if args and (isinstance(args[0], bool) or not isinstance(args[0], (int, np.integer))):
            raise TypeError(f"RWKV6_OP takes a head size (int) to build the op, "
                            f"RWKV6_OP(head_size=64), or the arrays r, k, v, w, u to run it, "
                            f"RWKV6_OP(r, k, v, w, u, ...); got {type(args[0]).__name__} "
                            f"{args[0]!r} first")
        return super().__new__(cls)

    def __init__(self, head_size=64, max_sequence_length=4096, ops_loop=False):
        self.head_size = _positive_int("head_size", head_size)
        self.max_sequence_length = max_sequence_length  # no limit here; kept for the signature
        self.backend = "native" if ops_loop else None  # None: preference, then default

    def __call__(self, r, k, v, w, u, with_state=False, init_state=None, state_map=None):
        y, state = _rwkv6(r, k, v, w, u, self.head_size, init_state, "init_state", state_map,
                          bool(with_state), self.backend)
        return y, state


def _rwkv6_direct(r, k, v, w, u, initial_state=None, output_final_state=False, state_map=None,
                  head_size=None, max_sequence_length=4096, head_first=False, backend=None):
    """rwkv_ops 0.11.3's ``RWKV6_OP(r, k, v, w, u, ...)`` (see :class:`RWKV6_OP`)."""
    head_first = checks.flag("head_first", head_first)
    output_final_state = checks.flag("output_final_state", output_final_state)
    if head_size is None:
        u_shape = getattr(u, "shape", ())
        head_size = u_shape[1] if len(u_shape) == 2 else 64
    head_size = _positive_int("head_size", head_size)
    if head_first:  # [B, H, T, N] -> [B, T, C]
        r, k, v, w = (_from_head_first("rkvw"[i], x, head_size)
                      for i, x in enumerate((r, k, v, w)))
    y, state = _rwkv6(r, k, v, w, u, head_size, initial_state, "initial_state", state_map,
                      output_final_state, backend)
    if head_first:
        batch, steps, _ = y.shape
        y = jnp.swapaxes(jnp.reshape(y, (batch, steps, -1, head_size)), 1, 2)
    return (y, state) if output_final_state else y


def _from_head_first(name, x, head_size):
    x = checks.shaped(name, x, ("B", "H", "T", "N"), {"N": (head_size, "head_size")})
    batch, heads, steps, _ = x.shape
    return jnp.reshape(jnp.swapaxes(x, 1, 2), (batch, steps, heads * head_size))


def _rwkv6(r, k, v, w, u, n, init_state, state_name, state_map, with_state, backend):
    """Both forms of RWKV6_OP: ``[B, T, C]`` tensors with heads of ``n`` -> ``(y, state or
    None)``."""
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
    h0 = None
    if init_state is not None:
        init_state = checks.floating(state_name, init_state)
        if init_state.ndim == 3:
            init_state = init_state[None]
        if init_state.ndim != 4 or tuple(init_state.shape[1:]) != (heads, n, n):
            raise ValueError(f"{state_name} must be [n_state, H, N, N] = [n_state, {heads}, {n}, "
                             f"{n}], got shape {tuple(init_state.shape)}")
        slots = init_state.shape[0]
        if state_map is None:
            if slots not in (1, batch):
                raise ValueError(f"{state_name} has n_state={slots} rows for a batch of "
                                 f"B={batch}: pass state_map [B] to pick a row per sequence")
            state_map = jnp.zeros((batch,), jnp.int32) if slots == 1 else jnp.arange(batch)
        state_map = checks.integer("state_map", state_map)
        if state_map.shape != (batch,):
            raise ValueError(f"state_map must be [B] = [{batch}], got shape {tuple(state_map.shape)}")
        h0 = checks.take_rows("state_map", jnp.asarray(init_state, jnp.float32), state_map)
    elif state_map is not None:
        raise ValueError(f"state_map was given without {state_name}")
    y, state = rwkv6(split(r), split(k), split(v), split(_log_decay(w)),
                     jnp.reshape(u, (heads, n)),
                     initial_state=h0, output_final_state=with_state, backend=backend)
    return jnp.reshape(y, (batch, length, channels)), state

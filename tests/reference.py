"""An independent float64 reference for every op of DESIGN.md, in plain numpy (no JAX).

Each recurrence is a loop over time written straight from the math of DESIGN.md, vectorised
over batch and heads only. Gradients are hand-derived reverse mode over the stored per-step
states (memory is no concern here), except RWKV-4, whose max trick makes a hand backward messy:
its channels are independent, so complex-step differentiation gives the exact derivative of all
channels at once.

Interface, for every op name of ``rwkv_jax.backends.OPS``:

    out, state = forward(op, inputs, **options)
    grads = gradients(op, inputs, d_out, d_state, **options)

``inputs`` maps argument names to float64 arrays in ``[B, T, H, *]`` layout (``initial_state``
may be absent, meaning zeros, or ``(0, 0, -1e38)`` for RWKV-4; step ops take ``state``, the
pool). ``gradients`` returns d(sum(out * d_out) + sum(state * d_state)) / d(input) for every
array in ``inputs``. Options: ``scale``, ``cu_seqlens`` (a host array of offsets), ``reverse``
(gated_linear_attention), ``state_indices`` (step ops).
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------------------------------------
# One batch of whole sequences [B, T, H, *] from an initial state [B, H, K, V]. Each op has
# `_<op>_forward(x, h0, opts) -> (o, states)` with states [T + 1, B, H, K, V] (states[i] is the
# state after i processed steps) and `_<op>_backward(x, states, do, dh, opts) -> grads`, where
# `x` holds the per-token inputs (and shared parameters) and grads include "initial_state".
# ---------------------------------------------------------------------------------------------


def _read(q, h):
    """h^T q per batch and head: q [B, H, K], h [B, H, K, V] -> [B, H, V]."""
    return np.einsum("bhk,bhkv->bhv", q, h)


def _weigh(h, y):
    """h y per batch and head: h [B, H, K, V], y [B, H, V] -> [B, H, K]."""
    return np.einsum("bhkv,bhv->bhk", h, y)


def _outer(x, y):
    return x[..., :, None] * y[..., None, :]


def _rwkv7_forward(x, h0, opts):
    r, w, k, v, a, b = (x[n] for n in "rwkvab")
    steps = r.shape[1]
    states = np.empty((steps + 1,) + h0.shape)
    states[0] = h0
    o = np.empty(v.shape)
    for t in range(steps):
        h = states[t]
        h = (np.exp(w[:, t])[..., None] * h + _outer(b[:, t], _read(a[:, t], h))
             + _outer(k[:, t], v[:, t]))
        states[t + 1] = h
        o[:, t] = _read(opts["scale"] * r[:, t], h)
    return o, states


def _rwkv7_backward(x, states, do, dh, opts):
    r, w, k, v, a, b = (x[n] for n in "rwkvab")
    scale = opts["scale"]
    grads = {n: np.zeros_like(x[n]) for n in "rwkvab"}
    g = dh.copy()  # d loss / d h_t, built up from the end
    for t in reversed(range(r.shape[1])):
        h_prev, h = states[t], states[t + 1]
        g = g + _outer(scale * r[:, t], do[:, t])
        grads["r"][:, t] = scale * _weigh(h, do[:, t])
        grads["k"][:, t] = _weigh(g, v[:, t])
        grads["v"][:, t] = _read(k[:, t], g)
        g_b = _read(b[:, t], g)                   # G^T b: gradient of a^T h_prev
        grads["b"][:, t] = _weigh(g, _read(a[:, t], h_prev))
        grads["a"][:, t] = _weigh(h_prev, g_b)
        grads["w"][:, t] = np.exp(w[:, t]) * (g * h_prev).sum(-1)
        g = np.exp(w[:, t])[..., None] * g + _outer(a[:, t], g_b)
    grads["initial_state"] = g
    return grads


def _rwkv6_forward(x, h0, opts):
    r, k, v, w, u = (x[n] for n in "rkvwu")
    steps = r.shape[1]
    states = np.empty((steps + 1,) + h0.shape)
    states[0] = h0
    o = np.empty(v.shape)
    for t in range(steps):
        kv = _outer(k[:, t], v[:, t])
        o[:, t] = _read(opts["scale"] * r[:, t], states[t] + u[None, :, :, None] * kv)
        states[t + 1] = np.exp(w[:, t])[..., None] * states[t] + kv
    return o, states


def _rwkv6_backward(x, states, do, dh, opts):
    r, k, v, w, u = (x[n] for n in "rkvwu")
    scale = opts["scale"]
    grads = {n: np.zeros_like(x[n]) for n in "rkvwu"}
    g = dh.copy()
    for t in reversed(range(r.shape[1])):
        h_prev = states[t]
        # o = s h_prev^T r + s (r . (u*k)) v
        v_do = (v[:, t] * do[:, t]).sum(-1)[..., None]           # [B, H, 1]
        bonus = scale * (r[:, t] * u * k[:, t]).sum(-1)[..., None]
        grads["r"][:, t] = scale * (_weigh(h_prev, do[:, t]) + u * k[:, t] * v_do)
        grads["u"] += (scale * r[:, t] * k[:, t] * v_do).sum(0)
        grads["k"][:, t] = scale * r[:, t] * u * v_do + _weigh(g, v[:, t])
        grads["v"][:, t] = bonus * do[:, t] + _read(k[:, t], g)
        grads["w"][:, t] = np.exp(w[:, t]) * (g * h_prev).sum(-1)
        g = np.exp(w[:, t])[..., None] * g + _outer(scale * r[:, t], do[:, t])
    grads["initial_state"] = g
    return grads


_GLA_GATES = ("g", "gk", "gv")


def _gla_log_decay(x, t):
    """log of the [B, H, K, V] decay of step t from whichever gates are present."""
    q, v = x["q"], x["v"]
    log_decay = np.zeros(q.shape[:1] + q.shape[2:] + v.shape[-1:])
    if x.get("g") is not None:
        log_decay += x["g"][:, t, :, None, None]
    if x.get("g_gamma") is not None:
        log_decay += x["g_gamma"][None, :, None, None]
    if x.get("gk") is not None:
        log_decay += x["gk"][:, t, :, :, None]
    if x.get("gv") is not None:
        log_decay += x["gv"][:, t, :, None, :]
    return log_decay


def _gla_order(steps, opts):
    return list(reversed(range(steps))) if opts.get("reverse") else list(range(steps))


def _gla_forward(x, h0, opts):
    q, k, v = x["q"], x["k"], x["v"]
    order = _gla_order(q.shape[1], opts)
    states = np.empty((len(order) + 1,) + h0.shape)
    states[0] = h0
    o = np.empty(v.shape)
    for i, t in enumerate(order):
        states[i + 1] = np.exp(_gla_log_decay(x, t)) * states[i] + _outer(k[:, t], v[:, t])
        o[:, t] = _read(opts["scale"] * q[:, t], states[i + 1])
    return o, states


def _gla_backward(x, states, do, dh, opts):
    q, k, v = x["q"], x["k"], x["v"]
    scale = opts["scale"]
    grads = {n: np.zeros_like(a) for n, a in x.items() if a is not None}
    order = _gla_order(q.shape[1], opts)
    g = dh.copy()
    for i in reversed(range(len(order))):
        t = order[i]
        h_prev, h = states[i], states[i + 1]
        g = g + _outer(scale * q[:, t], do[:, t])
        grads["q"][:, t] = scale * _weigh(h, do[:, t])
        grads["k"][:, t] = _weigh(g, v[:, t])
        grads["v"][:, t] = _read(k[:, t], g)
        decay = np.exp(_gla_log_decay(x, t))
        d_log_decay = g * decay * h_prev  # [B, H, K, V]
        if "g" in grads:
            grads["g"][:, t] = d_log_decay.sum((-2, -1))
        if "g_gamma" in grads:
            grads["g_gamma"] += d_log_decay.sum((0, 2, 3))
        if "gk" in grads:
            grads["gk"][:, t] = d_log_decay.sum(-1)
        if "gv" in grads:
            grads["gv"][:, t] = d_log_decay.sum(-2)
        g = decay * g
    grads["initial_state"] = g
    return grads


# name -> (forward, backward, per-token inputs, shared inputs without a time axis)
_SEQUENCE_OPS = {
    "rwkv7": (_rwkv7_forward, _rwkv7_backward, tuple("rwkvab"), ()),
    "rwkv6": (_rwkv6_forward, _rwkv6_backward, tuple("rkvw"), ("u",)),
    "gated_linear_attention": (_gla_forward, _gla_backward, ("q", "k", "v") + _GLA_GATES,
                               ("g_gamma",)),
}


def _segments(cu_seqlens, total):
    """(start, end) of each packed segment; one segment covering everything without packing."""
    if cu_seqlens is None:
        return None
    offsets = np.asarray(cu_seqlens).tolist()
    assert offsets[0] == 0 and offsets[-1] == total, offsets
    return list(zip(offsets[:-1], offsets[1:]))


def _sequence_state0(inputs, token_names, rows):
    if inputs.get("initial_state") is not None:
        return np.asarray(inputs["initial_state"], np.float64)
    first = inputs[token_names[0]]
    return np.zeros((rows, first.shape[2], first.shape[3], inputs["v"].shape[3]))


def _sequence(op, inputs, d_out, d_state, opts):
    """Forward (and, with cotangents, backward) of a sequence op, packed segments included.

    With cu_seqlens every segment runs alone (B = 1) from its own row of the initial state,
    which is exactly what DESIGN.md promises packing equals.
    """
    fwd, bwd, token_names, shared_names = _SEQUENCE_OPS[op]
    x = {n: (None if inputs.get(n) is None else np.asarray(inputs[n], np.float64))
         for n in token_names + shared_names}
    total = x[token_names[0]].shape[1]
    segments = _segments(opts.get("cu_seqlens"), total)
    if segments is None:
        pieces = [(slice(None), None)]
        rows = x[token_names[0]].shape[0]
    else:
        pieces = [(slice(start, end), n) for n, (start, end) in enumerate(segments)]
        rows = len(segments)
    h0 = _sequence_state0(inputs, token_names, rows)
    o = np.zeros(x["v"].shape)
    h = np.empty(h0.shape)
    grads = {n: np.zeros_like(a) for n, a in x.items() if a is not None}
    grads["initial_state"] = np.zeros_like(h0)
    for span, row in pieces:
        rows_of = slice(None) if row is None else slice(row, row + 1)
        piece = {n: (a[:, span] if n in token_names and a is not None else a) for n, a in x.items()}
        if piece[token_names[0]].shape[1] == 0:  # an empty segment passes its state through
            h[rows_of] = h0[rows_of]
            if d_out is not None:
                grads["initial_state"][rows_of] = d_state[rows_of]
            continue
        o_piece, states = fwd(piece, h0[rows_of], opts)
        o[:, span] = o_piece
        h[rows_of] = states[-1]
        if d_out is not None:
            g = bwd(piece, states, d_out[:, span], d_state[rows_of], opts)
            for n, dx in g.items():
                if n == "initial_state":
                    grads[n][rows_of] = dx
                elif n in token_names:
                    grads[n][:, span] = dx
                else:
                    grads[n] += dx
    if d_out is None:
        return o, h
    return {n: dx for n, dx in grads.items() if inputs.get(n) is not None}


# ---------------------------------------------------------------------------------------------
# RWKV-4: the max trick exactly as DESIGN.md writes it, on real or complex arrays.
# ---------------------------------------------------------------------------------------------

RWKV4_EMPTY_PP = -1e38


def _maximum(x, y):
    """max by real part, carrying the imaginary part of the chosen branch (complex step)."""
    return np.where(np.real(x) >= np.real(y), x, y)


def _rwkv4_run(w, u, k, v, state):
    """w, u [C]; k, v [B, T, C]; state [B, C, 3] -> (y [B, T, C], state [B, C, 3])."""
    aa, bb, pp = state[..., 0], state[..., 1], state[..., 2]
    y = np.empty(np.broadcast(k, v).shape, np.result_type(k, v, w, u, state))
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        ww = u + kt
        p = _maximum(pp, ww)
        e1, e2 = np.exp(pp - p), np.exp(ww - p)
        y[:, t] = (e1 * aa + e2 * vt) / (e1 * bb + e2)
        ww = w + pp
        p = _maximum(ww, kt)
        e1, e2 = np.exp(ww - p), np.exp(kt - p)
        aa, bb, pp = e1 * aa + e2 * vt, e1 * bb + e2, p
    return y, np.stack([aa, bb, pp], axis=-1)


def _rwkv4_state0(inputs):
    if inputs.get("initial_state") is not None:
        return np.asarray(inputs["initial_state"], np.float64)
    batch, channels = inputs["k"].shape[0], inputs["k"].shape[2]
    state = np.zeros((batch, channels, 3))
    state[..., 2] = RWKV4_EMPTY_PP
    return state


def _rwkv4_gradients(inputs, d_out, d_state):
    """Complex-step derivative: channels (and batch rows) never mix, so perturbing one index
    along the other axes in every channel and row at once yields all their derivatives."""
    step = 1e-30
    x = {n: np.asarray(inputs[n], np.float64) for n in ("w", "u", "k", "v")}
    x["initial_state"] = _rwkv4_state0(inputs)

    def loss_per_row_and_channel(perturbed):
        z = {n: perturbed.get(n, a).astype(np.complex128) for n, a in x.items()}
        y, state = _rwkv4_run(z["w"], z["u"], z["k"], z["v"], z["initial_state"])
        return (y * d_out).sum(1) + (state * d_state).sum(2)  # [B, C]

    def derivative(name, index):
        bumped = x[name].astype(np.complex128)
        bumped[index] += 1j * step
        return np.imag(loss_per_row_and_channel({name: bumped})) / step

    grads = {n: derivative(n, Ellipsis).sum(0) for n in ("w", "u")}
    for name in ("k", "v"):
        grads[name] = np.stack([derivative(name, (slice(None), t))
                                for t in range(x[name].shape[1])], axis=1)
    grads["initial_state"] = np.stack([derivative("initial_state", (Ellipsis, s))
                                       for s in range(3)], axis=-1)
    return {n: g for n, g in grads.items() if inputs.get(n) is not None}


# ---------------------------------------------------------------------------------------------
# Public entry points.
# ---------------------------------------------------------------------------------------------

_STEP_OPS = {"rwkv7_step": "rwkv7", "rwkv6_step": "rwkv6"}


def _options(op, inputs, options):
    opts = dict(options)
    if op == "gated_linear_attention" and opts.get("scale") is None:
        opts["scale"] = inputs["q"].shape[-1] ** -0.5
    opts.setdefault("scale", 1.0)
    return opts


def _step_indices(inputs, opts):
    batch = inputs["v"].shape[0]
    indices = opts.get("state_indices")
    indices = np.arange(batch) if indices is None else np.asarray(indices)
    assert len(set(indices.tolist())) == batch, "state_indices must be distinct"
    return indices


def forward(op, inputs, **options):
    """(out, state) of ``op`` in float64; see the module docstring."""
    opts = _options(op, inputs, options)
    if op == "rwkv4":
        x = {n: np.asarray(inputs[n], np.float64) for n in ("w", "u", "k", "v")}
        return _rwkv4_run(x["w"], x["u"], x["k"], x["v"], _rwkv4_state0(inputs))
    if op in _STEP_OPS:
        indices = _step_indices(inputs, opts)
        pool = np.asarray(inputs["state"], np.float64)
        seq_inputs = {n: a for n, a in inputs.items() if n != "state"}
        o, h = _sequence(_STEP_OPS[op], dict(seq_inputs, initial_state=pool[indices]),
                         None, None, opts)
        pool = pool.copy()
        pool[indices] = h
        return o, pool
    return _sequence(op, inputs, None, None, opts)


def gradients(op, inputs, d_out, d_state, **options):
    """d(sum(out * d_out) + sum(state * d_state)) / d(every array of ``inputs``), float64."""
    opts = _options(op, inputs, options)
    d_out = np.asarray(d_out, np.float64)
    d_state = np.asarray(d_state, np.float64)
    if op == "rwkv4":
        return _rwkv4_gradients(inputs, d_out, d_state)
    if op in _STEP_OPS:
        # The pool rows a step does not touch pass their cotangent straight through.
        indices = _step_indices(inputs, opts)
        pool = np.asarray(inputs["state"], np.float64)
        seq_inputs = {n: a for n, a in inputs.items() if n != "state"}
        grads = _sequence(_STEP_OPS[op], dict(seq_inputs, initial_state=pool[indices]),
                          d_out, d_state[indices], opts)
        d_pool = d_state.copy()
        d_pool[indices] = grads.pop("initial_state")
        return dict(grads, state=d_pool)
    return _sequence(op, inputs, d_out, d_state, opts)


def relative_error(x, ref):
    """DESIGN.md's error measure: ``||x - ref|| / ||ref||`` over the whole tensor, in float64;
    inf when ``x`` holds a non-finite value, so that no tolerance passes it. ``||ref||`` counts
    as at least float32's smallest normal number: a reference that strong decays make smaller
    than that (exp(-500), or exactly 0) is 0 in float32, and 0 is then the right answer."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    scale = max(np.linalg.norm(ref), np.finfo(np.float32).tiny)
    return float(np.linalg.norm(x - ref) / scale)


# ---------------------------------------------------------------------------------------------
# Realistic random inputs (float64 numpy, [B, T, H, *] layout) for tests of every backend.
# ---------------------------------------------------------------------------------------------

DECAYS = ("model", "strong", "zero")
# Decay patterns (tuples) beyond those: ("uniform", lo) draws uniform in [lo, 0] (in [0, lo]
# for lo > 0: positive log decays, outside the contract);
# ("tokens", value) puts whole tokens SPIKE_TOKENS at value (inside a chunk of 16 or 32 tokens,
# never on its boundary) and the rest in the model's range; ("every_third", value) puts tokens
# 1, 4, 7, ... at value (the first token keeps a path from the initial state). value may be
# -inf (decay exactly 0).
SPIKE_TOKENS = (5, 21)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _log_decay(rng, shape, decay, model):
    """A log decay of ``shape`` ([B, T, ...]): the model's range, strong (uniform down to -8),
    exactly 0, or one of the patterns above."""
    if decay == "model":
        return model(rng.standard_normal(shape))
    if decay == "strong":
        return rng.uniform(-8.0, 0.0, shape)
    if decay == "zero":
        return np.zeros(shape)
    kind, value = decay if isinstance(decay, tuple) and len(decay) == 2 else (None, None)
    if kind == "uniform":
        return rng.uniform(min(value, 0.0), max(value, 0.0), shape)
    if kind in ("tokens", "every_third"):
        x = model(rng.standard_normal(shape))
        steps = shape[1]
        tokens = [t for t in SPIKE_TOKENS if t < steps] if kind == "tokens" else range(1, steps, 3)
        x[:, list(tokens)] = value
        return x
    raise ValueError(f"decay must be one of {DECAYS} or a pattern, got {decay!r}")


def _per_head_log_decay(rng, heads, decay):
    """g_gamma [H]: RetNet's fixed decays for "model"; else the first head takes the pattern's
    value (or every head a uniform / zero / strong draw)."""
    retnet = np.log1p(-2.0 ** (-5.0 - np.arange(heads)))
    if decay == "model":
        return retnet
    if isinstance(decay, tuple) and decay[0] in ("tokens", "every_third"):
        return np.concatenate([[decay[1]], retnet[1:]])
    return _log_decay(rng, (heads,), decay, None)


def rwkv7_model_decay(x):
    """RWKV-7's w = -exp(-0.5) * sigmoid(x): in [-0.6065, 0)."""
    return -np.exp(-0.5) / (1.0 + np.exp(-x))


def random_inputs(op, rng, *, batch=2, steps=37, heads=2, key=16, value=None, decay="model",
                  gates=("gk",), initial_state=True, state_rows=None):
    """Inputs of ``op`` drawn as a model would produce them.

    RWKV-7: ``a = -kk``, ``b = kk * iclr`` with ``kk`` the L2-normalised key and ``iclr`` in
    (0, 1). ``gates`` picks the gated_linear_attention gates present (``g``, ``g_gamma``,
    ``gk``, ``gv``). ``decay`` ("model", "strong", "zero" or a pattern above) sets every log
    decay and gate present, g_gamma included (RetNet's fixed decays for "model"; RWKV-4 takes
    the three names only). The initial state of RWKV-4 comes from running a random prefix, so
    ``(aa, bb, pp)`` are consistent. The initial state (or a step op's pool) has ``state_rows``
    rows (default ``batch``; the number of segments with packing, the pool size for steps).
    """
    value = key if value is None else value
    token = (batch, steps, heads)
    normal = lambda *shape: rng.standard_normal(shape)
    if op in ("rwkv7", "rwkv7_step"):
        k = normal(*token, key)
        kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
        iclr = 1.0 / (1.0 + np.exp(-normal(*token, key)))
        x = dict(r=normal(*token, key), w=_log_decay(rng, token + (key,), decay, rwkv7_model_decay),
                 k=k, v=normal(*token, value), a=-kk, b=kk * iclr)
    elif op in ("rwkv6", "rwkv6_step"):
        model = lambda z: -np.exp(0.7 * z - 1.5)  # w = -exp(raw), raw around -1.5
        x = dict(r=normal(*token, key), k=normal(*token, key), v=normal(*token, value),
                 w=_log_decay(rng, token + (key,), decay, model), u=0.5 * normal(heads, key))
    elif op == "gated_linear_attention":
        unknown = set(gates) - {"g", "g_gamma", "gk", "gv"}
        assert not unknown, unknown
        x = dict(q=normal(*token, key), k=normal(*token, key), v=normal(*token, value))
        gla_gate = lambda z: _log_sigmoid(z) / 16.0  # GLA's normalised log-sigmoid gate
        if "g" in gates:
            x["g"] = _log_decay(rng, token, decay, _log_sigmoid)
        if "g_gamma" in gates:  # RetNet-style fixed per-head decays for "model"
            x["g_gamma"] = _per_head_log_decay(rng, heads, decay)
        if "gk" in gates:
            x["gk"] = _log_decay(rng, token + (key,), decay, gla_gate)
        if "gv" in gates:
            x["gv"] = _log_decay(rng, token + (value,), decay, gla_gate)
    elif op == "rwkv4":
        channels = heads * key
        # w = -exp(time_decay); strong decays reach w = -8.
        time_decay = {"model": (-5.0, 1.0), "strong": (-1.0, np.log(8.0))}
        w = np.zeros(channels) if decay == "zero" else -np.exp(rng.uniform(*time_decay[decay],
                                                                             channels))
        x = dict(w=w,
                 u=0.5 * normal(channels) - 1.0,
                 k=2.0 * normal(batch, steps, channels), v=normal(batch, steps, channels))
        if initial_state:
            prefix = dict(x, k=2.0 * normal(batch, 5, channels), v=normal(batch, 5, channels))
            x["initial_state"] = forward("rwkv4", prefix)[1]
        return x
    else:
        raise ValueError(f"unknown op {op!r}")
    rows = batch if state_rows is None else state_rows
    if op.endswith("_step"):
        x["state"] = 0.5 * normal(rows, heads, key, value)
    elif initial_state:
        x["initial_state"] = 0.5 * normal(rows, heads, key, value)
    return x

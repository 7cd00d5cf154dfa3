"""The official RWKV-6 ("x060") model — time-mix, channel-mix and the whole language model —
restated in float64 numpy.

Written from the published model math (BlinkDL's RWKV-LM, RWKV_Tmix_x060 / RWKV_CMix_x060 and
the model around them) on a dict of arrays with the official names and shapes; no rwkv_jax
inside. The wkv recurrence is the official per-head state ``S [K, V]``:

    y_t = r_t^T (S + diag(u) k_t v_t^T),    S = diag(exp(-exp(w_t))) S + k_t v_t^T.

``random_layer`` makes official-format weights of one layer at realistic scales,
``random_checkpoint`` those of a whole model.
"""

from __future__ import annotations

import numpy as np


def _shift(x):
    return np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def _layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _vec(p):
    return p.reshape(-1)


def time_mix(params, layer_id, x):
    """Official RWKV_Tmix_x060 forward of layer ``layer_id`` on ``x [B, T, C]`` (float64)."""
    p = {n: np.asarray(v, np.float64) for n, v in params.items()}
    g_ = lambda name: p[f"blocks.{layer_id}.att.{name}"]
    n_head, head_size = g_("time_faaaa").shape
    batch, steps, c = x.shape
    xx = _shift(x) - x
    # Data-dependent token shift: one tanh down-projection to 5 x D, five up-projections.
    hidden = np.tanh((x + xx * _vec(g_("time_maa_x"))) @ g_("time_maa_w1"))
    hidden = hidden.reshape(batch, steps, 5, -1)
    mw, mk, mv, mr, mg = (hidden[:, :, i] @ g_("time_maa_w2")[i] for i in range(5))
    xw = x + xx * (_vec(g_("time_maa_w")) + mw)
    xk = x + xx * (_vec(g_("time_maa_k")) + mk)
    xv = x + xx * (_vec(g_("time_maa_v")) + mv)
    xr = x + xx * (_vec(g_("time_maa_r")) + mr)
    xg = x + xx * (_vec(g_("time_maa_g")) + mg)
    r = xr @ g_("receptance.weight").T
    k = xk @ g_("key.weight").T
    v = xv @ g_("value.weight").T
    gate = xg @ g_("gate.weight").T
    gate = gate * _sigmoid(gate)
    w = _vec(g_("time_decay")) + np.tanh(xw @ g_("time_decay_w1")) @ g_("time_decay_w2")

    heads = lambda t: t.reshape(batch, steps, n_head, head_size)
    r, k, v = map(heads, (r, k, v))
    decay = heads(np.exp(-np.exp(w)))
    u = g_("time_faaaa")
    state = np.zeros((batch, n_head, head_size, head_size))      # S[b, h, k, v]
    out = np.empty((batch, steps, n_head, head_size))
    for t in range(steps):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", r[:, t], state + u[None, :, :, None] * kv)
        state = decay[:, t, :, :, None] * state + kv

    mean = out.mean(-1, keepdims=True)
    var = out.var(-1, keepdims=True)
    y = ((out - mean) / np.sqrt(var + 64e-5)).reshape(batch, steps, c)
    y = y * g_("ln_x.weight") + g_("ln_x.bias")
    return (y * gate) @ g_("output.weight").T


def channel_mix(params, layer_id, x):
    """Official RWKV_CMix_x060 forward (float64)."""
    p = {n: np.asarray(v, np.float64) for n, v in params.items()}
    g_ = lambda name: p[f"blocks.{layer_id}.ffn.{name}"]
    xx = _shift(x) - x
    xk = x + xx * _vec(g_("time_maa_k"))
    xr = x + xx * _vec(g_("time_maa_r"))
    k = np.maximum(xk @ g_("key.weight").T, 0.0) ** 2
    return _sigmoid(xr @ g_("receptance.weight").T) * (k @ g_("value.weight").T)


def random_layer(seed=0, *, layer_id=0, n_embd=32, head_size=16, dim_ffn=96, mix_lora=4,
                 decay_lora=8, dtype=np.float32):
    """Random official-format weights of RWKV-6 layer ``layer_id`` at realistic scales."""
    rng = np.random.default_rng(seed)
    c, f, h = n_embd, dim_ffn, n_embd // head_size
    normal = lambda *shape, scale=1.0, mean=0.0: mean + scale * rng.standard_normal(shape)
    per_channel = lambda values: np.asarray(values).reshape(1, 1, c)
    att, ffn = f"blocks.{layer_id}.att.", f"blocks.{layer_id}.ffn."
    p = {att + m: per_channel(rng.uniform(0.0, 1.0, c))
         for m in ("time_maa_x", "time_maa_w", "time_maa_k", "time_maa_v", "time_maa_r",
                   "time_maa_g")}
    p[att + "time_maa_w1"] = normal(c, 5 * mix_lora, scale=0.1)
    p[att + "time_maa_w2"] = normal(5, mix_lora, c, scale=0.1)
    p[att + "time_decay"] = per_channel(rng.uniform(-6.0, 1.0, c))
    p[att + "time_decay_w1"] = normal(c, decay_lora, scale=0.1)
    p[att + "time_decay_w2"] = normal(decay_lora, c, scale=0.1)
    p[att + "time_faaaa"] = normal(h, head_size, scale=0.5)
    for lin in ("receptance", "key", "value", "gate", "output"):
        p[att + lin + ".weight"] = normal(c, c, scale=c ** -0.5)
    p[att + "ln_x.weight"] = normal(c, scale=0.1, mean=1.0)
    p[att + "ln_x.bias"] = normal(c, scale=0.1)
    p[ffn + "time_maa_k"] = per_channel(rng.uniform(0.0, 1.0, c))
    p[ffn + "time_maa_r"] = per_channel(rng.uniform(0.0, 1.0, c))
    p[ffn + "key.weight"] = normal(f, c, scale=c ** -0.5)
    p[ffn + "receptance.weight"] = normal(c, c, scale=c ** -0.5)
    p[ffn + "value.weight"] = normal(c, f, scale=f ** -0.5)
    return {name: value.astype(dtype) for name, value in p.items()}


def forward(params, tokens):
    """Logits ``[B, T, vocab]`` of the official model on int ``tokens [B, T]`` (float64): the
    embedding, ``ln0`` on it, per block ``x += att(ln1(x)); x += ffn(ln2(x))``, ``ln_out`` and
    the head."""
    p = {name: np.asarray(value, np.float64) for name, value in params.items()}
    n_layer = 1 + max(int(name.split(".")[1]) for name in p if name.startswith("blocks."))
    norm = lambda x, name: _layer_norm(x, p[name + ".weight"], p[name + ".bias"])
    x = norm(p["emb.weight"][np.asarray(tokens)], "blocks.0.ln0")
    for i in range(n_layer):
        x = x + time_mix(p, i, norm(x, f"blocks.{i}.ln1"))
        x = x + channel_mix(p, i, norm(x, f"blocks.{i}.ln2"))
    return norm(x, "ln_out") @ p["head.weight"].T


def random_checkpoint(seed=0, *, vocab_size=50, n_layer=2, n_embd=32, head_size=16, dim_ffn=96,
                      mix_lora=4, decay_lora=8, dtype=np.float32):
    """Random official-format weights of a whole RWKV-6 model (the names and shapes of a
    ``.pth``) at realistic scales."""
    rng = np.random.default_rng(seed)
    c = n_embd
    normal = lambda *shape, scale=1.0, mean=0.0: mean + scale * rng.standard_normal(shape)
    p = {"emb.weight": normal(vocab_size, c),
         "ln_out.weight": normal(c, scale=0.1, mean=1.0), "ln_out.bias": normal(c, scale=0.1),
         "head.weight": normal(vocab_size, c, scale=c ** -0.5)}
    for i in range(n_layer):
        for norm in (["ln0"] if i == 0 else []) + ["ln1", "ln2"]:
            p[f"blocks.{i}.{norm}.weight"] = normal(c, scale=0.1, mean=1.0)
            p[f"blocks.{i}.{norm}.bias"] = normal(c, scale=0.1)
        p.update(random_layer(int(rng.integers(2 ** 31)), layer_id=i, n_embd=n_embd,
                              head_size=head_size, dim_ffn=dim_ffn, mix_lora=mix_lora,
                              decay_lora=decay_lora, dtype=np.float64))
    return {name: np.asarray(value).astype(dtype) for name, value in p.items()}

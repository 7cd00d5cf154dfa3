"""The official RWKV-7 ("x070") language model, restated in float64 numpy for tests.

Written from the published model math (BlinkDL's RWKV-LM, RWKV-v7) on a dict of arrays with
the official parameter names and shapes. Nothing here uses rwkv_jax: the wkv recurrence is the
official per-head row-layout state ``S [V, K]``, updated token by token as

    S = S diag(decay) - (S kk) (kk * a)^T + v k^T,    y = S r,    decay = exp(-exp(w_raw)),

with ``w_raw = -softplus(-(w0 + tanh(x_w @ w1) @ w2)) - 0.5`` as the official kernels take it.
``random_checkpoint`` makes official-format weights with realistic scales.
"""

from __future__ import annotations

import numpy as np


def _layer_norm(x, weight, bias, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _shift(x):
    """The token before every position, zeros before the first (torch ZeroPad2d((0, 0, 1, -1)))."""
    return np.concatenate([np.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def _vec(p):
    """Official per-channel parameters are stored as [1, 1, C]."""
    return p.reshape(-1)


def time_mix(p, prefix, x, v_first, first_layer):
    """One official RWKV_Tmix_x070 forward on ``x [B, T, C]``; returns ``(out, v_first)``."""
    g_ = lambda name: p[prefix + name]
    n_head, head_size = g_("r_k").shape
    batch, steps, c = x.shape
    xx = _shift(x) - x
    xr, xw, xk, xv, xa, xg = (x + xx * _vec(g_(m))
                              for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
    r = xr @ g_("receptance.weight").T
    w_raw = -_softplus(-(_vec(g_("w0")) + np.tanh(xw @ g_("w1")) @ g_("w2"))) - 0.5
    k = xk @ g_("key.weight").T
    v = xv @ g_("value.weight").T
    if first_layer:
        v_first = v
    else:
        v = v + (v_first - v) * _sigmoid(_vec(g_("v0")) + (xv @ g_("v1")) @ g_("v2"))
    a = _sigmoid(_vec(g_("a0")) + (xa @ g_("a1")) @ g_("a2"))
    g = _sigmoid(xg @ g_("g1")) @ g_("g2")
    kk = (k * _vec(g_("k_k"))).reshape(batch, steps, n_head, head_size)
    kk = kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)
    k = k * (1 + (a - 1) * _vec(g_("k_a")))

    heads = lambda t: t.reshape(batch, steps, n_head, head_size)
    r, k, v, a = map(heads, (r, k, v, a))
    decay = heads(np.exp(-np.exp(w_raw)))
    ab_a, ab_b = -kk, kk * a
    state = np.zeros((batch, n_head, head_size, head_size))     # S[b, h, v, k]
    out = np.empty((batch, steps, n_head, head_size))
    for t in range(steps):
        state = (state * decay[:, t, :, None, :]
                 + np.einsum("bhvk,bhk->bhv", state, ab_a[:, t])[..., None] * ab_b[:, t, :, None, :]
                 + v[:, t, :, :, None] * k[:, t, :, None, :])
        out[:, t] = np.einsum("bhvk,bhk->bhv", state, r[:, t])

    # ln_x: GroupNorm(H, C, eps=64e-5) over each head's channels.
    mean = out.mean(-1, keepdims=True)
    var = out.var(-1, keepdims=True)
    y = ((out - mean) / np.sqrt(var + 64e-5)).reshape(batch, steps, c)
    y = y * g_("ln_x.weight") + g_("ln_x.bias")
    y = y + ((r * k * g_("r_k")).sum(-1, keepdims=True) * v).reshape(batch, steps, c)
    return (y * g) @ g_("output.weight").T, v_first


def channel_mix(p, prefix, x):
    """One official RWKV_CMix_x070 forward."""
    xk = x + (_shift(x) - x) * _vec(p[prefix + "x_k"])
    k = np.maximum(xk @ p[prefix + "key.weight"].T, 0.0) ** 2
    return k @ p[prefix + "value.weight"].T


def forward(params, tokens):
    """Logits ``[B, T, vocab]`` of the official model on int ``tokens [B, T]`` (float64)."""
    p = {name: np.asarray(value, np.float64) for name, value in params.items()}
    n_layer = 1 + max(int(name.split(".")[1]) for name in p if name.startswith("blocks."))
    x = p["emb.weight"][np.asarray(tokens)]
    v_first = None
    for i in range(n_layer):
        b = f"blocks.{i}."
        if i == 0:
            x = _layer_norm(x, p[b + "ln0.weight"], p[b + "ln0.bias"])
        y, v_first = time_mix(p, b + "att.", _layer_norm(x, p[b + "ln1.weight"], p[b + "ln1.bias"]),
                              v_first, first_layer=i == 0)
        x = x + y
        x = x + channel_mix(p, b + "ffn.", _layer_norm(x, p[b + "ln2.weight"], p[b + "ln2.bias"]))
    x = _layer_norm(x, p["ln_out.weight"], p["ln_out.bias"])
    return x @ p["head.weight"].T


def random_checkpoint(seed=0, *, vocab_size=50, n_embd=32, n_layer=2, head_size=16, dim_ffn=None,
                      decay_lora=8, a_lora=8, v_lora=4, gate_lora=12, layer0_value_lora=True,
                      dtype=np.float32):
    """Random official-format RWKV-7 weights (names and shapes of a ``.pth``) at realistic
    scales. ``layer0_value_lora``: include ``blocks.0.att.v0/v1/v2`` (the official trainer
    saves them although layer 0 does not use them)."""
    rng = np.random.default_rng(seed)
    c, f = n_embd, dim_ffn or 4 * n_embd
    h = n_embd // head_size
    normal = lambda *shape, scale=1.0, mean=0.0: mean + scale * rng.standard_normal(shape)
    per_channel = lambda values: np.asarray(values).reshape(1, 1, c)
    p = {"emb.weight": normal(vocab_size, c),
         "ln_out.weight": normal(c, scale=0.1, mean=1.0), "ln_out.bias": normal(c, scale=0.1),
         "head.weight": normal(vocab_size, c, scale=c ** -0.5)}
    for i in range(n_layer):
        b = f"blocks.{i}."
        for norm in (["ln0"] if i == 0 else []) + ["ln1", "ln2"]:
            p[b + norm + ".weight"] = normal(c, scale=0.1, mean=1.0)
            p[b + norm + ".bias"] = normal(c, scale=0.1)
        att = b + "att."
        for m in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            p[att + m] = per_channel(rng.uniform(0.0, 1.0, c))
        p[att + "w0"] = per_channel(rng.uniform(-7.0, 2.0, c))
        p[att + "a0"] = per_channel(normal(c, scale=0.5))
        p[att + "k_k"] = per_channel(rng.uniform(0.5, 1.0, c))
        p[att + "k_a"] = per_channel(rng.uniform(0.8, 1.2, c))
        p[att + "r_k"] = normal(h, head_size, scale=0.3)
        loras = dict(w=decay_lora, a=a_lora, g=gate_lora)
        if i > 0 or layer0_value_lora:
            p[att + "v0"] = per_channel(normal(c, scale=0.5, mean=0.7))
            loras["v"] = v_lora
        for name, width in loras.items():
            p[att + name + "1"] = normal(c, width, scale=0.1)
            p[att + name + "2"] = normal(width, c, scale=0.1)
        for lin in ("receptance", "key", "value", "output"):
            p[att + lin + ".weight"] = normal(c, c, scale=c ** -0.5)
        p[att + "ln_x.weight"] = normal(c, scale=0.1, mean=1.0)
        p[att + "ln_x.bias"] = normal(c, scale=0.1)
        p[b + "ffn.x_k"] = per_channel(rng.uniform(0.0, 1.0, c))
        p[b + "ffn.key.weight"] = normal(f, c, scale=c ** -0.5)
        p[b + "ffn.value.weight"] = normal(c, f, scale=f ** -0.5)
    return {name: value.astype(dtype) for name, value in p.items()}


def write_checkpoint(path, params):
    """Write ``params`` (name -> numpy array) as the file format of ``path``'s suffix (.npz,
    .safetensors, or .pth in torch's layout, tests/pth_files.py), the way the official tools and
    users write them."""
    if path.suffix == ".npz":
        np.savez(path, **params)
    elif path.suffix == ".safetensors":
        from safetensors.numpy import save_file
        save_file(params, str(path))
    else:
        import pth_files
        pth_files.write_state_dict(path, params)

"""The fla-named functions (rwkv_jax.fla) in fla 0.6.0's conventions, against float64
restatements of fla's naive recurrences (outputs, final states) and the float64 reference's
gradients through the convention mapping; their argument checks; the backend choice."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from conftest import tolerance
from rwkv_jax import fla
from test_compat import chosen_backends  # noqa: F401 (a fixture: records resolved backends)

BACKEND = "native"   # the layer maps conventions; every backend's math is tested elsewhere
B, T, H, K, V = 2, 9, 2, 4, 6   # V != K, so that a transposed state cannot pass
CU = np.array([0, 4, 4, 9])      # packed: three segments, the middle one empty


# ------------------------------------------------------------------------------------------
# fla's naive recurrences (fla/ops/generalized_delta_rule/dplr/naive.py dplr_recurrence,
# fla/ops/rwkv6/recurrent_naive.py, fla/ops/gla/naive.py, fla/ops/simple_gla/naive.py) restated
# in float64 on [B, T, H, *] arrays, with the scale, gates and order fla's kernels take.
# ------------------------------------------------------------------------------------------

def _fla_step(kind, x, t, h, scale):
    """One step of fla's recurrence ``kind`` at time t: (output [B, H, V], new state)."""
    q = scale * x["r" if kind != "gla" else "q"][:, t]
    kv = x["k"][:, t, :, :, None] * x["v"][:, t, :, None, :]
    if kind == "rwkv7":   # S = S * exp(gk) + k v^T + beta (alpha^T S), then o = q S
        alpha_s = np.einsum("bhk,bhkv->bhv", x["a"][:, t], h)
        beta_alpha_s = x["b"][:, t, :, :, None] * alpha_s[:, :, None]
        h = np.exp(x["w"][:, t])[..., None] * h + kv + beta_alpha_s
        return np.einsum("bhk,bhkv->bhv", q, h), h
    if kind == "rwkv6":   # o = q (S + u k v^T), then S = S * exp(w) + k v^T
        o = np.einsum("bhk,bhkv->bhv", q, h + x["u"][None, :, :, None] * kv)
        return o, np.exp(x["w"][:, t])[..., None] * h + kv
    log_decay = np.zeros(h.shape)   # GLA / simple GLA: S = S * exp(every gate) + k v^T, o = q S
    if x.get("gk") is not None:
        log_decay += x["gk"][:, t, :, :, None]
    if x.get("gv") is not None:
        log_decay += x["gv"][:, t, :, None, :]
    if x.get("g") is not None:
        log_decay += x["g"][:, t, :, None, None]
    if x.get("g_gamma") is not None:
        log_decay += x["g_gamma"][None, :, None, None]
    h = np.exp(log_decay) * h + kv
    return np.einsum("bhk,bhkv->bhv", q, h), h


def fla_naive(kind, x, scale, initial_state, cu_seqlens=None, reverse=False):
    """(o [B, T, H, V], final state [N, H, K, V]) of fla's naive recurrence; with cu_seqlens
    each segment runs alone from its own row of the initial state."""
    total = x["v"].shape[1]
    spans = [(0, total)] if cu_seqlens is None else list(zip(cu_seqlens[:-1], cu_seqlens[1:]))
    rows = x["v"].shape[0] if cu_seqlens is None else len(spans)
    h0 = (np.zeros((rows, H, K, V)) if initial_state is None else initial_state)
    o, final = np.zeros(x["v"].shape), np.zeros(h0.shape)
    for n, (start, end) in enumerate(spans):
        h = h0 if cu_seqlens is None else h0[n:n + 1]
        steps = range(start, end)
        for t in (reversed(steps) if reverse else steps):
            o_t, h = _fla_step(kind, x, t, h, scale)
            o[:, t] = o_t
        final[slice(None) if cu_seqlens is None else slice(n, n + 1)] = h
    return o, final


# ------------------------------------------------------------------------------------------
# The cases: fla function, its core op, how its arguments map, what its defaults are.
# ------------------------------------------------------------------------------------------

CASES = {
    # name: (function, reference op, gates (GLA), {fla name: core name}, fla options, scale)
    "chunk_rwkv7": (fla.chunk_rwkv7, "rwkv7", None, {}, {}, 1.0),
    "fused_recurrent_rwkv7": (fla.fused_recurrent_rwkv7, "rwkv7", None, {}, {}, K ** -0.5),
    "chunk_rwkv6": (fla.chunk_rwkv6, "rwkv6", None, {}, {}, K ** -0.5),
    "fused_recurrent_rwkv6": (fla.fused_recurrent_rwkv6, "rwkv6", None, {}, {}, K ** -0.5),
    "fused_recurrent_rwkv6_reverse": (fla.fused_recurrent_rwkv6, "rwkv6", None, {},
                                      dict(reverse=True), K ** -0.5),
    "chunk_gla": (fla.chunk_gla, "gated_linear_attention", ("gk",), {"g": "gk"}, {}, K ** -0.5),
    "chunk_gla_state_v_first": (fla.chunk_gla, "gated_linear_attention", ("gk",), {"g": "gk"},
                                dict(state_v_first=True), K ** -0.5),
    "fused_recurrent_gla": (fla.fused_recurrent_gla, "gated_linear_attention", ("gk", "gv"), {},
                            {}, K ** -0.5),
    "fused_recurrent_gla_reverse": (fla.fused_recurrent_gla, "gated_linear_attention",
                                    ("gk", "gv"), {}, dict(reverse=True), K ** -0.5),
    "chunk_simple_gla": (fla.chunk_simple_gla, "gated_linear_attention", ("g",), {}, {},
                         K ** -0.5),
    "chunk_simple_gla_g_gamma": (fla.chunk_simple_gla, "gated_linear_attention", ("g_gamma",),
                                 {}, {}, K ** -0.5),
}
KIND = {"rwkv7": "rwkv7", "rwkv6": "rwkv6", "gated_linear_attention": "gla"}


def case_inputs(op, gates, seed, packed):
    """Float64 inputs in the core names, rounded to float32 (so the reference sees exactly what
    the op gets): [B, T, ...] without state, or packed [1, T, ...] with an initial state."""
    rng = np.random.default_rng(seed)
    extra = {} if gates is None else dict(gates=gates)
    x = reference.random_inputs(op, rng, batch=1 if packed else B, steps=T, heads=H, key=K,
                                value=V, initial_state=packed, state_rows=len(CU) - 1, **extra)
    return {n: np.asarray(np.float32(a), np.float64) for n, a in x.items()}


def fla_arguments(x, renamed, state_v_first):
    """The core-named inputs as the fla function's float32 arguments."""
    core_to_fla = {core: name for name, core in renamed.items()}
    args = {core_to_fla.get(n, n): jnp.asarray(a, jnp.float32) for n, a in x.items()}
    if state_v_first and "initial_state" in args:
        args["initial_state"] = jnp.swapaxes(args["initial_state"], -1, -2)
    return args


def assert_close(x, ref, kind="forward"):
    error = reference.relative_error(x, ref)
    assert error <= tolerance(BACKEND, "float32", kind), f"relative error {error:.2e}"


def reference_gradients(op, x, d_o, d_h, scale, cu_seqlens, reverse):
    """The float64 reference's gradients; rwkv6 has no reverse there, and a recurrence run from
    the last step to the first is the forward one on time-flipped inputs (segments flipped in
    order with them)."""
    if not reverse or op != "rwkv6":
        return reference.gradients(op, x, d_o, d_h, scale=scale, cu_seqlens=cu_seqlens,
                                   reverse=reverse)
    flip = lambda a: a[:, ::-1]
    flipped = {n: (a[::-1] if n == "initial_state" and cu_seqlens is not None
                   else a if n in ("u", "initial_state") else flip(a)) for n, a in x.items()}
    mirrored = None if cu_seqlens is None else T - cu_seqlens[::-1]
    d_h = d_h if cu_seqlens is None else d_h[::-1]
    grads = reference.gradients(op, flipped, flip(d_o), d_h, scale=scale, cu_seqlens=mirrored)
    return {n: (g[::-1] if n == "initial_state" and cu_seqlens is not None
                else g if n in ("u", "initial_state") else flip(g)) for n, g in grads.items()}


@pytest.mark.parametrize("packed", [False, True], ids=["batch-no-state", "varlen-with-state"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fla_function_matches_fla_naive_semantics(case, packed):
    """Outputs and the final state equal fla's naive recurrence (fla's default scale, gates,
    order and state layout) with B rows and no initial state, or packed segments (one empty)
    each from its own initial state; gradients of every argument (jax.grad) equal the float64
    reference's through the mapping."""
    fn, op, gates, renamed, options, scale = CASES[case]
    x = case_inputs(op, gates, seed=len(case) + packed, packed=packed)
    state_v_first = options.get("state_v_first", False)
    reverse = options.get("reverse", False)
    cu_seqlens = CU if packed else None
    ref_o, ref_h = fla_naive(KIND[op], x, scale, x.get("initial_state"), cu_seqlens, reverse)
    rng = np.random.default_rng(99)
    d_o, d_h = rng.standard_normal(ref_o.shape), rng.standard_normal(ref_h.shape)
    if state_v_first:
        ref_h, d_h_fla = np.swapaxes(ref_h, -1, -2), np.swapaxes(d_h, -1, -2)
    else:
        d_h_fla = d_h

    def loss(args):
        o, h = fn(**args, **options, output_final_state=True, cu_seqlens=cu_seqlens,
                  backend=BACKEND)
        return jnp.sum(o * d_o) + jnp.sum(h * d_h_fla), (o, h)

    grads, (o, h) = jax.grad(loss, has_aux=True)(fla_arguments(x, renamed, state_v_first))
    assert o.shape == ref_o.shape and o.dtype == jnp.float32
    assert h.shape == ref_h.shape and h.dtype == jnp.float32
    assert_close(o, ref_o)
    assert_close(h, ref_h)
    expected = reference_gradients(op, x, d_o, d_h, scale, cu_seqlens, reverse)
    core_to_fla = {core: name for name, core in renamed.items()}
    expected = {core_to_fla.get(n, n): g for n, g in expected.items()}
    if state_v_first and "initial_state" in expected:
        expected["initial_state"] = np.swapaxes(expected["initial_state"], -1, -2)
    assert set(grads) == set(expected)
    for name, g in grads.items():
        assert_close(g, expected[name], "gradient")


# ------------------------------------------------------------------------------------------
# Defaults, fla-only arguments, head_first.
# ------------------------------------------------------------------------------------------

def inputs(op, gates=None, seed=0):
    return {n: jnp.asarray(a, jnp.float32)
            for n, a in case_inputs(op, gates, seed, packed=False).items()}


def test_final_state_defaults_follow_fla():
    """output_final_state defaults to False (final state None) except for
    fused_recurrent_rwkv7, whose fla default is True."""
    x7, x6 = inputs("rwkv7"), inputs("rwkv6")
    gla = inputs("gated_linear_attention", ("gk",))
    assert fla.chunk_rwkv7(**x7, backend=BACKEND)[1] is None
    assert fla.fused_recurrent_rwkv7(**x7, backend=BACKEND)[1].shape == (B, H, K, V)
    assert fla.chunk_rwkv6(**x6, backend=BACKEND)[1] is None
    assert fla.fused_recurrent_rwkv6(**x6, backend=BACKEND)[1] is None
    q, k, v, g = gla["q"], gla["k"], gla["v"], gla["gk"]
    assert fla.chunk_gla(q, k, v, g, backend=BACKEND)[1] is None
    assert fla.fused_recurrent_gla(q, k, v, g, backend=BACKEND)[1] is None
    assert fla.chunk_simple_gla(q, k, v, g[..., 0], backend=BACKEND)[1] is None


def test_fla_tuning_arguments_change_nothing_and_lower_bound_clamps_nothing():
    """fla's chunk_size, safe_gate, disable_recompute, lower_bound and cu_seqlens_cpu pick fla's
    kernels: the result is the same, bit for bit. lower_bound is fla's promise lower_bound <= w,
    not a clamp (fla 0.6.0 clamps nothing either): decays far below it are computed as given."""
    x = inputs("rwkv7", seed=3)
    x["w"] = x["w"].at[:, 2].set(-20.0)   # far below the bound
    plain = fla.chunk_rwkv7(**x, output_final_state=True, backend=BACKEND)
    tuned = fla.chunk_rwkv7(**x, output_final_state=True, chunk_size=64, safe_gate=True,
                            disable_recompute=True, lower_bound=-0.6065, backend=BACKEND)
    for a, b in zip(plain, tuned):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref_o, ref_h = fla_naive("rwkv7", {n: np.asarray(a, np.float64) for n, a in x.items()},
                             1.0, None)
    assert_close(tuned[0], ref_o)
    assert_close(tuned[1], ref_h)
    packed = inputs("rwkv6", seed=4)
    packed = {n: a[:1] for n, a in packed.items() if n != "u"} | {"u": packed["u"]}
    one = fla.chunk_rwkv6(**packed, cu_seqlens=CU, backend=BACKEND)
    two = fla.chunk_rwkv6(**packed, cu_seqlens=CU, cu_seqlens_cpu=CU.copy(), chunk_size=32,
                          backend=BACKEND)
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(two[0]))


def test_head_first_takes_and_returns_b_h_t():
    """head_first (removed in fla 0.6, kept here for older fla code): [B, H, T, *] inputs and
    outputs, the same numbers; the state layout is unchanged."""
    x = inputs("gated_linear_attention", ("g",), seed=5)
    flat_o, flat_h = fla.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"],
                                          output_final_state=True, backend=BACKEND)
    t = {n: jnp.swapaxes(a, 1, 2) for n, a in x.items()}
    o, h = fla.chunk_simple_gla(t["q"], t["k"], t["v"], t["g"], output_final_state=True,
                                head_first=True, backend=BACKEND)
    assert o.shape == (B, H, T, V)
    np.testing.assert_allclose(np.asarray(jnp.swapaxes(o, 1, 2)), np.asarray(flat_o), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(h), np.asarray(flat_h), rtol=1e-6, atol=1e-6)


def test_reverse_with_traced_offsets():
    """Under jit the mirrored offsets of reverse=True are computed on the device: the same
    results as eager, and offsets that do not reach T make every value NaN (the core op's
    device-side check), never a wrong finite result."""
    x = inputs("rwkv6", seed=9)
    x = {n: a[:1] if n != "u" else a for n, a in x.items()}
    h0 = jnp.asarray(np.random.default_rng(10).standard_normal((len(CU) - 1, H, K, V)),
                     jnp.float32)
    run = jax.jit(lambda cu: fla.fused_recurrent_rwkv6(**x, initial_state=h0, reverse=True,
                                                        output_final_state=True, cu_seqlens=cu,
                                                        backend=BACKEND))
    eager = fla.fused_recurrent_rwkv6(**x, initial_state=h0, reverse=True,
                                      output_final_state=True, cu_seqlens=CU, backend=BACKEND)
    for a, b in zip(run(jnp.asarray(CU, jnp.int32)), eager):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    o, h = run(jnp.asarray([0, 4, 4, 8], jnp.int32))
    assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(h)).all()


def test_transpose_state_layout_is_the_deprecated_state_v_first():
    x = inputs("gated_linear_attention", ("gk",), seed=6)
    h0 = jnp.asarray(np.random.default_rng(7).standard_normal((B, H, V, K)), jnp.float32)
    args = (x["q"], x["k"], x["v"], x["gk"])
    new = fla.fused_recurrent_gla(*args, initial_state=h0, output_final_state=True,
                                  state_v_first=True, backend=BACKEND)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        old = fla.fused_recurrent_gla(*args, initial_state=h0, output_final_state=True,
                                      transpose_state_layout=True, backend=BACKEND)
    assert old[1].shape == (B, H, V, K)
    for a, b in zip(new, old):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="not both"):
        fla.fused_recurrent_gla(*args, state_v_first=True, transpose_state_layout=True)


# ------------------------------------------------------------------------------------------
# Argument errors, before any kernel runs.
# ------------------------------------------------------------------------------------------

def test_argument_errors_name_the_argument():
    x7, x6 = inputs("rwkv7"), inputs("rwkv6")
    gla = inputs("gated_linear_attention", ("gk",))
    q, k, v, g = gla["q"], gla["k"], gla["v"], gla["gk"]
    head_major = dict(x7, r=jnp.swapaxes(x7["r"], 1, 2))   # [B, H, T, K] among [B, T, H, K]
    with pytest.raises(ValueError, match=r"w must be \[B, T, H, K\]"):
        fla.chunk_rwkv7(**dict(x7, w=x7["w"][..., :2]))
    with pytest.raises(ValueError, match="^r must be"):
        fla.fused_recurrent_rwkv7(**dict(head_major, r=x7["r"][:, :, :, :, None]))
    with pytest.raises(ValueError, match=r"w must be \[B, T, H, K\] with T=2 \(from r\)"):
        fla.chunk_rwkv7(**head_major)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\]"):
        fla.chunk_rwkv6(**x6, initial_state=jnp.zeros((B, H, V, K)))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, V, K\].*from v"):
        fla.chunk_gla(q, k, v, g, initial_state=jnp.zeros((B, H, K, V)), state_v_first=True)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] with N=3"):
        fla.fused_recurrent_rwkv6(**{n: a[:1] if n != "u" else a for n, a in x6.items()},
                                  reverse=True, cu_seqlens=CU,
                                  initial_state=jnp.zeros((2, H, K, V)))
    with pytest.raises(ValueError, match="batch size must be 1"):
        fla.chunk_simple_gla(q, k, v, g[..., 0], cu_seqlens=CU)
    with pytest.raises(ValueError, match=r"g must be 4-D \[B, T, H, K\]"):
        fla.chunk_gla(q, k, v, g[..., 0])   # simple GLA's per-head gate given to chunk_gla
    with pytest.raises(TypeError, match="g must be an array, got None"):
        fla.chunk_gla(q, k, v, None)
    with pytest.raises(TypeError, match="state_v_first must be a bool"):
        fla.chunk_simple_gla(q, k, v, state_v_first="yes")
    with pytest.raises(TypeError, match="reverse must be a bool"):
        fla.fused_recurrent_rwkv6(**x6, reverse=1)


def test_fla_only_argument_errors():
    x7, x6 = inputs("rwkv7"), inputs("rwkv6")
    gla = inputs("gated_linear_attention", ("g",))
    with pytest.raises(ValueError, match="lower_bound must be negative"):
        fla.chunk_rwkv7(**x7, lower_bound=0.0)
    with pytest.raises(ValueError, match="chunk_size must be None or a power of 2, got 48"):
        fla.chunk_rwkv7(**x7, chunk_size=48)
    with pytest.raises(ValueError, match="chunk_size must be None or a power of 2"):
        fla.chunk_simple_gla(gla["q"], gla["k"], gla["v"], gla["g"], chunk_size=0)
    with pytest.raises(TypeError, match="safe_gate must be a bool"):
        fla.chunk_rwkv7(**x7, safe_gate=None)
    with pytest.raises(ValueError, match="cp_context .* rwkv_jax.shard"):
        fla.chunk_rwkv7(**x7, cp_context=object())
    one = {n: a[:1] if n != "u" else a for n, a in x6.items()}
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be a copy of cu_seqlens"):
        fla.chunk_rwkv6(**one, cu_seqlens=CU, cu_seqlens_cpu=np.array([0, 4, 5, 9]))
    with pytest.raises(ValueError, match="cu_seqlens_cpu was given without cu_seqlens"):
        fla.chunk_rwkv6(**one, cu_seqlens_cpu=CU)
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_exp2'"):
        # fla's chunk_simple_gla would swallow it in its **kwargs
        fla.chunk_simple_gla(gla["q"], gla["k"], gla["v"], gla["g"], use_exp2=True)


# ------------------------------------------------------------------------------------------
# The backend: backend= passes through, else the environment's preference.
# ------------------------------------------------------------------------------------------

def test_backend_passes_through_and_the_environment_is_honoured(monkeypatch, chosen_backends):
    x = inputs("rwkv6", seed=8)
    fla.chunk_rwkv6(**x, backend="chunked")
    monkeypatch.setenv("RWKV_JAX_BACKEND", "native")
    fla.fused_recurrent_rwkv6(**x)
    fla.fused_recurrent_rwkv6(**x, backend="chunked")   # explicit beats the environment
    assert chosen_backends == ["chunked", "native", "chunked"]

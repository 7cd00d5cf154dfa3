"""The rwkv_ops compatibility names and the backend choice through the environment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rwkv_jax
import reference
from conftest import tolerance
from rwkv_jax import backends, ops

B, T, H, N = 2, 9, 2, 8
C = H * N


@pytest.fixture
def chosen_backends(monkeypatch):
    """Records the backend each public op resolves to (the first element of every call)."""
    seen = []

    def spy(op, backend, **options):
        name, fn = backends.resolve(op, backend, **options)
        seen.append(name)
        return name, fn

    monkeypatch.setattr(ops, "resolve", spy)
    monkeypatch.delenv("RWKV_JAX_BACKEND", raising=False)
    monkeypatch.delenv("KERNEL_TYPE", raising=False)
    return seen


def rwkv7_inputs(seed=0):
    x = reference.random_inputs("rwkv7", np.random.default_rng(seed), batch=B, steps=T, heads=H,
                                key=N)
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}


def assert_close(x, ref, backend, kind="forward"):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    error = np.linalg.norm(x - ref) / np.linalg.norm(ref)
    assert error <= tolerance(backend, "float32", kind), f"relative error {error:.2e}"


# ------------------------------------------------------------------------------------------
# generalized_delta_rule / rwkv7_op: raw w (decay exp(-exp(w))), shared state, mask.
# ------------------------------------------------------------------------------------------

def value_major(state):
    """A key-major state h[.., k, v] (the core ops', the reference's) as rwkv_ops' value-major
    S[.., v, k], and back."""
    return np.swapaxes(np.asarray(state, np.float64), -1, -2)


def raw_rwkv7_inputs(seed, batch=B, steps=T):
    """(float32 arguments in rwkv_ops' convention, the same values in the core convention as
    float64 for the reference): raw w = log(-log decay), the initial state value-major."""
    x = reference.random_inputs("rwkv7", np.random.default_rng(seed), batch=batch, steps=steps,
                                heads=H, key=N)
    x = {n: np.asarray(jnp.asarray(a, jnp.float32), np.float64) for n, a in x.items()}
    raw = dict(x, w=np.log(-x["w"]))
    core = dict(x, w=-np.exp(raw["w"]))  # the log decay the compatibility layer passes on
    raw["initial_state"] = value_major(x["initial_state"])
    return {n: jnp.asarray(a, jnp.float32) for n, a in raw.items()}, core


def test_rwkv7_op_is_generalized_delta_rule():
    assert rwkv_jax.rwkv7_op is rwkv_jax.generalized_delta_rule


def test_raw_w_padding_is_decay_one_exactly():
    """rwkv_ops pads with w += -1e9: log decay exactly 0 (decay 1), finite, zero gradient."""
    from rwkv_jax.compat import _log_decay
    w = jnp.asarray([-1e9, -1e30, -jnp.inf, 0.0], jnp.float32)
    assert np.array_equal(np.asarray(_log_decay(w)), [0.0, 0.0, 0.0, -1.0])
    assert np.array_equal(np.asarray(jax.grad(lambda w: _log_decay(w).sum())(w)),
                          [0.0, 0.0, 0.0, -1.0])


def assert_gradients(grads, ref, core, backend, shared_state=False):
    """Gradients in rwkv_ops' convention against the float64 reference's: d raw w =
    d log decay * log decay; the initial state's value-major; a shared [1, H, K, K] initial state
    sums its rows' gradients."""
    expected = dict(ref, w=ref["w"] * core["w"], initial_state=value_major(ref["initial_state"]))
    if shared_state:
        expected["initial_state"] = expected["initial_state"].sum(0, keepdims=True)
    for name, g in grads.items():
        assert_close(g, expected[name], backend, "gradient")


def _delta_rule_gradients(args, d_o, d_h, backend):
    """The gradients of generalized_delta_rule's arguments for the cotangents d_o, d_h (d_h
    value-major, as the final state it multiplies)."""
    def loss(args):
        o, h = rwkv_jax.generalized_delta_rule(**args, backend=backend)
        return jnp.sum(o * d_o) + jnp.sum(h * d_h)

    return jax.grad(loss)(args)


def test_generalized_delta_rule_matches_reference(backend):
    raw, core = raw_rwkv7_inputs(10)
    o, h = rwkv_jax.generalized_delta_rule(**raw, backend=backend)
    ref_o, ref_h = reference.forward("rwkv7", core)
    assert o.shape == (B, T, H, N) and h.shape == (B, H, N, N)
    assert_close(o, ref_o, backend)
    assert_close(h, value_major(ref_h), backend)
    rng = np.random.default_rng(11)
    d_o, d_h = rng.standard_normal(ref_o.shape), rng.standard_normal(ref_h.shape)
    grads = _delta_rule_gradients(raw, d_o, d_h, backend)
    assert_gradients(grads, reference.gradients("rwkv7", core, d_o, value_major(d_h)), core,
                     backend)


def test_generalized_delta_rule_head_first_and_no_final_state(backend):
    raw, core = raw_rwkv7_inputs(12)
    head_first = {n: (jnp.swapaxes(a, 1, 2) if n != "initial_state" else a)
                  for n, a in raw.items()}
    o = rwkv_jax.rwkv7_op(**head_first, head_first=True, output_final_state=False,
                          chunk_size=64, backend=backend)
    assert isinstance(o, jax.Array) and o.shape == (B, H, T, N)  # o alone, as rwkv_ops returns
    assert_close(jnp.swapaxes(o, 1, 2), reference.forward("rwkv7", core)[0], backend)


def test_generalized_delta_rule_shared_initial_state(backend):
    """An initial state [1, H, K, K] serves every sequence; its gradient sums theirs."""
    raw, core = raw_rwkv7_inputs(13)
    shared = raw["initial_state"][:1]
    core = dict(core, initial_state=np.repeat(value_major(shared), B, axis=0))
    o, h = rwkv_jax.generalized_delta_rule(**dict(raw, initial_state=shared), backend=backend)
    ref_o, ref_h = reference.forward("rwkv7", core)
    assert_close(o, ref_o, backend)
    assert_close(h, value_major(ref_h), backend)
    rng = np.random.default_rng(14)
    d_o, d_h = rng.standard_normal(ref_o.shape), rng.standard_normal(ref_h.shape)
    grads = _delta_rule_gradients(dict(raw, initial_state=shared), d_o, d_h, backend)
    assert grads["initial_state"].shape == (1, H, N, N)
    assert_gradients(grads, reference.gradients("rwkv7", core, d_o, value_major(d_h)), core,
                     backend, shared_state=True)


def rwkv_ops_recurrence(r, w, k, v, a, b, initial_state):
    """rwkv_ops 0.11.3's RWKV-7 recurrence as its reference implementation writes it, restated
    in float64 numpy: the state value-major, S[v, k] per head,
    S = S diag(exp(-exp(w))) + (S a) b^T + v k^T, o = S r. Returns (o, final S)."""
    r, w, k, v, a, b, S = (np.asarray(x, np.float64) for x in (r, w, k, v, a, b, initial_state))
    o = np.zeros(v.shape)
    for t in range(r.shape[1]):
        decay = np.exp(-np.exp(w[:, t]))                                   # [B, H, K]
        sa = np.einsum("bhvk,bhk->bhv", S, a[:, t])
        S = (S * decay[:, :, None, :] + sa[..., None] * b[:, t, :, None, :]
             + v[:, t, :, :, None] * k[:, t, :, None, :])
        o[:, t] = np.einsum("bhvk,bhk->bhv", S, r[:, t])
    return o, S


def test_generalized_delta_rule_state_is_value_major(backend):
    """The states in and out are rwkv_ops' value-major S[v, k] (every rwkv_ops kernel's and the
    official RWKV-7 layout): from an initial state far from symmetric, the outputs and the final
    state are those of rwkv_ops' own recurrence, and a final state handed back as the next
    call's initial state continues the sequence."""
    raw, _ = raw_rwkv7_inputs(20)
    assert np.linalg.norm(raw["initial_state"] - value_major(raw["initial_state"])) > 1.0
    o, h = rwkv_jax.generalized_delta_rule(**raw, backend=backend)
    ref_o, ref_h = rwkv_ops_recurrence(**raw)
    assert_close(o, ref_o, backend)
    assert_close(h, ref_h, backend)
    half = T // 2
    first = {n: (x if n == "initial_state" else x[:, :half]) for n, x in raw.items()}
    second = {n: x[:, half:] for n, x in raw.items() if n != "initial_state"}
    _, h_half = rwkv_jax.generalized_delta_rule(**first, backend=backend)
    o_rest, h_end = rwkv_jax.generalized_delta_rule(**second, initial_state=h_half,
                                                    backend=backend)
    assert_close(o_rest, ref_o[:, half:], backend)
    assert_close(h_end, ref_h, backend)


MASKS = {  # 1 advances the state, 0 freezes it: leading (left padding), inner and trailing zeros
    "left_padding": np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 1]]),
    "holes": np.array([[1, 0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 0, 1, 1, 1, 0, 1]]),
}


@pytest.mark.parametrize("layout", ["[B,T]", "[B,T,1,1]"])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_generalized_delta_rule_mask_skips_frozen_steps(backend, mask_name, layout):
    """A frozen step leaves the state unchanged: outputs at the other steps, the final state and
    every gradient equal running each sequence without its frozen steps (float64 reference);
    frozen steps get zero gradients and finite padding outputs, even where the padding holds
    rwkv_ops' w = -1e9 and large k."""
    mask = MASKS[mask_name]
    raw, core = raw_rwkv7_inputs(15)
    frozen = jnp.asarray(mask == 0)[:, :, None, None]
    raw = dict(raw, w=jnp.where(frozen, -1e9, raw["w"]), k=jnp.where(frozen, 1e3, raw["k"]))
    given = jnp.asarray(mask if layout == "[B,T]" else mask[:, :, None, None], jnp.float32)
    rng = np.random.default_rng(16)
    d_o, d_h = rng.standard_normal((B, T, H, N)) * mask[:, :, None, None], rng.standard_normal((B, H, N, N))

    def loss(args):
        o, h = rwkv_jax.generalized_delta_rule(**args, mask=given, backend=backend)
        return jnp.sum(o * d_o) + jnp.sum(h * d_h), (o, h)

    grads, (o, h) = jax.grad(loss, has_aux=True)(raw)
    assert np.isfinite(np.asarray(o)).all()
    for row in range(B):
        kept = np.flatnonzero(mask[row])
        sub = {n: (a[row:row + 1] if n == "initial_state" else a[row:row + 1, kept])
               for n, a in core.items()}
        ref_o, ref_h = reference.forward("rwkv7", sub)
        assert_close(o[row:row + 1, kept], ref_o, backend)
        assert_close(h[row:row + 1], value_major(ref_h), backend)
        ref = reference.gradients("rwkv7", sub, d_o[row:row + 1, kept],
                                  value_major(d_h[row:row + 1]))
        sub_grads = {n: (g[row:row + 1] if n == "initial_state" else g[row:row + 1, kept])
                     for n, g in grads.items()}
        assert_gradients(sub_grads, ref, sub, backend)
        for name, g in grads.items():
            if name != "initial_state":
                assert not np.any(np.asarray(g[row, mask[row] == 0])), name


def test_generalized_delta_rule_fully_frozen_row_keeps_its_state_exactly(backend):
    """A row whose mask is all 0 over several chunks returns its initial state bit for bit."""
    raw, _ = raw_rwkv7_inputs(31, steps=40)
    mask = np.ones((B, 40))
    mask[0] = 0
    o, h = rwkv_jax.generalized_delta_rule(**raw, mask=mask, backend=backend)
    np.testing.assert_array_equal(np.asarray(h[0]), np.asarray(raw["initial_state"][0]))
    assert np.isfinite(np.asarray(o)).all()


@pytest.mark.parametrize("kernel_type, backend, chunked", [
    ("native", "native", False), ("triton", "triton", True), ("cuda", "ffi", False)])
def test_get_generalized_delta_rule(kernel_type, backend, chunked, chosen_backends):
    """KERNEL_TYPE binds that backend, strictly (no fallback when it cannot run here); the
    pair is rwkv_ops 0.11.3's (training_op, inference_op), the inference op called as rwkv_ops
    users call it, positionally in its order (the CUDA one puts output_final_state before
    initial_state), with a value-major state in and out."""
    training_op, inference_op = rwkv_jax.get_generalized_delta_rule(N, KERNEL_TYPE=kernel_type)
    assert rwkv_jax.compat.uses_chunked_kernel(kernel_type) is chunked
    raw, core = raw_rwkv7_inputs(17)
    if backends.unavailable_reason(backend, backends.platform()) is not None:
        for op in (training_op, inference_op):
            with pytest.raises(backends.BackendUnavailableError, match=repr(backend)):
                op(**raw)
        return
    ref_o, ref_h = reference.forward("rwkv7", core)
    args = [raw[n] for n in ("r", "w", "k", "v", "a", "b")]
    state = raw["initial_state"]
    inference_args = (True, state) if kernel_type == "cuda" else (state, True)
    for o, h in (training_op(*args, state, True), inference_op(*args, *inference_args)):
        assert_close(o, ref_o, backend)
        assert_close(h, value_major(ref_h), backend)
    assert chosen_backends == [backend, backend]
    o = inference_op(**dict(raw, output_final_state=False))  # by keyword, o alone
    assert_close(o, ref_o, backend)


def test_get_generalized_delta_rule_follows_the_environment(monkeypatch, chosen_backends):
    monkeypatch.setenv("KERNEL_TYPE", "native")
    training_op, inference_op = rwkv_jax.get_generalized_delta_rule(N)
    inference_op(**raw_rwkv7_inputs(18)[0])
    assert chosen_backends == ["native"] and not rwkv_jax.compat.uses_chunked_kernel()
    monkeypatch.setenv("KERNEL_TYPE", "triton")
    assert rwkv_jax.compat.uses_chunked_kernel() is (
        backends.unavailable_reason("triton", backends.platform()) is None)


@pytest.mark.parametrize("spelling", ["head_size", "HEAD_SIZE", "positional"])
def test_get_generalized_delta_rule_takes_both_spellings(spelling, chosen_backends):
    """rwkv_ops 0.11.3 spells it get_generalized_delta_rule(HEAD_SIZE=64, KERNEL_TYPE=...,
    chunk_size=16); the README head_size=. Both build the same pair, whose ops check K
    against the head size."""
    sizes = {"head_size": dict(head_size=N), "HEAD_SIZE": dict(HEAD_SIZE=N)}.get(spelling, {})
    args = (N,) if spelling == "positional" else ()
    fn, inference_op = rwkv_jax.get_generalized_delta_rule(*args, **sizes, KERNEL_TYPE="native",
                                                           chunk_size=32)
    assert inference_op is fn  # as rwkv_ops' native path returns it
    raw, core = raw_rwkv7_inputs(21)
    o, h = fn(**raw)
    assert chosen_backends == ["native"]
    ref_o, ref_h = reference.forward("rwkv7", core)
    assert_close(o, ref_o, "native")
    assert_close(h, value_major(ref_h), "native")
    twice = {name: 2 * N for name in sizes}
    wrong, _ = rwkv_jax.get_generalized_delta_rule(*(2 * N for _ in args), **twice,
                                                   KERNEL_TYPE="native")
    with pytest.raises(ValueError, match=f"K={N}, .*head_size={2 * N}"):
        wrong(**raw)


@pytest.mark.parametrize("arguments, error, words", [
    (dict(head_size=N, HEAD_SIZE=N), TypeError, ["head_size", "HEAD_SIZE", "once"]),
    (dict(HEAD_SIZE=0), ValueError, ["HEAD_SIZE", "0"]),
    (dict(head_size=True), ValueError, ["head_size", "True"]),
    (dict(chunk_size=0), ValueError, ["chunk_size", "0"]),
], ids=["both_spellings", "HEAD_SIZE_zero", "head_size_bool", "chunk_size_zero"])
def test_get_generalized_delta_rule_rejects_bad_arguments(arguments, error, words):
    with pytest.raises(error) as info:
        rwkv_jax.get_generalized_delta_rule(**arguments)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


GDR_BAD = [  # (id, changes to the arguments, error, words the message must contain)
    ("kernel_type", None, ValueError, ["KERNEL_TYPE", "'vulkan'"]),
    ("head_size", dict(head_size=2 * N), ValueError, [f"K={N}", f"head_size={2 * N}"]),
    ("chunk_size_zero", dict(chunk_size=0), ValueError, ["chunk_size", "0"]),
    ("chunk_size_float", dict(chunk_size=16.0), ValueError, ["chunk_size", "16.0"]),
    ("mask_shape", dict(mask=np.ones((B, T + 1))), ValueError, ["mask", f"[{B}, {T}]", f"({B}, {T + 1})"]),
    ("mask_values", dict(mask=np.full((B, T), 0.5)), ValueError, ["mask", "0.5"]),
    ("mask_dtype", dict(mask=np.full((B, T), "x")), TypeError, ["mask", "dtype"]),
    ("state_rows", dict(initial_state=np.ones((3, H, N, N), np.float32)), ValueError,
     ["initial_state", "(3, 2, 8, 8)"]),
    ("head_first_flag", dict(head_first=1), TypeError, ["head_first", "bool"]),
    ("k_shape", dict(k=np.ones((1, T, H, N), np.float32)), ValueError, ["k", "(1, 9, 2, 8)"]),
]


@pytest.mark.parametrize("changes, error, words", [p[1:] for p in GDR_BAD],
                         ids=[p[0] for p in GDR_BAD])
def test_generalized_delta_rule_rejects_bad_input(changes, error, words):
    with pytest.raises(error) as info:
        if changes is None:
            rwkv_jax.get_generalized_delta_rule(N, KERNEL_TYPE="vulkan")
        else:
            rwkv_jax.generalized_delta_rule(**dict(raw_rwkv7_inputs(19)[0], **changes))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ------------------------------------------------------------------------------------------
# Choosing backends: explicit (strict), the environment's preference, per-op defaults.
# ------------------------------------------------------------------------------------------

def runs_here(name, op):
    return (backends.unavailable_reason(name, backends.platform()) is None
            and backends.implements(name, op))


def expected_default(op):
    return next(n for n in backends.default_order(op, backends.platform()) if runs_here(n, op))


def test_defaults_are_per_op_and_cite_measurements():
    for (op, where), (order, measurement) in backends.DEFAULTS.items():
        assert op in backends.OPS and where in ("cpu", "gpu", "tpu")
        assert order and set(order) <= set(backends.names()), (op, where, order)
        assert measurement, (op, where)  # the measurement behind the order, or "not timed"
    for op in backends.OPS:
        for where in ("cpu", "gpu"):
            assert (op, where) in backends.DEFAULTS
    for where in ("cpu", "gpu"):  # measured: chunked trains GLA faster than native on both
        order = backends.default_order("gated_linear_attention", where)
        assert order.index("chunked") < order.index("native")
    # Measured: on a CPU native runs rwkv4 faster than ffi.
    order = backends.default_order("rwkv4", "cpu")
    assert order.index("native") < order.index("ffi")


def test_each_op_gets_its_own_default(chosen_backends):
    for op in backends.OPS:
        assert backends.resolve(op, None)[0] == expected_default(op)


@pytest.mark.parametrize("variable, value, preferred", [
    ("RWKV_JAX_BACKEND", "triton", "triton"),
    ("RWKV_JAX_BACKEND", "chunked", "chunked"),
    ("RWKV_JAX_BACKEND", "native", "native"),
    ("KERNEL_TYPE", "cuda", "ffi"),
    ("KERNEL_TYPE", "triton", "triton"),
    ("KERNEL_TYPE", "native", "native"),
])
def test_environment_is_a_preference(monkeypatch, chosen_backends, variable, value, preferred):
    """The preferred backend for every op it implements and can run here, the default for the
    others; rwkv-jax info shows the same choice per op."""
    from rwkv_jax.cli.info import collect_info

    monkeypatch.setenv(variable, value)
    expected = {op: preferred if runs_here(preferred, op) else expected_default(op)
                for op in backends.OPS}
    assert {op: backends.resolve(op, None)[0] for op in backends.OPS} == expected
    assert collect_info()["defaults"] == expected


@pytest.mark.parametrize("variable, value, preferred, op", [
    ("RWKV_JAX_BACKEND", "triton", "triton", "rwkv6"),
    ("RWKV_JAX_BACKEND", "triton", "triton", "rwkv7_step"),
    ("RWKV_JAX_BACKEND", "triton", "triton", "rwkv4"),
    ("KERNEL_TYPE", "cuda", "ffi", "gated_linear_attention"),
])
def test_preference_does_not_break_other_ops(monkeypatch, chosen_backends, variable, value,
                                             preferred, op):
    """Ops the preferred backend lacks run (on their default) and match the reference."""
    from test_ops import Case, call_op, make_inputs

    monkeypatch.setenv(variable, value)
    x, x64, _ = make_inputs(Case(op, dict(batch=2, steps=3, heads=2, key=8)), 30)
    out, state = call_op(op, x, {}, None)
    name = chosen_backends[-1]
    assert name == (preferred if runs_here(preferred, op) else expected_default(op))
    ref_out, ref_state = reference.forward(op, x64)
    assert_close(out, ref_out, name)
    assert_close(state, ref_state, name)


def test_explicit_backend_stays_strict(monkeypatch):
    """backend= never falls back, whatever the environment prefers."""
    monkeypatch.setenv("RWKV_JAX_BACKEND", "native")
    missing = [(name, op) for name in backends.names() for op in backends.OPS
               if backends.unavailable_reason(name, backends.platform()) is None
               and not backends.implements(name, op)]
    assert missing
    for name, op in missing:
        with pytest.raises(backends.BackendUnavailableError, match=f"{name!r} does not implement {op}"):
            backends.resolve(op, name)
    with pytest.raises(ValueError, match="unknown backend 'vulkan'"):
        backends.resolve("rwkv7", "vulkan")


def test_explicit_backend_beats_the_environment(monkeypatch, chosen_backends):
    monkeypatch.setenv("RWKV_JAX_BACKEND", "no_such_backend")
    monkeypatch.setenv("KERNEL_TYPE", "no_such_kernel")
    rwkv_jax.rwkv7(**rwkv7_inputs(), backend="native")
    assert chosen_backends == ["native"]
    with pytest.raises(ValueError, match="no_such_backend.*RWKV_JAX_BACKEND"):
        rwkv_jax.rwkv7(**rwkv7_inputs())


def test_rwkv_jax_backend_beats_kernel_type(monkeypatch, chosen_backends):
    monkeypatch.setenv("RWKV_JAX_BACKEND", "native")
    monkeypatch.setenv("KERNEL_TYPE", "no_such_kernel")
    rwkv_jax.rwkv6(**rwkv6_official_inputs(0)[1])
    assert chosen_backends == ["native"]


# ------------------------------------------------------------------------------------------
# RWKV6_OP: [B, T, C] tensors, official w (decay = exp(-exp(w))), u [H, N] or [C].
# ------------------------------------------------------------------------------------------

def rwkv6_official_inputs(seed):
    """(official [B, T, C] arguments, the same in our [B, T, H, N] convention with log decay)."""
    rng = np.random.default_rng(seed)
    x = reference.random_inputs("rwkv6", rng, batch=B, steps=T, heads=H, key=N,
                                initial_state=False)
    x = {n: np.asarray(jnp.asarray(a, jnp.float32), np.float64) for n, a in x.items()}
    raw_w = np.log(-x["w"])  # so that -exp(raw_w) is our log decay
    official = {n: x[n].reshape(B, T, C) for n in "rkv"}
    official.update(w=raw_w.reshape(B, T, C), u=x["u"])
    ours = dict(x, w=-np.exp(raw_w))
    return official, {n: jnp.asarray(a, jnp.float32) for n, a in ours.items()}


@pytest.mark.parametrize("u_layout", ["[H,N]", "[C]"])
@pytest.mark.parametrize("with_state", [True, False])
def test_rwkv6_op_matches_reference(u_layout, with_state, chosen_backends):
    official, ours = rwkv6_official_inputs(1)
    official = {n: jnp.asarray(a, jnp.float32) for n, a in official.items()}
    if u_layout == "[C]":
        official["u"] = official["u"].reshape(C)
    op = rwkv_jax.RWKV6_OP(head_size=N, max_sequence_length=64)
    y, state = op(**official, with_state=with_state)
    backend = chosen_backends[-1]
    ref_o, ref_h = reference.forward("rwkv6", {n: np.asarray(a, np.float64) for n, a in ours.items()})
    assert y.shape == (B, T, C)
    assert_close(y, ref_o.reshape(B, T, C), backend)
    if with_state:
        assert state.shape == (B, H, N, N) and state.dtype == jnp.float32
        assert_close(state, ref_h, backend)
    else:
        assert state is None


@pytest.mark.parametrize("state_map", [[2, 0], None])
def test_rwkv6_op_init_state_and_state_map(state_map, chosen_backends):
    """init_state [n_state, H, N, N] with state_map picking each row's initial state; gradients
    reach the official w, u and the shared initial states (rows picked twice add up)."""
    official, ours = rwkv6_official_inputs(2)
    rng = np.random.default_rng(3)
    n_state = 3 if state_map is not None else B
    init_state = jnp.asarray(0.5 * rng.standard_normal((n_state, H, N, N)), jnp.float32)
    picked = np.asarray(state_map if state_map is not None else np.arange(B))
    op = rwkv_jax.RWKV6_OP(head_size=N)
    d_y = rng.standard_normal((B, T, C))
    d_state = rng.standard_normal((B, H, N, N))

    mapping = None if state_map is None else jnp.asarray(state_map, jnp.int32)

    def loss(args):
        y, state = op(**args, with_state=True, state_map=mapping)
        return jnp.sum(y * d_y) + jnp.sum(state * d_state)

    args = {n: jnp.asarray(a, jnp.float32) for n, a in official.items()}
    grads = jax.grad(loss)(dict(args, init_state=init_state))
    backend = chosen_backends[-1]

    ours64 = {n: np.asarray(a, np.float64) for n, a in ours.items()}
    ours64["initial_state"] = np.asarray(init_state, np.float64)[picked]
    ref = reference.gradients("rwkv6", ours64, d_y.reshape(B, T, H, N), d_state)
    # Chain rule through the official convention: log decay = -exp(raw w).
    ref_w = ref["w"] * ours64["w"]
    ref_init = np.zeros((n_state, H, N, N))
    np.add.at(ref_init, picked, ref["initial_state"])
    assert_close(grads["w"], ref_w.reshape(B, T, C), backend, "gradient")
    assert_close(grads["u"], ref["u"], backend, "gradient")
    assert_close(grads["r"], ref["r"].reshape(B, T, C), backend, "gradient")
    assert_close(grads["init_state"], ref_init, backend, "gradient")


def test_rwkv6_op_ops_loop_means_native(monkeypatch, chosen_backends):
    monkeypatch.setenv("KERNEL_TYPE", "cuda")  # ops_loop wins over the environment
    official, _ = rwkv6_official_inputs(4)
    rwkv_jax.RWKV6_OP(head_size=N, ops_loop=True)(**{n: jnp.asarray(a) for n, a in official.items()})
    assert chosen_backends == ["native"]


def test_rwkv6_op_reads_kernel_type(monkeypatch, chosen_backends):
    monkeypatch.setenv("KERNEL_TYPE", "native")
    official, _ = rwkv6_official_inputs(5)
    rwkv_jax.RWKV6_OP(head_size=N)(**{n: jnp.asarray(a) for n, a in official.items()})
    assert chosen_backends == ["native"]


def _rwkv6_with_states(seed):
    """Official arguments, init_state [3, H, N, N] (key-major, as rwkv_ops' RWKV-6 kernels
    keep it), state_map [2, 0], and the float64 reference of the rows they pick."""
    official, ours = rwkv6_official_inputs(seed)
    init_state = 0.5 * np.random.default_rng(seed).standard_normal((3, H, N, N))
    init_state = np.asarray(jnp.asarray(init_state, jnp.float32), np.float64)
    ours64 = {n: np.asarray(a, np.float64) for n, a in ours.items()}
    ours64["initial_state"] = init_state[[2, 0]]
    args = {n: jnp.asarray(a, jnp.float32) for n, a in official.items()}
    return args, jnp.asarray(init_state, jnp.float32), reference.forward("rwkv6", ours64)


@pytest.mark.parametrize("output_final_state", [True, False])
def test_rwkv6_op_direct_call(backend, output_final_state):
    """rwkv_ops 0.11.3's direct form, RWKV6_OP(r, k, v, w, u, initial_state=...,
    output_final_state=..., state_map=...): y alone, or (y, state) with output_final_state; the
    head size from u [H, N]; the same results as the class form."""
    args, init_state, (ref_y, ref_state) = _rwkv6_with_states(7)
    state_map = jnp.asarray([2, 0], jnp.int32)
    result = rwkv_jax.RWKV6_OP(*(args[n] for n in "rkvwu"), initial_state=init_state,
                               output_final_state=output_final_state, state_map=state_map,
                               backend=backend)
    if output_final_state:
        y, state = result
        assert state.shape == (B, H, N, N) and state.dtype == jnp.float32
        assert_close(state, ref_state, backend)
    else:
        y = result
        assert isinstance(y, jax.Array)
    assert y.shape == (B, T, C)
    assert_close(y, ref_y.reshape(B, T, C), backend)


def test_rwkv6_op_direct_call_options(chosen_backends):
    """The direct form with u [C] and head_size=, with head_first ([B, H, T, N] in and out), and
    with numpy arrays, equals the class form."""
    args, init_state, _ = _rwkv6_with_states(8)
    state_map = np.array([2, 0], np.int32)
    y_class, state_class = rwkv_jax.RWKV6_OP(head_size=N)(**args, with_state=True,
                                                           init_state=init_state,
                                                           state_map=state_map)
    flat_u = dict(args, u=args["u"].reshape(C))
    y, state = rwkv_jax.RWKV6_OP(**flat_u, head_size=N, initial_state=init_state,
                                 state_map=state_map, output_final_state=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_class))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(state_class))
    heads = lambda x: jnp.swapaxes(x.reshape(B, T, H, N), 1, 2)
    y_heads = rwkv_jax.RWKV6_OP(*(heads(args[n]) for n in "rkvw"), args["u"], head_first=True,
                                initial_state=init_state, state_map=state_map)
    np.testing.assert_array_equal(np.asarray(y_heads), np.asarray(heads(y_class)))
    y_numpy = rwkv_jax.RWKV6_OP(*(np.asarray(args[n]) for n in "rkvwu"),
                                initial_state=np.asarray(init_state), state_map=state_map)
    np.testing.assert_array_equal(np.asarray(y_numpy), np.asarray(y_class))


@pytest.mark.parametrize("first, words", [
    ("r", ["RWKV6_OP", "head size", "r, k, v, w, u", "str"]),
    (64.0, ["RWKV6_OP", "head size", "float", "64.0"]),
    (None, ["RWKV6_OP", "NoneType"]),
])
def test_rwkv6_op_form_is_unambiguous(first, words):
    """The first argument picks the form: arrays run the op, an int builds it; anything else is
    a TypeError saying what each form takes."""
    assert isinstance(rwkv_jax.RWKV6_OP(N), rwkv_jax.RWKV6_OP)
    assert isinstance(rwkv_jax.RWKV6_OP(head_size=N), rwkv_jax.RWKV6_OP)
    with pytest.raises(TypeError) as info:
        rwkv_jax.RWKV6_OP(first)
    for word in words:
        assert word in str(info.value), (word, str(info.value))

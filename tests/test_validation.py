"""Bad input raises ValueError/TypeError naming the argument and what it got, before any
kernel runs; a backend that cannot run says why."""

import jax.numpy as jnp
import numpy as np
import pytest

import rwkv_jax
from rwkv_jax import backends

B, T, H, K = 2, 5, 2, 4


def _normal(*shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed + len(shape)).standard_normal(shape), dtype)


def rwkv7_args(**changes):
    x = dict(r=_normal(B, T, H, K), w=-jnp.abs(_normal(B, T, H, K)), k=_normal(B, T, H, K),
             v=_normal(B, T, H, K), a=_normal(B, T, H, K), b=_normal(B, T, H, K))
    x.update(changes)
    return x


def rwkv6_args(**changes):
    x = dict(r=_normal(B, T, H, K), k=_normal(B, T, H, K), v=_normal(B, T, H, K),
             w=-jnp.abs(_normal(B, T, H, K)), u=_normal(H, K))
    x.update(changes)
    return x


def gla_args(**changes):
    x = dict(q=_normal(B, T, H, K), k=_normal(B, T, H, K), v=_normal(B, T, H, K))
    x.update(changes)
    return x


def rwkv4_args(**changes):
    x = dict(w=-jnp.abs(_normal(K)), u=_normal(K), k=_normal(B, T, K), v=_normal(B, T, K))
    x.update(changes)
    return x


def call_rwkv7(options=None, **changes):
    return rwkv_jax.rwkv7(**rwkv7_args(**changes), **(options or {}))


def call_rwkv6(options=None, **changes):
    return rwkv_jax.rwkv6(**rwkv6_args(**changes), **(options or {}))


def call_gla(options=None, **changes):
    return rwkv_jax.gated_linear_attention(**gla_args(**changes), **(options or {}))


def call_rwkv4(options=None, **changes):
    return rwkv_jax.rwkv4(**rwkv4_args(**changes), **(options or {}))


def call_rwkv7_step(state=None, options=None, **changes):
    pool = _normal(4, H, K, K) if state is None else state
    return rwkv_jax.rwkv7_step(**rwkv7_args(**changes), state=pool, **(options or {}))


def call_rwkv6_step(state=None, options=None, **changes):
    pool = _normal(4, H, K, K) if state is None else state
    return rwkv_jax.rwkv6_step(**rwkv6_args(**changes), state=pool, **(options or {}))


# (id, call, exception, words the message must contain: the argument and what it got)
BAD_INPUTS = [
    ("rank", lambda: call_rwkv7(r=_normal(B, T, H * K)), ValueError, ["r", "4-D", "(2, 5, 8)"]),
    ("mismatched_K", lambda: call_rwkv7(k=_normal(B, T, H, K + 1)), ValueError, ["k", "K=4", "5"]),
    ("mismatched_T", lambda: call_rwkv7(v=_normal(B, T + 1, H, K)), ValueError, ["v", "T=5", "6"]),
    ("mismatched_B", lambda: call_rwkv6(w=_normal(B + 1, T, H, K)), ValueError, ["w", "B=2"]),
    ("integer_dtype", lambda: call_rwkv7(a=jnp.ones((B, T, H, K), jnp.int32)), TypeError,
     ["a", "int32", "float"]),
    ("bool_dtype", lambda: call_gla(q=jnp.ones((B, T, H, K), bool)), TypeError, ["q", "bool"]),
    ("not_an_array", lambda: call_rwkv7(r="r"), TypeError, ["r", "str"]),
    ("missing_array", lambda: call_rwkv7(b=None), TypeError, ["b", "None"]),
    ("empty_sequence", lambda: call_rwkv7(**{n: jnp.zeros((B, 0, H, K)) for n in "rwkvab"}),
     ValueError, ["T=0"]),
    ("initial_state_shape", lambda: call_rwkv7(dict(initial_state=_normal(B, H, K, K + 1))),
     ValueError, ["initial_state", "V=4", "(2, 2, 4, 5)"]),
    ("initial_state_rank", lambda: call_rwkv6(dict(initial_state=_normal(H, K, K))),
     ValueError, ["initial_state", "4-D"]),
    ("initial_state_dtype", lambda: call_rwkv7(dict(initial_state=jnp.ones((B, H, K, K), int))),
     TypeError, ["initial_state", "int"]),
    ("initial_state_rows_with_cu_seqlens",
     lambda: call_rwkv7(dict(cu_seqlens=np.array([0, 2, 5], np.int32),
                             initial_state=_normal(3, H, K, K)),
                        **{n: _normal(1, T, H, K) for n in "rwkvab"}),
     ValueError, ["initial_state", "N=2", "cu_seqlens"]),
    ("cu_seqlens_batch", lambda: call_rwkv7(dict(cu_seqlens=jnp.array([0, 2, 5], jnp.int32))),
     ValueError, ["cu_seqlens", "B=2"]),
    ("cu_seqlens_float", lambda: call_gla(dict(cu_seqlens=jnp.array([0.0, 5.0])),
                                          **{n: _normal(1, T, H, K) for n in "qkv"}),
     TypeError, ["cu_seqlens", "float32", "int"]),
    ("cu_seqlens_rank", lambda: call_rwkv6(dict(cu_seqlens=jnp.array([[0, 5]], jnp.int32)),
                                           **{n: _normal(1, T, H, K) for n in "rkvw"}),
     ValueError, ["cu_seqlens", "1-D"]),
    ("cu_seqlens_host_values", lambda: call_rwkv7(dict(cu_seqlens=np.array([0, 3, 4], np.int32)),
                                                  **{n: _normal(1, T, H, K) for n in "rwkvab"}),
     ValueError, ["cu_seqlens", "T=5", "[0, 3, 4]"]),
    ("head_first_not_bool", lambda: call_rwkv7(dict(head_first=1)), TypeError,
     ["head_first", "bool", "int"]),
    ("output_final_state_not_bool", lambda: call_rwkv4(dict(output_final_state="yes")),
     TypeError, ["output_final_state", "bool"]),
    ("reverse_not_bool", lambda: call_gla(dict(reverse=None)), TypeError, ["reverse", "bool"]),
    ("scale_string", lambda: call_rwkv7(dict(scale="0.5")), TypeError, ["scale", "str"]),
    ("scale_nan", lambda: call_rwkv6(dict(scale=float("nan"))), ValueError, ["scale", "nan"]),
    ("scale_array", lambda: call_gla(dict(scale=jnp.ones(3))), TypeError, ["scale"]),
    ("rwkv6_u_shape", lambda: call_rwkv6(u=_normal(H * K)), ValueError, ["u", "2-D", "(8,)"]),
    ("gla_g_shape", lambda: call_gla(dict(g=_normal(B, T, H, K))), ValueError, ["g", "3-D"]),
    ("gla_g_gamma_shape", lambda: call_gla(dict(g_gamma=_normal(H + 1))), ValueError,
     ["g_gamma", "H=2", "(3,)"]),
    ("gla_gk_shape", lambda: call_gla(dict(gk=_normal(B, T, H, K + 2))), ValueError,
     ["gk", "K=4"]),
    ("gla_gv_dtype", lambda: call_gla(dict(gv=jnp.zeros((B, T, H, K), jnp.int8))), TypeError,
     ["gv", "int8"]),
    ("rwkv4_w_shape", lambda: call_rwkv4(w=_normal(K + 1)), ValueError, ["w", "C=4", "(5,)"]),
    ("rwkv4_kv_rank", lambda: call_rwkv4(k=_normal(B, T, H, K)), ValueError, ["k", "3-D"]),
    ("rwkv4_state_shape", lambda: call_rwkv4(dict(initial_state=_normal(B, K, 2))), ValueError,
     ["initial_state", "[B, C, 3]", "(2, 4, 2)", "axis 2 is 2"]),
    ("step_pool_not_float32", lambda: call_rwkv7_step(state=_normal(4, H, K, K, dtype=jnp.bfloat16)),
     TypeError, ["state", "float32", "bfloat16"]),
    ("step_pool_shape", lambda: call_rwkv6_step(state=_normal(4, H, K + 1, K)), ValueError,
     ["state", "K=4"]),
    ("step_pool_too_small", lambda: call_rwkv7_step(state=_normal(1, H, K, K)), ValueError,
     ["state", "S=1", "state_indices"]),
    ("step_indices_shape", lambda: call_rwkv7_step(options=dict(
        state_indices=jnp.array([0, 1, 2], jnp.int32))), ValueError, ["state_indices", "B=2"]),
    ("step_indices_float", lambda: call_rwkv6_step(options=dict(
        state_indices=jnp.array([0.0, 1.0]))), TypeError, ["state_indices", "float32"]),
    ("step_bad_scale", lambda: call_rwkv6_step(options=dict(scale=True)), TypeError,
     ["scale", "bool"]),
    ("unknown_backend", lambda: call_rwkv7(dict(backend="cudnn")), ValueError,
     ["backend", "'cudnn'", "native"]),
    ("backend_not_str", lambda: call_rwkv4(dict(backend=3)), TypeError, ["backend", "int"]),
]


@pytest.mark.parametrize("call, error, words", [p[1:] for p in BAD_INPUTS],
                         ids=[p[0] for p in BAD_INPUTS])
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


# RWKV6_OP: [B, T, C] tensors with head_size N = K.
def rwkv6_op_call(u=None, **options):
    x = {n: _normal(B, T, H * K) for n in "rkvw"}
    return rwkv_jax.RWKV6_OP(head_size=K)(**x, u=_normal(H, K) if u is None else u, **options)


RWKV6_OP_BAD = [
    ("u_shape", lambda: rwkv6_op_call(u=_normal(H, K + 1)), ValueError, ["u", "[H, N]", "(2, 5)"]),
    ("u_dtype", lambda: rwkv6_op_call(u=jnp.ones((H, K), jnp.int32)), TypeError, ["u", "int32"]),
    ("init_state_shape", lambda: rwkv6_op_call(init_state=_normal(B, H, K, K + 1)), ValueError,
     ["init_state", "(2, 2, 4, 5)"]),
    ("init_state_rows", lambda: rwkv6_op_call(init_state=_normal(3, H, K, K)), ValueError,
     ["init_state", "n_state=3", "state_map"]),
    ("state_map_shape", lambda: rwkv6_op_call(init_state=_normal(3, H, K, K),
                                              state_map=jnp.array([0, 1, 2], jnp.int32)),
     ValueError, ["state_map", "(3,)"]),
    ("state_map_dtype", lambda: rwkv6_op_call(init_state=_normal(3, H, K, K),
                                              state_map=jnp.array([0.0, 1.0])),
     TypeError, ["state_map", "float32"]),
    ("state_map_alone", lambda: rwkv6_op_call(state_map=jnp.array([0, 1], jnp.int32)),
     ValueError, ["state_map", "init_state"]),
    ("channels_not_multiple", lambda: rwkv_jax.RWKV6_OP(head_size=3)(
        *(_normal(B, T, H * K) for _ in "rkvw"), u=_normal(H * K)), ValueError,
     ["C=8", "head_size=3"]),
    ("head_size", lambda: rwkv_jax.RWKV6_OP(head_size=0), ValueError, ["head_size", "0"]),
]


@pytest.mark.parametrize("call, error, words", [p[1:] for p in RWKV6_OP_BAD],
                         ids=[p[0] for p in RWKV6_OP_BAD])
def test_rwkv6_op_bad_input_is_named(call, error, words):
    test_bad_input_is_named(call, error, words)


@pytest.fixture
def unavailable_backend(monkeypatch):
    """A registered backend whose probe says it cannot run here."""
    name = "test_unavailable"
    monkeypatch.setitem(backends._BACKENDS, name, backends.Backend(
        name, "rwkv_jax.backends.native", "a backend for this test",
        lambda platform: f"it needs hardware that {platform} lacks"))
    backends.unavailable_reason.cache_clear()
    yield name
    backends.unavailable_reason.cache_clear()


def test_backend_that_cannot_run_says_why(unavailable_backend):
    with pytest.raises(backends.BackendUnavailableError, match="cannot run here: it needs hardware"):
        call_rwkv7(dict(backend=unavailable_backend))


def test_environment_backend_that_cannot_run_leaves_the_default(unavailable_backend, monkeypatch):
    """The environment states a preference (DESIGN.md, "Backends"): where the preferred backend
    cannot run, each op keeps its default; rwkv-jax info shows the choice."""
    monkeypatch.setenv("RWKV_JAX_BACKEND", unavailable_backend)
    default = next(n for n in backends.default_order("rwkv6", backends.platform())
                   if backends.unavailable_reason(n, backends.platform()) is None)
    assert backends.resolve("rwkv6", None)[0] == default
    call_rwkv6()


def test_backend_without_the_op_says_so(monkeypatch):
    # A registered backend whose module defines none of the ops.
    monkeypatch.setitem(backends._BACKENDS, "test_empty", backends.Backend(
        "test_empty", "rwkv_jax._checks", "a backend for this test", lambda platform: None))
    with pytest.raises(backends.BackendUnavailableError,
                       match="'test_empty'.*does not implement rwkv4; backends that do here: native"):
        call_rwkv4(dict(backend="test_empty"))


def test_unavailable_backends_report_reasons():
    """Every registered backend is either available here or carries a reason (rwkv-jax info)."""
    rows = backends.describe()
    assert {row["name"] for row in rows} == set(backends.names())
    for row in rows:
        assert row["available"] or row["reason"], row


# (op, the empty axis): K = 0 or V = 0 is one ValueError on every backend, before any kernel.
EMPTY_AXES = [(op, axis) for op in ("rwkv7", "rwkv6", "gated_linear_attention", "rwkv7_step",
                                    "rwkv6_step") for axis in "KV"]


@pytest.mark.parametrize("op, axis", EMPTY_AXES, ids=[f"{op}-{axis}=0" for op, axis in EMPTY_AXES])
def test_empty_key_or_value_axis_is_a_value_error(backend, op, axis):
    from test_ops import Case, call_op, make_inputs

    sizes = dict(batch=1, steps=3, heads=1, key=4, value=4)
    sizes["key" if axis == "K" else "value"] = 0
    x, _, _ = make_inputs(Case(op, sizes), 0)
    first = "r" if op.startswith("rwkv") else "q"
    with pytest.raises(ValueError, match=rf"^{first if axis == 'K' else 'v'} must have a "
                                         rf".*size {axis} >= 1 .*got {axis}=0"):
        call_op(op, x, {}, backend)


@pytest.mark.parametrize("op", ["rwkv7_step", "rwkv6_step"])
def test_step_takes_a_numpy_pool(backend, op):
    """A pool given as a numpy array is advanced like the same pool as a jax array."""
    call = {"rwkv7_step": call_rwkv7_step, "rwkv6_step": call_rwkv6_step}[op]
    pool = np.asarray(_normal(4, H, K, K))
    o_np, pool_np = call(state=pool, options=dict(backend=backend))
    o, new_pool = call(state=jnp.asarray(pool), options=dict(backend=backend))
    np.testing.assert_array_equal(np.asarray(o_np), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(pool_np), np.asarray(new_pool))


TRAINING_SHAPE = dict(sequence_heads=512, key=64, value=64, dtype=jnp.bfloat16)


@pytest.mark.parametrize("change,faster", [
    ({}, True), (dict(key=128, value=128, sequence_heads=256), True),
    (dict(dtype=jnp.float16), True), (dict(dtype=jnp.float32), False),
    (dict(sequence_heads=255), False),
    (dict(key=32, value=32), False), (dict(value=32), False)])
def test_chunked_cuda_shape_class(change, faster):
    """rwkv7's GPU default per shape class (SHAPE_DEFAULTS): the chunked CUDA kernels where they
    were measured to train faster than triton, at many sequence-heads with 16-bit inputs."""
    assert backends.chunked_cuda_trains_faster({**TRAINING_SHAPE, **change}) is faster


def test_calls_report_their_shape_class(monkeypatch):
    """ops.py hands resolve the call's sequence-heads (segments when packed), head sizes and
    dtype; on the CPU the shape class changes no default."""
    seen = []

    def spy(op, backend, dtype=None, shape=None):
        seen.append(shape)
        return backends.resolve(op, backend, dtype=dtype, shape=shape)

    monkeypatch.setattr(rwkv_jax.ops, "resolve", spy)
    call_rwkv7()
    call_rwkv7(cu_seqlens=jnp.asarray([0, 2, 2, 5, 10]), r=_normal(1, 2 * T, H, K),
               w=-jnp.abs(_normal(1, 2 * T, H, K)), k=_normal(1, 2 * T, H, K),
               v=_normal(1, 2 * T, H, 3, seed=1), a=_normal(1, 2 * T, H, K),
               b=_normal(1, 2 * T, H, K))
    assert seen == [dict(sequence_heads=B * H, key=K, value=K, dtype=jnp.float32),
                    dict(sequence_heads=4 * H, key=K, value=3, dtype=jnp.float32)]
    default = backends.resolve("rwkv7", None)[0]
    assert backends.resolve("rwkv7", None, shape=TRAINING_SHAPE)[0] == default

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

    def spy(op, backend):
        name, fn = backends.resolve(op, backend)
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


def test_rwkv7_aliases_are_rwkv7():
    assert rwkv_jax.generalized_delta_rule is rwkv_jax.rwkv7
    assert rwkv_jax.rwkv7_op is rwkv_jax.rwkv7


@pytest.mark.parametrize("kernel_type, backend, chunked", [
    ("native", "native", False), ("triton", "triton", True), ("cuda", "ffi", False)])
def test_get_generalized_delta_rule(kernel_type, backend, chunked, chosen_backends):
    fn, uses_chunked_kernel = rwkv_jax.get_generalized_delta_rule(N, KERNEL_TYPE=kernel_type)
    assert uses_chunked_kernel is chunked
    if backends.unavailable_reason(backend, backends.platform()) is not None:
        with pytest.raises(backends.BackendUnavailableError, match=repr(backend)):
            fn(**rwkv7_inputs())
        return
    x = rwkv7_inputs()
    o, h = fn(**x)
    assert chosen_backends == [backend]
    ref_o, ref_h = reference.forward("rwkv7", {n: np.asarray(a) for n, a in x.items()})
    assert_close(o, ref_o, backend)
    assert_close(h, ref_h, backend)


def test_get_generalized_delta_rule_reads_kernel_type(monkeypatch, chosen_backends):
    monkeypatch.setenv("KERNEL_TYPE", "native")
    fn, uses_chunked_kernel = rwkv_jax.get_generalized_delta_rule(N)
    fn(**rwkv7_inputs())
    assert chosen_backends == ["native"] and not uses_chunked_kernel


def test_get_generalized_delta_rule_rejects_unknown_kernel_type():
    with pytest.raises(ValueError, match="KERNEL_TYPE.*'vulkan'"):
        rwkv_jax.get_generalized_delta_rule(N, KERNEL_TYPE="vulkan")


@pytest.mark.parametrize("variable, value, expected", [
    ("RWKV_JAX_BACKEND", "native", "native"),
    ("KERNEL_TYPE", "native", "native"),
    ("KERNEL_TYPE", "cuda", "ffi"),
])
def test_environment_picks_the_backend(monkeypatch, chosen_backends, variable, value, expected):
    monkeypatch.setenv(variable, value)
    if backends.unavailable_reason(expected, backends.platform()) is not None:
        with pytest.raises(backends.BackendUnavailableError, match=f"{variable}={value}"):
            rwkv_jax.rwkv7(**rwkv7_inputs())
        return
    rwkv_jax.rwkv7(**rwkv7_inputs())
    assert chosen_backends == [expected]


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

"""Composition with JAX's transformations and dtypes, on every backend and op: forward-mode AD
(supported by native and chunked, one clear error elsewhere), jax_enable_x64 (one dtype rule,
no warning) and mixed input dtypes (rejected, except for the state and the per-head
parameters)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from conftest import tolerance
from rwkv_jax import backends
from test_ops import Case, call_op, make_inputs

OPS = ("rwkv7", "rwkv6", "gated_linear_attention", "rwkv4", "rwkv7_step", "rwkv6_step")
# Arrays without a time axis: the state (pool) and per-head parameters.
NOT_SEQUENCE = ("initial_state", "state", "u", "g_gamma")


def small_case(op, **inputs):
    sizes = dict(batch=2, steps=2 if op.endswith("_step") else 5, heads=2, key=8)
    if op == "gated_linear_attention":
        sizes["gates"] = ("g", "g_gamma", "gk")
    return Case(op, dict(sizes, **inputs))


def sequence_names(op, x):
    if op == "rwkv4":
        return ["k", "v"]
    return [n for n in x if n not in NOT_SEQUENCE]


# ------------------------------------------------------------------------------------------
# Forward-mode AD.
# ------------------------------------------------------------------------------------------

def _tangents(x, seed):
    rng = np.random.default_rng(seed)
    return {n: jnp.asarray(rng.standard_normal(a.shape), a.dtype) for n, a in x.items()}


def _forward_transforms(op, x, t, backend):
    """Each forward-mode transform of the op on ``backend``, as a thunk."""
    run = lambda x: call_op(op, x, {}, backend)
    first = next(iter(x))
    scalar = lambda a: jnp.sum(run(dict(x, **{first: a}))[0] ** 2)
    return {
        "jvp": lambda: jax.jvp(run, (x,), (t,)),
        "jit(jvp)": lambda: jax.jit(lambda x, t: jax.jvp(run, (x,), (t,)))(x, t),
        "jit(jacfwd)": lambda: jax.jit(jax.jacfwd(scalar))(x[first]),
        "jit(hessian)": lambda: jax.jit(jax.hessian(scalar))(x[first]),  # eager: 4x slower
    }


@pytest.mark.parametrize("op", OPS)
def test_forward_mode_ad(backend, op):
    """Backends that support it (native, chunked): jax.jvp within the gradient tolerance of a
    float64 central difference of the reference, and jvp, jvp inside jit, jacfwd and hessian
    within it of native's. Every other backend: one TypeError naming the op, the backend and
    the backends that support it, for each of them."""
    x, x64, _ = make_inputs(small_case(op), 20)
    t = _tangents(x, 21)
    transforms = _forward_transforms(op, x, t, backend)
    if not backends.supports_forward_mode(backend):
        for name, transform in transforms.items():
            with pytest.raises(TypeError, match=rf"{op} on backend '{backend}' does not support "
                                                rf"forward-mode autodiff.*'native'"):
                transform()
        return
    limit = tolerance(backend, "float32", "gradient")
    (out, state), (d_out, d_state) = transforms["jvp"]()
    eps = 1e-6
    shifted = lambda sign: reference.forward(
        op, {n: a + sign * eps * np.asarray(t[n], np.float64) for n, a in x64.items()})
    (out_plus, state_plus), (out_minus, state_minus) = shifted(1), shifted(-1)
    assert reference.relative_error(d_out, (out_plus - out_minus) / (2 * eps)) <= limit
    assert reference.relative_error(d_state, (state_plus - state_minus) / (2 * eps)) <= limit
    if backend != "native":
        natives = _forward_transforms(op, x, t, "native")
        for name, transform in transforms.items():
            for got, want in zip(jax.tree.leaves(transform()), jax.tree.leaves(natives[name]())):
                error = reference.relative_error(got, np.asarray(want, np.float64))
                assert error <= limit, f"{name}: {error:.2e} from native"


def test_reverse_mode_is_not_mistaken_for_forward_mode(backend):
    """grad of grad and vmap of grad stay allowed on every backend (reverse mode only)."""
    x, _, _ = make_inputs(small_case("rwkv7"), 22)
    loss = lambda r: jnp.sum(call_op("rwkv7", dict(x, r=r), {}, backend)[0] ** 2)
    g = jax.jit(jax.grad(loss))(x["r"])
    assert np.isfinite(np.asarray(g)).all()
    batched = jax.vmap(jax.grad(loss))(jnp.stack([x["r"], 2 * x["r"]]))
    assert np.isfinite(np.asarray(batched)).all()


# ------------------------------------------------------------------------------------------
# jax_enable_x64: outputs in the inputs' dtype, the state float32 (float64 for float64 inputs),
# the step pool as given; no warning. float64 inputs are computed in float64 or refused.
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_x64_dtype_rule(backend, op):
    """float32 inputs under jax_enable_x64 stay float32, whatever the float64 arrays beside them
    (the initial state jnp.zeros would give): results float32, within the float32 contract."""
    with jax.enable_x64(True):
        x, x64, _ = make_inputs(small_case(op), 23)
        # float32 inputs get a float64 initial state (what jnp.zeros gives under x64), which
        # the state's float32 rule converts; the step pool stays float32.
        x = {n: a.astype(jnp.float64 if n == "initial_state" else jnp.float32)
             for n, a in x.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. FutureWarning: scatter inputs have incompatible types
            out, state = call_op(op, x, {}, backend)
        ref_out, ref_state = reference.forward(op, x64)
    assert out.dtype == jnp.float32 and state.dtype == jnp.float32, (out.dtype, state.dtype)
    limit = tolerance(backend, "float32", "forward")
    assert reference.relative_error(out, ref_out) <= limit
    assert reference.relative_error(state, ref_state) <= limit


def _float64_backends(op):
    platform = backends.platform()
    return [n for n in backends.names() if backends.computes_float64(n)
            and backends.unavailable_reason(n, platform) is None and backends.implements(n, op)]


def _assert_computed_in_float64(op, backend, seed):
    """float64 inputs (state and step pool too) on ``backend`` (None: the default): float64
    results, forward and gradients within the float64 contract (1e-9) of the reference, where
    a float32 computation would be ~1e-7 off."""
    with jax.enable_x64(True):
        _, x64, rng = make_inputs(small_case(op), seed)
        x = {n: jnp.asarray(a, jnp.float64) for n, a in x64.items()}
        ref_out, ref_state = reference.forward(op, x64)
        d_out, d_state = rng.standard_normal(ref_out.shape), rng.standard_normal(ref_state.shape)
        ref_grads = reference.gradients(op, x64, d_out, d_state)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (out, state), pullback = jax.vjp(lambda x: call_op(op, x, {}, backend), x)
            (grads,) = pullback((jnp.asarray(d_out), jnp.asarray(d_state)))
    assert out.dtype == jnp.float64 and state.dtype == jnp.float64, (out.dtype, state.dtype)
    limit = backends.FLOAT64_TOLERANCE
    errors = {"output": reference.relative_error(out, ref_out),
              "state": reference.relative_error(state, ref_state),
              **{f"d{n}": reference.relative_error(g, ref_grads[n]) for n, g in grads.items()}}
    assert all(e <= limit for e in errors.values()), {n: f"{e:.1e}" for n, e in errors.items()}
    assert all(g.dtype == jnp.float64 for g in grads.values())


@pytest.mark.parametrize("op", OPS)
def test_float64_is_computed_in_float64_or_refused(backend, op):
    """float64 inputs: a backend that computes in float64 holds 1e-9; any other (its kernels run
    float32 or 16-bit) refuses them up front with a TypeError naming the backends that do."""
    if backends.computes_float64(backend):
        _assert_computed_in_float64(op, backend, 26)
        return
    with jax.enable_x64(True):
        x, _, _ = make_inputs(small_case(op), 26)
        x = {n: a.astype(jnp.float64) for n, a in x.items()}
        with pytest.raises(TypeError, match=rf"{op} on backend '{backend}' got float64") as info:
            call_op(op, x, {}, backend)
    able = _float64_backends(op)
    assert able and all(repr(n) in str(info.value) for n in able), str(info.value)


@pytest.mark.parametrize("op", OPS)
def test_float64_default_is_a_float64_backend(op, monkeypatch):
    """With no backend named, float64 inputs run on a backend that computes in float64 (the
    default and the environment's preference skip the others)."""
    monkeypatch.setenv("RWKV_JAX_BACKEND", "ffi" if "ffi" in backends.names() else "native")
    assert backends.resolve(op, None, dtype=jnp.float64)[0] in _float64_backends(op)
    _assert_computed_in_float64(op, None, 27)


# ------------------------------------------------------------------------------------------
# Mixed dtypes: sequence inputs share one dtype; the state and per-head parameters may differ.
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_mixed_sequence_dtypes_are_rejected(backend, op):
    x, _, _ = make_inputs(small_case(op), 24)
    odd = sequence_names(op, x)[0]
    x = dict(x, **{odd: x[odd].astype(jnp.bfloat16)})
    with pytest.raises(TypeError, match=rf"must share one dtype, got .*{odd} bfloat16.*float32"):
        call_op(op, x, {}, backend)


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6", "gated_linear_attention", "rwkv4"])
def test_state_and_parameters_in_another_dtype(backend, op):
    """A bfloat16 initial state (and bfloat16 per-head parameters) with float32 inputs: used as
    float32, so the result equals passing the same values in float32; the state stays float32
    and the initial state's gradient comes back in bfloat16."""
    x, _, _ = make_inputs(small_case(op), 25)
    other = [n for n in x if n not in sequence_names(op, x)]  # the state and the parameters
    low = {n: (a.astype(jnp.bfloat16) if n in other else a) for n, a in x.items()}
    rounded = {n: a.astype(jnp.float32) for n, a in low.items()}
    out, state = call_op(op, low, {}, backend)
    ref_out, ref_state = call_op(op, rounded, {}, backend)
    assert state.dtype == jnp.float32 and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(ref_state))
    grad = jax.grad(lambda h0: jnp.sum(call_op(op, dict(low, initial_state=h0), {}, backend)[1]))(
        low["initial_state"])
    assert grad.dtype == jnp.bfloat16

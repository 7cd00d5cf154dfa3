"""The ffi backend's chunked rwkv7 kernels (16-token chunks, the WY form; ffi/rwkv7_chunk_math.h)
against the float64 reference: output, final state and every gradient (initial state included)
for every log decay in [-inf, 0] (tame chunks, exact chunks and both in one sequence), ragged
last chunks, T = 1, packed sequences with empty segments, K = V = 64 and 128, 16-bit inputs,
head_first layouts and rwkv_jax.shard.

Here they run on the CPU twin (ffi/cpu_rwkv7_chunk.cc), which the CPU does not take by default
(the fixture below selects it); where a GPU is the default device, on the CUDA kernels
(ffi/cuda_rwkv7_chunk.cu).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
import rwkv_jax
from rwkv_jax import backends
from rwkv_jax.backends import ffi
from test_ffi import (FORWARD_TOL, GRADIENT_TOL, assert_vmap_and_jit_match_a_loop, call, draw,
                      rel, value_and_grads)

pytestmark = pytest.mark.skipif(backends.unavailable_reason("ffi", backends.platform()) is not None,
                                reason="the ffi extension is not built")

# The CPU's default for K = V = 64, before the fixture below changes it.
CPU_DEFAULT = ffi.rwkv7_kernel(64, 64, jnp.float32, "cpu")


@pytest.fixture(autouse=True)
def chunked_everywhere(monkeypatch):
    """The chunked kernels on every platform (the CPU twin here)."""
    monkeypatch.setattr(ffi, "CHUNKED_PLATFORMS", ("cpu", "gpu"))


DECAYS = {
    "model": "model",                       # tame chunks
    "strong": "strong",                     # uniform in [-8, 0]: exact chunks
    "uniform_1000": ("uniform", -1e3),
    "tokens_1e9": ("tokens", -1e9),         # exact chunks beside tame ones
    "tokens_inf": ("tokens", -np.inf),
    "every_third_1e9": ("every_third", -1e9),
    "zero": "zero",
}


def check_against_reference(x, rng, tol=(FORWARD_TOL, GRADIENT_TOL), **options):
    out, state = call("rwkv7", x, "native", **options)
    cotangents = (jnp.asarray(rng.standard_normal(out.shape), out.dtype),
                  jnp.asarray(rng.standard_normal(state.shape), jnp.float32))
    f_out, f_state, f_grads = value_and_grads("rwkv7", x, cotangents, "ffi", **options)
    ref_options = {n: np.asarray(v) for n, v in options.items()}
    x64 = {n: np.asarray(a, np.float64) for n, a in x.items()}
    ref_out, ref_state = reference.forward("rwkv7", x64, **ref_options)
    ref_grads = reference.gradients("rwkv7", x64, np.asarray(cotangents[0], np.float64),
                                    np.asarray(cotangents[1], np.float64), **ref_options)
    errors = {"output": rel(f_out, ref_out), "final state": rel(f_state, ref_state)}
    errors.update({f"d{n}": rel(f_grads[n], ref_grads[n]) for n in x})
    limits = {n: tol[0] if n in ("output", "final state") else tol[1] for n in errors}
    failed = {n: e for n, e in errors.items() if not e <= limits[n]}
    assert not failed, f"errors past the contract: {failed}"
    assert f_out.dtype == x["v"].dtype and f_state.dtype == jnp.float32
    for name in x:
        assert f_grads[name].dtype == x[name].dtype, name


def kernel_of(key, value):
    x, _ = draw("rwkv7", seed=0, batch=1, steps=3, heads=1, key=key, value=value)
    jaxpr = str(jax.make_jaxpr(lambda arrays: call("rwkv7", arrays, "ffi"))(x))
    return "chunk" if "rwkv_jax_rwkv7_chunk_fwd" in jaxpr else "sequential"


def test_head_sizes_pick_the_kernel():
    assert kernel_of(64, 64) == "chunk" and kernel_of(128, 128) == "chunk"
    # The chunked kernels' tiles take K = V in (64, 128); other sizes keep the sequential ones
    # (on the GPU those need K in (64, 128) too, and V a multiple of 32).
    assert kernel_of(64, 128) == "sequential"
    if backends.platform() == "cpu":
        assert kernel_of(16, 16) == "sequential"
    assert ffi.rwkv7_kernel(32, 32, jnp.float32, "cpu") == "rwkv7"
    assert ffi.rwkv7_kernel(128, 128, jnp.bfloat16, "cpu") == "rwkv7_chunk"


def test_the_cpu_keeps_the_sequential_kernels_by_default():
    assert CPU_DEFAULT == "rwkv7"


@pytest.mark.parametrize("decay", list(DECAYS))
def test_every_decay_matches_the_reference(decay):
    # T = 37: two whole chunks and a ragged one of 5 tokens.
    x, rng = draw("rwkv7", seed=11, batch=2, steps=37, heads=1, key=64, decay=DECAYS[decay])
    check_against_reference(x, rng)


@pytest.mark.parametrize("decay", ["model", "tokens_inf"])
def test_head_size_128(decay):
    x, rng = draw("rwkv7", seed=12, batch=1, steps=21, heads=2, key=128, decay=DECAYS[decay])
    check_against_reference(x, rng)


@pytest.mark.parametrize("steps", [1, 16, 17])
def test_short_and_chunk_edge_lengths(steps):
    x, rng = draw("rwkv7", seed=13, batch=2, steps=steps, heads=1, key=64)
    check_against_reference(x, rng)


def test_without_initial_state():
    x, rng = draw("rwkv7", seed=14, batch=1, steps=20, heads=1, key=64, initial_state=False)
    check_against_reference(x, rng)


@pytest.mark.parametrize("decay", ["model", "tokens_1e9"])
def test_packed_sequences(decay):
    # Empty segments (first, middle and last), one token, and segments across chunk boundaries.
    cu_seqlens = jnp.asarray([0, 0, 9, 9, 40, 41, 70, 70], jnp.int32)
    x, rng = draw("rwkv7", seed=15, batch=1, steps=70, heads=2, key=64, state_rows=7,
                  decay=DECAYS[decay])
    check_against_reference(x, rng, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(dtype):
    x, rng = draw("rwkv7", seed=16, dtype=dtype, batch=1, steps=33, heads=2, key=64,
                  decay=DECAYS["tokens_inf"])
    check_against_reference(x, rng, tol=(1e-2, 1e-2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_checkpoint_dtype(dtype):
    """The chunked forward saves each chunk's start state in bfloat16 for 16-bit inputs (the
    operand the backward's products take) and in float32 for float32 inputs; the first slot is
    the initial state, rounded so. The kernels reject any other checkpoint dtype."""
    x, _ = draw("rwkv7", seed=21, dtype=dtype, batch=1, steps=20, heads=1, key=64)
    saved = jnp.bfloat16 if dtype != jnp.float32 else jnp.float32
    h0 = jnp.asarray(np.random.default_rng(21).standard_normal((1, 1, 64, 64)), jnp.float32)
    cu = jnp.array([0, 20], jnp.int32)
    inputs = tuple(x[n] for n in "rwkvab")
    _, _, ckpt = ffi._rwkv7_forward("rwkv7_chunk", 1.0, *inputs, h0, cu, save=True)
    assert ckpt.dtype == saved and ckpt.shape == (1 + 20 // ffi._chunk(), 1, 64, 64)
    np.testing.assert_array_equal(np.asarray(ckpt[0], np.float32),
                                  np.asarray(h0[0].astype(saved), np.float32))
    other = jnp.float32 if saved == jnp.bfloat16 else jnp.bfloat16
    wrong = jax.ffi.ffi_call("rwkv_jax_rwkv7_chunk_fwd", (
        jax.ShapeDtypeStruct(x["v"].shape, dtype), jax.ShapeDtypeStruct(h0.shape, jnp.float32),
        jax.ShapeDtypeStruct(ckpt.shape, other)))
    name = "bfloat16" if saved == jnp.bfloat16 else "float32"
    with pytest.raises(Exception, match=f"checkpoints must be {name}"):
        jax.block_until_ready(wrong(*inputs, h0, cu, scale=np.float32(1.0)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nan_is_causal(dtype):
    """A NaN in w, k, v, a or b at t = 21 (inside the second chunk) reaches the outputs of its
    sequence and head from t on and its final state (no floor eats it), never an output before
    t (those equal the run without it); the other sequence and head stay as they were."""
    x, _ = draw("rwkv7", seed=17, dtype=dtype, batch=2, steps=37, heads=2, key=64)
    run = jax.jit(lambda x: call("rwkv7", x, "ffi"))
    clean_out, clean_state = (np.asarray(a, np.float64) for a in run(x))
    t = 21
    for name in "wkvab":
        out, state = (np.asarray(a, np.float64)
                      for a in run(dict(x, **{name: x[name].at[0, t, 0, 3].set(jnp.nan)})))
        np.testing.assert_allclose(out[0, :t, 0], clean_out[0, :t, 0], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        assert np.isnan(out[0, t:, 0]).any(-1).all() and np.isnan(state[0, 0]).any(), name
        np.testing.assert_array_equal(out[1], clean_out[1], err_msg=name)
        np.testing.assert_array_equal(out[0, :, 1], clean_out[0, :, 1], err_msg=name)
        np.testing.assert_array_equal(state[1], clean_state[1], err_msg=name)


def test_step_backward_through_the_chunked_kernels():
    """rwkv7_step's gradient runs the training kernels: at K = V = 64 the chunked ones."""
    x, rng = draw("rwkv7_step", seed=18, batch=2, steps=3, heads=1, key=64, state_rows=4)
    indices = jnp.asarray([3, 0], jnp.int32)
    out, state = call("rwkv7_step", x, "native", state_indices=indices)
    cotangents = (jnp.asarray(rng.standard_normal(out.shape), out.dtype),
                  jnp.asarray(rng.standard_normal(state.shape), jnp.float32))
    _, _, native = value_and_grads("rwkv7_step", x, cotangents, "native", state_indices=indices)
    _, _, compiled = value_and_grads("rwkv7_step", x, cotangents, "ffi", state_indices=indices)
    for name in x:
        assert rel(compiled[name], native[name]) <= GRADIENT_TOL, name


def test_vmap_and_jit_match_a_loop():
    assert_vmap_and_jit_match_a_loop(draw("rwkv7", seed=19, batch=1, steps=19, heads=1, key=64)[0])


def _native_results_and_check():
    """Inputs, cotangents, and a check that results (output, final state, every gradient) match
    one device's native run on them."""
    x, rng = draw("rwkv7", seed=23, batch=2, steps=24, heads=2, key=64)
    cotangents = (jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32),
                  jnp.asarray(rng.standard_normal(x["initial_state"].shape), jnp.float32))
    out, state, grads = value_and_grads("rwkv7", x, cotangents, "native")

    def assert_matches(got_out, got_state, got_grads):
        assert rel(got_out, out) <= FORWARD_TOL and rel(got_state, state) <= FORWARD_TOL
        for name in x:
            assert rel(got_grads[name], grads[name]) <= GRADIENT_TOL, name

    return x, cotangents, assert_matches


def test_head_first():
    """head_first inputs run the chunked kernels and give the native results."""
    x, cotangents, assert_matches = _native_results_and_check()
    swap = lambda a: jnp.swapaxes(a, 1, 2)
    x_first = {n: a if n == "initial_state" else swap(a) for n, a in x.items()}
    jaxpr = jax.make_jaxpr(lambda x: call("rwkv7", x, "ffi", head_first=True))(x_first)
    assert "rwkv_jax_rwkv7_chunk_fwd" in str(jaxpr)
    f_out, f_state, f_grads = value_and_grads(
        "rwkv7", x_first, (swap(cotangents[0]), cotangents[1]), "ffi", head_first=True)
    assert_matches(swap(f_out), f_state,
                   {n: g if n == "initial_state" else swap(g) for n, g in f_grads.items()})


def test_sharded_over_every_axis():
    """rwkv_jax.shard over batch, heads and the sequence (a (2, 2, 2) mesh of the simulated
    devices) runs the chunked kernels and gives one device's native results."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (the CPU suite simulates them)")
    x, cotangents, assert_matches = _native_results_and_check()
    mesh = jax.make_mesh((2, 2, 2), ("data", "heads", "seq"))
    sharded = rwkv_jax.shard(functools.partial(rwkv_jax.rwkv7, backend="ffi"), mesh,
                             batch_axis="data", head_axis="heads", seq_axis="seq")
    run = lambda x: sharded(*(x[n] for n in "rwkvab"), initial_state=x["initial_state"])
    assert "rwkv_jax_rwkv7_chunk_fwd" in str(jax.make_jaxpr(run)(x))
    (s_out, s_state), pullback = jax.vjp(jax.jit(run), x)
    assert_matches(s_out, s_state, pullback(cotangents)[0])

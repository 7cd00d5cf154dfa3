"""The ffi backend (compiled kernels through the XLA FFI) against the native backend and the
float64 reference: forward, final state and every gradient, packed sequences, the inference steps
on a state pool updated in place, vmap, jit, shard_map, and the kernels' own shape checks.

Runs on the CPU twins here (and on the CUDA kernels where a GPU is the default device). The
shared suite (tests/test_ops.py) also covers the ffi backend once it is registered; these tests
add what is specific to it.
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

pytestmark = pytest.mark.skipif(backends.unavailable_reason("ffi", backends.platform()) is not None,
                                reason="the ffi extension is not built")

FORWARD_TOL, GRADIENT_TOL = 1e-5, 1e-4  # float32, DESIGN.md
ARGS = {"rwkv7": "rwkvab", "rwkv6": "rkvwu", "rwkv4": "wukv", "rwkv7_step": "rwkvab",
        "rwkv6_step": "rkvwu"}
KEY = 64 if jax.default_backend() == "gpu" else 16  # the CUDA kernels need K in (64, 128)


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), "non-finite output"
    scale = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (scale if scale > 0 else 1.0))  # absolute if ref == 0


def call(op, arrays, backend, **options):
    positional = [arrays[n] for n in ARGS[op]]
    if op.endswith("_step"):
        return getattr(rwkv_jax, op)(*positional, arrays["state"], backend=backend, **options)
    if "initial_state" in arrays:
        options["initial_state"] = arrays["initial_state"]
    return getattr(rwkv_jax, op)(*positional, backend=backend, **options)


def value_and_grads(op, arrays, cotangents, backend, **options):
    names = list(arrays)
    (out, state), pullback = jax.vjp(
        lambda *xs: call(op, dict(zip(names, xs)), backend, **options), *arrays.values())
    return out, state, dict(zip(names, pullback(cotangents)))


def draw(op, seed, dtype=jnp.float32, **spec):
    rng = np.random.default_rng(seed)
    x = reference.random_inputs(op, rng, **spec)
    states = ("initial_state", "state")
    x = {n: jnp.asarray(a, jnp.float32 if n in states else dtype) for n, a in x.items()}
    return x, rng


def compare_backends(op, arrays, rng, tol=(FORWARD_TOL, GRADIENT_TOL), **options):
    """ffi against native, and both against the float64 reference, for one set of inputs."""
    out, state = call(op, arrays, "native", **options)
    cotangents = (jnp.asarray(rng.standard_normal(out.shape), out.dtype),
                  jnp.asarray(rng.standard_normal(state.shape), jnp.float32))
    results = {b: value_and_grads(op, arrays, cotangents, b, **options) for b in ("native", "ffi")}
    ref_options = {n: np.asarray(v) for n, v in options.items()}
    x64 = {n: np.asarray(a, np.float64) for n, a in arrays.items()}
    ref_out, ref_state = reference.forward(op, x64, **ref_options)
    ref_grads = reference.gradients(op, x64, np.asarray(cotangents[0], np.float64),
                                    np.asarray(cotangents[1], np.float64), **ref_options)
    (n_out, n_state, n_grads), (f_out, f_state, f_grads) = results["native"], results["ffi"]
    assert f_out.dtype == arrays["v"].dtype and f_state.dtype == jnp.float32
    assert rel(f_out, n_out) <= tol[0] and rel(f_out, ref_out) <= tol[0]
    assert rel(f_state, n_state) <= tol[0] and rel(f_state, ref_state) <= tol[0]
    for name in arrays:
        assert f_grads[name].dtype == arrays[name].dtype, name
        assert rel(f_grads[name], n_grads[name]) <= tol[1], name
        assert rel(f_grads[name], ref_grads[name]) <= tol[1], name


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6"])
@pytest.mark.parametrize("decay", ["model", "strong", "zero"])
def test_sequence_matches_native_and_reference(op, decay):
    x, rng = draw(op, seed=1, batch=2, steps=37, heads=2, key=KEY, value=2 * KEY, decay=decay)
    compare_backends(op, x, rng)


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6"])
def test_final_state_cotangent_is_not_transposed(op):
    """A cotangent on the final state that is far from symmetric reaches dk, dw, db right."""
    x, rng = draw(op, seed=2, batch=1, steps=20, heads=1, key=KEY)
    out, _ = call(op, x, "native")
    d_state = jnp.triu(jnp.ones((1, 1, KEY, KEY))) * 3.0  # upper triangular: d_state != d_state^T
    cotangents = (jnp.zeros_like(out), d_state)
    _, _, native = value_and_grads(op, x, cotangents, "native")
    _, _, compiled = value_and_grads(op, x, cotangents, "ffi")
    for name in x:
        assert rel(compiled[name], native[name]) <= GRADIENT_TOL, name


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6"])
def test_packed_sequences(op):
    cu_seqlens = np.array([0, 9, 9, 40, 41, 64], np.int32)  # an empty and a one-token segment
    x, rng = draw(op, seed=3, batch=1, steps=64, heads=2, key=KEY, state_rows=5)
    compare_backends(op, x, rng, cu_seqlens=jnp.asarray(cu_seqlens))


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6", "rwkv4"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_inputs(op, dtype):
    x, rng = draw(op, seed=4, dtype=dtype, batch=2, steps=33, heads=2, key=KEY)
    compare_backends(op, x, rng, tol=(1e-2, 1e-2))


@pytest.mark.parametrize("initial_state", [True, False])
def test_rwkv4(initial_state):
    x, rng = draw("rwkv4", seed=5, batch=2, steps=45, heads=3, key=8, initial_state=initial_state)
    compare_backends("rwkv4", x, rng)


@pytest.mark.parametrize("op", ["rwkv7_step", "rwkv6_step"])
@pytest.mark.parametrize("steps", [1, 4])
def test_step_updates_chosen_rows_in_place(op, steps):
    indices = jnp.array([4, 0, 2], jnp.int32)  # a permuted subset of the 6 pool rows
    x, rng = draw(op, seed=6, batch=3, steps=steps, heads=2, key=KEY, state_rows=6)
    compare_backends(op, x, rng, state_indices=indices)

    names = ARGS[op]
    step = jax.jit(lambda pool, *a: call(op, dict(zip(names, a), state=pool), "ffi",
                                         state_indices=indices), donate_argnums=0)
    pool = jnp.array(x["state"])
    out, new_pool = step(pool, *(x[n] for n in names))
    assert pool.is_deleted()  # donated: the kernel wrote into it (input/output aliasing)
    ref_out, ref_pool = call(op, x, "native", state_indices=indices)
    assert rel(out, ref_out) <= FORWARD_TOL and rel(new_pool, ref_pool) <= FORWARD_TOL
    untouched = np.array([1, 3, 5])
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(x["state"])[untouched])


def test_vmap_and_jit_match_a_loop():
    assert_vmap_and_jit_match_a_loop(draw("rwkv7", seed=7, batch=2, steps=19, heads=2, key=KEY)[0])


def assert_vmap_and_jit_match_a_loop(x):
    """jit(vmap(value_and_grad)) of an rwkv7 loss on ffi over two stacked inputs equals each
    input's own value and gradients."""
    stacked = {n: jnp.stack([a, a[::-1] * 0.5]) for n, a in x.items()}  # an extra leading axis

    def run(arrays):
        out, state = call("rwkv7", arrays, "ffi")
        return jnp.sum(out ** 2) + jnp.sum(state * state[..., ::-1])

    mapped = jax.jit(jax.vmap(jax.value_and_grad(run)))(stacked)
    for i in range(2):
        value, grads = jax.value_and_grad(run)({n: a[i] for n, a in stacked.items()})
        assert rel(mapped[0][i], value) <= FORWARD_TOL
        for name in x:
            assert rel(mapped[1][name][i], grads[name]) <= GRADIENT_TOL, name


def test_shard_map_keeps_varying_axes():
    devices = jax.devices()[:2]
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    x, _ = draw("rwkv6", seed=8, batch=4, steps=16, heads=2, key=KEY)
    spec = jax.sharding.PartitionSpec("batch")

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
    def sharded(r, k, v, w, h0):
        return rwkv_jax.rwkv6(r, k, v, w, x["u"], initial_state=h0, backend="ffi")

    out, state = jax.jit(sharded)(*(x[n] for n in "rkvw"), x["initial_state"])
    ref_out, ref_state = call("rwkv6", x, "native")
    assert rel(out, ref_out) <= FORWARD_TOL and rel(state, ref_state) <= FORWARD_TOL


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6", "rwkv7_step", "rwkv6_step"])
def test_value_size_past_the_kernels_limit_is_a_value_error(op):
    """V > 1024 (CPU kernels: stack rows; CUDA: a thread per value column) is a ValueError naming
    V before any kernel runs, not a kernel error at run time."""
    value = ffi.MAX_VALUE_SIZE + 32
    x, _ = draw(op, seed=9, batch=1, steps=1, heads=1, key=KEY, value=value)
    with pytest.raises(ValueError, match=rf"{op}: .*value size V .*up to 1024, got V={value}"):
        call(op, x, "ffi")


def test_cuda_sequence_limit_is_checked_before_the_launch():
    """The CUDA kernels' grid holds at most 65,535 sequences: more is a ValueError, checked where
    the CUDA kernels run (the CPU kernels have no such limit)."""
    limit = ffi.CUDA_MAX_SEQUENCES
    ffi.check_shape("rwkv7", 64, 64, limit, platform="gpu")
    ffi.check_shape("rwkv7", 64, 64, limit + 1, platform="cpu")
    with pytest.raises(ValueError, match=rf"at most {limit} sequences .*got {limit + 1}"):
        ffi.check_shape("rwkv7", 64, 64, limit + 1, platform="gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rwkv7", "rwkv6"])
def test_cuda_sequence_limit_through_the_op(op):
    """65,536 packed segments (all but one empty) on the GPU: the ValueError, before any launch."""
    x, _ = draw(op, seed=10, batch=1, steps=1, heads=1, key=KEY, initial_state=False)
    cu_seqlens = np.zeros(ffi.CUDA_MAX_SEQUENCES + 2, np.int32)
    cu_seqlens[-1] = 1
    with pytest.raises(ValueError, match=rf"at most {ffi.CUDA_MAX_SEQUENCES} sequences"):
        call(op, x, "ffi", cu_seqlens=cu_seqlens)


def test_kernel_rejects_bad_shapes_with_an_error():
    """Called directly (past ops.py's validation), the kernel answers a mismatch with an error."""
    ffi._chunk()
    r = jnp.ones((1, 4, 1, 8), jnp.float32)
    v = jnp.ones((1, 4, 1, 8), jnp.float32)
    h0 = jnp.zeros((1, 1, 8, 8), jnp.float32)
    cu = jnp.array([0, 4], jnp.int32)
    wrong_o = jax.ShapeDtypeStruct((1, 5, 1, 8), jnp.float32)  # T=5, inputs have T=4
    call_kernel = jax.ffi.ffi_call(
        "rwkv_jax_rwkv7_fwd", (wrong_o, jax.ShapeDtypeStruct(h0.shape, jnp.float32),
                               jax.ShapeDtypeStruct((0, 1, 8, 8), jnp.float32)))
    with pytest.raises(Exception, match="rwkv7 forward: o has shape"):
        jax.block_until_ready(call_kernel(r, r, r, v, r, r, h0, cu, scale=np.float32(1.0)))


def test_reports_why_it_cannot_run():
    assert "CPU and CUDA kernels only" in ffi.unavailable("tpu")

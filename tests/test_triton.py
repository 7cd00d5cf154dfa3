"""Tests of the triton backend itself, on CPU through Triton's interpreter (tiny shapes: the
interpreter is slow). The shared suite (test_ops.py) covers the public options; these cover the
launch bridge, chunk and saved-state boundaries, several V blocks and the head-size limits."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from reference import relative_error
import rwkv_jax
from conftest import tolerance
# Imported before triton: on CPU it switches Triton to the interpreter before anything defines
# a kernel (the test kernel below included).
from rwkv_jax.backends import _triton_probe
from rwkv_jax.backends import triton as triton_backend
from rwkv_jax.backends.triton import launch as _launch
from rwkv_jax.backends.triton.rwkv7 import CONFIG_OVERRIDES
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _scale_and_shift_kernel(x_ptr, y_ptr, doubled_ptr, shifted_ptr, SIZE: tl.constexpr,
                            SHIFT: tl.constexpr):
    """doubled = 2 * x (in x's dtype), shifted = y + SHIFT: inputs first, then outputs."""
    block = tl.program_id(0) * SIZE + tl.arange(0, SIZE)
    doubled = tl.load(x_ptr + block).to(tl.float32) * 2
    tl.store(doubled_ptr + block, doubled.to(doubled_ptr.dtype.element_ty))
    tl.store(shifted_ptr + block, tl.load(y_ptr + block) + SHIFT)


# (shape, block): one callback operand, or several pieces of at most 64 KiB (launch.py).
@pytest.mark.parametrize("shape, block", [((32,), 16), ((5, 8192), 4096)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_launch_keeps_argument_order_and_dtypes(dtype, shape, block):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    y = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    out_shapes = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
    grid = (x.size // block,)
    run = jax.jit(lambda x, y: _launch.launch(_scale_and_shift_kernel, (x, y), out_shapes, grid,
                                              SIZE=block, SHIFT=3.0))
    doubled, shifted = run(x, y)
    assert doubled.dtype == x.dtype and shifted.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(x * 2))
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(y) + 3.0, rtol=1e-6)


# Eight devices each launch a kernel on 160 KiB operands, then all-gather: in a child process
# with a time limit, since every callback used to wait forever for its operands' copy (launch.py,
# _callback_pieces) and a hang must fail the test instead of stopping the suite.
LAUNCH_BEFORE_ALL_GATHER = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P
from rwkv_jax.backends.triton import launch as _launch
import triton
import triton.language as tl

@triton.jit
def double(x_ptr, out_ptr, SIZE: tl.constexpr):
    block = tl.program_id(0) * SIZE + tl.arange(0, SIZE)
    tl.store(out_ptr + block, tl.load(x_ptr + block) * 2)

def per_device(x):
    (y,) = _launch.launch(double, (x[0],), (jax.ShapeDtypeStruct(x.shape[1:], x.dtype),),
                          (x.shape[1] // 4096,), SIZE=4096)
    return jax.lax.all_gather(y.sum(), "d")[None]

mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
x = jnp.arange(8 * 40960, dtype=jnp.float32).reshape(8, 40960) / 1e6
sums = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                             check_vma=False))(x)
np.testing.assert_allclose(np.asarray(sums)[0], 2 * np.asarray(x).sum(axis=1), rtol=1e-5)
print("ok")
"""


def test_launch_inside_shard_map_before_a_collective(tmp_path):
    script = tmp_path / "launch_before_all_gather.py"  # Triton reads a kernel's source file
    script.write_text(LAUNCH_BEFORE_ALL_GATHER)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-4000:]


def test_launch_under_vmap_runs_each_element():
    rng = np.random.default_rng(1)
    xs = jnp.asarray(rng.standard_normal((3, 16)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal(16), jnp.float32)  # not batched
    out_shapes = (jax.ShapeDtypeStruct((16,), jnp.bfloat16),
                  jax.ShapeDtypeStruct((16,), jnp.float32))
    one = lambda x: _launch.launch(_scale_and_shift_kernel, (x, y), out_shapes, (1,), SIZE=16,
                                   SHIFT=-1.0)
    doubled, shifted = jax.vmap(one)(xs)
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(xs * 2))
    np.testing.assert_allclose(np.asarray(shifted), np.broadcast_to(np.asarray(y) - 1.0, (3, 16)),
                               rtol=1e-6)


def test_register_cap_reaches_the_compiler():
    # On the GPU a capped launch's backends parse its options with Triton's maxnreg (jax-triton
    # passes none); the interpreter has no registers and runs the kernel as it is.
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    make = lambda device, capability: CUDABackend(GPUTarget("cuda", capability, 32))
    capped = _launch.capped_backend(make, 168)(0, 90).parse_options({"num_warps": 4})
    assert (capped.maxnreg, capped.num_warps) == (168, 4)
    assert make(0, 90).parse_options({"num_warps": 4}).maxnreg is None
    x = jnp.arange(16, dtype=jnp.float32)
    out_shapes = (jax.ShapeDtypeStruct((16,), jnp.float32),) * 2
    doubled, _ = _launch.launch(_scale_and_shift_kernel, (x, x), out_shapes, (1,),
                                max_registers=64, SIZE=16, SHIFT=0.0)
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(x * 2))


@dataclasses.dataclass(frozen=True)
class Case:
    steps: int = 20
    batch: int = 1
    heads: int = 1
    key: int = 16
    value: int = 16
    decay: str = "model"
    dtype: str = "float32"
    cu_seqlens: tuple = ()
    config: dict = dataclasses.field(default_factory=dict)  # KernelConfig fields to override
    hard: str = ""  # log decays past the reference's kinds (HARD_DECAYS)


# Log decays the chunked kernels must survive exactly (rows: [B, T, H, K]).
HARD_DECAYS = {
    "uniform down to -1e3": lambda rng, w: rng.uniform(-1e3, 0.0, w.shape),
    "-1e9 and -inf tokens": lambda rng, w: np.where(
        np.isin(np.arange(w.shape[1]), [5, 21])[None, :, None, None],
        np.where(np.arange(w.shape[1]) == 5, -1e9, -np.inf)[None, :, None, None], w),
    "every third -1e9": lambda rng, w: np.where(
        (np.arange(w.shape[1]) % 3 == 0)[None, :, None, None], -1e9, w),
}


def check(case, seed, differentiate=True):
    """Forward, final state and every gradient against the float64 reference (not
    ``differentiate``: the forward and final state of a call that is not differentiated)."""
    rng = np.random.default_rng(seed)
    packed = bool(case.cu_seqlens)
    drawn = reference.random_inputs(
        "rwkv7", rng, batch=case.batch, steps=case.steps, heads=case.heads, key=case.key,
        value=case.value, decay=case.decay,
        state_rows=len(case.cu_seqlens) - 1 if packed else None)
    if case.hard:
        drawn["w"] = HARD_DECAYS[case.hard](rng, drawn["w"])
    x = {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else case.dtype)
         for n, a in drawn.items()}
    x64 = {n: np.asarray(a, np.float64) for n, a in x.items()}
    options = dict(cu_seqlens=np.asarray(case.cu_seqlens)) if packed else {}
    ref_out, ref_state = reference.forward("rwkv7", x64, **options)
    d_out = jnp.asarray(rng.standard_normal(ref_out.shape), case.dtype)
    d_state = jnp.asarray(rng.standard_normal(ref_state.shape), jnp.float32)
    ref_grads = reference.gradients("rwkv7", x64, np.asarray(d_out, np.float64),
                                    np.asarray(d_state, np.float64), **options)

    default = triton_backend.default_config(case.key, case.value)
    key = (case.key, case.value)
    CONFIG_OVERRIDES[key] = dataclasses.replace(default, **case.config)
    try:
        @jax.jit
        def run(x, cu_seqlens):
            def op(x):
                return rwkv_jax.rwkv7(*(x[n] for n in "rwkvab"),
                                      initial_state=x["initial_state"], cu_seqlens=cu_seqlens,
                                      backend="triton")
            if not differentiate:
                return (*op(x), {})
            (out, state), pullback = jax.vjp(op, x)
            return out, state, pullback((d_out, d_state))[0]

        cu = jnp.asarray(case.cu_seqlens, jnp.int32) if packed else None
        out, state, grads = run(x, cu)
    finally:
        del CONFIG_OVERRIDES[key]

    forward_tol = tolerance("triton", case.dtype, "forward")
    gradient_tol = tolerance("triton", case.dtype, "gradient")
    assert out.dtype == x["v"].dtype
    errors = {"out": relative_error(out, ref_out), "state": relative_error(state, ref_state)}
    assert errors["out"] <= forward_tol and errors["state"] <= forward_tol, errors
    for name, grad in grads.items():
        assert grad.dtype == x[name].dtype, name
        assert np.all(np.isfinite(np.asarray(grad, np.float64))), f"non-finite d{name}"
        errors[name] = relative_error(grad, ref_grads[name])
        assert errors[name] <= gradient_tol, (name, errors)
    return errors


@pytest.mark.parametrize("steps", [1, 15, 16, 17, 32, 33, 70])
def test_chunk_boundaries(steps):
    check(Case(steps=steps), seed=steps)


@pytest.mark.parametrize("seed", [1, 3])
def test_several_chunks_and_heads(seed):
    check(Case(steps=75, heads=2), seed=seed)


@pytest.mark.parametrize("decay", ["strong", "zero"])
def test_decay_extremes_across_chunks(decay):
    check(Case(steps=40, decay=decay), seed=len(decay))


@pytest.mark.parametrize("hard", sorted(HARD_DECAYS))
def test_every_decay(hard):
    """Exact and finite for log decays far below the model's range (the exact path)."""
    check(Case(steps=40, hard=hard), seed=len(hard))


@pytest.mark.parametrize("decay, hard, tame", [("model", "", True), ("strong", "", False),
                                               ("model", "every third -1e9", False)])
def test_path_per_call(decay, hard, tame):
    """Model-range log decays take the tame path, strong ones the exact one; both match the
    float64 reference (the tame path also when forced onto the exact one)."""
    rng = np.random.default_rng(3)
    w = reference.random_inputs("rwkv7", rng, batch=1, steps=40, heads=1, key=16, value=16,
                                decay=decay)["w"]
    if hard:
        w = HARD_DECAYS[hard](rng, w)
    assert bool(jax.jit(triton_backend.tame_path)(jnp.asarray(w, jnp.float32))) is tame
    case = Case(steps=40, decay=decay, hard=hard)
    check(case, seed=3)
    if tame:
        check(dataclasses.replace(case, config=dict(tame=False)), seed=3)


def test_packed_sequences_with_initial_states_bfloat16():
    # Segments of 0, 17, 40 and 3 tokens: empty, partial chunk, short.
    check(Case(steps=60, cu_seqlens=(0, 0, 17, 57, 60), dtype="bfloat16"), seed=7)


@pytest.mark.parametrize("decay, hard", [("model", ""), ("model", "every third -1e9")])
def test_bfloat16_buffers(decay, hard):
    """KernelConfig.bf16_residuals and bf16_state_gradients: W, H per chunk,
    the decayed rows and dH' in bfloat16 (16-bit inputs), read by every gradient kernel: tame
    and exact, packed with an empty segment, several V blocks."""
    check(Case(steps=60, heads=2, key=32, value=32, decay=decay, hard=hard, dtype="bfloat16",
               cu_seqlens=(0, 0, 17, 57, 60),
               config=dict(block_v=16, bf16_residuals=True,
                           bf16_state_gradients=True)), seed=13)


@pytest.mark.parametrize("hard", ["", "every third -1e9"])
def test_bfloat16_packed_v_blocks(hard):
    """bfloat16 inputs, model decays (and the same with every third token at -1e9), packed with
    an empty segment and several V blocks: not differentiated (the 16-token forward, and the
    64-token forward without residuals) and differentiated."""
    case = Case(steps=60, heads=2, key=32, value=32, decay="model", hard=hard, dtype="bfloat16",
                cu_seqlens=(0, 0, 17, 57, 60), config=dict(block_v=16))
    check(case, seed=29, differentiate=False)
    check(dataclasses.replace(case, config=dict(block_v=16, inference64=True)), seed=29,
          differentiate=False)
    check(case, seed=29)


@pytest.mark.parametrize("key, value, block_v", [
    (32, 32, 16), (128, 64, 64), (16, 48, 32), (16, 48, 16)])
def test_head_sizes_and_v_blocks(key, value, block_v):
    """Several V blocks per head (of the state passes, outputs and V-side gradients; the K
    side sums over all of V inside each program), padded sizes, K = 128 (H in two halves)."""
    check(Case(steps=20, heads=2, key=key, value=value, config=dict(block_v=block_v)),
          seed=key + value)


@pytest.mark.parametrize("decay, hard", [
    ("model", ""), ("strong", ""), ("model", "-1e9 and -inf tokens")])
def test_key_blocks_of_the_gradient_kernels(decay, hard):
    """The K-side gradient kernel in blocks of 16 keys, with several V blocks, on both paths
    (model-range decays: tame; the others exact), packed with an empty segment."""
    check(Case(steps=40, heads=2, key=32, value=32, decay=decay, hard=hard,
               cu_seqlens=(0, 23, 23, 40),
               config=dict(block_v=16, k_side_block_k=16)), seed=11)


def test_few_sequences_take_narrow_v_blocks():
    """Fewer sequence-heads than multiprocessors: the sequential passes on V blocks of 32 (two
    per head here), packed with an empty segment."""
    assert triton_backend.default_config(64, 64, 32).recurrence_block_v == 32
    assert triton_backend.default_config(64, 64, 512).recurrence_block_v is None
    # (and a call not differentiated takes the 64-token forward: 4x fewer serial steps)
    assert triton_backend.default_config(64, 64, 32).inference64
    assert not triton_backend.default_config(128, 128, 512).inference64
    check(Case(steps=40, key=64, value=64, cu_seqlens=(0, 0, 23, 40),
               config=dict(recurrence_block_v=32)), seed=13)


@pytest.mark.parametrize("hard", ["", "-1e9 and -inf tokens"])
def test_inference64(hard):
    """A call not differentiated at 64-token chunks through the 64-token forward
    (KernelConfig.inference64): forward and final state, packed with an empty segment,
    on the tame and exact paths."""
    check(Case(steps=140, heads=2, key=32, value=16, cu_seqlens=(0, 0, 65, 130, 140), hard=hard,
               config=dict(inference64=True)), seed=41, differentiate=False)


def test_head_size_above_limit_is_refused():
    x = jnp.ones((1, 4, 1, 256), jnp.float32)
    with pytest.raises(ValueError, match="K .*= 256"):
        rwkv_jax.rwkv7(x, -x, x, x, x, x, backend="triton")


def test_platform_without_triton_gets_a_reason():
    assert "NVIDIA" in _triton_probe.unavailable_reason("tpu")
    assert _triton_probe.unavailable_reason("cpu") is None  # triton is a test requirement


# The op at 64-token chunks: forward, final state and every gradient through its custom_vjp,
# across chunk boundaries, packed sequences with an empty segment, V != K and the decays of the
# exact path.
CHUNK64_CASES = {
    "one token": Case(steps=1),
    "two chunks, the last partial": Case(steps=70, heads=2),
    "packed, bfloat16": Case(steps=140, cu_seqlens=(0, 0, 65, 130, 140), dtype="bfloat16"),
    "V != K": Case(steps=66, key=32, value=16),
    "strong decays": Case(steps=70, decay="strong"),
    "-1e9 and -inf tokens": Case(steps=70, hard="-1e9 and -inf tokens"),
    "-1e9 and -inf tokens, bfloat16": Case(steps=70, hard="-1e9 and -inf tokens",
                                           dtype="bfloat16"),
    "uniform down to -1e3": Case(steps=70, hard="uniform down to -1e3"),
    "float32 buffers between the kernels, packed bfloat16": Case(
        steps=140, cu_seqlens=(0, 0, 65, 130, 140), dtype="bfloat16",
        config=dict(bf16_residuals=False, bf16_state_gradients=False)),
}


@pytest.mark.parametrize("name", sorted(CHUNK64_CASES))
def test_chunk64_op(name):
    check(CHUNK64_CASES[name], seed=len(name))


@pytest.mark.parametrize("name", ["packed, bfloat16", "-1e9 and -inf tokens"])
def test_chunk64_op_not_differentiated(name):
    """A call that is not differentiated (many sequence-heads: the 16-token forward): the same
    outputs within the contract."""
    check(CHUNK64_CASES[name], seed=len(name), differentiate=False)

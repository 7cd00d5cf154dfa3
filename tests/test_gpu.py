"""What only an NVIDIA GPU can show: the kernels run compiled (not interpreted), the defaults
are the measured ones, and every backend matches the float64 reference at a size with many
chunks and model head sizes. Run by ``benchmarks/gpu_suite.sh`` (part ``gpu-tests``);
deselected on machines without a GPU."""

from __future__ import annotations

import os

import pytest

from rwkv_jax import backends
from test_ops import Case, check_case, _seed

pytestmark = pytest.mark.gpu

# Several chunks of every kernel's chunk length, a partial last chunk, model head sizes.
GPU_SHAPE = dict(batch=2, steps=333, heads=4, key=64)


def test_kernels_compiled_and_defaults_measured():
    assert backends.platform() == "gpu"
    for name in ("triton", "ffi"):
        assert backends.unavailable_reason(name, "gpu") is None, name
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "Triton kernels would be interpreted"
    assert backends.resolve("rwkv7", None)[0] == "triton"
    # Per shape class (SHAPE_DEFAULTS): many sequence-heads with 16-bit inputs take the chunked
    # CUDA kernels; few sequence-heads, or float32 inputs, keep triton.
    training = dict(sequence_heads=512, key=64, value=64, dtype="bfloat16")
    assert backends.resolve("rwkv7", None, shape=training)[0] == "ffi"
    assert backends.resolve("rwkv7", None, shape=dict(training, key=128, value=128))[0] == "ffi"
    assert backends.resolve("rwkv7", None, shape=dict(training, sequence_heads=32))[0] == "triton"
    assert backends.resolve("rwkv7", None, shape=dict(training, dtype="float32"))[0] == "triton"
    assert backends.resolve("rwkv6", None)[0] == "triton"
    assert backends.resolve("gated_linear_attention", None)[0] == "triton"
    assert backends.resolve("rwkv6_step", None)[0] == "ffi"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key,value", [(64, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("op", ["rwkv7", "rwkv6", "gated_linear_attention"])
def test_gpu_sized_inputs_match_reference(backend, op, key, value, dtype):
    case = Case(op, dict(GPU_SHAPE, key=key, value=value), dtype=dtype)
    check_case(backend, case, _seed("gpu", backend, op, str(key), str(value), dtype))


@pytest.mark.parametrize("op", ["rwkv7", "rwkv6"])
def test_gpu_packed_sequences_match_reference(backend, op):
    cu_seqlens = [0, 100, 100, 257, GPU_SHAPE["steps"]]
    case = Case(op, dict(GPU_SHAPE, batch=1, state_rows=4), dict(cu_seqlens=cu_seqlens),
                dtype="bfloat16")
    check_case(backend, case, _seed("gpu-packed", backend, op))

"""The GPU side of rwkv_jax.backends.triton.launch against the two jax-triton APIs, on the CPU.

jax_triton does not import without a CUDA jaxlib (0.3) and launches nothing without a GPU, so
these tests put a stand-in module in its place whose ``triton_call`` has the signature of each
release, and check what the launch passes it: 0.3 takes ``out_shape`` and has no register
option (a capped launch runs a copy of the kernel whose compiles are capped); 0.4 takes
``out_type`` (``out_shape`` deprecated) and ``maxnreg`` and ``enable_fp_fusion`` in
``backend_options``.
"""

import inspect
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Imported before triton: on CPU it switches Triton to the interpreter before anything defines
# a kernel (the test kernel below included).
from rwkv_jax.backends.triton import launch as _launch
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _copy_kernel(x_ptr, y_ptr, SIZE: tl.constexpr):
    block = tl.arange(0, SIZE)
    tl.store(y_ptr + block, tl.load(x_ptr + block))


# The keyword-only parameters of jax_triton.triton_call in each release (their sources).
def _triton_call_0_3(*args, kernel, out_shape, grid, name="",
                     custom_call_target_name="triton_kernel_call", num_warps=None,
                     num_stages=None, num_ctas=1, compute_capability=None, enable_fp_fusion=True,
                     input_output_aliases=None, zeroed_outputs=(), debug=False,
                     serialized_metadata=b"", **metaparams):
    pass


def _triton_call_0_4(*args, kernel, out_type=None, grid, name="", num_warps=None,
                     num_stages=None, num_ctas=None, compute_capability=None,
                     backend_options=None, input_output_aliases=None, zeroed_outputs=(),
                     debug=False, serialized_metadata=b"", cost_estimate=None,
                     has_side_effect=False, **kwargs):
    pass


class _TritonCall:
    """A ``triton_call`` with a release's signature that records its keyword arguments and
    returns outputs filled with 7."""

    def __init__(self, signature_of):
        self.__signature__ = inspect.signature(signature_of)
        self.calls = []

    def __call__(self, *arrays, **kwargs):
        self.__signature__.bind(*arrays, **kwargs)  # a TypeError for what the release refuses
        self.calls.append(kwargs)
        outputs = kwargs["out_type"] if "out_type" in kwargs else kwargs["out_shape"]
        return [jnp.full(s.shape, 7, s.dtype) for s in outputs]


def _jax_triton(signature_of):
    """A stand-in jax_triton module; its triton_lib compiles through a recorded backend."""
    compiled = []

    def get_or_create_triton_kernel(make_backend, platform, fn, *args, **kwargs):
        compiled.append((fn, make_backend(0, 90).parse_options({"num_warps": 4})))

    module = types.ModuleType("jax_triton")
    module.triton_call = _TritonCall(signature_of)
    module.triton_lib = types.ModuleType("jax_triton.triton_lib")
    module.triton_lib.get_or_create_triton_kernel = get_or_create_triton_kernel
    return module, compiled


def _launch_on_gpu(monkeypatch, jax_triton, **options):
    monkeypatch.setattr(_launch, "_on_gpu", lambda: True)
    monkeypatch.setattr(_launch, "_import_jax_triton", lambda: jax_triton)
    x = jnp.arange(8, dtype=jnp.float32)
    out_shapes = (jax.ShapeDtypeStruct((8,), jnp.float32),)
    (y,) = jax.jit(lambda x: _launch.launch(_copy_kernel, (x,), out_shapes, (1,), num_warps=8,
                                            **options, SIZE=8))(x)
    np.testing.assert_array_equal(np.asarray(y), np.full(8, 7, np.float32))
    (call,) = jax_triton.triton_call.calls
    assert (call["grid"], call["num_warps"], call["SIZE"]) == ((1,), 8, 8)
    return call


@pytest.mark.parametrize("max_registers", [None, 168])
def test_jax_triton_0_4_gets_out_type_and_compile_options_as_backend_options(
        monkeypatch, max_registers):
    jax_triton, compiled = _jax_triton(_triton_call_0_4)
    call = _launch_on_gpu(monkeypatch, jax_triton, max_registers=max_registers)
    assert call["kernel"] is _copy_kernel
    assert call["out_type"] == (jax.ShapeDtypeStruct((8,), jnp.float32),)
    # Nothing deprecated: out_shape, input_output_aliases and zeroed_outputs stay unset.
    assert not {"out_shape", "input_output_aliases", "zeroed_outputs"} & set(call)
    # Fused multiply-adds asked for, as 0.3 does (triton 3.10 turns its default off).
    cap = {} if max_registers is None else {"maxnreg": 168}
    assert call["backend_options"] == {"enable_fp_fusion": True, **cap}
    assert compiled == []  # jax-triton's own compile path, untouched


@pytest.mark.parametrize("max_registers", [None, 168])
def test_jax_triton_0_3_gets_out_shape_and_a_register_capped_copy(monkeypatch, max_registers):
    jax_triton, compiled = _jax_triton(_triton_call_0_3)
    call = _launch_on_gpu(monkeypatch, jax_triton, max_registers=max_registers)
    assert call["out_shape"] == (jax.ShapeDtypeStruct((8,), jnp.float32),)
    # 0.3 would take backend_options as a kernel metaparameter, silently: never passed.
    assert not {"out_type", "backend_options"} & set(call)
    launched = call["kernel"]
    jax_triton.triton_lib.get_or_create_triton_kernel(lambda *_: _Backend(), "cuda", launched)
    (fn, options), = compiled
    if max_registers is None:
        assert launched is _copy_kernel and options == {"num_warps": 4}
    else:
        assert launched is not _copy_kernel and launched.fn is _copy_kernel.fn
        assert options == {"num_warps": 4, "maxnreg": 168}


class _Backend:
    def parse_options(self, options):
        return options


@triton.jit
def _scalar_mask_kernel(x_ptr, y_ptr, LIMIT: tl.constexpr, SIZE: tl.constexpr):
    """y = x where the program's index is below LIMIT: a scalar comparison masks the block."""
    block = tl.program_id(0) * SIZE + tl.arange(0, SIZE)
    inside = tl.program_id(0) < LIMIT
    tl.store(y_ptr + block, tl.load(x_ptr + block, mask=inside, other=-1.0), mask=inside)


def test_interpreter_takes_scalar_masks_of_blocks():
    # Valid Triton that triton 3.9's interpreter refused ("mask has unsupported dtype").
    x = jnp.arange(12, dtype=jnp.float32)
    (y,) = _launch.launch(_scalar_mask_kernel, (x,), (jax.ShapeDtypeStruct((12,), jnp.float32),),
                          (3,), LIMIT=2, SIZE=4)
    np.testing.assert_array_equal(np.asarray(y[:8]), np.arange(8, dtype=np.float32))
    assert np.isnan(np.asarray(y[8:])).all()  # never written: the bridge's NaN


def test_probe_imports_neither_triton_nor_the_kernels():
    """The registry's probe answers without importing the backend's package, which imports
    Triton and the kernels: on a machine without Triton it must say so, not fail. (A fresh
    process: this one imported both above.)"""
    probe = ("import sys; from rwkv_jax import backends; "
             "reasons = [backends._BACKENDS['triton'].probe(p) for p in ('cpu', 'tpu')]; "
             "print(reasons[0], 'rwkv_jax.backends.triton' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False", "False"], out.stdout + out.stderr

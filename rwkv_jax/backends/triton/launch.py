"""The one way rwkv_jax launches a Triton kernel from JAX.

On an NVIDIA GPU the kernel goes through ``jax_triton.triton_call`` (jax-triton 0.3 or 0.4,
whose arguments differ: :func:`_triton_call_arguments`). Elsewhere (CPU) the same
``@triton.jit`` kernel runs under Triton's interpreter inside a ``jax.pure_callback``, on the
callback's numpy arrays themselves (:class:`_HostArray`; no torch), with the same grid and
argument order, and its outputs come back as numpy arrays. Either way the kernel's signature is:
every input pointer, then every output pointer, then the ``constexprs`` by name.

Neither path has a batching rule, so under ``jax.vmap`` a launch runs once per batch element
(``lax.map``); the backends fold real batch dimensions into their grids themselves.

:func:`kernels` imports ``rwkv_jax.triton_kernels`` (after setting ``TRITON_INTERPRET=1`` off the
GPU, which must precede the kernels' definition); the op modules call it when the package
imports them, so whether the backend can run at all is asked of
:mod:`rwkv_jax.backends._triton_probe`, outside the package.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import os
import threading
from typing import Optional, Sequence

import jax
import numpy as np
from jax import lax

from .._triton_probe import import_jax_triton as _import_jax_triton

_KERNELS = "rwkv_jax.triton_kernels"


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def kernels(module: str):
    """Import ``rwkv_jax.triton_kernels.<module>``, interpreted unless on a GPU."""
    if not _on_gpu():
        os.environ["TRITON_INTERPRET"] = "1"
    loaded = importlib.import_module(f"{_KERNELS}.{module}")
    if not _on_gpu():
        import triton.language as tl
        from triton.runtime.jit import JITFunction  # the compiled kind, not the interpreted
        if any(isinstance(f, JITFunction) for f in (*vars(loaded).values(), tl.cumsum)):
            raise RuntimeError(
                "triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot "
                "run in the interpreter on this CPU: set TRITON_INTERPRET=1 in the environment, "
                "or use rwkv_jax's triton backend before anything imports triton")
        _splat_masks_as_booleans()
    return loaded


@functools.lru_cache(maxsize=None)
def _splat_masks_as_booleans():
    """Make Triton's interpreter broadcast a scalar boolean to a boolean block.

    The interpreter tags a comparison's result with its operands' type, so a scalar comparison
    broadcast to a block (a scalar mask of a block load or store: valid Triton, which our
    kernels use for a chunk slot that holds no chunk) becomes an int32 block; triton 3.9's
    loads and stores refuse that ("mask has unsupported dtype"), earlier ones took it.
    """
    import triton.language as tl
    from triton.runtime import interpreter
    splat = interpreter.InterpreterBuilder.create_splat

    def create_splat(self, ret_ty, arg):
        out = splat(self, ret_ty, arg)
        if ret_ty.scalar == tl.int1 and out.data.dtype != np.bool_:
            return interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1)
        return out

    interpreter.InterpreterBuilder.create_splat = create_splat


def launch(kernel, inputs: Sequence[jax.Array], out_shapes: Sequence[jax.ShapeDtypeStruct],
           grid: tuple, *, num_warps: int = 4, num_stages: Optional[int] = None,
           max_registers: Optional[int] = None, **constexprs):
    """Run ``kernel[grid](*inputs, *outputs, **constexprs)`` and return the outputs (a tuple).

    ``max_registers``: a cap on each thread's registers (Triton's ``maxnreg``, PTX
    ``.maxnreg``), so that more programs fit on an SM at the price of some spills; None: the
    compiler's choice (up to 255). The interpreter has no registers and ignores it.

    Outputs are uninitialised: the kernel must write every element that is read back. On the
    CPU path they start as NaN (integers as -1), so an element a kernel forgets shows up.
    """
    out_shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes)
    if _on_gpu():
        jax_triton = _import_jax_triton()
        kernel, arguments = _triton_call_arguments(jax_triton, kernel, out_shapes, max_registers)

        def run(*arrays):
            return tuple(jax_triton.triton_call(*arrays, kernel=kernel, grid=grid,
                                                num_warps=num_warps, num_stages=num_stages,
                                                **arguments, **constexprs))
    else:
        _prepare_host_bridge()

        def run(*arrays):
            pieces, shapes = _callback_pieces(arrays)
            host = lambda *xs: _interpret(kernel, grid, _joined(xs, shapes), out_shapes,
                                          constexprs)
            return tuple(jax.pure_callback(host, out_shapes, *pieces))
    return _one_at_a_time_under_vmap(run)(*inputs)


def _triton_call_arguments(jax_triton, kernel, out_shapes, max_registers):
    """The kernel to launch and the output and compile-option arguments of ``triton_call``, by
    its signature. jax-triton 0.4 takes ``out_type`` (``out_shape`` is deprecated) and compile
    options in ``backend_options``: ``maxnreg`` for a register cap, and fused multiply-adds
    asked for as jax-triton 0.3 asks for them (Triton's default for them is changing). 0.3 takes
    ``out_shape`` and has no register option (it would take ``backend_options`` for a kernel
    argument), so a capped launch runs a copy of the kernel whose compiles are capped."""
    if "backend_options" in inspect.signature(jax_triton.triton_call).parameters:
        options = {"enable_fp_fusion": True}
        if max_registers is not None:
            options["maxnreg"] = max_registers
        return kernel, {"out_type": out_shapes, "backend_options": options}
    if max_registers is not None:
        _cap_registers_in_jax_triton(jax_triton.triton_lib)
        kernel = _register_capped(kernel, max_registers)
    return kernel, {"out_shape": out_shapes}


# jax-triton 0.3 passes no register cap to Triton (its compile options are num_warps,
# num_stages, num_ctas and enable_fp_fusion), so a capped launch runs a copy of the kernel (its
# own entry in jax-triton's kernel cache, which is keyed by the kernel), and the cap of that
# copy is added to the options jax-triton has Triton's CUDA backend parse.
_REGISTER_CAPS = {}


@functools.lru_cache(maxsize=None)
def _register_capped(kernel, max_registers: int):
    """A copy of the ``@triton.jit`` kernel that compiles under jax-triton 0.3 with ``maxnreg``."""
    import triton
    copy = triton.JITFunction(kernel.fn)
    _REGISTER_CAPS[copy] = max_registers
    return copy


def capped_backend(make_backend, max_registers: int):
    """``make_backend`` (jax-triton's ``(device, compute_capability) -> backend``) whose
    backends parse every compile's options with ``maxnreg=max_registers``."""
    def make_capped(device, compute_capability):
        backend = make_backend(device, compute_capability)
        parse = backend.parse_options
        backend.parse_options = lambda options: parse(dict(options, maxnreg=max_registers))
        return backend
    return make_capped


@functools.lru_cache(maxsize=None)
def _cap_registers_in_jax_triton(triton_lib):
    """Have jax-triton 0.3's kernel compiles (``triton_lib.get_or_create_triton_kernel``) cap
    the registers of the kernels in ``_REGISTER_CAPS``."""
    compile_kernel = triton_lib.get_or_create_triton_kernel

    def get_or_create_triton_kernel(make_backend, platform, fn, *args, **kwargs):
        if fn in _REGISTER_CAPS:
            make_backend = capped_backend(make_backend, _REGISTER_CAPS[fn])
        return compile_kernel(make_backend, platform, fn, *args, **kwargs)

    triton_lib.get_or_create_triton_kernel = get_or_create_triton_kernel


def _one_at_a_time_under_vmap(run):
    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return run(*arrays)

    @call.def_vmap
    def _batched(axis_size, in_batched, *arrays):
        batched = [x for x, is_batched in zip(arrays, in_batched) if is_batched]

        def one(slices):
            it = iter(slices)
            return call(*[next(it) if is_batched else x
                          for x, is_batched in zip(arrays, in_batched)])

        outs = lax.map(one, batched)
        return outs, jax.tree.map(lambda _: True, outs)

    return call


# ----------------------------------------------------------------------------------------------
# The CPU bridge.
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _prepare_host_bridge():
    """Once, when a launch is traced (never inside a callback): make the interpreter exit only
    after the callbacks it dispatched have run.

    XLA runs the callbacks asynchronously, so a script that ends right after a call exits while
    they still run, and jax's own exit handlers clear the backends before they wait for running
    computations, so the process crashed. Exit handlers run last-registered first: this one,
    registered after jax's, waits for every dispatched computation while Python is still whole.
    """
    atexit.register(jax.effects_barrier)


class _HostArray:
    """A C-contiguous numpy array as Triton's interpreter takes a kernel's pointer argument.

    The interpreter is written for torch tensors: it reads an argument's ``data_ptr()`` and
    ``dtype`` (whose name it maps to a Triton type: numpy's ``float32``, ml_dtypes'
    ``bfloat16``, ...), and around the grid it copies the argument's storage to the host
    (``untyped_storage().cpu()``, ``new_empty(0, device='cpu').set_(storage, offset, size,
    stride)``) and back (``copy_``). The array already lies on the host, so its host copy is
    itself, and the kernel reads and writes it in place.
    """

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("the interpreter bridge takes C-contiguous arrays")
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *size, device=None):
        return self

    def set_(self, storage, offset, size, stride):
        if storage is not self or offset != 0 or tuple(size) != self.array.shape:
            raise NotImplementedError("the interpreter asked for another view of a host array")
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple:
        return self.array.shape

    def stride(self) -> tuple:
        return tuple(step // self.array.itemsize for step in self.array.strides)

    def copy_(self, source):
        if source is not self:
            raise NotImplementedError("the interpreter copied a host array from elsewhere")
        return self


def _unwritten(shape, dtype) -> np.ndarray:
    """A fresh output: NaN (integers -1), so an element the kernel forgets shows up."""
    return np.full(shape, np.nan if jax.numpy.issubdtype(dtype, jax.numpy.floating) else -1, dtype)


# jax.pure_callback hands its host function each operand after a device_put to the CPU device,
# and XLA's CPU client copies a host buffer of 100 KiB or more on its thread pool instead of at
# once. Devices blocked in a collective (sequence parallelism's all-gather inside shard_map)
# hold that pool's threads on a machine with fewer cores than devices, so the copy never ran and
# every callback waited forever. Operands travel in pieces below that size, copied at once.
_CALLBACK_PIECE_BYTES = 64 * 1024


def _callback_pieces(arrays):
    """``arrays`` as flat pieces of at most _CALLBACK_PIECE_BYTES, and each array's shape and
    number of pieces (for :func:`_joined`)."""
    pieces, shapes = [], []
    for x in arrays:
        flat = x.reshape(-1)
        step = max(1, _CALLBACK_PIECE_BYTES // x.dtype.itemsize)
        parts = [flat[i:i + step] for i in range(0, flat.size, step)] or [flat]
        pieces += parts
        shapes.append((x.shape, len(parts)))
    return pieces, shapes


def _joined(pieces, shapes):
    pieces, arrays = iter(pieces), []
    for shape, count in shapes:
        parts = [np.asarray(next(pieces)) for _ in range(count)]
        arrays.append((parts[0] if count == 1 else np.concatenate(parts)).reshape(shape))
    return arrays


# Triton's interpreter keeps global state while it runs a grid, so callbacks that XLA runs at
# the same time (one per device inside shard_map, say) must take turns.
_INTERPRETER_LOCK = threading.Lock()


def _interpret(kernel, grid, inputs, out_shapes, constexprs):
    arrays = [_HostArray(np.ascontiguousarray(x)) for x in inputs]
    outputs = [_HostArray(_unwritten(s.shape, s.dtype)) for s in out_shapes]
    with _INTERPRETER_LOCK:
        kernel[grid](*arrays, *outputs, **constexprs)
    return tuple(out.array for out in outputs)

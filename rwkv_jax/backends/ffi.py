"""The ``ffi`` backend: compiled kernels called through the XLA FFI (``jax.ffi.ffi_call``).

``rwkv_jax._ffi_cpu`` (C++, threaded over sequences x heads) is built by every ``pip install``;
``rwkv_jax._ffi_cuda`` only where nvcc was found (see BUILD.md). Both register the same target
names, for the platforms "cpu" and "CUDA", so one ``ffi_call`` runs wherever the array lives.

Each op is a ``jax.custom_vjp``: the forward kernel saves the state every ``checkpoint_chunk``
steps and the backward kernel recomputes each chunk from its checkpoint and runs the exact
reverse recurrence. Kernels take one float dtype (float32, bfloat16 or float16; float64 inputs
are refused before they get here, see ``backends.resolve``), accumulate in float32 and return
the state in float32. Under ``vmap`` the calls run sequentially over the mapped axis; inside
``shard_map`` results keep their inputs' varying axes (result types come from ``jax.typeof``).
The ``*_step`` ops update the float32 state pool in place (the pool is aliased to the output;
donate it under ``jit``); a row whose index is outside the pool (the ops layer's sentinel S for
an invalid row) is skipped: its slot is neither read nor written and its output row is NaN.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import json
import urllib.parse
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .native import read_rows, write_rows

# Head sizes K the CUDA kernels are compiled for (each needs V a multiple of 32).
CUDA_HEAD_SIZES = (64, 128)
# Largest value size V of every kernel: the CPU kernels keep per-step rows of V floats on the
# stack (ffi/cpu_util.h, kMaxValueSize); the CUDA kernels run one thread per value column.
MAX_VALUE_SIZE = 1024
# The CUDA kernels put the sequences (B, or the segments of cu_seqlens) on the grid's y axis,
# which CUDA caps at 65,535 blocks.
CUDA_MAX_SEQUENCES = 65535


def _module_name(platform: str) -> str:
    return "rwkv_jax._ffi_cuda" if platform == "gpu" else "rwkv_jax._ffi_cpu"


def unavailable(platform: str) -> Optional[str]:
    """None if the kernels for ``platform`` ('cpu', 'gpu', 'tpu') are built, else why not."""
    if platform not in ("cpu", "gpu"):
        return f"the ffi backend has CPU and CUDA kernels only, not {platform!r}"
    if importlib.util.find_spec(_module_name(platform)) is None:
        what = "CUDA extension (built only where nvcc is found)" if platform == "gpu" else "CPU extension"
        return (f"the {what} {_module_name(platform)} is not built; reinstall with "
                f"`pip install .` (see BUILD.md)")
    return None


def _reinstall_command() -> str:
    """The install command that builds the CUDA extension for this installation of rwkv_jax."""
    source, editable = ".", False
    try:
        origin = json.loads(importlib.metadata.distribution("rwkv_jax").read_text("direct_url.json")
                            or "{}")
    except importlib.metadata.PackageNotFoundError:
        origin = {}
    if "dir_info" in origin and origin.get("url", "").startswith("file://"):  # a source folder
        source = urllib.parse.unquote(urllib.parse.urlparse(origin["url"]).path)
        editable = origin.get("dir_info", {}).get("editable", False)
    return f'RWKV_JAX_CUDA=ON pip install {"-e " if editable else ""}"{source}[gpu]"'


def cuda_build_report() -> str:
    """Which compiler built the CUDA kernels, for which GPUs and why; or why there are none and
    the one command that brings them. From rwkv_jax/_build_info.py, which the build writes."""
    try:
        info = importlib.import_module("rwkv_jax._build_info")
    except ModuleNotFoundError:
        return ("unknown: this installation has no build record (rwkv_jax/_build_info.py), so it "
                f"was not built by `pip install`; to build the CUDA kernels: {_reinstall_command()}")
    if not info.CUDA_EXTENSION:
        return (f"not built: {info.CUDA_REASON} (RWKV_JAX_CUDA={info.CUDA_MODE}); to build them: "
                f"{_reinstall_command()}")
    report = (f"built for sm {info.CUDA_ARCHITECTURES} by nvcc {info.CUDA_COMPILER_VERSION} "
              f"({info.CUDA_COMPILER}), {info.CUDA_COMPILER_ORIGIN}; because {info.CUDA_REASON}")
    if importlib.util.find_spec(_module_name("gpu")) is None:
        report += f"; but {_module_name('gpu')} is missing from this installation"
    return report


@functools.lru_cache(maxsize=None)
def _chunk() -> int:
    """Register the targets of every built extension (once) and return the checkpoint interval."""
    chunk = None
    for platform, ffi_platform in (("cpu", "cpu"), ("gpu", "CUDA")):
        if importlib.util.find_spec(_module_name(platform)) is None:
            continue
        module = importlib.import_module(_module_name(platform))
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=ffi_platform)
        chunk = module.checkpoint_chunk
    if chunk is None:
        raise RuntimeError(unavailable("cpu"))
    return chunk


def _call(target, results, *args, aliases=None, **attrs):
    _chunk()
    call = jax.ffi.ffi_call(f"rwkv_jax_{target}", results, vmap_method="sequential",
                            input_output_aliases=aliases)
    return call(*args, **{k: np.float32(v) for k, v in attrs.items()})


def _like(x, shape, dtype):
    """Result type of ``shape`` and ``dtype`` that keeps ``x``'s varying mesh axes (shard_map)."""
    return jax.typeof(x).update(shape=tuple(shape), dtype=jnp.dtype(dtype))


def check_shape(op, k_size, v_size, sequences, platform=None):
    """The kernels' limits on ``platform`` (None: JAX's default), checked before any kernel
    runs: a ValueError instead of a kernel's error at run time or a failed launch."""
    platform = platform or jax.default_backend()
    if v_size > MAX_VALUE_SIZE:
        raise ValueError(f"{op}: the ffi backend's kernels support a value size V (v's last axis) "
                         f"up to {MAX_VALUE_SIZE}, got V={v_size}; backends 'native' and "
                         f"'chunked' have no such limit")
    if platform != "gpu":
        return
    if k_size not in CUDA_HEAD_SIZES or v_size % 32 or v_size < 32:
        raise ValueError(f"{op}: the ffi backend's CUDA kernels need K in {CUDA_HEAD_SIZES} and "
                         f"V a multiple of 32 up to {MAX_VALUE_SIZE}, got K={k_size}, V={v_size}")
    if sequences > CUDA_MAX_SEQUENCES:
        raise ValueError(f"{op}: the ffi backend's CUDA kernels run at most {CUDA_MAX_SEQUENCES} "
                         f"sequences per call (the batch size B, or the segments of cu_seqlens), "
                         f"got {sequences}; split the call")


def _segments(batch, length, cu_seqlens):
    if cu_seqlens is None:
        return jnp.arange(batch + 1, dtype=jnp.int32) * length
    return cu_seqlens.astype(jnp.int32)


def _states(r, v, n, initial_state):
    if initial_state is not None:
        return initial_state.astype(jnp.float32)
    return jnp.zeros((n, r.shape[2], r.shape[3], v.shape[3]), jnp.float32)


def _checkpoint_shape(r, v, n, save):
    """Checkpoints of a forward: none (zero rows) unless a backward will use them."""
    batch, length, heads, k_size = r.shape
    return ((n + batch * length // _chunk()) if save else 0, heads, k_size, v.shape[3])


# ---------------------------------------------------------------------------------------------
# RWKV-7


# The chunked kernels (ffi/cpu_rwkv7_chunk.cc, ffi/cuda_rwkv7_chunk.cu) take K = V in these sizes:
# the CUDA kernel's tiles are compiled for them, and its shared memory (about 210 KiB per block
# at K = 128) leaves no room for larger heads. Other head sizes take the sequential kernels.
CHUNKED_HEAD_SIZES = (64, 128)
# Where the chunked pair is the default: on the GPU it trains several times faster than the
# sequential kernels; on the CPU its twin (which CI tests for the CUDA kernels' arithmetic) is
# slower than the sequential kernel (BENCHMARKS.md).
CHUNKED_PLATFORMS = ("gpu",)


def rwkv7_kernel(k_size, v_size, dtype, platform=None):
    """The rwkv7 training kernels' target stem on ``platform`` (None: JAX's default):
    "rwkv7_chunk" (16-token chunks, tensor cores on the GPU) on CHUNKED_PLATFORMS for K = V in
    CHUNKED_HEAD_SIZES where the GPU's shared memory per block holds the CUDA kernels' tiles,
    else "rwkv7" (sequential, any K and V)."""
    platform = platform or jax.default_backend()
    if platform not in CHUNKED_PLATFORMS or k_size != v_size or k_size not in CHUNKED_HEAD_SIZES:
        return "rwkv7"
    if platform == "gpu":
        _chunk()
        cuda = importlib.import_module(_module_name("gpu"))
        if cuda.rwkv7_chunk_shared_bytes(k_size, jnp.dtype(dtype).itemsize) > cuda.max_shared_bytes():
            return "rwkv7"
    return "rwkv7_chunk"


def _rwkv7_checkpoint_dtype(kernel, dtype):
    """The chunked kernels save the state in bfloat16 for 16-bit inputs (their backward reads it
    as a bfloat16 operand; ffi/checks.h's chunk_checkpoint_dtype), every other one in float32."""
    if kernel == "rwkv7_chunk" and jnp.dtype(dtype).itemsize == 2:
        return jnp.bfloat16
    return jnp.float32


def _rwkv7_forward(kernel, scale, r, w, k, v, a, b, h0, cu, save):
    return _call(f"{kernel}_fwd",
                 (_like(v, v.shape, v.dtype), _like(h0, h0.shape, jnp.float32),
                  _like(h0, _checkpoint_shape(r, v, h0.shape[0], save),
                        _rwkv7_checkpoint_dtype(kernel, r.dtype))),
                 r, w, k, v, a, b, h0, cu, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rwkv7(kernel, scale, r, w, k, v, a, b, h0, cu):
    return _rwkv7_forward(kernel, scale, r, w, k, v, a, b, h0, cu, save=False)[:2]


def _rwkv7_fwd(kernel, scale, r, w, k, v, a, b, h0, cu):
    o, h, ckpt = _rwkv7_forward(kernel, scale, r, w, k, v, a, b, h0, cu, save=True)
    return (o, h), (r, w, k, v, a, b, ckpt, cu)


def _rwkv7_bwd(kernel, scale, residuals, cotangents):
    r, w, k, v, a, b, ckpt, cu = residuals
    d_o, dh = cotangents
    n = cu.shape[0] - 1
    grads = _call(f"{kernel}_bwd",
                  tuple(_like(x, x.shape, x.dtype) for x in (r, w, k, v, a, b))
                  + (_like(ckpt, (n,) + ckpt.shape[1:], jnp.float32),),
                  r, w, k, v, a, b, d_o.astype(v.dtype), dh.astype(jnp.float32), ckpt, cu,
                  scale=scale)
    return (*grads, None)


_rwkv7.defvjp(_rwkv7_fwd, _rwkv7_bwd)


def rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens):
    dtype = jnp.result_type(r, w, k, v, a, b)
    batch, length = r.shape[:2]
    cu = _segments(batch, length, cu_seqlens)
    check_shape("rwkv7", r.shape[3], v.shape[3], cu.shape[0] - 1)
    h0 = _states(r, v, cu.shape[0] - 1, initial_state)
    o, h = _rwkv7(rwkv7_kernel(r.shape[3], v.shape[3], dtype), float(scale),
                  *(x.astype(dtype) for x in (r, w, k, v, a, b)), h0, cu)
    return o.astype(v.dtype), h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rwkv7_step(scale, r, w, k, v, a, b, state, rows):
    return _call("rwkv7_step", (_like(v, v.shape, v.dtype), _like(state, state.shape, jnp.float32)),
                 r, w, k, v, a, b, state, rows, aliases={6: 1}, scale=scale)


def _rwkv7_step_fwd(scale, r, w, k, v, a, b, state, rows):
    h0 = read_rows(state, rows)  # read before the kernel overwrites these rows in place
    return _rwkv7_step(scale, r, w, k, v, a, b, state, rows), (r, w, k, v, a, b, h0, rows)


def _rwkv7_step_bwd(scale, residuals, cotangents):
    r, w, k, v, a, b, h0, rows = residuals
    d_o, d_state = cotangents
    cu = _segments(r.shape[0], r.shape[1], None)
    kernel = rwkv7_kernel(r.shape[3], v.shape[3], r.dtype)
    _, saved = _rwkv7_fwd(kernel, scale, r, w, k, v, a, b, h0, cu)
    *grads, dh0, _ = _rwkv7_bwd(kernel, scale, saved, (d_o, read_rows(d_state, rows)))
    return (*grads, write_rows(d_state, rows, dh0), None)


_rwkv7_step.defvjp(_rwkv7_step_fwd, _rwkv7_step_bwd)


def rwkv7_step(r, w, k, v, a, b, state, *, scale, state_indices):
    check_shape("rwkv7_step", r.shape[3], v.shape[3], r.shape[0])
    dtype = jnp.result_type(r, w, k, v, a, b)
    o, state = _rwkv7_step(float(scale), *(x.astype(dtype) for x in (r, w, k, v, a, b)), state,
                           state_indices.astype(jnp.int32))
    return o.astype(v.dtype), state


# ---------------------------------------------------------------------------------------------
# RWKV-6


def _rwkv6_forward(scale, r, k, v, w, u, h0, cu, save):
    return _call("rwkv6_fwd",
                 (_like(v, v.shape, v.dtype), _like(h0, h0.shape, jnp.float32),
                  _like(h0, _checkpoint_shape(r, v, h0.shape[0], save), jnp.float32)),
                 r, k, v, w, u, h0, cu, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rwkv6(scale, r, k, v, w, u, h0, cu):
    return _rwkv6_forward(scale, r, k, v, w, u, h0, cu, save=False)[:2]


def _rwkv6_fwd(scale, r, k, v, w, u, h0, cu):
    o, h, ckpt = _rwkv6_forward(scale, r, k, v, w, u, h0, cu, save=True)
    return (o, h), (r, k, v, w, u, ckpt, cu)


def _rwkv6_bwd(scale, residuals, cotangents):
    r, k, v, w, u, ckpt, cu = residuals
    d_o, dh = cotangents
    n = cu.shape[0] - 1
    dr, dk, dv, dw, du, dh0 = _call(
        "rwkv6_bwd",
        tuple(_like(x, x.shape, x.dtype) for x in (r, k, v, w))
        + (_like(u, (n,) + u.shape, jnp.float32), _like(ckpt, (n,) + ckpt.shape[1:], jnp.float32)),
        r, k, v, w, u, d_o.astype(v.dtype), dh.astype(jnp.float32), ckpt, cu, scale=scale)
    return dr, dk, dv, dw, du.sum(0), dh0, None


_rwkv6.defvjp(_rwkv6_fwd, _rwkv6_bwd)


def rwkv6(r, k, v, w, u, *, scale, initial_state, output_final_state, cu_seqlens):
    dtype = jnp.result_type(r, k, v, w)
    batch, length = r.shape[:2]
    cu = _segments(batch, length, cu_seqlens)
    check_shape("rwkv6", r.shape[3], v.shape[3], cu.shape[0] - 1)
    h0 = _states(r, v, cu.shape[0] - 1, initial_state)
    o, h = _rwkv6(float(scale), *(x.astype(dtype) for x in (r, k, v, w)), u.astype(jnp.float32),
                  h0, cu)
    return o.astype(v.dtype), h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rwkv6_step(scale, r, k, v, w, u, state, rows):
    return _call("rwkv6_step", (_like(v, v.shape, v.dtype), _like(state, state.shape, jnp.float32)),
                 r, k, v, w, u, state, rows, aliases={5: 1}, scale=scale)


def _rwkv6_step_fwd(scale, r, k, v, w, u, state, rows):
    h0 = read_rows(state, rows)  # read before the kernel overwrites these rows in place
    return _rwkv6_step(scale, r, k, v, w, u, state, rows), (r, k, v, w, u, h0, rows)


def _rwkv6_step_bwd(scale, residuals, cotangents):
    r, k, v, w, u, h0, rows = residuals
    d_o, d_state = cotangents
    cu = _segments(r.shape[0], r.shape[1], None)
    _, saved = _rwkv6_fwd(scale, r, k, v, w, u, h0, cu)
    *grads, dh0, _ = _rwkv6_bwd(scale, saved, (d_o, read_rows(d_state, rows)))
    return (*grads, write_rows(d_state, rows, dh0), None)


_rwkv6_step.defvjp(_rwkv6_step_fwd, _rwkv6_step_bwd)


def rwkv6_step(r, k, v, w, u, state, *, scale, state_indices):
    check_shape("rwkv6_step", r.shape[3], v.shape[3], r.shape[0])
    dtype = jnp.result_type(r, k, v, w)
    o, state = _rwkv6_step(float(scale), *(x.astype(dtype) for x in (r, k, v, w)),
                           u.astype(jnp.float32), state, state_indices.astype(jnp.int32))
    return o.astype(v.dtype), state


# ---------------------------------------------------------------------------------------------
# RWKV-4


@jax.custom_vjp
def _rwkv4(w, u, k, v, s0):
    return _rwkv4_fwd(w, u, k, v, s0)[0]


def _rwkv4_fwd(w, u, k, v, s0):
    batch, length, channels = k.shape
    chunks = -(-length // _chunk())
    y, s, ckpt = _call("rwkv4_fwd",
                       (_like(v, v.shape, v.dtype), _like(s0, s0.shape, jnp.float32),
                        _like(s0, (batch, chunks, channels, 3), jnp.float32)),
                       w, u, k, v, s0)
    return (y, s), (w, u, k, v, ckpt)


def _rwkv4_bwd(residuals, cotangents):
    w, u, k, v, ckpt = residuals
    dy, ds = cotangents
    batch, _, channels = k.shape
    per_row = _like(k, (batch, channels), jnp.float32)
    dw, du, dk, dv, ds0 = _call("rwkv4_bwd",
                                (per_row, per_row, _like(k, k.shape, k.dtype),
                                 _like(v, v.shape, v.dtype),
                                 _like(ckpt, (batch, channels, 3), jnp.float32)),
                                w, u, k, v, dy.astype(v.dtype), ds.astype(jnp.float32), ckpt)
    return dw.sum(0), du.sum(0), dk, dv, ds0


_rwkv4.defvjp(_rwkv4_fwd, _rwkv4_bwd)


def rwkv4(w, u, k, v, *, initial_state, output_final_state):
    dtype = jnp.result_type(k, v)
    batch, _, channels = k.shape
    if initial_state is None:
        zeros = jnp.zeros((batch, channels), jnp.float32)
        initial_state = jnp.stack([zeros, zeros, jnp.full_like(zeros, -1e38)], axis=-1)
    y, s = _rwkv4(w.astype(jnp.float32), u.astype(jnp.float32), k.astype(dtype), v.astype(dtype),
                  initial_state.astype(jnp.float32))
    return y.astype(v.dtype), s

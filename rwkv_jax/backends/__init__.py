"""Backend registry.

A backend is a module that defines some of the functions named in ``OPS`` with the canonical
signatures documented in ``rwkv_jax.backends.native`` (inputs already validated, layout
``[B, T, H, *]``, ``initial_state`` float32 or None). Adding a backend is one ``register`` call
below; the module is imported only when the backend is first asked for.

Which backend runs an op: the explicit ``backend=`` argument, else the environment variable
``RWKV_JAX_BACKEND`` (or ``KERNEL_TYPE``, where ``cuda`` means ``ffi``), else the first backend in
``DEFAULT_ORDER`` for the platform that can run here and implements the op. An explicit or
environment choice that cannot run raises ``BackendUnavailableError`` saying why: never a
silent fallback.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable, Optional

import jax

OPS = ("rwkv7", "rwkv6", "rwkv4", "gated_linear_attention", "rwkv7_step", "rwkv6_step")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run this op on this machine."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    module: str
    summary: str
    # Returns None when the backend can run on ``platform`` ("cpu", "gpu", "tpu"), else the reason.
    probe: Callable[[str], Optional[str]]
    # DESIGN.md's numerical contract for float32 inputs: (forward, gradients) relative error
    # against float64. Sequential backends are exact to rounding; chunked ones use tf32 matmuls.
    float32_tolerance: tuple[float, float] = (1e-5, 1e-4)


_BACKENDS: dict[str, Backend] = {}

# bfloat16 / float16 inputs, against a reference computed from the same rounded values.
LOW_PRECISION_TOLERANCE = 1e-2

# Chunked paths raise every log decay below this to it before any cumulative sum: exp of either
# is exactly 0 in float32 (< 1e-55 in float64), so no result changes, while in-chunk sums stay
# finite and their differences precise (DESIGN.md, numerical contract).
LOG_DECAY_FLOOR = -128.0

# Fastest first, per platform; backends that cannot run here or lack the op are skipped. The order
# follows BENCHMARKS.md: on the GPU (H100) triton trains rwkv7 ~20x faster than native and ~5x
# faster than ffi, and ffi beats native; on the CPU ffi beats native and chunked for both the
# forward and forward+backward of rwkv7/rwkv6. chunked trains faster than native on the CPU but
# runs the forward slower; it is unmeasured on GPU and TPU, so it comes last until measured.
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("triton", "ffi", "native", "chunked"),
    "cpu": ("ffi", "native", "chunked"),
    "tpu": ("native", "chunked"),
}


def register(name: str, module: str, summary: str, probe: Callable[[str], Optional[str]],
             float32_tolerance: tuple[float, float] = (1e-5, 1e-4)) -> None:
    _BACKENDS[name] = Backend(name, module, summary, probe, float32_tolerance)


def tolerance(name: str, dtype) -> tuple[float, float]:
    """(forward, gradients) relative error that backend ``name`` may have for ``dtype`` inputs."""
    if jax.numpy.dtype(dtype) != jax.numpy.float32:
        return LOW_PRECISION_TOLERANCE, LOW_PRECISION_TOLERANCE
    return _BACKENDS[name].float32_tolerance


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def platform() -> str:
    """The platform of JAX's default device: 'cpu', 'gpu' or 'tpu'."""
    return jax.default_backend()


@functools.lru_cache(maxsize=None)
def unavailable_reason(name: str, platform_name: str) -> Optional[str]:
    """None if backend ``name`` can run on ``platform_name``, else a sentence saying why not."""
    backend = _BACKENDS[name]
    reason = backend.probe(platform_name)
    if reason is not None:
        return reason
    try:
        importlib.import_module(backend.module)
    except Exception as err:  # an import error is a reason, reported to the user verbatim
        return f"importing {backend.module} failed: {type(err).__name__}: {err}"
    return None


def implements(name: str, op: str) -> bool:
    backend = _BACKENDS[name]
    return callable(getattr(importlib.import_module(backend.module), op, None))


def _requested() -> tuple[Optional[str], str]:
    for var in ("RWKV_JAX_BACKEND", "KERNEL_TYPE"):
        value = os.environ.get(var, "").strip().lower()
        if value:
            return ("ffi" if var == "KERNEL_TYPE" and value == "cuda" else value), f"{var}={value}"
    return None, ""


def resolve(op: str, backend: Optional[str]) -> tuple[str, Callable]:
    """The (name, function) that runs ``op``; raises a clear error when that is impossible."""
    source = f"backend={backend!r}"
    if backend is None:
        backend, source = _requested()
    where = platform()
    if backend is None:
        for name in DEFAULT_ORDER.get(where, ("native",)):
            if unavailable_reason(name, where) is None and implements(name, op):
                return name, getattr(importlib.import_module(_BACKENDS[name].module), op)
        raise BackendUnavailableError(f"no backend implements {op} on platform {where!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (from {source}); known: {', '.join(_BACKENDS)}")
    reason = unavailable_reason(backend, where)
    if reason is not None:
        raise BackendUnavailableError(f"backend {backend!r} (from {source}) cannot run here: {reason}")
    if not implements(backend, op):
        have = [n for n in _BACKENDS if unavailable_reason(n, where) is None and implements(n, op)]
        raise BackendUnavailableError(
            f"backend {backend!r} (from {source}) does not implement {op}; "
            f"backends that do here: {', '.join(have)}"
        )
    return backend, getattr(importlib.import_module(_BACKENDS[backend].module), op)


def describe() -> list[dict]:
    """One row per backend: name, summary, available here, why not, ops it implements."""
    where = platform()
    rows = []
    for name, backend in _BACKENDS.items():
        reason = unavailable_reason(name, where)
        ops = [op for op in OPS if reason is None and implements(name, op)]
        rows.append(dict(name=name, summary=backend.summary, available=reason is None,
                         reason=reason or "", ops=ops))
    return rows


register("native", "rwkv_jax.backends.native",
         "lax.scan over time, checkpointed blocks; the readable reference", lambda p: None)
register("chunked", "rwkv_jax.backends.chunked",
         "chunked WY/UT-transform algorithm in jax.numpy", lambda p: None,
         float32_tolerance=(2e-3, 2e-3))
register("triton", "rwkv_jax.backends.triton",
         "chunked Triton kernels (jax-triton on GPU, Triton's interpreter on CPU)",
         lambda p: importlib.import_module("rwkv_jax.backends._launch").unavailable_reason(p),
         float32_tolerance=(2e-3, 2e-3))
register("ffi", "rwkv_jax.backends.ffi", "compiled C++ (CPU) and CUDA kernels through the XLA FFI",
         lambda p: importlib.import_module("rwkv_jax.backends.ffi").unavailable(p))

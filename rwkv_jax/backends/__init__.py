"""Backend registry.

A backend is a module that defines some of the functions named in ``OPS`` with the canonical
signatures documented in ``rwkv_jax.backends.native`` (inputs already validated, layout
``[B, T, H, *]``, ``initial_state`` float32 or None). Adding a backend is one ``register`` call
below; the module is imported only when the backend is first asked for.

Which backend runs an op (``resolve``):
1. the explicit ``backend=`` argument, strictly: if it cannot run this op here, the error says
   why, never a silent fallback;
2. else a preference from the environment, ``RWKV_JAX_BACKEND`` (or ``KERNEL_TYPE``, rwkv_ops'
   variable, where ``cuda`` means ``ffi``): that backend for every op it implements and can run
   here, the default for the others;
3. else the default: the backend ``SHAPE_DEFAULTS[(op, platform)]`` names for the call's shape
   class, if any and if it can run here; else the first backend of ``DEFAULTS[(op, platform)]``
   (fastest measured first) that can run here.
For float64 inputs (``dtype``) only the backends that compute in float64 count: an explicit
other one is a TypeError naming those that do, and the preference and default skip the others.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Callable, Optional

import jax
from jax.interpreters import ad
from jax.interpreters import partial_eval as pe

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
    # Whether jax.jvp / jacfwd / hessian work through it (kernels wrapped in custom_vjp do not).
    forward_mode_ad: bool = False
    # Whether float64 inputs are computed in float64; a backend that cannot refuses them.
    float64: bool = False


_BACKENDS: dict[str, Backend] = {}

# bfloat16 / float16 inputs, against a reference computed from the same rounded values.
LOW_PRECISION_TOLERANCE = 1e-2
# float64 inputs (jax_enable_x64), on the backends that compute in float64.
FLOAT64_TOLERANCE = 1e-9

# Chunked paths raise every log decay below this to it before any cumulative sum: exp of either
# is exactly 0 in float32 (< 1e-55 in float64), so no result changes, while in-chunk sums stay
# finite and their differences precise (DESIGN.md, numerical contract).
LOG_DECAY_FLOOR = -128.0

# The default backend per op and platform: fastest measured first (backends that cannot run here
# are skipped), each entry with the measurement behind its order (BENCHMARKS.md unless said).
# Adding a backend to an op is a one-line edit of its entry.
DEFAULTS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("rwkv7", "gpu"): (("triton", "ffi", "native", "chunked"),
        "H100 B=8 T=4096 H=64 K=64 bf16 fwd+bwd: triton 14.63 ms, ffi 110.9 (its sequential "
        "kernels; the chunked ones by shape class: SHAPE_DEFAULTS), native 466; at B=8 T=1024 "
        "H=32 (main job, 5 repeats) fwd: triton 0.84 ms, ffi 2.58, chunked 6.72, native 11.46"),
    ("rwkv7", "cpu"): (("ffi", "native", "chunked"),
        "2-core CPU B=4 T=1024 H=8 K=64 f32 fwd / fwd+bwd: ffi 24.1 / 131 ms, native 80.7 / 664, "
        "chunked 250 / 1259"),
    ("rwkv6", "gpu"): (("triton", "ffi", "native", "chunked"),
        "H100 B=8 T=4096 H=64 K=64 bf16 fwd / fwd+bwd: triton 1.63 / 7.66 ms (fla "
        "4.00 / 14.35), ffi 7.1 / 68.6 (ffi stays the step path); at B=8 T=1024 H=32 (main "
        "job) fwd: triton 1.10 ms, ffi 1.96, chunked 2.90, native 21.3"),
    ("rwkv6", "cpu"): (("ffi", "chunked", "native"),
        "2-core CPU B=4 T=1024 H=8 K=64 f32 fwd / fwd+bwd: ffi 18.5 / 124 ms, chunked 84.0 / 769, "
        "native 105.8 / 854"),
    ("gated_linear_attention", "gpu"): (("triton", "chunked", "native"),
        "H100 B=8 T=4096 H=64 K=64 bf16 gk fwd / fwd+bwd: triton 1.35 / 6.53 ms "
        "(fla 3.20 / 12.78), chunked 18.5 / 85.3, native 67.3 / 378"),
    ("gated_linear_attention", "cpu"): (("chunked", "native"),
        "2-core CPU (loaded) f32 fwd+bwd, the dominant cost: chunked 390 ms vs native 1294 at "
        "B=1 T=1024 H=4 K=64, 1450 vs 3131 at B=1 T=4096, a tie at B=2 T=1024 H=4 (758 vs 710) "
        "and B=4 T=1024 H=8 K=128 (13.1 vs 12.6 s); the forward alone is 2-9x faster on native "
        "(22 vs 191 ms at B=1 T=1024)"),
    ("rwkv4", "gpu"): (("ffi", "native"),
        "H100 B=8 T=1024 C=2048 bf16 fwd (main job, 5 repeats): ffi 0.91 ms, native 18.4"),
    ("rwkv4", "cpu"): (("native", "ffi"),
        "2-core CPU (loaded), 2026-12-02, f32 fwd / fwd+bwd, medians of 3 runs at B=2 T=1024 "
        "C=256: native 4.5 / 20.4 ms, ffi 12.8 / 30.4; of 5 at B=4 T=2048 C=512: native "
        "59.3 / 273.5, ffi 101.1 / 290.1; ffi's peak memory about half"),
    ("rwkv7_step", "gpu"): (("ffi", "native"),
        "H100 T=1 H=32 K=64 decode step in a jitted loop: ffi 15-108 us for B=1-256 "
        "(fla 35-114); native not timed"),
    ("rwkv7_step", "cpu"): (("ffi", "native"),
        "2-core CPU (loaded) B=2 T=1 H=4 K=64 f32: ffi 0.080 ms, native 0.125"),
    ("rwkv6_step", "gpu"): (("ffi", "native"),
        "H100 B=8 H=32 K=64 one token (main job, 5 repeats, launch-bound): native 0.161 ms, ffi "
        "0.191, a tie at this size; ffi as for rwkv7_step, whose jitted loop it won"),
    ("rwkv6_step", "cpu"): (("ffi", "native"),
        "2-core CPU (loaded) B=2 T=1 H=4 K=64 f32: ffi 0.069 ms, native 0.125"),
}
# Platforms without an entry (TPU): the portable backends, unmeasured.
FALLBACK_ORDER = ("native", "chunked")

# rwkv7's chunked CUDA kernels (the ffi backend on the GPU, K = V in its chunked head sizes)
# train faster than triton from this many sequence-heads (sequences x heads) on: one thread block
# each, so fewer leave multiprocessors idle.
CHUNKED_CUDA_MIN_SEQUENCE_HEADS = 256


def chunked_cuda_trains_faster(shape: dict) -> bool:
    """Whether an rwkv7 call of this shape class (``ops.py``'s ``shape``) is one where the chunked
    CUDA kernels train faster than triton: 16-bit inputs, K = V in (64, 128) and at least
    CHUNKED_CUDA_MIN_SEQUENCE_HEADS sequence-heads."""
    return (jax.numpy.dtype(shape["dtype"]) in (jax.numpy.bfloat16, jax.numpy.float16)
            and shape["key"] == shape["value"] and shape["key"] in (64, 128)
            and shape["sequence_heads"] >= CHUNKED_CUDA_MIN_SEQUENCE_HEADS)


def _rwkv7_gpu_by_shape(shape: dict) -> Optional[str]:
    if not chunked_cuda_trains_faster(shape) or not _runs("ffi", "rwkv7", "gpu"):
        return None
    ffi = importlib.import_module(_BACKENDS["ffi"].module)
    chunked = ffi.rwkv7_kernel(shape["key"], shape["value"], shape["dtype"], "gpu") == "rwkv7_chunk"
    return "ffi" if chunked else None  # (the chunked kernels' tiles fit this GPU's shared memory)


# Shape classes whose default is another backend than DEFAULTS' first: (op, platform) -> (rule,
# measurement); rule(shape) names that backend for a call's shape (a dict from ops.py:
# sequence_heads, key, value, dtype), or None for DEFAULTS' order.
SHAPE_DEFAULTS: dict[tuple[str, str], tuple[Callable[[dict], Optional[str]], str]] = {
    ("rwkv7", "gpu"): (_rwkv7_gpu_by_shape,
        "H200, one machine, bf16 fwd+bwd (fwd), the chunked pair with bfloat16 checkpoints: "
        "B=8 T=4096 H=64 K=64 ffi 11.79 ms (4.02), triton 15.01 (3.93), fla 13.48; B=8 T=4096 "
        "H=32 K=128 ffi 17.46 (5.34), triton 17.77 (6.02), fla 15.36; 16 packed sequences of "
        "32768 tokens, H=64 K=64 ffi 15.14 (5.77), triton 15.91 (4.51); B=1 T=65536 H=32 (32 "
        "sequence-heads) ffi 68.1 (23.9), triton 20.8 (8.04). H100, one machine, float32 "
        "checkpoints: K=64 ffi 11.84, triton 15.77, fla 15.95; K=128 ffi 18.03, triton 18.95; "
        "packed ffi 15.02, triton 16.50; B=1 T=65536 ffi 70.7, triton 21.0. K=128 is the close "
        "call (2% on the H200). Defaults optimise forward+backward: a forward alone is slower "
        "than triton's at K=64 and packed"),
}


def default_order(op: str, where: str) -> tuple[str, ...]:
    """The backends ``op`` tries by default on platform ``where``, fastest measured first."""
    return DEFAULTS.get((op, where), (FALLBACK_ORDER,))[0]


def register(name: str, module: str, summary: str, probe: Callable[[str], Optional[str]],
             float32_tolerance: tuple[float, float] = (1e-5, 1e-4),
             forward_mode_ad: bool = False, float64: bool = False) -> None:
    _BACKENDS[name] = Backend(name, module, summary, probe, float32_tolerance, forward_mode_ad,
                              float64)


def tolerance(name: str, dtype) -> tuple[float, float]:
    """(forward, gradients) relative error that backend ``name`` may have for ``dtype`` inputs
    (float64: on the backends that compute in float64; the others refuse float64 inputs)."""
    dtype = jax.numpy.dtype(dtype)
    if dtype == jax.numpy.float64:
        return FLOAT64_TOLERANCE, FLOAT64_TOLERANCE
    if dtype != jax.numpy.float32:
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


def supports_forward_mode(name: str) -> bool:
    """Whether jax.jvp / jacfwd / hessian work through backend ``name``."""
    return _BACKENDS[name].forward_mode_ad


def computes_float64(name: str) -> bool:
    """Whether backend ``name`` computes float64 inputs in float64 (else it refuses them)."""
    return _BACKENDS[name].float64


def _function(name: str, op: str) -> Callable:
    fn = getattr(importlib.import_module(_BACKENDS[name].module), op)
    return fn if supports_forward_mode(name) else _refusing_forward_mode(op, name, fn)


def _runs(name: str, op: str, where: str) -> bool:
    return unavailable_reason(name, where) is None and implements(name, op)


def preference() -> Optional[str]:
    """The backend preferred through the environment, or None."""
    for var in ("RWKV_JAX_BACKEND", "KERNEL_TYPE"):
        value = os.environ.get(var, "").strip().lower()
        if value:
            name = "ffi" if var == "KERNEL_TYPE" and value == "cuda" else value
            if name not in _BACKENDS:
                raise ValueError(f"unknown backend {value!r} (from {var}={value}); known: "
                                 f"{', '.join(_BACKENDS)}, and for KERNEL_TYPE cuda (= ffi)")
            return name
    return None


def resolve(op: str, backend: Optional[str], dtype=None,
            shape: Optional[dict] = None) -> tuple[str, Callable]:
    """The (name, function) that runs ``op`` on inputs of ``dtype`` (None: any): the explicit
    ``backend`` (strict), else the environment's preference where it runs ``op`` here, else the
    default, per shape class where ``shape`` is given (SHAPE_DEFAULTS) and per op; for float64
    inputs only backends that compute in float64."""
    where = platform()
    wide = dtype is not None and jax.numpy.dtype(dtype) == jax.numpy.float64
    fits = lambda name: _runs(name, op, where) and (not wide or computes_float64(name))
    if backend is None:
        preferred = preference()
        if preferred is not None and fits(preferred):
            return preferred, _function(preferred, op)
        by_shape = SHAPE_DEFAULTS.get((op, where))
        first = None if by_shape is None or shape is None or wide else by_shape[0](shape)
        if first is not None and fits(first):
            return first, _function(first, op)
        # (float64: any backend that computes it, where the default order has none)
        for name in (*default_order(op, where), *(_BACKENDS if wide else ())):
            if name in _BACKENDS and fits(name):
                return name, _function(name, op)
        what = " in float64" if wide else ""
        raise BackendUnavailableError(f"no backend implements {op}{what} on platform {where!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(_BACKENDS)}")
    reason = unavailable_reason(backend, where)
    if reason is not None:
        raise BackendUnavailableError(f"backend {backend!r} cannot run here: {reason}")
    if not implements(backend, op):
        have = [n for n in _BACKENDS if _runs(n, op, where)]
        raise BackendUnavailableError(
            f"backend {backend!r} does not implement {op}; backends that do here: {', '.join(have)}"
        )
    if wide and not computes_float64(backend):
        able = [n for n in _BACKENDS if fits(n)]
        raise TypeError(
            f"{op} on backend {backend!r} got float64 inputs, which it would compute in float32 "
            f"or less; backends that compute float64 in float64: {', '.join(map(repr, able))} "
            f"(pass backend=..., or cast the inputs to float32)")
    return backend, _function(backend, op)


def _forward_mode(x) -> bool:
    """Whether forward-mode AD (jax.jvp, jacfwd, hessian) is differentiating ``x``: a JVP tracer
    somewhere in its chain of tracers (under vmap, jit, grad...). A JVP tracer whose tangent is
    a partial-evaluation tracer is reverse mode (jax.grad without direct linearization)."""
    while isinstance(x, jax.core.Tracer):
        if isinstance(x, ad.JVPTracer) and not isinstance(x.tangent, pe.JaxprTracer):
            return True
        x = getattr(x, "primal", getattr(x, "val", None))
    return False


def _refusing_forward_mode(op: str, name: str, fn: Callable) -> Callable:
    """``fn`` that raises one clear error under forward-mode AD, before any kernel is traced."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if any(_forward_mode(x) for x in jax.tree.leaves((args, kwargs))):
            able = [n for n in _BACKENDS if supports_forward_mode(n) and _runs(n, op, platform())]
            raise TypeError(
                f"{op} on backend {name!r} does not support forward-mode autodiff (jax.jvp, "
                f"jax.jacfwd, jax.hessian): its kernels define only a reverse-mode rule "
                f"(custom_vjp). Backends that support it: {', '.join(map(repr, able))} "
                f"(pass backend=...)")
        return fn(*args, **kwargs)

    return call


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
         "lax.scan over time, checkpointed blocks; the readable reference", lambda p: None,
         forward_mode_ad=True, float64=True)
register("chunked", "rwkv_jax.backends.chunked",
         "chunked WY/UT-transform algorithm in jax.numpy", lambda p: None,
         float32_tolerance=(2e-3, 2e-3), forward_mode_ad=True, float64=True)
register("triton", "rwkv_jax.backends.triton",
         "chunked Triton kernels (jax-triton on GPU, Triton's interpreter on CPU)",
         lambda p: importlib.import_module("rwkv_jax.backends._triton_probe").unavailable_reason(p),
         float32_tolerance=(2e-3, 2e-3))
register("ffi", "rwkv_jax.backends.ffi", "compiled C++ (CPU) and CUDA kernels through the XLA FFI",
         lambda p: importlib.import_module("rwkv_jax.backends.ffi").unavailable(p))

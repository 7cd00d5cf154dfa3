"""Random inputs with realistic distributions for every op, and the timing and memory helpers
shared by ``rwkv-jax check``, ``rwkv-jax bench`` and ``benchmarks/``.

A ``Case`` holds the differentiable inputs of one op call (keyword name -> numpy array, state
included) and its other keyword options. The same case runs through the public op (any
backend) or through a backend function directly (the float64 reference), so everything here
is keyed by the op's argument names.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

SEQUENCE_OPS = ("rwkv7", "rwkv6", "rwkv4", "gated_linear_attention")
STEP_OPS = ("rwkv7_step", "rwkv6_step")

# Size presets (B, T, H, K) for the benchmarks; "medium" is the CPU baseline of BENCHMARKS.md,
# "large" the GPU baseline, "xl" the memory test of a training call.
PRESETS = {
    "tiny": (1, 64, 2, 64),
    "small": (1, 256, 4, 64),
    "medium": (1, 1024, 4, 64),
    "large": (8, 1024, 32, 64),
    "xl": (8, 4096, 64, 64),
}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass
class Case:
    op: str
    arrays: dict  # differentiable inputs: keyword name -> numpy array (the state is float32)
    options: dict  # non-differentiable keyword options (scale, state_indices, reverse)
    tokens: int  # tokens processed by one call, for tokens/s
    shape: tuple  # (B, T, H, K) of the call

    def as_dtype(self, dtype) -> dict:
        """The arrays with every non-state input cast to ``dtype`` (the state stays float32)."""
        return {n: (x if n in ("initial_state", "state") else x.astype(dtype))
                for n, x in self.arrays.items()}


def cuda_event_ms(fn, repeats, max_seconds, before=None) -> list[float]:
    """The milliseconds of calls of ``fn()`` (torch work on the GPU) between CUDA events around
    each: ``repeats`` of them (at least 3), fewer once ``max_seconds`` have passed after the
    third. ``before`` runs ahead of each call, untimed."""
    import torch
    times, started = [], time.perf_counter()
    while len(times) < max(repeats, 3):
        if before is not None:
            before()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
        if len(times) >= 3 and time.perf_counter() - started > max_seconds:
            break
    return times


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def make_case(op: str, batch: int, length: int, heads: int, head_size: int, *, seed: int = 0,
              slots: int | None = None) -> Case:
    """Float32 inputs of ``op`` at ``[B, T, H, K]`` (K == V), drawn as real models produce them.

    RWKV-7: ``w = -exp(-0.5) * sigmoid(x)``, ``a = -kk``, ``b = kk * iclr`` with ``kk`` an
    L2-normalised key; RWKV-6: ``w = -exp(x)`` from a decay-speed range; RWKV-4:
    ``w = -exp(time_decay)``; gated linear attention: log-sigmoid gates. Step ops advance rows of
    a state pool of ``slots`` (default B + 1) picked in reverse order.
    """
    rng = np.random.default_rng(seed)
    bthk = (batch, length, heads, head_size)

    def normal(*shape, std=1.0):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    options: dict = {}
    if op in ("rwkv7", "rwkv7_step"):
        kk = normal(*bthk)
        kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
        iclr = _sigmoid(normal(*bthk))
        arrays = dict(r=normal(*bthk), w=-np.exp(-0.5) * _sigmoid(normal(*bthk)), k=normal(*bthk),
                      v=normal(*bthk), a=-kk, b=kk * iclr)
        options["scale"] = 1.0
    elif op in ("rwkv6", "rwkv6_step"):
        arrays = dict(r=normal(*bthk), k=normal(*bthk), v=normal(*bthk),
                      w=-np.exp(rng.uniform(-3.0, 0.0, bthk)), u=normal(heads, head_size, std=0.5))
        options["scale"] = 1.0
    elif op == "gated_linear_attention":
        arrays = dict(q=normal(*bthk), k=normal(*bthk), v=normal(*bthk),
                      g=_log_sigmoid(normal(batch, length, heads)) / 16,
                      g_gamma=-np.exp(rng.uniform(-5.0, -2.0, heads)),
                      gk=_log_sigmoid(normal(*bthk)) / 16, gv=_log_sigmoid(normal(*bthk)) / 16)
        options.update(scale=head_size ** -0.5, reverse=False)
    elif op == "rwkv4":
        channels = heads * head_size
        bb = rng.uniform(0.5, 2.0, (batch, channels))  # running sums: bb > 0, |aa| <~ bb |v|
        arrays = dict(w=-np.exp(rng.uniform(-5.0, 2.0, channels)), u=normal(channels, std=0.5) - 0.6,
                      k=normal(batch, length, channels), v=normal(batch, length, channels),
                      initial_state=np.stack([bb * rng.standard_normal(bb.shape) * 0.5, bb,
                                              rng.standard_normal(bb.shape)], axis=-1))
    else:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(SEQUENCE_OPS + STEP_OPS)}")

    if op in STEP_OPS:
        slots = batch + 1 if slots is None else slots
        arrays["state"] = normal(slots, heads, head_size, head_size, std=0.5)
        options["state_indices"] = np.arange(slots - 1, slots - 1 - batch, -1, dtype=np.int32)
    elif op != "rwkv4":
        arrays["initial_state"] = normal(batch, heads, head_size, head_size, std=0.5)
    arrays = {n: np.asarray(x, np.float32) for n, x in arrays.items()}
    return Case(op, arrays, options, tokens=batch * length, shape=bthk)


def vjp_function(forward: Callable) -> Callable:
    """``(xs, cotangents) -> (outputs, gradients of every x)`` for ``forward(*xs)``."""
    def run(xs, cotangents):
        outputs, pullback = jax.vjp(forward, *xs)
        return outputs, pullback(cotangents)
    return run


def bind(fn: Callable, names, options: dict) -> Callable:
    """``fn(**{names: xs}, **options)`` as a function of the positional arrays ``xs``."""
    return lambda *xs: fn(**dict(zip(names, xs)), **options)


def random_cotangents(forward: Callable, xs, seed: int = 1):
    """Random cotangents shaped and typed like ``forward(*xs)``'s outputs (numpy)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(forward, *xs)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)


def compiled_peak_bytes(compiled) -> int | None:
    """XLA's own account of the memory one call of ``compiled`` needs: arguments + outputs +
    temporaries - buffers aliased between them (None where the platform does not report it)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


@dataclasses.dataclass
class Timing:
    median_s: float
    min_s: float
    repeats: int
    peak_bytes: int | None


def time_function(fn: Callable, args, *, repeats: int = 20, warmup: int = 2,
                  max_seconds: float = 10.0) -> Timing:
    """Compile ``jax.jit(fn)`` for ``args``, run it ``warmup`` times, then time up to
    ``repeats`` calls (at least 3, fewer than ``repeats`` once ``max_seconds`` have passed),
    each waited for with ``block_until_ready`` so the time covers the device work."""
    compiled = jax.jit(fn).lower(*args).compile()
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < max(repeats, 1):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
        if len(times) >= 3 and time.perf_counter() - started > max_seconds:
            break
    return Timing(statistics.median(times), min(times), len(times), compiled_peak_bytes(compiled))


def device_peak_bytes() -> int | None:
    """The default device's peak allocation since the process started (GPU/TPU; None on CPU).
    JAX cannot reset it, so it is per case only in a process that runs one case."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def bytes_moved(fn: Callable, args) -> int:
    """The least memory traffic of one call: every input read once and every output written
    once (bytes). Achieved bandwidth = this / time: a lower bound on what the kernel moved."""
    outputs = jax.eval_shape(fn, *args)
    sizes = [np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
             for x in jax.tree.leaves((args, outputs))]
    return int(sum(sizes))


# Peak memory bandwidth (bytes/s) of GPUs by the start of jax's device_kind, from the vendors'
# data sheets; the achieved-bandwidth plot draws it as the ceiling.
PEAK_BANDWIDTH = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100": 3.35e12,  # SXM (HBM3)
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100": 1.555e12,
    "NVIDIA L4": 0.3e12,
}


def peak_bandwidth(device_kind: str) -> float | None:
    """The peak bandwidth of ``device_kind`` (longest matching name first), None if unknown."""
    for name in sorted(PEAK_BANDWIDTH, key=len, reverse=True):
        if device_kind.startswith(name):
            return PEAK_BANDWIDTH[name]
    return None


# ---------------------------------------------------------------------------------------------
# fla (flash-linear-attention, torch + Triton) on the same inputs, where it is installed and a
# CUDA device is there: its number beside ours. Only ops whose math fla computes exactly.

FLA_OPS = {
    # op -> (fla module, function, our argument names in fla's positional order)
    "rwkv7": ("fla.ops.rwkv7", "chunk_rwkv7", ("r", "w", "k", "v", "a", "b")),
    "rwkv6": ("fla.ops.rwkv6", "chunk_rwkv6", ("r", "k", "v", "w", "u")),
}
# fla's fastest RWKV-7 configuration (TF32 tensor cores, in-chunk parts stored for the backward),
# valid only while every log decay is at least its lower bound; make_case's RWKV-7 decays are.
FLA_RWKV7_LOWER_BOUND = -0.6065
FLA_RWKV7_FASTEST = dict(chunk_size=64, safe_gate=True, lower_bound=FLA_RWKV7_LOWER_BOUND,
                         disable_recompute=True)


def fla_unavailable_reason() -> str | None:
    """Why fla cannot be timed here (None when it can)."""
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        return "fla is not installed"
    if importlib.util.find_spec("torch") is None:
        return "fla needs torch"
    import torch
    if not torch.cuda.is_available():
        return "fla needs a CUDA device visible to torch"
    return None


def time_fla(case: Case, dtype_name: str, *, repeats: int, max_seconds: float) -> dict:
    """Median ms of fla's kernel for ``case`` (its fastest configuration where the inputs allow):
    ``{"fwd": ms, "fwd+bwd": ms}`` (torch's CUDA events around each call; the first calls
    compile and autotune, untimed)."""
    import importlib
    import torch
    module, function, names = FLA_OPS[case.op]
    fla_op = getattr(importlib.import_module(module), function)
    dtype = getattr(torch, dtype_name)
    arrays = case.as_dtype(np.float32)  # cast in torch: numpy has no bfloat16
    tensors = {n: torch.from_numpy(np.ascontiguousarray(x)).cuda() for n, x in arrays.items()}
    tensors = {n: (t if n == "initial_state" else t.to(dtype)).requires_grad_(True)
               for n, t in tensors.items()}
    options = dict(scale=case.options.get("scale", 1.0), output_final_state=True)
    if case.op == "rwkv7" and arrays["w"].min() >= FLA_RWKV7_LOWER_BOUND:
        options.update(FLA_RWKV7_FASTEST)

    def forward():
        return fla_op(*(tensors[n] for n in names), initial_state=tensors["initial_state"],
                      **options)

    out, state = forward()
    d_out, d_state = torch.randn_like(out), torch.randn_like(state)

    def forward_backward():
        out, state = forward()
        torch.autograd.backward((out, state), (d_out, d_state))
        for t in tensors.values():
            t.grad = None

    def median_ms(fn):
        for _ in range(2):
            fn()
        return statistics.median(cuda_event_ms(fn, repeats, max_seconds))

    with torch.no_grad():
        fwd = median_ms(forward)
    return {"fwd": fwd, "fwd+bwd": median_ms(forward_backward)}

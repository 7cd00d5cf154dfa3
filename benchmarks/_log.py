"""The GPU scripts' log: every line is printed and, once ``open_log`` has named a file, written
there too (flushed, so a run cut short keeps what it printed). Also their plain timing, their
peak-memory measures and their per-kernel profile."""

import statistics
import time

_file = None


def open_log(path):
    global _file
    _file = open(path, "w")


def log(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if _file:
        _file.write(line + "\n")
        _file.flush()


def relative_error(x, ref):
    """||x - ref|| / ||ref|| in float64; inf when x has a non-finite value."""
    import numpy as np
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def jax_peak_bytes(fn, *args):
    """Arguments + outputs + temporaries of the compiled program (what it holds at its peak)."""
    stats = fn.lower(*args).compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def torch_peak_bytes(fns, leaves, held):
    """Each of ``fns``' peak memory on the torch allocator, plus the tensors ``held`` (inputs
    and cotangents), the leaves' gradients cleared before each call."""
    import torch
    held_bytes = sum(t.numel() * t.element_size() for t in held)
    peaks = []
    for fn in fns:
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base + held_bytes)
    return peaks


def median_seconds(fn, *args, reps=20):
    """Median seconds of ``reps`` calls of ``fn(*args)``, each waited for, after one untimed
    call (it compiles)."""
    import jax
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_kernels(fn, before=None, calls=10):
    """GPU time per kernel name and call of ``fn`` (which waits for its work; ``before`` runs
    ahead of each call, untimed), the largest first, as one line. torch's profiler records
    through CUPTI every kernel of the process, fla's and those XLA launches for JAX alike."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        ms = getattr(event, "device_time_total", 0) / 1e3 / calls
        if ms > 0.005:
            times[event.key[:60]] = ms
    return ", ".join(f"{name} {ms:.3f}" for name, ms in
                     sorted(times.items(), key=lambda item: -item[1])[:14])

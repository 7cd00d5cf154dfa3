"""The log and plain timing of benchmarks/gpu_causal_nan.py (the topic scripts use
benchmarks/runner.py): every line is printed and, once ``open_log`` has named a file, written
there too (flushed, so a run cut short keeps what it printed)."""

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

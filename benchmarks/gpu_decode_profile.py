"""Where one decode step of ``rwkv_jax.nn.Generator`` spends its time, kernel by kernel.

    source benchmarks/gpu_env.sh
    python benchmarks/gpu_decode_profile.py --size 1.5b --backend ffi --batch 1

Decodes ``--steps`` tokens in one compiled call under JAX's profiler, then reads the trace
(``jax.profiler.ProfileData``) and prints, for the device's kernels: how many ran per step, the
busy time per step (the sum of kernel durations), the wall time per step, and the kernels that
take the most time, grouped by name. Wall time well above busy time means the GPU waits between
kernels (launch latency), not for memory or arithmetic. Off the GPU it runs a tiny model and
reports the host's XLA ops instead, as a smoke test.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.profiler import ProfileData  # noqa: E402

from gpu_generate import random_model  # noqa: E402
from rwkv_jax import nn as rnn  # noqa: E402


def kernel_events(trace_dir):
    """(name, start_ns, duration_ns) of every event on the device planes (the host's XLA ops
    where there is no device plane)."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    data = ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    events = []
    for plane in planes or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if planes and not line.name.startswith("Stream"):
                continue
            events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return events


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=None, help="0.1b, 1.5b (GPU default) or tiny")
    parser.add_argument("--backend", default=None, help="the step kernels' backend")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    size = args.size or ("1.5b" if gpu else "tiny")
    vocab = 65536 if gpu else 512
    model = random_model(size, vocab)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, 16).tolist() for _ in range(args.batch)]
    engine = rnn.Generator(model, max_batch=args.batch, steps_per_call=args.steps,
                           backend=args.backend, early_exit=False)
    greedy = rnn.Sampling(temperature=0)
    run = lambda: engine.generate(prompts, max_new_tokens=args.steps, sampling=greedy)
    run()  # compiles
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir)
    started = time.perf_counter()
    result = run()
    wall = time.perf_counter() - started
    jax.profiler.stop_trace()
    events = kernel_events(trace_dir)
    steps = args.steps
    busy = sum(d for _, _, d in events)
    span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) if events else 0
    print(f"{size}, batch {args.batch}, backend {args.backend or 'default'}, {steps} steps in "
          f"{result.decode_calls} decode calls; device {jax.devices()[0].device_kind}")
    print(f"per step: {len(events) / steps:.0f} kernels, busy {busy / steps / 1e6:.3f} ms, "
          f"trace span {span / steps / 1e6:.3f} ms, decode {1e3 * result.decode_seconds / steps:.3f}"
          f" ms (whole generate call {1e3 * wall / steps:.3f} ms)")
    by_name = collections.defaultdict(lambda: [0, 0])
    for name, _, duration in events:
        by_name[name][0] += 1
        by_name[name][1] += duration
    print(f"{'kernel':70s} {'per step':>9s} {'us/step':>9s} {'us each':>8s}")
    for name, (count, total) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{name[:70]:70s} {count / steps:9.1f} {total / steps / 1e3:9.1f} "
              f"{total / count / 1e3:8.2f}")


if __name__ == "__main__":
    main()

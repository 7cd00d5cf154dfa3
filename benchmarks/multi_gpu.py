"""RWKV-7 forward + backward on one GPU against data and sequence parallelism over several.

    python benchmarks/multi_gpu.py                 # the issue's shapes, on 2 GPUs
    python benchmarks/multi_gpu.py --tiny          # tiny shapes on 2 simulated CPU devices
    python benchmarks/multi_gpu.py --processes 2   # data / sequence as 2 processes, 1 GPU each

For each shape ``BxTxHxK`` (bfloat16 inputs by default) and each mode

    1 device    the op itself on the first device
    data        rwkv_jax.shard(..., batch_axis=) over --devices devices (needs B divisible)
    sequence    rwkv_jax.shard(..., seq_axis=) over --devices devices

it times ``jax.jit(jax.vjp(...))`` (the gradient of every input for a random output
cotangent) as the median of --repeats runs after a warm-up, each ending in
``block_until_ready``, and reads each device's peak memory from ``device.memory_stats()``
(inputs included). Every mode runs in its own process, so peaks do not mix and an
out-of-memory error ends one row only. With ``--processes P`` the data and sequence modes run
as P processes of this host joined by ``jax.distributed`` (the multi-host recipe of the README,
on one host: each process has ``devices / P`` GPUs, or simulated CPU devices with gloo
collectives), and the row's time is the slowest process's. On CPU, where ``memory_stats()`` is
unavailable, the memory column is XLA's compiled estimate per device (arguments + outputs +
temporaries).
Prints a markdown table; ``--json`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MODES = ("1 device", "data", "sequence")
ISSUE_SHAPES = ("8x4096x64x64", "1x131072x64x64")
TINY_SHAPES = ("4x64x2x16", "1x256x2x16")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", help=f"BxTxHxK (default {' '.join(ISSUE_SHAPES)})")
    parser.add_argument("--devices", type=int, default=2, help="devices for data / sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--backend", default=None, help="rwkv_jax backend (default: automatic)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true",
                        help=f"shapes {' '.join(TINY_SHAPES)} on simulated CPU devices")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--processes", type=int, default=1,
                        help="run data / sequence as this many processes (jax.distributed)")
    parser.add_argument("--one", nargs=2, metavar=("MODE", "SHAPE"), help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.devices % args.processes:
        parser.error(f"--devices {args.devices} must split evenly over --processes "
                     f"{args.processes}")
    if args.shapes is None:
        args.shapes = TINY_SHAPES if args.tiny else ISSUE_SHAPES
    return args


def _shape(text):
    batch, steps, heads, key = (int(n) for n in text.lower().split("x"))
    return batch, steps, heads, key


def measure(mode, shape, args):
    """One row: runs in a process of its own (see ``main``)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

    if args.coordinator:   # one of --processes processes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.processes, process_id=args.process_id)

    import rwkv_jax
    import rwkv_jax.backends

    batch, steps, heads, key = _shape(shape)
    dtype = jnp.dtype(args.dtype)
    op = functools.partial(rwkv_jax.rwkv7, backend=args.backend, output_final_state=False)
    if mode == "1 device":
        devices = jax.devices()[:1]
        placement = SingleDeviceSharding(devices[0])
        fn = op
    else:
        devices = jax.devices()[:args.devices]
        if len(devices) < args.devices:
            raise SystemExit(f"needs {args.devices} devices, found {len(devices)}")
        axis = "data" if mode == "data" else "seq"
        mesh = jax.make_mesh((args.devices,), (axis,), axis_types=(AxisType.Auto,),
                             devices=devices)
        placement = NamedSharding(mesh, PartitionSpec(*((axis,) if axis == "data"
                                                        else (None, axis))))
        fn = rwkv_jax.shard(op, mesh, **{f"{'batch' if axis == 'data' else 'seq'}_axis": axis})

    @functools.partial(jax.jit, out_shardings=placement)
    def inputs(seed):
        """Model-range RWKV-7 inputs and an output cotangent, made where they are used."""
        keys = jax.random.split(jax.random.PRNGKey(seed), 6)
        normal = lambda i: jax.random.normal(keys[i], (batch, steps, heads, key), jnp.float32)
        kk = normal(2) / jnp.linalg.norm(normal(2), axis=-1, keepdims=True)
        w = -jnp.exp(-0.5) * jax.nn.sigmoid(normal(1))
        b = kk * jax.nn.sigmoid(normal(4))
        return tuple(x.astype(dtype) for x in (normal(0), w, normal(2), normal(3), -kk, b,
                                                normal(5)))

    @jax.jit
    def forward_backward(r, w, k, v, a, b, do):
        _, pull = jax.vjp(fn, r, w, k, v, a, b)
        return pull((do, None))

    x = inputs(0)
    compiled = forward_backward.lower(*x).compile()
    jax.block_until_ready(compiled(*x))      # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*x))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)

    local = [d for d in devices if d.process_index == jax.process_index()]
    stats = [d.memory_stats() for d in local]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        peaks = [s["peak_bytes_in_use"] for s in stats]
        source = "memory_stats"
    else:
        m = compiled.memory_analysis()
        peaks = [m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes] * len(local)
        source = "compiled estimate"
    return dict(mode=mode, shape=shape, dtype=args.dtype, devices=len(devices),
                processes=jax.process_count(),
                platform=devices[0].platform, device_kind=devices[0].device_kind,
                backend=rwkv_jax.backends.resolve("rwkv7", args.backend)[0],
                milliseconds=1e3 * seconds,
                all_milliseconds=[1e3 * t for t in times],
                tokens_per_second=batch * steps / seconds,
                peak_bytes_per_device=peaks, memory_source=source, error=None)


def _run_one(mode, shape, args, argv):
    """Run one row in fresh processes (their own memory peaks): one, or --processes of them
    joined by jax.distributed for data / sequence. Returns the row."""
    processes = 1 if mode == "1 device" else args.processes
    env = dict(os.environ)
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                            f"{args.devices // processes}").strip()
    command = [sys.executable, __file__, *argv, "--one", mode, shape]
    if processes == 1:
        workers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)]
    else:
        with socket.socket() as s:   # a free port for the coordinator
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        per_process = args.devices // processes
        workers = []
        for i in range(processes):
            own = dict(env)
            if not args.tiny:   # this process's GPUs
                own["CUDA_VISIBLE_DEVICES"] = ",".join(
                    str(g) for g in range(i * per_process, (i + 1) * per_process))
            workers.append(subprocess.Popen(
                command + ["--coordinator", coordinator, "--process-id", str(i)], env=own,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = [w.communicate() for w in workers]   # small outputs: no pipe fills up
    rows = []
    for (stdout, stderr), worker in zip(done, workers):
        row = next((json.loads(line) for line in reversed(stdout.splitlines())
                    if line.startswith("{")), None)
        if row is None:
            error = (stderr.strip().splitlines() or [f"exited with code {worker.returncode}"])[-1]
            return dict(mode=mode, shape=shape, error=error[:200])
        rows.append(row)
    if len(rows) == 1:
        return rows[0]
    slowest = max(rows, key=lambda r: r["milliseconds"])
    peaks = [p for r in rows for p in r["peak_bytes_per_device"]]
    return dict(slowest, peak_bytes_per_device=peaks)


def _gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def table(rows):
    lines = ["| shape BxTxHxK | mode | devices | fwd+bwd ms (median) | tokens/s | vs 1 device "
             "| peak memory per device |",
             "|---|---|---|---|---|---|---|"]
    single = {r["shape"]: r for r in rows if r["mode"] == "1 device" and not r.get("error")}
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['shape']} | {r['mode']} | | {r['error']} | | | |")
            continue
        base = single.get(r["shape"])
        speedup = f"{base['milliseconds'] / r['milliseconds']:.2f}x" if base else ""
        memory = " / ".join(_gib(p) for p in r["peak_bytes_per_device"])
        if r["memory_source"] != "memory_stats":
            memory += " (compiled estimate)"
        devices = (f"{r['devices']} ({r['processes']} processes)" if r.get("processes", 1) > 1
                   else r["devices"])
        lines.append(f"| {r['shape']} | {r['mode']} | {devices} | {r['milliseconds']:.2f} "
                     f"| {r['tokens_per_second']:,.0f} | {speedup} | {memory} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one, args)))
        return None
    rows = []
    for shape in args.shapes:
        batch = _shape(shape)[0]
        for mode in MODES:
            if mode == "data" and batch % args.devices:
                rows.append(dict(mode=mode, shape=shape,
                                 error=f"n/a: B={batch} does not split over {args.devices}"))
                continue
            rows.append(_run_one(mode, shape, args, argv))
            print(f"{shape} {mode}: " + (rows[-1].get("error") or
                                         f"{rows[-1]['milliseconds']:.2f} ms"), file=sys.stderr)
    first = next((r for r in rows if not r.get("error")), None)
    if first:
        print(f"\nRWKV-7 forward + backward, {first['dtype']}, {first['platform']} "
              f"({first['device_kind']}), backend {first['backend']}, median of {args.repeats}\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

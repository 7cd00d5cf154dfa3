"""Forward + backward on one GPU against data and sequence parallelism over several.

    python benchmarks/multi_device.py --devices 2 4 --backend triton   # the issue's table, 1-4 GPUs
    python benchmarks/multi_device.py --tiny --devices 2 4              # tiny, simulated CPU devices
    python benchmarks/multi_device.py --devices 2 4 --processes 2       # each count as 2 processes

For each op (``--ops``: rwkv7, rwkv6, gated_linear_attention with gk), shape ``BxTxHxK``
(bfloat16 inputs by default; ``BxTxHxK:mode`` for one mode only: the defaults are B=8 T=4096
over the batch and B=1 T=131072 over the sequence, H=64 K=64) and mode

    1 device    the op itself on the first device
    data        rwkv_jax.shard(..., batch_axis=) over n devices (B divisible by n)
    sequence    rwkv_jax.shard(..., seq_axis=) over n devices (T divisible by n)

it times ``jax.jit(jax.vjp(...))`` (the gradient of every input for a random output
cotangent) as the median of --repeats runs after a warm-up, each ending in
``block_until_ready``. Each device count (1, then each of --devices) runs in its own process,
every row of that count one after the other with the same inputs. Per-device memory is XLA's
compiled estimate of the program (arguments + outputs + temporaries, the Triton kernels'
buffers included), so rows of one process do not mix. The check column compares each row's
outputs and gradients with the 1-device row's: for every array ``x`` and three fixed probe
arrays ``P``, ``<x, P>`` has the spread of ``|x|``, so ``|<x, P> - <x1, P>| / |x1|`` estimates
the relative difference ``|x - x1| / |x1|``; the column shows the largest estimate over the
arrays (bf16 inputs: the backends' contract is 1e-2 each against float64). With
``--processes P`` each count n > 1 runs as P processes of this host joined by
``jax.distributed`` (the README's multi-host recipe on one host: n / P GPUs each, or simulated
CPU devices with gloo collectives); a row's time is the slowest process's, its memory the
largest of the processes' estimates (each one's in ``process_peak_bytes_per_device``). Prints
a markdown table; ``--json`` appends the rows (benchmarks/runner.py's JSON lines).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402

MODES = ("1 device", "data", "sequence")
OPS = ("rwkv7", "rwkv6", "gated_linear_attention")
# BxTxHxK, optionally ":mode" to run that mode only (else every mode of --modes that splits it)
ISSUE_SHAPES = ("8x4096x64x64:data", "1x131072x64x64:sequence")
TINY_SHAPES = ("4x64x2x16", "1x256x2x16")
PROJECTIONS = 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--shapes", nargs="+",
                        help=f"BxTxHxK[:mode] (default {' '.join(ISSUE_SHAPES)})")
    parser.add_argument("--modes", nargs="+", default=list(MODES[1:]), choices=MODES[1:])
    parser.add_argument("--devices", type=int, nargs="+", default=[2],
                        help="device counts for data / sequence (each against 1 device)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--backend", default=None, help="rwkv_jax backend (default: automatic)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true",
                        help=f"shapes {' '.join(TINY_SHAPES)} on simulated CPU devices")
    parser.add_argument("--json", metavar="PATH",
                        help="append every row to this file, one JSON object per line")
    parser.add_argument("--processes", type=int, default=1,
                        help="run each device count > 1 as this many processes (jax.distributed)")
    parser.add_argument("--one", type=int, metavar="DEVICES", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1 or any(n % args.processes for n in args.devices if n > 1):
        parser.error(f"--processes {args.processes} must be positive and divide every --devices "
                     f"count above 1 (got {' '.join(map(str, args.devices))})")
    if args.shapes is None:
        args.shapes = TINY_SHAPES if args.tiny else ISSUE_SHAPES
    return args


def _shape(text):
    batch, steps, heads, key = (int(n) for n in text.split(":")[0].lower().split("x"))
    return batch, steps, heads, key


# The inputs of each op, the first ones positional.
INPUTS = {"rwkv7": (tuple("rwkvab"), 6), "rwkv6": (tuple("rkvwu"), 5),
          "gated_linear_attention": (("q", "k", "v", "gk"), 3)}


def _make_inputs(op, seed, batch, steps, heads, key, dtype):
    """Model-range inputs of ``op`` and an output cotangent (rwkv_jax._bench.make_case's
    distributions, drawn on the device: the long shapes are GBs on the host)."""
    import jax
    import jax.numpy as jnp

    shape = (batch, steps, heads, key)
    # One draw for every array: each separate draw costs its own compile (seconds on a CPU).
    draws = iter(jax.random.normal(jax.random.PRNGKey(seed), (8,) + shape, jnp.float32))
    normal = lambda: next(draws)
    if op == "rwkv7":
        kk = normal()
        kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
        x = dict(r=normal(), w=-jnp.exp(-0.5) * jax.nn.sigmoid(normal()), k=normal(),
                 v=normal(), a=-kk, b=kk * jax.nn.sigmoid(normal()))
    elif op == "rwkv6":
        # (a normal's distribution function makes it uniform: w's log decay speed in [-3, 0])
        x = dict(r=normal(), k=normal(), v=normal(),
                 w=-jnp.exp(-3.0 * jax.scipy.special.ndtr(normal())),
                 u=0.5 * normal()[0, 0])
    else:
        x = dict(q=normal(), k=normal(), v=normal(), gk=jax.nn.log_sigmoid(normal()) / 16)
    x = {n: y.astype(dtype) for n, y in x.items()}
    return x, normal().astype(dtype)


def _probe(shape, seed):
    """A fixed array of mean 0 and variance 1 (uniform in [-sqrt 3, sqrt 3]) from an integer
    hash of each element's index and ``seed``: the same under every sharding, and cheap to
    compile (a PRNG's draw compiles for seconds on a CPU)."""
    import jax.numpy as jnp
    index = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    h = index * jnp.uint32(0x9E3779B1) + jnp.uint32((seed * 0x85EBCA77) % 2**32)
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    h = h ^ (h >> 16)
    return (h.astype(jnp.float32) / 2.0**32 - 0.5) * (2 * 3 ** 0.5)


def measure(mode, shape, args, op="rwkv7", devices=None):
    """One row, in this process: ``devices`` (default ``args.devices[0]``) for data / sequence."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec, SingleDeviceSharding

    import rwkv_jax
    import rwkv_jax.backends

    batch, steps, heads, key = _shape(shape)
    dtype = jnp.dtype(args.dtype)
    base = functools.partial(getattr(rwkv_jax, op), backend=args.backend,
                             output_final_state=False)
    if mode == "1 device":
        used = jax.devices()[:1]
        placement = lambda name: SingleDeviceSharding(used[0])
        fn = base
    else:
        count = args.devices[0] if devices is None else devices
        used = jax.devices()[:count]
        if len(used) < count:
            raise SystemExit(f"needs {count} devices, found {len(used)}")
        axis = "data" if mode == "data" else "seq"
        mesh = jax.make_mesh((count,), (axis,), axis_types=(AxisType.Auto,), devices=used)
        split = (axis,) if axis == "data" else (None, axis)
        placement = lambda name: NamedSharding(mesh, PartitionSpec(*(() if name == "u"
                                                                     else split)))
        fn = rwkv_jax.shard(base, mesh, **{f"{'batch' if axis == 'data' else 'seq'}_axis": axis})

    names, positional = INPUTS[op][0], INPUTS[op][0][:INPUTS[op][1]]

    def make(seed):
        arrays, do = _make_inputs(op, seed, batch, steps, heads, key, dtype)
        return tuple(arrays[n] for n in names) + (do,)

    inputs = jax.jit(make, static_argnums=0,
                     out_shardings=tuple(placement(n) for n in names + ("do",)))

    def call(*x):
        arrays = dict(zip(names, x))
        return fn(*(arrays[n] for n in positional),
                  **{n: y for n, y in arrays.items() if n not in positional})[0]

    @jax.jit
    def forward_backward(*x):
        o, pull = jax.vjp(call, *x[:-1])
        return (o,) + pull(x[-1])

    x = inputs(0)
    compiled = forward_backward.lower(*x).compile()
    jax.block_until_ready(compiled(*x))      # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*x))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    m = compiled.memory_analysis()
    per_device = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - m.alias_size_in_bytes)

    @jax.jit
    def fingerprint(results):
        """Per array: its norm and PROJECTIONS inner products with fixed probe arrays."""
        rows = []
        for i, y in enumerate(results):
            y = y.astype(jnp.float32)
            probes = [jnp.sum(y * _probe(y.shape, PROJECTIONS * i + j))
                      for j in range(PROJECTIONS)]
            rows.append(jnp.stack([jnp.sqrt(jnp.sum(y * y))] + probes))
        return jnp.stack(rows)

    results = compiled(*x)
    prints = fingerprint(results).tolist()
    return dict(op=op, mode=mode, shape=shape, dtype=args.dtype, devices=len(used),
                platform=used[0].platform, device_kind=used[0].device_kind,
                backend=rwkv_jax.backends.resolve(op, args.backend)[0],
                milliseconds=1e3 * seconds, all_milliseconds=[1e3 * t for t in times],
                tokens_per_second=batch * steps / seconds, peak_bytes_per_device=per_device,
                fingerprint=prints, arrays=["o"] + [f"d{n}" for n in names], error=None)


def _rows_for(devices, args):
    """(op, shape, mode) of every row with this device count."""
    for op in args.ops:
        for shape in args.shapes:
            batch, steps = _shape(shape)[:2]
            if devices == 1:
                yield op, shape, "1 device"
                continue
            only = shape.split(":")[1:]
            for mode in only or args.modes:
                size = batch if mode == "data" else steps
                if size % devices == 0:
                    yield op, shape, mode


def _run_group(devices, args, argv):
    """Every row of one device count in fresh processes: one, or --processes of them (devices /
    processes each) joined by jax.distributed. Returns the rows."""
    processes = 1 if devices == 1 else args.processes
    local = devices // processes
    env = dict(os.environ)
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                            f"{local}").strip()
    command = [sys.executable, __file__, *argv, "--one", str(devices)]
    if processes > 1:
        with socket.socket() as s:   # a free port for the coordinator
            s.bind(("127.0.0.1", 0))
            command += ["--coordinator", f"127.0.0.1:{s.getsockname()[1]}"]
    gpus = env.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(devices)))).split(",")
    logs, workers = [], []
    for i in range(processes):
        own = dict(env)
        if processes > 1 and not args.tiny:   # this process's GPUs
            own["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * local:(i + 1) * local])
        logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
        workers.append(subprocess.Popen(
            command + (["--process-id", str(i)] if processes > 1 else []), env=own,
            stdout=logs[-1][0], stderr=logs[-1][1], text=True))
    # A process that fails leaves the others waiting in a collective: end them too.
    ended = []
    while any(w.poll() is None for w in workers):
        if any(w.poll() for w in workers) and not ended:
            ended = [w for w in workers if w.poll() is None]
            for w in ended:
                w.kill()
        time.sleep(0.2)
    outputs = []
    for out, err in logs:
        out.seek(0), err.seek(0)
        outputs.append(([json.loads(line) for line in out if line.startswith("{")], err.read()))
        out.close(), err.close()
    # Row i of every process is the same row: its time is the slowest process's.
    rows = []
    for same in zip(*(found for found, _ in outputs)):
        slowest = max(same, key=lambda r: r["milliseconds"])
        peaks = [r["peak_bytes_per_device"] for r in same]
        rows.append(dict(slowest, processes=processes, peak_bytes_per_device=max(peaks),
                         process_peak_bytes_per_device=peaks))
    failed = [(w.returncode, err) for w, (_, err) in zip(workers, outputs)
              if w.returncode and w not in ended]
    if failed:
        code, stderr = failed[0]
        # The exception's line (JAX appends a note after the traceback), else the last line.
        error = ([line for line in stderr.splitlines()
                  if re.match(r"[\w.]+(Error|Exception)\b", line)]
                 or stderr.strip().splitlines() or [f"exited with code {code}"])[-1]
        finished = {(r["op"], r["shape"], r["mode"]) for r in rows}
        rows += [dict(op=op, shape=shape, mode=mode, devices=devices, error=error[:200])
                 for op, shape, mode in _rows_for(devices, args)
                 if (op, shape, mode) not in finished]
    return rows


def difference(row, single):
    """The largest estimated relative difference of ``row``'s arrays from ``single``'s."""
    worst = 0.0
    for a, b in zip(row["fingerprint"], single["fingerprint"]):
        spread = [(pa - pb) ** 2 for pa, pb in zip(a[1:], b[1:])]
        worst = max(worst, (sum(spread) / len(spread)) ** 0.5 / max(b[0], 1e-30))
    return worst


def table(rows):
    lines = ["| op | shape BxTxHxK | mode | devices | fwd+bwd ms (median) | tokens/s | vs 1 device "
             "| memory per device | difference from 1 device |",
             "|---|---|---|---|---|---|---|---|---|"]
    single = {(r["op"], r["shape"]): r for r in rows
              if r["mode"] == "1 device" and not r.get("error")}
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['op']} | {r['shape'].split(':')[0]} | {r['mode']} "
                         f"| {r.get('devices', '')} "
                         f"| {r['error']} | | | | |")
            continue
        base = single.get((r["op"], r["shape"]))
        speedup = f"{base['milliseconds'] / r['milliseconds']:.2f}x" if base else ""
        check = f"{difference(r, base):.1e}" if base and r is not base else ""
        devices = (f"{r['devices']} ({r['processes']} processes)" if r.get("processes", 1) > 1
                   else r["devices"])
        lines.append(f"| {r['op']} | {r['shape'].split(':')[0]} | {r['mode']} | {devices} "
                     f"| {r['milliseconds']:.2f} | {r['tokens_per_second']:,.0f} | {speedup} "
                     f"| {runner.size_text(r['peak_bytes_per_device'])} | {check} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.one:
        if args.coordinator:   # one of --processes processes
            import jax
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator_address=args.coordinator,
                                       num_processes=args.processes, process_id=args.process_id)
        try:
            for op, shape, mode in _rows_for(args.one, args):
                print(json.dumps(measure(mode, shape, args, op, args.one)), flush=True)
        except Exception:
            if not args.coordinator:
                raise
            # Exit now: jax.distributed's shutdown at exit would wait for the other processes,
            # which wait for this one.
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return None
    out = runner.Rows("multi-device", args.json, devices=False)  # (the workers hold the GPUs)
    rows = []
    for devices in [1] + sorted(set(args.devices) - {1}):
        for r in _run_group(devices, args, argv):
            rows.append(out.add(r, f"{r['op']} {r['shape']} {r['mode']} x{devices}: "
                                   + (r.get("error") or f"{r['milliseconds']:.2f} ms")))
    first = next((r for r in rows if not r.get("error")), None)
    if first:
        print(f"\nforward + backward, {first['dtype']}, {first['platform']} "
              f"({first['device_kind']}), backend {args.backend or 'automatic'}, median of "
              f"{args.repeats}; memory: XLA's compiled estimate per device\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

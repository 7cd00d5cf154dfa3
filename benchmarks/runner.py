"""What every benchmark topic shares (``ops.py``, ``decode.py``, ``multi_device.py``): the
run's description (date, device, software, commit, command), rows appended as JSON lines to
the ``--json`` file as soon as each is measured (a run cut short keeps what it measured), the
peers' availability (a peer that is not installed is a row saying why, never a crash),
timing of JAX and torch calls (the median of many calls after warm-up, each waited for),
peak memory and the float64 error column.

JAX calls are timed by ``rwkv_jax._bench.time_function`` (compiled once, ``--warmup`` untimed
calls, then up to ``--repeats`` calls each ending in ``block_until_ready``); their peak memory
is XLA's compiled memory analysis (arguments + outputs + temporaries - aliased buffers). torch
calls (the peers) are timed with CUDA events around each call, their peak memory is the torch
allocator's peak above what was held before the call, plus the inputs and cotangents held.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys

import numpy as np

from rwkv_jax.cli.check import relative_error  # noqa: F401 (the topics' error column)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def log(*parts) -> None:
    print(" ".join(str(p) for p in parts), flush=True)


def add_common_arguments(parser, *, peers: tuple[str, ...] = (), default_repeats: int = 20,
                         warmup: bool = True):
    """The flags the topics share: where the rows go, the timing's repeats, time limit and
    (``warmup``) untimed calls, and (where the topic has peers) which peers to run."""
    parser.add_argument("--json", metavar="PATH",
                        help="append every row to this file, one JSON object per line")
    parser.add_argument("--repeats", type=_positive_int, default=default_repeats,
                        help=f"timed calls per measurement, the median reported "
                             f"(default {default_repeats})")
    if warmup:
        parser.add_argument("--warmup", type=_positive_int, default=2,
                            help="untimed calls after compiling, before the timed ones "
                                 "(default 2)")
    parser.add_argument("--max-seconds", type=float, default=30.0,
                        help="stop timing a measurement after this many seconds (at least 3 "
                             "calls; default 30)")
    if peers:
        parser.add_argument("--peers", type=names_of(peers), default=list(peers),
                            help=f"comma-separated peers to run beside ours: "
                                 f"{', '.join(peers)} (default all; 'none' for none)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs a positive integer, got {text!r}")
    return value


def names_of(choices):
    """An argparse type: a comma-separated subset of ``choices`` ('none': the empty list)."""
    def parse(text: str) -> list[str]:
        if text.strip().lower() == "none":
            return []
        picked = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in picked if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choices: {', '.join(choices)}")
        return picked
    parse.__name__ = "names"  # argparse names the type in its error message
    return parse


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_name() -> str:
    model = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    return f"CPU {model or platform.processor()} ({os.cpu_count()} cores)"


def describe_run(topic: str, *, devices: bool = True) -> dict:
    """The fields every row of this run carries: what ran where, when, from which tree.
    ``devices=False`` leaves the device out (a parent process whose workers use the devices
    must not start JAX's GPU client: it would take the memory they need)."""
    import importlib.metadata
    run = dict(topic=topic, date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               python=platform.python_version(), jax=importlib.metadata.version("jax"),
               commit=_commit(),
               command=" ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    if devices:
        import jax
        device = jax.devices()[0]
        run.update(device=_cpu_name() if device.platform == "cpu" else device.device_kind,
                   devices=jax.device_count(), platform=device.platform)
    return run


class Rows:
    """The rows of one run: each gets the run's description, is printed as one line and, with
    a path, appended to that file at once."""

    def __init__(self, topic: str, path: str | None, *, devices: bool = True):
        self.run = describe_run(topic, devices=devices)
        self.path = path
        self.rows: list[dict] = []
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        where = f"{self.run['device']} x{self.run['devices']}, " if devices else ""
        log(f"{topic}: {where}jax {self.run['jax']}, commit {self.run['commit']}, "
            f"{self.run['date']}")

    def add(self, row: dict, line: str) -> dict:
        row = dict(self.run, **row)
        self.rows.append(row)
        log(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=_plain) + "\n")
        return row


def _plain(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def error_text(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:300]}"


# ---------------------------------------------------------------------------------------------
# Peers

def _module_missing(*modules: str) -> str | None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


def torch_cuda_missing() -> str | None:
    """Why torch cannot run CUDA work here (None when it can)."""
    missing = _module_missing("torch")
    if missing:
        return missing
    import torch
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


PEER_REQUIREMENTS = {
    # peer -> the modules it needs, and whether it needs torch on a CUDA device
    "fla": (("fla", "triton"), True),
    "official": (("rwkv",), True),
}


def peer_absent(peer: str) -> str | None:
    """Why ``peer`` cannot run here, as a sentence for its row (None when it can)."""
    modules, needs_cuda = PEER_REQUIREMENTS[peer]
    return _module_missing(*modules) or (torch_cuda_missing() if needs_cuda else None)


# ---------------------------------------------------------------------------------------------
# Timing and memory

def time_jax(fn, args, options) -> dict:
    """``fn(*args)`` under ``jax.jit``: median and minimum ms, calls timed, XLA's peak bytes."""
    from rwkv_jax._bench import time_function
    timing = time_function(fn, args, repeats=options.repeats, warmup=options.warmup,
                           max_seconds=options.max_seconds)
    return dict(median_ms=timing.median_s * 1e3, min_ms=timing.min_s * 1e3,
                repeats=timing.repeats, peak_bytes=timing.peak_bytes)


def time_torch(fn, options, *, before=None, held=()) -> dict:
    """``fn()`` (torch work on the GPU): median and minimum ms over CUDA events around each
    call (``before`` runs ahead of each, untimed), and the allocator's peak above what was held
    before the call plus the bytes of the tensors ``held`` (inputs, cotangents)."""
    import torch
    for _ in range(options.warmup + 1):  # the first call compiles and autotunes
        if before is not None:
            before()
        fn()
    torch.cuda.synchronize()
    from rwkv_jax._bench import cuda_event_ms
    times = cuda_event_ms(fn, options.repeats, options.max_seconds, before)
    if before is not None:
        before()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base
            + sum(t.numel() * t.element_size() for t in held))
    return dict(median_ms=statistics.median(times), min_ms=min(times), repeats=len(times),
                peak_bytes=peak)


def size_text(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"

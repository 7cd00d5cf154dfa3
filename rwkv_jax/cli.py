"""The ``rwkv-jax`` command (also ``python -m rwkv_jax``).

    rwkv-jax          info, then check, then a quick bench: the first thing to run on a machine
    rwkv-jax info     versions, devices, backends available here (or why not), default per op
    rwkv-jax check    every op x available backend against a float64 reference, with pass/fail
    rwkv-jax bench    every op x backend, forward and forward+backward, timings and memory

Exit codes: 0 all good, 1 a check failed or a benchmark case errored, 2 bad command line.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform as host
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import __version__, backends
from . import ops as public_ops
from ._bench import (DTYPES, PRESETS, STEP_OPS, Case, bind, device_peak_bytes, make_case,
                     random_cotangents, time_function, vjp_function)
from .backends import native

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "numpy", "triton", "torch", "jax-triton", "flax")

# check: (B, T, H, K); T is deliberately not a multiple of a chunk size. Steps run STEP_LENGTH tokens.
CHECK_SIZE = (2, 72, 2, 64)
QUICK_CHECK_SIZE = (1, 20, 2, 64)
STEP_LENGTH = 3

# The keyword arguments a backend function needs that the public op fills in by default.
BACKEND_DEFAULTS = {
    "rwkv7": dict(output_final_state=True, cu_seqlens=None),
    "rwkv6": dict(output_final_state=True, cu_seqlens=None),
    "gated_linear_attention": dict(output_final_state=True, cu_seqlens=None),
    "rwkv4": dict(output_final_state=True),
    "rwkv7_step": {},
    "rwkv6_step": {},
}


# ---------------------------------------------------------------------------------------------
# Output helpers

def format_table(header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _sci(x: float | None) -> str:
    return "-" if x is None else ("non-finite" if not np.isfinite(x) else f"{x:.1e}")


def _megabytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _error_text(err: Exception) -> str:
    """One line: the error's first line, and its last one where they differ (the cause of an
    error raised inside a callback comes last)."""
    lines = [line.strip() for line in f"{type(err).__name__}: {err}".splitlines() if line.strip()]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------------------------------------
# info

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_info() -> dict:
    """Versions, devices, backends and the default backend of each op, as plain data."""
    defaults = {}
    for op in backends.OPS:
        try:
            defaults[op] = backends.resolve(op, None)[0]
        except Exception as err:  # reported, not fatal: info must always print
            defaults[op] = f"none ({_error_text(err)})"
    return dict(
        rwkv_jax=__version__,
        python=host.python_version(),
        machine=f"{host.system()} {host.machine()}, {os.cpu_count()} CPU cores",
        packages={name: _version(name) for name in PACKAGES},
        platform=backends.platform(),
        devices=[f"{d.id}: {d.device_kind} ({d.platform})" for d in jax.devices()],
        environment={v: os.environ[v] for v in ("RWKV_JAX_BACKEND", "KERNEL_TYPE", "JAX_PLATFORMS")
                     if os.environ.get(v)},
        backends=backends.describe(),
        defaults=defaults,
    )


def print_info(info: dict) -> None:
    print(f"rwkv_jax {info['rwkv_jax']} on Python {info['python']}, {info['machine']}")
    print("packages: " + ", ".join(f"{name} {version or '-'}"
                                   for name, version in info["packages"].items()))
    print(f"platform: {info['platform']}; devices: " + "; ".join(info["devices"]))
    if info["environment"]:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in info["environment"].items()))
    print()
    rows = [[b["name"], "yes" if b["available"] else "no",
             " ".join(b["ops"]) if b["available"] else b["reason"], b["summary"]]
            for b in info["backends"]]
    print(format_table(["backend", "here", "ops (or why not)", "what"], rows))
    print()
    print(format_table(["op", "default backend here"], [[op, name] for op, name in info["defaults"].items()]))


def cmd_info(args) -> int:
    print_info(collect_info())
    return 0


# ---------------------------------------------------------------------------------------------
# Selection of ops and backends shared by check and bench

def _selected_ops(args) -> list[str]:
    return args.op or list(backends.OPS)


def _selected_backends(args, op: str) -> list[str]:
    """Backends to run ``op`` on: the requested ones that implement it, else all available."""
    rows = {b["name"]: b for b in backends.describe()}
    names = args.backend or [name for name, row in rows.items() if row["available"]]
    return [name for name in names if op in rows[name]["ops"]]


def _check_requested_backends(args) -> str | None:
    """Why a backend named on the command line cannot run here, or None."""
    rows = {b["name"]: b for b in backends.describe()}
    for name in args.backend or []:
        if not rows[name]["available"]:
            return f"backend {name!r} cannot run here: {rows[name]['reason']}"
    return None


# ---------------------------------------------------------------------------------------------
# check

def _relative_error(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf when x is non-finite."""
    x = np.asarray(x, np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"result of shape {x.shape} where the reference has {ref.shape}")
    if not np.all(np.isfinite(x)):
        return float("inf")
    norm = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (norm if norm > 0 else 1.0))


def _native(case: Case, names) -> Callable:
    """The native backend function of ``case.op`` as a function of the positional arrays."""
    return bind(getattr(native, case.op), names, {**case.options, **BACKEND_DEFAULTS[case.op]})


def _reference(case: Case, arrays: dict, cotangents):
    """Outputs and gradients of the native backend on float64 copies of ``arrays``."""
    with jax.enable_x64(True):
        to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        xs = tuple(to64(x) for x in arrays.values())
        result = jax.jit(vjp_function(_native(case, tuple(arrays))))(xs, jax.tree.map(to64, cotangents))
        return jax.tree.map(lambda y: np.asarray(y, np.float64), result)


def check_case(case: Case, dtype_name: str, backend_names: list[str]) -> list[dict]:
    """One row per backend: errors of outputs, final state and every gradient."""
    arrays = case.as_dtype(DTYPES[dtype_name])
    names = tuple(arrays)
    xs = tuple(jnp.asarray(x) for x in arrays.values())
    cotangents = random_cotangents(_native(case, names), xs)  # shaped and typed per the contract
    (ref_out, ref_state), ref_grads = _reference(case, arrays, cotangents)
    public = getattr(public_ops, case.op)
    rows = []
    for name in backend_names:
        fwd_tol, grad_tol = backends.tolerance(name, dtype_name)
        row = dict(op=case.op, backend=name, dtype=dtype_name, tolerance=[fwd_tol, grad_tol])
        try:
            forward = bind(functools.partial(public, backend=name), names, case.options)
            (out, state), grads = jax.jit(vjp_function(forward))(xs, cotangents)
            mistyped = [n for n, g, x in zip(names, grads, xs) if g.dtype != x.dtype]
            if mistyped:
                raise TypeError(f"gradients of {', '.join(mistyped)} are not in their input's dtype")
            grad_errors = {n: _relative_error(g, r) for n, g, r in zip(names, grads, ref_grads)}
            output, final_state = _relative_error(out, ref_out), _relative_error(state, ref_state)
        except Exception as err:  # a backend that raises fails the check; the message says why
            rows.append(dict(row, ok=False, error=_error_text(err)))
            continue
        worst = max(grad_errors, key=grad_errors.get)
        row.update(output=output, state=final_state, gradient=grad_errors[worst], worst_input=worst)
        row["ok"] = output <= fwd_tol and final_state <= fwd_tol and row["gradient"] <= grad_tol
        rows.append(row)
    return rows


def run_check(ops: list[str], dtypes: list[str], size, select_backends, *, seed: int = 0,
              progress: bool = True) -> list[dict]:
    from tqdm import tqdm
    batch, length, heads, head_size = size
    jobs = [(op, dt) for op in ops for dt in dtypes if select_backends(op)]
    rows = []
    for op, dtype_name in tqdm(jobs, desc="check", unit="case", disable=not progress,
                               file=sys.stderr, leave=False):
        step_length = min(length, STEP_LENGTH) if op in STEP_OPS else length
        case = make_case(op, batch, step_length, heads, head_size, seed=seed)
        rows.extend(check_case(case, dtype_name, select_backends(op)))
    return rows


def print_check(rows: list[dict], size) -> None:
    table = []
    for r in rows:
        tolerance = f"{r['tolerance'][0]:.0e}/{r['tolerance'][1]:.0e}"
        if "error" in r:
            table.append([r["op"], r["backend"], r["dtype"], "-", "-", "-", "", tolerance,
                          "ERROR " + r["error"]])
        else:
            table.append([r["op"], r["backend"], r["dtype"], _sci(r["output"]), _sci(r["state"]),
                          _sci(r["gradient"]), r["worst_input"], tolerance,
                          "pass" if r["ok"] else "FAIL"])
    print(f"check: relative error ||x - ref|| / ||ref|| against the native backend in float64, "
          f"B,T,H,K = {','.join(map(str, size))} (steps: T={STEP_LENGTH})")
    print(format_table(["op", "backend", "dtype", "output", "state", "grad (worst)", "of",
                        "tol fwd/grad", "result"], table))
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")


def cmd_check(args) -> int:
    reason = _check_requested_backends(args)
    if reason:
        print(f"rwkv-jax check: {reason}", file=sys.stderr)
        return 1
    size = args.size[-1] if args.size else (QUICK_CHECK_SIZE if args.quick else CHECK_SIZE)
    dtypes = args.dtype or ["float32", "bfloat16"]
    rows = run_check(_selected_ops(args), dtypes, size, lambda op: _selected_backends(args, op),
                     seed=args.seed)
    if not rows:
        print("rwkv-jax check: no backend here implements the selected ops", file=sys.stderr)
        return 1
    print_check(rows, size)
    return 0 if all(r["ok"] for r in rows) else 1


# ---------------------------------------------------------------------------------------------
# bench

def bench_case(case: Case, backend: str, dtype_name: str, *, repeats: int, warmup: int,
               max_seconds: float) -> list[dict]:
    """Forward and forward+backward timings of one op call on one backend."""
    arrays = case.as_dtype(DTYPES[dtype_name])
    xs = tuple(jax.device_put(x) for x in arrays.values())
    forward = bind(functools.partial(getattr(public_ops, case.op), backend=backend), tuple(arrays),
                   case.options)
    batch, length, heads, head_size = case.shape
    common = dict(op=case.op, backend=backend, dtype=dtype_name, B=batch, T=length, H=heads,
                  K=head_size)
    results = []
    for pass_name, fn, args in (("fwd", forward, xs),
                                ("fwd+bwd", vjp_function(forward),
                                 (xs, random_cotangents(forward, xs)))):
        row = dict(common, **{"pass": pass_name})
        try:
            timing = time_function(fn, args, repeats=repeats, warmup=warmup, max_seconds=max_seconds)
        except Exception as err:  # e.g. out of memory or a size the backend refuses: reported
            results.append(dict(row, error=_error_text(err)))
            continue
        results.append(dict(row, median_ms=timing.median_s * 1e3, min_ms=timing.min_s * 1e3,
                            repeats=timing.repeats, tokens_per_s=case.tokens / timing.median_s,
                            peak_bytes=timing.peak_bytes))
    return results


def run_bench(ops, backend_names, sizes, dtypes, *, repeats=20, warmup=2, max_seconds=10.0,
              progress=True) -> list[dict]:
    """Every op x backend x size x dtype; step ops run one decoding token (T=1) per row."""
    from tqdm import tqdm
    jobs = [(op, name, size, dt) for size in sizes for op in ops for name in backend_names(op)
            for dt in dtypes]
    results = []
    bar = tqdm(jobs, desc="bench", unit="case", disable=not progress, file=sys.stderr)
    for op, name, (batch, length, heads, head_size), dtype_name in bar:
        bar.set_postfix_str(f"{op} {name} {batch},{length},{heads},{head_size} {dtype_name}")
        case = make_case(op, batch, 1 if op in STEP_OPS else length, heads, head_size)
        results.extend(bench_case(case, name, dtype_name, repeats=repeats, warmup=warmup,
                                  max_seconds=max_seconds))
    return results


def print_bench(results: list[dict]) -> None:
    table = []
    for r in results:
        shape = f"{r['B']},{r['T']},{r['H']},{r['K']}"
        if "error" in r:
            table.append([r["op"], r["backend"], r["dtype"], shape, r["pass"], "ERROR " + r["error"],
                          "", "", ""])
        else:
            table.append([r["op"], r["backend"], r["dtype"], shape, r["pass"],
                          f"{r['median_ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                          _megabytes(r["peak_bytes"]), r["repeats"]])
    print("bench: median wall time per call (block_until_ready); peak = compiled memory "
          "(arguments + outputs + temporaries); step ops decode T=1")
    print(format_table(["op", "backend", "dtype", "B,T,H,K", "pass", "ms", "tokens/s", "peak MB",
                        "n"], table))


def plot_bench(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if "error" not in r]
    ops = list(dict.fromkeys(r["op"] for r in timed))
    fig, axes = plt.subplots(1, max(len(ops), 1), figsize=(4.5 * max(len(ops), 1), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in timed if r["op"] == op]
        for series in dict.fromkeys((r["backend"], r["dtype"], r["pass"]) for r in rows):
            points = [r for r in rows if (r["backend"], r["dtype"], r["pass"]) == series]
            ax.plot([f"{r['B']},{r['T']},{r['H']},{r['K']}" for r in points],
                    [r["median_ms"] for r in points], marker="o", label=" ".join(series))
        ax.set_title(op)
        ax.set_xlabel("B,T,H,K")
        ax.set_ylabel("ms per call (median)")
        ax.set_yscale("log")
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _bench_sizes(args) -> list[tuple]:
    sizes = [PRESETS[name] for name in args.preset or []] + list(args.size or [])
    if sizes:
        return sizes
    if args.quick:
        return [PRESETS["small"]]
    if backends.platform() == "cpu":
        return [PRESETS["small"], PRESETS["medium"]]
    return [PRESETS[name] for name in ("small", "medium", "large", "xl")]


def cmd_bench(args) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("rwkv-jax bench: --plot needs the package 'matplotlib' "
              "(pip install matplotlib, or the [plot] extra)", file=sys.stderr)
        return 2
    reason = _check_requested_backends(args)
    if reason:
        print(f"rwkv-jax bench: {reason}", file=sys.stderr)
        return 1
    dtypes = args.dtype or (["float32"] if backends.platform() == "cpu" else ["bfloat16"])
    repeats = args.repeats or (5 if args.quick else 20)
    max_seconds = 3.0 if args.quick else args.max_seconds
    results = run_bench(_selected_ops(args), lambda op: _selected_backends(args, op),
                        _bench_sizes(args), dtypes, repeats=repeats, warmup=args.warmup,
                        max_seconds=max_seconds)
    print_bench(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=collect_info(), device_peak_bytes=device_peak_bytes(),
                           results=results), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_bench(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any("error" in r for r in results) else 0


# ---------------------------------------------------------------------------------------------
# The command line

def _size(text: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--size needs four positive integers B,T,H,K, got {text!r}")
    return values


def _names(choices):
    """An argparse type for comma-separated names, each from ``choices`` (read when called)."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices()]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown name {', '.join(unknown) or repr(text)}; choose from {', '.join(choices())}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rwkv-jax", description="RWKV linear-attention kernels for JAX: inspect, check, benchmark. "
        "Without a subcommand: info, then check, then a quick bench.")
    parser.add_argument("--version", action="version", version=f"rwkv_jax {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{info,check,bench}")
    commands.add_parser("info", help="versions, devices, backends available here and why not")

    def selection(p):
        p.add_argument("--op", type=_names(lambda: backends.OPS), action="extend",
                       help="ops to run, comma-separated (default: all)")
        p.add_argument("--backend", type=_names(backends.names), action="extend",
                       help="backends to run, comma-separated (default: all available here)")
        p.add_argument("--dtype", type=_names(lambda: tuple(DTYPES)), action="extend",
                       help="input dtypes, comma-separated")
        p.add_argument("--size", type=_size, action="append", metavar="B,T,H,K",
                       help="problem size (K == V); repeatable for bench")
        p.add_argument("--quick", action="store_true", help="tiny sizes and few repeats")

    check = commands.add_parser("check", help="every op x backend against a float64 reference")
    selection(check)
    check.add_argument("--seed", type=int, default=0, help="random inputs' seed")

    bench = commands.add_parser("bench", help="time every op x backend, forward and forward+backward")
    selection(bench)
    bench.add_argument("--preset", type=_names(lambda: tuple(PRESETS)), action="extend",
                       help="size presets: " + ", ".join(f"{k}={','.join(map(str, v))}"
                                                         for k, v in PRESETS.items()))
    bench.add_argument("--repeats", type=int, help="timed calls per case (default 20, quick 5)")
    bench.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
    bench.add_argument("--max-seconds", type=float, default=10.0,
                       help="stop repeating a case after this long (at least 3 calls)")
    bench.add_argument("--json", metavar="OUT.json", help="write every result as JSON")
    bench.add_argument("--plot", metavar="OUT.png", help="plot times per op (needs matplotlib)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    if args.command == "check":
        return cmd_check(args)
    if args.command == "bench":
        return cmd_bench(args)
    # The main job: everything, small enough for a 2-core CPU in a few minutes.
    cmd_info(args)
    print()
    status = cmd_check(parser.parse_args(["check"]))
    print()
    if status:
        print("rwkv-jax: check failed; skipping the benchmark")
        return status
    return cmd_bench(parser.parse_args(["bench", "--quick"]))

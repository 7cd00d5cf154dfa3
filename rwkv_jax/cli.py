"""The ``rwkv-jax`` command (also ``python -m rwkv_jax``).

    rwkv-jax          the main job (about a minute on a CPU): info, check, a quick bench of the
                      performance paths, then one verdict line
    rwkv-jax info     versions, devices, backends available here (or why not), default per op
    rwkv-jax check    every op x available backend against a float64 reference, with pass/fail
    rwkv-jax bench    every op x backend, forward and forward+backward, timings and memory
                      (beside fla's kernels on a GPU where fla is installed); --plot draws them;
                      on a GPU also a generation row (rwkv_jax.nn.Generator, --op generate)

Exit codes: 0 all good, 1 a check failed or a benchmark case errored, 2 bad command line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform as host
import signal
import sys
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import __version__, backends
from ._files import write_atomically
from . import ops as public_ops
from ._bench import (DTYPES, FLA_OPS, PRESETS, STEP_OPS, Case, bind, bytes_moved,
                     device_peak_bytes, fla_unavailable_reason, make_case, peak_bandwidth,
                     random_cotangents, time_fla, time_function, vjp_function)
from .backends import ffi as ffi_backend, native
from .train import command as train_command

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "numpy", "triton", "torch", "jax-triton", "flax")

# check: (B, T, H, K); T is deliberately not a multiple of a chunk size. Steps run STEP_LENGTH tokens.
CHECK_SIZE = (2, 72, 2, 64)
QUICK_CHECK_SIZE = (1, 20, 2, 64)
STEP_LENGTH = 3

# Backends that run on a platform only as a correctness path: checked, but not timed unless
# named with --backend (their times say nothing about speed).
CORRECTNESS_ONLY = {"cpu": {"triton": "Triton's interpreter"}}

# bench's generation row (--op generate, by default on a GPU where flax is installed): a random
# RWKV7LM (bfloat16 weights and compute) decoding greedily, one lane per request, each request
# a PROMPT_TOKENS-token prompt; per platform: (model size, vocabulary, new tokens per request,
# lane counts). Its step kernels are those of rwkv7_step.
GENERATE = "generate"
GENERATE_STEP_OP = "rwkv7_step"
GENERATE_SIZES = {"cpu": ("tiny", 512, 8, (1, 4)), "gpu": ("0.1b", 65536, 128, (1, 32))}
PROMPT_TOKENS = 16
STEPS_PER_CALL = 64

# bench --plot without sizes: a sweep over the sequence length at one (B, H, K).
PLOT_SWEEP = {"cpu": ((1, 4, 64), (64, 256, 1024)), "gpu": ((8, 32, 64), (512, 1024, 2048, 4096))}

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

def _progress(jobs: list, desc: str, describe: Callable, *, enabled: bool = True,
              leave: bool = True):
    """Each of ``jobs``, with a progress report on stderr naming ``describe(job)``: a tqdm bar
    on a terminal, one plain line per job elsewhere (piped, logged, CI), where a bar's frames
    would run together into one line."""
    if not enabled:
        yield from jobs
        return
    if sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(jobs, desc=desc, unit="case", file=sys.stderr, leave=leave)
        try:
            for job in bar:
                bar.set_postfix_str(describe(job))
                yield job
        finally:
            bar.close()
        return
    for i, job in enumerate(jobs, 1):
        print(f"{desc} {i}/{len(jobs)}: {describe(job)}", file=sys.stderr, flush=True)
        yield job


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
    print(f"CUDA kernels (ffi): {ffi_backend.cuda_build_report()}")
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
    """The ops named with --op, else every op (and bench's generation row on a GPU where flax
    is installed: on a CPU it runs only when named, so that the default stays quick)."""
    if args.op:
        return args.op
    generation = (args.command == "bench" and backends.platform() != "cpu"
                  and _flax_missing() is None)
    return list(backends.OPS) + ([GENERATE] if generation else [])


def _flax_missing() -> str | None:
    """Why the generation row cannot run here (None when it can)."""
    if importlib.util.find_spec("flax") is None:
        return 'the generation row needs flax: pip install "rwkv_jax[flax]"'
    return None


def _kernel_op(op: str) -> str:
    """The op whose backends run ``op`` (the generation row runs on the step kernels)."""
    return GENERATE_STEP_OP if op == GENERATE else op


def _selected_backends(args, op: str, *, timing: bool = False) -> list[str]:
    """Backends to run ``op`` on: the requested ones that implement it, else all available
    (for timing, without this platform's correctness-only paths)."""
    rows = {b["name"]: b for b in backends.describe()}
    names = args.backend or [name for name, row in rows.items() if row["available"]
                             and not (timing and name in _correctness_only())]
    return [name for name in names if _kernel_op(op) in rows[name]["ops"]]


def _correctness_only() -> dict:
    return CORRECTNESS_ONLY.get(backends.platform(), {})


def _check_requested_backends(args) -> str | None:
    """Why a backend named on the command line cannot run here, or why an op named there runs
    on none of the backends named, or None."""
    rows = {b["name"]: b for b in backends.describe()}
    for name in args.backend or []:
        if not rows[name]["available"]:
            return f"backend {name!r} cannot run here: {rows[name]['reason']}"
    for op in args.op or []:
        if op == GENERATE and _flax_missing():
            return _flax_missing()
        if args.backend and not any(_kernel_op(op) in rows[name]["ops"] for name in args.backend):
            named = ", ".join(repr(name) for name in dict.fromkeys(args.backend))
            have = [name for name, row in rows.items()
                    if row["available"] and _kernel_op(op) in row["ops"]]
            return (f"{'backend' if len(set(args.backend)) == 1 else 'backends'} {named} "
                    f"{'does' if len(set(args.backend)) == 1 else 'do'} not implement {op}; "
                    f"backends that do here: {', '.join(have) or 'none'}")
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
    batch, length, heads, head_size = size
    jobs = [(op, dt) for op in ops for dt in dtypes if select_backends(op)]
    rows = []
    describe = lambda job: f"{job[0]} {job[1]} on {', '.join(select_backends(job[0]))}"
    for op, dtype_name in _progress(jobs, "check", describe, enabled=progress, leave=False):
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


def check_rows(args) -> list[dict] | None:
    """The rows of ``rwkv-jax check`` (printed), or None when nothing could run."""
    reason = _check_requested_backends(args)
    if reason:
        print(f"rwkv-jax check: {reason}", file=sys.stderr)
        return None
    size = args.size[-1] if args.size else (QUICK_CHECK_SIZE if args.quick else CHECK_SIZE)
    dtypes = args.dtype or ["float32", "bfloat16"]
    rows = run_check(_selected_ops(args), dtypes, size, lambda op: _selected_backends(args, op),
                     seed=args.seed)
    if not rows:
        print("rwkv-jax check: no backend here implements the selected ops", file=sys.stderr)
        return None
    print_check(rows, size)
    return rows


def cmd_check(args) -> int:
    rows = check_rows(args)
    return 0 if rows and all(r["ok"] for r in rows) else 1


# ---------------------------------------------------------------------------------------------
# bench

def bench_case(case: Case, backend: str, dtype_name: str, *, repeats: int, warmup: int,
               max_seconds: float) -> list[dict]:
    """Forward and forward+backward timings of one op call on one backend."""
    arrays = case.as_dtype(DTYPES[dtype_name])
    xs = tuple(jax.device_put(x) for x in arrays.values())
    forward = bind(functools.partial(getattr(public_ops, case.op), backend=backend), tuple(arrays),
                   case.options)
    results = []
    for pass_name, fn, args in (("fwd", forward, xs),
                                ("fwd+bwd", vjp_function(forward),
                                 (xs, jax.device_put(random_cotangents(forward, xs))))):
        row = dict(_case_row(case, backend, dtype_name), **{"pass": pass_name})
        try:
            timing = time_function(fn, args, repeats=repeats, warmup=warmup, max_seconds=max_seconds)
        except Exception as err:  # e.g. out of memory or a size the backend refuses: reported
            results.append(dict(row, error=_error_text(err)))
            continue
        results.append(dict(row, median_ms=timing.median_s * 1e3, min_ms=timing.min_s * 1e3,
                            repeats=timing.repeats, tokens_per_s=case.tokens / timing.median_s,
                            peak_bytes=timing.peak_bytes, bytes_moved=bytes_moved(fn, args)))
    return results


def _case_row(case: Case, backend: str, dtype_name: str) -> dict:
    batch, length, heads, head_size = case.shape
    return dict(op=case.op, backend=backend, dtype=dtype_name, B=batch, T=length, H=heads,
                K=head_size)


def bench_fla(case: Case, dtype_name: str, *, repeats: int, max_seconds: float) -> list[dict]:
    """fla's rows for ``case`` (its kernel on the same inputs). A failure of fla is reported in
    its rows, never as a failure of ours."""
    common = _case_row(case, "fla", dtype_name)
    try:
        times = time_fla(case, dtype_name, repeats=repeats, max_seconds=max_seconds)
    except Exception as err:
        return [dict(common, **{"pass": p}, fla_error=_error_text(err)) for p in ("fwd", "fwd+bwd")]
    return [dict(common, **{"pass": p}, median_ms=ms, tokens_per_s=case.tokens / (ms / 1e3),
                 peak_bytes=None, repeats=repeats) for p, ms in times.items()]


def _bench_jobs(ops, backend_names, sizes, dtypes) -> list[tuple]:
    """(op, backend, (B, T, H, K), dtype) per case; step ops decode one token (T=1), so they
    run once per (B, H, K) whatever the lengths asked for. The generation row comes last, at
    its own size: (lanes, new tokens per lane, the model's heads and head size), bfloat16."""
    jobs = []
    for batch, length, heads, head_size in sizes:
        for op in ops:
            if op == GENERATE:
                continue
            size = (batch, 1 if op in STEP_OPS else length, heads, head_size)
            jobs += [(op, name, size, dt) for name in backend_names(op) for dt in dtypes]
    if GENERATE in ops:
        from .nn._bench import HEAD_SIZE, SIZES
        model, _, new_tokens, lane_counts = GENERATE_SIZES[_platform_kind()]
        heads = SIZES[model]["n_embd"] // HEAD_SIZE
        jobs += [(GENERATE, name, (lanes, new_tokens, heads, HEAD_SIZE), "bfloat16")
                 for name in backend_names(GENERATE) for lanes in lane_counts]
    return list(dict.fromkeys(jobs))


def _platform_kind() -> str:
    return "cpu" if backends.platform() == "cpu" else "gpu"


@functools.lru_cache(maxsize=1)
def _generation_model(size: str, vocab: int):
    from .nn._bench import random_model
    return random_model(size, vocab)


def bench_generation(backend: str, shape: tuple, *, repeats: int, max_seconds: float) -> dict:
    """The generation row: ``rwkv_jax.nn.Generator`` with ``B`` lanes on backend ``backend``'s
    step kernels, each lane decoding ``T`` tokens greedily after a PROMPT_TOKENS-token prompt;
    ms per decode step and new tokens/s of all lanes."""
    from .nn import Sampling
    from .nn._bench import SIZES, decode_rate
    lanes, new_tokens, heads, head_size = shape
    model_size, vocab = GENERATE_SIZES[_platform_kind()][:2]
    row = dict(op=GENERATE, backend=backend, dtype="bfloat16", B=lanes, T=new_tokens, H=heads,
               K=head_size, **{"pass": "decode"}, model=model_size, vocab=vocab,
               prompt_tokens=PROMPT_TOKENS, **SIZES[model_size])
    try:
        model = _generation_model(model_size, vocab)
        prompts = np.random.default_rng(0).integers(1, vocab, (lanes, PROMPT_TOKENS)).tolist()
        rate, _ = decode_rate(model, prompts, new_tokens, backend, STEPS_PER_CALL,
                              Sampling(temperature=0), repeats=repeats, max_seconds=max_seconds)
    except Exception as err:  # e.g. out of memory: reported in the row
        return dict(row, error=_error_text(err))
    return dict(row, median_ms=rate["ms_per_step"], min_ms=rate["min_ms_per_step"],
                repeats=rate["repeats"], tokens_per_s=rate["tokens_per_s"], peak_bytes=None,
                generated=rate["generated"], steps_per_call=rate["steps_per_call"],
                decode_calls=rate["decode_calls"])


def run_bench(ops, backend_names, sizes, dtypes, *, repeats=20, warmup=2, max_seconds=10.0,
              progress=True, fla=False) -> list[dict]:
    """Every op x backend x size x dtype, then fla's kernel for the ops it has when ``fla``."""
    jobs = _bench_jobs(ops, backend_names, sizes, dtypes)
    fla_jobs = [(op, "fla", size, dt) for op, size, dt in dict.fromkeys(
        (op, size, dt) for op, _, size, dt in jobs if op in FLA_OPS)] if fla else []
    results = []
    describe = lambda job: f"{job[0]} {job[1]} {','.join(map(str, job[2]))} {job[3]}"
    try:
        for op, name, size, dtype_name in _progress(jobs + fla_jobs, "bench", describe,
                                                    enabled=progress):
            _bench_job(op, name, size, dtype_name, results, repeats=repeats, warmup=warmup,
                       max_seconds=max_seconds)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (e.g. `timeout`): keep what was measured
        raise BenchInterrupted(results, len(jobs + fla_jobs)) from None
    return results


class BenchInterrupted(Exception):
    """The bench was stopped: ``results`` holds the cases measured before, of ``total``."""

    def __init__(self, results: list[dict], total: int):
        super().__init__(f"interrupted after {len({_job_key(r) for r in results})} of {total} "
                         f"cases")
        self.results = results


def _job_key(row: dict) -> tuple:
    return row["op"], row["backend"], row["B"], row["T"], row["H"], row["K"], row["dtype"]


def _bench_job(op, name, size, dtype_name, results: list[dict], *, repeats, warmup,
               max_seconds) -> None:
    """Time ``op`` on backend ``name`` (or fla's kernel) at one size and dtype; append its rows
    to ``results``."""
    if op == GENERATE:
        results.append(bench_generation(name, size, repeats=repeats, max_seconds=max_seconds))
        return
    case = make_case(op, *size)
    if name == "fla":
        rows = bench_fla(case, dtype_name, repeats=repeats, max_seconds=max_seconds)
        # The same call moves the same bytes as ours (for the bandwidth plot).
        ours = {r["pass"]: r["bytes_moved"] for r in results if "bytes_moved" in r
                and (r["op"], (r["B"], r["T"], r["H"], r["K"]), r["dtype"])
                == (op, tuple(size), dtype_name)}
        results.extend(dict(r, bytes_moved=ours[r["pass"]]) if r["pass"] in ours else r
                       for r in rows)
    else:
        results.extend(bench_case(case, name, dtype_name, repeats=repeats, warmup=warmup,
                                  max_seconds=max_seconds))


def print_bench(results: list[dict]) -> None:
    table = []
    for r in results:
        shape = f"{r['B']},{r['T']},{r['H']},{r['K']}"
        failure = r.get("error") or r.get("fla_error")
        if failure:
            table.append([r["op"], r["backend"], r["dtype"], shape, r["pass"], "ERROR " + failure,
                          "", "", ""])
        else:
            table.append([r["op"], r["backend"], r["dtype"], shape, r["pass"],
                          f"{r['median_ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                          _megabytes(r["peak_bytes"]), r["repeats"]])
    print("bench: median wall time per call (block_until_ready); peak = compiled memory "
          "(arguments + outputs + temporaries); step ops decode one token (T=1)")
    print(format_table(["op", "backend", "dtype", "B,T,H,K", "pass", "ms", "tokens/s", "peak MB",
                        "n"], table))
    generation = next((r for r in results if r["op"] == GENERATE), None)
    if generation:
        print(f"generate: rwkv_jax.nn.Generator on a random RWKV7LM {generation['model']} "
              f"(L={generation['n_layer']}, C={generation['n_embd']}, vocab "
              f"{generation['vocab']}, bfloat16 weights), greedy after "
              f"{generation['prompt_tokens']}-token prompts: B lanes decode T tokens each; "
              f"ms per decode step, tokens/s of all lanes (prefill not included)")


def fastest(results: list[dict]) -> list[dict]:
    """Per op, the row of our fastest backend at the largest size timed: forward+backward
    (training) for sequence ops, forward (decoding) for step ops."""
    best = []
    for op in dict.fromkeys(r["op"] for r in results):
        wanted = "fwd" if op in STEP_OPS else "fwd+bwd"
        rows = [r for r in results if r["op"] == op and r["pass"] == wanted and "median_ms" in r
                and r["backend"] != "fla"]
        if rows:
            largest = max(r["B"] * r["T"] * r["H"] * r["K"] for r in rows)
            best.append(min((r for r in rows if r["B"] * r["T"] * r["H"] * r["K"] == largest),
                            key=lambda r: r["median_ms"]))
    return best


# ---------------------------------------------------------------------------------------------
# bench --plot

def _backend_colour(name: str) -> str:
    """One colour per backend, the same in every panel and figure."""
    order = list(backends.names()) + ["fla"]
    return f"C{order.index(name) % 10}" if name in order else "black"


DTYPE_STYLES = {"float32": "-", "bfloat16": "--", "float16": ":"}


def _series(rows):
    """Rows grouped into lines: (backend, dtype, B, H, K) -> rows sorted by T."""
    lines: dict = {}
    for r in rows:
        lines.setdefault((r["backend"], r["dtype"], r["B"], r["H"], r["K"]), []).append(r)
    return {key: sorted(points, key=lambda r: r["T"]) for key, points in lines.items()}


def _label(key, dtypes, shapes) -> str:
    backend, dtype, batch, heads, head_size = key
    parts = [backend] + ([dtype] if len(dtypes) > 1 else [])
    parts += [f"B,H,K={batch},{heads},{head_size}"] if len(shapes) > 1 else []
    return " ".join(parts)


def _timed(results):
    return [r for r in results if "median_ms" in r]


def _length_axes(ax, lengths, ylabel):
    """Log-log axes (call after plotting) with the measured lengths as plain-number ticks, and
    plain numbers on y: 1, 10, 100, with 2 and 5 in between where the data span few decades."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted(lengths), [str(t) for t in sorted(lengths)])
    ax.xaxis.set_minor_formatter(NullFormatter())
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    two_five = FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.0e}"[0] in "25" else "")
    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(two_five if high / low < 100 else NullFormatter())
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.grid(True, which="minor", alpha=0.1)


PASSES = {"fwd": "forward", "fwd+bwd": "forward + backward"}


def _line_panels(axes, timed, ops, value, ylabel, entries, peak=None):
    """Row ``i`` of ``axes``: op ``ops[i]``, forward then forward+backward, ``value(row)``
    against T, a line per (backend, dtype, B, H, K); ``entries`` collects the legend."""
    dtypes = set(r["dtype"] for r in timed)
    shapes = set((r["B"], r["H"], r["K"]) for r in timed)
    for row, op in enumerate(ops):
        for col, pass_name in enumerate(PASSES):
            ax = axes[row][col]
            rows = [r for r in timed if r["op"] == op and r["pass"] == pass_name]
            for key, points in _series(rows).items():
                entries[_label(key, dtypes, shapes)] = key[:2]
                ax.plot([r["T"] for r in points], [value(r) for r in points],
                        color=_backend_colour(key[0]), linestyle=DTYPE_STYLES.get(key[1], "-"),
                        marker="o", markersize=4)
            if peak:
                ax.axhline(peak, color="black", linestyle="--", linewidth=1)
            _length_axes(ax, {r["T"] for r in rows}, ylabel)
            ax.set_title(f"{op}: {PASSES[pass_name]}", fontsize=10)


def _legend(fig, entries: dict, extra=()):
    """One legend for the figure, outside the panels: a line per (backend, dtype) label."""
    from matplotlib.lines import Line2D
    handles = [Line2D([], [], color=_backend_colour(backend), linestyle=DTYPE_STYLES.get(dtype, "-"),
                      marker="o", markersize=4) for backend, dtype in entries.values()]
    handles += [h for h, _ in extra]
    fig.legend(handles, list(entries) + [label for _, label in extra], loc="outside right center",
               title="backend")


def plot_bench(results: list[dict], path: str, *, device: str = "") -> None:
    """Time per call against the sequence length (log-log), one row of panels per op (forward,
    forward+backward), one line per backend; decode steps (T=1) as bars in a last row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in _timed(results) if r["op"] != GENERATE]  # not a kernel call
    sequence_ops = [op for op in dict.fromkeys(r["op"] for r in timed) if op not in STEP_OPS]
    step_ops = [op for op in dict.fromkeys(r["op"] for r in timed) if op in STEP_OPS]
    dtypes = set(r["dtype"] for r in timed)
    shapes = set((r["B"], r["H"], r["K"]) for r in timed if r["op"] in sequence_ops)
    n_rows = len(sequence_ops) + (1 if step_ops else 0)
    fig, axes = plt.subplots(max(n_rows, 1), 2, figsize=(10, 3.1 * max(n_rows, 1)),
                             squeeze=False, layout="constrained")
    entries = {}
    _line_panels(axes, [r for r in timed if r["op"] in sequence_ops], sequence_ops,
                 lambda r: r["median_ms"], "time per call (ms)", entries)
    for col, pass_name in enumerate(PASSES if step_ops else ()):
        ax = axes[n_rows - 1][col]
        rows = [r for r in timed if r["op"] in step_ops and r["pass"] == pass_name]
        series = list(dict.fromkeys((r["backend"], r["dtype"]) for r in rows))
        width = 0.8 / max(len(series), 1)
        for i, (backend, dtype) in enumerate(series):
            xs, ys = [], []
            for j, op in enumerate(step_ops):
                for r in rows:
                    if (r["op"], r["backend"], r["dtype"]) == (op, backend, dtype):
                        xs.append(j + (i - (len(series) - 1) / 2) * width)
                        ys.append(r["median_ms"])
            entries.setdefault(backend + (f" {dtype}" if len(dtypes) > 1 else ""),
                               (backend, dtype))
            # A linear axis from 0: bar lengths compare the times.
            container = ax.bar(xs, ys, width, color=_backend_colour(backend),
                               hatch="//" if dtype != "float32" else None)
            ax.bar_label(container, fmt="%.3g", fontsize=7, padding=1)
        shapes_text = ", ".join(sorted({f"{r['B']},{r['H']},{r['K']}" for r in rows}))
        ax.set_xticks(range(len(step_ops)), step_ops)
        ax.margins(y=0.15)
        ax.set_title(f"decode step (T=1, B,H,K={shapes_text}): {PASSES[pass_name]}", fontsize=10)
        ax.set_ylabel("time per step (ms)")
        ax.grid(True, axis="y", alpha=0.3)
    title = "rwkv_jax bench: median time per call"
    if len(shapes) == 1:
        batch, heads, head_size = next(iter(shapes))
        title += f" (B={batch}, H={heads}, K=V={head_size})"
    fig.suptitle(title + (f" on {device}" if device else ""))
    _legend(fig, entries)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bandwidth(results: list[dict], path: str, *, device: str, peak: float | None) -> None:
    """Achieved bandwidth (least bytes moved / time) against the sequence length, per op and
    pass, with the device's peak as the ceiling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in _timed(results) if r.get("bytes_moved") and r["op"] not in STEP_OPS]
    from matplotlib.lines import Line2D
    ops = list(dict.fromkeys(r["op"] for r in timed))
    fig, axes = plt.subplots(max(len(ops), 1), 2, figsize=(10, 3.1 * max(len(ops), 1)),
                             squeeze=False, layout="constrained")
    entries = {}
    _line_panels(axes, timed, ops, lambda r: r["bytes_moved"] / (r["median_ms"] / 1e3) / 1e9,
                 "achieved bandwidth (GB/s)", entries, peak=peak / 1e9 if peak else None)
    extra = [(Line2D([], [], color="black", linestyle="--", linewidth=1),
              f"device peak\n{peak / 1e9:,.0f} GB/s")] if peak else []
    fig.suptitle(f"achieved bandwidth = bytes of inputs and outputs / time, on {device}"
                 + ("" if peak else " (peak unknown for this device)"))
    _legend(fig, entries, extra)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bandwidth_path(path: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}_bandwidth{ext}"


def _bench_sizes(args) -> list[tuple]:
    sizes = [PRESETS[name] for name in args.preset or []] + list(args.size or [])
    if sizes:
        return sizes
    platform = "cpu" if backends.platform() == "cpu" else "gpu"
    if args.plot:  # a line per backend needs several lengths
        (batch, heads, head_size), lengths = PLOT_SWEEP[platform]
        return [(batch, t, heads, head_size) for t in lengths]
    if args.quick:  # on a GPU, a size that fills it (smaller ones time the launches)
        return [PRESETS["small" if platform == "cpu" else "large"]]
    if platform == "cpu":
        return [PRESETS["small"], PRESETS["medium"]]
    return [PRESETS[name] for name in ("small", "medium", "large", "xl")]


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (`timeout`, a job scheduler) stops the bench as Ctrl-C does, so that what it
    measured is still printed, written and plotted (main thread only: signals go there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def bench_results(args) -> list[dict] | None:
    """The rows of ``rwkv-jax bench`` (printed, written), or None when it could not start."""
    reason = _check_requested_backends(args)
    if reason:
        print(f"rwkv-jax bench: {reason}", file=sys.stderr)
        return None
    skipped = {name: what for name, what in _correctness_only().items()
               if not args.backend and any(name in _selected_backends(args, op)
                                           for op in _selected_ops(args))}
    for name, what in skipped.items():
        print(f"bench: not timing {name} ({what} on {backends.platform()}: a correctness path, "
              f"checked by rwkv-jax check); name it with --backend {name} to time it anyway")
    on_gpu = backends.platform() != "cpu"
    fla_reason = fla_unavailable_reason() if on_gpu and not args.no_fla else None
    if on_gpu and not args.no_fla and fla_reason:
        print(f"bench: fla not timed beside ours: {fla_reason}")
    dtypes = args.dtype or (["float32"] if not on_gpu else ["bfloat16"])
    repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    max_seconds = 3.0 if args.quick else args.max_seconds
    interrupted = None
    try:
        with _terminate_as_interrupt():
            results = run_bench(_selected_ops(args),
                                lambda op: _selected_backends(args, op, timing=True),
                                _bench_sizes(args), dtypes, repeats=repeats,
                                warmup=args.warmup, max_seconds=max_seconds,
                                fla=on_gpu and not args.no_fla and not fla_reason)
    except BenchInterrupted as stop:
        interrupted, results = stop, stop.results
        print(f"bench: {stop}; what was measured follows")
    print_bench(results)
    if args.json:
        text = json.dumps(dict(info=collect_info(), device_peak_bytes=device_peak_bytes(),
                               results=results), indent=1)
        write_atomically(args.json, lambda f: f.write(text.encode()))
        print(f"wrote {args.json}")
    if args.plot and results:
        device = jax.devices()[0].device_kind
        plot_bench(results, args.plot,
                   device=device if on_gpu else f"a CPU ({os.cpu_count()} cores)")
        print(f"wrote {args.plot}")
        if on_gpu:
            path = _bandwidth_path(args.plot)
            plot_bandwidth(results, path, device=device, peak=peak_bandwidth(device))
            print(f"wrote {path}")
    if interrupted:
        raise SystemExit(130)  # the shell's status for an interrupted command
    return results


def cmd_bench(args) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("rwkv-jax bench: --plot needs the package 'matplotlib' "
              "(pip install matplotlib, or the [plot] extra)", file=sys.stderr)
        return 2
    if args.plot:
        from matplotlib.backend_bases import FigureCanvasBase
        formats = FigureCanvasBase.get_supported_filetypes()
        extension = os.path.splitext(args.plot)[1][1:].lower()
        if extension not in formats:
            print(f"rwkv-jax bench: --plot {args.plot!r}: matplotlib writes no "
                  f"'.{extension}' files; use one of .{', .'.join(formats)}", file=sys.stderr)
            return 2
    results = bench_results(args)
    return 1 if results is None or any("error" in r for r in results) else 0


# ---------------------------------------------------------------------------------------------
# The main job

def verdict(check: list[dict] | None, bench: list[dict] | None) -> tuple[int, str]:
    """The exit status and the one line that ends the main job."""
    if not check:
        return 1, "FAILED: no check ran"
    failed = [f"{r['op']} {r['backend']} {r['dtype']}" for r in check if not r["ok"]]
    if failed:
        return 1, (f"FAILED: {len(failed)} of {len(check)} checks failed ({', '.join(failed)}); "
                   f"benchmark skipped")
    errored = [f"{r['op']} {r['backend']} {r['pass']}" for r in bench or [] if "error" in r]
    best = fastest(bench or [])
    line = f"all {len(check)} checks passed; fastest here: " + ", ".join(
        f"{r['op']} {r['backend']} {r['median_ms']:.3g} ms" + (" per step" if r["op"] in STEP_OPS
                                                               else "") for r in best)
    shapes = " / ".join(dict.fromkeys(f"{r['B']},{r['T']},{r['H']},{r['K']}" for r in best
                                    if r["op"] not in STEP_OPS))
    if best:
        line += f" (forward+backward at B,T,H,K={shapes}; steps: forward, one token)"
    if bench is None or errored:
        return 1, line + (f"; FAILED: {len(errored)} benchmark cases errored ({', '.join(errored)})"
                          if errored else "; FAILED: the benchmark did not run")
    return 0, line


def main_job(parser) -> int:
    """info, check (the quick size, float32, every backend), a quick bench of the performance
    paths, and the verdict: about a minute on a 2-core CPU."""
    cmd_info(None)
    print()
    check = check_rows(parser.parse_args(["check", "--quick", "--dtype", "float32"]))
    print()
    bench = None
    if check and all(r["ok"] for r in check):
        bench = bench_results(parser.parse_args(["bench", "--quick"]))
        print()
    status, line = verdict(check, bench)
    print(line)
    return status


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


def _at_least(minimum: int):
    """An argparse type for an integer no smaller than ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"needs an integer >= {minimum}, got {text!r}")
        return value
    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"needs a number of seconds > 0, got {text!r}")
    return value


def _output_path(text: str) -> str:
    """An argparse type for a file to write at the end: its directory must exist and be
    writable now, so that a bad path fails before the work rather than after it."""
    directory = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file name")
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(
            f"cannot write {text!r}: {directory!r} "
            f"{'is not a directory' if os.path.exists(directory) else 'does not exist'}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the directory {directory!r} "
                                         f"is not writable")
    return text


def _plot_path(text: str) -> str:
    """``--plot``'s file, named as it will be written: without an extension, ``.png`` added
    (as matplotlib would add it)."""
    return _output_path(text if os.path.splitext(text)[1] else text + ".png")


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
        "Without a subcommand, the main job (about a minute on a CPU): info, check (quick size, "
        "float32), a quick bench of the backends that are performance paths here, and a verdict.")
    parser.add_argument("--version", action="version", version=f"rwkv_jax {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{info,check,bench,train}")
    commands.add_parser("info", help="versions, devices, backends available here and why not")

    def selection(p, *, ops, op_help, backend_default, dtype_default, size_help, quick_help):
        p.add_argument("--op", type=_names(ops), action="extend", help=op_help)
        p.add_argument("--backend", type=_names(backends.names), action="extend",
                       help=f"backends to run, comma-separated (default: {backend_default})")
        p.add_argument("--dtype", type=_names(lambda: tuple(DTYPES)), action="extend",
                       help=f"input dtypes, comma-separated (default: {dtype_default})")
        p.add_argument("--size", type=_size, action="append", metavar="B,T,H,K", help=size_help)
        p.add_argument("--quick", action="store_true", help=quick_help)

    size = lambda v: ",".join(map(str, v))
    check = commands.add_parser("check", help="every op x backend against a float64 reference")
    selection(check, ops=lambda: backends.OPS, op_help="ops to run, comma-separated (default: all)",
              backend_default="all available here", dtype_default="float32,bfloat16",
              size_help=f"problem size (K == V; default {size(CHECK_SIZE)}); step ops run "
                        f"T={STEP_LENGTH} tokens; if given twice, the last counts",
              quick_help=f"the smaller size {size(QUICK_CHECK_SIZE)}")
    check.add_argument("--seed", type=_at_least(0), default=0,
                       help="random inputs' seed, an integer >= 0")

    bench = commands.add_parser("bench", help="time every op x backend, forward and forward+backward")
    selection(bench, ops=lambda: backends.OPS + (GENERATE,),
              op_help=f"ops to run, comma-separated (default: all; on a GPU where flax is "
                      f"installed also {GENERATE}); {GENERATE}: rwkv_jax.nn.Generator decoding "
                      f"greedily on a random bfloat16 RWKV7LM, on the {GENERATE_STEP_OP} "
                      f"backends: the 0.1B shape (L=12, C=768, vocab 65536) with "
                      f"{' and '.join(map(str, GENERATE_SIZES['gpu'][3]))} lanes on a GPU, a "
                      f"tiny one on a CPU (--size and --dtype do not apply)",
              backend_default="all available here that are performance paths; on a CPU "
              "not triton, which runs in Triton's interpreter there",
              dtype_default="float32 on a CPU, bfloat16 on a GPU",
              size_help="problem size (K == V), repeatable; step ops always decode T=1 (default: "
                        "the presets small,medium on a CPU, small..xl on a GPU; with --plot a "
                        "sweep over T)",
              quick_help=f"one size: the small preset ({size(PRESETS['small'])}) on a CPU, the "
                         f"large one ({size(PRESETS['large'])}) on a GPU; 5 repeats, at most 3 s "
                         f"per case")
    bench.add_argument("--preset", type=_names(lambda: tuple(PRESETS)), action="extend",
                       help="size presets: " + ", ".join(f"{k}={','.join(map(str, v))}"
                                                         for k, v in PRESETS.items()))
    bench.add_argument("--repeats", type=_at_least(1),
                       help="timed calls per case, at least 1 (default 20, quick 5)")
    bench.add_argument("--warmup", type=_at_least(0), default=2,
                       help="untimed calls after compiling")
    bench.add_argument("--max-seconds", type=_positive_seconds, default=10.0,
                       help="stop repeating a case after this long (at least 3 calls)")
    bench.add_argument("--json", metavar="OUT.json", type=_output_path,
                       help="write every result as JSON")
    bench.add_argument("--plot", metavar="OUT.png", type=_plot_path,
                       help="plot time against sequence length per op and backend (needs "
                            "matplotlib; OUT without an extension writes OUT.png); on a GPU "
                            "also OUT_bandwidth.png, achieved bandwidth "
                            "against the device's peak. Without --size/--preset it sweeps T over "
                            + "; ".join(f"{','.join(map(str, v[1]))} on a {k.upper()}"
                                        for k, v in PLOT_SWEEP.items()))
    bench.add_argument("--no-fla", action="store_true",
                       help="on a GPU, do not time fla's kernels beside ours (default: timed "
                            "where fla is installed)")
    train_command.register(commands)
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
    if args.command == "train":
        return args.handler(args)
    return main_job(parser)

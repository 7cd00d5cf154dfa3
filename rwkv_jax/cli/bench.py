"""``rwkv-jax bench``: every op x backend, forward and forward+backward, median time, tokens/s
and compiled memory per case (beside fla's kernels on a GPU where fla is installed); on a GPU
also the generation row (``--op generate``); ``--json`` and ``--plot`` write the results."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import sys
import threading

import jax
import numpy as np

from .. import backends
from .. import ops as public_ops
from .._bench import (DTYPES, FLA_OPS, PRESETS, STEP_OPS, Case, bind, bytes_moved,
                      device_peak_bytes, fla_unavailable_reason, make_case, peak_bandwidth,
                      random_cotangents, time_fla, time_function, vjp_function)
from .._files import write_atomically
from . import _parser, _plot
from ._print import error_text, format_table, megabytes, shape_text, with_progress
from ._select import (GENERATE, GENERATE_STEP_OP, correctness_only, selected_backends,
                      selected_ops, selection_problem)
from .info import collect_info

# The generation row (--op generate, by default on a GPU where flax is installed): a random
# RWKV7LM (bfloat16 weights and compute) decoding greedily, one lane per request, each request
# a PROMPT_TOKENS-token prompt; per platform: (model size, vocabulary, new tokens per request,
# lane counts). Its step kernels are those of GENERATE_STEP_OP.
GENERATE_SIZES = {"cpu": ("tiny", 512, 8, (1, 4)), "gpu": ("0.1b", 65536, 128, (1, 32))}
PROMPT_TOKENS = 16
STEPS_PER_CALL = 64

# --plot without sizes: a sweep over the sequence length at one (B, H, K).
PLOT_SWEEP = {"cpu": ((1, 4, 64), (64, 256, 1024)), "gpu": ((8, 32, 64), (512, 1024, 2048, 4096))}

# Timing per case (time_function's arguments), and with --quick.
REPEATS, MAX_SECONDS, WARMUP = 20, 10.0, 2
QUICK_REPEATS, QUICK_MAX_SECONDS = 5, 3.0


def register(commands) -> None:
    parser = commands.add_parser(
        "bench", help="time every op x backend, forward and forward+backward",
        description="Time every op x backend that is a performance path here, forward and "
        "forward+backward: the median wall time per call, tokens/s and the compiled peak memory "
        "per case. Exit status 1 if a case errored, 130 if interrupted (Ctrl-C, SIGTERM: what "
        "was measured is still printed and written).")
    _parser.add_selection(
        parser, ops=lambda: backends.OPS + (GENERATE,),
        op_help=f"ops to run, comma-separated, repeatable (default: all; on a GPU where flax "
                f"is installed also {GENERATE}); {GENERATE}: rwkv_jax.nn.Generator decoding "
                f"greedily on a random bfloat16 RWKV7LM, on the {GENERATE_STEP_OP} backends: "
                f"the 0.1B shape (L=12, C=768, vocab 65536) with "
                f"{' and '.join(map(str, GENERATE_SIZES['gpu'][3]))} lanes on a GPU, a tiny one "
                f"on a CPU (--size and --dtype do not apply)",
        backend_default="all available here that are performance paths; on a CPU not triton, "
                        "which runs in Triton's interpreter there",
        dtype_default="float32 on a CPU, bfloat16 on a GPU",
        size_help="problem size (K == V), repeatable: each size adds cases; step ops always "
                  "decode T=1 (default: the presets small,medium on a CPU, small..xl on a GPU; "
                  "with --plot a sweep over T)",
        quick_help=f"one size: the small preset ({shape_text(PRESETS['small'])}) on a CPU, the "
                   f"large one ({shape_text(PRESETS['large'])}) on a GPU; {QUICK_REPEATS} "
                   f"repeats, at most {QUICK_MAX_SECONDS:g} s per case (--size, --preset, --repeats "
                   f"and --max-seconds override these)")
    parser.add_argument("--preset", type=_parser.names(lambda: tuple(PRESETS)), action="extend",
                        help="size presets, comma-separated, repeatable, beside --size: "
                             + ", ".join(f"{k}={shape_text(v)}" for k, v in PRESETS.items()))
    parser.add_argument("--repeats", type=_parser.at_least(1),
                        help=f"timed calls per case, at least 1 (default {REPEATS}, quick "
                             f"{QUICK_REPEATS})")
    parser.add_argument("--warmup", type=_parser.at_least(0), default=WARMUP,
                        help=f"untimed calls per case after compiling, at least 0 (default "
                             f"{WARMUP}; fla and the generation row warm up on their own)")
    parser.add_argument("--max-seconds", type=_parser.positive_seconds,
                        help=f"stop repeating a case once its timed calls have taken this "
                             f"long, after at least 3 calls (default {MAX_SECONDS:g}, quick "
                             f"{QUICK_MAX_SECONDS:g})")
    parser.add_argument("--json", metavar="OUT.json", type=_parser.output_path,
                        help="write every result as JSON, with rwkv-jax info's data")
    parser.add_argument("--plot", metavar="OUT.png", type=_parser.plot_path,
                        help="plot time against sequence length per op and backend (needs "
                             "matplotlib; OUT without an extension writes OUT.png); on a GPU "
                             "also OUT_bandwidth.png, achieved bandwidth against the device's "
                             "peak. Without --size/--preset it sweeps T over "
                             + "; ".join(f"{shape_text(v[1])} on a {k.upper()}"
                                         for k, v in PLOT_SWEEP.items()))
    parser.add_argument("--no-fla", action="store_true",
                        help="on a GPU, do not time fla's kernels beside ours (default: timed "
                             "where fla is installed)")
    parser.set_defaults(handler=run)


def run(args) -> int:
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


def _platform_kind() -> str:
    return "cpu" if backends.platform() == "cpu" else "gpu"


def bench_results(args) -> list[dict] | None:
    """The rows of ``rwkv-jax bench`` (printed, written), or None when it could not start."""
    reason = selection_problem(args)
    if reason:
        print(f"rwkv-jax bench: {reason}", file=sys.stderr)
        return None
    skipped = {name: what for name, what in correctness_only().items()
               if not args.backend and any(name in selected_backends(args, op)
                                           for op in selected_ops(args))}
    for name, what in skipped.items():
        print(f"bench: not timing {name} ({what} on {backends.platform()}: a correctness path, "
              f"checked by rwkv-jax check); name it with --backend {name} to time it anyway")
    on_gpu = backends.platform() != "cpu"
    fla_reason = fla_unavailable_reason() if on_gpu and not args.no_fla else None
    if on_gpu and not args.no_fla and fla_reason:
        print(f"bench: fla not timed beside ours: {fla_reason}")
    dtypes = args.dtype or (["float32"] if not on_gpu else ["bfloat16"])
    repeats = args.repeats or (QUICK_REPEATS if args.quick else REPEATS)
    max_seconds = args.max_seconds or (QUICK_MAX_SECONDS if args.quick else MAX_SECONDS)
    interrupted = None
    try:
        with _terminate_as_interrupt():
            results = run_bench(selected_ops(args),
                                lambda op: selected_backends(args, op, timing=True),
                                bench_sizes(args), dtypes,
                                repeats=repeats, warmup=args.warmup, max_seconds=max_seconds,
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
        _plot.plot_bench(results, args.plot,
                         device=device if on_gpu else f"a CPU ({os.cpu_count()} cores)")
        print(f"wrote {args.plot}")
        if on_gpu:
            path = _plot.bandwidth_path(args.plot)
            _plot.plot_bandwidth(results, path, device=device, peak=peak_bandwidth(device))
            print(f"wrote {path}")
    if interrupted:
        raise SystemExit(130)  # the shell's status for an interrupted command
    return results


def bench_sizes(args) -> list[tuple]:
    """The (B, T, H, K) of --preset and --size, else this platform's defaults."""
    sizes = [PRESETS[name] for name in args.preset or []] + list(args.size or [])
    if sizes:
        return sizes
    platform = _platform_kind()
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


def run_bench(ops, backend_names, sizes, dtypes, *, repeats=REPEATS, warmup=WARMUP,
              max_seconds=MAX_SECONDS, progress=True, fla=False) -> list[dict]:
    """Every op x backend x size x dtype, then fla's kernel for the ops it has when ``fla``."""
    jobs = bench_jobs(ops, backend_names, sizes, dtypes)
    fla_jobs = [(op, "fla", size, dt) for op, size, dt in dict.fromkeys(
        (op, size, dt) for op, _, size, dt in jobs if op in FLA_OPS)] if fla else []
    results = []
    describe = lambda job: f"{job[0]} {job[1]} {shape_text(job[2])} {job[3]}"
    try:
        for op, name, size, dtype_name in with_progress(jobs + fla_jobs, "bench", describe,
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


def bench_jobs(ops, backend_names, sizes, dtypes) -> list[tuple]:
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
        from ..nn._bench import HEAD_SIZE, SIZES
        model, _, new_tokens, lane_counts = GENERATE_SIZES[_platform_kind()]
        heads = SIZES[model]["n_embd"] // HEAD_SIZE
        jobs += [(GENERATE, name, (lanes, new_tokens, heads, HEAD_SIZE), "bfloat16")
                 for name in backend_names(GENERATE) for lanes in lane_counts]
    return list(dict.fromkeys(jobs))


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
            results.append(dict(row, error=error_text(err)))
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
        return [dict(common, **{"pass": p}, fla_error=error_text(err)) for p in ("fwd", "fwd+bwd")]
    return [dict(common, **{"pass": p}, median_ms=ms, tokens_per_s=case.tokens / (ms / 1e3),
                 peak_bytes=None, repeats=repeats) for p, ms in times.items()]


@functools.lru_cache(maxsize=1)
def _generation_model(size: str, vocab: int):
    from ..nn._bench import random_model
    return random_model(size, vocab)


def bench_generation(backend: str, shape: tuple, *, repeats: int, max_seconds: float) -> dict:
    """The generation row: ``rwkv_jax.nn.Generator`` with ``B`` lanes on backend ``backend``'s
    step kernels, each lane decoding ``T`` tokens greedily after a PROMPT_TOKENS-token prompt;
    ms per decode step and new tokens/s of all lanes."""
    from ..nn import Sampling
    from ..nn._bench import SIZES, decode_rate
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
        return dict(row, error=error_text(err))
    return dict(row, median_ms=rate["ms_per_step"], min_ms=rate["min_ms_per_step"],
                repeats=rate["repeats"], tokens_per_s=rate["tokens_per_s"], peak_bytes=None,
                generated=rate["generated"], steps_per_call=rate["steps_per_call"],
                decode_calls=rate["decode_calls"])


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
                          megabytes(r["peak_bytes"]), r["repeats"]])
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


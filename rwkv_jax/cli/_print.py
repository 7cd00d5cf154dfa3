"""What every command prints the same way: tables, numbers, errors in one line, progress, and
the main job's verdict."""

from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from .._bench import STEP_OPS


def format_table(header: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def scientific(x: float | None) -> str:
    return "-" if x is None else ("non-finite" if not np.isfinite(x) else f"{x:.1e}")


def megabytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def shape_text(shape) -> str:
    """``(B, T, H, K)`` as ``B,T,H,K``, as --size takes it."""
    return ",".join(map(str, shape))


def error_text(err: Exception) -> str:
    """One line: the error's first line, and its last one where they differ (the cause of an
    error raised inside a callback comes last)."""
    lines = [line.strip() for line in f"{type(err).__name__}: {err}".splitlines() if line.strip()]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= 200 else text[:197] + "..."


def with_progress(jobs: list, desc: str, describe: Callable, *, enabled: bool = True,
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

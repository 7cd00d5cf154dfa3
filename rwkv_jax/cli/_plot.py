"""``rwkv-jax bench --plot``: time per call against the sequence length, and on a GPU the
achieved bandwidth against the device's peak (matplotlib, imported only here)."""

from __future__ import annotations

import os

from .. import backends
from .._bench import STEP_OPS
from ._select import GENERATE

DTYPE_STYLES = {"float32": "-", "bfloat16": "--", "float16": ":"}
PASSES = {"fwd": "forward", "fwd+bwd": "forward + backward"}


def _backend_colour(name: str) -> str:
    """One colour per backend, the same in every panel and figure."""
    order = list(backends.names()) + ["fla"]
    return f"C{order.index(name) % 10}" if name in order else "black"


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


def bandwidth_path(path: str) -> str:
    """Where the bandwidth figure of ``--plot path`` goes: beside it, ``_bandwidth`` added."""
    root, ext = os.path.splitext(path)
    return f"{root}_bandwidth{ext}"

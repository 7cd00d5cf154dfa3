"""Which ops and backends check and bench run: those named on the command line, else every op
on every backend available here."""

from __future__ import annotations

import importlib.util

from .. import backends

# bench's generation row (rwkv_jax.nn.Generator decoding; cli/bench.py) runs on the step
# kernels of GENERATE_STEP_OP.
GENERATE = "generate"
GENERATE_STEP_OP = "rwkv7_step"

# Backends that run on a platform only as a correctness path: checked, but not timed unless
# named with --backend (their times say nothing about speed).
CORRECTNESS_ONLY = {"cpu": {"triton": "Triton's interpreter"}}


def selected_ops(args) -> list[str]:
    """The ops named with --op, else every op (and bench's generation row on a GPU where flax
    is installed: on a CPU it runs only when named, so that the default stays quick)."""
    if args.op:
        return args.op
    generation = (args.command == "bench" and backends.platform() != "cpu"
                  and flax_missing() is None)
    return list(backends.OPS) + ([GENERATE] if generation else [])


def flax_missing() -> str | None:
    """Why the generation row cannot run here (None when it can)."""
    if importlib.util.find_spec("flax") is None:
        return 'the generation row needs flax: pip install "rwkv_jax[flax]"'
    return None


def kernel_op(op: str) -> str:
    """The op whose backends run ``op`` (the generation row runs on the step kernels)."""
    return GENERATE_STEP_OP if op == GENERATE else op


def correctness_only() -> dict:
    """This platform's correctness-only backends: name -> what runs there."""
    return CORRECTNESS_ONLY.get(backends.platform(), {})


def selected_backends(args, op: str, *, timing: bool = False) -> list[str]:
    """Backends to run ``op`` on: the requested ones that implement it, else all available
    (for timing, without this platform's correctness-only paths)."""
    rows = {b["name"]: b for b in backends.describe()}
    names = args.backend or [name for name, row in rows.items() if row["available"]
                             and not (timing and name in correctness_only())]
    return [name for name in names if kernel_op(op) in rows[name]["ops"]]


def selection_problem(args) -> str | None:
    """Why a backend named on the command line cannot run here, or why an op named there runs
    on none of the backends named, or None."""
    rows = {b["name"]: b for b in backends.describe()}
    for name in args.backend or []:
        if not rows[name]["available"]:
            return f"backend {name!r} cannot run here: {rows[name]['reason']}"
    for op in args.op or []:
        if op == GENERATE and flax_missing():
            return flax_missing()
        if args.backend and not any(kernel_op(op) in rows[name]["ops"] for name in args.backend):
            named = ", ".join(repr(name) for name in dict.fromkeys(args.backend))
            one = len(set(args.backend)) == 1
            have = [name for name, row in rows.items()
                    if row["available"] and kernel_op(op) in row["ops"]]
            return (f"{'backend' if one else 'backends'} {named} {'does' if one else 'do'} "
                    f"not implement {op}; backends that do here: {', '.join(have) or 'none'}")
    return None

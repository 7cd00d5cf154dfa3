"""The ``rwkv-jax`` command (also ``python -m rwkv_jax``); docs/cli.md documents every flag.

    rwkv-jax          the main job (about a minute on a CPU): info, check, a quick bench of the
                      performance paths, then one verdict line
    rwkv-jax info     versions, devices, backends available here (or why not), default per op
    rwkv-jax check    every op x available backend against a float64 reference, with pass/fail
    rwkv-jax bench    every op x backend, forward and forward+backward, timings and memory
                      (beside fla's kernels on a GPU where fla is installed); --plot draws them;
                      on a GPU also a generation row (rwkv_jax.nn.Generator, --op generate)
    rwkv-jax train    train an RWKV-7 language model on a token file (rwkv_jax.train)

A module per command (``register`` adds its subparser, ``run`` runs it); what they share is in
``_parser`` (argument types, the selection flags), ``_select`` (which ops and backends run) and
``_print`` (tables, progress, the verdict).

Exit codes: 0 all good, 1 a check failed or a benchmark case errored, 2 bad command line, 130
a bench interrupted.
"""

from __future__ import annotations

import argparse

from .. import __version__
from . import bench, check, info, train
from ._print import verdict

COMMANDS = (info, check, bench, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rwkv-jax",
        description="RWKV linear-attention kernels for JAX: inspect, check, benchmark, train. "
        "Without a subcommand, the main job (about a minute on a CPU): info, check (quick size, "
        "float32), a quick bench of the backends that are performance paths here, and a verdict "
        "line; exit status 0 only if every check passed and no benchmark case errored.")
    parser.add_argument("--version", action="version", version=f"rwkv_jax {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{info,check,bench,train}")
    for command in COMMANDS:
        command.register(commands)
    return parser


def main_job(parser) -> int:
    """info, check (the quick size, float32, every backend), a quick bench of the performance
    paths, and the verdict: about a minute on a 2-core CPU."""
    info.run(None)
    print()
    check_rows = check.check_rows(parser.parse_args(["check", "--quick", "--dtype", "float32"]))
    print()
    bench_rows = None
    if check_rows and all(r["ok"] for r in check_rows):
        bench_rows = bench.bench_results(parser.parse_args(["bench", "--quick"]))
        print()
    status, line = verdict(check_rows, bench_rows)
    print(line)
    return status


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        return main_job(parser)
    return args.handler(args)

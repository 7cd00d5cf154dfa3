"""The argparse types of every command (each value is checked before any work: a bad one is a
usage error, exit status 2) and the selection flags that check and bench share."""

from __future__ import annotations

import argparse
import os

from .. import backends
from .._bench import DTYPES


def size(text: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--size needs four positive integers B,T,H,K, got {text!r}")
    return values


def at_least(minimum: int):
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


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"needs a number of seconds > 0, got {text!r}")
    return value


def output_path(text: str) -> str:
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


def plot_path(text: str) -> str:
    """``--plot``'s file, named as it will be written: without an extension, ``.png`` added
    (as matplotlib would add it)."""
    return output_path(text if os.path.splitext(text)[1] else text + ".png")


def names(choices):
    """An argparse type for comma-separated names, each from ``choices`` (read when called)."""
    def parse(text: str) -> list[str]:
        chosen = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in choices()]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"unknown name {', '.join(unknown) or repr(text)}; choose from {', '.join(choices())}")
        return chosen
    return parse


def add_selection(parser, *, ops, op_help, backend_default, dtype_default, size_help,
                  quick_help) -> None:
    """check's and bench's --op, --backend, --dtype, --size and --quick. The first four
    repeat: ``--op rwkv7 --op rwkv4`` is ``--op rwkv7,rwkv4``, and each --size adds a size."""
    parser.add_argument("--op", type=names(ops), action="extend", help=op_help)
    parser.add_argument("--backend", type=names(backends.names), action="extend",
                        help=f"backends to run, comma-separated, repeatable (default: "
                             f"{backend_default})")
    parser.add_argument("--dtype", type=names(lambda: tuple(DTYPES)), action="extend",
                        help=f"input dtypes, comma-separated, repeatable (default: "
                             f"{dtype_default})")
    parser.add_argument("--size", type=size, action="append", metavar="B,T,H,K", help=size_help)
    parser.add_argument("--quick", action="store_true", help=quick_help)

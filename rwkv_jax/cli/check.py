"""``rwkv-jax check``: every op x available backend against the native backend in float64
(outputs, final state and every gradient), with pass/fail per row."""

from __future__ import annotations

import functools
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import backends
from .. import ops as public_ops
from .._bench import DTYPES, STEP_OPS, Case, bind, make_case, random_cotangents, vjp_function
from ..backends import native
from . import _parser
from ._print import error_text, format_table, scientific, shape_text, with_progress
from ._select import selected_backends, selected_ops, selection_problem

# (B, T, H, K); T is deliberately not a multiple of a chunk size. Steps run STEP_LENGTH tokens.
CHECK_SIZE = (2, 72, 2, 64)
QUICK_CHECK_SIZE = (1, 20, 2, 64)
STEP_LENGTH = 3
DEFAULT_DTYPES = ("float32", "bfloat16")

# The keyword arguments a backend function needs that the public op fills in by default.
BACKEND_DEFAULTS = {
    "rwkv7": dict(output_final_state=True, cu_seqlens=None),
    "rwkv6": dict(output_final_state=True, cu_seqlens=None),
    "gated_linear_attention": dict(output_final_state=True, cu_seqlens=None),
    "rwkv4": dict(output_final_state=True),
    "rwkv7_step": {},
    "rwkv6_step": {},
}


def register(commands) -> None:
    parser = commands.add_parser(
        "check", help="every op x backend against a float64 reference",
        description="Every op x backend available here against the native backend in float64: "
        "the relative error of the output, the final state and the worst gradient, each within "
        "the backend's tolerance for the dtype. Exit status 1 if any row fails.")
    _parser.add_selection(
        parser, ops=lambda: backends.OPS,
        op_help="ops to run, comma-separated, repeatable (default: all)",
        backend_default="all available here", dtype_default=",".join(DEFAULT_DTYPES),
        size_help=f"problem size (K == V), repeatable: each size is checked and gets its own "
                  f"table (default {shape_text(CHECK_SIZE)}); step ops run T={STEP_LENGTH} "
                  f"tokens",
        quick_help=f"the smaller size {shape_text(QUICK_CHECK_SIZE)} (--size overrides it)")
    parser.add_argument("--seed", type=_parser.at_least(0), default=0,
                        help="random inputs' seed, an integer >= 0 (default 0)")
    parser.set_defaults(handler=run)


def run(args) -> int:
    rows = check_rows(args)
    return 0 if rows and all(r["ok"] for r in rows) else 1


def check_rows(args) -> list[dict] | None:
    """The rows of ``rwkv-jax check`` (printed, a table per size), or None when nothing could
    run."""
    reason = selection_problem(args)
    if reason:
        print(f"rwkv-jax check: {reason}", file=sys.stderr)
        return None
    sizes = args.size or [QUICK_CHECK_SIZE if args.quick else CHECK_SIZE]
    dtypes = args.dtype or list(DEFAULT_DTYPES)
    rows = []
    for i, size in enumerate(dict.fromkeys(sizes)):
        size_rows = run_check(selected_ops(args), dtypes, size,
                              lambda op: selected_backends(args, op), seed=args.seed)
        if not size_rows:  # the same selection at every size
            print("rwkv-jax check: no backend here implements the selected ops", file=sys.stderr)
            return None
        if i:
            print()
        print_check(size_rows, size)
        rows += size_rows
    return rows


def run_check(ops: list[str], dtypes: list[str], size, select_backends, *, seed: int = 0,
              progress: bool = True) -> list[dict]:
    batch, length, heads, head_size = size
    jobs = [(op, dt) for op in ops for dt in dtypes if select_backends(op)]
    rows = []
    describe = lambda job: f"{job[0]} {job[1]} on {', '.join(select_backends(job[0]))}"
    for op, dtype_name in with_progress(jobs, "check", describe, enabled=progress,
                                            leave=False):
        step_length = min(length, STEP_LENGTH) if op in STEP_OPS else length
        case = make_case(op, batch, step_length, heads, head_size, seed=seed)
        rows.extend(check_case(case, dtype_name, select_backends(op)))
    return rows


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
            grad_errors = {n: relative_error(g, r) for n, g, r in zip(names, grads, ref_grads)}
            output, final_state = relative_error(out, ref_out), relative_error(state, ref_state)
        except Exception as err:  # a backend that raises fails the check; the message says why
            rows.append(dict(row, ok=False, error=error_text(err)))
            continue
        worst = max(grad_errors, key=grad_errors.get)
        row.update(output=output, state=final_state, gradient=grad_errors[worst], worst_input=worst)
        row["ok"] = output <= fwd_tol and final_state <= fwd_tol and row["gradient"] <= grad_tol
        rows.append(row)
    return rows


def relative_error(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf when x is non-finite."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
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


def print_check(rows: list[dict], size) -> None:
    table = []
    for r in rows:
        tolerance = f"{r['tolerance'][0]:.0e}/{r['tolerance'][1]:.0e}"
        if "error" in r:
            table.append([r["op"], r["backend"], r["dtype"], "-", "-", "-", "", tolerance,
                          "ERROR " + r["error"]])
        else:
            table.append([r["op"], r["backend"], r["dtype"], scientific(r["output"]),
                          scientific(r["state"]), scientific(r["gradient"]), r["worst_input"],
                          tolerance, "pass" if r["ok"] else "FAIL"])
    print(f"check: relative error ||x - ref|| / ||ref|| against the native backend in float64, "
          f"B,T,H,K = {shape_text(size)} (steps: T={STEP_LENGTH})")
    print(format_table(["op", "backend", "dtype", "output", "state", "grad (worst)", "of",
                        "tol fwd/grad", "result"], table))
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")

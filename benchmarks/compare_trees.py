"""Time the public ops of two source trees of rwkv_jax on one GPU, one after the other, in one run.

    python benchmarks/compare_trees.py OLD_TREE NEW_TREE [--cases rwkv7-k64 gla-k128 ...]
    python benchmarks/compare_trees.py OLD_TREE NEW_TREE --smoke     # tiny sizes, CPU

Each tree runs in its own process (``PYTHONPATH=TREE``: both define the package ``rwkv_jax``),
old first, then new, then old again when ``--rounds 2``; every process times the same cases on
the same inputs (bf16, seeded random values in the models' ranges, never zeros) through the
public op with ``backend="triton"``: the forward alone and forward+backward (``jax.vjp`` with a
random cotangent), each the median of ``--reps`` calls after a compiling call (which takes a
minute or more per case on a fresh machine: give ``--timeout`` room, or fewer ``--cases``; a
process stopped at its timeout keeps the rows it printed). Prints one markdown table: each case
measured in both trees, its milliseconds per tree and new / old (the old tree's figure is the
median of its rounds).

``--parallel`` compiles on every core at once: one process per tree and case, all started
together, each compiling its case and then waiting; once all are ready they time one at a time,
each case in two rounds (old, new, then new, old) before its two processes quit, and each tree's
figure is the median of its two rounds. Nothing else runs on the GPU while one process times."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# name -> (op, batch, steps, heads, key, extra): the shapes the kernels are judged on.
CASES = {
    "rwkv7-k64": ("rwkv7", 8, 4096, 64, 64, {}),
    "rwkv7-k128": ("rwkv7", 8, 4096, 32, 128, {}),
    "rwkv7-k32": ("rwkv7", 8, 4096, 128, 32, {}),
    "rwkv7-long": ("rwkv7", 1, 65536, 32, 64, {}),
    "rwkv7-varlen": ("rwkv7", 1, 32768, 32, 64, {"sequences": 16}),
    "rwkv7-exact": ("rwkv7", 8, 4096, 64, 64, {"strong": True}),
    "gla-k64": ("gated_linear_attention", 8, 4096, 64, 64, {}),
    "gla-k128": ("gated_linear_attention", 8, 4096, 32, 128, {}),
    "gla-long": ("gated_linear_attention", 1, 65536, 32, 64, {}),
    "gla-varlen": ("gated_linear_attention", 1, 32768, 32, 64, {"sequences": 16}),
    "rwkv6-k64": ("rwkv6", 8, 4096, 64, 64, {}),
    "rwkv6-k128": ("rwkv6", 8, 4096, 32, 128, {}),
    "rwkv6-long": ("rwkv6", 1, 65536, 32, 64, {}),
    "rwkv6-varlen": ("rwkv6", 1, 32768, 32, 64, {"sequences": 16}),
}
SMOKE = dict(batch=1, steps=80, heads=2, key=16)


def inputs(op, batch, steps, heads, key, extra, seed=0):
    """Keyword arrays of ``op`` (float32 numpy; the worker casts to bf16)."""
    rng = np.random.default_rng(seed)
    normal = lambda: rng.standard_normal((batch, steps, heads, key)).astype(np.float32)
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))
    if op == "rwkv7":
        r, k, v, iclr, raw = (normal() for _ in range(5))
        kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
        w = -np.exp(-0.5) * sigmoid(raw)           # the models' range, >= -0.6065
        if extra.get("strong"):                    # chunks past the tame bound: the exact path
            w = np.where(rng.random(w.shape) < 0.05, -8.0, w).astype(np.float32)
        return dict(r=r, w=w, k=k, v=v, a=-kk, b=kk * sigmoid(iclr))
    if op == "rwkv6":
        r, k, v, raw = (normal() for _ in range(4))
        u = rng.standard_normal((heads, key)).astype(np.float32)
        return dict(r=r, k=k, v=v, w=-np.exp(-0.5 + 0.5 * raw), u=u)
    q, k, v, raw = (normal() for _ in range(4))
    return dict(q=q, k=k, v=v, gk=np.log(sigmoid(raw + 3.0)) / 16.0)


def worker(names, reps, smoke, serve=False):
    """Times ``names``; with ``serve``, compiles them, prints "ready", then times them each time
    a line "time" arrives on standard input (and prints "done"), until the input ends."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _log import median_seconds   # benchmarks/_log.py
    import jax
    import jax.numpy as jnp
    import rwkv_jax
    jobs = []
    for name in names:
        op, batch, steps, heads, key, extra = CASES[name]
        if smoke:
            batch, steps, heads, key = (SMOKE[n] for n in ("batch", "steps", "heads", "key"))
        arrays = inputs(op, batch, steps, heads, key, extra)
        dtype = jnp.float32 if smoke else jnp.bfloat16
        x = {n: jnp.asarray(a, jnp.float32 if n == "u" else dtype) for n, a in arrays.items()}
        options = dict(backend="triton", output_final_state=True)
        sequences = extra.get("sequences")
        if sequences:
            cuts = np.sort(np.random.default_rng(1).choice(np.arange(1, steps), sequences - 1,
                                                           replace=False))
            options["cu_seqlens"] = jnp.asarray(np.concatenate([[0], cuts, [steps]]), jnp.int32)
        call = lambda x: getattr(rwkv_jax, op)(**x, **options)
        out, state = jax.eval_shape(call, x)
        rng = np.random.default_rng(2)
        d_out = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
        d_state = jnp.asarray(rng.standard_normal(state.shape), state.dtype)
        forward = jax.jit(call)

        @jax.jit
        def forward_backward(x):
            result, pull = jax.vjp(call, x)
            return result, pull((d_out, d_state))

        for mode, fn in (("forward", forward), ("forward+backward", forward_backward)):
            jobs.append((f"{name} {mode}", fn.lower(x).compile() if serve else fn, x))
    if not serve:
        return time_jobs(jobs, reps, median_seconds)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "time":
            time_jobs(jobs, reps, median_seconds)
            print("done", flush=True)


def time_jobs(jobs, reps, median_seconds):
    for label, fn, x in jobs:
        row = {label: 1e3 * median_seconds(fn, x, reps=reps)}
        print(json.dumps(row), flush=True)   # one line each: a run cut short keeps them


def worker_process(tree, names, reps, smoke, serve=False):
    """The command and environment of a worker timing ``names`` on ``tree``'s package."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.abspath(tree), os.environ.get("PYTHONPATH")])))
    if serve:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # the GPU is shared
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--reps", str(reps),
               "--cases", *names] + (["--smoke"] if smoke else []) + (["--serve"] if serve else [])
    return command, env


def run_tree(tree, names, reps, smoke, timeout):
    command, env = worker_process(tree, names, reps, smoke)
    print(f"== {tree}", flush=True)
    try:
        proc = subprocess.run(command, env=env, cwd=tree, stdout=subprocess.PIPE, text=True,
                              timeout=timeout)
        output, status = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as stopped:
        output, status = stopped.stdout or "", f"stopped after {timeout} s"
        output = output.decode() if isinstance(output, bytes) else output
    rows = {}
    for line in output.splitlines():
        if line.startswith("{"):
            rows.update(json.loads(line))
            print("  " + line, flush=True)
    if status:
        print(f"{tree}: exit status {status}; {len(rows)} rows", flush=True)
    return rows


def run_parallel(trees, names, reps, smoke, timeout):
    """One serving worker per (tree, case), compiling at once; then timed one at a time, each
    case in two rounds of opposite tree order. Returns each tree's rows per round."""
    workers = {}
    for tree in trees:
        for name in names:
            command, env = worker_process(tree, [name], reps, smoke, serve=True)
            workers[tree, name] = subprocess.Popen(command, env=env, cwd=tree, text=True,
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    start = time.monotonic()
    ready = {}
    for key, proc in workers.items():
        line = proc.stdout.readline()            # "ready", or "" when the worker failed
        ready[key] = line.strip() == "ready"
        print(f"{key}: {'compiled' if ready[key] else 'FAILED'} at "
              f"{time.monotonic() - start:.0f} s", flush=True)
    rows = {tree: [{}, {}] for tree in trees}
    for name in names:              # a case's processes quit after it: they free their memory
        for round_index, tree in ((0, trees[0]), (0, trees[1]), (1, trees[1]), (1, trees[0])):
            if not ready[tree, name] or time.monotonic() - start > timeout:
                continue
            proc = workers[tree, name]
            proc.stdin.write("time\n")
            proc.stdin.flush()
            for line in proc.stdout:
                if line.strip() == "done":
                    break
                if line.startswith("{"):
                    rows[tree][round_index].update(json.loads(line))
                    print(f"  round {round_index + 1} {tree}: {line.strip()}", flush=True)
        for tree in trees:
            workers[tree, name].stdin.close()
            workers[tree, name].wait()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", help="OLD_TREE NEW_TREE")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, choices=(1, 2))
    parser.add_argument("--timeout", type=int, default=400, help="seconds per tree's process")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--parallel", action="store_true",
                        help="compile every (tree, case) at once, then time one at a time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1; got {args.reps}")
    if args.worker:
        return worker(args.cases, args.reps, args.smoke, args.serve)
    if len(args.trees) != 2 or not all(os.path.isdir(t) for t in args.trees):
        parser.error(f"give two source trees, OLD_TREE NEW_TREE; got {args.trees}")
    old_tree, new_tree = args.trees
    if args.parallel:
        rows = run_parallel([old_tree, new_tree], args.cases, args.reps, args.smoke, args.timeout)
        old = rows[old_tree]
        new = {row: statistics.median(r[row] for r in rows[new_tree] if row in r)
               for row in set().union(*rows[new_tree])}
        return print_table(old, new)
    old = [run_tree(old_tree, args.cases, args.reps, args.smoke, args.timeout)]
    new = run_tree(new_tree, args.cases, args.reps, args.smoke, args.timeout)
    if args.rounds == 2:
        old.append(run_tree(old_tree, args.cases, args.reps, args.smoke, args.timeout))
    print_table(old, new)


def print_table(old, new):
    """``old``: the old tree's rows per round; ``new``: the new tree's figure per row."""
    print("\n| case | old ms | new ms | new / old |\n|---|---|---|---|")
    for row in sorted(r for r in new if any(r in o for o in old)):
        before = statistics.median(o[row] for o in old if row in o)
        print(f"| {row} | {before:.3f} | {new[row]:.3f} | {new[row] / before:.3f} |")


if __name__ == "__main__":
    main()

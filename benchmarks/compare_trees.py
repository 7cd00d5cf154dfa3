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
median of its rounds)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

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
    "rwkv6-k64": ("rwkv6", 8, 4096, 64, 64, {}),
    "rwkv6-k128": ("rwkv6", 8, 4096, 32, 128, {}),
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


def worker(names, reps, smoke):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _log import median_seconds   # benchmarks/_log.py
    import jax
    import jax.numpy as jnp
    import rwkv_jax
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
        out, state = call(x)
        rng = np.random.default_rng(2)
        d_out = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
        d_state = jnp.asarray(rng.standard_normal(state.shape), state.dtype)
        forward = jax.jit(call)

        @jax.jit
        def forward_backward(x):
            result, pull = jax.vjp(call, x)
            return result, pull((d_out, d_state))

        for mode, fn in (("forward", forward), ("forward+backward", forward_backward)):
            row = {f"{name} {mode}": 1e3 * median_seconds(fn, x, reps=reps)}
            print(json.dumps(row), flush=True)   # one line each: a run cut short keeps them


def run_tree(tree, names, reps, smoke, timeout):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.abspath(tree), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--reps", str(reps),
               "--cases", *names] + (["--smoke"] if smoke else [])
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", help="OLD_TREE NEW_TREE")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, choices=(1, 2))
    parser.add_argument("--timeout", type=int, default=400, help="seconds per tree's process")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1; got {args.reps}")
    if args.worker:
        return worker(args.cases, args.reps, args.smoke)
    if len(args.trees) != 2 or not all(os.path.isdir(t) for t in args.trees):
        parser.error(f"give two source trees, OLD_TREE NEW_TREE; got {args.trees}")
    old_tree, new_tree = args.trees
    old = [run_tree(old_tree, args.cases, args.reps, args.smoke, args.timeout)]
    new = run_tree(new_tree, args.cases, args.reps, args.smoke, args.timeout)
    if args.rounds == 2:
        old.append(run_tree(old_tree, args.cases, args.reps, args.smoke, args.timeout))
    print(f"\n| case | old ms | new ms | new / old |\n|---|---|---|---|")
    for row in [r for r in new if any(r in o for o in old)]:
        before = statistics.median(o[row] for o in old if row in o)
        print(f"| {row} | {before:.3f} | {new[row]:.3f} | {new[row] / before:.3f} |")


if __name__ == "__main__":
    main()

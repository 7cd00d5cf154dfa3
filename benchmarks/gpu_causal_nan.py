"""Causal NaN on the GPU kernels, and the timing that shows what keeping it causal costs.

    python benchmarks/gpu_causal_nan.py --out DIR [--check] [--time]   (both when neither)

1. ``--check``: a NaN in each input with a time axis at t = 70 (row 0, head 0; inside a second
   chunk of 64 tokens and of 16) on the triton and ffi backends (the ffi ones on the GPU: the
   chunked CUDA pair at K = V in (64, 128)), float32 and bfloat16, the forward alone (the
   inference kernels) and under ``jax.vjp`` (the training kernels): outputs before t equal the
   run without the NaN, every output from t on holds a NaN, the final state too; RWKV-6 and GLA
   on triton likewise. rwkv7 on triton at 2 and 80 heads: a forward alone takes the 64-token
   kernels at few sequence-heads and the 16-token forward at many. Prints one line per case
   and FAIL for any that is not causal (the GPU chunked kernels are not yet: DESIGN.md).
2. ``--time``: rwkv7 forward and forward+backward medians at B=8 T=4096, H=64 K=64 and H=32
   K=128, bf16, random non-zero inputs (model-range decays), on triton and ffi. Run it once per
   source tree in one GPU session (benchmarks/gpu_causal_nan.sh) to compare before and after.
Everything goes to DIR/gpu_causal_nan.log as well.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import reference  # noqa: E402
from _log import log, median_seconds, open_log  # noqa: E402 (benchmarks/_log.py)

import rwkv_jax  # noqa: E402

ARGS = {"rwkv7": tuple("rwkvab"), "rwkv6": tuple("rkvwu"),
        "gated_linear_attention": ("q", "k", "v")}


def inputs(op, batch, steps, heads, key, dtype, seed=0):
    extra = dict(gates=("g", "gk", "gv")) if op == "gated_linear_attention" else {}
    x = reference.random_inputs(op, np.random.default_rng(seed), batch=batch, steps=steps,
                                heads=heads, key=key, **extra)
    return {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else dtype) for n, a in x.items()}


def caller(op, backend, differentiated):
    def run(x):
        f = lambda x: getattr(rwkv_jax, op)(*(x[n] for n in ARGS[op]), backend=backend,
                                            **{n: a for n, a in x.items() if n not in ARGS[op]})
        if not differentiated:
            return f(x)
        (out, state), pullback = jax.vjp(f, x)
        return out, state, pullback((jnp.ones_like(out), jnp.ones_like(state)))
    return jax.jit(run)


def check(t=70, quick=False):
    failures = 0
    cases = [("rwkv7", b, key, 2) for b in ("triton", "ffi") for key in (64, 128)]
    cases += [("rwkv7", "triton", key, 80) for key in (64, 128)]
    cases += [("rwkv6", "triton", 64, 2), ("gated_linear_attention", "triton", 64, 2)]
    dtypes = (jnp.float32, jnp.bfloat16)
    if quick:  # RWKV-7 at K=64 on each GPU kernel family, bfloat16
        cases, dtypes = [("rwkv7", "ffi", 64, 2), ("rwkv7", "triton", 64, 2),
                         ("rwkv7", "triton", 64, 80)], (jnp.bfloat16,)
    for op, backend, key, heads in cases:
        for dtype in dtypes:
            x = inputs(op, 2, 160, heads, key, dtype)
            for differentiated in (False, True):
                run = caller(op, backend, differentiated)
                clean = np.asarray(run(x)[0], np.float64)  # (out, state[, grads])
                for name in (n for n in x if x[n].ndim >= 3 and n != "initial_state"):
                    at = (0, t, 0) + (0,) * (x[name].ndim - 3)
                    out, state = run(dict(x, **{name: x[name].at[at].set(jnp.nan)}))[:2]
                    out, state = np.asarray(out, np.float64), np.asarray(state)
                    before, after = out[0, :t, 0], out[0, t + ((op, name) == ("rwkv6", "w")):, 0]
                    read_only = name in ("r", "q")
                    ok = (np.isfinite(before).all()
                          and np.allclose(before, clean[0, :t, 0], rtol=2e-2, atol=2e-2)
                          and np.isnan(after[:1] if read_only else after).any(-1).all()
                          and (read_only or np.isnan(state[0, 0]).any())
                          and np.isfinite(out[1]).all())
                    failures += not ok
                    log(f"{'ok  ' if ok else 'FAIL'} {op} {backend} K={key} H={heads} "
                        f"{jnp.dtype(dtype).name} {'vjp' if differentiated else 'forward'} "
                        f"NaN in {name}[t={t}]")
    log(f"causal NaN: {failures} failures")
    return failures


def timing(reps):
    for heads, key in ((64, 64), (32, 128)):
        x = inputs("rwkv7", 8, 4096, heads, key, jnp.bfloat16)
        x = {n: a for n, a in x.items() if n != "initial_state"}
        for backend in ("triton", "ffi"):
            forward = caller("rwkv7", backend, False)
            both = caller("rwkv7", backend, True)
            log(f"rwkv7 {backend} B=8 T=4096 H={heads} K={key} bf16: forward "
                f"{1e3 * median_seconds(forward, x, reps=reps):.3f} ms, forward+backward "
                f"{1e3 * median_seconds(both, x, reps=reps):.3f} ms (medians of {reps})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="--check on three cases only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    open_log(os.path.join(args.out, "gpu_causal_nan.log"))
    log("rwkv_jax from", os.path.dirname(rwkv_jax.__file__), "| devices", jax.devices())
    failures = check(quick=args.quick) if args.check or not args.time else 0
    if args.time or not args.check:
        timing(args.reps)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

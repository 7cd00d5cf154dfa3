"""The ffi backend's CUDA kernels on an NVIDIA GPU: correctness against the float64 reference,
then side-by-side timings with fla. Run through benchmarks/gpu_ffi.sh (it builds the extension).

1. Correctness of every op (forward, final state and every gradient, including a non-symmetric
   final-state cotangent, packed sequences, strong and zero decays, K = 64 and 128, float32 and
   bfloat16, steps with a permuted subset of pool rows) against tests/reference.py.
2. Timings (medians): RWKV-6 forward and forward+backward at B=8, T=4096, H=64, K=64, bf16
   against fla's chunk_rwkv6; RWKV-7 training at the same size against fla's chunk_rwkv7; the
   RWKV-7 decode step (T=1, H=32, K=64) at B = 1, 64, 256 against fla's fused_recurrent_rwkv7
   and the memory floor (reading and writing the float32 state at the measured copy bandwidth).
The table comes last; everything also goes to OUT/gpu_ffi.log and OUT/gpu_ffi.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import reference  # noqa: E402
from _log import log, median_seconds, open_log, relative_error as rel  # noqa: E402  (benchmarks/_log.py)

import rwkv_jax  # noqa: E402

ARGS = {"rwkv7": "rwkvab", "rwkv6": "rkvwu", "rwkv4": "wukv", "rwkv7_step": "rwkvab",
        "rwkv6_step": "rkvwu"}
results: dict = {"correctness": [], "timings": []}




def call(op, arrays, opts):
    """ops.<op> on the ffi backend from a dict of named arrays."""
    fn = getattr(rwkv_jax, op)
    positional = [arrays[n] for n in ARGS[op]]
    kw = dict(backend="ffi")
    if op.endswith("_step"):
        return fn(*positional, arrays["state"], state_indices=opts["state_indices"], **kw)
    if "initial_state" in arrays:
        kw["initial_state"] = arrays["initial_state"]
    if op != "rwkv4" and "cu_seqlens" in opts:
        kw["cu_seqlens"] = jnp.asarray(opts["cu_seqlens"], jnp.int32)
    return fn(*positional, **kw)


def check(label, op, dtype, seed, **spec):
    rng = np.random.default_rng(seed)
    ref_opts = {}
    if "cu_seqlens" in spec:
        ref_opts["cu_seqlens"] = np.asarray(spec["cu_seqlens"])
    if op.endswith("_step"):
        ref_opts["state_indices"] = np.asarray(spec.pop("state_indices"))
    cu = spec.pop("cu_seqlens", None)
    x = reference.random_inputs(op, rng, **spec)
    # Round the per-token inputs to the tested dtype; the reference uses the rounded values.
    states = ("initial_state", "state")
    x = {n: (a if n in states else np.asarray(jnp.asarray(a, dtype).astype(jnp.float64)))
         for n, a in x.items()}
    out, state = reference.forward(op, x, **ref_opts)
    d_out, d_state = rng.standard_normal(out.shape), rng.standard_normal(state.shape)
    grads = reference.gradients(op, x, d_out, d_state, **ref_opts)
    names = list(x)
    arrays = {n: jnp.asarray(a, jnp.float32 if n in states else dtype) for n, a in x.items()}
    opts = {"state_indices": jnp.asarray(ref_opts.get("state_indices", [0]), jnp.int32)}
    if cu is not None:
        opts["cu_seqlens"] = cu

    def f(*values):
        return call(op, dict(zip(names, values)), opts)

    (o, h), vjp = jax.vjp(f, *(arrays[n] for n in names))
    g = vjp((jnp.asarray(d_out, o.dtype), jnp.asarray(d_state, h.dtype)))
    errors = {"out": rel(o, out), "state": rel(h, state)}
    errors.update({f"d{n}": rel(gi, grads[n]) for n, gi in zip(names, g)})
    fwd_tol, grad_tol = rwkv_jax.backends.tolerance("ffi", dtype)
    ok = all(e <= (fwd_tol if n in ("out", "state") else grad_tol) for n, e in errors.items())
    worst = max(errors.values())
    log(f"check {label:34s} {'PASS' if ok else 'FAIL'} worst {worst:.1e}  "
        + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
    results["correctness"].append(dict(label=label, ok=ok, errors=errors))
    return ok


def correctness(only):
    f32, bf16 = jnp.float32, jnp.bfloat16
    common = dict(batch=2, steps=100, heads=3)
    cases = [
        ("rwkv7 fp32 K64", "rwkv7", f32, dict(common, key=64)),
        ("rwkv7 fp32 K128 strong", "rwkv7", f32, dict(common, key=128, decay="strong")),
        ("rwkv7 fp32 K64 w=0", "rwkv7", f32, dict(common, key=64, decay="zero")),
        ("rwkv7 fp32 K64 packed", "rwkv7", f32,
         dict(batch=1, steps=160, heads=3, key=64, cu_seqlens=[0, 37, 37, 100, 160], state_rows=4)),
        ("rwkv7 bf16 K64", "rwkv7", bf16, dict(common, key=64)),
        ("rwkv6 fp32 K64", "rwkv6", f32, dict(common, key=64)),
        ("rwkv6 fp32 K128 strong", "rwkv6", f32, dict(common, key=128, decay="strong")),
        ("rwkv6 fp32 K64 packed", "rwkv6", f32,
         dict(batch=1, steps=160, heads=3, key=64, cu_seqlens=[0, 37, 37, 100, 160], state_rows=4)),
        ("rwkv6 bf16 K64", "rwkv6", bf16, dict(common, key=64)),
        ("rwkv4 fp32 C=192", "rwkv4", f32, dict(common, key=64)),
        ("rwkv4 bf16 C=192", "rwkv4", bf16, dict(common, key=64)),
    ]
    for op in ("rwkv7_step", "rwkv6_step"):
        for steps in (1, 5):
            cases.append((f"{op} fp32 T={steps} rows [4,1,3]", op, f32,
                          dict(batch=3, steps=steps, heads=3, key=64, state_rows=6,
                               state_indices=[4, 1, 3])))
        cases.append((f"{op} bf16 T=1", op, bf16,
                      dict(batch=3, steps=1, heads=3, key=64, state_rows=6, state_indices=[5, 0, 2])))
    ok = True
    for i, (label, op, dtype, spec) in enumerate(cases):
        if only and not any(label.startswith(prefix) for prefix in only):
            continue
        try:
            ok &= check(label, op, dtype, seed=i, **spec)
        except Exception:  # report and go on: the timings are still worth having
            log(f"check {label:34s} ERROR\n" + traceback.format_exc())
            ok = False
    return ok


# --------------------------------------------------------------------------------------------
# Timings


def time_jax(fn, *args, reps=20):
    return 1e3 * median_seconds(fn, *args, reps=reps)


def time_torch(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def record(label, ms, note=""):
    log(f"time {label:44s} {ms:9.3f} ms {note}")
    results["timings"].append(dict(label=label, ms=ms, note=note))


def training_inputs(op, rng, batch, steps, heads, key, dtype):
    x = reference.random_inputs(op, rng, batch=batch, steps=steps, heads=heads, key=key,
                                initial_state=False)
    return {n: jnp.asarray(a, dtype) for n, a in x.items()}


def to_torch(x):
    import torch

    return torch.from_dlpack(jax.block_until_ready(x)).clone().requires_grad_(True)


def bench_training(op, fla_fn, batch=8, steps=4096, heads=64, key=64):
    import torch

    rng = np.random.default_rng(0)
    x = training_inputs(op, rng, batch, steps, heads, key, jnp.bfloat16)
    names = ARGS[op]
    args = [x[n] for n in names]
    fn = getattr(rwkv_jax, op)
    do = jnp.asarray(rng.standard_normal((batch, steps, heads, key)), jnp.bfloat16)
    fwd = jax.jit(lambda *a: fn(*a, backend="ffi")[0])

    def fwd_bwd(*a):
        o, vjp = jax.vjp(lambda *z: fn(*z, backend="ffi")[0], *a)
        return vjp(do)

    record(f"{op} ffi fwd bf16 B{batch} T{steps} H{heads} K{key}", time_jax(fwd, *args))
    record(f"{op} ffi fwd+bwd", time_jax(jax.jit(fwd_bwd), *args, reps=10))
    t = [to_torch(a) for a in args]
    t_do = torch.from_dlpack(do).clone()
    record(f"{op} fla fwd", time_torch(lambda: fla_fn(*t)[0]))

    def fla_fwd_bwd():
        for a in t:
            a.grad = None
        fla_fn(*t)[0].backward(t_do)

    record(f"{op} fla fwd+bwd", time_torch(fla_fwd_bwd))


def copy_bandwidth():
    import torch

    src = torch.empty(2 ** 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_torch(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)  # bytes read + written per second


def bench_decode(batches=(1, 64, 256), heads=32, key=64, steps_per_call=100):
    import torch
    from fla.ops.rwkv7 import fused_recurrent_rwkv7

    bandwidth = copy_bandwidth()
    log(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (read + write)")
    for batch in batches:
        rng = np.random.default_rng(batch)
        x = training_inputs("rwkv7", rng, batch, 1, heads, key, jnp.bfloat16)
        state = jnp.asarray(0.5 * rng.standard_normal((batch, heads, key, key)), jnp.float32)
        args = [x[n] for n in "rwkvab"]
        rows = jnp.arange(batch, dtype=jnp.int32)

        # Many steps inside one jit, the pool carried (and updated in place): per-step kernel
        # time without Python dispatch.
        @jax.jit
        def run(state, *a):
            def body(_, s):
                return rwkv_jax.rwkv7_step(*a, s, state_indices=rows, backend="ffi")[1]
            return jax.lax.fori_loop(0, steps_per_call, body, state)

        ms = time_jax(run, state, *args) / steps_per_call
        floor_us = 2 * batch * heads * key * key * 4 / bandwidth * 1e6
        record(f"rwkv7_step ffi B{batch} H{heads} K{key} T1", ms, f"(floor {floor_us:.1f} us)")
        # One call per step from Python, as fla is called below (dispatch included).
        one = jax.jit(lambda s, *a: rwkv_jax.rwkv7_step(*a, s, state_indices=rows,
                                                        backend="ffi")[1])
        record(f"rwkv7_step ffi B{batch} one call per step", time_jax(one, state, *args))
        t = [torch.from_dlpack(a).clone() for a in args]
        t_state = torch.from_dlpack(state).clone()
        record(f"rwkv7_step fla fused_recurrent B{batch}",
               time_torch(lambda: fused_recurrent_rwkv7(*t, scale=1.0, initial_state=t_state,
                                                        output_final_state=True)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/gpu_ffi")
    parser.add_argument("--checks", default="",
                        help="comma-separated label prefixes of the checks to run (default all)")
    parser.add_argument("--jobs", default="rwkv6,rwkv7,decode",
                        help="timings to run, in this order (empty: none)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    open_log(os.path.join(args.out, "gpu_ffi.log"))
    log("devices:", jax.devices())
    ok = correctness([p for p in args.checks.split(",") if p])

    def rwkv6_job():
        from fla.ops.rwkv6 import chunk_rwkv6
        bench_training("rwkv6", lambda r, k, v, w, u: chunk_rwkv6(r, k, v, w, u, scale=1.0))

    def rwkv7_job():
        from fla.ops.rwkv7 import chunk_rwkv7
        bench_training("rwkv7", lambda r, w, k, v, a, b: chunk_rwkv7(r, w, k, v, a, b, scale=1.0))

    jobs = {"rwkv6": rwkv6_job, "rwkv7": rwkv7_job, "decode": bench_decode}
    for name in (j for j in args.jobs.split(",") if j):
        try:
            jobs[name]()
        except Exception:
            log(f"timing {name} ERROR\n" + traceback.format_exc())
    with open(os.path.join(args.out, "gpu_ffi.json"), "w") as f:
        json.dump(results, f, indent=1)
    log("\n== summary ==")
    for c in results["correctness"]:
        log(f"{'PASS' if c['ok'] else 'FAIL'} {c['label']}  worst {max(c['errors'].values()):.1e}")
    for t in results["timings"]:
        log(f"{t['label']:44s} {t['ms']:9.3f} ms {t['note']}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

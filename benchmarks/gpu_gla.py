"""Gated linear attention and RWKV-6 on an NVIDIA GPU: the triton backend against a float64
reference, then side by side with fla's ``chunk_gla`` and ``chunk_rwkv6`` on the same inputs.

Run on the GPU machine (benchmarks/gpu_gla.sh installs jax-triton and fla-core first):

    python benchmarks/gpu_gla.py --out DIR [--checks N] [--no-fla] [--budget S]

1. Correctness: forward, final state and every gradient (initial state, packed sequences with
   an empty segment, reverse, every GLA gate, strong gates, bf16 and fp32, K = 64 and 128)
   against the float64 numpy reference of tests/reference.py.
2. Benchmark, bf16, model-range gates (GLA: a key gate log-sigmoid / 16; RWKV-6: w =
   -exp(0.7 z - 1.5)): B=8, T=4096, H=64, K=V=64 and H=32, K=V=128. For each op and size fla
   runs FIRST (its first call compiles and autotunes for minutes), then ours: forward and
   forward+backward medians, peak memory, error against float64 on a slice (batch 0, first
   4 heads, all steps). Ours also: the forward that saves states and the backward alone.
The table comes last; everything is also written to DIR/gpu_gla.log and DIR/gpu_gla.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import reference  # noqa: E402
from _log import (jax_peak_bytes, log, open_log, profile_kernels,  # noqa: E402
                  torch_peak_bytes)  # (benchmarks/_log.py)
from gpu_rwkv7 import time_jax, within  # noqa: E402
from reference import relative_error  # noqa: E402

import rwkv_jax  # noqa: E402
from rwkv_jax.backends.triton import gla as triton_gla  # noqa: E402

NAMES = {"gated_linear_attention": ("q", "k", "v"), "rwkv6": tuple("rkvwu")}
results: dict = {"correctness": [], "benchmark": []}


def call(op, x, cu_seqlens=None, **options):
    """The public op on a dict of arrays (positional names, then gates/state by keyword)."""
    args = [x[n] for n in NAMES[op]]
    keywords = {n: a for n, a in x.items() if n not in NAMES[op]}
    return getattr(rwkv_jax, op)(*args, **keywords, cu_seqlens=cu_seqlens, backend="triton",
                                 **options)


# ----------------------------------------------------------------------------------------------
# 1. Correctness against float64.
# ----------------------------------------------------------------------------------------------

PACKED = [0, 100, 100, 117, 300]  # an empty segment, partial chunks
CHECKS = [  # (name, op, dtype, K, V, random_inputs options, op options); most telling first
    ("gla fp32 K=128 V=64 packed, every gate", "gated_linear_attention", "float32", 128, 64,
     dict(gates=("g", "g_gamma", "gk", "gv"), cu_seqlens=PACKED), {}),
    ("gla fp32 K=V=64 reverse packed, every gate", "gated_linear_attention", "float32", 64, 64,
     dict(gates=("g", "g_gamma", "gk", "gv"), cu_seqlens=PACKED), dict(reverse=True)),
    ("rwkv6 fp32 K=V=64 packed", "rwkv6", "float32", 64, 64, dict(cu_seqlens=PACKED), {}),
    ("rwkv6 fp32 K=V=128 strong", "rwkv6", "float32", 128, 128, dict(decay="strong"), {}),
    ("gla bf16 K=V=64 gk", "gated_linear_attention", "bfloat16", 64, 64, {}, {}),
    ("gla fp32 K=V=64 gk strong", "gated_linear_attention", "float32", 64, 64,
     dict(decay="strong"), {}),
    ("gla bf16 K=V=128 gk", "gated_linear_attention", "bfloat16", 128, 128, {}, {}),
    ("rwkv6 bf16 K=V=64", "rwkv6", "bfloat16", 64, 64, {}, {}),
    ("rwkv6 bf16 K=V=128", "rwkv6", "bfloat16", 128, 128, {}, {}),
    ("gla bf16 K=V=64 every gate strong packed", "gated_linear_attention", "bfloat16", 64, 64,
     dict(gates=("g", "g_gamma", "gk", "gv"), decay="strong", cu_seqlens=PACKED), {}),
    ("rwkv6 bf16 K=V=128 strong", "rwkv6", "bfloat16", 128, 128, dict(decay="strong"), {}),
]


def check(name, op, dtype, key, value, drawn_options, options, seed, steps=300):
    rng = np.random.default_rng(seed)
    cu_seqlens = drawn_options.pop("cu_seqlens", None)
    packed = dict(batch=1, state_rows=len(cu_seqlens) - 1) if cu_seqlens else dict(batch=2)
    drawn = reference.random_inputs(op, rng, steps=steps, heads=4, key=key, value=value,
                                    **packed, **drawn_options)
    x = {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else dtype)
         for n, a in drawn.items()}
    x64 = {n: np.asarray(a, np.float64) for n, a in x.items()}
    ref_options = dict(options, **({"cu_seqlens": np.asarray(cu_seqlens)} if cu_seqlens else {}))
    ref_out, ref_state = reference.forward(op, x64, **ref_options)
    d_out = jnp.asarray(rng.standard_normal(ref_out.shape), dtype)
    d_state = jnp.asarray(rng.standard_normal(ref_state.shape), jnp.float32)
    ref_grads = reference.gradients(op, x64, np.asarray(d_out, np.float64),
                                    np.asarray(d_state, np.float64), **ref_options)

    @jax.jit
    def run(x, cu):
        (out, state), pullback = jax.vjp(lambda x: call(op, x, cu, **options), x)
        return out, state, pullback((d_out, d_state))[0]

    out, state, grads = run(x, jnp.asarray(cu_seqlens, jnp.int32) if cu_seqlens else None)
    errors = {"out": relative_error(out, ref_out), "state": relative_error(state, ref_state)}
    errors.update({f"d{n}": relative_error(g, ref_grads[n]) for n, g in grads.items()})
    finite = all(np.isfinite(np.asarray(a, np.float64)).all()
                 for a in [out, state, *grads.values()])
    worst = max(errors.values())
    ok = finite and worst <= max(rwkv_jax.backends.tolerance("triton", dtype))
    log(f"check {name:44s} {'PASS' if ok else 'FAIL'} worst {worst:.2e}  "
        + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    results["correctness"].append(dict(name=name, ok=ok, finite=finite, errors=errors))


# ----------------------------------------------------------------------------------------------
# 2. Benchmark against fla.
# ----------------------------------------------------------------------------------------------

def model_inputs(op, batch, steps, heads, size, seed=0):
    """bf16 torch tensors on the GPU (the reference's model-range draws), and cotangents."""
    rng = np.random.default_rng(seed)
    drawn = reference.random_inputs(op, rng, batch=batch, steps=steps, heads=heads, key=size,
                                    initial_state=False)
    cuda = lambda a: torch.from_numpy(np.asarray(a, np.float32)).cuda()
    x = {n: cuda(a).to(torch.bfloat16).contiguous() for n, a in drawn.items()}
    d_out = cuda(rng.standard_normal((batch, steps, heads, size))).to(torch.bfloat16)
    d_state = cuda(rng.standard_normal((batch, heads, size, size)))
    return x, d_out, d_state


def float64_slice(op, x, d_out, d_state, heads=4):
    """The float64 reference on batch 0 and the first ``heads`` heads (all steps)."""
    pick = lambda t: t[:1, :, :heads].double().cpu().numpy()
    x64 = {n: (t[:heads].double().cpu().numpy() if n == "u" else pick(t)) for n, t in x.items()}
    out, state = reference.forward(op, x64)
    grads = reference.gradients(op, x64, pick(d_out), d_state[:1, :heads].double().cpu().numpy())
    return out, state, grads


def slice_errors(out, state, grads, ref, heads=4):
    ref_out, ref_state, ref_grads = ref
    pick = lambda a: np.asarray(a, np.float64)[:1, :, :heads]
    errors = {"out": relative_error(pick(out), ref_out),
              "state": relative_error(np.asarray(state, np.float64)[:1, :heads], ref_state)}
    # du sums over every batch row, so the slice's reference cannot check it (the correctness
    # section does, on whole inputs).
    errors.update({f"d{n}": relative_error(pick(g), ref_grads[n]) for n, g in grads.items()
                   if n != "u"})
    return errors


def kernel_times(op, x_jax, d_out, d_state):
    """Each launch of the tame path alone (the backend's own functions, jitted one by one):
    where the forward+backward time goes."""
    tb = triton_gla
    rows = lambda t: t.reshape(-1, *t.shape[2:])
    q, k, v = (x_jax[n] for n in NAMES[op][:3])
    a, u = x_jax["w" if op == "rwkv6" else "gk"], x_jax.get("u")
    static = tb._gla_static(q, k, v, a, None, u, 1.0 if op == "rwkv6" else q.shape[-1] ** -0.5,
                            False)
    cu = jnp.arange(q.shape[0] + 1, dtype=jnp.int32) * q.shape[1]
    q, k, v, a, do = (rows(t) for t in (q, k, v, a, d_out))
    h0 = jnp.zeros((cu.shape[0] - 1,) + d_state.shape[1:], jnp.float32)
    states_fn = jax.jit(lambda k, v, a: tb._gla_states(static, k, v, a, None, h0, cu))
    _, states, _ = states_fn(k, v, a)
    gradient_fn = jax.jit(lambda q, a, do: tb._gla_state_gradient(static, q, a, None, do,
                                                                   d_state, cu))
    _, dstates = gradient_fn(q, a, do)
    inputs = (q, k, v, a, None, u, do, states, dstates, cu)
    return {"state pass": time_jax(states_fn, k, v, a),
            "outputs": time_jax(jax.jit(lambda q, k, v, a, states: tb._gla_outputs(
                static, True, q, k, v, a, None, u, states, cu)), q, k, v, a, states),
            "state gradient": time_jax(gradient_fn, q, a, do),
            "key gradients": time_jax(jax.jit(
                lambda *x: tb._gla_key_gradients(static, True, *x)), *inputs),
            "value gradients": time_jax(jax.jit(
                lambda *x: tb._gla_value_gradients(static, True, *x)), *inputs)}


def bench_ours(op, x_jax, d_out, d_state, ref, full=True, split=True):
    """Times, errors and (``full``) peak memory, the forward that saves states and the backward
    alone; (``split``) each kernel alone."""
    forward = jax.jit(lambda x: call(op, x))

    def both(x, d_out, d_state):
        (out, state), pullback = jax.vjp(lambda x: call(op, x), x)
        return out, state, pullback((d_out, d_state))[0]

    both = jax.jit(both)
    saving = jax.jit(lambda x: jax.vjp(lambda x: call(op, x), x))
    backward = jax.jit(lambda pullback, d_out, d_state: pullback((d_out, d_state)))
    compile_start = time.perf_counter()
    out, state, grads = jax.block_until_ready(both(x_jax, d_out, d_state))
    compile_s = time.perf_counter() - compile_start
    row = dict(name=f"rwkv_jax triton {op}", forward_ms=time_jax(forward, x_jax),
               forward_backward_ms=time_jax(both, x_jax, d_out, d_state),
               errors=slice_errors(out, state, grads, ref), compile_s=compile_s)
    if split:
        row.update(kernel_ms=kernel_times(op, x_jax, d_out, d_state))
    if full:
        _, pullback = saving(x_jax)
        row.update(forward_saving_states_ms=time_jax(lambda x: saving(x)[0], x_jax),
                   backward_ms=time_jax(backward, pullback, d_out, d_state),
                   peak_bytes=jax_peak_bytes(both, x_jax, d_out, d_state),
                   forward_peak_bytes=jax_peak_bytes(forward, x_jax))
    return row


def bench_fla(op, x, d_out, d_state, ref):
    import triton.testing
    if op == "rwkv6":
        from fla.ops.rwkv6 import chunk_rwkv6 as fla_op
        names, options = NAMES[op], dict(scale=1.0)
    else:
        from fla.ops.gla import chunk_gla as fla_op
        names, options = ("q", "k", "v", "gk"), {}
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}

    def forward():
        with torch.no_grad():
            return fla_op(*(leaves[n] for n in names), output_final_state=True, **options)

    def forward_backward():
        out, state = fla_op(*(leaves[n] for n in names), output_final_state=True, **options)
        torch.autograd.backward((out, state), (d_out, d_state))

    compile_start = time.perf_counter()
    out, state = forward()
    forward_backward()
    compile_s = time.perf_counter() - compile_start
    grads = {n: t.grad.float().cpu().numpy() for n, t in leaves.items()}
    errors = slice_errors(out.float().cpu().numpy(), state.float().cpu().numpy(), grads, ref)
    fresh = list(leaves.values())
    forward_ms = triton.testing.do_bench(forward, warmup=50, rep=300, return_mode="median")
    both_ms = triton.testing.do_bench(forward_backward, warmup=50, rep=500,
                                      grad_to_none=fresh, return_mode="median")
    peaks = torch_peak_bytes((forward_backward, forward), fresh,
                             held=[*x.values(), d_out, d_state])
    for label, fn in (("forward", forward), ("forward+backward", forward_backward)):
        log(f"  fla {op} {label}, per kernel: " + profile_kernels(
            fn, lambda: [setattr(t, "grad", None) for t in fresh]))
    return dict(name=f"fla {fla_op.__name__}", forward_ms=forward_ms, forward_backward_ms=both_ms,
                peak_bytes=peaks[0], forward_peak_bytes=peaks[1], errors=errors,
                compile_s=compile_s)


def describe(row):
    errors = row["errors"]
    worst_grad = max(v for k, v in errors.items() if k.startswith("d"))
    kernels = " + ".join(f"{name} {ms:.2f}" for name, ms in row.get("kernel_ms", {}).items())
    extra = f" (bwd {row['backward_ms']:.2f})" if "backward_ms" in row else ""
    extra += f" [{kernels}]" if kernels else ""
    peak = (f"  peak {row['peak_bytes'] / 2**30:5.2f} GiB (fwd "
            f"{row['forward_peak_bytes'] / 2**30:4.2f})" if "peak_bytes" in row else "")
    return (f"{row['shape']:18s} {row['name']:36s} fwd {row['forward_ms']:6.2f} ms  fwd+bwd "
            f"{row['forward_backward_ms']:6.2f} ms{extra}{peak}"
            f"  err out {errors['out']:.1e} state {errors['state']:.1e} grads<= {worst_grad:.1e}")


SHAPES = [("rwkv6", 64, 64), ("gated_linear_attention", 64, 64),
          ("rwkv6", 32, 128), ("gated_linear_attention", 32, 128)]


def benchmark(deadline, out_dir, with_fla, shapes, sweep, lean):
    prepared = []
    for op, heads, size in shapes:
        batch, steps = 8, 4096
        shape = f"H={heads} K=V={size}"
        x, d_out, d_state = model_inputs(op, batch, steps, heads, size)
        log(f"benchmark {op}: B={batch} T={steps} {shape} bf16")
        ref = float64_slice(op, x, d_out, d_state)
        x_jax = {n: jax.dlpack.from_dlpack(t) for n, t in x.items()}
        ours = (x_jax, jax.dlpack.from_dlpack(d_out), jax.dlpack.from_dlpack(d_state), ref)
        prepared.append((op, shape, ours))
        contenders = ([("fla", bench_fla, (x, d_out, d_state, ref))] if with_fla else []) + [
            ("ours", bench_ours, ours + (not lean,))]
        for label, fn, inputs in contenders:
            row = within(f"{label} {op} {shape}", deadline, 200 if label == "fla" else 120, fn,
                         op, *inputs)
            if row is not None:
                record(row, op, shape, out_dir)
    # Other kernel settings (the backend's GLA_OVERRIDES), after every shape's defaults: times
    # and errors only (no peaks, no backward alone).
    for overrides, picked in sweep:
        for index, (op, shape, ours) in enumerate(prepared):
            if picked is not None and index not in picked:
                continue
            triton_gla.GLA_OVERRIDES.update(overrides)
            try:
                row = within(f"ours {op} {shape} {overrides}", deadline, 60, bench_ours, op,
                             *ours, False, False)
            finally:
                triton_gla.GLA_OVERRIDES.clear()
            if row is not None:
                row["name"] += " " + ",".join(f"{k}={v}" for k, v in overrides.items())
                record(row, op, shape, out_dir)


def record(row, op, shape, out_dir):
    row.update(op=op, shape=shape)
    log("  " + describe(row))
    results["benchmark"].append(row)
    with open(os.path.join(out_dir, "gpu_gla.json"), "w") as f:  # kept up to date
        json.dump(results, f, indent=1, default=str)


def sweep_item(item):
    """'a=1,b=bf16@0,1' -> ({'a': 1, 'b': 'bf16'}, {0, 1}); without '@': (..., None), every
    shape."""
    settings, _, picked = item.partition("@")
    overrides = {k: int(v) if v.lstrip("-").isdigit() else v
                 for k, v in (pair.split("=") for pair in settings.split(","))}
    return overrides, ({int(i) for i in picked.split(",")} if picked else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds (from the start) after which nothing new starts")
    parser.add_argument("--checks", type=int, default=len(CHECKS),
                        help="how many of the correctness checks to run (0: none)")
    parser.add_argument("--no-fla", action="store_true", help="time ours only")
    parser.add_argument("--lean", action="store_true",
                        help="time ours with the defaults as sweep rows are (no peaks)")
    parser.add_argument("--shapes", default="0,1,2,3", help="which of SHAPES to benchmark")
    parser.add_argument("--sweep", default="", help="also time ours with other settings, e.g. "
                        "'key_gradient_warps=4;key_block_k=64,value_gradient_warps=8@0,1' "
                        "(fields of the backend's _GlaStatic; '@' picks benchmarked shapes by "
                        "their index in --shapes' list, all by default)")
    parser.add_argument("--check-filter", default="",
                        help="run only the checks whose name contains this")
    parser.add_argument("--check-sweep", default="", help="also run the checks with other "
                        "settings, e.g. 'precision=bf16,bf16_states=1;bf16_states=1'")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    open_log(os.path.join(args.out, "gpu_gla.log"))
    deadline = time.time() + args.budget
    gpu = torch.cuda.get_device_name()
    log(f"GPU {gpu}; jax {jax.__version__} ({jax.devices()[0]}), torch {torch.__version__}")
    results["gpu"] = gpu
    for overrides in [{}] + [sweep_item(item)[0] for item in args.check_sweep.split(";") if item]:
        triton_gla.GLA_OVERRIDES.update(overrides)
        suffix = " " + ",".join(f"{k}={v}" for k, v in overrides.items()) if overrides else ""
        try:
            for seed, (name, *check_args) in enumerate(CHECKS[:args.checks]):
                if args.check_filter not in name or (overrides.get("precision") == "bf16"
                                                     and check_args[1] == "float32"):
                    continue  # (filtered out; bf16 operands are for 16-bit inputs only)
                within(name + suffix, deadline, 120, check, name + suffix, *check_args[:4],
                       dict(check_args[4]), check_args[5], seed)
        finally:
            triton_gla.GLA_OVERRIDES.clear()
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",") if i]
    benchmark(deadline, args.out, not args.no_fla, shapes,
              [sweep_item(item) for item in args.sweep.split(";") if item], args.lean)
    log("\ncorrectness: " + ", ".join(f"{c['name']}: {'ok' if c['ok'] else 'FAIL'}"
                                      for c in results["correctness"]))
    log(f"\nB=8 T=4096 bf16 on {gpu}")
    for row in results["benchmark"]:
        log(describe(row))


if __name__ == "__main__":
    main()

"""RWKV-7 on an NVIDIA GPU: the triton backend against a float64 reference, then side by side
with fla's ``chunk_rwkv7`` (fastest and default configurations) on the same inputs.

Run on the GPU machine (benchmarks/gpu_rwkv7.sh installs jax-triton and fla-core first):

    python benchmarks/gpu_rwkv7.py --out DIR [--sweep]

1. Correctness: forward, final state and every gradient (with an initial state, packed
   sequences, bf16 and fp32, K = 64 and 128, strong and zero decays) against the float64 numpy
   reference of tests/reference.py, on fresh random inputs.
2. Benchmark at B=8, T=4096, H=64, K=V=64, bf16 (model-range decays): forward and
   forward+backward times (medians), peak memory (inputs, outputs and temporaries), and each
   one's error against float64 on a slice of the same inputs (batch 0, the first 4 heads, all
   4096 steps). ``--sweep`` also times other kernel configurations of the triton backend.
The table comes last; everything is also written to DIR/gpu_rwkv7.log and DIR/gpu_rwkv7.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import reference  # noqa: E402
from _log import (jax_peak_bytes, log, open_log, profile_kernels,  # noqa: E402
                  torch_peak_bytes)  # (benchmarks/_log.py)
from reference import relative_error  # noqa: E402

import rwkv_jax  # noqa: E402
from rwkv_jax.backends import triton as triton_backend  # noqa: E402
from rwkv_jax.backends.triton.rwkv7 import CONFIG_OVERRIDES  # noqa: E402

NAMES = tuple("rwkvab")
LOWER_BOUND = -0.6065  # fla's fastest configuration asserts w >= this

results: dict = {"correctness": [], "benchmark": []}


# ----------------------------------------------------------------------------------------------
# 1. Correctness against float64.
# ----------------------------------------------------------------------------------------------

def triton_vjp(x, d_out, d_state, cu_seqlens=None):
    def op(x):
        return rwkv_jax.rwkv7(*(x[n] for n in NAMES), initial_state=x.get("initial_state"),
                              cu_seqlens=cu_seqlens, backend="triton")
    (out, state), pullback = jax.vjp(op, x)
    return out, state, pullback((d_out, d_state))[0]


def _hard_decays(kind, rng, shape):
    """Log decays the chunked kernels must survive exactly: uniform down to -1e3, single tokens
    at -1e9 and -inf, every third token at -1e9 (the rest model-range)."""
    if kind == "uniform-1e3":
        return rng.uniform(-1e3, 0.0, shape)
    w = reference.rwkv7_model_decay(rng.standard_normal(shape))
    if kind == "spikes":
        w[:, 5] = -1e9
        w[:, 40] = -np.inf
    elif kind == "every-third":
        w[:, ::3] = -1e9
    return w


def check(name, dtype, key, value, steps=300, batch=2, heads=4, decay="model", cu_seqlens=None,
          seed=0, hard=None):
    rng = np.random.default_rng(seed)
    rows = len(cu_seqlens) - 1 if cu_seqlens else None
    drawn = reference.random_inputs("rwkv7", rng, batch=1 if cu_seqlens else batch, steps=steps,
                                    heads=heads, key=key, value=value, decay=decay,
                                    state_rows=rows)
    if hard:
        drawn["w"] = _hard_decays(hard, rng, drawn["w"].shape)
    x = {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else dtype)
         for n, a in drawn.items()}
    x64 = {n: np.asarray(a, np.float64) for n, a in x.items()}
    options = dict(cu_seqlens=np.asarray(cu_seqlens)) if cu_seqlens else {}
    ref_out, ref_state = reference.forward("rwkv7", x64, **options)
    d_out = jnp.asarray(rng.standard_normal(ref_out.shape), dtype)
    d_state = jnp.asarray(rng.standard_normal(ref_state.shape), jnp.float32)
    ref_grads = reference.gradients("rwkv7", x64, np.asarray(d_out, np.float64),
                                    np.asarray(d_state, np.float64), **options)
    cu = jnp.asarray(cu_seqlens, jnp.int32) if cu_seqlens else None
    out, state, grads = jax.jit(triton_vjp)(x, d_out, d_state, cu)
    errors = {"out": relative_error(out, ref_out), "state": relative_error(state, ref_state)}
    errors.update({f"d{n}": relative_error(g, ref_grads[n]) for n, g in grads.items()})
    finite = all(np.isfinite(np.asarray(a, np.float64)).all()
                 for a in [out, state, *grads.values()])
    worst = max(errors.values())
    ok = finite and worst <= max(rwkv_jax.backends.tolerance("triton", dtype))
    log(f"check {name:34s} {'PASS' if ok else 'FAIL'} worst {worst:.2e}  "
        + " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    results["correctness"].append(dict(name=name, ok=ok, finite=finite, errors=errors))
    return ok


PACKED = [0, 100, 100, 117, 300]  # with an empty segment and a partial chunk
CHECKS = [
    ("fp32 K=128 V=64 packed (cu_seqlens)", "float32", 128, 64, dict(cu_seqlens=PACKED)),
    ("bf16 K=V=64 initial state", "bfloat16", 64, 64, {}),
    ("fp32 K=V=64 strong decay (w>=-8)", "float32", 64, 64, dict(decay="strong")),
    ("bf16 K=V=128 initial state", "bfloat16", 128, 128, {}),
    ("fp32 K=V=64 initial state", "float32", 64, 64, {}),
    ("bf16 K=64 packed (cu_seqlens)", "bfloat16", 64, 64, dict(cu_seqlens=PACKED)),
    ("fp32 K=V=64 zero decay", "float32", 64, 64, dict(decay="zero")),
    ("bf16 K=V=64 T=4097", "bfloat16", 64, 64, dict(steps=4097, batch=1, heads=2)),
    ("fp32 K=V=64 w uniform [-1e3, 0]", "float32", 64, 64, dict(hard="uniform-1e3")),
    ("fp32 K=V=64 w -1e9 and -inf tokens", "float32", 64, 64, dict(hard="spikes")),
    ("bf16 K=V=64 every third w -1e9", "bfloat16", 64, 64, dict(hard="every-third")),
    ("bf16 K=V=128 w uniform [-1e3, 0]", "bfloat16", 128, 128, dict(hard="uniform-1e3")),
]


def correctness(count):
    # The hard decays first: --checks N runs them and the first N - 4 others.
    ordered = CHECKS[-4:] + CHECKS[:-4]
    for seed, (name, dtype, key, value, options) in enumerate(ordered[:count]):
        check(name, dtype, key, value, seed=seed, **options)


# ----------------------------------------------------------------------------------------------
# 2. Benchmark against fla.
# ----------------------------------------------------------------------------------------------

def model_inputs(batch, steps, heads, size, seed=0, states=None):
    """RWKV-7 inputs as a model makes them, on the GPU in bf16 (torch), plus cotangents (of
    ``states`` final states: one per sequence, ``batch`` by default)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)
    shape = (batch, steps, heads, size)
    k = normal(*shape)
    kk = torch.nn.functional.normalize(k, dim=-1)
    x = dict(r=normal(*shape), w=LOWER_BOUND * torch.sigmoid(normal(*shape)), k=k,
             v=normal(*shape), a=-kk, b=kk * torch.sigmoid(normal(*shape)))
    x = {n: t.to(torch.bfloat16).contiguous() for n, t in x.items()}
    d_out = normal(*shape).to(torch.bfloat16)
    d_state = normal(states or batch, heads, size, size)
    return x, d_out, d_state


def float64_slice(x, d_out, d_state, heads=4, cu_seqlens=None):
    """The float64 reference on batch 0 and the first ``heads`` heads (all steps; with
    ``cu_seqlens`` every sequence's final state)."""
    pick = lambda t: t[:1, :, :heads].double().cpu().numpy()
    x64 = {n: pick(t) for n, t in x.items()}
    options = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)
    out, state = reference.forward("rwkv7", x64, **options)
    grads = reference.gradients("rwkv7", x64, pick(d_out),
                                d_state[:state.shape[0], :heads].double().cpu().numpy(),
                                **options)
    return out, state, grads


def slice_errors(out, state, grads, ref):
    ref_out, ref_state, ref_grads = ref
    heads = ref_out.shape[2]
    pick = lambda a: np.asarray(a, np.float64)[:1, :, :heads]
    errors = {"out": relative_error(pick(out), ref_out),
              "state": relative_error(np.asarray(state, np.float64)[:ref_state.shape[0], :heads],
                                      ref_state)}
    if grads is not None:
        errors.update({f"d{n}": relative_error(pick(grads[n]), ref_grads[n]) for n in NAMES})
    return errors


def time_jax(fn, *args, reps=7, min_seconds=0.2):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    iters = max(3, int(min_seconds / max(once, 1e-4)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times) * 1e3


def bench_jax(label, x_jax, d_out, d_state, ref, backend="triton", config=None,
              cu_seqlens=None):
    """One rwkv_jax backend: times, peak memory, errors; for triton also the forward that
    saves states for the backward (the backward alone is the difference)."""
    size = x_jax["k"].shape[-1]
    if config is not None:
        CONFIG_OVERRIDES[(size, size)] = config
    try:
        def op(x):
            return rwkv_jax.rwkv7(*(x[n] for n in NAMES), backend=backend,
                                  cu_seqlens=cu_seqlens)

        def both(x, d_out, d_state):
            (out, state), pullback = jax.vjp(op, x)
            return out, state, pullback((d_out, d_state))[0]

        forward, both = jax.jit(op), jax.jit(both)
        compile_start = time.perf_counter()
        out, state = jax.block_until_ready(forward(x_jax))
        _, _, grads = jax.block_until_ready(both(x_jax, d_out, d_state))
        compile_s = time.perf_counter() - compile_start
        row = dict(name=label, forward_ms=time_jax(forward, x_jax),
                   forward_backward_ms=time_jax(both, x_jax, d_out, d_state),
                   peak_bytes=jax_peak_bytes(both, x_jax, d_out, d_state),
                   forward_peak_bytes=jax_peak_bytes(forward, x_jax),
                   errors=slice_errors(out, state, grads, ref), compile_s=compile_s)
        if backend == "triton":
            saving = jax.jit(lambda x: jax.vjp(op, x)[0])
            row["forward_saving_states_ms"] = time_jax(saving, x_jax)
            row["profile"] = profile_kernels(
                lambda: jax.block_until_ready(both(x_jax, d_out, d_state)))
            log(f"  {label} forward+backward, per kernel: {row['profile']}")
            row["config"] = dataclasses.asdict(CONFIG_OVERRIDES.get(
                (size, size), triton_backend.default_config(size, size)))
    finally:
        CONFIG_OVERRIDES.pop((size, size), None)
    return row


def bench_fla(label, x, d_out, d_state, ref, cu_seqlens=None, **options):
    import triton.testing
    from fla.ops.rwkv7 import chunk_rwkv7
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    if cu_seqlens is not None:
        options = dict(options, cu_seqlens=torch.tensor(cu_seqlens, device="cuda"))

    def forward():
        with torch.no_grad():
            return chunk_rwkv7(*(leaves[n] for n in NAMES), scale=1.0,
                               output_final_state=True, **options)

    def forward_backward():
        out, state = chunk_rwkv7(*(leaves[n] for n in NAMES), scale=1.0,
                                 output_final_state=True, **options)
        torch.autograd.backward((out, state), (d_out, d_state))

    out, state = forward()
    forward_backward()
    grads = {n: t.grad.float().cpu().numpy() for n, t in leaves.items()}
    log(f"  {label} forward+backward, per kernel: " + profile_kernels(
        forward_backward, lambda: [setattr(t, "grad", None) for t in leaves.values()]))
    errors = slice_errors(out.float().cpu().numpy(), state.float().cpu().numpy(), grads, ref)
    fresh = list(leaves.values())
    forward_ms = triton.testing.do_bench(forward, warmup=100, rep=500, return_mode="median")
    both_ms = triton.testing.do_bench(forward_backward, warmup=100, rep=1000,
                                      grad_to_none=fresh, return_mode="median")
    peaks = torch_peak_bytes((forward_backward, forward), fresh,
                             held=[*x.values(), d_out, d_state])
    return dict(name=label, forward_ms=forward_ms, forward_backward_ms=both_ms,
                peak_bytes=peaks[0], forward_peak_bytes=peaks[1], errors=errors, options=options)


def describe(row):
    errors = row["errors"]
    worst_grad = max(v for k, v in errors.items() if k.startswith("d"))
    saving = (f" (saving states {row['forward_saving_states_ms']:.3f})"
              if "forward_saving_states_ms" in row else "")
    return (f"{row['name']:44s} fwd {row['forward_ms']:7.3f} ms{saving}  fwd+bwd "
            f"{row['forward_backward_ms']:7.3f} ms  peak {row['peak_bytes'] / 2**30:6.2f} GiB "
            f"(fwd {row['forward_peak_bytes'] / 2**30:5.2f})  err out {errors['out']:.1e} "
            f"state {errors['state']:.1e} grads<= {worst_grad:.1e}")


class _OutOfTime(Exception):
    pass


def _alarm(signum, frame):
    raise _OutOfTime()


def within(label, deadline, cap, fn, *args, **kwargs):
    """fn(*args, **kwargs) within ``cap`` seconds and the run's deadline; None (and a line in
    the log) when there is no time left for it, it runs out of time or it fails: one failing
    contender must not hide the others."""
    allowed = int(min(cap, deadline - time.time()))
    if allowed < 20:
        log(f"  {label}: not run, out of time")
        return None
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(allowed)
    try:
        return fn(*args, **kwargs)
    except _OutOfTime:
        log(f"  {label}: did not finish within {allowed} s")
    except Exception as err:
        log(f"  {label}: FAILED {type(err).__name__}: {str(err)[:400]}")
    finally:
        signal.alarm(0)
    return None


def _attempt(rows, prefix, deadline, out_dir, fn, *args, cap=240, **kwargs):
    """One contender's row (``within``), named with ``prefix``, into ``rows`` and the JSON
    file."""
    row = within(args[0], deadline, cap, fn, *args, **kwargs)
    if row is None:
        return None
    row["name"] = f"{prefix} {row['name']}"
    log("  " + describe(row))
    rows.append(row)
    with open(os.path.join(out_dir, "gpu_rwkv7.json"), "w") as f:  # kept up to date
        json.dump(dict(results, benchmark=results["benchmark"] + rows), f, indent=1, default=str)
    return row


# Issue 13's other layouts (K=V=64, bf16, model-range decays): one long sequence, and 16
# packed sequences of random lengths (some odd) in 32768 tokens.
LAYOUTS = {"long": dict(steps=65536, heads=32, sequences=1),
           "packed": dict(steps=32768, heads=64, sequences=16)}


def benchmark_layout(name, deadline, out_dir, fla_configs=("disable_recompute",), sweep=False,
                     variants=()):
    """Ours beside fla's fastest configuration(s) on one of LAYOUTS (batch 1; float64 errors
    on the first 2 heads), with ``variants`` (KernelConfig changes) as rows; with ``sweep``
    also the sequential passes on other V blocks (few sequences fill few multiprocessors: the
    default takes 32 below FEW_RECURRENCE_PROGRAMS)."""
    steps, heads, sequences = (LAYOUTS[name][k] for k in ("steps", "heads", "sequences"))
    cu_seqlens = None
    if sequences > 1:
        cuts = np.random.default_rng(0).choice(np.arange(1, steps), sequences - 1, replace=False)
        cu_seqlens = [0, *sorted(int(c) for c in cuts), steps]
    x, d_out, d_state = model_inputs(1, steps, heads, 64, states=sequences)
    log(f"benchmark {name}: B=1 T={steps} H={heads} K=V=64 bf16, "
        f"{sequences} sequence(s){'' if cu_seqlens is None else f', cu_seqlens {cu_seqlens}'}")
    ref = float64_slice(x, d_out, d_state, heads=2, cu_seqlens=cu_seqlens)
    x_jax = {n: jax.dlpack.from_dlpack(t) for n, t in x.items()}
    rows = []
    fastest = dict(chunk_size=64, safe_gate=True, lower_bound=LOWER_BOUND)
    for config in fla_configs:
        label = "fla fastest" + (", disable_recompute" if config == "disable_recompute" else "")
        _attempt(rows, name, deadline, out_dir, bench_fla, label, x, d_out, d_state, ref,
                 cu_seqlens=cu_seqlens, disable_recompute=config == "disable_recompute",
                 cap=240, **fastest)
    ours = (x_jax, jax.dlpack.from_dlpack(d_out), jax.dlpack.from_dlpack(d_state), ref)
    cu_jax = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    _attempt(rows, name, deadline, out_dir, bench_jax, "rwkv_jax triton (default config)",
             *ours, cu_seqlens=cu_jax, cap=120)
    default = triton_backend.default_config(64, 64, heads * sequences)
    for change in variants:  # (--variants, as at the benchmark shape)
        _attempt(rows, name, deadline, out_dir, bench_jax, f"triton {change}", *ours, "triton",
                 dataclasses.replace(default, **change), cu_seqlens=cu_jax, cap=120)
    for block_v in (64, 16) if sweep else ():
        _attempt(rows, name, deadline, out_dir, bench_jax, f"triton recurrence_block_v={block_v}",
                 *ours, "triton", dataclasses.replace(default, recurrence_block_v=block_v),
                 cu_seqlens=cu_jax, cap=60)
    results["benchmark"] = results["benchmark"] + rows
    return rows


def benchmark(sweep, others, deadline, out_dir, fla_first=False, size=64, fla_default=True,
              fla_configs=("disable_recompute", "safe"), variants=()):
    batch, steps, heads = 8, 4096, 64 * 64 // size
    x, d_out, d_state = model_inputs(batch, steps, heads, size)
    log(f"benchmark inputs: B={batch} T={steps} H={heads} K=V={size} bf16, "
        f"w in [{LOWER_BOUND}, 0)")
    ref = float64_slice(x, d_out, d_state)
    x_jax = {n: jax.dlpack.from_dlpack(t) for n, t in x.items()}
    d_out_jax = jax.dlpack.from_dlpack(d_out)
    d_state_jax = jax.dlpack.from_dlpack(d_state)
    # The per-call choice of the kernels' path: one read of w (the tame path for these inputs).
    choose = jax.jit(triton_backend.tame_path)
    log(f"tame_path(w) = {bool(choose(x_jax['w']))}: {time_jax(choose, x_jax['w']):.3f} ms")
    rows = []

    def attempt(fn, *args, cap=240, **kwargs):
        return _attempt(rows, f"K={size}", deadline, out_dir, fn, *args, cap=cap, **kwargs)

    ours = lambda: attempt(bench_jax, "rwkv_jax triton (default config)", x_jax, d_out_jax,
                           d_state_jax, ref)
    if not fla_first:
        ours()
    # On a fresh machine fla's compile and autotuning took 70 to over 330 s.
    fastest = dict(chunk_size=64, safe_gate=True, lower_bound=LOWER_BOUND)
    if "disable_recompute" in fla_configs:
        attempt(bench_fla, "fla fastest, disable_recompute", x, d_out, d_state, ref,
                disable_recompute=True, cap=480 if fla_first else 330, **fastest)
    if "safe" in fla_configs:
        attempt(bench_fla, "fla chunk_rwkv7 (C=64, safe)", x, d_out, d_state, ref,
                cap=480 if fla_first else 330, **fastest)
    if fla_first:
        ours()
    default = triton_backend.default_config(size, size)
    # Other configurations (KernelConfig fields, --variants); with --sweep also those with every
    # chunk on the exact path.
    for change in [*variants, *(dict(c, tame=False) for c in variants if sweep)]:
        attempt(bench_jax, f"triton {change}", x_jax, d_out_jax, d_state_jax, ref, "triton",
                dataclasses.replace(default, **change), cap=120)
    if sweep:
        # Every chunk through the level-by-level path (what chunks with strong decays take).
        attempt(bench_jax, "triton, every chunk level by level", x_jax, d_out_jax, d_state_jax,
                ref, "triton", dataclasses.replace(default, tame=False), cap=90)
    if fla_default:  # it autotunes each kernel on first use (minutes): last, capped.
        attempt(bench_fla, "fla chunk_rwkv7 default", x, d_out, d_state, ref, cap=300)
    for backend in others:
        attempt(bench_jax, f"rwkv_jax {backend}", x_jax, d_out_jax, d_state_jax, ref, backend,
                cap=60)
    results["benchmark"] = results["benchmark"] + rows
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--sweep", action="store_true", help="also time other kernel configs")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds (from the start) after which nothing new starts")
    parser.add_argument("--checks", type=int, default=len(CHECKS),
                        help="how many of the correctness checks to run (0: none)")
    parser.add_argument("--variants", default="",
                        help="|-separated JSON dicts of KernelConfig fields, each timed as a "
                             "row beside the default")
    parser.add_argument("--fla-first", action="store_true",
                        help="time fla's fastest configuration first, with a longer cap")
    parser.add_argument("--others", default="native,chunked",
                        help="other rwkv_jax backends to time at the benchmark shape")
    parser.add_argument("--sizes", default="64",
                        help="head sizes to benchmark (H = 4096 / size), e.g. 64,128")
    parser.add_argument("--no-fla-default", action="store_true",
                        help="skip fla's default configuration (minutes of autotuning)")
    parser.add_argument("--layouts", default="",
                        help="also time these of LAYOUTS beside fla's fastest, e.g. long,packed")
    parser.add_argument("--fla", default="disable_recompute,safe",
                        help="fla's fastest configuration with disable_recompute=True and/or "
                             "without (each compiles for about 2 minutes)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    open_log(os.path.join(args.out, "gpu_rwkv7.log"))
    deadline = time.time() + args.budget
    gpu = torch.cuda.get_device_name()
    log(f"GPU {gpu}; jax {jax.__version__} ({jax.devices()[0]}), torch {torch.__version__}")
    results["gpu"] = gpu
    correctness(args.checks)
    rows = []
    variants = [json.loads(v) for v in args.variants.split("|") if v.strip()]
    for size in (int(x) for x in args.sizes.split(",") if x):
        rows += benchmark(args.sweep, [b for b in args.others.split(",") if b], deadline,
                          args.out, args.fla_first, size, not args.no_fla_default,
                          args.fla.split(","), variants)
    for name in (x for x in args.layouts.split(",") if x):
        rows += benchmark_layout(name, deadline, args.out, [c for c in args.fla.split(",") if c],
                                 args.sweep, variants)
    with open(os.path.join(args.out, "gpu_rwkv7.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log("\ncorrectness: " + ", ".join(f"{c['name']}: {'ok' if c['ok'] else 'FAIL'}"
                                      for c in results["correctness"]))
    log(f"\nRWKV-7 B=8 T=4096 H*K=4096 bf16 on {gpu}")
    for row in rows:
        log(describe(row))


if __name__ == "__main__":
    main()

"""The ffi backend's chunked rwkv7 CUDA kernels (ffi/cuda_rwkv7_chunk.cu) on an NVIDIA GPU, in
one process: correctness against the float64 reference, then timings side by side with our
triton backend and fla's chunk_rwkv7.

It builds nothing: build the extension first and copy it next to the package, e.g.

    cmake -S ffi -B /tmp/build -G Ninja -DPython_EXECUTABLE=$(which python3) \\
        -DRWKV_JAX_CUDA_ARCHITECTURES=90 && ninja -C /tmp/build
    cp /tmp/build/_ffi_cpu*.so /tmp/build/_ffi_cuda*.so rwkv_jax/
    python3 benchmarks/gpu_rwkv7_cuda.py --out /tmp/gpu_rwkv7_cuda

1. Correctness (small shapes, K = 64 and 128, float32 and bfloat16): output, final state and
   every gradient (initial state included) against tests/reference.py, for model decays,
   w uniform in [-1e3, 0], tokens at -1e9 and -inf, w = 0, packed sequences with an empty
   segment, T not a multiple of 16 (ragged last chunks); relative errors printed per array.
2. Timings (medians, bf16, model-range decays w = -0.6065 sigmoid(z), never 0): forward and
   forward+backward and peak memory at B=8 T=4096 (H=64 K=64; H=32 K=128), one sequence of
   65536 tokens (H=32 K=64) and 16 packed sequences of 32768 tokens (H=64 K=64), for
   ffi (chunked CUDA), triton and, if importable, fla's fastest chunk_rwkv7 configuration.
   The errors of each against float64 on a slice (batch 0, two heads) of the B=8 inputs.

``--shapes`` (k64 k128 long packed) and ``--backends`` (ffi triton fla) narrow part 2;
``--skip-correctness`` skips part 1. ``--smoke`` runs the correctness part at tiny sizes on the CPU (the CPU twin of the kernels)
and a tiny timing of the ffi backend alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
import reference  # noqa: E402
from _log import (jax_peak_bytes, log, median_seconds, open_log, profile_kernels,  # noqa: E402
                  relative_error as rel, torch_peak_bytes)

import rwkv_jax  # noqa: E402
from rwkv_jax.backends import ffi as ffi_backend  # noqa: E402

NAMES = "rwkvab"
LOWER_BOUND = -0.6065  # fla's fastest configuration asserts w >= this
results: dict = {"correctness": [], "timings": []}




# --------------------------------------------------------------------------------------------
# Correctness


def check(label, dtype, seed, cu_seqlens=None, **spec):
    rng = np.random.default_rng(seed)
    x = reference.random_inputs("rwkv7", rng, **spec)
    # The per-token inputs rounded to the tested dtype; the reference takes the rounded values.
    x = {n: (a if n == "initial_state" else np.asarray(jnp.asarray(a, dtype).astype(jnp.float64)))
         for n, a in x.items()}
    options = {} if cu_seqlens is None else dict(cu_seqlens=np.asarray(cu_seqlens))
    out, state = reference.forward("rwkv7", x, **options)
    d_out, d_state = rng.standard_normal(out.shape), rng.standard_normal(state.shape)
    grads = reference.gradients("rwkv7", x, d_out, d_state, **options)
    names = list(x)
    arrays = [jnp.asarray(x[n], jnp.float32 if n == "initial_state" else dtype) for n in names]
    cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    key = spec["key"]
    kernel = ffi_backend.rwkv7_kernel(key, key, dtype)

    def f(*values):
        z = dict(zip(names, values))
        return rwkv_jax.rwkv7(*(z[n] for n in NAMES), initial_state=z["initial_state"],
                              cu_seqlens=cu, backend="ffi")

    (o, h), vjp = jax.vjp(f, *arrays)
    g = vjp((jnp.asarray(d_out, o.dtype), jnp.asarray(d_state, h.dtype)))
    errors = {"out": rel(o, out), "state": rel(h, state)}
    errors.update({f"d{n}": rel(gi, grads[n]) for n, gi in zip(names, g)})
    fwd_tol, grad_tol = rwkv_jax.backends.tolerance("ffi", dtype)
    ok = all(e <= (fwd_tol if n in ("out", "state") else grad_tol) for n, e in errors.items())
    log(f"check {label:40s} [{kernel}] {'PASS' if ok else 'FAIL'} worst {max(errors.values()):.1e}  "
        + " ".join(f"{n}={e:.1e}" for n, e in errors.items()))
    results["correctness"].append(dict(label=label, kernel=kernel, ok=ok, errors=errors))
    return ok


def correctness(smoke):
    steps, heads = (37, 1) if smoke else (100, 2)
    decays = {"model": "model", "w uniform [-1e3, 0]": ("uniform", -1e3),
              "tokens -1e9": ("tokens", -1e9), "tokens -inf": ("tokens", -np.inf),
              "w = 0": "zero"}
    cases = []
    for key in (64, 128):
        for dtype in (jnp.float32, jnp.bfloat16):
            name = "fp32" if dtype == jnp.float32 else "bf16"
            for label, decay in decays.items():
                if smoke and key == 128 and label != "tokens -inf":
                    continue
                cases.append((f"K{key} {name} T{steps} {label}", dtype,
                              dict(batch=2, steps=steps, heads=heads, key=key, decay=decay)))
            cases.append((f"K{key} {name} packed [0,37,37,100,161]", dtype,
                          dict(batch=1, steps=161, heads=heads, key=key, state_rows=4,
                               decay=("tokens", -1e9), cu_seqlens=[0, 37, 37, 100, 161])))
            cases.append((f"K{key} {name} T1", dtype, dict(batch=3, steps=1, heads=heads, key=key)))
    ok = True
    for i, (label, dtype, spec) in enumerate(cases):
        try:
            ok &= check(label, dtype, seed=i, **spec)
        except Exception:  # report and go on: the timings are still worth having
            log(f"check {label:40s} ERROR\n" + traceback.format_exc())
            ok = False
    return ok


# --------------------------------------------------------------------------------------------
# Timings


def time_jax(fn, *args, reps=15):
    return 1e3 * median_seconds(fn, *args, reps=reps)


def make_inputs(batch, steps, heads, key, seed=0):
    """bf16 inputs on the device: model-range decays w = LOWER_BOUND * sigmoid(z) (never 0),
    a = -kk, b = kk * sigmoid(z) with kk the normalised key; cotangents of o and the state."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    shape = (batch, steps, heads, key)
    normal = lambda i, s=shape: jax.random.normal(keys[i], s, jnp.float32)
    k = normal(0)
    kk = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    x = dict(r=normal(1), w=LOWER_BOUND * jax.nn.sigmoid(normal(2)), k=k, v=normal(3), a=-kk,
             b=kk * jax.nn.sigmoid(normal(4)))
    x = {n: a.astype(jnp.bfloat16) for n, a in x.items()}
    return x, normal(5).astype(jnp.bfloat16), normal(6, (batch, heads, key, key))


def float64_slice(x, d_out, d_state, heads=2):
    pick = lambda a: np.asarray(a[:1, :, :heads], np.float64)
    x64 = {n: pick(a) for n, a in x.items()}
    out, state = reference.forward("rwkv7", x64)
    grads = reference.gradients("rwkv7", x64, pick(d_out),
                                np.asarray(d_state[:1, :heads], np.float64))
    return out, state, grads


def slice_errors(out, state, grads, ref, heads=2):
    ref_out, ref_state, ref_grads = ref
    pick = lambda a: np.asarray(a, np.float64)[:1, :, :heads]
    errors = {"out": rel(pick(out), ref_out),
              "state": rel(np.asarray(state, np.float64)[:1, :heads], ref_state)}
    errors.update({f"d{n}": rel(pick(grads[n]), ref_grads[n]) for n in NAMES})
    return errors


def record(shape, name, forward_ms, both_ms, peak, errors=None, note=""):
    err = "" if not errors else (f" err out {errors['out']:.1e} worst grad "
                                 f"{max(v for n, v in errors.items() if n.startswith('d')):.1e}")
    log(f"time {shape:34s} {name:12s} fwd {forward_ms:8.3f} ms  fwd+bwd {both_ms:8.3f} ms  "
        f"peak {peak / 2**30:6.2f} GiB{err} {note}")
    results["timings"].append(dict(shape=shape, name=name, forward_ms=forward_ms,
                                   forward_backward_ms=both_ms, peak_bytes=peak, errors=errors))


def bench_jax(shape, backend, x, d_out, d_state, cu_seqlens=None, ref=None):
    def op(x):
        return rwkv_jax.rwkv7(*(x[n] for n in NAMES), backend=backend, cu_seqlens=cu_seqlens)

    def both(x, d_out, d_state):
        (out, state), pullback = jax.vjp(op, x)
        return out, state, pullback((d_out, d_state))[0]

    forward, both = jax.jit(op), jax.jit(both)
    errors = None
    if ref is not None:
        out, state, grads = both(x, d_out, d_state)
        errors = slice_errors(out, state, grads, ref)
    record(shape, backend, time_jax(forward, x), time_jax(both, x, d_out, d_state, reps=10),
           jax_peak_bytes(both, x, d_out, d_state), errors)
    if jax.default_backend() == "gpu":
        try:  # GPU time per kernel (torch's profiler sees XLA's launches too)
            log(f"  {shape} {backend} fwd+bwd per kernel (ms): " + profile_kernels(
                lambda: jax.block_until_ready(both(x, d_out, d_state))))
        except Exception as e:  # noqa: BLE001
            log(f"  {shape} {backend}: no per-kernel profile ({e!r})")


def bench_fla(shape, x, d_out, d_state, cu_seqlens=None, ref=None):
    try:
        import torch
        import triton.testing
        from fla.ops.rwkv7 import chunk_rwkv7
    except Exception as e:  # noqa: BLE001
        log(f"time {shape:34s} fla skipped: cannot import fla's chunk_rwkv7 ({e!r})")
        return
    options = dict(chunk_size=64, safe_gate=True, lower_bound=LOWER_BOUND, disable_recompute=True)
    leaves = {n: torch.from_dlpack(jax.block_until_ready(a)).clone().requires_grad_(True)
              for n, a in x.items()}
    t_do = torch.from_dlpack(d_out).clone()
    t_ds = torch.from_dlpack(d_state).clone()
    if cu_seqlens is not None:
        options["cu_seqlens"] = torch.from_dlpack(cu_seqlens).long()

    def run(**extra):
        return chunk_rwkv7(*(leaves[n] for n in NAMES), scale=1.0, output_final_state=True,
                           **options, **extra)

    try:
        run()
    except TypeError as e:  # an fla without this configuration's options
        log(f"time {shape:34s} fla: fastest configuration refused ({e}); its defaults instead")
        for name in ("safe_gate", "lower_bound", "disable_recompute"):
            options.pop(name)

    def forward():
        with torch.no_grad():
            return run()

    def forward_backward():
        out, state = run()
        torch.autograd.backward((out, state), (t_do, t_ds))

    forward_backward()
    errors = None
    if ref is not None:
        out, state = forward()
        grads = {n: t.grad.float().cpu().numpy() for n, t in leaves.items()}
        errors = slice_errors(out.float().cpu().numpy(), state.float().cpu().numpy(), grads, ref)
    fresh = list(leaves.values())
    forward_ms = triton.testing.do_bench(forward, warmup=50, rep=300, return_mode="median")
    both_ms = triton.testing.do_bench(forward_backward, warmup=50, rep=500, grad_to_none=fresh,
                                      return_mode="median")
    (peak,) = torch_peak_bytes((forward_backward,), fresh, [*fresh, t_do, t_ds])
    record(shape, "fla fastest", forward_ms, both_ms, peak, errors, note=str(sorted(options)))


SHAPES = {"k64": ("B8 T4096 H64 K64", 8, 4096, 64, 64, None),
          "k128": ("B8 T4096 H32 K128", 8, 4096, 32, 128, None),
          "long": ("B1 T65536 H32 K64", 1, 65536, 32, 64, None),
          "packed": ("packed 16 seqs 32768 tok H64 K64", 1, 32768, 64, 64, 16)}


def timings(smoke, deadline, shape_names=tuple(SHAPES), backends=("ffi", "triton", "fla")):
    if smoke:
        shapes = [("B2 T64 H2 K64", 2, 64, 2, 64, None)]
        backends = ["ffi"]
    else:
        shapes = [SHAPES[name] for name in shape_names]
    for shape, batch, steps, heads, key, packed in shapes:
        if time.time() > deadline:
            log(f"time {shape}: skipped, past the time budget")
            continue
        x, d_out, d_state = make_inputs(batch, steps, heads, key)
        cu = None
        if packed:  # uneven segment lengths summing to `steps`
            cuts = np.sort(np.random.default_rng(1).choice(np.arange(1, steps), packed - 1,
                                                           replace=False))
            cu = jnp.asarray(np.concatenate([[0], cuts, [steps]]), jnp.int32)
            d_state = jnp.zeros((packed, heads, key, key), jnp.float32)
        ref = float64_slice(x, d_out, d_state) if batch == 8 or smoke else None
        log(f"{shape}: ffi kernel {ffi_backend.rwkv7_kernel(key, key, jnp.bfloat16)}")
        for backend in backends:
            if time.time() > deadline:
                log(f"time {shape} {backend}: skipped, past the time budget")
                continue
            try:
                if backend == "fla":
                    bench_fla(shape, x, d_out, d_state, cu, ref)
                else:
                    bench_jax(shape, backend, x, d_out, d_state, cu, ref)
            except Exception:  # noqa: BLE001
                log(f"time {shape} {backend}: ERROR\n" + traceback.format_exc())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU twin")
    parser.add_argument("--out", default="/tmp/gpu_rwkv7_cuda")
    parser.add_argument("--budget", type=float, default=360.0,
                        help="seconds after which remaining timings are skipped")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--backends", nargs="+", choices=["ffi", "triton", "fla"],
                        default=["ffi", "triton", "fla"])
    parser.add_argument("--skip-correctness", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        ffi_backend.CHUNKED_PLATFORMS = ("cpu", "gpu")   # the chunked kernels' CPU twin
    os.makedirs(args.out, exist_ok=True)
    open_log(os.path.join(args.out, "gpu_rwkv7_cuda.log"))
    deadline = time.time() + args.budget
    log(f"devices: {jax.devices()}")
    ok = True
    if not args.skip_correctness:
        ok = correctness(args.smoke)
        log(f"correctness: {'ALL PASS' if ok else 'FAILURES (see above)'}")
    timings(args.smoke, deadline, args.shapes, args.backends)
    with open(os.path.join(args.out, "gpu_rwkv7_cuda.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Compiles and autotunes fla's kernels for the benchmark shapes, so that a later run can carry
them: fla's first call takes minutes per op and head size on a fresh machine (its rwkv6 over
200 s), more than a benchmark call can spare.

    python benchmarks/gpu_fla_warm.py OP:SIZE     (OP: rwkv7, gla or rwkv6; SIZE: 64 or 128)

runs fla's forward and forward+backward once on the inputs gpu_rwkv7.py / gpu_gla.py time
(B=8, T=4096, H=4096/SIZE, bf16; rwkv7 in both of its fastest configurations), into the Triton
cache of TRITON_CACHE_DIR with TRITON_CACHE_AUTOTUNING=1 (benchmarks/gpu_fla_warm.sh sets both
and packs one cache per job into .gpu-cache/, which benchmarks/gpu_env.sh unpacks).
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_gla  # noqa: E402
import gpu_rwkv7  # noqa: E402


def warm(op, size):
    batch, steps, heads = 8, 4096, 64 * 64 // size
    if op == "rwkv7":
        from fla.ops.rwkv7 import chunk_rwkv7
        x, d_out, d_state = gpu_rwkv7.model_inputs(batch, steps, heads, size)
        fastest = dict(chunk_size=64, safe_gate=True, lower_bound=gpu_rwkv7.LOWER_BOUND)
        calls = [(chunk_rwkv7, tuple("rwkvab"), dict(fastest, scale=1.0)),
                 (chunk_rwkv7, tuple("rwkvab"), dict(fastest, scale=1.0, disable_recompute=True))]
    elif op == "gla":
        from fla.ops.gla import chunk_gla
        x, d_out, d_state = gpu_gla.model_inputs("gated_linear_attention", batch, steps, heads,
                                                 size)
        calls = [(chunk_gla, ("q", "k", "v", "gk"), {})]
    else:
        from fla.ops.rwkv6 import chunk_rwkv6
        x, d_out, d_state = gpu_gla.model_inputs("rwkv6", batch, steps, heads, size)
        calls = [(chunk_rwkv6, tuple("rkvwu"), dict(scale=1.0))]
    for fn, names, options in calls:
        start = time.perf_counter()
        leaves = [x[n].detach().clone().requires_grad_(True) for n in names]
        with torch.no_grad():
            fn(*leaves, output_final_state=True, **options)
        out, state = fn(*leaves, output_final_state=True, **options)
        torch.autograd.backward((out, state), (d_out, d_state))
        torch.cuda.synchronize()
        print(f"fla {op} K={size} {options}: compiled in {time.perf_counter() - start:.0f} s",
              flush=True)


if __name__ == "__main__":
    op, size = sys.argv[1].split(":")
    warm(op, int(size))

"""Each triton RWKV-7 kernel timed alone on the benchmark's shape (B=8, T=4096, H=64, K=V=64,
bf16, model-range decays), launched straight from torch: where the fwd+bwd time goes.

    python benchmarks/gpu_rwkv7_kernels.py [--warps 4]   # every kernel, 4 and 8 warps

Each (kernel, warps) runs in its own process, so one that crashes loses only its row; the
gradient kernel's outputs are compared with those of its 4-warp launch (a miscompile shows).
On CPU (Triton's interpreter) the same code runs at a toy size, as a smoke test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from triton_kernels import rwkv7  # noqa: E402

RUNS = [(kernel, warps) for kernel in ("forward", "state gradient", "gradient") for warps in (4, 8)]


def run(kernel_name, warps):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, steps, heads, size = (8, 4096, 64, 64) if device == "cuda" else (1, 128, 2, 16)
    chunk, chunks_per_state = 16, 8
    span, rows = chunk * chunks_per_state, batch * steps
    gen = torch.Generator(device=device).manual_seed(0)
    normal = lambda *shape: torch.randn(*shape, device=device, generator=gen)
    shape = (rows, heads, size)
    k = normal(*shape)
    kk = torch.nn.functional.normalize(k, dim=-1)
    x = dict(r=normal(*shape), w=-0.6065 * torch.sigmoid(normal(*shape)), k=k,
             v=normal(*shape), a=-kk, b=kk * torch.sigmoid(normal(*shape)))
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    do = normal(*shape).to(torch.bfloat16)
    h0, dht = normal(batch, heads, size, size), normal(batch, heads, size, size)
    empty = lambda *shape, dtype=torch.float32: torch.empty(*shape, device=device, dtype=dtype)
    index = lambda per_sequence: torch.arange(batch, device=device, dtype=torch.int32) * per_sequence
    cu = index(steps)
    cu = torch.cat([cu, cu.new_tensor([rows])])
    slots, chunk_slots = rows // span + batch, rows // chunk + batch
    o, ht, dh0 = empty(*shape, dtype=torch.bfloat16), empty(*h0.shape), empty(*h0.shape)
    states, dstates = empty(slots, heads, size, size), empty(chunk_slots, heads, size, size)
    u, dx = empty(*shape), empty(*shape)
    sizes = dict(scale=1.0, HEADS=heads, K=size, V=size, BK=size, BV=size, C=chunk, LEVELS=4,
                 FLOOR=-128.0, TAME=True, TOTAL_ROWS=rows, PRECISION="tf32")
    grid = (batch * heads, 1)

    def forward(warps):
        rwkv7.rwkv7_forward_kernel[grid](
            *x.values(), h0, cu, index(steps // span), o, ht, states, u,
            CHUNKS_PER_STATE=chunks_per_state, SAVE=True, INVERSE_PRECISION="tf32",
            STATE_SLOTS=slots,
            num_warps=warps, **sizes)

    def state_gradient(warps):
        rwkv7.rwkv7_state_gradient_kernel[grid](
            x["r"], x["w"], x["a"], x["b"], do, dht, cu, index(steps // chunk), dh0, dstates, dx,
            INVERSE_PRECISION="tf32", CHUNK_SLOTS=chunk_slots, num_warps=warps, **sizes)

    slot_sequence = torch.full((slots,), -1, device=device, dtype=torch.int32)
    slot_sequence[:rows // span] = torch.arange(batch, device=device, dtype=torch.int32
                                                ).repeat_interleave(steps // span)
    grads = {w: [torch.full(shape, float("nan"), device=device, dtype=torch.bfloat16)
                 for _ in range(6)] for w in (4, warps)}

    def gradient(warps):
        rwkv7.rwkv7_backward_kernel[(slots, heads, 1)](
            *x.values(), do, states, u, dstates, dx, cu, index(steps // span),
            index(steps // chunk), slot_sequence, *grads[warps],
            CHUNKS_PER_STATE=chunks_per_state, ROWS=0, SEQUENCES=batch, CHUNK_SLOTS=chunk_slots,
            num_warps=warps, **sizes)

    forward(4)
    state_gradient(4)
    launch = {"forward": forward, "state gradient": state_gradient, "gradient": gradient}
    note = ""
    if kernel_name == "gradient":
        gradient(4)
        gradient(warps)
        differences = [((a.float() - b.float()).norm() / b.float().norm()).item()
                       for a, b in zip(grads[warps], grads[4])]
        note = "  vs 4 warps: " + " ".join(f"d{n} {d:.0e}" for n, d in zip("rwkvab", differences))
    timed = lambda: launch[kernel_name](warps)
    ms = (triton.testing.do_bench(timed, warmup=50, rep=300, return_mode="median")
          if device == "cuda" else float("nan"))
    print(f"ROW {kernel_name:15s} {warps} warps {ms:8.3f} ms{note}", flush=True)


def main():
    if len(sys.argv) == 3 and sys.argv[1] != "--warps":
        return run(sys.argv[1], int(sys.argv[2]))
    runs = RUNS
    if len(sys.argv) == 3:
        runs = [(kernel, int(sys.argv[2])) for kernel, _ in RUNS[::2]]
    rows = []
    for kernel_name, warps in runs:
        done = subprocess.run([sys.executable, __file__, kernel_name, str(warps)],
                              capture_output=True, text=True)
        got = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        rows.append(got[0] if got else f"{kernel_name:15s} {warps} warps FAILED: "
                    + (done.stderr.strip().splitlines() or ["?"])[-1][:160])
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()

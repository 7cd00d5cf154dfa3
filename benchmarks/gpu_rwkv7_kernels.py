"""Each triton RWKV-7 kernel timed alone on the benchmark's shape (B=8, T=4096, H*K=4096,
K=V=64 or 128, bf16, model-range decays), launched straight from torch: where the fwd+bwd time
goes.

    python benchmarks/gpu_rwkv7_kernels.py [--warps 4] [--size 128]  # every kernel, 4 and 8 warps

Each (kernel, warps) runs in its own process, so one that crashes loses only its row; the
gradient kernels' outputs are compared with those of their 4-warp launch (a miscompile shows).
On CPU (Triton's interpreter) the same code runs at a toy size, as a smoke test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from triton_kernels import rwkv7  # noqa: E402

KERNELS = ("in-chunk", "in-chunk exact", "forward", "state gradient", "value gradient",
           "key gradient", "query gradient")


def run(kernel_name, warps, size, recurrence_block_v, gradient_block_k):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, steps, heads = (8, 4096, 4096 // size) if device == "cuda" else (1, 128, 2)
    size = size if device == "cuda" else 16
    block_v = min(size, 64)
    recurrence_block_v = min(recurrence_block_v or block_v, size)
    v_blocks = size // block_v
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
    chunk_sequence = torch.full((chunk_slots,), -1, device=device, dtype=torch.int32)
    chunk_sequence[:rows // chunk] = torch.arange(batch, device=device, dtype=torch.int32
                                                  ).repeat_interleave(steps // chunk)
    matrices = torch.zeros(chunk_slots, heads, 4, chunk, chunk, device=device)
    o, ht, dh0 = empty(*shape, dtype=torch.bfloat16), empty(*h0.shape), empty(*h0.shape)
    states, dstates = empty(slots, heads, size, size), empty(chunk_slots, heads, size, size)
    u, dx = empty(*shape), empty(*shape)
    sizes = dict(scale=1.0, HEADS=heads, K=size, V=size, BK=size, BV=block_v, C=chunk, LEVELS=4,
                 FLOOR=-128.0, TAME=True, TOTAL_ROWS=rows, PRECISION="tf32")
    recurrence = dict({n: v for n, v in sizes.items() if n not in ("LEVELS", "TAME")},
                      BV=recurrence_block_v, CHUNK_SLOTS=chunk_slots, ROUNDED=False)
    grid = (batch * heads, size // recurrence_block_v)

    def in_chunk(warps, tame=True, group=4):
        options = dict(GROUP=group) if tame else dict(LEVELS=4)
        kernel = rwkv7.rwkv7_tame_in_chunk_kernel if tame else rwkv7.rwkv7_in_chunk_kernel
        kernel[(-(-chunk_slots // (group if tame else 1)), heads)](
            x["r"], x["w"], x["k"], x["a"], x["b"], cu, index(steps // chunk), chunk_sequence,
            matrices, KI=min(64 if tame else 32, size), SEQUENCES=batch, CHUNK_SLOTS=chunk_slots,
            INVERSE_PRECISION="tf32", num_warps=warps, **options,
            **{n: v for n, v in sizes.items() if n not in ("V", "BV", "TAME", "LEVELS")})

    def forward(warps):
        rwkv7.rwkv7_forward_kernel[grid](
            *x.values(), h0, matrices, cu, index(steps // span), index(steps // chunk), o, ht,
            states, u, CHUNKS_PER_STATE=chunks_per_state, SAVE=True, STATE_SLOTS=slots,
            num_warps=warps, **recurrence)

    def state_gradient(warps):
        rwkv7.rwkv7_state_gradient_kernel[grid](
            x["r"], x["w"], x["a"], x["b"], do, dht, matrices, cu, index(steps // chunk), dh0,
            dstates, dx, num_warps=warps, **recurrence)

    slot_sequence = torch.full((slots,), -1, device=device, dtype=torch.int32)
    slot_sequence[:rows // span] = torch.arange(batch, device=device, dtype=torch.int32
                                                ).repeat_interleave(steps // span)
    # The K-side gradients: one launch per V block, float32 sums when there are several (each
    # launch here adds the same zero earlier sums, so that repeated launches write the same).
    k_side = dict(dtype=torch.bfloat16) if v_blocks == 1 else dict(dtype=torch.float32)
    earlier = [torch.zeros(shape, device=device) for _ in range(3)]
    outputs = {w: dict(dv=[torch.full(shape, float("nan"), device=device, dtype=torch.bfloat16)],
                       key=[torch.full(shape, float("nan"), device=device, **k_side)
                            for _ in range(2)] + [empty(*shape)],
                       query=[torch.full(shape, float("nan"), device=device, **k_side)
                              for _ in range(3)]) for w in (4, warps)}
    gradient_grid = (slots, heads, v_blocks)
    gradient_sizes = dict(CHUNKS_PER_STATE=chunks_per_state, SEQUENCES=batch,
                          CHUNK_SLOTS=chunk_slots, **sizes)
    # The key and query kernels on blocks of K rows (default_config's: 64 at K=128).
    block_k = gradient_block_k or (64 if size == 128 else size)
    k_blocks = size // block_k
    k_side_sizes = dict(gradient_sizes, BK=block_k, K_BLOCKS=k_blocks)
    k_side_grid = (slots, heads, k_blocks)
    indices = (cu, index(steps // span), index(steps // chunk), slot_sequence)

    def value_gradient(warps):
        rwkv7.rwkv7_value_gradient_kernel[gradient_grid](
            x["w"], x["k"], do, dstates, dx, matrices, *indices, *outputs[warps]["dv"],
            num_warps=warps, K_PIECES=size // min(size, 64),
            **dict({n: v for n, v in gradient_sizes.items()
                    if n not in ("scale", "LEVELS", "TAME")}, BK=min(size, 64)))

    def key_gradient(warps):
        for v_block in range(v_blocks):
            rwkv7.rwkv7_key_gradient_kernel[k_side_grid](
                *x.values(), do, u, dstates, dx, *earlier[:2], *indices,
                *outputs[warps]["key"], V_BLOCK=v_block, ACCUMULATE=v_block > 0,
                num_warps=warps, **k_side_sizes)

    def query_gradient(warps):
        for v_block in range(v_blocks):
            rwkv7.rwkv7_query_gradient_kernel[k_side_grid](
                *x.values(), do, states, u, dstates, dx, outputs[4]["key"][2], *earlier,
                *indices, *outputs[warps]["query"], V_BLOCK=v_block, ACCUMULATE=v_block > 0,
                num_warps=warps, **k_side_sizes)

    in_chunk(4)
    forward(4)
    state_gradient(4)
    launch = {"in-chunk": in_chunk, "in-chunk exact": lambda warps: in_chunk(warps, False),
              "forward": forward, "state gradient": state_gradient,
              "value gradient": value_gradient, "key gradient": key_gradient,
              "query gradient": query_gradient}
    note = ""
    if kernel_name in ("value gradient", "key gradient", "query gradient"):
        key_gradient(4)  # (the query side reads the key side's share of dw)
        name = {"value": "dv", "key": "key", "query": "query"}[kernel_name.split()[0]]
        launch[kernel_name](4)
        launch[kernel_name](warps)
        differences = [((a.float() - b.float()).norm() / b.float().norm()).item()
                       for a, b in zip(outputs[warps][name], outputs[4][name])]
        note = "  vs 4 warps: " + " ".join(f"{d:.0e}" for d in differences)
    timed = lambda: launch[kernel_name](warps)
    ms = (triton.testing.do_bench(timed, warmup=50, rep=300, return_mode="median")
          if device == "cuda" else float("nan"))
    print(f"ROW K={size:<3} {kernel_name:15s} {warps} warps {ms:8.3f} ms{note}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--only", default="", help="one kernel, e.g. 'key gradient'")
    parser.add_argument("--recurrence-block-v", type=int, default=0,
                        help="V columns per program of the sequential passes (0: as the rest)")
    parser.add_argument("--gradient-block-k", type=int, default=0,
                        help="K rows per program of the key and query gradient kernels (0: "
                             "default_config's, 64 at K=128, else all)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warps_list = [int(w) for w in args.warps.split(",")]
    if args.child:
        return run(args.only, warps_list[0], args.size, args.recurrence_block_v,
                   args.gradient_block_k)
    runs = [(kernel, warps) for kernel in (KERNELS if not args.only else (args.only,))
            for warps in warps_list]
    rows = []
    for kernel_name, warps in runs:
        done = subprocess.run([sys.executable, __file__, "--child", "--only", kernel_name,
                               "--warps", str(warps), "--size", str(args.size),
                               "--recurrence-block-v", str(args.recurrence_block_v),
                               "--gradient-block-k", str(args.gradient_block_k)],
                              capture_output=True, text=True)
        got = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        rows.append(got[0] if got else f"{kernel_name:15s} {warps} warps FAILED: "
                    + (done.stderr.strip().splitlines() or ["?"])[-1][:160])
        print(rows[-1], flush=True)


if __name__ == "__main__":
    main()

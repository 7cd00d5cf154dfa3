"""Registers, spills and shared memory of the triton kernels (RWKV-7, or GLA / RWKV-6 with
``--family gla``), compiled for an H100/H200 (sm_90) on any machine: no GPU needed, Triton's
wheel carries ptxas and cuobjdump.

    python benchmarks/compile_report.py [--family rwkv7-64|gla] [--key 64] [--value 64]
        [--warps 4,8]
        [--precision tf32|bf16] [--span 64 --scores-block-k 16 --bonus --gate-v
         --key-block-k 16 --key-program-k 16 --tame-key-block-k 16 --tame-key-program-k 128
         --float32-states --no-rounded --stages 3]   (gla: the backend's defaults for bf16
         inputs)
        [--bf16-saved]   (rwkv7-64: also U, dH' and dX in bfloat16, not the backend's choice)
        [--float32-residuals]   (rwkv7-64: KernelConfig.bf16_residuals off)

Each kernel is reported for both compiled paths (TAME=True, the model-range one; TAME=False,
exact for every decay). A kernel at 255 registers with spills is latency-bound: METHOD.md's
resource report, read before spending device time. Counts of the SASS instructions that matter
follow (SASS: every instruction; HGMMA: Hopper's warpgroup MMA, then by operand type; HMMA:
the older 16-row MMA; LDL/STL: spill traffic).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from triton_kernels import gla, rwkv7  # noqa: E402

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SASS = ("HGMMA", "HMMA", "LDL", "STL", "BAR.SYNC", "LDS", "STS", "LDG", "STG")


def compile_for_hopper(kernel, pointer_types, constexprs, warps, stages=3, max_registers=None):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else pointer_types[n] for n in names}
    # Launches pass 16-byte aligned pointers; say so, or loads would not be vectorised.
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs}
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()},
                       aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   "maxnreg": max_registers})


def resources(compiled):
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        # (Triton's newer ptxas where the PTX's version is past the older one's)
        for ptxas in ("ptxas", "ptxas-blackwell"):
            run = subprocess.run([os.path.join(TOOLS, ptxas), "-arch=sm_90a", "-v", ptx, "-o",
                                  cubin], capture_output=True, text=True)
            if run.returncode == 0 or not os.path.exists(os.path.join(TOOLS, "ptxas-blackwell")):
                break
        run.check_returncode()
        report = run.stderr
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    registers = re.search(r"Used (\d+) registers", report).group(1)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()
    counts = " ".join(f"{op}={len(re.findall(op, sass))}" for op in SASS)
    # (every instruction of the binary: where a kernel's loops are unrolled, as the 64-token
    # in-chunk kernel's, close to what each warp issues per program)
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s", sass, re.M))
    counts = f"SASS={instructions} " + counts
    # (HGMMA by operand type: BF16/F16 take 16-bit tiles as stored, TF32 float32 ones)
    types = re.findall(r"HGMMA\.\w+\.F32\.(\w+)", sass)
    if types:
        counts += " (" + " ".join(f"{t}={types.count(t)}" for t in sorted(set(types))) + ")"
    return (f"registers {registers:>3}  spill stores/loads {spills[0]:>4}/{spills[1]:<4} "
            f"shared {compiled.metadata.shared:>6} B  {counts}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--key", type=int, default=64)
    parser.add_argument("--value", type=int, default=64)
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--span", type=int, default=64,
                        help="gla family: tokens per chunk of the forward (a state saved at each)")
    parser.add_argument("--block-v", type=int, default=64,
                        help="the most V columns a program takes")
    parser.add_argument("--scores-block-k", type=int, default=16,
                        help="gla family: K columns per step of the forward's scores kernel")
    parser.add_argument("--family", choices=("rwkv7-64", "gla"), default="rwkv7-64",
                        help="rwkv7-64: RWKV-7's kernels (forward_chunk64 and the backward's)")
    parser.add_argument("--block-k-in-chunk", type=int, default=None,
                        help="rwkv7-64: K columns per part of the in-chunk kernel's tame path "
                             "(default as forward_chunk64: 64; the exact path's: 16)")
    parser.add_argument("--k-side-block-k", type=int, default=16,
                        help="rwkv7-64: keys per program of the K-side kernel (K_SIDE_BLOCK_K64)")
    parser.add_argument("--da-block-v", type=int, default=32,
                        help="rwkv7-64: V columns per step of the dA kernel's sums")
    parser.add_argument("--bonus", action="store_true", help="gla family: RWKV-6's kernels")
    parser.add_argument("--key-block-k", type=int, default=16,
                        help="gla family: K columns per step of the K-side gradient kernel")
    parser.add_argument("--key-program-k", type=int, default=16,
                        help="gla family: K columns per program of it")
    parser.add_argument("--tame-key-block-k", type=int, default=16,
                        help="gla family: --key-block-k on the tame path")
    parser.add_argument("--tame-key-program-k", type=int, default=128,
                        help="gla family: --key-program-k on the tame path")
    parser.add_argument("--gate-v", action="store_true", help="gla family: with a value gate")
    parser.add_argument("--sums-by-product", action=argparse.BooleanOptionalAction,
                        default=True, help="gla family: _GlaStatic.gate_sums_by_product")
    parser.add_argument("--stages", type=int, default=None,
                        help="num_stages of the loops Triton pipelines (gla: the sequential "
                             "passes, default 3; rwkv7-64: the state pass's, "
                             "KernelConfig.state_stages, "
                             "default as forward_chunk64: 1 at K > 64, else 2)")
    parser.add_argument("--rounded", action=argparse.BooleanOptionalAction, default=None,
                        help="decayed operands rounded to bf16 against stored tiles (gla: "
                             "_GlaStatic.rounded_products, on by default as for bf16 inputs)")
    parser.add_argument("--precision", default="tf32",
                        help="of the matrix products (gla family: tf32 or bf16)")
    parser.add_argument("--float32-states", action="store_true",
                        help="gla family: the saved states and their gradients in float32 (as "
                        "for float32 inputs; bf16 inputs save them in bfloat16)")
    parser.add_argument("--bf16-saved", action="store_true",
                        help="rwkv7-64: the saved states, dH', U and dX in bfloat16 (not the "
                        "backend's choice)")
    parser.add_argument("--float32-residuals", action="store_true",
                        help="rwkv7-64: W and H per chunk in float32, as with "
                        "KernelConfig.bf16_residuals off (on: bfloat16 for bf16 inputs)")
    parser.add_argument("--max-registers", type=int, default=None,
                        help="a cap on every kernel's registers per thread (Triton's maxnreg, as "
                        "launch.launch's max_registers; the backend's rwkv7-64 caps: "
                        "IN_CHUNK_MAX_REGISTERS64, K_SIDE_MAX_REGISTERS64, tame paths)")
    parser.add_argument("--dump", metavar="DIR",
                        help="also write each compiled kernel's TTGIR and PTX into DIR")
    parser.add_argument("--only", default="", help="e.g. 'gradient': only the kernels so named")
    args = parser.parse_args()
    rounded = args.family == "gla" if args.rounded is None else args.rounded
    bk = max(16, 1 << (args.key - 1).bit_length())
    stages = args.stages if args.stages is not None else (
        3 if args.family == "gla" else 1 if bk > 64 else 2)
    bv = min(args.block_v, max(16, 1 << (args.value - 1).bit_length()))
    v_blocks = -(-args.value // bv)
    rows = 8 * 4096
    shapes = dict(scale=1.0, HEADS=64, K=args.key, V=args.value, BK=bk, BV=bv, C=16, LEVELS=4,
                  FLOOR=-128.0, TOTAL_ROWS=rows, PRECISION=args.precision)
    bf16, f32, i32 = "*bf16", "*fp32", "*i32"
    inputs = dict(r_ptr=bf16, w_ptr=bf16, k_ptr=bf16, v_ptr=bf16, a_ptr=bf16, b_ptr=bf16,
                  do_ptr=bf16, h0_ptr=f32, dht_ptr=f32, states_ptr=f32, dstates_ptr=f32,
                  u_ptr=f32, dx_ptr=f32, dw_part_ptr=f32, ht_ptr=f32, dh0_ptr=f32, o_ptr=bf16,
                  dv_ptr=bf16,
                  matrices_ptr=f32, cu_ptr=i32, state_index_ptr=i32, chunk_index_ptr=i32,
                  slot_sequence_ptr=i32, chunk_sequence_ptr=i32, scores_ptr=f32, low_ptr=f32)
    # The K-side gradients: the last V block's launch (with several, it adds the earlier sums)
    inputs.update({f"d{n}_ptr": bf16 for n in "rwkab"})
    inputs.update({f"earlier_d{n}_ptr": f32 for n in "rwkab"})
    kernels = []
    tame_constexprs = {}  # kernel name -> the tame path's own constexprs
    if args.family == "gla":
        if not args.float32_states:
            inputs.update(states_ptr=bf16, dstates_ptr=bf16)
        kernels = gla_kernels(shapes, inputs, args.bonus, args.gate_v, args.span,
                              args.scores_block_k, args.key_block_k, args.key_program_k,
                              rounded, args.sums_by_product)
        tame_constexprs["key gradient"] = dict(BK=min(args.tame_key_block_k, bk),
                                               KEYS=min(args.tame_key_program_k, bk))
    if args.family == "rwkv7-64":
        kernels = chunk64_kernels(shapes, inputs, args.k_side_block_k, args.da_block_v,
                                  not args.float32_residuals, stages)
        tame_constexprs["wy in-chunk"] = dict(KI=min(args.block_k_in_chunk or 64, bk))
        if args.bf16_saved:
            inputs.update(states_ptr=bf16, dstates_ptr=bf16, u_ptr=bf16, dx_ptr=bf16)
    print(f"{args.family}: K={args.key} V={args.value} (BK={bk}, BV={bv}), bf16 inputs, sm_90")
    # Each kernel's two compiled paths (TAME=True for model-range decays, the exact one).
    paths = ((True, "tame"), (False, "exact"))
    for name, kernel, constexprs in kernels:
        if args.only and name != args.only:
            continue
        # (the sequential passes and the fused tame gradient kernel have one path only)
        for tame, path in paths if "TAME" in kernel.arg_names else ((None, "both"),):
            for warps in (int(w) for w in args.warps.split(",")):
                options = constexprs if tame is None else dict(
                    constexprs, TAME=tame, **tame_constexprs.get(name, {}) if tame else {})
                pipelined = ("ROUNDED" in kernel.arg_names if args.family == "gla"
                             else "PIPELINED" in kernel.arg_names)
                compiled = compile_for_hopper(kernel, inputs, options, warps,
                                              max(stages, 1) if pipelined else 3,
                                              args.max_registers)
                print(f"{name:15s} {path:5s} {warps} warps: {resources(compiled)}")
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    stem = os.path.join(args.dump, f"{name}-{path}-{warps}".replace(" ", "_"))
                    for ir in ("ttgir", "ptx"):
                        with open(f"{stem}.{ir}", "w") as f:
                            f.write(compiled.asm[ir])


def chunk64_kernels(shapes, inputs, k_side_block_k, da_block_v, bf16_residuals, state_stages):
    """The 64-token forward (triton.forward_chunk64's launches), the backward's sequential pass
    and V side (backward_chunk64_v_side's) and its K side (backward_chunk64_k_side's, on its
    ``k_side_block_k`` keys per program, the dA kernel's sums in steps of ``da_block_v``),
    bf16 inputs: the pointer types and constexprs. The in-chunk kernel in K parts of 16, as
    forward_chunk64's exact path (the caller sets the tame path's).
    ``bf16_residuals``: W, H per chunk and the decayed rows in bfloat16
    (KernelConfig.bf16_residuals), else float32. ``state_stages``: the state pass's
    num_stages (KernelConfig.state_stages; 0: its ``while`` loop, not pipelined)."""
    buffer = "*bf16" if bf16_residuals else "*fp32"
    inputs.update({f"{n}_ptr": "*fp32" for n in ("u0", "u", "matrices", "du", "dx", "dstates")},
                  wy_ptr=buffer, states_ptr=buffer, dA_ptr="*bf16", diagonal_ptr="*fp32",
                  qd_ptr=buffer, kd_ptr=buffer,
                  bd_ptr=buffer, decay_ptr="*fp32")
    rows = shapes["TOTAL_ROWS"]
    common = dict({n: x for n, x in shapes.items() if n not in ("scale", "LEVELS")}, C=64,
                  CHUNK_SLOTS=rows // 64 + 8)
    parallel = dict(common, SEQUENCES=8)
    no_decays = lambda constexprs: {n: x for n, x in constexprs.items() if n != "FLOOR"}
    return [
        # (as launched: one program takes every V block of U0, VI = BV columns at a time)
        ("wy in-chunk", rwkv7.rwkv7_wy_kernel,
         dict(parallel, scale=1.0, LEVELS=6, KI=min(16, shapes["BK"]),
              BV=-(-shapes["V"] // shapes["BV"]) * shapes["BV"], VI=shapes["BV"],
              INVERSE_PRECISION=shapes["PRECISION"], BLOCK_LEVELS=4, RESIDUALS=True)),
        ("wy state", rwkv7.rwkv7_wy_state_kernel,
         dict(no_decays(common), PIPELINED=state_stages > 0, OUTPUTS=False)),
        # (a call that is not differentiated: the state pass with the outputs, no residuals)
        ("wy state outputs", rwkv7.rwkv7_wy_state_kernel,
         dict(no_decays(common), PIPELINED=state_stages > 0, OUTPUTS=True)),
        ("wy output", rwkv7.rwkv7_wy_output_kernel, no_decays(parallel)),
        ("wy state gradient", rwkv7.rwkv7_wy_state_gradient_kernel,
         dict(no_decays(common), PIPELINED=state_stages > 0)),
        ("wy value gradient", rwkv7.rwkv7_wy_value_gradient_kernel, no_decays(parallel)),
        ("wy dA", rwkv7.rwkv7_wy_matrix_gradient_kernel,
         dict({n: parallel[n] for n in ("HEADS", "V", "C", "TOTAL_ROWS", "SEQUENCES",
                                        "CHUNK_SLOTS", "PRECISION")},
              BV=min(shapes["BV"], da_block_v))),
        ("wy key gradient", rwkv7.rwkv7_wy_key_gradient_kernel,
         dict(parallel, scale=1.0, LEVELS=6, BV=min(shapes["BV"], 32),
              BK=k_side_block_k if shapes["K"] % k_side_block_k == 0 else shapes["BK"])),
    ]


def gla_kernels(shapes, inputs, bonus, gate_v, span, scores_block_k, key_block_k,
                key_program_k, rounded, sums_by_product):
    """GLA (key gate only, as benchmarked, or with a value gate) or RWKV-6: the pointer types
    and constexprs."""
    inputs.update(q_ptr=inputs["r_ptr"], dq_ptr=inputs["dr_ptr"], dk_ptr="*bf16",
                  da_ptr="*fp32", db_ptr="*fp32", du_ptr="*fp32")
    shapes = {n: x for n, x in shapes.items() if n != "TOTAL_ROWS"}  # RWKV-7's
    shapes = dict(shapes, ROWS=8 * 4096, HAS_A=True, HAS_B=gate_v, BONUS=bonus, REVERSE=False,
                  FLOOR=-128.0, C=span, LEVELS=span.bit_length() - 1, BLOCKS_FASTEST=False)
    rows = shapes["ROWS"]
    blocked = dict(shapes, BK=min(64, shapes["BK"]))  # K in blocks as V
    without = lambda names, **more: {n: x for n, x in dict(blocked, **more).items()
                                     if n not in names}
    return [
        ("state pass", gla.gla_state_kernel,
         without(("scale", "LEVELS", "BONUS"), SLOTS=rows // span + 8, ROUNDED=rounded,
                 SUMS_BY_PRODUCT=sums_by_product)),
        ("scores", gla.gla_scores_kernel,
         without(("V", "BV", "HAS_B", "LEVELS", "BLOCKS_FASTEST"),
                 BK=min(scores_block_k, blocked["BK"]))),
        ("output", gla.gla_output_kernel,
         dict(blocked, ROUNDED=rounded, SUMS_BY_PRODUCT=sums_by_product)),
        ("state gradient", gla.gla_state_gradient_kernel,
         without(("LEVELS",), SLOTS=rows // span + 8, ROUNDED=rounded,
                 SUMS_BY_PRODUCT=sums_by_product)),
        ("key gradient", gla.gla_key_gradient_kernel,
         dict(blocked, BK=min(key_block_k, blocked["BK"]),
              KEYS=min(key_program_k, shapes["BK"]))),
        ("value gradient", gla.gla_value_gradient_kernel, blocked),
    ]


if __name__ == "__main__":
    main()

#!/bin/bash
# The train topic on a GPU machine, from the repository root, set up by benchmarks/gpu_setup.sh
# (GPU_SETUP_FFI=1 builds the ffi extension first). Every row of benchmarks/train_throughput.py
# runs in its own process (its own memory peak; an error or the time limit ends that row only),
# its JSON line appended to $OUT/train.jsonl and its report to $OUT/<row>.log:
#
#   benchmarks/gpu_train.sh table [ROW ...] [-- ARGS]   # the recipe's MFU table on one GPU:
#       rows 0.1b 0.4b 1.5b (with the step's breakdown) and 1.5b_bf16_params (bfloat16
#       parameters, float32 optimizer state), T=4096 and 65,536 tokens per optimizer step
#       (micro-batches accumulated inside the step); default all four
#   benchmarks/gpu_train.sh data N [N ...] [-- ARGS]    # 1.5B, T=4096, batch 2 per GPU, N GPUs
#   benchmarks/gpu_train.sh seq N [N ...] [-- ARGS]     # 0.4B, one 65,536-token sequence, remat
#   benchmarks/gpu_train.sh curve [-- ARGS]             # benchmarks/train_loss_curve.py: the
#       recipe beside the plain step on benchmarks/data/shakespeare_*.npy (made by
#       benchmarks/shakespeare_tokens.py)
#
# ARGS go to every row (or to train_loss_curve.py). A row compiles the 24-layer step and, with
# the breakdown, each of its parts: allow several minutes per row (ROW_SECONDS, default 400).
set -o pipefail
mode=$1; shift
picks=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do picks+=("$1"); shift; done
[ "$1" = "--" ] && shift
out=${OUT:-/tmp/gpu_train}
mkdir -p "$out"
source benchmarks/gpu_setup.sh

row() {  # row NAME TRAIN_THROUGHPUT_ARGUMENTS...
    local name=$1; shift
    echo "== train_throughput.py $*"
    timeout "${ROW_SECONDS:-400}" python3 benchmarks/train_throughput.py "$@" \
        --json "$out/train.jsonl" 2>&1 | grep -v "^WARNING" | tee "$out/$name.log"
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || echo "== exit status $status for $name"
}

case $mode in
    table)
        [ ${#picks[@]} -eq 0 ] && picks=(0.1b 0.4b 1.5b 1.5b_bf16_params)
        for name in "${picks[@]}"; do
            case $name in
                0.1b) run=(--model 0.1b --batch 8 --accumulation 2 --breakdown) ;;
                0.4b) run=(--model 0.4b --batch 4 --accumulation 4 --breakdown) ;;
                1.5b) run=(--model 1.5b --batch 2 --accumulation 8 --breakdown) ;;
                1.5b_bf16_params) run=(--model 1.5b --batch 2 --accumulation 8 --param-dtype bfloat16) ;;
                *) echo "table rows are 0.1b 0.4b 1.5b 1.5b_bf16_params, got $name" >&2; exit 2 ;;
            esac
            row "$name" "${run[@]}" --seq 4096 --warmup 1 --steps 3 "$@"
        done ;;
    data|seq)
        [ ${#picks[@]} -gt 0 ] || { echo "$mode needs GPU counts" >&2; exit 2; }
        for n in "${picks[@]}"; do
            if [ "$mode" = data ]; then
                run=(--model 1.5b --devices "$n" --batch $((2 * n)) --seq 4096 --parallel data)
            else
                run=(--model 0.4b --devices "$n" --batch 1 --seq 65536 --parallel seq --remat block)
            fi
            row "${mode}_${n}gpu" "${run[@]}" --breakdown "$@"
        done ;;
    curve)
        echo "== train_loss_curve.py $*"
        timeout "${CURVE_SECONDS:-540}" python3 benchmarks/train_loss_curve.py \
            --train benchmarks/data/shakespeare_train.npy --eval benchmarks/data/shakespeare_eval.npy \
            --out "$out" "$@" 2>&1 | grep -v "^WARNING" | tee "$out/loss_curve.log"
        status=${PIPESTATUS[0]}
        [ "$status" -eq 0 ] || echo "== exit status $status for the loss curves" ;;
    *) echo "mode must be table, data, seq or curve, got $mode" >&2; exit 2 ;;
esac

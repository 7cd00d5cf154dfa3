#!/bin/bash
# Runs benchmarks/train_throughput.py on a GPU machine from the repository root, set up by
# benchmarks/gpu_setup.sh: one process per row (its own memory peak; an out-of-memory error ends
# that row only), JSON rows and the printed reports in $OUT.
#   benchmarks/gpu_train_throughput.sh data 1   # 1.5B, T=4096, batch 2 per GPU, on 1 GPU
#   benchmarks/gpu_train_throughput.sh seq 4    # 0.4B, one sequence of 65,536 tokens, remat
# Each row takes a few minutes (compiling the 24-layer step and the breakdown's parts): give one
# GPU count per call where a call's time is bounded.
# Further arguments after "--" go to every run (e.g. -- --backend triton --steps 10).
set -o pipefail
mode=$1; shift
counts=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do counts+=("$1"); shift; done
[ "$1" = "--" ] && shift
out=${OUT:-/tmp/gpu_train_throughput}
mkdir -p "$out"
source benchmarks/gpu_setup.sh
for n in "${counts[@]}"; do
    case $mode in
        data) run=(--model 1.5b --devices "$n" --batch $((2 * n)) --seq 4096 --parallel data) ;;
        seq) run=(--model 0.4b --devices "$n" --batch 1 --seq 65536 --parallel seq --remat block) ;;
        *) echo "mode must be data or seq, got $mode" >&2; exit 2 ;;
    esac
    echo "== train_throughput.py ${run[*]} $*"
    log="$out/${mode}_${n}gpu"
    timeout 540 python3 benchmarks/train_throughput.py "${run[@]}" --breakdown "$@" \
        --json "$log.json" 2>&1 | grep -v "^WARNING" | tee "$log.log" \
        || echo "== exit status $? for ${mode} on $n GPUs"
done

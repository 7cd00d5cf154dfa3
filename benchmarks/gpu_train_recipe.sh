#!/bin/bash
# rwkv_jax.train's step on one GPU, set up by benchmarks/gpu_env.sh, from the repository root:
# the MFU table of RWKV-7 0.1B, 0.4B and 1.5B at T=4096 and 65,536 tokens per optimizer step
# (micro-batches accumulated inside the step), each row in its own process (its own memory
# peak; an error ends that row only) with the step's breakdown, then the 1.5B step with bfloat16
# parameters (float32 optimizer state) without it ("table", at most ~9 minutes, ~5 expected);
# or ("curve") the loss curves of benchmarks/train_loss_curve.py, the recipe and the plain step,
# on benchmarks/data/shakespeare_*.npy (made by benchmarks/shakespeare_tokens.py). JSON and the
# printed reports in $OUT.
#   benchmarks/gpu_train_recipe.sh table      # further arguments go to every row
#   benchmarks/gpu_train_recipe.sh curve      # further arguments go to train_loss_curve.py
set -o pipefail
mode=$1; shift
case $mode in
    table|curve) ;;
    *) echo "mode must be table or curve, got $mode" >&2; exit 2 ;;
esac
out=${OUT:-/tmp/gpu_train_recipe}
mkdir -p "$out"
source benchmarks/gpu_env.sh
rows=("0.1b --batch 8 --accumulation 2 --breakdown"
      "0.4b --batch 4 --accumulation 4 --breakdown"
      "1.5b --batch 2 --accumulation 8 --breakdown"
      "1.5b --batch 2 --accumulation 8 --param-dtype bfloat16")
names=(0.1b 0.4b 1.5b 1.5b_bf16_params)
limits=(90 120 200 120)
for i in "${!rows[@]}"; do
    [ "$mode" = table ] || break
    echo "== train_throughput.py --model ${rows[$i]} $*"
    timeout "${limits[$i]}" python3 benchmarks/train_throughput.py --model ${rows[$i]} --seq 4096 \
        --warmup 1 --steps 3 --json "$out/${names[$i]}.json" "$@" 2>&1 | grep -v "^WARNING" \
        | tee "$out/${names[$i]}.log" || echo "== exit status $? for ${names[$i]}"
done
if [ "$mode" = curve ]; then
    echo "== train_loss_curve.py $*"
    timeout 540 python3 benchmarks/train_loss_curve.py --train benchmarks/data/shakespeare_train.npy \
        --eval benchmarks/data/shakespeare_eval.npy --out "$out" "$@" 2>&1 | grep -v "^WARNING" \
        | tee "$out/loss_curve.log" || echo "== exit status $? for the loss curves"
fi

#!/bin/bash
# Runs benchmarks/gpu_rwkv7.py on a GPU machine from the repository root, set up by
# benchmarks/gpu_env.sh (wheels, Triton cache). Arguments go to the script.
set -eo pipefail
out=${OUT:-/tmp/gpu_rwkv7}
source benchmarks/gpu_env.sh
python3 benchmarks/gpu_rwkv7.py --out "$out" "$@" 2>&1 | tee "$out/stdout.log"

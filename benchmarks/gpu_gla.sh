#!/bin/bash
# Runs benchmarks/gpu_gla.py on a GPU machine from the repository root, with the wheels of
# shared/tools/gpu-wheels.sh (jax-triton, fla-core) carried in .whl/. Arguments go to the script.
set -eo pipefail
out=${OUT:-/tmp/gpu_gla}
python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
# The package build maps triton_kernels/ to rwkv_jax.triton_kernels; from the source tree, link it.
[ -e rwkv_jax/triton_kernels ] || ln -s ../triton_kernels rwkv_jax/triton_kernels
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
python3 benchmarks/gpu_gla.py --out "$out" "$@" 2>&1 | tee "$out/stdout.log"

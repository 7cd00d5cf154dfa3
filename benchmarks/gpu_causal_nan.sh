#!/bin/bash
# benchmarks/gpu_causal_nan.py on a GPU machine, once per source tree, in one session (so that
# timings before and after a change come from the same GPU):
#
#   OUT=/tmp/nan bash benchmarks/gpu_causal_nan.sh [TREE ...] [-- SCRIPT ARGUMENTS]
#
# TREE: repository checkouts (default: this one), e.g. main's beside this branch's; each gets
# its CUDA extension built (build/gpu inside it) and the script run against it, logs in
# $OUT/<tree's folder name>/. Wheels from .whl/ (jax-triton).
set -eo pipefail
here=$PWD
out=${OUT:-/tmp/gpu_causal_nan}
trees=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$(cd "$1" && pwd)"); shift; done
[ "$1" = "--" ] && shift
[ ${#trees[@]} -eq 0 ] && trees=("$here")
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$here"/.whl/*.whl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
for tree in "${trees[@]}"; do
  (cd "$tree"
   [ -e rwkv_jax/triton_kernels ] || ln -s ../triton_kernels rwkv_jax/triton_kernels
   cmake -S ffi -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" \
     -DRWKV_JAX_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" > /tmp/causal_nan_build.log 2>&1
   ninja -C build/gpu >> /tmp/causal_nan_build.log 2>&1 || { tail -40 /tmp/causal_nan_build.log; exit 1; }
   cp build/gpu/_ffi_cpu*.so build/gpu/_ffi_cuda*.so rwkv_jax/)
  PYTHONPATH=/tmp/site:$tree PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache_$(basename "$tree") \
    python3 "$here/benchmarks/gpu_causal_nan.py" --out "$out/$(basename "$tree")" "$@" || echo "exit $? for $tree"
done

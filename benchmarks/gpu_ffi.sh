#!/bin/bash
# Builds the ffi backend's CUDA extension on a GPU machine and runs benchmarks/gpu_ffi.py from
# the repository root. Wheels: .whl/ (shared/tools/gpu-wheels.sh: fla-core, jax-triton) and
# .whl_ffi/ (einops, which fla imports). Arguments go to the script; CUDA_ARCH picks the
# architectures (default 90: the H100/H200); PREBUILT names a folder of extensions built for
# this machine's Python instead of building here.
set -eo pipefail
out=${OUT:-/tmp/gpu_ffi}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl_ffi/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton_cache
[ -e rwkv_jax/triton_kernels ] || ln -s ../triton_kernels rwkv_jax/triton_kernels
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
if [ -n "$PREBUILT" ]; then
  # Extensions built elsewhere for this Python (saves the build's minute of device time).
  cp "$PREBUILT"/_ffi_cpu*.so "$PREBUILT"/_ffi_cuda*.so rwkv_jax/
else
  start=$(date +%s)
  cmake -S ffi -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" \
    -DRWKV_JAX_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DCMAKE_CUDA_FLAGS="-Xptxas -v" > "$out/build.log" 2>&1
  ninja -C build/gpu >> "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  cp build/gpu/_ffi_cpu*.so build/gpu/_ffi_cuda*.so rwkv_jax/
fi
python3 benchmarks/gpu_ffi.py --out "$out" "$@" 2>&1 | tee "$out/stdout.log"

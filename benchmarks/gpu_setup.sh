# The one set-up of a GPU machine for the benchmarks, sourced from the repository root:
#   source benchmarks/gpu_setup.sh                        # wheels, import path, Triton cache
#   GPU_SETUP_FFI=1 source benchmarks/gpu_setup.sh        # also builds the ffi backend's extension
# - installs the wheels carried in .whl/ (BUILD.md, "The GPU suite": jax-triton, fla-core,
#   einops, rwkv) and .whl_ffi/ where there is one into /tmp/site, and puts /tmp/site and the
#   source tree on PYTHONPATH;
# - unpacks the Triton caches carried in .gpu-cache/*.tar.xz (compiles and autotuning results:
#   fla compiles and autotunes for minutes per op and head size on a fresh machine), and packs
#   the cache into $OUT/triton.tar.xz at exit, so that the next run can carry it (a returned
#   file may have 16 MiB: run one op's fla rows per call, `ops.py --ops rwkv7 --peers fla`, to
#   keep each pack under it);
# - links rwkv_jax/triton_kernels (the package build maps triton_kernels/ there);
# - with GPU_SETUP_FFI=1, builds the CUDA extension (CUDA_ARCH: the architectures, default 90,
#   the H100/H200; PREBUILT: a folder of extensions built for this Python instead) next to the
#   package;
# - prints the GPU's name, driver, memory and clock.
python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/*.whl \
    $(ls .whl_ffi/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# torch (the peers) and JAX share the GPU: JAX takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
for carried in ${TRITON_CACHE_TAR:-.gpu-cache/*.tar.xz}; do
    if [ -f "$carried" ]; then
        tar -xJf "$carried" -C "$TRITON_CACHE_DIR" && echo "Triton cache from $carried: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
    fi
done
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    trap 'tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 > "$OUT/triton.tar.xz"' EXIT
fi
[ -e rwkv_jax/triton_kernels ] || ln -s ../triton_kernels rwkv_jax/triton_kernels
if [ -n "${GPU_SETUP_FFI:-}" ]; then
    if [ -n "${PREBUILT:-}" ]; then
        cp "$PREBUILT"/_ffi_cpu*.so "$PREBUILT"/_ffi_cuda*.so rwkv_jax/
    else
        started=$(date +%s)
        { cmake -S ffi -B build/gpu -G Ninja -DPython_EXECUTABLE="$(command -v python3)" \
              -DRWKV_JAX_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" && ninja -C build/gpu; } \
            > /tmp/ffi_build.log 2>&1 \
            && cp build/gpu/_ffi_cpu*.so build/gpu/_ffi_cuda*.so rwkv_jax/ \
            && echo "ffi extension built in $(( $(date +%s) - started )) s" \
            || { tail -40 /tmp/ffi_build.log; echo "ffi extension: build FAILED (log above)"; }
    fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv

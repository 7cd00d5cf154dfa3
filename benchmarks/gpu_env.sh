# Sourced by the benchmarks/gpu_*.sh scripts on a GPU machine, from the repository root.
# Installs the wheels of shared/tools/gpu-wheels.sh (jax-triton, fla-core, einops) carried in
# .whl/, and makes the source tree importable as the package. fla compiles and autotunes its
# kernels for minutes on a fresh machine: a Triton cache (compiles and autotuning results)
# carried in .gpu-cache/*.tar.xz (e.g. benchmarks/gpu_fla_warm.sh's) is unpacked first, and the
# cache is packed into $OUT/triton.tar.xz at exit, so the next run can carry it.
python3 -m pip install -q --no-index --no-deps --target /tmp/site ${WHL:-.whl}/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache} TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
for carried in ${TRITON_CACHE_TAR:-.gpu-cache/*.tar.xz}; do
    if [ -f "$carried" ]; then
        tar -xJf "$carried" -C "$TRITON_CACHE_DIR" && echo "Triton cache from $carried: $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
    fi
done
if [ -n "$OUT" ]; then
    trap 'tar -cf - -C "$TRITON_CACHE_DIR" . | xz -T0 -6 > "$OUT/triton.tar.xz"' EXIT
fi
# The package build maps triton_kernels/ to rwkv_jax.triton_kernels; from the source tree, link it.
[ -e rwkv_jax/triton_kernels ] || ln -s ../triton_kernels rwkv_jax/triton_kernels
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv

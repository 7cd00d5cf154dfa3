#!/usr/bin/env bash
# The CUDA extension built with nothing but pip's CUDA wheels, on a GPU machine without internet:
# a fresh venv (over the image's site-packages, for jax and the build tools), the nvcc of the
# nvidia-cuda-nvcc wheel (the image's own if it has a whole set, else the wheels carried in
# .whl/), a failing stand-in for every other nvcc on PATH, then `pip install` of the package,
# `rwkv-jax info` and the ffi backend's GPU tests.
#
#   OUT=/some/dir bash benchmarks/gpu_pip_build.sh
#
# Wheels to carry where the image has none (BUILD.md, "CUDA kernels from pip's wheels alone"):
# nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-runtime, nvidia-cuda-crt, nvidia-cuda-cccl, at any
# depth under $CUDA_WHEELS (default .whl/; e.g. .whl/cuda-a/ and .whl/cuda-b/, carried by two
# calls and copied out of the tree by the first). Exit status: 0 only if the build used the
# wheel's nvcc and the GPU tests passed.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
VENV=${VENV:-/tmp/gpu-pip-venv}
CUDA_WHEELS=${CUDA_WHEELS:-.whl}  # where the carried nvidia-* wheels are (any depth)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_pip_build.log") 2>&1

# The pieces of a CUDA toolkit that nvcc needs, relative to the wheels' common root nvidia/cu13.
TOOLKIT_FILES="bin/nvcc bin/ptxas bin/nvlink bin/fatbinary nvvm/bin/cicc include/cuda_runtime.h
include/cuda_bf16.h include/crt/host_config.h lib/libcudart_static.a include/cccl/cuda/std/version"

toolkit_report() {  # toolkit_report PYTHON [check]: its nvidia-* wheels, what their root lacks
  "$1" - "$TOOLKIT_FILES" "${@:2}" <<'EOF'
import importlib.metadata as metadata, os, sys
wheels = sorted((d.metadata["Name"], d.version, str(d.locate_file("")))
                for d in metadata.distributions() if d.metadata["Name"].startswith("nvidia-"))
for name, version, where in wheels:
    print(f"  {name} {version} ({where})")
try:
    import nvidia.cu13
    roots = list(nvidia.cu13.__path__)
except ImportError:
    roots = []
print(f"  nvidia/cu13 roots: {roots or 'none'}")
for root in roots:
    missing = [f for f in sys.argv[1].split() if not os.path.exists(os.path.join(root, f))]
    print(f"  {root}: {'complete' if not missing else 'lacks ' + ', '.join(missing)}")
if len(sys.argv) > 2:  # "check": the tree of the nvidia-cuda-nvcc wheel must be complete
    try:
        nvcc = metadata.distribution("nvidia-cuda-nvcc")
    except metadata.PackageNotFoundError:
        sys.exit("FAILED: no nvidia-cuda-nvcc wheel: carry the wheels in .whl/ (BUILD.md)")
    root = os.path.join(str(nvcc.locate_file("")), "nvidia", "cu13")
    missing = [f for f in sys.argv[1].split() if not os.path.exists(os.path.join(root, f))]
    if missing:
        sys.exit(f"FAILED: the nvcc wheel's tree {root} lacks {', '.join(missing)}: carry "
                 "nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-runtime, nvidia-cuda-crt and "
                 "nvidia-cuda-cccl in .whl/ (BUILD.md)")
    print(f"  the build's nvcc: {root}/bin/nvcc ({nvcc.version})")
EOF
}

echo "== the image"
"$PY" --version
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
echo "nvcc on PATH: $(command -v nvcc || echo none)"
echo "the image's CUDA wheels:"
toolkit_report "$PY"
echo "carried wheels: $(find "$CUDA_WHEELS" -name 'nvidia_*.whl' 2>/dev/null | sort | tr '\n' ' ')"

echo "== a fresh venv over the image's site-packages ($VENV)"
rm -rf "$VENV"
"$PY" -m venv --system-site-packages "$VENV"
# Where the image's python3 is itself a venv's, --system-site-packages reaches only its base
# interpreter's: a .pth file adds the image's own site-packages (jax, the build tools).
"$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
  > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_image.pth"
. "$VENV/bin/activate"
mapfile -t carried < <(find "$CUDA_WHEELS" -name 'nvidia_*.whl' 2>/dev/null | sort)
if [ ${#carried[@]} -gt 0 ]; then
  # All into the venv (--ignore-installed), so that nvcc, cicc and the headers share one root.
  pip install -q --no-index --no-deps --ignore-installed "${carried[@]}" || exit 1
fi
echo "CUDA wheels seen in the venv:"
toolkit_report python check || exit 1

# No nvcc but the wheel's: the nvcc that PATH finds fails (the folders it shared with cmake, ninja
# or the host compiler stay on PATH), and no CUDACXX or CUDA_PATH.
stub=$(mktemp -d)
printf '#!/bin/sh\necho "a system nvcc was run: only the wheel'"'"'s may be" >&2\nexit 1\n' > "$stub/nvcc"
chmod +x "$stub/nvcc"
export PATH="$stub:$PATH"
unset CUDACXX CUDA_PATH CUDA_HOME
echo "nvcc on PATH now: $(command -v nvcc), which fails: $(nvcc --version 2>&1)"

echo "== pip install (no index, no isolation: the venv's nvcc wheel, the visible GPU's architecture)"
started=$SECONDS
pip install -v --no-index --no-deps --no-build-isolation -C build-dir=.build/gpu-pip/{wheel_tag} . \
  > "$OUT/gpu_pip_build.install.log" 2>&1 \
  || { tail -60 "$OUT/gpu_pip_build.install.log"; exit 1; }
echo "built and installed in $((SECONDS - started)) s"
grep 'rwkv_jax: ' "$OUT/gpu_pip_build.install.log"
grep -q 'rwkv_jax: CUDA compiler nvcc .*nvidia-cuda-nvcc' "$OUT/gpu_pip_build.install.log" \
  || { echo "FAILED: the CUDA extension was not built with the nvidia-cuda-nvcc wheel's nvcc"; exit 1; }

echo "== rwkv-jax info and the ffi GPU tests (the installed package, not the source folder)"
export PYTHONSAFEPATH=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python -c "import rwkv_jax, sys; print('rwkv_jax from', rwkv_jax.__file__); \
assert rwkv_jax.__file__.startswith(sys.prefix), 'not the installed package'" || exit 1
(cd /tmp && rwkv-jax info) || exit 1
python -m pytest -p no:cacheprovider -q tests/test_ffi.py -m gpu

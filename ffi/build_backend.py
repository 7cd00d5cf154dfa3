"""rwkv_jax's build backend: scikit-build-core's, plus the CUDA compiler's wheels among the build
requirements of a build that will compile the CUDA extension.

pip builds in an isolated environment that holds only the build requirements, so the nvcc that
ffi/CMakeLists.txt looks for first (the nvidia-cuda-nvcc wheel's, found through the build's
Python) must be asked for here, before the build starts. It is asked for when RWKV_JAX_CUDA is ON,
or AUTO (the default) on a machine with a visible NVIDIA GPU: the rule ffi/CMakeLists.txt applies
when it decides what to build. Not when CUDACXX or -C cmake.define.CMAKE_CUDA_COMPILER names a
compiler, and not for RWKV_JAX_CUDA=OFF.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from scikit_build_core import build as _scikit_build_core
from scikit_build_core.build import *  # noqa: F403 (every hook this module does not change)

# nvcc (with ptxas, nvlink, and through its own requirements cicc, the CUDA runtime headers and
# libraries, crt) and the CCCL headers that CUDA 13's runtime headers include.
CUDA_BUILD_REQUIREMENTS = ["nvidia-cuda-nvcc>=13,<14", "nvidia-cuda-cccl>=13,<14"]


def _define(name: str, config_settings: dict | None) -> str:
    """A CMake setting as ffi/CMakeLists.txt reads it: a -C cmake.define wins over the environment."""
    value = (config_settings or {}).get(f"cmake.define.{name}")
    return str(value if value is not None else os.environ.get(name, "")).strip()


def gpu_visible() -> bool:
    """What ffi/CMakeLists.txt calls a visible GPU: nvidia-smi lists one, or /dev/nvidia0 exists."""
    if os.path.exists("/dev/nvidia0"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def wants_cuda_compiler_wheels(config_settings: dict | None = None) -> bool:
    if os.environ.get("CUDACXX") or _define("CMAKE_CUDA_COMPILER", config_settings):
        return False
    mode = _define("RWKV_JAX_CUDA", config_settings).upper() or "AUTO"
    if mode in ("ON", "1", "Y", "YES", "TRUE"):
        return True
    return mode == "AUTO" and gpu_visible()


def _with_cuda_compiler(requirements: list[str], config_settings: dict | None) -> list[str]:
    if wants_cuda_compiler_wheels(config_settings):
        return [*requirements, *CUDA_BUILD_REQUIREMENTS]
    return requirements


def get_requires_for_build_wheel(config_settings=None):
    return _with_cuda_compiler(_scikit_build_core.get_requires_for_build_wheel(config_settings),
                               config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _with_cuda_compiler(_scikit_build_core.get_requires_for_build_editable(config_settings),
                               config_settings)

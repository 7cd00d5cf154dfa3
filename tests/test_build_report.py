"""The build's record of its CUDA extension (rwkv_jax.backends.ffi.cuda_build_report) and the build
backend's choice of the CUDA compiler's wheels (ffi/build_backend.py), without compiling."""

import importlib.util
import pathlib
import sys
import types

import pytest

from rwkv_jax.backends import ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _record(**fields):
    record = types.ModuleType("rwkv_jax._build_info")
    defaults = dict(CUDA_EXTENSION=False, CUDA_MODE="AUTO", CUDA_REASON="", CUDA_COMPILER="",
                    CUDA_COMPILER_ORIGIN="", CUDA_COMPILER_VERSION="", CUDA_ARCHITECTURES="")
    vars(record).update(defaults, **fields)
    return record


def test_report_of_this_installation_names_its_build():
    report = ffi.cuda_build_report()
    assert report.startswith(("built for sm", "not built: ", "unknown: ")), report
    if not report.startswith("built"):
        assert "RWKV_JAX_CUDA=ON pip install" in report


def test_report_without_cuda_says_why_and_the_command(monkeypatch):
    reason = "no NVIDIA GPU is visible (nvidia-smi lists none and /dev/nvidia0 does not exist)"
    monkeypatch.setitem(sys.modules, "rwkv_jax._build_info", _record(CUDA_REASON=reason))
    report = ffi.cuda_build_report()
    assert report.startswith(f"not built: {reason} (RWKV_JAX_CUDA=AUTO); to build them: "
                             f"RWKV_JAX_CUDA=ON pip install "), report
    assert report.endswith('[gpu]"'), report


def test_report_with_cuda_names_the_compiler(monkeypatch):
    monkeypatch.setitem(sys.modules, "rwkv_jax._build_info", _record(
        CUDA_EXTENSION=True, CUDA_MODE="ON", CUDA_REASON="RWKV_JAX_CUDA=ON (environment variable)",
        CUDA_COMPILER="/env/site-packages/nvidia/cu13/bin/nvcc", CUDA_COMPILER_VERSION="13.5.37",
        CUDA_COMPILER_ORIGIN="the nvidia-cuda-nvcc 13.5.37 wheel", CUDA_ARCHITECTURES="90"))
    report = ffi.cuda_build_report()
    assert report.startswith("built for sm 90 by nvcc 13.5.37 (/env/site-packages/nvidia/cu13/bin/"
                             "nvcc), the nvidia-cuda-nvcc 13.5.37 wheel; because RWKV_JAX_CUDA=ON "
                             "(environment variable)"), report
    if importlib.util.find_spec("rwkv_jax._ffi_cuda") is None:
        assert report.endswith("but rwkv_jax._ffi_cuda is missing from this installation"), report


@pytest.fixture
def build_backend(monkeypatch):
    """ffi/build_backend.py over a stand-in scikit-build-core (a build requirement, not a test one)."""
    stand_in = types.ModuleType("scikit_build_core.build")
    stand_in.__all__ = ["get_requires_for_build_wheel", "get_requires_for_build_editable"]
    stand_in.get_requires_for_build_wheel = lambda config_settings=None: ["ninja"]
    stand_in.get_requires_for_build_editable = lambda config_settings=None: ["ninja"]
    package = types.ModuleType("scikit_build_core")
    package.build = stand_in
    monkeypatch.setitem(sys.modules, "scikit_build_core", package)
    monkeypatch.setitem(sys.modules, "scikit_build_core.build", stand_in)
    spec = importlib.util.spec_from_file_location("build_backend", ROOT / "ffi" / "build_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("RWKV_JAX_CUDA", "CUDACXX", "CMAKE_CUDA_COMPILER"):
        monkeypatch.delenv(name, raising=False)
    return module


@pytest.mark.parametrize("mode, gpu, wanted", [
    ("ON", False, True), ("on", False, True), ("1", False, True), ("OFF", True, False),
    ("", True, True), ("", False, False), ("AUTO", True, True), ("AUTO", False, False)])
def test_backend_asks_for_nvcc_wheels_where_cuda_is_built(build_backend, monkeypatch, mode, gpu, wanted):
    monkeypatch.setattr(build_backend, "gpu_visible", lambda: gpu)
    if mode:
        monkeypatch.setenv("RWKV_JAX_CUDA", mode)
    expected = ["ninja", *build_backend.CUDA_BUILD_REQUIREMENTS] if wanted else ["ninja"]
    assert build_backend.get_requires_for_build_wheel() == expected
    assert build_backend.get_requires_for_build_editable() == expected


def test_backend_define_wins_and_a_named_compiler_needs_no_wheels(build_backend, monkeypatch):
    monkeypatch.setattr(build_backend, "gpu_visible", lambda: False)
    monkeypatch.setenv("RWKV_JAX_CUDA", "OFF")
    assert build_backend.wants_cuda_compiler_wheels({"cmake.define.RWKV_JAX_CUDA": "ON"})
    monkeypatch.setenv("RWKV_JAX_CUDA", "ON")
    assert not build_backend.wants_cuda_compiler_wheels({"cmake.define.RWKV_JAX_CUDA": "OFF"})
    assert not build_backend.wants_cuda_compiler_wheels({"cmake.define.CMAKE_CUDA_COMPILER": "/x/nvcc"})
    monkeypatch.setenv("CUDACXX", "/usr/local/cuda/bin/nvcc")
    assert not build_backend.wants_cuda_compiler_wheels()

"""The chunked RWKV-7 CUDA kernels' own source (ffi/cuda_rwkv7_chunk.cuh) compiled for the host
and run there (tests/cuda_emulation: a std::thread per CUDA thread, barriers for __syncthreads,
wmma on 16 x 16 tiles with bfloat16 operands), against the float64 reference: output, final
state and every gradient, initial state included, for every log decay in [-inf, 0], ragged last
chunks, packed sequences with empty segments, K = 64 and 128, float32 / bfloat16 / float16.

CI has no GPU: this checks the kernels' indexing, synchronisation and arithmetic wherever a C++
compiler is (the one that builds the CPU extension); the GPU run (benchmarks/gpu_rwkv7_cuda.py)
checks them on the hardware.
"""

import importlib.util
import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

import reference

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NAMES = "rwkvab"
TOLERANCE = {"f32": (1e-5, 1e-4), "bf16": (1e-2, 1e-2), "f16": (1e-2, 1e-2)}  # DESIGN.md
ROUND = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}


def compile_driver(tmp_path_factory, name):
    """tests/cuda_emulation/<name>.cc built with the host C++ compiler (jaxlib's headers for the
    XLA FFI types that ffi/common.h names)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    assert compiler, "no C++ compiler (the CPU extension's build needs one too)"
    include = os.path.join(os.path.dirname(importlib.util.find_spec("jaxlib").origin), "include")
    binary = str(tmp_path_factory.mktemp("cuda_emulation") / name)
    subprocess.run([compiler, "-std=c++20", "-O1", "-pthread",
                    f"-I{os.path.join(HERE, 'cuda_emulation')}", f"-I{os.path.join(ROOT, 'ffi')}",
                    "-isystem", include, os.path.join(HERE, "cuda_emulation", f"{name}.cc"),
                    "-o", binary], check=True)
    return binary


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_driver(tmp_path_factory, "rwkv7_chunk_driver")


@pytest.fixture(scope="module")
def sequential_driver(tmp_path_factory):
    return compile_driver(tmp_path_factory, "sequential_driver")


def rounder(dtype):
    """x rounded to the kernels' input type DTYPE, back in float64."""
    return lambda a: np.asarray(a).astype(np.float32).astype(ROUND[dtype]).astype(np.float64)


def write_files(workdir, files):
    for name, a in files.items():
        a = np.asarray(a)
        a.astype(np.int32 if a.dtype.kind == "i" else np.float32).tofile(os.path.join(workdir, name))


def read_file(workdir, name, like):
    return np.fromfile(os.path.join(workdir, name), np.float32).reshape(np.shape(like))


def assert_within_contract(results, dtype):
    """results: name -> (kernel's float32 result, float64 reference); "out" and "state" are held
    to the forward tolerance of DTYPE, everything else to the gradient one."""
    errors = {}
    for name, (got, want) in results.items():
        assert np.all(np.isfinite(got)), f"{name}: non-finite"
        errors[name] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    forward_tol, gradient_tol = TOLERANCE[dtype]
    failed = {n: e for n, e in errors.items()
              if e > (forward_tol if n in ("out", "state") else gradient_tol)}
    assert not failed, f"errors past the contract: {failed}"


def run_case(driver, workdir, key, dtype, batch, steps, decay, cu_seqlens=None, seed=0):
    rng = np.random.default_rng(seed)
    rows = batch if cu_seqlens is None else len(cu_seqlens) - 1
    x = reference.random_inputs("rwkv7", rng, batch=batch, steps=steps, heads=1, key=key,
                                decay=decay, state_rows=rows)
    rounded = rounder(dtype)
    x = {n: (a if n == "initial_state" else rounded(a)) for n, a in x.items()}
    options = {} if cu_seqlens is None else dict(cu_seqlens=np.asarray(cu_seqlens))
    out, state = reference.forward("rwkv7", x, **options)
    d_out = rounded(rng.standard_normal(out.shape))
    d_state = rng.standard_normal(state.shape)
    grads = reference.gradients("rwkv7", x, d_out, d_state, **options)
    cu = np.arange(batch + 1) * steps if cu_seqlens is None else np.asarray(cu_seqlens)
    write_files(workdir, {**{n: x[n] for n in NAMES}, "do": d_out, "h0": x["initial_state"],
                          "dh": d_state, "cu": cu})
    subprocess.run([driver, str(key), dtype, str(workdir), str(batch), str(steps), "1",
                    str(rows)], check=True)
    read = lambda name, like: read_file(workdir, name, like)
    results = {"out": (read("out_o", out), out), "state": (read("out_h", state), state),
               "dinitial_state": (read("out_dh0", state), grads["initial_state"])}
    results.update({f"d{n}": (read(f"out_d{n}", out if n == "v" else x[n]), grads[n]) for n in NAMES})
    assert_within_contract(results, dtype)


DECAYS = {"model": "model", "uniform_1000": ("uniform", -1e3), "tokens_1e9": ("tokens", -1e9),
          "tokens_inf": ("tokens", -np.inf), "every_third_1e9": ("every_third", -1e9),
          "zero": "zero"}


@pytest.mark.parametrize("decay", list(DECAYS))
def test_every_decay(driver, tmp_path, decay):
    run_case(driver, tmp_path, 64, "f32", batch=2, steps=37, decay=DECAYS[decay], seed=1)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_half_precision_inputs(driver, tmp_path, dtype):
    run_case(driver, tmp_path, 64, dtype, batch=1, steps=37, decay=DECAYS["tokens_inf"], seed=2)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_head_size_128(driver, tmp_path, dtype):
    run_case(driver, tmp_path, 128, dtype, batch=1, steps=21, decay=DECAYS["tokens_1e9"], seed=3)


@pytest.mark.parametrize("steps", [1, 16])
def test_one_token_and_one_whole_chunk(driver, tmp_path, steps):
    run_case(driver, tmp_path, 64, "f32", batch=2, steps=steps, decay="model", seed=4)


def test_packed_sequences(driver, tmp_path):
    run_case(driver, tmp_path, 64, "f32", batch=1, steps=50, decay=DECAYS["tokens_1e9"],
             cu_seqlens=[0, 0, 9, 9, 40, 50, 50], seed=5)

"""The CUDA kernels' own source compiled for the host and run there (tests/cuda_emulation: a
std::thread per CUDA thread, barriers for __syncthreads and warp shuffles, wmma on 16 x 16 tiles
with bfloat16 operands), with the real device helpers of ffi/cuda_device.cuh, against the float64
reference:

- the chunked RWKV-7 pair (ffi/cuda_rwkv7_chunk*.cuh): output, final state and every gradient,
  initial state included, for every log decay in [-inf, 0], ragged last chunks, packed sequences
  with empty segments, K = 64 and 128, float32 / bfloat16 / float16;
- the sequential RWKV-7 and RWKV-6 kernels (ffi/cuda_rwkv7.cuh, ffi/cuda_rwkv6.cuh): the same
  for the forward with checkpoints and the backward (u's gradient too), and the inference step
  on a state pool, invalid rows included.

CI has no GPU: this checks the kernels' indexing, synchronisation and arithmetic wherever a C++
compiler is (the one that builds the CPU extension); the GPU runs (tests/test_ffi.py on a GPU machine, benchmarks/ops.py)
check them on the hardware.
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
    """Each array as the drivers read it: int32 for integer arrays, else float32."""
    for name, a in files.items():
        a = np.asarray(a)
        a = a.astype(np.int32 if a.dtype.kind == "i" else np.float32)
        a.tofile(os.path.join(workdir, name))


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


@pytest.mark.parametrize("decay", ["model", "tokens_inf"])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_half_precision_inputs(driver, tmp_path, dtype, decay):
    """16-bit inputs take the tensor-core products of tame chunks (every chunk, at model
    decays) and the exact path where a chunk holds a -inf."""
    run_case(driver, tmp_path, 64, dtype, batch=1, steps=37, decay=DECAYS[decay], seed=2)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_head_size_128(driver, tmp_path, dtype):
    run_case(driver, tmp_path, 128, dtype, batch=1, steps=21, decay=DECAYS["tokens_1e9"], seed=3)


@pytest.mark.parametrize("steps", [1, 16])
def test_one_token_and_one_whole_chunk(driver, tmp_path, steps):
    run_case(driver, tmp_path, 64, "f32", batch=2, steps=steps, decay="model", seed=4)


def test_packed_sequences(driver, tmp_path):
    run_case(driver, tmp_path, 64, "f32", batch=1, steps=50, decay=DECAYS["tokens_1e9"],
             cu_seqlens=[0, 0, 9, 9, 40, 50, 50], seed=5)


# The sequential RWKV-7 / RWKV-6 kernels (ffi/cuda_rwkv7.cuh, ffi/cuda_rwkv6.cuh): one block per
# (head, sequence), a thread per value column, so V (a multiple of 32) sets the block's warps.
# Every warp shuffle of the backward's reductions is two host barriers, so the shapes stay small:
# one warp (V = 32) where the case is about the math, more where it is about the reductions.
SEQUENTIAL_INPUTS = {"rwkv7": "rwkvab", "rwkv6": "rkvw"}
SCALE = 0.5  # not 1, so that a misplaced scale shows


def sequential_inputs(op, dtype, rng, **sizes):
    """reference.random_inputs of op, token inputs rounded to DTYPE and the float32 operands
    (state, u) to float32, as the kernels see them."""
    x = reference.random_inputs(op, rng, **sizes)
    rounded, as_f32 = rounder(dtype), rounder("f32")
    return {n: (rounded(a) if n in SEQUENTIAL_INPUTS[op.removesuffix("_step")] else as_f32(a))
            for n, a in x.items()}


def run_sequential(driver, workdir, op, dtype, batch, steps, decay, key=64, value=32, heads=1,
                   cu_seqlens=None, seed=0):
    """Forward with checkpoints and backward of `op` (train mode) against the float64 reference:
    output, final state and the gradient of every input, initial state (and u) included."""
    rng = np.random.default_rng(seed)
    rows = batch if cu_seqlens is None else len(cu_seqlens) - 1
    x = sequential_inputs(op, dtype, rng, batch=batch, steps=steps, heads=heads, key=key,
                          value=value, decay=decay, state_rows=rows)
    options = dict(scale=SCALE)
    if cu_seqlens is not None:
        options["cu_seqlens"] = np.asarray(cu_seqlens)
    out, state = reference.forward(op, x, **options)
    d_out = rounder(dtype)(rng.standard_normal(out.shape))
    d_state = rng.standard_normal(state.shape)
    grads = reference.gradients(op, x, d_out, d_state, **options)
    names = SEQUENTIAL_INPUTS[op]
    cu = np.arange(batch + 1) * steps if cu_seqlens is None else np.asarray(cu_seqlens)
    write_files(workdir, {**{n: x[n] for n in names}, "do": d_out, "h0": x["initial_state"],
                          "dh": d_state, "cu": cu, **({"u": x["u"]} if "u" in x else {})})
    subprocess.run([driver, op, "train", str(key), str(value), dtype, str(workdir), str(batch),
                    str(steps), str(heads), str(rows), str(SCALE)], check=True)
    read = lambda name, like: read_file(workdir, name, like)
    results = {"out": (read("out_o", out), out), "state": (read("out_h", state), state),
               "dinitial_state": (read("out_dh0", state), grads["initial_state"])}
    results.update({f"d{n}": (read(f"out_d{n}", x[n]), grads[n]) for n in names})
    if op == "rwkv6":  # the kernel's du is per sequence
        results["du"] = (read("out_du", state[..., 0]).sum(0), grads["u"])
    assert_within_contract(results, dtype)


def run_step(driver, workdir, op, dtype, steps, state_indices, pool_rows, decay, seed=0):
    """The inference step of `op` on a pool of `pool_rows` rows at `state_indices` (one per batch
    row; one outside the pool is an invalid row: NaN outputs, the pool untouched)."""
    rng = np.random.default_rng(seed)
    batch, key, value, heads = len(state_indices), 64, 64, 1
    x = sequential_inputs(f"{op}_step", dtype, rng, batch=batch, steps=steps, heads=heads,
                          key=key, value=value, decay=decay, state_rows=pool_rows)
    indices = np.asarray(state_indices)
    valid = (indices >= 0) & (indices < pool_rows)
    names = SEQUENTIAL_INPUTS[op]
    on_valid = {n: (a[valid] if n in names else a) for n, a in x.items()}
    out, pool = reference.forward(f"{op}_step", on_valid, scale=SCALE,
                                  state_indices=indices[valid])
    write_files(workdir, {**{n: x[n] for n in names}, "pool": x["state"], "rows": indices,
                          **({"u": x["u"]} if "u" in x else {})})
    subprocess.run([driver, op, "step", str(key), str(value), dtype, str(workdir), str(batch),
                    str(steps), str(heads), str(pool_rows), str(SCALE)], check=True)
    got_out = read_file(workdir, "out_o", x["v"])
    got_pool = read_file(workdir, "out_pool", x["state"])
    assert np.all(np.isnan(got_out[~valid])), "an invalid row's outputs are not NaN"
    untouched = np.setdiff1d(np.arange(pool_rows), indices[valid])
    np.testing.assert_array_equal(got_pool[untouched], x["state"][untouched])
    assert_within_contract({"out": (got_out[valid], out), "state": (got_pool, pool)}, dtype)


@pytest.mark.parametrize("op", list(SEQUENTIAL_INPUTS))
@pytest.mark.parametrize("decay", list(DECAYS))
def test_sequential_every_decay(sequential_driver, tmp_path, op, decay):
    run_sequential(sequential_driver, tmp_path, op, "f32", batch=1, steps=23,
                   decay=DECAYS[decay], seed=11)


@pytest.mark.parametrize("op", list(SEQUENTIAL_INPUTS))
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_sequential_half_precision_inputs(sequential_driver, tmp_path, op, dtype):
    run_sequential(sequential_driver, tmp_path, op, dtype, batch=1, steps=23,
                   decay=DECAYS["tokens_inf"], seed=12)


@pytest.mark.parametrize("op", list(SEQUENTIAL_INPUTS))
@pytest.mark.parametrize("steps", [1, 16])
def test_sequential_one_token_and_one_whole_chunk(sequential_driver, tmp_path, op, steps):
    run_sequential(sequential_driver, tmp_path, op, "f32", batch=2, steps=steps, decay="model",
                   seed=13)


@pytest.mark.parametrize("op", list(SEQUENTIAL_INPUTS))
def test_sequential_packed_sequences(sequential_driver, tmp_path, op):
    """Empty segments first, in the middle and last, one of 22 tokens (two checkpoints); two heads
    (u is per head); V = 64, two warps in the key-side reductions."""
    run_sequential(sequential_driver, tmp_path, op, "f32", batch=1, steps=31,
                   decay=DECAYS["tokens_1e9"], value=64, heads=2,
                   cu_seqlens=[0, 0, 9, 9, 31, 31], seed=14)


@pytest.mark.parametrize("op", list(SEQUENTIAL_INPUTS))
def test_sequential_head_size_128(sequential_driver, tmp_path, op):
    run_sequential(sequential_driver, tmp_path, op, "bf16", batch=1, steps=21, key=128,
                   value=32, decay=DECAYS["every_third_1e9"], seed=15)


@pytest.mark.parametrize("op", list(SEQUENTIAL_INPUTS))
@pytest.mark.parametrize("steps", [1, 4])
def test_sequential_step_on_a_pool(sequential_driver, tmp_path, op, steps):
    """Rows 3 and 0 of a 4-row pool (1 and 2 untouched), and two invalid rows (4 and -1); V = 64,
    two warps."""
    run_step(sequential_driver, tmp_path, op, "f32", steps, [3, 4, -1, 0], pool_rows=4,
             decay=DECAYS["tokens_inf"], seed=16)

"""The ``rwkv-jax`` command: info, check (passing, and failing on a broken backend), bench, and
docs/cli.md naming every flag."""

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rwkv_jax import _bench, backends, cli
from rwkv_jax.backends import native

TINY = "1,12,2,16"


@pytest.fixture
def fake_backend(monkeypatch):
    """Register a backend module made in the test; the registry is restored afterwards."""
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))

    def add(name, reason=None, **functions):
        module = types.ModuleType(f"rwkv_jax_test_{name}")
        module.__dict__.update(functions)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        backends.register(name, module.__name__, f"test backend {name}", lambda platform: reason)

    yield add
    backends.unavailable_reason.cache_clear()


def test_info_lists_versions_backends_and_defaults(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "jax " in out and "numpy " in out and "platform: cpu" in out
    for row in backends.describe():
        assert row["name"] in out
    for op in backends.OPS:
        assert op in out
    assert "native" in out


def test_info_says_why_a_backend_is_unavailable(fake_backend, capsys):
    fake_backend("elsewhere", reason="needs an NVIDIA GPU")
    assert cli.main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("elsewhere"))
    assert " no " in line and "needs an NVIDIA GPU" in line


def test_module_entry_point_runs():
    done = subprocess.run([sys.executable, "-m", "rwkv_jax", "info"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "native" in done.stdout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_passes_on_native(dtype, capsys):
    ops = ",".join(backends.OPS) if dtype == "float32" else "rwkv7,rwkv4"
    assert cli.main(["check", "--quick", "--backend", "native", "--dtype", dtype, "--op", ops]) == 0
    out = capsys.readouterr().out
    results = [line.split()[-1] for line in out.splitlines() if line.split()[:1] in ([o] for o in ops.split(","))]
    assert results == ["pass"] * len(ops.split(","))
    assert f"{len(ops.split(','))} passed, 0 failed" in out


def _native_rwkv7_times(factor):
    def rwkv7(**kwargs):
        o, h = native.rwkv7(**kwargs)
        return o * factor, h
    return rwkv7


def _raises(**kwargs):
    raise ValueError("this backend is broken on purpose")


def _drops_last_step(**kwargs):
    o, h = native.rwkv7(**kwargs)
    return o[:, :-1], h


@pytest.mark.parametrize("rwkv7, verdict", [
    (_native_rwkv7_times(1.01), "FAIL"),  # 1e-2 off: above any float32 bound
    (_native_rwkv7_times(float("nan")), "non-finite"),
    (_raises, "broken on purpose"),
    (_drops_last_step, "ERROR"),
])
def test_check_fails_on_a_broken_backend(fake_backend, capsys, rwkv7, verdict):
    fake_backend("broken", rwkv7=rwkv7)
    status = cli.main(["check", "--quick", "--backend", "broken", "--op", "rwkv7", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert status == 1
    assert verdict in out and "0 passed, 1 failed" in out


def test_check_runs_every_available_backend_by_default(fake_backend):
    fake_backend("extra", rwkv7=native.rwkv7)
    fake_backend("elsewhere", reason="needs an NVIDIA GPU", rwkv7=native.rwkv7)
    args = cli.build_parser().parse_args(["check"])
    chosen = cli._select.selected_backends(args, "rwkv7")
    assert "native" in chosen and "extra" in chosen and "elsewhere" not in chosen
    assert "extra" not in cli._select.selected_backends(args, "rwkv4")  # it lacks that op


def test_check_refuses_an_unavailable_backend(fake_backend, capsys):
    fake_backend("elsewhere", reason="needs an NVIDIA GPU", rwkv7=native.rwkv7)
    assert cli.main(["check", "--backend", "elsewhere"]) == 1
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_check_runs_every_size_given(capsys):
    """--size repeats in check as in bench: each size is checked, in a table of its own."""
    status = cli.main(["check", "--size", TINY, "--size", "1,5,1,16", "--op", "rwkv4",
                       "--backend", "native", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert status == 0
    titles = [line for line in out.splitlines() if line.startswith("check: ")]
    assert [title.split("B,T,H,K = ")[1].split()[0] for title in titles] == [TINY, "1,5,1,16"]
    assert out.count("1 passed, 0 failed") == 2
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("rwkv4 ")] == [
        "pass", "pass"]


def test_bench_quick_timing_yields_to_the_flags(monkeypatch):
    """--quick's repeats and time per case are defaults: --repeats and --max-seconds win."""
    calls = []
    monkeypatch.setattr(cli.bench, "run_bench",
                        lambda *args, **kwargs: calls.append(kwargs) or [])
    command = ["bench", "--quick", "--op", "rwkv4", "--backend", "native"]
    assert cli.main(command) == 0
    assert cli.main([*command, "--repeats", "7", "--max-seconds", "0.5", "--warmup", "0"]) == 0
    assert [(c["repeats"], c["max_seconds"], c["warmup"]) for c in calls] == [(5, 3.0, 2),
                                                                                (7, 0.5, 0)]


def test_bench_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    # --plot without an extension: OUT.png, and the message names it.
    status = cli.main(["bench", "--size", TINY, "--op", "rwkv7,rwkv4,rwkv7_step", "--backend",
                       "native", "--repeats", "3", "--warmup", "1", "--json", str(out_json),
                       "--plot", str(tmp_path / "bench")])
    assert status == 0
    report = json.loads(out_json.read_text())
    assert report["info"]["platform"] == "cpu"
    results = report["results"]
    assert {(r["op"], r["pass"]) for r in results} == {
        (op, p) for op in ("rwkv7", "rwkv4", "rwkv7_step") for p in ("fwd", "fwd+bwd")}
    for r in results:
        assert r["backend"] == "native" and r["dtype"] == "float32" and r["repeats"] == 3
        assert 0 < r["min_ms"] <= r["median_ms"] and math.isfinite(r["median_ms"])
        assert r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
        assert r["T"] == (1 if r["op"] == "rwkv7_step" else 12)
    backward = {r["op"]: r["peak_bytes"] for r in results if r["pass"] == "fwd+bwd"}
    forward = {r["op"]: r["peak_bytes"] for r in results if r["pass"] == "fwd"}
    assert all(backward[op] > forward[op] for op in forward)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.png"]
    out = capsys.readouterr().out
    assert "tokens/s" in out and f"wrote {out_png}\n" in out


def test_interrupted_bench_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM, which the bench turns into the same) during the second case: the
    first case's rows are still printed, written and plotted, and the exit status is 130."""
    calls = []

    def bench_case(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_bench_case(*args, **kwargs)

    real_bench_case = cli.bench.bench_case
    monkeypatch.setattr(cli.bench, "bench_case", bench_case)
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["bench", "--size", TINY, "--op", "rwkv7,rwkv4", "--backend", "native",
                  "--repeats", "3", "--warmup", "1", "--json", str(out_json),
                  "--plot", str(out_png)])
    assert stopped.value.code == 130
    results = json.loads(out_json.read_text())["results"]
    assert {(r["op"], r["pass"]) for r in results} == {("rwkv7", "fwd"), ("rwkv7", "fwd+bwd")}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "interrupted after 1 of 2 cases" in out and "rwkv7" in out


def test_sigterm_stops_the_bench_like_ctrl_c(tmp_path):
    """A real SIGTERM (what `timeout` sends) to a running `rwkv-jax bench`."""
    out_json = tmp_path / "bench.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "rwkv_jax", "bench", "--size", TINY, "--op", "rwkv7",
         "--backend", "native", "--repeats", "100000", "--max-seconds", "300",
         "--json", str(out_json)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = b""
    while b"rwkv7 native" not in output:  # the progress bar names the case being timed
        chunk = os.read(process.stdout.fileno(), 4096)
        assert chunk, output.decode()
        output += chunk
    process.terminate()
    output = (output + process.communicate(timeout=120)[0]).decode()
    assert process.returncode == 130, output
    assert "interrupted after 0 of 1 cases" in output, output
    assert json.loads(out_json.read_text())["results"] == []


def test_bench_generation_row_on_request(tmp_path, capsys):
    """--op generate on a CPU: the Generator's decode speed on the tiny random model, one row
    per lane count, in the table and the JSON; plots and the verdict leave it out."""
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    status = cli.main(["bench", "--op", "generate,rwkv7_step", "--size", TINY, "--backend",
                       "native", "--repeats", "3", "--json", str(out_json),
                       "--plot", str(out_png)])
    assert status == 0
    model, vocab, new_tokens, lane_counts = cli.bench.GENERATE_SIZES["cpu"]
    rows = [r for r in json.loads(out_json.read_text())["results"] if r["op"] == "generate"]
    assert [r["B"] for r in rows] == list(lane_counts)
    for r in rows:
        assert (r["backend"], r["dtype"], r["pass"], r["model"]) == (
            "native", "bfloat16", "decode", model)
        assert (r["T"], r["vocab"], r["n_layer"], r["H"], r["K"]) == (new_tokens, vocab, 2, 2, 64)
        assert r["tokens_per_s"] > 0 and 0 < r["min_ms"] <= r["median_ms"]
        assert r["repeats"] == 3 and r["generated"] == r["B"] * new_tokens
        # ms per step and tokens/s describe the same decode time.
        assert math.isclose(r["tokens_per_s"] * r["median_ms"] / 1e3, r["B"], rel_tol=1e-6)
    out = capsys.readouterr().out
    table = [line.split() for line in out.splitlines() if line.startswith("generate ")]
    assert [(line[1], line[3], line[4]) for line in table] == [
        ("native", f"{b},{new_tokens},2,64", "decode") for b in lane_counts]
    assert "generate: rwkv_jax.nn.Generator on a random RWKV7LM tiny" in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    check = [dict(op="rwkv7_step", backend="native", dtype="float32", ok=True)]
    results = json.loads(out_json.read_text())["results"]
    assert [r["op"] for r in cli._print.fastest(results)] == ["rwkv7_step"]
    assert cli._print.verdict(check, results)[0] == 0


def test_generation_row_runs_by_default_on_a_gpu_only(monkeypatch):
    parser = cli.build_parser()
    assert "generate" not in cli._select.selected_ops(parser.parse_args(["bench"]))  # a CPU here
    named = parser.parse_args(["bench", "--op", "generate"])
    assert cli._select.selected_ops(named) == ["generate"]
    monkeypatch.setattr(backends, "platform", lambda: "gpu")
    assert cli._select.selected_ops(parser.parse_args(["bench"]))[-1] == "generate"
    assert "generate" not in cli._select.selected_ops(parser.parse_args(["check"]))
    monkeypatch.setattr(cli._select, "flax_missing", lambda: "the generation row needs flax")
    assert "generate" not in cli._select.selected_ops(parser.parse_args(["bench"]))


def test_generation_row_without_flax_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cli.bench, "run_bench", _no_work)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flax" else find_spec(name, *a))
    assert cli.main(["bench", "--op", "generate"]) == 1
    assert "the generation row needs flax" in capsys.readouterr().err


def test_bench_times_performance_paths_only_unless_named():
    parser = cli.build_parser()
    default = parser.parse_args(["bench"])
    assert "triton" not in cli._select.selected_backends(default, "rwkv7", timing=True)  # a CPU
    assert "native" in cli._select.selected_backends(default, "rwkv7", timing=True)
    assert "triton" in cli._select.selected_backends(default, "rwkv7")  # check still runs it
    named = parser.parse_args(["bench", "--backend", "triton"])
    assert cli._select.selected_backends(named, "rwkv7", timing=True) == ["triton"]


def test_bench_runs_step_ops_once_at_their_decoding_size():
    jobs = cli.bench.bench_jobs(["rwkv4", "rwkv7_step"], lambda op: ["native"],
                                [(1, 64, 2, 16), (1, 128, 2, 16)], ["float32"])
    assert jobs == [("rwkv4", "native", (1, 64, 2, 16), "float32"),
                    ("rwkv7_step", "native", (1, 1, 2, 16), "float32"),
                    ("rwkv4", "native", (1, 128, 2, 16), "float32")]


def _timing_rows(op, backend, ms, lengths=(64, 256)):
    return [dict(op=op, backend=backend, dtype="float32", B=1, T=1 if op in _bench.STEP_OPS else t,
                 H=2, K=16, **{"pass": p},
                 median_ms=ms * (t / lengths[0]) * (2 if p == "fwd+bwd" else 1),
                 bytes_moved=4096 * t, tokens_per_s=1.0, peak_bytes=1, repeats=3)
            for t in lengths for p in ("fwd", "fwd+bwd")]


def test_plots_render_every_panel(tmp_path):
    results = (_timing_rows("rwkv7", "native", 2.0) + _timing_rows("rwkv7", "ffi", 0.5)
               + _timing_rows("rwkv7", "fla", 0.4) + _timing_rows("rwkv7_step", "ffi", 0.1, (1,))
               + [dict(op="rwkv7", backend="chunked", dtype="float32", B=1, T=64, H=2, K=16,
                       **{"pass": "fwd"}, error="ValueError: refused")])
    times, bandwidth = tmp_path / "t.png", tmp_path / "t_bandwidth.png"
    cli._plot.plot_bench(results, str(times), device="cpu")
    cli._plot.plot_bandwidth(results, str(bandwidth), device="NVIDIA H100 80GB HBM3",
                             peak=_bench.peak_bandwidth("NVIDIA H100 80GB HBM3"))
    for path in (times, bandwidth):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _bench.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert _bench.peak_bandwidth("NVIDIA H200") == 4.8e12 and _bench.peak_bandwidth("cpu") is None
    assert cli._plot.bandwidth_path("out/bench.png") == "out/bench_bandwidth.png"


def test_verdict_line_and_exit_status():
    check = [dict(op="rwkv7", backend=b, dtype="float32", ok=True) for b in ("native", "ffi")]
    bench = _timing_rows("rwkv7", "native", 2.0) + _timing_rows("rwkv7", "ffi", 0.5) \
        + _timing_rows("rwkv7", "fla", 0.1) + _timing_rows("rwkv7_step", "native", 0.1, (1,))
    status, line = cli._print.verdict(check, bench)
    # The fastest of ours at the largest size (fla is beside, not among, the candidates).
    assert status == 0 and line.startswith("all 2 checks passed; fastest here")
    assert "rwkv7 ffi 4 ms" in line and "rwkv7_step native 0.1 ms per step" in line
    assert "forward+backward at B,T,H,K=1,256,2,16; steps: forward, one token" in line
    status, line = cli._print.verdict([dict(check[0], ok=False)] + check[1:], None)
    assert status == 1 and line.startswith("FAILED: 1 of 2 checks failed (rwkv7 native float32)")
    status, line = cli._print.verdict(check, bench + [dict(bench[0], error="boom")])
    assert status == 1 and "FAILED: 1 benchmark cases errored" in line
    assert cli._print.verdict(None, None)[0] == 1


def test_main_job_ends_with_the_verdict(monkeypatch, capsys):
    ok = [dict(op="rwkv4", backend="native", dtype="float32", ok=True)]
    monkeypatch.setattr(cli.check, "check_rows", lambda args: ok)
    monkeypatch.setattr(cli.bench, "bench_results",
                        lambda args: _timing_rows("rwkv4", "native", 1.0))
    assert cli.main([]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("all 1 checks passed")
    monkeypatch.setattr(cli.check, "check_rows", lambda args: [dict(ok[0], ok=False)])
    assert cli.main([]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("FAILED: 1 of 1 checks")


def test_fla_is_optional_here(capsys):
    assert _bench.fla_unavailable_reason() is not None  # no CUDA device on the CPU machine
    # A failing fla call is reported in fla's rows and never fails our benchmark.
    rows = cli.bench.bench_fla(_bench.make_case("rwkv7", 1, 8, 1, 16), "float32", repeats=1,
                               max_seconds=1.0)
    assert [r["pass"] for r in rows] == ["fwd", "fwd+bwd"]
    assert all(r["backend"] == "fla" and r["fla_error"] for r in rows)
    cli.bench.print_bench(rows)
    assert "ERROR" in capsys.readouterr().out
    ok = [dict(op="rwkv7", backend="native", dtype="float32", ok=True)]
    assert cli._print.verdict(ok, _timing_rows("rwkv7", "native", 1.0) + rows)[0] == 0


def test_bench_plot_without_matplotlib_names_it(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert cli.main(["bench", "--size", TINY, "--plot", "out.png"]) == 2
    assert "matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "--size", "1,2,3"], "four positive integers"),
    (["bench", "--size", "1,0,2,16"], "four positive integers"),
    (["check", "--op", "rwkv5"], "unknown name rwkv5"),
    (["check", "--op", "generate"], "unknown name generate"),
    (["check", "--backend", "nope"], "unknown name nope"),
    (["bench", "--dtype", "int8"], "unknown name int8"),
    (["bench", "--repeats", "0"], r"--repeats: needs an integer >= 1, got '0'"),
    (["bench", "--repeats", "-3"], r"--repeats: needs an integer >= 1"),
    (["bench", "--warmup", "-1"], r"--warmup: needs an integer >= 0"),
    (["bench", "--max-seconds", "0"], r"--max-seconds: needs a number of seconds > 0"),
    (["bench", "--max-seconds", "nan"], r"--max-seconds: needs a number of seconds > 0"),
    (["bench", "--json", "/nonexistent-dir/out.json"], r"--json: .*does not exist"),
    (["bench", "--plot", "/nonexistent-dir/out.png"], r"--plot: .*does not exist"),
    (["bench", "--json", "."], r"--json: '\.' is a directory"),
    (["check", "--seed", "-1", "--quick", "--op", "rwkv4"], r"--seed: needs an integer >= 0, "
                                                            r"got '-1'"),
    (["check", "--seed", "0.5"], r"--seed: needs an integer >= 0"),
])
def test_bad_command_lines_exit_2_before_any_work(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(cli.bench, "run_bench", _no_work)
    monkeypatch.setattr(cli.check, "run_check", _no_work)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "rwkv-jax" in err and re.search(message, err), err


def _no_work(*args, **kwargs):
    raise AssertionError("work started before the command line was checked")


def test_an_unwritable_output_path_fails_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli.bench, "run_bench", _no_work)
    a_file = tmp_path / "results.txt"
    a_file.write_text("")
    unwritable = [(a_file / "out.json", "is not a directory")]
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root may write anywhere
        unwritable.append((locked / "out.json", "is not writable"))
    for path, message in unwritable:
        for option in ("--json", "--plot"):
            with pytest.raises(SystemExit) as exit_info:
                cli.main(["bench", "--size", TINY, option, str(path)])
            assert exit_info.value.code == 2
            assert message in capsys.readouterr().err


def test_a_plot_format_matplotlib_lacks_fails_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli.bench, "run_bench", _no_work)
    assert cli.main(["bench", "--size", TINY, "--plot", str(tmp_path / "out.xyz")]) == 2
    assert "matplotlib writes no '.xyz' files" in capsys.readouterr().err


def test_an_op_the_named_backend_lacks_is_named(fake_backend, monkeypatch, capsys):
    monkeypatch.setattr(cli.check, "run_check", _no_work)
    monkeypatch.setattr(cli.bench, "run_bench", _no_work)
    fake_backend("partial", rwkv7=native.rwkv7)
    assert cli.main(["check", "--backend", "partial", "--op", "rwkv4"]) == 1
    err = capsys.readouterr().err
    assert "backend 'partial' does not implement rwkv4; backends that do here: " in err, err
    assert "native" in err.split("backends that do here: ")[1]
    assert cli.main(["bench", "--backend", "partial", "--op", "rwkv7,rwkv4",
                     "--size", TINY]) == 1
    assert "backend 'partial' does not implement rwkv4" in capsys.readouterr().err


def test_progress_is_plain_lines_when_not_a_terminal():
    """Piped (CI, a log file): one line per case on stderr, no bar frames, nothing glued to the
    table."""
    done = subprocess.run(
        [sys.executable, "-m", "rwkv_jax", "bench", "--size", TINY, "--op", "rwkv7,rwkv4",
         "--backend", "native", "--repeats", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "\x1b" not in done.stderr
    progress = [line for line in done.stderr.splitlines() if line.startswith("bench ")]
    assert progress == ["bench 1/2: rwkv7 native 1,12,2,16 float32",
                        "bench 2/2: rwkv4 native 1,12,2,16 float32"], done.stderr
    title, header = done.stdout.splitlines()[:2]
    assert title.startswith("bench: median wall time") and header.split()[:3] == [
        "op", "backend", "dtype"], done.stdout


@pytest.mark.parametrize("op", backends.OPS)
def test_random_inputs_are_realistic_and_never_zero(op):
    case = _bench.make_case(op, 2, 9, 3, 16, seed=5)
    for name, x in case.arrays.items():
        assert x.dtype == np.float32 and np.all(np.isfinite(x)) and np.all(x != 0), name
    arrays = case.arrays
    if op.startswith("rwkv7"):
        assert np.all((arrays["w"] >= -np.exp(-0.5)) & (arrays["w"] < 0))
        kk = -arrays["a"]
        np.testing.assert_allclose(np.linalg.norm(kk, axis=-1), 1.0, rtol=1e-5)
        iclr = arrays["b"] / kk
        assert np.all((iclr > 0) & (iclr < 1))
    if op in ("rwkv6", "rwkv6_step", "rwkv4"):
        assert np.all(arrays["w"] < 0)
    if op in _bench.STEP_OPS:
        indices = case.options["state_indices"]
        assert len(set(indices.tolist())) == 2 and arrays["state"].shape[0] == 3
    bf16 = case.as_dtype(jnp.bfloat16)
    state = "state" if op in _bench.STEP_OPS else "initial_state"
    assert bf16[state].dtype == np.float32
    assert all(x.dtype == jnp.bfloat16 for n, x in bf16.items() if n != state)


def test_every_command_and_flag_is_documented():
    """docs/cli.md names every command and every flag of each (the --help texts say the same
    in short)."""
    page = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == {"info", "check", "bench", "train"}
    for name, command in commands.choices.items():
        assert f"## `rwkv-jax {name}`" in page, name
        flags = [flag for action in command._actions for flag in action.option_strings
                 if flag not in ("-h", "--help")]
        missing = [flag for flag in flags if not re.search(f"`{re.escape(flag)}[ `]", page)]
        assert not missing, (name, missing)
        assert all(action.help for action in command._actions), name

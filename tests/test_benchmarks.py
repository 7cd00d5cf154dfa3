"""The benchmark topics (benchmarks/ops.py, decode.py, multi_device.py, train_throughput.py)
run end to end at their smallest CPU configuration, each in its own process as on a GPU
machine, so that the harness
cannot rot: flags parse, every row is measured or reported absent, rows reach the JSON file.
Nothing here needs a GPU (the peers are absent on a CPU and must be reported so)."""

import json
import os
import subprocess
import sys

import pytest

from scripts import ROOT


def run_topic(script, *args, tmp_path):
    rows_file = tmp_path / f"{script}.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args,
                           "--json", str(rows_file)],
                          capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert rows, done.stdout
    for row in rows:
        assert row["date"] and row["jax"] and script in row["command"]
    return rows, done.stdout


@pytest.mark.parametrize("script", ["ops.py", "decode.py", "multi_device.py",
                                    "train_throughput.py"])
def test_help(script):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr
    assert "--json" in done.stdout


def test_ops_rows_with_errors_and_absent_peer(tmp_path):
    rows, _ = run_topic("ops.py", "--quick", "--ops", "rwkv7,rwkv4", "--backends",
                        "native,triton", "--peers", "fla", "--passes", "fwd+bwd",
                        tmp_path=tmp_path)
    by_name = {(r["op"], r["name"]): r for r in rows}
    native = by_name[("rwkv7", "native")]
    assert native["median_ms"] > 0 and native["peak_bytes"] > 0 and native["shape"] == [2, 64, 2, 16]
    # float32 native against the float64 native: rounding only
    assert native["errors"]["out"] < 1e-5 and native["errors"]["worst_grad"] < 1e-5
    assert by_name[("rwkv4", "native")]["errors"]["state"] < 1e-5
    assert "does not implement rwkv4" in by_name[("rwkv4", "triton")]["absent"]
    assert by_name[("rwkv7", "fla")]["absent"]  # not installed here: a row, not a crash


def test_ops_packed_sequences(tmp_path):
    rows, _ = run_topic("ops.py", "--quick", "--ops", "gla", "--shapes", "1,48,2,16", "--packed",
                        "3", "--backends", "native", "--peers", "none", "--passes", "fwd+bwd",
                        tmp_path=tmp_path)
    (row,) = rows
    assert row["packed"] == 3 and row["errors"]["state"] < 1e-5 and row["errors"]["worst_grad"] < 1e-5


def test_ops_refuses_a_bad_flag():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ops.py"), "--ops", "rwkv9"],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 2 and "--ops" in done.stderr


def test_decode_rows(tmp_path):
    rows, _ = run_topic("decode.py", "--sizes", "tiny", "--backends", "native", "--parts",
                        "single", "--new-tokens", "2", "--steps-per-call", "2", "--peers",
                        "official", tmp_path=tmp_path)
    single = [r for r in rows if r["row"] == "single stream"]
    assert len(single) == 1 and single[0]["tokens_per_s"] > 0
    assert [r["absent"] for r in rows if r["backend"] == "official"]


def test_multi_device_rows(tmp_path):
    rows, out = run_topic("multi_device.py", "--tiny", "--devices", "2", "--ops", "rwkv7",
                          "--shapes", "2x32x2x8:data", "--repeats", "1", "--backend", "native",
                          tmp_path=tmp_path)
    assert [(r["mode"], r["devices"]) for r in rows] == [("1 device", 1), ("data", 2)]
    assert all(r["error"] is None and r["milliseconds"] > 0 for r in rows)
    assert "| rwkv7 | 2x32x2x8 | data | 2 |" in out


def test_train_rows(tmp_path):
    """The train topic's row: the recipe's step measured and described like every topic's."""
    rows, out = run_topic("train_throughput.py", "--model", "tiny", "--cpu-devices", "2",
                          "--devices", "2", "--batch", "2", "--seq", "16", "--steps", "1",
                          "--warmup", "1", "--backend", "native", tmp_path=tmp_path)
    assert len(rows) == 1 and rows[0]["topic"] == "train"
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["devices"] == 2
    assert "tokens/s" in out

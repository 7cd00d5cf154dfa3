"""Checkpoint files against failures and untrusted input: a failed write keeps the previous file,
and a crafted file is refused by its names and shapes before any array is read (rwkv_jax.nn
checkpoint.py). Round trips and the official layout are in test_nn.py."""

import json
import os
import pathlib
import re
import stat
import subprocess
import sys
import zipfile
import zlib

import numpy as np
import pytest

import official_rwkv7
import pth_files
from rwkv_jax import nn as rnn

SUFFIXES = [".npz", ".safetensors", ".pth"]


@pytest.fixture(scope="module")
def checkpoint():
    return official_rwkv7.random_checkpoint(0, vocab_size=50, n_layer=1)


# --- a failed write ---------------------------------------------------------------------------

# Saves every format over a previous file with the file size capped below what the write needs:
# a full disk as the writer sees it (EFBIG instead of ENOSPC).
FULL_DISK = """
import pathlib, resource, signal, sys
from rwkv_jax import nn as rnn
directory = pathlib.Path(sys.argv[1])
model = rnn.load_rwkv7(directory / "previous.npz")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails instead of killing us
cap = min(p.stat().st_size for p in directory.iterdir()) // 2
resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
for suffix in sys.argv[2:]:
    try:
        rnn.save_rwkv7(model, directory / ("previous" + suffix))
    except Exception as err:
        print(suffix, "failed:", type(err).__name__, err)
    else:
        print(suffix, "written")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_failed_save_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, checkpoint):
    for suffix in SUFFIXES:
        official_rwkv7.write_checkpoint(tmp_path / f"previous{suffix}", checkpoint)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path), *SUFFIXES],
                          capture_output=True, text=True, timeout=300,
                          cwd=pathlib.Path(__file__).parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for suffix in SUFFIXES:
        assert f"{suffix} failed:" in proc.stdout, proc.stdout + proc.stderr
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(after) == sorted(before)  # no temporary left behind
    for name, content in before.items():
        assert after[name] == content, f"{name} changed by a failed save"
    for suffix in SUFFIXES:  # and still a checkpoint
        rnn.load_rwkv7(tmp_path / f"previous{suffix}")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_save_replaces_the_previous_file_whole(tmp_path, suffix, checkpoint):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"an older, longer file " * 10_000)
    model = rnn.load_rwkv7(checkpoint)
    rnn.save_rwkv7(model, path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    for name, value in rnn.rwkv7_state_dict(rnn.load_rwkv7(path)).items():
        np.testing.assert_array_equal(value, rnn.rwkv7_state_dict(model)[name], err_msg=name)


# --- untrusted files --------------------------------------------------------------------------

# Loads each crafted file (or, for "dict:INDEX", a dict) in a child process whose memory is capped
# (a loader that builds huge sets or inflates huge members fails there instead of exhausting the
# machine), printing the error and the time each took as a JSON line.
LOAD_CRAFTED = """
import json, resource, sys, time
import numpy as np
import safetensors  # imported before any clock starts: the reader imports it lazily
from rwkv_jax import nn as rnn
used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), resource.RLIM_INFINITY))
for source in sys.argv[1:]:
    if source.startswith("dict:"):
        source = {f"blocks.{source[5:]}.att.x_r": np.zeros((1, 1, 4), np.float32),
                  "emb.weight": np.zeros((2, 4), np.float32)}
    start = time.perf_counter()
    try:
        rnn.load_rwkv7(source)
        error, message = None, "loaded"
    except BaseException as err:
        error, message = type(err).__name__, str(err)[:2000]
    print(json.dumps(dict(error=error, message=message, seconds=time.perf_counter() - start)),
          flush=True)
"""


def _npy_header(dtype, shape) -> bytes:
    import io
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
              "shape": shape})
    return out.getvalue()


def _add_deflated_zeros(path, name, header: bytes, size: int):
    """Append to the zip at ``path`` a deflated member ``name``: ``header`` then ``size`` zero
    bytes, about 1/1000 of that on disk. The deflate stream is one block of 1 MiB of zeros
    repeated (each block is flushed whole, so every copy is the same bytes): nothing of the
    inflated size is ever held in memory or compressed."""
    chunk = 1 << 20
    assert size % chunk == 0
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(header) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH)
    assert compressor.compress(bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH) == block
    tail = compressor.flush()
    crc = zlib.crc32(header)
    zeros = bytes(chunk)
    for _ in range(size // chunk):
        crc = zlib.crc32(zeros, crc)
    info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.CRC, info.file_size = crc, len(header) + size
    info.compress_size = len(head) + len(block) * (size // chunk) + len(tail)
    with zipfile.ZipFile(path, "a") as archive:
        # The member's local header, then its compressed bytes as they are, where the central
        # directory was; ZipFile writes the directory again, with this member, on close.
        archive.fp.seek(archive.start_dir)
        info.header_offset = archive.fp.tell()
        archive.fp.write(info.FileHeader(zip64=False))
        archive.fp.write(head)
        for _ in range(size // chunk):
            archive.fp.write(block)
        archive.fp.write(tail)
        archive.filelist.append(info)
        archive.NameToInfo[info.filename] = info
        archive.start_dir = archive.fp.tell()
        archive._didModify = True


GIB = 1 << 30
HUGE_INDICES = ["100000000", "9" * 5000]


def _crafted_files(directory, checkpoint) -> dict:
    """Case name -> (source for LOAD_CRAFTED, the error message it must give)."""
    cases = {}
    for index in HUGE_INDICES:
        message = r"gives a layer index beyond what its 2 names can hold"
        cases[f"index {index[:9]} dict"] = (f"dict:{index}", message)
        for suffix in SUFFIXES:
            path = directory / f"index{len(index)}{suffix}"
            official_rwkv7.write_checkpoint(path, {f"blocks.{index}.att.x_r": np.zeros((1, 1, 4), np.float32),
                          "emb.weight": np.zeros((2, 4), np.float32)})
            cases[f"index {index[:9]} {suffix}"] = (str(path), message)
    # A small .npz whose unknown member inflates to 1 GiB.
    bomb = directory / "bomb.npz"
    np.savez(bomb, **checkpoint)
    _add_deflated_zeros(bomb, "surprise.npy", _npy_header(np.uint8, (GIB,)), GIB)
    assert bomb.stat().st_size < 4 << 20
    cases["unknown member"] = (str(bomb), r"unknown \['surprise'\]")
    # A known name whose member inflates to 1 GiB of the wrong shape: refused by its header.
    wrong = directory / "wrong_shape.npz"
    np.savez(wrong, **{n: v for n, v in checkpoint.items() if n != "blocks.0.ffn.value.weight"})
    _add_deflated_zeros(wrong, "blocks.0.ffn.value.weight.npy",
                        _npy_header(np.float32, (32, GIB // 128)), GIB)
    cases["wrong shape"] = (str(wrong), r"blocks\.0\.ffn\.value\.weight must have shape \(32, 128\)")
    # A .pth whose storage is a deflated member that inflates to 1 GiB: refused unread.
    deflated = directory / "deflated.pth"
    storage = pth_files.Storage("0", np.zeros(1, np.float32))
    pth_files.write(deflated, {"emb.weight": pth_files.Tensor(storage, 0, (GIB // 4,), (1,))}, [])
    _add_deflated_zeros(deflated, "archive/data/0", b"", GIB)
    assert deflated.stat().st_size < 4 << 20
    cases["deflated storage"] = (str(deflated), r"member 'archive/data/0' is compressed")
    return cases


CASES = [f"index {index[:9]} {kind}" for index in HUGE_INDICES for kind in ["dict", *SUFFIXES]] \
    + ["unknown member", "wrong shape", "deflated storage"]


@pytest.fixture(scope="module")
def crafted(tmp_path_factory, checkpoint):
    """Each crafted case's expected message and what loading it gave (one child process)."""
    cases = _crafted_files(tmp_path_factory.mktemp("crafted"), checkpoint)
    assert sorted(cases) == sorted(CASES)
    proc = subprocess.run([sys.executable, "-c", LOAD_CRAFTED, *(s for s, _ in cases.values())],
                          capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(cases), proc.stdout + proc.stderr[-4000:]
    return {name: (message, result) for (name, (_, message)), result in zip(cases.items(), results)}


@pytest.mark.skipif(sys.platform != "linux", reason="the child's memory cap reads /proc")
@pytest.mark.parametrize("case", CASES)
def test_a_crafted_file_is_refused_quickly_by_its_names_and_shapes(crafted, case):
    message, result = crafted[case]
    assert result["error"] == "ValueError", result
    assert re.search(message, result["message"]), result
    assert result["seconds"] < 1.0, result


def test_the_zip_bomb_is_well_formed(tmp_path):
    path = tmp_path / "bomb.zip"
    with zipfile.ZipFile(path, "w"):
        pass
    _add_deflated_zeros(path, "zeros.npy", _npy_header(np.uint8, (4 << 20,)), 4 << 20)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # the CRC of every member matches its inflated bytes
        with archive.open("zeros.npy") as member:
            array = np.lib.format.read_array(member)
    assert array.shape == (4 << 20,) and not array.any()


class _Trap:
    """Pickled, loading it would create ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.mark.parametrize("suffix", [".npz", ".pth"])
def test_loading_never_runs_pickled_code(tmp_path, suffix, checkpoint):
    marker = tmp_path / "pickled_code_ran"
    path = tmp_path / f"trap{suffix}"
    if suffix == ".npz":
        trap = np.empty(checkpoint["emb.weight"].shape, object)
        trap[...] = _Trap(marker)
        np.savez(path, **dict(checkpoint, **{"emb.weight": trap}))
    else:
        state = pth_files.state_dict(checkpoint)
        state["emb.weight"] = _Trap(marker)
        pth_files.write(path, state)
    with pytest.raises(ValueError):
        rnn.load_rwkv7(path)
    assert not marker.exists()


# --- file modes, links, damaged files ---------------------------------------------------------

def test_saving_again_keeps_the_file_mode_and_follows_a_link(tmp_path, checkpoint):
    from rwkv_jax._files import write_atomically
    model = rnn.load_rwkv7(checkpoint)
    path = tmp_path / "model.safetensors"
    old_umask = os.umask(0o027)
    try:
        rnn.save_rwkv7(model, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640  # new: the umask's, as open() gives
    finally:
        os.umask(old_umask)
    path.chmod(0o600)
    rnn.save_rwkv7(model, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # kept: weights stay private
    # Every atomic write (the CLI's --json too) keeps it; a link is followed, and stays a link.
    target, link = tmp_path / "results.json", tmp_path / "latest.json"
    target.write_text("old")
    target.chmod(0o604)
    link.symlink_to(target.name)
    write_atomically(os.fsencode(link), lambda f: f.write(b"new"))
    assert link.is_symlink() and target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o604
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "model.safetensors",
                                                          "results.json"]


def test_damaged_checkpoints_are_value_errors_naming_the_file(tmp_path, checkpoint):
    model = rnn.load_rwkv7(checkpoint)
    for suffix in (".safetensors", ".npz"):
        whole = tmp_path / f"whole{suffix}"
        rnn.save_rwkv7(model, whole)
        data = bytearray(whole.read_bytes())
        truncated = tmp_path / f"truncated{suffix}"
        truncated.write_bytes(data[:len(data) // 2])
        cases = [truncated]
        if suffix == ".npz":
            # One bit of one member's array flipped: its CRC no longer matches.
            with zipfile.ZipFile(whole) as archive:
                info = archive.getinfo("blocks.0.ffn.key.weight.npy")
            at = info.header_offset + 30 + len(info.filename) + 200  # inside the array's bytes
            data[at] ^= 0x10
            flipped = tmp_path / f"flipped{suffix}"
            flipped.write_bytes(data)
            cases.append(flipped)
        for path in cases:
            with pytest.raises(ValueError, match=re.escape(str(path))):
                rnn.load_rwkv7(path)


def test_non_finite_weights_load_with_a_warning(checkpoint):
    damaged = dict(checkpoint)
    damaged["blocks.0.att.w0"] = checkpoint["blocks.0.att.w0"].copy()
    damaged["blocks.0.att.w0"][..., 3] = np.nan
    damaged["head.weight"] = np.full_like(checkpoint["head.weight"], np.inf)
    with pytest.warns(RuntimeWarning, match=r"NaN or inf in 2 tensors: \['head\.weight', "
                                            r"'blocks\.0\.att\.w0'\]"):
        model = rnn.load_rwkv7(damaged)
    assert np.isnan(np.asarray(model.blocks[0].att.w0[...])[3])  # loaded as it is
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rnn.load_rwkv7(checkpoint)  # finite weights: no warning


def test_paths_and_layer_ids_are_checked(tmp_path, checkpoint):
    import official_rwkv6
    model = rnn.load_rwkv7(checkpoint)
    rnn.save_rwkv7(model, os.fsencode(tmp_path / "bytes.npz"))  # bytes, as os functions take
    assert (tmp_path / "bytes.npz").exists()
    loaded = rnn.load_rwkv7(os.fsencode(tmp_path / "bytes.npz"))
    np.testing.assert_array_equal(rnn.rwkv7_state_dict(loaded)["head.weight"],
                                  checkpoint["head.weight"])
    with pytest.raises(TypeError, match="path must be a str, bytes or os.PathLike file name, "
                                        "got int 3"):
        rnn.save_rwkv7(model, 3)
    params = official_rwkv6.random_layer(0, layer_id=1)
    for layer_id, error, message in (("1", TypeError, "layer_id must be an int, got str '1'"),
                                     (True, TypeError, "layer_id must be an int, got bool"),
                                     (-1, ValueError, "layer_id must be >= 0, got -1")):
        with pytest.raises(error, match=message):
            rnn.load_rwkv6_layer(params, layer_id)
    att, _ = rnn.load_rwkv6_layer(params, np.int64(1))  # numpy ints are ints
    assert isinstance(att, rnn.RWKV6TimeMix)

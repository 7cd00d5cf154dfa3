""".pth state dicts without torch (rwkv_jax/_pth.py): files written here in torch's layout
(tests/pth_files.py) and by rwkv_jax's writer read back exactly, crafted files refused quickly
before any tensor is read, and, where torch is installed, files torch wrote read identically
and files we wrote read by torch.load(weights_only=True) identically."""

import io
import pickle
import pickletools
import struct
import sys
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import official_rwkv6
import official_rwkv7
import pth_files
from rwkv_jax import _pth
from rwkv_jax import nn as rnn

DTYPES = [np.float32, np.float16, jnp.bfloat16, np.float64, np.int64, np.int32, np.bool_,
          np.uint8]


def _random(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 200, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.fixture(scope="module")
def arrays():
    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (2, 3, 4), (), (0, 3), (1, 1, 6), (4, 2), (5,)]
    return {f"t{i}.{np.dtype(dtype).name}": _random(rng, shape, dtype)
            for i, (dtype, shape) in enumerate(zip(DTYPES, shapes))}


def _assert_identical(found, expected):
    assert list(found) == list(expected)
    for name, value in expected.items():
        assert found[name].dtype == value.dtype and found[name].shape == value.shape, name
        np.testing.assert_array_equal(found[name], value, err_msg=name)


def _read_all(path):
    pth = _pth.open_pth(path)
    return {name: pth.read(name) for name in pth.tensors}


def test_reads_a_state_dict_in_torch_layout(tmp_path, arrays):
    path = tmp_path / "model.pth"
    pth_files.write_state_dict(path, arrays)  # an OrderedDict with _metadata, as torch saves
    pth = _pth.open_pth(path)
    assert {name: view.shape for name, view in pth.tensors.items()} == \
        {name: value.shape for name, value in arrays.items()}
    found = {name: pth.read(name) for name in pth.tensors}
    _assert_identical(found, arrays)
    assert all(value.flags.owndata and value.flags.writeable for value in found.values())


def test_reads_views_of_a_shared_storage(tmp_path):
    data = np.random.default_rng(1).standard_normal(30).astype(np.float32)
    storage = pth_files.Storage("7", data)
    state = {"whole": pth_files.Tensor(storage, 0, (5, 6), (6, 1)),
             "transposed": pth_files.Tensor(storage, 0, (6, 5), (1, 6)),
             "slice": pth_files.Tensor(storage, 13, (2, 3), (6, 2)),
             "parameter": pth_files.Tensor(storage, 4, (3,), (1,), parameter=True),
             "empty": pth_files.Tensor(storage, 30, (0, 4), (4, 1))}
    path = tmp_path / "views.pth"
    pth_files.write(path, state)
    grid = data.reshape(5, 6)
    _assert_identical(_read_all(path), {
        "whole": grid, "transposed": grid.T, "slice": data[[[13, 15, 17], [19, 21, 23]]],
        "parameter": data[4:7], "empty": np.zeros((0, 4), np.float32)})


def test_write_pth_round_trip_in_torch_layout(tmp_path, arrays):
    path = tmp_path / "ours.pth"
    with open(path, "wb") as f:
        _pth.write_pth(f, arrays)
    _assert_identical(_read_all(path), arrays)  # bfloat16 stays bfloat16
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        assert names == ["archive/data.pkl", "archive/byteorder"] + \
            [f"archive/data/{key}" for key in range(len(arrays))] + ["archive/version"]
        assert archive.read("archive/byteorder") == b"little"
        assert archive.read("archive/version") == b"3\n"
        assert archive.testzip() is None
        raw = path.read_bytes()
        for info in archive.infolist():  # stored, the data 64-byte aligned as torch aligns it
            assert info.compress_type == zipfile.ZIP_STORED
            name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
            assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0
        pickled = archive.read("archive/data.pkl")
    # The pickle names what torch.save's does, and nothing else.
    globals_named = {arg for op, arg, _ in pickletools.genops(pickled) if op.name == "GLOBAL"}
    assert globals_named == {"collections OrderedDict", "torch._utils _rebuild_tensor_v2",
                             "torch FloatStorage", "torch HalfStorage", "torch BFloat16Storage",
                             "torch DoubleStorage", "torch LongStorage", "torch IntStorage",
                             "torch BoolStorage", "torch ByteStorage"}


def test_write_pth_refuses_what_a_pth_cannot_hold(tmp_path):
    with pytest.raises(TypeError, match=r"x has dtype complex64"):
        _pth.write_pth(io.BytesIO(), {"x": np.ones(2, np.complex64)})
    with pytest.raises(TypeError, match=r"tensor names must be str, got int"):
        _pth.write_pth(io.BytesIO(), {3: np.ones(2, np.float32)})


# --- crafted and damaged files ----------------------------------------------------------------

def _pickle(*opcodes) -> bytes:
    return b"\x80\x02" + b"".join(opcodes) + b"."


def _text(text: str) -> bytes:
    return b"X" + struct.pack("<I", len(text)) + text.encode()


ONE_FLOAT = {"x": pth_files.Tensor(pth_files.Storage("0", np.float32([1.5])))}


def _crafted(directory, case):
    """Write crafted file ``case`` into ``directory``; its path."""
    path = directory / f"{case}.pth"
    one = pth_files.Storage("0", np.arange(6, dtype=np.float32) + 0.5)
    if case == "os.system":
        pth_files.write(path, {}, [], pickled=_pickle(b"cos\nsystem\n", _text("echo hi"),
                                                     b"\x85R"))
    elif case == "builtins.eval":  # protocol 4's STACK_GLOBAL
        pth_files.write(path, {}, [], pickled=b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93"
                                              + _text("1") + b"\x85R.")
    elif case == "storage class called":
        pth_files.write(path, {}, [], pickled=_pickle(b"ctorch\nFloatStorage\n)R"))
    elif case == "unknown torch name":
        pth_files.write(path, {}, [], pickled=_pickle(b"ctorch._utils\n_rebuild_tensor_v3\n"))
    elif case == "BUILD on a rebuilder":
        pth_files.write(path, {}, [], pickled=_pickle(
            b"ctorch._utils\n_rebuild_tensor_v2\n}", _text("__defaults__"), b"Kx", b"sb"))
    elif case == "BUILD slots on a rebuilder":
        pth_files.write(path, {}, [], pickled=_pickle(
            b"ctorch._utils\n_rebuild_tensor_v2\nN}", _text("name"), _text("x"), b"s\x86b"))
    elif case == "storage past the end":
        pth_files.write(path, ONE_FLOAT)
        pth_files.patch_directory_entry(path, "archive/data/0", file_size=1 << 31)
    elif case == "compressed storage":
        pth_files.write(path, ONE_FLOAT, compress=zipfile.ZIP_DEFLATED)
    elif case == "shape past the storage":
        pth_files.write(path, {"x": pth_files.Tensor(one, 0, (3, 4), (4, 1))})
    elif case == "offset past the storage":
        pth_files.write(path, {"x": pth_files.Tensor(one, 4, (3,), (1,))})
    elif case == "broadcast view":
        pth_files.write(path, {"x": pth_files.Tensor(one, 0, (1 << 40,), (0,))})
    elif case == "negative stride":
        pth_files.write(path, {"x": pth_files.Tensor(one, 5, (3,), (-1,))})
    elif case == "numel not the member's size":
        pth_files.write(path, ONE_FLOAT, [one])
    elif case == "big-endian":
        pth_files.write(path, ONE_FLOAT, byteorder=b"big")
    elif case == "legacy format":
        path.write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + b"rest")
    elif case == "not a zip":
        path.write_bytes(b"plain text, " * 100)
    elif case == "no data.pkl":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("archive/constants.pkl", b"")
    elif case == "not a dict":
        pth_files.write(path, [ONE_FLOAT["x"]], pth_files.storages_of(ONE_FLOAT))
    elif case == "not a tensor":
        pth_files.write(path, {"x": ONE_FLOAT["x"], "epoch": 3})
    elif case == "huge directory declared":
        pth_files.write(path, ONE_FLOAT)
        data = bytearray(path.read_bytes())
        struct.pack_into("<L", data, data.rindex(b"PK\x05\x06") + 12, 1 << 31)
        path.write_bytes(bytes(data))
    else:
        raise AssertionError(case)
    return path


CRAFTED = {
    "os.system": r"names os\.system, which a state dict does not use",
    "builtins.eval": r"names builtins\.eval, which a state dict does not use",
    "storage class called": r"calls torch\.FloatStorage, which a state dict never calls",
    "unknown torch name": r"names torch\._utils\._rebuild_tensor_v3",
    "BUILD on a rebuilder": r"not a state dict that can be read safely",
    "BUILD slots on a rebuilder": r"not a state dict that can be read safely",
    "storage past the end": r"member 'archive/data/0' declares 2147483648 bytes .* past the end",
    "compressed storage": r"member 'archive/data/0' is compressed",
    "shape past the storage": r"size \(3, 4\), stride \(4, 1\) and offset 0 needs 12 elements, "
                              r"but its storage holds 6",
    "offset past the storage": r"offset 4 needs 7 elements, but its storage holds 6",
    "broadcast view": r"needs 1099511627776 elements, but its storage holds 6",
    "negative stride": r"non-negative ints",
    "numel not the member's size": r"storage '0' declares 1 elements of float32, but its member "
                                   r"has 24 bytes",
    "big-endian": r"byte order b'big'; only little-endian",
    "legacy format": r"torch's legacy format \(before torch 1\.6\)",
    "not a zip": r"is not a \.pth file",
    "no data.pkl": r"needs one <archive>/data\.pkl member, found none",
    "not a dict": r"must hold a dict of tensors, got list",
    "not a tensor": r"its 'epoch' is int",
    "huge directory declared": r"in a 2147483648-byte directory",
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_pth_is_refused_quickly_before_any_tensor_is_read(tmp_path, case):
    path = _crafted(tmp_path, case)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=CRAFTED[case]) as refused:
        _pth.open_pth(path)
    assert time.perf_counter() - start < 1.0  # generous: milliseconds here
    assert str(path) in str(refused.value)


def test_too_many_members_are_refused_before_the_directory_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr(_pth, "_MAX_MEMBERS", 4)  # one that the test can reach cheaply
    path = tmp_path / "many.pth"
    storages = [pth_files.Storage(str(key), np.float32([key])) for key in range(4)]
    pth_files.write(path, ONE_FLOAT, storages)  # 4 storages, data.pkl, byteorder, version
    with pytest.raises(ValueError, match=r"declares 7 zip members .*at most 4 members"):
        _pth.open_pth(path)
    # End records that understate the count: the members parsed are counted too.
    data = bytearray(path.read_bytes())
    struct.pack_into("<HH", data, data.rindex(b"PK\x05\x06") + 8, 1, 1)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"has 7 zip members; .*at most 4 are read"):
        _pth.open_pth(path)


def test_a_damaged_storage_is_refused_when_read(tmp_path):
    path = tmp_path / "damaged.pth"
    values = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    pth_files.write_state_dict(path, {"w": values, "b": values[0]})
    raw = bytearray(path.read_bytes())
    raw[raw.index(values.tobytes()) + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    pth = _pth.open_pth(path)
    assert pth.tensors["w"].shape == (4, 4)  # names and shapes need no data
    np.testing.assert_array_equal(pth.read("b"), values[0])
    with pytest.raises(ValueError, match=r"storage '0' \(tensor 'w'\) do not match their CRC"):
        pth.read("w")


def test_loading_a_missing_pth_says_it_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        rnn.load_rwkv7(tmp_path / "rwkv7-g1-0.1b.pth")


# --- the loaders, without torch ----------------------------------------------------------------

def test_load_and_save_pth_never_import_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as without torch
    params = official_rwkv7.random_checkpoint(4, vocab_size=20, n_layer=1)
    official_rwkv7.write_checkpoint(tmp_path / "official.pth", params)
    model = rnn.load_rwkv7(tmp_path / "official.pth")
    expected = rnn.rwkv7_state_dict(rnn.load_rwkv7(params))
    _assert_identical(rnn.rwkv7_state_dict(model), expected)
    rnn.save_rwkv7(model, tmp_path / "saved.pth")
    _assert_identical(rnn.rwkv7_state_dict(rnn.load_rwkv7(tmp_path / "saved.pth")), expected)
    layer = official_rwkv6.random_layer(5, layer_id=1)
    pth_files.write_state_dict(tmp_path / "rwkv6.pth", layer)
    for ours, reference in zip(rnn.load_rwkv6_layer(tmp_path / "rwkv6.pth", 1),
                               rnn.load_rwkv6_layer(layer, 1)):
        for value, expected in zip(jax.tree.leaves(nnx.state(ours)),
                                   jax.tree.leaves(nnx.state(reference))):
            np.testing.assert_array_equal(value, expected)


# --- against torch, where it is installed -------------------------------------------------------

def test_files_of_torch_read_identically_and_torch_reads_ours(tmp_path, arrays):
    torch = pytest.importorskip("torch")
    as_torch = lambda v: (torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
                          if v.dtype == jnp.bfloat16 else torch.from_numpy(np.array(v)))
    layer = torch.nn.Linear(5, 3)  # a module's state dict: an OrderedDict with _metadata
    wide = torch.randn(4, 6)
    saved = dict(layer.state_dict(), **{name: as_torch(v) for name, v in arrays.items()},
                 transposed=wide.t(), column=wide[:, 2], parameter=torch.nn.Parameter(wide[1]))
    torch.save(saved, tmp_path / "torch.pth")
    as_numpy = lambda t: (t.detach().view(torch.int16).numpy().view(jnp.bfloat16)
                          if t.dtype == torch.bfloat16 else t.detach().numpy())
    _assert_identical(_read_all(tmp_path / "torch.pth"),
                      {name: as_numpy(t) for name, t in saved.items()})

    with open(tmp_path / "ours.pth", "wb") as f:
        _pth.write_pth(f, arrays)
    loaded = torch.load(tmp_path / "ours.pth", weights_only=True)
    _assert_identical({name: as_numpy(t) for name, t in loaded.items()}, arrays)
    mapped = torch.load(tmp_path / "ours.pth", weights_only=True, mmap=True)
    _assert_identical({name: as_numpy(t) for name, t in mapped.items()}, arrays)

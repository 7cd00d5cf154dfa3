"""PyTorch ``.pth`` files written here as torch.save writes them, without torch and without
rwkv_jax's writer: Python's own pickler (protocol 2) pickles stand-ins for torch's names, whose
GLOBAL opcodes are then renamed to torch's, and zipfile stores the members. A state dict comes
as ``module.state_dict()`` gives it: an OrderedDict with a ``_metadata`` attribute (pickled
with a BUILD), each tensor a ``_rebuild_tensor_v2`` of a storage named by a persistent id."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict

import numpy as np
from jax.numpy import bfloat16


# Stand-ins for torch's names, pickled by reference and renamed (torch_names) afterwards.
class FloatStorage: pass
class HalfStorage: pass
class BFloat16Storage: pass
class DoubleStorage: pass
class LongStorage: pass
class IntStorage: pass
class BoolStorage: pass
class ByteStorage: pass


def _rebuild_tensor_v2(*args):
    raise AssertionError("a stand-in, never called")


def _rebuild_parameter(*args):
    raise AssertionError("a stand-in, never called")


STORAGE_TYPES = {np.dtype(np.float32): FloatStorage, np.dtype(np.float16): HalfStorage,
                 np.dtype(bfloat16): BFloat16Storage,
                 np.dtype(np.float64): DoubleStorage, np.dtype(np.int64): LongStorage,
                 np.dtype(np.int32): IntStorage, np.dtype(np.bool_): BoolStorage,
                 np.dtype(np.uint8): ByteStorage}
TORCH_NAMES = {_rebuild_tensor_v2: "torch._utils", _rebuild_parameter: "torch._utils",
               **{kind: "torch" for kind in STORAGE_TYPES.values()}}


class Storage:
    """A storage: ``data`` (1-D) is written as member ``data/<key>``."""

    def __init__(self, key: str, data: np.ndarray):
        self.key, self.data = key, np.ascontiguousarray(data).reshape(-1)


class Tensor:
    """A tensor pickled as torch pickles one: a view of ``storage`` (element offset, size,
    stride), or as an ``nn.Parameter`` holding that tensor."""

    def __init__(self, storage: Storage, offset=0, shape=None, stride=None, parameter=False):
        self.storage, self.offset, self.parameter = storage, offset, parameter
        self.shape = tuple(storage.data.shape if shape is None else shape)
        self.stride = tuple(stride) if stride is not None else tuple(
            int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    def __reduce__(self):
        tensor = (_rebuild_tensor_v2, (self.storage, self.offset, self.shape, self.stride, False,
                                       OrderedDict()))
        if self.parameter:
            return _rebuild_parameter, (_Reduced(tensor), True, OrderedDict())
        return tensor


class _Reduced:
    def __init__(self, reduced):
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", STORAGE_TYPES[obj.data.dtype], obj.key, "cpu", obj.data.size)
        return None


def torch_pickle(obj) -> bytes:
    """``obj`` pickled as torch.save pickles it (protocol 2), stand-ins renamed to torch's."""
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(obj)
    data = out.getvalue()
    for stand_in, module in TORCH_NAMES.items():
        ours = f"c{stand_in.__module__}\n{stand_in.__qualname__}\n".encode()
        data = data.replace(ours, f"c{module}\n{stand_in.__qualname__}\n".encode())
    assert __name__.encode() + b"\n" not in data, "a stand-in was not renamed"
    return data


def state_dict(arrays: dict) -> OrderedDict:
    """``arrays`` as a module's state dict: each in its own storage, with ``_metadata``."""
    out = OrderedDict((name, Tensor(Storage(str(key), value), shape=np.shape(value)))
                      for key, (name, value) in enumerate(arrays.items()))
    out._metadata = OrderedDict([("", {"version": 1})])
    return out


def storages_of(obj) -> list:
    values = obj.values() if isinstance(obj, dict) else [obj]
    found = {t.storage.key: t.storage for t in values if isinstance(t, Tensor)}
    return list(found.values())


def write(path, obj, storages=None, *, archive="archive", pickled=None, byteorder=b"little",
          compress=zipfile.ZIP_STORED):
    """A zip of torch's layout: ``<archive>/data.pkl`` (``pickled``, or ``obj`` pickled),
    ``byteorder`` (left out if None), ``data/<key>`` per storage (compressed with ``compress``),
    ``version``."""
    with zipfile.ZipFile(path, "w") as out:
        out.writestr(f"{archive}/data.pkl", torch_pickle(obj) if pickled is None else pickled)
        if byteorder is not None:
            out.writestr(f"{archive}/byteorder", byteorder)
        for storage in storages_of(obj) if storages is None else storages:
            out.writestr(f"{archive}/data/{storage.key}", storage.data.tobytes(),
                         compress_type=compress)
        out.writestr(f"{archive}/version", b"3\n")


def write_state_dict(path, arrays: dict) -> None:
    write(path, state_dict(arrays))


def patch_directory_entry(path, name: str, *, file_size: int) -> None:
    """Set member ``name``'s sizes in the central directory (its data left as it is)."""
    data = bytearray(open(path, "rb").read())
    at, encoded = 0, name.encode()
    while True:
        at = data.index(b"PK\x01\x02", at)
        length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + length] == encoded:
            break
        at += 4
    struct.pack_into("<LL", data, at + 20, file_size, file_size)
    open(path, "wb").write(bytes(data))

"""PyTorch ``.pth`` state dicts (a dict of name -> tensor) read and written without torch.

torch.save (the zip format, its default since torch 1.6) writes a zip archive whose members are
all stored uncompressed: ``<archive>/data.pkl``, a pickle of the dict in which each tensor is a
call of ``torch._utils._rebuild_tensor_v2`` on a storage named by a persistent id;
``<archive>/data/<key>``, each storage's raw bytes; ``<archive>/byteorder`` and
``<archive>/version``. The reader unpickles with an unpickler that knows only the names a state
dict uses and builds nothing but inert records from them, so nothing in a file ever runs; the
file is memory-mapped and every member's place, every storage's size and every tensor's shape,
strides and offset are checked against it before anything is read, so a tensor's bytes are read
only when asked for (their CRC checked then). The writer writes the same layout.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from collections import OrderedDict
from typing import Callable, Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np

# torch's storage classes as a state dict's pickle names them (torch.<name>), and their elements.
_STORAGE_DTYPES = {
    "DoubleStorage": np.dtype(np.float64), "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16), "BFloat16Storage": np.dtype(jnp.bfloat16),
    "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16), "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8), "BoolStorage": np.dtype(np.bool_)}
_STORAGE_NAMES = {dtype: name for name, dtype in _STORAGE_DTYPES.items()}

# A state dict of the largest models has a few thousand tensors; these bound what a crafted
# file can make the reader hold before it is refused.
_MAX_MEMBERS = 1 << 17
_MAX_DIRECTORY_BYTES = 32 << 20
_MAX_PICKLE_BYTES = 64 << 20
_ALIGNMENT = 64  # torch aligns every member's data so; the reader does not need it

_END_OF_DIRECTORY = struct.Struct("<4s4H2LH")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_END_OF_DIRECTORY = struct.Struct("<4sQ2H2L4Q")
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")


class PthFile(NamedTuple):
    """An open ``.pth`` state dict. ``tensors``: each name, in file order, with a read-only numpy
    view of its values in the memory-mapped file (bfloat16 as ``jnp.bfloat16``): its shape and
    dtype cost nothing, its values are read from the disk when used. :meth:`read` gives a
    tensor's values in memory of their own, once its storage's CRC has been checked."""

    path: str
    tensors: dict
    read: Callable[[str], np.ndarray]


def open_pth(path) -> PthFile:
    """Open the ``.pth`` file ``path`` (a dict of tensors saved by ``torch.save`` since torch
    1.6, or by :func:`write_pth`) without torch. A file that is not one, or one that names
    anything but tensors, storages and ordered dicts, or whose members or tensors lie outside
    it, raises ``ValueError`` naming ``path`` before any tensor is read. The file stays mapped
    while the result's views live."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        archive = _open_archive(f, size, path)
        # The mapping outlives the file object; no zip is empty, so it is never zero-length.
        whole = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    tensors, storages = _load_state_dict(archive, whole, path)
    checked = set()

    def read(name):
        storage = storages[tensors[name].key]
        if storage.key not in checked:
            if zlib.crc32(storage.data.view(np.uint8)) != storage.crc:
                raise ValueError(f"{path}: the bytes of storage {storage.key!r} (tensor "
                                 f"{name!r}) do not match their CRC: the file is damaged")
            checked.add(storage.key)
        return np.array(tensors[name].view)

    return PthFile(path, {name: tensor.view for name, tensor in tensors.items()}, read)


def _open_archive(f, size, path) -> zipfile.ZipFile:
    """The zip directory of ``f``, its size checked from the end records before it is parsed."""
    if f.read(1) == pickle.PROTO:  # torch's legacy format: pickles one after another
        raise ValueError(f"{path} is a .pth file of torch's legacy format (before torch 1.6), "
                         f"which is not read: save it again with a newer torch")
    start = max(0, size - _END_OF_DIRECTORY.size - 0xFFFF)  # the record, then a comment
    f.seek(start)
    tail = f.read()
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _END_OF_DIRECTORY.size:
        raise ValueError(f"{path} is not a .pth file (the zip archive torch.save writes)")
    entries, directory_bytes = _END_OF_DIRECTORY.unpack_from(tail, at)[4:6]
    locator = start + at - _ZIP64_LOCATOR.size
    if locator >= 0:
        f.seek(locator)
        signature, _, offset, _ = _ZIP64_LOCATOR.unpack(f.read(_ZIP64_LOCATOR.size))
        if signature == b"PK\x06\x07":
            f.seek(offset)
            record = f.read(_ZIP64_END_OF_DIRECTORY.size)
            if len(record) == _ZIP64_END_OF_DIRECTORY.size and record[:4] == b"PK\x06\x06":
                entries, directory_bytes = _ZIP64_END_OF_DIRECTORY.unpack(record)[6:8]
    if entries > _MAX_MEMBERS or directory_bytes > _MAX_DIRECTORY_BYTES:
        raise ValueError(f"{path} declares {entries} zip members in a {directory_bytes}-byte "
                         f"directory; a state dict needs far fewer (at most {_MAX_MEMBERS} "
                         f"members, {_MAX_DIRECTORY_BYTES} bytes are read)")
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path} is not a .pth file (the zip archive torch.save writes): "
                         f"{err}") from err
    if len(archive.infolist()) > _MAX_MEMBERS:
        raise ValueError(f"{path} has {len(archive.infolist())} zip members; a state dict "
                         f"needs far fewer (at most {_MAX_MEMBERS} are read)")
    return archive


class _Member(NamedTuple):
    data: np.ndarray  # the member's bytes, a view of the mapped file
    crc: int


def _member(archive: zipfile.ZipFile, whole: np.ndarray, name: str, path) -> _Member:
    """The bytes of member ``name`` where they lie in the file: stored (not compressed), not
    encrypted, and wholly inside the file."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise ValueError(f"{path} has no member {name!r}") from None
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
        raise ValueError(f"{path}: member {name!r} is compressed or encrypted; torch.save "
                         f"stores every member as it is, and only such members are read")
    header = bytes(whole[max(0, info.header_offset):][:_LOCAL_HEADER.size])
    if info.header_offset < 0 or len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise ValueError(f"{path}: member {name!r} has no local header at its offset "
                         f"{info.header_offset}")
    name_length, extra_length = _LOCAL_HEADER.unpack(header)[-2:]
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if info.compress_size != info.file_size or start + info.file_size > whole.size:
        raise ValueError(f"{path}: member {name!r} declares {info.file_size} bytes at offset "
                         f"{start}, past the end of the {whole.size}-byte file (truncated or "
                         f"crafted)")
    return _Member(whole[start:start + info.file_size], info.CRC)


class _Global(NamedTuple):
    """What a torch name in the pickle unpickles to: immutable, so that a pickle's BUILD
    cannot change it, and callable only as torch's own is in a state dict."""

    name: str

    def __call__(self, *args):
        if self.name == "torch._utils._rebuild_tensor_v2":
            return _rebuild_tensor_v2(*args)
        if self.name == "torch._utils._rebuild_parameter":
            return _rebuild_parameter(*args)
        raise ValueError(f"the pickle calls {self.name}, which a state dict never calls")


class _Storage(NamedTuple):
    key: str
    data: np.ndarray  # the member's bytes as the storage's elements
    crc: int


class _Tensor(NamedTuple):
    key: str
    view: np.ndarray


_REBUILD = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter"}


class _StateDictUnpickler(pickle.Unpickler):
    """Knows only the names a state dict's pickle uses (``collections.OrderedDict``, torch's
    tensor rebuilders and storage classes) and refuses every other one; the torch names give
    inert records (:class:`_Global`, :class:`_Tensor`), never torch's code."""

    def __init__(self, file, storage):
        super().__init__(file)
        self._storage = storage

    def find_class(self, module, name):
        qualified = f"{module}.{name}"
        if qualified == "collections.OrderedDict":
            return OrderedDict
        if qualified in _REBUILD or (module == "torch" and name in _STORAGE_DTYPES):
            return _Global(qualified)
        raise ValueError(f"the pickle names {qualified}, which a state dict does not use "
                         f"(only tensors, their storages and ordered dicts are read)")

    def persistent_load(self, pid):
        return self._storage(pid)


def _rebuild_tensor_v2(storage, offset, shape, stride, requires_grad, hooks, metadata=None):
    if not isinstance(storage, _Storage):
        raise ValueError(f"a tensor's storage must be a persistent storage, got "
                         f"{type(storage).__name__}")
    if not isinstance(requires_grad, bool) or not isinstance(hooks, dict) or hooks:
        raise ValueError("a tensor's requires_grad must be a bool and its backward hooks empty")
    if metadata is not None and (not isinstance(metadata, dict) or any(metadata.values())):
        raise ValueError(f"a tensor carries metadata {metadata!r}, which is not read")
    return _Tensor(storage.key, _strided_view(storage.data, offset, shape, stride))


def _rebuild_parameter(tensor, requires_grad, hooks):
    if not isinstance(tensor, _Tensor):
        raise ValueError(f"a parameter must hold a tensor, got {type(tensor).__name__}")
    return tensor


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strided_view(data: np.ndarray, offset, shape, stride) -> np.ndarray:
    """``data[offset + sum(i * stride)]`` over the indices of ``shape``, as a read-only view,
    refused unless every element lies inside ``data`` and no element is counted twice over
    more than ``data`` holds (a broadcast view would let a small file read as a huge one)."""
    if not (_is_index(offset) and isinstance(shape, tuple) and isinstance(stride, tuple)
            and len(shape) == len(stride) and all(map(_is_index, shape + stride))):
        raise ValueError(f"a tensor needs a size and strides of as many non-negative ints and "
                         f"a non-negative offset, got size {shape!r}, stride {stride!r}, offset "
                         f"{offset!r}")
    count = math.prod(shape)
    end = offset + (sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if count else 0)
    if end > data.size or count > data.size:
        raise ValueError(f"a tensor of size {shape}, stride {stride} and offset {offset} needs "
                         f"{max(end, count)} elements, but its storage holds {data.size}")
    return np.lib.stride_tricks.as_strided(data[offset:], shape,
                                           [s * data.itemsize for s in stride], writeable=False)


def _load_state_dict(archive, whole, path):
    """(name -> :class:`_Tensor`, storage key -> :class:`_Storage`) of the archive's pickle."""
    pickles = [name for name in archive.namelist()
               if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError(f"{path} is not a state dict saved by torch.save: it needs one "
                         f"<archive>/data.pkl member, found {pickles or 'none'}")
    prefix = pickles[0][:-len("data.pkl")]
    if prefix + "byteorder" in archive.namelist():
        order = bytes(_member(archive, whole, prefix + "byteorder", path).data)
        if order != b"little":
            raise ValueError(f"{path} was saved with byte order {order[:16]!r}; only "
                             f"little-endian files (b'little') are read")
    pickled = archive.getinfo(pickles[0])
    if pickled.file_size > _MAX_PICKLE_BYTES:
        raise ValueError(f"{path}: its pickle has {pickled.file_size} bytes; a state dict's "
                         f"needs far fewer (at most {_MAX_PICKLE_BYTES} are read)")
    storages = {}

    def storage(pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _Global) and isinstance(pid[2], str)
                and _is_index(pid[4])):
            raise ValueError(f"the pickle names a storage {pid!r:.200}; a state dict's are "
                             f"('storage', torch.<Type>Storage, key, location, numel)")
        _, kind, key, _, numel = pid
        dtype = _STORAGE_DTYPES.get(kind.name.removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"the pickle's storage {key!r} is of type {kind.name}; read are "
                             f"torch.{', torch.'.join(_STORAGE_DTYPES)}")
        if key not in storages:
            member = _member(archive, whole, f"{prefix}data/{key}", path)
            if member.data.size != numel * dtype.itemsize:
                raise ValueError(f"storage {key!r} declares {numel} elements of {dtype}, but "
                                 f"its member has {member.data.size} bytes")
            storages[key] = _Storage(key, member.data.view(dtype), member.crc)
        if storages[key].data.dtype != dtype or storages[key].data.size != numel:
            raise ValueError(f"storage {key!r} is named twice with different types or sizes")
        return storages[key]

    pickle_bytes = bytes(_member(archive, whole, pickles[0], path).data)
    try:
        state = _StateDictUnpickler(io.BytesIO(pickle_bytes), storage).load()
    except Exception as err:  # whatever the pickle does wrong, the file is refused as one
        raise ValueError(f"{path} is not a state dict that can be read safely: {err}") from err
    if not isinstance(state, dict):
        raise ValueError(f"{path} must hold a dict of tensors, got {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, _Tensor):
            raise ValueError(f"{path} must hold a dict of str -> tensor, but its "
                             f"{str(name)[:80]!r} is {type(value).__name__}")
    return state, storages


def write_pth(f, tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` (name -> numpy array) to the seekable binary file ``f`` as torch.save
    writes a dict of CPU tensors, so that ``torch.load`` (``weights_only`` too) and
    :func:`open_pth` read it: each array in its own storage, in its own dtype (bfloat16 as
    torch.bfloat16), C-contiguous."""
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        value = np.asarray(value, order="C")
        if value.dtype not in _STORAGE_NAMES:
            raise TypeError(f"{name} has dtype {value.dtype}; a .pth holds "
                            f"{', '.join(str(d) for d in _STORAGE_NAMES)}")
        arrays[name] = value
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as archive:
        _write_member(archive, f, "archive/data.pkl", _pickle_state_dict(arrays))
        _write_member(archive, f, "archive/byteorder", b"little")
        for key, value in enumerate(arrays.values()):
            _write_member(archive, f, f"archive/data/{key}", value.reshape(-1).view(np.uint8))
        _write_member(archive, f, "archive/version", b"3\n")


def _write_member(archive, f, name, data):
    """Add member ``name`` holding ``data`` (bytes or a uint8 array) uncompressed, its data
    aligned to 64 bytes as torch aligns it (a padding field in the local header)."""
    data = memoryview(data)
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.file_size = data.nbytes
    # The local header: 30 bytes, the name, the padding field (4 bytes and the padding), then
    # the zip64 sizes (20 bytes: every member is written with them, so the length is known).
    padding = -(f.tell() + _LOCAL_HEADER.size + len(name.encode()) + 4 + 20) % _ALIGNMENT
    info.extra = struct.pack("<HH", 0x4246, padding) + b"Z" * padding
    step = 1 << 24
    with archive.open(info, "w", force_zip64=True) as member:
        for start in range(0, data.nbytes, step):
            member.write(data[start:start + step])


def _pickle_state_dict(arrays: Mapping[str, np.ndarray]) -> bytes:
    """The protocol-2 pickle torch.save writes for a dict of C-contiguous CPU tensors: per name,
    ``_rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())``, the storage the
    persistent id ``("storage", torch.<Type>Storage, key, "cpu", numel)``."""
    out = [pickle.PROTO, b"\x02", pickle.EMPTY_DICT, pickle.MARK]
    for key, (name, value) in enumerate(arrays.items()):
        stride, step = [], 1
        for size in reversed(value.shape):   # torch's contiguous strides (a 0 counts as 1)
            stride.insert(0, step)
            step *= max(size, 1)
        out += [_pickle_text(name), pickle.GLOBAL, b"torch._utils\n_rebuild_tensor_v2\n",
                pickle.MARK,
                pickle.MARK, _pickle_text("storage"), pickle.GLOBAL,
                f"torch\n{_STORAGE_NAMES[value.dtype]}\n".encode(), _pickle_text(str(key)),
                _pickle_text("cpu"), _pickle_int(value.size), pickle.TUPLE, pickle.BINPERSID,
                _pickle_int(0), _pickle_ints(value.shape), _pickle_ints(stride), pickle.NEWFALSE,
                pickle.GLOBAL, b"collections\nOrderedDict\n", pickle.EMPTY_TUPLE, pickle.REDUCE,
                pickle.TUPLE, pickle.REDUCE]
    out += [pickle.SETITEMS, pickle.STOP]
    return b"".join(out)


def _pickle_text(text: str) -> bytes:
    encoded = text.encode("utf-8")
    return pickle.BINUNICODE + struct.pack("<I", len(encoded)) + encoded


def _pickle_int(value: int) -> bytes:
    if value < 1 << 31:
        return pickle.BININT + struct.pack("<i", value)
    encoded = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
    return pickle.LONG1 + bytes([len(encoded)]) + encoded


def _pickle_ints(values) -> bytes:
    return pickle.MARK + b"".join(map(_pickle_int, values)) + pickle.TUPLE

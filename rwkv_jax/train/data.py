"""Token corpora on disk and the windows a training run reads from them.

Three formats open into one :class:`TokenFile` (a read-only memory map of the ids, nothing read
until used): a flat file of little-endian ids (``.bin`` or any name, its dtype given), a ``.npy``
array, and RWKV-LM's ``binidx`` pair (``.bin`` + ``.idx``, Megatron's ``MMapIndexedDataset``
layout). :class:`WindowSampler` cuts windows of ``seq_len + 1`` tokens from it, the same ones for
a given step whatever the number of processes, each process reading only its own rows.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple, Optional

import jax.numpy as jnp
import numpy as np

from .._files import write_atomically

__all__ = ["TokenFile", "open_tokens", "WindowSampler", "Batch", "pack_rows", "write_tokens",
           "write_binidx", "tokenize_text"]

# Integer dtypes a corpus may hold ids in; signed ones are checked for negative ids when read.
TOKEN_DTYPES = tuple(np.dtype(t) for t in ("uint8", "uint16", "uint32", "int16", "int32", "int64"))

# The .idx header: magic, version <Q, dtype code <B, item count <Q, document-index count <Q; then
# sizes int32 [items], pointers int64 [items] (byte offsets into the .bin), doc_idx int64 [docs]
# (the first item of each document, then the item count).
BINIDX_MAGIC = b"MMIDIDX\x00\x00"
_BINIDX_HEADER = struct.Struct("<9sQBQQ")
_BINIDX_CODES = {1: np.dtype("uint8"), 3: np.dtype("int16"), 4: np.dtype("int32"),
                 5: np.dtype("int64"), 8: np.dtype("uint16")}
_BINIDX_OTHER_CODES = {2: "int8", 6: "a floating-point type", 7: "a floating-point type"}

_SCAN_CHUNK = 1 << 24  # tokens per pass of the whole-file scans (max id, separators)


class TokenFile:
    """A corpus of token ids, memory-mapped. Open one with :func:`open_tokens`.

    ``tokens``: the ids, 1-D read-only ``np.memmap``, every document one after the other.
    ``document_starts``: int64 offsets into ``tokens`` where documents begin (sorted, distinct,
    the first 0), or None when the file says nothing about documents.
    ``vocab_bound``: the largest id + 1, from one scan of the file on first use.
    """

    def __init__(self, path, tokens, *, format, document_starts=None, eos_id=None):
        self.path = os.fspath(path)
        self.tokens = tokens
        self.format = format
        self.eos_id = eos_id
        self._document_starts = document_starts
        self._vocab_bound = None
        if len(tokens) == 0:
            raise ValueError(f"{self.path} holds no tokens")

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return (f"TokenFile({self.path!r}, {self.format}, {len(self)} tokens of "
                f"{self.tokens.dtype.name})")

    @property
    def document_starts(self) -> Optional[np.ndarray]:
        if self._document_starts is None and self.eos_id is not None:
            # A document ends with its separator: the next one starts after it.
            ends = [np.flatnonzero(self.tokens[i:i + _SCAN_CHUNK] == self.eos_id) + (i + 1)
                    for i in range(0, len(self), _SCAN_CHUNK)]
            starts = np.concatenate([np.zeros(1, np.int64)] + ends).astype(np.int64)
            self._document_starts = starts[starts < len(self)]
        return self._document_starts

    @property
    def vocab_bound(self) -> int:
        if self._vocab_bound is None:
            largest = 0
            for i in range(0, len(self), _SCAN_CHUNK):
                chunk = self.tokens[i:i + _SCAN_CHUNK]
                if chunk.dtype.kind == "i" and chunk.min() < 0:
                    where = i + int(np.argmax(chunk < 0))
                    raise ValueError(f"{self.path} holds a negative token id "
                                     f"({int(self.tokens[where])}) at position {where}")
                largest = max(largest, int(chunk.max()))
            self._vocab_bound = largest + 1
        return self._vocab_bound

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError unless every id lies in ``[0, vocab_size)`` (one scan, then cached)."""
        if self.vocab_bound > vocab_size:
            raise ValueError(f"{self.path} holds token id {self.vocab_bound - 1}, outside the "
                             f"model's vocabulary [0, {vocab_size})")


def open_tokens(path, dtype=None, *, eos_id=None) -> TokenFile:
    """Open a token corpus, checking its layout before anything is read from it.

    - ``X.npy``: a 1-D integer array (dtype from its header; ``dtype``, if given, must match).
    - binidx: ``X.idx`` beside ``X.bin``; ``path`` may be ``X``, ``X.bin`` or ``X.idx``. The
      documents come from the index (``eos_id`` must be None); its dtype code gives the dtype.
    - anything else: a flat file of little-endian ids, ``dtype`` required (uint16 or uint32
      usually; any of uint8/16/32, int16/32/64).

    ``eos_id`` (flat and ``.npy`` files): the id that ends each document, so that
    ``document_starts`` (computed on first use) are the positions after it; None: no documents.
    """
    path = os.fspath(path)
    wanted = None if dtype is None else _token_dtype(dtype, "dtype")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer))
                               or eos_id < 0):
        raise TypeError(f"eos_id must be a non-negative int or None, got {eos_id!r}")
    prefix = _binidx_prefix(path)
    if prefix is not None:
        if eos_id is not None:
            raise ValueError(f"{prefix}.idx gives the documents of a binidx corpus; eos_id is "
                             f"for flat and .npy files, got eos_id={eos_id}")
        corpus = _open_binidx(prefix)
    elif path.endswith(".npy"):
        corpus = TokenFile(path, _open_npy(path), format="npy", eos_id=eos_id)
    else:
        if wanted is None:
            raise ValueError(f"{path} is a flat token file: give its dtype (uint16 or uint32, "
                             f"say); only .npy files and binidx indices record one")
        corpus = TokenFile(path, _open_flat(path, wanted, path), format="flat", eos_id=eos_id)
    if wanted is not None and corpus.tokens.dtype.newbyteorder("=") != wanted:
        raise TypeError(f"{corpus.path} holds {corpus.tokens.dtype.name} ids, but dtype="
                        f"{wanted.name} was asked for")
    return corpus


def _token_dtype(dtype, name) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name} must be a numpy integer dtype, got {dtype!r}") from e
    if dtype.newbyteorder("=") not in TOKEN_DTYPES:
        raise TypeError(f"{name} must be one of {', '.join(t.name for t in TOKEN_DTYPES)} (token "
                        f"ids), got {dtype}")
    return dtype.newbyteorder("=")


def _require_file(path) -> int:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token file {path} does not exist"
                                if not os.path.exists(path) else f"{path} is not a file")
    return os.path.getsize(path)


def _binidx_prefix(path) -> Optional[str]:
    stem, ext = os.path.splitext(path)
    if ext == ".idx":
        return stem
    if ext == ".bin" and os.path.exists(stem + ".idx"):
        return stem
    if ext not in (".bin", ".npy") and os.path.exists(path + ".idx"):
        return path
    return None


def _open_flat(path, dtype: np.dtype, what) -> np.memmap:
    size = _require_file(path)
    if size % dtype.itemsize:
        raise ValueError(f"{what} is truncated: {size} bytes is not a whole number of "
                         f"{dtype.name} ids ({dtype.itemsize} bytes each)")
    if size == 0:
        raise ValueError(f"{what} holds no tokens")
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r")


def _open_npy(path) -> np.ndarray:
    _require_file(path)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{path} is not a readable .npy file ({e})") from e
    if not isinstance(tokens, np.memmap):
        raise ValueError(f"{path} holds no array data to map (a 0-d or empty .npy)")
    if tokens.ndim != 1:
        raise ValueError(f"{path} must hold a 1-D array of token ids, got shape {tokens.shape}")
    _token_dtype(tokens.dtype, f"the dtype of {path}")
    return tokens


def _open_binidx(prefix) -> TokenFile:
    index_path, data_path = prefix + ".idx", prefix + ".bin"
    index_size = _require_file(index_path)
    with open(index_path, "rb") as f:
        header = f.read(_BINIDX_HEADER.size)
    if header[:len(BINIDX_MAGIC)] != BINIDX_MAGIC:
        raise ValueError(f"{index_path} is not a binidx index: it starts with "
                         f"{header[:len(BINIDX_MAGIC)]!r}, not {BINIDX_MAGIC!r}")
    if len(header) < _BINIDX_HEADER.size:
        raise ValueError(f"{index_path} is truncated: {index_size} bytes, shorter than the "
                         f"{_BINIDX_HEADER.size}-byte header")
    _, version, code, items, docs = _BINIDX_HEADER.unpack(header)
    if version != 1:
        raise ValueError(f"{index_path} has index version {version}; only version 1 is known")
    if code not in _BINIDX_CODES:
        what = _BINIDX_OTHER_CODES.get(code)
        known = ", ".join(f"{c} {t.name}" for c, t in _BINIDX_CODES.items())
        raise TypeError(f"{index_path} has dtype code {code}: "
                        + (f"{what}, not a token id type" if what else "not a known code")
                        + f" (known: {known})")
    dtype = _BINIDX_CODES[code]
    expected = _BINIDX_HEADER.size + 12 * items + 8 * docs
    if index_size != expected:
        raise ValueError(f"{index_path} is {index_size} bytes, but its header ({items} items, "
                         f"{docs} document entries) needs {expected}: "
                         + ("truncated" if index_size < expected else "trailing bytes"))
    index = np.memmap(index_path, dtype=np.uint8, mode="r")
    offset = _BINIDX_HEADER.size
    sizes = index[offset:offset + 4 * items].view("<i4")
    pointers = index[offset + 4 * items:offset + 12 * items].view("<i8")
    doc_idx = index[offset + 12 * items:].view("<i8")
    data_size = _require_file(data_path)
    _check_binidx_index(index_path, data_path, data_size, dtype, sizes, pointers, doc_idx)
    tokens = _open_flat(data_path, dtype, data_path)
    first_items = np.unique(doc_idx[doc_idx < items])
    starts = np.unique(pointers[first_items] // dtype.itemsize)
    return TokenFile(data_path, tokens, format="binidx",
                     document_starts=starts[starts < len(tokens)].astype(np.int64))


def _check_binidx_index(index_path, data_path, data_size, dtype, sizes, pointers, doc_idx):
    """The items must tile the .bin from its first byte to its last, in order; doc_idx must
    name items in order."""
    if np.any(sizes < 0):
        i = int(np.argmax(sizes < 0))
        raise ValueError(f"{index_path}: item {i} has a negative size ({int(sizes[i])})")
    ends = pointers + sizes.astype(np.int64) * dtype.itemsize
    past = np.flatnonzero((pointers < 0) | (ends > data_size))
    if past.size:
        i = int(past[0])
        raise ValueError(f"{index_path}: item {i} (bytes {int(pointers[i])} to {int(ends[i])}) "
                         f"runs past the end of {data_path} ({data_size} bytes): the .bin is "
                         f"shorter than its index says")
    contiguous = np.concatenate([np.zeros(1, np.int64), ends[:-1]])
    gap = np.flatnonzero(pointers != contiguous)
    if gap.size:
        i = int(gap[0])
        where = f"where item {i - 1} ends ({int(contiguous[i])})" if i else "at byte 0"
        raise ValueError(f"{index_path}: item {i} starts at byte {int(pointers[i])}, not "
                         f"{where}; items must follow each other in {data_path}")
    covered = int(ends[-1]) if ends.size else 0
    if covered != data_size:
        raise ValueError(f"{data_path} is {data_size} bytes but its index {index_path} describes "
                         f"{covered}: the pair does not belong together")
    if doc_idx.size == 0 or doc_idx[0] != 0 or np.any(np.diff(doc_idx) < 0) \
            or doc_idx[-1] > sizes.size:
        raise ValueError(f"{index_path}: the document index must rise from 0 to at most the item "
                         f"count ({sizes.size}) without decreasing, got "
                         f"{np.asarray(doc_idx[:8]).tolist()}{' ...' if doc_idx.size > 8 else ''}")


# --- windows --------------------------------------------------------------------------------

class Batch(NamedTuple):
    """One process's rows of a global batch (numpy; a pytree, so it can enter ``jax.jit``).

    ``inputs``, ``targets``: int32 ``[rows, seq_len]``, ``targets`` the inputs shifted by one.
    With documents honoured (else None):
    ``segment_starts``: int32 ``[rows, segments_per_row]``, the input positions where each row's
    segments begin: 0 (every row starts from a zero state), then each position holding the first
    token of a document, then ``seq_len`` as padding (empty segments), so the shape is the same
    for every batch; :func:`pack_rows` turns it into ``cu_seqlens``.
    ``loss_mask``: float32 ``[rows, seq_len]``, 0 where the target is the first token of a
    document (predicted from the previous document, across the state reset), 1 elsewhere.
    """
    inputs: np.ndarray
    targets: np.ndarray
    segment_starts: Optional[np.ndarray] = None
    loss_mask: Optional[np.ndarray] = None


class WindowSampler:
    """Deterministic windows of ``seq_len + 1`` tokens from ``corpus``, ``global_rows`` per step.

    Window ``w = step * global_rows + g`` fills global row ``g``; process ``process_index`` of
    ``process_count`` gets the rows ``[process_index * rows, (process_index + 1) * rows)`` with
    ``rows = global_rows // process_count``, so a row is a fixed function of (step, process,
    row) and the global batch is the same on any number of processes.

    Windows start on a grid of stride ``seq_len`` (consecutive windows share one token, so each
    token is a target once per epoch). ``mode="sequential"``: window ``w`` starts at
    ``(w mod W) * seq_len``, ``W = (len - 1) // seq_len`` windows per epoch (evaluation).
    ``mode="random"``: in each epoch the grid is shifted by a seeded offset in ``[0, seq_len)``
    (when the corpus leaves that much room; one window per epoch is given up for it) and its
    ``W`` windows are visited in a seeded order: a keyed permutation computed per window
    (a Feistel network), nothing held in memory but the step.

    ``documents=True`` (the corpus must have ``document_starts``): windows still cross
    documents, and each batch carries ``segment_starts`` and ``loss_mask`` (see :class:`Batch`)
    so that the model restarts its state at every document (``cu_seqlens``, :func:`pack_rows`).

    ``next(sampler)`` returns ``batch(step)`` and advances ``step``; ``state()`` / ``restore()``
    save and resume that position exactly.
    """

    def __init__(self, corpus: TokenFile, seq_len: int, global_rows: int, *, mode="random",
                 seed: int = 0, documents: bool = False, process_index: int = 0,
                 process_count: int = 1):
        if not isinstance(corpus, TokenFile):
            raise TypeError(f"corpus must be a TokenFile (open_tokens), got "
                            f"{type(corpus).__name__}")
        for name, value in (("seq_len", seq_len), ("global_rows", global_rows),
                            ("process_count", process_count)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if (isinstance(process_index, bool) or not isinstance(process_index, (int, np.integer))
                or not 0 <= process_index < process_count):
            raise ValueError(f"process_index must be an int in [0, {process_count}), got "
                             f"{process_index!r}")
        if global_rows % process_count:
            raise ValueError(f"global_rows ({global_rows}) must be a multiple of process_count "
                             f"({process_count}): each process reads an equal share of rows")
        if mode not in ("random", "sequential"):
            raise ValueError(f"mode must be 'random' or 'sequential', got {mode!r}")
        if seq_len + 1 > len(corpus):
            raise ValueError(f"seq_len={seq_len} needs windows of {seq_len + 1} tokens, but "
                             f"{corpus.path} holds only {len(corpus)}")
        self.corpus, self.seq_len, self.global_rows = corpus, int(seq_len), int(global_rows)
        self.mode, self.seed, self.documents = mode, int(seed), bool(documents)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.rows = self.global_rows // self.process_count
        self.step = 0
        grid = (len(corpus) - 1) // self.seq_len
        # random: one window fewer than the grid holds leaves room to shift the grid.
        self.windows_per_epoch = grid - 1 if mode == "random" and grid >= 2 else grid
        self._max_shift = min(self.seq_len - 1,
                              len(corpus) - 1 - self.windows_per_epoch * self.seq_len)
        self.segments_per_row = None
        if self.documents:
            starts = corpus.document_starts
            if starts is None:
                raise ValueError(f"documents=True needs document boundaries, and {corpus.path} "
                                 f"has none (binidx files carry them; for flat and .npy files "
                                 f"give open_tokens an eos_id)")
            self._starts = starts
            # The most document starts at input positions 1 .. seq_len-1 of any window.
            inside = np.searchsorted(starts, starts + self.seq_len - 1) - np.arange(len(starts))
            self.segments_per_row = 1 + int(inside.max())

    def window_starts(self, step: int) -> np.ndarray:
        """The corpus offsets (int64 ``[rows]``) of this process's windows at ``step``."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        first = int(step) * self.global_rows + self.process_index * self.rows
        window = np.arange(first, first + self.rows, dtype=np.uint64)
        per_epoch = np.uint64(self.windows_per_epoch)
        epoch, slot = window // per_epoch, window % per_epoch
        if self.mode == "sequential":
            return slot.astype(np.int64) * self.seq_len
        starts = np.empty(self.rows, np.int64)
        for e in np.unique(epoch):  # a batch spans at most two epochs unless epochs are tiny
            here = epoch == e
            shift = _hash(self.seed, int(e), 0) % (self._max_shift + 1)
            order = _permutation(slot[here], self.windows_per_epoch, _hash(self.seed, int(e), 1))
            starts[here] = shift + order.astype(np.int64) * self.seq_len
        return starts

    def batch(self, step: int) -> Batch:
        """This process's rows at ``step`` (any step, in any order: no state is read)."""
        starts = self.window_starts(step)
        offsets = starts[:, None] + np.arange(self.seq_len + 1)
        windows = _as_int32(self.corpus.tokens[offsets], self.corpus.path)
        inputs = np.ascontiguousarray(windows[:, :-1])
        targets = np.ascontiguousarray(windows[:, 1:])
        if not self.documents:
            return Batch(inputs, targets)
        return Batch(inputs, targets, *self._segments(starts))

    def _segments(self, starts):
        length, width = self.seq_len, self.segments_per_row
        # document starts at input positions 1 .. seq_len - 1 (segments) and 1 .. seq_len
        # (masked targets: target i is the token at position i + 1).
        lo = np.searchsorted(self._starts, starts, side="right")
        hi = np.searchsorted(self._starts, starts + length, side="left")
        hi_target = np.searchsorted(self._starts, starts + length, side="right")
        picks = lo[:, None] + np.arange(width - 1)
        found = self._starts[np.minimum(picks, len(self._starts) - 1)] - starts[:, None]
        inner = np.where(picks < hi[:, None], found, length)
        segment_starts = np.concatenate([np.zeros((len(starts), 1), np.int64), inner], axis=1)
        loss_mask = np.ones((len(starts), length), np.float32)
        for row, (a, b) in enumerate(zip(lo, hi_target)):
            loss_mask[row, self._starts[a:b] - starts[row] - 1] = 0
        return segment_starts.astype(np.int32), loss_mask

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        batch = self.batch(self.step)
        self.step += 1
        return batch

    def state(self) -> dict:
        """The position (``step``) and what it means (the fields that fix the windows): ints."""
        return {"step": self.step, "seed": self.seed, "seq_len": self.seq_len,
                "global_rows": self.global_rows, "corpus_tokens": len(self.corpus),
                "random": int(self.mode == "random"), "documents": int(self.documents)}

    def restore(self, state: dict) -> None:
        """Continue from ``state()`` of a sampler over the same corpus and settings (the number
        of processes may differ: the global batch does not depend on it)."""
        mine = self.state()
        if not isinstance(state, dict) or set(state) != set(mine):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must be a dict with keys {sorted(mine)}, got {got}")
        differ = {k: (int(state[k]), v) for k, v in mine.items()
                  if k != "step" and int(state[k]) != v}
        if differ:
            raise ValueError("the saved sampler state is for other windows: "
                             + ", ".join(f"{k} saved {a}, now {b}" for k, (a, b) in differ.items()))
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"state['step'] must be non-negative, got {step}")
        self.step = step


def pack_rows(batch: Batch):
    """Pack each group of rows into one sequence for the model's ``cu_seqlens`` mode (B = 1).

    The arrays may have leading axes (``inputs [..., R, T]``, e.g. ``[micro_batches, R, T]``
    from a reshape) and may be numpy or jax arrays (this runs under ``jax.jit``). Returns
    ``(tokens [..., 1, R*T], targets [..., 1, R*T], cu_seqlens int32 [..., R*S + 1],
    loss_mask [..., 1, R*T])``: the segments of row ``r`` offset by ``r*T``, padded ones empty.
    """
    if batch.segment_starts is None or batch.loss_mask is None:
        raise ValueError("pack_rows needs a batch with segment_starts and loss_mask (a "
                         "WindowSampler with documents=True)")
    xp = np if isinstance(batch.inputs, np.ndarray) else jnp
    *lead, rows, length = batch.inputs.shape
    if tuple(batch.segment_starts.shape[:-1]) != (*lead, rows):
        raise ValueError(f"segment_starts {tuple(batch.segment_starts.shape)} does not match "
                         f"inputs {tuple(batch.inputs.shape)}")
    row_offsets = (xp.arange(rows, dtype=xp.int32) * length)[:, None]
    inner = (batch.segment_starts + row_offsets).reshape(*lead, -1)
    end = xp.full((*lead, 1), rows * length, dtype=xp.int32)
    cu_seqlens = xp.concatenate([inner.astype(xp.int32), end], axis=-1)
    flat = [x.reshape(*lead, 1, rows * length)
            for x in (batch.inputs, batch.targets, batch.loss_mask)]
    return flat[0], flat[1], cu_seqlens, flat[2]


def _as_int32(windows: np.ndarray, path) -> np.ndarray:
    """The ids as int32, refusing any the cast would change."""
    info = np.iinfo(windows.dtype)
    if info.min < 0 and windows.min() < 0:
        raise ValueError(f"{path} holds a negative token id ({int(windows.min())})")
    if info.max > np.iinfo(np.int32).max and windows.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{path} holds token id {int(windows.max())}, beyond int32")
    return windows.astype(np.int32)


_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (a bijection on uint64 that scrambles every bit), elementwise."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _hash(*values: int) -> int:
    h = np.zeros(1, np.uint64)
    for v in values:
        h = _mix(h ^ np.uint64(v & _MASK64))
    return int(h[0])


def _permutation(i: np.ndarray, n: int, key: int, rounds: int = 6) -> np.ndarray:
    """Position ``i`` (uint64, each < n) of a keyed permutation of ``[0, n)``: a balanced Feistel
    network on ``2 * half`` bits (a bijection there), applied again to any value that lands at
    or past ``n`` until it does not (cycle walking keeps it a bijection of ``[0, n)``)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = [np.uint64(_hash(key, r)) for r in range(rounds)]
    x = i.astype(np.uint64)
    todo = np.ones(x.shape, bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half), x[todo] & low
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & low)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x


# --- writing corpora ------------------------------------------------------------------------

def _ids(name, ids, dtype: np.dtype) -> np.ndarray:
    """``ids`` as a 1-D array of ``dtype``, refusing floats and any id the dtype cannot hold."""
    array = np.asarray(ids)
    if array.size == 0:
        array = array.astype(dtype)
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    info = np.iinfo(dtype)
    if array.size and (array.min() < max(info.min, 0) or array.max() > info.max):
        raise ValueError(f"{name} holds ids from {int(array.min())} to {int(array.max())}; "
                         f"{dtype.name} token ids lie in [0, {info.max}]")
    return array.astype(dtype.newbyteorder("<"), copy=False)


def write_tokens(path, ids, dtype) -> None:
    """Write ``ids`` (1-D integers) as a ``.npy`` file when ``path`` ends in ``.npy``, else as a
    flat file of little-endian ``dtype`` ids (atomically: a failed write keeps the old file)."""
    dtype = _token_dtype(dtype, "dtype")
    array = _ids("ids", ids, dtype)
    if os.fspath(path).endswith(".npy"):
        write_atomically(path, lambda f: np.save(f, array, allow_pickle=False))
    else:
        write_atomically(path, lambda f: f.write(array.tobytes()))


def write_binidx(prefix, documents, dtype=np.uint16) -> None:
    """Write ``prefix.bin`` and ``prefix.idx``: one item per document, as RWKV-LM's make_data
    does (it appends the end-of-text id 0 to each document first; this writes them as given).
    The .bin is written first, so a failure leaves the old index, which no longer matches and
    is refused when opened."""
    dtype = _token_dtype(dtype, "dtype")
    codes = {t: c for c, t in _BINIDX_CODES.items()}
    if dtype not in codes:
        raise TypeError(f"binidx has no dtype code for {dtype.name}; use one of "
                        f"{', '.join(t.name for t in codes)}")
    arrays = [_ids(f"documents[{i}]", d, dtype) for i, d in enumerate(documents)]
    sizes = np.array([len(a) for a in arrays], np.int64)
    if sizes.size and sizes.max() > np.iinfo(np.int32).max:
        raise ValueError(f"a binidx item holds at most {np.iinfo(np.int32).max} tokens, got a "
                         f"document of {int(sizes.max())}")
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<i8") * dtype.itemsize
    prefix = os.fspath(prefix)

    def write_data(f):
        for a in arrays:
            f.write(a.tobytes())

    def write_index(f):
        f.write(_BINIDX_HEADER.pack(BINIDX_MAGIC, 1, codes[dtype], len(arrays), len(arrays) + 1))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers[:len(arrays)].tobytes())
        f.write(np.arange(len(arrays) + 1, dtype="<i8").tobytes())

    write_atomically(prefix + ".bin", write_data)
    write_atomically(prefix + ".idx", write_index)


def tokenize_text(source, out_path, *, dtype=np.uint16) -> int:
    """Tokenize text with the RWKV "World" tokenizer (pyrwkv-tokenizer) into a token file.

    ``source``: the text itself (a ``str``) or the path of a UTF-8 text file (an
    ``os.PathLike`` such as ``pathlib.Path``; a plain ``str`` is always taken as text).
    ``out_path``: written as by :func:`write_tokens` (``.npy`` or flat). The vocabulary has
    65,536 slots, so uint16 holds every id. Returns the number of tokens written.
    """
    try:
        import pyrwkv_tokenizer
    except ImportError as e:
        raise ImportError("tokenize_text needs the RWKV tokenizer: pip install pyrwkv-tokenizer "
                          "(or the [tokenizer] extra of rwkv_jax)") from e
    if isinstance(source, os.PathLike):
        _require_file(os.fspath(source))
        with open(source, encoding="utf-8") as f:
            text = f.read()
    elif isinstance(source, str):
        text = source
    else:
        raise TypeError(f"source must be text (str) or a path (os.PathLike), got "
                        f"{type(source).__name__}")
    if not text:
        raise ValueError(f"{source!r} holds no text to tokenize")
    ids = np.asarray(pyrwkv_tokenizer.RWKVTokenizer().encode(text), np.int64)
    write_tokens(out_path, ids, dtype)
    return len(ids)

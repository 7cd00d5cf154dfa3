"""Token corpora and training windows (rwkv_jax.train.data): the three readers against files
written here byte by byte, every malformed file refused with its name before a step, and the
sampler's determinism, resume, coverage, bounds, process sharding and document segments."""

import pathlib
import struct

import jax
import numpy as np
import pytest

from rwkv_jax.train import (Batch, WindowSampler, open_tokens, pack_rows, tokenize_text,
                            write_binidx, write_tokens)
from rwkv_jax.train import data as train_data

RNG = np.random.default_rng(0)


def binidx_bytes(code, sizes, pointers, doc_idx, *, magic=b"MMIDIDX\x00\x00", version=1):
    """An .idx file as the format lays it out: magic, <Q version, <B dtype code, <Q item count,
    <Q document-index count, int32 sizes, int64 pointers, int64 doc_idx."""
    out = magic + struct.pack("<QBQQ", version, code, len(sizes), len(doc_idx))
    out += struct.pack(f"<{len(sizes)}i", *sizes)
    out += struct.pack(f"<{len(pointers)}q", *pointers)
    return out + struct.pack(f"<{len(doc_idx)}q", *doc_idx)


def npy_bytes(descr, shape, payload):
    """A version 1.0 .npy file: magic, version, <H header length, a dict padded to 64 bytes."""
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + payload


def hand_binidx(tmp_path, name="corpus"):
    """Three documents of uint16 ids; the second is two items (an item, then an empty one and
    another), the way Megatron's builder writes sentences: doc_idx [0, 1, 4, 5]."""
    items = [[5, 6, 7], [8, 9], [], [10], [11, 12, 13, 14]]
    sizes = [len(i) for i in items]
    pointers = list(np.concatenate([[0], np.cumsum(sizes)[:-1]]) * 2)
    (tmp_path / f"{name}.bin").write_bytes(
        b"".join(struct.pack(f"<{len(i)}H", *i) for i in items))
    (tmp_path / f"{name}.idx").write_bytes(binidx_bytes(8, sizes, pointers, [0, 1, 4, 5]))
    return tmp_path / name


# --- readers --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,dtype", [("<H", "uint16"), ("<I", "uint32")])
def test_flat_file_written_by_hand(tmp_path, fmt, dtype, monkeypatch):
    ids = [3, 70, 0, 9, 9, 0, 4, 65535]
    path = tmp_path / "corpus.bin"
    path.write_bytes(b"".join(struct.pack(fmt, i) for i in ids))
    corpus = open_tokens(path, dtype)
    assert corpus.format == "flat" and len(corpus) == len(ids)
    np.testing.assert_array_equal(corpus.tokens, ids)
    assert not corpus.tokens.flags.writeable
    assert corpus.document_starts is None and corpus.vocab_bound == 65536
    monkeypatch.setattr(train_data, "_SCAN_CHUNK", 3)  # separators found across scan chunks
    np.testing.assert_array_equal(open_tokens(path, dtype, eos_id=0).document_starts, [0, 3, 6])
    np.testing.assert_array_equal(open_tokens(path, dtype, eos_id=65535).document_starts, [0])
    assert open_tokens(path, dtype).vocab_bound == 65536


@pytest.mark.parametrize("descr,fmt", [("<u2", "<H"), ("<i4", "<i"), ("<u4", "<I")])
def test_npy_file_written_by_hand(tmp_path, descr, fmt):
    ids = [1, 0, 2, 50000, 0, 7]
    path = tmp_path / "corpus.npy"
    path.write_bytes(npy_bytes(descr, (len(ids),), struct.pack(f"{fmt[0]}{len(ids)}{fmt[1]}",
                                                                  *ids)))
    corpus = open_tokens(path, eos_id=0)  # the dtype comes from the header
    assert corpus.format == "npy" and corpus.tokens.dtype == np.dtype(descr)
    np.testing.assert_array_equal(corpus.tokens, ids)
    np.testing.assert_array_equal(corpus.document_starts, [0, 2, 5])
    assert corpus.vocab_bound == 50001
    open_tokens(path, descr)  # a matching dtype is accepted


def test_binidx_written_by_hand(tmp_path):
    prefix = hand_binidx(tmp_path)
    for name in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
        corpus = open_tokens(name)
        assert corpus.format == "binidx" and corpus.tokens.dtype == np.uint16
        np.testing.assert_array_equal(corpus.tokens, np.arange(5, 15))
        np.testing.assert_array_equal(corpus.document_starts, [0, 3, 6])
        assert corpus.vocab_bound == 15
    corpus.check_vocab(15)
    with pytest.raises(ValueError, match=r"corpus.bin holds token id 14, outside .*\[0, 14\)"):
        corpus.check_vocab(14)


def test_writers_give_the_bytes_of_the_format(tmp_path):
    docs = [RNG.integers(0, 65536, n) for n in (4, 0, 7)]
    write_binidx(tmp_path / "w", docs, np.uint16)
    sizes = [4, 0, 7]
    assert (tmp_path / "w.idx").read_bytes() == binidx_bytes(8, sizes, [0, 8, 8], [0, 1, 2, 3])
    assert (tmp_path / "w.bin").read_bytes() == np.concatenate(docs).astype("<u2").tobytes()
    np.testing.assert_array_equal(open_tokens(tmp_path / "w").document_starts, [0, 4])
    ids = RNG.integers(0, 2**32, 9, dtype=np.uint64)
    write_tokens(tmp_path / "flat.u32", ids, np.uint32)
    assert (tmp_path / "flat.u32").read_bytes() == struct.pack("<9I", *ids.tolist())
    write_tokens(tmp_path / "ids.npy", ids[:5] % 60000, "uint16")
    np.testing.assert_array_equal(open_tokens(tmp_path / "ids.npy", np.uint16).tokens,
                                  ids[:5] % 60000)


def test_writers_refuse_ids_the_dtype_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match=r"ids from 0 to 70000; uint16 token ids lie in"):
        write_tokens(tmp_path / "a.bin", [0, 70000], np.uint16)
    with pytest.raises(ValueError, match=r"ids from -1"):
        write_tokens(tmp_path / "a.bin", [-1, 3], np.int32)
    with pytest.raises(TypeError, match="integer token ids, got dtype float64"):
        write_tokens(tmp_path / "a.bin", [1.0, 2.0], np.uint16)
    with pytest.raises(TypeError, match="no dtype code for uint32"):
        write_binidx(tmp_path / "b", [[1, 2]], np.uint32)
    assert not list(tmp_path.iterdir())


def test_tokenize_text(tmp_path):
    import pyrwkv_tokenizer
    text = "It was the best of times, it was the worst of times.\nÇa va? 東京"
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    count = tokenize_text(tmp_path / "book.txt", tmp_path / "book.bin")
    corpus = open_tokens(tmp_path / "book.bin", np.uint16)
    assert count == len(corpus) > 10
    assert pyrwkv_tokenizer.RWKVTokenizer().decode(corpus.tokens.tolist()) == text
    assert tokenize_text(text, tmp_path / "text.npy") == count  # a str is the text itself
    np.testing.assert_array_equal(open_tokens(tmp_path / "text.npy").tokens, corpus.tokens)
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        tokenize_text(tmp_path / "missing.txt", tmp_path / "x.bin")


# --- malformed files ------------------------------------------------------------------------

def _corrupt_binidx(tmp_path, what):
    prefix = hand_binidx(tmp_path)
    idx, bin_ = pathlib.Path(f"{prefix}.idx"), pathlib.Path(f"{prefix}.bin")
    sizes, pointers, doc_idx = [3, 2, 0, 1, 4], [0, 6, 10, 10, 12], [0, 1, 4, 5]
    if what == "magic":
        idx.write_bytes(binidx_bytes(8, sizes, pointers, doc_idx, magic=b"MMIDIDX\x00\x01"))
    elif what == "version":
        idx.write_bytes(binidx_bytes(8, sizes, pointers, doc_idx, version=2))
    elif what == "float code":
        idx.write_bytes(binidx_bytes(6, sizes, pointers, doc_idx))
    elif what == "unknown code":
        idx.write_bytes(binidx_bytes(9, sizes, pointers, doc_idx))
    elif what == "truncated index":
        idx.write_bytes(idx.read_bytes()[:-3])
    elif what == "short header":
        idx.write_bytes(idx.read_bytes()[:20])
    elif what == "truncated bin":
        bin_.write_bytes(bin_.read_bytes()[:-3])
    elif what == "size past the end":
        idx.write_bytes(binidx_bytes(8, [3, 2, 0, 1, 5], pointers, doc_idx))
    elif what == "pointer past the end":
        idx.write_bytes(binidx_bytes(8, sizes, [0, 6, 10, 10, 30], doc_idx))
    elif what == "gap":
        idx.write_bytes(binidx_bytes(8, sizes, [0, 8, 10, 10, 12], doc_idx))
    elif what == "first item not at 0":
        idx.write_bytes(binidx_bytes(8, [3, 2, 0, 1, 3], [2, 8, 12, 12, 14], doc_idx))
    elif what == "longer bin":
        bin_.write_bytes(bin_.read_bytes() + b"\x00\x00")
    elif what == "doc_idx":
        idx.write_bytes(binidx_bytes(8, sizes, pointers, [0, 4, 1, 5]))
    elif what == "missing bin":
        bin_.unlink()
    return prefix


BAD_BINIDX = {
    "magic": (ValueError, r"corpus.idx is not a binidx index: it starts with b'MMIDIDX"),
    "version": (ValueError, r"corpus.idx has index version 2; only version 1"),
    "float code": (TypeError, r"corpus.idx has dtype code 6: a floating-point type, not a token"),
    "unknown code": (TypeError, r"corpus.idx has dtype code 9: not a known code"),
    "truncated index": (ValueError, r"corpus.idx is 123 bytes, but its header \(5 items, 4 "
                                    r"document entries\) needs 126: truncated"),
    "short header": (ValueError, r"corpus.idx is truncated: 20 bytes"),
    "truncated bin": (ValueError, r"item 4 \(bytes 12 to 20\) runs past the end of .*corpus.bin "
                                  r"\(17 bytes\): the .bin is shorter than its index says"),
    "size past the end": (ValueError, r"item 4 \(bytes 12 to 22\) runs past the end"),
    "pointer past the end": (ValueError, r"item 4 \(bytes 30 to 38\) runs past the end"),
    "gap": (ValueError, r"item 1 starts at byte 8, not where item 0 ends \(6\)"),
    "first item not at 0": (ValueError, r"item 0 starts at byte 2, not at byte 0; items must"),
    "longer bin": (ValueError, r"corpus.bin is 22 bytes but its index .*corpus.idx describes 20"),
    "doc_idx": (ValueError, r"the document index must rise from 0 .* got \[0, 4, 1, 5\]"),
    "missing bin": (FileNotFoundError, r"corpus.bin does not exist"),
}


@pytest.mark.parametrize("what", list(BAD_BINIDX))
def test_malformed_binidx_is_refused(tmp_path, what):
    prefix = _corrupt_binidx(tmp_path, what)
    error, message = BAD_BINIDX[what]
    with pytest.raises(error, match=message):
        open_tokens(prefix)


def test_malformed_flat_and_npy_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="none.bin does not exist"):
        open_tokens(tmp_path / "none.bin", np.uint16)
    with pytest.raises(FileNotFoundError, match="none.npy does not exist"):
        open_tokens(tmp_path / "none.npy")
    flat = tmp_path / "odd.bin"
    flat.write_bytes(struct.pack("<3H", 1, 2, 3) + b"\x07")
    with pytest.raises(ValueError, match=r"odd.bin is truncated: 7 bytes is not a whole number of "
                                         r"uint16 ids"):
        open_tokens(flat, np.uint16)
    with pytest.raises(ValueError, match=r"odd.bin is a flat token file: give its dtype"):
        open_tokens(flat)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.bin holds no tokens"):
        open_tokens(tmp_path / "empty.bin", np.uint32)
    with pytest.raises(TypeError, match=r"dtype must be one of .* got float32"):
        open_tokens(flat, np.float32)
    npy = tmp_path / "grid.npy"
    npy.write_bytes(npy_bytes("<u2", (2, 2), struct.pack("<4H", 1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"grid.npy must hold a 1-D array of token ids, got shape "
                                         r"\(2, 2\)"):
        open_tokens(npy)
    npy.write_bytes(npy_bytes("<f4", (2,), struct.pack("<2f", 1, 2)))
    with pytest.raises(TypeError, match=r"the dtype of .*grid.npy must be one of .* got float32"):
        open_tokens(npy)
    npy.write_bytes(npy_bytes("<u2", (9,), struct.pack("<4H", 1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"grid.npy is not a readable .npy file"):
        open_tokens(npy)
    npy.write_bytes(npy_bytes("<i4", (3,), struct.pack("<3i", 4, -2, 1)))
    with pytest.raises(ValueError, match=r"grid.npy holds a negative token id \(-2\) at "
                                         r"position 1"):
        open_tokens(npy).vocab_bound
    with pytest.raises(ValueError, match=r"grid.npy holds a negative token id \(-2\)"):
        WindowSampler(open_tokens(npy), 2, 1, mode="sequential").batch(0)
    with pytest.raises(TypeError, match=r"grid.npy holds int32 ids, but dtype=uint16"):
        open_tokens(npy, np.uint16)
    with pytest.raises(ValueError, match=r"binidx corpus; eos_id is for flat and .npy files"):
        open_tokens(hand_binidx(tmp_path), eos_id=0)
    with pytest.raises(TypeError, match=r"eos_id must be a non-negative int"):
        open_tokens(flat, np.uint16, eos_id=-1)


def test_sampler_arguments_are_checked(tmp_path):
    corpus = open_tokens(hand_binidx(tmp_path))  # 10 tokens
    with pytest.raises(ValueError, match=r"seq_len=10 needs windows of 11 tokens, but .*corpus.bin "
                                         r"holds only 10"):
        WindowSampler(corpus, 10, 1)
    WindowSampler(corpus, 9, 1)  # the longest that fits
    with pytest.raises(ValueError, match=r"seq_len must be a positive int, got 0"):
        WindowSampler(corpus, 0, 1)
    with pytest.raises(ValueError, match=r"global_rows \(6\) must be a multiple of process_count "
                                         r"\(4\)"):
        WindowSampler(corpus, 2, 6, process_count=4)
    with pytest.raises(ValueError, match=r"process_index must be an int in \[0, 2\), got 2"):
        WindowSampler(corpus, 2, 4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"mode must be 'random' or 'sequential'"):
        WindowSampler(corpus, 2, 4, mode="shuffled")
    flat = tmp_path / "flat.bin"
    write_tokens(flat, np.arange(20), np.uint16)
    with pytest.raises(ValueError, match=r"documents=True needs document boundaries, and "
                                         r".*flat.bin has none"):
        WindowSampler(open_tokens(flat, np.uint16), 4, 2, documents=True)
    with pytest.raises(ValueError, match="pack_rows needs a batch with segment_starts"):
        pack_rows(WindowSampler(open_tokens(flat, np.uint16), 4, 2).batch(0))
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        WindowSampler(corpus, 2, 4).batch(-1)


# --- the sampler ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A flat corpus whose id at each position is the position, so a window shows its start."""
    path = tmp_path_factory.mktemp("corpus") / "positions.bin"
    write_tokens(path, np.arange(1003), np.uint32)
    return open_tokens(path, np.uint32)


def test_batches_are_windows_shifted_by_one(corpus):
    sampler = WindowSampler(corpus, 16, 8, seed=1)
    batch = sampler.batch(3)
    assert batch.inputs.dtype == batch.targets.dtype == np.int32
    assert batch.inputs.shape == batch.targets.shape == (8, 16)
    np.testing.assert_array_equal(batch.inputs, sampler.window_starts(3)[:, None] + np.arange(16))
    np.testing.assert_array_equal(batch.targets, batch.inputs + 1)
    assert batch.segment_starts is None and batch.loss_mask is None


def test_sampler_is_deterministic(corpus):
    a, b = WindowSampler(corpus, 16, 8, seed=5), WindowSampler(corpus, 16, 8, seed=5)
    for step in (0, 1, 7, 1000):
        np.testing.assert_array_equal(a.batch(step).inputs, b.batch(step).inputs)
    other = WindowSampler(corpus, 16, 8, seed=6)
    assert not np.array_equal(a.window_starts(0), other.window_starts(0))


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_restore_continues_exactly(corpus, mode):
    run = WindowSampler(corpus, 16, 8, seed=2, mode=mode)
    for _ in range(7):
        next(run)
    saved = run.state()
    assert all(type(v) is int for v in saved.values()) and saved["step"] == 7
    expected = [next(run).inputs for _ in range(12)]  # crosses into the next epochs
    resumed = WindowSampler(corpus, 16, 8, seed=2, mode=mode)
    resumed.restore(saved)
    np.testing.assert_array_equal([next(resumed).inputs for _ in range(12)], expected)
    with pytest.raises(ValueError, match=r"for other windows: seed saved 2, now 3"):
        WindowSampler(corpus, 16, 8, seed=3, mode=mode).restore(saved)
    with pytest.raises(ValueError, match=r"seq_len saved 16, now 32"):
        WindowSampler(corpus, 32, 8, seed=2, mode=mode).restore(saved)
    with pytest.raises(ValueError, match=r"state must be a dict with keys"):
        resumed.restore({"step": 3})


def test_sequential_covers_every_target_once_per_epoch(corpus):
    sampler = WindowSampler(corpus, 16, 2, mode="sequential")
    assert sampler.windows_per_epoch == 62  # (1003 - 1) // 16
    starts = np.concatenate([sampler.window_starts(s) for s in range(31)])
    np.testing.assert_array_equal(starts, np.arange(62) * 16)
    targets = np.concatenate([sampler.batch(s).targets.ravel() for s in range(31)])
    np.testing.assert_array_equal(targets, np.arange(1, 62 * 16 + 1))
    np.testing.assert_array_equal(sampler.window_starts(31), [0, 16])  # then it starts again


@pytest.mark.parametrize("tokens,seq_len", [(1003, 16), (40, 7), (18, 16), (17, 16), (300, 1)])
def test_random_epochs_visit_each_window_once_within_bounds(tmp_path, tokens, seq_len):
    write_tokens(tmp_path / "c.bin", np.arange(tokens), np.uint16)
    sampler = WindowSampler(open_tokens(tmp_path / "c.bin", np.uint16), seq_len, 1, seed=9)
    per_epoch = sampler.windows_per_epoch
    assert per_epoch == max(1, (tokens - 1) // seq_len - 1)
    shifts = set()
    for epoch in range(4):
        starts = np.concatenate([sampler.window_starts(epoch * per_epoch + i)
                                 for i in range(per_epoch)])
        assert starts.min() >= 0 and starts.max() + seq_len + 1 <= tokens
        shift = starts.min()
        shifts.add(int(shift))
        assert shift < seq_len
        np.testing.assert_array_equal(np.sort(starts), shift + np.arange(per_epoch) * seq_len)
        if per_epoch > 4:
            assert not np.array_equal(starts, np.sort(starts))  # shuffled
    if tokens - 1 >= 2 * seq_len and seq_len > 4:
        assert len(shifts) > 1  # the grid moves between epochs


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000])
def test_keyed_permutation_is_a_bijection(n):
    order = train_data._permutation(np.arange(n, dtype=np.uint64), n, key=12345)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    if n >= 64:
        other = train_data._permutation(np.arange(n, dtype=np.uint64), n, key=54321)
        assert not np.array_equal(order, other)


@pytest.mark.parametrize("mode,documents", [("random", False), ("sequential", False),
                                            ("random", True)])
def test_processes_read_their_rows_of_the_global_batch(tmp_path, corpus, mode, documents):
    if documents:
        write_binidx(tmp_path / "d", [RNG.integers(0, 99, n) for n in RNG.integers(1, 30, 40)])
        corpus = open_tokens(tmp_path / "d")
    whole = WindowSampler(corpus, 8, 6, mode=mode, seed=4, documents=documents)
    parts = [WindowSampler(corpus, 8, 6, mode=mode, seed=4, documents=documents,
                           process_index=p, process_count=2) for p in range(2)]
    assert parts[0].rows == 3
    for step in (0, 5, 33):
        batches = [p.batch(step) for p in parts]
        for field, value in zip(Batch._fields, whole.batch(step)):
            if value is not None:
                np.testing.assert_array_equal(
                    np.concatenate([getattr(b, field) for b in batches]), value)
    resumed = WindowSampler(corpus, 8, 6, mode=mode, seed=4, documents=documents,
                            process_index=1, process_count=2)
    resumed.restore(whole.state())  # a checkpoint of one process resumes on two
    np.testing.assert_array_equal(next(resumed).inputs, whole.batch(0).inputs[3:])


def test_documents_give_segments_cu_seqlens_and_loss_mask(tmp_path):
    # documents [0..3), [3..5), [5..7), [7..12), [12..20): they start at 0, 3, 5, 7, 12
    write_binidx(tmp_path / "d", [np.arange(a, b) for a, b in
                                  [(0, 3), (3, 5), (5, 7), (7, 12), (12, 20)]])
    sampler = WindowSampler(open_tokens(tmp_path / "d"), 6, 3, mode="sequential",
                            documents=True)
    # the most document starts at positions 1..5 of a window: 3, 5, 7 (from a window at 2)
    assert sampler.segments_per_row == 4
    batch = sampler.batch(0)  # windows at 0, 6, 12
    np.testing.assert_array_equal(batch.inputs, np.arange(18).reshape(3, 6))
    np.testing.assert_array_equal(batch.segment_starts, [[0, 3, 5, 6], [0, 1, 6, 6],
                                                         [0, 6, 6, 6]])
    # targets 3, 5 (row 0), 7 and 12 (row 1, its first and last) start documents
    np.testing.assert_array_equal(batch.loss_mask, [[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 0],
                                                    [1, 1, 1, 1, 1, 1]])
    tokens, targets, cu_seqlens, mask = pack_rows(batch)
    assert tokens.shape == targets.shape == mask.shape == (1, 18)
    assert cu_seqlens.dtype == np.int32
    np.testing.assert_array_equal(cu_seqlens, [0, 3, 5, 6, 6, 7, 12, 12, 12, 18, 18, 18, 18])
    np.testing.assert_array_equal(tokens[0], np.arange(18))
    np.testing.assert_array_equal(targets[0], np.arange(1, 19))
    np.testing.assert_array_equal(mask[0], batch.loss_mask.ravel())


def test_segments_match_document_ids_of_every_token(tmp_path):
    """On random documents (many in one window, some longer than it), random windows: each
    segment is one document, each boundary is a segment, masked targets are document starts."""
    lengths = RNG.integers(1, 12, 60)
    write_binidx(tmp_path / "d", [RNG.integers(0, 50, n) for n in lengths])
    document_of = np.repeat(np.arange(len(lengths)), lengths)
    sampler = WindowSampler(open_tokens(tmp_path / "d"), 10, 4, seed=3, documents=True)
    for step in range(6):
        batch, starts = sampler.batch(step), sampler.window_starts(step)
        for row, s in enumerate(starts):
            docs = document_of[s:s + 11]
            boundaries = np.flatnonzero(np.diff(docs[:10])) + 1
            segments = batch.segment_starts[row]
            np.testing.assert_array_equal(segments[segments < 10], np.concatenate([[0],
                                                                                   boundaries]))
            np.testing.assert_array_equal(batch.loss_mask[row], docs[1:] == docs[:-1])
    # packed per micro-batch (a leading axis), under jax.jit as in a training step
    micro = Batch(*(x.reshape(2, 2, *x.shape[1:]) for x in batch))
    packed = jax.jit(pack_rows)(micro)
    expected = [pack_rows(Batch(*(x[i] for x in micro))) for i in range(2)]
    for got, want in zip(packed, zip(*expected)):
        np.testing.assert_array_equal(got, np.stack(want))

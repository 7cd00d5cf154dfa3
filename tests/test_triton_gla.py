"""The triton GLA / RWKV-6 kernels (triton_kernels/gla.py) where the shared suite does not
reach: several V blocks per head (the K-side gradient kernel summing over them), several K
blocks (the V-side kernel summing over them, the state gradient's grid over both), saved
states every 2 forward chunks so that short packed sequences cross span boundaries, spans
(the backward's chunks) of 32 and 64 tokens (packed sequences shorter than a chunk, partial
chunks, odd T, T = 1, strong gates), every GLA gate with reverse and packed sequences (an empty
segment, partial chunks) together, strong gates across chunk and span boundaries. Against the
float64 reference, forward and every gradient, through test_ops.check_case (tiny shapes:
Triton's interpreter)."""

import pytest

from rwkv_jax.backends import triton as triton_backend
from test_ops import Case, check_case

GATES = ("g", "g_gamma", "gk", "gv")
PACKED = [0, 0, 17, 57, 70]  # empty, partial chunk, several spans of 2 chunks, short


def _chunks(monkeypatch, forward, span):
    for name, value in zip(("GLA_CHUNK", "GLA_SPAN"), (forward, span)):
        monkeypatch.setattr(triton_backend, name, value)


# (forward chunk, span = the backward's chunk), the backend's settings: saved states every 2
# forward chunks (every test's), the default span of 4 chunks, and one chunk per span.
CHUNKS = [(16, 32), (16, 64), (64, 64)]
chunk_ids = lambda c: "chunks=%d,%d" % c


@pytest.fixture(autouse=True)
def short_spans(monkeypatch):
    _chunks(monkeypatch, *CHUNKS[0])


@pytest.mark.parametrize("reverse", [False, True])
def test_gla_every_gate_packed_several_v_blocks(reverse):
    case = Case("gated_linear_attention",
                dict(gates=GATES, batch=1, steps=70, key=32, value=128, state_rows=4),
                dict(cu_seqlens=PACKED, reverse=reverse, scale=0.3))
    check_case("triton", case, seed=11 + reverse)


def test_rwkv6_packed_several_v_blocks_strong_decays():
    case = Case("rwkv6", dict(batch=1, steps=70, key=32, value=128, state_rows=4,
                              decay=("uniform", -50.0)), dict(cu_seqlens=PACKED))
    check_case("triton", case, seed=5)


@pytest.mark.parametrize("gate", ["gk", "gv"])
def test_gla_strong_gates_across_spans(gate):
    case = Case("gated_linear_attention",
                dict(gates=(gate,), batch=2, steps=70, key=16, value=48,
                     decay=("every_third", -1e9)), dict(reverse=gate == "gv"))
    check_case("triton", case, seed=3)


@pytest.mark.parametrize("chunks", CHUNKS[1:], ids=chunk_ids)
@pytest.mark.parametrize("op", ["gated_linear_attention", "rwkv6"])
def test_other_chunk_sizes_packed_strong_gates(monkeypatch, op, chunks):
    _chunks(monkeypatch, *chunks)
    drawn = dict(batch=1, steps=70, key=16, value=32, state_rows=4,
                 decay=("every_third", -1e9))
    options = dict(cu_seqlens=PACKED)
    if op == "gated_linear_attention":
        drawn["gates"] = GATES
        options["reverse"] = True
    check_case("triton", Case(op, drawn, options), seed=7)


@pytest.mark.parametrize("chunks", CHUNKS, ids=chunk_ids)
@pytest.mark.parametrize("op, steps", [("gated_linear_attention", 37), ("rwkv6", 1)])
def test_odd_and_single_step_lengths(monkeypatch, op, steps, chunks):
    _chunks(monkeypatch, *chunks)
    drawn = dict(batch=2, steps=steps, key=16, value=32)
    if op == "gated_linear_attention":
        drawn["gates"] = GATES
    check_case("triton", Case(op, drawn, {}), seed=steps)


@pytest.mark.parametrize("op, key, value", [("gated_linear_attention", 128, 64),
                                            ("rwkv6", 64, 128)])
def test_head_sizes_of_several_k_and_v_blocks(monkeypatch, op, key, value):
    """The backward's blocks at the default span: K-side programs of 16 keys each summing
    over V blocks, V-side programs summing over K blocks of 64, the state gradient's grid
    over both (packed with an empty segment, strong gates, chunks crossing the 64-token
    spans)."""
    _chunks(monkeypatch, *CHUNKS[1])
    drawn = dict(batch=1, steps=70, key=key, value=value, state_rows=3,
                 decay=("every_third", -1e9))
    options = dict(cu_seqlens=[0, 3, 3, 70])
    if op == "gated_linear_attention":
        drawn["gates"] = GATES
    check_case("triton", Case(op, drawn, options), seed=key + value)

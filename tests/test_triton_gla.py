"""The triton GLA / RWKV-6 kernels (triton_kernels/gla/) where the shared suite does not
reach: several V blocks (the K-side gradient kernel summing over them) and several K blocks
(the V-side kernel summing over them, the state passes' grids over both), chunks (spans) of
16, 32 and 64 tokens (packed sequences shorter than a chunk, partial chunks, odd T, T = 1,
strong gates), every GLA gate with reverse and packed sequences (an empty segment, partial
chunks) together, strong gates across chunk boundaries, the tame and exact builds chosen per
call. Against the float64 reference, forward and every gradient, through test_ops.check_case
(tiny shapes: Triton's interpreter)."""

import jax
import jax.numpy as jnp
import pytest

from rwkv_jax.backends.triton import gla as triton_gla
from test_ops import Case, check_case, make_inputs

GATES = ("g", "g_gamma", "gk", "gv")
PACKED = [0, 0, 17, 57, 70]  # empty, partial chunk, several spans of 2 chunks, short


def _chunks(monkeypatch, span):
    monkeypatch.setattr(triton_gla, "GLA_SPAN", span)


def _tame(a, cu, reverse=False):
    """Whether the state pass sends key gates ``a`` ([rows, H, K]) of sequences ``cu`` (in
    their direction) down the tame path."""
    x = jnp.ones((1,) + a.shape, jnp.float32)
    static = triton_gla._gla_static(x, x, x, a[None], None, None, 1.0, reverse)
    h0 = jnp.zeros((len(cu) - 1,) + a.shape[1:] + a.shape[-1:], jnp.float32)
    states = jax.jit(lambda a: triton_gla._gla_states(static, x[0], x[0], a, None, h0,
                                                          jnp.asarray(cu, jnp.int32)))
    return bool(states(a)[2])


# Chunks (spans) of the forward and backward: shorter than the default so that short sequences
# cross several (every test's), and the others.
CHUNKS = [32, 16, 64]
chunk_ids = lambda c: "chunk=%d" % c


@pytest.fixture(autouse=True)
def short_spans(monkeypatch):
    _chunks(monkeypatch, CHUNKS[0])


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
    _chunks(monkeypatch, chunks)
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
    _chunks(monkeypatch, chunks)
    drawn = dict(batch=2, steps=steps, key=16, value=32)
    if op == "gated_linear_attention":
        drawn["gates"] = GATES
    check_case("triton", Case(op, drawn, {}), seed=steps)


@pytest.mark.parametrize("op", ["gated_linear_attention", "rwkv6"])
def test_default_span_several_chunks_packed_key_128(monkeypatch, op):
    """The default span (64 tokens, the forward's chunk) with K = 128 (the forward's K blocks)
    and V = 32: packed sequences of several chunks that end mid-chunk, one of a single token
    in its last chunk, an empty segment, strong gates inside chunks."""
    _chunks(monkeypatch, 64)
    drawn = dict(batch=1, steps=215, key=128, value=32, state_rows=3,
                 decay=("every_third", -1e9))
    options = dict(cu_seqlens=[0, 150, 150, 215])
    if op == "gated_linear_attention":
        drawn["gates"] = ("gk", "gv")
        options["reverse"] = True
    check_case("triton", Case(op, drawn, options), seed=13)


@pytest.mark.parametrize("op, decay, tame, key, value", [
    ("gated_linear_attention", ("uniform", -0.2), True, 32, 96),
    ("rwkv6", ("uniform", -0.5), True, 48, 32),
    ("rwkv6", "strong", False, 32, 32)])
def test_tame_and_exact_paths_per_call(monkeypatch, op, decay, tame, key, value):
    """Log gates whose chunk sums are >= -GLA_TAME_SUM take the tame path (pair factors
    referenced to the chunk's middle: the output kernel's scores, the gradient kernels' pairs),
    stronger ones the exact build; both match the float64 reference (a tame call also when
    forced onto the exact build). Default span, packed sequences of several chunks ending
    mid-chunk, one shorter than a chunk, an empty segment; GLA with every gate, reverse, two V
    blocks (one partial); RWKV-6 with K = 48: the tame K-side program's last step of 16 keys
    past K."""
    _chunks(monkeypatch, 64)
    drawn = dict(batch=1, steps=140, key=key, value=value, state_rows=3, decay=decay)
    options = dict(cu_seqlens=[0, 5, 5, 140])
    if op == "gated_linear_attention":
        drawn["gates"] = GATES
        options["reverse"] = True
    case = Case(op, drawn, options)
    x = make_inputs(case, seed=17)[0]
    if op == "rwkv6":
        a = x["w"]
    else:  # the key-side log gate the backend sums
        a = (x["gk"].astype(jnp.float32) + x["g"].astype(jnp.float32)[..., None]
             + x["g_gamma"].astype(jnp.float32)[:, None])
    assert _tame(a[0], options["cu_seqlens"], options.get("reverse", False)) is tame
    check_case("triton", case, seed=17)
    if tame:
        monkeypatch.setattr(triton_gla, "GLA_OVERRIDES", {"tame": False})
        check_case("triton", case, seed=17)


@pytest.mark.parametrize("dtype, by_product", [("float32", False), ("bfloat16", True)])
def test_tame_path_criterion(monkeypatch, dtype, by_product):
    """The state pass sums every chunk's key gates per channel: a call is tame while none sums
    below -GLA_TAME_SUM (64). The chunks are the kernels' (from each sequence's start, or its
    end if reverse); -inf and NaN take the exact path. Also with the sums as products
    (_GlaStatic.gate_sums_by_product, bfloat16 gates)."""
    _chunks(monkeypatch, 64)
    monkeypatch.setattr(triton_gla, "GLA_OVERRIDES", {"gate_sums_by_product": by_product})
    # Chunks of 64 rows sum to -57.6 (bfloat16: -57.5), of 36 to -32.4
    gates = jnp.full((100, 2, 3), -0.9, dtype)
    assert _tame(gates, [0, 100]) and _tame(gates, [0, 100], reverse=True)
    assert not _tame(gates * 1.2, [0, 100])  # -69.1
    assert _tame(gates * 1.2, [0, 50, 100])  # two sequences of 50 rows: -54
    for value in (-jnp.inf, jnp.nan, -10.0):  # in the first chunk: -66.7 with -10
        assert not _tame(gates.at[10, 1, 2].set(value), [0, 100])
    # In the chunk of 36 rows, the first in reverse: -41.5
    assert _tame(gates.at[10, 1, 2].set(-10.0), [0, 100], reverse=True)
    assert _tame(gates.at[70, 1, 2].set(-30.0), [0, 100])  # -61.5


SCANS = {"gate_sums_by_product": False}


def _check_packed_with_overrides(monkeypatch, op, decay, overrides, key, reverse, dtype, seed):
    """One op under _GlaStatic overrides on the default span: packed sequences of several
    chunks (one empty, one shorter than a chunk) with V = 96 (two V blocks, one partial); GLA
    with its key gate gk (in ``reverse`` if asked)."""
    _chunks(monkeypatch, 64)
    monkeypatch.setattr(triton_gla, "GLA_OVERRIDES", overrides)
    drawn = dict(batch=1, steps=140, key=key, value=96, state_rows=3, decay=decay)
    options = dict(cu_seqlens=[0, 5, 5, 140])
    if op == "gated_linear_attention":
        drawn["gates"] = ("gk",)
        options["reverse"] = reverse
    check_case("triton", Case(op, drawn, options, dtype=dtype), seed=seed)


@pytest.mark.parametrize("op, decay, overrides", [
    ("gated_linear_attention", ("uniform", -0.2), {}), ("rwkv6", "strong", {}),
    ("gated_linear_attention", ("uniform", -0.2), SCANS), ("rwkv6", "strong", SCANS),
    ("rwkv6", ("uniform", -0.5), {})])
def test_bfloat16_inputs(monkeypatch, op, decay, overrides):
    """bfloat16 inputs: the states saved per chunk (and their gradients) in bfloat16, the K-side
    gradient kernel's products of two stored 16-bit tiles (dO v^T, dO H^T, v dH^T) taken as
    they are (common.dot), and the decayed operands of the sequential passes and the output
    kernel rounded to bfloat16 (rounded_products); the key-gate sums as products
    (gate_sums_by_product, the default for bfloat16 gates) and as scans. GLA's gk on the tame
    path with reverse, RWKV-6 with strong decays on the exact one (and model ones on the tame
    one); packed sequences of several chunks, an empty segment, two V blocks."""
    _check_packed_with_overrides(monkeypatch, op, decay, overrides, key=32, reverse=True,
                                 dtype="bfloat16", seed=19)


def test_sixteen_bit_path_only_without_float32():
    """bfloat16 saved states and tf32 products for 16-bit inputs, and rounded 16-bit operands
    for bfloat16 ones (not float16: its range would not hold every score); float32 anywhere
    (here the key gate GLA sums with a float32 g_gamma) keeps float32 states and tf32x3."""
    x = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
    static = triton_gla._gla_static(x, x, x, x, None, None, 1.0, False)
    assert static.bf16_states and static.precision == "tf32" and static.rounded_products
    half = x.astype(jnp.float16)
    static = triton_gla._gla_static(half, half, half, half, None, None, 1.0, False)
    assert static.bf16_states and not static.rounded_products
    static = triton_gla._gla_static(x, x, x, x.astype(jnp.float32), None, None, 1.0, False)
    assert not static.bf16_states and static.precision == "tf32x3"
    assert not static.rounded_products


@pytest.mark.parametrize("op, decay, overrides", [
    ("gated_linear_attention", ("uniform", -0.2), {"blocks_fastest": False}),
    ("rwkv6", "strong", {"blocks_fastest": False}),
    ("gated_linear_attention", ("uniform", -0.2), {"state_block_v": 128}),
    ("rwkv6", "strong", {"state_block_v": 32})])
def test_launch_orders_and_state_blocks(monkeypatch, op, decay, overrides):
    """Grids with the blocks slowest (the default has them fastest, _GlaStatic.blocks_fastest)
    and state passes on V blocks of their own (one block wider than V, three blocks). K = 128
    (two K blocks in the state passes; the exact K-side kernel's programs of 16 keys) and V = 96
    (two V blocks, one partial), packed with an empty segment; GLA's gk on the tame path,
    RWKV-6 with strong decays on the exact one."""
    _check_packed_with_overrides(monkeypatch, op, decay, overrides, key=128, reverse=False,
                                 dtype="float32", seed=23)

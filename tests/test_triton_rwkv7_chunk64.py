"""The 64-token-chunk RWKV-7 forward (``triton.forward_chunk64``; docs/DESIGN.md, "RWKV-7 at
64-token chunks", the kernels in triton_kernels/rwkv7/) against the float64 reference,
on CPU through Triton's interpreter: both in-chunk paths (tame, exact, and tame-range decays
forced onto the exact one), strong, zero, -1e9 and -inf decays, T = 1, lengths that are no
multiple of 64, several chunks, packed sequences with an empty segment, initial states, several
V blocks and K parts, float32 and bfloat16. Then the backward, chained as the op will chain
it (``forward_chunk64(residuals=True)``, ``backward_chunk64_v_side``, ``backward_chunk64_k_side``):
every gradient (dr, dw, dk, dv, da, db, dh0) against the reference's exact ones, and dH', dU, dX
per chunk against the plan's float64 formulas (tests/test_rwkv7_chunk64_math.py), on the same
cases. Shapes are tiny: the interpreter is slow."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
import test_rwkv7_chunk64_math as plan
from reference import relative_error
from conftest import has_gpu, tolerance
from rwkv_jax.backends import triton as triton_backend
from rwkv_jax.backends.triton import launch as launch_module


@dataclasses.dataclass(frozen=True)
class Case:
    steps: int = 70
    batch: int = 1
    heads: int = 1
    key: int = 16
    value: int = 32
    decay: object = "model"  # reference.random_inputs' decay, or a key of HARD
    dtype: str = "float32"
    cu_seqlens: tuple = ()
    exact: bool = False  # force the exact in-chunk path
    # forward_chunk64's block sizes (and bf16_residuals)
    options: dict = dataclasses.field(default_factory=dict)
    correlated: bool = False  # keys as _correlated_keys draws them
    initial: bool = True  # an initial state (else None: zeros)


# Log decays past the reference's kinds, [B, T, H, K]: whole tokens at -1e9 and -inf inside and
# at the edges of 64-token chunks, and uniform draws down to -1e3.
def _tokens(w, values):
    w = w.copy()
    for t, value in values.items():
        if t < w.shape[1]:
            w[:, t] = value
    return w


HARD = {
    "-1e9 and -inf tokens": lambda rng, w: _tokens(w, {5: -1e9, 40: -np.inf, 63: -1e9,
                                                      64: -np.inf, 100: -1e9}),
    "uniform down to -1e3": lambda rng, w: rng.uniform(-1e3, 0.0, w.shape),
}

# On the interpreter every product is plain float32: the prototype's errors are ~1e-6, far
# under the backend's float32 contract (2e-3), which a small slip (a term of the inverse, say)
# could stay under. This bound catches those; bfloat16 inputs keep the contract's, and so do
# correlated keys (test_correlated_keys: ~7e-5 blockwise, the 16-row blocks' own squaring).
INTERPRETED_FLOAT32 = 1e-4


def _correlated_keys(rng, x):
    """Keys of consecutive tokens at correlation ~0.8 (a shared direction per sequence and
    head) and in-context learning rates near 1: a = -kk, b = kk * iclr make |A_ab| close to 1
    along the whole chunk, where the in-chunk inverse's series cancels the most (a full 64-row
    repeated squaring loses every digit in float32 there; the blockwise inverse keeps them)."""
    k = 0.8 * rng.standard_normal(x["k"].shape[:1] + (1,) + x["k"].shape[2:]) \
        + 0.2 * rng.standard_normal(x["k"].shape)
    kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
    return dict(x, k=k, a=-kk, b=kk * rng.uniform(0.9, 1.0, k.shape))


def _draw(case, rng):
    """The case's inputs (jax arrays in its dtype, initial state float32) and the same values in
    float64 for the references."""
    packed = bool(case.cu_seqlens)
    hard = case.decay in HARD
    drawn = reference.random_inputs(
        "rwkv7", rng, batch=case.batch, steps=case.steps, heads=case.heads, key=case.key,
        value=case.value, decay="model" if hard else case.decay,
        state_rows=len(case.cu_seqlens) - 1 if packed else None, initial_state=case.initial)
    if hard:
        drawn["w"] = HARD[case.decay](rng, drawn["w"])
    if case.correlated:
        drawn = _correlated_keys(rng, drawn)
    x = {n: jnp.asarray(a, jnp.float32 if n == "initial_state" else case.dtype)
         for n, a in drawn.items()}
    return x, {n: np.asarray(a, np.float64) for n, a in x.items()}


def check(case, seed):
    """Outputs and final states against the float64 reference; every value finite."""
    packed = bool(case.cu_seqlens)
    x, x64 = _draw(case, np.random.default_rng(seed))
    options = dict(cu_seqlens=np.asarray(case.cu_seqlens)) if packed else {}
    ref_out, ref_state = reference.forward("rwkv7", x64, scale=0.5, **options)

    @jax.jit
    def run(x, cu_seqlens):
        return triton_backend.forward_chunk64(
            *(x[n] for n in "rwkvab"), scale=0.5, initial_state=x.get("initial_state"),
            cu_seqlens=cu_seqlens, exact=case.exact, **case.options)

    out, state = run(x, jnp.asarray(case.cu_seqlens, jnp.int32) if packed else None)
    assert out.dtype == x["v"].dtype and out.shape == ref_out.shape
    assert state.dtype == jnp.float32 and state.shape == ref_state.shape
    assert np.all(np.isfinite(np.asarray(out, np.float64))), "non-finite output"
    assert np.all(np.isfinite(np.asarray(state))), "non-finite final state"
    bound = tolerance("triton", case.dtype, "forward")
    if case.dtype == "float32" and not has_gpu() and not case.correlated:
        bound = min(bound, INTERPRETED_FLOAT32)
    errors = {"out": relative_error(out, ref_out), "state": relative_error(state, ref_state)}
    assert errors["out"] <= bound and errors["state"] <= bound, errors
    return errors


@pytest.mark.parametrize("decay, exact, tame", [
    ("model", False, True), ("model", True, True), ("strong", False, False),
    ("zero", False, True)])
def test_paths_and_decays(decay, exact, tame):
    """Model-range decays take the tame path (and match when forced onto the exact one),
    strong ones the exact path; w = 0 (no decay at all) is tame. Two heads, V != K, 133 tokens:
    two full chunks and a partial one."""
    case = Case(steps=133, heads=2, key=32, value=16, decay=decay, exact=exact)
    w = reference.random_inputs("rwkv7", np.random.default_rng(1), batch=1, steps=8, heads=1,
                                key=4, decay=decay)["w"]
    assert bool(triton_backend.tame_path(jnp.asarray(w, jnp.float32))) is tame
    check(case, seed=1)


@pytest.mark.parametrize("decay", sorted(HARD))
def test_hard_decays(decay):
    """-1e9 and -inf tokens (inside a chunk, on its last and first rows) and uniform draws
    down to -1e3: the exact path, finite and exact (factors underflow to 0 as they should)."""
    check(Case(steps=133, decay=decay), seed=2)


@pytest.mark.parametrize("steps, initial", [(1, True), (64, True), (70, False)])
def test_lengths(steps, initial):
    """One token, exactly one chunk, and one chunk and a bit (rows past the end read as zeros
    and are not stored); the last without an initial state (zeros)."""
    check(Case(steps=steps, batch=2, initial=initial), seed=steps)


@pytest.mark.parametrize("dtype, decay", [("float32", "model"), ("bfloat16", "model"),
                                          ("bfloat16", "-1e9 and -inf tokens")])
def test_packed_sequences_with_initial_states(dtype, decay):
    """Segments of 0, 70, 3 and 67 tokens (an empty one, several chunks, a short one), each
    with its initial state; bfloat16 inputs against the looser contract, on both paths."""
    check(Case(steps=140, heads=2, cu_seqlens=(0, 0, 70, 73, 140), dtype=dtype, decay=decay),
          seed=7)


@pytest.mark.parametrize("decay", ["model", "-1e9 and -inf tokens"])
def test_v_blocks_and_k_parts(decay):
    """Several V blocks (state pass, outputs, U0 products) and K parts (the in-chunk sums):
    V = 48 in blocks of 16, K = 32 in parts of 16; tame and exact."""
    check(Case(steps=100, key=32, value=48, decay=decay,
               options=dict(block_v=16, block_k_in_chunk=16)), seed=11)


@pytest.mark.parametrize("decay, exact", [("zero", False), ("model", True)])
def test_correlated_keys(decay, exact):
    """The in-chunk inverse where its series cancels the most (``_correlated_keys``): w = 0
    (tame path) and model decays on the exact path."""
    check(Case(steps=128, key=16, value=16, decay=decay, exact=exact, correlated=True), seed=17)


@pytest.mark.parametrize("case", [
    Case(steps=133, key=96, value=48, decay="-1e9 and -inf tokens"),
    Case(steps=140, heads=2, key=128, value=64, cu_seqlens=(0, 0, 70, 73, 140),
         dtype="bfloat16"),
], ids=["K=96", "K=128 packed bfloat16"])
def test_key_halves(case):
    """K > 64: the state pass carries H as two halves of 64 keys. K = 96 (its second half
    partly masked) with V != K and hard decays; K = 128, V = 64 packed with an empty segment
    and bfloat16 inputs (W and H per chunk stored in bfloat16)."""
    check(case, seed=31)


@pytest.mark.parametrize("case", [
    Case(steps=140, heads=2, key=128, value=64, cu_seqlens=(0, 0, 70, 73, 140),
         dtype="bfloat16", decay="-1e9 and -inf tokens"),
    Case(steps=133, key=32, value=48, options=dict(block_v=16, recurrence_block_v=16)),
], ids=["K=128 packed bfloat16 exact", "K=32 V blocks"])
def test_forward_without_residuals(case, monkeypatch):
    """A forward that keeps no residuals (a call that is not differentiated) is two launches:
    the in-chunk kernel, which then writes no T, and the state pass writing each chunk's
    outputs (no H or U to memory, no outputs kernel); its outputs and final states are those
    of the forward that keeps its residuals, which the earlier tests check against float64."""
    launched = []
    launch = launch_module.launch

    def recorded(kernel, *args, **options):
        launched.append((kernel.__name__, options.get("RESIDUALS"), options.get("OUTPUTS")))
        return launch(kernel, *args, **options)

    monkeypatch.setattr(launch_module, "launch", recorded)
    packed = bool(case.cu_seqlens)
    x, _ = _draw(case, np.random.default_rng(41))
    forward = jax.jit(lambda x, cu, residuals: triton_backend.forward_chunk64(
        *(x[n] for n in "rwkvab"), scale=0.5, initial_state=x.get("initial_state"),
        cu_seqlens=cu, residuals=residuals, **case.options)[:2], static_argnums=2)
    cu = jnp.asarray(case.cu_seqlens, jnp.int32) if packed else None
    out, state = forward(x, cu, False)
    # (the in-chunk kernel once per path, both traced for the device's choice)
    assert sorted(set(launched)) == [("rwkv7_wy_kernel", False, None),
                                     ("rwkv7_wy_state_kernel", None, True)], launched
    launched.clear()
    kept_out, kept_state = forward(x, cu, True)
    assert ("rwkv7_wy_output_kernel", None, None) in launched
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(kept_out, np.float32))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(kept_state))


def test_invalid_traced_offsets_stay_in_bounds():
    """Offsets past the rows, negative and decreasing (traced: no check can see them) are
    clamped by the kernels: the call runs and writes finite final states."""
    rng = np.random.default_rng(5)
    drawn = reference.random_inputs("rwkv7", rng, batch=1, steps=70, heads=1, key=16,
                                    value=16, state_rows=4)
    x = {n: jnp.asarray(a, jnp.float32) for n, a in drawn.items()}
    run = jax.jit(lambda x, cu: triton_backend.forward_chunk64(
        *(x[n] for n in "rwkvab"), initial_state=x["initial_state"], cu_seqlens=cu))
    cu = jnp.asarray([-100, 50, 20, 500, 10**6], jnp.int32)
    _, state = run(x, cu)
    assert state.shape == (4, 1, 16, 16)
    assert np.all(np.isfinite(np.asarray(state)))


def test_backward_invalid_traced_offsets_stay_in_bounds():
    """The same offsets through the backward's three launchers: they run and write finite
    gradients."""
    rng = np.random.default_rng(6)
    drawn = reference.random_inputs("rwkv7", rng, batch=1, steps=70, heads=1, key=16,
                                    value=16, state_rows=4)
    x = {n: jnp.asarray(a, jnp.float32) for n, a in drawn.items()}

    @jax.jit
    def run(x, cu, do, dht):
        inputs = [x[n] for n in "rwkvab"]
        _, _, residuals = triton_backend.forward_chunk64(
            *inputs, initial_state=x["initial_state"], cu_seqlens=cu, residuals=True)
        dv, dh0, dstates, du, dx = triton_backend.backward_chunk64_v_side(
            *inputs, residuals, do, dht, cu_seqlens=cu)
        return (dh0, dv) + triton_backend.backward_chunk64_k_side(
            *inputs, residuals, do, dstates, dx, cu_seqlens=cu)

    grads = run(x, jnp.asarray([-100, 50, 20, 500, 10**6], jnp.int32), jnp.ones_like(x["v"]),
                jnp.ones((4, 1, 16, 16), jnp.float32))
    assert grads[0].shape == (4, 1, 16, 16)
    for grad, like in zip(grads[1:], "vrwkab"):
        assert grad.shape == x[like].shape
    assert all(np.all(np.isfinite(np.asarray(grad))) for grad in grads)


# ---------------------------------------------------------------------------------------------
# The backward: the state-gradient pass and V-side gradients (kernels 4 and 5), then the K-side
# gradients (kernel 6).
# ---------------------------------------------------------------------------------------------

def _plan_per_chunk(x64, cu, d_out, d_state, scale):
    """The plan's backward (float64 numpy, test_rwkv7_chunk64_math) per sequence and head, at
    64-token chunks: dH' [chunk slots, H, K, V] (zeros in unused slots), dU and dX [rows, H, V],
    dh0 [N, H, K, V]; chunk slots as the kernels number them (each sequence's chunks in order)."""
    rows = lambda a: a.reshape((-1,) + a.shape[2:])
    x = {n: rows(x64[n]) for n in "rwkvab"}
    d_out = rows(d_out)
    heads, key, value = x["k"].shape[1], x["k"].shape[2], x["v"].shape[2]
    chunks = [-(-(end - start) // triton_backend.CHUNK64) for start, end in zip(cu, cu[1:])]
    dstates = np.zeros((sum(chunks) + 1, heads, key, value))
    du, dx = np.zeros_like(d_out), np.zeros_like(d_out)
    dh0 = np.zeros((len(chunks), heads, key, value))
    for n, (start, end) in enumerate(zip(cu, cu[1:])):
        if end == start:  # no chunk: the state passes through
            dh0[n] = d_state[n]
            continue
        pad = ((0, chunks[n] * triton_backend.CHUNK64 - (end - start)), (0, 0))
        for head in range(heads):
            seq = {name: np.pad(x[name][start:end, head], pad) for name in "rwkvab"}
            seq["q"] = scale * seq.pop("r")
            seq["floored"] = seq["w"] < plan.FLOOR
            seq["w"] = np.maximum(seq["w"], plan.FLOOR)
            h0 = x64["initial_state"][n, head] if "initial_state" in x64 else np.zeros(
                (key, value))
            _, _, saved = plan._forward(seq, h0, triton_backend.CHUNK64)
            grads = plan._backward(seq, saved, np.pad(d_out[start:end, head], pad),
                                   d_state[n, head], triton_backend.CHUNK64)
            dh0[n, head] = grads["initial_state"]
            for c, (dh, du_c, dx_c) in enumerate(grads["chunks"]):
                dstates[sum(chunks[:n]) + c, head] = dh
                first = start + c * triton_backend.CHUNK64
                count = min(end, first + triton_backend.CHUNK64) - first
                du[first:first + count, head] = du_c[:count]
                dx[first:first + count, head] = dx_c[:count]
    return dstates, du, dx, dh0


def check_backward(case, seed):
    """dr, dw, dk, dv, da, db and dh0 against the reference's exact gradients; dH' (used
    slots), dU, dX and dh0 against the plan's formulas; every value finite. float32 to
    INTERPRETED_FLOAT32 (on the interpreter; correlated keys, as the forward's, to the
    contract), bfloat16 to the backend's gradient contract (the input gradients are stored in
    bfloat16), and so are dH', dU, dX and dh0 where some of the forward's buffers are bfloat16
    (``bf16_residuals``, the default; float32 buffers keep float32's bound). W and H per
    chunk are bfloat16 for bfloat16 inputs under bf16_residuals, else float32; U, the
    matrices, dH', dU, dX float32."""
    packed = bool(case.cu_seqlens)
    rng = np.random.default_rng(seed)
    x, x64 = _draw(case, rng)
    sequences = len(case.cu_seqlens) - 1 if packed else case.batch
    cu = list(case.cu_seqlens) if packed else [n * case.steps for n in range(case.batch + 1)]
    do = jnp.asarray(rng.standard_normal(x["v"].shape), case.dtype)
    dht = jnp.asarray(rng.standard_normal((sequences, case.heads, case.key, case.value)),
                      jnp.float32)
    d_out, d_state = np.asarray(do, np.float64), np.asarray(dht, np.float64)
    options = dict(cu_seqlens=np.asarray(case.cu_seqlens)) if packed else {}
    expected = reference.gradients("rwkv7", x64, d_out, d_state, scale=0.5, **options)

    @jax.jit
    def run(x, cu_seqlens, do, dht):
        inputs = [x[n] for n in "rwkvab"]
        _, _, residuals = triton_backend.forward_chunk64(
            *inputs, scale=0.5, initial_state=x.get("initial_state"), cu_seqlens=cu_seqlens,
            exact=case.exact, residuals=True, **case.options)
        block_v = case.options.get("block_v", 64)
        dv, dh0, dstates, du, dx = triton_backend.backward_chunk64_v_side(
            *inputs, residuals, do, dht, cu_seqlens=cu_seqlens, block_v=block_v,
            recurrence_block_v=case.options.get("recurrence_block_v"))
        k_side = triton_backend.backward_chunk64_k_side(
            *inputs, residuals, do, dstates, dx, scale=0.5, cu_seqlens=cu_seqlens,
            block_v=block_v, exact=case.exact)
        return (dv, dh0, dstates, du, dx), dict(zip("rwkab", k_side)), residuals

    (dv, dh0, dstates, du, dx), grads, residuals = run(
        x, jnp.asarray(cu, jnp.int32) if packed else None, do, dht)
    for name, grad in dict(grads, v=dv).items():
        assert grad.dtype == x[name].dtype and grad.shape == x[name].shape, name
    bf16_residuals = case.dtype != "float32" and case.options.get("bf16_residuals", True)
    buffer = jnp.bfloat16 if bf16_residuals else jnp.float32
    assert residuals["wy"].dtype == residuals["states"].dtype == buffer
    assert all(a.dtype == jnp.float32
               for a in (residuals["u"], residuals["matrices"], dstates, du, dx, dh0))
    plan_dstates, plan_du, plan_dx, plan_dh0 = _plan_per_chunk(x64, cu, d_out, d_state, 0.5)
    used = plan_dstates.shape[0] - 1
    ours = dict({"dv": dv, "dh0": dh0, "dH'": np.asarray(dstates)[:used], "dU": du, "dX": dx},
                **{f"d{name}": grad for name, grad in grads.items()})
    for name, value in ours.items():
        assert np.all(np.isfinite(np.asarray(value, np.float64))), f"non-finite {name}"
    bound = INTERPRETED_FLOAT32 if not has_gpu() else tolerance("triton", "float32", "gradient")
    if case.correlated:
        bound = tolerance("triton", "float32", "gradient")
    if bf16_residuals:
        bound = tolerance("triton", case.dtype, "gradient")
    # (the input gradients, stored in the inputs' dtype)
    stored_bound = bound if case.dtype == "float32" else tolerance("triton", case.dtype,
                                                                   "gradient")
    errors = {"dv": relative_error(dv, expected["v"]),
              "dh0 (plan)": relative_error(dh0, plan_dh0),
              "dH'": relative_error(ours["dH'"], plan_dstates[:used]),
              "dU": relative_error(du, plan_du), "dX": relative_error(dx, plan_dx)}
    errors.update({f"d{name}": relative_error(grad, expected[name])
                   for name, grad in grads.items()})
    if "initial_state" in expected:
        errors["dh0"] = relative_error(dh0, expected["initial_state"])
    bounds = dict({name: bound for name in errors},
                  **{f"d{name}": stored_bound for name in "rwkvab"})
    assert all(errors[name] <= bounds[name] for name in errors), errors
    # A log decay below the kernels' FLOOR has dw exactly 0 (the reference's is e^w times a
    # bounded sum: 0 in float32), not the rounding left by the sums that cancel there.
    floored = x64["w"] < plan.FLOOR
    assert np.all(np.asarray(grads["w"], np.float64)[floored] == 0.0)
    return errors


@pytest.mark.parametrize("decay, exact", [("model", False), ("model", True), ("strong", False),
                                          ("zero", False)] + [(d, False) for d in sorted(HARD)])
def test_backward_decays(decay, exact):
    """Tame and exact paths (and tame-range decays forced onto the exact one), strong and zero
    decays, -1e9 and -inf tokens, uniform down to -1e3; two heads, V != K, 133 tokens (two full
    chunks and a partial one)."""
    check_backward(Case(steps=133, heads=2, key=32, value=16, decay=decay, exact=exact), seed=3)


@pytest.mark.parametrize("steps, initial", [(1, True), (64, True), (70, False)])
def test_backward_lengths(steps, initial):
    """One token, exactly one chunk, and one chunk and a bit without an initial state (dh0
    still its gradient)."""
    check_backward(Case(steps=steps, batch=2, initial=initial), seed=steps + 1)


@pytest.mark.parametrize("dtype, decay, bf16_residuals", [
    ("float32", "model", True), ("bfloat16", "model", True),
    ("bfloat16", "-1e9 and -inf tokens", True), ("bfloat16", "model", False)])
def test_backward_packed(dtype, decay, bf16_residuals):
    """Segments of 0, 70, 3 and 67 tokens with initial states, and several V blocks (V = 32 in
    blocks of 16: the K side's sums over V in two steps); bfloat16 inputs and cotangents (the
    input gradients in bfloat16), on both paths, with the buffers between the kernels in
    bfloat16 (the default) and in float32 (``bf16_residuals=False``)."""
    check_backward(Case(steps=140, heads=2, cu_seqlens=(0, 0, 70, 73, 140), dtype=dtype,
                        decay=decay, options=dict(block_v=16, bf16_residuals=bf16_residuals)),
                   seed=8)


def test_backward_recurrence_v_blocks():
    """The two sequential passes on narrower V blocks than the parallel kernels
    (``recurrence_block_v``, for few sequences: KernelConfig.recurrence_block_v): V = 32, the
    passes in blocks of 16, the other kernels in one of 32; packed, with hard decays."""
    check_backward(Case(steps=140, heads=2, cu_seqlens=(0, 0, 70, 73, 140),
                        decay="-1e9 and -inf tokens",
                        options=dict(block_v=32, recurrence_block_v=16)), seed=37)


@pytest.mark.parametrize("decay, exact", [("zero", False), ("model", True)])
def test_backward_correlated_keys(decay, exact):
    """The in-chunk inverse where its series cancels the most (``_correlated_keys``), through
    the whole backward: w = 0 (tame path) and model decays on the exact path."""
    check_backward(Case(steps=128, key=16, value=16, decay=decay, exact=exact, correlated=True),
                   seed=17)


@pytest.mark.parametrize("decay", ["model", "-1e9 and -inf tokens"])
def test_backward_key_blocks(decay):
    """K = 128: the K side in programs of 16 keys per chunk, each reading the chunk's dA
    buffer and summing its state products over all of V (here V = 16 < K); tame and exact."""
    check_backward(Case(steps=70, key=128, value=16, decay=decay), seed=19)


def test_backward_key_halves():
    """K = 96 (BK = 128): the state-gradient pass in two halves of 64 K columns, the upper one
    partly past K (masked); V = 16, two heads, two chunks, hard decays."""
    check_backward(Case(steps=70, heads=2, key=96, value=16, decay="-1e9 and -inf tokens"),
                   seed=31)


def test_backward_padded_head_sizes():
    """K = V = 48: the K side's one block of 64 keys with masked columns (no block of 32 keys
    tiles K), and its steps over V a full one of 32 and a masked one; in the forward, K parts
    of 16 of which only three reach into K."""
    check_backward(Case(steps=70, key=48, value=48, decay="-1e9 and -inf tokens"), seed=23)

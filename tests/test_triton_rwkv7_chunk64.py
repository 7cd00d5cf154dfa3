"""The 64-token-chunk RWKV-7 forward (``triton.forward_chunk64``; docs/RWKV7-CHUNK64.md, the
kernels in triton_kernels/rwkv7.py's section "64-token chunks") against the float64 reference,
on CPU through Triton's interpreter: both in-chunk paths (tame, exact, and tame-range decays
forced onto the exact one), strong, zero, -1e9 and -inf decays, T = 1, lengths that are no
multiple of 64, several chunks, packed sequences with an empty segment, initial states, several
V blocks and K parts, float32 and bfloat16. Shapes are tiny: the interpreter is slow."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from reference import relative_error
from conftest import has_gpu, tolerance
from rwkv_jax.backends import triton as triton_backend


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
    options: dict = dataclasses.field(default_factory=dict)  # forward_chunk64's block sizes
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


def check(case, seed):
    """Outputs and final states against the float64 reference; every value finite."""
    rng = np.random.default_rng(seed)
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
    x64 = {n: np.asarray(a, np.float64) for n, a in x.items()}
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
    assert bool(triton_backend.tame_path64(jnp.asarray(w, jnp.float32))) is tame
    assert bool(triton_backend.tame_path(jnp.asarray(w, jnp.float32))) is tame  # the same bound
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


def test_invalid_traced_offsets_stay_in_bounds():
    """Offsets past the rows, negative and decreasing (traced: no check can see them) are
    clamped by the kernels: the call runs and writes finite final states."""
    rng = np.random.default_rng(5)
    drawn = reference.random_inputs("rwkv7", rng, batch=1, steps=70, heads=1, key=16,
                                    value=16, state_rows=4)
    x = {n: jnp.asarray(a, jnp.float32) for n, a in drawn.items()}
    run = jax.jit(lambda x, cu: triton_backend.forward_chunk64(
        *(x[n] for n in "rwkvab"), initial_state=x["initial_state"], cu_seqlens=cu))
    _, state = run(x, jnp.asarray([-100, 50, 20, 500, 10**6], jnp.int32))
    assert state.shape == (4, 1, 16, 16)
    assert np.all(np.isfinite(np.asarray(state)))

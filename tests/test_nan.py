"""NaN in, NaN out, on every backend and op: a NaN in any input (a log decay or gate, r, k, v,
a, b, the bonus, the initial state or the step pool) comes back as NaN in the outputs it feeds,
the final state where it feeds the state, and the gradients, never as a finite value. The
backends' floor on log decays (DESIGN.md, numerical contract) raises finite and -inf values
only; a NaN decay stays NaN. The NaN sits in the first element of the input (token 0, head or
channel 0 of batch row 0: a RWKV-6 decay at the last token would reach the state only), and
head 1 (channels 1 on) stays finite: the NaN is visible where it belongs and goes nowhere else.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import has_gpu
from test_composition import small_case
from test_ops import call_op, make_inputs

KEY = 64 if has_gpu() else 8  # the ffi backend's CUDA kernels take K in (64, 128)
# variant -> Case: every GLA gate present at once, so that each gate gets its own NaN.
CASES = {
    "rwkv7": small_case("rwkv7", key=KEY),
    "rwkv6": small_case("rwkv6", key=KEY),
    "gla": small_case("gated_linear_attention", key=KEY, gates=("g", "g_gamma", "gk", "gv")),
    "rwkv4": small_case("rwkv4", key=KEY),
    "rwkv7_step": small_case("rwkv7_step", key=KEY),
    "rwkv6_step": small_case("rwkv6_step", key=KEY),
}
# Inputs that reach the outputs only, never the state: the receptance/query and the bonus.
READ_ONLY = {"r", "q", "u"}


def _rest(op, out):
    """The outputs the NaN must not reach: head 1 ([B, T, H, V]) or channels 1 on (RWKV-4)."""
    return out[..., 1:] if op == "rwkv4" else out[:, :, 1]


@pytest.mark.parametrize("op, variant", [(case.op, name) for name, case in CASES.items()],
                         ids=list(CASES))
def test_nan_in_any_input_comes_out_nan(backend, op, variant):
    case = CASES[variant]
    x, _, _ = make_inputs(case, 40)

    @jax.jit
    def run(x):
        (out, state), pullback = jax.vjp(lambda x: call_op(op, x, {}, backend), x)
        return out, state, pullback((jnp.ones_like(out), jnp.ones_like(state)))[0]

    missed = []
    for name in x:
        poisoned = dict(x, **{name: x[name].at[(0,) * x[name].ndim].set(jnp.nan)})
        out, state, grads = jax.tree.map(lambda a: np.asarray(a, np.float64), run(poisoned))
        if not np.isnan(out).any():
            missed.append(f"{name}: finite output")
        if name not in READ_ONLY and not np.isnan(state).any():
            missed.append(f"{name}: finite final state")
        if not any(np.isnan(g).any() for g in grads.values()):
            missed.append(f"{name}: finite gradients")
        if not np.isfinite(_rest(op, out)).all():
            missed.append(f"{name}: NaN beyond the poisoned head")
    assert not missed, f"{backend} {variant}: " + "; ".join(missed)


# ------------------------------------------------------------------------------------------
# Causality: a NaN at position t spoils outputs from t on, never before, in its own sequence —
# on the sequential backends. The chunked ones (chunked, triton) take the NaN row into their
# in-chunk products with zero weights (0 * NaN), so there it spoils outputs from the start of its
# chunk on, never further back and never another head, row or segment. (Keeping it causal
# inside the chunks cost the GPU training path a fifth of its time: BENCHMARKS.md.)
# ------------------------------------------------------------------------------------------

CAUSAL_STEPS = 80  # a second chunk on every backend (chunks of 16, 32 and 64 tokens)
# The second chunk's inside (past a 64-token chunk's start) for every input, and the first
# and the last position for the first and the last input (each run is a kernel call: on the
# Triton interpreter they are what the test costs).
MIDDLE = 70
CAUSAL_CASES = {
    "rwkv7": small_case("rwkv7", key=KEY, steps=CAUSAL_STEPS),
    "rwkv6": small_case("rwkv6", key=KEY, steps=CAUSAL_STEPS),
    "gla": small_case("gated_linear_attention", key=KEY, steps=CAUSAL_STEPS,
                      gates=("g", "gk", "gv")),
}
# The longest chunk of each chunked backend: how far back a NaN may reach there.
CHUNK = {"chunked": 32, "triton": 64}


def _clean_before(backend, t, start=0):
    """The first position at or after which a NaN at ``t`` (in a sequence or segment that
    begins at ``start``, where chunks begin too) may spoil outputs on ``backend``."""
    return t - (t - start) % CHUNK[backend] if backend in CHUNK else t


def _jit_vjp(op, backend, **options):
    @jax.jit
    def run(x):
        (out, state), pullback = jax.vjp(lambda x: call_op(op, x, options, backend), x)
        return out, state, pullback((jnp.ones_like(out), jnp.ones_like(state)))[0]
    return run


def _causal_positions(x):
    """(input, position) pairs: every input with a time axis at MIDDLE, the first also at 0,
    the last also at the last position."""
    names = [n for n in x if x[n].ndim >= 3 and n != "initial_state"]
    return [(n, MIDDLE) for n in names] + [(names[0], 0), (names[-1], CAUSAL_STEPS - 1)]


def _assert_causal(label, out, clean, start, first, end=None, nan_from=None):
    """out[start:first] equals the clean run, every output in out[nan_from (default
    first):end] has a NaN ([T, V] arrays; a NaN value column of RWKV-7 or GLA may reach that
    column alone)."""
    before = out[start:first]
    assert np.isfinite(before).all(), f"{label}: NaN before the poisoned position"
    np.testing.assert_allclose(before, clean[start:first], rtol=1e-4, atol=1e-5, err_msg=label)
    nan_from = first if nan_from is None else nan_from
    assert np.isnan(out[nan_from:end]).any(-1).all(), f"{label}: finite output at or after the NaN"


def _check_causal(backend, op, variant, x, run, differentiated):
    """``run(x)`` -> (out, state[, gradients]) with a NaN in each input at each of
    ``_causal_positions`` (row 0, head 0) against the run without it: that head's outputs before
    t equal the clean ones, those from t on are NaN, and so is its final state; the other heads
    and batch rows are untouched; under ``differentiated`` some gradient is NaN."""
    as64 = lambda results: jax.tree.map(lambda a: np.asarray(a, np.float64), results)
    clean_out, clean_state = as64(run(x))[:2]
    for name, t in _causal_positions(x):
        label = f"{variant} {name}[t={t}]{'' if differentiated else ' forward'}"
        at = (0, t, 0) + (0,) * (x[name].ndim - 3)
        results = as64(run(dict(x, **{name: x[name].at[at].set(jnp.nan)})))
        out, state = results[:2]
        read_only = name in READ_ONLY or name == "q"
        # RWKV-6's decay at t first decays the state o_{t+1} reads: o_t stays finite on the
        # sequential backends and may be NaN on the chunked ones.
        nan_from = t + 1 if (op, name) == ("rwkv6", "w") else t
        _assert_causal(label, out[0, :, 0], clean_out[0, :, 0], 0, _clean_before(backend, t),
                       t + 1 if read_only else None, nan_from)
        if read_only:  # o_t alone
            np.testing.assert_allclose(out[0, t + 1:, 0], clean_out[0, t + 1:, 0],
                                       rtol=1e-4, atol=1e-5, err_msg=label)
        np.testing.assert_allclose(out[1], clean_out[1], rtol=1e-4, atol=1e-5, err_msg=label)
        np.testing.assert_allclose(out[0, :, 1], clean_out[0, :, 1], rtol=1e-4, atol=1e-5,
                                   err_msg=label)
        if not read_only:
            assert np.isnan(state[0, 0]).any(), f"{label}: finite final state"
        np.testing.assert_allclose(state[1], clean_state[1], rtol=1e-4, atol=1e-5,
                                   err_msg=label)
        if differentiated:
            assert any(np.isnan(g).any() for g in results[2].values()), \
                f"{label}: finite gradients"


@pytest.mark.parametrize("op, variant", [(case.op, name) for name, case in CAUSAL_CASES.items()],
                         ids=list(CAUSAL_CASES))
def test_nan_is_causal(backend, op, variant):
    """A NaN in any input with a time axis at position t, under jax.vjp (the training
    kernels): ``_check_causal``."""
    x, _, _ = make_inputs(CAUSAL_CASES[variant], 41)
    _check_causal(backend, op, variant, x, _jit_vjp(op, backend), True)


def test_nan_is_causal_in_a_forward_alone(backend):
    """The same for a rwkv7 call that is not differentiated (the inference kernels: on triton
    the 16-token forward at these head sizes)."""
    x, _, _ = make_inputs(CAUSAL_CASES["rwkv7"], 43)
    _check_causal(backend, "rwkv7", "rwkv7", x,
                  jax.jit(lambda x: call_op("rwkv7", x, {}, backend)), False)


@pytest.mark.parametrize("op, variant", [(case.op, name) for name, case in CAUSAL_CASES.items()],
                         ids=list(CAUSAL_CASES))
def test_nan_stays_in_its_segment(backend, op, variant):
    """Packed sequences: a NaN in one segment leaves the others' outputs and final states as
    they were, and its own segment's outputs before it."""
    cu_seqlens = np.array([0, 30, CAUSAL_STEPS], np.int32)
    case = CAUSAL_CASES[variant]
    x, _, _ = make_inputs(dataclasses.replace(case, inputs=dict(case.inputs, batch=1,
                                                                state_rows=2)), 42)
    run = _jit_vjp(op, backend, cu_seqlens=jnp.asarray(cu_seqlens))
    clean_out, clean_state, _ = jax.tree.map(lambda a: np.asarray(a, np.float64), run(x))
    for segment, t in ((0, 10), (1, 70)):
        label = f"{backend} {variant} k[t={t}]"
        out, state, _ = jax.tree.map(lambda a: np.asarray(a, np.float64),
                                     run(dict(x, k=x["k"].at[0, t, 0, 0].set(jnp.nan))))
        start, end = cu_seqlens[segment], cu_seqlens[segment + 1]
        _assert_causal(label, out[0, :, 0], clean_out[0, :, 0], start,
                       _clean_before(backend, t, start), end, t)
        other = slice(end, None) if segment == 0 else slice(0, start)
        np.testing.assert_allclose(out[0, other], clean_out[0, other], rtol=1e-4, atol=1e-5,
                                   err_msg=label)
        assert np.isnan(state[segment, 0]).any(), f"{label}: finite final state"
        np.testing.assert_allclose(state[1 - segment], clean_state[1 - segment], rtol=1e-4,
                                   atol=1e-5, err_msg=label)


def test_invalid_token_is_causal_in_the_model(backend):
    """RWKV7LM under jit: a token id outside the vocabulary (-1) at position 5 gives NaN logits
    from 5 on and the logits without it before."""
    from flax import nnx

    from rwkv_jax import nn as rnn
    head = 64 if has_gpu() else 16  # the ffi backend's CUDA kernels take K in (64, 128)
    cfg = rnn.RWKV7Config(vocab_size=16, n_embd=2 * head, n_layer=2, head_size=head, decay_lora=8,
                          a_lora=8, v_lora=4, gate_lora=12)
    model = rnn.RWKV7LM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(1, 11, dtype=jnp.int32)[None]
    logits = nnx.jit(lambda m, t: m(t, backend=backend))
    clean = np.asarray(logits(model, tokens), np.float64)[0]
    spoiled = np.asarray(logits(model, tokens.at[0, 5].set(-1)), np.float64)[0]
    _assert_causal(f"{backend} RWKV7LM", spoiled, clean, 0, _clean_before(backend, 5), None, 5)

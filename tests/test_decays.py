"""Every backend holds the numerical contract for every log decay in [-inf, 0] (DESIGN.md).

Each op (RWKV-7, RWKV-6, gated linear attention with each gate kind carrying the decays, and the
step ops) runs against the float64 reference of tests/reference.py through test_ops.check_case:
output, final state and every gradient (initial state included), finite and within the
backend's tolerance. The decays: uniform in [lo, 0] for lo down to -1e3, whole tokens at -1e9
and at -inf inside a chunk (tokens 5 and 21 of 37: off every chunk boundary for chunks of 16
and 32), every third token at -1e9, and w = 0; float32, and bfloat16 for the -inf tokens.
Shapes are tiny (B=1, T=37, H=2, K=16): the Triton interpreter runs them in CI.

Every decay of one (backend, op, dtype) runs through one compiled program (same shapes and
options), and a failure lists every decay that fails with its first error.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import reference
from conftest import has_gpu
from test_ops import (Case, _seed, check_case, forward_and_gradients, make_inputs,
                      traced_options)

STEPS = 37
KEY = 64 if has_gpu() else 16  # the ffi backend's CUDA kernels take K in (64, 128)
DECAYS = {
    "uniform_8": ("uniform", -8.0),
    "uniform_20": ("uniform", -20.0),
    "uniform_50": ("uniform", -50.0),
    "uniform_1000": ("uniform", -1e3),
    "tokens_1e9": ("tokens", -1e9),
    "tokens_inf": ("tokens", -np.inf),
    "every_third_1e9": ("every_third", -1e9),
    "zero": "zero",
}
# bfloat16 once per algorithm family (each needs its own compilation).
BFLOAT16 = [(v, ("tokens_inf",)) for v in ("rwkv7", "rwkv6", "gla_gk")]

# name -> (op, random_inputs options, op options): each GLA gate kind carries the decays alone.
OPS = {
    "rwkv7": ("rwkv7", {}, {}),
    "rwkv6": ("rwkv6", {}, {}),
    "gla_g": ("gated_linear_attention", dict(gates=("g",)), {}),
    "gla_gk": ("gated_linear_attention", dict(gates=("gk",)), {}),
    "gla_gv": ("gated_linear_attention", dict(gates=("gv",)), {}),
    "gla_g_gamma": ("gated_linear_attention", dict(gates=("g_gamma",)), {}),
    "rwkv7_step": ("rwkv7_step", dict(state_rows=3), dict(state_indices=[2])),
    "rwkv6_step": ("rwkv6_step", dict(state_rows=3), dict(state_indices=[2])),
}


def _case(variant, decay, dtype):
    op, inputs, options = OPS[variant]
    return Case(op, dict(inputs, batch=1, steps=STEPS, key=KEY, decay=DECAYS[decay]), options,
                dtype)


PARAMS = [(v, "float32", tuple(DECAYS)) for v in OPS] + [(v, "bfloat16", d) for v, d in BFLOAT16]


# ``op`` is a parameter so that conftest.py deselects the ops a backend does not implement.
# One test runs every decay of a (backend, op, dtype) through one compiled program: pytest-xdist
# hands out tests round robin, so one test per decay would compile each program on both workers.
@pytest.mark.parametrize("op, variant, dtype, decays", [
    pytest.param(OPS[v][0], v, t, d, id=f"{v}-{t}") for v, t, d in PARAMS])
def test_decays_hold_the_contract(backend, op, variant, dtype, decays):
    run = forward_and_gradients(_case(variant, "zero", dtype), backend)
    failures = []
    for decay in decays:
        try:
            check_case(backend, _case(variant, decay, dtype), _seed(variant, decay, dtype), run)
        except AssertionError as err:
            failures.append(f"{decay}: {str(err).splitlines()[0]}")
    assert not failures, f"{backend} {variant} {dtype} fails for " + "; ".join(failures)


def test_reference_at_minus_infinity_matches_minus_1e9():
    """The reference itself: exp(-inf) = 0, so a decay of -inf gives the outputs, state and
    gradients of -1e9 (whose exp is 0 too), every one finite; the -inf decay's gradient is 0."""
    for variant in ("rwkv7", "rwkv6", "gla_gk", "gla_g_gamma", "rwkv7_step"):
        op, inputs, options = OPS[variant]
        runs = []
        for value in (-1e9, -np.inf):
            rng = np.random.default_rng(_seed("reference", variant))
            x = reference.random_inputs(op, rng, batch=1, steps=STEPS, decay=("tokens", value),
                                        **inputs)
            opts = {n: np.asarray(a) for n, a in options.items()}
            out, state = reference.forward(op, x, **opts)
            d_out, d_state = rng.standard_normal(out.shape), rng.standard_normal(state.shape)
            runs.append((out, state, reference.gradients(op, x, d_out, d_state, **opts)))
        (out, state, grads), (out_inf, state_inf, grads_inf) = runs
        np.testing.assert_array_equal(out, out_inf)
        np.testing.assert_array_equal(state, state_inf)
        for name, grad in grads_inf.items():
            assert np.all(np.isfinite(grad)), (variant, name)
            np.testing.assert_array_equal(grad, grads[name], err_msg=f"{variant} d{name}")
        # The -inf entries themselves: tokens SPIKE_TOKENS, or g_gamma's first head.
        spikes = (grads_inf["g_gamma"][0] if "g_gamma" in grads_inf else
                  grads_inf["gk" if "gk" in grads_inf else "w"][:, list(reference.SPIKE_TOKENS)])
        assert np.all(spikes == 0), variant


@pytest.mark.parametrize("op", ["gated_linear_attention"])
def test_summed_gate_gradient_at_model_head_size(backend, op):
    """g_gamma's gradient sums every gate gradient of its head: under strong gates it is tiny
    (here ~1e-7) beside terms of order 1, so a chunked kernel must form each in-chunk sum
    without cancellation. K = 64, where such terms add up (triton once failed here: 0.23)."""
    variant = "gla_g_gamma"
    run = None
    for decay in ("uniform_20", "uniform_50"):
        op_name, inputs, options = OPS[variant]
        case = Case(op_name, dict(inputs, batch=1, steps=STEPS, key=64, decay=DECAYS[decay]),
                    options, "float32")
        run = run or forward_and_gradients(case, backend)
        check_case(backend, case, _seed(variant, decay, "k64"), run)


# Positive log decays (decays > 1) are outside the contract and not inspected; every backend
# computes the same recurrence with no clamp (DESIGN.md, numerical contract).
DECAY_NAMES = {"gla_g": "g", "gla_gk": "gk", "gla_gv": "gv", "gla_g_gamma": "g_gamma"}


@pytest.mark.parametrize("op, variant", [pytest.param(OPS[v][0], v, id=v) for v in OPS])
def test_positive_log_decays_are_computed_unclamped(backend, op, variant):
    """Small positive log decays match the reference within the float32 contract, outputs and
    gradients. One log decay at +inf on the first token, from a zero state: e^inf * 0 is NaN, in
    the output and the state, on every backend (a clamped exp, e^88 for e^inf, gives 0 there and
    keeps everything finite)."""
    name, inputs, options = OPS[variant]
    small = Case(name, dict(inputs, batch=1, steps=STEPS, key=KEY, decay=("uniform", 0.05)),
                 options)
    run = forward_and_gradients(small, backend)
    check_case(backend, small, _seed(variant, "small_positive"), run)
    x, _, _ = make_inputs(small, _seed(variant, "plus_inf"))
    decay = DECAY_NAMES.get(variant, "w")
    x[decay] = x[decay].at[(0,) * x[decay].ndim].set(jnp.inf)
    state_name = "state" if "state" in x else "initial_state"
    x[state_name] = jnp.zeros_like(x[state_name])
    out, state, _ = run(x, traced_options(small), jnp.ones_like(x["v"]),
                        jnp.ones_like(x[state_name]))
    assert not np.isfinite(np.asarray(out, np.float64)).all(), "finite output for w = +inf"
    assert not np.isfinite(np.asarray(state)).all(), "finite state for w = +inf"

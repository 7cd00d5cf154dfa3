"""One suite for every backend x op x option: forward output, final state and the gradients of
every input (initial state included) against the float64 reference of tests/reference.py.

Errors are ``||out - ref|| / ||ref||`` over the whole tensor (DESIGN.md, numerical contract),
every result must be finite, and dtypes follow the policy: output in ``v``'s dtype, state
float32, each gradient in its input's dtype. Cotangents on the output and on the final state
are random (so never symmetric). Shapes are tiny and shared between cases so that a slow
backend (the Triton interpreter) compiles few distinct programs.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rwkv_jax
import reference
from reference import relative_error
from conftest import tolerance

BATCH, STEPS, HEADS, KEY = 2, 37, 2, 16
ALL_GATES = ("g", "g_gamma", "gk", "gv")
# Arguments of each public op, in call order; the rest go by keyword.
POSITIONAL = {
    "rwkv7": tuple("rwkvab"),
    "rwkv6": tuple("rkvwu"),
    "gated_linear_attention": ("q", "k", "v"),
    "rwkv4": ("w", "u", "k", "v"),
    "rwkv7_step": tuple("rwkvab") + ("state",),
    "rwkv6_step": tuple("rkvwu") + ("state",),
}
STATE_NAMES = ("initial_state", "state")
SHARED_NAMES = ("u", "g_gamma")  # parameters without a time axis


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    inputs: dict = dataclasses.field(default_factory=dict)   # reference.random_inputs options
    options: dict = dataclasses.field(default_factory=dict)  # keyword options of the public op
    dtype: str = "float32"

    @property
    def reference_options(self):
        names = ("scale", "cu_seqlens", "reverse", "state_indices")
        return {n: np.asarray(x) if n in ("cu_seqlens", "state_indices") else x
                for n, x in self.options.items() if n in names}


PACKED = dict(batch=1, state_rows=4)
CU_SEQLENS = [0, 12, 12, 30, STEPS]  # four segments, one of them empty


def _sequence_cases(op, extra_inputs):
    """The options every [B, T, H, K] sequence op supports."""
    base = dict(extra_inputs)
    cases = {
        "plain": Case(op, dict(base, initial_state=False)),
        "initial_state": Case(op, base),
        "no_final_state": Case(op, base, dict(output_final_state=False)),
        "cu_seqlens": Case(op, dict(base, **PACKED), dict(cu_seqlens=CU_SEQLENS)),
        "head_first": Case(op, base, dict(head_first=True)),
        "scale": Case(op, base, dict(scale=0.37)),
        "k32_v16": Case(op, dict(base, key=32, value=16)),
        # Size-1 batch and head axes (a rank-7 gradient with a unit axis crashed XLA:CPU).
        "batch1_heads1": Case(op, dict(base, batch=1, heads=1)),
        "bfloat16": Case(op, base, dtype="bfloat16"),
        "float16": Case(op, base, dtype="float16"),
        "strong_decay": Case(op, dict(base, decay="strong")),
        "zero_decay": Case(op, dict(base, decay="zero")),
        "steps1": Case(op, dict(base, steps=1)),
        "steps7": Case(op, dict(base, steps=7)),
    }
    return {(op, name): case for name, case in cases.items()}


def _gla_gate_cases():
    op = "gated_linear_attention"
    cases = {f"gates_{g}": Case(op, dict(gates=(g,))) for g in ALL_GATES}
    cases["no_gates"] = Case(op, dict(gates=()))
    cases["scalar_gates"] = Case(op, dict(gates=("g", "g_gamma")))
    cases["reverse"] = Case(op, dict(gates=ALL_GATES), dict(reverse=True))
    cases["reverse_cu_seqlens"] = Case(op, dict(gates=ALL_GATES, **PACKED),
                                       dict(reverse=True, cu_seqlens=CU_SEQLENS))
    return {(op, name): case for name, case in cases.items()}


def _rwkv4_cases():
    op = "rwkv4"
    cases = {
        "plain": Case(op, dict(initial_state=False)),
        "initial_state": Case(op),
        "no_final_state": Case(op, {}, dict(output_final_state=False)),
        "bfloat16": Case(op, dtype="bfloat16"),
        "float16": Case(op, dtype="float16"),
        "strong_decay": Case(op, dict(decay="strong")),
        "zero_decay": Case(op, dict(decay="zero")),
        "steps1": Case(op, dict(steps=1)),
        "steps7": Case(op, dict(steps=7)),
    }
    return {(op, name): case for name, case in cases.items()}


def _step_cases(op):
    pool = dict(state_rows=5)
    cases = {
        "decode_subset": Case(op, dict(pool, steps=1), dict(state_indices=[3, 0])),
        "decode_permutation": Case(op, dict(steps=1), dict(state_indices=[1, 0])),
        "default_indices": Case(op, dict(steps=1)),
        "prefill": Case(op, dict(pool, steps=7), dict(state_indices=[4, 1], scale=0.5)),
        "bfloat16": Case(op, dict(pool, steps=1), dict(state_indices=[2, 4]), dtype="bfloat16"),
        "strong_decay": Case(op, dict(pool, steps=7, decay="strong"), dict(state_indices=[0, 2])),
    }
    return {(op, name): case for name, case in cases.items()}


CASES = {
    **_sequence_cases("rwkv7", {}),
    **_sequence_cases("rwkv6", {}),
    **_sequence_cases("gated_linear_attention", dict(gates=ALL_GATES)),
    **_gla_gate_cases(),
    **_rwkv4_cases(),
    **_step_cases("rwkv7_step"),
    **_step_cases("rwkv6_step"),
}


# ------------------------------------------------------------------------------------------
# Running a case.
# ------------------------------------------------------------------------------------------

def _has_time_axis(name):
    return name not in STATE_NAMES + SHARED_NAMES


def call_op(op, x, options, backend):
    """Call the public op with the arrays ``x`` ([B, T, H, *] layout) -> (out, state).

    With ``head_first`` the time-major arrays are swapped to [B, H, T, *] on the way in and the
    output back on the way out, so callers always see [B, T, H, *].
    """
    head_first = options.get("head_first", False)
    if head_first:
        x = {n: jnp.swapaxes(a, 1, 2) if _has_time_axis(n) else a for n, a in x.items()}
    args = [x[n] for n in POSITIONAL[op]]
    keywords = {n: a for n, a in x.items() if n not in POSITIONAL[op]}
    out, state = getattr(rwkv_jax, op)(*args, **keywords, **options, backend=backend)
    return (jnp.swapaxes(out, 1, 2) if head_first else out), state


def make_inputs(case, seed):
    """(jax inputs in the case's dtype, the same values in float64 for the reference)."""
    rng = np.random.default_rng(seed)
    drawn = reference.random_inputs(case.op, rng, **{**dict(batch=BATCH, steps=STEPS,
                                                           heads=HEADS, key=KEY), **case.inputs})
    # States are float32 by contract; every other input takes the case's dtype.
    x = {n: jnp.asarray(a, jnp.float32 if n in STATE_NAMES else case.dtype)
         for n, a in drawn.items()}
    return x, {n: np.asarray(a, np.float64) for n, a in x.items()}, rng


def forward_and_gradients(case, backend):
    """jit(vjp) of the op: traced cu_seqlens / state_indices, static everything else."""
    static = {n: v for n, v in case.options.items() if n not in ("cu_seqlens", "state_indices")}

    @jax.jit
    def run(x, traced, d_out, d_state):
        (out, state), pullback = jax.vjp(
            lambda x: call_op(case.op, x, {**static, **traced}, backend), x)
        (grads,) = pullback((d_out, d_state))
        return out, state, grads

    return run


def traced_options(case):
    return {n: jnp.asarray(case.options[n], jnp.int32)
            for n in ("cu_seqlens", "state_indices") if n in case.options}


def check_case(backend, case, seed, run=None):
    """Run ``case`` on ``backend`` and compare everything with the reference."""
    x, x64, rng = make_inputs(case, seed)
    ref_opts = case.reference_options
    ref_out, ref_state = reference.forward(case.op, x64, **ref_opts)
    keep_state = case.options.get("output_final_state", True)
    d_out = jnp.asarray(rng.standard_normal(ref_out.shape), x["v"].dtype)
    d_state = jnp.asarray(rng.standard_normal(ref_state.shape), jnp.float32) if keep_state else None
    ref_grads = reference.gradients(
        case.op, x64, np.asarray(d_out, np.float64),
        np.asarray(d_state, np.float64) if keep_state else np.zeros(ref_state.shape), **ref_opts)

    run = run or forward_and_gradients(case, backend)
    out, state, grads = run(x, traced_options(case), d_out, d_state)

    forward_tol = tolerance(backend, case.dtype, "forward")
    gradient_tol = tolerance(backend, case.dtype, "gradient")
    assert out.dtype == x["v"].dtype and out.shape == ref_out.shape
    assert np.all(np.isfinite(np.asarray(out, np.float64))), "non-finite output"
    error = relative_error(out, ref_out)
    assert error <= forward_tol, f"output error {error:.2e}"
    if keep_state:
        assert state.dtype == jnp.float32 and state.shape == ref_state.shape
        assert np.all(np.isfinite(state)), "non-finite state"
        error = relative_error(state, ref_state)
        assert error <= forward_tol, f"final state error {error:.2e}"
    else:
        assert state is None
    if case.op.endswith("_step"):
        untouched = np.setdiff1d(np.arange(x["state"].shape[0]),
                                 case.options.get("state_indices", np.arange(BATCH)))
        assert np.array_equal(np.asarray(state)[untouched], np.asarray(x["state"])[untouched]), \
            "pool rows outside state_indices changed"
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert grad.dtype == x[name].dtype and grad.shape == x[name].shape, name
        assert np.all(np.isfinite(np.asarray(grad, np.float64))), f"non-finite d{name}"
        error = relative_error(grad, ref_grads[name])
        assert error <= gradient_tol, f"gradient of {name}: error {error:.2e} > {gradient_tol}"


def _seed(*parts):
    return zlib.crc32("/".join(parts).encode())


@pytest.mark.parametrize("op, option", sorted(CASES), ids=lambda p: p)
def test_matches_reference(backend, op, option):
    check_case(backend, CASES[op, option], _seed(op, option))


# ------------------------------------------------------------------------------------------
# jit / vmap / grad composition and the jit cache under cu_seqlens.
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["rwkv7", "rwkv6", "gated_linear_attention"])
def test_cu_seqlens_compiles_once_for_every_length_pattern(backend, op):
    """cu_seqlens is traced: two length patterns with the same N share one compiled program,
    and each still equals running its segments alone."""
    gates = dict(gates=ALL_GATES) if op == "gated_linear_attention" else {}
    first = Case(op, dict(gates, **PACKED), dict(cu_seqlens=CU_SEQLENS))
    second = dataclasses.replace(first, options=dict(cu_seqlens=[0, 0, 20, 21, STEPS]))
    run = forward_and_gradients(first, backend)
    check_case(backend, first, _seed(op, "pattern1"), run)
    check_case(backend, second, _seed(op, "pattern2"), run)
    assert run._cache_size() == 1


VMAP_CASES = {
    "rwkv7": Case("rwkv7", dict(steps=7)),
    "rwkv6": Case("rwkv6", dict(steps=7)),
    "gated_linear_attention": Case("gated_linear_attention", dict(steps=7, gates=ALL_GATES)),
    "rwkv4": Case("rwkv4", dict(steps=7)),
    "rwkv7_step": Case("rwkv7_step", dict(steps=1), dict(state_indices=[1, 0])),
}


@pytest.mark.parametrize("op", sorted(VMAP_CASES))
def test_jit_of_vmap_of_grad(backend, op):
    """jax.jit(jax.vmap(jax.grad(loss))) over a leading axis equals the reference per slice."""
    case = VMAP_CASES[op]
    slices = [make_inputs(case, _seed(op, "vmap", str(i))) for i in range(2)]
    outs = [reference.forward(op, x64, **case.reference_options) for _, x64, _ in slices]
    rng = np.random.default_rng(_seed(op, "vmap cotangents"))
    d_out = np.stack([rng.standard_normal(o.shape) for o, _ in outs])
    d_state = np.stack([rng.standard_normal(s.shape) for _, s in outs])
    traced = traced_options(case)

    def loss(x, d_out, d_state):
        out, state = call_op(op, x, {**case.options, **traced}, backend)
        return jnp.sum(out * d_out) + jnp.sum(state * d_state)

    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[x for x, _, _ in slices])
    grads = jax.jit(jax.vmap(jax.grad(loss)))(stacked, jnp.asarray(d_out, jnp.float32),
                                              jnp.asarray(d_state, jnp.float32))
    for i, (_, x64, _) in enumerate(slices):
        ref = reference.gradients(op, x64, d_out[i], d_state[i], **case.reference_options)
        for name in ref:
            error = relative_error(grads[name][i], ref[name])
            assert error <= tolerance(backend, "float32", "gradient"), f"d{name}[{i}]: {error:.2e}"


@pytest.mark.parametrize("op", ["rwkv7"])
def test_eager_call_without_jit(backend, op):
    """The op also runs op-by-op outside jit, forward and vjp, with the same results."""
    case = Case(op, dict(steps=7))
    x, x64, rng = make_inputs(case, _seed("eager"))
    (out, state), pullback = jax.vjp(lambda x: call_op(op, x, {}, backend), x)
    ref_out, ref_state = reference.forward(op, x64)
    d_out, d_state = rng.standard_normal(ref_out.shape), rng.standard_normal(ref_state.shape)
    (grads,) = pullback((jnp.asarray(d_out, jnp.float32), jnp.asarray(d_state, jnp.float32)))
    ref_grads = reference.gradients(op, x64, d_out, d_state)
    assert relative_error(out, ref_out) <= tolerance(backend, "float32", "forward")
    assert relative_error(state, ref_state) <= tolerance(backend, "float32", "forward")
    for name in ref_grads:
        assert relative_error(grads[name], ref_grads[name]) <= tolerance(backend, "float32",
                                                                         "gradient"), name

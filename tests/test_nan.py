"""NaN in, NaN out, on every backend and op: a NaN in any input (a log decay or gate, r, k, v,
a, b, the bonus, the initial state or the step pool) comes back as NaN in the outputs it feeds,
the final state where it feeds the state, and the gradients, never as a finite value. The
backends' floor on log decays (DESIGN.md, numerical contract) raises finite and -inf values
only; a NaN decay stays NaN. The NaN sits in the first element of the input (token 0, head or
channel 0 of batch row 0: a RWKV-6 decay at the last token would reach the state only), and
head 1 (channels 1 on) stays finite: the NaN is visible where it belongs and goes nowhere else.
"""

from __future__ import annotations

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

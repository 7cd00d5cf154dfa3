"""The native backend's memory is bounded: training stores the state only at checkpointed block
boundaries (about sqrt(T) of them), inference stores no per-step state at all.

Measured with XLA's compiled memory analysis (temp_size_in_bytes: scratch buffers beyond the
arguments and outputs), which compiles but runs nothing, so even the issue's full-size shape
is cheap to check.
"""

import jax
import jax.numpy as jnp
import pytest

import rwkv_jax

BATCH, HEADS, KEY = 1, 2, 64
STATE_BYTES = BATCH * HEADS * KEY * KEY * 4  # one float32 state [B, H, K, V]
SEQUENCE_OPS = {  # op -> names of its [B, T, H, K] inputs
    "rwkv7": tuple("rwkvab"),
    "rwkv6": tuple("rkvw"),
    "gated_linear_attention": ("q", "k", "v", "gk", "gv"),
}


def temp_bytes(op, steps, *, train, batch=BATCH, heads=HEADS, key=KEY):
    """Scratch memory XLA plans for the op (forward+backward when ``train``)."""
    names = SEQUENCE_OPS[op]
    token = jax.ShapeDtypeStruct((batch, steps, heads, key), jnp.float32)
    extra = {"rwkv6": {"u": jax.ShapeDtypeStruct((heads, key), jnp.float32)}}.get(op, {})

    def loss(inputs):
        named = {n: inputs[n] for n in names + tuple(extra)}
        positional = [named.pop(n) for n in ("q", "k", "v") if op == "gated_linear_attention"]
        o, h = getattr(rwkv_jax, op)(*positional, **named, backend="native")
        return jnp.sum(o) + jnp.sum(h)

    fn = jax.grad(loss) if train else loss
    inputs = dict({n: token for n in names}, **extra)
    return jax.jit(fn).lower(inputs).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("op", sorted(SEQUENCE_OPS))
def test_training_memory_is_far_below_per_step_states(op):
    """At T=4096, storing every step's state would need T * state = 134 MB of scratch; the
    checkpointed scan must stay under a quarter of that (it needs about 15%, most of it the
    time-major copies of the inputs)."""
    steps = 4096
    assert temp_bytes(op, steps, train=True) < steps * STATE_BYTES / 4


@pytest.mark.parametrize("op", sorted(SEQUENCE_OPS))
def test_backward_extra_memory_grows_like_sqrt_t(op):
    """What the backward adds over the forward (stored block-boundary states and one block's
    recomputed states, ~2 sqrt(T) states) grows ~sqrt(T): 16x more steps cost ~4x (measured
    ~3x), not 16x. The bound is the geometric middle, 8x."""
    extra = {steps: temp_bytes(op, steps, train=True) - temp_bytes(op, steps, train=False)
             for steps in (256, 4096)}
    assert extra[256] > 0
    assert extra[4096] / extra[256] < 8, extra


@pytest.mark.parametrize("op", sorted(SEQUENCE_OPS))
def test_inference_keeps_no_per_step_states(op):
    """Without a gradient, scratch is the time-major copies of the inputs and of the output
    (measured: those plus ~8 states), never a state per step (which would add 134 MB)."""
    steps = 4096
    copies = (len(SEQUENCE_OPS[op]) + 1) * BATCH * steps * HEADS * KEY * 4
    assert temp_bytes(op, steps, train=False) < copies + 16 * STATE_BYTES


def test_issue_shape_fits_in_a_few_gigabytes():
    """B=8, T=4096, H=64, K=V=64: per-step states would need 34 GB; the native forward+backward
    plans about 5 GB of scratch (3.2 GB of it the time-major copies of the six inputs)."""
    batch, steps, heads, key = 8, 4096, 64, 64
    per_step = steps * batch * heads * key * key * 4
    scratch = temp_bytes("rwkv7", steps, train=True, batch=batch, heads=heads, key=key)
    assert scratch < 6e9 and scratch < per_step / 5

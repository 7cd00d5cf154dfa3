"""Tests specific to the ``chunked`` backend (the shared suite in test_ops.py covers the rest).

The chunked algorithm must agree with the step-by-step ``native`` backend to float32 rounding
(much tighter than the contract's 2e-3, which leaves room for tf32 on GPUs) at chunk
boundaries, for strong (-8) and zero log decays, with packed segments, and in all gradients;
it must compile once for every packing of the same number of segments, and its training memory
must not grow like one state per step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from reference import relative_error
from rwkv_jax.backends import chunked, native

FORWARD_TOLERANCE = 1e-4   # chunked vs native, both float32
GRADIENT_TOLERANCE = 1e-4
HEADS, KEY, VALUE = 2, 16, 8  # K != V on purpose
OPS = ("rwkv7", "rwkv6", "gated_linear_attention")
ALL_GATES = ("g", "g_gamma", "gk", "gv")


def draw(op, seed, *, steps, batch=1, decay="model", state_rows=None, constant_decay=None):
    """float32 inputs of ``op`` (``initial_state`` included) as a model would produce them;
    ``constant_decay`` sets every log decay to that value (w, or every GLA gate)."""
    rng = np.random.default_rng(seed)
    x = reference.random_inputs(op, rng, batch=batch, steps=steps, heads=HEADS, key=KEY,
                                value=VALUE, decay=decay, gates=ALL_GATES, state_rows=state_rows)
    if constant_decay is not None:
        for name in ("w", "g", "gk", "gv"):
            if name in x:
                x[name] = np.full_like(x[name], constant_decay)
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}, rng


def call(module, op, x, cu_seqlens=None, chunk_size=None, reverse=False):
    """The backend function of ``op`` with the canonical keywords -> (o, final state);
    ``reverse`` applies to gated_linear_attention only."""
    x = dict(x)
    extra = dict(scale=0.5, initial_state=x.pop("initial_state", None), output_final_state=True,
                 cu_seqlens=cu_seqlens)
    if op == "gated_linear_attention":
        extra.update({gate: x.pop(gate, None) for gate in ALL_GATES}, reverse=reverse)
    if chunk_size is not None:
        extra["chunk_size"] = chunk_size
    return getattr(module, op)(**x, **extra)


@functools.partial(jax.jit, static_argnames=("module", "op", "chunk_size", "reverse"))
def forward_and_gradients(x, d_out, d_state, cu_seqlens=None, *, module, op, chunk_size=None,
                          reverse=False):
    (out, state), pullback = jax.vjp(
        lambda x: call(module, op, x, cu_seqlens, chunk_size, reverse), x)
    return out, state, pullback((d_out, d_state))[0]


def compare_with_native(op, x, rng, *, chunk_size, cu_seqlens=None, reverse=False):
    """chunked and native agree on the output, the final state and every gradient."""
    out, state = call(native, op, x, cu_seqlens, reverse=reverse)
    d_out = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    d_state = jnp.asarray(rng.standard_normal(state.shape), jnp.float32)
    results = {}
    for module in (native, chunked):
        results[module] = forward_and_gradients(
            x, d_out, d_state, cu_seqlens, module=module, op=op,
            chunk_size=chunk_size if module is chunked else None, reverse=reverse)
    (out_n, state_n, grads_n), (out_c, state_c, grads_c) = results[native], results[chunked]
    for name, value in [("output", out_c), ("final state", state_c), *grads_c.items()]:
        assert np.all(np.isfinite(np.asarray(value))), f"non-finite {name}"
    assert relative_error(out_c, out_n) <= FORWARD_TOLERANCE, "output"
    assert relative_error(state_c, state_n) <= FORWARD_TOLERANCE, "final state"
    assert set(grads_c) == set(x)
    for name in x:
        error = relative_error(grads_c[name], grads_n[name])
        assert error <= GRADIENT_TOLERANCE, f"gradient of {name}: {error:.2e}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("steps", [15, 16, 17, 53])  # C - 1, C, C + 1, 3C + 5 for C = 16
def test_chunk_boundaries(op, steps):
    x, rng = draw(op, steps, steps=steps, batch=2)
    compare_with_native(op, x, rng, chunk_size=16)


@pytest.mark.parametrize("op", OPS)
def test_several_sub_chunks_per_chunk(op):
    """C = 64 holds four sub-chunks: the factored decays between them and the merged inverse."""
    x, rng = draw(op, 64, steps=3 * 64 + 5)
    compare_with_native(op, x, rng, chunk_size=64)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("decay", [-8.0, 0.0, "strong"])
def test_extreme_decays_with_long_chunks(op, decay):
    """w = -8 everywhere sums to -512 over a chunk of 64: exponents must stay differences."""
    constant = decay if isinstance(decay, float) else None
    x, rng = draw(op, 8, steps=130, decay="strong", constant_decay=constant)
    compare_with_native(op, x, rng, chunk_size=64)


def test_gated_linear_attention_reverse():
    x, rng = draw("gated_linear_attention", 5, steps=40)
    compare_with_native("gated_linear_attention", x, rng, chunk_size=16, reverse=True)


@pytest.mark.parametrize("op", OPS)
def test_packed_segments_compile_once(op):
    """Segment lengths that are not multiples of C, an empty segment, a one-token segment;
    two length patterns with the same number of segments share one compilation."""
    steps = 70
    patterns = [[0, 5, 5, 38, 39, steps], [0, 17, 40, 40, 52, steps]]
    x, rng = draw(op, 3, steps=steps, state_rows=len(patterns[0]) - 1)
    forward_and_gradients.clear_cache()
    for cu_seqlens in patterns:
        cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        compare_with_native(op, x, rng, chunk_size=16, cu_seqlens=cu_seqlens)
        out, state = call(chunked, op, x, cu_seqlens, chunk_size=16)
        empty = int(np.flatnonzero(np.diff(np.asarray(cu_seqlens)) == 0)[0])
        assert np.array_equal(state[empty], x["initial_state"][empty]), \
            "an empty segment must keep its initial state"
    assert forward_and_gradients._cache_size() == 2, "one compilation per backend"


def test_training_memory_is_per_chunk():
    """The compiled forward + backward keeps per-chunk states only: its temporary memory is far
    below one state per step, and it grows like the inputs as T quadruples."""
    heads, key = 2, 32

    def temp_bytes(steps):
        shapes = {n: jax.ShapeDtypeStruct((1, steps, heads, key), jnp.float32) for n in "rwkvab"}
        shapes["initial_state"] = jax.ShapeDtypeStruct((1, heads, key, key), jnp.float32)

        def loss(x):
            out, state = call(chunked, "rwkv7", x, chunk_size=64)
            return jnp.sum(out) + jnp.sum(state)

        compiled = jax.jit(jax.grad(loss)).lower(shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    steps = 2048
    small, large = temp_bytes(steps // 4), temp_bytes(steps)
    growth = large - small  # for 3/4 of the steps
    per_step_states = 3 * steps // 4 * heads * key * key * 4
    inputs = 6 * 3 * steps // 4 * heads * key * 4
    assert growth < per_step_states / 4, (small, large, per_step_states)
    assert growth < 4 * inputs, (small, large, inputs)


def test_unit_lower_inverse_and_its_gradient():
    rng = np.random.default_rng(1)
    for size in (16, 64):
        a = np.tril(rng.standard_normal((3, size, size)), -1) * 0.3
        expected = np.linalg.inv(np.eye(size) - a)
        inverse = chunked._unit_lower_inverse(jnp.asarray(a, jnp.float32))
        assert relative_error(inverse, expected) < 1e-5
        d_inverse = rng.standard_normal(a.shape)
        # d/da <T, dT> = T^T dT T^T on the strictly lower part.
        expected_grad = np.tril(np.swapaxes(expected, -1, -2) @ d_inverse
                                @ np.swapaxes(expected, -1, -2), -1)
        grad = jax.grad(lambda a: jnp.sum(chunked._unit_lower_inverse(a) * d_inverse))(
            jnp.asarray(a, jnp.float32))
        assert relative_error(grad, expected_grad) < 1e-5


def test_bad_chunk_size():
    x, _ = draw("rwkv7", 0, steps=8)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        call(chunked, "rwkv7", x, chunk_size=48)

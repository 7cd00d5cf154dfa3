"""Offsets and pool indices that are invalid (DESIGN.md, "Public API"), held on every backend.

Values Python can know (numpy arrays and scalars, lists, tuples, jax arrays that are not
tracers) raise a ValueError naming the argument before any kernel runs. Traced values (under
``jax.jit``) that turn out invalid never crash or read outside a buffer: invalid ``cu_seqlens``
make every value of ``o`` and of the final state NaN, an invalid ``state_indices`` row (outside
the pool, or a slot two rows share) gets a NaN output row and writes no slot, while valid rows
work as usual. The cases once observed on the GPU are here, tiny (the Triton interpreter runs them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rwkv_jax
import reference
from reference import relative_error
from conftest import has_gpu, tolerance
from rwkv_jax import backends
from test_ops import call_op

# The CUDA kernels of the ffi backend take K in {64, 128} only.
T, HEADS, KEY = 32, 2, (64 if has_gpu() else 16)
SEQUENCE_OPS = ("rwkv7", "rwkv6", "gated_linear_attention")
STEP_OPS = ("rwkv7_step", "rwkv6_step")

# Offsets invalid for T = 32 (the cases first), and one wrapped by an int32 cast: 2**32 + 10
# would become 10, a valid offset, if it were cast before the check.
BAD_OFFSETS = {
    "past_end": [0, 10, 40],
    "negative": [0, -8, 32],
    "far_negative": [-100000, 10, 32],
    "short_of_T": [0, 10, 20],
    "late_start": [4, 10, 32],
    "decreasing": [0, 20, 10, 32],
}
INT32_WRAPPED_OFFSETS = np.array([0, 2**32 + 10, 32], np.int64)
GOOD_OFFSETS = [[0, 10, 32], [0, 12, 12, 32]]  # one with an empty segment

# Pool of 4 slots, batch of 2.
SLOTS = 4
BAD_ROWS = {  # rows -> which rows are invalid
    "past_pool": ([0, 4], [False, True]),
    "negative": ([0, -1], [False, True]),
    "shared_slot": ([2, 2], [True, True]),
}
INT32_WRAPPED_ROWS = np.array([0, 2**32 + 1], np.int64)


def _inputs(op, seed, **options):
    rng = np.random.default_rng(seed)
    drawn = reference.random_inputs(op, rng, **{**dict(steps=T, heads=HEADS, key=KEY), **options})
    return {n: jnp.asarray(a, jnp.float32) for n, a in drawn.items()}, drawn


def _as(form, values):
    if form == "numpy":
        return np.asarray(values, np.int32)
    if form == "list":
        return list(values)
    if form == "tuple":
        return tuple(values)
    return jnp.asarray(values, jnp.int32)  # a concrete jax array: its values are read too


# ------------------------------------------------------------------------------------------
# Values known in Python: a ValueError naming the argument, before any kernel runs.
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", SEQUENCE_OPS)
@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
@pytest.mark.parametrize("form", ["numpy", "list", "tuple", "jax"])
def test_concrete_bad_offsets_raise(backend, op, case, form):
    x, _ = _inputs(op, 0, batch=1, state_rows=len(BAD_OFFSETS[case]) - 1)
    with pytest.raises(ValueError, match="cu_seqlens") as error:
        call_op(op, x, dict(cu_seqlens=_as(form, BAD_OFFSETS[case])), backend)
    assert "T=32" in str(error.value)


@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_int64_offsets_are_checked_before_any_cast(backend, op):
    x, _ = _inputs(op, 0, batch=1, state_rows=2)
    with pytest.raises(ValueError, match=r"cu_seqlens.*4294967306"):
        call_op(op, x, dict(cu_seqlens=INT32_WRAPPED_OFFSETS), backend)


@pytest.mark.parametrize("op", STEP_OPS)
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
@pytest.mark.parametrize("form", ["numpy", "list", "jax"])
def test_concrete_bad_state_indices_raise(backend, op, case, form):
    x, _ = _inputs(op, 0, batch=2, steps=1, state_rows=SLOTS)
    with pytest.raises(ValueError, match="state_indices"):
        call_op(op, x, dict(state_indices=_as(form, BAD_ROWS[case][0])), backend)


@pytest.mark.parametrize("op", STEP_OPS)
def test_int64_state_indices_are_checked_before_any_cast(backend, op):
    x, _ = _inputs(op, 0, batch=2, steps=1, state_rows=SLOTS)
    for rows in (INT32_WRAPPED_ROWS, np.int64(2**32 + 1) * np.ones(2, np.int64)):
        with pytest.raises(ValueError, match=r"state_indices.*4294967297"):
            call_op(op, x, dict(state_indices=rows), backend)


# ------------------------------------------------------------------------------------------
# Traced values: NaN results, never a crash; valid traced values still match the reference.
# ------------------------------------------------------------------------------------------

def _traced_forward_and_gradients(op, backend):
    @jax.jit
    def run(x, cu_seqlens):
        (o, h), pullback = jax.vjp(lambda x: call_op(op, x, dict(cu_seqlens=cu_seqlens), backend), x)
        (grads,) = pullback((jnp.ones_like(o), jnp.ones_like(h)))
        return o, h, grads
    return run


@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_traced_bad_offsets_give_nan(backend, op):
    run = _traced_forward_and_gradients(op, backend)
    for case, offsets in BAD_OFFSETS.items():
        x, _ = _inputs(op, 1, batch=1, state_rows=len(offsets) - 1)
        o, h, grads = run(x, jnp.asarray(offsets, jnp.int32))
        assert np.all(np.isnan(o)) and np.all(np.isnan(h)), f"{case}: results not all NaN"
        for name, grad in grads.items():  # defined: the NaN results pass no gradient back
            assert np.all(np.isfinite(grad)), f"{case}: non-finite d{name}"
    for offsets in GOOD_OFFSETS:
        x, x64 = _inputs(op, 2, batch=1, state_rows=len(offsets) - 1)
        o, h, _ = run(x, jnp.asarray(offsets, jnp.int32))
        ref_o, ref_h = reference.forward(op, x64, cu_seqlens=np.asarray(offsets))
        tol = tolerance(backend, "float32", "forward")
        assert relative_error(o, ref_o) <= tol and relative_error(h, ref_h) <= tol, offsets


def _traced_step(op, backend):
    def step(x, state, rows):
        return call_op(op, dict(x, state=state), dict(state_indices=rows), backend)
    return jax.jit(step, donate_argnums=1)  # the pool is donated, as inference uses it


@pytest.mark.parametrize("op", STEP_OPS)
def test_traced_bad_state_indices_spare_the_pool(backend, op):
    step = _traced_step(op, backend)
    cases = dict(BAD_ROWS, valid=([3, 1], [False, False]))
    for case, (rows, invalid) in cases.items():
        x, x64 = _inputs(op, 3, batch=2, steps=2, state_rows=SLOTS)
        pool = np.asarray(x.pop("state"))
        o, new_pool = step(x, jnp.asarray(pool), jnp.asarray(rows, jnp.int32))
        o, new_pool = np.asarray(o), np.asarray(new_pool)
        invalid = np.asarray(invalid)
        assert np.all(np.isnan(o[invalid])), f"{case}: invalid rows' outputs not NaN"
        valid = np.flatnonzero(~invalid)
        expected_pool = pool.copy()
        if valid.size:
            only_valid = {n: (a if n in ("u", "state") else a[valid]) for n, a in x64.items()}
            ref_o, ref_pool = reference.forward(op, only_valid,
                                                state_indices=np.asarray(rows)[valid])
            tol = tolerance(backend, "float32", "forward")
            assert relative_error(o[valid], ref_o) <= tol, case
            written = np.asarray(rows)[valid]
            assert relative_error(new_pool[written], ref_pool[written]) <= tol, case
            expected_pool[written] = new_pool[written]
        # Every slot that no valid row names is untouched, bit for bit (a shared slot too).
        assert np.array_equal(new_pool, expected_pool), f"{case}: a slot was written"


@pytest.mark.parametrize("op", STEP_OPS)
def test_traced_bad_state_indices_have_gradients(backend, op):
    x, _ = _inputs(op, 4, batch=2, steps=2, state_rows=SLOTS)

    @jax.jit
    def grads(x, rows):
        def loss(x):
            o, pool = call_op(op, x, dict(state_indices=rows), backend)
            return jnp.sum(jnp.where(jnp.isnan(o), 0.0, o)) + jnp.sum(pool)
        return jax.grad(loss)(x)

    g = grads(x, jnp.asarray([1, 4], jnp.int32))
    assert all(np.all(np.isfinite(a)) for a in g.values())
    # The invalid row (index 4) neither reads nor writes a slot: nothing flows back to its inputs.
    for name, grad in g.items():
        if name not in ("u", "state"):
            assert np.all(np.asarray(grad)[1] == 0), f"d{name} of the invalid row"
    # The pool's cotangent passes straight through every slot the valid row does not write.
    untouched = [0, 2, 3]
    assert np.array_equal(np.asarray(g["state"])[untouched], np.ones((3,) + x["state"].shape[1:]))


# ------------------------------------------------------------------------------------------
# RWKV6_OP's state_map (rwkv_ops convention) is checked the same way.
# ------------------------------------------------------------------------------------------

def _rwkv6_op_inputs(seed=5, batch=2, length=5, heads=2, size=KEY):
    rng = np.random.default_rng(seed)
    c = heads * size
    x = {n: jnp.asarray(rng.standard_normal((batch, length, c)), jnp.float32) for n in "rkv"}
    x["w"] = jnp.asarray(rng.uniform(-3.0, 0.0, (batch, length, c)), jnp.float32)
    x["u"] = jnp.asarray(0.5 * rng.standard_normal((heads, size)), jnp.float32)
    init = jnp.asarray(0.5 * rng.standard_normal((3, heads, size, size)), jnp.float32)
    return x, init, rwkv_jax.RWKV6_OP(head_size=size)


@pytest.mark.parametrize("state_map", [[0, 5], [-1, 0], np.array([0, 2**32 + 1], np.int64)],
                         ids=["past_end", "negative", "int32_wrapped"])
def test_rwkv6_op_concrete_bad_state_map_raises(state_map):
    x, init, op = _rwkv6_op_inputs()
    with pytest.raises(ValueError, match=r"state_map must be in \[0, 3\)"):
        op(**x, init_state=init, state_map=state_map, with_state=True)


def test_rwkv6_op_traced_bad_state_map_gives_nan_rows():
    x, init, op = _rwkv6_op_inputs()
    run = jax.jit(lambda x, m: op(**x, init_state=init, state_map=m, with_state=True))
    y, state = run(x, jnp.asarray([2, 5], jnp.int32))
    y_ref, state_ref = op(**x, init_state=init, state_map=[2, 2], with_state=True)
    assert np.all(np.isnan(y[1])) and np.all(np.isnan(state[1]))
    np.testing.assert_allclose(y[0], y_ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state[0], state_ref[0], rtol=1e-5, atol=1e-6)
    # Rows may share an initial state: a repeated traced index is valid here.
    y, _ = run(x, jnp.asarray([2, 2], jnp.int32))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Defence in depth: the ffi kernels themselves, called without the ops layer's checks.
# ------------------------------------------------------------------------------------------

ffi_only = pytest.mark.skipif(
    backends.unavailable_reason("ffi", backends.platform()) is not None,
    reason="the ffi backend is not built here")

# Invalid offsets and the valid ones the CUDA kernels' clamping makes of them: the first range
# starts at 0, the last ends at T, every other offset is clamped into [previous, T].
CLAMPED_OFFSETS = [([0, 10, 20], [0, 10, 32]), ([4, 10, 32], [0, 10, 32]),
                   ([0, 10, 40], [0, 10, 32]), ([0, -8, 32], [0, 0, 32])]


@ffi_only
@pytest.mark.parametrize("kernel", ["rwkv7", "rwkv7_chunk"])
@pytest.mark.parametrize("offsets, clamped", CLAMPED_OFFSETS, ids=str)
def test_ffi_kernels_never_return_unwritten_memory(offsets, clamped, kernel):
    """Both rwkv7 kernel pairs of the ffi backend: the sequential one and the chunked one (on the
    CPU its twin; K = V = 64, a size it takes)."""
    from rwkv_jax.backends import ffi
    x, _ = _inputs("rwkv7", 6, batch=1, state_rows=2, key=64)
    args = [x[n] for n in "rwkvab"] + [x["initial_state"]]
    run = jax.jit(lambda cu: ffi._rwkv7(kernel, 1.0, *args, cu))
    if backends.platform() == "cpu":  # the C++ kernels read the offsets on the host: an error
        with pytest.raises(Exception, match="cu_seqlens"):
            jax.block_until_ready(run(jnp.asarray(offsets, jnp.int32)))
    else:  # the CUDA kernels clamp: the same results as the clamped offsets, written everywhere
        o, h = run(jnp.asarray(offsets, jnp.int32))
        o_ref, h_ref = run(jnp.asarray(clamped, jnp.int32))
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(h, h_ref)


@ffi_only
@pytest.mark.parametrize("op", STEP_OPS)
def test_ffi_step_kernels_skip_rows_outside_the_pool(op):
    from rwkv_jax.backends import ffi
    x, _ = _inputs(op, 7, batch=2, steps=2, state_rows=SLOTS)
    pool = np.asarray(x["state"])
    names = "rwkvab" if op == "rwkv7_step" else "rkvwu"
    for rows in ([1, SLOTS], [1, -3], [1, 2**31 - 1]):
        o, new_pool = jax.jit(lambda x, rows: getattr(ffi, op)(
            *[x[n] for n in names], x["state"], scale=1.0, state_indices=rows))(
                x, jnp.asarray(rows, jnp.int32))
        assert np.all(np.isnan(o[1])) and np.all(np.isfinite(o[0])), rows
        untouched = [0, 2, 3]
        np.testing.assert_array_equal(np.asarray(new_pool)[untouched], pool[untouched])

"""rwkv_jax.shard on 8 simulated CPU devices (tests/conftest.py creates them).

Every combination of batch, head and sequence axes on a (2, 2, 2) mesh must give the
single-device result of the same op and backend, forward and gradients (initial state
included), with outputs really split: each device holds only its block.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import reference
from reference import relative_error
import rwkv_jax
from conftest import tolerance
from scripts import load_script

MESH_AXES = {"batch_axis": "data", "head_axis": "heads", "seq_axis": "seq"}
COMBINATIONS = [roles for n in (1, 2, 3) for roles in itertools.combinations(MESH_AXES, n)]
SEQUENCE_OPS = ("rwkv7", "rwkv6", "gated_linear_attention")
POSITIONAL = {"rwkv7": tuple("rwkvab"), "rwkv6": tuple("rkvwu"),
              "gated_linear_attention": ("q", "k", "v"), "rwkv4": ("w", "u", "k", "v")}
SIZES = dict(batch=2, steps=16, heads=2, key=8)
ALL_GATES = ("g", "g_gamma", "gk", "gv")


def test_eight_devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set jax_num_cpu_devices to 8"


def _mesh(shape=(2, 2, 2), names=("data", "heads", "seq")):
    return jax.make_mesh(shape, names)


def _inputs(op, seed, dtype="float32", **options):
    options = {**SIZES, **options}
    if op == "gated_linear_attention":
        options.setdefault("gates", ALL_GATES)
    x = reference.random_inputs(op, np.random.default_rng(seed), **options)
    return {n: jnp.asarray(y, jnp.float32 if n == "initial_state" else dtype) for n, y in x.items()}


def _call(fn, op, x, options):
    positional = [x[n] for n in POSITIONAL[op]]
    keywords = {n: y for n, y in x.items() if n not in POSITIONAL[op]}
    return fn(*positional, **keywords, **options)


def _forward_and_gradients(fn, op, x, options, seed=1):
    """(output, final state, gradients of every input) for random cotangents, under jit."""
    @jax.jit
    def run(x):
        (o, h), pull = jax.vjp(lambda x: _call(fn, op, x, options), x)
        rng = np.random.default_rng(seed)
        do = jnp.asarray(rng.standard_normal(o.shape), o.dtype)
        dh = None if h is None else jnp.asarray(rng.standard_normal(h.shape), h.dtype)
        return o, h, pull((do, dh))[0]
    return run(x)


_ONE_DEVICE = {}


def _assert_matches(op, x, roles, *, options=None, mesh=None, backend="native", dtype="float32"):
    """Sharded over ``roles`` equals one device, forward and gradients; returns (o, h)."""
    options = dict(options or {})
    mesh = _mesh() if mesh is None else mesh
    fn = functools.partial(getattr(rwkv_jax, op), backend=backend)
    sharded = rwkv_jax.shard(fn, mesh, **{role: MESH_AXES[role] for role in roles})
    o, h, grads = _forward_and_gradients(sharded, op, x, options)
    # The single-device run is shared by the tests that give it the same inputs.
    key = (op, backend, repr(options), tuple((n, y.shape, np.asarray(y, np.float32).tobytes())
                                             for n, y in x.items()))
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = _forward_and_gradients(fn, op, x, options)
    o1, h1, grads1 = _ONE_DEVICE[key]
    forward, gradient = tolerance(backend, dtype, "forward"), tolerance(backend, dtype, "gradient")
    assert o.dtype == o1.dtype and o.shape == o1.shape
    assert relative_error(o, o1) <= forward, "output"
    if h1 is None:
        assert h is None
    else:
        assert h.dtype == h1.dtype and relative_error(h, h1) <= forward, "final state"
    for name in x:
        assert grads[name].dtype == grads1[name].dtype, name
        assert relative_error(grads[name], grads1[name]) <= gradient, f"gradient of {name}"
    return o, h


def _assert_split(x, mesh, axes_per_dim):
    """Each of the mesh's devices holds only its block of ``x``: the shape divided by the
    sizes of the mesh axes named per dimension (None: not split)."""
    block = tuple(size // (mesh.shape[a] if a else 1) for size, a in zip(x.shape, axes_per_dim))
    shards = x.addressable_shards
    assert len(shards) == mesh.size
    assert all(s.data.shape == block for s in shards), (block, [s.data.shape for s in shards])
    distinct = {tuple((i.start, i.stop) for i in s.index) for s in shards}
    assert len(distinct) == math.prod(mesh.shape[a] for a in axes_per_dim if a)


@pytest.mark.parametrize("roles", COMBINATIONS, ids="+".join)
@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_every_axis_combination_matches_one_device(op, roles):
    mesh = _mesh()
    o, h = _assert_matches(op, _inputs(op, seed=0), roles, mesh=mesh)
    axis = {r[0]: MESH_AXES[r] for r in roles}   # "b", "h", "s"
    _assert_split(o, mesh, (axis.get("b"), axis.get("s"), axis.get("h"), None))
    _assert_split(h, mesh, (axis.get("b"), axis.get("h"), None, None))


@pytest.mark.parametrize("roles", [("batch_axis",), ("head_axis",), ("batch_axis", "head_axis")],
                         ids="+".join)
def test_rwkv4_over_batch_and_channels(roles):
    mesh = _mesh()
    o, state = _assert_matches("rwkv4", _inputs("rwkv4", seed=3), roles, mesh=mesh)
    axis = {r[0]: MESH_AXES[r] for r in roles}
    _assert_split(o, mesh, (axis.get("b"), None, axis.get("h")))
    _assert_split(state, mesh, (axis.get("b"), axis.get("h"), None))


def _head_first(x):
    return {n: jnp.swapaxes(y, 1, 2) if n not in ("u", "g_gamma", "initial_state") else y
            for n, y in x.items()}


@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_every_backend_head_first_over_all_three_axes(op, backend):
    mesh = _mesh()
    o, _ = _assert_matches(op, _head_first(_inputs(op, seed=4)), tuple(MESH_AXES),
                           options=dict(head_first=True), mesh=mesh, backend=backend)
    _assert_split(o, mesh, ("data", "heads", "seq", None))


@pytest.mark.parametrize("case", [
    ("rwkv7", dict(value=4, decay="strong"), {}),       # V != K: the identity run has V = K
    ("rwkv6", dict(decay="zero"), dict(scale=0.37)),
    ("gated_linear_attention", dict(decay="strong"), dict(reverse=True)),
    ("gated_linear_attention", dict(gates=("g_gamma",), value=4), dict(reverse=True)),
], ids=lambda case: "-".join([case[0]] + [f"{k}={v}" for k, v in {**case[1], **case[2]}.items()]))
def test_sequence_over_eight_devices(case):
    """Two steps per device: the state crosses seven device boundaries."""
    op, input_options, options = case
    mesh = _mesh((8,), ("seq",))
    o, _ = _assert_matches(op, _inputs(op, seed=5, **input_options), ("seq_axis",),
                           options=options, mesh=mesh)
    _assert_split(o, mesh, (None, "seq", None, None))


@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_without_initial_or_final_state(op):
    gates = dict(gates=()) if op == "gated_linear_attention" else {}   # GLA: no gate at all
    x = _inputs(op, seed=7, initial_state=False, **gates)
    _assert_matches(op, x, tuple(MESH_AXES), options=dict(output_final_state=False))


def test_bfloat16_over_the_sequence():
    x = _inputs("rwkv7", seed=8, dtype="bfloat16")
    o, _ = _assert_matches("rwkv7", x, ("batch_axis", "seq_axis"), dtype="bfloat16")
    assert o.dtype == jnp.bfloat16


def test_partial_with_options_and_packed_sequences_over_heads():
    x = _inputs("rwkv6", seed=9, batch=1, state_rows=3)
    options = dict(cu_seqlens=np.array([0, 5, 5, 16], np.int32), scale=0.5)
    o, h = _assert_matches("rwkv6", x, ("head_axis",), options=options)
    assert h.shape == (3, 2, 8, 8)


def test_sequence_parallel_result_equals_float64_reference():
    """Not only the same as one device: right, against the independent numpy reference."""
    raw = reference.random_inputs("rwkv7", np.random.default_rng(10), **SIZES)
    x = {n: jnp.asarray(y, jnp.float32) for n, y in raw.items()}
    sharded = rwkv_jax.shard(rwkv_jax.rwkv7, _mesh(), **MESH_AXES)
    o, h = jax.jit(lambda x: _call(sharded, "rwkv7", x, {}))(x)
    want_o, want_h = reference.forward("rwkv7", raw)
    assert relative_error(o, want_o) <= 1e-5 and relative_error(h, want_h) <= 1e-5


@pytest.mark.parametrize("in_context", [False, True], ids=["no_context", "set_mesh"])
def test_explicit_mesh_and_presharded_inputs(in_context):
    """jax.make_mesh's Explicit axes, inputs already placed (over another axis than shard uses),
    with and without jax.set_mesh: still the one-device result."""
    mesh = _mesh()
    x = _inputs("rwkv7", seed=11)
    heads = NamedSharding(mesh, PartitionSpec("heads"))
    placed = {n: jax.device_put(y, heads) for n, y in x.items()}
    fn = functools.partial(rwkv_jax.rwkv7, backend="native")
    sharded = rwkv_jax.shard(fn, mesh, **MESH_AXES)
    with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
        got = _forward_and_gradients(sharded, "rwkv7", placed, {})
    want = _forward_and_gradients(fn, "rwkv7", x, {})
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert relative_error(got_leaf, want_leaf) <= 1e-4
    _assert_split(got[0], mesh, ("data", "seq", "heads", None))


def _sequence_args(op="rwkv7", **options):
    x = _inputs(op, seed=12, **options)
    return [x[n] for n in POSITIONAL[op]], {n: y for n, y in x.items() if n not in POSITIONAL[op]}


@pytest.mark.parametrize("axes, error, message", [
    (dict(batch_axis="rows"), ValueError, "batch_axis='rows' is not an axis of the mesh"),
    (dict(head_axis=0), TypeError, "head_axis must be a mesh axis name"),
    (dict(batch_axis="data", seq_axis="data"), ValueError, "both name mesh axis 'data'"),
])
def test_bad_axes(axes, error, message):
    with pytest.raises(error, match=message):
        rwkv_jax.shard(rwkv_jax.rwkv7, _mesh(), **axes)


def test_bad_op_and_mesh():
    with pytest.raises(TypeError, match="op must be one of rwkv_jax.rwkv7"):
        rwkv_jax.shard(rwkv_jax.rwkv7_step, _mesh(), batch_axis="data")
    with pytest.raises(TypeError, match="op must be one of"):
        rwkv_jax.shard(functools.partial(jnp.add, 1), _mesh(), batch_axis="data")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        rwkv_jax.shard(rwkv_jax.rwkv7, ("data",), batch_axis="data")
    with pytest.raises(ValueError, match="rwkv4 supports batch_axis and head_axis"):
        rwkv_jax.shard(rwkv_jax.rwkv4, _mesh(), seq_axis="seq")


def test_indivisible_dimension():
    args, keywords = _sequence_args(steps=15)
    sharded = rwkv_jax.shard(rwkv_jax.rwkv7, _mesh(), seq_axis="seq")
    with pytest.raises(ValueError, match=r"r has size 15 on axis 1 .* mesh axis 'seq' of size 2"):
        sharded(*args, **keywords)


def test_op_validation_runs_first():
    args, keywords = _sequence_args()
    sharded = rwkv_jax.shard(rwkv_jax.rwkv7, _mesh(), batch_axis="data")
    with pytest.raises(ValueError, match="v must be"):
        sharded(*args[:3], args[3][:, :, :1, :], *args[4:], **keywords)


def test_packed_sequences_over_the_sequence_axis_are_refused():
    args, keywords = _sequence_args(batch=1, state_rows=2)
    sharded = rwkv_jax.shard(rwkv_jax.rwkv7, _mesh(), seq_axis="seq")
    with pytest.raises(ValueError, match="cu_seqlens with seq_axis='seq' is not supported"):
        sharded(*args, **keywords, cu_seqlens=np.array([0, 7, 16], np.int32))


def test_sharded_training_example():
    example = load_script("examples/sharded_training.py")
    losses = example.main(["--steps", "6", "--batch", "2", "--seq-len", "8", "--width", "16",
                           "--layers", "1", "--backend", "native"])
    assert len(losses) == 6 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_sharded_model_gradients_equal_one_device():
    """The example's whole model: loss and parameter gradients as on one device."""
    example = load_script("examples/sharded_training.py")
    mesh = _mesh((2, 4), ("data", "seq"))
    one_device = functools.partial(rwkv_jax.rwkv7, backend="native")
    sharded = rwkv_jax.shard(one_device, mesh, batch_axis="data", seq_axis="seq")
    params = example.init_params(jax.random.PRNGKey(1), vocab=16, width=32, layers=1)
    tokens = jnp.asarray(example.make_batch(np.random.default_rng(1), 2, 17, 16))
    grad = jax.jit(jax.value_and_grad(example.loss_fn), static_argnums=2)
    (loss, grads), (loss1, grads1) = grad(params, tokens, sharded), grad(params, tokens, one_device)
    assert abs(float(loss) - float(loss1)) <= 1e-5 * abs(float(loss1))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads1)):
        assert relative_error(got, want) <= 1e-4


def test_multi_gpu_benchmark_rows():
    """benchmarks/multi_device.py, in this process (on the first 2 of the 8 CPU devices): rows of
    every op, their check against one device, the table."""
    bench = load_script("benchmarks/multi_device.py")
    args = bench.parse_args(["--tiny", "--repeats", "1", "--backend", "native"])
    rows = [bench.measure(mode, "2x16x2x8", args, op)
            for op in bench.OPS for mode in bench.MODES]
    for row, devices in zip(rows, (1, 2, 2) * len(bench.OPS)):
        assert row["devices"] == devices and row["milliseconds"] > 0
        assert row["peak_bytes_per_device"] > 0
    for single, *sharded in (rows[i:i + 3] for i in range(0, len(rows), 3)):
        assert len(single["fingerprint"]) == len(single["arrays"])
        for row in sharded:
            assert bench.difference(row, single) <= 1e-2, (row["op"], row["mode"])
        wrong = dict(sharded[1], fingerprint=[[x[0]] + [-y for y in x[1:]]
                                              for x in sharded[1]["fingerprint"]])
        assert bench.difference(wrong, single) > 0.5   # the check sees a wrong result
    assert "| rwkv6 | 2x16x2x8 | sequence | 2 |" in bench.table(rows)


def test_sequence_parallel_memory_per_device_shrinks():
    """XLA's compiled estimate of one device's memory for RWKV-7 forward + backward."""
    shapes = [jax.ShapeDtypeStruct((1, 2048, 2, 16), jnp.float32)] * 6
    one_device = functools.partial(rwkv_jax.rwkv7, backend="native")

    def per_device_bytes(fn):
        loss = lambda *x: sum(jnp.sum(y) for y in fn(*x))
        m = jax.jit(jax.grad(loss, argnums=range(6))).lower(*shapes).compile().memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)

    eight = rwkv_jax.shard(one_device, _mesh((8,), ("seq",)), seq_axis="seq")
    assert per_device_bytes(eight) < 0.3 * per_device_bytes(one_device)   # about 0.2 measured


HARD_DECAYS = [("every_third", -np.inf), ("every_third", -1e9), "zero"]


@pytest.mark.parametrize("decay", HARD_DECAYS, ids=str)
@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_sequence_parallel_hard_decays_every_backend(op, decay, backend):
    """Decays of exactly zero (-inf, -1e9: whole one-step blocks of 8 devices) and of one (w = 0,
    two-step blocks): the transitions and state gradients through them stay exact, forward,
    final state and every gradient (initial state included). GLA: every gate, reversed."""
    options = dict(reverse=True) if op == "gated_linear_attention" else {}
    x = _inputs(op, seed=13, batch=1, steps=16 if decay == "zero" else 8, decay=decay)
    _assert_matches(op, x, ("seq_axis",), options=options, mesh=_mesh((8,), ("seq",)),
                    backend=backend)


@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_sequence_parallel_backward_runs_the_op_backward_once(op, monkeypatch):
    """Counted as the compiled forward + backward runs, on each of 8 devices: the op's backward
    runs once per block (on the forward's op call, not on a recomputation), and besides that
    call the op runs only in the state passes: none for RWKV-6 and GLA, one forward (state and
    transition) and one backward (state gradient) for RWKV-7."""
    from rwkv_jax.backends import native
    real = getattr(native, op)
    runs = {"op": 0, "op backward": 0}

    def count(name, x):
        def increment(_):
            runs[name] += 1
        jax.debug.callback(increment, jnp.sum(x))

    def spy(**keywords):
        arrays = {n: y for n, y in keywords.items() if isinstance(y, jax.Array)}
        options = {n: y for n, y in keywords.items() if n not in arrays}

        @jax.custom_vjp
        def counted(arrays):
            o, h = real(**arrays, **options)
            count("op", o)
            return o, h

        def counted_fwd(arrays):
            (o, h), pull = jax.vjp(lambda a: real(**a, **options), arrays)
            count("op", o)
            return (o, h), pull

        def counted_bwd(pull, cotangents):
            count("op backward", cotangents[0])
            return pull(cotangents)

        counted.defvjp(counted_fwd, counted_bwd)
        return counted(arrays)

    monkeypatch.setattr(native, op, spy)
    x = _inputs(op, seed=14, batch=1)
    fn = functools.partial(getattr(rwkv_jax, op), backend="native")
    sharded = rwkv_jax.shard(fn, _mesh((8,), ("seq",)), seq_axis="seq")
    loss = lambda x: sum(jnp.sum(y) for y in _call(sharded, op, x, {}))
    jax.clear_caches()   # shard's jitted program, traced by earlier tests without the spy
    try:
        jax.block_until_ready(jax.jit(jax.grad(loss))(x))
        jax.effects_barrier()
    finally:
        jax.clear_caches()   # and none traced with the spy for later tests
    assert runs == {"op": 8 * (3 if op == "rwkv7" else 1), "op backward": 8}


@pytest.mark.parametrize("op", SEQUENCE_OPS)
def test_backend_sequence_pieces_are_used(op, monkeypatch):
    """The triton backend's own passes (its kernels once each way, chunk states corrected;
    RWKV-7's state passes over V + K columns) take the place of the reference and give one
    device's results (the hard-decay test above covers every backend)."""
    from rwkv_jax.backends import triton
    real = triton.sequence_parallel_pieces
    asked = []

    def spy(name, options):
        pieces = real(name, options)
        asked.append((name, pieces is not None))
        return pieces

    monkeypatch.setattr(triton, "sequence_parallel_pieces", spy)
    x = _inputs(op, seed=15, batch=1, steps=8)
    jax.clear_caches()   # shard's jitted program, if an earlier test traced it without the spy
    _assert_matches(op, x, ("seq_axis",), mesh=_mesh((4,), ("seq",)), backend="triton")
    assert asked and set(asked) == {(op, True)}


def test_sequence_parallel_refuses_forward_mode_clearly():
    """Its gradient is a custom_vjp: jax.jvp gets one clear error naming the limit, before
    anything is traced; over batch and heads forward mode still works (native backend)."""
    x = _inputs("rwkv6", seed=16, batch=2)
    fn = functools.partial(rwkv_jax.rwkv6, backend="native")
    run = lambda f: jax.jvp(lambda r: _call(f, "rwkv6", dict(x, r=r), {})[0], (x["r"],),
                            (jnp.ones_like(x["r"]),))
    with pytest.raises(TypeError, match="seq_axis='seq' does not support forward-mode"):
        run(rwkv_jax.shard(fn, _mesh(), seq_axis="seq"))
    _, tangent = run(rwkv_jax.shard(fn, _mesh(), batch_axis="data", head_axis="heads"))
    assert relative_error(tangent, run(fn)[1]) <= 1e-5


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_rwkv7_wide_values_over_the_sequence(backend_name):
    """V + K above the widest value block of every backend (the triton backend's 128): the
    transition takes its own op call, still exact."""
    x = _inputs("rwkv7", seed=17, batch=1, steps=8, heads=1, value=128)
    _assert_matches("rwkv7", x, ("seq_axis",), mesh=_mesh((4,), ("seq",)), backend=backend_name)


# The README's sharding snippet at its shapes (B=2, T=128, H=4, K=64; mesh (2, 4) over data and
# seq) with the triton backend in Triton's interpreter, forward and gradients against one device
# of the native backend. In a child process with a time limit: the sequence-parallel all-gather
# used to leave every interpreter callback waiting forever (rwkv_jax/backends/triton/launch.py,
# _callback_pieces), and a hang must fail the test instead of stopping the suite.
README_SHAPES = """
import functools, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
import reference
import rwkv_jax

x = {n: jnp.asarray(y, jnp.float32) for n, y in reference.random_inputs(
    "rwkv7", np.random.default_rng(0), batch=2, steps=128, heads=4, key=64).items()}
mesh = jax.make_mesh((2, 4), ("data", "seq"))
triton = rwkv_jax.shard(functools.partial(rwkv_jax.rwkv7, backend="triton"), mesh,
                        batch_axis="data", seq_axis="seq")
native = functools.partial(rwkv_jax.rwkv7, backend="native")

def loss_and_outputs(fn, x):
    o, h = fn(*(x[n] for n in "rwkvab"), initial_state=x["initial_state"])
    return jnp.sum(o * jnp.cos(o)) + jnp.sum(h * h), (o, h)

results = [jax.jit(jax.value_and_grad(functools.partial(loss_and_outputs, fn), has_aux=True))(x)
           for fn in (triton, native)]
(_, (o, h)), grads = results[0]
(_, (o1, h1)), grads1 = results[1]
errors = {"output": reference.relative_error(o, o1), "state": reference.relative_error(h, h1)}
errors.update({f"d{n}": reference.relative_error(grads[n], grads1[n]) for n in x})
print(" ".join(f"{n}={e:.2e}" for n, e in errors.items()))
"""


@pytest.mark.skipif(rwkv_jax.backends.unavailable_reason("triton", "cpu") is not None,
                    reason="the triton backend cannot run on this CPU")
def test_readme_shapes_over_eight_devices_in_the_interpreter():
    tests = pathlib.Path(__file__).parent
    # The devices' kernels take turns in the interpreter: on a busy machine a device may wait at
    # the all-gather longer than XLA:CPU's default 40 s before it aborts (README, "Several
    # devices and hosts").
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                   "--xla_cpu_collective_call_terminate_timeout_seconds=3600"]))
    proc = subprocess.run([sys.executable, "-c", README_SHAPES], cwd=tests, capture_output=True,
                          text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1",
                                   XLA_FLAGS=flags))
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stderr[-4000:]}"
    errors = {name: float(value) for name, value in
              (item.split("=") for item in proc.stdout.split())}
    assert set(errors) == {"output", "state", *(f"d{n}" for n in "rwkvab"), "dinitial_state"}
    forward, gradient = tolerance("triton", "float32", "forward"), tolerance(
        "triton", "float32", "gradient")
    for name, error in errors.items():
        assert error <= (forward if name in ("output", "state") else gradient), (name, errors)

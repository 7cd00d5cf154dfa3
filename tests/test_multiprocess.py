"""Every entry point on arrays split across processes: two processes on this host joined by
``jax.distributed`` (gloo collectives on 127.0.0.1), two CPU devices each.

This file is also the worker: ``python tests/test_multiprocess.py PROCESS_ID PORT OUT_DIR
BACKENDS`` runs every case on global arrays, gathers the results and process 0 writes them to
``OUT_DIR/results.npz`` (the model checkpoint to ``OUT_DIR/model.safetensors``). The tests
compare them with the same calls on one device in this (single) process. The workers run with a
bounded time: a hang fails the tests, it never blocks CI.

The backends are native and ffi (those under test): what runs across processes here is the host
reads and the collectives around the ops, the same for every backend; tests/test_shard.py checks
the sharding math of every backend on one process's 8 devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np

SIZES = dict(batch=4, steps=8, heads=4, key=8)
POOL = 6                      # slots of the step ops' state pools
INDICES = [5, 0, 3, 1]        # one pool row per batch row, split over the processes
BAD_INDICES = [5, 0, 9, 1]    # row 2 outside the pool: only process 1 holds it
SHARD_AXES = ("batch_axis", "seq_axis", "head_axis")
MODEL = dict(vocab_size=16, n_embd=32, n_layer=2, head_size=8)
EXAMPLE_ARGS = ["--steps", "3", "--batch", "2", "--seq-len", "8", "--width", "16", "--layers",
                "1", "--backend", "native"]
TIMEOUT_S = 240
# rwkv_jax.train's recipe: 2 processes x 2 devices as data 2 x seq 2 against one device.
RECIPE = dict(vocab_size=16, n_layer=2, n_embd=32, head_size=8, seq_len=8, micro_batch=2,
              accumulation=2, steps=3, warmup_steps=1, compute_dtype="float32",
              backend="native", eval_every=3, eval_batches=1)
FAST_BACKENDS = ("native", "ffi")


def _inputs(op, seed, **options):
    import reference
    rng = np.random.default_rng(seed)
    x = reference.random_inputs(op, rng, **{**SIZES, **options})
    return {n: np.asarray(y, np.float32) for n, y in x.items()}


def _on_device(x):
    import jax.numpy as jnp
    return {n: jnp.asarray(y) for n, y in x.items()}


def _cotangents(o_shape, h_shape):
    rng = np.random.default_rng(7)
    return (rng.standard_normal(o_shape).astype(np.float32),
            rng.standard_normal(h_shape).astype(np.float32))


def _example():
    from scripts import load_script
    return load_script("examples/sharded_training.py")


def _raw(w):
    """rwkv_ops' raw decay parameter for the log decay ``w``: decay exp(-exp(raw)) = exp(w)."""
    return np.log(-w)


def _flat(y):
    """[B, T, H, K] -> rwkv_ops' [B, T, C]."""
    return y.reshape(y.shape[:2] + (-1,))


def _rwkv6_op(backend):
    from rwkv_jax import compat
    op = compat.RWKV6_OP(head_size=SIZES["key"])
    op.backend = backend   # its constructor picks only native (ops_loop) or the default
    return op


def _mask():
    mask = np.ones((SIZES["batch"], SIZES["steps"]), np.int32)
    mask[1, 3:5] = 0
    mask[2, 0] = 0
    return mask


def _recipe_corpus(out_dir):
    path = os.path.join(out_dir, "tokens.npy")
    if not os.path.exists(path):   # each process writes the same bytes; the last rename wins
        tokens = np.random.default_rng(5).integers(0, RECIPE["vocab_size"], 400)
        tmp = f"{path}.{os.getpid()}.npy"
        np.save(tmp, tokens.astype(np.uint16))
        os.replace(tmp, path)
    return path


def _tokens():
    return np.random.default_rng(3).integers(0, MODEL["vocab_size"], (SIZES["batch"], 1),
                                             dtype=np.int32)


# --------------------------------------------------------------------------------------------
# The worker (one per process).


def _worker(process_id, port, out_dir, backends):
    import contextlib
    import faulthandler
    import functools
    import traceback

    # A worker that hangs (a collective the other process never joins) prints every thread's
    # stack into its log before the test kills it, so the failure says where it stopped.
    faulthandler.dump_traceback_later(TIMEOUT_S - 20, exit=False)
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    import jax.numpy as jnp
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import rwkv_jax
    from rwkv_jax import compat
    from rwkv_jax.nn import RWKV7Config, RWKV7LM, save_rwkv7

    assert jax.process_count() == 2 and jax.device_count() == 4
    line = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    # The README's recipe: processes along "data", each process's devices along "seq".
    grid = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("data", "seq"),
                         axis_types=(AxisType.Auto, AxisType.Auto))
    assert all(d.process_index == row for row, devices in enumerate(grid.devices)
               for d in devices), "the sequence axis must stay inside a process"
    rows = ("x",)   # the batch rows split over all four devices, two per process
    results = {}

    @contextlib.contextmanager
    def case(name):
        """Run one case; its error (both processes meet the same ones) goes to its test."""
        try:
            yield
        except Exception:
            results[f"error/{name}"] = np.str_(traceback.format_exc()[-3000:])

    def put(x, mesh, *spec):
        """The global array ``x`` split by ``spec``; this process fills only its own blocks."""
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P(*spec)),
                                            lambda index: x[index])

    def keep(name, x, split=False):
        if split:
            assert not x.is_fully_addressable, f"{name} should span both processes"
        results[name] = (np.asarray(x) if x.is_fully_addressable
                         else multihost_utils.process_allgather(x, tiled=True))

    for backend in backends:
        x = _inputs("rwkv7", 0)
        op = functools.partial(rwkv_jax.rwkv7, backend=backend)
        # rwkv_jax.shard over batch, time and heads, each split over all four devices.
        specs = {"batch_axis": (("x",), ("x",)), "seq_axis": ((None, "x"), ()),
                 "head_axis": ((None, None, "x"), (None, "x"))}
        for axis, (token_spec, state_spec) in specs.items():
            with case(f"shard/{backend}/{axis}"):
                f = rwkv_jax.shard(op, line, **{axis: "x"})
                o, h = f(*(put(x[n], line, *token_spec) for n in "rwkvab"),
                         initial_state=put(x["initial_state"], line, *state_spec))
                keep(f"shard/{backend}/{axis}/o", o, split=True)
                keep(f"shard/{backend}/{axis}/h", h)

        with case(f"train/{backend}"):   # gradients of every input through a sharded op
            f = rwkv_jax.shard(op, grid, batch_axis="data", seq_axis="seq")
            args = {n: put(x[n], grid, "data", "seq") for n in "rwkvab"}
            args["initial_state"] = put(x["initial_state"], grid, "data")
            do, dh = _cotangents(x["r"].shape, x["initial_state"].shape)

            @jax.jit
            def gradients(args, do, dh):
                _, pull = jax.vjp(lambda a: f(*(a[n] for n in "rwkvab"),
                                              initial_state=a["initial_state"]), args)
                return pull((do, dh))[0]

            grads = gradients(args, put(do, grid, "data", "seq"), put(dh, grid, "data"))
            for name, g in grads.items():
                keep(f"train/{backend}/{name}", g, split=True)

        # The step ops: pool rows picked by state_indices split over the processes.
        for op_name, names in (("rwkv7_step", "rwkvab"), ("rwkv6_step", "rkvwu")):
            s = _inputs(op_name, 1, steps=1, state_rows=POOL)
            cases = dict(good=INDICES, bad=BAD_INDICES) if op_name == "rwkv7_step" else dict(
                good=INDICES)
            for kind, indices in cases.items():
                with case(f"step/{backend}/{op_name}/{kind}"):
                    o, pool = getattr(rwkv_jax, op_name)(
                        *(s[n] if n == "u" else put(s[n], line, *rows) for n in names),
                        jnp.asarray(s["state"]), state_indices=put(np.int32(indices), line, *rows),
                        backend=backend)
                    keep(f"step/{backend}/{op_name}/{kind}/o", o)
                    keep(f"step/{backend}/{op_name}/{kind}/pool", pool)

        # rwkv_ops' names: a mask split over the processes, a state_map split likewise.
        with case(f"compat/{backend}/gdr"):
            g = _inputs("rwkv7", 2)
            o, h = compat.generalized_delta_rule(
                *(put(_raw(g[n]) if n == "w" else g[n], line, *rows) for n in "rwkvab"),
                mask=put(_mask(), line, *rows), backend=backend)
            keep(f"compat/{backend}/gdr/o", o)
            keep(f"compat/{backend}/gdr/h", h)
        with case(f"compat/{backend}/rwkv6_op"):
            s = _inputs("rwkv6", 3, initial_state=False)
            y, state = _rwkv6_op(backend)(
                *(put(_flat(_raw(s[n]) if n == "w" else s[n]), line, *rows) for n in "rkvw"),
                s["u"], with_state=True,
                init_state=_inputs("rwkv6_step", 4, state_rows=POOL)["state"],
                state_map=put(np.int32(INDICES), line, *rows))
            keep(f"compat/{backend}/rwkv6_op/y", y)
            keep(f"compat/{backend}/rwkv6_op/state", state)

        # The model's step mode, state_indices split, jitted as a server runs it: one program
        # across the processes (eagerly each of its many small ops is a cross-process program
        # of its own, and two processes dispatching those asynchronously can hang on gloo).
        with case(f"model/{backend}"):
            model = RWKV7LM(RWKV7Config(**MODEL), rngs=nnx.Rngs(0))
            step = nnx.jit(lambda m, tokens, state, indices: m.step(
                tokens, state, state_indices=indices, backend=backend))
            logits, state = step(model, put(_tokens(), line, *rows), model.init_state(POOL),
                                 put(np.int32(INDICES), line, *rows))
            keep(f"model/{backend}/logits", logits)
            keep(f"model/{backend}/wkv", state[-1].att.wkv)

    # Indices replicated on every device: each process holds them whole and checks them on the
    # host, so both raise the same ValueError before any kernel runs.
    with case("replicated_bad_indices"):
        s = _inputs("rwkv7_step", 1, steps=1, state_rows=POOL)
        rwkv_jax.rwkv7_step(*(put(s[n], line, *rows) for n in "rwkvab"), jnp.asarray(s["state"]),
                            state_indices=put(np.int32(BAD_INDICES), line), backend="native")

    with case("example"):   # examples/sharded_training.py's multi-process mode
        results["example/losses"] = np.asarray(
            _example().train(_example().parse_args(EXAMPLE_ARGS)))

    with case("recipe"):   # rwkv_jax.train.train, each process reading its own rows
        from rwkv_jax.train import TrainConfig, train
        path = _recipe_corpus(out_dir)
        records = train(TrainConfig(**RECIPE, train_data=path, eval_data=path, data=2, seq=2,
                                    checkpoint_dir=os.path.join(out_dir, "recipe")))
        results["recipe/losses"] = np.asarray([r.get("loss", r.get("eval_loss"))
                                               for r in records])

    with case("checkpoint"):   # a model whose parameters are split across the processes
        model = RWKV7LM(RWKV7Config(**MODEL), rngs=nnx.Rngs(0))
        split = jax.tree.map(lambda v: put(v, line, "x") if v.shape[0] % 4 == 0 else v,
                             nnx.state(model, nnx.Param))
        nnx.update(model, split)
        assert not model.emb.embedding.get_value().is_fully_addressable
        path = os.path.join(out_dir, "model.safetensors")
        save_rwkv7(model, path)
        assert os.path.exists(path), "save_rwkv7 returned before process 0 wrote the file"

    if process_id == 0:
        np.savez(os.path.join(out_dir, "results.npz"), **results)
    multihost_utils.sync_global_devices("results written")
    print(f"process {process_id}: done, {sum(k.startswith('error/') for k in results)} errors",
          flush=True)
    jax.distributed.shutdown()


# --------------------------------------------------------------------------------------------
# The tests (one process, the single-device references).


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out_dir, backends):
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    logs = [open(os.path.join(out_dir, f"process{i}.log"), "w+") for i in range(2)]
    workers = [subprocess.Popen([sys.executable, __file__, str(i), str(port), str(out_dir),
                                 ",".join(backends)], env=env, stdout=log,
                                stderr=subprocess.STDOUT) for i, log in enumerate(logs)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for w in workers:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [w.poll() is None for w in workers]
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    text = []
    for i, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {i} (exit {workers[i].returncode}"
                    f"{', killed after the time limit' if timed_out[i] else ''}):\n"
                    + log.read()[-4000:])
        log.close()
    return [w.returncode for w in workers], "\n".join(text)


if __name__ != "__main__":
    import fcntl
    import json

    import jax
    import jax.numpy as jnp
    import pytest

    import rwkv_jax
    from conftest import BACKENDS_UNDER_TEST, tolerance
    from reference import relative_error

    BACKENDS = [b for b in BACKENDS_UNDER_TEST if b in FAST_BACKENDS]

    @pytest.fixture(scope="module")
    def results(tmp_path_factory, worker_id):
        """The workers' results: one run per pytest run, however many xdist workers get tests of
        this module (the first runs them under a lock, the others read its results)."""
        root = tmp_path_factory.getbasetemp()
        root = root if worker_id == "master" else root.parent   # shared by the xdist workers
        out_dir = root / "multiprocess"
        with open(root / "multiprocess.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out_dir / "outcome.json").exists():
                out_dir.mkdir(exist_ok=True)
                codes, logs = _run_workers(out_dir, BACKENDS)
                (out_dir / "outcome.json").write_text(json.dumps(dict(codes=codes, logs=logs)))
        outcome = json.loads((out_dir / "outcome.json").read_text())
        assert outcome["codes"] == [0, 0], f"the two processes failed:\n{outcome['logs']}"
        with np.load(out_dir / "results.npz") as data:
            found = dict(data)
        found["checkpoint"] = out_dir / "model.safetensors"
        return found

    def _case(results, name):
        """The arrays the workers kept for case ``name`` (fails with the workers' error)."""
        if f"error/{name}" in results:
            pytest.fail(f"{name} failed in the workers:\n{results[f'error/{name}']}")
        return lambda part: results[f"{name}/{part}"]

    def _close(got, want, backend, kind="forward"):
        assert got.shape == want.shape, (got.shape, want.shape)
        assert relative_error(got, want) <= tolerance(backend, "float32", kind)

    @pytest.mark.parametrize("axis", SHARD_AXES)
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_shard_across_processes_matches_one_device(results, backend, axis):
        got = _case(results, f"shard/{backend}/{axis}")
        o, h = rwkv_jax.rwkv7(**_inputs("rwkv7", 0), backend=backend)
        _close(got("o"), o, backend)
        _close(got("h"), h, backend)

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_training_step_gradients_across_processes(results, backend):
        got = _case(results, f"train/{backend}")
        x = _on_device(_inputs("rwkv7", 0))
        (o, h), pull = jax.vjp(lambda a: rwkv_jax.rwkv7(**a, backend=backend), x)
        grads = pull(tuple(map(jnp.asarray, _cotangents(o.shape, h.shape))))[0]
        for name, g in grads.items():
            _close(got(name), g, backend, "gradient")

    @pytest.mark.parametrize("op_name", ["rwkv7_step", "rwkv6_step"])
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_step_ops_with_state_indices_split_across_processes(results, backend, op_name):
        got = _case(results, f"step/{backend}/{op_name}/good")
        s = _on_device(_inputs(op_name, 1, steps=1, state_rows=POOL))
        o, pool = getattr(rwkv_jax, op_name)(**s, state_indices=np.int32(INDICES),
                                             backend=backend)
        _close(got("o"), o, backend)
        _close(got("pool"), pool, backend)

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_invalid_index_split_across_processes_is_guarded_on_the_device(results, backend):
        """No process can read row 2's index whole on the host (process 1 holds it): the
        device guard gives that row NaN and leaves the pool untouched by it, as under jit."""
        got = _case(results, f"step/{backend}/rwkv7_step/bad")
        s = _on_device(_inputs("rwkv7_step", 1, steps=1, state_rows=POOL))
        assert np.isnan(got("o")[2]).all()
        valid = np.array([0, 1, 3])
        o_ok, pool_ok = rwkv_jax.rwkv7_step(
            **{n: (y if n == "state" else y[valid]) for n, y in s.items()},
            state_indices=np.int32(INDICES)[valid], backend=backend)
        _close(got("o")[valid], o_ok, backend)
        _close(got("pool"), pool_ok, backend)

    def test_replicated_indices_are_checked_on_the_host_in_every_process(results):
        error = str(results.get("error/replicated_bad_indices", ""))
        assert "ValueError: state_indices must be in [0, 6)" in error, error or "no error"

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_rwkv_ops_names_with_split_mask_and_state_map(results, backend):
        from rwkv_jax import compat
        got = _case(results, f"compat/{backend}/gdr")
        g = _inputs("rwkv7", 2)
        o, h = compat.generalized_delta_rule(*(_raw(g[n]) if n == "w" else g[n] for n in "rwkvab"),
                                             mask=_mask(), backend=backend)
        _close(got("o"), o, backend)
        _close(got("h"), h, backend)
        got = _case(results, f"compat/{backend}/rwkv6_op")
        s = _inputs("rwkv6", 3, initial_state=False)
        y, state = _rwkv6_op(backend)(
            *(_flat(_raw(s[n]) if n == "w" else s[n]) for n in "rkvw"), s["u"], with_state=True,
            init_state=_inputs("rwkv6_step", 4, state_rows=POOL)["state"],
            state_map=np.int32(INDICES))
        _close(got("y"), y, backend)
        _close(got("state"), state, backend)

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_model_step_with_state_indices_split_across_processes(results, backend):
        from flax import nnx
        from rwkv_jax.nn import RWKV7Config, RWKV7LM
        got = _case(results, f"model/{backend}")
        model = RWKV7LM(RWKV7Config(**MODEL), rngs=nnx.Rngs(0))
        logits, state = model.step(_tokens(), model.init_state(POOL),
                                   state_indices=np.int32(INDICES), backend=backend)
        _close(got("logits"), logits, backend)
        _close(got("wkv"), state[-1].att.wkv, backend)

    def test_sharded_training_example_across_processes(results):
        """Two processes, each building only its rows, train as one process does."""
        got = _case(results, "example")("losses")
        want = _example().main(EXAMPLE_ARGS)   # one process, this test's 8 devices
        np.testing.assert_allclose(got, want, rtol=1e-4)

    def test_training_recipe_across_processes(results, tmp_path):
        """rwkv_jax.train over two processes (batch over them, time over each one's two
        devices, parameters and optimizer state split, checkpoints written by both): the
        losses of one device."""
        from rwkv_jax.train import TrainConfig, train
        got = _case(results, "recipe")("losses")
        path = _recipe_corpus(str(tmp_path))
        want = [r.get("loss", r.get("eval_loss"))
                for r in train(TrainConfig(**RECIPE, train_data=path, eval_data=path, data=1))]
        np.testing.assert_allclose(got, want, rtol=1e-5)

    def test_multi_gpu_benchmark_as_two_processes():
        """benchmarks/multi_device.py --processes 2: a row from two processes of 1 device each,
        its results those of one device."""
        from scripts import load_script
        bench = load_script("benchmarks/multi_device.py")
        argv = ["--tiny", "--processes", "2", "--devices", "2", "--ops", "rwkv7", "--shapes",
                "1x16x2x8:sequence", "--repeats", "1", "--backend", "native"]
        args = bench.parse_args(argv)
        (single,), (row,) = bench._run_group(1, args, argv), bench._run_group(2, args, argv)
        assert single.get("error") is None and row.get("error") is None, (single, row)
        assert row["mode"] == "sequence" and row["devices"] == 2 and row["processes"] == 2
        assert row["milliseconds"] > 0 and single["processes"] == 1
        peaks = row["process_peak_bytes_per_device"]
        assert len(peaks) == 2 and min(peaks) > 0 and row["peak_bytes_per_device"] == max(peaks)
        assert bench.difference(row, single) <= 1e-2
        assert "| rwkv7 | 1x16x2x8 | sequence | 2 (2 processes) |" in bench.table([single, row])

    def test_checkpoint_of_parameters_split_across_processes(results):
        """save_rwkv7 gathers the split parameters; process 0 writes the file."""
        from flax import nnx
        from rwkv_jax.nn import RWKV7Config, RWKV7LM, read_checkpoint, rwkv7_state_dict
        _case(results, "checkpoint")
        want = rwkv7_state_dict(RWKV7LM(RWKV7Config(**MODEL), rngs=nnx.Rngs(0)))
        got = read_checkpoint(results["checkpoint"])
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # for reference.py
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
            [b for b in sys.argv[4].split(",") if b])

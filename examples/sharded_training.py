"""Train a tiny RWKV-7 language model with data and sequence parallelism over every device.

The recurrence runs through ``rwkv_jax.shard``: the batch is split over the mesh axis "data",
time over "seq", and the state crosses the "seq" devices exactly. Everything else in the model
is plain ``jax.numpy`` inside one ``jax.jit``: XLA partitions it from the input shardings.

On a CPU, simulate devices first:

    python examples/sharded_training.py --cpu-devices 8

Several processes (one per host, or one per GPU) run the same command with ``--distributed``:
each calls ``jax.distributed.initialize`` (which reads the coordinator, process count and id
from SLURM, Open MPI, Kubernetes or Cloud TPU, or from the flags below), the mesh is
``(process_count, local_device_count)`` with the batch over processes and time over each
process's own devices (the sequence axis, the one that communicates, stays inside a host), and
each process builds only its rows of every batch. Two processes on one CPU host:

    python examples/sharded_training.py --cpu-devices 2 --distributed \
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 &
    python examples/sharded_training.py --cpu-devices 2 --distributed \
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1

The task is synthetic: each sequence follows ``x_{t+1} = (a * x_t + c) mod vocab`` with its own
``a`` and ``c``, so the model has to read the context to predict the next token.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import rwkv_jax


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="simulate this many CPU devices (0: use the real ones)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=64, help="model width C = heads * 16")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--backend", default=None, help="rwkv_jax backend (default: automatic)")
    parser.add_argument("--distributed", action="store_true",
                        help="one of several processes: call jax.distributed.initialize")
    parser.add_argument("--coordinator", default=None,
                        help="with --distributed: the coordinator's host:port (default: detected)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    return parser.parse_args(argv)


HEAD_SIZE = 16
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=3600"


def init_params(key, vocab, width, layers):

    def dense(key, fan_in, fan_out, scale=1.0):
        return scale * jax.random.normal(key, (fan_in, fan_out)) / jnp.sqrt(fan_in)

    keys = iter(jax.random.split(key, 2 + 8 * layers))
    params = {"embed": jax.random.normal(next(keys), (vocab, width)) * 0.5,
              "head": dense(next(keys), width, vocab), "layers": []}
    for _ in range(layers):
        params["layers"].append({
            "mix": jnp.full((5, width), 0.5),            # token-shift mixes for r, w, k, v, a
            **{name: dense(next(keys), width, width) for name in ("r", "w", "k", "v", "a")},
            "w_bias": jnp.zeros(width), "a_bias": jnp.zeros(width),
            "out": dense(next(keys), width, width, scale=0.5),
            "ffn_in": dense(next(keys), width, 4 * width),
            "ffn_out": dense(next(keys), 4 * width, width, scale=0.5),
        })
    return params


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def time_mix(p, x, recurrence):
    """RWKV-7 style time mixing: token shift, projections, the generalized delta rule."""

    batch, steps, width = x.shape
    heads = width // HEAD_SIZE
    previous = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]     # crosses "seq" shards: XLA's job
    xr, xw, xk, xv, xa = (x + (previous - x) * p["mix"][i] for i in range(5))
    per_head = lambda y: y.reshape(batch, steps, heads, HEAD_SIZE)
    r, k, v = per_head(xr @ p["r"]), per_head(xk @ p["k"]), per_head(xv @ p["v"])
    w = per_head(-jnp.exp(-0.5) * jax.nn.sigmoid(xw @ p["w"] + p["w_bias"]))   # log decay
    iclr = per_head(jax.nn.sigmoid(xa @ p["a"] + p["a_bias"]))
    kk = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + 1e-6)
    o, _ = recurrence(r, w, k, v, -kk, kk * iclr)
    return _norm(o.reshape(batch, steps, width)) @ p["out"]


def forward(params, tokens, recurrence):
    x = params["embed"][tokens]
    for p in params["layers"]:
        x = x + time_mix(p, _norm(x), recurrence)
        x = x + jax.nn.relu(_norm(x) @ p["ffn_in"]) ** 2 @ p["ffn_out"]
    return _norm(x) @ params["head"]


def loss_fn(params, tokens, recurrence):
    logits = forward(params, tokens[:, :-1], recurrence)   # tokens: seq_len + 1 of them
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_batch(rng, batch, steps, vocab):
    """Sequences x_{t+1} = (a x_t + c) mod vocab, each with its own a, c and x_0."""
    a, c, x = (rng.integers(low, vocab, (batch,)) for low in (1, 0, 0))
    tokens = np.empty((batch, steps), np.int32)
    for t in range(steps):
        tokens[:, t] = x
        x = (a * x + c) % vocab
    return tokens


def make_rows(step, rows, steps, vocab):
    """Rows ``rows`` of training step ``step``'s batch, each drawn from its own seed: a process
    builds only its rows, and the batch is the same whatever the number of processes."""
    return np.concatenate([make_batch(np.random.default_rng((step, row)), 1, steps, vocab)
                           for row in rows])


def local_rows(sharding, shape):
    """The rows of a global array of ``shape`` split by ``sharding`` that this process holds."""
    starts_stops = {index[0].indices(shape[0])[:2]
                    for index in sharding.addressable_devices_indices_map(shape).values()}
    return range(min(a for a, _ in starts_stops), max(b for _, b in starts_stops))


def make_mesh():
    """(data, seq): with several processes, processes along "data" and each process's devices
    along "seq" (the README's recipe); in one process two rows of devices when they split."""
    axis_types = (AxisType.Auto, AxisType.Auto)
    if jax.process_count() > 1:
        return jax.make_mesh((jax.process_count(), jax.local_device_count()), ("data", "seq"),
                             axis_types=axis_types)
    devices = jax.device_count()
    data = 2 if devices % 2 == 0 else 1
    return jax.make_mesh((data, devices // data), ("data", "seq"), axis_types=axis_types)


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_devices:  # before anything asks JAX for its devices
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # across processes
        # With --backend triton the simulated devices' kernels take turns in Triton's
        # interpreter, so a device may wait at the sequence all-gather longer than the 40 s
        # after which XLA:CPU aborts a collective.
        if "collective_call_terminate_timeout" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                       + COLLECTIVE_TIMEOUT_FLAG).strip()
    if args.distributed:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes, process_id=args.process_id)
    return train(args)


def train(args):
    """The training loop, in every process; returns the losses."""
    mesh = make_mesh()
    data = mesh.shape["data"]
    if args.seq_len % mesh.shape["seq"] or args.batch % data or args.width % HEAD_SIZE:
        raise SystemExit(f"need seq_len divisible by {mesh.shape['seq']}, batch by {data}, "
                         f"width by {HEAD_SIZE}; got seq_len={args.seq_len}, batch={args.batch}, "
                         f"width={args.width}")
    recurrence = rwkv_jax.shard(functools.partial(rwkv_jax.rwkv7, backend=args.backend), mesh,
                                batch_axis="data", seq_axis="seq")
    optimizer = optax.adam(args.learning_rate)
    # The same key in every process: the same parameters, replicated over the mesh.
    params = jax.device_put(init_params(jax.random.PRNGKey(0), args.vocab, args.width,
                                        args.layers), NamedSharding(mesh, PartitionSpec()))
    state = optimizer.init(params)
    tokens_sharding = NamedSharding(mesh, PartitionSpec("data", None))
    tokens_shape = (args.batch, args.seq_len + 1)   # seq_len + 1 tokens: inputs and targets
    rows = local_rows(tokens_sharding, tokens_shape)

    @jax.jit
    def train_step(params, state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, recurrence)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    say = print if jax.process_index() == 0 else (lambda *_: None)
    say(f"{jax.process_count()} process(es), {jax.device_count()} devices, mesh "
        f"{dict(mesh.shape)}; model width {args.width}, {args.layers} layers, batch "
        f"{args.batch} x {args.seq_len} tokens")
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = jax.make_array_from_process_local_data(
            tokens_sharding, make_rows(step, rows, args.seq_len + 1, args.vocab), tokens_shape)
        params, state, loss = train_step(params, state, tokens)
        losses.append(float(loss))   # the loss is replicated: every process reads its copy
        if step % 10 == 0 or step == args.steps - 1:
            say(f"step {step:4d}  loss {losses[-1]:.4f}")
    say(f"{args.steps} steps in {time.perf_counter() - start:.1f} s "
        f"(first step includes compilation)")
    return losses


if __name__ == "__main__":
    main()

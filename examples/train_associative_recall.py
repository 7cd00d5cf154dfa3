"""Train a small RWKV-7 language model on associative recall, then generate with the step path.

Each sequence lists key-value pairs and then asks for some of the keys again:

    k1 v1 k2 v2 ... kP vP   q1 a1 q2 a2 ... qQ aQ        (a_i is the value paired with q_i)

The mapping is new in every sequence, so the model must store the pairs in its state as it
reads them and look them up later: the delta rule of RWKV-7 (which overwrites what a key
stored) is made for this. The loss is the cross-entropy of the answers.

Training runs data-parallel over the available devices through ``rwkv_jax.shard`` (the batch
split over a "data" mesh axis) when there are several, else under plain ``jax.jit``. After
training, the answers are generated greedily: the pairs and the first query go through the
sequence mode (prefill, returning the state), then each predicted answer and the next query go
through the step mode, so the recall shown is that of the generation path.

    python examples/train_associative_recall.py            # a few minutes on a CPU
    python examples/train_associative_recall.py --tiny     # seconds (CI)
    python examples/train_associative_recall.py --devices 2   # 2 CPU devices, data-parallel
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import rwkv_jax
from rwkv_jax.nn import RWKV7Config, RWKV7LM

CONFIGS = {
    # keys, values, pairs per sequence, queries, model width, layers, head size, steps, batch, lr
    "full": dict(keys=16, values=16, pairs=6, queries=6, n_embd=64, n_layer=2, head_size=32,
                 steps=400, batch=32, lr=1e-2),
    "tiny": dict(keys=8, values=8, pairs=4, queries=4, n_embd=32, n_layer=1, head_size=16,
                 steps=150, batch=16, lr=1e-2),
}


def make_batch(rng, batch, keys, values, pairs, queries):
    """Token ids: 0..keys-1 are keys, keys..keys+values-1 are values. Returns (inputs, targets,
    answer mask), each [batch, 2 * (pairs + queries) - 1]."""
    key_ids = np.argsort(rng.random((batch, keys)), axis=1)[:, :pairs]      # distinct keys
    value_ids = keys + rng.integers(0, values, (batch, pairs))
    asked = np.argsort(rng.random((batch, pairs)), axis=1)[:, :queries]     # distinct queries
    rows = np.arange(batch)[:, None]
    seq = np.empty((batch, 2 * (pairs + queries)), np.int32)
    seq[:, 0:2 * pairs:2] = key_ids
    seq[:, 1:2 * pairs:2] = value_ids
    seq[:, 2 * pairs::2] = key_ids[rows, asked]
    seq[:, 2 * pairs + 1::2] = value_ids[rows, asked]
    answer = np.zeros(seq.shape, bool)
    answer[:, 2 * pairs + 1::2] = True
    return seq[:, :-1], seq[:, 1:], answer[:, 1:]


def data_parallel(backend):
    """(wkv_op for the model, a function placing a batch on the devices, one replicating a
    pytree on them): the batch is split over all devices through rwkv_jax.shard when there are
    several and it exists."""
    devices = jax.devices()
    if len(devices) == 1 or not hasattr(rwkv_jax, "shard"):
        return None, lambda x: x, lambda x: x
    # Auto axes: XLA shards the rest of the model (matmuls, norms) from the batch's placement.
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    wkv_op = rwkv_jax.shard(functools.partial(rwkv_jax.rwkv7, backend=backend), mesh,
                            batch_axis="data")
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return (wkv_op, lambda x: jax.device_put(x, split),
            lambda tree: jax.device_put(tree, replicated))


def answer_loss(logits, targets, answer):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * answer) / jnp.sum(answer)


def recall_by_generation(model, inputs, targets, pairs, queries, backend):
    """Greedy answers through the generation path: prefill up to the first query (sequence mode,
    returning the state), then per query one step call on (previous answer, next query). Returns
    the fraction of answers recalled."""
    prefill = nnx.jit(lambda m, t: m(t, return_state=True, backend=backend))
    step = nnx.jit(lambda m, t, s: m.step(t, s, backend=backend), donate_argnums=2)
    logits, state = prefill(model, jnp.asarray(inputs[:, :2 * pairs + 1]))
    correct = []
    for i in range(queries):
        guess = jnp.argmax(logits[:, -1], axis=-1)
        correct.append(np.asarray(guess) == targets[:, 2 * pairs + 2 * i])
        if i + 1 < queries:
            next_query = jnp.asarray(inputs[:, 2 * pairs + 2 * i + 2])
            logits, state = step(model, jnp.stack([guess.astype(jnp.int32), next_query], 1), state)
    return float(np.mean(correct))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the small CI configuration")
    parser.add_argument("--steps", type=int, help="training steps (default: per configuration)")
    parser.add_argument("--backend", default=None, help="rwkv_jax backend (default: automatic)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=None,
                        help="number of CPU devices to simulate (before JAX starts)")
    args = parser.parse_args(argv)
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    cfg = dict(CONFIGS["tiny" if args.tiny else "full"])
    steps = args.steps or cfg["steps"]
    task = {n: cfg[n] for n in ("keys", "values", "pairs", "queries")}

    wkv_op, place, replicate = data_parallel(args.backend)
    devices = jax.device_count() if wkv_op is not None else 1
    batch = -(-cfg["batch"] // devices) * devices          # a multiple of the device count
    model = RWKV7LM(RWKV7Config(vocab_size=cfg["keys"] + cfg["values"], n_embd=cfg["n_embd"],
                                n_layer=cfg["n_layer"], head_size=cfg["head_size"]),
                    rngs=nnx.Rngs(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg["lr"], steps // 10, steps,
                                                  cfg["lr"] / 10)
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                 optax.adamw(schedule, weight_decay=0.01)),
                              wrt=nnx.Param)
    # Parameters and optimizer state live on every device (else the first update moves them
    # there and jit compiles again).
    for tree in (model, optimizer):
        nnx.update(tree, replicate(nnx.state(tree)))
    print(f"RWKV-7 LM {model.config}; batch {batch} over {devices} device(s) "
          f"({'rwkv_jax.shard' if wkv_op else 'jax.jit'}); task {task}")

    @nnx.jit
    def train_step(model, optimizer, inputs, targets, answer):
        def loss_fn(model):
            logits = model(inputs, backend=None if wkv_op else args.backend, wkv_op=wkv_op)
            return answer_loss(logits, targets, answer)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(args.seed)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        inputs, targets, answer = make_batch(rng, batch, **task)
        loss = train_step(model, optimizer, place(inputs), place(targets), place(answer))
        losses.append(float(loss))
        if step % max(1, steps // 20) == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.0f} s)",
                  flush=True)

    inputs, targets, _ = make_batch(np.random.default_rng(args.seed + 1), 256, **task)
    accuracy = recall_by_generation(model, inputs, targets, task["pairs"], task["queries"],
                                    args.backend)
    chance = 1.0 / cfg["values"]
    print(f"recall of {256 * task['queries']} answers generated through the step path: "
          f"{accuracy:.1%} (chance {chance:.1%})")
    return dict(losses=losses, accuracy=accuracy, chance=chance)


if __name__ == "__main__":
    main()

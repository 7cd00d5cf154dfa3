"""Training throughput of the rwkv_jax.train recipe (its jitted step) on 1 to N devices of one
host, in one process.

    python benchmarks/train_throughput.py --model 1.5b --devices 1 --batch 2 --seq 4096 \\
        --accumulation 8 --breakdown
    python benchmarks/train_throughput.py --model 1.5b --devices 4 --batch 8 --seq 4096
    python benchmarks/train_throughput.py --model 0.4b --devices 4 --batch 1 --seq 65536 \\
        --parallel seq --remat block
    python benchmarks/train_throughput.py --model tiny --devices 2 --cpu-devices 2   # smoke test

The models are rwkv_jax.train.MODEL_SIZES: the official RWKV-7 shapes (vocabulary 65536, head
size 64) ``0.1b`` (12 layers of width 768), ``0.4b`` (24 x 1024), ``1.5b`` (24 x 2048), and
``tiny``. The step is :class:`rwkv_jax.train.TrainStep`'s, as ``rwkv-jax train`` runs it:
float32 parameters (``--param-dtype bfloat16``: bfloat16 ones, the optimizer state float32
either way), bfloat16 compute, ``--accumulation`` micro-batches of ``--batch`` rows accumulated
inside the step, AdamW with RWKV-LM's masks, clipping, the L2-wrap gradient, the loss by
:func:`rwkv_jax.nn.chunked_cross_entropy`, on random tokens. ``--parallel data`` splits the rows
over the devices (parameters and optimizer state too, FSDP, unless ``--no-fsdp``), ``seq``
splits time (sequence parallelism: the state crosses the devices).

Reported: tokens/s (median step time over ``--steps`` after ``--warmup``); MFU with the
project's FLOP formula (:mod:`rwkv_jax.train.flops`: ``F = 6 N + 24 L C K`` per token against
the dense bfloat16 peak, 989 TFLOP/s on H100 and H200 SXM; ``--peak-tflops`` elsewhere); peak
memory per device (``memory_stats()["peak_bytes_in_use"]``, XLA's compiled estimate on CPU);
and with ``--breakdown`` where a step's time goes: each part jitted alone on the step's
micro-batch shapes and shardings, forward + backward, times its count per step (L calls per
micro-batch, ``--accumulation`` micro-batches): the wkv recurrence; a block with an
elementwise stand-in for the recurrence, less its norms (the projections, LoRAs, token shift
and channel mix); the norms (ln1, ln2 and ln_x of a block); the head and loss; and once per step
the optimizer update. What the step takes beyond their sum (the embedding, collectives, the
accumulation, and what fusion across parts saves, which makes it smaller or negative) is
"other". The parts omit ``--remat``'s recomputation.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax

from rwkv_jax.train import MODEL_SIZES
from rwkv_jax.train.config import REMAT_POLICIES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402 (benchmarks/runner.py: the JSON lines and the run's description)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SIZES), default="tiny")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch", type=int, default=None,
                        help="rows per micro-batch, global (default: devices)")
    parser.add_argument("--accumulation", type=int, default=1,
                        help="micro-batches per optimizer step")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default 4096; tiny: 32)")
    parser.add_argument("--parallel", choices=("data", "seq"), default="data")
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True,
                        help="split parameters and optimizer state over the data axis")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (compile)")
    parser.add_argument("--backend", default=None, help="rwkv_jax backend (default: automatic)")
    parser.add_argument("--vocab-chunk", type=int, default=8192)
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="none",
                        help="recompute in the backward: each block, or each block but the "
                             "wkv outputs (less memory)")
    parser.add_argument("--breakdown", action="store_true", help="time the parts of a step")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: known GPUs)")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="simulate this many CPU devices (smoke tests)")
    parser.add_argument("--json", help="append the result as a JSON line (with the run's date, "
                        "device, versions, commit and command) to this file")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = args.devices if args.parallel == "data" else 1
    if args.seq is None:
        args.seq = 32 if args.model == "tiny" else 4096
    return args


def recipe(args):
    """The TrainConfig of the benchmark's arguments."""
    from rwkv_jax.train import TrainConfig
    data, seq = (args.devices, 1) if args.parallel == "data" else (1, args.devices)
    return TrainConfig.for_model(
        args.model, seq_len=args.seq, micro_batch=args.batch, accumulation=args.accumulation,
        steps=1000, warmup_steps=0, schedule="constant", learning_rate=args.learning_rate,
        param_dtype=args.param_dtype, remat=args.remat, vocab_chunk=args.vocab_chunk,
        backend=args.backend, data=data, seq=seq, fsdp=args.fsdp)


def wkv_backend(args, cfg):
    """The backend the blocks' rwkv7 calls take: the op's own choice for one device's share
    of a micro-batch (its shape class: SHAPE_DEFAULTS)."""
    import jax.numpy as jnp

    import rwkv_jax
    rows = args.batch // args.devices if args.parallel == "data" else args.batch
    shape = dict(sequence_heads=rows * cfg.n_head, key=cfg.head_size, value=cfg.head_size,
                 dtype=jnp.dtype(jnp.bfloat16))
    return rwkv_jax.backends.resolve("rwkv7", args.backend, dtype=jnp.bfloat16, shape=shape)[0]


def run(args):
    import jax.numpy as jnp
    import numpy as np

    import rwkv_jax
    from rwkv_jax import _bench
    from rwkv_jax.train import TrainStep, flops
    from rwkv_jax.train import mesh as meshes

    if len(jax.devices()) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(jax.devices())} devices here")
    try:
        config = recipe(args)
        mesh = meshes.make_mesh(config)
    except ValueError as err:
        raise SystemExit(str(err))
    devices = list(mesh.devices.flat)
    step_fn = TrainStep(config, mesh)
    state = step_fn.init()
    cfg = step_fn.model_config
    shape = (args.accumulation, args.batch, args.seq)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, *shape), dtype=np.int32)
    inputs, targets = (jax.device_put(x, meshes.batch_sharding(mesh)) for x in tokens)

    start = time.perf_counter()
    compiled = step_fn.step.lower(state, inputs, targets).compile()   # no documents: resets and
    # weights are None, and the compiled step takes them as such
    compile_s = time.perf_counter() - start
    losses, times = [], []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, inputs, targets, None, None)
        losses.append(float(metrics["loss"]))   # waits for the step
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup:])
    stats = [d.memory_stats() for d in devices]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        peaks, memory_source = [s["peak_bytes_in_use"] for s in stats], "memory_stats"
    else:
        peaks = [_bench.compiled_peak_bytes(compiled)] * len(devices)
        memory_source = "compiled estimate"

    tokens_per_s = config.tokens_per_step / step_s
    per_token = flops.flops_per_token(cfg, step_fn.parameters)
    kind = devices[0].device_kind
    peak = args.peak_tflops or flops.peak_tflops(kind)
    result = dict(model=args.model, config=dataclasses.asdict(cfg), devices=args.devices, device_kind=kind, parallel=args.parallel,
                  batch=args.batch, accumulation=args.accumulation, seq=args.seq,
                  tokens_per_step=config.tokens_per_step, fsdp=args.fsdp,
                  param_dtype=args.param_dtype,
                  backend=wkv_backend(args, cfg),
                  remat=args.remat, params=step_fn.parameters,
                  params_without_embedding=step_fn.parameters - cfg.vocab_size * cfg.n_embd,
                  flops_per_token=per_token, step_ms=1e3 * step_s, compile_s=compile_s,
                  warmup_s=sum(times[:args.warmup]), tokens_per_s=tokens_per_s,
                  mfu=flops.mfu(tokens_per_s, per_token, args.devices, peak),
                  peak_tflops=peak, peak_bytes_per_device=peaks, memory_source=memory_source,
                  losses=losses, wall_s=time.perf_counter() - start)

    if args.breakdown:
        result["breakdown_ms"] = breakdown(args, step_fn, state, step_s)
    return result


def breakdown(args, step_fn, state, step_s):
    """Milliseconds of each part of a step, each jitted alone (forward + backward) on one
    micro-batch's shapes and shardings, times its count per step; the rest is the step time
    left over."""
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rwkv_jax import _bench
    from rwkv_jax.nn import chunked_cross_entropy
    from rwkv_jax.train.step import _float32

    cfg, mesh, config = step_fn.model_config, step_fn.mesh, step_fn.config
    b, t, c = args.batch, args.seq, cfg.n_embd
    h, k = cfg.n_head, cfg.head_size
    place = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", "seq")))
    timed = lambda fn, *xs: _bench.time_function(fn, xs, repeats=args.steps, warmup=1).median_s

    def forward_backward(fn):
        def run(*xs):
            out, pull = jax.vjp(fn, *xs)
            return pull(jax.tree.map(jnp.ones_like, out))
        return run

    case = _bench.make_case("rwkv7", b, t, h, k)
    wkv_inputs = [place(jnp.asarray(case.arrays[n], jnp.bfloat16)) for n in "rwkvab"]
    wkv = timed(forward_backward(lambda *x: step_fn.wkv_op(*x)[0]), *wkv_inputs)

    lm = step_fn.model(jax.device_put(state["params"], NamedSharding(mesh, P())))
    block = lm.blocks[min(1, cfg.n_layer - 1)]
    x = place(jax.random.normal(jax.random.PRNGKey(1), (b, t, c), jnp.bfloat16))

    def norms(x):
        y = block.ln1(x) + block.ln2(x)
        return y + block.att.ln_x(x.reshape(b, t, h, k))

    norm = timed(forward_backward(norms), x)

    def stand_in(r, w, k, v, a, b, initial_state=None):   # elementwise: every input stays used
        return r + w + k + v + a + b, None

    rest = timed(forward_backward(lambda x, v: block(x, v, wkv_op=stand_in)[:2]), x, x)
    targets = place(jax.random.randint(jax.random.PRNGKey(2), (b, t), 0, cfg.vocab_size))
    chunk = min(config.vocab_chunk, cfg.vocab_size)
    head = timed(forward_backward(lambda x, w: chunked_cross_entropy(
        x, w, targets, vocab_chunk=chunk, l2wrap=config.l2wrap)), x,
        jax.device_put(lm.head.kernel[...], NamedSharding(mesh, P())))

    def update(grads, opt_state, params):
        updates, opt_state = step_fn.optimizer.update(grads, opt_state, _float32(params))
        return optax.apply_updates(params, updates), opt_state

    grads = jax.tree.map(lambda p: p.astype(jnp.float32), state["params"])
    opt = timed(update, grads, state["opt_state"], state["params"])
    calls = args.accumulation
    parts = {"wkv kernels": calls * cfg.n_layer * wkv,
             "projections, LoRAs, token shift, channel mix": calls * cfg.n_layer * (rest - norm),
             "norms": calls * cfg.n_layer * norm, "head and loss": calls * head,
             "optimizer": opt}
    parts["other (embedding, collectives, overlap)"] = step_s - sum(parts.values())
    return {name: 1e3 * s for name, s in parts.items()}


def report(r):
    gib = lambda n: ("?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28
                     else f"{n / 2**20:.1f} MiB")
    lines = [f"RWKV7LM {r['model']} ({r['params'] / 1e6:.1f} M parameters, "
             f"{r['params_without_embedding'] / 1e6:.1f} M without the embedding), "
             f"{r['device_kind']} x {r['devices']}, {r['parallel']} parallel"
             f"{' (FSDP)' if r['fsdp'] and r['parallel'] == 'data' and r['devices'] > 1 else ''}"
             f", {r['accumulation']} x {r['batch']} x {r['seq']} = {r['tokens_per_step']:,} "
             f"tokens per step, {r['param_dtype']} parameters, backend {r['backend']}, remat "
             f"{r['remat']}",
             f"step {r['step_ms']:.1f} ms (median of the timed steps; compile "
             f"{r['compile_s']:.1f} s, warm-up steps {r['warmup_s']:.1f} s), "
             f"{r['tokens_per_s']:,.0f} tokens/s",
             "MFU " + (f"{100 * r['mfu']:.1f}% (F = 6 N + 24 L C K = "
                       f"{r['flops_per_token'] / 1e9:.2f} GFLOP/token, peak "
                       f"{r['peak_tflops']:.0f} TFLOP/s per device)" if r["mfu"] is not None
                       else "n/a (unknown peak: pass --peak-tflops)"),
             "peak memory per device: " + " / ".join(gib(p) for p in r["peak_bytes_per_device"])
             + ("" if r["memory_source"] == "memory_stats" else " (compiled estimate)"),
             f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"]
    if "breakdown_ms" in r:
        lines.append("where a step's time goes:")
        for name, ms in r["breakdown_ms"].items():
            lines.append(f"  {name:46s} {ms:9.1f} ms  {100 * ms / r['step_ms']:5.1f}%")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_devices:   # before anything asks JAX for its devices
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    result = run(args)
    runner.Rows("train", args.json).add(result, report(result))
    return result


if __name__ == "__main__":
    sys.exit(main() is None)

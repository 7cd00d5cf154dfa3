"""Training throughput of rwkv_jax.nn.RWKV7LM on 1 to N devices of one host, in one process.

    python benchmarks/train_throughput.py --model 1.5b --devices 1 --batch 4 --seq 4096
    python benchmarks/train_throughput.py --model 1.5b --devices 4 --batch 16 --seq 4096
    python benchmarks/train_throughput.py --model 0.4b --devices 4 --batch 1 --seq 65536 \\
        --parallel seq
    python benchmarks/train_throughput.py --model tiny --devices 2 --cpu-devices 2   # smoke test

The models are the official RWKV-7 shapes (vocabulary 65536, head size 64): ``0.4b`` is 24
layers of width 1024, ``1.5b`` 24 layers of width 2048 (``tiny``: 2 layers of width 64). Float32
parameters, bfloat16 compute, random tokens, optax AdamW; one jitted step computes the loss, the
gradients and the update. ``--parallel data`` splits the batch over the devices, ``seq`` splits
time (sequence parallelism: the state crosses the devices). The recurrence runs through
``rwkv_jax.shard`` (custom calls do not partition by themselves); XLA partitions the rest of
the model from the input shardings and all-reduces the gradients of the replicated parameters.
The loss is :func:`rwkv_jax.nn.chunked_cross_entropy` (no full float32 logits; ``--loss plain``
for the plain head + optax loss).

Reported: tokens/s (median step time over ``--steps`` after ``--warmup``); model FLOP
utilisation ``MFU = tokens/s * F / (devices * peak)`` with ``F = 6 N + 24 L C K`` FLOPs per
token: ``N`` the parameters without the embedding table (a lookup, not a product; the head
counts), ``24 L C K`` the wkv recurrence (per layer and head four K x K products per token, 2
FLOPs each, times 3 for forward + backward), ``peak`` the dense bfloat16 peak (989 TFLOP/s on
H100 and H200 SXM; ``--peak-tflops`` elsewhere); peak memory per device
(``memory_stats()["peak_bytes_in_use"]``, XLA's compiled estimate on CPU); and with
``--breakdown`` where a step's time goes: each part jitted alone on the step's shapes and
shardings, forward + backward, times its count in the model: the wkv recurrence (L calls); a
block with an elementwise stand-in for the recurrence, less its norms (the projections, LoRAs,
token shift and channel mix, times L); the norms (ln1, ln2 and ln_x of a block, times L); the
head and loss; the optimizer update. What the step takes beyond their sum (the embedding, the
gradient all-reduce and other collectives, and what fusion across parts saves, which makes it
smaller or negative) is "other". The parts omit ``--remat``'s recomputation.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax

MODELS = {
    "0.4b": dict(vocab_size=65536, n_embd=1024, n_layer=24, head_size=64),
    "1.5b": dict(vocab_size=65536, n_embd=2048, n_layer=24, head_size=64),
    "tiny": dict(vocab_size=256, n_embd=64, n_layer=2, head_size=16),
}
PEAK_BF16_TFLOPS = {"NVIDIA H100": 989.0, "NVIDIA H200": 989.0}   # dense, SXM data sheets


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: devices)")
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per sequence (default 4096; tiny: 32)")
    parser.add_argument("--parallel", choices=("data", "seq"), default="data")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (compile)")
    parser.add_argument("--backend", default=None, help="rwkv_jax backend (default: automatic)")
    parser.add_argument("--loss", choices=("chunked", "plain"), default="chunked")
    parser.add_argument("--vocab-chunk", type=int, default=8192)
    parser.add_argument("--remat", action="store_true",
                        help="recompute each block in the backward (less memory)")
    parser.add_argument("--breakdown", action="store_true", help="time the parts of a step")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: known GPUs)")
    parser.add_argument("--cpu-devices", type=int, default=0,
                        help="simulate this many CPU devices (smoke tests)")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = args.devices if args.parallel == "data" else 1
    if args.seq is None:
        args.seq = 32 if args.model == "tiny" else 4096
    return args


def run(args):
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import rwkv_jax
    from rwkv_jax import _bench
    from rwkv_jax.nn import RWKV7Config, RWKV7LM, chunked_cross_entropy

    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(devices)} devices here")
    axis = args.parallel
    split = args.batch if axis == "data" else args.seq
    if split % args.devices:
        raise SystemExit(f"--parallel {axis} needs {'batch' if axis == 'data' else 'seq'}="
                         f"{split} divisible by --devices {args.devices}")
    mesh = jax.make_mesh((args.devices,), (axis,), axis_types=(AxisType.Auto,), devices=devices)
    tokens_spec = P(axis) if axis == "data" else P(None, axis)
    op = functools.partial(rwkv_jax.rwkv7, backend=args.backend)
    wkv_op = op if args.devices == 1 else rwkv_jax.shard(
        op, mesh, **{("batch_axis" if axis == "data" else "seq_axis"): axis})

    cfg = RWKV7Config(**MODELS[args.model])
    model = RWKV7LM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    del model   # its arrays, on the first device, go once the replicated copies exist
    params = jax.device_put(params, NamedSharding(mesh, P()))
    total_params = sum(x.size for x in jax.tree.leaves(params))
    counted = total_params - cfg.vocab_size * cfg.n_embd   # without the embedding table

    def hidden(params, tokens):
        """ln_out of the last block's output [B, T, C] and the head's kernel [C, V]."""
        lm = nnx.merge(graphdef, params)
        x, v_first = lm.emb(tokens), None
        for block in lm.blocks:
            block_graph, block_state = nnx.split(block)

            def run_block(state, x, v_first, block_graph=block_graph):
                return nnx.merge(block_graph, state)(x, v_first, wkv_op=wkv_op)[:2]

            if args.remat:
                run_block = jax.checkpoint(run_block)
            x, v_first = run_block(block_state, x, v_first)
        return lm.ln_out(x), lm.head.kernel[...]

    def head_loss(h, kernel, targets):
        if args.loss == "chunked":
            return chunked_cross_entropy(h, kernel, targets, vocab_chunk=args.vocab_chunk)
        logits = jnp.dot(h, kernel.astype(h.dtype), preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def loss_fn(params, tokens, targets):
        return head_loss(*hidden(params, tokens), targets)

    optimizer = optax.adamw(args.learning_rate, weight_decay=0.01)
    opt_state = jax.jit(optimizer.init)(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    token_sharding = NamedSharding(mesh, tokens_spec)
    shape = (args.batch, args.seq)

    @functools.partial(jax.jit, out_shardings=(token_sharding, token_sharding))
    def random_tokens(key):
        a, b = jax.random.split(key)
        return (jax.random.randint(a, shape, 0, cfg.vocab_size, jnp.int32),
                jax.random.randint(b, shape, 0, cfg.vocab_size, jnp.int32))

    tokens, targets = random_tokens(jax.random.PRNGKey(0))
    start = time.perf_counter()
    compiled = train_step.lower(params, opt_state, tokens, targets).compile()
    compile_s = time.perf_counter() - start
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens, targets)
        losses.append(float(loss))   # waits for the step
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup:])
    stats = [d.memory_stats() for d in devices]
    if all(s and "peak_bytes_in_use" in s for s in stats):
        peaks, memory_source = [s["peak_bytes_in_use"] for s in stats], "memory_stats"
    else:
        peaks = [_bench.compiled_peak_bytes(compiled)] * len(devices)
        memory_source = "compiled estimate"

    tokens_per_s = args.batch * args.seq / step_s
    flops_per_token = 6 * counted + 24 * cfg.n_layer * cfg.n_embd * cfg.head_size
    kind = devices[0].device_kind
    peak = args.peak_tflops or next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), reverse=True)
                                     if kind.startswith(k)), None)
    mfu = None if peak is None else tokens_per_s * flops_per_token / (args.devices * peak * 1e12)
    result = dict(model=args.model, config=dataclasses.asdict(cfg), devices=args.devices,
                  device_kind=kind, parallel=axis, batch=args.batch, seq=args.seq,
                  backend=rwkv_jax.backends.resolve("rwkv7", args.backend)[0], loss=args.loss,
                  remat=args.remat, params=total_params, params_without_embedding=counted,
                  flops_per_token=flops_per_token, step_ms=1e3 * step_s, compile_s=compile_s,
                  warmup_s=sum(times[:args.warmup]), tokens_per_s=tokens_per_s, mfu=mfu,
                  peak_tflops=peak, peak_bytes_per_device=peaks, memory_source=memory_source,
                  losses=losses, wall_s=time.perf_counter() - start)

    if args.breakdown:
        result["breakdown_ms"] = breakdown(args, cfg, mesh, axis, wkv_op, graphdef, params,
                                           opt_state, head_loss, optimizer, step_s)
    return result


def breakdown(args, cfg, mesh, axis, wkv_op, graphdef, params, opt_state, head_loss, optimizer,
              step_s):
    """Milliseconds of each part of a step, each jitted alone (forward + backward) on the step's
    shapes and shardings, times its count per step; the rest is the step time left over."""
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rwkv_jax import _bench

    b, t, c = args.batch, args.seq, cfg.n_embd
    h, k = cfg.n_head, cfg.head_size
    spec = P(axis) if axis == "data" else P(None, axis)
    place = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
    timed = lambda fn, *xs: _bench.time_function(fn, xs, repeats=args.steps, warmup=1).median_s

    def forward_backward(fn):
        def run(*xs):
            out, pull = jax.vjp(fn, *xs)
            return pull(jax.tree.map(jnp.ones_like, out))
        return run

    case = _bench.make_case("rwkv7", b, t, h, k)
    wkv_inputs = [place(jnp.asarray(case.arrays[n], jnp.bfloat16)) for n in "rwkvab"]
    wkv = timed(forward_backward(lambda *x: wkv_op(*x)[0]), *wkv_inputs)

    lm = nnx.merge(graphdef, params)
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
    head = timed(forward_backward(lambda x, w: head_loss(x, w, targets)), x,
                 jax.device_put(lm.head.kernel[...], NamedSharding(mesh, P())))

    def update(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt = timed(update, params, opt_state, params)
    parts = {"wkv kernels": cfg.n_layer * wkv,
             "projections, LoRAs, token shift, channel mix": cfg.n_layer * (rest - norm),
             "norms": cfg.n_layer * norm, "head and loss": head, "optimizer": opt}
    parts["other (embedding, collectives, overlap)"] = step_s - sum(parts.values())
    return {name: 1e3 * s for name, s in parts.items()}


def report(r):
    gib = lambda n: ("?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**28
                     else f"{n / 2**20:.1f} MiB")
    lines = [f"RWKV7LM {r['model']} ({r['params'] / 1e6:.1f} M parameters, "
             f"{r['params_without_embedding'] / 1e6:.1f} M without the embedding), "
             f"{r['device_kind']} x {r['devices']}, {r['parallel']} parallel, batch "
             f"{r['batch']} x {r['seq']} tokens, backend {r['backend']}, loss {r['loss']}"
             f"{', remat' if r['remat'] else ''}",
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
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main() is None)

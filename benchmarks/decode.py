"""Generation with ``rwkv_jax.nn.Generator`` beside the official ``rwkv`` package (0.8.32) on the
same random checkpoint, in one process, and where a decode step's time goes.

    source benchmarks/gpu_setup.sh      # on the GPU machine: wheels (rwkv 0.8.32 among them)
    python benchmarks/decode.py --sizes 0.1b,1.5b --backends ffi,triton,native --json decode.jsonl
    python benchmarks/decode.py --arch rwkv6 --sizes 1.5b --parts single,concurrent
    python benchmarks/decode.py --sizes 1.5b --backends ffi --parts profile
    python benchmarks/decode.py --peers none            # off the GPU: a tiny model, a smoke run

Random weights in the official RWKV-7 shapes (0.1B: L=12 C=768; 1.5B: L=24 C=2048; vocab 65536,
head 64), bfloat16 weights and compute, float32 state pool; ``--arch rwkv6``: an RWKV6LM
("Finch") of the same shapes (1.5b is Finch 1.6B's). Per size and step backend, the parts
(``--parts``):

- single: one request, 16 prompt tokens, greedy, ``--new-tokens`` decoded; both decode loop
  forms (``early_exit`` while_loop, and the fixed-length loop);
- concurrent: ``--concurrent`` requests at once (one lane each), 16 prompt tokens, greedy, and
  the same with the official defaults' sampling (top_p 0.85 and the penalties);
- prefill: one ``--prompt-tokens`` prompt against the model's sequence-mode forward (with and
  without the output head) on the same tokens;
- breakdown: the time of one decode step split by part (embedding, per layer: projections,
  LoRAs, the wkv step, norms; output head; sampling), each part a jitted function timed alone,
  summed over layers (RWKV-7 only);
- profile: ``--steps-per-call`` steps decoded in one compiled call under JAX's profiler, the
  trace read back: kernels per step, the device's busy time per step (the sum of kernel
  durations) against the wall time per step (well above busy: the GPU waits between kernels,
  launch latency), and the kernels that take the most time (off the GPU: the host's XLA ops).

Steps per compiled call and calls made are reported (the host sees the lanes once per call;
``--per-token-calls`` adds a run of one step per call: a host round trip per token). The peer
``official`` (``RWKV_CUDA_ON=1``; ``RWKV_V7_ON=1`` and its ``RWKV_x070`` for RWKV-7, its
``RWKV`` class for RWKV-6; each of ``--official-strategies``, default "cuda fp16" for RWKV-7 and
"cuda fp32,cuda fp16" for RWKV-6) loads the checkpoint written by ``torch.save`` of our state
dict: its single-stream tokens/s, the agreement of its last-position logits on the prompt with
ours (relative error against our bfloat16 model and against a float32 copy of it, same top-1),
and whether its first 16 greedy tokens are those of our float32 copy's Generator. Where it
cannot run (no torch with CUDA, the package not installed) its row says why.

XLA flags to try go in ``XLA_FLAGS`` (e.g. ``--xla_gpu_enable_command_buffer=...``).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# torch (the official package) shares the GPU with JAX in this process: JAX must not take 75%.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import runner  # noqa: E402
from runner import log  # noqa: E402
from rwkv_jax import backends, rwkv7_step  # noqa: E402
from rwkv_jax import nn as rnn  # noqa: E402
from rwkv_jax.nn._bench import decode_rate, random_model  # noqa: E402
from rwkv_jax.nn.common import lora  # noqa: E402


def timed(fn, *args, repeats=5):
    """Median seconds of ``repeats`` calls of ``fn(*args)`` (Python work included: the engine's
    calls are not one jitted function), each waited for, after one untimed call (it
    compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prefill_rate(model, prompt, backend):
    engine = rnn.Generator(model, max_batch=1, prefill_tokens=len(prompt), steps_per_call=1)
    engine.prefill_backend = backend

    def prefill():
        engine.reset()
        engine.prefill([0], [prompt], [0], max_new_tokens=1)
        return engine.pool

    seconds = timed(prefill)
    tokens = np.asarray(prompt[:-1], np.int32)[None]
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, backend=backend))
    hidden = jax.jit(lambda p, t: nnx.merge(graphdef, p).hidden(t, backend=backend)[0])
    full, trunk = timed(forward, params, tokens), timed(hidden, params, tokens)
    count = tokens.shape[1]
    return dict(prefill_tokens_per_s=count / seconds, forward_tokens_per_s=count / full,
                forward_without_head_tokens_per_s=count / trunk,
                prefill_over_forward=full / seconds,
                prefill_over_forward_without_head=trunk / seconds)


def breakdown(model, batch, backend):
    """Milliseconds of one decode step's parts, each a jitted function timed alone."""
    cfg = model.config
    c, h, n = cfg.n_embd, cfg.n_head, cfg.head_size
    block = model.blocks[1]
    att = block.att
    key = iter(jax.random.split(jax.random.key(3), 16))
    x = jax.random.normal(next(key), (batch, 1, c), jnp.bfloat16)
    heads = lambda: jax.random.normal(next(key), (batch, 1, h, n), jnp.bfloat16)
    r, k, v, kk = heads(), heads(), heads(), heads()
    w = -jax.nn.sigmoid(heads())
    kk = kk / jnp.linalg.norm(kk.astype(jnp.float32), axis=-1, keepdims=True).astype(kk.dtype)
    pool = jnp.zeros((batch, h, n, n), jnp.float32)
    parts = {}

    def jitted(module, fn):
        """``fn(module, *args)`` as a plain jitted function of the module's arrays (no Python
        work per call beyond the dispatch), and those arrays."""
        graphdef, params = nnx.split(module)
        call = jax.jit(lambda p, *args: fn(nnx.merge(graphdef, p), *args))
        return lambda *args: call(params, *args)

    projections = jitted(block, lambda b, x: (
        b.att.receptance(x), b.att.key(x), b.att.value(x), b.att.output(x),
        b.ffn.value(jnp.square(jax.nn.relu(b.ffn.key(x))))))
    loras = jitted(att, lambda a, x: (
        lora(x, a.w1, a.w2, jnp.tanh), lora(x, a.a1, a.a2), lora(x, a.v1, a.v2),
        lora(x, a.g1, a.g2, jax.nn.sigmoid)))
    norms = jitted(block, lambda b, x: (b.ln1(x), b.ln2(x),
                                        b.att.ln_x(x.reshape(batch, 1, h, n))))

    wkv = jax.jit(lambda pool: rwkv7_step(r, w, k, v, -kk, kk * 0.5, pool, backend=backend),
                  donate_argnums=0)
    step_ms = lambda fn, *a: 1e3 * timed(fn, *a)
    per_layer = {"projections": step_ms(projections, x), "loras": step_ms(loras, x),
                 "norms": step_ms(norms, x)}
    holder = [pool]

    def wkv_once():
        holder[0] = wkv(holder[0])[1]
        return holder[0]

    per_layer["wkv step"] = step_ms(wkv_once)
    parts.update({f"{name} (x{cfg.n_layer} layers)": ms * cfg.n_layer
                  for name, ms in per_layer.items()})
    tokens = jnp.zeros((batch, 1), jnp.int32)
    parts["embedding"] = step_ms(jitted(model.emb, lambda e, t: rnn.common.embed(
        e.embedding[...], t, jnp.bfloat16)), tokens)
    parts["head (ln_out + matmul)"] = step_ms(jitted(model, lambda m, x: m.head(m.ln_out(x))), x)
    logits = jax.random.normal(next(key), (batch, cfg.vocab_size), jnp.float32)
    keys = jax.random.split(next(key), batch)
    for label, kwargs in (("sampling, greedy", dict(draw=False, cut=False)),
                          ("sampling, top_p 0.85", dict(draw=True, cut=True))):
        fn = jax.jit(lambda l, k, kw=kwargs: rnn.sample_logits(l, k, 1.0, 0.85, **kw))
        parts[label] = step_ms(fn, logits, keys)
    graphdef, params = nnx.split(model)
    state = model.init_state(batch)
    step = jax.jit(lambda p, t, s: nnx.merge(graphdef, p).step(t, s, backend=backend),
                   donate_argnums=2)
    holder = [state]

    def one_step():
        logits, holder[0] = step(params, tokens, holder[0])
        return logits

    parts["whole model.step (one call)"] = step_ms(one_step)
    return parts


def official(path_pth, prompt, new_tokens, arch, strategy):
    """The official package on the same checkpoint: single-stream greedy tokens/s, its logits
    after the prompt and its greedy tokens; None (with the reason) where it cannot run."""
    import torch
    # Read when rwkv.model is first imported: RWKV_V7_ON picks the RWKV-7 code.
    os.environ["RWKV_V7_ON"] = "1" if arch == "rwkv7" else "0"
    os.environ["RWKV_CUDA_ON"] = "1"
    os.environ.setdefault("RWKV_JIT_ON", "1")
    try:
        from rwkv import model as official_model
        build = official_model.RWKV_x070 if arch == "rwkv7" else official_model.RWKV
        engine = build(path_pth[:-len(".pth")], strategy)
    except Exception as err:  # report it, keep our numbers
        return None, f"the official package failed to load: {type(err).__name__}: {err}"
    with torch.no_grad():
        logits, state = engine.forward(list(prompt), None)
        first = logits.float().cpu().numpy()

        def decode():
            out, st, tokens = logits, [s.clone() for s in state], []
            for _ in range(new_tokens):
                tokens.append(int(torch.argmax(out)))
                out, st = engine.forward([tokens[-1]], st)
            torch.cuda.synchronize()
            return tokens

        decode()
        start = time.perf_counter()
        tokens = decode()
        seconds = time.perf_counter() - start
    del engine
    torch.cuda.empty_cache()
    return dict(tokens_per_s=new_tokens / seconds, logits=first, greedy=tokens), None


def compare_with_official(model, arch, prompt, new_tokens, strategies, greedy_steps=16):
    """The official package on ``model``'s weights (written with torch.save in the official
    layout), per strategy: speed, logits against ours (bfloat16 and a float32 copy) and greedy
    tokens against our float32 copy's Generator."""
    greedy_steps = min(greedy_steps, new_tokens)
    state_dict = rnn.rwkv7_state_dict if arch == "rwkv7" else rnn.rwkv6_state_dict
    load = rnn.load_rwkv7 if arch == "rwkv7" else rnn.load_rwkv6
    params = state_dict(model)   # float32 copies of the bfloat16 weights: the same values
    exact = load(params)

    def last_logits(m):
        graphdef, weights = nnx.split(m)
        forward = jax.jit(lambda w, t: nnx.merge(graphdef, w)(t))
        return np.asarray(forward(weights, np.asarray([prompt], np.int32))[0, -1], np.float32)

    ours = dict(bf16=last_logits(model), fp32=last_logits(exact))
    ours_greedy = rnn.Generator(exact, max_batch=1).generate(
        [prompt], max_new_tokens=greedy_steps, sampling=rnn.Sampling(temperature=0)).tokens[0]
    import torch
    path = os.path.join(tempfile.mkdtemp(), "random.pth")
    torch.save({name: torch.from_numpy(value) for name, value in params.items()}, path)
    results = {}
    for strategy in strategies:
        try:
            anchor, reason = official(path, prompt, new_tokens, arch, strategy)
        except Exception as err:  # keep our numbers
            anchor, reason = None, f"the official package failed: {type(err).__name__}: {err}"
        if anchor is None:
            results[strategy] = {"error": reason}
            continue
        theirs = anchor.pop("logits")
        greedy = anchor.pop("greedy")[:greedy_steps]
        for kind, logits in ours.items():
            anchor[f"logits_relative_error_vs_ours_{kind}"] = runner.relative_error(logits, theirs)
            anchor[f"same_top1_as_ours_{kind}"] = bool(np.argmax(logits) == np.argmax(theirs))
        anchor["same_greedy_tokens_as_ours_fp32"] = greedy == ours_greedy
        anchor["greedy_tokens"], anchor["ours_fp32_greedy_tokens"] = greedy, ours_greedy
        results[strategy] = anchor
    return results


def kernel_events(trace_dir):
    """(name, start_ns, duration_ns) of every event on the device planes (the host's XLA ops
    where there is no device plane)."""
    from jax.profiler import ProfileData
    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    data = ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    events = []
    for plane in planes or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if planes and not line.name.startswith("Stream"):
                continue
            events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    return events


def profile(model, prompts, steps, backend, top):
    """One compiled call of ``steps`` decode steps under JAX's profiler: per step, the kernels
    launched, the device's busy time, the trace's span and the decode time; the ``top``
    kernels by time (name, launches per step, us per step, us each)."""
    engine = rnn.Generator(model, max_batch=len(prompts), steps_per_call=steps, backend=backend,
                           early_exit=False)
    greedy = rnn.Sampling(temperature=0)
    run = lambda: engine.generate(prompts, max_new_tokens=steps, sampling=greedy)
    run()  # compiles
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir)
    started = time.perf_counter()
    result = run()
    wall = time.perf_counter() - started
    jax.profiler.stop_trace()
    events = kernel_events(trace_dir)
    busy = sum(d for _, _, d in events)
    span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) if events else 0
    by_name = collections.defaultdict(lambda: [0, 0])
    for name, _, duration in events:
        by_name[name][0] += 1
        by_name[name][1] += duration
    kernels = [(name[:70], count / steps, total / steps / 1e3, total / count / 1e3)
               for name, (count, total) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]]
    return dict(kernels_per_step=len(events) / steps, busy_ms_per_step=busy / steps / 1e6,
                span_ms_per_step=span / steps / 1e6,
                decode_ms_per_step=1e3 * result.decode_seconds / steps,
                generate_ms_per_step=1e3 * wall / steps, decode_calls=result.decode_calls,
                top_kernels=kernels)


PARTS = ("single", "concurrent", "prefill", "breakdown", "profile")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("rwkv7", "rwkv6"), default="rwkv7",
                        help="the model: RWKV7LM, or RWKV6LM (Finch)")
    parser.add_argument("--sizes", default=None, help="comma-separated: 0.1b, 1.5b (GPU "
                        "default both), tiny (CPU default)")
    parser.add_argument("--backends", default=None, help="step backends to compare (default: "
                        "every one that runs the arch's step op here)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens decoded per request (default 512 on a GPU, 8 on a CPU)")
    parser.add_argument("--concurrent", type=int, default=None,
                        help="requests at once in 'concurrent' (default 256 on a GPU, 4 on a CPU)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="the prompt of 'prefill' (default 4096 on a GPU, 64 on a CPU)")
    parser.add_argument("--steps-per-call", type=int, default=64)
    parser.add_argument("--parts", type=runner.names_of(PARTS),
                        default=["single", "concurrent", "prefill"],
                        help=f"comma-separated: {', '.join(PARTS)} (default single,concurrent,"
                             f"prefill)")
    parser.add_argument("--profile-batch", type=int, default=1, help="lanes in 'profile'")
    parser.add_argument("--top", type=int, default=25, help="kernels listed by 'profile'")
    parser.add_argument("--official-strategies", default=None, help="comma-separated strategies "
                        "of the official package (default: 'cuda fp16' for rwkv7, "
                        "'cuda fp32,cuda fp16' for rwkv6)")
    parser.add_argument("--per-token-calls", action="store_true", help="also decode one step "
                        "per call (a host round trip per token), for contrast")
    # (one untimed run compiles each engine: no further warm-up)
    runner.add_common_arguments(parser, peers=("official",), default_repeats=1, warmup=False)
    args = parser.parse_args(argv)
    if not args.parts:
        parser.error("--parts needs at least one part")
    if "breakdown" in args.parts and args.arch != "rwkv7":
        parser.error("--parts breakdown times RWKV-7's parts only")
    return args


def main(argv=None):
    args = parse_args(argv)
    parts = set(args.parts)
    strategies = (args.official_strategies
                  or ("cuda fp16" if args.arch == "rwkv7" else "cuda fp32,cuda fp16")).split(",")
    gpu = jax.default_backend() == "gpu"
    sizes = (args.sizes or ("0.1b,1.5b" if gpu else "tiny")).split(",")
    vocab = 65536 if gpu else 512
    new_tokens = args.new_tokens or (512 if gpu else 8)
    concurrent = args.concurrent or (256 if gpu else 4)
    prompt_tokens = args.prompt_tokens or (4096 if gpu else 64)
    where = backends.platform()
    step_backends = (args.backends.split(",") if args.backends else
                     [b for b in backends.names() if backends.implements(b, f"{args.arch}_step")
                      and backends.unavailable_reason(b, where) is None])
    out = runner.Rows("decode", args.json)
    log(f"step backends {step_backends}")

    def record(size, backend, label, numbers, line):
        return out.add(dict(dict(arch=args.arch, size=size, backend=backend, row=label,
                                 new_tokens=new_tokens, steps_per_call=args.steps_per_call),
                            **numbers), line)

    rng = np.random.default_rng(0)
    greedy = rnn.Sampling(temperature=0)
    official_sampling = rnn.Sampling(temperature=1.0, top_p=0.85, alpha_frequency=0.2,
                                     alpha_presence=0.2, alpha_decay=0.996)
    for size in sizes:
        model = random_model(size, vocab, arch=args.arch)
        log(f"\n== {size}: {model.config}")
        prompt = rng.integers(1, vocab, 16).tolist()
        for backend in step_backends:
            forms = [(args.steps_per_call, True), (args.steps_per_call, False)]
            if "single" not in parts:
                forms = []
            if args.per_token_calls:  # what a host round trip per token costs, for contrast
                forms.append((1, False))
            for steps, early_exit in forms:
                label = "single stream" + ("" if early_exit else ", fixed-length loop") + (
                    "" if steps == args.steps_per_call else f", {steps} step per call")
                rate, _ = decode_rate(model, [prompt], new_tokens, backend, steps, greedy,
                                      early_exit=early_exit, repeats=args.repeats,
                                      max_seconds=args.max_seconds)
                record(size, backend, label, dict(rate, requests=1),
                       f"{backend:7s} {label:40s} {rate['tokens_per_s']:10.1f} tokens/s "
                       f"({rate['ms_per_step']:.3f} ms/step, {rate['decode_calls']} calls of "
                       f"<= {steps} steps)")
            prompts = [rng.integers(1, vocab, 16).tolist() for _ in range(concurrent)]
            for label, sampling in ((f"{concurrent} concurrent, greedy", greedy),
                                    (f"{concurrent} concurrent, official sampling",
                                     official_sampling)) if "concurrent" in parts else ():
                rate, _ = decode_rate(model, prompts, new_tokens, backend, args.steps_per_call,
                                      sampling, repeats=args.repeats,
                                      max_seconds=args.max_seconds)
                record(size, backend, label, dict(rate, requests=concurrent),
                       f"{backend:7s} {label:40s} {rate['tokens_per_s']:10.1f} tokens/s "
                       f"({rate['ms_per_step']:.3f} ms/step)")
            if "breakdown" in parts:
                for batch in (1, concurrent):
                    step_parts = breakdown(model, batch, backend)
                    record(size, backend, f"breakdown, batch {batch}", dict(parts_ms=step_parts),
                           f"{backend:7s} one step at batch {batch}: " + ", ".join(
                               f"{name} {ms:.3f}" for name, ms in step_parts.items()) + " ms")
            if "profile" in parts:
                prompts = [rng.integers(1, vocab, 16).tolist() for _ in range(args.profile_batch)]
                found = profile(model, prompts, args.steps_per_call, backend, args.top)
                lines = [f"{backend:7s} profile, batch {args.profile_batch}: per step "
                         f"{found['kernels_per_step']:.0f} kernels, busy "
                         f"{found['busy_ms_per_step']:.3f} ms, trace span "
                         f"{found['span_ms_per_step']:.3f} ms, decode "
                         f"{found['decode_ms_per_step']:.3f} ms",
                         f"{'kernel':70s} {'per step':>9s} {'us/step':>9s} {'us each':>8s}"]
                lines += [f"{name:70s} {count:9.1f} {per_step:9.1f} {each:8.2f}"
                          for name, count, per_step, each in found["top_kernels"]]
                record(size, backend, f"profile, batch {args.profile_batch}", found,
                       "\n".join(lines))
        if "prefill" in parts:
            big = rng.integers(1, vocab, prompt_tokens + 1).tolist()
            rates = prefill_rate(model, big, None)
            record(size, "default", f"prefill of {prompt_tokens} tokens", rates,
                   f"prefill of {prompt_tokens} tokens: "
                   + ", ".join(f"{k} {v:.3f}" if "over" in k else f"{k} {v:.0f}"
                               for k, v in rates.items()))
        if "official" in args.peers:
            absent = runner.peer_absent("official")
            if absent is not None:
                record(size, "official", "official rwkv package", dict(absent=absent),
                       f"official rwkv package: absent ({absent})")
                continue
            for strategy, found in compare_with_official(model, args.arch, prompt, new_tokens,
                                                         strategies).items():
                line = f"official rwkv ({strategy}): " + (found.get("error") or (
                    f"{found['tokens_per_s']:.1f} tokens/s single stream; logits relative "
                    f"error vs ours fp32 {found['logits_relative_error_vs_ours_fp32']:.2e}, vs "
                    f"ours bf16 {found['logits_relative_error_vs_ours_bf16']:.2e}; same top-1 "
                    f"(fp32) {found['same_top1_as_ours_fp32']}; same greedy tokens (fp32) "
                    f"{found['same_greedy_tokens_as_ours_fp32']}"))
                record(size, "official", f"official rwkv, {strategy}", found, line)
    return out.rows


if __name__ == "__main__":
    main()

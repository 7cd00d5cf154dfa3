"""Generate text with an official RWKV-7 checkpoint, streamed as it comes.

    python examples/generate.py --checkpoint rwkv7-g1-0.1b.pth --prompt "The capital of France is"
    python examples/generate.py --checkpoint model.pth --prompt "Once" --prompt "A long one" \\
        --temperature 0      # several prompts share each step (continuous batching); 0 = greedy
    python examples/generate.py --random-checkpoint /tmp/random.npz --prompt "Hi"
                             # writes a small random model first (gibberish, for a first try)

Official RWKV-7 weights are published by BlinkDL on Hugging Face (the ``BlinkDL/rwkv7-g1``
repository: ``rwkv7-g1-0.1b-...pth`` and larger). A thin front of ``rwkv_jax.nn.TextGenerator``:
loads the checkpoint with ``load_rwkv7`` (.pth, read without torch; .safetensors; .npz),
tokenizes with the RWKV "World" tokenizer (the ``[tokenizer]`` extra), streams each
continuation and prints the prefill and decode speeds. The sampling defaults are
``rwkv_jax.nn.Sampling``'s (plain sampling at temperature 1); the official package's are
``--top-p 0.85 --alpha-frequency 0.2 --alpha-presence 0.2 --alpha-decay 0.996``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from rwkv_jax.nn import Sampling

SAMPLING_HELP = dict(temperature="0: greedy", top_p="nucleus: keep the most likely tokens up to "
                     "this probability", top_k="keep the k most likely (0: all)",
                     alpha_frequency="penalty per earlier occurrence of a token",
                     alpha_presence="penalty for a token already generated",
                     alpha_decay="the occurrence counts' decay per token")


def write_random_checkpoint(path, vocab_size):
    """A small random RWKV-7 (2 layers, width 64, one head of 64) in the official format."""
    from flax import nnx

    from rwkv_jax.nn import RWKV7Config, RWKV7LM, save_rwkv7
    config = RWKV7Config(vocab_size=vocab_size, n_embd=64, n_layer=2, head_size=64)
    save_rwkv7(RWKV7LM(config, rngs=nnx.Rngs(0)), path)
    print(f"wrote a random checkpoint ({config}) to {path}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="official RWKV-7 weights (.pth, .safetensors or "
                        ".npz)")
    source.add_argument("--random-checkpoint", metavar="PATH", help="write a small random "
                        "model to PATH (.npz, .safetensors or .pth) and use it")
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to continue; repeat for several prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--stop", action="append", default=[],
                        help="a string that ends the text (not printed); repeatable")
    for field in dataclasses.fields(Sampling):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                            default=field.default, help=SAMPLING_HELP[field.name])
    parser.add_argument("--batch-size", type=int,
                        help="lanes (None: as many as prompts, at most 16)")
    parser.add_argument("--steps-per-call", type=int, default=32,
                        help="decode steps per compiled call (text comes out between calls)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 weights and compute")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    parser.add_argument("--backend", help="step kernels' backend (None: the platform's)")
    args = parser.parse_args(argv)
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        parser.error(f"--checkpoint {args.checkpoint}: no such file")

    import jax.numpy as jnp

    from rwkv_jax.nn import TextGenerator, WorldTokenizer, load_rwkv7

    tokenizer = WorldTokenizer()
    path = args.checkpoint
    if args.random_checkpoint:
        path = args.random_checkpoint
        write_random_checkpoint(path, vocab_size=65536)
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    model = load_rwkv7(path, dtype=dtype, param_dtype=dtype)
    print(f"model: {model.config}")
    prompts = args.prompt
    lanes = min(len(prompts), 16 if args.batch_size is None else args.batch_size)
    text = TextGenerator(model, tokenizer=tokenizer, max_batch=lanes,
                         steps_per_call=args.steps_per_call, backend=args.backend)
    sampling = Sampling(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sampling)})
    run = dict(sampling=sampling, stop=args.stop, seed=args.seed)
    started = time.perf_counter()
    text.generate(prompts, max_new_tokens=2, **run)  # compiles prefill and decode
    compiled = time.perf_counter() - started

    many = len(prompts) > 1
    print("".join(f"\n[{i}] {p}" for i, p in enumerate(prompts)) if many else f"\n{prompts[0]}",
          end="")
    shown = [None if many else 0]  # the prompt whose text the terminal shows last

    def show(i, piece):
        if shown[0] != i:
            print(f"\n[{i}]> ", end="")
            shown[0] = i
        print(piece, end="", flush=True)

    result = text.generate(prompts, max_new_tokens=args.max_new_tokens, **run,
                           on_text=[lambda piece, i=i: show(i, piece) for i in range(len(prompts))])
    g = result.generation
    generated = sum(map(len, g.tokens))
    prefill = (f"{g.prefill_tokens} tokens in {g.prefill_seconds:.3f} s "
               f"({g.prefill_tokens / max(g.prefill_seconds, 1e-9):.1f} tokens/s)"
               if g.prefill_tokens else "none")
    decode_rate = generated / max(g.decode_seconds, 1e-9)
    print(f"\n\nfinish: {', '.join(result.finish)}\nprefill: {prefill} (each prompt's last "
          f"token goes with the first decode step)\ndecode: {generated} tokens for {len(prompts)} "
          f"prompt(s) in {g.decode_seconds:.3f} s ({decode_rate:.1f} tokens/s, "
          f"{args.steps_per_call} steps per call; compiling took {compiled:.1f} s)")
    return dict(texts=result.texts, finish=result.finish, tokens=g.tokens,
                sample_below=text.generator.sample_below, decode_tokens_per_s=decode_rate)


if __name__ == "__main__":
    main()

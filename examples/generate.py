"""Generate text with an official RWKV-7 checkpoint.

    python examples/generate.py --checkpoint rwkv7-g1-0.1b.pth --prompt "The capital of France is"
    python examples/generate.py --checkpoint model.pth --prompt "Once" --prompt "A long one" \\
        --temperature 0      # several prompts share each step (continuous batching); 0 = greedy
    python examples/generate.py --random-checkpoint /tmp/random.npz --prompt "Hi"
                             # writes a small random model first (gibberish, for a first try)

Official RWKV-7 weights are published by BlinkDL on Hugging Face (the ``BlinkDL/rwkv7-g1``
repository: ``rwkv7-g1-0.1b-...pth`` and larger). Loads the checkpoint with
``rwkv_jax.nn.load_rwkv7`` (.pth, read without torch; .safetensors; .npz), tokenizes with the
RWKV "World" tokenizer of the ``pyrwkv-tokenizer`` package (the vocabulary of the released
RWKV-7 models; ``pip install pyrwkv-tokenizer`` or the ``[tokenizer]`` extra), runs a
``rwkv_jax.nn.Generator`` and prints each prompt with its continuation, and the prefill and
decode speeds. Text is decoded from each token's bytes, so a continuation cut inside a
multi-byte character still prints (with a replacement character).
"""

from __future__ import annotations

import argparse
import ast
import codecs
import sys
import time


def load_tokenizer():
    try:
        import pyrwkv_tokenizer
    except ImportError:
        sys.exit("examples/generate.py needs the RWKV tokenizer: pip install pyrwkv-tokenizer "
                 "(or the package's [tokenizer] extra)")
    return pyrwkv_tokenizer.RWKVTokenizer()


class TextStream:
    """Token ids in, text out as it completes: each token's bytes (read from the tokenizer's
    vocabulary file) go through an incremental UTF-8 decoder, so a sequence that ends inside a
    multi-byte character loses nothing (the tokenizer's own ``decode`` raises on it); what is
    left at the end comes out with replacement characters."""

    def __init__(self, tokenizer):
        self.token_bytes = _token_bytes(tokenizer.vocab_filepath)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        piece = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        return self.decoder.decode("\ufffd".encode() if piece is None else piece)

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True)


def _token_bytes(path) -> list:
    """Index: token id; value: its bytes (None for ids the vocabulary lacks). Each line of the
    World vocabulary is ``id literal length``, the literal a Python str or bytes."""
    table: dict[int, bytes] = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            token_id = int(line[:line.index(" ")])
            literal = ast.literal_eval(line[line.index(" "):line.rindex(" ")].strip())
            table[token_id] = literal.encode("utf-8") if isinstance(literal, str) else literal
    return [table.get(i) for i in range(max(table) + 1)]


def write_random_checkpoint(path, vocab_size):
    """A small random RWKV-7 (2 layers, width 64, one head of 64) in the official format."""
    from flax import nnx

    from rwkv_jax.nn import RWKV7Config, RWKV7LM, save_rwkv7
    config = RWKV7Config(vocab_size=vocab_size, n_embd=64, n_layer=2, head_size=64)
    save_rwkv7(RWKV7LM(config, rngs=nnx.Rngs(0)), path)
    print(f"wrote a random checkpoint ({config}) to {path}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="official RWKV-7 weights (.pth, .safetensors or "
                        ".npz)")
    source.add_argument("--random-checkpoint", metavar="PATH", help="write a small random "
                        "model to PATH (.npz, .safetensors or .pth) and use it")
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to continue; repeat for several prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=0.7,
                        help="nucleus sampling: keep the most likely tokens up to this "
                        "probability (default 0.7)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: all)")
    parser.add_argument("--alpha-frequency", type=float, default=0.0)
    parser.add_argument("--alpha-presence", type=float, default=0.0)
    parser.add_argument("--alpha-decay", type=float, default=0.996)
    parser.add_argument("--batch-size", type=int, help="lanes (default: all prompts, at most 16)")
    parser.add_argument("--steps-per-call", type=int, default=32)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 weights and compute")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", help="backend of the step kernels (default: the platform's)")
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    from rwkv_jax.nn import Generator, Sampling, load_rwkv7

    tokenizer = load_tokenizer()
    path = args.checkpoint
    if args.random_checkpoint:
        path = args.random_checkpoint
        write_random_checkpoint(path, vocab_size=65536)
    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    model = load_rwkv7(path, dtype=dtype, param_dtype=dtype)
    prompts = [tokenizer.encode(text) for text in args.prompt]
    print(f"model: {model.config}")
    engine = Generator(model, max_batch=min(len(prompts), args.batch_size or 16),
                       steps_per_call=args.steps_per_call, backend=args.backend,
                       # The head may have more outputs than the tokenizer has ids (65536 vs
                       # 65530).
                       sample_below=min(tokenizer.vocab_size(), model.config.vocab_size))
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        alpha_frequency=args.alpha_frequency,
                        alpha_presence=args.alpha_presence, alpha_decay=args.alpha_decay)
    run = lambda count: engine.generate(prompts, max_new_tokens=count, sampling=sampling,
                                        stop_tokens=[0],  # the tokenizer's end of text
                                        seed=args.seed)
    started = time.perf_counter()
    run(2)  # compiles the prefill and decode calls for these shapes
    compiled = time.perf_counter() - started
    result = run(args.max_new_tokens)

    for text, tokens in zip(args.prompt, result.tokens):
        stream = TextStream(tokenizer)
        print(f"\n{text}" + "".join(stream.push(t) for t in tokens) + stream.flush())
    generated = sum(map(len, result.tokens))
    prefill_rate = result.prefill_tokens / max(result.prefill_seconds, 1e-9)
    decode_rate = generated / max(result.decode_seconds, 1e-9)
    print(f"\nprefill: {result.prefill_tokens} prompt tokens in {result.prefill_seconds:.3f} s "
          f"({prefill_rate:.1f} tokens/s)\ndecode: {generated} tokens for {len(prompts)} "
          f"prompt(s) in {result.decode_seconds:.3f} s ({decode_rate:.1f} tokens/s, "
          f"{engine.steps_per_call} steps per call; compiling took {compiled:.1f} s)")
    return dict(tokens=result.tokens, prefill_tokens_per_s=prefill_rate,
                decode_tokens_per_s=decode_rate)


if __name__ == "__main__":
    main()

"""Generate text with an official RWKV-7 checkpoint.

    python examples/generate.py --checkpoint model.pth --prompt "The capital of France is"
    python examples/generate.py --checkpoint model.pth --prompt "Once" --prompt "A long prompt ..." \
        --temperature 0      # several prompts share each step (continuous batching); 0 = greedy

Loads the checkpoint with ``rwkv_jax.nn.load_rwkv7`` (.pth needs torch; .safetensors, .npz),
tokenizes with the RWKV "World" tokenizer of the ``pyrwkv-tokenizer`` package (the vocabulary of
the released RWKV-7 models; ``pip install pyrwkv-tokenizer`` or the ``[tokenizer]`` extra), runs
``rwkv_jax.nn.generate`` and prints each prompt with its continuation and the speed.
"""

from __future__ import annotations

import argparse
import sys
import time


def load_tokenizer():
    try:
        import pyrwkv_tokenizer
    except ImportError:
        sys.exit("examples/generate.py needs the RWKV tokenizer: pip install pyrwkv-tokenizer "
                 "(or the package's [tokenizer] extra)")
    return pyrwkv_tokenizer.RWKVTokenizer()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="official RWKV-7 weights "
                        "(.pth, .safetensors or .npz)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="text to continue; repeat for several prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=0.7,
                        help="nucleus sampling: keep the most likely tokens up to this "
                        "probability (default 0.7)")
    parser.add_argument("--batch-size", type=int, help="prompts per step (default: all, at most 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", help="backend of the step kernels (default: the platform's)")
    args = parser.parse_args(argv)

    from rwkv_jax.nn import generate, load_rwkv7

    tokenizer = load_tokenizer()
    model = load_rwkv7(args.checkpoint)
    prompts = [tokenizer.encode(text) for text in args.prompt]
    options = dict(temperature=args.temperature, top_p=args.top_p, batch_size=args.batch_size,
                   backend=args.backend, seed=args.seed,
                   stop_token=0,  # the tokenizer's end of text
                   # The head may have more outputs than the tokenizer has ids (65536 vs 65530).
                   sample_below=min(tokenizer.vocab_size(), model.config.vocab_size))
    print(f"model: {model.config}")

    started = time.perf_counter()
    generate(model, prompts, max_new_tokens=1, **options)  # compiles the step for these shapes
    compiled = time.perf_counter() - started
    started = time.perf_counter()
    result = generate(model, prompts, max_new_tokens=args.max_new_tokens, **options)
    seconds = time.perf_counter() - started

    for text, tokens in zip(args.prompt, result.tokens):
        print(f"\n{text}{tokenizer.decode(tokens)}")
    generated = sum(map(len, result.tokens))
    fed = sum(map(len, prompts)) + generated
    print(f"\n{generated} tokens generated for {len(prompts)} prompt(s) ({fed} tokens fed through "
          f"the model) in {seconds:.2f} s: {generated / seconds:.1f} generated tokens/s, "
          f"{fed / seconds:.1f} tokens/s through the model (step compiled in {compiled:.1f} s)")
    return dict(tokens=result.tokens, seconds=seconds, tokens_per_s=generated / seconds)


if __name__ == "__main__":
    main()

"""Generation speed of :class:`rwkv_jax.nn.Generator` on a random RWKV-7 (or RWKV-6) model in the
official shapes, shared by ``rwkv-jax bench`` (its generation rows) and
``benchmarks/decode.py``."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .generate import Generator, Sampling
from .rwkv6 import RWKV6Config, RWKV6LM
from .rwkv7 import RWKV7Config, RWKV7LM

# The official RWKV-7 shapes (RWKV-6's 1.6B has the 1.5b one), and a tiny one for CPU smoke
# tests.
HEAD_SIZE = 64
SIZES = {"0.1b": dict(n_layer=12, n_embd=768), "1.5b": dict(n_layer=24, n_embd=2048),
         "tiny": dict(n_layer=2, n_embd=128)}


MODELS = {"rwkv7": (RWKV7Config, RWKV7LM), "rwkv6": (RWKV6Config, RWKV6LM)}


def random_model(size: str, vocab: int, seed: int = 0, arch: str = "rwkv7"):
    """An RWKV7LM (``arch="rwkv6"``: an RWKV6LM) of shape ``SIZES[size]`` with bfloat16 weights
    and compute whose every matrix is random (the fresh init leaves the output projections and
    LoRA down-projections at zero, which would make the layers trivial)."""
    config_type, model_type = MODELS[arch]
    config = config_type(vocab_size=vocab, head_size=HEAD_SIZE, **SIZES[size])
    model = model_type(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(state))))

    def fill(x):
        key = next(keys)
        if x.ndim != 2:
            return x
        scale = 0.5 / np.sqrt(x.shape[0])
        return (scale * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)

    nnx.update(model, jax.tree.map(fill, state))
    return model


def decode_rate(model, prompts, new_tokens: int, backend, steps: int, sampling: Sampling, *,
                early_exit: bool = True, repeats: int = 1, max_seconds: float = float("inf")):
    """Decode speed of a :class:`Generator` with one lane per prompt, each request sampling
    ``new_tokens`` tokens with ``sampling``: after one untimed (compiling) run, up to
    ``repeats`` timed runs (at least 3, fewer than ``repeats`` once ``max_seconds`` have
    passed). Returns the median decode
    time's numbers (prefill excluded) and the last run's :class:`Generation`."""
    engine = Generator(model, max_batch=len(prompts), steps_per_call=steps, backend=backend,
                       early_exit=early_exit)
    run = lambda: engine.generate(prompts, max_new_tokens=new_tokens, sampling=sampling)
    run()  # compiles
    results = []
    started = time.perf_counter()
    while len(results) < max(repeats, 1):
        results.append(run())
        if len(results) >= 3 and time.perf_counter() - started > max_seconds:
            break
    result = results[-1]
    seconds = statistics.median(r.decode_seconds for r in results)
    generated = sum(map(len, result.tokens))
    return dict(tokens_per_s=generated / seconds, ms_per_step=1e3 * seconds / max(1, new_tokens),
                min_ms_per_step=1e3 * min(r.decode_seconds for r in results) / max(1, new_tokens),
                decode_calls=result.decode_calls, steps_per_call=steps, generated=generated,
                repeats=len(results)), result

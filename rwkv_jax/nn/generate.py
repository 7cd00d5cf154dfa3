"""Text generation with :class:`rwkv_jax.nn.RWKV7LM`: prompts of token ids in, sampled token ids
out, through the model's step mode on a donated state pool.

Continuous batching: ``batch_size`` lanes run side by side, one token per lane per step. Each
request (prompt) owns one slot of the state pool; a lane feeds its request's prompt tokens one
by one, then the tokens it samples, and when the request is done (``max_new_tokens`` or the
stop token) the lane takes the next waiting request. ``state_indices`` tells the step which
slot each lane advances, so prompts of different lengths and requests that start late share
every step. A step (model step, sampling, pool update) is one compiled call.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .rwkv7 import RWKV7LM


class Generation(NamedTuple):
    """``tokens[i]``: the tokens sampled for prompt ``i`` (without the stop token); ``state``:
    the state pool, slot ``i`` holding request ``i``'s state after its last fed token."""
    tokens: list[list[int]]
    state: tuple


def sample_logits(logits, key, temperature, top_p):
    """One token per row of ``logits [B, V]``: greedy where ``temperature == 0``, else drawn from
    ``softmax(logits / temperature)`` restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (nucleus sampling). ``temperature``/``top_p`` are scalars or
    ``[B]`` arrays (traced: changing them does not recompile)."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:1])
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), logits.shape[:1])
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the tokens more likely than it have not yet reached top_p (the most
    # likely token is always kept).
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(before < top_p[:, None], sorted_logits, -jnp.inf)
    choice = jax.random.categorical(key, kept, axis=-1)
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "backend", "sample_below"),
                   donate_argnames=("state",))
def _step(params, state, tokens, slots, active, key, temperature, top_p, *, graphdef, backend,
          sample_below):
    """Feed ``tokens [B]`` to the pool rows ``slots [B]``; rows of inactive lanes are left as
    they were. Returns ``(next token per lane [B], state)``."""
    model = nnx.merge(graphdef, params)
    before = jax.tree.map(lambda pool: pool[slots], state)
    logits, state = model.step(tokens[:, None], state, state_indices=slots, backend=backend)

    def keep_inactive(pool, old):
        mask = active.reshape((-1,) + (1,) * (old.ndim - 1))
        return pool.at[slots].set(jnp.where(mask, pool[slots], old))

    state = jax.tree.map(keep_inactive, state, before)
    logits = logits[:, -1]
    if sample_below is not None:  # e.g. ids a tokenizer cannot decode
        logits = jnp.where(jnp.arange(logits.shape[-1]) < sample_below, logits, -jnp.inf)
    return sample_logits(logits, key, temperature, top_p), state


def _check_prompts(prompts, vocab_size) -> list[np.ndarray]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of token-id sequences, got "
                        f"{type(prompts).__name__}")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D sequence of integer token ids, "
                             f"got shape {ids.shape} and dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise ValueError(f"prompts[{i}] must hold token ids in [0, {vocab_size}) (the model's "
                             f"vocabulary), got ids in [{ids.min()}, {ids.max()}]")
        checked.append(ids.astype(np.int32))
    return checked


def _positive_int(name, value):
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def generate(model: RWKV7LM, prompts, *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, stop_token: int | None = None, batch_size: int | None = None,
             sample_below: int | None = None, seed: int = 0, backend=None) -> Generation:
    """Sample up to ``max_new_tokens`` tokens after each prompt (a list of token-id sequences
    of any lengths).

    ``temperature=0`` is greedy decoding; otherwise tokens are drawn at ``temperature`` from the
    nucleus of probability ``top_p``. Generation of a prompt ends early at ``stop_token`` (not
    included in the output). ``batch_size`` lanes (default: all prompts, at most 16) run in each
    compiled step; ``sample_below`` restricts sampling to ids below it (a tokenizer may know
    fewer ids than the model's output head); ``backend`` picks the step kernels.
    """
    if not isinstance(model, RWKV7LM):
        raise TypeError(f"model must be an RWKV7LM, got {type(model).__name__}")
    vocab = model.config.vocab_size
    prompts = _check_prompts(prompts, vocab)
    max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
    lanes = min(len(prompts), _positive_int("batch_size", 16 if batch_size is None else batch_size))
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if sample_below is not None and not 1 <= _positive_int("sample_below", sample_below) <= vocab:
        raise ValueError(f"sample_below must be in [1, {vocab}], got {sample_below}")
    if stop_token is not None and not 0 <= operator.index(stop_token) < vocab:
        raise ValueError(f"stop_token must be in [0, {vocab}), got {stop_token}")

    graphdef, params = nnx.split(model)
    state = model.init_state(len(prompts))  # slot i: request i
    step = functools.partial(_step, graphdef=graphdef, backend=backend,
                             sample_below=sample_below)
    key = jax.random.key(seed)
    outputs: list[list[int]] = [[] for _ in prompts]
    request = list(range(lanes))  # the request each lane serves
    position = [0] * lanes  # tokens of its request fed so far
    active = [True] * lanes
    waiting = lanes  # the next request to start
    steps = 0
    while any(active):
        tokens = np.array([prompts[r][p] if p < len(prompts[r]) else outputs[r][-1]
                           for r, p in zip(request, position)], np.int32)
        sampled, state = step(params, state, tokens, np.array(request, np.int32),
                              np.array(active), jax.random.fold_in(key, steps),
                              float(temperature), float(top_p))
        next_token = np.asarray(sampled)
        steps += 1
        for lane in range(lanes):
            if not active[lane]:
                continue
            r = request[lane]
            position[lane] += 1
            if position[lane] < len(prompts[r]):
                continue  # still reading the prompt: the sample is not used
            token = int(next_token[lane])
            done = token == stop_token
            if not done:
                outputs[r].append(token)
                done = len(outputs[r]) == max_new_tokens
            if done and waiting < len(prompts):
                request[lane], position[lane] = waiting, 0
                waiting += 1
            elif done:
                active[lane] = False  # idle: its slot (a finished request's) is left as it is
    return Generation(outputs, state)

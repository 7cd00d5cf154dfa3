"""Text generation with :class:`rwkv_jax.nn.RWKV7LM` or :class:`rwkv_jax.nn.RWKV6LM`: prompts of
token ids in, sampled token ids out, on a donated float32 state pool with one slot per lane.

:class:`Generator` is the engine:

- **prefill** packs the prompts of the requests that start (all but each prompt's last token)
  along T with ``cu_seqlens`` and runs them through the model's sequence mode (the chunked
  kernels) in one compiled call, from zero states, writing each prompt's final states (wkv state
  and both token shifts of every layer) into its lane's slot of the pool;
- **decode** runs up to ``steps_per_call`` steps in one compiled call (a ``lax.while_loop`` on
  the device): each step feeds every lane its next token through the step mode, samples the next
  one (greedy, temperature, top-p, top-k, the official package's frequency/presence penalties),
  stops a lane at a stop token or at its request's ``max_new_tokens``, and writes the sampled
  tokens to an output buffer. The host sees the lanes only between calls: after
  ``steps_per_call`` steps, or, while requests wait, as soon as one lane finishes;
- **generate** serves a list of prompts with continuous batching: a finished lane is refilled
  with the next waiting request (prefill into its slot) between decode calls.

Randomness: the key of request ``r``'s ``n``-th sampled token is
``fold_in(fold_in(key(seed), r), n)``, so a seed gives the same tokens whatever the batch
composition, the lane a request lands in, or ``steps_per_call``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import _checks as checks
from .common import LanguageModel

_FLOAT32 = np.finfo(np.float32)
_INT32_MAX = int(np.iinfo(np.int32).max)


def _int32_limit(count: int) -> int:
    """A count limit as the engine stores it, an int32: larger ones (past any reachable count,
    in effect no limit) become the largest int32 instead of wrapping."""
    return min(count, _INT32_MAX)


class Generation(NamedTuple):
    """``tokens[i]``: the tokens sampled for prompt ``i`` (without the stop token);
    ``finish[i]``: "stop" (a stop token was sampled) or "length" (``max_new_tokens`` reached);
    ``prefill_tokens``/``prefill_seconds`` and ``decode_tokens``/``decode_seconds``: the tokens
    each phase processed and the wall time it took (compilation included the first time);
    ``decode_calls``: the compiled decode calls made (the host's only looks at the lanes)."""
    tokens: list[list[int]]
    finish: list[str]
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    decode_calls: int


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one request samples, with the names of the official ``rwkv`` package's
    ``PIPELINE_ARGS``: the logits of tokens already generated are lowered by
    ``alpha_presence + alpha_frequency * count`` (counts decay by ``alpha_decay`` at every new
    token; prompt tokens do not count), then the nucleus of probability ``top_p`` and the
    ``top_k`` most likely tokens (0: all) are kept and the token is drawn from
    ``probs ** (1 / temperature)``. ``temperature == 0`` is greedy (the most likely token after
    the penalties). The defaults change nothing; the official pipeline's are ``top_p=0.85,
    alpha_frequency=0.2, alpha_presence=0.2, alpha_decay=0.996``. (The official pipeline also
    counts whitespace and digit tokens as 0 occurrences; here every token counts 1.)"""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    alpha_frequency: float = 0.0
    alpha_presence: float = 0.0
    alpha_decay: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_p", "alpha_frequency", "alpha_presence", "alpha_decay"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
            # The sampler runs in float32: a value beyond its range would become inf there.
            if not abs(float(value)) <= float(_FLOAT32.max):
                raise ValueError(f"{name} must be finite in float32 (|x| <= {_FLOAT32.max:.4g}), "
                                 f"got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if 0 < self.temperature < float(_FLOAT32.tiny):
            # Below float32's smallest normal number, 1 / temperature is not finite.
            raise ValueError(f"temperature must be 0 (greedy) or >= {_FLOAT32.tiny:.4g} "
                             f"(float32's smallest normal number), got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1] (1: no nucleus cut), got {self.top_p}")
        if not 0 <= self.alpha_decay <= 1:
            raise ValueError(f"alpha_decay must be in [0, 1], got {self.alpha_decay}")
        try:
            top_k = operator.index(self.top_k)
        except TypeError:
            raise TypeError(f"top_k must be an int, got {type(self.top_k).__name__} "
                            f"{self.top_k!r}") from None
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {top_k}")
        object.__setattr__(self, "top_k", top_k)

    @property
    def penalised(self) -> bool:
        return self.alpha_frequency != 0 or self.alpha_presence != 0


class Lanes(NamedTuple):
    """What the device knows of each lane ``[L]`` between calls (one pytree, donated)."""
    token: jax.Array  # int32: the next token to feed
    active: jax.Array  # bool
    request: jax.Array  # int32: the request's id (its random stream)
    generated: jax.Array  # int32: tokens sampled so far
    max_new: jax.Array  # int32
    temperature: jax.Array  # float32, and the rest of Sampling per lane
    top_p: jax.Array
    top_k: jax.Array
    alpha_frequency: jax.Array
    alpha_presence: jax.Array
    alpha_decay: jax.Array
    counts: jax.Array  # float32 [L, V] decayed occurrence counts, [L, 0] without penalties
    seen: jax.Array  # bool [L, V] tokens generated at least once, [L, 0] without penalties
    seed: jax.Array  # uint32 scalar


def sample_logits(logits, keys, temperature, top_p, top_k=0, *, sample_below=None, draw=True,
                  cut=True):
    """One token per row of ``logits [B, V]`` with the official ``rwkv`` sampler: keep the
    nucleus (the most likely tokens whose probability, at temperature 1, first reaches ``top_p``)
    and the ``top_k`` most likely (0 or ``>= V``: all), then draw from
    ``probs ** (1 / temperature)``; ``temperature == 0`` is greedy. ``sample_below``: only ids
    below it come out (None: all). ``keys``: one key, or one per row (``[B]``) for streams
    that do not depend on the other rows. ``temperature``, ``top_p``, ``top_k``: scalars or
    ``[B]`` (traced: changing them does not recompile). An id outside ``sample_below``, the
    nucleus or the top k never comes out, whatever the logits (NaN, infinite) and the
    temperature.

    ``draw=False`` promises that every row is greedy, ``cut=False`` that no row cuts (top_p 1,
    top_k 0): the work they skip (a draw over the vocabulary; sorting it) is not compiled in.
    Static flags rather than run-time branches: a branch on device values costs a device-to-host
    read of its predicate on GPUs."""
    rows, vocab = logits.shape
    ids = jnp.arange(vocab)
    # One rule decides which ids may come out: ``allowed`` (below sample_below, inside the
    # nucleus and the top k; the most likely allowed id always is), applied last to the very
    # scores drawn from. The arithmetic before it runs on finite values (infinite logits, such
    # as a penalty's overflow, are clipped to float32's range), so no value can turn a masked
    # id's score into a NaN or a winner.
    valid = jnp.ones((vocab,), bool) if sample_below is None else ids < sample_below
    logits = jnp.where(valid, jnp.clip(logits.astype(jnp.float32), _FLOAT32.min, _FLOAT32.max),
                       -jnp.inf)
    per_row = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (rows,))
    temperature = per_row(temperature, jnp.float32)
    if isinstance(top_k, numbers.Integral):
        top_k = _int32_limit(int(top_k))
    top_p, top_k = per_row(top_p, jnp.float32), per_row(top_k, jnp.int32)
    if jnp.ndim(keys) == 0:
        keys = jax.random.split(keys, rows)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # a NaN logit wins, if allowed
    sampling = temperature > 0
    cutting = sampling & ((top_p < 1) | ((top_k > 0) & (top_k < vocab)))

    def kept():
        """Per row, whether each id is in the nucleus and the top k."""
        probs = jax.nn.softmax(logits, axis=-1)
        ordered = -jnp.sort(-probs, axis=-1)
        reached = jnp.cumsum(ordered, axis=-1) >= top_p[:, None]
        # The probability of the token that reaches top_p (the last one when rounding keeps
        # the sum below it); every token at least as likely is kept.
        first = jnp.where(reached.any(-1), jnp.argmax(reached, axis=-1), vocab - 1)
        cutoff = jnp.take_along_axis(ordered, first[:, None], axis=-1)
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        cutoff = jnp.where((top_k > 0)[:, None], jnp.maximum(cutoff, kth), cutoff)
        return ~cutting[:, None] | (probs >= cutoff)

    if not draw:
        return greedy
    allowed = ((valid & kept()) if cut else valid) | (ids == greedy[:, None])
    # 1 / temperature is finite (Sampling refuses temperatures below float32's smallest normal
    # number); a product beyond float32's range is infinite but stays inside ``allowed``.
    scaled = logits / jnp.where(sampling, temperature, 1.0)[:, None]
    scores = jnp.where(allowed, jnp.maximum(scaled, _FLOAT32.min), -jnp.inf)
    sampled = jax.vmap(jax.random.categorical)(keys, scores).astype(jnp.int32)
    return jnp.where(sampling, sampled, greedy)


def _penalised(logits, lanes):
    if lanes.counts.shape[1] == 0:
        return logits
    penalty = lanes.alpha_presence[:, None] + lanes.alpha_frequency[:, None] * lanes.counts
    return logits - jnp.where(lanes.seen, penalty, 0.0)


def _count(lanes, token, emitted):
    if lanes.counts.shape[1] == 0:
        return lanes
    rows = jnp.arange(token.shape[0])
    decay = jnp.where(emitted, lanes.alpha_decay, 1.0)[:, None]
    counts = (lanes.counts * decay).at[rows, token].add(emitted.astype(jnp.float32))
    seen = lanes.seen.at[rows, token].max(emitted)
    return lanes._replace(counts=counts, seen=seen)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "backend", "sample_below",
                                             "draw", "cut", "early_exit"),
                   donate_argnames=("pool", "lanes"))
def _decode(params, pool, lanes, stop_tokens, stop_on_finish, *, graphdef, steps, backend,
            sample_below, draw, cut, early_exit):
    """Up to ``steps`` decode steps of every lane; returns ``(pool, lanes, tokens [L, steps]``
    (-1 where nothing was emitted), ``steps done)``. ``early_exit``: a ``while_loop`` that ends
    when every lane is idle, or when one finishes if ``stop_on_finish``; else exactly ``steps``
    steps (a loop of known trip count: no predicate to read back per step)."""
    model = nnx.merge(graphdef, params)
    width = lanes.token.shape[0]
    base = jax.random.key(lanes.seed)

    def step(carry):
        i, pool, lanes, out, finished = carry
        logits, pool = model.step(lanes.token[:, None], pool, backend=backend)
        logits = _penalised(logits[:, 0].astype(jnp.float32), lanes)
        keys = jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(base, r), n))(
            lanes.request, lanes.generated)
        token = sample_logits(logits, keys, lanes.temperature, lanes.top_p, lanes.top_k,
                              sample_below=sample_below, draw=draw, cut=cut)
        stop = jnp.any(token[:, None] == stop_tokens[None, :], axis=-1)
        emitted = lanes.active & ~stop
        generated = lanes.generated + emitted
        done = lanes.active & (stop | (generated >= lanes.max_new))
        out = out.at[:, i].set(jnp.where(emitted, token, -1))
        lanes = _count(lanes, token, emitted)
        lanes = lanes._replace(token=jnp.where(emitted, token, lanes.token),
                               active=lanes.active & ~done, generated=generated)
        return i + 1, pool, lanes, out, finished | jnp.any(done)

    def more(carry):
        i, _, lanes, _, finished = carry
        return (i < steps) & jnp.any(lanes.active) & ~(stop_on_finish & finished)

    carry = (jnp.int32(0), pool, lanes, jnp.full((width, steps), -1, jnp.int32), jnp.bool_(False))
    if early_exit:
        done, pool, lanes, out, _ = jax.lax.while_loop(more, step, carry)
    else:
        done, pool, lanes, out, _ = jax.lax.fori_loop(0, steps, lambda i, c: step(c), carry)
    return pool, lanes, out, done


@functools.partial(jax.jit, static_argnames=("graphdef", "backend"), donate_argnames=("pool",))
def _prefill(params, pool, packed, cu_seqlens, slots, *, graphdef, backend):
    """Run the packed prompts ``packed [1, T]`` (segments ``cu_seqlens [N + 1]``) from zero
    states and write segment ``i``'s final state into slot ``slots[i]`` of every pool (slots
    out of range: segments whose state is dropped, such as the padding)."""
    model = nnx.merge(graphdef, params)
    _, final = model.hidden(packed, backend=backend, cu_seqlens=cu_seqlens)
    return jax.tree.map(lambda pool, rows: pool.at[slots].set(rows, mode="drop"), pool, final)


@functools.partial(jax.jit, donate_argnames=("lanes",))
def _admit(lanes, rows, fields):
    """Lanes ``rows`` (out of range: none) take the values ``fields`` (name -> ``[n]``) of the
    requests they start; their occurrence counts restart."""
    updates = {name: getattr(lanes, name).at[rows].set(value.astype(getattr(lanes, name).dtype),
                                                       mode="drop")
               for name, value in fields.items()}
    return lanes._replace(**updates, counts=lanes.counts.at[rows].set(0.0, mode="drop"),
                          seen=lanes.seen.at[rows].set(False, mode="drop"))


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
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            raise ValueError(f"prompts[{i}] must hold token ids in [0, {vocab_size}) (the model's "
                             f"vocabulary), got {ids[bad[0]]} at position {bad[0]}")
        checked.append(ids.astype(np.int32))
    return checked


def _positive_int(name, value):
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _token_limit(max_new_tokens) -> int:
    """``max_new_tokens`` checked, and as the engine counts it (see :func:`_int32_limit`)."""
    return _int32_limit(_positive_int("max_new_tokens", max_new_tokens))


def _check_sampling(sampling):
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__} "
                        f"{sampling!r}")


def _bucket(n, smallest=16):
    """The padded size of ``n`` (at least ``smallest``): a multiple of an eighth of the power of
    two below it, so that few sizes ever compile and at most 1/8 is padding."""
    n = max(int(n), smallest)
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


class Generator:
    """A generation engine for an :class:`RWKV7LM` or :class:`RWKV6LM`: ``max_batch`` lanes,
    each with a slot of a float32 state pool (lane i, slot i).

    ``steps_per_call``: decode steps per compiled call (the host sees the lanes between calls);
    ``backend``: the step kernels' backend (None: the platform's default); ``prefill_backend``:
    the sequence kernels' backend for prefill; ``sample_below``: sample only ids below it (a
    tokenizer may know fewer ids than the head has outputs); ``prefill_tokens``: the most prompt
    tokens packed into one prefill call (longer prompts go alone); ``early_exit``: a decode call
    ends as soon as every lane is idle (or, while requests wait, when one finishes) instead of
    always running ``steps_per_call`` steps (a loop of fixed length spares the GPU a read-back
    of the loop condition per step; idle lanes then wait for the call's end).

    The engine takes the model's weights when it is built: build a new one after changing them.
    Use :meth:`generate`, or drive it by hand: :meth:`prefill` requests into free lanes, then
    :meth:`decode` until they finish.
    """

    def __init__(self, model, *, max_batch: int = 16, steps_per_call: int = 32, backend=None,
                 prefill_backend=None, sample_below: int | None = None,
                 prefill_tokens: int = 8192, early_exit: bool = True):
        if not isinstance(model, LanguageModel):
            raise TypeError(f"model must be an RWKV7LM or RWKV6LM, got {type(model).__name__}")
        self.model = model
        self.vocab = model.config.vocab_size
        self.max_batch = _positive_int("max_batch", max_batch)
        self.steps_per_call = _positive_int("steps_per_call", steps_per_call)
        self.prefill_tokens = _positive_int("prefill_tokens", prefill_tokens)
        if sample_below is not None and not 1 <= _positive_int("sample_below",
                                                              sample_below) <= self.vocab:
            raise ValueError(f"sample_below must be in [1, {self.vocab}], got {sample_below}")
        self.graphdef, self.params = nnx.split(model)
        self.backend, self.prefill_backend, self.sample_below = (backend, prefill_backend,
                                                                 sample_below)
        self.early_exit = checks.flag("early_exit", early_exit)
        self.pool = model.init_state(self.max_batch)
        self.lanes = None
        self.stop_tokens = jnp.full((8,), -1, jnp.int32)

    # --- lanes -----------------------------------------------------------------------------

    def reset(self, *, penalties: bool = False, seed: int = 0, stop_tokens=()):
        """Every lane idle; ``penalties`` allocates the ``[L, vocab]`` occurrence counts;
        ``seed`` and ``stop_tokens`` (ids that end a request, not emitted) hold for every
        request until the next reset."""
        seed = operator.index(seed)
        # One id: an int, a numpy scalar, a 0-d numpy or jax array.
        if isinstance(stop_tokens, numbers.Integral) or getattr(stop_tokens, "ndim", None) == 0:
            stop_tokens = [stop_tokens]
        stops = sorted({self._token_id("stop_tokens", t) for t in stop_tokens})
        stops = stops + [-1] * (_bucket(len(stops), 8) - len(stops))
        width, vocab = self.max_batch, self.vocab if penalties else 0
        zeros = lambda dtype: jnp.zeros((width,), dtype)
        self.lanes = Lanes(token=zeros(jnp.int32), active=zeros(bool), request=zeros(jnp.int32),
                           generated=zeros(jnp.int32), max_new=zeros(jnp.int32),
                           temperature=zeros(jnp.float32), top_p=zeros(jnp.float32),
                           top_k=zeros(jnp.int32), alpha_frequency=zeros(jnp.float32),
                           alpha_presence=zeros(jnp.float32), alpha_decay=zeros(jnp.float32),
                           counts=jnp.zeros((width, vocab), jnp.float32),
                           seen=jnp.zeros((width, vocab), bool),
                           seed=jnp.asarray(seed % 2**32, jnp.uint32))
        self.stop_tokens = jnp.asarray(stops, jnp.int32)
        self.draw = self.cut = False  # what the lanes' sampling needs (see sample_logits)

    def _token_id(self, name, token):
        try:
            token = operator.index(token)
        except TypeError:
            raise TypeError(f"{name} must hold int token ids, got {token!r}") from None
        if not 0 <= token < self.vocab:
            raise ValueError(f"{name} must hold token ids in [0, {self.vocab}), got {token}")
        return token

    def prefill(self, lanes: Sequence[int], prompts: Sequence, requests: Sequence[int], *,
                max_new_tokens: int, sampling: Sampling = Sampling()) -> int:
        """Start ``requests`` (ids: each one's random stream) in the free ``lanes``: their
        ``prompts`` but the last token go through the sequence mode into the lanes' slots, the
        last token waits for the next :meth:`decode`. Returns the number of tokens prefilled."""
        _check_sampling(sampling)
        if self.lanes is None:
            self.reset(penalties=sampling.penalised)
        if sampling.penalised and self.lanes.counts.shape[1] == 0:
            raise ValueError("penalties (alpha_frequency, alpha_presence) need the occurrence "
                             "counts: reset(penalties=True) first")
        prompts = _check_prompts(list(prompts), self.vocab)
        max_new_tokens = _token_limit(max_new_tokens)
        lanes = [operator.index(lane) for lane in lanes]
        if len(lanes) != len(prompts) or len(requests) != len(prompts):
            raise ValueError(f"lanes, prompts and requests must have one entry per request, got "
                             f"{len(lanes)}, {len(prompts)} and {len(requests)}")
        if len(set(lanes)) != len(lanes) or not all(0 <= x < self.max_batch for x in lanes):
            raise ValueError(f"lanes must be distinct lanes in [0, {self.max_batch}), got {lanes}")
        busy = [lane for lane in lanes if np.asarray(self.lanes.active)[lane]]
        if busy:
            raise ValueError(f"lanes {busy} still serve a request: prefill only free lanes "
                             f"(decode until they finish, or reset())")
        heads = [p[:-1] for p in prompts]
        total = sum(map(len, heads))
        # Segments: one per request, empty ones up to a bucketed count, then the padding up to
        # a bucketed length (so that few shapes compile); the states of all but the requests'
        # segments are dropped (a slot out of range).
        segments = min(_bucket(len(lanes), 1), self.max_batch) + 1
        lengths = np.zeros(segments, np.int64)
        lengths[:len(heads)] = [len(h) for h in heads]
        lengths[-1] = _bucket(total) - total
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        packed = np.zeros((1, int(cu[-1])), np.int32)
        packed[0, :total] = np.concatenate(heads)
        slots = np.full(segments, self.max_batch, np.int32)
        slots[:len(lanes)] = lanes
        self.pool = _prefill(self.params, self.pool, packed, cu, slots,
                             graphdef=self.graphdef, backend=self.prefill_backend)

        drawn = sampling.temperature > 0
        self.draw |= drawn
        self.cut |= drawn and (sampling.top_p < 1 or 0 < sampling.top_k < self.vocab)
        # The lanes' new values in one call, rows padded (dropped) to a bucketed count.
        width = slots.shape[0] - 1
        pad = lambda values: np.concatenate([values, np.zeros(width - len(values),
                                                              np.asarray(values).dtype)])
        fields = dict(token=pad([p[-1] for p in prompts]), active=pad([True] * len(lanes)),
                      request=pad(np.asarray(requests, np.int32)),
                      generated=pad([0] * len(lanes)),
                      max_new=pad([max_new_tokens] * len(lanes)),
                      top_k=pad([_int32_limit(sampling.top_k)] * len(lanes)),
                      **{name: pad([getattr(sampling, name)] * len(lanes))
                         for name in ("temperature", "top_p", "alpha_frequency",
                                      "alpha_presence", "alpha_decay")})
        self.lanes = _admit(self.lanes, slots[:-1], fields)
        return total

    def decode(self, *, stop_on_finish: bool = False):
        """One compiled call of ``steps_per_call`` steps (with ``early_exit``, fewer when every
        lane is idle, or with ``stop_on_finish`` once a lane finishes). Returns ``(tokens,
        active)``: numpy ``[L, steps done]`` sampled tokens (-1 where a lane emitted nothing)
        and ``[L]`` whether each lane still runs."""
        if self.lanes is None:
            raise ValueError("nothing to decode: prefill requests first")
        self.pool, self.lanes, out, done = _decode(
            self.params, self.pool, self.lanes, self.stop_tokens, jnp.bool_(stop_on_finish),
            graphdef=self.graphdef, steps=self.steps_per_call, backend=self.backend,
            sample_below=self.sample_below, draw=self.draw, cut=self.cut,
            early_exit=self.early_exit)
        return np.asarray(out)[:, :int(done)], np.asarray(self.lanes.active)

    # --- the whole loop --------------------------------------------------------------------

    def generate(self, prompts, *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 stop_tokens=(), seed: int = 0, on_tokens=None) -> Generation:
        """Sample up to ``max_new_tokens`` tokens after each prompt (token-id sequences of any
        lengths), ``max_batch`` requests at a time; request ``i``'s random stream is ``(seed,
        i)``. Generation of a request ends at any of ``stop_tokens`` (not included).

        ``on_tokens(i, tokens, finished)``, if given, sees each running request's tokens as
        each decode call ends (the tokens it emitted in that call, whether it finished); a true
        return ends the request there (finish "stop"), freeing its lane, e.g. when its text
        reached a stop string."""
        prompts = _check_prompts(prompts, self.vocab)
        max_new_tokens = _token_limit(max_new_tokens)
        _check_sampling(sampling)
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"on_tokens must be callable or None, got {type(on_tokens).__name__}")
        self.reset(penalties=sampling.penalised, seed=seed, stop_tokens=stop_tokens)
        outputs: list[list[int]] = [[] for _ in prompts]
        finish = [""] * len(prompts)
        serving = [-1] * self.max_batch  # the request in each lane
        waiting = 0
        prefilled = decoded = calls = 0
        prefill_s = decode_s = 0.0
        while True:
            free = [lane for lane, r in enumerate(serving) if r < 0]
            start, budget = [], self.prefill_tokens
            while free and waiting < len(prompts):
                cost = len(prompts[waiting]) - 1
                if start and cost > budget:
                    break
                start.append((free.pop(0), waiting))
                budget -= cost
                waiting += 1
            if start:
                began = time.perf_counter()
                prefilled += self.prefill([lane for lane, _ in start],
                                          [prompts[r] for _, r in start],
                                          [r for _, r in start],
                                          max_new_tokens=max_new_tokens, sampling=sampling)
                jax.block_until_ready(self.pool)
                prefill_s += time.perf_counter() - began
                for lane, r in start:
                    serving[lane] = r
            if all(r < 0 for r in serving):
                break
            began = time.perf_counter()
            tokens, active = self.decode(stop_on_finish=waiting < len(prompts))
            decode_s += time.perf_counter() - began
            calls += 1
            decoded += tokens.shape[1] * sum(r >= 0 for r in serving)
            for lane, r in enumerate(serving):
                if r < 0:
                    continue
                emitted = [int(t) for t in tokens[lane] if t >= 0]
                outputs[r].extend(emitted)
                finished = not active[lane]
                if on_tokens is not None and on_tokens(r, emitted, finished) and not finished:
                    self.lanes = self.lanes._replace(active=self.lanes.active.at[lane].set(False))
                    finished = True
                if finished:
                    finish[r] = "length" if len(outputs[r]) >= max_new_tokens else "stop"
                    serving[lane] = -1
        return Generation(outputs, finish, prefilled, prefill_s, decoded, decode_s, calls)


def generate(model: LanguageModel, prompts, *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, top_k: int = 0, alpha_frequency: float = 0.0,
             alpha_presence: float = 0.0, alpha_decay: float = 1.0, stop_tokens=(),
             batch_size: int | None = None, steps_per_call: int = 32,
             sample_below: int | None = None, seed: int = 0, backend=None,
             prefill_backend=None, early_exit: bool = True) -> Generation:
    """Sample up to ``max_new_tokens`` tokens after each prompt: a :class:`Generator` with
    ``batch_size`` lanes (default: all prompts, at most 16) and its :meth:`Generator.generate`.
    Sampling arguments as in :class:`Sampling` (``temperature=0``: greedy)."""
    sampling = Sampling(temperature, top_p, top_k, alpha_frequency, alpha_presence, alpha_decay)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise TypeError(f"prompts must be a non-empty list of token-id sequences, got "
                        f"{type(prompts).__name__}")
    lanes = min(len(prompts), _positive_int("batch_size", 16 if batch_size is None else batch_size))
    engine = Generator(model, max_batch=lanes, steps_per_call=steps_per_call, backend=backend,
                       prefill_backend=prefill_backend, sample_below=sample_below,
                       early_exit=early_exit)
    return engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                           stop_tokens=stop_tokens, seed=seed)

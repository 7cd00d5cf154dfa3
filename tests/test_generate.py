"""rwkv_jax.nn's generation engine and what it relies on in the model: packed sequence mode
(cu_seqlens) against each prompt alone, token-id checks, guarded state pools in step mode,
bfloat16 parameters, the Generator against step-by-step greedy decoding, continuous batching,
the same engine on RWKV6LM, sampling and penalties, seeds and errors."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import official_rwkv6
import official_rwkv7
from reference import relative_error
from rwkv_jax import nn as rnn

VOCAB = 50
_F32 = np.finfo(np.float32)
PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 8, 7], [3, 3, 4, 1, 2, 6, 7]]


@pytest.fixture(scope="module")
def checkpoint():
    return official_rwkv7.random_checkpoint(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def model(checkpoint):
    return rnn.load_rwkv7(checkpoint)


def _random_state(model, rows, seed):
    keys = iter(jax.random.split(jax.random.key(seed), 3 * model.config.n_layer))
    return jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype),
                        model.init_state(rows))


# --- the model's sequence mode, packed --------------------------------------------------------

@pytest.mark.parametrize("op", ["rwkv7"])
def test_packed_sequence_mode_equals_each_prompt_alone(backend, op, model):
    # Three prompts (one empty) from random initial states: the token shifts must restart at
    # each segment's first token from that segment's row, not from the previous segment.
    prompts = [[4, 9, 1, 0, 33], [], [12, 7, 7]]
    cu = np.cumsum([0] + [len(p) for p in prompts]).astype(np.int32)
    packed = np.concatenate([np.asarray(p, np.int32) for p in prompts])[None]
    initial = _random_state(model, len(prompts), 1)
    logits, final = model(packed, initial, cu_seqlens=cu, return_state=True, backend=backend)
    for i, prompt in enumerate(prompts):
        row = jax.tree.map(lambda x: x[i:i + 1], initial)
        got = jax.tree.map(lambda x: x[i:i + 1], final)
        if not prompt:  # an empty segment keeps its initial state
            for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(row)):
                np.testing.assert_array_equal(g, want)
            continue
        want_logits, want = model(np.asarray([prompt], np.int32), row, return_state=True,
                                  backend=backend)
        assert relative_error(logits[:, cu[i]:cu[i + 1]], want_logits) < 1e-4
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert relative_error(g, w) < 1e-4
    with pytest.raises(ValueError, match="one row per segment of cu_seqlens"):
        model(packed, model.init_state(1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T=8"):
        model(packed, cu_seqlens=np.array([0, 3, 7], np.int32))


# --- token ids and state pools ----------------------------------------------------------------

def test_token_ids_outside_the_vocabulary_are_errors(model):
    pool = model.init_state(2)
    for bad, where in (([[1, 2], [-1, 3]], r"tokens\[1, 0\] = -1"),
                       ([[1, VOCAB], [0, 3]], rf"tokens\[0, 1\] = {VOCAB}")):
        with pytest.raises(ValueError, match=rf"ids in \[0, {VOCAB}\).*{where}"):
            model(np.asarray(bad, np.int32))
        with pytest.raises(ValueError, match=where):
            model.step(np.asarray(bad, np.int32), pool)
    # Traced ids cannot be checked: an id outside the vocabulary gives NaN, not another token.
    logits = nnx.jit(lambda m, t: m(t))(model, np.array([[1, 2], [3, -1]], np.int32))
    assert np.all(np.isfinite(logits[0])) and np.all(np.isfinite(logits[1, 0]))
    assert np.all(np.isnan(logits[1, 1]))


def test_step_with_invalid_traced_indices_touches_no_other_slot(model):
    pool = _random_state(model, 4, 2)
    step = nnx.jit(lambda m, t, p, i: m.step(t, p, state_indices=i))
    tokens = np.array([[5], [6]], np.int32)
    # -1 must not wrap to slot 3; a slot named twice must not be updated at all.
    for indices, untouched in (([-1, 1], [0, 2, 3]), ([2, 2], [0, 1, 3]), ([0, 9], [1, 2, 3])):
        logits, new = step(model, tokens, jax.tree.map(jnp.copy, pool),
                           np.asarray(indices, np.int32))
        for old, got in zip(jax.tree.leaves(pool), jax.tree.leaves(new)):
            np.testing.assert_array_equal(got[np.array(untouched)], old[np.array(untouched)])
        valid = [i for i, x in enumerate(indices) if 0 <= x < 4 and indices.count(x) == 1]
        for row in range(2):
            assert np.all(np.isnan(logits[row])) == (row not in valid)


def test_channel_mix_step_checks_its_indices(model):
    ffn = model.blocks[0].ffn
    x = jnp.ones((2, 1, 32))
    with pytest.raises(ValueError, match=r"state_indices must be in \[0, 2\)"):
        ffn.step(x, jnp.zeros((2, 32)), state_indices=np.array([0, 2]))
    with pytest.raises(ValueError, match="state_indices must be distinct"):
        ffn.step(x, jnp.zeros((2, 32)), state_indices=np.array([1, 1]))
    with pytest.raises(ValueError, match=r"token-shift pool must be float32 \[S, 32\]"):
        ffn.step(x, jnp.zeros((2, 31)))
    y, pool = ffn.step(x, jnp.zeros((3, 32)), state_indices=np.array([2, 0]))
    np.testing.assert_array_equal(pool[1], 0.0)
    np.testing.assert_array_equal(pool[np.array([2, 0])], x[:, 0])


# --- bfloat16 parameters ----------------------------------------------------------------------

def test_bfloat16_parameters_construct_train_and_load(checkpoint):
    cfg = rnn.rwkv7_config(checkpoint)
    model = rnn.RWKV7LM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.bfloat16 for p in params)
    # The low-rank up-projections are still orthogonal (scaled by 0.1) after the cast.
    up = np.asarray(model.blocks[1].att.w2[...], np.float32)
    np.testing.assert_allclose(up @ up.T, 0.01 * np.eye(up.shape[0]), atol=1e-3)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 6)).astype(np.int32)

    @nnx.jit
    def train_step(model):
        def loss(model):
            logits = model(tokens[:, :-1]).astype(jnp.float32)
            return jnp.mean(jax.nn.logsumexp(logits, -1)
                            - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
        value, grads = nnx.value_and_grad(loss)(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g.astype(p.dtype),
                                       nnx.state(model, nnx.Param), grads))
        return value

    first, second = float(train_step(model)), float(train_step(model))
    assert np.isfinite(first) and np.isfinite(second)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # A checkpoint loads in bfloat16; the state pool stays float32.
    loaded = rnn.load_rwkv7(checkpoint, param_dtype=jnp.bfloat16)
    assert loaded.blocks[0].att.key.kernel[...].dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded.init_state(2)))
    want = official_rwkv7.forward(checkpoint, tokens)
    assert relative_error(loaded(tokens), want) < 2e-2


# --- the engine -------------------------------------------------------------------------------

def _greedy_by_steps(model, prompt, count, below=VOCAB, stop=()):
    """Greedy decoding one token per model.step call from a zero state (the reference)."""
    pool = model.init_state(1)
    logits = None
    for token in prompt:
        logits, pool = model.step(np.array([[token]], np.int32), pool)
    out = []
    for _ in range(count):
        token = int(np.argmax(np.asarray(logits[0, -1])[:below]))
        if token in stop:
            break
        out.append(token)
        logits, pool = model.step(np.array([[token]], np.int32), pool)
    return out


@pytest.mark.parametrize("op", ["rwkv7_step"])
def test_generator_greedy_equals_step_by_step_decoding(backend, op, model):
    # Two lanes for four prompts of different lengths, three steps per call: requests start in
    # the lanes others leave, and calls end in the middle of requests.
    # Both loop forms: ending a call early, or always steps_per_call steps.
    for early_exit in (True, False):
        engine = rnn.Generator(model, max_batch=2, steps_per_call=3, backend=backend,
                               early_exit=early_exit)
        result = engine.generate(PROMPTS, max_new_tokens=5, sampling=rnn.Sampling(temperature=0))
        for prompt, tokens in zip(PROMPTS, result.tokens):
            assert tokens == _greedy_by_steps(model, prompt, 5)
        assert result.finish == ["length"] * 4
        assert result.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)
        assert result.decode_tokens >= sum(map(len, result.tokens))


def test_prefill_states_equal_stepping_token_by_token(model):
    engine = rnn.Generator(model, max_batch=3)
    prompts = [PROMPTS[3], PROMPTS[1], PROMPTS[0]]  # 7, 1 and 5 tokens into lanes 2, 0, 1
    engine.prefill([2, 0, 1], prompts, [0, 1, 2], max_new_tokens=1)
    for lane, prompt in zip([2, 0, 1], prompts):
        pool = model.init_state(1)
        for token in prompt[:-1]:
            _, pool = model.step(np.array([[token]], np.int32), pool)
        for got, want in zip(jax.tree.leaves(engine.pool), jax.tree.leaves(pool)):
            assert relative_error(got[lane], want[0]) < 1e-5
    np.testing.assert_array_equal(engine.lanes.token, [PROMPTS[1][-1], PROMPTS[0][-1],
                                                       PROMPTS[3][-1]])
    # Refilling lane 0 alone overwrites its slot (from zeros) and leaves the others as they were.
    before = jax.tree.map(np.asarray, engine.pool)
    engine.reset()  # every lane idle; the pool as it was
    engine.prefill([0], [PROMPTS[2]], [3], max_new_tokens=1)
    pool = model.init_state(1)
    for token in PROMPTS[2][:-1]:
        _, pool = model.step(np.array([[token]], np.int32), pool)
    for got, old, want in zip(jax.tree.leaves(engine.pool), jax.tree.leaves(before),
                              jax.tree.leaves(pool)):
        assert relative_error(got[0], want[0]) < 1e-5
        np.testing.assert_array_equal(got[1:], old[1:])


# --- the engine on RWKV-6 ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def rwkv6_model():
    return rnn.load_rwkv6(official_rwkv6.random_checkpoint(0, vocab_size=VOCAB))


def _greedy_by_forward(model, prompts, count):
    """Greedy decoding by the sequence mode over each whole text so far (the reference): all
    prompts as rows of one padded batch of fixed length (one compile), the logits read at each
    row's last real token (the model is causal: the padding after it changes nothing)."""
    texts = [list(p) for p in prompts]
    width = max(map(len, texts)) + count
    for _ in range(count):
        batch = np.zeros((len(texts), width), np.int32)
        for row, text in enumerate(texts):
            batch[row, :len(text)] = text
        logits = np.asarray(model(batch))
        for row, text in enumerate(texts):
            text.append(int(np.argmax(logits[row, len(text) - 1])))
    return [text[len(p):] for text, p in zip(texts, prompts)]


@pytest.mark.parametrize("op", ["rwkv6_step"])
def test_generator_on_rwkv6_greedy_equals_an_argmax_loop(backend, op, rwkv6_model):
    # Four prompts of different lengths through two lanes, three steps per call: prefill
    # through the packed sequence mode, continuous batching on the pool, rwkv6_step decoding.
    engine = rnn.Generator(rwkv6_model, max_batch=2, steps_per_call=3, backend=backend)
    result = engine.generate(PROMPTS, max_new_tokens=5, sampling=rnn.Sampling(temperature=0))
    assert result.tokens == _greedy_by_forward(rwkv6_model, PROMPTS, 5)
    assert result.finish == ["length"] * 4
    assert result.prefill_tokens == sum(len(p) - 1 for p in PROMPTS)


def test_rwkv6_prefill_states_equal_sequence_mode(rwkv6_model):
    model = rwkv6_model
    engine = rnn.Generator(model, max_batch=4)
    prompts = [PROMPTS[3], PROMPTS[1], PROMPTS[0], PROMPTS[2]]  # 7, 1, 5 and 3 tokens
    lanes = [2, 0, 3, 1]
    engine.prefill(lanes, prompts, [0, 1, 2, 3], max_new_tokens=1)
    for lane, prompt in zip(lanes, prompts):
        if len(prompt) == 1:  # nothing to prefill: the slot stays zero
            assert not any(np.any(pool[lane]) for pool in jax.tree.leaves(engine.pool))
            continue
        _, want = model(np.asarray([prompt[:-1]], np.int32), return_state=True)
        for got, w in zip(jax.tree.leaves(engine.pool), jax.tree.leaves(want)):
            assert relative_error(got[lane], w[0]) < 1e-5
    last = dict(zip(lanes, (p[-1] for p in prompts)))
    np.testing.assert_array_equal(engine.lanes.token, [last[lane] for lane in range(4)])


def test_continuous_batching_with_stop_tokens_and_an_immediate_stop(model):
    # The crash: a request whose first sampled token is a stop token while another
    # lane still runs.
    first = _greedy_by_steps(model, PROMPTS[0], 1)[0]
    stop = {first}
    result = rnn.generate(model, PROMPTS, max_new_tokens=6, temperature=0, batch_size=2,
                          stop_tokens=stop, steps_per_call=4)
    one_id = rnn.generate(model, PROMPTS, max_new_tokens=6, temperature=0, batch_size=2,
                          stop_tokens=np.int64(first), steps_per_call=4)
    assert one_id.tokens == result.tokens
    assert result.tokens[0] == [] and result.finish[0] == "stop"
    for prompt, tokens, finish in zip(PROMPTS, result.tokens, result.finish):
        want = _greedy_by_steps(model, prompt, 6, stop=stop)
        assert tokens == want
        assert finish == ("length" if len(want) == 6 else "stop")
    # Different lengths finish at different times; the sample_below mask holds throughout.
    limited = rnn.generate(model, PROMPTS, max_new_tokens=4, temperature=0, batch_size=3,
                           sample_below=10)
    for prompt, tokens in zip(PROMPTS, limited.tokens):
        assert tokens == _greedy_by_steps(model, prompt, 4, below=10)


def test_same_seed_same_tokens_whatever_the_batch(model):
    sampling = dict(temperature=1.3, top_p=0.9, top_k=20, alpha_frequency=0.3,
                    alpha_presence=0.2, alpha_decay=0.99)
    runs = [rnn.generate(model, PROMPTS, max_new_tokens=7, batch_size=lanes,
                         steps_per_call=steps, seed=11, **sampling).tokens
            for lanes, steps in ((4, 8), (1, 3), (3, 2))]
    fixed = rnn.generate(model, PROMPTS, max_new_tokens=7, batch_size=2, steps_per_call=5,
                         seed=11, early_exit=False, **sampling).tokens
    assert runs[0] == runs[1] == runs[2] == fixed
    assert all(len(t) == 7 for t in runs[0])
    # A request's tokens depend on its id and the seed only, not on its neighbours.
    alone = rnn.generate(model, PROMPTS[:2], max_new_tokens=7, seed=11, **sampling).tokens
    assert alone == runs[0][:2]
    other = rnn.generate(model, PROMPTS, max_new_tokens=7, seed=12, **sampling).tokens
    assert other != runs[0]


def test_penalties_follow_the_official_pipeline(model):
    # Greedy with the official penalties, restated on the host: logits of tokens generated so
    # far lose alpha_presence + alpha_frequency * count; counts decay by alpha_decay per token.
    presence, frequency, decay = 0.5, 0.8, 0.9
    result = rnn.generate(model, PROMPTS[:2], max_new_tokens=8, temperature=0,
                          alpha_presence=presence, alpha_frequency=frequency, alpha_decay=decay)
    for prompt, tokens in zip(PROMPTS[:2], result.tokens):
        pool = model.init_state(1)
        for token in prompt:
            logits, pool = model.step(np.array([[token]], np.int32), pool)
        counts, want = {}, []
        for _ in range(8):
            out = np.asarray(logits[0, -1], np.float64).copy()
            for t, n in counts.items():
                out[t] -= presence + n * frequency
            token = int(np.argmax(out))
            want.append(token)
            counts = {t: n * decay for t, n in counts.items()}
            counts[token] = counts.get(token, 0.0) + 1
            logits, pool = model.step(np.array([[token]], np.int32), pool)
        assert tokens == want
    plain = rnn.generate(model, PROMPTS[:2], max_new_tokens=8, temperature=0)
    assert plain.tokens != result.tokens


def test_sample_logits_follows_the_official_sampler():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
    keys = jax.random.split(jax.random.key(0), 4000)
    # top_p = 0.7: the two most likely tokens (0.5 + 0.3 reach it), renormalised to 5/8, 3/8.
    drawn = np.asarray(rnn.sample_logits(logits, keys, 1.0, 0.7))
    assert set(drawn) == {0, 1} and abs(np.mean(drawn == 0) - 0.625) < 0.03
    drawn = np.asarray(rnn.sample_logits(logits, keys, 1.0, 1.0))
    assert set(drawn) == {0, 1, 2, 3} and abs(np.mean(drawn == 3) - 0.05) < 0.015
    # top_k = 3 then temperature 0.5: probs ** 2 over the three kept, 25 : 9 : 2.25.
    drawn = np.asarray(rnn.sample_logits(logits, keys, 0.5, 1.0, 3))
    assert set(drawn) == {0, 1, 2} and abs(np.mean(drawn == 0) - 25 / 36.25) < 0.03
    assert set(np.asarray(rnn.sample_logits(logits, keys, 0.0, 1.0))) == {0}  # greedy
    assert set(np.asarray(rnn.sample_logits(logits, keys, 1.0, 0.0))) == {0}  # official top_p=0


def test_generate_errors_name_the_argument(model):
    cases = [
        (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\] must be a non-empty 1-D"),
        (dict(prompts=[[1, 2], [1, VOCAB]]), ValueError,
         rf"prompts\[1\] must hold token ids in \[0, 50\).*got {VOCAB} at position 1"),
        (dict(prompts=[[-1]]), ValueError, r"prompts\[0\] .*got -1 at position 0"),
        (dict(prompts="hello"), TypeError, "prompts must be a non-empty list"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
        (dict(temperature=-1.0), ValueError, "temperature must be >= 0"),
        (dict(temperature="hot"), TypeError, "temperature must be a number"),
        (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \[0, 1\]"),
        (dict(top_k=-1), ValueError, "top_k must be >= 0"),
        (dict(top_k=2.5), TypeError, "top_k must be an int"),
        (dict(alpha_decay=2.0), ValueError, r"alpha_decay must be in \[0, 1\]"),
        (dict(sample_below=VOCAB + 1), ValueError, r"sample_below must be in \[1, 50\]"),
        (dict(stop_tokens=[VOCAB]), ValueError, r"stop_tokens must hold token ids in \[0, 50\)"),
        (dict(batch_size=0), ValueError, "batch_size must be >= 1"),
        (dict(steps_per_call=0), ValueError, "steps_per_call must be >= 1"),
    ]
    for change, error, message in cases:
        kwargs = {"prompts": [[1, 2]], "max_new_tokens": 2, **change}
        with pytest.raises(error, match=message):
            rnn.generate(model, kwargs.pop("prompts"), **kwargs)
    engine = rnn.Generator(model, max_batch=2)
    engine.prefill([1], [[1, 2]], [0], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"lanes \[1\] still serve a request"):
        engine.prefill([0, 1], [[1], [2]], [1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"penalties .* need the occurrence counts"):
        engine.prefill([0], [[1]], [1], max_new_tokens=3,
                       sampling=rnn.Sampling(alpha_presence=0.5))
    # numpy scalars are numbers.
    result = rnn.generate(model, [[1, 2]], max_new_tokens=np.int64(2), temperature=np.float32(0),
                          top_p=np.float64(0.5), top_k=np.int32(3))
    assert result.tokens == [_greedy_by_steps(model, [1, 2], 2)]


def _stopping_greedy_run(model, prompt):
    """(a stop token that greedy decoding of ``prompt`` reaches within 4 tokens, the tokens
    before it)."""
    stop = _greedy_by_steps(model, prompt, 4)[3]
    return stop, _greedy_by_steps(model, prompt, 4, stop={stop})


def test_token_limits_beyond_int32_mean_no_limit(model):
    # The engine counts in int32: larger limits are clamped to the largest int32, never
    # wrapped (2**32 + 3 once gave 3 tokens and finish "stop").
    stop, want = _stopping_greedy_run(model, PROMPTS[0])
    for limit in (2**31, 2**32 + 3, sys.maxsize):
        result = rnn.generate(model, [PROMPTS[0]], max_new_tokens=limit, temperature=0,
                              stop_tokens=[stop])
        assert result.tokens == [want] and result.finish == ["stop"]
    cut = rnn.generate(model, [PROMPTS[0]], max_new_tokens=len(want), temperature=0)
    assert cut.tokens == [want] and cut.finish == ["length"]
    engine = rnn.Generator(model, max_batch=1)
    engine.prefill([0], [PROMPTS[0]], [0], max_new_tokens=2**40)
    assert int(engine.lanes.max_new[0]) == np.iinfo(np.int32).max


def test_top_k_at_or_beyond_the_vocabulary_cuts_nothing(model):
    sampling = dict(max_new_tokens=5, temperature=1.0, seed=3)
    for top_p in (1.0, 0.9):  # without and with the cut compiled in
        want = rnn.generate(model, PROMPTS[:2], top_p=top_p, top_k=0, **sampling).tokens
        for top_k in (VOCAB, 2**32 + 1):
            assert rnn.generate(model, PROMPTS[:2], top_p=top_p, top_k=top_k,
                                **sampling).tokens == want
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((64, VOCAB)), jnp.float32)
    keys = jax.random.split(jax.random.key(1), 64)
    want = rnn.sample_logits(logits, keys, 1.0, 1.0, 0)
    np.testing.assert_array_equal(rnn.sample_logits(logits, keys, 1.0, 1.0, 2**32 + 1), want)


def test_masked_ids_never_come_out_at_float32_edges(model):
    vocab, rows, below, top_k = 24, 256, 4, 2
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    # Masked ids with the most tempting logits a float32 holds, and NaN.
    logits[:, below:] = rng.choice([np.inf, 1e38, np.nan, -np.inf], (rows, vocab - below))
    logits[:3, 1] = [np.inf, -np.inf, np.nan]  # an allowed id at the edges too
    top2 = np.argsort(-np.nan_to_num(logits[:, :below], nan=-np.inf, posinf=3.4e38), axis=1)
    keys = jax.random.split(jax.random.key(0), rows)
    for temperature in (1e38, _F32.max, _F32.tiny, 1e-30, 1.0):
        drawn = np.asarray(rnn.sample_logits(jnp.asarray(logits), keys, temperature, 1.0, top_k,
                                             sample_below=below))
        assert np.all(drawn < below), temperature
        rest = slice(3, None)  # rows without an infinite or NaN allowed logit
        assert np.all((drawn[rest] == top2[rest, 0]) | (drawn[rest] == top2[rest, 1]))
        nucleus = np.asarray(rnn.sample_logits(jnp.asarray(logits), keys, temperature, 0.5,
                                               sample_below=below))
        assert np.all(nucleus < below)
    greedy = np.asarray(rnn.sample_logits(jnp.asarray(logits), keys, 0.0, 1.0,
                                          sample_below=below, draw=False))
    assert np.all(greedy < below)
    # The engine: huge temperatures and penalties of both signs keep to sample_below.
    for extreme in (dict(temperature=1e38, top_k=top_k),
                    dict(temperature=1.0, alpha_presence=3e38, alpha_frequency=-3e38),
                    dict(temperature=0.0, alpha_presence=-3e38, alpha_frequency=3e38)):
        result = rnn.generate(model, PROMPTS[:2], max_new_tokens=6, sample_below=below,
                              **extreme)
        assert all(0 <= t < below for tokens in result.tokens for t in tokens), extreme
    # Values a float32 sampler cannot use are refused.
    for bad, message in ((dict(temperature=1e39), "temperature must be finite in float32"),
                         (dict(temperature=1e-40), "temperature must be 0 .greedy. or >="),
                         (dict(alpha_presence=-1e39), "alpha_presence must be finite in float32"),
                         (dict(alpha_frequency=float("inf")), "alpha_frequency must be finite")):
        with pytest.raises(ValueError, match=message):
            rnn.Sampling(**bad)


def test_entry_points_taking_a_sampling_refuse_anything_else(model):
    engine = rnn.Generator(model, max_batch=1)
    for call in (lambda: engine.prefill([0], [[1, 2]], [0], max_new_tokens=2, sampling=None),
                 lambda: engine.generate([[1, 2]], max_new_tokens=2, sampling=dict(top_k=2))):
        with pytest.raises(TypeError, match="sampling must be a Sampling, got"):
            call()


def test_one_stop_token_in_a_0d_array_is_one_id(model):
    stop, want = _stopping_greedy_run(model, PROMPTS[0])
    for one in (np.array(stop), jnp.asarray(stop), np.int32(stop), stop):
        result = rnn.generate(model, [PROMPTS[0]], max_new_tokens=8, temperature=0,
                              stop_tokens=one)
        assert result.tokens == [want] and result.finish == ["stop"]
    with pytest.raises(TypeError, match="stop_tokens must hold int token ids"):
        rnn.generate(model, [PROMPTS[0]], max_new_tokens=2, stop_tokens=np.array(1.5))

"""rwkv_jax.nn: the Flax layers and language models against float64 numpy restatements of the
official models (tests/official_rwkv7.py, tests/official_rwkv6.py), sequence mode against step
mode, checkpoint files, errors, the Linen wrappers and the training example."""

import importlib.util
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import official_rwkv6
from reference import relative_error
import official_rwkv7
import rwkv_jax
from conftest import tolerance
from rwkv_jax import nn as rnn
from rwkv_jax.nn import linen

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB, TOKENS_SHAPE = 50, (2, 9)
CHECKPOINT_SUFFIXES = [".npz", ".safetensors", ".pth"]


def model_tolerance(backend):
    # Logits go through every layer, so allow the kernel's float32 error, at least 1e-4.
    return max(1e-4, tolerance(backend, np.float32, "forward"))


@pytest.fixture(scope="module")
def checkpoint():
    return official_rwkv7.random_checkpoint(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(0, VOCAB, TOKENS_SHAPE).astype(np.int32)


@pytest.fixture(scope="module")
def reference_logits(checkpoint, tokens):
    return official_rwkv7.forward(checkpoint, tokens)


@pytest.fixture(scope="module")
def model(checkpoint):
    return rnn.load_rwkv7(checkpoint)


# --- RWKV-7 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["rwkv7"])
def test_rwkv7_lm_matches_official_reference(backend, op, model, tokens, reference_logits):
    logits = model(tokens, backend=backend)
    assert logits.shape == TOKENS_SHAPE + (VOCAB,) and logits.dtype == jnp.float32
    assert relative_error(logits, reference_logits) < model_tolerance(backend)


def check_step_mode_equals_sequence_mode(model, tokens, reference_logits, backend):
    """Prefill 4 tokens in sequence mode, then one step of 3 tokens and two single-token steps,
    on slots 3 and 1 of a pool of 4 whose other slots must stay untouched; then token by token
    from a zero state without state_indices."""
    slots = jnp.array([3, 1])
    prefill, state = model(tokens[:, :4], return_state=True)
    pool = jax.tree.map(lambda p, s: p.at[slots].set(s), model.init_state(4), state)
    pieces = [prefill]
    for start, stop in ((4, 7), (7, 8), (8, 9)):
        logits, pool = model.step(tokens[:, start:stop], pool, state_indices=slots,
                                  backend=backend)
        pieces.append(logits)
    assert relative_error(jnp.concatenate(pieces, 1), reference_logits) < model_tolerance(backend)
    for leaf in jax.tree.leaves(pool):
        assert not np.any(leaf[jnp.array([0, 2])])

    # The sequence mode's final state is the one the steps reached.
    _, full_state = model(tokens, return_state=True)
    for got, want in zip(jax.tree.leaves(full_state), jax.tree.leaves(pool)):
        assert relative_error(got, want[slots]) < 1e-5

    state, pieces = model.init_state(tokens.shape[0]), []
    for t in range(tokens.shape[1]):
        logits, state = model.step(tokens[:, t:t + 1], state, backend=backend)
        pieces.append(logits)
    assert relative_error(jnp.concatenate(pieces, 1), reference_logits) < model_tolerance(backend)


@pytest.mark.parametrize("op", ["rwkv7_step"])
def test_rwkv7_step_mode_equals_sequence_mode(backend, op, model, tokens, reference_logits):
    check_step_mode_equals_sequence_mode(model, tokens, reference_logits, backend)


def test_rwkv7_layers_compose_to_the_lm(model, tokens, reference_logits):
    """The block and layer modules used on their own give the LM's logits, and their step
    modes (token by token from zero pools, no state_indices) their sequence modes."""
    x = model.emb(tokens)
    v_first = None
    for block in model.blocks:
        x, v_first, _ = block(x, v_first)
    assert relative_error(model.head(model.ln_out(x)), reference_logits) < 1e-4

    block = model.blocks[1]
    x, v_first = (jax.random.normal(key, (2, 9, 32)) for key in jax.random.split(jax.random.key(0)))
    y_att, _, att_state = block.att(x, v_first)
    y_ffn, ffn_shift = block.ffn(x)
    att_pool = rnn.TimeMixState(jnp.zeros((2, 32)), jnp.zeros((2, 2, 16, 16)))
    ffn_pool = jnp.zeros((2, 32))
    steps_att, steps_ffn = [], []
    for t in range(9):
        y, _, att_pool = block.att.step(x[:, t:t + 1], v_first[:, t:t + 1], att_pool)
        steps_att.append(y)
        y, ffn_pool = block.ffn.step(x[:, t:t + 1], ffn_pool)
        steps_ffn.append(y)
    assert relative_error(jnp.concatenate(steps_att, 1), y_att) < 1e-5
    assert relative_error(jnp.concatenate(steps_ffn, 1), y_ffn) < 1e-5
    assert relative_error(att_pool.wkv, att_state.wkv) < 1e-5
    np.testing.assert_array_equal(ffn_pool, ffn_shift)


def test_rwkv7_through_shard_and_jit(model, tokens, reference_logits):
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    wkv_op = rwkv_jax.shard(rwkv_jax.rwkv7, mesh, batch_axis="data")
    logits = nnx.jit(lambda m, t: m(t, wkv_op=wkv_op))(model, tokens)
    assert relative_error(logits, reference_logits) < 1e-4


def test_rwkv7_bfloat16_compute(checkpoint, tokens, reference_logits):
    model = rnn.load_rwkv7(checkpoint, dtype=jnp.bfloat16)
    assert model.blocks[0].att.w1.get_value().dtype == jnp.float32
    logits = model(tokens)
    assert logits.dtype == jnp.bfloat16
    assert relative_error(logits, reference_logits) < 5e-2


def test_rwkv7_gradients_are_finite_and_reach_every_parameter(model, tokens):
    @nnx.jit
    def grads(model):
        def loss(model):
            logits = model(tokens[:, :-1])
            return jnp.mean(jax.nn.logsumexp(logits, -1)
                            - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
        return nnx.grad(loss)(model)

    for path, g in jax.tree.leaves_with_path(nnx.state(grads(model), nnx.Param)):
        g = np.asarray(g)
        assert np.all(np.isfinite(g)) and np.any(g != 0), jax.tree_util.keystr(path)


def test_rwkv7_fresh_model_runs_both_modes(tokens):
    defaults = rnn.RWKV7Config(vocab_size=20, n_embd=32, n_layer=2, head_size=16)
    assert (defaults.dim_ffn, defaults.decay_lora, defaults.v_lora, defaults.gate_lora) == (
        128, 32, 32, 32)
    # The test checkpoint's sizes, so that the compiled shapes are shared with other tests.
    cfg = rnn.RWKV7Config(vocab_size=VOCAB, n_embd=32, n_layer=2, head_size=16, decay_lora=8,
                          a_lora=8, v_lora=4, gate_lora=12)
    model = rnn.RWKV7LM(cfg, rngs=nnx.Rngs(0))
    logits = model(tokens)
    stepped, _ = model.step(tokens, model.init_state(2))
    assert logits.shape == TOKENS_SHAPE + (VOCAB,)
    assert relative_error(stepped, logits) < 1e-5


def test_an_empty_batch_gives_empty_results(model, rwkv6_layer):
    logits = model(jnp.zeros((0, 3), jnp.int32))
    assert logits.shape == (0, 3, VOCAB)
    pool = jax.tree.map(lambda x: x + 1.5, model.init_state(2))
    stepped, after = model.step(jnp.zeros((0, 1), jnp.int32), pool)
    assert stepped.shape == (0, 1, VOCAB)
    for got, was in zip(jax.tree.leaves(after), jax.tree.leaves(pool)):
        np.testing.assert_array_equal(got, was)  # no slot served: the pool is unchanged
    att, ffn = rnn.load_rwkv6_layer(rwkv6_layer[0], 1)
    y, state = att(jnp.zeros((0, 3, 32)))
    assert y.shape == (0, 3, 32) and state.wkv.shape == (0, 2, 16, 16)
    y, _ = att.step(jnp.zeros((0, 1, 32)), rnn.TimeMixState(jnp.ones((2, 32)),
                                                            jnp.ones((2, 2, 16, 16))))
    assert y.shape == (0, 1, 32)
    assert ffn(jnp.zeros((0, 3, 32)))[0].shape == (0, 3, 32)


# --- checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", CHECKPOINT_SUFFIXES)
def test_checkpoint_files_round_trip(tmp_path, suffix, checkpoint, model, tokens):
    path = tmp_path / f"model{suffix}"
    official_rwkv7.write_checkpoint(path, checkpoint)
    loaded = rnn.load_rwkv7(path)
    exported = rnn.rwkv7_state_dict(loaded)
    # Everything comes back, except layer 0's unused value-residual LoRA.
    assert set(checkpoint) - set(exported) == {"blocks.0.att.v0", "blocks.0.att.v1",
                                               "blocks.0.att.v2"}
    for name, value in exported.items():
        np.testing.assert_array_equal(value, checkpoint[name], err_msg=name)
    np.testing.assert_array_equal(loaded(tokens), model(tokens))


def test_state_dict_arrays_are_c_contiguous_and_writable(model, checkpoint):
    exported = rnn.rwkv7_state_dict(model)
    for name, value in exported.items():
        assert value.flags.c_contiguous and value.flags.writeable and value.flags.owndata, name
        assert value.dtype == np.float32, name
    value = exported["blocks.0.att.key.weight"]
    value += 1.0  # its own memory: the model is untouched
    np.testing.assert_array_equal(rnn.rwkv7_state_dict(model)["blocks.0.att.key.weight"],
                                  checkpoint["blocks.0.att.key.weight"])


@pytest.mark.parametrize("suffix", CHECKPOINT_SUFFIXES)
def test_save_rwkv7_round_trip_gives_identical_logits(tmp_path, suffix, model, tokens):
    path = tmp_path / f"saved{suffix}"
    rnn.save_rwkv7(model, path)
    assert path.exists()  # under its own name (np.savez would add a second ".npz")
    np.testing.assert_array_equal(rnn.load_rwkv7(path)(tokens), model(tokens))


def test_state_dict_written_by_safetensors_loads_right(tmp_path, model, tokens, reference_logits):
    # The case: a writer that takes the buffers as they lie in memory.
    from safetensors.numpy import save_file
    path = tmp_path / "plain.safetensors"
    save_file(rnn.rwkv7_state_dict(model), str(path))
    logits = rnn.load_rwkv7(path)(tokens)
    np.testing.assert_array_equal(logits, model(tokens))
    assert relative_error(logits, reference_logits) < 1e-4


def test_save_rwkv7_errors(tmp_path, model):
    with pytest.raises(ValueError, match=r"path must end in \.pth, \.pt, \.safetensors or \.npz"):
        rnn.save_rwkv7(model, tmp_path / "model.bin")
    with pytest.raises(TypeError, match="model must be an RWKV7LM"):
        rnn.save_rwkv7({"emb.weight": np.ones((2, 2))}, tmp_path / "model.npz")


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_checkpoint_bfloat16_and_flat_vectors(tmp_path, suffix, checkpoint, tokens):
    # bf16 tensors (as released models are) and [C] instead of [1, 1, C] per-channel vectors.
    arrays = {n: (v.reshape(-1) if v.shape[:2] == (1, 1) else v).astype(jnp.bfloat16)
              for n, v in checkpoint.items()}
    path = tmp_path / f"bf16{suffix}"
    official_rwkv7.write_checkpoint(path, arrays)
    rounded = {n: v.astype(jnp.bfloat16).astype(np.float32) for n, v in checkpoint.items()}
    logits = rnn.load_rwkv7(path)(tokens)
    assert relative_error(logits, official_rwkv7.forward(rounded, tokens)) < 1e-4


def test_checkpoint_without_layer0_value_lora(tokens):
    params = official_rwkv7.random_checkpoint(3, vocab_size=VOCAB, n_layer=1,
                                              layer0_value_lora=False)
    model = rnn.load_rwkv7(params)
    assert model.config.n_layer == 1
    assert relative_error(model(tokens), official_rwkv7.forward(params, tokens)) < 1e-4


def test_config_is_inferred_from_shapes(checkpoint):
    cfg = rnn.rwkv7_config(checkpoint)
    assert cfg == rnn.RWKV7Config(vocab_size=VOCAB, n_embd=32, n_layer=2, head_size=16,
                                  dim_ffn=128, decay_lora=8, a_lora=8, v_lora=4, gate_lora=12)


@pytest.mark.parametrize("change, message", [
    (lambda p: p.pop("blocks.1.att.k_a"), r"missing \['blocks\.1\.att\.k_a'\]"),
    (lambda p: p.update({"blocks.1.att.extra": np.ones(3, np.float32)}),
     r"unknown \['blocks\.1\.att\.extra'\]"),
    (lambda p: p.update({"blocks.1.att.w2": np.ones((8, 31), np.float32)}),
     r"blocks\.1\.att\.w2 must have shape \(8, 32\) \[D_decay=8, C=32\].*got \(8, 31\)"),
    (lambda p: p.update({"blocks.0.att.receptance.weight": np.ones((32, 16), np.float32)}),
     r"blocks\.0\.att\.receptance\.weight must have shape \(32, 32\).*got \(32, 16\)"),
    (lambda p: p.update({"head.weight": np.ones((49, 32), np.float32)}),
     r"head\.weight must have shape \(50, 32\) \[vocab=50, C=32\].*got \(49, 32\)"),
    (lambda p: p.pop("blocks.0.att.r_k"),
     r"no 'blocks\.0\.att\.r_k', needed to infer the head size"),
    (lambda p: p.update({"blocks.0.att.x_r": np.ones((1, 1, 32), np.int32)}),
     r"blocks\.0\.att\.x_r must be floating point"),
])
def test_checkpoint_errors_name_the_key(checkpoint, change, message):
    params = dict(checkpoint)
    change(params)
    with pytest.raises((ValueError, TypeError), match=message):
        rnn.load_rwkv7(params)


def test_checkpoint_path_errors(tmp_path):
    with pytest.raises(ValueError, match=r"must end in \.pth, \.pt, \.safetensors or \.npz"):
        rnn.load_rwkv7(tmp_path / "model.bin")
    with pytest.raises(TypeError, match="source must be a checkpoint path or a dict"):
        rnn.load_rwkv7(42)


def test_bad_inputs_are_named(model, tokens):
    with pytest.raises(TypeError, match=r"tokens must be an integer array \[B, T\]"):
        model(tokens.astype(np.float32))
    with pytest.raises(ValueError, match="pass either backend= or wkv_op="):
        model(tokens, backend="native", wkv_op=rwkv_jax.rwkv7)
    with pytest.raises(ValueError, match="state must hold one LayerState per layer"):
        model.step(tokens, model.init_state(2)[:1])
    bad = list(model.init_state(2))
    bad[1] = bad[1]._replace(ffn_shift=jnp.zeros((2, 31)))
    with pytest.raises(ValueError, match=r"state\[1\]\.ffn_shift must be float32 \[2, 32\]"):
        model.step(tokens, tuple(bad))
    with pytest.raises(ValueError, match="one row per batch row"):
        model(tokens, model.init_state(3))
    with pytest.raises(ValueError, match="v_first"):
        model.blocks[1].att(jnp.zeros((1, 2, 32)))
    with pytest.raises(ValueError, match="head_size=16"):
        rnn.RWKV7Config(vocab_size=5, n_embd=40, n_layer=1, head_size=16)


# --- RWKV-6 ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rwkv6_layer():
    params = official_rwkv6.random_layer(0, layer_id=1)
    x = np.random.default_rng(2).standard_normal((2, 9, 32))
    return params, x


@pytest.mark.parametrize("op", ["rwkv6"])
def test_rwkv6_layers_match_official_reference(backend, op, rwkv6_layer):
    params, x = rwkv6_layer
    att, ffn = rnn.load_rwkv6_layer(params, 1)
    y, _ = att(jnp.asarray(x, jnp.float32), backend=backend)
    assert relative_error(y, official_rwkv6.time_mix(params, 1, x)) < model_tolerance(backend)
    y, _ = ffn(jnp.asarray(x, jnp.float32))
    assert relative_error(y, official_rwkv6.channel_mix(params, 1, x)) < 1e-5


@pytest.mark.parametrize("op", ["rwkv6_step"])
def test_rwkv6_step_mode_equals_sequence_mode(backend, op, rwkv6_layer):
    params, x = rwkv6_layer
    att, ffn = rnn.load_rwkv6_layer(params, 1)
    x = jnp.asarray(x, jnp.float32)
    want, want_state = att(x)
    # Three slots, the batch on slots 2 and 0; prefill 4 tokens in sequence mode first.
    head, first = att(x[:, :4])
    pool = rnn.TimeMixState(jnp.zeros((3, 32)).at[jnp.array([2, 0])].set(first.shift),
                            jnp.zeros((3, 2, 16, 16)).at[jnp.array([2, 0])].set(first.wkv))
    pieces = [head]
    for t in range(4, 9):
        y, pool = att.step(x[:, t:t + 1], pool, state_indices=jnp.array([2, 0]), backend=backend)
        pieces.append(y)
    assert relative_error(jnp.concatenate(pieces, 1), want) < model_tolerance(backend)
    assert relative_error(pool.wkv[jnp.array([2, 0])], want_state.wkv) < model_tolerance(backend)
    assert not np.any(pool.wkv[1])

    y_seq, _ = ffn(x)
    shift = jnp.zeros((2, 32))
    steps = []
    for t in range(9):
        y, shift = ffn.step(x[:, t:t + 1], shift)
        steps.append(y)
    assert relative_error(jnp.concatenate(steps, 1), y_seq) < 1e-5


def test_rwkv6_fresh_layers_and_errors():
    cfg = rnn.RWKV6Config(n_embd=32, n_layer=2, head_size=16, mix_lora=4, decay_lora=8)
    assert cfg.dim_ffn == 96
    att = rnn.RWKV6TimeMix(cfg, 0, rngs=nnx.Rngs(0))
    y, state = att(jnp.ones((1, 3, 32)))
    assert y.shape == (1, 3, 32) and state.wkv.shape == (1, 2, 16, 16)
    params = official_rwkv6.random_layer(0, layer_id=0)
    params["blocks.0.att.time_maa_w2"] = np.ones((4, 4, 32), np.float32)
    with pytest.raises(ValueError, match=r"time_maa_w2 must have shape \(5, 4, 32\)"):
        rnn.load_rwkv6_layer(params, 0)


# --- RWKV-6 language model ------------------------------------------------------------------

@pytest.fixture(scope="module")
def rwkv6_checkpoint():
    return official_rwkv6.random_checkpoint(0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def rwkv6_model(rwkv6_checkpoint):
    return rnn.load_rwkv6(rwkv6_checkpoint)


@pytest.fixture(scope="module")
def rwkv6_reference(rwkv6_checkpoint, tokens):
    return official_rwkv6.forward(rwkv6_checkpoint, tokens)


@pytest.mark.parametrize("op", ["rwkv6"])
def test_rwkv6_lm_matches_official_reference(backend, op, rwkv6_model, tokens, rwkv6_reference):
    logits = rwkv6_model(tokens, backend=backend)
    assert logits.shape == TOKENS_SHAPE + (VOCAB,) and logits.dtype == jnp.float32
    assert relative_error(logits, rwkv6_reference) < model_tolerance(backend)


@pytest.mark.parametrize("op", ["rwkv6_step"])
def test_rwkv6_lm_step_mode_equals_sequence_mode(backend, op, rwkv6_model, tokens,
                                                 rwkv6_reference):
    check_step_mode_equals_sequence_mode(rwkv6_model, tokens, rwkv6_reference, backend)


def test_rwkv6_blocks_compose_to_the_lm(rwkv6_model, tokens, rwkv6_reference):
    x = rwkv6_model.emb(tokens)
    for block in rwkv6_model.blocks:
        x, _ = block(x)
    assert relative_error(rwkv6_model.head(rwkv6_model.ln_out(x)), rwkv6_reference) < 1e-4


def test_rwkv6_fresh_model_runs_both_modes_and_bfloat16(tokens, rwkv6_checkpoint,
                                                        rwkv6_reference):
    cfg = rnn.RWKV6Config(vocab_size=VOCAB, n_embd=32, n_layer=2, head_size=16, mix_lora=4,
                          decay_lora=8)
    model = rnn.RWKV6LM(cfg, rngs=nnx.Rngs(0))
    stepped, _ = model.step(tokens, model.init_state(2))
    assert relative_error(stepped, model(tokens)) < 1e-5
    # The official sizes: 7B and 14B (C = 4096) double both LoRA widths.
    finch_3b = rnn.RWKV6Config(vocab_size=65536, n_embd=2560, n_layer=32)
    assert (finch_3b.dim_ffn, finch_3b.mix_lora, finch_3b.decay_lora) == (8960, 32, 64)
    finch_7b = rnn.RWKV6Config(vocab_size=65536, n_embd=4096, n_layer=32)
    assert (finch_7b.dim_ffn, finch_7b.mix_lora, finch_7b.decay_lora) == (14336, 64, 128)
    with pytest.raises(ValueError, match=r"needs RWKV6Config\.vocab_size"):
        rnn.RWKV6LM(rnn.RWKV6Config(n_embd=32, n_layer=1, head_size=16), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="config must be an RWKV6Config, got RWKV7Config"):
        rnn.RWKV6LM(rnn.RWKV7Config(vocab_size=5, n_embd=32, n_layer=1, head_size=16),
                    rngs=nnx.Rngs(0))
    loaded = rnn.load_rwkv6(rwkv6_checkpoint, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert loaded.blocks[1].att.key.kernel[...].dtype == jnp.bfloat16
    logits = loaded(tokens)
    assert logits.dtype == jnp.bfloat16 and relative_error(logits, rwkv6_reference) < 5e-2


@pytest.mark.parametrize("suffix", CHECKPOINT_SUFFIXES)
def test_rwkv6_checkpoint_round_trip(tmp_path, suffix, rwkv6_checkpoint, rwkv6_model, tokens):
    path = tmp_path / f"finch{suffix}"
    official_rwkv7.write_checkpoint(path, rwkv6_checkpoint)
    exported = rnn.rwkv6_state_dict(rnn.load_rwkv6(path))
    assert sorted(exported) == sorted(rwkv6_checkpoint)  # every name, none added
    for name, value in exported.items():
        np.testing.assert_array_equal(value, rwkv6_checkpoint[name], err_msg=name)
    saved = tmp_path / f"saved{suffix}"
    rnn.save_rwkv6(rwkv6_model, saved)
    np.testing.assert_array_equal(rnn.load_rwkv6(saved)(tokens), rwkv6_model(tokens))
    assert rnn.rwkv6_config(saved) == rwkv6_model.config


@pytest.mark.parametrize("change, message", [
    (lambda p: p.pop("blocks.1.att.time_maa_g"), r"missing \['blocks\.1\.att\.time_maa_g'\]"),
    (lambda p: p.update({"blocks.1.att.time_state": np.ones((2, 16, 16), np.float32)}),
     r"unknown \['blocks\.1\.att\.time_state'\]"),
    (lambda p: p.update({"blocks.1.att.time_decay_w2": np.ones((8, 31), np.float32)}),
     r"blocks\.1\.att\.time_decay_w2 must have shape \(8, 32\) \[D_decay=8, C=32\].*"
     r"got \(8, 31\)"),
    (lambda p: p.update({"blocks.1.ffn.key.weight": np.ones((64, 32), np.float32)}),
     r"blocks\.1\.ffn\.key\.weight must have shape \(96, 32\) \[F=96, C=32\]"),
    (lambda p: p.update({"head.weight": np.ones((49, 32), np.float32)}),
     r"head\.weight must have shape \(50, 32\) \[vocab=50, C=32\].*got \(49, 32\)"),
    (lambda p: p.update({"blocks.0.att.time_faaaa": np.ones((4, 16), np.float32)}),
     r"time_faaaa must be \[H, N\] with H \* N = n_embd = 32, got \(4, 16\)"),
    (lambda p: p.pop("emb.weight"), r"no 'emb\.weight', needed to infer the vocabulary size"),
    (lambda p: p.update({"blocks.0.ln0.weight": np.ones(32, np.int32)}),
     r"blocks\.0\.ln0\.weight must be floating point"),
    (lambda p: p.update({"blocks.0.att.time_mix_k": p.pop("blocks.0.att.time_maa_x")}),
     r"an RWKV-5 \(or older\) checkpoint .*time_mix_k.*not RWKV-6: those are not supported"),
])
def test_rwkv6_checkpoint_errors_name_the_key(rwkv6_checkpoint, change, message):
    params = dict(rwkv6_checkpoint)
    change(params)
    with pytest.raises((ValueError, TypeError), match=message):
        rnn.load_rwkv6(params)


def test_checkpoint_of_the_other_version_says_which_loader(checkpoint, rwkv6_checkpoint):
    with pytest.raises(ValueError, match=r"an RWKV-7 checkpoint .*r_k.*load it with load_rwkv7"):
        rnn.load_rwkv6(checkpoint)
    with pytest.raises(ValueError, match=r"an RWKV-6 checkpoint .*load it with load_rwkv6"):
        rnn.load_rwkv7(rwkv6_checkpoint)
    with pytest.raises(TypeError, match="model must be an RWKV6LM, got RWKV7LM"):
        rnn.save_rwkv6(rnn.load_rwkv7(checkpoint), "model.npz")


# --- documents inside rows (resets) ----------------------------------------------------------

# Two rows of 12 tokens: documents begin at positions 0, 3 and 8 of row 0, 0 and 5 of row 1.
DOCUMENTS, DOC_LENGTH = ((0, 3, 8), (0, 5)), 12
DOC_TOKENS = np.random.default_rng(3).integers(0, VOCAB, (2, DOC_LENGTH)).astype(np.int32)


def document_resets(starts=DOCUMENTS):
    resets = np.zeros((len(starts), DOC_LENGTH), bool)
    for row, row_starts in enumerate(starts):
        resets[row, list(row_starts)] = True
    return resets


def each_document_alone(fn):
    """``fn(tokens [1, t]) -> [1, t, ...]`` on each document of DOC_TOKENS alone, in place."""
    rows = []
    for row, starts in enumerate(DOCUMENTS):
        bounds = (*starts, DOC_LENGTH)
        rows.append(jnp.concatenate([fn(DOC_TOKENS[row:row + 1, a:b])
                                     for a, b in zip(bounds, bounds[1:])], axis=1))
    return jnp.concatenate(rows, axis=0)


# Every document of every row, one after another along T (B = 1).
DOC_CU_SEQLENS = np.array([row * DOC_LENGTH + start for row, starts in enumerate(DOCUMENTS)
                           for start in starts] + [len(DOCUMENTS) * DOC_LENGTH])


@pytest.mark.parametrize("version", ["rwkv7", "rwkv6"])
@pytest.mark.parametrize("backend", ["native", "chunked"])
def test_resets_run_each_document_alone(version, backend, model, rwkv6_model):
    """With resets, each document's logits are those of the document run alone, and those of
    the packed mode (cu_seqlens) on the same documents; without its reset at position 0, where
    a row begins from zeros anyway, nothing changes."""
    lm = model if version == "rwkv7" else rwkv6_model
    resets = document_resets()
    logits = lm(DOC_TOKENS, resets=resets, backend=backend)
    alone = each_document_alone(lambda t: lm(t, backend=backend))
    assert relative_error(logits, alone) < 1e-5
    assert relative_error(lm(DOC_TOKENS, backend=backend), alone) > 1e-2   # the resets matter
    packed = lm(DOC_TOKENS.reshape(1, -1), cu_seqlens=DOC_CU_SEQLENS, backend=backend)
    assert relative_error(logits, packed.reshape(logits.shape)) < 1e-5
    resets[:, 0] = False
    assert relative_error(lm(DOC_TOKENS, resets=resets, backend=backend), logits) < 1e-5


@pytest.mark.parametrize("backend", ["native", "chunked"])
def test_resets_gradients_are_the_packed_modes(backend, model):
    """The parameters' gradient of a function of the hidden states through resets is the one
    through the packed mode (cu_seqlens) on the same documents."""
    cotangent = jax.random.normal(jax.random.key(0), (1, 2 * DOC_LENGTH, 32))

    def gradient(tokens, **documents):
        def loss(lm):
            h, _ = lm.hidden(tokens, backend=backend, **documents)
            return jnp.sum(h.reshape(cotangent.shape) * cotangent)
        return jax.tree.leaves(nnx.state(nnx.grad(loss)(model), nnx.Param))

    through_resets = gradient(DOC_TOKENS, resets=document_resets())
    packed = gradient(DOC_TOKENS.reshape(1, -1), cu_seqlens=DOC_CU_SEQLENS)
    # 1e-4: the float32 gradient contract of the exact backends (backends.tolerance); chunked
    # takes its path for strong decays at the resets' -inf, which rounds differently.
    for got, want in zip(through_resets, packed):
        assert relative_error(got, want) < 1e-4


def test_resets_are_checked(model, rwkv6_model):
    resets = document_resets()
    with pytest.raises(TypeError, match=r"resets must be a bool array \[B, T\]"):
        model(DOC_TOKENS, resets=resets.astype(np.int32))
    with pytest.raises(TypeError, match=r"resets must be a bool array \[B, T\]"):
        rwkv6_model(DOC_TOKENS, resets=resets[0])
    with pytest.raises(ValueError, match=r"resets must be \[B, T\] = \[2, 12\].*\(2, 6\)"):
        model(DOC_TOKENS, resets=resets[:, :6])
    with pytest.raises(ValueError, match="either cu_seqlens= .* or resets="):
        model(DOC_TOKENS[:1], cu_seqlens=np.array([0, DOC_LENGTH]), resets=resets[:1])


def test_weighted_cross_entropy_and_l2wrap_against_float64():
    """With weights, the loss is sum(w * ce) / sum(w) and L2-wrap adds l2wrap * w * m / sum(w)
    at each token's largest logit m (float64 numpy); weights summing to 0 give 0."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 16))
    kernel = rng.standard_normal((16, 40))
    labels = rng.integers(0, 40, (2, 5))
    weights = rng.uniform(0.5, 2.0, (2, 5)) * (rng.random((2, 5)) > 0.3)

    def value_and_grads(weights):
        return jax.value_and_grad(
            lambda x, k: rnn.chunked_cross_entropy(x, k, labels, vocab_chunk=16, l2wrap=0.01,
                                                   weights=jnp.asarray(weights, jnp.float32)),
            argnums=(0, 1))(jnp.asarray(x, jnp.float32), jnp.asarray(kernel, jnp.float32))

    loss, grads = value_and_grads(weights)
    logits = x @ kernel
    top = logits.max(-1, keepdims=True)
    exp = np.exp(logits - top)
    log_total = np.log(exp.sum(-1)) + top[..., 0]
    ce = log_total - np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    share = weights / weights.sum()
    d_logits = exp / exp.sum(-1, keepdims=True)
    d_logits[np.arange(2)[:, None], np.arange(5), labels] -= 1
    d_logits *= share[..., None]
    d_logits[np.arange(2)[:, None], np.arange(5), logits.argmax(-1)] += 0.01 * share * top[..., 0]
    assert abs(float(loss) - float(np.sum(share * ce))) <= 1e-6 * float(np.sum(share * ce))
    assert relative_error(grads[0], d_logits @ kernel.T) < 1e-5
    assert relative_error(grads[1], np.einsum("btc,btv->cv", x, d_logits)) < 1e-5

    loss, grads = value_and_grads(np.zeros((2, 5)))
    assert float(loss) == 0 and all(not np.any(np.asarray(g)) for g in grads)
    with pytest.raises(ValueError, match=r"weights must have labels' shape \(2, 5\)"):
        rnn.chunked_cross_entropy(jnp.asarray(x), jnp.asarray(kernel), labels,
                                  weights=jnp.ones((2, 4)))


# --- Linen wrappers --------------------------------------------------------------------------

def test_linen_wrappers_call_the_ops():
    rng = np.random.default_rng(4)
    shape = (1, 5, 2, 4)
    r, k, v, a = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    w = -jnp.asarray(rng.uniform(0.01, 0.6, shape), jnp.float32)
    kk = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    u = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
    module = linen.RWKV7(scale=0.5, backend="native")
    o, h = module.apply({}, r, w, k, v, -kk, kk * 0.5)
    want_o, want_h = rwkv_jax.rwkv7(r, w, k, v, -kk, kk * 0.5, scale=0.5, backend="native")
    np.testing.assert_array_equal(o, want_o)
    np.testing.assert_array_equal(h, want_h)
    o, pool = module.apply({}, r, w, k, v, -kk, kk * 0.5, jnp.zeros((1, 2, 4, 4)), method="step")
    assert relative_error(o, want_o) < 1e-5 and relative_error(pool, want_h) < 1e-5

    o, h = linen.RWKV6().apply({}, r, k, v, w, u)
    np.testing.assert_array_equal(o, rwkv_jax.rwkv6(r, k, v, w, u)[0])
    o, _ = linen.RWKV6().apply({}, r, k, v, w, u, jnp.zeros((1, 2, 4, 4)), method="step")
    assert relative_error(o, rwkv_jax.rwkv6(r, k, v, w, u)[0]) < 1e-5
    o, _ = linen.GatedLinearAttention(reverse=True).apply({}, r, k, v, gk=w)
    want_o, _ = rwkv_jax.gated_linear_attention(r, k, v, gk=w, reverse=True)
    np.testing.assert_array_equal(o, want_o)
    c = (1, 5, 8)
    kc, vc = (jnp.asarray(rng.standard_normal(c), jnp.float32) for _ in range(2))
    wc, uc = -jnp.ones(8), jnp.zeros(8)
    y, _ = linen.RWKV4().apply({}, wc, uc, kc, vc)
    np.testing.assert_array_equal(y, rwkv_jax.rwkv4(wc, uc, kc, vc)[0])


# --- the training example --------------------------------------------------------------------

def test_associative_recall_example_tiny_learns(capsys):
    spec = importlib.util.spec_from_file_location(
        "train_associative_recall", ROOT / "examples" / "train_associative_recall.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--tiny"])
    losses = result["losses"]
    assert np.mean(losses[-10:]) < 0.85 * np.mean(losses[:10])
    assert result["accuracy"] > result["chance"]
    assert "loss" in capsys.readouterr().out


def test_importing_nn_without_flax_names_the_extra():
    # flax made unimportable in a fresh interpreter, as where it is not installed.
    code = ("import sys; sys.modules['flax'] = None\n"
            "try:\n    import rwkv_jax.nn\n"
            "except ImportError as err:\n    print(type(err).__name__, err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ImportError rwkv_jax.nn needs flax: "
                                  'pip install "rwkv_jax[flax]"'), done.stdout

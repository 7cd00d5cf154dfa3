"""rwkv_jax.train on this process's 8 CPU devices (tests/conftest.py makes them): the step's
accumulation and FSDP against one batch on one device, the weight-decay mask, the L2-wrap
gradient, and the loop through ``rwkv-jax train``: log, checkpoints, exact resume, export;
with documents (``--documents``), the step's loss against each document run alone, the
token-weighted accumulation and the exact resume. The two-process run is in
tests/test_multiprocess.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rwkv_jax import cli
from rwkv_jax.nn import chunked_cross_entropy, read_checkpoint
from rwkv_jax.cli.train import config_from
from rwkv_jax.train import (Checkpoints, TrainConfig, TrainStep, WindowSampler, open_tokens,
                            train, write_binidx)
from rwkv_jax.train import mesh as meshes
from rwkv_jax.train.loop import document_resets
from rwkv_jax.train.step import decay_mask

TINY = dict(vocab_size=64, n_layer=2, n_embd=32, head_size=16, seq_len=8,
            compute_dtype="float32", backend="ffi", warmup_steps=1, steps=4, l2wrap=1e-4)


def tiny_corpus(path, tokens=3000, seed=0):
    """A token file with something to learn: a pattern of 97 ids repeated, every 7th id noise."""
    rng = np.random.default_rng(seed)
    ids = np.tile(rng.integers(0, TINY["vocab_size"], 97), tokens // 97 + 1)[:tokens]
    noise = rng.integers(0, TINY["vocab_size"], tokens)
    ids = np.where(np.arange(tokens) % 7 == 0, noise, ids).astype(np.uint16)
    np.save(path, ids)
    return str(path)


def document_corpus(prefix, documents=400, seed=0):
    """A binidx corpus of short documents (1 to 6 tokens: a window of 8 crosses several)."""
    rng = np.random.default_rng(seed)
    write_binidx(prefix, [rng.integers(0, TINY["vocab_size"], rng.integers(1, 7))
                          for _ in range(documents)])
    return str(prefix)


def document_batches(prefix, rows, steps):
    """``steps`` batches of ``rows`` windows of the corpus with documents: tokens
    ``[steps, rows, seq_len + 1]``, and the resets and loss weights ``[steps, rows, seq_len]``."""
    sampler = WindowSampler(open_tokens(prefix), TINY["seq_len"], rows, documents=True)
    batches = [sampler.batch(step) for step in range(steps)]
    tokens = np.stack([np.concatenate([b.inputs, b.targets[:, -1:]], 1) for b in batches])
    resets = np.stack([document_resets(b.segment_starts, TINY["seq_len"]) for b in batches])
    return tokens, resets, np.stack([b.loss_mask for b in batches])


def _step_run(config, batches, documents=()):
    """The losses and final parameters of ``config``'s step over host ``batches`` of
    ``[micro-batches, rows, seq_len + 1]`` tokens (``documents``: their resets and loss
    weights, ``[steps, rows, seq_len]`` each)."""
    mesh = meshes.make_mesh(config)
    step = TrainStep(config, mesh)
    state, losses, norms = step.init(), [], []
    for i, tokens in enumerate(batches):
        arrays = (tokens[..., :-1], tokens[..., 1:], *(x[i] for x in documents))
        state, metrics = step.step(state, *(meshes.global_batch(
            mesh, x.reshape(config.accumulation, config.micro_batch, -1)) for x in arrays))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.asarray(losses), jax.tree.map(np.asarray, state["params"]), state, norms


@pytest.fixture(scope="module")
def one_batch_run():
    """Two steps of 8 rows on one device: the reference of the accumulation and FSDP tests."""
    rng = np.random.default_rng(1)
    batches = rng.integers(0, TINY["vocab_size"], (2, 8, TINY["seq_len"] + 1)).astype(np.int32)
    config = TrainConfig(**TINY, micro_batch=8, data=1)
    return batches, _step_run(config, batches)


def _assert_same_run(got, want, tolerance):
    """Losses and gradient norms to ``tolerance``; parameters to 20 x ``tolerance`` of each
    array's largest entry: Adam divides each gradient entry by its own running size, so an
    entry whose gradient nearly cancels between the two steps carries a larger relative
    error into its update than the gradients have."""
    np.testing.assert_allclose(got[0], want[0], rtol=tolerance)
    np.testing.assert_allclose(got[3], want[3], rtol=tolerance)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got[1])[0],
                            jax.tree.leaves(want[1])):
        scale = max(float(np.abs(b).max()), 1e-30)
        assert float(np.abs(a - b).max()) <= 20 * tolerance * scale, jax.tree_util.keystr(path)


def test_accumulation_equals_one_larger_batch(one_batch_run):
    """4 micro-batches of 2 rows inside one step make the update of one batch of 8 rows."""
    batches, want = one_batch_run
    got = _step_run(TrainConfig(**TINY, micro_batch=2, accumulation=4, data=1), batches)
    _assert_same_run(got, want, 1e-6)


def test_fsdp_over_eight_devices_equals_one_device(one_batch_run):
    """Rows over 8 devices, parameters and optimizer state split over them (ZeRO-3): the
    losses and parameters of one device."""
    batches, want = one_batch_run
    got = _step_run(TrainConfig(**TINY, micro_batch=8, data=8), batches)
    _assert_same_run(got, want, 1e-5)
    state = got[2]
    split = [x for x in jax.tree.leaves((state["params"], state["opt_state"]))
             if "data" in x.sharding.spec]
    assert len(split) > len(jax.tree.leaves(state["params"])), "FSDP left the state whole"
    emb = state["params"]["emb"]["embedding"]
    assert tuple(emb.sharding.spec) == ("data", None) and emb.addressable_shards[0].data.shape == (8, 32)


def test_documents_step_loss_is_the_per_document_mean(tmp_path):
    """A step with documents: its loss is the cross-entropy of each document run alone (from
    a zero state), averaged over the targets that loss_mask keeps."""
    config = TrainConfig(**TINY, micro_batch=4, data=1)
    tokens, resets, weights = document_batches(document_corpus(tmp_path / "docs"), 4, 1)
    mesh = meshes.make_mesh(config)
    step = TrainStep(config, mesh)
    state = step.init()
    # Random parameters: at init every layer's output projection is 0, and no logit would
    # depend on the tokens before it.
    rng = np.random.default_rng(0)
    state["params"] = jax.tree.map(
        lambda p: jax.device_put(rng.normal(0, 0.3, p.shape).astype(np.float32), p.sharding),
        state["params"])
    lm = step.model(jax.tree.map(jnp.array, state["params"]))   # copies: the step donates
    _, metrics = step.step(state, *(meshes.global_batch(mesh, x) for x in
                                    (tokens[:, :, :-1], tokens[:, :, 1:], resets, weights)))

    def cross_entropy(inputs, targets):
        logits = np.asarray(lm(inputs[None], backend="native")[0], np.float64)
        top = logits.max(-1)
        log_total = np.log(np.exp(logits - top[:, None]).sum(-1)) + top
        return log_total - logits[np.arange(len(targets)), targets]

    inputs, targets, mask = tokens[0, :, :-1], tokens[0, :, 1:], weights[0]
    alone = []
    for row in range(4):
        starts = np.flatnonzero(resets[0, row])
        for a, b in zip(starts, [*starts[1:], TINY["seq_len"]]):
            alone.append(cross_entropy(inputs[row, a:b], targets[row, a:b]))
    alone = np.concatenate(alone)
    assert mask.min() == 0 and resets[0, :, 1:].sum() > 4
    want = np.sum(alone * mask.ravel()) / mask.sum()
    np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)
    across = np.concatenate([cross_entropy(inputs[row], targets[row]) for row in range(4)])
    assert np.abs(across - alone).max() > 0.1   # run across the documents, the losses differ


def test_documents_accumulation_is_token_weighted(tmp_path):
    """4 micro-batches of 2 rows with documents, on 2 devices, make the step of one batch of 8
    rows: loss and gradient are the token-weighted means over the step, although the
    micro-batches keep different numbers of targets."""
    tokens, *documents = document_batches(document_corpus(tmp_path / "docs"), 8, 2)
    kept = documents[1].reshape(2, 4, -1).sum(-1)
    assert len(np.unique(kept)) > 1
    want = _step_run(TrainConfig(**TINY, micro_batch=8, data=1), tokens, documents)
    got = _step_run(TrainConfig(**TINY, micro_batch=2, accumulation=4, data=2), tokens,
                    documents)
    _assert_same_run(got, want, 1e-5)


def test_documents_flag_and_resume(tmp_path):
    """``rwkv-jax train --documents`` stopped after step 2 and resumed: the losses, eval losses
    and final state of the same run uninterrupted."""
    corpus = document_corpus(tmp_path / "docs")
    argv = ["train", *CLI_ARGS, "--documents", "--train-data", corpus, "--eval-data", corpus,
            "--log-path", str(tmp_path / "log.jsonl")]
    resumed = [*argv, "--checkpoint-dir", str(tmp_path / "resumed")]
    assert cli.main([*resumed, "--until", "2"]) == 0
    assert cli.main(resumed) == 0
    config = config_from(cli.build_parser().parse_args(
        [*argv[:-2], "--checkpoint-dir", str(tmp_path / "whole")]))
    assert config.documents and not config_from(cli.build_parser().parse_args(
        ["train", "--no-documents"])).documents
    whole = train(config)
    with open(tmp_path / "log.jsonl") as f:
        logged = [json.loads(line) for line in f]
    for name in ("loss", "eval_loss", "grad_norm"):
        pick = lambda records: sorted((r["step"], r[name]) for r in records if name in r)
        np.testing.assert_allclose(pick(logged), pick(whole), rtol=1e-6)
    step = TrainStep(config, meshes.make_mesh(config))
    got, got_data, _ = Checkpoints(tmp_path / "resumed").restore(step.abstract_state)
    want, want_data, _ = Checkpoints(tmp_path / "whole").restore(step.abstract_state)
    assert got_data == want_data and got_data["documents"] == 1 and int(got["step"]) == 4
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-12)


def test_weight_decay_mask_is_rwkv_lms():
    """Decay on the embedding, the head and every projection matrix; nothing else (norms,
    mixes, decays, LoRAs, r_k)."""
    step = TrainStep(TrainConfig(**TINY, micro_batch=1, data=1), meshes.make_mesh(
        TrainConfig(**TINY, micro_batch=1, data=1)))
    mask = decay_mask(step.abstract_state["params"])
    decayed = {jax.tree_util.keystr(p) for p, on in jax.tree_util.tree_flatten_with_path(mask)[0]
               if on}
    projections = [f"['blocks'][{i}]['{part}']['{name}']['kernel']" for i in range(2)
                   for part, names in (("att", ("receptance", "key", "value", "output")),
                                       ("ffn", ("key", "value"))) for name in names]
    assert decayed == {"['emb']['embedding']", "['head']['kernel']", *projections}


def test_l2wrap_adds_rwkv_lms_gradient_and_keeps_the_loss():
    """The value stays the cross-entropy; the gradient gains l2wrap * max_logit / n at each
    token's largest logit (against float64)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 40, (2, 5)), jnp.int32)
    loss, grads = jax.value_and_grad(
        lambda x, k: chunked_cross_entropy(x, k, labels, vocab_chunk=16, l2wrap=0.01),
        argnums=(0, 1))(x, kernel)
    with jax.enable_x64(True):
        x64, k64 = (jnp.asarray(np.asarray(a), jnp.float64) for a in (x, kernel))

        def reference(x, k):
            logits = x @ k
            top = jax.lax.stop_gradient(logits.max(-1))
            wrap = 0.01 / logits[..., 0].size * jnp.sum(
                jnp.where(logits == top[..., None], logits, 0.0) * top[..., None])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return ce + wrap - jax.lax.stop_gradient(wrap), ce

        (_, ce), want = jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)(x64, k64)
    assert abs(float(loss) - float(ce)) <= 1e-6 * float(ce)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="l2wrap must be a number >= 0"):
        chunked_cross_entropy(x, kernel, labels, l2wrap=-1.0)


CLI_ARGS = ["--vocab-size", "64", "--n-layer", "2", "--n-embd", "32", "--head-size", "16",
            "--seq-len", "8", "--micro-batch", "2", "--accumulation", "2", "--steps", "4",
            "--warmup-steps", "1", "--compute-dtype", "float32", "--backend", "ffi",
            "--eval-every", "2", "--eval-batches", "2", "--log-every", "1",
            "--checkpoint-every", "2", "--checkpoint-keep", "2", "--data", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``rwkv-jax train`` stopped after step 2 and run again (it resumes), and the same run
    uninterrupted through ``train()``."""
    root = tmp_path_factory.mktemp("train")
    data = ["--train-data", tiny_corpus(root / "train.npy"),
            "--eval-data", tiny_corpus(root / "eval.npy", 500, seed=1)]
    resumed = root / "resumed"
    argv = ["train", *CLI_ARGS, *data, "--checkpoint-dir", str(resumed / "checkpoints"),
            "--log-path", str(resumed / "log.jsonl")]
    resumed.mkdir()
    assert cli.main([*argv, "--until", "2"]) == 0
    first_steps = sorted(Checkpoints(resumed / "checkpoints").all_steps())
    assert cli.main([*argv, "--plot", str(resumed / "loss.png"),
                     "--export", str(resumed / "model.safetensors")]) == 0
    args = cli.build_parser().parse_args([*argv[:-4], "--checkpoint-dir",
                                          str(root / "whole")])
    whole = train(config_from(args))
    return dict(root=root, resumed=resumed, first_steps=first_steps, whole=whole,
                config=config_from(args))


def test_resume_continues_exactly(runs):
    """Stopped after step 2 and resumed: the losses, eval losses and final state (parameters,
    optimizer state, step, sampler position) of the uninterrupted run."""
    with open(runs["resumed"] / "log.jsonl") as f:
        logged = [json.loads(line) for line in f]
    key = lambda r: (r["step"], "eval_loss" in r)
    pick = lambda records, name: [(r["step"], r[name]) for r in sorted(records, key=key)
                                  if name in r]
    for name in ("loss", "eval_loss", "grad_norm"):
        np.testing.assert_allclose(np.asarray(pick(logged, name)),
                                   np.asarray(pick(runs["whole"], name)), rtol=1e-6)
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]
    step = TrainStep(runs["config"], meshes.make_mesh(runs["config"]))
    got, got_data, _ = Checkpoints(runs["resumed"] / "checkpoints").restore(step.abstract_state)
    want, want_data, _ = Checkpoints(runs["root"] / "whole").restore(step.abstract_state)
    assert got_data == want_data and got_data["step"] == 8   # 4 steps of 2 micro-batches
    assert int(got["step"]) == 4
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-12)


def test_command_writes_log_checkpoints_plot_and_export(runs):
    """The log's records (train and eval), the checkpoints kept (the last 2), the plot, and
    the export in the official layout holding the final parameters."""
    resumed = runs["resumed"]
    assert runs["first_steps"] == [2]
    assert Checkpoints(resumed / "checkpoints").all_steps() == [2, 4]
    with open(resumed / "log.jsonl") as f:
        logged = [json.loads(line) for line in f]
    train_records = [r for r in logged if "loss" in r]
    assert {"loss", "grad_norm", "learning_rate", "elapsed_s"} <= set(train_records[0])
    assert all("tokens_per_s" in r and r["tokens_per_s"] > 0 for r in train_records[1:2])
    assert [r["step"] for r in logged if "eval_loss" in r] == [2, 4]
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    assert (resumed / "loss.png").stat().st_size > 1000
    exported = read_checkpoint(resumed / "model.safetensors")
    step = TrainStep(runs["config"], meshes.make_mesh(runs["config"]))
    state, _, _ = Checkpoints(resumed / "checkpoints").restore(step.abstract_state)
    head = np.asarray(state["params"]["head"]["kernel"])
    np.testing.assert_array_equal(exported["head.weight"], head.T)


def test_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="documents must be a bool"):
        TrainConfig(documents=1)
    with pytest.raises(ValueError, match="documents=True restarts .* marks none"):
        train(TrainConfig(**TINY, documents=True, train_data=tiny_corpus(tmp_path / "t.npy")))
    with pytest.raises(ValueError, match="remat must be one of"):
        TrainConfig(remat="all")
    with pytest.raises(ValueError, match="micro_batch must be a positive int"):
        TrainConfig(micro_batch=0)
    with pytest.raises(ValueError, match="micro_batch .3. must be a multiple of the mesh's data"):
        meshes.make_mesh(TrainConfig(**TINY, micro_batch=3, data=2))
    with pytest.raises(ValueError, match="config.train_data must name a token file"):
        train(TrainConfig(**TINY))

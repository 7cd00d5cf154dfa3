"""``train(config)``: the training loop around :class:`rwkv_jax.train.TrainStep`.

Every process runs it (``jax.distributed`` initialised first where there are several): each
reads its own rows of every batch, and process 0 alone shows the progress bar (loss, tokens/s,
MFU), writes the JSON-lines log and the plot. Checkpoints go to ``checkpoint_dir`` every
``checkpoint_every`` steps and at the end; a run whose directory holds one continues from the
latest, computing the same steps as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

import jax
import numpy as np

from . import flops, mesh as meshes
from .checkpoint import Checkpoints
from .step import TrainStep


def document_resets(segment_starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The model's ``resets`` (bool ``[..., seq_len]``, True where a segment begins) from a
    batch's ``segment_starts`` (int ``[..., S]``, padded with ``seq_len``). Position 0, where
    every row begins, is True too: a reset at a row's start changes nothing."""
    resets = np.zeros(segment_starts.shape[:-1] + (seq_len + 1,), bool)
    np.put_along_axis(resets, segment_starts.astype(np.intp), True, axis=-1)
    return resets[..., :seq_len]


class _Data:
    """The run's token windows: the one place the loop meets :mod:`rwkv_jax.train.data`."""

    def __init__(self, config, path, mode):
        from .data import WindowSampler, open_tokens
        corpus = open_tokens(path, config.token_dtype)
        corpus.check_vocab(config.vocab_size)
        if config.documents and corpus.document_starts is None:
            raise ValueError(f"documents=True restarts the model at every document, and {path} "
                             f"marks none: give a binidx corpus (its .idx lists the documents)")
        self.documents, self.seq_len = config.documents, config.seq_len
        self.sampler = WindowSampler(corpus, config.seq_len, config.micro_batch, mode=mode,
                                     seed=config.seed, documents=config.documents,
                                     process_index=jax.process_index(),
                                     process_count=jax.process_count())

    def take(self, micro_batches: int) -> tuple:
        """This process's rows of the next ``micro_batches`` micro-batches, each array
        ``[micro_batches, rows, seq_len]``: int32 inputs and targets, and with documents the
        resets (bool) and the loss weights (float32, the batches' ``loss_mask``)."""
        batches = [next(self.sampler) for _ in range(micro_batches)]
        stack = lambda field: np.stack([getattr(b, field) for b in batches])
        if not self.documents:
            return stack("inputs"), stack("targets")
        return (stack("inputs"), stack("targets"),
                document_resets(stack("segment_starts"), self.seq_len), stack("loss_mask"))

    def state(self) -> dict:
        return self.sampler.state()

    def restore(self, state: dict) -> None:
        self.sampler.restore(state)


class _Log:
    """JSON lines appended to ``path`` (process 0 only), each flushed as written."""

    def __init__(self, path: Optional[str]):
        self._file = (open(path, "a") if path is not None and jax.process_index() == 0
                      else None)

    def write(self, record: dict):
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self):
        if self._file is not None:
            self._file.close()


def train(config, *, until: Optional[int] = None, plot: Optional[str] = None,
          progress: Optional[bool] = None, export: Optional[str] = None) -> list[dict]:
    """Train as ``config`` says; returns the log's records (also those of eval).

    ``until``: stop after this step (the schedule still spans ``config.steps``; a later run
    with the same checkpoint directory continues). ``plot``: write the loss curves to this
    image (needs matplotlib). ``progress``: show a progress bar (default: on a terminal).
    ``export``: write the final parameters as an official checkpoint (``save_rwkv7``)."""
    if config.train_data is None:
        raise ValueError("config.train_data must name a token file")
    stop = config.steps if until is None else min(until, config.steps)
    mesh = meshes.make_mesh(config)
    step_fn = TrainStep(config, mesh)
    data = _Data(config, config.train_data, "random")
    evaluation = None
    if config.eval_data is not None:
        held_out = _Data(config, config.eval_data, "sequential")
        evaluation = [meshes.global_batch(mesh, x) for x in held_out.take(config.eval_batches)]

    checkpoints = None
    if config.checkpoint_dir is not None:
        checkpoints = Checkpoints(config.checkpoint_dir, keep=config.checkpoint_keep)
    if checkpoints is not None and checkpoints.latest_step() is not None:
        state, sampler_state, _ = checkpoints.restore(step_fn.abstract_state)
        data.restore(sampler_state)
    else:
        state = step_fn.init()
    first = int(state["step"])

    per_token = flops.flops_per_token(step_fn.model_config, step_fn.parameters)
    peak = flops.peak_tflops(jax.devices()[0].device_kind)
    main = jax.process_index() == 0
    log = _Log(config.log_path)
    records = []
    bar = None
    if main and (sys.stderr.isatty() if progress is None else progress):
        from tqdm import tqdm
        bar = tqdm(total=stop, initial=first, desc="train", unit="step", file=sys.stderr)

    def record(entry):
        records.append(entry)
        log.write(entry)

    def evaluate(step):
        if evaluation is not None:
            record(dict(step=step, eval_loss=float(step_fn.eval_loss(state["params"],
                                                                     *evaluation))))

    started = time.perf_counter()
    timed = None   # (step, time) from which tokens/s counts: the end of the first (compiling) step
    try:
        for step in range(first, stop):
            batch = [meshes.global_batch(mesh, x) for x in data.take(config.accumulation)]
            state, metrics = step_fn.step(state, *batch)
            done = step + 1
            if checkpoints is not None and (done % config.checkpoint_every == 0 or done == stop):
                checkpoints.save(done, state, data.state(), config)
            if step == first or done % config.log_every == 0 or done == stop:
                entry = dict(step=done, **{k: float(v) for k, v in metrics.items()})
                now = time.perf_counter()
                if timed is None:
                    timed = (done, now)
                elif done > timed[0]:
                    rate = config.tokens_per_step * (done - timed[0]) / (now - timed[1])
                    entry.update(tokens_per_s=rate,
                                 mfu=flops.mfu(rate, per_token, mesh.size, peak))
                entry["elapsed_s"] = now - started
                record(entry)
                if bar is not None:
                    bar.update(done - bar.n)
                    bar.set_postfix_str(_postfix(entry))
            if done % config.eval_every == 0 or done == stop:
                evaluate(done)
    finally:
        if bar is not None:
            bar.close()
        log.close()
        if checkpoints is not None:
            checkpoints.wait()
            checkpoints.close()
    if export is not None:
        from .checkpoint import export as export_params
        export_params(step_fn, state["params"], export)
    if plot is not None and main:
        plot_losses(records, plot)
    return records


def _postfix(entry) -> str:
    text = f"loss {entry['loss']:.3f}"
    if "tokens_per_s" in entry:
        text += f", {entry['tokens_per_s']:,.0f} tokens/s"
    if entry.get("mfu") is not None:
        text += f", MFU {100 * entry['mfu']:.1f}%"
    return text


def read_log(path) -> list[dict]:
    """The records of a JSON-lines log."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(records: list[dict], path) -> None:
    """The training loss (and the eval loss, where there is one) against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .._files import write_atomically
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    held_out = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    figure, axes = plt.subplots(figsize=(7, 4))
    for points, label in ((train, "train"), (held_out, "eval")):
        if points:
            axes.plot(*zip(*points), label=label, marker="." if len(points) < 50 else None)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    suffix = os.path.splitext(os.fspath(path))[1].lstrip(".") or "png"
    write_atomically(path, lambda f: figure.savefig(f, format=suffix))
    plt.close(figure)

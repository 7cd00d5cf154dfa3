"""Checkpoints of a training run through orbax-checkpoint, and their export to the official
layout.

A checkpoint holds the train state (step, parameters, optimizer state: saved sharded, each
process writing its own pieces, asynchronously while training goes on), the data sampler's
position (its windows are a function of its seed and that position, the same in every process:
the data RNG) and the run's config. :class:`Checkpoints` keeps the last ``keep``; restoring puts
every array back where the step wants it, so a resumed run computes exactly the steps the
uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:   # an optional dependency: say which extra brings it
        raise ImportError("training checkpoints need orbax-checkpoint: pip install "
                          "'rwkv_jax[train]'") from err
    return ocp


class Checkpoints:
    """The checkpoints of one run in ``directory`` (created if missing)."""

    def __init__(self, directory, *, keep: int = 3):
        ocp = _orbax()
        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=True, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, sampler_state: dict, config) -> None:
        """Start writing the checkpoint of ``step``; every process calls it. The arrays are
        copied off the devices before it returns (the next step may reuse their buffers)."""
        ocp = self._ocp
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({k: int(v) for k, v in sampler_state.items()}),
            config=ocp.args.JsonSave(dataclasses.asdict(config)))
        self._manager.save(step, args=args, force=True)

    def restore(self, abstract_state, step: Optional[int] = None):
        """``(state, sampler_state, config dict)`` of ``step`` (default: the latest), the
        arrays placed as ``abstract_state``'s shardings say."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["data"]), restored["config"]

    def wait(self):
        """Block until the checkpoints being written are on disk."""
        self._manager.wait_until_finished()

    def close(self):
        self._manager.close()


def export(train_step, params, path) -> None:
    """Write ``params`` (a train state's) as an official RWKV-7 checkpoint (``.pth``,
    ``.safetensors`` or ``.npz``) with :func:`rwkv_jax.nn.save_rwkv7`. Every process calls it."""
    from ..nn import save_rwkv7
    save_rwkv7(train_step.model(params), path)

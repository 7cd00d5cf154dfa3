"""Training RWKV-7 language models: token files, the training step, the mesh, checkpoints and
the loop (``rwkv-jax train``). The step and the loop need the ``train`` extra (flax, optax,
orbax-checkpoint); they load when first used, so that ``rwkv-jax`` starts without them."""

import importlib

from .config import MODEL_SIZES, TrainConfig
from .data import (Batch, TokenFile, WindowSampler, open_tokens, pack_rows, tokenize_text,
                   write_binidx, write_tokens)

_LAZY = {"TrainStep": "step", "Checkpoints": "checkpoint", "train": "loop"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

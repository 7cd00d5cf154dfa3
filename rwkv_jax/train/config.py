"""What a training run is: one small dataclass, every field with a default that trains."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

# The official RWKV-7 shapes (vocabulary 65536, head size 64) by name, and a tiny one for CPUs.
MODEL_SIZES = {
    "0.1b": dict(n_layer=12, n_embd=768),
    "0.4b": dict(n_layer=24, n_embd=1024),
    "1.5b": dict(n_layer=24, n_embd=2048),
    "tiny": dict(n_layer=2, n_embd=64, head_size=16, vocab_size=256),
}
REMAT_POLICIES = ("none", "block", "save_wkv")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run of an :class:`rwkv_jax.nn.RWKV7LM`.

    Data: token files (``train_data``, ``eval_data``); ``documents`` (corpora that mark their
    documents: binidx) restarts the model's state and token shifts at every document inside
    the rows and leaves out of the loss each target predicted across such a restart.

    Batch: each optimizer step takes ``accumulation`` micro-batches of ``micro_batch`` rows
    (global, over every process) of ``seq_len`` tokens, accumulated inside one jitted step.

    Optimizer: AdamW (``beta1``, ``beta2``, ``eps``) with ``weight_decay`` on the embedding, the
    head and the projection matrices only (as RWKV-LM), ``w0``'s learning rate times
    ``w0_lr_scale`` (RWKV-LM: 2); ``learning_rate`` reached linearly after ``warmup_steps``, then
    ``schedule`` "cosine" down to ``final_lr_fraction * learning_rate`` at ``steps`` (or
    "constant"); gradients clipped to global norm ``clip`` (0: no clipping); ``l2wrap``: the
    coefficient of RWKV-LM's L2-wrap term (1e-4 there; 0: off).

    Precision: ``param_dtype`` "float32" (master weights) or "bfloat16"; the optimizer state is
    float32 either way; ``compute_dtype`` the dtype the model computes in. ``remat``: "none",
    "block" (recompute each block in the backward) or "save_wkv" (recompute each block but the
    wkv recurrence's outputs).

    Devices: a mesh of ``data`` x ``seq`` devices (``data`` -1: every device left), the batch
    split over "data", time over "seq"; ``fsdp`` shards parameters and optimizer state over
    "data" too.
    """
    # data
    train_data: Optional[str] = None
    eval_data: Optional[str] = None
    token_dtype: Optional[str] = None      # for flat files without a dtype of their own
    documents: bool = False
    # model
    vocab_size: int = 65536
    n_layer: int = 12
    n_embd: int = 768
    head_size: int = 64
    # batch
    seq_len: int = 512
    micro_batch: int = 8
    accumulation: int = 1
    steps: int = 1000
    # optimizer
    learning_rate: float = 6e-4
    warmup_steps: int = 100
    schedule: str = "cosine"
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-18
    clip: float = 1.0
    w0_lr_scale: float = 2.0
    l2wrap: float = 1e-4
    # precision and memory
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    remat: str = "none"
    vocab_chunk: int = 8192
    backend: Optional[str] = None
    # devices
    data: int = -1
    seq: int = 1
    fsdp: bool = True
    # checkpoints, evaluation, logging
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 1000
    checkpoint_keep: int = 3
    eval_every: int = 200
    eval_batches: int = 8
    log_path: Optional[str] = None
    log_every: int = 10
    seed: int = 0

    def __post_init__(self):
        positive = ("vocab_size", "n_layer", "n_embd", "head_size", "seq_len", "micro_batch",
                    "accumulation", "steps", "checkpoint_every", "checkpoint_keep",
                    "eval_every", "eval_batches", "log_every", "vocab_chunk", "seq")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("documents", "fsdp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.n_embd % self.head_size:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of head_size "
                             f"({self.head_size})")
        if not isinstance(self.data, int) or not (self.data == -1 or self.data >= 1):
            raise ValueError(f"data must be -1 (every device) or a positive int, got "
                             f"{self.data!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {', '.join(REMAT_POLICIES)}, got "
                             f"{self.remat!r}")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got "
                                 f"{getattr(self, name)!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a non-negative int, got "
                             f"{self.warmup_steps!r}")
        for name in ("learning_rate", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "clip", "l2wrap", "w0_lr_scale", "final_lr_fraction"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")

    @classmethod
    def for_model(cls, size: str, **fields) -> "TrainConfig":
        """A config with the shape ``MODEL_SIZES[size]`` (fields given override it)."""
        if size not in MODEL_SIZES:
            raise ValueError(f"unknown model size {size!r}; known: {', '.join(MODEL_SIZES)}")
        return cls(**{**MODEL_SIZES[size], **fields})

    def model_config(self):
        from ..nn import RWKV7Config
        return RWKV7Config(vocab_size=self.vocab_size, n_embd=self.n_embd,
                           n_layer=self.n_layer, head_size=self.head_size)

    @property
    def tokens_per_step(self) -> int:
        return self.accumulation * self.micro_batch * self.seq_len

"""Flax modules for RWKV models built on rwkv_jax's operators.

- RWKV-7 ("x070"): :class:`RWKV7TimeMix`, :class:`RWKV7ChannelMix`, :class:`RWKV7Block`,
  :class:`RWKV7LM` (sequence mode for training, step mode with a state cache for generation);
- RWKV-6 ("Finch", "x060"): :class:`RWKV6TimeMix`, :class:`RWKV6ChannelMix`,
  :class:`RWKV6Block`, :class:`RWKV6LM` (the same two modes);
- checkpoints with the official parameter names: :func:`load_rwkv7`, :func:`save_rwkv7`,
  :func:`rwkv7_state_dict`, :func:`load_rwkv6`, :func:`save_rwkv6`, :func:`rwkv6_state_dict`,
  :func:`load_rwkv6_layer`;
- the loss: :func:`chunked_cross_entropy` (softmax cross-entropy of ``x @ kernel`` without full
  float32 logits);
- generation: :class:`Generator` (prefill through the sequence mode with packed prompts,
  many decode steps per compiled call, continuous batching on a donated state pool, the
  official sampler and penalties: :class:`Sampling`) and :func:`generate`, a one-call wrapper;
- text in, text out: :class:`TextGenerator` (a tokenizer, by default the RWKV "World" one,
  :class:`WorldTokenizer`, and a Generator; streams text as it completes, stop strings);
- thin Linen wrappers of the bare operators in :mod:`rwkv_jax.nn.linen`.
"""

try:
    import flax  # noqa: F401
except ModuleNotFoundError as err:
    if err.name != "flax":
        raise
    raise ImportError('rwkv_jax.nn needs flax: pip install "rwkv_jax[flax]" (flax, optax, '
                      'safetensors)') from err

from .checkpoint import (load_rwkv6, load_rwkv6_layer, load_rwkv7, read_checkpoint,
                         rwkv6_config, rwkv6_state_dict, rwkv7_config, rwkv7_state_dict,
                         save_rwkv6, save_rwkv7)
from .common import LayerState, TimeMixState
from .generate import Generation, Generator, Sampling, generate, sample_logits
from .loss import chunked_cross_entropy
from .rwkv6 import RWKV6Block, RWKV6ChannelMix, RWKV6Config, RWKV6LM, RWKV6TimeMix
from .rwkv7 import RWKV7Block, RWKV7ChannelMix, RWKV7Config, RWKV7LM, RWKV7TimeMix
from .text import TextGeneration, TextGenerator, WorldTokenizer

__all__ = [
    "RWKV7Config", "RWKV7TimeMix", "RWKV7ChannelMix", "RWKV7Block", "RWKV7LM",
    "RWKV6Config", "RWKV6TimeMix", "RWKV6ChannelMix", "RWKV6Block", "RWKV6LM",
    "LayerState", "TimeMixState",
    "load_rwkv7", "load_rwkv6_layer", "read_checkpoint", "rwkv7_config", "rwkv7_state_dict",
    "save_rwkv7", "load_rwkv6", "rwkv6_config", "rwkv6_state_dict", "save_rwkv6",
    "Generator", "Sampling", "generate", "Generation", "sample_logits",
    "TextGenerator", "TextGeneration", "WorldTokenizer", "chunked_cross_entropy",
]

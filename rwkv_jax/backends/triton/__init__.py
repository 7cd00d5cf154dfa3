"""The ``triton`` backend: chunked Triton kernels (``rwkv_jax.triton_kernels``) launched from JAX.

Modules:

- :mod:`.launch`: the one way a kernel is launched (jax-triton on GPU, Triton's interpreter
  on CPU through a ``jax.pure_callback``), and :func:`~.launch.kernels`, which imports a kernel
  module;
- :mod:`.common`: what both op families share: the list of sequences ``cu``, the slot
  arithmetic of the per-chunk buffers, the head-size check;
- :mod:`.rwkv7`: RWKV-7 (``KernelConfig``, ``default_config``, ``CONFIG_OVERRIDES``, the
  64-token launches and the 16-token forward, the op, its sequence-parallel pieces);
- :mod:`.gla`: gated linear attention and RWKV-6, and their sequence-parallel pieces.

:func:`sequence_parallel_pieces`, which :mod:`rwkv_jax.shard` looks up on this package, picks
the family's.

The names below are the backend's entry points. ``rwkv7`` here is the op, not the module: take
the module's other names with ``from rwkv_jax.backends.triton.rwkv7 import ...``, and patch
a setting (``CONFIG_OVERRIDES``, ``GLA_OVERRIDES``) on the module that defines it. Whether the
backend runs on a platform is :mod:`rwkv_jax.backends._triton_probe`'s to say, since importing
this package imports Triton.
"""

from . import gla as _gla
from . import rwkv7 as _rwkv7_module
from .common import SequencePieces
from .gla import gated_linear_attention, rwkv6
from .rwkv7 import (CHUNK64, KernelConfig, backward_chunk64_k_side,
                    backward_chunk64_v_side, default_config, forward_chunk64, rwkv7, tame_path)

__all__ = ["CHUNK64", "KernelConfig", "SequencePieces", "backward_chunk64_k_side",
           "backward_chunk64_v_side", "default_config", "forward_chunk64",
           "gated_linear_attention", "rwkv6", "rwkv7", "sequence_parallel_pieces", "tame_path"]


def sequence_parallel_pieces(op, options):
    """The triton kernels' :class:`SequencePieces` of ``op`` for rwkv_jax.shard."""
    if op == "rwkv7":
        return _rwkv7_module.sequence_pieces(options)
    if op in ("rwkv6", "gated_linear_attention"):
        return _gla.sequence_pieces(op, options)
    return None

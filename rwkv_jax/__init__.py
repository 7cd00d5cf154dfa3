"""rwkv_jax: JAX kernels for the RWKV family of linear-attention operators."""

from .backends import BackendUnavailableError
from .compat import RWKV6_OP, generalized_delta_rule, get_generalized_delta_rule, rwkv7_op
from . import fla
from .ops import gated_linear_attention, rwkv4, rwkv6, rwkv6_step, rwkv7, rwkv7_step
from .shard import shard

__version__ = "0.1.0"

__all__ = [
    "rwkv7", "rwkv6", "rwkv4", "gated_linear_attention", "rwkv7_step", "rwkv6_step",
    "generalized_delta_rule", "rwkv7_op", "get_generalized_delta_rule", "RWKV6_OP",
    "BackendUnavailableError", "shard",
]

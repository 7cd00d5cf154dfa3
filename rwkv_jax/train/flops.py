"""The project's model FLOP utilisation, used by the training loop and
``benchmarks/train_throughput.py`` alike.

``MFU = tokens/s * F / (devices * peak)`` with ``F = 6 N + 24 L C K`` FLOPs per token: ``N`` the
parameters without the embedding table (a lookup, not a product; the head counts), ``24 L C K``
the wkv recurrence (per layer and head four K x K products per token, 2 FLOPs each, times 3 for
forward + backward), ``peak`` the device's dense bfloat16 peak.
"""

from __future__ import annotations

from typing import Optional

# Dense bfloat16 TFLOP/s, from the SXM data sheets.
PEAK_BF16_TFLOPS = {"NVIDIA H100": 989.0, "NVIDIA H200": 989.0}


def flops_per_token(model_config, parameters: int) -> int:
    """``6 N + 24 L C K`` for an RWKV7Config and its total parameter count."""
    counted = parameters - model_config.vocab_size * model_config.n_embd
    return 6 * counted + 24 * model_config.n_layer * model_config.n_embd * model_config.head_size


def peak_tflops(device_kind: str) -> Optional[float]:
    """The dense bfloat16 peak of a known device kind (None for others)."""
    return next((v for k, v in sorted(PEAK_BF16_TFLOPS.items(), reverse=True)
                 if device_kind.startswith(k)), None)


def mfu(tokens_per_s: float, flops: int, devices: int, peak: Optional[float]) -> Optional[float]:
    """The fraction of ``devices`` x ``peak`` TFLOP/s that ``tokens_per_s`` uses (None without
    a peak)."""
    return None if peak is None else tokens_per_s * flops / (devices * peak * 1e12)

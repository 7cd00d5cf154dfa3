"""The language-model loss without full float32 logits.

At a vocabulary of 65536, ``[tokens, V]`` float32 logits (and their gradient) are the largest
tensors of a training step. :func:`chunked_cross_entropy` computes the same mean softmax
cross-entropy from the hidden states and the head's kernel, one slice of the vocabulary at a
time: a running log-sum-exp in float32, each slice's logits recomputed in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _checks as checks


def chunked_cross_entropy(x, kernel, labels, *, vocab_chunk=8192, l2wrap=0.0, weights=None):
    """Mean over tokens of ``logsumexp(l) - l[label]`` for the logits ``l = x @ kernel``.

    ``x [..., C]`` (any floating dtype; the products run in it and accumulate in float32, or
    float64 for float64 ``x``),
    ``kernel [C, V]`` (cast to ``x``'s dtype, as a ``dtype=x.dtype`` ``nnx.Linear`` head does),
    ``labels [...]`` integers in ``[0, V)``. Never holds more than ``[..., vocab_chunk]`` logits;
    the scan over slices of the vocabulary is rematerialised in the backward, so its memory is
    that of one slice plus three float32 values per token. Batch and sequence shardings of ``x``
    are kept (every slice is a product with the whole of ``x``).

    ``weights`` (floating ``[...]``, like ``labels``; None: every token 1) makes the mean a
    weighted one, ``sum(weights * ce) / sum(weights)``, and 0 when the weights sum to 0 (a
    batch whose every target is masked out); 0 leaves a token out (e.g. the first token of a
    document, predicted across a state reset).

    ``l2wrap`` > 0 adds RWKV-LM's L2-wrap to the gradient, not to the value: at each of the
    ``n`` tokens the largest logit ``m`` gets ``l2wrap * m / n`` more gradient (RWKV-LM: 1e-4),
    which keeps the logits from drifting up. It is the gradient of ``l2wrap * mean(m**2) / 2``
    (with ``weights``, their weighted mean: ``l2wrap * w * m / sum(w)`` at each token), added
    here as that term minus its own value, so the result is still the cross-entropy.
    """
    x = checks.floating("x", x)
    kernel = checks.floating("kernel", kernel)
    labels = checks.integer("labels", labels)
    if kernel.ndim != 2 or x.shape[-1:] != kernel.shape[:1] or labels.shape != x.shape[:-1]:
        raise ValueError(f"need x [..., C], kernel [C, V] and labels [...] with x's leading "
                         f"shape; got x {tuple(x.shape)}, kernel {tuple(kernel.shape)}, "
                         f"labels {tuple(labels.shape)}")
    if isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, int) or vocab_chunk < 1:
        raise ValueError(f"vocab_chunk must be a positive int, got {vocab_chunk!r}")
    if isinstance(l2wrap, bool) or not isinstance(l2wrap, (int, float)) or not l2wrap >= 0:
        raise ValueError(f"l2wrap must be a number >= 0, got {l2wrap!r}")
    if weights is not None:
        weights = checks.floating("weights", weights)
        if weights.shape != labels.shape:
            raise ValueError(f"weights must have labels' shape {tuple(labels.shape)}, got "
                             f"{tuple(weights.shape)}")
    channels, vocab = kernel.shape
    values = checks.host_values(labels)
    if values is not None and values.size and (values.min() < 0 or values.max() >= vocab):
        raise ValueError(f"labels must be in [0, {vocab}) (the vocabulary), got values from "
                         f"{values.min()} to {values.max()}")
    chunk = min(vocab_chunk, vocab)
    slices = -(-vocab // chunk)
    kernel = jnp.pad(jnp.asarray(kernel), ((0, 0), (0, slices * chunk - vocab)))
    kernel = jnp.moveaxis(kernel.reshape(channels, slices, chunk), 1, 0)   # [slices, C, chunk]
    starts = jnp.arange(slices, dtype=jnp.int32) * chunk
    labels = jnp.asarray(labels)
    wide = jnp.promote_types(x.dtype, jnp.float32)
    # The products run in x's dtype, but x enters the scan widened: its gradient, a sum over the
    # slices, then accumulates in float32 rather than being rounded to 16 bits at every slice.
    dtype, x = x.dtype, jnp.asarray(x).astype(wide)

    @jax.checkpoint
    def step(carry, inputs):
        top, total, picked = carry
        w, start = inputs
        logits = jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=wide)
        column = start + jnp.arange(chunk, dtype=jnp.int32)
        logits = jnp.where(column < vocab, logits, -jnp.inf)   # the padding past V
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        total = (total * jnp.exp(top - new_top)
                 + jnp.sum(jnp.exp(logits - new_top[..., None]), axis=-1))
        picked = picked + jnp.sum(jnp.where(column == labels[..., None], logits, 0.0), axis=-1)
        return (new_top, total, picked), None

    lead = x.shape[:-1]
    start = (jnp.full(lead, -jnp.inf, wide), jnp.zeros(lead, wide), jnp.zeros(lead, wide))
    (top, total, picked), _ = jax.lax.scan(step, start, (kernel, starts))
    if weights is None:
        mean = jnp.mean
    else:
        weights = jnp.asarray(weights).astype(wide)
        weight = jnp.sum(weights)
        # The where keeps a zero total from dividing (and from a NaN gradient).
        scale = jnp.where(weight > 0, 1 / jnp.where(weight > 0, weight, 1), 0)
        mean = lambda values: jnp.sum(weights * values) * scale
    loss = mean(top + jnp.log(total) - picked)
    if l2wrap:
        wrap = 0.5 * l2wrap * mean(jnp.square(top))
        loss = loss + (wrap - jax.lax.stop_gradient(wrap))
    return loss

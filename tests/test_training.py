"""The chunked language-model loss against the plain one, and benchmarks/train_throughput.py as
a smoke test on CPU devices (tests/conftest.py makes 8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from reference import relative_error
from scripts import load_script
from rwkv_jax.nn import chunked_cross_entropy


def _plain(x, kernel, labels):
    logits = jnp.dot(x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _case(dtype, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(3 * rng.standard_normal((2, 5, 16)), dtype)
    kernel = jnp.asarray(rng.standard_normal((16, vocab)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, vocab, (2, 5)), jnp.int32)
    return x, kernel, labels


# Relative error allowed against float64: float32's accumulation, or one rounding of the
# gradient to bfloat16 (2**-8), which the plain loss's gradient carries too.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-8}


@pytest.mark.parametrize("vocab_chunk", [16, 50, 64])   # a padded last slice, one slice, wider
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_cross_entropy_equals_the_plain_loss(dtype, vocab_chunk):
    """Loss and gradients as the plain loss (float32 logits) gives them in float64, from the
    same rounded inputs (the kernel rounded to x's dtype, as the products use it)."""
    x, kernel, labels = _case(dtype)
    got, (dx, dk) = jax.value_and_grad(
        lambda *a: chunked_cross_entropy(*a, vocab_chunk=vocab_chunk), argnums=(0, 1))(
        x, kernel, labels)
    with jax.enable_x64(True):
        x64, k64 = (np.asarray(y.astype(dtype), np.float64) for y in (x, kernel))
        want, (dx1, dk1) = jax.value_and_grad(_plain, argnums=(0, 1))(
            jnp.asarray(x64), jnp.asarray(k64), labels)
    assert got.dtype == jnp.float32 and dx.dtype == x.dtype and dk.dtype == kernel.dtype
    assert abs(float(got) - float(want)) <= 1e-6 * abs(float(want))
    assert relative_error(dx, dx1) <= TOLERANCE[dtype]
    assert relative_error(dk, dk1) <= TOLERANCE[dtype]


def test_chunked_cross_entropy_never_holds_full_logits():
    """XLA's compiled memory for the gradient: the [tokens, V] float32 logits of the plain loss
    are not there (what is left is a few [C, V] copies of the kernel and its gradient, small
    where tokens are many more than channels, as in training)."""
    x = jax.ShapeDtypeStruct((1, 1024, 16), jnp.float32)
    kernel = jax.ShapeDtypeStruct((16, 16384), jnp.float32)
    labels = jax.ShapeDtypeStruct((1, 1024), jnp.int32)

    def temp_bytes(f):
        grad = jax.jit(jax.grad(f, argnums=(0, 1)))
        return grad.lower(x, kernel, labels).compile().memory_analysis().temp_size_in_bytes

    logits = 1024 * 16384 * 4
    assert temp_bytes(_plain) >= logits
    assert temp_bytes(lambda *a: chunked_cross_entropy(*a, vocab_chunk=128)) < logits / 8


def test_chunked_cross_entropy_nan_in_nan_out():
    x, kernel, labels = _case("float32")
    assert np.isnan(float(chunked_cross_entropy(x.at[0, 0, 0].set(jnp.nan), kernel, labels)))


@pytest.mark.parametrize("change, message", [
    (dict(labels=np.full((2, 5), 50, np.int32)), r"labels must be in \[0, 50\)"),
    (dict(labels=np.zeros((2, 4), np.int32)), "need x"),
    (dict(kernel=np.zeros((8, 50), np.float32)), "need x"),
    (dict(vocab_chunk=0), "vocab_chunk must be a positive int"),
])
def test_chunked_cross_entropy_errors(change, message):
    x, kernel, labels = _case("float32")
    args = {**dict(x=x, kernel=kernel, labels=labels, vocab_chunk=16), **change}
    with pytest.raises(ValueError, match=message):
        chunked_cross_entropy(args.pop("x"), args.pop("kernel"), args.pop("labels"), **args)


@pytest.mark.parametrize("parallel", ["data", "seq"])
def test_train_throughput_smoke(parallel):
    """benchmarks/train_throughput.py --model tiny on 2 of this process's CPU devices: it trains
    (the loss falls on its repeated batch) and reports; the breakdown and gradient accumulation
    once (sequence)."""
    bench = load_script("benchmarks/train_throughput.py")
    argv = ["--model", "tiny", "--devices", "2", "--batch", "2", "--seq", "16", "--steps", "1",
            "--warmup", "1", "--backend", "native", "--parallel", parallel]
    result = bench.run(bench.parse_args(
        argv + (["--breakdown", "--accumulation", "2"] if parallel == "seq" else [])))
    assert result["devices"] == 2 and result["tokens_per_s"] > 0
    assert result["losses"][-1] < result["losses"][0]
    assert len(result["peak_bytes_per_device"]) == 2
    if parallel == "seq":
        assert set(result["breakdown_ms"]) == {
            "wkv kernels", "projections, LoRAs, token shift, channel mix", "norms",
            "head and loss", "optimizer", "other (embedding, collectives, overlap)"}
    assert "tokens/s" in bench.report(result)

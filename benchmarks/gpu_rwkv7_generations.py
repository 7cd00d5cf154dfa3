"""RWKV-7's two Triton kernel generations side by side, in one process: the 16-token kernels
(KernelConfig.chunk = 16) against the 64-token WY kernels (chunk = 64; a call that is not
differentiated takes their forward without residuals, the state pass writing the outputs),
on the cases that decide whether the 16-token kernels can go:

- inference (not differentiated), B=8 T=4096: H=64 K=64 and H=32 K=128;
- K=32 (H=128, B=8, T=4096): inference and training (forward+backward);
- one sequence of 65536 tokens, H=32 K=64: inference and training;
- the exact path (decays below -1 force it), K=64 H=64 B=8: inference and training.

Every case is bf16 with random non-zero inputs and model-range decays (as ``rwkv_jax._bench``
draws them; the exact cases also set every 97th token's decays to -5), timed as the median of
many calls. Each generation is first checked against the float64 reference of tests/reference.py
at a small size of the same kind (K, decays, inference or training: outputs, final state and,
for training, every gradient). For inference the 64-token forward is also timed with its
residuals (what a differentiated call's forward runs) and with the state pass at one pipeline
stage (KernelConfig.state_stages). One table at the end; ``--out FILE`` also writes it
as JSON.

    source benchmarks/gpu_env.sh   # on the GPU machine: wheels, PYTHONPATH
    python benchmarks/gpu_rwkv7_generations.py [--reps 50] [--out FILE]
    python benchmarks/gpu_rwkv7_generations.py --smoke   # CPU, Triton's interpreter, tiny

Without the 16-token training kernels (KernelConfig has no ``chunk`` field) it compares the
forwards alone; without the 16-token forward too, it times the 64-token kernels alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
import reference  # noqa: E402  (tests/reference.py)
from _log import log, median_seconds  # noqa: E402  (benchmarks/_log.py)
from reference import relative_error  # noqa: E402

import rwkv_jax  # noqa: E402
from rwkv_jax.backends import tolerance  # noqa: E402
from rwkv_jax.backends import triton as triton_backend  # noqa: E402
from rwkv_jax.backends.triton.rwkv7 import CONFIG_OVERRIDES  # noqa: E402

NAMES = tuple("rwkvab")
EXACT_DECAY = -5.0  # below -1 (tame_path's bound): the call takes the exact in-chunk path
EXACT_EVERY = 97    # tokens between the exact cases' strong decays


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    steps: int
    heads: int
    key: int
    train: bool       # forward+backward, else the forward of a call not differentiated
    exact: bool = False


CASES = [
    Case("inference K=64 H=64", 8, 4096, 64, 64, False),
    Case("inference K=128 H=32", 8, 4096, 32, 128, False),
    Case("inference K=32 H=128", 8, 4096, 128, 32, False),
    Case("training K=32 H=128", 8, 4096, 128, 32, True),
    Case("inference T=65536 K=64 H=32", 1, 65536, 32, 64, False),
    Case("training T=65536 K=64 H=32", 1, 65536, 32, 64, True),
    Case("inference exact K=64 H=64", 8, 4096, 64, 64, False, exact=True),
    Case("training exact K=64 H=64", 8, 4096, 64, 64, True, exact=True),
]


def generations(case):
    """(name, KernelConfig) of each generation the backend has for this case (its shape, and
    whether it is differentiated): the 16-token kernels while they exist (KernelConfig.chunk),
    then the 16-token forward while it exists (chunk64_inference off), and the 64-token ones."""
    base = triton_backend.default_config(case.key, case.key, case.batch * case.heads)
    fields = {f.name for f in dataclasses.fields(base)}
    # (the 64-token forward for calls not differentiated: chunk64_inference, later inference64)
    inference = next((n for n in ("chunk64_inference", "inference64") if n in fields), None)
    sixty_four = dict({inference: True} if inference else {},
                      **{"chunk": 64} if "chunk" in fields else {})
    if "chunk" in fields:
        sixteen = dict(chunk=16)
    elif inference and not case.train:
        sixteen = {inference: False}
    else:
        return [("64", dataclasses.replace(base, **sixty_four))]
    return [("16", dataclasses.replace(base, **sixteen)),
            ("64", dataclasses.replace(base, **sixty_four))]


def _field(config, name):
    """A KernelConfig field by its name, or by its earlier name chunk64_<name>."""
    return getattr(config, name) if hasattr(config, name) else getattr(config, f"chunk64_{name}")


def draw(seed, batch, steps, heads, key, exact, dtype):
    """Model-range inputs (``rwkv_jax._bench.make_case``'s distributions) drawn on the device,
    in ``dtype``, and a float32 initial state; the exact cases' strong decays on every
    EXACT_EVERY-th token."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 7)
    shape = (batch, steps, heads, key)
    normal = lambda k: jax.random.normal(k, shape, jnp.float32)
    kk = normal(keys[0])
    kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
    w = -np.exp(-0.5) * jax.nn.sigmoid(normal(keys[1]))
    if exact:
        w = w.at[:, ::EXACT_EVERY].set(EXACT_DECAY)
    x = dict(r=normal(keys[2]), w=w, k=normal(keys[3]), v=normal(keys[4]), a=-kk,
             b=kk * jax.nn.sigmoid(normal(keys[5])))
    x = {n: a.astype(dtype) for n, a in x.items()}
    x["initial_state"] = 0.1 * jax.random.normal(keys[6], (batch, heads, key, key), jnp.float32)
    return x


def op(x):
    return rwkv_jax.rwkv7(*(x[n] for n in NAMES), initial_state=x["initial_state"],
                          backend="triton")


def with_config(case, config, fn):
    """fn run (traced and compiled) with the backend's configuration for the case's K set."""
    def run(*args):
        CONFIG_OVERRIDES[(case.key, case.key)] = config
        try:
            return fn(*args)
        finally:
            CONFIG_OVERRIDES.pop((case.key, case.key), None)
    return run


def programs(case, config):
    """The case's jitted call under ``config`` and its arguments' builder: the forward, or
    forward+backward (every gradient)."""
    if case.train:
        def call(x, do, dht):
            return jax.vjp(op, x)[1]((do, dht))[0]
    else:
        call = op
    return jax.jit(with_config(case, config, call))


def check(case, config, small):
    """Relative errors against float64 at the small size of the case's kind."""
    batch, steps, heads = small
    x = draw(1, batch, steps, heads, case.key, case.exact, jnp.bfloat16)
    x64 = {n: np.asarray(a, np.float64) for n, a in x.items()}
    ref_out, ref_state = reference.forward("rwkv7", x64)
    out, state = jax.jit(with_config(case, config, op))(x)
    errors = dict(out=relative_error(out, ref_out), state=relative_error(state, ref_state))
    if case.train:
        rng = np.random.default_rng(2)
        do = jnp.asarray(rng.standard_normal(ref_out.shape), jnp.bfloat16)
        dht = jnp.asarray(rng.standard_normal(ref_state.shape), jnp.float32)
        grads = programs(case, config)(x, do, dht)
        ref_grads = reference.gradients("rwkv7", x64, np.asarray(do, np.float64),
                                        np.asarray(dht, np.float64))
        errors.update({f"d{n}": relative_error(grads[n], ref_grads[n]) for n in ref_grads})
    bound = max(tolerance("triton", "bfloat16"))
    worst = max(errors.values())
    return worst, bool(np.isfinite(worst) and worst <= bound)


def timed(case, config, reps, scale, options=None):
    """Median ms of the case's call at its (scaled) size under ``config``; ``options``:
    "residuals" times the 64-token forward with its residuals (the forward of a differentiated
    call) instead of the op."""
    batch, steps, heads = scale(case)
    x = draw(0, batch, steps, heads, case.key, case.exact, jnp.bfloat16)
    if options == "residuals":
        fn = jax.jit(lambda x: triton_backend.forward_chunk64(
            *(x[n] for n in NAMES), initial_state=x["initial_state"], residuals=True,
            block_v=config.block_v, recurrence_block_v=config.recurrence_block_v,
            bf16_residuals=_field(config, "bf16_residuals"),
            state_stages=_field(config, "state_stages")))
        return 1e3 * median_seconds(fn, x, reps=reps)
    fn = programs(case, config)
    if case.train:
        do = jax.random.normal(jax.random.PRNGKey(3), (batch, steps, heads, case.key),
                               jnp.bfloat16)
        dht = jnp.zeros((batch, heads, case.key, case.key), jnp.float32)
        return 1e3 * median_seconds(fn, x, do, dht, reps=reps)
    return 1e3 * median_seconds(fn, x, reps=reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=50, help="timed calls per measurement")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, a few calls (CPU, Triton's interpreter)")
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    parser.add_argument("--out", help="also write the table as JSON to this file")
    args = parser.parse_args()
    if args.smoke:
        scale, small, reps = (lambda case: (1, 70, 1)), (1, 70, 1), 1
    else:
        scale, small, reps = (lambda case: (case.batch, case.steps, case.heads)), (2, 300, 2), \
            args.reps
    log(f"devices: {jax.devices()}; jax {jax.__version__}")
    rows = []
    for case in CASES:
        if args.only not in case.name:
            continue
        row = dict(case=case.name)
        for name, config in generations(case):
            worst, ok = check(case, config, small)
            row[f"{name} ms"] = timed(case, config, reps, scale)
            row[f"{name} error"] = worst
            row[f"{name} ok"] = ok
            log(f"{case.name}: {name}-token {row[f'{name} ms']:.3f} ms, worst error {worst:.2e} "
                f"({'PASS' if ok else 'FAIL'})")
            if name == "64" and not case.train:
                row["64 with residuals ms"] = timed(case, config, reps, scale, "residuals")
                log(f"{case.name}: 64-token with residuals {row['64 with residuals ms']:.3f} ms")
                stages = next((n for n in ("chunk64_state_stages", "state_stages")
                               if hasattr(config, n)), None)
                if stages:
                    one_stage = dataclasses.replace(config, **{stages: 1})
                    row["64 one stage ms"] = timed(case, one_stage, reps, scale)
                    log(f"{case.name}: 64-token, state pass at one stage "
                        f"{row['64 one stage ms']:.3f} ms")
        rows.append(row)
    columns = ["16 ms", "64 ms", "64 with residuals ms", "64 one stage ms", "16 error",
               "64 error"]
    log("")
    log(f"{'case':30s}" + "".join(f"{c:>22s}" for c in columns) + f"{'64 / 16':>9s}")
    for row in rows:
        cells = "".join(f"{row[c]:22.3f}" if c in row and c.endswith("ms") else
                        f"{row[c]:>17.2e} {'PASS' if row[c[:-6] + ' ok'] else 'FAIL'}"
                        if c in row else f"{'-':>22s}" for c in columns)
        ratio = f"{row['64 ms'] / row['16 ms']:9.3f}" if "16 ms" in row else f"{'-':>9s}"
        log(f"{row['case']:30s}{cells}{ratio}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if not all(row[k] for row in rows for k in row if k.endswith(" ok")):
        sys.exit("an error past the bfloat16 tolerance (FAIL above)")


if __name__ == "__main__":
    main()

"""The cost of ops._causal_nan (the recompute behind a non-finite final state). Same process: rwkv7 B=8 T=4096 bf16 through the public op, with ops' causal-NaN guard and
without it (ops.spreads_nan_in_chunks patched to False), interleaved A B A B. Forward: o
returned; forward+backward: the gradient of sum(o * c) for every input (o feeds the loss)."""
import sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests")
import jax, jax.numpy as jnp, numpy as np
from _log import median_seconds
import reference, rwkv_jax, rwkv_jax.ops as ops
guard = ops.spreads_nan_in_chunks
cases = [c.split(":") for c in (sys.argv[1] if len(sys.argv) > 1 else "ffi:64,ffi:128,triton:64").split(",")]
print("devices", jax.devices(), flush=True)
for backend, key in cases:
    key = int(key); heads = 4096 // key
    x = reference.random_inputs("rwkv7", np.random.default_rng(0), batch=8, steps=4096, heads=heads, key=key)
    args = [jnp.asarray(x[n], jnp.bfloat16) for n in "rwkvab"]
    c = jnp.asarray(np.random.default_rng(1).standard_normal(args[3].shape), jnp.bfloat16)
    res = {}
    for rnd in range(2):
        for label, fn in (("guard", guard), ("none", lambda *a: False)):
            ops.spreads_nan_in_chunks = fn
            f = jax.jit(lambda *a: rwkv_jax.rwkv7(*a, backend=backend, output_final_state=False)[0])
            loss = lambda *a: (rwkv_jax.rwkv7(*a, backend=backend, output_final_state=False)[0] * c).astype(jnp.float32).sum()
            g = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
            res.setdefault(label, []).append((median_seconds(f, *args, reps=25) * 1e3, median_seconds(g, *args, reps=25) * 1e3))
    for label, r in res.items():
        print(f"rwkv7 {backend} H={heads} K={key} bf16 {label}: fwd " + " / ".join(f"{a:.3f}" for a, _ in r)
              + " ms, fwd+bwd " + " / ".join(f"{b:.3f}" for _, b in r) + " ms", flush=True)
ops.spreads_nan_in_chunks = guard

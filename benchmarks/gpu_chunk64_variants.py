"""The 64-token RWKV-7 path in three timed stages, one process per variant: the forward with
its residuals (in-chunk kernel, state pass, outputs), the V side (state-gradient pass, V-side
gradients) and the K side (dA and K-side kernels), at B=8 T=4096 H=4096/K bf16, model-range
inputs (``rwkv_jax._bench.make_case``, as the main job's bench): where a kernel change moves
the time, without fla or the whole op.

    source benchmarks/gpu_env.sh   # on the GPU machine: wheels, PYTHONPATH
    python benchmarks/gpu_chunk64_variants.py \
        'base={}|uncapped={"k": {"max_registers": {"tame": null}}}' 128,64

A variant is JSON: "fwd", "v", "k": keyword arguments of ``forward_chunk64``,
``backward_chunk64_v_side`` and ``backward_chunk64_k_side`` (e.g. ``warps``, ``max_registers``:
caps over the function's defaults, null for none); "stages": those to time (default ["fwd",
"v", "k"]; ["fwd"]: the forward alone; "k" runs "v" too, for its inputs); "patch": {"path":
[[old, new], ...]}, text replacements in a copy of the tree (each ``old`` must occur once),
which the variant's process imports instead. ``@FILE``: the variants from FILE, a JSON object
(name -> variant). Each stage is timed as the main benchmark times the op (``gpu_rwkv7.time_jax``:
median ms); their sum includes a little dispatch that the op's one jitted call does not pay.
Off the GPU it runs a toy size in Triton's interpreter (a smoke test). The register caps were
chosen with it (BENCHMARKS.md, "Decisions that shaped the kernels").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(fn, *args):
    """(median ms of ``fn(*args)``, as the main benchmark times it, and its output)."""
    from gpu_rwkv7 import time_jax  # (benchmarks/, beside this script)
    return time_jax(fn, *args), fn(*args)


def child(variant, size):
    import jax
    import jax.numpy as jnp
    from rwkv_jax._bench import make_case
    from rwkv_jax.backends import triton as backend
    batch, steps, heads = 8, 4096, 4096 // size
    if jax.default_backend() != "gpu":  # (the interpreter: a smoke test)
        batch, steps, heads, size = 1, 70, 2, 16
    x = make_case("rwkv7", batch, steps, heads, size).as_dtype(jnp.bfloat16)
    inputs = [jnp.asarray(x[n]) for n in "rwkvab"]
    do_key, dht_key = jax.random.split(jax.random.PRNGKey(0))
    do = jax.random.normal(do_key, inputs[3].shape, jnp.float32).astype(jnp.bfloat16)
    dht = jax.random.normal(dht_key, (batch, heads, size, size), jnp.float32)
    forward = jax.jit(lambda *a: backend.forward_chunk64(*a, residuals=True,
                                                         **variant.get("fwd", {})))
    stages = variant.get("stages", ["fwd", "v", "k"])
    t_forward, (o, _, residuals) = timed(forward, *inputs)
    t_v = t_k = 0.0
    grads = [o]
    if "v" in stages or "k" in stages:
        v_side = jax.jit(lambda *a: backend.backward_chunk64_v_side(*a, **variant.get("v", {})))
        t_v, (dv, _, dstates, _, dx) = timed(v_side, *inputs, residuals, do, dht)
        grads.append(dv)
    if "k" in stages:
        k_side = jax.jit(lambda *a: backend.backward_chunk64_k_side(*a, **variant.get("k", {})))
        t_k, k_grads = timed(k_side, *inputs, residuals, do, dstates, dx)
        grads += list(k_grads)
    finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
    print(json.dumps(dict(fwd=round(t_forward, 3), v=round(t_v, 3), k=round(t_k, 3),
                          total=round(t_forward + t_v + t_k, 3), finite=finite)))


def patched_tree(name, patches):
    """A copy of the tree at /tmp/chunk64_variant_<name> with ``patches`` applied."""
    root = f"/tmp/chunk64_variant_{name}"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(ROOT, root, symlinks=True,
                    ignore=shutil.ignore_patterns(".whl", ".gpu-cache", ".git", ".venv"))
    for path, pairs in patches.items():
        with open(os.path.join(root, path)) as f:
            text = f.read()
        for old, new in pairs:
            if text.count(old) != 1:
                raise ValueError(f"variant {name}: {old[:60]!r} occurs {text.count(old)} times "
                                 f"in {path}, not once")
            text = text.replace(old, new)
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    return root


def main():
    if sys.argv[1].startswith("@"):  # a JSON object name -> variant (patches outgrow a command)
        with open(sys.argv[1][1:]) as f:
            variants = [(name, json.dumps(v)) for name, v in json.load(f).items()]
    else:
        variants = [v.split("=", 1) for v in sys.argv[1].split("|")]
    sizes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["128", "64"]
    for name, spec in variants:
        patches = json.loads(spec).get("patch", {})
        root = patched_tree(name, patches) if patches else ROOT
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                      if p and os.path.abspath(p) != ROOT]))
        for size in sizes:
            start = time.time()
            result = subprocess.run(
                [sys.executable, os.path.join(root, "benchmarks", os.path.basename(__file__)),
                 "--child", spec, size], capture_output=True, text=True, env=env, cwd=root)
            lines = result.stdout.strip().splitlines()
            line = lines[-1] if lines else result.stderr[-800:]
            print(f"{name:12s} K={size}: {line}  ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]), int(sys.argv[3]))
    else:
        main()

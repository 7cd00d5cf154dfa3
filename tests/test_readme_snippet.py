"""The README's sharding snippet, run as a user runs it: a script on 8 CPU devices with the
``triton`` backend (Triton's interpreter) that ends right after the call. It used to print
``jax.pure_callback failed ... can't register atexit after shutdown`` and die with a segfault,
since the interpreter's callbacks were still running when Python shut down
(rwkv_jax/backends/triton/launch.py)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from rwkv_jax import backends

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# Tiny realistic inputs (RWKV-7: a = -kk, b = kk * iclr, w in the model's range) named as the
# snippet uses them; the snippet itself comes verbatim from the README.
SETUP = """
import functools
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
import rwkv_jax

rng = np.random.default_rng(0)
B, T, H, K = 2, 8, 1, 16
r, k, v, iclr, raw = (rng.standard_normal((B, T, H, K)) for _ in range(5))
kk = k / np.linalg.norm(k, axis=-1, keepdims=True)
w = -np.exp(-0.5) / (1.0 + np.exp(-raw))
r, w, k, v, a, b = (jnp.asarray(x, jnp.float32)
                    for x in (r, w, k, v, -kk, kk / (1.0 + np.exp(-iclr))))
h0 = jnp.asarray(0.5 * rng.standard_normal((B, H, K, K)), jnp.float32)
"""


def _sharding_snippet():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if "rwkv_jax.shard(" in b and 'backend="triton"' in b]
    assert len(found) == 1, "README.md should hold one sharding snippet with backend=\"triton\""
    return found[0]


@pytest.mark.skipif(backends.unavailable_reason("triton", "cpu") is not None,
                    reason="the triton backend cannot run on this CPU")
def test_readme_sharding_snippet_exits_cleanly():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, "-c", SETUP + _sharding_snippet()], env=env,
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{output[-4000:]}"
    for symptom in ("pure_callback failed", "atexit", "Traceback", "Fatal Python error"):
        assert symptom not in output, f"{symptom!r} in the output:\n{output[-4000:]}"

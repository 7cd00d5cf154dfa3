"""Whether the ``triton`` backend can run on a platform (the registry's probe), outside the
``rwkv_jax.backends.triton`` package: importing that package imports Triton and the kernels,
which the probe must not need (on a machine without Triton it says so instead of failing)."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional


def unavailable_reason(platform: str) -> Optional[str]:
    """None if Triton kernels can run on ``platform``, else why not (the backend's probe)."""
    if platform == "gpu":
        try:
            import_jax_triton()
        except Exception as err:
            return (f"jax_triton does not import ({type(err).__name__}: {err}); "
                    f"install rwkv_jax[gpu] (BUILD.md: jax-triton next to a CUDA jaxlib)")
        return None
    if platform == "cpu":
        # Found, not imported: triton must first be imported with TRITON_INTERPRET=1 set.
        if importlib.util.find_spec("triton") is None:
            return ("on CPU the Triton kernels run in Triton's interpreter, which needs triton "
                    "(pip install triton)")
        return None
    return f"Triton kernels run on NVIDIA GPUs (or interpreted on CPU), not on {platform!r}"


def import_jax_triton():
    """jax_triton, without its import-time ``TRITON_CACHE_DIR=""``, which would leave every
    other Triton user of the process (torch, say) unable to compile."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
    return jax_triton

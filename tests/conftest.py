"""Shared test set-up: 8 CPU devices, the backends under test, tolerances, the gpu marker.

A backend joins the whole suite by registration alone: every test that takes a ``backend``
argument runs once per registered backend that can run here and implements the test's op
(``op`` argument). ``RWKV_JAX_TEST_BACKENDS=native,chunked`` narrows the set.
"""

import jax

# Before anything initialises a JAX backend: the sharding tests need 8 CPU devices.
jax.config.update("jax_num_cpu_devices", 8)

import os  # noqa: E402
import tempfile  # noqa: E402

# The suite's time is mostly XLA:CPU compiling small programs. LLVM's optimisation level 0 and
# XLA:CPU's elemental emitters instead of its fusion emitters compile them 4-7x faster (the
# gradient of chunked rwkv7 at T=37: 4.7 -> 0.7 s; native: 1.3 -> 0.3 s) and leave the math as
# written (no fast-math either way). The main job (`rwkv-jax check`, which CI runs too) checks
# every op x backend with XLA's defaults.
# XLA aborts on a flag it does not know, and jaxlib 0.11 (the GPU image's 0.11.2) has no
# fusion-emitter flag any more: it goes only to older jaxlibs.
_CPU_FLAGS = ["--xla_backend_optimization_level=0"]
if jax.__version_info__ < (0, 11):
    _CPU_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *_CPU_FLAGS]))

# Many tests compile the same program (same op, shapes and options; other values): JAX's
# persistent compilation cache, shared by the xdist workers of one run, compiles each once.
# A fresh directory per run, so a run's time is what a fresh clone's CI run takes.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(tempfile.gettempdir(), "rwkv_jax_tests", _RUN))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402

from rwkv_jax import backends  # noqa: E402

# DESIGN.md, "Numerical contract": relative error against float64, per backend and input dtype.
def tolerance(backend, dtype, kind):
    """Allowed relative error of ``kind`` ("forward" or "gradient") for inputs of ``dtype``:
    the numerical contract each backend declares when it registers."""
    forward, gradient = backends.tolerance(backend, dtype)
    return forward if kind == "forward" else gradient


def _backends_under_test():
    platform = backends.platform()
    available = [n for n in backends.names() if backends.unavailable_reason(n, platform) is None]
    requested = os.environ.get("RWKV_JAX_TEST_BACKENDS", "").strip()
    if not requested:
        return available
    chosen = [n.strip() for n in requested.split(",") if n.strip()]
    for name in chosen:
        if name not in backends.names():
            raise pytest.UsageError(f"RWKV_JAX_TEST_BACKENDS names unknown backend {name!r}; "
                                    f"registered: {', '.join(backends.names())}")
        reason = backends.unavailable_reason(name, platform)
        if reason is not None:
            raise pytest.UsageError(f"RWKV_JAX_TEST_BACKENDS names {name!r}, which cannot run "
                                    f"here: {reason}")
    return chosen


BACKENDS_UNDER_TEST = _backends_under_test()


def has_gpu():
    return any(d.platform == "gpu" for d in jax.devices())


def pytest_report_header(config):
    return f"rwkv_jax backends under test: {', '.join(BACKENDS_UNDER_TEST)}"


def _parametrized_by_the_test(metafunc, name):
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return True
    return False


def pytest_generate_tests(metafunc):
    """A ``backend`` argument means: every backend under test (unless the test lists its own)."""
    if "backend" in metafunc.fixturenames and not _parametrized_by_the_test(metafunc, "backend"):
        metafunc.parametrize("backend", BACKENDS_UNDER_TEST)


def pytest_collection_modifyitems(config, items):
    """Deselect (backend, op) pairs the backend does not implement, and gpu tests where there
    is no GPU (they run through benchmarks/gpu_suite.sh on a GPU machine)."""
    gpu = has_gpu()
    keep, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        backend, op = (params.params.get("backend"), params.params.get("op")) if params else (None, None)
        unimplemented = backend is not None and op is not None and not backends.implements(backend, op)
        if unimplemented or ("gpu" in item.keywords and not gpu):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep

"""``rwkv-jax info``: versions, devices, the backends available here (or why not) and the
default backend of each op. ``collect_info`` is also the ``info`` of ``bench --json``."""

from __future__ import annotations

import importlib.metadata
import os
import platform as host

import jax

from .. import __version__, backends
from ..backends import ffi as ffi_backend
from ._print import error_text, format_table

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "numpy", "triton", "torch", "jax-triton", "flax")
ENVIRONMENT = ("RWKV_JAX_BACKEND", "KERNEL_TYPE", "JAX_PLATFORMS")


def register(commands) -> None:
    parser = commands.add_parser(
        "info", help="versions, devices, backends available here and why not",
        description="Versions, devices, the backends available here (or why not) and the "
        "default backend of each op.")
    parser.set_defaults(handler=run)


def run(args) -> int:
    print_info(collect_info())
    return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_info() -> dict:
    """Versions, devices, backends and the default backend of each op, as plain data."""
    defaults = {}
    for op in backends.OPS:
        try:
            defaults[op] = backends.resolve(op, None)[0]
        except Exception as err:  # reported, not fatal: info must always print
            defaults[op] = f"none ({error_text(err)})"
    return dict(
        rwkv_jax=__version__,
        python=host.python_version(),
        machine=f"{host.system()} {host.machine()}, {os.cpu_count()} CPU cores",
        packages={name: _version(name) for name in PACKAGES},
        platform=backends.platform(),
        devices=[f"{d.id}: {d.device_kind} ({d.platform})" for d in jax.devices()],
        cuda_kernels=ffi_backend.cuda_build_report(),
        environment={v: os.environ[v] for v in ENVIRONMENT if os.environ.get(v)},
        backends=backends.describe(),
        defaults=defaults,
    )


def summary_lines(info: dict) -> list[str]:
    """The lines above the tables, one per fact of ``collect_info``'s."""
    lines = [f"rwkv_jax {info['rwkv_jax']} on Python {info['python']}, {info['machine']}",
             "packages: " + ", ".join(f"{name} {version or '-'}"
                                      for name, version in info["packages"].items()),
             f"platform: {info['platform']}; devices: " + "; ".join(info["devices"]),
             f"CUDA kernels (ffi): {info['cuda_kernels']}"]
    if info["environment"]:
        lines.append("environment: " + ", ".join(f"{k}={v}"
                                                 for k, v in info["environment"].items()))
    return lines


def print_info(info: dict) -> None:
    print("\n".join(summary_lines(info)))
    print()
    rows = [[b["name"], "yes" if b["available"] else "no",
             " ".join(b["ops"]) if b["available"] else b["reason"], b["summary"]]
            for b in info["backends"]]
    print(format_table(["backend", "here", "ops (or why not)", "what"], rows))
    print()
    print(format_table(["op", "default backend here"],
                       [[op, name] for op, name in info["defaults"].items()]))

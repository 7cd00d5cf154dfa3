"""Every ```python block of README.md and of the docs pages runs as written: a page's blocks in
order, as one script in a fresh process on the CPU (a reader runs them that way), which must exit
cleanly. Blocks not meant to run (signatures, GPU or network commands) are fenced as text or
bash, never as python.

The sharding page runs the triton backend (Triton's interpreter) on 8 simulated CPU devices and
ends right after the call: that used to print ``jax.pure_callback failed ... can't register
atexit after shutdown`` and die with a segfault, since the interpreter's callbacks were still
running when Python shut down (rwkv_jax/backends/triton/launch.py)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# An opening fence of python (``` or ~~~, any length, optionally indented in a list) and its
# closing fence of the same kind.
BLOCK = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`]*)[^\n]*\n"
                   r"(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$", re.M | re.S)
# What a clean exit must not print: the interpreter bridge's shutdown failure, and any crash.
SYMPTOMS = ("pure_callback failed", "atexit", "Traceback", "Fatal Python error")


def python_blocks(page: pathlib.Path) -> list[str]:
    blocks = []
    for match in BLOCK.finditer(page.read_text()):
        if match["lang"] in ("python", "py"):
            indent = match["indent"]
            blocks.append("".join(line[len(indent):] if line.startswith(indent) else line
                                  for line in match["body"].splitlines(keepends=True)))
    return blocks


RUNNABLE = {page.relative_to(ROOT).as_posix(): python_blocks(page) for page in PAGES}
RUNNABLE = {name: blocks for name, blocks in RUNNABLE.items() if blocks}


def test_the_pages_that_show_code_have_runnable_blocks():
    expected = {"README.md", "docs/quickstart.md", "docs/sharding.md", "docs/models.md",
                "docs/generation.md", "docs/training.md", "docs/migration.md",
                "docs/contract.md", "docs/backends.md"}
    assert expected <= set(RUNNABLE), f"pages without python blocks: {expected - set(RUNNABLE)}"
    sharding = [b for b in RUNNABLE["docs/sharding.md"]
                if "rwkv_jax.shard(" in b and 'backend="triton"' in b]
    assert sharding, "docs/sharding.md should shard a triton-backed op"


def test_blocks_are_found_whatever_their_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("a\n```python\nx = 1\n```\n```text\nno\n```\n"
                    "- item\n\n  ~~~~python\n  y = 2\n  ~~~~\n")
    assert python_blocks(page) == ["x = 1\n", "y = 2\n"]


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_page_runs(name, tmp_path):
    script = "\n".join(RUNNABLE[name])
    compile(script, name, "exec")       # a SyntaxError names the page before anything runs
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    env.pop("RWKV_JAX_BACKEND", None)
    env.pop("KERNEL_TYPE", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: exit status {proc.returncode}:\n{output[-4000:]}"
    for symptom in SYMPTOMS:
        assert symptom not in output, f"{name}: {symptom!r} in the output:\n{output[-4000:]}"
    assert proc.stdout.strip(), f"{name}: its blocks printed nothing"

"""Sphinx configuration of the rwkv_jax documentation (Markdown pages through MyST)."""

import importlib.metadata

project = "rwkv_jax"
author = "the rwkv_jax authors"
release = importlib.metadata.version("rwkv_jax")
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Links to headings inside pages (e.g. BUILD.md#the-build) and the included files' headings.
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"      # the signatures say it; the docstrings explain it

html_theme = "furo"
html_title = "rwkv_jax"

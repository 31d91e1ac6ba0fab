"""Sphinx configuration of the tfjax documentation (MyST Markdown pages, API
reference from docstrings). Build: `make docs`, i.e.

    sphinx-build -W --keep-going -b html docs docs/_build/html

Offline by design: no intersphinx inventories are fetched and nothing is
downloaded at build time. tfjax is imported from this checkout (autodoc), on CPU.
"""

from __future__ import annotations

import os
import pkgutil
import re
import sys

from sphinx.util.docutils import SphinxDirective

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
# Importing tfjax must not probe for accelerators (libtpu is installed with the test
# extra) or grab a GPU's memory while the docs build.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "tfjax"
author = "the tfjax authors"
copyright = "the tfjax authors, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures carry them; jaxtyping aliases render poorly
autodoc_default_options = {"members": True}
# tfjax.eval.harness makes lm-eval's model class (tfjax.eval.tasks); lm_eval is the
# `eval` extra, not the `docs` one.
autodoc_mock_imports = ["lm_eval", "tqdm"]  # the `eval` extra (tfjax.eval.harness)

try:
    import furo  # noqa: F401

    html_theme = "furo"
except ImportError:  # the docs extra installs it; alabaster ships with Sphinx
    html_theme = "alabaster"
html_title = "tfjax"
html_static_path: list[str] = []


# --------------------------------------------------------------------------- #
# Every module of tfjax is in the API reference.
# --------------------------------------------------------------------------- #

_AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)", re.M)


def _package_modules() -> set[str]:
    import tfjax

    names = {"tfjax"}
    for info in pkgutil.walk_packages(tfjax.__path__, "tfjax."):
        leaf = info.name.rsplit(".", 1)[-1]
        if not leaf.startswith("_"):
            names.add(info.name)
    return names


def _check_api_coverage(app, env, *args):
    """Warn (an error under -W) about a tfjax module no page documents with
    `.. automodule::`, so a new or renamed module cannot drop out of the reference."""
    from sphinx.util import logging

    documented = set()
    api = os.path.join(app.srcdir, "api")
    for name in sorted(os.listdir(api)):
        if name.endswith(".md"):
            with open(os.path.join(api, name)) as f:
                documented.update(_AUTOMODULE.findall(f.read()))
    log = logging.getLogger(__name__)
    for module in sorted(_package_modules() - documented):
        log.warning(f"API reference: module {module} is on no page of docs/api/; add an "
                    f"automodule for it")
    for module in sorted(documented - _package_modules()):
        log.warning(f"API reference: docs/api/ documents {module}, which is not a tfjax module")


# --------------------------------------------------------------------------- #
# Docstrings are Markdown.
# --------------------------------------------------------------------------- #
# tfjax's docstrings are written in Markdown, the syntax of these pages: code in
# single backticks (`dot_product_attention(q, k, v)`, `[B, T, N, H]`), indented code
# blocks, `-` lists with hanging indents, `|q_pos - kv_pos|`. autodoc hands docstrings
# to reStructuredText, which reads those as substitutions, block quotes and broken
# lists; so every docstring is wrapped in a directive that parses it with MyST, as
# the pages are parsed. The signatures and the object structure stay autodoc's.


class _MarkdownDocstring(SphinxDirective):
    """`.. tfjax-docstring::` content parsed as MyST Markdown."""

    has_content = True

    def run(self):
        from docutils.utils import new_document
        from myst_parser.mdit_to_docutils.sphinx_ import SphinxRenderer
        from myst_parser.parsers.mdit import create_md_parser

        source, line = self.get_source_info()
        document = new_document(source, self.state.document.settings)
        document.reporter = self.state.document.reporter
        parser = create_md_parser(self.env.myst_config, SphinxRenderer)
        parser.options["document"] = document
        parser.render("\n".join(self.content))
        return list(document.children)


def _docstring_as_markdown(app, what, name, obj, options, lines):
    if any(line.strip() for line in lines):
        lines[:] = [".. tfjax-docstring::", ""] + [f"   {l}" if l else "" for l in lines] + [""]


def setup(app):
    app.add_directive("tfjax-docstring", _MarkdownDocstring)
    app.connect("autodoc-process-docstring", _docstring_as_markdown)
    app.connect("env-updated", _check_api_coverage)

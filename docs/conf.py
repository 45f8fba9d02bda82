"""Sphinx configuration of the headwise documentation site.

Build it (warnings are errors, as in CI) with::

    pip install -c constraints.txt -e ".[dev]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST); the API reference is rendered from the docstrings
(autodoc, Google style through napoleon). Pictures, tables and the "how attention works"
page are produced by the code while the site builds (``_ext/generated.py``), except
timings: a build never measures, it renders the benchmark run committed in
``_measured/bench.json`` (written by ``python tools/measure_docs.py`` on a quiet machine).
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path

from docutils import nodes

import headwise

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "headwise"
author = "The headwise authors"
copyright = "2026, the headwise authors"
release = version = headwise.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
    "constants",  # _ext/constants.py: module constants with the comments written beside them
    "generated",  # _ext/generated.py: runs headwise at build time for the generated pages and pictures
    "viewcode_links",  # _ext/viewcode_links.py: the source pages' "[docs]" links land on their entries
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "_generated/*.md",  # pulled into pages with {include}, not pages of their own
    # The copy GitHub readers follow from README.md; the site generates its own at build time
    # (attention.md), and tests/test_explain.py keeps this one current.
    "how-attention-works.md",
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # an override without a docstring (forward, extra_repr) gets none of torch's
autodoc_preserve_defaults = True  # show `scale=None` as written, not a repr of a computed default
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_attr_annotations = True

# Cross-references to headwise's own names must resolve (strict mode turns a broken one into
# an error); names of other libraries (torch, the standard library) are not checked, since
# the build has no network for their inventories, and neither are private names.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(?!headwise\.).*"),
    (r"py:.*", r"headwise(\.\w+)*\._\w+.*"),
    (r"py:func", r"headwise\.functional\.attend"),  # the internal entry point kernels' docs name
    (r"py:(func|class)", r"headwise\.functional\.(prepare|Prepared)"),  # the memo's internal call (module/memo.py)
]

html_theme = "furo"
html_title = f"headwise {release}"
html_static_path = ["_static"]
html_css_files = ["headwise.css"]


def _is_method(obj: object) -> bool:
    """A method, property or nested class of a class, as opposed to a data attribute (a field's
    default may itself be a function, defined elsewhere: that is data)."""
    if inspect.isclass(obj) or isinstance(obj, property | functools.cached_property):
        return True
    func = getattr(obj, "__func__", obj)  # classmethod, staticmethod
    return inspect.isfunction(func) and "." in func.__qualname__ and func.__name__ != "<lambda>"


def _skip_class_data(app, what: str, name: str, obj, skip: bool, options) -> bool | None:
    """Leave a class's data attributes (dataclass fields, class constants) to its docstring.

    The "Attributes:" section of a Google-style docstring already documents them, with a
    sentence each; autodoc listing them again, bare, would describe every field twice.
    Methods and properties are kept.
    """
    if what == "class" and not _is_method(obj):
        return True
    return None


def _drop_object_base(app, doctree) -> None:
    """No "Bases: object" line under every dataclass: only real base classes are worth a line."""
    for paragraph in list(doctree.findall(nodes.paragraph)):
        if paragraph.astext().strip() == "Bases: object":
            paragraph.parent.remove(paragraph)


def setup(app) -> None:
    app.connect("autodoc-skip-member", _skip_class_data)
    app.connect("doctree-read", _drop_object_base)

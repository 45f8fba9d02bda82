"""Sphinx extension: ``.. headwise-constants:: MODULE``, the module's public constants.

autodoc documents a module-level constant only when a ``#:`` comment or a docstring goes
with it; headwise's constants carry plain ``#`` comments (``headwise.policy`` explains each
threshold that way) or none. This directive documents every public constant of a module
(the names of ``__all__`` where the module has one, else the names it assigns at top level
without a leading underscore), each with the comment written above it or beside it.
Functions, classes and modules are left to ``automodule``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import types

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

_RST_SPECIAL = re.compile(r"([\\*`|_])")
_RULE = re.compile(r"^-{2,}.*-{2,}$")  # a section rule such as "---- tiles ----"
_MAX_VALUE = 80  # longer reprs (dicts of kernels, weight maps) are left out of the signature


def _comments(source: str) -> dict[str, list[str]]:
    """name -> the comment lines directly above its top-level assignment, then the one beside it."""
    lines = source.splitlines()
    found: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if not names:
            continue
        above, row = [], node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#"):
            text = lines[row].strip().lstrip("#").strip()
            if _RULE.match(text):
                break
            above.insert(0, text)
            row -= 1
        code = lines[node.end_lineno - 1]
        beside = code.split("  # ", 1)[1].strip() if "  # " in code else ""
        for name in names:
            found[name] = above + ([beside] if beside else [])
    return found


def public_constants(module: types.ModuleType) -> list[str]:
    """The module's public names that are neither functions, classes nor modules, in order."""
    if hasattr(module, "__all__"):
        names = list(module.__all__)
    else:
        names = [n for n in _comments(inspect.getsource(module)) if not n.startswith("_")]
    out = []
    for name in names:
        value = getattr(module, name)
        if inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value):
            continue
        if isinstance(value, logging.Logger):
            continue
        out.append(name)
    return out


class ConstantsDirective(SphinxDirective):
    """``.. headwise-constants:: headwise.policy`` (option ``:exclude:`` names, comma-separated)."""

    required_arguments = 1
    option_spec = {"exclude": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        modname = self.arguments[0]
        module = importlib.import_module(modname)
        excluded = {n.strip() for n in self.options.get("exclude", "").split(",") if n.strip()}
        comments = _comments(inspect.getsource(module))
        rst: list[str] = []
        for name in public_constants(module):
            if name in excluded:
                continue
            rst.append(f".. autodata:: {modname}.{name}")
            if len(repr(getattr(module, name))) > _MAX_VALUE:
                rst.append("   :no-value:")
            rst.append("")
            text = " ".join(comments.get(name, []))
            if text:
                rst += ["   " + _RST_SPECIAL.sub(r"\\\1", text), ""]
        container = nodes.section()
        self.state.nested_parse(StringList(rst, source=f"<headwise-constants {modname}>"), self.content_offset,
                                container)
        return container.children


def _drop_type_docstring(app: Sphinx, what: str, name: str, obj: object, options, lines: list[str]) -> None:
    """A constant without a docstring of its own would show its type's (``dict``'s, ``Kernel``'s):
    drop that, so only the comment written with the constant remains."""
    if what == "data" and lines:
        own = inspect.getdoc(type(obj)) or ""
        if own and lines[0].strip() == own.splitlines()[0].strip():
            lines.clear()


def setup(app: Sphinx) -> dict:
    app.add_directive("headwise-constants", ConstantsDirective)
    app.connect("autodoc-process-docstring", _drop_type_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

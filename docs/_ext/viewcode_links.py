"""Sphinx extension: the "[docs]" links of the highlighted source pages land on their entry.

``sphinx.ext.viewcode`` links each object on a source page back to its entry as
``<page>#<module>.<name>``, with one module name per source page: the module it first saw
documented from there. headwise documents many objects where users import them
(``headwise.MultiHeadAttention``, not ``headwise.module.MultiHeadAttention``), and the old
names page documents aliases of the same functions, so that pairing sends links to anchors
that do not exist. This extension rewrites each link, once the page is rendered, to an entry
the Python domain really holds for the same object (found by importing both), preferring
the page viewcode chose and never the old names page when another exists.
"""

from __future__ import annotations

import importlib
import inspect
import re

from sphinx.application import Sphinx

_BLOCK = re.compile(r'(<div class="viewcode-block" id="(?P<name>[^"]+)">\s*<a class="viewcode-back" href=")'
                    r'(?P<href>[^"]+)(")')
_OLD_NAMES = "api/deprecated"  # the old names page: a last resort


def _resolve(dotted: str) -> object | None:
    """The object a dotted name names: the longest importable module, then attributes; None if none."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = inspect.getattr_static(obj, attr) if inspect.isclass(obj) else getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _home(obj: object) -> tuple[str, str] | None:
    """(defining module, qualified name) of a function, class, method or property."""
    obj = getattr(obj, "fget", None) or getattr(obj, "__func__", None) or obj  # property, class/staticmethod
    obj = inspect.unwrap(obj) if callable(obj) else obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return (module, qualname) if isinstance(module, str) and isinstance(qualname, str) else None


def documented(app: Sphinx) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(defining module, qualified name) -> [(docname, anchor)] of every documented Python object."""
    cached = getattr(app.env, "_headwise_documented", None)
    if cached is not None:
        return cached
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for fullname, entry in app.env.get_domain("py").objects.items():  # type: ignore[attr-defined]
        if entry.aliased:
            continue
        home = _home(_resolve(fullname))
        if home is not None:
            found.setdefault(home, []).append((entry.docname, entry.node_id))
    app.env._headwise_documented = found  # type: ignore[attr-defined]
    return found


def fix_backlinks(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Point each "[docs]" link of a ``_modules/`` page at an anchor its target page holds."""
    if not pagename.startswith("_modules/") or "body" not in context:
        return
    modname = pagename.removeprefix("_modules/").replace("/", ".")
    homes = documented(app)

    def relink(match: re.Match) -> str:
        entries = homes.get((modname, match["name"]))
        if not entries:
            return match[0]
        page, _, anchor = match["href"].partition("#")
        uri = {docname: app.builder.get_relative_uri(pagename, docname) for docname, _ in entries}
        right = any(uri[docname] == page and node_id == anchor for docname, node_id in entries)
        if right and (page != uri.get(_OLD_NAMES) or len(uri) == 1):
            return match[0]  # viewcode's link is right (and not to the old names, with a better page)
        docname, node_id = min(entries, key=lambda e: (e[0] == _OLD_NAMES, uri[e[0]] != page))
        return f'{match[1]}{uri[docname]}#{node_id}{match[4]}'

    context["body"] = _BLOCK.sub(relink, context["body"])


def setup(app: Sphinx) -> dict:
    app.connect("html-page-context", fix_backlinks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

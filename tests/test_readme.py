"""README.md's claims that code can check: the layout section names every source file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "headwise"


def layout_files() -> set[str]:
    """Paths (relative to src/headwise) the README's layout tree names."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Layout\n\n```\n(.*?)```", text, re.S).group(1)
    named, folder = set(), ""
    for line in block.splitlines()[1:]:  # after "src/headwise/"
        indent = len(line) - len(line.lstrip())
        words = line.split()
        if not words:
            continue
        if indent == 2:  # a new entry: a folder ("kernels/"), a file, or files of the top level
            folder = words[0] if words[0].endswith("/") else ""
        for word in words:
            word = word.strip("(),")
            if word.endswith(".py"):
                named.add(word if "/" in word else folder + word)
    return named


def _holds_code(path: Path) -> bool:
    """False for a file that is only a docstring (a sub-package's __init__.py)."""
    body = ast.parse(path.read_text()).body
    return not (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant))


def test_the_layout_names_every_source_file_and_only_those():
    real = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _holds_code(p)}
    named = layout_files()
    assert named - real == set(), "README's layout names files that do not exist"
    assert real - named == set(), "README's layout leaves these files out"

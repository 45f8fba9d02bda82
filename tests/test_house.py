"""House rules that read the source: STYLE.md's "the house", checked over src/headwise."""

from __future__ import annotations

import ast
from pathlib import Path

import headwise

SOURCE = Path(headwise.__file__).parent  # src/headwise, whichever copy is imported
LIMIT = 80  # lines from a function's def to its last line, docstring included


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    """``path:line name (n lines)`` for every function or method in ``root`` longer than ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_long_functions_finds_one_over_the_limit_and_none_at_it(tmp_path):
    body = [f"x{i} = {i}" for i in range(LIMIT - 1)]  # with its def: LIMIT lines, at the limit
    function = "def at():\n" + "".join(f"    {line}\n" for line in body)
    method = "class C:\n    def over(self):\n" + "".join(f"        {line}\n" for line in [*body, "y = 0"])
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(function + "\n\n" + method)
    assert long_functions(tmp_path / "pkg") == [f"pkg/m.py:{LIMIT + 4} over ({LIMIT + 1} lines)"]
    assert long_functions(tmp_path / "pkg", LIMIT - 1) == [f"pkg/m.py:1 at ({LIMIT} lines)",
                                                         f"pkg/m.py:{LIMIT + 4} over ({LIMIT + 1} lines)"]


def test_no_function_over_80_lines():
    """STYLE.md: no function over 80 lines (def line to end line); a longer one is several functions."""
    found = long_functions(SOURCE)
    assert not found, f"over {LIMIT} lines (split each into steps):\n" + "\n".join(found)

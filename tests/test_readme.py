"""README.md, the front door: short, every Python block runs alone as written, no indented
code, and the test command CI runs is the one it shows.

Each fenced ``python`` block runs as ``python -c`` in a process of its own (a reader pastes one
block, not the page), forked from one that has imported only torch (``tests/fresh_process.py``);
blocks not meant to run use another fence (``bash``, ``text``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from conftest import markdown_blocks, run_python_block

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PYTHON_BLOCKS = [(line, code) for lang, line, code in markdown_blocks(README, "fence") if lang == "python"]


def test_the_readme_is_a_front_door_of_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize(("line", "code"), PYTHON_BLOCKS, ids=[f"README.md:{line}" for line, _ in PYTHON_BLOCKS])
def test_every_python_block_runs_alone_in_a_fresh_interpreter(line, code, tmp_path):
    if re.search(r"^\s*(from|import) transformers\b", code, re.M) and not importlib.util.find_spec("transformers"):
        pytest.skip("the hf extra is not installed: pip install -e '.[hf]'")
    run = run_python_block(code, cwd=tmp_path)
    assert run.returncode == 0, f"README.md:{line} failed alone:\n{run.stderr[-3000:]}"


def test_the_readme_shows_one_example_of_each_main_use():
    text = "".join(code for _, code in PYTHON_BLOCKS)
    for use in ("MultiHeadAttention(", "mask_mod=", "score_mod=", "new_cache(", "PagedKVCache",
                "integrations.transformers", "headwise.trace()", "merge_attentions("):
        assert use in text, use
    assert len(PYTHON_BLOCKS) >= 7


def test_the_readme_has_no_indented_code_block():
    assert [line for _, line, _ in markdown_blocks(README, "code_block")] == []


def test_ci_runs_the_test_command_the_readme_shows():
    """.ci/run greps README.md for its test command: it must be there, install the project with
    the extras the suite needs, and run pytest on two processes (pytest-xdist, the dev extra)."""
    ci = (ROOT / ".ci" / "run").read_text()
    pattern = re.search(r"grep -m1 -E '([^']+)' README.md", ci).group(1)
    found = [line for line in README.read_text().splitlines() if re.search(pattern, line)]
    assert found, f"no README line matches {pattern!r}"
    assert found[0] == 'pip install -c constraints.txt -e ".[dev,hf]" && python -m pytest -q -n 2'
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"pytest-xdist>=[\d.]+"', pyproject)


def test_the_teaching_documents_are_introduced_where_first_named():
    text = " ".join(README.read_text().split())
    first = text.index("teaching document")
    sentence = text[text.rfind(".", 0, first) + 1: text.index(".", first) + 1]
    assert "Chinese tutorials on multi-head self-attention" in sentence
    assert "print every stage's shape" in sentence and "equivalent ways" in sentence


def test_every_relative_link_of_the_readme_exists():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links and [link for link in links if not (ROOT / link).exists()] == []

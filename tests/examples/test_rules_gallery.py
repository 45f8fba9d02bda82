"""examples/rules_gallery.py --quick: four rules equal the textbook formula, and their tile
maps are drawn into --out."""

from __future__ import annotations

import re

import pytest

from conftest import run_example

pytest.importorskip("matplotlib", reason="the pictures need matplotlib: pip install -e '.[plot]'")


def test_quick_run_matches_the_textbook_and_draws_every_tile_map(tmp_path):
    run = run_example("rules_gallery.py", "--quick", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    diffs = [float(d) for d in re.findall(r"from the textbook formula ([\d.e+-]+)", run.stdout)]
    assert len(diffs) == 4 and max(diffs) < 1e-10, run.stdout
    for name in ("document", "prefix_lm", "sliding_window", "t5_bias"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "written as a plain function gives the same output: True" in run.stdout

"""examples/hf_model.py --quick: a transformers model with headwise inside equals eager
attention (logits and greedy tokens, with left padding), offline."""

from __future__ import annotations

import re

import pytest

from conftest import run_example

pytest.importorskip("transformers", minversion="5", reason="the hf extra is not installed: pip install -e '.[hf]'")


def test_quick_run_matches_eager_attention():
    run = run_example("hf_model.py", "--quick")
    assert run.returncode == 0, run.stderr[-3000:]
    diff = float(re.search(r"headwise vs eager: max \|difference\| ([\d.e+-]+)", run.stdout).group(1))
    assert diff < 1e-5, run.stdout
    assert "the same tokens True" in run.stdout
    assert "one traced forward: 2 attention calls" in run.stdout  # headwise really ran, once a layer

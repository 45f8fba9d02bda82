"""examples/train_gpt.py --quick: trains (the loss falls), samples with the KV cache, and the
cached generation equals the uncached forward."""

from __future__ import annotations

import re

from conftest import run_example


def test_quick_run_trains_samples_and_matches_the_uncached_forward():
    run = run_example("train_gpt.py", "--quick")
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", run.stdout).groups())
    assert last < first - 1.0, run.stdout  # 40 steps take a character model well below its start
    assert "sampled 40 characters with the KV cache" in run.stdout
    same, diff = re.search(r"same characters (\w+), max \|logits difference\| ([\d.e+-]+)", run.stdout).groups()
    assert same == "True" and float(diff) < 1e-4, run.stdout

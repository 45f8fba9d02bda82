"""examples/same_bits.py --quick: the sampler's logits (paged KV cache, a batch of four decoded
together) equal the trainer's teacher-forced forward bit for bit inside the batch-invariant
mode; outside it they differ (else the example would show nothing)."""

from __future__ import annotations

import re

from conftest import run_example


def test_quick_run_gives_the_trainer_the_samplers_bits_inside_the_mode_only():
    run = run_example("same_bits.py", "--quick")
    assert run.returncode == 0, run.stderr[-3000:]
    inside = re.search(r"inside headwise.batch_invariant\(\): .* bit for bit: (\w+) "
                       r"\(max \|difference\| ([\d.e+-]+)\); log-probabilities equal: (\w+)", run.stdout)
    outside = re.search(r"outside the mode: .* bit for bit: (\w+)", run.stdout)
    assert inside and outside, run.stdout
    assert inside.group(1) == "True" and float(inside.group(2)) == 0.0 and inside.group(3) == "True", run.stdout
    assert outside.group(1) == "False", run.stdout

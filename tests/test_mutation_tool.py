"""tools/mutation.py's arithmetic and parsing (the mutation run itself is a measurement, not a test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("killed", "n", "low", "high"), [
    (95, 100, 0.8882, 0.9785),  # Wilson's interval as the tables give it (Newcombe 1998, method 3)
    (81, 263, 0.2553, 0.3662),  # Newcombe's worked example 81/263
    (15, 148, 0.0624, 0.1605),  # and 15/148
    (0, 20, 0.0, 0.1611),
    (20, 20, 0.8389, 1.0),
])
def test_wilson_interval_matches_published_values(tool, killed, n, low, high):
    got = tool.wilson(killed, n)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_holds_the_rate_and_narrows_with_n(tool):
    for n in (10, 100, 1000):
        low, high = tool.wilson(int(0.9 * n), n)
        assert low < 0.9 < high
    assert tool.wilson(900, 1000)[1] - tool.wilson(900, 1000)[0] < tool.wilson(90, 100)[1] - tool.wilson(90, 100)[0]


def test_mutated_line_names_the_function_and_the_added_line(tool):
    diff = ("--- src/headwise/module/plan.py\n+++ src/headwise/module/plan.py\n@@ -1,2 +1,2 @@\n"
            "-    return a < b\n+    return a <= b  # a comment\n")
    assert tool.mutated_line("headwise.module.plan.x_real_tokens__mutmut_12", diff) == (
        "headwise.module.plan.real_tokens", "return a <= b")
    method = tool.mutated_line("headwise.module.layer.xǁMultiHeadAttentionǁforward__mutmut_3", diff)
    assert method[0] == "headwise.module.layer.MultiHeadAttention.forward"


def test_every_listed_equivalent_has_a_function_a_line_and_a_reason(tool):
    known = tool.equivalents()
    assert len(known) > 100
    for entry, reason in known.items():
        function, mutated = entry.split(" | ", 1)
        assert function.startswith("headwise.") and mutated and reason, entry


def test_sample_refuses_rerun_and_report(tool, tmp_path, capsys):
    with pytest.raises(SystemExit):
        tool.main(["--sample", "5", "--report", str(tmp_path)])
    assert "--sample makes a fresh copy" in capsys.readouterr().err

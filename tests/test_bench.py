"""headwise bench: the measurement plumbing (timings themselves are never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

import headwise
from headwise import bench
from headwise.cli import main
from test_module_oracles import oracle


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    """The tables as a 160-column terminal shows them (the command follows the terminal's width)."""
    monkeypatch.setenv("COLUMNS", "160")


def test_every_implementation_computes_the_same_attention():
    """Every implementation `headwise bench` times computes the same function on its case,
    checked against the float64 formula of tests/test_module_oracles.py."""
    case = bench.Case("padded", 3, 16, 32, 4, lengths=(16, 9, 4))
    x, mask = bench.inputs(case, requires_grad=False)
    with torch.no_grad():
        outs = {impl: bench.build(impl, case)(x, mask) for impl in (*bench.IMPLS, "headwise matmul")}
    want, _ = oracle(bench.headwise_module(case), x, mask)  # the weights every implementation shares
    real = mask[..., None]  # padded query rows: headwise gives zeros, the others attend anyway
    for impl, out in outs.items():
        torch.testing.assert_close(torch.where(real, out.double(), 0.0), want, atol=2e-5, rtol=1e-4, msg=impl)


def test_memory_prediction_reports_out_of_memory_instead_of_running():
    long = bench.Case("long", 1, 32768, 512, 8, lengths=(30000,), dropout=0.1)
    assert bench.predicted_peak_gib("reference", long) > 16
    assert bench.predicted_peak_gib("headwise auto", long) == 0
    measured = bench.measure_in_child("reference", long, limit_gib=16)
    assert measured["train_peak_mib"] is None and measured["note"].startswith("out of memory")


def test_memory_child_measures_a_real_rise():
    case = bench.Case("dense", 1, 2048, 64, 8)  # (B, H, S, S) scores: 128 MiB, kept twice for backward
    measured = bench.measure_in_child("reference", case, limit_gib=4)
    assert measured["note"] == "" and measured["train_peak_mib"] > 128 and measured["train_ms"] > 0
    assert measured["forward_peak_mib"] < measured["train_peak_mib"]  # backward keeps the probabilities


def test_quick_run_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--quick", "--repeats", "1", "--max-repeats", "1", "--no-memory", "--json",
                 str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    impls = {r["impl"] for r in report["results"]}
    assert {"headwise auto", "SDPA module", "torch MHA", "reference"} <= impls
    assert report["matmul_gflops"] > 0 and report["core"]
    for row in report["core"]:  # each rate sits next to the matmul timed in the same rounds
        assert row["of_matmul"] == pytest.approx(row["gflops"] / row["matmul_gflops"])
    for label in {r["case"]["label"] for r in report["results"]}:  # every implementation of a case was timed
        assert all(r["forward_ms"] and r["train_ms"] for r in report["results"] if r["case"]["label"] == label)
    text = capsys.readouterr().out
    assert "/SDPA" in text and "% of matmul" in text
    drawn = bench.sweep(report)  # the quick run has a dense sweep to draw
    assert sorted({r["case"]["S"] for r in drawn}) == [64, 128, 256] and {r["case"]["B"] for r in drawn} == {4}
    bench.plot(report, str(out_png))
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_sweep_is_the_longest_dense_series():
    """What plot draws in a full run: the B=8 E=512 H=8 rows over S, not the other dense cases."""
    def row(group, B, S, E, H, impl="headwise auto"):
        return {"impl": impl, "case": {"group": group, "B": B, "S": S, "E": E, "H": H}}

    results = [row("dense", 32, 128, 512, 8), row("dense", 8, 512, 768, 12), row("padded", 8, 64, 512, 8),
               *(row("dense", 8, s, 512, 8, impl) for s in (64, 256, 1024) for impl in ("a", "b"))]
    drawn = bench.sweep({"results": results})
    assert len(drawn) == 6 and {(r["case"]["B"], r["case"]["E"], r["case"]["H"]) for r in drawn} == {(8, 512, 8)}
    assert bench.sweep({"results": [row("padded", 8, 64, 512, 8)]}) == []


# ---------------------------------------------------------------- issue 25: medians that can be trusted


class _FakeClock:
    """time.perf_counter for the timing loops: each fake function "takes" the next scripted seconds."""

    def __init__(self, seconds):
        self.now, self.seconds = 0.0, iter(seconds)

    def perf_counter(self) -> float:
        return self.now

    def fn(self) -> None:
        self.now += next(self.seconds)


def test_round_robin_repeats_until_the_medians_are_stable(monkeypatch):
    # a warm-up, then a 200 ms hiccup among 1 ms runs: 3 rounds cannot tell, 5 can
    clock = _FakeClock([0.5, 0.001, 0.2, 0.001] + [0.001] * 20)
    monkeypatch.setattr(bench.time, "perf_counter", clock.perf_counter)
    timing = bench.round_robin([clock.fn], repeats=3, max_repeats=20)
    assert timing.stable and timing.rounds == 5 and timing.ms == [pytest.approx(1.0)]
    assert timing.spread == [0.0]


def test_round_robin_reports_medians_that_do_not_settle(monkeypatch):
    clock = _FakeClock([0.5] + [0.001, 0.003] * 10)  # alternating 1 and 3 ms: +-50% or worse
    monkeypatch.setattr(bench.time, "perf_counter", clock.perf_counter)
    timing = bench.round_robin([clock.fn], repeats=3, max_repeats=8)
    assert not timing.stable and timing.rounds == 8
    assert timing.spread[0] == pytest.approx(1.58 * 0.002 / 8**0.5 / 0.002)


def test_round_robin_ms_keeps_its_exact_repeats(monkeypatch):
    clock = _FakeClock([0.5] + [0.001, 0.003] * 10)
    monkeypatch.setattr(bench.time, "perf_counter", clock.perf_counter)
    assert bench.round_robin_ms([clock.fn], 3) == [pytest.approx(1.0)]  # 1, 3, 1 ms: no extra rounds
    assert next(clock.seconds) == 0.003


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"repeats": 0}, r"repeats must be >= 1, got 0; e.g. --repeats 3"),
    ({"repeats": -1}, r"repeats must be >= 1, got -1"),
    ({"repeats": 5, "max_repeats": 3}, r"max_repeats \(3\) must be >= repeats \(5\)"),
    ({"limit_gib": -1}, r"limit_gib must be > 0, got -1; e.g. --memory-limit 16"),
])
def test_run_refuses_bad_settings_before_measuring(kwargs, message, monkeypatch):
    monkeypatch.setattr(bench, "cases", lambda quick: pytest.fail("run measured before checking its settings"))
    with pytest.raises(ValueError, match=message):
        bench.run(quick=True, **kwargs)


def test_bench_warns_on_stderr_naming_the_spread(monkeypatch, capsys):
    """Under load the medians do not settle: the tables still print, and stderr says which and by how much."""
    monkeypatch.setattr(bench, "cases", lambda quick: [bench.Case("dense", 2, 16, 32, 4, backward=False)])
    monkeypatch.setattr(bench, "median_spread", lambda samples: 0.3)  # a busy machine: +-30% every time
    assert main(["bench", "--quick", "--no-memory", "--repeats", "3", "--max-repeats", "4"]) == 0
    captured = capsys.readouterr()
    assert "/SDPA" in captured.out
    lines = captured.err.strip().splitlines()
    err = [" ".join(captured.err.split())]  # one warning, wrapped to the terminal's width
    assert lines[0].startswith("headwise bench: warning: ") and all(line.startswith("  ") for line in lines[1:])
    assert "medians are not stable within +-5% after 4 repeats" in err[0]
    assert "B=2 S=16 E=32 H=4 headwise auto forward: median +-30% after 4 repeats" in err[0]


def test_the_q_k_v_linears_module_computes_what_headwise_does():
    """The second baseline of benchmarks/auto_grid.py: separate q_proj, k_proj, v_proj and
    out_proj with headwise's weights, the same outputs and input gradients on a padded batch
    (padded positions aside: headwise zeroes them)."""
    from headwise.bench import SDPALinearsModule

    mha = headwise.MultiHeadAttention(32, 4)
    ref = SDPALinearsModule.like(mha)
    x = torch.randn(3, 6, 32)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 4, 2])[:, None]  # (B, S)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = mha(x1, mask), ref(x2, mask)
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    ours[mask].sum().backward()
    theirs[mask].sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)

"""headwise bench: the measurement plumbing (timings themselves are never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from headwise import bench
from headwise.cli import main
from test_module_oracles import oracle


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
    assert main(["bench", "--quick", "--repeats", "1", "--no-memory", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    impls = {r["impl"] for r in report["results"]}
    assert {"headwise auto", "SDPA module", "torch MHA", "reference"} <= impls
    assert report["matmul_gflops"] > 0 and report["core"]
    for row in report["core"]:  # each rate sits next to the matmul timed in the same rounds
        assert row["of_matmul"] == pytest.approx(row["gflops"] / row["matmul_gflops"])
    for label in {r["case"]["label"] for r in report["results"]}:  # every implementation of a case was timed
        assert all(r["forward_ms"] and r["train_ms"] for r in report["results"] if r["case"]["label"] == label)
    text = capsys.readouterr().out
    assert "/ SDPA mod" in text and "% of matmul rate" in text
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

"""The benchmark scripts behind "auto"'s cost model still run (tiny sizes, one repeat: no timing is judged)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_pack_cost_measures_every_unit_cost(monkeypatch, capsys):
    """The benchmark runs headwise.tune's procedure (tests/test_tune.py tests the fits): every
    point is timed once, and each fit is taken as it comes (a loaded machine scatters them)."""
    pack_cost = _load("pack_cost")
    from headwise import tune

    monkeypatch.setattr(tune, "_seconds", lambda fn, timing: _once(fn))
    monkeypatch.setattr(tune, "_slope", lambda points, what: 1.0)
    pack_cost.main(["--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# benchmarks/pack_cost.py") and len(lines) == 3
    assert lines[1].startswith("INFERENCE_COSTS = Costs(call_us=") and lines[2].startswith("TRAINING_COSTS = Costs(")


def _once(fn) -> float:
    import time

    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_auto_grid_pairs_the_modules_and_both_paths():
    auto_grid = _load("auto_grid")
    row = auto_grid.pair(2, 16, 32, 2, 0.4, repeats=1, paths=True, window=1e-4)
    assert set(row.ratio) == set(row.other) == set(row.path) == set(row.linears) == {"fwd", "train"}
    assert all(ratio > 0 for ratio in row.linears.values())
    assert all(path in ("dense", "packed") for path in row.path.values())
    assert all(ratio > 0 for ratio in (*row.ratio.values(), *row.other.values()))
    assert 0 < row.padding < 1
    dense = auto_grid.pair(1, 8, 32, 2, 0.0, repeats=1, window=1e-4)
    assert dense.path == {"fwd": "fused", "train": "dense"} and dense.other == {}  # a tiny forward: fused
    assert row.pairs == dense.pairs == {"fwd": 1, "train": 1}  # no budget: the repeats asked for


def test_auto_grid_gives_a_cheap_row_more_pairs_within_its_budget():
    auto_grid = _load("auto_grid")
    row = auto_grid.pair(1, 8, 32, 2, 0.0, repeats=2, window=1e-4, budget=1.0)  # a call: ~0.1 ms (30 on a busy machine)
    assert all(2 < n <= 40 for n in row.pairs.values())  # more than asked, at most 20x


def test_overhead_times_the_fused_path_against_the_dense_one():
    import argparse

    overhead = _load("overhead")
    args = argparse.Namespace(calls=1, repeats=1, cpu_time=True)
    rows = overhead.fused_rows(args, shapes=[(1, 4, 16, 2), (2, 8, 32, 4)])
    assert [row[:4] for row in rows] == [(1, 4, 16, 2), (2, 8, 32, 4)]
    assert all(fused > 0 and dense > 0 for *_, fused, dense in rows)


def test_overhead_times_the_tiny_call_and_a_decode_step_in_cpu_time(monkeypatch):
    import argparse

    from headwise import bench

    overhead = _load("overhead")
    clocks = []
    monkeypatch.setattr(overhead.time, "process_time", lambda: clocks.append(1) or time.perf_counter())
    args = argparse.Namespace(calls=2, repeats=1, steps=2, cpu_time=True)
    ours, theirs = overhead.tiny_pair(args)
    assert len(ours) == len(theirs) == 1 and ours[0] > 0 and theirs[0] > 0
    monkeypatch.setattr(bench, "TOLERANCE", float("inf"))  # one repeat is enough here
    ours, theirs = overhead.decode_pair(args)
    assert len(ours) == len(theirs) >= 1 and all(t > 0 for t in (*ours, *theirs))
    assert len(clocks) >= 8  # every timing read the CPU clock: 2 x 2 tiny, 2 x 2 decode


def test_rules_benchmark_pairs_the_rule_with_the_materialised_mask_and_packed_attention():
    rules = _load("rules")
    ids, lengths = rules.documents(512, 16)
    assert len(lengths) == 16 and sum(lengths) == 512 and min(lengths) >= 16 and ids.shape == (512,)
    rows = rules.document_causal(256, 2, 16, repeats=1)
    assert [name for name, _, _ in rows] == ["helpers, auto (varlen)", "plain function, auto (varlen)",
                                             "plain function, nothing remembered", "plain function, chunked",
                                             "sdpa, materialised mask", "packed_attention"]
    assert "x faster than the materialised mask (target >= 4x)" in rows[1][2] and "packed_attention" in rows[1][2]
    assert all(seconds > 0 for _, seconds, _ in rows)
    names = [name for name, _, _ in rules.tile_map_time(1024, repeats=1)]
    assert names == ["helpers, S = Sk = 1024", "plain function, built", "plain function, remembered"]
    (_, seconds, note), *_ = rules.tile_map_time(1024, repeats=1)
    assert seconds > 0 and "8 x 8 tiles of 128 x 128" in note


def test_paged_benchmark_pairs_each_target_with_its_baseline():
    paged = _load("paged")
    rows = [paged.decode_target(2, 40, 32, 4, 2, repeats=1), *paged.shared_target(3, 32, 16, 32, 4, 2, repeats=1),
            paged.ragged_target([8, 24, 40], 32, 4, 2, repeats=1)]
    assert [name for name, _, _ in rows] == ["paged decode step", "shared prefix step", "shared prefix pool",
                                             "ragged batch step"]
    assert all(value > 0 for _, value, _ in rows)
    assert rows[2][1] == 1.0  # 32 + 3 x 16 tokens in pages of 16: every slot holds a unique token
    users = [paged.shuffled_step_target(2, 40, 4, 2, 8, repeats=1),
             *paged.module_pool_target(2, 32, 32, 4, 2, repeats=1, later=3),
             *paged.shared_target(3, 32, 16, 32, 4, 2, repeats=1, churn=True),
             paged.ragged_target([8, 24, 40], 32, 4, 2, repeats=1, churn=True),
             *paged.prefill_chunk_rows(2, 40, 4, 2, 8, [2, 40], repeats=1)]
    assert [name for name, _, _ in users] == ["shuffled decode step", "module pool, first", "module pool, later",
                                              "shared prefix, churned", "ragged batch, churned", "prefill chunk T=2",
                                              "prefill chunk T=40"]
    assert all(value > 0 for _, value, _ in users)
    cache = paged.paged_cache(paged.module(32, 4, 2), [40, 70], 2, churn=True)
    pages = [cache.pages(s) for s in cache.sequences[-2:]]
    assert any(p != list(range(p[0], p[0] + len(p))) for p in pages)  # the churned pool scatters them


def test_pieces_benchmark_pairs_weights_and_the_lse_with_the_plain_forward():
    pieces = _load("pieces")
    times = pieces.weights_time(64, 2, 16, repeats=1)
    assert set(times) == set(pieces.SIDES) and all(ms > 0 for ms in times.values())
    rows = pieces.lse_overhead(64, 2, 16, repeats=1)
    assert set(rows) == {"sdpa", "chunked"} and all(a > 0 and b > 0 for a, b in rows.values())


def test_contract_cost_takes_a_small_row_apart_and_restores_the_module():
    import torch

    import headwise
    from headwise.module import plan as planning
    from headwise.module import projections as proj

    contract_cost = _load("contract_cost")

    saved = proj.hide_padding, proj.zero_padding_, planning.real_tokens
    padded = contract_cost.padded_row(2, 8, 16, 2, (8, 5), repeats=1, window=1e-4)
    assert (proj.hide_padding, proj.zero_padding_, planning.real_tokens) == saved  # the ablation is undone
    assert set(padded) == {"minimal", "minimal + the three ops", "headwise", "headwise without them", "base_us"}
    training = contract_cost.training_row(1, 8, 16, 2, repeats=1, window=1e-4)
    assert set(training) == {"minimal", "three Linears", "three Linears + the q check", "headwise", "base_us"}
    assert all(v > 0 for v in (*padded.values(), *training.values())) and padded["minimal"] == 1.0
    three = contract_cost.ThreeLinears(16, 2, check_q=True)  # the layout the module has: the same function
    mha = headwise.MultiHeadAttention(16, 2)
    three.load_state_dict(mha.state_dict())
    x = torch.randn(2, 8, 16)
    assert (three(x) - mha(x)).abs().max() < 1e-5

"""The rule helpers (headwise.mask_mods): each equals its formula, and the tiles it claims
empty or full are exactly that when every pair is evaluated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import mask_mods as mm
from headwise.mask_mods import Bounds
from headwise.rules import evaluated_tile_states, grid, mask_tile_states

B, H = 2, 3


def on_grid(mod, S, Sk):
    b, h, q, kv = grid(B, H, (0, S), (0, Sk), None)
    return mod(b, h, q, kv).expand(B, H, S, Sk)


def test_each_helper_equals_its_formula():
    S, Sk = 7, 9
    i = torch.arange(S)[:, None]
    j = torch.arange(Sk)[None, :]
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1, 2, 2]])
    prefix = torch.tensor([2, 5])
    cases = [
        (mm.causal, (j <= i).expand(B, H, S, Sk)),
        (mm.sliding_window(3), ((j <= i) & (j > i - 3)).expand(B, H, S, Sk)),
        (mm.document(ids[0]), (ids[0][:S, None] == ids[0][None, :Sk]).expand(B, H, S, Sk)),
        (mm.document(ids), (ids[:, :S, None] == ids[:, None, :Sk])[:, None].expand(B, H, S, Sk)),
        (mm.prefix_lm(3), ((j < 3) | (j <= i)).expand(B, H, S, Sk)),
        (mm.prefix_lm(prefix), ((j < prefix[:, None, None]) | (j <= i))[:, None].expand(B, H, S, Sk)),
        (mm.and_masks(mm.causal, mm.document(ids)), ((j <= i) & (ids[:, :S, None] == ids[:, None, :Sk]))[:, None]
         .expand(B, H, S, Sk)),
        (mm.or_masks(mm.sliding_window(2), mm.prefix_lm(1)), (((j <= i) & (j > i - 2)) | (j < 1) | (j <= i))
         .expand(B, H, S, Sk)),
        (mm.causal & mm.prefix_lm(4), ((j <= i) & ((j < 4) | (j <= i))).expand(B, H, S, Sk)),
        (mm.causal | mm.sliding_window(2), (j <= i).expand(B, H, S, Sk)),
        (mm.AlignedCausal(Sk - S, 2, 1), ((j <= i + 2) & ((j > i + 2 - 2) | (j < 1))).expand(B, H, S, Sk)),
        (mm.Shifted(mm.causal, 2), (j <= i + 2).expand(B, H, S, Sk)),
    ]
    for mod, want in cases:
        assert torch.equal(on_grid(mod, S, Sk), want), repr(mod)


def _plain(mod):
    """The same rule as a plain function, so tile states come from evaluating every pair."""
    return lambda b, h, q, kv: mod(b, h, q, kv)


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 40), extra=st.integers(0, 12), bq=st.integers(1, 9), bk=st.integers(1, 9),
       window=st.integers(1, 6), sinks=st.integers(0, 3), prefix=st.integers(0, 20), seed=st.integers(0, 99))
def test_tiles_a_helper_calls_empty_or_full_are_so_pair_by_pair(S, extra, bq, bk, window, sinks, prefix, seed):
    Sk = S + extra
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, 4, (B, Sk), generator=gen), dim=1).values
    shuffled = torch.randint(0, 3, (Sk,), generator=gen)  # ids that come back: not contiguous documents
    helpers = [mm.causal, mm.sliding_window(window), mm.AlignedCausal(extra, window, sinks), mm.document(ids),
               mm.document(shuffled), mm.prefix_lm(prefix), mm.prefix_lm(torch.tensor([prefix, 2])),
               mm.and_masks(mm.causal, mm.document(ids)), mm.or_masks(mm.sliding_window(window), mm.prefix_lm(prefix)),
               mm.and_masks(mm.prefix_lm(prefix), _plain(mm.sliding_window(window)))]
    exact = helpers[:2] + helpers[3:4] + helpers[5:7]  # no sink tokens, no ids that come back, no combination
    bounds = Bounds(S, Sk, bq, bk)
    for mod in helpers:
        claimed, exact_states = torch.broadcast_tensors(mask_tile_states(mod, bounds, B, H),
                                                        evaluated_tile_states(_plain(mod), bounds, B, H))
        wrong = (claimed != mm.PARTIAL) & (claimed != exact_states)
        assert not bool(wrong.any()), repr(mod)
        if mod in exact:  # these helpers are exact, not only safe
            assert torch.equal(claimed, exact_states), repr(mod)


def test_document_segments_are_the_runs_of_contiguous_ids():
    assert mm.document(torch.tensor([0, 0, 1, 1, 1, 5])).segments(6, 6) == [[2, 3, 1]]
    assert mm.document(torch.tensor([[0, 0, 1], [0, 1, 2]])).segments(3, 3) == [[2, 1], [1, 1, 1]]
    assert mm.document(torch.tensor([0, 1, 0])).segments(3, 3) is None  # document 0 comes back
    assert mm.document(torch.tensor([0, 0, 1])).segments(2, 3) is None  # S != Sk


def test_t5_buckets_equal_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 300)[None, :]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 16)):
            want = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets,
                                                            max_distance=distance)
            assert torch.equal(mm.t5_bucket(rel, buckets, distance, bidirectional), want)


def test_relative_position_bias_reads_its_table_at_the_bucket_and_head():
    table = torch.randn(8, H, dtype=torch.float64)
    rule = mm.relative_position_bias(table, max_distance=16)
    b, h, q, kv = grid(1, H, (0, 5), (0, 6), None)
    bias = rule.bias(b, h, q, kv)  # (1, H, 5, 6)
    bucket = mm.t5_bucket(kv - q, 8, 16, True)[0, 0]  # (5, 6)
    assert torch.equal(bias[0], table[bucket].permute(2, 0, 1))
    score = torch.randn(1, H, 5, 6, dtype=torch.float64)
    assert torch.equal(rule(score, b, h, q, kv), score + bias)
    embedding = torch.nn.Embedding(8, H)
    assert mm.relative_position_bias(embedding).weight is embedding.weight  # T5's module: its parameter


def test_helpers_refuse_what_cannot_be_a_rule():
    with pytest.raises(ValueError, match="sliding_window needs an int window >= 1, got 0"):
        mm.sliding_window(0)
    with pytest.raises(ValueError, match=r"doc_ids must be an integer tensor \(S,\) or \(B, S\), got torch.float32"):
        mm.document(torch.zeros(4))
    with pytest.raises(ValueError, match="prefix_lengths must be an int or an integer tensor"):
        mm.prefix_lm(torch.zeros(2))
    with pytest.raises(ValueError, match="and_masks needs at least one mask_mod"):
        mm.and_masks()
    with pytest.raises(TypeError, match="or_masks takes mask_mod functions"):
        mm.or_masks(mm.causal, 3)
    with pytest.raises(ValueError, match=r"relative_position_bias needs a float \(num_buckets, H\) table"):
        mm.relative_position_bias(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"doc_ids \(1, 4\) must cover B = 1 rows \(or 1\) and max\(S, Sk\) = 6"):
        mm.document(torch.zeros(4, dtype=torch.long)).check(6, 6, 1)


@pytest.mark.parametrize("lengths", [-3, torch.tensor([2, -1]), [4, -2]], ids=["int", "tensor", "list"])
def test_prefix_lm_refuses_a_negative_prefix_length(lengths):
    with pytest.raises(ValueError, match=r"prefix_lm's prefix_lengths must be >= 0, got -\d at row \d"):
        mm.prefix_lm(lengths)
    assert mm.prefix_lm(0)(0, 0, torch.tensor(1), torch.tensor(2)).item() is False  # 0: causal, still accepted

"""The packing cost model of headwise.policy: what it prices, and that "auto" follows it."""

from __future__ import annotations

import re

import pytest
import torch

import headwise
from headwise import packing, policy
from headwise.policy import Costs, estimate_packing

UNIT = Costs(call_us=10.0, pack_us=20.0, bucket_us=5.0, gemm_ps=1.0, attn_ps=2.0, copy_ps=3.0)


def _buckets(lengths):
    return packing.bucket_shapes(tuple(lengths), tuple(lengths))


def test_each_term_by_hand():
    B, S, E, H, Hkv = 2, 4, 8, 2, 1
    kv = Hkv * (E // H)
    buckets = [(2, 3, 3, 5)]  # one bucket of two sequences, 5 real tokens
    e = estimate_packing(B, S, E, H, Hkv, buckets, costs=UNIT)
    per_row = E * (E + 2 * kv) + E * E
    dense_ps = 1.0 * B * S * per_row + 2.0 * 2 * B * S * S * E + 3.0 * 2 * B * S * E
    packed_ps = (1.0 * 5 * per_row + 3.0 * (3 * 5 * E + B * S * E)
                 + 2.0 * 2 * 2 * 3 * 3 * E + 3.0 * 2 * (2 * 3 * E + 2 * 3 * kv))
    assert e.dense_us == pytest.approx(10.0 + dense_ps / 1e6)
    assert e.packed_us == pytest.approx(10.0 + 20.0 + 5.0 + packed_ps / 1e6)
    assert e.buckets == 1
    causal = estimate_packing(B, S, E, H, Hkv, buckets, is_causal=True, costs=UNIT)
    assert e.dense_us - causal.dense_us == pytest.approx(2.0 * B * S * S * E / 1e6)  # half the scores


def test_no_padding_never_packs_and_padding_lowers_the_packed_price():
    B, S, E, H = 8, 256, 256, 4
    full = estimate_packing(B, S, E, H, H, _buckets([S] * B))
    assert full.packed_us > full.dense_us and not full.packs
    prices = [estimate_packing(B, S, E, H, H, _buckets([S] + [int(S * (1 - p))] * (B - 1))).packed_us
              for p in (0.1, 0.3, 0.5, 0.7)]
    assert prices == sorted(prices, reverse=True)


def test_fixed_costs_decide_small_batches_and_work_decides_large_ones():
    half = [64, 32, 32, 32, 32, 32, 32, 32]  # about 44% padding of 8 x 64
    assert not estimate_packing(8, 64, 64, 2, 2, _buckets(half)).packs  # tiny: fixed costs dominate
    big = [512] + [256] * 31  # about 48% padding of 32 x 512
    assert estimate_packing(32, 512, 512, 8, 8, _buckets(big)).packs  # half the work saved


def test_training_reads_the_training_costs(monkeypatch):
    monkeypatch.setattr(policy, "TRAINING_COSTS", UNIT)
    buckets = _buckets([4, 2])
    assert estimate_packing(2, 4, 8, 2, 2, buckets, training=True) == estimate_packing(2, 4, 8, 2, 2, buckets,
                                                                                        costs=UNIT)
    assert estimate_packing(2, 4, 8, 2, 2, buckets) != estimate_packing(2, 4, 8, 2, 2, buckets, costs=UNIT)


def test_the_sentence_dispatch_prints():
    e = policy.PackingEstimate(dense_us=1234.4, packed_us=987.6, buckets=3)
    assert str(e) == "estimated packed 988 us (3 attention calls) vs dense 1,234 us"
    assert e.packs
    assert str(policy.PackingEstimate(1.0, 2.0, 1)) == "estimated packed 2 us (1 attention call) vs dense 1 us"


@pytest.mark.parametrize("packs", [True, False])
def test_the_module_follows_the_estimate(monkeypatch, packs):
    """Whatever the costs say, plan() takes that path and forward follows plan()."""
    cheap = Costs(0.0, 0.0, 0.0, 1.0, 1.0, 0.0)
    dear = Costs(0.0, 1e9, 0.0, 1.0, 1.0, 0.0)
    monkeypatch.setattr(policy, "INFERENCE_COSTS", cheap if packs else dear)
    mha = headwise.MultiHeadAttention(32, 4).eval()
    x = torch.randn(3, 6, 32)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 2 + [0] * 4])
    with torch.no_grad():
        plan = mha.plan(x, mask)
        assert plan.path == ("packed" if packs else "dense")
        with headwise.trace() as t:
            out = mha(x, mask)
    assert ("pack" in t.names()) == packs
    reference = headwise.MultiHeadAttention(32, 4, packing=False).eval()
    reference.load_state_dict(mha.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x, mask), atol=1e-5, rtol=1e-5)


def test_varlen_estimate_by_hand():
    B, H, Hkv, S, Sk, D = 3, 2, 1, 4, 8, 2
    E, kv = H * D, Hkv * D
    calls = [(1, 8), (2, 3)]
    e = policy.estimate_varlen(B, H, Hkv, S, Sk, D, calls, costs=UNIT)
    assert e.sdpa_us == pytest.approx(2.0 * 2 * B * S * Sk * E / 1e6)
    varlen_ps = (3.0 * B * S * E + 2.0 * 2 * 1 * S * 8 * E + 2.0 * 2 * 2 * S * 3 * E + 3.0 * 2 * (S * E + 2 * 3 * kv))
    assert e.varlen_us == pytest.approx(2 * 5.0 + varlen_ps / 1e6)
    assert e.sdpa_us < 1  # a toy call: priced under a microsecond, printed as such, not as "0 us"
    assert e.calls == 2 and str(e) == f"estimated varlen {e.varlen_us:,.0f} us (2 calls) vs sdpa <1 us"


def test_varlen_pays_later_for_short_keys():
    """At the same share of padding the saved multiply-adds grow with Sk, the fixed cost per call does not."""
    from headwise.kernels.varlen import call_shapes

    def ratio(Sk):
        lengths = [Sk] + [Sk // 2] * 7
        e = policy.estimate_varlen(8, 8, 8, Sk, Sk, 64, call_shapes(lengths))
        return e.sdpa_us / e.varlen_us

    ratios = [ratio(Sk) for Sk in (32, 128, 512, 2048)]
    assert ratios == sorted(ratios) and ratios[0] < 1 < ratios[-1]


def test_an_estimate_under_one_microsecond_never_prints_as_zero():
    """A tiny call's SDPA estimate printed as "sdpa 0 us" (issue 38): under 1 us it reads "<1 us"."""
    assert str(policy.VarlenEstimate(0.3, 256.0, 3)) == "estimated varlen 256 us (3 calls) vs sdpa <1 us"
    assert str(policy.PackingEstimate(0.4, 0.0, 1)) == "estimated packed <1 us (1 attention call) vs dense <1 us"
    assert str(policy.VarlenEstimate(1.0, 12_345.6, 2)) == "estimated varlen 12,346 us (2 calls) vs sdpa 1 us"
    q = k = v = torch.randn(1, 1, 2, 4)  # (B, H, S, D): the smallest call, priced at a fraction of a us
    mask = torch.tensor([[True, False]])
    text = str(headwise.choose_backend(q, k, v, mask))
    assert " 0 us" not in text and not re.search(r"\b0 us", text)

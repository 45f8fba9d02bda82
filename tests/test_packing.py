"""The padding-free path: pack, attend per length bucket, scatter back; headwise.packed_attention.

Legend: B sequences, Tq / Tk packed query / key rows, H query heads, Hkv key/value heads,
D head dim, E embed dim, Lq / Lk one sequence's query / key length.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from conftest import contract_backends
from headwise import packing, policy
from headwise.kernels import buckets
from headwise.policy import PACK_MIN_PADDING

E, H = 32, 4
BACKENDS = contract_backends()
SLOPES = headwise.masks.alibi_slopes(4)


def reference(q, k, v, cu_q, cu_k, *, is_causal=False, window=None, alibi_slopes=None, scale=None,
              softcap=None, sinks=None, sink_tokens=0):
    """The packed contract in float64, one sequence and one head at a time.

    Sequence b: queries q[cu_q[b]:cu_q[b + 1]], keys k[cu_k[b]:cu_k[b + 1]]; query i sits at
    key position i + Lk - Lq; causal keeps j <= that, a window also j > that - window (or
    j < sink_tokens), ALiBi adds -slope * |that - j|. A query with no key allowed gets zeros.
    ``softcap`` caps the scaled scores with tanh first; ``sinks`` (H,) add exp(sink_h) to each
    denominator. v may have its own head dim Dv.
    """
    q, k, v = q.double(), k.double(), v.double()
    H, D, Hkv, Dv = q.shape[1], q.shape[2], k.shape[1], v.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    pieces = [0 * q[:0, :, :1].expand(0, H, Dv)]  # (0, H, Dv): keeps an empty batch in the graph
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        Lq, Lk = q1 - q0, k1 - k0
        if Lk == 0:
            pieces.append(0 * q[q0:q1, :, :1].expand(-1, -1, Dv))  # nothing to attend: zero rows
            continue
        at = torch.arange(Lq)[:, None] + (Lk - Lq)  # (Lq, 1) each query's key position
        j = torch.arange(Lk)[None, :]  # (1, Lk)
        allowed = torch.ones(Lq, Lk, dtype=torch.bool)
        if is_causal or window is not None:
            allowed &= j <= at
        if window is not None:
            allowed &= (j > at - window) | (j < sink_tokens)
        heads = []
        for h in range(H):
            g = h // (H // Hkv)  # the kv head query head h reads
            s = q[q0:q1, h] @ k[k0:k1, g].T * scale  # (Lq, D) x (D, Lk) -> (Lq, Lk)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if alibi_slopes is not None:
                s = s - float(alibi_slopes[h]) * (at - j).abs().double()
            s = s.masked_fill(~allowed, -math.inf)
            top = torch.where(allowed.any(1, keepdim=True), s.amax(1, keepdim=True), 0.0).detach()  # (Lq, 1)
            e = torch.exp(s - top)  # masked keys: exp(-inf) = 0
            total = e.sum(1, keepdim=True)
            if sinks is not None:
                total = total + torch.exp(sinks[h].double() - top)  # the sink's column, no value
            w = e / total.clamp_min(1e-300)  # all-masked rows: 0 / tiny = 0
            heads.append(w @ v[k0:k1, g])  # (Lq, Lk) x (Lk, Dv) -> (Lq, Dv)
        pieces.append(torch.stack(heads, 1))  # (Lq, H, Dv)
    return torch.cat(pieces)  # (Tq, H, Dv)


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def inputs(lengths_q, lengths_k, heads=(4, 2), D=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H, Hkv = heads
    q = torch.randn(sum(lengths_q), H, D, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), Hkv, D, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def grads(out, q, k, v, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # materialize: the reference leaves k and v out of the graph where no sequence has a key
    return torch.autograd.grad(out, (q, k, v), g.to(out.dtype), allow_unused=True, materialize_grads=True)


CASES = {
    "self": ([5, 3, 0, 1, 4], [5, 3, 0, 1, 4]),
    # (7, 10), (6, 10), (7, 9) share a bucket with different Lk - Lq: shifted queries and keys
    "cross": ([7, 6, 7, 2, 4], [10, 10, 9, 5, 1]),
    "empty": ([0, 3, 2, 0, 4, 0], [2, 0, 3, 0, 5, 0]),  # empty on the q side, the k side, both
}
RULES = {
    "plain": {},
    "causal": {"is_causal": True},
    "window": {"window": 2},
    "alibi": {"alibi_slopes": SLOPES},
    "scale": {"scale": 0.3},
    "all": {"is_causal": True, "window": 3, "alibi_slopes": SLOPES, "scale": 0.5},
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def check(case, rule, heads=(4, 2), backend="auto"):
    """Output and dq, dk, dv of one call equal the reference's to 1e-10 in float64."""
    lengths_q, lengths_k = CASES[case]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, heads)
    out = headwise.packed_attention(q, k, v, cu_q, cu_k, backend=backend, **RULES[rule])
    want = reference(q, k, v, cu_q, cu_k, **RULES[rule])
    assert out.shape == want.shape == (sum(lengths_q), 4, 8)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, expected in zip(grads(out, q, k, v), grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rule", RULES)
def test_every_backend_matches_the_reference_in_float64_with_gradients(backend, case, rule):
    check(case, rule, HEADS["gqa"], backend)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rule", ["plain", "all"])
@pytest.mark.parametrize("heads", ["mha", "mqa"])
def test_mha_and_mqa_match_the_reference_in_float64_with_gradients(case, rule, heads):
    check(case, rule, HEADS[heads])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["cross", "empty"])
@pytest.mark.parametrize("features", [{"softcap": 0.7}, {"sinks": True}, {"softcap": 0.7, "sinks": True}],
                         ids=["softcap", "sinks", "both"])
def test_softcap_and_sinks_match_the_reference_with_gradients(backend, case, features):
    """Every bucket gets the same cap and the same per-head sinks; sequences without keys
    still output zeros. A kernel that cannot cap (sdpa, varlen) refuses."""
    lengths_q, lengths_k = CASES[case]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k)
    sinks = None
    if "sinks" in features:
        sinks = torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=torch.float64, requires_grad=True)
    kwargs = {**RULES["all"], "softcap": features.get("softcap"), "sinks": sinks}
    if "softcap" in features and backend in ("sdpa", "varlen"):
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot soft-cap the scores"):
            headwise.packed_attention(q, k, v, cu_q, cu_k, backend=backend, **kwargs)
        return
    out = headwise.packed_attention(q, k, v, cu_q, cu_k, backend=backend, **kwargs)
    want = reference(q, k, v, cu_q, cu_k, **kwargs)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    leaves = (q, k, v) + (() if sinks is None else (sinks,))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got, expected = (torch.autograd.grad(o, leaves, g, allow_unused=True, materialize_grads=True) for o in (out, want))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


SINK_RULES = {
    "Dv": ({"is_causal": True}, 5),
    "sinks": ({"window": 2, "sink_tokens": 1}, 8),
    "sinks-Dv-alibi": ({"window": 3, "sink_tokens": 2, "alibi_slopes": SLOPES}, 5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("rule", SINK_RULES)
def test_own_value_dim_and_sink_tokens_match_the_reference(backend, case, rule):
    """v (Tk, Hkv, Dv) and sink tokens, counted from each sequence's first key: in the cross case
    a shared bucket would shift keys; with sink tokens it pads the queries instead (float64, 1e-10)."""
    kwargs, Dv = SINK_RULES[rule]
    lengths_q, lengths_k = CASES[case]
    q, k, _, cu_q, cu_k = inputs(lengths_q, lengths_k, (4, 2))
    v = torch.randn(sum(lengths_k), 2, Dv, generator=torch.Generator().manual_seed(3), dtype=torch.float64,
                    requires_grad=True)
    out = headwise.packed_attention(q, k, v, cu_q, cu_k, backend=backend, **kwargs)
    want = reference(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == want.shape == (sum(lengths_q), 4, Dv)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, expected in zip(grads(out, q, k, v), grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_the_cross_case_shifts_sequences_within_a_bucket():
    """Guard on the case above: its shared bucket holds sequences with different Lk - Lq."""
    q, k, v, cu_q, cu_k = inputs(*CASES["cross"])
    with headwise.trace() as t:
        headwise.packed_attention(q, k, v, cu_q, cu_k, is_causal=True)
    shifted = [s for s in t.stages if "shifted" in s.note]
    assert [s.shape for s in shifted] == [(3, 4, 7, 8)]  # (n, H, Lq, D)
    assert shifted[0].note.startswith("3 sequences: queries of lengths 7, 7, 6 padded to 7, keys of lengths "
                                      "10, 9, 10 padded to 10")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_is_within_1e5_of_the_float64_reference(backend):
    lengths_q, lengths_k = CASES["cross"]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, dtype=torch.float32, seed=2)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    for rule in ({}, {"is_causal": True}, {"window": 3, "alibi_slopes": SLOPES}):
        out = headwise.packed_attention(q, k, v, cu_q, cu_k, backend=backend, **rule)
        want = reference(q64, k64, v64, cu_q, cu_k, **rule)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        for got, expected in zip(grads(out, q, k, v), grads(want, q64, k64, v64), strict=True):
            torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_long_sequences_attend_alone_and_short_ones_in_buckets():
    L = policy.DIRECT_MIN_LENGTH
    lengths_q, lengths_k = [L + 2, 8, 7, 1, L], [L + 2, 8, 8, 3, L + 30]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, seed=3)
    with headwise.trace() as t:
        out = headwise.packed_attention(q, k, v, cu_q, cu_k, is_causal=True, max_seqlen_q=L + 2, max_seqlen_k=L + 30)
    want = reference(q, k, v, cu_q, cu_k, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, expected in zip(grads(out, q, k, v), grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    buckets = [s for s in t.stages if s.name.startswith("attention, bucket")]
    assert [(s.name, s.shape, s.note) for s in buckets] == [
        ("attention, bucket 1 of 4", (1, 4, L, 8), f"1 sequence of {L} queries and {L + 30} keys, alone, no padding"),
        ("attention, bucket 2 of 4", (1, 4, L + 2, 8), f"1 sequence of length {L + 2}, alone, no padding"),
        ("attention, bucket 3 of 4", (2, 4, 8, 8),
         "2 sequences: queries of lengths 8, 7 padded to 8, keys of lengths 8, 8 padded to 8; sequences shifted "
         "within the padding to keep each one's causal alignment"),
        ("attention, bucket 4 of 4", (1, 4, 1, 8), "1 sequence of 1 queries and 3 keys, alone, no padding"),
    ]
    (merge,) = [s for s in t.stages if s.name == "merge buckets"]
    assert merge.shape == (sum(lengths_q), 4, 8) and t.names()[-1] == "merge buckets"
    assert merge.note == "5 sequences' query rows back in packed order, padding dropped: (Tq, H, D)"


@pytest.mark.parametrize("direct", [1, 10_000], ids=["every-sequence-alone", "every-sequence-bucketed"])
def test_alone_and_bucketed_paths_agree_with_the_reference(monkeypatch, direct):
    monkeypatch.setattr(policy, "DIRECT_MIN_LENGTH", direct)
    lengths_q, lengths_k = [8, 8, 7, 0, 2], [10, 9, 10, 2, 0]  # one bucket of three
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, seed=4)
    rule = {"is_causal": True, "alibi_slopes": SLOPES}
    with headwise.trace() as t:
        out = headwise.packed_attention(q, k, v, cu_q, cu_k, **rule)
    want = reference(q, k, v, cu_q, cu_k, **rule)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, expected in zip(grads(out, q, k, v), grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    alone = [s for s in t.stages if "alone" in s.note]
    assert len(alone) == (3 if direct == 1 else 0)
    assert t.stages[-1].note.endswith("; 1 without keys output zeros: (Tq, H, D)")


def test_the_trace_of_self_attention_names_buckets_and_their_padding():
    lengths = [7, 6, 6, 3, 3, 0]
    q, k, v, cu, _ = inputs(lengths, lengths, seed=5)
    with headwise.trace() as t:
        headwise.packed_attention(q, k, v, cu, cu, backend="matmul")
    buckets = [s for s in t.stages if s.name.startswith("attention, bucket")]
    assert [(s.name, s.shape, s.dtype, s.note) for s in buckets] == [
        ("attention, bucket 1 of 2", (3, 4, 7, 8), torch.float64, "3 sequences of lengths 7, 6, 6 padded to 7"),
        ("attention, bucket 2 of 2", (2, 4, 3, 8), torch.float64, "2 sequences of length 3, no padding"),
    ]
    names = t.names()
    assert names.index("attention, bucket 1 of 2") < names.index("kernel") < names.index("attention, bucket 2 of 2")
    assert {s.call for s in t.stages} == {0} and t.calls == 1  # one call, its buckets inside it


def test_everything_empty_stays_in_the_graph():
    q, k, v, cu_q, cu_k = inputs([0, 0], [3, 0], seed=6)
    out = headwise.packed_attention(q, k, v, cu_q, cu_k)
    assert out.shape == (0, 4, 8)
    q, k, v, cu_q, cu_k = inputs([2, 1], [0, 0], seed=6)
    out = headwise.packed_attention(q, k, v, cu_q, cu_k, is_causal=True)
    assert out.shape == (3, 4, 8) and (out == 0).all()
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (gq == 0).all() and gk.shape == (0, 2, 8)
    q, k, v, cu_q, cu_k = inputs([], [], seed=6)  # B = 0: offsets [0]
    assert headwise.packed_attention(q, k, v, cu_q, cu_k).shape == (0, 4, 8)


def test_dropout_is_applied_and_differentiable():
    lengths_q, lengths_k = [6, 3, 4], [6, 5, 0]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, dtype=torch.float32, seed=7)
    want = reference(q, k, v, cu_q, cu_k, is_causal=True)
    torch.manual_seed(0)
    out = headwise.packed_attention(q, k, v, cu_q, cu_k, is_causal=True, dropout_p=0.5)
    assert torch.isfinite(out).all() and (out[9:] == 0).all()  # the keyless sequence stays zero
    assert not torch.allclose(out.double(), want, atol=1e-3)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.sum(), (q, k, v)))
    same = headwise.packed_attention(q, k, v, cu_q, cu_k, is_causal=True, dropout_p=0.0)
    torch.testing.assert_close(same.double(), want, atol=1e-5, rtol=1e-5)


def test_max_seqlen_hints_may_exceed_the_longest_sequence():
    q, k, v, cu_q, cu_k = inputs([3, 1], [2, 5], seed=8)
    want = headwise.packed_attention(q, k, v, cu_q, cu_k)
    for hints in ((3, 5), (100, 50), (torch.tensor(3), 5)):
        torch.testing.assert_close(headwise.packed_attention(q, k, v, cu_q, cu_k, *hints), want)


def test_attend_packed_takes_lengths_and_equals_the_offsets_entry():
    lengths_q, lengths_k = CASES["cross"]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, seed=9)
    rule = {"is_causal": True, "window": 4}
    torch.testing.assert_close(packing.attend_packed(q, k, v, tuple(lengths_q), tuple(lengths_k), **rule),
                               headwise.packed_attention(q, k, v, cu_q, cu_k, **rule), atol=0, rtol=0)
    with pytest.raises(ValueError, match=re.escape("lengths_q has 5 sequences but lengths_k has 4; give both sides "
                                                   "the same sequences, an empty one as length 0")):
        packing.attend_packed(q, k, v, tuple(lengths_q), tuple(lengths_k[:4]))
    with pytest.raises(ValueError, match=re.escape("lengths_k (10, 10, 9, 5, 2) must be >= 0 and sum to the 35 "
                                                   "packed rows of k (they sum to 36)")):
        packing.attend_packed(q, k, v, tuple(lengths_q), (10, 10, 9, 5, 2))
    with pytest.raises(ValueError, match=re.escape("lengths_q (7, 6, 7, -2, 8) must be >= 0")):
        packing.attend_packed(q, k, v, (7, 6, 7, -2, 8), tuple(lengths_k))


def _bad_offsets(**change):
    """Arguments of a valid call (Tq = 4, Tk = 6, 2 sequences), with ``change`` applied."""
    gen = torch.Generator().manual_seed(10)
    args = {"q": torch.randn(4, 4, 8, generator=gen), "k": torch.randn(6, 2, 8, generator=gen),
            "v": torch.randn(6, 2, 8, generator=gen), "cu_seqlens_q": torch.tensor([0, 1, 4]),
            "cu_seqlens_k": torch.tensor([0, 6, 6], dtype=torch.int32)}
    args.update(change)
    return args


ERRORS = [
    (TypeError, "cu_seqlens_q must be a 1-D integer tensor of B + 1 offsets, got list; wrap it: "
                "torch.tensor(cu_seqlens_q, dtype=torch.int32)", {"cu_seqlens_q": [0, 1, 4]}),
    (ValueError, "cu_seqlens_k must be 1-D with B + 1 >= 1 offsets, got shape (1, 3); offsets are 0 then the "
                 "cumulative lengths: F.pad(lengths.cumsum(0), (1, 0))", {"cu_seqlens_k": torch.tensor([[0, 6, 6]])}),
    (ValueError, "cu_seqlens_q must be 1-D with B + 1 >= 1 offsets, got shape (0,)",
     {"cu_seqlens_q": torch.tensor([], dtype=torch.int64)}),
    (TypeError, "cu_seqlens_q must hold integers, got torch.float32; cast it: cu_seqlens_q.to(torch.int32)",
     {"cu_seqlens_q": torch.tensor([0.0, 1.0, 4.0])}),
    (TypeError, "cu_seqlens_k must hold integers, got torch.bool", {"cu_seqlens_k": torch.tensor([False, True])}),
    (ValueError, "cu_seqlens_q has 4 offsets (3 sequences) but cu_seqlens_k has 3 (2 sequences); give both the "
                 "same B + 1 offsets, an empty sequence as a repeated offset",
     {"cu_seqlens_q": torch.tensor([0, 1, 1, 4])}),
    (ValueError, "cu_seqlens_k must start at 0, got 1; offsets are 0 then the cumulative lengths",
     {"cu_seqlens_k": torch.tensor([1, 6, 6])}),
    (ValueError, "cu_seqlens_q must not decrease, but cu_seqlens_q[2] = 3 < cu_seqlens_q[1] = 4; offsets are 0",
     {"cu_seqlens_q": torch.tensor([0, 4, 3, 4])}),
    (ValueError, "cu_seqlens_q ends at 5 but q has 4 rows; the last offset must be the number of packed rows "
                 "(q.shape[0])", {"cu_seqlens_q": torch.tensor([0, 1, 5])}),
    (ValueError, "cu_seqlens_k ends at 6 but k has 7 rows", {"k": torch.randn(7, 2, 8), "v": torch.randn(7, 2, 8)}),
    (ValueError, "max_seqlen_q (2) is less than the longest query sequence (3, sequence 1); pass max_seqlen_q=3 "
                 "or None", {"max_seqlen_q": 2}),
    (ValueError, "max_seqlen_k (5) is less than the longest key sequence (6, sequence 0); pass max_seqlen_k=6",
     {"max_seqlen_k": 5}),
    (TypeError, "max_seqlen_k must be an int or None, got float (6.0)", {"max_seqlen_k": 6.0}),
    (TypeError, "max_seqlen_q must be an int or None, got bool (True)", {"max_seqlen_q": True}),
    (ValueError, "packed q must be 3-D (Tq, H, D), got shape (1, 4, 4, 8); pack a padded (B, S, H, D) batch with "
                 "headwise.packing.pack(x, mask)", {"q": torch.randn(1, 4, 4, 8)}),
    (ValueError, "packed v must be 3-D (Tk, Hkv, Dv), got shape (6, 16)", {"v": torch.randn(6, 16)}),
    (TypeError, "k must be a torch.Tensor, got list", {"k": [[0.0]]}),
    (TypeError, "q must be floating point, got torch.int64", {"q": torch.ones(4, 4, 8, dtype=torch.int64)}),
    (TypeError, "q, k, v dtypes differ (torch.float64, torch.float32, torch.float32); cast them to one dtype",
     {"q": torch.randn(4, 4, 8, dtype=torch.float64)}),
    (ValueError, "q, k, v are on different devices (meta, cpu, cpu); move them to one device",
     {"q": torch.randn(4, 4, 8, device="meta")}),
    (ValueError, "k (6, 2, 8) and v (6, 1, 8) must agree on (Tk, Hkv): k is (Tk, Hkv, D), v (Tk, Hkv, Dv); only "
                 "the head dim may differ", {"v": torch.randn(6, 1, 8)}),
    (ValueError, "k (6, 2, 8) and v (5, 2, 8) must agree on (Tk, Hkv)", {"v": torch.randn(5, 2, 8)}),
    (ValueError, "q head dim (4) differs from k head dim (8); project q and k to the same head_dim (v may have "
                 "its own)",
     {"q": torch.randn(4, 4, 4)}),
    (ValueError, "q has 4 heads, which is not a multiple of k/v's 3 heads; grouped-query attention needs "
                 "num_heads % num_kv_heads == 0", {"k": torch.randn(6, 3, 8), "v": torch.randn(6, 3, 8)}),
    (ValueError, "dropout_p must be in [0, 1), got 1.0", {"dropout_p": 1.0}),
    (ValueError, "unknown backend 'flash'", {"backend": "flash"}),
    (ValueError, "window must be >= 1 (keys per query, its own included), got 0", {"window": 0}),
    (ValueError, "alibi_slopes must have shape (H,) = (4,), got (2,)", {"alibi_slopes": torch.ones(2)}),
    (ValueError, "sink_tokens=1 keeps the first keys visible under a sliding window; give window=W too",
     {"sink_tokens": 1}),
]


@pytest.mark.parametrize("error, message, change", ERRORS, ids=[f"{i}" for i in range(len(ERRORS))])
def test_errors_name_the_values_and_the_remedy(error, message, change):
    with pytest.raises(error, match=re.escape(message)):
        headwise.packed_attention(**_bad_offsets(**change))


def test_the_valid_call_behind_the_error_table_runs():
    assert headwise.packed_attention(**_bad_offsets()).shape == (4, 4, 8)


@given(lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=6),
       rule=st.sampled_from(list(RULES)), heads=st.sampled_from(list(HEADS)))
def test_property_any_lengths_match_the_reference(lengths, rule, heads):
    lengths_q, lengths_k = [a for a, _ in lengths], [b for _, b in lengths]
    q, k, v, cu_q, cu_k = inputs(lengths_q, lengths_k, HEADS[heads], seed=11)
    out = headwise.packed_attention(q, k, v, cu_q, cu_k, **RULES[rule])
    want = reference(q, k, v, cu_q, cu_k, **RULES[rule])
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    for got, expected in zip(grads(out, q, k, v), grads(want, q, k, v), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


# --- pack / unpack and the module's packed path ---------------------------------------------


def _mask(lengths, S, *, left=False, hole=False):
    m = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # right padding
    if left:
        m = m.flip(1)
    if hole:
        m[0, 1] = False
    return m


def test_pack_and_unpack_round_trip():
    x = torch.randn(3, 5, 2)
    mask = _mask([5, 2, 0], 5)
    packed, info = packing.pack(x, mask)
    assert packed.shape == (7, 2) and info.lengths == (5, 2, 0) and info.tokens == 7
    assert info.cu_seqlens.tolist() == [0, 5, 7, 7]
    back = packing.unpack(packed, info)
    assert torch.equal(back[mask], x[mask]) and (back[~mask] == 0).all()


@pytest.mark.parametrize("kwargs", [{}, {"num_kv_heads": 2}, {"num_kv_heads": 1, "rope": True}],
                         ids=["mha", "gqa", "mqa+rope"])
@pytest.mark.parametrize("layout", ["right", "left", "holes"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_module_equals_dense_module_with_gradients(kwargs, layout, is_causal):
    torch.manual_seed(0)
    dense = headwise.MultiHeadAttention(E, H, backend="sdpa", **kwargs)
    packed = headwise.MultiHeadAttention(E, H, packing=True, **kwargs)
    packed.load_state_dict(dense.state_dict())
    lengths = [9, 4, 7, 1, 0]
    mask = _mask(lengths, 9, left=layout == "left", hole=layout == "holes")
    x = torch.randn(5, 9, E, requires_grad=True)
    want, got = dense(x, mask, is_causal=is_causal), packed(x, mask, is_causal=is_causal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[~mask] == 0).all()
    g = torch.randn_like(want)
    gx_want, *gw_want = torch.autograd.grad(want, (x, *dense.parameters()), g)
    gx_got, *gw_got = torch.autograd.grad(got, (x, *packed.parameters()), g)
    torch.testing.assert_close(gx_got, gx_want, atol=1e-5, rtol=1e-5)
    assert (gx_got[~mask] == 0).all()
    for a, b in zip(gw_got, gw_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6), causal=st.booleans())
def test_property_module_any_lengths(lengths, causal):
    torch.manual_seed(1)
    S = max(max(lengths), 1)
    dense = headwise.MultiHeadAttention(E, H, backend="matmul").eval()
    packed = headwise.MultiHeadAttention(E, H, packing=True).eval()
    packed.load_state_dict(dense.state_dict())
    mask = _mask(lengths, S)
    x = torch.randn(len(lengths), S, E)
    torch.testing.assert_close(packed(x, mask, is_causal=causal), dense(x, mask, is_causal=causal),
                               atol=1e-5, rtol=1e-5)


def test_auto_packs_only_when_the_estimate_says_it_pays(monkeypatch):
    mha = headwise.MultiHeadAttention(E, H)
    x = torch.randn(4, 10, E)
    light = _mask([10, 10, 10, 9], 10)  # 2.5% padding ("2%": 1 of 40 exactly, rounded half to even)
    heavy = _mask([10, 3, 2, 5], 10)  # 50% padding
    assert 1 - light.float().mean() < PACK_MIN_PADDING <= 1 - heavy.float().mean()
    d = mha.dispatch(x, light)
    assert (d.path, d.path_reason) == ("dense", "2% of the batch is padding (< PACK_MIN_PADDING 10%): nothing to save")
    # on this tiny batch the fixed costs of packing outweigh what it saves
    buckets = packing.bucket_shapes((10, 3, 2, 5), (10, 3, 2, 5))
    estimate = policy.estimate_packing(4, 10, E, H, H, buckets)
    assert not estimate.packs
    with torch.no_grad():  # inference: the forward's costs
        d = mha.dispatch(x, heavy)
    assert (d.path, d.path_reason) == ("dense", f"50% of the batch is padding, but forward {estimate}; unit costs "
                                                "built in (HEADWISE_TUNE=off)")
    cheap = policy.Costs(call_us=0.0, pack_us=0.0, bucket_us=0.0, gemm_ps=1.0, attn_ps=1.0, copy_ps=0.0)
    monkeypatch.setattr(policy, "INFERENCE_COSTS", cheap)
    estimate = policy.estimate_packing(4, 10, E, H, H, buckets)
    with torch.no_grad():
        d = mha.dispatch(x, heavy)
    assert (d.path, d.path_reason) == ("packed", f"50% of the batch is padding; forward {estimate}; unit costs "
                                                 "built in (HEADWISE_TUNE=off)")
    # with gradients the training costs price it
    monkeypatch.setattr(policy, "TRAINING_COSTS", policy.Costs(1e6, 1e6, 1e6, 1.0, 1.0, 1.0))
    assert mha.plan(x, heavy).why.startswith("50% of the batch is padding, but forward + backward")
    # weights need the dense path; a window needs positions that packing would move
    assert mha.dispatch(x, heavy, need_weights=True).path == "dense"
    assert headwise.MultiHeadAttention(E, H, window=4).dispatch(x, heavy).path == "dense"


def test_forward_packed_directly():
    torch.manual_seed(2)
    mha = headwise.MultiHeadAttention(E, H, rope=True).eval()
    x = torch.randn(2, 6, E)
    mask = _mask([6, 4], 6)
    packed, info = packing.pack(x, mask)
    out = mha.forward_packed(packed, info.cu_seqlens)  # positions default to 0.. within each sequence
    torch.testing.assert_close(packing.unpack(out, info), mha(x, mask), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"packed x must be \(T, E\) with E = embed_dim = 32, got \(2, 6, 32\)"):
        mha.forward_packed(x, info.cu_seqlens)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens must end at the 9 rows of x, got 10 ([0, 6, 10])")):
        headwise.MultiHeadAttention(E, H).forward_packed(torch.randn(9, E), info.cu_seqlens)


def test_buckets_bound_the_padding_on_both_sides():
    lengths_q = [512, 500, 480, 300, 290, 64, 10, 0, 9, 60]
    lengths_k = [512, 400, 480, 300, 290, 64, 10, 5, 0, 64]
    groups = buckets.bucket_groups(lengths_q, lengths_k)
    assert sorted(b for g in groups for b in g) == [b for b in range(10) if lengths_q[b] and lengths_k[b]]
    for group in groups:
        for lengths in (lengths_q, lengths_k):
            longest = max(lengths[b] for b in group)
            assert all(lengths[b] >= (1 - policy.BUCKET_SLACK) * longest for b in group)
    assert groups[:5] == [[0], [2], [1], [3], [4]]  # long ones alone, longest keys first
    assert [5, 9] in groups  # 64 keys each, 64 and 60 queries: one bucket


@pytest.mark.parametrize("direct", [1, 10_000], ids=["every-sequence-direct", "every-sequence-bucketed"])
def test_direct_and_bucketed_sequences_agree_in_the_module(monkeypatch, direct):
    monkeypatch.setattr(policy, "DIRECT_MIN_LENGTH", direct)
    torch.manual_seed(3)
    dense = headwise.MultiHeadAttention(E, H, backend="sdpa", num_kv_heads=2)
    packed = headwise.MultiHeadAttention(E, H, packing=True, num_kv_heads=2)
    packed.load_state_dict(dense.state_dict())
    mask = _mask([7, 3, 6, 0, 1], 7)
    x = torch.randn(5, 7, E, requires_grad=True)
    got, want = packed(x, mask, is_causal=True), dense(x, mask, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(*(torch.autograd.grad(y.sum(), x)[0] for y in (got, want)), atol=1e-5, rtol=1e-5)


def test_a_batch_of_padding_only_keeps_x_in_the_graph():
    mha = headwise.MultiHeadAttention(E, H, packing=True)
    x = torch.randn(2, 4, E, requires_grad=True)
    out = mha(x, torch.zeros(2, 4, dtype=torch.bool))
    out.sum().backward()
    assert out.abs().max() == 0
    assert x.grad is not None and x.grad.abs().max() == 0

"""The padding-free path: pack, attend per length bucket, scatter back."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from headwise import varlen
from headwise.policy import PACK_MIN_PADDING

E, H = 32, 4


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
    packed, info = varlen.pack(x, mask)
    assert packed.shape == (7, 2) and info.lengths == (5, 2, 0) and info.tokens == 7
    assert info.cu_seqlens.tolist() == [0, 5, 7, 7]
    back = varlen.unpack(packed, info)
    assert torch.equal(back[mask], x[mask]) and (back[~mask] == 0).all()


@pytest.mark.parametrize("kwargs", [{}, {"num_kv_heads": 2}, {"num_kv_heads": 1, "rope": True}],
                         ids=["mha", "gqa", "mqa+rope"])
@pytest.mark.parametrize("layout", ["right", "left", "holes"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_packed_module_equals_dense_module_with_gradients(kwargs, layout, is_causal):
    torch.manual_seed(0)
    dense = headwise.MultiHeadAttention(E, H, backend="sdpa", **kwargs)
    packed = headwise.MultiHeadAttention(E, H, backend="varlen", **kwargs)
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
def test_property_any_lengths(lengths, causal):
    torch.manual_seed(1)
    S = max(max(lengths), 1)
    dense = headwise.MultiHeadAttention(E, H, backend="matmul").eval()
    packed = headwise.MultiHeadAttention(E, H, backend="varlen").eval()
    packed.load_state_dict(dense.state_dict())
    mask = _mask(lengths, S)
    x = torch.randn(len(lengths), S, E)
    torch.testing.assert_close(packed(x, mask, is_causal=causal), dense(x, mask, is_causal=causal),
                               atol=1e-5, rtol=1e-5)


def test_auto_packs_only_when_the_padding_pays():
    mha = headwise.MultiHeadAttention(E, H)
    x = torch.randn(4, 10, E)
    light = _mask([10, 10, 10, 9], 10)  # 2.5% padding
    heavy = _mask([10, 3, 2, 5], 10)  # 50% padding
    assert 1 - light.float().mean() < PACK_MIN_PADDING <= 1 - heavy.float().mean()
    assert "module packed path" not in mha.dispatch(x, light).reason
    d = mha.dispatch(x, heavy)
    assert d.backend == "varlen" and "module packed path: 50% of the batch is padding" in d.reason
    # weights need the dense path; a window needs positions that packing would move
    assert "module packed path" not in mha.dispatch(x, heavy, need_weights=True).reason
    assert "module packed path" not in headwise.MultiHeadAttention(E, H, window=4).dispatch(x, heavy).reason


def test_forward_packed_directly():
    torch.manual_seed(2)
    mha = headwise.MultiHeadAttention(E, H, rope=True).eval()
    x = torch.randn(2, 6, E)
    mask = _mask([6, 4], 6)
    packed, info = varlen.pack(x, mask)
    out = mha.forward_packed(packed, info.cu_seqlens)  # positions default to 0.. within each sequence
    torch.testing.assert_close(varlen.unpack(out, info), mha(x, mask), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"packed x must be \(T, E\) with E = embed_dim = 32, got \(2, 6, 32\)"):
        mha.forward_packed(x, info.cu_seqlens)
    with pytest.raises(ValueError, match=r"must all equal the sum of the sequence lengths \(10\)"):
        varlen.packed_attention(torch.randn(9, 4, 8), torch.randn(9, 4, 8), torch.randn(9, 4, 8),
                                info.cu_seqlens)


def test_buckets_bound_the_padding():
    lengths = [512, 500, 480, 300, 290, 64, 10, 0]
    buckets = varlen.length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == [i for i, n in enumerate(lengths) if n]
    for bucket in buckets:
        longest = lengths[bucket[0]]
        assert all(lengths[i] >= (1 - varlen.BUCKET_SLACK) * longest for i in bucket)


@pytest.mark.parametrize("direct", [1, 10_000], ids=["every-sequence-direct", "every-sequence-bucketed"])
def test_direct_and_bucketed_sequences_agree(monkeypatch, direct):
    monkeypatch.setattr(varlen, "DIRECT_MIN_LENGTH", direct)
    torch.manual_seed(3)
    dense = headwise.MultiHeadAttention(E, H, backend="sdpa", num_kv_heads=2)
    packed = headwise.MultiHeadAttention(E, H, backend="varlen", num_kv_heads=2)
    packed.load_state_dict(dense.state_dict())
    mask = _mask([7, 3, 6, 0, 1], 7)
    x = torch.randn(5, 7, E, requires_grad=True)
    got, want = packed(x, mask, is_causal=True), dense(x, mask, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(*(torch.autograd.grad(y.sum(), x)[0] for y in (got, want)), atol=1e-5, rtol=1e-5)


def test_a_batch_of_padding_only_keeps_x_in_the_graph():
    mha = headwise.MultiHeadAttention(E, H, backend="varlen")
    x = torch.randn(2, 4, E, requires_grad=True)
    out = mha(x, torch.zeros(2, 4, dtype=torch.bool))
    out.sum().backward()
    assert out.abs().max() == 0
    assert x.grad is not None and x.grad.abs().max() == 0

"""Rotary embeddings against a direct float64 rotation of each pair (i, i + D/2)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from headwise.positions import RotaryEmbedding


def rotate_pairs_float64(x, start, base):
    """The rotation formula itself: pair (i, i + D/2) at position p turns by p * base^(-2i/D)."""
    x = x.double()
    B, H, S, D = x.shape
    out = torch.empty_like(x)
    half = D // 2
    for p in range(S):
        for i in range(half):
            angle = (start + p) * base ** (-2 * i / D)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, :, p, i], x[:, :, p, i + half]
            out[:, :, p, i] = a * c - b * s
            out[:, :, p, i + half] = a * s + b * c
    return out


@pytest.mark.parametrize("start", [0, 7, 300])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_matches_the_rotation_formula(start, base):
    x = torch.randn(2, 3, 5, 8)
    got = RotaryEmbedding(8, base)(x, start=start)
    torch.testing.assert_close(got.double(), rotate_pairs_float64(x, start, base), atol=1e-5, rtol=1e-5)
    got64 = RotaryEmbedding(8, base)(x.double(), start=start)
    torch.testing.assert_close(got64, rotate_pairs_float64(x, start, base), atol=1e-12, rtol=1e-12)


@given(shift=st.integers(0, 1000), i=st.integers(0, 5), j=st.integers(0, 5))
def test_scores_depend_only_on_relative_position(shift, i, j):
    """<R(p) q, R(p') k> depends on p - p' only: the reason RoPE exists."""
    rope = RotaryEmbedding(16)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, generator=gen, dtype=torch.float64)
    qs = rope(q.expand(1, 1, 6, 16), start=0)
    ks = rope(k.expand(1, 1, 6, 16), start=0)
    qs2 = rope(q.expand(1, 1, 6, 16), start=shift)
    ks2 = rope(k.expand(1, 1, 6, 16), start=shift)
    a = (qs[0, 0, i] * ks[0, 0, j]).sum()
    b = (qs2[0, 0, i] * ks2[0, 0, j]).sum()
    torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_module_applies_rope_to_q_and_k():
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(16, 2, rope=True, backend="matmul").eval()
    x = torch.randn(1, 4, 16)
    with headwise.trace() as t:
        mha(x)
    assert "rotary positions" in t.names()
    # by hand: project, split, rotate, attend
    q = mha.q_proj(x).reshape(1, 4, 2, 8).transpose(1, 2)
    k = mha.k_proj(x).reshape(1, 4, 2, 8).transpose(1, 2)
    v = mha.v_proj(x).reshape(1, 4, 2, 8).transpose(1, 2)
    q, k = rotate_pairs_float64(q, 0, 10000.0).float(), rotate_pairs_float64(k, 0, 10000.0).float()
    out = headwise.attention(q, k, v).transpose(1, 2).reshape(1, 4, 16)
    torch.testing.assert_close(mha(x), mha.out_proj(out), atol=1e-5, rtol=1e-5)


def test_errors():
    with pytest.raises(ValueError, match=r"even head_dim, got 5"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match=r"rope_base must be positive, got -1"):
        headwise.MultiHeadAttention(16, 2, rope_base=-1)
    with pytest.raises(ValueError, match=r"rotary embeddings \(rope\) are for self-attention"):
        headwise.MultiHeadAttention(16, 2, rope=True)(torch.randn(1, 2, 16), context=torch.randn(1, 3, 16))


def test_the_default_base_is_ropes_10000():
    assert RotaryEmbedding(8).base == 10000.0 and headwise.MultiHeadAttention(16, 2, rope=True).rope.base == 10000.0


def test_base_must_be_positive_but_may_be_below_one():
    with pytest.raises(ValueError, match="rope_base must be positive, got 0"):
        RotaryEmbedding(8, base=0)
    assert RotaryEmbedding(8, base=0.5).base == 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_rotation_keeps_the_inputs_dtype_and_device(dtype):
    rope = RotaryEmbedding(8)
    for device in ("cpu", "meta"):  # on meta, a table built on the default device would raise
        out = rope(torch.ones(1, 2, 3, 8, dtype=dtype, device=device), start=2)
        assert (out.dtype, out.device.type) == (dtype, device)
    packed = rope.at(torch.ones(4, 2, 8, dtype=dtype), torch.tensor([0, 1, 2, 0]))  # reads the positions' values
    assert packed.dtype == dtype


def test_no_packed_tokens_rotate_to_nothing():
    out = RotaryEmbedding(8).at(torch.empty(0, 2, 8), torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 2, 8)


def test_positions_start_at_zero_by_default():
    x = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(4))
    rope = RotaryEmbedding(8)
    assert torch.equal(rope(x), rope(x, start=0)) and not torch.allclose(rope(x), rope(x, start=1))

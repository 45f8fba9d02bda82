"""The varlen kernel: dense (B, H, S, D) inputs, padded keys dropped per row."""

from __future__ import annotations

import pytest
import torch

import headwise


def test_refuses_masks_with_no_key_padding_to_drop():
    q = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match=r"backend 'varlen' needs a bool/integer key padding mask"):
        headwise.attention(q, q, q, torch.ones(2, 3, 3, dtype=torch.bool), backend="varlen")
    with pytest.raises(ValueError, match=r"backend 'varlen' needs a bool/integer key padding mask"):
        headwise.attention(q, q, q, torch.zeros(2, 3), backend="varlen")


def test_trims_keys_but_keeps_every_query(ref):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 6, 8, generator=gen)
    k, v = torch.randn(2, 4, 2, 10, 8, generator=gen)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, 3:7] = True  # left and right padding
    mask[2, ::3] = True  # holes
    # row 3: nothing to attend
    for kwargs in ({}, {"is_causal": True}, {"window": 3}, {"alibi_slopes": headwise.masks.alibi_slopes(4)}):
        out = headwise.attention(q, k, v, mask, backend="varlen", **kwargs)
        expected, _ = ref(q, k, v, mask, **kwargs)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        assert (out[3] == 0).all()

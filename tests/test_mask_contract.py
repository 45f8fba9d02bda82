"""Tests for ``headwise.mask_contract``: the contract on a call's inputs (the values a float mask
may hold; what no query may attend is hidden, tested end to end in tests/test_nan_contract.py).

Legend: B batch, H query heads, S query length, Sk key length, D head dim.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from headwise import attention, mask_contract

INF = float("inf")


# --- a float mask of 0s and 1s ------------------------------------------------------------


def test_float_mask_of_zeros_and_ones_warns_once(monkeypatch):
    monkeypatch.setattr(mask_contract, "_WARNED_BINARY", False)
    q = k = v = torch.randn(2, 2, 3, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    with pytest.warns(UserWarning, match=re.escape(
            "attention_mask is floating and holds only 0s and 1s, so it is read as an additive bias (1 adds 1 "
            "to a score, 0 excludes nothing); for a keep/pad mask pass it as bool or int: attention_mask.bool()")):
        attention(q, k, v, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(q, k, v, mask)  # once per process
        attention(q, k, v, mask.bool())


def test_other_float_masks_do_not_warn(monkeypatch):
    monkeypatch.setattr(mask_contract, "_WARNED_BINARY", False)
    q = k = v = torch.randn(2, 2, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention(q, k, v, torch.zeros(2, 3))  # all zeros: no bias at all
        attention(q, k, v, torch.tensor([[0.0, 0.0, -INF], [0.0, 0.5, 0.0]]))

"""Conversion to and from ``torch.nn.MultiheadAttention`` (module/torch_mha.py): the default
layout, and every refusal in full, naming the values and the remedy.

Legend: B batch, S length, E embed dim, H heads.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import headwise

E, H = 32, 4


def test_to_torch_is_batch_first_by_default_and_equal_to_the_module():
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64).eval()
    m = mha.to_torch()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    assert m.batch_first
    with torch.no_grad():
        torch.testing.assert_close(m(x, x, x, need_weights=False)[0], mha(x), rtol=0, atol=1e-12)


def _without_bias(mha, name):
    getattr(mha, name).bias = None
    return mha


@pytest.mark.parametrize(("build", "message"), [
    (lambda: headwise.MultiHeadAttention(E, H, is_causal=True),
     "this module is causal (is_causal=True) and torch.nn.MultiheadAttention has no causal setting, only a per-call "
     "mask: build the module with is_causal=False to convert it, and call the torch module with "
     "attn_mask=nn.Transformer.generate_square_subsequent_mask(S) and is_causal=True"),
    (lambda: headwise.MultiHeadAttention(E, H, rope=True, alibi=True),
     "torch.nn.MultiheadAttention has no rope, alibi; build this module without them to convert it"),
    (lambda: headwise.MultiHeadAttention(E, H, window=3, softcap=2.0, sinks=True, qk_norm="rms"),
     "torch.nn.MultiheadAttention has no window, qk_norm, softcap, sinks; build this module without them to "
     "convert it"),
    (lambda: headwise.MultiHeadAttention(E, H, v_head_dim=6),
     "torch.nn.MultiheadAttention's value heads are embed_dim // num_heads = 8 wide; this module has v_head_dim=6 "
     "(torch's vdim is the width of the value input, not of a head, so it cannot hold it)"),
    (lambda: headwise.MultiHeadAttention(E, H, num_kv_heads=2),
     "torch.nn.MultiheadAttention has no grouped-query attention; this module has num_kv_heads=2 < num_heads=4"),
    (lambda: _without_bias(headwise.MultiHeadAttention(E, H), "k_proj"),
     "torch.nn.MultiheadAttention has biases on all four projections or on none; this module has them on some "
     "([True, False, True, True]): give the others zero biases to convert it"),
    (lambda: setattr_then(headwise.MultiHeadAttention(E, H), "v_proj", nn.Sequential(nn.Linear(E, E))),
     "v_proj is not a plain nn.Linear (wrapped or replaced, e.g. by PEFT); merge or unwrap first (PEFT: "
     "model.merge_and_unload())"),
    (lambda: setattr_then(setattr_then(headwise.MultiHeadAttention(E, H), "q_proj", nn.Sequential(nn.Linear(E, E))),
                          "out_proj", nn.Sequential(nn.Linear(E, E))),
     "q_proj, out_proj are not a plain nn.Linear (wrapped or replaced, e.g. by PEFT); merge or unwrap first (PEFT: "
     "model.merge_and_unload())"),
], ids=["causal", "rope alibi", "window qk_norm softcap sinks", "v_head_dim", "gqa", "some biases", "one wrapped",
        "two wrapped"])
def test_to_torch_refuses_in_full(build, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        build().to_torch()


def setattr_then(mha, name, value):
    setattr(mha, name, value)
    return mha


def test_from_torch_takes_the_value_head_dim_only_when_it_is_the_head_dim():
    m = nn.MultiheadAttention(E, H)
    with pytest.raises(ValueError, match="^" + re.escape(
            "v_head_dim=6: torch.nn.MultiheadAttention's value heads are embed_dim // num_heads = 8 wide (its vdim "
            "is the width of the value input, not of a head); drop v_head_dim= to convert") + "$"):
        headwise.MultiHeadAttention.from_torch(m, v_head_dim=6)
    for v in (8, None):
        assert headwise.MultiHeadAttention.from_torch(m, v_head_dim=v).v_head_dim == 8


@pytest.mark.parametrize("name", ["q_proj", "k_proj", "v_proj", "out_proj"])
def test_to_torch_names_the_projection_that_is_not_a_plain_linear(name):
    mha = setattr_then(headwise.MultiHeadAttention(E, H), name, nn.Sequential(nn.Linear(E, E)))
    with pytest.raises(ValueError, match="^" + re.escape(f"{name} is not a plain nn.Linear (wrapped or replaced")):
        mha.to_torch()

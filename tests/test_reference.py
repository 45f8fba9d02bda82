"""Tests for ``headwise.reference``: the documents' classes on the documents' examples.

Legend: B batch, H heads, S sequence length, D head dim, E (hidden_dim) embed dim.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from headwise import MultiHeadAttention
from headwise.reference import MHSA, MultiHeadAttentionFormal, to_headwise_state_dict


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_formal_on_the_documents_example():
    # The first document: X (3, 2, 128), 8 heads, a (B, S) 0/1 mask expanded to (B, H, S, S).
    X = torch.rand(3, 2, 128)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    mask = mask.unsqueeze(1).unsqueeze(2).expand(3, 8, 2, 2)
    net = MultiHeadAttentionFormal(128, 8)
    out = net(X, mask)
    assert out.shape == (3, 2, 128)
    assert torch.isfinite(out).all()
    assert net.head_dim == 16


def test_formal_without_mask():
    assert MultiHeadAttentionFormal(128, 8)(torch.rand(3, 2, 128)).shape == (3, 2, 128)


def test_formal_masked_key_gets_no_weight():
    # With dropout off, changing a masked key's input must not change the other rows' output.
    net = MultiHeadAttentionFormal(16, 4, attention_dropout=0.0)
    X = torch.rand(1, 3, 16)
    mask = torch.tensor([[1, 1, 0]]).unsqueeze(1).unsqueeze(2).expand(1, 4, 3, 3)
    Y = X.clone()
    Y[0, 2] = torch.rand(16)
    torch.testing.assert_close(net(X, mask)[0, :2], net(Y, mask)[0, :2])


def test_formal_fully_padded_row_is_nan():
    # What headwise fixes: masked_fill(-inf) then softmax gives NaN for a row with no key.
    net = MultiHeadAttentionFormal(16, 4).eval()
    mask = torch.tensor([[1, 1], [0, 0]]).unsqueeze(1).unsqueeze(2).expand(2, 4, 2, 2)
    out = net(torch.rand(2, 2, 16), mask)
    assert torch.isfinite(out[0]).all()
    assert torch.isnan(out[1]).all()


def test_formal_dropout_is_active_in_training_only():
    net = MultiHeadAttentionFormal(16, 4, attention_dropout=0.5)
    X = torch.rand(2, 5, 16)
    net.eval()
    assert torch.equal(net(X), net(X))
    net.train()
    assert not torch.allclose(net(X), net(X))


def test_mhsa_on_the_documents_example():
    # The second document: x (4, 10, 512), 8 heads.
    net = MHSA(512, 8)
    out = net(torch.rand(4, 10, 512))
    assert out.shape == (4, 10, 512)
    assert net.head_dim == 64


@pytest.mark.parametrize("embed_dim, num_heads", [(512, 7), (100, 8), (64, 3)])
def test_mhsa_value_error(embed_dim, num_heads):
    with pytest.raises(
        ValueError,
        match=re.escape(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim})"),
    ):
        MHSA(embed_dim, num_heads)


@pytest.mark.parametrize(
    "ref, names",
    [
        (MultiHeadAttentionFormal(64, 4), ("q_proj", "k_proj", "v_proj", "output")),
        (MHSA(64, 4), ("query", "key", "value", "fc_out")),
    ],
    ids=["formal", "mhsa"],
)
def test_to_headwise_state_dict(ref, names):
    state = to_headwise_state_dict(ref)
    ours = MultiHeadAttention(64, 4)
    assert state.keys() == ours.state_dict().keys()
    ours.load_state_dict(state)  # strict: every key and shape fits
    for theirs, mine in zip(names, ("q_proj", "k_proj", "v_proj", "out_proj"), strict=True):
        for param in ("weight", "bias"):
            assert torch.equal(state[f"{mine}.{param}"], ref.state_dict()[f"{theirs}.{param}"])


def test_to_headwise_state_dict_rejects_other_modules():
    with pytest.raises(TypeError, match="expected MultiHeadAttentionFormal or MHSA, got Linear"):
        to_headwise_state_dict(nn.Linear(4, 4))

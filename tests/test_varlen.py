"""headwise.varlen and headwise.embed, old homes of moved code: their names and their deprecation.

The path itself is tested in tests/test_packing.py.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import headwise
from headwise import packing, policy, varlen


@pytest.fixture
def unwarned(monkeypatch):
    """A process where no deprecation has warned yet."""
    import headwise.deprecation

    monkeypatch.setattr(headwise.deprecation, "_warned", set())


def test_the_old_names_are_the_new_objects(unwarned):
    assert (varlen.pack, varlen.unpack, varlen.Packed) == (packing.pack, packing.unpack, packing.Packed)
    with pytest.warns(FutureWarning, match=r"headwise.varlen.BUCKET_SLACK moved to headwise.policy.BUCKET_SLACK"):
        assert varlen.BUCKET_SLACK == policy.BUCKET_SLACK
    with pytest.warns(FutureWarning, match=r"varlen.DIRECT_MIN_LENGTH moved to headwise.policy.DIRECT_MIN_LENGTH"):
        assert varlen.DIRECT_MIN_LENGTH == policy.DIRECT_MIN_LENGTH
    assert varlen.length_buckets([3, 0, 2]) == [[0], [2]]


@pytest.mark.parametrize("rule", [{}, {"is_causal": True, "scale": 0.5}, {"window": 2, "dropout_p": 0.0},
                                  {"alibi_slopes": headwise.masks.alibi_slopes(4), "backend": "matmul"}])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_old_signature_equals_the_new_function(rule):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 5, 5, 9])
    want = headwise.packed_attention(q, k, v, cu, cu, **rule)
    torch.testing.assert_close(varlen.packed_attention(q, k, v, cu, **rule), want, atol=0, rtol=0)
    torch.testing.assert_close(varlen.packed_attention(q, k, v, cu, lengths=(5, 0, 4), **rule), want, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_old_signature_checks_rows_against_the_offsets():
    q = k = v = torch.randn(9, 4, 8)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens ends at 10 but q has 9 rows")):
        varlen.packed_attention(q, k, v, torch.tensor([0, 6, 10]))
    with pytest.raises(ValueError, match=re.escape("lengths_k (6, 4) must be >= 0 and sum to the 8 packed rows of k")):
        varlen.packed_attention(torch.randn(10, 4, 8), k[:8], v[:8], torch.tensor([0, 6, 10]))


def test_the_old_signature_warns_once_pointing_to_the_new_function(unwarned):
    q = k = v = torch.randn(3, 2, 4)
    cu = torch.tensor([0, 1, 3])
    with pytest.warns(FutureWarning, match=re.escape("call headwise.packed_attention(q, k, v, cu_seqlens, "
                                                          "cu_seqlens)")) as record:
        varlen.packed_attention(q, k, v, cu)
    assert record[0].filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        varlen.packed_attention(q, k, v, cu)  # once: no second warning


def test_the_modules_packed_path_does_not_use_the_old_function(unwarned):
    mha = headwise.MultiHeadAttention(16, 2, packing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mha(torch.randn(2, 3, 16), torch.tensor([[1, 1, 0], [1, 0, 0]]))
        mha.forward_packed(torch.randn(3, 16), torch.tensor([0, 2, 3]))


def test_the_old_embed_module_names_warn_once_and_are_the_new_objects(unwarned):
    import headwise.embed
    from headwise.apps.embed import add_embed_parser
    from headwise.models.bert import PackedBertEncoder

    with pytest.warns(FutureWarning, match=r"headwise.embed.PackedBertEncoder moved to headwise.models.bert"):
        assert headwise.embed.PackedBertEncoder is PackedBertEncoder
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert headwise.embed.PackedBertEncoder is PackedBertEncoder  # once
    with pytest.warns(FutureWarning, match=r"headwise.embed.add_embed_parser moved to headwise.apps.embed"):
        assert headwise.embed.add_embed_parser is add_embed_parser
    with pytest.raises(AttributeError, match="module 'headwise.embed' has no attribute 'nothing'"):
        headwise.embed.nothing  # noqa: B018

"""headwise.models.bert: the padding-free BERT encoder, against transformers' own BertModel on
random weights (no download).

Legend: B sentences, T real tokens, S padded length, E embed dim.
"""

from __future__ import annotations

import json

import pytest
import torch

from headwise.integrations.sentence_transformers import hf_bert_to_headwise
from headwise.models.bert import BertConfig, PackedBertEncoder

CFG = dict(vocab_size=50, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
           intermediate_size=64, max_position_embeddings=24)


def _packed(lengths, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return ids, torch.cat(ids), cu



def test_config_refuses_what_the_encoder_does_not_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CFG, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match="hidden_act is 'relu'; this encoder implements 'gelu'"):
        BertConfig.from_json(path)
    path.write_text(json.dumps({**CFG, "model_type": "roberta"}))
    with pytest.raises(ValueError, match="model_type is 'roberta'"):
        BertConfig.from_json(path)


# ---------------------------------------------------------------- the encoder on random weights


def test_packed_encoder_matches_transformers_bert():
    transformers = pytest.importorskip("transformers", minversion="5",
                                       reason="the hf extra is not installed: pip install -e '.[hf]'")
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**CFG), add_pooling_layer=False).eval()
    ours = PackedBertEncoder(BertConfig(**CFG)).eval()
    ours.load_state_dict(hf_bert_to_headwise(hf.state_dict(), CFG["num_hidden_layers"]))
    lengths = [7, 1, 20, 3]
    ids, flat, cu = _packed(lengths)
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)  # (B, S)
    mask = torch.zeros_like(padded)
    for b, row in enumerate(ids):
        padded[b, :len(row)], mask[b, :len(row)] = row, 1
    with torch.no_grad():
        expected = hf(input_ids=padded, attention_mask=mask).last_hidden_state[mask.bool()]  # (T, E)
        got = ours(flat, cu)  # (T, E)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_sentence_embeds_the_same_alone_and_in_a_batch():
    torch.manual_seed(0)
    enc = PackedBertEncoder(BertConfig(**CFG)).eval()
    _, flat, cu = _packed([5, 12, 2])
    with torch.no_grad():
        batch = enc.embed(flat, cu)  # (B, E)
        alone = enc.embed(flat[5:17], torch.tensor([0, 12]))  # the middle sentence only
    torch.testing.assert_close(batch[1:2], alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(batch.norm(dim=-1), torch.ones(3))


def test_encoder_refuses_bad_shapes_and_too_long_sentences():
    enc = PackedBertEncoder(BertConfig(**CFG)).eval()
    with pytest.raises(ValueError, match=r"cu_seqlens \(B \+ 1,\) ending at T; got input_ids \(5,\) and "
                                         r"cu_seqlens ending at 4"):
        enc(torch.ones(5, dtype=torch.int64), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="a sentence has 30 tokens but the model has 24 positions"):
        enc(torch.ones(30, dtype=torch.int64), torch.tensor([0, 30]))

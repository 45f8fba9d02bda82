"""A padding-free BERT encoder on real weights: all-MiniLM-L6-v2 through headwise.

    pip install -e ".[hf]" && python examples/packed_bert.py [--quick]

What it shows, on sentences of very different lengths:

1. The weights: sentence-transformers' all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads,
   E = 384), read from its ``model.safetensors`` and renamed into an encoder whose
   attention layers are ``headwise.MultiHeadAttention`` (the table lists layer 0's
   tensors; ``headwise.integrations.sentence_transformers.WEIGHT_MAP`` is the whole mapping).
2. Packing: the batch's real tokens one after another, (T, E), with ``cu_seqlens``
   marking the sentences. Embeddings, q/k/v/out projections, feed-forward layers and
   layer norms run on T rows; attention runs within each sentence
   (``MultiHeadAttention.forward_packed``). A padded batch would compute B * max_length.
3. The result: mean pooling + L2 normalisation over each sentence's rows gives the same
   embeddings as ``SentenceTransformer.encode`` (cosine >= 0.99999 for every sentence).

The encoder itself lives in ``headwise.models.bert`` and its loader in
``headwise.integrations.sentence_transformers`` (``headwise embed`` uses them);
this script is the walk-through. ``benchmarks/embed_throughput.py`` measures its speed.

Legend: B sentences, T real tokens, S the longest sentence, E embed dim.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from headwise.integrations.sentence_transformers import WEIGHT_MAP, SentenceEncoder, default_model_dir, load_encoder

SENTENCES = [
    "Hi!",
    "Attention is all you need.",
    "The cat sat on the mat while the dog slept by the door.",
    "A padded batch spends as much compute on its padding as on its words, so packing the real "
    "tokens of sentences of very different lengths saves work in every layer of the encoder.",
    "Multi-head attention splits the model width into heads that attend independently, then joins "
    "them again with an output projection. " * 8,
    "ok",
]


def mapping_table(encoder: SentenceEncoder, layer: int = 0) -> Table:
    """The checkpoint tensors of one layer and where they go, with their shapes."""
    table = Table(title=f"model.safetensors -> headwise encoder (layer {layer}; the other layers alike)")
    for column in ("checkpoint tensor", "encoder parameter", "shape"):
        table.add_column(column)
    params = encoder.encoder.state_dict()  # the names checkpoints load into (q, k, v apart)
    for old, new in WEIGHT_MAP.items():
        for kind in ("weight", "bias"):
            ours = f"layers.{layer}.{new}{kind}"
            table.add_row(f"encoder.layer.{layer}.{old}{kind}", ours, str(tuple(params[ours].shape)))
    return table


def padding_saved(encoder: SentenceEncoder, sentences: list[str]) -> tuple[int, int]:
    """(tokens packed, tokens a padded batch would compute) for one batch of ``sentences``."""
    lengths = [len(ids) for ids in encoder.tokenize(sentences)]
    return sum(lengths), len(lengths) * max(lengths)


def compare_with_sentence_transformers(encoder: SentenceEncoder, sentences: list[str]) -> dict[str, torch.Tensor]:
    """Embed ``sentences`` with the packed encoder and with sentence-transformers.

    Returns:
        ``{"ours": (B, E), "theirs": (B, E), "cosine": (B,), "max_abs_diff": ()}``.
    """
    from sentence_transformers import SentenceTransformer

    ours = encoder.encode(sentences)  # (B, E)
    reference = SentenceTransformer(str(default_model_dir()), device="cpu")
    theirs = reference.encode(sentences, convert_to_tensor=True).float()  # (B, E)
    return {"ours": ours, "theirs": theirs, "cosine": (ours * theirs).sum(-1),
            "max_abs_diff": (ours - theirs).abs().max()}


def main(console: Console | None = None, argv: list[str] | None = None) -> dict[str, torch.Tensor]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first four sentences only (CI)")
    args = parser.parse_args([] if argv is None and console is not None else argv)
    sentences = SENTENCES[:4] if args.quick else SENTENCES
    console = console or Console(width=120)
    encoder = load_encoder()
    cfg = encoder.encoder.config
    console.print(f"all-MiniLM-L6-v2 from {default_model_dir()}: {cfg.num_hidden_layers} layers, "
                  f"{cfg.num_attention_heads} heads, E = {cfg.hidden_size}, max {encoder.max_length} tokens")
    console.print(mapping_table(encoder))

    packed, padded = padding_saved(encoder, sentences)
    ids, cu_seqlens, lengths = encoder.pack(encoder.tokenize(sentences))
    console.print(f"\n{len(sentences)} sentences of {list(lengths)} tokens -> packed input_ids {tuple(ids.shape)}, "
                  f"cu_seqlens {cu_seqlens.tolist()}")
    console.print(f"every layer computes {packed} token rows instead of {padded} "
                  f"({len(sentences)} x {max(lengths)} padded): {1 - packed / padded:.0%} less work")

    result = compare_with_sentence_transformers(encoder, sentences)
    table = Table(title="packed headwise encoder vs SentenceTransformer.encode")
    for column in ("sentence", "tokens", "cosine"):
        table.add_column(column)
    for sentence, n, cos in zip(sentences, encoder.tokenize(sentences), result["cosine"].tolist(), strict=True):
        table.add_row(sentence[:60] + ("..." if len(sentence) > 60 else ""), str(len(n)), f"{cos:.7f}")
    console.print(table)
    console.print(f"cosine min {result['cosine'].min().item():.7f}, "
                  f"max |difference| {result['max_abs_diff'].item():.1e}")
    return result


if __name__ == "__main__":
    main()

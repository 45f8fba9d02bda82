"""A BERT encoder that runs on packed tokens, its attention a ``headwise.MultiHeadAttention``.

Legend: T real tokens in a batch (no padding), B sentences in a batch, E embed dim,
H heads, F feed-forward width, V vocabulary.

A padded batch of B sentences costs B * max_length tokens in every projection, every
feed-forward layer and every attention score. Here the real tokens of a batch are
*packed* one after another into a (T, E) tensor, with ``cu_seqlens`` (B + 1,) marking
where each sentence starts: embeddings, projections, feed-forward layers and layer
norms run on T rows, and attention runs within each sentence through
:meth:`headwise.MultiHeadAttention.forward_packed`. Mean pooling is a segment mean over
each sentence's rows, then L2 normalisation, as sentence-transformers defines the
embedding of all-MiniLM-L6-v2.

Loading a Hugging Face / sentence-transformers checkpoint into it is
:mod:`headwise.integrations.sentence_transformers`; the ``headwise embed`` command is
:mod:`headwise.apps.embed`.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headwise.module import MultiHeadAttention

__all__ = ["BertConfig", "BertEmbeddings", "BertLayer", "PackedBertEncoder"]


@dataclass(frozen=True)
class BertConfig:
    """The parts of a Hugging Face ``config.json`` a BERT encoder needs."""

    vocab_size: int
    hidden_size: int  # E
    num_attention_heads: int  # H
    num_hidden_layers: int
    intermediate_size: int  # F
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Read ``config.json``; ``ValueError`` for architectures this encoder does not model."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); download the model again or fix the file") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object (a dict of settings), got a {type(raw).__name__}; "
                             "download the model again or fix the file")
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"{path}: model_type is {raw['model_type']!r}; this encoder is for 'bert' checkpoints")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act is {raw['hidden_act']!r}; this encoder implements 'gelu' (erf)")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: position_embedding_type is {raw['position_embedding_type']!r}; "
                             "this encoder implements 'absolute'")
        fields = cls.__dataclass_fields__.values()
        missing = [f.name for f in fields if f.default is MISSING and f.name not in raw]
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)}; a BERT config.json names them all")
        return cls(**{f.name: raw[f.name] for f in fields if f.name in raw})


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm, on packed tokens."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, E)
        self.position = nn.Embedding(config.max_position_embeddings, E)
        self.token_type = nn.Embedding(config.type_vocab_size, E)
        self.norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        # Single-segment input: token type 0 everywhere, as sentence-transformers encodes.
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]  # (T, E)
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """One post-norm BERT layer whose attention is a ``headwise.MultiHeadAttention``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        E, H = config.hidden_size, config.num_attention_heads
        self.attn = MultiHeadAttention(E, H, dropout=config.attention_probs_dropout_prob)
        self.attn_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.ffn_in = nn.Linear(E, config.intermediate_size)
        self.ffn_out = nn.Linear(config.intermediate_size, E)
        self.ffn_norm = nn.LayerNorm(E, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: Tensor, cu_seqlens: Tensor, lengths: tuple[int, ...]) -> Tensor:
        a = self.attn.forward_packed(x, cu_seqlens, lengths=lengths)  # (T, E): attention within each sentence
        x = self.attn_norm(x + self.dropout(a))  # (T, E)
        h = F.gelu(self.ffn_in(x))  # (T, E) -> (T, F)
        return self.ffn_norm(x + self.dropout(self.ffn_out(h)))  # (T, F) -> (T, E)


class PackedBertEncoder(nn.Module):
    """A BERT encoder that runs on packed tokens: no compute on padding anywhere.

    Args:
        config: the checkpoint's :class:`BertConfig`.

    >>> cfg = BertConfig(vocab_size=30, hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
    ...                  intermediate_size=32, max_position_embeddings=8)
    >>> enc = PackedBertEncoder(cfg).eval()
    >>> ids, cu = torch.tensor([2, 5, 3, 2, 3]), torch.tensor([0, 3, 5])  # two sentences, 3 + 2 tokens
    >>> enc(ids, cu).shape, enc.embed(ids, cu).shape
    (torch.Size([5, 16]), torch.Size([2, 16]))
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor, lengths: tuple[int, ...] | None = None) -> Tensor:
        """Token states of packed sentences.

        Args:
            input_ids: (T,) the token ids of B sentences, one after another.
            cu_seqlens: (B + 1,) offsets: sentence b is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``.
            lengths: the B lengths as ints, if known (saves reading ``cu_seqlens``).

        Returns:
            (T, E) the last layer's states of every real token.

        Raises:
            ValueError: shapes that do not fit, or a sentence longer than the position table.
        """
        if input_ids.dim() != 1 or cu_seqlens.dim() != 1 or int(cu_seqlens[-1]) != input_ids.shape[0]:
            raise ValueError(f"input_ids must be (T,) and cu_seqlens (B + 1,) ending at T; got input_ids "
                             f"{tuple(input_ids.shape)} and cu_seqlens ending at {int(cu_seqlens[-1])}")
        if lengths is None:
            lengths = tuple(torch.diff(cu_seqlens).tolist())
        longest = max(lengths, default=0)
        if longest > self.config.max_position_embeddings:
            raise ValueError(f"a sentence has {longest} tokens but the model has "
                             f"{self.config.max_position_embeddings} positions; truncate the input")
        sizes = torch.tensor(lengths, device=input_ids.device)  # (B,)
        starts = torch.repeat_interleave(cu_seqlens[:-1], sizes)  # (T,) each token's sentence start
        positions = torch.arange(input_ids.shape[0], device=input_ids.device) - starts  # (T,) 0, 1, ... per sentence
        x = self.embeddings(input_ids, positions)  # (T, E)
        for layer in self.layers:
            x = layer(x, cu_seqlens, lengths)  # (T, E)
        return x

    def embed(self, input_ids: Tensor, cu_seqlens: Tensor, lengths: tuple[int, ...] | None = None, *,
              normalize: bool = True) -> Tensor:
        """Sentence embeddings: the mean of each sentence's token states, L2-normalised.

        Args:
            input_ids, cu_seqlens, lengths: as in :meth:`forward`.
            normalize: L2-normalise each embedding.

        Returns:
            (B, E), each row of unit length when ``normalize``.
        """
        if lengths is None:
            lengths = tuple(torch.diff(cu_seqlens).tolist())
        states = self(input_ids, cu_seqlens, lengths)  # (T, E)
        sizes = torch.tensor(lengths, device=states.device)  # (B,)
        mean = torch.segment_reduce(states, "mean", lengths=sizes, axis=0)  # (T, E) -> (B, E)
        return F.normalize(mean, dim=-1) if normalize else mean

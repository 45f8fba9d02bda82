"""Moved: the BERT encoder is :mod:`headwise.models.bert`, checkpoint loading and
:class:`SentenceEncoder` are :mod:`headwise.integrations.sentence_transformers`, and the
``headwise embed`` command is :mod:`headwise.apps.embed`. The old names here warn once,
then keep working.
"""

from __future__ import annotations

from headwise.deprecation import moved

_PLACES = {
    "headwise.models.bert": ("BertConfig", "BertEmbeddings", "BertLayer", "PackedBertEncoder"),
    "headwise.integrations.sentence_transformers": ("SentenceEncoder", "WEIGHT_MAP", "default_model_dir",
                                                    "hf_bert_to_headwise", "load_encoder"),
    "headwise.apps.embed": ("add_embed_parser",),
}


__getattr__ = moved(__name__, {name: (place, f"{place}.{name}") for place, names in _PLACES.items() for name in names})

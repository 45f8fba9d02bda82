"""Models built on headwise attention, each in its own file.

:mod:`headwise.models.bert`: a BERT encoder that runs on packed tokens (no compute on
padding), loaded from sentence-transformers checkpoints by
:mod:`headwise.integrations.sentence_transformers`.
"""

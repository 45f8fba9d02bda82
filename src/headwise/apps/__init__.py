"""Command-line applications built on headwise, beside the core (``headwise <command>``).

:mod:`headwise.apps.embed`: ``headwise embed``, sentence embeddings.
"""

"""Command-line applications built on headwise, beside the core (``headwise <command>``).

:mod:`headwise.apps.embed`: ``headwise embed``, sentence embeddings.
:mod:`headwise.apps.checks`: the checks every command makes before its work.
"""

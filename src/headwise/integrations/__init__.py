"""Bridges from headwise to other libraries, imported on demand.

Nothing here is imported by ``import headwise``: each bridge needs an optional extra
(``pip install "headwise[hf]"`` for :mod:`headwise.integrations.transformers`) and says
so, in one line, when it is missing.

>>> from headwise.integrations import transformers as hw_hf
>>> hw_hf.register()
'headwise'
"""

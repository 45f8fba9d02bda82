"""headwise: multi-head attention for PyTorch, correct for every mask, fast, and explainable.

>>> import torch, headwise
>>> mha = headwise.MultiHeadAttention(128, 8)
>>> mha(torch.rand(3, 2, 128), torch.tensor([[1, 1], [1, 0], [1, 0]])).shape
torch.Size([3, 2, 128])
"""

from headwise import calibration, masks, reference, tune
from headwise.calibration import calibrate
from headwise.dispatch import Dispatch
from headwise.functional import attention, available_backends, choose_backend
from headwise.invariance import batch_invariant, is_batch_invariant
from headwise.module import MultiHeadAttention
from headwise.packing import packed_attention
from headwise.paged import paged_attention
from headwise.paged_cache import PagedKVCache
from headwise.pieces import merge_attentions
from headwise.tracing import Trace, trace

calibration.measure_with(tune.measure)  # "auto" measures this machine's unit costs at first use

__all__ = [
    "Dispatch",
    "MultiHeadAttention",
    "attention",
    "available_backends",
    "batch_invariant",
    "calibrate",
    "choose_backend",
    "is_batch_invariant",
    "masks",
    "packed_attention",
    "paged_attention",
    "PagedKVCache",
    "reference",
    "trace",
    "Trace",
    "merge_attentions",
]

__version__ = "0.1.0"

"""Attention in pieces: partial attentions over disjoint sets of keys, merged exactly.

Attention over keys split into parts P1, P2, ... is each part's attention, ``out_i``
(normalised over the part's keys only), weighed by how much of the row's softmax mass the
part holds. With ``lse_i``, the log of part i's softmax denominator (what
``headwise.attention(..., return_lse=True)`` returns)::

    lse = log(sum_i exp(lse_i))          out = sum_i exp(lse_i - lse) * out_i

This is what the ring of :mod:`headwise.distributed` does between ranks, what chunked
prefill does between the cache and the new tokens, and what shared-prefix (cascade)
decoding does between a prefix attended once and each sequence's own suffix. A part in
which a row attends nothing has ``lse_i = -inf`` and carries no weight; a row that attends
nothing in any part is zeros with ``lse = -inf``, never NaN, forward or backward.

Legend: S query length, Dv value head dim; ``...`` any leading dims, (B, H) in attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge_attentions", "merge_into"]


def _check(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> None:
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"merge_attentions needs one lse per output and at least one part, got {len(outs)} outputs "
                         f"and {len(lses)} lses")
    for n, (o, s) in enumerate(zip(outs, lses, strict=True)):
        if not isinstance(o, Tensor) or not isinstance(s, Tensor):
            raise TypeError(f"part {n}: outs and lses must be tensors, got {type(o).__name__} and {type(s).__name__}")
        if o.shape[:-1] != s.shape or o.shape != outs[0].shape:
            raise ValueError(f"part {n}: out {tuple(o.shape)} and lse {tuple(s.shape)} must be (..., S, Dv) and "
                             f"(..., S), every part like part 0's out {tuple(outs[0].shape)}")


def merge_attentions(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge partial attentions over disjoint keys into the attention over all of them.

    Args:
        outs: each part's output (..., S, Dv), e.g. (B, H, S, Dv), normalised over its keys.
        lses: each part's log-sum-exp (..., S): ``-inf`` where the row attended nothing there.

    Returns:
        ``(out, lse)``: (..., S, Dv) in the outputs' dtype and (..., S) in float32 (float64
        for float64 inputs); exact to float64 rounding, differentiable in every input.

    Raises:
        ValueError / TypeError: parts that are not tensors or whose shapes differ.

    >>> import torch, headwise
    >>> q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    >>> a = headwise.attention(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    >>> b = headwise.attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    >>> out, lse = merge_attentions([a[0], b[0]], [a[1], b[1]])
    >>> torch.allclose(out, headwise.attention(q, k, v), atol=1e-6)
    True
    """
    _check(outs, lses)
    acc = torch.float64 if any(t.dtype == torch.float64 for t in (*outs, *lses)) else torch.float32
    stacked = torch.stack([s.to(acc) for s in lses])  # (P, ..., S)
    top = stacked.detach().amax(dim=0)  # (..., S): the largest part, a shift for exp
    top = torch.where(torch.isinf(top), 0.0, top)  # every part empty (-inf): shift by 0, all weights 0
    weights = torch.exp(stacked - top)  # (P, ..., S), 0 for an empty part
    total = weights.sum(dim=0)  # (..., S)
    some = total > 0
    lse = torch.where(some, top + torch.log(torch.where(some, total, 1.0)), float("-inf"))  # (..., S)
    share = weights / torch.where(some, total, 1.0)  # (P, ..., S): each part's share of the row's mass
    out = torch.stack([share[n].unsqueeze(-1) * o.to(acc) for n, o in enumerate(outs)]).sum(dim=0)  # (..., S, Dv)
    return out.to(outs[0].dtype), lse


def merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge one more part ``(out_b, lse_b)`` into a running ``(out, lse)``, in place, without
    autograd (``out_b`` is overwritten): the same formula as :func:`merge_attentions` for two
    parts, for loops that merge many (the ring). ``lse`` may keep a trailing dimension of 1."""
    new = torch.logaddexp(lse, lse_b)  # (..., S[, 1])
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # both -inf: stay zeros and -inf
    out.mul_(torch.exp(lse - safe)).add_(out_b.mul_(torch.exp(lse_b - safe)))
    lse.copy_(new)

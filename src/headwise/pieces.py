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

from headwise import policy

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
    for n, s in enumerate(lses):
        if not policy.reads_values(s):  # meta, an accelerator (a host sync), torch.compile: as the mask's check
            continue
        positive = torch.isposinf(s)
        if bool(positive.any()):
            first = tuple(positive.nonzero()[0].tolist())
            raise ValueError(f"merge_attentions: part {n}'s lse holds +inf at {int(positive.sum())} position(s), the "
                             f"first at {first}; a log-sum-exp is finite, or -inf where the row attended nothing")


def merge_attentions(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Merge partial attentions over disjoint keys into the attention over all of them.

    Args:
        outs: each part's output (..., S, Dv), e.g. (B, H, S, Dv), normalised over its keys.
        lses: each part's log-sum-exp (..., S): ``-inf`` where the row attended nothing there.

    Returns:
        A tuple ``(out, lse)``: the merged output (..., S, Dv) in the outputs' dtype and its
        log-sum-exp (..., S) in float32 (float64 for float64 inputs); exact to float64
        rounding, differentiable in every input. A part whose lse is ``-inf`` in a row adds
        nothing to it (even NaN or inf in its out) and gets zero gradients there; a row no
        part attends is zeros with lse ``-inf``; a NaN lse makes its row's out and lse NaN.

    Raises:
        ValueError / TypeError: parts that are not tensors or whose shapes differ; an lse that
            holds ``+inf`` (checked where its values are read without cost, as the mask's
            +inf: a CPU tensor outside torch.compile; elsewhere the row comes back NaN).

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
    empty = torch.isneginf(stacked.detach())  # (P, ..., S): a part the row attends nothing in, weight 0
    top = stacked.detach().amax(dim=0)  # (..., S): the largest part, a shift for exp (NaN where an lse is NaN)
    top = torch.where(torch.isneginf(top), 0.0, top)  # every part empty (-inf): shift by 0, all weights 0
    weights = torch.exp(stacked - top)  # (P, ..., S), 0 for an empty part
    total = weights.sum(dim=0)  # (..., S): NaN where an lse is NaN
    dead = total == 0  # (..., S): no part attends the row
    lse = torch.where(dead, float("-inf"), top + torch.log(torch.where(dead, 1.0, total)))  # (..., S)
    share = weights / torch.where(dead, 1.0, total)  # (P, ..., S): each part's share of the row's mass
    # An empty part's out may hold anything (NaN, inf): zeroed, so neither it nor its gradient reaches the merge.
    parts = [share[n].unsqueeze(-1) * torch.where(empty[n].unsqueeze(-1), 0.0, o.to(acc)) for n, o in enumerate(outs)]
    out = torch.stack(parts).sum(dim=0)  # (P, ..., S, Dv) -> (..., S, Dv)
    return out.to(outs[0].dtype), lse


def merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge one more part ``(out_b, lse_b)`` into a running ``(out, lse)``, in place, without
    autograd (``out_b`` is overwritten): the same formula as :func:`merge_attentions` for two
    parts, for loops that merge many (the ring). ``lse`` may keep a trailing dimension of 1."""
    new = torch.logaddexp(lse, lse_b)  # (..., S[, 1])
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))  # both -inf: stay zeros and -inf
    # A part whose lse is -inf carries no weight: its out may hold anything (NaN, inf), so it is zeroed, not
    # multiplied by exp(-inf) = 0 (0 * NaN is NaN).
    out.masked_fill_(_per_row(torch.isneginf(lse), out), 0.0)
    out_b.masked_fill_(_per_row(torch.isneginf(lse_b), out_b), 0.0)
    out.mul_(_per_row(torch.exp(lse - safe), out)).add_(out_b.mul_(_per_row(torch.exp(lse_b - safe), out_b)))
    lse.copy_(new)


def _per_row(flags: Tensor, out: Tensor) -> Tensor:
    """``flags`` (..., S) or (..., S, 1) as (..., S, 1), to broadcast over ``out`` (..., S, Dv)."""
    return flags if flags.dim() == out.dim() else flags.unsqueeze(-1)

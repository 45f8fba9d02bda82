"""Steps shared by the kernels: the middle of attention for those that materialise the
score matrix, and the zeros and length buckets of those that drop padding.

Explain mode describes :func:`mask_softmax_dropout`'s stages in
:func:`headwise.kernels.describe.middle`; nothing here records anything.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise import policy
from headwise.masks import masked_scores, safe_softmax
from headwise.rules import Rules


def mask_softmax_dropout(scores: Tensor, attention_mask: Tensor | None, rules: Rules, dropout_p: float,
                         lse: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """Apply the score rules, mask the scaled scores, softmax them, and apply dropout: the
    middle of attention, with every rule evaluated on the whole (S, Sk) grid.

    Args:
        scores: scaled scores (B, H, S, Sk).
        attention_mask: normalised mask (B|1, H|1, S|1, Sk) or None.
        rules: the call's rules (softcap, ALiBi and score_mod in that order, then the
            mask with the causal / window rule and mask_mod ANDed in; sinks join the softmax).
        dropout_p: dropout probability on the weights (0 disables it).
        lse: also return each row's log-sum-exp.

    Returns:
        ``(weights, dropped, lse)``: the probabilities (B, H, S, Sk) (zero rows where
        nothing may be attended; with sinks each row sums to less than 1), the same after
        dropout, and with ``lse`` the log of each row's softmax denominator (B, H, S),
        sinks counted, ``-inf`` where nothing may be attended (else None).
    """
    B, H, S, Sk = scores.shape
    everything = (0, S), (0, Sk)
    scores = rules.scored(scores, S, Sk, *everything)  # (B, H, S, Sk): softcap, ALiBi, score_mod
    allowed = rules.allowed(B, H, S, Sk, *everything, scores.device)  # (B|1, H|1, S, Sk) or None
    scores = masked_scores(masked_scores(scores, attention_mask), allowed)  # (B, H, S, Sk)
    if rules.sinks is None:
        weights = safe_softmax(scores)  # (B, H, S, Sk)
    else:
        column = rules.sinks.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, S, 1)  # (H,) -> (B, H, S, 1)
        scores = torch.cat([scores, column], dim=-1)  # (B, H, S, Sk + 1): the sink is key Sk
        weights = safe_softmax(scores)[..., :Sk]  # (B, H, S, Sk + 1) -> (B, H, S, Sk), the sink dropped
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights  # (B, H, S, Sk)
    return weights, dropped, row_lse(scores) if lse else None


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_lse(scores: Tensor) -> Tensor:
    """Each row's log-sum-exp of final scores (..., S, Sk) (``-inf`` where masked): (..., S),
    ``-inf`` for a row with nothing to attend, whose gradient is zero (never NaN)."""
    dead = torch.isneginf(scores.detach().amax(dim=-1, keepdim=True))  # (..., S, 1)
    lse = torch.logsumexp(scores.masked_fill(dead, 0.0).to(lse_dtype(scores.dtype)), dim=-1)  # (..., S)
    return lse.masked_fill(dead[..., 0], float("-inf"))


def blocks(n: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each block of ``size`` along ``n`` positions, the last one shorter.

    Under torch.compile with dynamic shapes, the number of blocks becomes a guard but ``n``
    stays symbolic: ``range(0, n, size)`` or ``min(start + size, n)`` would pin ``n`` to one
    value, so every sequence length would compile a graph of its own.

    >>> blocks(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    count = int((n + size - 1) // size)  # a guard on the number of blocks, not on n
    return [(i * size, n if i == count - 1 else i * size + size) for i in range(count)]


def fold_rules(attention_mask: Tensor | None, rules: Rules, B: int, H: int, S: int, Sk: int,
               device: torch.device, dtype: torch.dtype) -> Tensor | None:
    """The one mask a kernel that takes a mask gets (B|1, H|1, S|1, Sk): the caller's, with the
    mask rules (causal, window, sink tokens, mask_mod) ANDed in and the additive score rules
    (ALiBi, a score_mod with ``bias``) added; a float mask where there is a bias. The caller
    has checked ``rules.additive`` (soft-capping and a general score_mod cannot be folded)."""
    allowed = rules.allowed(B, H, S, Sk, (0, S), (0, Sk), device)  # (B|1, H|1, S, Sk) bool or None
    mask = attention_mask
    if allowed is not None:
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask & allowed
        else:
            mask = mask.masked_fill(~allowed, float("-inf"))
    bias = rules.bias(B, H, S, Sk, device, dtype)  # (B|1, H|1, S, Sk) float or None
    if bias is None:
        return mask
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return mask + bias


def attached_zeros(like: Tensor, *also: Tensor, size: int | None = None) -> Tensor:
    """Zeros shaped like ``like`` (with last dimension ``size``, None: like's) that stay in
    the autograd graph of ``like`` and ``also`` (zero gradients, no NaN even where the inputs
    hold inf), for outputs where nothing may be attended: (B, H, S, Dv) from q (B, H, S, D)."""
    never = torch.zeros((), dtype=torch.bool, device=like.device)
    if size is None or size == like.shape[-1]:
        out = torch.where(never, like, 0.0)
    else:  # v's own head dim: the shape of the output, q's graph through a sum
        out = like.new_zeros(*like.shape[:-1], size) + torch.where(never, like.sum(), 0.0)
    for t in also:
        out = out + torch.where(never, t.sum(), 0.0)
    return out


def length_buckets(lengths: list[int], slack: float | None = None) -> list[list[int]]:  # None: the policy's
    """Group indices of non-empty ``lengths``, longest first, so that in each group every
    length is at least ``(1 - slack)`` of the group's longest (padding waste <= slack;
    ``policy.BUCKET_SLACK`` by default)."""
    slack = policy.BUCKET_SLACK if slack is None else slack
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lengths[i] >= (1 - slack) * lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets

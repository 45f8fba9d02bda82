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
from headwise.deprecation import moved
from headwise.masks import alibi_bias, combined_mask, masked_scores, safe_softmax


def mask_softmax_dropout(
    scores: Tensor,
    attention_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    sink_tokens: int = 0,
) -> tuple[Tensor, Tensor]:
    """Cap, mask the scaled scores, softmax them, and apply dropout: the middle of attention.

    Args:
        scores: scaled scores (B, H, S, Sk).
        attention_mask: normalised mask (B|1, H|1, S|1, Sk) or None.
        is_causal: AND the bottom-right causal rule into the mask.
        dropout_p: dropout probability on the weights (0 disables it).
        window: causal sliding window length (None: unlimited).
        alibi_slopes: (H,) ALiBi slopes (None: no positional bias).
        softcap: soft-capping ``softcap * tanh(scores / softcap)``, before ALiBi and the
            mask (None: none).
        sinks: (H,) sink logits: one more column in each row's softmax, dropped after it
            (None: none).
        sink_tokens: keys kept visible under the window (StreamingLLM; 0: none).

    Returns:
        ``(weights, dropped)``, both (B, H, S, Sk): the probabilities (zero rows where
        nothing may be attended; with sinks each row sums to less than 1) and the same
        after dropout.
    """
    S, Sk = scores.shape[-2:]
    mask = combined_mask(attention_mask, is_causal, S, Sk, scores.device, window,
                         sink_tokens)  # (B|1, H|1, S|1, Sk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap  # (B, H, S, Sk), in (-softcap, softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(scores.dtype), S, Sk)  # + (1, H, S, Sk)
    scores = masked_scores(scores, mask)  # (B, H, S, Sk)
    if sinks is None:
        weights = safe_softmax(scores)  # (B, H, S, Sk)
    else:
        B, H = scores.shape[:2]
        column = sinks.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, S, 1)  # (H,) -> (B, H, S, 1)
        scores = torch.cat([scores, column], dim=-1)  # (B, H, S, Sk + 1): the sink is key Sk
        weights = safe_softmax(scores)[..., :Sk]  # (B, H, S, Sk + 1) -> (B, H, S, Sk), the sink dropped
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights  # (B, H, S, Sk)
    return weights, dropped


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


__getattr__ = moved(__name__, {name: (policy, f"headwise.policy.{name}") for name in ("BUCKET_SLACK",
                                                                                       "DIRECT_MIN_LENGTH")})


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

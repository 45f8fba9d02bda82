"""Steps shared by the kernels that materialise the score matrix.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise import tracing as trace
from headwise.masks import alibi_bias, combined_mask, masked_scores, safe_softmax


def mask_softmax_dropout(
    scores: Tensor,
    attention_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Mask the scaled scores, softmax them, and apply dropout: the middle of attention.

    Args:
        scores: scaled scores (B, H, S, Sk).
        attention_mask: normalised mask (B|1, H|1, S|1, Sk) or None.
        is_causal: AND the bottom-right causal rule into the mask.
        dropout_p: dropout probability on the weights (0 disables it).
        window: causal sliding window length (None: unlimited).
        alibi_slopes: (H,) ALiBi slopes (None: no positional bias).

    Returns:
        ``(weights, dropped)``, both (B, H, S, Sk): the probabilities (zero rows where
        nothing may be attended) and the same after dropout.
    """
    S, Sk = scores.shape[-2:]
    mask = combined_mask(attention_mask, is_causal, S, Sk, scores.device, window)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(scores.dtype), S, Sk)  # + (1, H, S, Sk)
        if trace.ACTIVE:
            trace.record("alibi", scores, "+ -slope_h * |i + Sk - S - j| (per-head linear distance bias)")
    scores = masked_scores(scores, mask)
    if trace.ACTIVE:
        trace.record("mask", scores, _mask_note(mask, attention_mask, is_causal, window))
    weights = safe_softmax(scores)  # (B, H, S, Sk)
    if trace.ACTIVE:
        trace.record("softmax", weights, "softmax over Sk; a row with nothing to attend -> zeros, not NaN")
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    if trace.ACTIVE:
        trace.record("dropout", dropped, f"p = {dropout_p}: zero weights at random, scale the rest by "
                     f"1/(1-p)" if dropout_p > 0 else "p = 0: identity")
    return weights, dropped


def scale_queries(q: Tensor, scale: float) -> Tensor:
    """``q * scale`` (B, H, S, D), recorded as explain mode's scaling stage.

    Scaling q before the product equals scaling the scores, and it cannot overflow fp16
    where the scaled scores fit, while an unscaled ``q k^T`` can pass 65504.
    """
    q = q * scale  # (B, H, S, D)
    if trace.ACTIVE:
        default = abs(scale - q.shape[-1] ** -0.5) <= 1e-12 * max(1.0, scale)
        trace.record("scaling", q, f"q x scale = {scale:.4g} " + ("(1 / sqrt(D))" if default else "(given scale=)")
                     + " before the product")
    return q


def _mask_note(mask: Tensor | None, user_mask: Tensor | None, is_causal: bool,
               window: int | None) -> str:
    """One line saying what the mask step did (for explain mode only)."""
    if mask is None:
        return "no mask: every key visible"
    parts = []
    if user_mask is not None:
        how = "masked_fill(~mask, -inf)" if user_mask.dtype == torch.bool else "+ additive bias"
        parts.append(f"{how}, mask {tuple(user_mask.shape)} broadcast to (B, H, S, Sk)")
    if is_causal or window is not None:
        parts.append("causal j <= i + Sk - S" + (f", window {window}" if window else ""))
    return "; ".join(parts)


def attached_zeros(like: Tensor, *also: Tensor) -> Tensor:
    """Zeros shaped like ``like`` that stay in the autograd graph of ``like`` and ``also``
    (zero gradients, no NaN even where the inputs hold inf), for outputs where nothing
    may be attended."""
    never = torch.zeros((), dtype=torch.bool, device=like.device)
    out = torch.where(never, like, 0.0)
    for t in also:
        out = out + torch.where(never, t.sum(), 0.0)
    return out


# A length bucket takes sequences down to (1 - BUCKET_SLACK) of its longest one.
BUCKET_SLACK = 0.15

# From this length on a sequence (or a batch row's real keys) attends on its own, on views
# of its rows: no gather and no mask. Stacking it into a bucket would cost about what
# the bucket's padding saves.
DIRECT_MIN_LENGTH = 128


def length_buckets(lengths: list[int], slack: float = BUCKET_SLACK) -> list[list[int]]:
    """Group indices of non-empty ``lengths``, longest first, so that in each group every
    length is at least ``(1 - slack)`` of the group's longest (padding waste <= slack)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if buckets and lengths[i] >= (1 - slack) * lengths[buckets[-1][0]]:
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets

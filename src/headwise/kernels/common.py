"""Steps shared by the kernels that materialise the score matrix.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

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
    weights = safe_softmax(masked_scores(scores, mask))  # (B, H, S, Sk)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return weights, dropped

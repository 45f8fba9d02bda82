"""The documents' ``torch.einsum`` form: ``'bhij,bhjd->bhid'``, with a group axis for GQA.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per kv head,
S query length, Sk key length, D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwise.kernels import describe
from headwise.kernels.common import mask_softmax_dropout
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage
from headwise.rules import Rules


def einsum_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    rules: Rules,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    return_lse: bool = False,  # True: the result's lse (B, H, S) too
) -> KernelResult:
    B, H, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    q = q * scale  # (B, H, S, D): before the product, where q k^T could overflow fp16
    qg = q.reshape(B, Hkv, H // Hkv, S, D)  # (B, H, S, D) -> (B, Hkv, G, S, D)
    scores = torch.einsum("bhgsd,bhkd->bhgsk", qg, k)  # -> (B, Hkv, G, S, Sk)
    scores = scores.reshape(B, H, S, Sk)  # (B, Hkv, G, S, Sk) -> (B, H, S, Sk)
    weights, dropped, lse = mask_softmax_dropout(scores, attention_mask, rules, dropout_p, return_lse)
    dropped = dropped.reshape(B, Hkv, H // Hkv, S, Sk)  # (B, H, S, Sk) -> (B, Hkv, G, S, Sk)
    out = torch.einsum("bhgsk,bhkd->bhgsd", dropped, v).reshape(B, H, S, v.shape[-1])  # -> (B, H, S, Dv)
    return KernelResult(out, weights if need_weights else None, lse)  # lse None unless return_lse


def einsum_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stages of :func:`einsum_attention` for one call (recorded by headwise.functional)."""
    _, H, Hkv, _, _, _ = call.sizes
    groups = f"G = H // Hkv = {H // Hkv} query heads share each kv head, no copy" if Hkv != H else "G = 1"
    return describe.textbook(
        call,
        scores=f"einsum('bhgsd,bhkd->bhgsk', q, k), {groups}; reshaped to (B, H, S, Sk)",
        weighted_sum=f"einsum('bhgsk,bhkd->bhgsd', weights, v), reshaped to (B, H, S, {describe.value_dim_name(call)})",
    )


KERNEL = Kernel(
    name="einsum",
    fn=einsum_attention,
    summary="torch.einsum index notation; grouped-query heads without copying k/v",
    supports_weights=True,
    native_gqa=True,
    stages=einsum_stages,
)

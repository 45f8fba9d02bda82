"""The textbook kernel: softmax(q k^T * scale + mask) v, written as the documents write it.

This is the oracle the tests compare every other kernel with, and the first file a
newcomer should open.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwise.kernels import describe
from headwise.kernels.common import mask_softmax_dropout
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage
from headwise.rules import Rules


def matmul_attention(
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
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv != H:
        # Grouped-query attention: query head h reads kv head h // (H // Hkv).
        # Readable, but it copies k and v to H heads; einsum/sdpa/chunked do not.
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, D) -> (B, H, Sk, D)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, Dv) -> (B, H, Sk, Dv)
    q = q * scale  # (B, H, S, D): before the product, where q k^T could overflow fp16
    scores = torch.matmul(q, k.transpose(-2, -1))  # (B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)
    weights, dropped, lse = mask_softmax_dropout(scores, attention_mask, rules, dropout_p, return_lse)
    out = torch.matmul(dropped, v)  # (B, H, S, Sk) x (B, H, Sk, Dv) -> (B, H, S, Dv)
    return KernelResult(out, weights if need_weights else None, lse)  # lse None unless return_lse


def matmul_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stages of :func:`matmul_attention` for one call (recorded by headwise.functional)."""
    dv = describe.value_dim_name(call)
    return describe.textbook(
        call,
        copies_kv="a copy",
        scores="torch.matmul(q, k.transpose(-2, -1)): (B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)",
        weighted_sum=f"torch.matmul(weights, v): (B, H, S, Sk) x (B, H, Sk, {dv}) -> (B, H, S, {dv})",
    )


KERNEL = Kernel(
    name="matmul",
    fn=matmul_attention,
    summary="torch.matmul, the documents' formula; the reference the others are tested against",
    supports_weights=True,
    stages=matmul_stages,
)

"""The documents' ``torch.bmm`` form: batch and heads flattened into one 3-D batch.

``bmm`` takes 3-D tensors only and does not broadcast, so grouped-query k/v are copied
to H heads before flattening.

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


def bmm_attention(
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
    if Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, D) -> (B, H, Sk, D)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, Dv) -> (B, H, Sk, Dv)
    q = q * scale  # (B, H, S, D): before the product, where q k^T could overflow fp16
    q3 = q.reshape(B * H, S, D)  # (B, H, S, D) -> (B*H, S, D)
    k3 = k.reshape(B * H, Sk, D)  # (B, H, Sk, D) -> (B*H, Sk, D)
    Dv = v.shape[-1]
    v3 = v.reshape(B * H, Sk, Dv)  # (B, H, Sk, Dv) -> (B*H, Sk, Dv)
    scores = torch.bmm(q3, k3.transpose(1, 2))  # (B*H, S, D) x (B*H, D, Sk) -> (B*H, S, Sk)
    scores = scores.reshape(B, H, S, Sk)  # (B*H, S, Sk) -> (B, H, S, Sk)
    weights, dropped, lse = mask_softmax_dropout(scores, attention_mask, rules, dropout_p, return_lse)
    out = torch.bmm(dropped.reshape(B * H, S, Sk), v3)  # (B*H, S, Sk) x (B*H, Sk, Dv) -> (B*H, S, Dv)
    out = out.reshape(B, H, S, Dv)  # (B*H, S, Dv) -> (B, H, S, Dv)
    return KernelResult(out, weights if need_weights else None, lse)  # lse None unless return_lse


def bmm_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stages of :func:`bmm_attention` for one call (recorded by headwise.functional)."""
    B, H, _, S, Sk, D = call.sizes
    Dv, dv = call.value_dim, describe.value_dim_name(call)
    return describe.textbook(
        call,
        copies_kv="a copy (bmm cannot broadcast)",
        scores=f"torch.bmm on (B*H, S, D) x (B*H, D, Sk) = ({B * H}, {S}, {D}) x ({B * H}, {D}, {Sk}), "
               "reshaped to (B, H, S, Sk)",
        weighted_sum=f"torch.bmm on (B*H, S, Sk) x (B*H, Sk, {dv}) = ({B * H}, {S}, {Sk}) x ({B * H}, {Sk}, {Dv}), "
                     f"reshaped to (B, H, S, {dv})",
    )


KERNEL = Kernel(
    name="bmm",
    fn=bmm_attention,
    summary="torch.bmm on (B*H, S, D); copies k/v to H heads for grouped-query attention",
    supports_weights=True,
    stages=bmm_stages,
)

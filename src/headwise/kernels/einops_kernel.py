"""The documents' ``einops`` form: named axes for every rearrangement and product.

Legend: b batch, h query heads, hkv key/value heads, g = h // hkv query heads per kv head,
s query length, k key length, d head dim (v's own in the weighted sum).
"""

from __future__ import annotations

import einops
from torch import Tensor

from headwise.kernels import describe
from headwise.kernels.common import mask_softmax_dropout
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage
from headwise.rules import Rules


def einops_attention(
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
    q = q * scale  # (B, H, S, D): before the product, where q k^T could overflow fp16
    hkv = k.shape[1]
    qg = einops.rearrange(q, "b (hkv g) s d -> b hkv g s d", hkv=hkv)
    scores = einops.einsum(qg, k, "b hkv g s d, b hkv k d -> b hkv g s k")
    scores = einops.rearrange(scores, "b hkv g s k -> b (hkv g) s k")  # (B, H, S, Sk)
    weights, dropped, lse = mask_softmax_dropout(scores, attention_mask, rules, dropout_p, return_lse)
    dropped = einops.rearrange(dropped, "b (hkv g) s k -> b hkv g s k", hkv=hkv)
    out = einops.einsum(dropped, v, "b hkv g s k, b hkv k d -> b hkv g s d")  # v's d may differ from q's
    out = einops.rearrange(out, "b hkv g s d -> b (hkv g) s d")  # (B, H, S, Dv)
    return KernelResult(out, weights if need_weights else None, lse)  # lse None unless return_lse


def einops_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stages of :func:`einops_attention` for one call (recorded by headwise.functional)."""
    _, H, Hkv, _, _, _ = call.sizes
    return describe.textbook(
        call,
        scores=f"einops.einsum 'b hkv g s d, b hkv k d -> b hkv g s k' with g = {H // Hkv}, "
               "rearranged 'b hkv g s k -> b (hkv g) s k'",
        weighted_sum="einops.einsum 'b hkv g s k, b hkv k d -> b hkv g s d', rearranged 'b hkv g s d -> b (hkv g) s d'",
    )


KERNEL = Kernel(
    name="einops",
    fn=einops_attention,
    summary="einops.rearrange and einops.einsum with named axes; grouped-query without copies",
    supports_weights=True,
    native_gqa=True,
    stages=einops_stages,
)

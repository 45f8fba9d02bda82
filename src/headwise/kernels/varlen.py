"""Key-padding-free attention for dense (B, H, S, D) inputs.

With a key padding mask, each batch row only needs its real keys: this kernel moves
them to the front (keeping their order and original positions), groups rows of similar
key counts into buckets, and runs SDPA on each bucket with only as many key columns as
its longest row has real keys. Causality, windows and ALiBi are rebuilt from the keys'
original positions, so the result is the dense result. Queries are all kept (the
functional contract gives padded queries an output too); the module's packed path
(:mod:`headwise.varlen`) also drops padded queries.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, n rows in a bucket, L a bucket's key count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwise import tracing as trace
from headwise.kernels.common import attached_zeros, length_buckets
from headwise.kernels.registry import register
from headwise.kernels.sdpa import sdpa_attention, sdpa_masked


def _refuses(request) -> str | None:
    if request.mask_kind == "float" or (request.mask_kind == "bool" and not request.key_padding_only):
        return "needs a bool/integer key padding mask (B, Sk); other masks have no padding to drop"
    return None


@register(
    "varlen",
    summary="drops padded keys per batch row and runs SDPA per length bucket; cost follows real keys",
    native_gqa=True,
    fused=True,
    refuses=_refuses,
)
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    window: int | None = None,  # None: unlimited; else a causal sliding window of this many keys
    alibi_slopes: Tensor | None = None,  # None: no ALiBi; else (H,) slopes
) -> tuple[Tensor, Tensor | None]:
    if attention_mask is None:  # no padding to drop: the dense kernel is the same computation
        return sdpa_attention(q, k, v, attention_mask=None, is_causal=is_causal, dropout_p=dropout_p,
                              scale=scale, need_weights=False, window=window, alibi_slopes=alibi_slopes)
    B, H, S, D = q.shape
    Sk = k.shape[2]
    keys = attention_mask.reshape(attention_mask.shape[0], Sk).expand(B, Sk)  # (B, Sk) True = real key
    order = torch.argsort((~keys).to(torch.int8), dim=1, stable=True)  # real keys first, in order
    lengths = keys.sum(1).tolist()
    out = attached_zeros(q, k, v)  # (B, H, S, D); rows with no real key stay zero
    i = torch.arange(S, device=q.device)[:, None] + (Sk - S)  # (S, 1) aligned query positions
    rows_all, outs = [], []
    for rows in length_buckets(lengths):
        L = lengths[rows[0]]
        idx = torch.tensor(rows, device=q.device)
        pos = order.index_select(0, idx)[:, :L]  # (n, L) original positions of the kept keys
        gather = pos[:, None, :, None].expand(-1, k.shape[1], -1, D)  # (n, Hkv, L, D)
        kb = k.index_select(0, idx).gather(2, gather)  # (n, Hkv, L, D)
        vb = v.index_select(0, idx).gather(2, gather)
        allowed = (torch.arange(L, device=q.device)[None, :]
                   < torch.tensor([lengths[r] for r in rows], device=q.device)[:, None])  # (n, L)
        mask = allowed[:, None, None, :]  # (n, 1, 1, L)
        j = pos[:, None, None, :]  # (n, 1, 1, L)
        if is_causal or window is not None:
            mask = mask & (j <= i)  # (n, 1, S, L)
            if window is not None:
                mask = mask & (j > i - window)
        if alibi_slopes is not None:
            bias = -alibi_slopes.to(q.dtype)[None, :, None, None] * (i - j).abs().to(q.dtype)  # (n, H, S, L)
            mask = bias.masked_fill(~mask, float("-inf"))
        ob = sdpa_masked(q.index_select(0, idx), kb, vb, mask, dropout_p=dropout_p, scale=scale)  # (n, H, S, D)
        rows_all.append(idx)
        outs.append(ob)
    if outs:
        out = out.index_copy(0, torch.cat(rows_all), torch.cat(outs))
    if trace.ACTIVE:
        trace.record("varlen", out, f"scores, mask, softmax, dropout, weighted sum per bucket of rows with "
                     f"similar real-key counts ({len(outs)} buckets, keys kept: {sum(lengths)} of {B * Sk})",
                     fused=True)
    return out, None

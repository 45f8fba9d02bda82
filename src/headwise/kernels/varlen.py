"""Key-padding-free attention for dense (B, H, S, D) inputs.

With a key padding mask, each batch row only needs its real keys. A row with many
(``DIRECT_MIN_LENGTH``) attends on its own, reading a view of its first keys when the
padding is on the right (the usual layout) or gathering them otherwise; shorter rows are
stacked into buckets of similar key counts, each run with only as many key columns as
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
from headwise.kernels.common import DIRECT_MIN_LENGTH, attached_zeros, length_buckets
from headwise.kernels.registry import Kernel
from headwise.kernels.sdpa import sdpa_attention, sdpa_masked


def _refuses(request) -> str | None:
    if request.mask_kind == "float" or (request.mask_kind == "bool" and not request.key_padding_only):
        return "needs a bool/integer key padding mask (B, Sk); other masks have no padding to drop"
    return None


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
    sizes = keys.sum(1)  # (B,)
    lengths = sizes.tolist()
    buckets = length_buckets(lengths)
    if not buckets:  # no row has a key: the contract's zero rows, in the graph of q, k and v
        out = attached_zeros(q, k, v)  # (B, H, S, D)
        if trace.ACTIVE:
            trace.record("varlen", out, "no real key in any row: zeros", fused=True)
        return out, None
    span = torch.arange(Sk, device=q.device)  # (Sk,)
    # Right padding (real keys first, the usual layout) needs no gather: a row reads k[b, :, :L, :].
    prefix = bool((keys == (span[None, :] < sizes[:, None])).all())
    order = None if prefix else torch.argsort((~keys).to(torch.int8), dim=1, stable=True)  # (B, Sk) real keys first
    i = torch.arange(S, device=q.device)[:, None] + (Sk - S)  # (S, 1) aligned query positions
    # Per-row views: unbind's backward is one stack, where indexing rows out of the batch
    # would cost a (B, H, S, D) zero fill per index.
    q_rows, k_rows, v_rows = q.unbind(0), k.unbind(0), v.unbind(0)  # B x (H|Hkv, S|Sk, D)
    out_rows: list[Tensor | None] = [None] * B  # None: a row with no real key
    groups = [[r] for rows in buckets for r in rows if lengths[r] >= DIRECT_MIN_LENGTH]  # long rows: alone
    groups += [[r for r in rows if lengths[r] < DIRECT_MIN_LENGTH] for rows in buckets]
    for rows in filter(None, groups):
        L = max(lengths[r] for r in rows)
        idx = torch.tensor(rows, device=q.device)  # (n,)
        if prefix:
            pos = span[None, :L]  # (1, L): the kept keys are the first L
            kb, vb = (torch.stack([t[r][:, :L] for r in rows]) if len(rows) > 1 else t[rows[0]][None, :, :L]
                      for t in (k_rows, v_rows))  # (n, Hkv, L, D); one row: a view
        else:
            pos = order.index_select(0, idx)[:, :L]  # (n, L) original positions of the kept keys
            kb, vb = (torch.stack([t[r].index_select(1, pos[j]) for j, r in enumerate(rows)])
                      for t in (k_rows, v_rows))  # (n, Hkv, L, D)
        qb = torch.stack([q_rows[r] for r in rows]) if len(rows) > 1 else q_rows[rows[0]][None]  # (n, H, S, D)
        mask = None
        if any(lengths[r] < L for r in rows):
            mask = (span[None, :L] < sizes.index_select(0, idx)[:, None])[:, None, None, :]  # (n, 1, 1, L)
        j = pos[:, None, None, :]  # (n|1, 1, 1, L)
        if is_causal or window is not None:
            near = j <= i if window is None else (j <= i) & (j > i - window)  # (n|1, 1, S, L)
            mask = near if mask is None else mask & near
        if alibi_slopes is not None:
            bias = -alibi_slopes.to(q.dtype)[None, :, None, None] * (i - j).abs().to(q.dtype)  # (n|1, H, S, L)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        ob = sdpa_masked(qb, kb, vb, mask, dropout_p=dropout_p, scale=scale)  # (n, H, S, D)
        for r, o in zip(rows, ob.unbind(0), strict=True):
            out_rows[r] = o
    if any(o is None for o in out_rows):  # rows with no real key output zeros (zero gradients reach q through unbind)
        zeros = q.new_zeros(H, S, v.shape[-1])
        out_rows = [zeros if o is None else o for o in out_rows]
    out = torch.stack(out_rows)  # (B, H, S, D)
    if trace.ACTIVE:
        trace.record("varlen", out, f"scores, mask, softmax, dropout, weighted sum per bucket of rows with "
                     f"similar real-key counts ({len(buckets)} buckets, keys kept: {sum(lengths)} of {B * Sk})",
                     fused=True)
    return out, None


KERNEL = Kernel(
    name="varlen",
    fn=varlen_attention,
    summary="drops padded keys per batch row and runs SDPA per length bucket; cost follows real keys",
    native_gqa=True,
    fused=True,
    refuses=_refuses,
)

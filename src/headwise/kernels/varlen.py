"""Key-padding-free attention for dense (B, H, S, D) inputs.

Each batch row only needs its real keys: those that some query of some head may attend
(with a key padding mask, the unpadded ones). A row with many (``DIRECT_MIN_LENGTH``)
attends on its own, reading a view of its first keys when the padding is on the right
(the usual layout) or gathering them otherwise; shorter rows are stacked into buckets of
similar key counts, each run with only as many key columns as its longest row has real
keys. Causality, windows and ALiBi are rebuilt from the keys' original positions, and the
rest of a mask (3-D, 4-D, float) is gathered at the kept keys' columns, so the result is
the dense result for every mask of the contract. Queries are all kept (the functional
contract gives padded queries an output too); the module's packed path
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
    m = attention_mask  # (B|1, H|1, S|1, Sk)
    attend = m if m.dtype == torch.bool else ~torch.isneginf(m)
    keys = attend.any(dim=2).any(dim=1).expand(B, Sk)  # (B, Sk) True = some query may attend the key
    # What the kept keys' columns still need beyond dropping the others: nothing for a key
    # padding mask; the mask itself for 3-D / 4-D masks and additive biases.
    rest = None if m.dtype == torch.bool and m.shape[1:3] == (1, 1) else m.expand(B, -1, -1, -1)  # (B, H|1, S|1, Sk)
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
        allowed, bias = None, None  # bool (True = attend) and additive parts of the bucket's mask
        if any(lengths[r] < L for r in rows):
            allowed = (span[None, :L] < sizes.index_select(0, idx)[:, None])[:, None, None, :]  # (n, 1, 1, L)
        j = pos[:, None, None, :]  # (n|1, 1, 1, L)
        if is_causal or window is not None:
            near = j <= i if window is None else (j <= i) & (j > i - window)  # (n|1, 1, S, L)
            allowed = near if allowed is None else allowed & near
        if rest is not None:
            cols = rest.index_select(0, idx)  # (n, H|1, S|1, Sk)
            cols = cols[..., :L] if prefix else cols.gather(-1, j.expand(*cols.shape[:3], L))  # (n, H|1, S|1, L)
            if cols.dtype == torch.bool:
                allowed = cols if allowed is None else allowed & cols
            else:
                bias = cols
        if alibi_slopes is not None:
            distance = -alibi_slopes.to(q.dtype)[None, :, None, None] * (i - j).abs().to(q.dtype)  # (n|1, H, S, L)
            bias = distance if bias is None else bias + distance
        if bias is None:
            mask = allowed
        elif allowed is None:
            mask = bias
        else:
            mask = bias.masked_fill(~allowed, float("-inf"))
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
)

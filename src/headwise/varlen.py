"""Padding-free attention: pack the real tokens, attend per length bucket, scatter back.

A padded batch costs dense attention as much as a full one. Here the valid tokens of a
(B, S) batch are packed into (T, ...) with T = the real token count, so projections and
feed-forward layers run on T rows, and attention runs per *length bucket*: sequences of
similar length are gathered into a small padded batch (at most ``BUCKET_SLACK`` of it
padding), or a long one attends on its own, and handed to
:func:`headwise.functional.attend`, so every mask rule, causal, dropout and GQA work as
everywhere else.

Legend: B batch, S padded length, T real tokens, H query heads, Hkv key/value heads,
D head dim, E embed dim, n sequences in a bucket, L a bucket's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from headwise.functional import attend
from headwise.kernels.common import BUCKET_SLACK, length_buckets

__all__ = ["Packed", "pack", "unpack", "packed_attention", "BUCKET_SLACK", "DIRECT_MIN_LENGTH"]

# From this length on a sequence attends on its own (views of the packed rows, no gather
# and no mask): the gather and scatter of a bucket cost about what its padding saves.
DIRECT_MIN_LENGTH = 128

@dataclass(frozen=True)
class Packed:
    """Where the real tokens of a padded batch went.

    Attributes:
        index: (T,) positions of the real tokens in the flattened (B * S) batch.
        cu_seqlens: (B + 1,) int64 offsets: sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1].
        positions: (T,) each token's position in its padded sequence (for rotary angles).
        lengths: the B lengths as Python ints.
        batch, seq: B and S of the padded batch.
    """

    index: Tensor
    cu_seqlens: Tensor
    positions: Tensor
    lengths: tuple[int, ...]
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def pack(x: Tensor, mask: Tensor) -> tuple[Tensor, Packed]:
    """Keep the rows of ``x`` (B, S, ...) where ``mask`` (B, S) is True / nonzero.

    Returns:
        ``(packed (T, ...), Packed)``; sequence order and token order are kept.

    >>> x = torch.arange(6.).reshape(2, 3, 1)
    >>> packed, info = pack(x, torch.tensor([[1, 1, 0], [1, 0, 0]]))
    >>> packed.flatten().tolist(), info.lengths
    ([0.0, 1.0, 3.0], (2, 1))
    """
    B, S = mask.shape
    keep = mask.reshape(-1) != 0  # (B * S,)
    index = keep.nonzero().squeeze(1)  # (T,)
    lengths = (mask != 0).sum(1)  # (B,)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=mask.device)
    cu[1:] = lengths.cumsum(0)
    info = Packed(index, cu, index % S, tuple(lengths.tolist()), B, S)
    packed = x.reshape(B * S, *x.shape[2:]).index_select(0, index)  # (T, ...)
    return packed, info


def unpack(packed: Tensor, info: Packed) -> Tensor:
    """Scatter packed rows (T, ...) back to (B, S, ...), zeros at the padding."""
    out = packed.new_zeros(info.batch * info.seq, *packed.shape[1:])
    out = out.index_copy(0, info.index, packed)  # differentiable scatter
    return out.reshape(info.batch, info.seq, *packed.shape[1:])


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    lengths: tuple[int, ...] | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str = "auto",
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
) -> Tensor:
    """Self-attention within each packed sequence.

    Args:
        q: (T, H, D) packed queries.
        k, v: (T, Hkv, D) packed keys and values (same sequences as q).
        cu_seqlens: (B + 1,) offsets of the sequences in the packed rows.
        lengths: the B lengths as ints, if known (saves reading cu_seqlens).
        is_causal, dropout_p, scale, backend, window, alibi_slopes: as in
            :func:`headwise.attention`; positions count within each packed sequence.

    Returns:
        (T, H, D) outputs.

    Raises:
        ValueError: shapes that do not fit ``cu_seqlens``.
    """
    T = q.shape[0]
    if lengths is None:
        lengths = tuple(torch.diff(cu_seqlens).tolist())
    if k.shape[0] != T or v.shape[0] != T or sum(lengths) != T:
        raise ValueError(
            f"packed q ({T}), k ({k.shape[0]}) and v ({v.shape[0]}) rows must all equal the "
            f"sum of the sequence lengths ({sum(lengths)})"
        )
    starts = cu_seqlens.tolist()
    targets, results = [], []
    for bucket in length_buckets(list(lengths)):
        L = lengths[bucket[0]]
        if L >= DIRECT_MIN_LENGTH:  # long sequences: attend on strided views, no gather, no mask
            for i in bucket:
                span = slice(starts[i], starts[i] + lengths[i])
                qi, ki, vi = (t[span].transpose(0, 1)[None] for t in (q, k, v))  # (1, H|Hkv, L_i, D)
                oi = attend(qi, ki, vi, is_causal=is_causal, dropout_p=dropout_p, scale=scale, backend=backend,
                            window=window, alibi_slopes=alibi_slopes)  # (1, H, L_i, D)
                targets.append(torch.arange(span.start, span.stop, device=q.device))
                results.append(oi[0].transpose(0, 1))  # (L_i, H, D)
            continue
        span = torch.arange(L, device=q.device)  # (L,)
        first = torch.tensor([starts[i] for i in bucket], device=q.device)  # (n,)
        size = torch.tensor([lengths[i] for i in bucket], device=q.device)  # (n,)
        valid = span[None, :] < size[:, None]  # (n, L)
        rows = torch.where(valid, first[:, None] + span[None, :], 0)  # (n, L) rows of q/k/v
        flat = rows.reshape(-1)
        qb = q.index_select(0, flat).reshape(len(bucket), L, *q.shape[1:]).transpose(1, 2)  # (n, H, L, D)
        kb = k.index_select(0, flat).reshape(len(bucket), L, *k.shape[1:]).transpose(1, 2)  # (n, Hkv, L, D)
        vb = v.index_select(0, flat).reshape(len(bucket), L, *v.shape[1:]).transpose(1, 2)
        mask = None if bool(valid.all()) else valid  # equal lengths: no mask, the fastest path
        ob = attend(qb, kb, vb, mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
                    backend=backend, window=window, alibi_slopes=alibi_slopes)  # (n, H, L, D)
        ob = ob.transpose(1, 2).reshape(len(bucket) * L, *ob.shape[1:2], ob.shape[-1])  # (n * L, H, D)
        keep = valid.reshape(-1)
        targets.append(flat[keep])
        results.append(ob[keep])
    out = q.new_zeros(T, q.shape[1], v.shape[-1])  # (T, H, D)
    if targets:  # one scatter for all buckets
        out = out.index_copy(0, torch.cat(targets), torch.cat(results))
    return out

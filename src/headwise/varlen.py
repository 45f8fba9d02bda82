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
from headwise.kernels.common import BUCKET_SLACK, DIRECT_MIN_LENGTH, length_buckets

__all__ = ["Packed", "pack", "unpack", "packed_attention", "BUCKET_SLACK", "DIRECT_MIN_LENGTH"]


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
    # split() views are cheap in both directions: its backward is one concatenation, where
    # slicing each sequence out of the packed rows would cost a (T, H, D) zero fill apiece.
    qs, ks, vs = (t.split(list(lengths)) for t in (q, k, v))  # B x (L_i, H|Hkv, D)
    pieces: list[Tensor | None] = [None] * len(lengths)  # each sequence's (L_i, H, D) output
    for bucket in length_buckets(list(lengths)):
        L = lengths[bucket[0]]
        if L >= DIRECT_MIN_LENGTH:  # long sequences attend on their own: no padding and no mask
            for i in bucket:
                qi, ki, vi = (t[i].transpose(0, 1)[None] for t in (qs, ks, vs))  # (1, H|Hkv, L_i, D)
                oi = attend(qi, ki, vi, is_causal=is_causal, dropout_p=dropout_p, scale=scale, backend=backend,
                            window=window, alibi_slopes=alibi_slopes)  # (1, H, L_i, D)
                pieces[i] = oi[0].transpose(0, 1)  # (L_i, H, D)
            continue
        n = len(bucket)
        qb, kb, vb = (_pad_bucket([t[i] for i in bucket], L).transpose(1, 2) for t in (qs, ks, vs))  # (n, H|Hkv, L, D)
        size = torch.tensor([lengths[i] for i in bucket], device=q.device)  # (n,)
        valid = torch.arange(L, device=q.device)[None, :] < size[:, None]  # (n, L) True = token
        mask = None if bool(valid.all()) else valid  # equal lengths: no mask, the fastest path
        ob = attend(qb, kb, vb, mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
                    backend=backend, window=window, alibi_slopes=alibi_slopes)  # (n, H, L, D)
        ob = ob.transpose(1, 2).reshape(n * L, ob.shape[1], ob.shape[-1])  # (n * L, H, D)
        parts = ob.split([m for i in bucket for m in (lengths[i], L - lengths[i])])  # token, padding, ...
        for j, i in enumerate(bucket):
            pieces[i] = parts[2 * j]  # (L_i, H, D)
    kept = [p for p in pieces if p is not None]  # empty sequences have no rows
    if not kept:  # no tokens at all: (0, H, D), still in the graph so backward reaches x
        return q.new_zeros(T, q.shape[1], v.shape[-1]) + (q.sum() + k.sum() + v.sum())
    return torch.cat(kept)  # (T, H, D), in the packed order


def _pad_bucket(seqs: list[Tensor], L: int) -> Tensor:
    """Stack sequences (L_i, ...) into (n, L, ...), zero rows after each one.

    A single concatenation, so the backward hands each sequence a view of its gradient.
    """
    rows = []
    for t in seqs:
        rows.append(t)
        if t.shape[0] < L:
            rows.append(t.new_zeros(L - t.shape[0], *t.shape[1:]))
    return torch.cat(rows).reshape(len(seqs), L, *seqs[0].shape[1:])  # (n, L, ...)

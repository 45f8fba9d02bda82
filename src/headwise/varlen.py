"""The old home of the padding-free path, kept importable: see :mod:`headwise.packing`.

``pack``, ``unpack`` and ``Packed`` are re-exported unchanged. ``packed_attention`` keeps
its old self-attention signature (one offsets tensor) and runs
:func:`headwise.packing.attend_packed`; it warns once (``FutureWarning``) that
:func:`headwise.packed_attention` (separate query and key offsets, as flash-attn's
``flash_attn_varlen_func``) replaces it. ``BUCKET_SLACK`` and ``DIRECT_MIN_LENGTH`` moved
to :mod:`headwise.policy`.

Legend: B sequences, T packed tokens, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor

from headwise import policy
from headwise.deprecation import moved, warn_once
from headwise.kernels.common import length_buckets
from headwise.packing import Packed, _check_inputs, _lengths, attend_packed, pack, unpack

__all__ = ["Packed", "pack", "unpack", "packed_attention", "length_buckets"]

__getattr__ = moved(__name__, {name: (policy, f"headwise.policy.{name}") for name in ("BUCKET_SLACK",
                                                                                       "DIRECT_MIN_LENGTH")})

def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    lengths: tuple[int, ...] | None = None,  # None: read from cu_seqlens
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,  # None: 1 / sqrt(D)
    backend: str = "auto",
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
) -> Tensor:
    """Self-attention within each packed sequence (deprecated: use :func:`headwise.packed_attention`).

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
        ValueError / TypeError: as :func:`headwise.packed_attention`.

    >>> import torch
    >>> q = k = v = torch.randn(5, 2, 4)
    >>> packed_attention(q, k, v, torch.tensor([0, 2, 5]), is_causal=True).shape
    torch.Size([5, 2, 4])
    """
    warn_once("headwise.varlen.packed_attention",
              "headwise.varlen.packed_attention(q, k, v, cu_seqlens) is deprecated; call "
              "headwise.packed_attention(q, k, v, cu_seqlens, cu_seqlens) (separate query and key offsets, "
              "as flash-attn's flash_attn_varlen_func)")
    kwargs: dict[str, Any] = {"is_causal": is_causal, "window": window, "alibi_slopes": alibi_slopes,
                              "dropout_p": dropout_p, "scale": scale, "backend": backend}
    if lengths is None:
        _check_inputs(q, k, v, dropout_p, backend, window, alibi_slopes)  # before reading q's rows
        lengths = _lengths(cu_seqlens, "cu_seqlens", q.shape[0], "q")
    return cast(Tensor, attend_packed(q, k, v, lengths, lengths, **kwargs))  # no return_lse: a tensor

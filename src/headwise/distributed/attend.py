"""Context-parallel attention's entry: :func:`attention` checks its arguments on every rank
together (:mod:`headwise.distributed.arguments`), then runs the method asked for, or the one
``"auto"`` picks (:func:`~headwise.distributed.choose_method`): the ring
(:mod:`headwise.distributed.ring`) or Ulysses' all-to-alls around a local kernel
(:mod:`headwise.distributed.ulysses`).

Legend: B batch, H query heads, Hkv key/value heads, S / Sk global query / key length,
S_l / Sk_l this rank's lengths, D head dim, N world size.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import Tensor

from headwise.distributed import ulysses
from headwise.distributed.agreement import _group_info
from headwise.distributed.arguments import _Agreed, _agreed, _same_value_dim, _unexpected
from headwise.distributed.layout import check_layout
from headwise.distributed.method import METHODS, choose_method
from headwise.distributed.ring import Ring, RingPlan, ring_attention
from headwise.distributed.sharding import _gather_seq
from headwise.functional import attention as _local_attention

__all__ = ["attention"]

logger = logging.getLogger(__name__)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
    scale: float | None = None,  # None: 1 / sqrt(D)
    dropout_p: float = 0.0,  # only 0: context-parallel attention raises ValueError for dropout
    method: str = "ring",
    layout: str = "zigzag",
    group=None,  # None: the default process group
    **unexpected: Any,  # none: TypeError on every rank (one rank alone raising would hang the others)
) -> Tensor:
    """Exact attention of this rank's queries over the keys of every rank in ``group``.

    Same results, forward and backward, as :func:`headwise.attention` on the whole
    sequences, with the same mask contract (zero rows, never NaN). Causal alignment is
    bottom-right on global positions; window and ALiBi use global positions too.

    Args:
        q: this rank's queries (B, H, S_l, D), sharded with ``layout``.
        k: this rank's keys (B, Hkv, Sk_l, D), sharded with ``layout`` (Sk may differ from S).
        v: this rank's values (B, Hkv, Sk_l, D) (no head dim of its own: ValueError).
        attention_mask: None; a 2-D (B, Sk_l) key padding shard (bool/integer True = token
            or float additive), which travels with its K/V block; or a bool/integer/float
            (B|1, H|1, S_l, Sk) mask (3-D (B, S_l, Sk) too) of the local queries over all
            keys in natural order. Masks get no gradient.
        is_causal: query ``i`` may attend key ``j`` iff ``j <= i + Sk - S`` (global positions).
        window: sliding window over global positions (implies causal).
        alibi_slopes: (H,) ALiBi slopes; distances are global.
        scale: multiplier of ``q k^T`` (None: 1 / sqrt(D)).
        dropout_p: must be 0; there is no context-parallel dropout.
        method: ``"ring"``, ``"ulysses"`` or ``"auto"`` (see :func:`choose_method`).
        layout: ``"zigzag"`` or ``"contiguous"``, as the shards were made.
        group: the process group (None: the default group).

    Returns:
        (B, H, S_l, D): the output for this rank's queries, in q's dtype.

    Raises:
        RuntimeError: torch.distributed is not initialised, or a rank died / timed out.
        ValueError / TypeError: bad input on any rank (raised on every rank: the refusing rank
            raises its own error, the others one naming it and its message), an unknown keyword,
            ``+inf`` in a float mask, ranks that disagree on shapes, flags, ALiBi slopes or shard
            lengths, dropout, or heads ulysses cannot split.
    """
    rank, world = _group_info(group)
    if world == 1:
        return _one_rank(q, k, v, attention_mask, is_causal=is_causal, window=window, alibi_slopes=alibi_slopes,
                         scale=scale, dropout_p=dropout_p, method=method, layout=layout, unexpected=unexpected)
    agreed = _agreed(q, k, v, attention_mask, is_causal, window, alibi_slopes, scale, dropout_p, method, layout,
                     unexpected, group, world)
    H, D, Hkv = q.shape[1], q.shape[3], k.shape[1]
    scale = D ** -0.5 if scale is None else float(scale)
    if method == "auto":
        choice = choose_method(H, Hkv, world, dense_mask=agreed.dense is not None)
        logger.debug("hwd.attention method='auto' -> %s", choice)
        method = choice.method
    if method == "ulysses":
        ulysses.check_heads(H, Hkv, world)
        return _ulysses_attention(q, k, v, agreed, rank, layout, group, is_causal=is_causal, window=window,
                                  alibi_slopes=alibi_slopes, scale=scale)
    return _ring_attention(q, k, v, agreed, rank, layout, group, is_causal=is_causal, window=window,
                           alibi_slopes=alibi_slopes, scale=scale)


def _one_rank(q, k, v, attention_mask, *, is_causal, window, alibi_slopes, scale, dropout_p, method, layout,
              unexpected) -> Tensor:
    """A group of one: :func:`headwise.attention` on the whole sequences, after the checks every world size makes."""
    _unexpected(unexpected)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_layout(layout)
    _same_value_dim(k, v)  # the same contract at every world size
    return cast(Tensor, _local_attention(q, k, v, attention_mask, is_causal=is_causal, dropout_p=dropout_p,
                                         scale=scale, window=window, alibi_slopes=alibi_slopes))  # no weights


def _ring_attention(q, k, v, agreed: _Agreed, rank, layout, group, *, is_causal, window, alibi_slopes,
                    scale) -> Tensor:
    """K/V blocks travel around the ranks; this rank's (B, H, S_l, D) output."""
    world = len(agreed.q_lens)
    plan = RingPlan(q, k, S=sum(agreed.q_lens), Sk=sum(agreed.k_lens), rank=rank, world=world, layout=layout,
                    dense=agreed.dense, is_causal=is_causal, window=window, slopes=alibi_slopes, scale=scale)
    pad = agreed.pad
    if pad is not None:  # bool stored inverted (True = blocked), ready for masked_fill
        pad = ~pad.contiguous() if pad.dtype == torch.bool else pad.contiguous()
    return ring_attention(q, k, v, pad, plan, Ring(group, rank, world))


def _ulysses_attention(q, k, v, agreed: _Agreed, rank, layout, group, *, is_causal, window, alibi_slopes,
                       scale) -> Tensor:
    """Sequence split traded for a head split, the local kernel on whole sequences, and back; (B, H, S_l, D)."""
    q_lens, k_lens = agreed.q_lens, agreed.k_lens
    world = len(q_lens)
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    h = H // world
    index = ulysses.kv_head_index(H, Hkv, world, q.device)
    qh = ulysses.seq_to_heads(q, q_lens, layout, group)  # (B, h, S, D)
    kh = ulysses.seq_to_heads(k, k_lens, layout, group, index)  # (B, h_kv, Sk, D)
    vh = ulysses.seq_to_heads(v, k_lens, layout, group, index)
    mask = None
    if agreed.pad is not None:
        mask = _gather_seq(agreed.pad, -1, k_lens, layout, group)  # (B|1, Sk)
    elif agreed.dense is not None:
        # (B|1, H|1, 1, Sk) broadcast, or every rank's rows gathered: (B|1, H|1, S, Sk)
        dense = agreed.dense
        mask = dense if agreed.broadcast else _gather_seq(dense, 2, q_lens, layout, group)
        if mask.shape[1] == H:
            mask = mask[:, rank * h:(rank + 1) * h]  # this rank's heads
    slopes = None if alibi_slopes is None else alibi_slopes[rank * h:(rank + 1) * h]
    out = cast(Tensor, _local_attention(qh, kh, vh, mask, is_causal=is_causal, scale=scale, window=window,
                                        alibi_slopes=slopes))  # (B, h, S, D); no weights asked
    return ulysses.heads_to_seq(out, q_lens, rank, layout, group)  # (B, H, S_l, D)

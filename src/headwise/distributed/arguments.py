"""The arguments of :func:`headwise.distributed.attention`: checked on this rank, then agreed
by every rank in one small all-gather of metadata, before any data moves.

Each rank sends one row (the fields of ``_FIELDS``, then its q and k/v shard lengths and its
dense mask's row count); ranks that disagree on shapes, dtype, flags, ALiBi slopes (a CRC-32
of them) or shard lengths raise the same error on every rank.

Legend: B batch, H query heads, Hkv key/value heads, S / Sk global query / key length,
S_l / Sk_l this rank's lengths, D head dim, N world size.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple, cast

import torch
from torch import Tensor

from headwise.distributed.agreement import _all_gather_rows, _comm_device, _lengths, _refused
from headwise.distributed.layout import LAYOUTS, check_layout
from headwise.distributed.method import METHODS
from headwise.functional import _check_inputs, _check_structure
from headwise.mask_contract import check_mask_values
from headwise.masks import normalize_mask

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FIELDS = ("inputs valid", "batch B", "num_heads H", "num_kv_heads Hkv", "head_dim D", "dtype", "is_causal",
           "window", "alibi_slopes", "scale", "mask kind", "mask batch", "mask heads", "mask key length", "method",
           "layout", "dropout_p", "device type", "needs grad")
_MASK_KINDS = ("none", "bool (B, Sk_l) key padding", "float (B, Sk_l) key padding", "bool (.., S_l, Sk)",
               "float (.., S_l, Sk)")


def _same_value_dim(k: Tensor, v: Tensor) -> None:
    """Context parallelism moves k and v as one (2, B, Hkv, Sk_l, D) block: v's head dim must be k's."""
    if isinstance(k, Tensor) and isinstance(v, Tensor) and k.dim() == v.dim() == 4 and k.shape[-1] != v.shape[-1]:
        raise ValueError(f"context-parallel attention needs v's head dim to be k's (the ring sends k and v as one "
                         f"block): got D = {k.shape[-1]}, Dv = {v.shape[-1]}; use headwise.attention on one process "
                         "for a value head dim of its own")


def _unexpected(unexpected: dict) -> None:
    """A keyword attention does not take: TypeError (on every rank: a rank alone raising would hang the others)."""
    if unexpected:
        raise TypeError(f"hwd.attention() got an unexpected keyword argument {next(iter(unexpected))!r}; it takes "
                        "attention_mask, is_causal, window, alibi_slopes, scale, dropout_p, method, layout and group")


def _slopes_print(slopes: Tensor | None) -> float:
    """-1 for no ALiBi, else a CRC-32 of the slopes' float64 values: ranks that pass other slopes differ."""
    if slopes is None:
        return -1.0
    raw = slopes.detach().to("cpu", torch.float64).contiguous().view(torch.uint8)  # (8 H,) bytes
    return float(zlib.crc32(bytes(raw.tolist())))


def _local_check(q, k, v, attention_mask, is_causal, window, alibi_slopes, scale, dropout_p, method, layout,
                 unexpected):
    """Validate this rank's arguments; returns (normalised masks, metadata row, q/k lengths, dense mask rows)."""
    _unexpected(unexpected)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_layout(layout)
    _check_inputs(q, k, v, dropout_p, "auto")
    _check_structure(q, window, alibi_slopes)
    _same_value_dim(k, v)
    if dropout_p > 0:
        raise ValueError(f"context-parallel attention has no dropout (got dropout_p={dropout_p}); "
                         "use dropout_p=0 (the module: dropout=0.0 or .eval())")
    B, H, S_l, D = q.shape
    Sk_l = k.shape[2]
    pad = dense = None
    mask_kind, mask_b, mask_h, mask_rows, mask_sk = 0, 0, 0, -1, -1
    m = attention_mask
    if isinstance(m, Tensor):  # +inf makes a softmax NaN: refused here, before the ranks exchange anything
        check_mask_values(m)
    if m is not None:
        if isinstance(m, Tensor) and m.dim() == 2:
            pad4 = cast(Tensor, normalize_mask(m, batch=B, heads=H, q_len=S_l, k_len=Sk_l, device=q.device,
                                               dtype=q.dtype))  # a tensor for a tensor
            pad = pad4[:, 0, 0, :]  # (B|1, 1, 1, Sk_l) -> (B|1, Sk_l)
            mask_kind = 1 if pad.dtype == torch.bool else 2
            mask_b = pad.shape[0]
        else:
            k_len = m.shape[-1] if isinstance(m, Tensor) and m.dim() in (3, 4) else -1
            dense = cast(Tensor, normalize_mask(m, batch=B, heads=H, q_len=S_l, k_len=k_len, device=q.device,
                                                dtype=q.dtype))  # a tensor for a tensor
            mask_kind = 3 if dense.dtype == torch.bool else 4
            mask_b, mask_h, mask_rows, mask_sk = dense.shape[0], dense.shape[1], dense.shape[2], k_len
    row = [1, B, H, k.shape[1], D, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, int(bool(is_causal)),
           -1 if window is None else window, _slopes_print(alibi_slopes), -1.0 if scale is None else float(scale),
           mask_kind, mask_b, mask_h, mask_sk, METHODS.index(method), LAYOUTS.index(layout),
           float(dropout_p), 0 if q.device.type == "cpu" else 1,
           int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))]  # backward is collective
    return pad, dense, row, S_l, Sk_l, mask_rows


def _agree(rows: list[list[float]], world: int, alibi_slopes: Tensor | None):
    """Raise the same error on every rank when the ranks' metadata disagree."""
    for i, name in enumerate(_FIELDS):
        values = [row[i] for row in rows]
        if len(set(values)) > 1 and name == "alibi_slopes":
            groups = [[r for r, x in enumerate(values) if x == value] for value in dict.fromkeys(values)]
            mine = None if alibi_slopes is None else alibi_slopes.tolist()
            raise ValueError(f"the ranks disagree on alibi_slopes: the groups of ranks {groups} pass different ones "
                             f"(this rank's: {mine}); every rank must pass the same (H,) slopes, or none")
        if len(set(values)) > 1:
            shown = [_MASK_KINDS[int(x)] if name == "mask kind" else x for x in values]
            why = ("every rank must pass tensors of the same batch, heads, head dim and dtype, and the same flags"
                   if name != "needs grad" else "the backward is collective: q, k or v must require grad (under "
                   "grad mode) on every rank, or on none")
            raise ValueError(f"the ranks disagree on {name}: {shown} on ranks 0..{world - 1}; {why}")


def _rows_broadcast(rows: list[int], q_lens: list[int]) -> bool:
    """Whether a dense mask is one (.., 1, Sk) row for every query (True) or each rank's own rows.

    A rank that holds one query reads its one-row mask the same way under both, so the
    rows are each rank's own whenever every rank's row count is its query count.
    """
    if rows == q_lens:
        return False
    if all(n == 1 for n in rows):
        return True
    raise ValueError(f"attention_mask has {rows} rows on ranks 0..{len(rows) - 1} for {q_lens} queries; pass every "
                     "rank the rows of its own queries (.., S_l, Sk), or every rank the same (.., 1, Sk) row")


class _Agreed(NamedTuple):
    """What the ranks agreed on: this rank's masks, normalised, and every rank's shard lengths."""

    pad: Tensor | None  # (B|1, Sk_l) key padding, or None
    dense: Tensor | None  # (B|1, H|1, S_l | 1, Sk) mask of the local queries over every key, or None
    broadcast: bool  # dense is one (.., 1, Sk) row for every query (not each rank's own rows)
    q_lens: list[int]  # every rank's S_l, rank by rank
    k_lens: list[int]  # every rank's Sk_l, rank by rank


def _agreed(q, k, v, attention_mask, is_causal, window, alibi_slopes, scale, dropout_p, method, layout, unexpected,
            group, world: int) -> _Agreed:
    """This rank's checks (:func:`_local_check`), then one all-gather of every rank's metadata row:
    the same error on every rank when any rank refused its inputs or the ranks disagree."""
    error, pad, dense, row, S_l, Sk_l, mask_rows = None, None, None, [0] * len(_FIELDS), -1, -1, -1
    try:
        pad, dense, row, S_l, Sk_l, mask_rows = _local_check(q, k, v, attention_mask, is_causal, window,
                                                             alibi_slopes, scale, dropout_p, method, layout,
                                                             unexpected)
    except (TypeError, ValueError) as caught:
        error = caught
    device = _comm_device(group, q)
    rows = _all_gather_rows([*row, S_l, Sk_l, mask_rows], group, world, device)
    _refused([r[0] == 1 for r in rows], error, group, world, device)
    _agree([r[:len(_FIELDS)] for r in rows], world, alibi_slopes)
    q_lens = _lengths([int(r[-3]) for r in rows], world, layout, "q")
    k_lens = _lengths([int(r[-2]) for r in rows], world, layout, "k/v")
    # each rank's rows are its queries' unless every rank passes one row to broadcast
    broadcast = dense is not None and _rows_broadcast([int(r[-1]) for r in rows], q_lens)
    Sk = sum(k_lens)
    if dense is not None and dense.shape[-1] != Sk:
        raise ValueError(f"attention_mask covers {dense.shape[-1]} keys, but the k shards hold Sk = {Sk}; "
                         "a (.., S_l, Sk) mask spans every key in natural order")
    return _Agreed(pad, dense, broadcast, q_lens, k_lens)

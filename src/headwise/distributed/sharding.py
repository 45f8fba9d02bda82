"""Shards of one sequence across the ranks: cut (:func:`shard`), put back together on every rank
(:func:`unshard`, differentiable), and where each rank's positions lie (:func:`positions`,
:func:`global_positions`, :func:`global_length`).

Legend: B batch, H query heads, S global sequence length, S_l this rank's shard length,
D head dim, E embed dim, N world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from headwise.distributed.agreement import (
    _agree_tensors,
    _all_gather_rows,
    _checked_rows,
    _comm_device,
    _group_info,
    _lengths,
    _tensor_row,
)
from headwise.distributed.layout import check_layout, local_length, positions_of, segments

__all__ = ["global_length", "global_positions", "positions", "shard", "unshard"]


def global_length(local_len: int, group=None, device: torch.device | str | None = None) -> int:
    """The sequence length summed over the ranks of ``group`` (one all-gather).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    _, world = _group_info(group)
    device = _comm_device(group, torch.device(device) if device is not None else None)
    return int(sum(row[0] for row in _all_gather_rows([local_len], group, world, device)))


def positions(seq_len: int, layout: str = "zigzag", group=None,
              device: torch.device | str | None = None) -> Tensor:
    """The global positions of this rank's shard of a ``seq_len`` sequence.

    Args:
        seq_len: the global length S.
        layout: ``"zigzag"`` or ``"contiguous"``.
        group: the process group (None: the default group).
        device: where to build the result.

    Returns:
        (S_l,) int64 positions, in the shard's order (use them for rotary embeddings).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout.
    """
    check_layout(layout)
    rank, world = _group_info(group)
    return positions_of(seq_len, world, rank, layout, device)


def global_positions(local_len: int, layout: str = "zigzag", group=None,
                     device: torch.device | str | None = None) -> tuple[int, Tensor]:
    """The global length and this rank's global positions, from this rank's shard length (one all-gather).

    Unlike :func:`~headwise.distributed.global_length` then
    :func:`~headwise.distributed.positions`, it checks that the ranks' lengths are
    the layout's split of their sum, so a shard made some other way is the same ValueError on
    every rank, not a size mismatch on some and a hang on the others.

    Args:
        local_len: S_l, this rank's shard length.
        layout: ``"zigzag"`` or ``"contiguous"``, as the shards were made.
        group: the process group (None: the default group).
        device: where to build the positions (and, with gloo, where the metadata travels).

    Returns:
        The global length S and this rank's (S_l,) int64 positions, in the shard's order.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout, or lengths that are not the layout's split (on every rank).

    >>> S, pos = global_positions(x_local.shape[1], "zigzag")  # doctest: +SKIP
    """
    rank, world = _group_info(group)
    device = torch.device(device) if device is not None else None
    comm = _comm_device(group, device)

    def local() -> list[float]:
        check_layout(layout)
        if isinstance(local_len, bool) or not isinstance(local_len, int) or local_len < 0:
            raise ValueError(f"local_len must be a shard length (an int >= 0), got {local_len!r}")
        return [local_len]

    lengths = _lengths([int(row[0]) for row in _checked_rows(local, 1, group, world, comm)], world, layout, "x",
                       dim=1)
    return sum(lengths), positions_of(sum(lengths), world, rank, layout, device)


def shard(x: Tensor, dim: int = 1, layout: str = "zigzag", group=None) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (a view for ``"contiguous"``, a copy for ``"zigzag"``).

    Every rank of ``group`` calls it with the same whole tensor: one small all-gather of
    metadata checks its shape, dtype, device type, dim and layout on every rank.

    Args:
        x: the whole tensor, the same on every rank, e.g. (B, S, E) with ``dim=1`` or
            (B, H, S, D) with ``dim=2``; a (B, Sk) key padding mask with ``dim=1``.
        dim: the sequence dimension.
        layout: ``"zigzag"`` (rank r holds chunks r and 2N-1-r of 2N) or ``"contiguous"``.
        group: the process group (None: the default group).

    Returns:
        The shard, S_l = S // C or S // C + 1 positions per chunk (C chunks); nothing is
        dropped whatever S is.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout, a dim out of range, or ranks that pass tensors of another
            shape, dtype or device type, or another dim or layout (on every rank: one small
            all-gather of metadata checks).
    """
    rank, world = _group_info(group)
    if world == 1:
        _tensor_row("shard", x, dim, layout)
    else:
        _agree_tensors("shard", x, dim, layout, group, world, whole=True)
    parts = [x.narrow(dim, a, b - a) for a, b in segments(x.shape[dim], world, rank, layout)]
    if not parts:
        return x.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gather_seq(t: Tensor, dim: int, lengths: list[int], layout: str, group) -> Tensor:
    """All-gather shards of uneven length along ``dim`` into the whole tensor, natural order."""
    world = len(lengths)
    dim = dim % t.dim()
    wire = t.view(torch.uint8) if t.dtype == torch.bool else t  # bool travels as bytes
    shape = list(wire.shape)
    shape[dim] = max(lengths)
    padded = wire.new_zeros(shape)
    padded.narrow(dim, 0, wire.shape[dim]).copy_(wire)
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    shape[dim] = sum(lengths)
    full = wire.new_empty(shape)
    for r, part in enumerate(every):
        local = 0
        for a, b in segments(sum(lengths), world, r, layout):
            full.narrow(dim, a, b - a).copy_(part.narrow(dim, local, b - a))
            local += b - a
    return full.view(torch.bool) if t.dtype == torch.bool else full


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dim, lengths, layout, group, rank):
        ctx.args = (dim, lengths, layout, group, rank)
        return _gather_seq(y, dim, lengths, layout, group)

    @staticmethod
    def backward(ctx, grad):
        dim, lengths, layout, group, rank = ctx.args
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)  # every rank's use of the whole tensor reaches each shard
        parts = [grad.narrow(dim, a, b - a) for a, b in segments(sum(lengths), len(lengths), rank, layout)]
        local = torch.cat(parts, dim=dim) if parts else grad.narrow(dim, 0, 0)
        return local, None, None, None, None, None


def unshard(y: Tensor, dim: int = 2, layout: str = "zigzag", group=None) -> Tensor:
    """The whole tensor on every rank, from each rank's shard along ``dim`` (inverse of :func:`shard`).

    Differentiable: the gradient of a shard is the sum of every rank's gradient of the
    whole tensor at its positions.

    Args:
        y: this rank's shard, e.g. the (B, H, S_l, D) output of :func:`attention`.
        dim: the sequence dimension.
        layout: the layout the shards were made with.
        group: the process group (None: the default group).

    Returns:
        The whole tensor, S = sum of the shards' lengths along ``dim``.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout, a dim out of range, shards whose lengths do not fit the
            layout, or ranks whose shards differ in ndim, dtype, device type, dim, layout or
            shape outside ``dim`` (on every rank: one small all-gather of metadata checks).
    """
    rank, world = _group_info(group)
    if world == 1:
        _tensor_row("unshard", y, dim, layout)
    shapes = _agree_tensors("unshard", y, dim, layout, group, world, whole=False) if world > 1 else [list(y.shape)]
    dim = dim % y.dim()
    lengths = [shape[dim] for shape in shapes]
    expected = [local_length(sum(lengths), world, r, layout) for r in range(world)]
    if lengths != expected:
        raise ValueError(f"unshard got shards of lengths {lengths} along dim {dim}, but layout {layout!r} splits "
                         f"{sum(lengths)} positions as {expected}; shard with hwd.shard(x, dim, layout={layout!r})")
    return _Unshard.apply(y, dim, lengths, layout, group, rank)

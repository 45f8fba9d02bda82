"""Which global sequence positions each rank holds: the ``"contiguous"`` and ``"zigzag"`` layouts.

Pure arithmetic, no communication. A sequence of ``L`` positions is cut into ``C`` chunks
whose sizes differ by at most one (the first ``L % C`` chunks hold one more), so any length
works and nothing is dropped:

* ``"contiguous"``: ``C = N`` chunks, rank ``r`` holds chunk ``r``.
* ``"zigzag"``: ``C = 2N`` chunks, rank ``r`` holds chunks ``r`` and ``2N - 1 - r``. Under a
  causal mask every rank then has about the same number of (query, key) pairs to compute.

Legend: N world size, r rank, L sequence length.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "check_layout", "chunk_bounds", "segments", "local_length", "positions_of",
           "layout_order"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """Raise ValueError for a layout name that is not one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` half-open ranges that cover ``range(length)``, sizes differing by at most one.

    >>> chunk_bounds(7, 3)
    [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        stop = start + base + (c < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def segments(length: int, world: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """The global ranges ``[start, stop)`` rank ``rank`` holds, in its local order.

    Empty ranges are dropped (a sequence shorter than the chunk count).

    >>> segments(10, 2, 0, "zigzag")
    [(0, 3), (8, 10)]
    """
    check_layout(layout)
    if layout == "contiguous":
        picked = [chunk_bounds(length, world)[rank]]
    else:
        bounds = chunk_bounds(length, 2 * world)
        picked = [bounds[rank], bounds[2 * world - 1 - rank]]
    return [(a, b) for a, b in picked if b > a]


def local_length(length: int, world: int, rank: int, layout: str) -> int:
    """How many of ``length`` positions rank ``rank`` holds."""
    return sum(b - a for a, b in segments(length, world, rank, layout))


def positions_of(length: int, world: int, rank: int, layout: str,
                 device: torch.device | str | None = None) -> Tensor:
    """The global positions (S_local,) of rank ``rank``'s shard, int64, in its local order.

    >>> positions_of(10, 2, 1, "zigzag").tolist()
    [3, 4, 5, 6, 7]
    """
    parts = [torch.arange(a, b, device=device) for a, b in segments(length, world, rank, layout)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def layout_order(length: int, world: int, layout: str, device: torch.device | str | None = None) -> Tensor:
    """(L,) global positions of rank 0's shard, then rank 1's, ...: the order of a gather.

    ``x_natural = x_gathered[argsort(order)]``; for ``"contiguous"`` it is ``arange(L)``.
    """
    return torch.cat([positions_of(length, world, r, layout, device) for r in range(world)])

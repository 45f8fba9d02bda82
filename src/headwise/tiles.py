"""The tile grid that rules are read on: a (S, Sk) score grid cut into (bq, bk) tiles, and
each tile's state.

A tile is empty (no pair may attend: a blockwise kernel skips it), full (every pair may: it
runs without a mask) or partial. States are int8: ``EMPTY`` 0, ``PARTIAL`` 1, ``FULL`` 2, so
AND is a minimum and OR a maximum. A rule never calls a partial tile empty or full.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the rows / columns
of one tile, nq / nk the tiles along S / Sk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Bounds", "states", "as_4d"]

EMPTY, PARTIAL, FULL = 0, 1, 2  # tile states: no pair may attend, some may, every pair may


class Bounds:
    """The first and last row and column of every tile of a (S, Sk) grid in (bq, bk) tiles.

    Attributes:
        q_lo, q_hi: (nq, 1) first and last query of each row of tiles.
        k_lo, k_hi: (1, nk) first and last key of each column of tiles.
    """

    def __init__(self, S: int, Sk: int, bq: int, bk: int, device: torch.device | None = None):
        self.S, self.Sk, self.bq, self.bk = S, Sk, bq, bk
        self.q_lo = torch.arange(0, S, bq, device=device)[:, None]  # (nq, 1)
        self.q_hi = torch.clamp(self.q_lo + bq, max=S) - 1  # (nq, 1)
        self.k_lo = torch.arange(0, Sk, bk, device=device)[None, :]  # (1, nk)
        self.k_hi = torch.clamp(self.k_lo + bk, max=Sk) - 1  # (1, nk)
        self.device = device


def states(full: Tensor, empty: Tensor) -> Tensor:
    """int8 tile states from two bool tensors (full wins over partial, empty over both)."""
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)


def as_4d(t: Tensor) -> Tensor:
    """A (nq, nk) or (B|1, nq, nk) state or mask tensor as (B|1, H|1, nq, nk)."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t

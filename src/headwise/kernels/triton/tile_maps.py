"""What the kernels walk, built on the host for each call: per batch row the key tiles that
hold a real key (a key padding mask), and a mask_mod's tile map (per (b, h) and map row or
column the partial tiles, then the full ones; the partial tiles' bits packed 32 to an int32
word). Empty tiles are listed last and never visited.

Legend: B batch, H query heads, S query length, Sk key length, T key tiles per row, nq / nk
the map tiles along S / Sk, bq / bk the rows / columns of one map tile, P partial map tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise.evaluate import MaskMod, evaluate_mask, mask_tile_states
from headwise.tiles import EMPTY, FULL, PARTIAL, Bounds


def _live_key_tiles(key_bias: Tensor, block_n: int) -> tuple[Tensor, Tensor]:
    """Per batch row, the key tiles that hold a real key, for the kernels to walk.

    Args:
        key_bias: (B|1, Sk) fp32, ``-inf`` at padding.
        block_n: keys per tile.

    Returns:
        ``tiles`` (B|1, T) int32: the live tiles' indices in ascending order, then the
        dead ones; ``cum`` (B|1, T + 1) int32: ``cum[t]`` live tiles before tile ``t``, so
        the live tiles of [t0, t1) sit at positions [cum[t0], cum[t1]) of ``tiles``.
        Computed on the device: no synchronisation with the host.
    """
    Bb, Sk = key_bias.shape
    T = -(-Sk // block_n)
    live = F.pad(key_bias > float("-inf"), (0, T * block_n - Sk), value=False)  # (B|1, T*BN)
    live = live.reshape(Bb, T, block_n).any(-1)  # (B|1, T)
    tiles = torch.argsort((~live).to(torch.uint8), dim=-1, stable=True).to(torch.int32)  # (B|1, T)
    cum = F.pad(live.to(torch.int32).cumsum(-1), (1, 0)).to(torch.int32)  # (B|1, T + 1)
    return tiles, cum



# Pairs a mask_mod is evaluated on at once while the partial tiles' bits are built: bounds
# the memory of one evaluation to a few tens of MiB (the bool result and its index tensors).
_BITS_EVAL_PAIRS = 1 << 24


def _partial_bits(rule: MaskMod, states: Tensor, B: int, H: int, S: int, Sk: int,
                  block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The mask_mod's pairs on the partial tiles only.

    ``rule`` is evaluated (the call's contract: ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), index
    ranges) a row of map tiles at a time, on the span of key tiles that holds the row's partial
    tiles, in pieces of at most ``_BITS_EVAL_PAIRS`` pairs; rows and spans without a partial
    tile are never evaluated.

    Args:
        rule: the mask rules as one mask_mod.
        states: int8 (B|1, H|1, nq, nk) tile states of ``rule`` at ``block``.
        B, H, S, Sk: the call's sizes.
        block: (bq, bk), the map tile.

    Returns:
        ``slots`` int32 (B|1, H|1, nq, nk): each partial tile's index into ``bits``, -1 for the
        others; ``bits`` bool (P, bq, bk), True = may attend (pairs past S or Sk False).
    """
    bq, bk = block
    device = states.device
    partial = states == PARTIAL  # (B|1, H|1, nq, nk)
    P = int(partial.sum())
    slots = torch.full(states.shape, -1, dtype=torch.int32, device=device)
    slots[partial] = torch.arange(P, dtype=torch.int32, device=device)
    bits = torch.zeros(P, bq, bk, dtype=torch.bool, device=device)
    if P == 0:
        return slots, bits
    cols = torch.arange(states.shape[-1], device=device)
    in_row = partial.any(dim=(0, 1))  # (nq, nk): some (b, h) has this tile partial
    first = torch.where(in_row, cols, states.shape[-1]).amin(-1).tolist()  # (nq,) first partial column
    last = torch.where(in_row, cols, -1).amax(-1).tolist()  # (nq,) last partial column
    step = max(1, _BITS_EVAL_PAIRS // (B * H * bq * bk))  # tile columns per evaluation
    for qi, (lo, hi) in enumerate(zip(first, last, strict=True)):
        i0, i1 = qi * bq, min(qi * bq + bq, S)
        for c0 in range(lo, hi + 1, step):
            c1 = min(c0 + step, hi + 1)  # tile columns [c0, c1)
            index = partial[:, :, qi, c0:c1].nonzero()  # (p, 3): b, h, tile column - c0
            if index.shape[0] == 0:
                continue
            j0, j1 = c0 * bk, min(c1 * bk, Sk)
            allowed = evaluate_mask(rule, B, H, (i0, i1), (j0, j1), device)  # (B|1, H|1, rows|1, cols|1)
            b1, h1 = allowed.shape[:2]
            tiles = torch.zeros(b1, h1, bq, (c1 - c0) * bk, dtype=torch.bool, device=device)
            tiles[:, :, :i1 - i0, :j1 - j0] = allowed
            tiles = tiles.reshape(b1, h1, bq, c1 - c0, bk).transpose(2, 3)  # (b1, h1, c1 - c0, bq, bk)
            b, h, c = index.unbind(-1)
            at = slots[b, h, qi, c0 + c].long()  # (p,)
            bits[at] = tiles[b.clamp(max=b1 - 1), h.clamp(max=h1 - 1), c]  # (p, bq, bk)
    return slots, bits


def _pack_bits(bits: Tensor) -> Tensor:
    """Bits (P, bq, bk) bool, bk a multiple of 32, as int32 words (max(P, 1), bq, bk // 32):
    column ``c`` is bit ``c % 32`` of word ``c // 32`` (one slot of zeros when P = 0, so
    the kernel always gets a real pointer)."""
    P, bq, bk = bits.shape
    if P == 0:
        return torch.zeros(1, bq, bk // 32, dtype=torch.int32, device=bits.device)
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device)
    words = (bits.reshape(P, bq, bk // 32, 32).to(torch.int64) * weights).sum(-1)  # (P, bq, bk // 32) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def _tile_lists(states: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Per (b, h) and map row, what the kernels walk: the partial tiles, then the full ones.

    Args:
        states: int8 (B|1, H|1, n_outer, n_inner): the tile map, rows outer (forward, dq) or
            columns outer (dkdv, the map transposed).
        slots: int32 (B|1 or more, H|1, n_outer, n_inner), each partial tile's bits slot.

    Returns:
        ``lists`` int32 (2, B|1, H|1, n_outer, n_inner): ``lists[0]`` the tiles' inner indices,
        partial ones first, then full, then empty (ascending within each); ``lists[1]`` their
        bits slots. ``counts`` int32 (B|1, H|1, n_outer, 2): (partial, full) tiles per row.
    """
    rank = torch.tensor([2, 0, 1], device=states.device)[states.long()]  # EMPTY 2, PARTIAL 0, FULL 1
    order = torch.argsort(rank, dim=-1, stable=True)  # (B|1, H|1, n_outer, n_inner)
    slot = slots.expand(states.shape).gather(-1, order)
    lists = torch.stack((order.to(torch.int32), slot)).contiguous()
    counts = torch.stack(((states == PARTIAL).sum(-1), (states == FULL).sum(-1)), dim=-1).to(torch.int32)
    return lists, counts.contiguous()


def _rule_tiles(rule: MaskMod, key_bias: Tensor | None, B: int, H: int, S: int, Sk: int,
                block: tuple[int, int], device: torch.device) -> list[Tensor]:
    """The tile map the kernels walk for a mask_mod (the causal / window rule ANDed in).

    Its states come from the rule (a helper's bounds, a :class:`headwise.masks.TileMap` of
    this shape and block as is, a plain function evaluated); only the partial tiles' bits
    are built. A full tile that runs past Sk counts as partial (its bits end at Sk), so the
    kernels read full tiles with no bounds check; a key tile that is all padding in a batch
    row's key mask is empty for that row.

    Returns:
        ``[row_lists, row_counts, col_lists, col_counts, bits]``: :func:`_tile_lists` of the
        map (forward, dq) and of its transpose (dkdv), and the partial tiles' bits as
        :func:`_pack_bits` words (P, bq, bk // 32).
    """
    bq, bk = block
    states = mask_tile_states(rule, Bounds(S, Sk, bq, bk, device), B, H).to(device)  # (B|1, H|1, nq, nk)
    if Sk % bk:
        edge = states[..., -1:]
        states = torch.cat([states[..., :-1], torch.where(edge == FULL, PARTIAL, edge).to(torch.int8)], dim=-1)
    slots, bits = _partial_bits(rule, states, B, H, S, Sk, block)
    if key_bias is not None:  # (B|1, Sk): tiles holding no real key are empty for that row
        nk = states.shape[-1]
        live = F.pad(key_bias > float("-inf"), (0, nk * bk - Sk), value=False)
        live = live.reshape(key_bias.shape[0], 1, 1, nk, bk).any(-1)  # (B|1, 1, 1, nk)
        states = torch.where(live, states, EMPTY).to(torch.int8)  # (B|1, H|1, nq, nk)
    rows = _tile_lists(states, slots)
    cols = _tile_lists(states.transpose(-2, -1), slots.transpose(-2, -1))
    return [*rows, *cols, _pack_bits(bits)]

"""Calling a rule function on the score grid: FlexAttention's ``mask_mod`` and ``score_mod``.

``mask_mod(b, h, q_idx, kv_idx)`` returns a bool tensor, True where query ``q_idx`` of
batch row ``b`` and query head ``h`` may attend key ``kv_idx``; ``score_mod(score, b, h,
q_idx, kv_idx)`` returns the new score. The index arguments are integer tensors that
broadcast against each other (``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, S, 1),
``kv_idx`` (1, 1, 1, Sk)), so a function written for FlexAttention or for transformers'
``masking_utils`` runs unchanged. A function written for Flex's one-scalar-at-a-time indices
(``bias[b][q_idx]``), which raises on these tensors or returns a result that does not
broadcast to the grid, is evaluated as Flex evaluates it: ``torch.vmap`` over scalar
indices (slower; the broadcast call is kept for every function that runs on it). A result
that broadcasts (per head, per key, a number) is expanded to the grid. As in Flex,
``q_idx`` and ``kv_idx`` are raw positions (0..S-1 and 0..Sk-1), also when S != Sk, and
``h`` is the query head.

A mask_mod's tiles (:mod:`headwise.tiles`) come from the rule itself where it knows them
(the helpers of :mod:`headwise.masks` read them from the tiles' bounds); a plain function
is traced (``headwise.symbolic``) and its tiles classified from their bounds
(``headwise.intervals``), or, where the tracer cannot read it, evaluated pair by pair,
a block of rows at a time.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the rows / columns
of one tile, nq / nk the tiles along S / Sk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from headwise import intervals
from headwise.tiles import EMPTY, FULL, PARTIAL, Bounds, as_4d

__all__ = ["MaskMod", "ScoreMod", "grid", "grid_at", "evaluate_mask", "evaluate_score", "evaluate_score_at",
           "evaluated_tile_states", "mask_tile_states"]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

# Pairs evaluated at once when a plain mask_mod is read on the whole grid: bounds the memory
# of building a tile map to a few tens of MiB whatever S and Sk are.
_EVAL_PAIRS = 1 << 24


def grid(B: int, H: int, rows: tuple[int, int], cols: tuple[int, int],
         device: torch.device | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The index arguments of a mask_mod / score_mod call on rows [i0, i1) x cols [j0, j1):
    ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q_idx`` (1, 1, bq, 1), ``kv_idx`` (1, 1, 1, bk), int64."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(rows[0], rows[1], device=device).view(1, 1, -1, 1)
    kv = torch.arange(cols[0], cols[1], device=device).view(1, 1, 1, -1)
    return b, h, q, kv


def grid_at(B: int, heads: Tensor, rows: Tensor, Sk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The index arguments at chosen heads (h,) and query rows (s,), every key: ``b`` (B, 1, 1, 1),
    ``h`` (1, h, 1, 1), ``q_idx`` (1, 1, s, 1), ``kv_idx`` (1, 1, 1, Sk)."""
    b = torch.arange(B, device=heads.device).view(B, 1, 1, 1)
    kv = torch.arange(Sk, device=heads.device).view(1, 1, 1, Sk)
    return b, heads.view(1, -1, 1, 1), rows.view(1, 1, -1, 1), kv


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", None) or repr(fn)


def _broadcasts(out: Any, want: tuple[int, ...]) -> bool:
    """Whether ``out`` is a tensor that broadcasts to ``want`` (4 dims) without growing it."""
    return isinstance(out, Tensor) and out.dim() <= 4 and all(
        n in (1, w) for n, w in zip(reversed(out.shape), reversed(want), strict=False))


def _flex_way(fn: Any, index: tuple[Tensor, Tensor, Tensor, Tensor], score: Tensor | None) -> Tensor | None:
    """``fn`` evaluated as FlexAttention does (torch's ``_vmap_for_bhqkv``): ``torch.vmap`` over
    one scalar ``b``, ``h``, ``q_idx``, ``kv_idx`` (and score) at a time, kv innermost:
    (B, h, s, k), the grid of the four index tensors. None where that fails too."""
    flat = tuple(t.reshape(-1) for t in index)  # (B,), (h,), (s,), (k,)
    lead = () if score is None else (0,)
    f = fn
    for pos in (3, 2, 1, 0):  # kv_idx innermost, b outermost, as Flex nests them
        f = torch.vmap(f, in_dims=(*lead, *(0 if n == pos else None for n in range(4))))
    grid_shape = tuple(t.shape[0] for t in flat)
    args = flat if score is None else (score.expand(grid_shape), *flat)
    try:
        out = f(*args)  # (B, h, s, k)
    except Exception:  # noqa: BLE001 - the caller reports the broadcast call's own error or result
        return None
    return out if isinstance(out, Tensor) and tuple(out.shape) == grid_shape else None


def _evaluate(fn: Any, index: tuple[Tensor, Tensor, Tensor, Tensor], score: Tensor | None = None) -> Any:
    """``fn(b, h, q_idx, kv_idx)`` (``fn(score, ...)`` with a score) on broadcasting index tensors:
    one call, the fast way. A function written for Flex's scalar indices (``bias[b][q_idx]``)
    may raise there, or return a result that does not broadcast to the grid (it grows dims);
    it is then evaluated the Flex way. A number comes back as a 0-d tensor; anything else
    that is not a tensor comes back as it is, for the caller to name."""
    want = tuple(score.shape) if score is not None else (
        index[0].shape[0], index[1].shape[1], index[2].shape[2], index[3].shape[3])
    args = index if score is None else (score, *index)
    try:
        out = fn(*args)
    except Exception:
        flex = _flex_way(fn, index, score)
        if flex is None:
            raise  # not a Flex function either: its own error
        return flex
    if isinstance(out, (bool, int, float)):
        out = torch.as_tensor(out, device=index[0].device)
    if not isinstance(out, Tensor) or _broadcasts(out, want):
        return out
    flex = _flex_way(fn, index, score)
    return out if flex is None else flex  # None: the caller names the broadcast call's shape


def evaluate_mask(mod: MaskMod, B: int, H: int, rows: tuple[int, int], cols: tuple[int, int],
                  device: torch.device | None, at: tuple[Tensor, Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """``mod`` on rows [i0, i1) x cols [j0, j1): bool (B|1, H|1, bq|1, bk|1), True = may attend
    (``at``: on these index arguments instead, from :func:`grid_at`). A function written for
    Flex's scalar indices is evaluated as Flex does (see :func:`_evaluate`).

    Raises:
        TypeError: the function returned something other than a bool tensor (or a bool).
        ValueError: its result does not broadcast to (B, H, bq, bk).
    """
    b, h, q, kv = grid(B, H, rows, cols, device) if at is None else at
    allowed = _evaluate(mod, (b, h, q, kv))
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        got = allowed.dtype if isinstance(allowed, Tensor) else "None" if allowed is None else type(allowed).__name__
        raise TypeError(f"mask_mod {_name(mod)} must return a bool tensor (True = may attend), got "
                        f"{got}; compare instead of computing, e.g. kv_idx <= q_idx")
    want = (B, h.shape[1], q.shape[2], kv.shape[3])
    if not _broadcasts(allowed, want):
        raise ValueError(f"mask_mod {_name(mod)} returned shape {tuple(allowed.shape)}, which does not broadcast "
                         f"to (B, H, S, Sk) = {want}; index with the b, h, q_idx, kv_idx tensors it is given")
    return as_4d(allowed)


def evaluate_score(mod: ScoreMod, scores: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
    """``mod`` on a block of scores (B, H, bq, bk) at rows [i0, i1) x cols [j0, j1), in the scores' dtype."""
    B, H = scores.shape[:2]
    return evaluate_score_at(mod, scores, *grid(B, H, rows, cols, scores.device))


def evaluate_score_at(mod: ScoreMod, scores: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``mod`` on scores (B, h, s, Sk) at the index arguments given: the new scores (B, h, s, Sk)
    in the scores' dtype, a result that broadcasts (per key, per head, a number) expanded to
    them. A function written for Flex's scalar indices is evaluated as Flex does.

    Raises:
        TypeError: the function returned something other than a tensor or a number.
        ValueError: its result does not broadcast to the scores.
    """
    out = _evaluate(mod, (b, h, q, kv), scores)
    if not isinstance(out, Tensor):
        got = "None" if out is None else type(out).__name__
        raise TypeError(f"score_mod {_name(mod)} must return the new scores as a tensor, got {got}; "
                        "e.g. return score + bias")
    if not _broadcasts(out, tuple(scores.shape)):
        raise ValueError(f"score_mod {_name(mod)} returned shape {tuple(out.shape)}, which does not broadcast to the "
                         f"scores' shape (B, H, S, Sk) = {tuple(scores.shape)}; return the scores' shape (or one "
                         "that broadcasts to it), indexing with the b, h, q_idx, kv_idx tensors it is given")
    return out.to(scores.dtype).expand(scores.shape)


def evaluated_tile_states(mod: MaskMod, bounds: Bounds, B: int, H: int) -> Tensor:
    """Tile states of a plain mask_mod, evaluating every pair a block of rows at a time:
    int8 (B|1, H|1, nq, nk)."""
    S, Sk, bq, bk = bounds.S, bounds.Sk, bounds.bq, bounds.bk
    if S == 0 or Sk == 0:  # no pair: no tile in one direction (nothing to evaluate, nothing to pad)
        return torch.empty((1, 1, -(-S // bq), -(-Sk // bk)), dtype=torch.int8, device=bounds.device)
    step = max(1, _EVAL_PAIRS // max(1, B * H * Sk * bq)) * bq  # rows per evaluation, whole tiles
    parts = []
    for i0 in range(0, S, step):
        i1 = min(i0 + step, S)
        allowed = evaluate_mask(mod, B, H, (i0, i1), (0, Sk), bounds.device)  # (B|1, H|1, rows|1, Sk|1)
        b, h = allowed.shape[:2]
        allowed = allowed.expand(b, h, i1 - i0, Sk)
        rows_pad, cols_pad = (-(i1 - i0)) % bq, (-Sk) % bk
        # Padding repeats the last row and column: it changes neither "any" nor "all".
        padded = torch.nn.functional.pad(allowed.to(torch.uint8), (0, cols_pad, 0, rows_pad), mode="replicate") \
            if rows_pad or cols_pad else allowed.to(torch.uint8)
        tiles = padded.reshape(b, h, -1, bq, padded.shape[-1] // bk, bk)  # (b, h, nq', bq, nk, bk)
        some = tiles.amax(dim=(3, 5)).bool()  # (b, h, nq', nk)
        every = tiles.amin(dim=(3, 5)).bool()
        parts.append(torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8))
    return torch.cat(parts, dim=2)


def mask_tile_states(mod: MaskMod, bounds: Bounds, B: int, H: int) -> Tensor:
    """int8 (B|1, H|1, nq, nk) tile states of any mask_mod: a rule's own; else, for a plain
    function the tracer reads, classified from its bounds (``headwise.intervals``); else
    evaluated pair by pair."""
    own = getattr(mod, "tile_states", None)
    if callable(own):
        return own(bounds, B, H)
    traced = intervals.tile_states(mod, bounds, B, H)
    return traced if traced is not None else evaluated_tile_states(mod, bounds, B, H)

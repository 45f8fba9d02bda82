"""Attention rules as small functions, FlexAttention's way: ``mask_mod`` and ``score_mod``.

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

The helpers here are callables of that signature that also know their tiles: for a grid
of (bq, bk) tiles each can say, with a few vectorised ops on block bounds, which tiles no
pair may attend (empty), which every pair may attend (full) and which are mixed
(partial), without evaluating every pair (:func:`headwise.rules.tile_map` reads it). A
plain function is evaluated pair by pair instead. :func:`and_masks` / :func:`or_masks`
combine both kinds. Tile states are int8: ``EMPTY`` 0, ``PARTIAL`` 1, ``FULL`` 2, so AND is
a minimum and OR a maximum. A helper never calls a partial tile empty or full.

The built-in keywords become rules of the same kind (:class:`AlignedCausal` for
``is_causal``, ``window`` and ``sink_tokens``; :class:`SoftCap` and :class:`Alibi` for
``softcap`` and ``alibi_slopes``), so a kernel reads one object.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the rows / columns
of one tile, nq / nk the tiles along S / Sk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

__all__ = ["MaskMod", "ScoreMod", "MaskRule", "ScoreRule", "causal", "sliding_window", "document", "prefix_lm",
           "and_masks", "or_masks", "relative_position_bias", "t5_bucket", "AlignedCausal", "Document", "PrefixLM",
           "Combined", "Shifted", "ShiftedScore", "Composed", "SoftCap", "Alibi", "RelativePositionBias",
           "combine_rules", "Bounds", "states", "as_4d"]

#: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, True = may attend.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
#: ``score_mod(score, b, h, q_idx, kv_idx) -> score``.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

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


class MaskRule:
    """A ``mask_mod`` that knows its tiles. Subclasses define ``__call__`` and ``tile_states``."""

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def tile_states(self, bounds: Bounds, B: int, H: int) -> Tensor:  # pragma: no cover
        """int8 (B|1, H|1, nq, nk) tile states (EMPTY, PARTIAL, FULL) on ``bounds``' grid."""
        raise NotImplementedError

    def __and__(self, other: Any) -> MaskRule:
        return and_masks(self, other)

    def __or__(self, other: Any) -> MaskRule:
        return or_masks(self, other)


class AlignedCausal(MaskRule):
    """The built-in ``is_causal`` / ``window`` / ``sink_tokens`` rule, query ``i`` at key
    position ``i + offset``: key ``j`` may be attended iff ``j <= i + offset`` and, with a
    window, ``j > i + offset - window`` or ``j < sink_tokens``.

    ``offset = Sk - S`` is the bottom-right alignment of ``is_causal=True``; ``offset = 0`` is
    Flex's and transformers' ``kv_idx <= q_idx`` (:data:`causal`).
    """

    def __init__(self, offset: int = 0, window: int | None = None, sink_tokens: int = 0):
        self.offset, self.window, self.sink_tokens = offset, window, sink_tokens

    def __call__(self, b, h, q_idx, kv_idx):
        i = q_idx + self.offset  # the query's aligned key position
        allowed = kv_idx <= i
        if self.window is not None:
            near = kv_idx > i - self.window
            allowed = allowed & ((near | (kv_idx < self.sink_tokens)) if self.sink_tokens else near)
        return allowed

    def tile_states(self, bounds, B, H):
        lo, hi = bounds.q_lo + self.offset, bounds.q_hi + self.offset  # (nq, 1) aligned rows
        full = bounds.k_hi <= lo  # (nq, nk): every key at or before the first query's position
        empty = bounds.k_lo > hi  # every key after the last query's position
        if self.window is not None:
            near_full = bounds.k_lo > hi - self.window  # every key inside the last query's window
            near_empty = bounds.k_hi <= lo - self.window  # every key before the first query's window
            if self.sink_tokens:
                near_full = near_full | (bounds.k_hi < self.sink_tokens)
                near_empty = near_empty & (bounds.k_lo >= self.sink_tokens)
            full, empty = full & near_full, empty | near_empty
        return as_4d(states(full, empty))

    def __repr__(self) -> str:
        if self.window is None:
            return "causal" if self.offset == 0 else f"causal(offset={self.offset})"
        sinks = f", sink_tokens={self.sink_tokens}" if self.sink_tokens else ""
        return f"sliding_window({self.window}{', offset=' + str(self.offset) if self.offset else ''}{sinks})"


#: ``kv_idx <= q_idx``: Flex's and transformers' causal mask_mod (top-left when S != Sk; the
#: ``is_causal=True`` keyword is bottom-right aligned).
causal = AlignedCausal()


def sliding_window(window: int) -> AlignedCausal:
    """The causal sliding window of ``window`` keys, the query's own included, as ``window=W``
    does: ``q_idx - window < kv_idx <= q_idx``.

    >>> import torch
    >>> sliding_window(2)(0, 0, torch.arange(3)[:, None], torch.arange(3)[None, :]).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window needs an int window >= 1, got {window!r}")
    return AlignedCausal(0, window)


def _ids_2d(ids: Any, name: str) -> Tensor:
    t = torch.as_tensor(ids)
    if t.dim() not in (1, 2) or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must be an integer tensor (S,) or (B, S), got {t.dtype} {tuple(t.shape)}")
    return t if t.dim() == 2 else t[None]  # (B|1, S)


def _block_extremes(ids: Tensor, n: int, block: int) -> tuple[Tensor, Tensor]:
    """Per-block min and max of ``ids[:, :n]`` (B|1, n) in blocks of ``block``: (B|1, nblocks) each."""
    rows = ids[:, :n]
    pad = (-n) % block
    if pad:  # repeat the last id: it changes neither extreme
        rows = torch.cat([rows, rows[:, -1:].expand(rows.shape[0], pad)], dim=1)
    blocks = rows.reshape(rows.shape[0], -1, block)  # (B|1, nblocks, block)
    return blocks.amin(-1), blocks.amax(-1)


class Document(MaskRule):
    """Tokens attend only tokens of their own document: ``doc_ids[b, q_idx] == doc_ids[b, kv_idx]``."""

    def __init__(self, doc_ids: Any):
        self.ids = _ids_2d(doc_ids, "document's doc_ids")  # (B|1, L)

    def __call__(self, b, h, q_idx, kv_idx):
        ids = self.ids.to(q_idx.device) if isinstance(q_idx, Tensor) else self.ids
        if ids.shape[0] == 1:
            return ids[0][q_idx] == ids[0][kv_idx]
        return ids[b, q_idx] == ids[b, kv_idx]

    def check(self, S: int, Sk: int, B: int) -> None:
        """ValueError when the ids do not cover the call's positions or batch."""
        L, rows = self.ids.shape[1], self.ids.shape[0]
        if L < max(S, Sk) or rows not in (1, B):
            raise ValueError(f"document's doc_ids {tuple(self.ids.shape)} must cover B = {B} rows (or 1) and "
                             f"max(S, Sk) = {max(S, Sk)} positions; pass one id per token of the call")

    def tile_states(self, bounds, B, H):
        self.check(bounds.S, bounds.Sk, B)
        ids = self.ids.to(bounds.device)
        qmin, qmax = _block_extremes(ids, bounds.S, bounds.bq)  # (B|1, nq)
        kmin, kmax = _block_extremes(ids, bounds.Sk, bounds.bk)  # (B|1, nk)
        qmin, qmax, kmin, kmax = qmin[:, :, None], qmax[:, :, None], kmin[:, None, :], kmax[:, None, :]
        empty = (qmax < kmin) | (kmax < qmin)  # (B|1, nq, nk): id ranges apart
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)  # one id on both sides
        return states(full, empty).unsqueeze(1)  # (B|1, 1, nq, nk)

    def segments(self, S: int, Sk: int) -> list[list[int]] | None:
        """Per batch row, the lengths of its runs of equal ids when every document is one
        contiguous run and S == Sk (a packed batch); None otherwise."""
        if S != Sk:
            return None
        ids = self.ids[:, :S]
        if ids.shape[1] > 1 and not bool((ids[:, 1:] >= ids[:, :-1]).all()):
            return None  # ids not sorted: a document may come back after another
        return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in ids]

    def __repr__(self) -> str:
        return f"document(doc_ids {tuple(self.ids.shape)})"


def document(doc_ids: Any) -> Document:
    """Document masking for packed sequences: a token attends only tokens with its own id.

    Args:
        doc_ids: integer ids per token, (S,) for every batch row or (B, S) per row; they
            must cover max(S, Sk) positions.

    >>> import torch
    >>> m = document(torch.tensor([0, 0, 1]))
    >>> m(0, 0, torch.arange(3)[:, None], torch.arange(3)[None, :]).int().tolist()
    [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    return Document(doc_ids)


class PrefixLM(MaskRule):
    """Bidirectional over each row's prefix, causal after it: ``kv_idx < prefix[b] or kv_idx <= q_idx``."""

    def __init__(self, prefix_lengths: Any):
        p = torch.as_tensor(prefix_lengths)
        if p.dim() > 1 or p.dtype.is_floating_point or p.dtype == torch.bool:
            raise ValueError(f"prefix_lm's prefix_lengths must be an int or an integer tensor (B,), got "
                             f"{p.dtype} {tuple(p.shape)}")
        self.prefix = p.reshape(-1)  # (B|1,)
        if self.prefix.device.type != "meta" and not torch.compiler.is_compiling():  # values to read
            negative = (self.prefix < 0).nonzero().flatten().tolist()
            if negative:
                row = negative[0]
                raise ValueError(f"prefix_lm's prefix_lengths must be >= 0, got {int(self.prefix[row])} at row {row}; "
                                 "a prefix is a count of keys (0: plain causal)")

    def _p(self, device) -> Tensor:
        return self.prefix.to(device).reshape(-1, 1, 1, 1)  # (B|1, 1, 1, 1)

    def __call__(self, b, h, q_idx, kv_idx):
        p = self.prefix.to(kv_idx.device)
        prefix = p[0] if p.numel() == 1 else p[b]
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    def tile_states(self, bounds, B, H):
        p = self._p(bounds.device)  # (B|1, 1, 1, 1)
        full = (bounds.k_hi < p) | (bounds.k_hi <= bounds.q_lo)  # (B|1, 1, nq, nk)
        empty = (bounds.k_lo >= p) & (bounds.k_lo > bounds.q_hi)
        return states(full, empty)

    def __repr__(self) -> str:
        return f"prefix_lm({self.prefix.tolist() if self.prefix.numel() <= 4 else tuple(self.prefix.shape)})"


def prefix_lm(prefix_lengths: Any) -> PrefixLM:
    """The prefix-LM mask: keys before ``prefix_lengths[b]`` are visible to every query of row
    ``b``; after them the mask is causal (``kv_idx <= q_idx``).

    Args:
        prefix_lengths: an int, or an integer tensor (B,), one prefix length per row, each >= 0
            (0: plain causal).

    Raises:
        ValueError: a length is negative, or the lengths are not integers in at most one dim.
    """
    return PrefixLM(prefix_lengths)


class Combined(MaskRule):
    """:func:`and_masks` / :func:`or_masks` of several mask_mods."""

    def __init__(self, mods: tuple, both: bool):
        self.mods, self.both = mods, both

    def __call__(self, b, h, q_idx, kv_idx):
        result = None
        for mod in self.mods:
            m = mod(b, h, q_idx, kv_idx)
            result = m if result is None else (result & m if self.both else result | m)
        return result

    def tile_states(self, bounds, B, H):
        from headwise.rules import mask_tile_states  # a plain part is evaluated there

        result = None
        for mod in self.mods:
            s = mask_tile_states(mod, bounds, B, H)
            result = s if result is None else (torch.minimum(result, s) if self.both else torch.maximum(result, s))
        return result

    def __repr__(self) -> str:
        parts = ", ".join(getattr(m, "__name__", None) or repr(m) for m in self.mods)
        return f"{'and' if self.both else 'or'}_masks({parts})"


def _combine(mods: tuple, both: bool, name: str) -> Combined:
    if not mods:
        raise ValueError(f"{name} needs at least one mask_mod")
    bad = [m for m in mods if not callable(m)]
    if bad:
        raise TypeError(f"{name} takes mask_mod functions (b, h, q_idx, kv_idx) -> bool; got {bad[0]!r}")
    return Combined(tuple(mods), both)


def and_masks(*mods: MaskMod) -> Combined:
    """A mask_mod that allows a pair only where every one of ``mods`` does (transformers' and Flex's ``and_masks``).

    >>> import torch
    >>> m = and_masks(causal, document(torch.tensor([0, 0, 1])))
    >>> m(0, 0, torch.arange(3)[:, None], torch.arange(3)[None, :]).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    return _combine(mods, True, "and_masks")


def or_masks(*mods: MaskMod) -> Combined:
    """A mask_mod that allows a pair where any one of ``mods`` does (transformers' and Flex's ``or_masks``)."""
    return _combine(mods, False, "or_masks")


class Shifted(MaskRule):
    """``mask_mod`` with its queries at ``q_idx + offset``: a cached decode step's queries are
    the tokens after ``offset`` cached ones, so one rule serves prefill and decode."""

    def __init__(self, mod: MaskMod, offset: int):
        self.mod, self.offset = mod, offset

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mod(b, h, q_idx + self.offset, kv_idx)

    def tile_states(self, bounds, B, H):
        from headwise.rules import evaluated_tile_states

        return evaluated_tile_states(self, bounds, B, H)

    def __repr__(self) -> str:
        return f"{getattr(self.mod, '__name__', None) or self.mod!r} (queries from position {self.offset})"


# --- score mods -------------------------------------------------------------------------------


class ScoreRule:
    """A ``score_mod``; an additive one (``score + bias``) also has ``bias(b, h, q_idx, kv_idx)``,
    so a kernel that takes a float mask (SDPA) can run it as one."""

    additive = False

    def __call__(self, score, b, h, q_idx, kv_idx):  # pragma: no cover
        raise NotImplementedError


class SoftCap(ScoreRule):
    """The built-in ``softcap``: ``softcap * tanh(score / softcap)`` (Gemma 2)."""

    def __init__(self, cap: float):
        self.cap = cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return torch.tanh(score / self.cap) * self.cap

    def __repr__(self) -> str:
        return f"softcap({self.cap})"


class Alibi(ScoreRule):
    """The built-in ``alibi_slopes``: ``score - slope[h] * |q_idx + offset - kv_idx|``."""

    additive = True

    def __init__(self, slopes: Tensor, offset: int):
        self.slopes, self.offset = slopes, offset

    def bias(self, b, h, q_idx, kv_idx, dtype: torch.dtype | None = None):
        """``-slope[h] * |q_idx + offset - kv_idx|`` (1, H, S, Sk), in ``dtype`` (None: the slopes')."""
        dtype = self.slopes.dtype if dtype is None else dtype
        distance = (q_idx + self.offset - kv_idx).abs().to(dtype)  # (1, 1, S, Sk)
        return -self.slopes.to(dtype)[h] * distance  # (1, H, 1, 1) x (1, 1, S, Sk) -> (1, H, S, Sk)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(b, h, q_idx, kv_idx, score.dtype)  # the product in the scores' precision

    def __repr__(self) -> str:
        return f"alibi({self.slopes.numel()} slopes)"


def t5_bucket(relative_position: Tensor, num_buckets: int = 32, max_distance: int = 128,
              bidirectional: bool = True) -> Tensor:
    """T5's relative-position bucket of ``kv_idx - q_idx``: exact for small distances,
    logarithmic up to ``max_distance``, the last bucket beyond (as transformers' T5Attention).

    >>> import torch
    >>> t5_bucket(torch.tensor([-3, 0, 3, 500]), num_buckets=8, max_distance=16).tolist()
    [2, 0, 6, 7]
    """
    buckets = torch.zeros_like(relative_position)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets = buckets + (relative_position > 0).to(relative_position.dtype) * n
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    exact = n // 2
    small = distance < exact
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = torch.clamp(exact + (log_ratio * (n - exact)).to(relative_position.dtype), max=n - 1)
    return buckets + torch.where(small, distance, large)


class RelativePositionBias(ScoreRule):
    """T5's learned bias: ``score + table[bucket(kv_idx - q_idx), h]``."""

    additive = True

    def __init__(self, table: Any, max_distance: int, bidirectional: bool):
        self.table = table
        self.max_distance, self.bidirectional = max_distance, bidirectional

    @property
    def weight(self) -> Tensor:
        table = self.table
        return cast(Tensor, table.weight if isinstance(table, torch.nn.Module) else table)  # (buckets, H)

    def bias(self, b, h, q_idx, kv_idx):
        w = self.weight
        bucket = t5_bucket(kv_idx - q_idx, w.shape[0], self.max_distance, self.bidirectional)  # (1, 1, S, Sk)
        return w[bucket, h]  # (1, H, S, Sk): (buckets, H) read at (bucket, head)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(b, h, q_idx, kv_idx).to(score.dtype)

    def __repr__(self) -> str:
        return f"relative_position_bias({tuple(self.weight.shape)} table)"


def relative_position_bias(table: Any, *, max_distance: int = 128, bidirectional: bool = True) -> RelativePositionBias:
    """A score_mod adding T5's learned relative-position bias: ``table[bucket(kv_idx - q_idx), h]``.

    Args:
        table: (num_buckets, H) float tensor, or an ``nn.Embedding(num_buckets, H)`` (T5's
            ``relative_attention_bias``); gradients reach it on every backend that serves
            score_mod with gradients.
        max_distance: distances from here on share the last bucket.
        bidirectional: half the buckets for keys after the query (encoders); False: only
            keys before it count (decoders).
    """
    w = table.weight if isinstance(table, torch.nn.Module) else table
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"relative_position_bias needs a float (num_buckets, H) table or nn.Embedding, got "
                         f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}")
    return RelativePositionBias(table, max_distance, bidirectional)


class ShiftedScore(ScoreRule):
    """``score_mod`` with its queries at ``q_idx + offset`` (a cached decode step's, see :class:`Shifted`)."""

    def __init__(self, mod: Any, offset: int):  # a ScoreMod, perhaps with bias()
        self.mod, self.offset = mod, offset
        self.additive = bool(getattr(mod, "additive", False))

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.mod(score, b, h, q_idx + self.offset, kv_idx)

    def bias(self, b, h, q_idx, kv_idx):
        return self.mod.bias(b, h, q_idx + self.offset, kv_idx)

    @property
    def weight(self):  # what score_mod_needs_grad reads, where the rule has a table
        return getattr(self.mod, "weight", None)

    def __repr__(self) -> str:
        return f"{getattr(self.mod, '__name__', None) or self.mod!r} (queries from position {self.offset})"


class Composed(ScoreRule):
    """Two score_mods, one after the other (the module's and the call's)."""

    def __init__(self, first: Any, second: Any):  # ScoreMods, perhaps with bias()
        self.first, self.second = first, second
        self.additive = bool(getattr(first, "additive", False) and getattr(second, "additive", False))

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.second(self.first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    def bias(self, b, h, q_idx, kv_idx):
        return self.first.bias(b, h, q_idx, kv_idx) + self.second.bias(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"{getattr(self.first, '__name__', None) or self.first!r}, then " \
               f"{getattr(self.second, '__name__', None) or self.second!r}"


def combine_rules(module_rule: Any, call_rule: Any, *, score: bool) -> Any:
    """The module's rule and the call's together: mask_mods ANDed, score_mods one after the other."""
    if module_rule is None or call_rule is None:
        return call_rule if module_rule is None else module_rule
    return Composed(module_rule, call_rule) if score else and_masks(module_rule, call_rule)

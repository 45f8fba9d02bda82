"""One rule object per attention call: which (query, key) pairs may attend, and how scores change.

A kernel reads one :class:`Rules` instead of a keyword per variant. Its parts are the
public keywords (``is_causal``, ``window``, ``sink_tokens``, ``alibi_slopes``, ``softcap``,
``sinks``) and the two functions of FlexAttention, ``mask_mod`` and ``score_mod`` (see
:mod:`headwise.evaluate`). The keywords are rules of the same kind: ``is_causal``,
``window`` and ``sink_tokens`` are one :class:`~headwise.masks.AlignedCausal` mask rule,
``softcap`` and ``alibi_slopes`` are score rules (:class:`SoftCap`, :class:`Alibi`, here);
``sinks`` alone acts on the softmax. A module's rules and a call's combine here too
(:func:`combine_rules`; :class:`Shifted` places a cached step's queries).

The order of operations, every kernel alike::

    s = q k^T * scale
    s = softcap * tanh(s / softcap)          # softcap
    s = s - slope_h * |i + Sk - S - j|       # alibi_slopes
    s = score_mod(s, b, h, i, j)             # score_mod, on the capped, biased score
    s = s + attention_mask (float) ; s = -inf where the bool mask, the causal / window
        rule or mask_mod(b, h, i, j) forbids   # mask_mod ANDs with all of them
    p = softmax([s, sink_h])[:-1] ; dropout ; out = p @ v

:func:`headwise.masks.tile_map` marks each (bq, bk) tile of the score grid empty, full or
partial, so a blockwise kernel skips empty tiles and runs full ones without a mask.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the rows / columns
of one tile, nq / nk the tiles along S / Sk, P partial tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from headwise import intervals
from headwise.evaluate import (
    MaskMod,
    ScoreMod,
    _broadcasts,
    _evaluate,
    _name,
    evaluate_mask,
    evaluate_score,
    evaluated_tile_states,
    grid,
    mask_tile_states,
)
from headwise.masks import AlignedCausal, Combined, Document, MaskRule, ScoreRule, TileMap, and_masks
from headwise.tiles import Bounds, as_4d, states

__all__ = ["Rules", "SoftCap", "Alibi", "Shifted", "ShiftedScore", "Composed", "combine_rules", "knows_tiles",
           "document_lengths", "document_rule", "score_mod_needs_grad", "check_functions", "BlockRule",
           "from_block_mask"]

@dataclass(frozen=True, eq=False)
class Rules:
    """What one call asks of the scores: the built-in keywords and the user's two functions.

    Attributes:
        is_causal: the bottom-right causal rule, ``j <= i + Sk - S`` (True also with a window).
        window: a causal sliding window of this many keys (None: unlimited).
        sink_tokens: keys kept visible under the window (StreamingLLM; 0: none).
        alibi_slopes: (H,) ALiBi slopes (None: none).
        softcap: logit soft-capping (None: none).
        sinks: (H,) sink logits, one more softmax column per row (None: none).
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, ANDed with everything else (None: none).
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, after softcap and ALiBi (None: none).
    """

    is_causal: bool = False
    window: int | None = None  # None: unlimited
    sink_tokens: int = 0  # 0: no sink tokens
    alibi_slopes: Tensor | None = None  # None: no ALiBi
    softcap: float | None = None  # None: no soft-capping
    sinks: Tensor | None = None  # None: no sink logits
    mask_mod: MaskMod | None = None  # None: no mask rule beyond the keywords
    score_mod: ScoreMod | None = None  # None: no score rule beyond the keywords

    def __post_init__(self) -> None:
        # Read on every call of the fast paths (SDPA's own arguments): computed once.
        object.__setattr__(self, "plain", self.window is None and self.alibi_slopes is None and self.softcap is None
                           and self.sinks is None and self.mask_mod is None and self.score_mod is None)

    plain: bool = field(default=False, init=False, compare=False)  # no rule but (bottom-right) causal

    def structure(self, S: int, Sk: int) -> MaskMod | None:
        """The mask rules as one mask_mod (the causal / window rule AND ``mask_mod``); None: none."""
        parts: list = []
        if self.is_causal or self.window is not None:
            parts.append(AlignedCausal(Sk - S, self.window, self.sink_tokens))
        if self.mask_mod is not None:
            parts.append(self.mask_mod)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else Combined(tuple(parts), True)

    def score_rules(self, S: int, Sk: int) -> list:
        """The score rules in their order: softcap, ALiBi, score_mod."""
        mods: list = []
        if self.softcap is not None:
            mods.append(SoftCap(self.softcap))
        if self.alibi_slopes is not None:
            mods.append(Alibi(self.alibi_slopes, Sk - S))
        if self.score_mod is not None:
            mods.append(self.score_mod)
        return mods

    @property
    def additive(self) -> bool:
        """Whether every score rule is a bias that a float mask can carry (no softcap, and a
        score_mod only if it declares ``bias``)."""
        return self.softcap is None and (self.score_mod is None or bool(getattr(self.score_mod, "additive", False)))

    def allowed(self, B: int, H: int, S: int, Sk: int, rows: tuple[int, int], cols: tuple[int, int],
                device: torch.device | None) -> Tensor | None:
        """The mask rules on rows x cols: bool (B|1, H|1, bq|1, bk|1), True = may attend; None: no rule."""
        rule = self.structure(S, Sk)
        return None if rule is None else evaluate_mask(rule, B, H, rows, cols, device)

    def scored(self, scores: Tensor, S: int, Sk: int, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
        """The score rules applied to a block of scaled scores (B, H, bq, bk) at rows x cols."""
        for mod in self.score_rules(S, Sk):
            scores = evaluate_score(mod, scores, rows, cols)
        return scores

    def bias(self, B: int, H: int, S: int, Sk: int, device: torch.device | None, dtype: torch.dtype) -> Tensor | None:
        """The additive score rules (ALiBi, an additive score_mod) as one float (B|1, H|1, S, Sk); None: none."""
        total = None
        b, h, q, kv = grid(B, H, (0, S), (0, Sk), device)
        for mod in self.score_rules(S, Sk):
            part = mod.bias(b, h, q, kv, dtype) if isinstance(mod, Alibi) else _evaluate(mod.bias, (b, h, q, kv))
            if not _broadcasts(part, (B, H, S, Sk)):
                got = tuple(part.shape) if isinstance(part, Tensor) else "None" if part is None else type(part).__name__
                raise ValueError(f"score_mod {_name(mod)} returned shape {got} from bias(b, h, q_idx, kv_idx), which "
                                 f"does not broadcast to (B, H, S, Sk) = {(B, H, S, Sk)}; return a tensor that does")
            part = as_4d(part).to(dtype)
            part = part.expand(part.shape[0], part.shape[1], S, Sk)  # (B|1, H|1, S, Sk): a bias per key and query
            total = part if total is None else total + part
        return total

    def tile_states(self, B: int, H: int, S: int, Sk: int, block: tuple[int, int],
                    device: torch.device | None) -> Tensor | None:
        """int8 (B|1, H|1, nq, nk) states of the mask rules' tiles; None: no rule."""
        rule = self.structure(S, Sk)
        if rule is None:
            return None
        return mask_tile_states(rule, Bounds(S, Sk, block[0], block[1], device), B, H)

    def keywords(self) -> dict:
        """The keywords of a kernel written before rules (``mask_mod`` / ``score_mod`` not among them)."""
        return dict(is_causal=self.is_causal or self.window is not None, window=self.window,
                    alibi_slopes=self.alibi_slopes, softcap=self.softcap, sinks=self.sinks,
                    sink_tokens=self.sink_tokens)

    def describe(self) -> str:
        """The rules in words, for explain mode and errors ("" when there are none)."""
        words = []
        if self.mask_mod is not None:
            words.append(f"mask_mod {_name(self.mask_mod)}")
        if self.score_mod is not None:
            words.append(f"score_mod {_name(self.score_mod)}")
        return ", ".join(words)


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


class Shifted(MaskRule):
    """``mask_mod`` with its queries at ``q_idx + offset``: a cached decode step's queries are
    the tokens after ``offset`` cached ones, so one rule serves prefill and decode."""

    def __init__(self, mod: MaskMod, offset: int):
        self.mod, self.offset = mod, offset

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mod(b, h, q_idx + self.offset, kv_idx)

    def tile_states(self, bounds, B, H):
        traced = intervals.tile_states(self, bounds, B, H)  # the function with q_idx + offset, traced
        return traced if traced is not None else evaluated_tile_states(self, bounds, B, H)

    def __repr__(self) -> str:
        return f"{getattr(self.mod, '__name__', None) or self.mod!r} (queries from position {self.offset})"


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


def knows_tiles(mod: Any) -> bool:
    """Whether a mask_mod's tiles come from its bounds (a helper, a tile map, a traced plain
    function (``headwise.recognise.Traced``), and/or of those) rather than from evaluating
    every pair."""
    if isinstance(mod, TileMap):
        return True
    if isinstance(mod, Combined):
        return all(knows_tiles(m) for m in mod.mods)
    return isinstance(mod, MaskRule) and not isinstance(mod, Shifted)


def document_lengths(rules: Rules, B: int, S: int, Sk: int) -> tuple[tuple[int, ...], ...] | None:
    """Per batch row, the lengths of its documents, where the mask rules are one document mask
    (with or without the causal rule or one window) over contiguous documents and S == Sk:
    attention then splits into one independent attention per document. None otherwise."""
    mod = rules.mask_mod.mask_mod if isinstance(rules.mask_mod, TileMap) else rules.mask_mod
    if mod is None or S != Sk or rules.sink_tokens or rules.score_mod is not None:
        return None
    parts = mod.mods if isinstance(mod, Combined) and mod.both else (mod,)
    docs = [p for p in parts if isinstance(p, Document)]
    causal = [p for p in parts if isinstance(p, AlignedCausal) and p.offset == 0 and not p.sink_tokens]
    if len(docs) != 1 or len(causal) > 1 or len(docs) + len(causal) != len(parts):
        return None
    if causal and rules.window is not None and causal[0].window is not None:
        return None  # two windows: left to the dense path
    lengths = docs[0].segments(S, Sk)
    if lengths is None or len(lengths) not in (1, B):
        return None
    return tuple(tuple(row) for row in (lengths * B if len(lengths) == 1 else lengths))


def document_rule(rules: Rules) -> tuple[bool, int | None]:
    """For rules :func:`document_lengths` splits: whether each document is causal, and its window."""
    mod = rules.mask_mod.mask_mod if isinstance(rules.mask_mod, TileMap) else rules.mask_mod
    parts = mod.mods if isinstance(mod, Combined) else (mod,)
    causal = next((p for p in parts if isinstance(p, AlignedCausal)), None)
    window = rules.window if causal is None or causal.window is None else causal.window
    return rules.is_causal or causal is not None or window is not None, window


def score_mod_needs_grad(score_mod: Any, device: torch.device | None) -> bool:
    """Whether ``score_mod`` reads a tensor that requires grad: one probe call on a (1, 1, 1, 1) score."""
    if score_mod is None or not torch.is_grad_enabled():
        return False
    weight = getattr(score_mod, "weight", None)
    if isinstance(weight, Tensor) and not isinstance(score_mod, Combined):
        return weight.requires_grad
    probe = _evaluate(score_mod, grid(1, 1, (0, 1), (0, 1), device), torch.zeros(1, 1, 1, 1, device=device))
    return isinstance(probe, Tensor) and probe.requires_grad


def check_functions(mask_mod: Any, score_mod: Any) -> None:
    """TypeError when ``mask_mod`` / ``score_mod`` is given but is not callable."""
    for name, fn, sig in (("mask_mod", mask_mod, "(b, h, q_idx, kv_idx) -> bool tensor"),
                          ("score_mod", score_mod, "(score, b, h, q_idx, kv_idx) -> score")):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function {sig} or None, got {type(fn).__name__}")


class BlockRule(MaskRule):
    """A FlexAttention ``BlockMask`` as a mask_mod, with Flex's meaning: query ``i`` may attend
    key ``j`` iff ``i < Q_LEN``, ``j < KV_LEN`` and block ``(i // bq, j // bk)`` of its (b, h) is
    one of the full blocks, or one of the partial blocks and ``mask_mod(b, h, i, j)`` allows it
    (a BlockMask built from its blocks alone has Flex's ``noop_mask``: every pair of a listed
    block). A block past a row's count is not listed.

    Attributes:
        partial: bool (B|1, H|1, nq, nk), the partial blocks (``kv_num_blocks`` / ``kv_indices``).
        full: bool (B|1, H|1, nq, nk), the full blocks, or None.
        block: (bq, bk), the BlockMask's ``BLOCK_SIZE``.
        lengths: (Q_LEN, KV_LEN), its ``seq_lengths``.
        mask_mod: its mask_mod, None where it is Flex's ``noop_mask``.
    """

    def __init__(self, partial: Tensor, full: Tensor | None, block: tuple[int, int], lengths: tuple[int, int],
                 mask_mod: MaskMod | None):
        self.partial, self.full, self.block, self.lengths, self.mask_mod = partial, full, block, lengths, mask_mod

    def __call__(self, b, h, q_idx, kv_idx):
        (bq, bk), (Q, K) = self.block, self.lengths
        q_idx, kv_idx = torch.as_tensor(q_idx), torch.as_tensor(kv_idx)
        inside = (q_idx >= 0) & (q_idx < Q) & (kv_idx >= 0) & (kv_idx < K)
        # (b, h, block row, block column): broadcasts to the index arguments' (B|1, H|1, S|1, Sk|1)
        at = (0 if self.partial.shape[0] == 1 else b, 0 if self.partial.shape[1] == 1 else h,
              q_idx.clamp(0, Q - 1) // bq, kv_idx.clamp(0, K - 1) // bk)
        allowed = self.partial.to(q_idx.device)[at]
        if self.mask_mod is not None:
            allowed = allowed & self.mask_mod(b, h, q_idx, kv_idx)
        if self.full is not None:
            allowed = allowed | self.full.to(q_idx.device)[at]
        return allowed & inside

    def tile_states(self, bounds, B, H):
        """A tile is full where every block it overlaps is, empty where every one is; from 2-D
        prefix counts of the blocks, so tiles of any size cost a few ops on the block grid."""
        listed = self.partial if self.full is None else self.partial | self.full  # (B|1, H|1, nq, nk)
        full = self.partial if self.mask_mod is None else torch.zeros_like(self.partial)
        full = full if self.full is None else full | self.full
        (bq, bk), device = self.block, bounds.device
        r0, r1 = bounds.q_lo // bq, bounds.q_hi // bq + 1  # (nt_q, 1) the block rows [r0, r1) of each tile row
        c0, c1 = bounds.k_lo // bk, bounds.k_hi // bk + 1  # (1, nt_k)

        def count(blocks: Tensor) -> Tensor:  # blocks set in each tile's span: (B|1, H|1, nt_q, nt_k)
            sums = blocks.to(device=device, dtype=torch.int32).cumsum(-1).cumsum(-2)  # blocks in [0, r) x [0, c)
            sums = torch.nn.functional.pad(sums, (1, 0, 1, 0))  # (B|1, H|1, nq + 1, nk + 1), 0 at r = 0 or c = 0
            return sums[..., r1, c1] - sums[..., r0, c1] - sums[..., r1, c0] + sums[..., r0, c0]

        return states(count(full) == (r1 - r0) * (c1 - c0), count(listed) == 0)

    def __repr__(self) -> str:
        rule = "" if self.mask_mod is None else f", mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)}"
        return f"BlockMask(BLOCK_SIZE={self.block}, seq_lengths={self.lengths}{rule})"


def _listed(num: Tensor, index: Tensor, nk: int) -> Tensor:
    """The blocks a (num_blocks, indices) pair lists, bool (B|1, H|1, nq, nk): the first
    ``num[b, h, i]`` of ``index[b, h, i]``; indices outside 0..nk-1 list nothing."""
    while index.dim() < 4:  # (nq, n) or (H|1, nq, n) -> (B|1, H|1, nq, n)
        num, index = num.unsqueeze(0), index.unsqueeze(0)
    first = torch.arange(index.shape[-1], device=index.device) < num[..., None]  # (B|1, H|1, nq, n)
    cols = torch.where(first & (index >= 0) & (index < nk), index.long(), nk)  # the rest to a spare column
    dense = torch.zeros(*index.shape[:-1], nk + 1, dtype=torch.bool, device=index.device)
    return dense.scatter_(-1, cols, True)[..., :nk]  # (B|1, H|1, nq, nk)


def from_block_mask(block_mask: Any, S: int, Sk: int, *, B: int | None = None, H: int | None = None) -> BlockRule:
    """The rule of a FlexAttention ``BlockMask`` built for (S, Sk), as Flex reads it (see
    :class:`BlockRule`); ``B``, ``H``: the call's batch and heads (None: not checked).

    Raises:
        ValueError: the BlockMask was built for another (S, Sk), another batch size or head
            count (each must match or be 1), covers fewer queries than S, or was sliced.

    >>> from torch.nn.attention.flex_attention import BlockMask
    >>> blocks = BlockMask.from_kv_blocks(torch.tensor([[[1, 1]]]), torch.tensor([[[[1, 0], [0, 1]]]]), BLOCK_SIZE=2)
    >>> from_block_mask(blocks, 4, 4)(0, 0, torch.arange(4)[:, None], torch.arange(4)[None, :]).int().tolist()
    [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]
    """
    from torch.nn.attention import flex_attention as flex  # where is_block_mask found a BlockMask

    lengths = tuple(getattr(block_mask, "seq_lengths", (S, Sk)))
    if lengths != (S, Sk):
        raise ValueError(f"the BlockMask was built for (Q_LEN, KV_LEN) = {lengths}, but the call has (S, Sk) = "
                         f"{(S, Sk)}; build it with create_block_mask(mask_mod, B, H, {S}, {Sk})")
    if block_mask.mask_mod is getattr(flex, "_sliced_mask_mod_error", None):
        raise ValueError("this BlockMask was sliced (block_mask[...]), which drops its mask_mod; set "
                         "sliced.mask_mod = the original's mask_mod (flex_attention.noop_mask where it had none)")
    num, index, (bq, bk) = block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.BLOCK_SIZE
    sizes = (1,) * (3 - num.dim()) + tuple(num.shape)  # (B|1, H|1, nq)
    if (B is not None and sizes[0] not in (1, B)) or (H is not None and sizes[1] not in (1, H)):
        raise ValueError(f"the BlockMask has batch size {sizes[0]} and {sizes[1]} heads (kv_num_blocks "
                         f"{tuple(num.shape)}), but the call has B = {B} and H = {H}; each must match or be 1")
    if sizes[2] * bq < S:
        raise ValueError(f"the BlockMask covers {sizes[2]} query blocks of {bq} ({sizes[2] * bq} queries), but its "
                         f"seq_lengths say {S}; give kv_num_blocks and kv_indices one row per block of queries")
    nk = -(-Sk // bk)  # key blocks covering Sk
    full = None
    if block_mask.full_kv_num_blocks is not None:
        full = _listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
    mask_mod = None if block_mask.mask_mod is flex.noop_mask else block_mask.mask_mod
    return BlockRule(_listed(num, index, nk), full, (bq, bk), (S, Sk), mask_mod)

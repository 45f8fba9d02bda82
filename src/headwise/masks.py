"""The one mask contract, in code.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.

Rules (the README repeats them):

* bool or integer mask: True / nonzero = may attend, False / 0 = masked.
* floating mask: an additive bias added to the scaled scores; ``-inf`` blocks.
* 2-D ``(B, Sk)`` is a key padding mask; 3-D is ``(B, S, Sk)``; 4-D broadcasts to
  ``(B, H, S, Sk)``. Every dimension may also be 1 (broadcast).
* causal: query ``i`` may attend key ``j`` iff ``j <= i + (Sk - S)`` (bottom-right
  alignment, so decoding with a cache works). Causal and a mask combine with AND.
* sliding window ``W``: additionally ``j > i + (Sk - S) - W``; a window implies causal.
* sink tokens ``n`` (StreamingLLM, with a window only): the first ``n`` keys stay visible
  under the window: query ``i`` attends key ``j`` iff ``i + Sk - S - W < j <= i + Sk - S``
  or ``j < n and j <= i + Sk - S``.
* a query row that may attend nothing outputs zeros and gets zero gradients.
* rules as functions (FlexAttention's, :mod:`headwise.evaluate`): ``mask_mod(b, h, q_idx,
  kv_idx)`` ANDs with all of the above; ``score_mod`` acts on the scaled score. Their helpers
  (``causal``, ``sliding_window``, ``document``, ``prefix_lm``, ``and_masks``, ``or_masks``,
  ``relative_position_bias``) and :func:`tile_map` are the second half of this file.

Every kernel receives the mask already normalised by :func:`normalize_mask`: ``None``
or a 4-D tensor of shape ``(B|1, H|1, S|1, Sk)`` that is either bool (True = attend)
or floating in the query dtype (additive).

The helpers are callables of the mask_mod signature that also know their tiles: for a grid
of (bq, bk) tiles (:mod:`headwise.tiles`) each can say, with a few vectorised ops on block
bounds, which tiles no pair may attend (empty), which every pair may attend (full) and which
are mixed (partial), without evaluating every pair (:func:`tile_map` reads it). A plain
function is evaluated pair by pair instead. :func:`and_masks` / :func:`or_masks` combine
both kinds. A helper never calls a partial tile empty or full.

Legend of the tiles: bq / bk the rows / columns of one tile, nq / nk the tiles along S / Sk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from headwise.evaluate import MaskMod, _name, evaluate_mask, mask_tile_states
from headwise.tiles import EMPTY, FULL, PARTIAL, Bounds, as_4d, states

__all__ = [
    "normalize_mask",
    "causal_mask",
    "alibi_slopes",
    "alibi_bias",
    "combined_mask",
    "masked_scores",
    "safe_softmax",
    "row_is_dead",
    "from_torch_masks",
    "key_padding_mask",
    "is_block_mask",
    "and_masks",
    "or_masks",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "relative_position_bias",
    "t5_bucket",
    "tile_map",
    "TileMap",
    "MaskRule",
    "ScoreRule",
    "AlignedCausal",
    "Document",
    "PrefixLM",
    "Combined",
    "RelativePositionBias",
]

_LAYOUTS = {
    2: "(B, Sk) key padding mask",
    3: "(B, S, Sk)",
    4: "(B, H, S, Sk)",
}


def normalize_mask(
    attention_mask: Tensor | None,
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor | None:
    """Validate a user mask and bring it to the canonical 4-D form kernels expect.

    Args:
        attention_mask: ``None``, or a bool / integer / floating tensor of shape
            ``(B, Sk)``, ``(B, S, Sk)`` or ``(B, H, S, Sk)`` (any dimension may be 1).
        batch, heads, q_len, k_len: the expected B, H, S and Sk.
        device: the device of the queries; the mask must already be there.
        dtype: the query dtype; floating masks are cast to it.

    Returns:
        ``None`` or a tensor of shape ``(B|1, H|1, S|1, Sk)``: bool (True = attend) for
        bool and integer masks, ``dtype`` for floating masks. No data is copied for
        bool masks; integer masks become bool.

    Raises:
        TypeError: the mask is not a tensor (a FlexAttention ``BlockMask`` included: only
            :func:`headwise.attention` takes one), or has a complex dtype.
        ValueError: the mask has the wrong number of dimensions, a wrong size, or lives
            on another device.

    >>> normalize_mask(torch.tensor([[1, 0]]), batch=1, heads=8, q_len=2, k_len=2,
    ...                device=torch.device("cpu"), dtype=torch.float32).shape
    torch.Size([1, 1, 1, 2])
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        if is_block_mask(attention_mask):
            raise TypeError(
                "attention_mask is a FlexAttention BlockMask, which headwise.attention takes but this call does "
                "not; pass its rule as mask_mod=headwise.rules.from_block_mask(block_mask, S, Sk)"
            )
        raise TypeError(
            f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}; "
            "wrap it with torch.as_tensor(...)"
        )
    m = attention_mask
    _refuse_complex(m)
    if m.device != device:
        raise ValueError(
            f"attention_mask is on {m.device} but the queries are on {device}; "
            f"move it with attention_mask.to({str(device)!r})"
        )
    expected = {
        2: (batch, k_len),
        3: (batch, q_len, k_len),
        4: (batch, heads, q_len, k_len),
    }
    if m.dim() not in expected:
        raise ValueError(
            f"attention_mask must be 2-D {_LAYOUTS[2]} {expected[2]}, 3-D {_LAYOUTS[3]} "
            f"{expected[3]} or 4-D {_LAYOUTS[4]} {expected[4]}; got {m.dim()}-D with shape "
            f"{tuple(m.shape)}"
        )
    want = expected[m.dim()]
    if any(got not in (exp, 1) for got, exp in zip(m.shape, want, strict=True)):
        raise ValueError(
            f"attention_mask of shape {tuple(m.shape)} does not fit {m.dim()}-D layout "
            f"{_LAYOUTS[m.dim()]} = {want} (each dimension must match or be 1)"
        )
    return _canonical(m, dtype)


def _refuse_complex(mask: Tensor) -> None:
    """Raise TypeError for a complex mask: a mask is bool/integer (True = attend) or a real bias."""
    if mask.is_complex():
        raise TypeError(
            f"attention_mask has dtype {mask.dtype}; use bool/integer (True = attend) or a "
            "real floating additive bias"
        )


def _canonical(mask: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An accepted mask in the 4-D form kernels expect, without checking it:
    :func:`normalize_mask`'s last step, also taken alone for a repeated call's mask (of the
    shape, dtype and device the checks passed).

    Args:
        mask: 2-D (B, Sk), 3-D (B, S, Sk) or 4-D bool / integer / floating mask.
        dtype: the dtype floating masks are cast to (None: they keep theirs).

    Returns:
        ``(B|1, H|1, S|1, Sk)`` views: bool as is, integer as ``!= 0``, floating in ``dtype``.
    """
    if mask.dim() == 2:
        B, Sk = mask.shape
        mask = mask.view(B, 1, 1, Sk)  # (B, Sk) -> (B, 1, 1, Sk); half the time of [:, None, None, :]
    elif mask.dim() == 3:
        mask = mask.unsqueeze(1)  # (B, S, Sk) -> (B, 1, S, Sk)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask if dtype is None else mask.to(dtype)
    return mask != 0  # integer: nonzero = may attend


def is_block_mask(mask: Any) -> bool:
    """Whether ``mask`` is a ``torch.nn.attention.flex_attention.BlockMask`` (where torch has one)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without FlexAttention
        return False
    return isinstance(mask, BlockMask)


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None,
                window: int | None = None, sink_tokens: int = 0) -> Tensor:
    """Bottom-right aligned causal mask: query ``i`` may attend key ``j`` iff ``j <= i + Sk - S``.

    Args:
        q_len: S, the number of queries.
        k_len: Sk, the number of keys.
        device: where to build it.
        window: also require ``j > i + Sk - S - window`` (a sliding window of ``window``
            keys ending at the query's own position); None: unlimited.
        sink_tokens: with a window, keys ``j < sink_tokens`` stay visible too (still only
            where ``j <= i + Sk - S``): StreamingLLM's attention sinks.

    Returns:
        Bool tensor ``(S, Sk)``, True = may attend.

    >>> causal_mask(2, 3).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    >>> causal_mask(3, 3, window=2).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    >>> causal_mask(4, 4, window=2, sink_tokens=1).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]
    """
    rule = AlignedCausal(k_len - q_len, window, sink_tokens)  # the rule every kernel reads (below)
    return rule(None, None, torch.arange(q_len, device=device)[:, None], torch.arange(k_len, device=device)[None, :])


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's head slopes: a geometric sequence starting at ``2 ** (-8 / H)``.

    For a head count that is not a power of two, the paper's recipe interleaves the
    slopes of the next power of two.

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: Tensor, q_len: int, k_len: int) -> Tensor:
    """ALiBi's additive bias ``-slope_h * |i + Sk - S - j|`` as a float ``(1, H, S, Sk)``.

    Positions are aligned bottom-right like the causal rule, so the last query sits at
    the last key and a cache keeps distances right.
    """
    i = torch.arange(q_len, device=slopes.device)[:, None] + (k_len - q_len)  # (S, 1)
    j = torch.arange(k_len, device=slopes.device)[None, :]  # (1, Sk)
    distance = (i - j).abs().to(slopes.dtype)  # (S, Sk)
    return -slopes[None, :, None, None] * distance  # (1, H, S, Sk)


def combined_mask(mask: Tensor | None, is_causal: bool, q_len: int, k_len: int,
                  device: torch.device, window: int | None = None, sink_tokens: int = 0) -> Tensor | None:
    """AND a normalised mask with the causal (and window) rule, as one ``(B|1, H|1, S|1, Sk)``.

    A bool mask stays bool; a floating mask gets ``-inf`` where causality blocks. A
    ``window`` implies the causal upper bound; ``sink_tokens`` keeps the window's first
    keys visible (see :func:`causal_mask`).
    """
    if not is_causal and window is None:
        return mask
    c = causal_mask(q_len, k_len, device, window, sink_tokens)[None, None]  # (1, 1, S, Sk)
    if mask is None:
        return c
    if mask.dtype == torch.bool:
        return mask & c
    return mask.masked_fill(~c, float("-inf"))


def masked_scores(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Apply a combined mask to scores ``(..., S, Sk)``: bool blocks with ``-inf``, float adds."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def safe_softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Softmax that returns zeros, with zero gradients, for rows that are all ``-inf``.

    ``torch.softmax`` returns NaN there (0 / 0), and its backward spreads the NaN. Dead
    rows are set to 0 before the softmax (any finite row would do) and their output is
    zeroed after it, so nothing flows back into them. The softmax itself is torch's fused
    one, which accumulates fp16/bf16 rows in fp32, as plain PyTorch does.

    >>> safe_softmax(torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]]))
    tensor([[1., 0.],
            [0., 0.]])
    """
    dead = torch.isneginf(scores.detach().amax(dim=dim, keepdim=True))  # (..., 1) rows with nothing to attend
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=dim).masked_fill(dead, 0.0)


def row_is_dead(mask: Tensor) -> Tensor:
    """For a combined mask ``(..., S, Sk)``, True where a query row may attend no key.

    Returns a bool tensor ``(..., S, 1)``.
    """
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def key_padding_mask(lengths: Tensor | list[int], max_len: int | None = None) -> Tensor:
    """Build a ``(B, Sk)`` bool key padding mask (True = real token) from lengths.

    >>> key_padding_mask([2, 1]).tolist()
    [[True, True], [True, False]]
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    max_len = longest if max_len is None else max_len
    if max_len < longest:
        raise ValueError(f"max_len ({max_len}) is shorter than the longest length ({longest})")
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, Sk)


def from_torch_masks(
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> Tensor | None:
    """Translate ``torch.nn.MultiheadAttention`` masks into headwise's contract.

    Torch's bool masks mean True = *ignore*; ours mean True = *attend*, so bool masks are
    inverted. Floating masks are additive in both and pass through.

    Args:
        key_padding_mask: torch's ``(B, Sk)`` mask (bool True = padding, or float).
        attn_mask: torch's ``(S, Sk)`` or ``(B * num_heads, S, Sk)`` mask.
        num_heads: required when ``attn_mask`` is 3-D, to split ``B * num_heads``.

    Returns:
        ``None``, a ``(B, Sk)`` mask, a ``(1, 1, S, Sk)`` mask or a ``(B, H, S, Sk)`` mask
        in headwise's contract (bool True = attend, or float additive).

    >>> from_torch_masks(torch.tensor([[False, True]])).tolist()
    [[True, False]]
    """

    def ours(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return ~m
        if m.is_floating_point():
            return m
        raise TypeError(
            f"torch.nn.MultiheadAttention masks are bool or float, got {m.dtype}; "
            "convert with .bool() (True = ignore)"
        )

    kpm = None if key_padding_mask is None else ours(key_padding_mask)
    am = None
    if attn_mask is not None:
        am = ours(attn_mask)
        if am.dim() == 2:
            am = am[None, None]  # (S, Sk) -> (1, 1, S, Sk)
        elif am.dim() == 3:
            if num_heads is None:
                raise ValueError(
                    f"a 3-D attn_mask {tuple(am.shape)} is (B * num_heads, S, Sk); "
                    "pass num_heads= to split it"
                )
            if am.shape[0] % num_heads:
                raise ValueError(
                    f"attn_mask's first dimension ({am.shape[0]}) is not a multiple of "
                    f"num_heads ({num_heads})"
                )
            am = am.reshape(-1, num_heads, *am.shape[1:])  # (B*H, S, Sk) -> (B, H, S, Sk)
        else:
            raise ValueError(
                f"attn_mask must be (S, Sk) or (B * num_heads, S, Sk), got shape "
                f"{tuple(attn_mask.shape)}"
            )
    if am is None:
        return kpm
    if kpm is None:
        return am
    k4 = kpm[:, None, None, :]  # (B, Sk) -> (B, 1, 1, Sk)
    if am.dtype == torch.bool and k4.dtype == torch.bool:
        return am & k4
    dtype = am.dtype if am.is_floating_point() else k4.dtype
    return _as_bias(am, dtype) + _as_bias(k4, dtype)


def _as_bias(m: Tensor, dtype: torch.dtype) -> Tensor:
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
    return m.to(dtype)


# --- rules as functions: mask_mod and score_mod helpers that know their tiles ---------------------


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


class ScoreRule:
    """A ``score_mod``; an additive one (``score + bias``) also has ``bias(b, h, q_idx, kv_idx)``,
    so a kernel that takes a float mask (SDPA) can run it as one."""

    additive = False

    def __call__(self, score, b, h, q_idx, kv_idx):  # pragma: no cover
        raise NotImplementedError


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


@dataclass(frozen=True, eq=False)
class TileMap:
    """Which (bq, bk) tiles of a mask_mod's (S, Sk) grid are empty, full or partial.

    Calling it is calling its ``mask_mod``, so it is accepted wherever a mask_mod is, and a
    kernel whose call has the map's shape and tiles reads ``states`` instead of building them.

    Attributes:
        mask_mod: the rule.
        shape: (B, H, S, Sk) it was built for.
        block: (bq, bk).
        states: int8 (B|1, H|1, nq, nk): 0 empty, 1 partial, 2 full.
    """

    mask_mod: MaskMod
    shape: tuple[int, int, int, int]
    block: tuple[int, int]
    states: Tensor

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mask_mod(b, h, q_idx, kv_idx)

    def tile_states(self, bounds: Bounds, B: int, H: int) -> Tensor:
        if (B, H, bounds.S, bounds.Sk) == self.shape and (bounds.bq, bounds.bk) == self.block:
            return self.states.to(bounds.device) if bounds.device is not None else self.states
        return mask_tile_states(self.mask_mod, bounds, B, H)

    def shares(self) -> dict[str, float]:
        """The share of empty, partial and full tiles (over B x H x nq x nk)."""
        n = self.states.numel()
        return {name: int((self.states == value).sum()) / n
                for name, value in (("empty", EMPTY), ("partial", PARTIAL), ("full", FULL))}

    def partial_masks(self) -> tuple[Tensor, Tensor]:
        """The partial tiles and their pairs: ``index`` (P, 4) of (b, h, tile row, tile column)
        in ``states``, and ``bits`` (P, bq, bk) bool, True = may attend (pairs past S or Sk False)."""
        B, H, S, Sk = self.shape
        bq, bk = self.block
        index = (self.states == PARTIAL).nonzero()  # (P, 4)
        bits = torch.zeros(index.shape[0], bq, bk, dtype=torch.bool, device=self.states.device)
        for n, (b, h, qi, kj) in enumerate(index.tolist()):
            rows, cols = (qi * bq, min(qi * bq + bq, S)), (kj * bk, min(kj * bk + bk, Sk))
            allowed = evaluate_mask(self.mask_mod, B, H, rows, cols, self.states.device)
            tile = allowed[min(b, allowed.shape[0] - 1), min(h, allowed.shape[1] - 1)]
            bits[n, :rows[1] - rows[0], :cols[1] - cols[0]] = tile
        return index, bits

    def describe(self) -> str:
        """One line: the rule, its tiles and their shares."""
        s = self.shares()
        nq, nk = self.states.shape[-2:]
        return (f"{_name(self.mask_mod)}: {nq} x {nk} tiles of {self.block[0]} x {self.block[1]}, "
                f"{s['empty']:.0%} empty, {s['full']:.0%} full, {s['partial']:.0%} partial")


def tile_map(mask_mod: MaskMod, B: int, H: int, S: int, Sk: int, block: tuple[int, int] = (128, 128),
             device: torch.device | str | None = None) -> TileMap:
    """Mark each (bq, bk) tile of ``mask_mod``'s (S, Sk) grid empty, full or partial.

    Built eagerly with vectorised tensor ops on ``device`` (no compile): the helpers of
    of this file from their tiles' bounds, a plain function by evaluating
    every pair a block of rows at a time. Pass the map as ``mask_mod=`` to reuse it across
    calls of the same shape.

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``.
        B, H, S, Sk: the call's batch, query heads, queries and keys.
        block: (bq, bk), the tile.
        device: where to build it (None: the CPU).

    Returns:
        A :class:`TileMap`.

    >>> tile_map(causal, 1, 1, 4, 4, block=(2, 2)).states.tolist()
    [[[[1, 0], [2, 1]]]]
    """
    for name, n in (("B", B), ("H", H), ("S", S), ("Sk", Sk)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"tile_map needs {name} >= 1 as an int, got {n!r}")
    if len(block) != 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in block):
        raise ValueError(f"tile_map's block must be two ints >= 1 (bq, bk), got {block!r}")
    if isinstance(mask_mod, TileMap):
        mask_mod = mask_mod.mask_mod
    bounds = Bounds(S, Sk, block[0], block[1], torch.device(device) if device is not None else None)
    states = mask_tile_states(mask_mod, bounds, B, H)
    return TileMap(mask_mod, (B, H, S, Sk), (block[0], block[1]), states)

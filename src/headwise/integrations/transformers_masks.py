"""transformers' mask functions as headwise rules: the ``"headwise"`` entry of ``AttentionMaskInterface``.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the rows / columns
of one tile, nq / nk the tiles along S / Sk.

transformers (5.x) describes every mask by a ``mask_function(batch_idx, head_idx, q_idx,
kv_idx)`` on ABSOLUTE positions (query ``i`` of the call is position ``q_offset + i``, key
``j`` is ``kv_offset + j``), composed with ``and_masks`` from a few named parts
(``causal_mask_function``, ``sliding_window_overlay``, ``chunked_overlay``, the packed-sequence
pair), plus a 2-D padding mask. Its ``sdpa_mask`` evaluates that on the whole (B, 1, S, Sk)
grid. :func:`headwise_mask` evaluates nothing: it reads the composition and returns a
:class:`TransformersMask`, a headwise ``mask_mod`` on raw indices (0..S-1, 0..Sk-1) that
carries the offsets, ANDs the padding, and knows its tiles; the attention function turns it
into headwise's arguments with :meth:`TransformersMask.attention_kwargs`:

* causal and sliding window, aligned bottom-right (``q_offset - kv_offset == Sk - S``, the
  case of every dynamic cache): ``is_causal=True, window=W``, the keywords the fast paths
  run natively; otherwise an :class:`~headwise.masks.AlignedCausal` mask_mod with the
  offset (a static cache's unfilled slots, for one);
* packed sequences (transformers finds them in ``position_ids`` restarting): the document
  ids become :func:`headwise.masks.document`, so headwise skips the empty tiles or runs
  the documents as packed segments; causality and the window inside a document are the
  same rule on raw indices, since positions rise by one inside a document;
* chunked attention (Llama 4): a chunk rule with the row's left padding;
* padding: a (B, 1, 1, Sk) bool ``attention_mask`` of real keys (headwise's padding contract,
  which its varlen path reads), and a mask_mod part when the object is called as a rule;
* anything else (a model's own parts, ``or_masks``): transformers' function itself, called
  with the offsets added, pair by pair.

Functions a model marks for ``vmap`` (``use_vmap=True``: its own or/and overlays, which may
not broadcast) get transformers' dense ``sdpa_mask``, which the attention function accepts
as before. Plain causal without padding, where transformers would let SDPA's ``is_causal``
do it, gives ``None`` as ``sdpa_mask`` does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from headwise.evaluate import evaluated_tile_states, mask_tile_states
from headwise.masks import AlignedCausal, MaskRule, and_masks, document
from headwise.tiles import Bounds, as_4d, states

__all__ = ["headwise_mask", "TransformersMask"]

logger = logging.getLogger(__name__)


def _closure(fn: Any) -> dict[str, Any]:
    """The free variables of a closure by name ({} for a plain function)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))


def _codes(mu: Any) -> dict[str, Any]:
    """The code objects of transformers' mask-function factories, to recognise their closures."""
    return {
        "and": mu.and_masks().__code__,
        "sliding": mu.sliding_window_overlay(1).__code__,
        "chunked": mu.chunked_overlay(1, None).__code__,
        "remap": mu.remap_positions_for_packed_sequence(None, None).__code__,
        "packed": mu.packed_sequence_mask_function(None).__code__,
    }


@dataclass
class _Pattern:
    """What a transformers mask_function composes (None / False: that part is absent)."""

    causal: bool = False
    window: int | None = None  # None: unlimited
    chunk: tuple[int, Tensor] | None = None  # (chunk_size, (B,) left padding)
    documents: Tensor | None = None  # (B, S) packed-sequence ids
    remapped: bool = False  # the parts above read positions from position_ids (packing)


def _leaves(fn: Any, and_code: Any) -> list:
    """``fn`` as the list of functions it ANDs (itself when it is not ``and_masks``)."""
    if getattr(fn, "__code__", None) is not and_code:
        return [fn]
    return [leaf for part in _closure(fn)["mask_functions"] for leaf in _leaves(part, and_code)]


def _pattern(fn: Any, mu: Any, codes: dict[str, Any]) -> _Pattern | None:
    """The parts of a transformers mask_function, or None when it holds one headwise does not know."""
    p = _Pattern()
    for leaf in _leaves(fn, codes["and"]):
        code, free = getattr(leaf, "__code__", None), _closure(leaf) if callable(leaf) else {}
        if leaf is mu.causal_mask_function:
            p.causal = True
        elif leaf is mu.bidirectional_mask_function:
            continue
        elif code is codes["sliding"] and p.window is None:
            p.window = int(free["sliding_window"])
        elif code is codes["chunked"] and p.chunk is None:
            p.chunk = (int(free["chunk_size"]), free["left_padding"])
        elif code is codes["packed"] and p.documents is None:
            p.documents = free["packed_sequence_mask"]
        elif code is codes["remap"] and not p.remapped:
            inner = _pattern(free["mask_function"], mu, codes)
            if inner is None or inner.chunk is not None or inner.documents is not None:
                return None  # chunks count from each document's start: not a rule on raw indices
            p.causal, p.window, p.remapped = p.causal or inner.causal, inner.window, True
        else:
            return None
    if (p.window is not None and not p.causal) or (p.remapped and p.documents is None):
        return None
    return p


class KeyPadding(MaskRule):
    """Keys that are real tokens: ``keys[b, kv_idx]``; a tile is empty where every key is padding.

    Attributes:
        keys: (B, Sk) bool, True = a real key.
    """

    def __init__(self, keys: Tensor):
        self.keys = keys

    def __call__(self, b, h, q_idx, kv_idx):
        return self.keys.to(kv_idx.device)[b, kv_idx]  # (B, 1, 1, Sk)

    def tile_states(self, bounds: Bounds, B: int, H: int) -> Tensor:
        keys = self.keys[:, :bounds.Sk].to(bounds.device)
        pad = (-bounds.Sk) % bounds.bk
        if pad:  # repeat the last key: it changes neither "any" nor "all"
            keys = torch.cat([keys, keys[:, -1:].expand(keys.shape[0], pad)], dim=1)
        tiles = keys.reshape(keys.shape[0], -1, bounds.bk)  # (B, nk, bk)
        s = states(tiles.all(-1), ~tiles.any(-1))[:, None, None, :]  # (B, 1, 1, nk)
        return s.expand(-1, -1, bounds.q_lo.shape[0], -1)  # (B, 1, nq, nk)

    def __repr__(self) -> str:
        return f"key_padding({tuple(self.keys.shape)})"


class Chunks(MaskRule):
    """Llama 4's chunked attention: query and key in the same chunk of ``chunk_size`` positions,
    counted from the row's first real token: ``(pos - left[b]) // chunk_size`` equal, with query
    ``i`` at position ``i + q_offset`` and key ``j`` at ``j + kv_offset``."""

    def __init__(self, chunk_size: int, left_padding: Tensor, q_offset: int, kv_offset: int):
        self.size, self.left = chunk_size, left_padding.reshape(-1)  # (B,)
        self.q_offset, self.kv_offset = q_offset, kv_offset

    def _chunk(self, positions: Tensor, b: Any = None) -> Tensor:
        left = self.left.to(positions.device)
        left = left.reshape(-1, 1, 1, 1) if b is None else left[b]  # (B, 1, 1, 1)
        return torch.div(positions - left, self.size, rounding_mode="floor")

    def __call__(self, b, h, q_idx, kv_idx):
        return self._chunk(q_idx + self.q_offset, b) == self._chunk(kv_idx + self.kv_offset, b)

    def tile_states(self, bounds: Bounds, B: int, H: int) -> Tensor:
        # a chunk id never falls as the position rises: a tile's ids span its corners'
        q_lo, q_hi = (self._chunk(t + self.q_offset) for t in (bounds.q_lo, bounds.q_hi))  # (B, 1, nq, 1)
        k_lo, k_hi = (self._chunk(t + self.kv_offset) for t in (bounds.k_lo, bounds.k_hi))  # (B, 1, 1, nk)
        full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)  # (B, 1, nq, nk): one chunk on both sides
        return as_4d(states(full, (q_hi < k_lo) | (k_hi < q_lo)))

    def __repr__(self) -> str:
        return f"chunks({self.size})"


class Offsets(MaskRule):
    """A transformers mask_function on raw indices: called with ``q_idx + q_offset`` and
    ``kv_idx + kv_offset``, as transformers' ``add_offsets_to_mask_function`` does."""

    def __init__(self, mask_function: Any, q_offset: int, kv_offset: int):
        self.fn, self.q_offset, self.kv_offset = mask_function, q_offset, kv_offset

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx + self.q_offset, kv_idx + self.kv_offset)

    def tile_states(self, bounds: Bounds, B: int, H: int) -> Tensor:
        return evaluated_tile_states(self, bounds, B, H)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        return f"transformers {name} at offsets ({self.q_offset}, {self.kv_offset})"


class TransformersMask(MaskRule):
    """One transformers mask as headwise rules, for a call of B rows, S queries and Sk keys.

    Called as a mask_mod, it is the whole rule on raw indices (every part ANDed, padding
    included); :meth:`attention_kwargs` splits it into the arguments headwise runs fastest.

    transformers treats it as a prepared 4-D mask: ``shape`` is that of the dense mask it
    stands for, and the mask builder hands a prepared one back unchanged (``generate`` with a
    static cache builds the masks ahead and the model passes them to the builder again).

    Attributes:
        shape: (B, 1, S, Sk), the dense mask's shape.
        ndim: 4.
        causal: the causal / sliding-window part (query ``i`` at key position ``i + offset``,
            ``offset = q_offset - kv_offset``), or None (bidirectional).
        parts: the other mask_mods (documents, chunks, a transformers function), ANDed.
        key_padding: (B, Sk) bool, True = a real key; None: no padding.
    """

    ndim = 4

    def __init__(self, shape: tuple[int, int, int, int], causal: AlignedCausal | None, parts: tuple,
                 key_padding: Tensor | None):
        self.shape, self.causal, self.parts, self.key_padding = shape, causal, parts, key_padding
        every = ((causal,) if causal is not None else ()) + parts
        every += (KeyPadding(key_padding),) if key_padding is not None else ()
        self.mask_mod = and_masks(*every) if every else None  # None: every pair may attend

    def __call__(self, b, h, q_idx, kv_idx):
        if self.mask_mod is None:
            return torch.ones((), dtype=torch.bool, device=kv_idx.device)
        return self.mask_mod(b, h, q_idx, kv_idx)

    def tile_states(self, bounds: Bounds, B: int, H: int) -> Tensor:
        if self.mask_mod is None:
            return torch.full((1, 1, bounds.q_lo.shape[0], bounds.k_lo.shape[1]), 2, dtype=torch.int8,
                              device=bounds.device)
        return mask_tile_states(self.mask_mod, bounds, B, H)

    def attention_kwargs(self, B: int, S: int, Sk: int) -> dict[str, Any]:
        """:func:`headwise.attention`'s ``attention_mask``, ``is_causal``, ``window`` and ``mask_mod``.

        Raises:
            ValueError: the call's (B, S, Sk) is not the one the mask was built for.
        """
        if (B, 1, S, Sk) != self.shape:
            built = (self.shape[0], self.shape[2], self.shape[3])
            raise ValueError(f"the headwise mask was built for (B, S, Sk) = {built}, but attention got "
                             f"{(B, S, Sk)}; build the mask for this call's query and key lengths")
        kwargs: dict[str, Any] = {"attention_mask": None, "is_causal": False, "window": None}
        if self.key_padding is not None:
            kwargs["attention_mask"] = self.key_padding[:, None, None, :]  # (B, Sk) -> (B, 1, 1, Sk)
        parts = self.parts
        if self.causal is not None and self.causal.offset == Sk - S:  # bottom-right: headwise's is_causal
            kwargs.update(is_causal=True, window=self.causal.window)
        elif self.causal is not None:
            parts = (self.causal,) + parts
        kwargs["mask_mod"] = None if not parts else parts[0] if len(parts) == 1 else and_masks(*parts)
        return kwargs

    def __repr__(self) -> str:
        return f"TransformersMask({self.shape}, {self.mask_mod!r})"


def _key_padding(attention_mask: Tensor | None, kv_length: int, kv_offset: int) -> Tensor | None:
    """The (B, Sk) real keys of a 2-D padding mask over absolute positions (zero-padded to
    ``kv_offset + kv_length`` as transformers does); None when every key is real."""
    if attention_mask is None:
        return None
    keys = attention_mask.bool()
    if (short := kv_offset + kv_length - keys.shape[-1]) > 0:  # a static cache's unfilled slots
        keys = torch.nn.functional.pad(keys, (0, short))
    keys = keys[:, kv_offset:kv_offset + kv_length]  # (B, Sk)
    return None if bool(keys.all()) else keys


def _parts(p: _Pattern, q_offset: int, kv_offset: int) -> tuple[AlignedCausal | None, tuple]:
    """The headwise rules of a recognised pattern: the causal / window part, and the others."""
    causal = AlignedCausal(q_offset - kv_offset, p.window) if p.causal else None
    parts: tuple = ()
    if p.documents is not None:
        parts += (document(p.documents),)
    if p.chunk is not None:
        parts += (Chunks(p.chunk[0], p.chunk[1], q_offset, kv_offset),)
    return causal, parts


def _is_plain_causal(causal: AlignedCausal | None, parts: tuple, keys: Tensor | None, S: int, Sk: int) -> bool:
    """Whether SDPA's ``is_causal`` (top-left, as the attention function applies it when it
    gets no mask) is the whole rule: causal aligned at S == Sk, or one query that sees every
    key, a window no shorter than the keys, no padding, nothing else."""
    return (causal is not None and not parts and keys is None and causal.offset == Sk - S
            and (S == Sk or S == 1) and (causal.window is None or causal.window >= Sk))


def headwise_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Any = None,  # None: transformers' causal_mask_function
    attention_mask: Tensor | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    **kwargs: Any,
) -> TransformersMask | Tensor | None:
    """transformers' mask-interface signature (that of ``sdpa_mask``), answered with rules, not a dense mask.

    Args:
        batch_size: B.
        q_length: S.
        kv_length: Sk.
        q_offset: the absolute position of query 0 (a 0-d tensor for static caches).
        kv_offset: the absolute position of key 0.
        mask_function: transformers' ``(batch_idx, head_idx, q_idx, kv_idx) -> bool`` on
            absolute positions.
        attention_mask: (B, >= kv_offset + Sk or fewer) 2-D padding mask, True / 1 = real token;
            a :class:`TransformersMask` already built for the call is returned as it is.
        allow_is_causal_skip: may return None where the attention function's ``is_causal`` does it.
        allow_is_bidirectional_skip: may return None for full attention without padding.
        use_vmap: the model marked its own mask parts for ``vmap``: a dense mask is built.
        **kwargs: the rest of transformers' arguments (``device``, ``dtype``, ``config``,
            ``local_size``), passed on to ``sdpa_mask`` when it builds the mask.

    Returns:
        A :class:`TransformersMask`; None where no mask is needed; with ``use_vmap``, or a
        function headwise cannot read while the positions are traced, transformers' dense
        (B, 1, S, Sk) bool mask.
    """
    from transformers import masking_utils as mu

    if isinstance(attention_mask, TransformersMask):  # prepared ahead (generate, static cache): as it is
        return attention_mask
    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask)
    if use_vmap or isinstance(q_offset, Tensor) and mu.is_tracing(q_offset):
        return mu.sdpa_mask(**args, allow_is_causal_skip=allow_is_causal_skip,
                            allow_is_bidirectional_skip=allow_is_bidirectional_skip, use_vmap=use_vmap, **kwargs)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    keys = _key_padding(attention_mask, kv_length, kv_offset)  # (B, Sk) or None
    p = _pattern(mask_function, mu, _codes(mu))
    if p is not None and p.remapped and (q_offset, kv_offset, q_length) != (0, 0, kv_length):
        p = None  # packing without a cache only: positions and raw indices then agree inside a document
    if p is None:
        logger.debug("headwise_mask: %r is called pair by pair", mask_function)
        causal, parts = None, (Offsets(mask_function, q_offset, kv_offset),)
    else:
        causal, parts = _parts(p, q_offset, kv_offset)
    if allow_is_causal_skip and _is_plain_causal(causal, parts, keys, q_length, kv_length):
        return None
    if allow_is_bidirectional_skip and causal is None and not parts and keys is None:
        return None
    return TransformersMask((batch_size, 1, q_length, kv_length), causal, parts, keys)

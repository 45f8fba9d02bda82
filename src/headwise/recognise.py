"""A plain mask_mod read as the helpers it equals, where that is proven: documents (causal or
not, with or without a sliding window) and the causal rule, so a rule written as FlexAttention
users write it, ``lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)``, reaches the paths
:func:`headwise.masks.document` reaches (one attention per document, :mod:`headwise.kernels.varlen`).

The function is traced (:mod:`headwise.symbolic`); a few exact probes propose a candidate (a
segment starts where a query may not attend the key before it; the rule is causal where no
query attends the key after it; the window is read off the last row of the longest
segment); then the candidate is *proven* equal to the traced rule on the call's whole
(B, H, S, Sk) grid: the tile states of ``rule != candidate`` (:mod:`headwise.intervals`,
exact) must all be empty. Only then is the candidate used; otherwise the rule runs as given.

Legend: B batch, H query heads, S query length, Sk key length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headwise import intervals
from headwise.evaluate import evaluated_tile_states
from headwise.masks import AlignedCausal, Combined, Document, MaskRule, TileMap
from headwise.symbolic import Memo, Node, captured, replay, signature, trace
from headwise.tiles import EMPTY, Bounds

__all__ = ["Recognised", "Traced", "read", "recognise"]

_PROOF_TILE = 128  # the tiles the proof classifies (cached with them)


class Recognised(Combined):
    """The helpers a plain mask_mod was proven to equal on one call's grid (and_masks of them),
    named after the function."""

    def __init__(self, mod: Any, parts: tuple):
        super().__init__(parts, True)
        self.original = mod

    def __repr__(self) -> str:
        name = getattr(self.original, "__name__", None) or repr(self.original)
        return f"{name} (proven equal to {super().__repr__()})"


def _row(root: Node, b: int, q: Tensor, kv: Tensor) -> Tensor:
    """The traced rule's exact values at pairs (q, kv) of batch row b, bool (n,)."""
    z = torch.zeros((), dtype=torch.long, device=q.device)
    return replay(root, {0: z + b, 1: z, 2: q, 3: kv}).expand(torch.broadcast_shapes(q.shape, kv.shape))


def _propose_row(root: Node, b: int, S: int, device: torch.device) -> tuple[Tensor, bool, int | None] | None:
    """Batch row b's candidate: segment ids (S,), whether causal, the window (None: none)."""
    q = torch.arange(S, device=device)
    if not bool(_row(root, b, q, q).all()):
        return None  # a query that may not attend itself: no document rule
    starts = torch.ones(S, dtype=torch.bool, device=device)
    starts[1:] = ~_row(root, b, q[1:], q[:-1])  # a segment starts where the key before is hidden
    ids = starts.long().cumsum(0) - 1  # (S,)
    causal = S == 1 or not bool(_row(root, b, q[:-1], q[1:]).any())
    window = None
    if causal:
        lengths = torch.bincount(ids)
        longest = int(lengths.argmax())
        last = int(lengths[: longest + 1].sum()) - 1  # the longest segment's last query
        allowed = _row(root, b, torch.tensor(last, device=device), q).nonzero().flatten()
        first, start = int(allowed[0]), last - int(lengths[longest]) + 1
        window = last - first + 1 if first > start else None
    return ids, causal, window


def _propose(root: Node, B: int, S: int, device: torch.device) -> tuple | None:
    """The candidate helpers for every batch row, or None where the rows disagree or the probes refute."""
    rows = [_propose_row(root, b, S, device) for b in range(B if 0 in root.leaves else 1)]
    if any(r is None for r in rows) or len({(r[1], r[2]) for r in rows if r is not None}) != 1:
        return None
    ids = torch.stack([r[0] for r in rows if r is not None])  # (B|1, S)
    _, causal, window = rows[0]  # type: ignore[misc]
    parts: list[MaskRule] = []
    if int(ids.max()) > 0:
        parts.append(Document(ids))
    if causal:
        parts.append(AlignedCausal(0, window))
    return tuple(parts) if parts else None


def _plain(mod: Any) -> bool:
    """Whether ``mod`` is, or ANDs / ORs in, a plain function (not a helper, a tile map or a BlockMask)."""
    if isinstance(mod, Combined):
        return any(_plain(m) for m in mod.mods)
    return not isinstance(mod, (MaskRule, TileMap))


class Traced(MaskRule):
    """A plain mask_mod and its graph, traced once for one call: its tiles come from the graph
    (:func:`headwise.intervals.traced_states`), its values from the function itself."""

    def __init__(self, mod: Any, root: Node):
        self.mod, self.root = mod, root
        self.__name__ = getattr(mod, "__name__", None) or repr(mod)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mod(b, h, q_idx, kv_idx)

    def tile_states(self, bounds, B, H):
        states = intervals.traced_states(self.root, bounds, B, H)
        return states if states is not None else evaluated_tile_states(self.mod, bounds, B, H)

    def __repr__(self) -> str:
        return self.__name__


_PROOFS = Memo(32)


def _prove(root: Node, B: int, S: int, device: torch.device) -> tuple | None:
    """The candidate helpers, where ``rule != candidate`` has only empty tiles; else None."""
    try:
        parts = _propose(root, B, S, device)
    except (IndexError, RuntimeError):  # the probes ran the rule where it raises: left to the plain path
        return None
    if parts is None:
        return None
    other = trace(Combined(parts, True), device)
    if other is None:  # pragma: no cover - the helpers are traced
        return None
    differs = Node("xor", (root, other), torch.bool, root.leaves | other.leaves)
    states = intervals.traced_states(differs, Bounds(S, S, _PROOF_TILE, _PROOF_TILE, device), B, 1)
    return parts if states is not None and bool((states == EMPTY).all()) else None


def read(mod: Any, B: int, H: int, S: int, Sk: int, device: torch.device) -> MaskRule | None:
    """A plain mask_mod for one (B, H, S, Sk) call: :class:`Recognised` where it is proven equal
    to helpers, else :class:`Traced` where the tracer reads it; None where ``mod`` is no plain
    function (or None), is opaque, or the call is on the meta device or under torch.compile."""
    if isinstance(mod, TileMap):  # its states are there already: only a reading as helpers adds a path
        inner = read(mod.mask_mod, B, H, S, Sk, device)
        return inner if isinstance(inner, Recognised) else None
    if mod is None or not _plain(mod) or device.type == "meta" or torch.compiler.is_compiling():
        return None
    root = trace(mod, device)
    if root is None:
        return None
    parts = None
    if S == Sk and S >= 1 and 1 not in root.leaves:  # a document rule is the same for every head
        tensors = captured(root)
        key = (signature(root, tensors), B if 0 in root.leaves else 1, S, str(device))
        known, parts = _PROOFS.get(key, tensors)
        if not known:
            parts = _prove(root, B, S, device)
            _PROOFS.put(key, tensors, parts)
    return Traced(mod, root) if parts is None else Recognised(mod, parts)


def recognise(mod: Any, B: int, H: int, S: int, Sk: int, device: torch.device) -> Recognised | None:
    """The helpers equal to the plain mask_mod ``mod`` on the (B, H, S, Sk) grid, proven (see
    the module docstring); None where ``mod`` is a helper already, is opaque, depends on the
    head, S != Sk, or no candidate is proven."""
    found = read(mod, B, H, S, Sk, device)
    return found if isinstance(found, Recognised) else None

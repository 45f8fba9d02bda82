"""A traced mask_mod's tiles (:mod:`headwise.symbolic`), classified by interval arithmetic and
made exact where the intervals cannot tell.

Every node of the graph gets, per tile, the least and greatest value it can take over the
tile's indices (``doc[q]``: the min and max of ``doc`` over the tile's query range, from a
sparse table; ``q >= kv``: 1 where it holds for every pair, 0 where for none). A tile is
*full* only where the rule's lower bound is 1 (proven true for every pair), *empty* only
where its upper bound is 0; the others are split into sub-tiles, classified again, and
those still undecided are evaluated pair by pair by replaying the graph. The states are
exact, as evaluating every pair would give, at the cost of the tiles a rule's boundaries
cross. They are cached per (graph, captured tensors' values, shape, tiles, device), so the
forward, the backward and every layer of a step pay once; a captured tensor changed in
place is a miss.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the rows / columns
of one tile, nq / nk the tiles along S / Sk, n cells.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from headwise.symbolic import LIMIT, Memo, Node, Opaque, _walk, captured, replay, signature, trace
from headwise.tiles import EMPTY, FULL, PARTIAL, Bounds

__all__ = ["tile_states", "traced_states", "classify"]

_SPLIT = 8  # sub-tiles per side when a tile is split
_EXACT_AREA = 256  # cells of at most this many pairs are evaluated pair by pair
_CHUNK_PAIRS = 1 << 22  # pairs evaluated at once
_CHUNK_CELLS = 1 << 15  # cells split at once

Bounded = tuple[Tensor, Tensor]  # (lo, hi) int64


class _Tables:
    """Range min / max of each captured tensor over [lo, hi] along its last dim, by sparse table."""

    def __init__(self, device: torch.device):
        self.device = device
        self.made: dict[tuple, tuple[Tensor, Tensor, tuple[Tensor, Tensor]]] = {}

    def _table(self, t: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)  # views of the same values share a table
        if key not in self.made:
            v = t.to(device=self.device, dtype=torch.int64)
            v = v if v.dim() == 2 else v[None]  # (R, L)
            R, L = v.shape
            K = L.bit_length()  # levels: level k holds the extremes of [i, i + 2^k) (past the end: of what is left)
            mins, maxs = v.new_empty(K, R, L), v.new_empty(K, R, L)  # (K, R, L)
            mins[0], maxs[0] = v, v
            for k in range(1, K):
                w = 1 << (k - 1)
                torch.minimum(mins[k - 1, :, :L - w], mins[k - 1, :, w:], out=mins[k, :, :L - w])
                torch.maximum(maxs[k - 1, :, :L - w], maxs[k - 1, :, w:], out=maxs[k, :, :L - w])
                mins[k, :, L - w:], maxs[k, :, L - w:] = mins[k - 1, :, L - w:], maxs[k - 1, :, L - w:]
            self.made[key] = (mins, maxs, (v.amin(), v.amax()))
        return self.made[key]

    def range(self, t: Tensor, row: Bounded | None, col: Bounded) -> Bounded:
        """min and max of ``t[row, lo..hi]`` (t 1-D: of ``t[lo..hi]``); over a row range of
        more than one row, t's extremes."""
        mins, maxs, whole = self._table(t)
        K, R, L = mins.shape
        if row is None:
            lo, hi = torch.broadcast_tensors(*col)
            r = torch.zeros_like(lo)
        else:
            r, r_hi, lo, hi = torch.broadcast_tensors(*row, *col)
            row = (r, r_hi)
        k = torch.frexp((hi - lo + 1).double())[1].long() - 1  # floor(log2(hi - lo + 1))
        base = (k * R + r) * L
        second = hi - (1 << k) + 1
        low = torch.minimum(mins.reshape(-1)[base + lo], mins.reshape(-1)[base + second])
        high = torch.maximum(maxs.reshape(-1)[base + lo], maxs.reshape(-1)[base + second])
        if row is not None:
            one = row[0] == row[1]
            low, high = torch.where(one, low, whole[0]), torch.where(one, high, whole[1])
        return low, high


def _arith(op: str, a: Bounded, b: Bounded) -> Bounded:
    (alo, ahi), (blo, bhi) = a, b
    if op == "add":
        return alo + blo, ahi + bhi
    if op == "sub":
        return alo - bhi, ahi - blo
    if op == "mul":
        p = torch.stack(torch.broadcast_tensors(alo * blo, alo * bhi, ahi * blo, ahi * bhi))
        return p.amin(0), p.amax(0)
    if op == "min":
        return torch.minimum(alo, blo), torch.minimum(ahi, bhi)
    if op == "max":
        return torch.maximum(alo, blo), torch.maximum(ahi, bhi)
    c = int(blo.item())  # floordiv / mod: a constant divisor (the tracer refuses any other)
    if op == "floordiv":  # monotone: non-decreasing for c > 0, non-increasing for c < 0
        return (alo // c, ahi // c) if c > 0 else (ahi // c, alo // c)
    one_period = (alo // c) == (ahi // c)  # mod by c > 0
    return torch.where(one_period, alo % c, 0), torch.where(one_period, ahi % c, c - 1)


def _compare(op: str, a: Bounded, b: Bounded) -> Bounded:
    """(must, may) of a comparison as 0 / 1: must = true for every pair, may = for some."""
    (alo, ahi), (blo, bhi) = a, b
    if op in ("gt", "ge"):
        (alo, ahi), (blo, bhi), op = (blo, bhi), (alo, ahi), "lt" if op == "gt" else "le"
    if op == "lt":
        must, may = ahi < blo, alo < bhi
    elif op == "le":
        must, may = ahi <= blo, alo <= bhi
    else:
        must = (alo == ahi) & (blo == bhi) & (alo == blo)
        may = (alo <= bhi) & (blo <= ahi)
        if op == "ne":
            must, may = ~may, ~must
    return must.long(), may.long()


def _logic(op: str, args: list[Bounded]) -> Bounded:
    if op == "not":
        lo, hi = args[0]
        return 1 - hi, 1 - lo
    (alo, ahi), (blo, bhi) = args
    if op == "and":
        return torch.minimum(alo, blo), torch.minimum(ahi, bhi)
    if op == "or":
        return torch.maximum(alo, blo), torch.maximum(ahi, bhi)
    must = ((alo == 1) & (bhi == 0)) | ((ahi == 0) & (blo == 1))  # xor: proven different
    may = ~((alo == ahi) & (blo == bhi) & (alo == blo))
    return must.long(), may.long()


def _step(node: Node, args: list, tables: _Tables) -> Bounded:
    op = node.op
    if op == "const":
        v = torch.tensor(args[0], device=tables.device)
        return v, v
    if op == "index":
        return tables.range(args[0], args[1] if len(args) == 3 else None, args[-1])
    if op == "same":
        return args[0]
    if op == "neg":
        return -args[0][1], -args[0][0]
    if op == "abs":
        lo, hi = args[0]
        return torch.where(lo >= 0, lo, torch.where(hi <= 0, -hi, 0)), torch.maximum(-lo, hi)
    if op == "where":
        (clo, chi), (alo, ahi), (blo, bhi) = args
        lo = torch.where(clo == 1, alo, torch.where(chi == 0, blo, torch.minimum(alo, blo)))
        return lo, torch.where(clo == 1, ahi, torch.where(chi == 0, bhi, torch.maximum(ahi, bhi)))
    if op in ("lt", "le", "gt", "ge", "eq", "ne"):
        return _compare(op, *args)
    if op in ("and", "or", "xor", "not"):
        return _logic(op, args)
    return _arith(op, *args)


def classify(root: Node, leaves: dict[int, Bounded], tables: _Tables, check: bool = False) -> Bounded:
    """The rule's (lo, hi) over each cell: lo 1 = true for every pair, hi 0 = false for every
    pair. ``leaves``: each index argument's (lo, hi), broadcasting. With ``check``, Opaque where
    a value could leave the int32 range or an index its tensor (then the real call decides)."""
    out: dict[int, Bounded] = {}
    for node in _walk(root):
        if node.op == "leaf":
            out[id(node)] = leaves[node.args[0]]
            continue
        args = [out[id(a)] if isinstance(a, Node) else a for a in node.args]
        if check and node.op == "index":
            t = node.args[0]
            for (lo, hi), size in zip(args[1:], t.shape, strict=True):
                if int(lo.min()) < 0 or int(hi.max()) >= size:
                    raise Opaque(f"an index may leave [0, {size})")
        lo, hi = _step(node, args, tables)
        if check and (int(lo.min()) <= -LIMIT or int(hi.max()) >= LIMIT):
            raise Opaque("values may leave the int32 range")
        out[id(node)] = (lo, hi)
    return out[id(root)]


def _cells(root: Node, tables: _Tables, cell: dict[int, Bounded]) -> Tensor:
    """Exact int8 states of n cells (each leaf's (lo, hi) of shape (n,)), from their sub-cells:
    split ``_SPLIT`` ways a side, classified, and the undecided ones split again; cells of at
    most ``_EXACT_AREA`` pairs are replayed pair by pair."""
    (q_lo, q_hi), (k_lo, k_hi) = cell[2], cell[3]
    sq, sk = int((q_hi - q_lo).max()) + 1, int((k_hi - k_lo).max()) + 1
    if sq * sk <= _EXACT_AREA:
        return _replayed(root, cell, sq, sk)
    cq, ck = -(-sq // _SPLIT), -(-sk // _SPLIT)
    # sub-cells past a cell's end are clamped onto its last row / column: they repeat pairs
    # of the cell, which changes neither "every" nor "some"
    sub_q = [torch.minimum(q_lo[:, None] + torch.arange(0, sq, cq, device=q_lo.device) + d, q_hi[:, None])
             for d in (0, cq - 1)]  # (n, nq') each
    sub_k = [torch.minimum(k_lo[:, None] + torch.arange(0, sk, ck, device=k_lo.device) + d, k_hi[:, None])
             for d in (0, ck - 1)]  # (n, nk') each
    leaves = {0: (cell[0][0][:, None, None], cell[0][1][:, None, None]),
              1: (cell[1][0][:, None, None], cell[1][1][:, None, None]),
              2: (sub_q[0][:, :, None], sub_q[1][:, :, None]), 3: (sub_k[0][:, None, :], sub_k[1][:, None, :])}
    lo, hi = classify(root, leaves, tables)
    n, shape = q_lo.shape[0], (q_lo.shape[0], sub_q[0].shape[1], sub_k[0].shape[1])
    full, empty = (lo == 1).expand(shape), (hi == 0).expand(shape)  # (n, nq', nk')
    unknown = ~full & ~empty
    if int(unknown.sum()) * 2 > unknown.numel():  # the intervals decide too little here: pair by pair
        return _replayed(root, cell, sq, sk)
    has_full, has_empty = full.flatten(1).any(1), empty.flatten(1).any(1)  # (n,)
    todo = unknown.flatten(1).any(1) & ~(has_full & has_empty)
    partial = torch.zeros(n, dtype=torch.bool, device=q_lo.device)
    if bool(todo.any()):
        at = (unknown & todo[:, None, None]).nonzero()  # (m, 3): cell, sub-row, sub-column
        sub = {0: (cell[0][0][at[:, 0]], cell[0][1][at[:, 0]]), 1: (cell[1][0][at[:, 0]], cell[1][1][at[:, 0]]),
               2: (sub_q[0][at[:, 0], at[:, 1]], sub_q[1][at[:, 0], at[:, 1]]),
               3: (sub_k[0][at[:, 0], at[:, 2]], sub_k[1][at[:, 0], at[:, 2]])}
        got = _chunked(root, tables, sub)  # (m,)
        count = torch.zeros(n, 3, dtype=torch.long, device=q_lo.device)
        count.index_put_((at[:, 0], got.long()), torch.ones_like(at[:, 0]), accumulate=True)
        has_full, has_empty, partial = has_full | (count[:, FULL] > 0), has_empty | (count[:, EMPTY] > 0), \
            count[:, PARTIAL] > 0
    state = torch.where(has_full, FULL, EMPTY)
    return torch.where(partial | (has_full & has_empty), PARTIAL, state).to(torch.int8)


def _chunked(root: Node, tables: _Tables, cell: dict[int, Bounded]) -> Tensor:
    """:func:`_cells` a bounded number of cells at a time."""
    n = cell[2][0].shape[0]
    parts = []
    for i in range(0, n, _CHUNK_CELLS):
        part = {leaf: (lo.expand(n)[i:i + _CHUNK_CELLS], hi.expand(n)[i:i + _CHUNK_CELLS])
                for leaf, (lo, hi) in cell.items()}
        parts.append(_cells(root, tables, part))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int8)


def _replayed(root: Node, cell: dict[int, Bounded], sq: int, sk: int) -> Tensor:
    """Exact int8 states of n cells of at most (sq, sk) pairs: the graph replayed on every pair
    (rows and columns past a cell's end repeat its last one)."""
    (q_lo, q_hi), (k_lo, k_hi) = cell[2], cell[3]
    n = q_lo.shape[0]
    step = max(1, _CHUNK_PAIRS // (sq * sk))
    out = []
    for i in range(0, n, step):
        s = slice(i, i + step)
        q = torch.minimum(q_lo[s, None] + torch.arange(sq, device=q_lo.device), q_hi[s, None])[:, :, None]
        kv = torch.minimum(k_lo[s, None] + torch.arange(sk, device=k_lo.device), k_hi[s, None])[:, None, :]
        b, h = cell[0][0][s, None, None], cell[1][0][s, None, None]
        allowed = replay(root, {0: b, 1: h, 2: q, 3: kv}).expand(q.shape[0], sq, sk).flatten(1)  # (n', sq * sk)
        every, some = allowed.all(1), allowed.any(1)
        out.append(torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8))
    return torch.cat(out)


def _grid_states(root: Node, bounds: Bounds, B: int, H: int) -> Tensor:
    """Exact int8 (B|1, H|1, nq, nk) states of a traced rule on ``bounds``' grid (Opaque where
    the rule may index out of range or overflow: the caller evaluates it the plain way)."""
    device = bounds.device if bounds.device is not None else torch.device("cpu")
    tables = _Tables(device)
    arange = lambda n, dims: torch.arange(n, device=device).view(dims)  # noqa: E731
    whole = {0: (torch.tensor(0, device=device), torch.tensor(B - 1, device=device)),
             1: (torch.tensor(0, device=device), torch.tensor(H - 1, device=device)),
             2: (torch.tensor(0, device=device), torch.tensor(bounds.S - 1, device=device)),
             3: (torch.tensor(0, device=device), torch.tensor(bounds.Sk - 1, device=device))}
    classify(root, whole, tables, check=True)  # every tile's values lie within these
    Bn, Hn = (B if 0 in root.leaves else 1), (H if 1 in root.leaves else 1)
    b, h = arange(Bn, (Bn, 1, 1, 1)), arange(Hn, (1, Hn, 1, 1))
    q = (bounds.q_lo.to(device)[None, None], bounds.q_hi.to(device)[None, None])  # (1, 1, nq, 1)
    kv = (bounds.k_lo.to(device)[None, None], bounds.k_hi.to(device)[None, None])  # (1, 1, 1, nk)
    lo, hi = classify(root, {0: (b, b), 1: (h, h), 2: q, 3: kv}, tables)
    shape = (Bn, Hn, q[0].shape[2], kv[0].shape[3])
    states = torch.where(lo == 1, FULL, torch.where(hi == 0, EMPTY, PARTIAL)).to(torch.int8).expand(shape).clone()
    at = ((lo == 0) & (hi == 1)).expand(shape).nonzero()  # (U, 4): undecided tiles
    if at.shape[0]:
        cell = {0: (at[:, 0], at[:, 0]), 1: (at[:, 1], at[:, 1]),
                2: (bounds.q_lo.to(device)[at[:, 2], 0], bounds.q_hi.to(device)[at[:, 2], 0]),
                3: (bounds.k_lo.to(device)[0, at[:, 3]], bounds.k_hi.to(device)[0, at[:, 3]])}
        states[at.unbind(1)] = _chunked(root, tables, cell)
    return states


_MEMO = Memo(32)


def traced_states(root: Node, bounds: Bounds, B: int, H: int) -> Tensor | None:
    """Exact int8 (B|1, H|1, nq, nk) tile states of a traced rule; None where the bounds show
    it may index out of range or overflow (the caller evaluates every pair). Cached (see the
    module docstring)."""
    device = bounds.device if bounds.device is not None else torch.device("cpu")
    if bounds.S == 0 or bounds.Sk == 0:
        return None
    tensors = captured(root)
    if any(t.device != device for t in tensors):
        return None
    key = (signature(root, tensors), B if 0 in root.leaves else 1, H if 1 in root.leaves else 1,
           bounds.S, bounds.Sk, bounds.bq, bounds.bk, str(device))
    found, states = _MEMO.get(key, tensors)
    if not found:
        try:
            states = _grid_states(root, bounds, B, H)
        except Opaque:
            states = None
        _MEMO.put(key, tensors, states)
    return states


def tile_states(mod: Any, bounds: Bounds, B: int, H: int) -> Tensor | None:
    """:func:`traced_states` of a plain mask_mod, traced here; None where it is opaque."""
    root = trace(mod, bounds.device)
    return None if root is None else traced_states(root, bounds, B, H)

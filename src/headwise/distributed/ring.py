"""Ring attention: K/V blocks travel around the ranks, partial results merge by log-sum-exp.

Each rank keeps its queries. Its K/V block (with the Hkv heads, never expanded to H, and
the key padding shard when there is one) goes around the ring: at step ``t`` rank ``r``
holds the block of rank ``r - t``, sends it on to ``r + 1`` and receives the next one from
``r - 1`` while it computes (two buffers: the one being computed on and the one arriving).
Every block gives an output and a log-sum-exp per query row, in fp32 (fp64 for fp64
inputs); merging them by log-sum-exp is exact, and a row that may attend nothing in a block
carries lse = -inf and merges as zeros.

The backward pass goes around the ring again, FlashAttention-2 style: every tile's
probabilities are recomputed from the saved (out, lse), ``dS = P * (dP - rowsum(dO * O))``;
each block's dK/dV accumulator travels with the block and arrives back at its owner after
N hops.

Inside a block the work is tiled (``policy.RING_BLOCK_Q`` queries x ``RING_BLOCK_K`` keys),
so memory stays O(S_local x block); a tile that the causal rule or the window blocks
entirely, decided from global positions alone, is skipped in both passes. On the CPU, when
no mask, window or ALiBi is involved, each (query segment, key segment) pair of a block is
fully allowed, fully blocked (skipped) or exactly diagonal, and runs on PyTorch's fused
flash kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which
returns exactly the pair's share of the gradients given the merged output and lse), in
parts of at most ``policy.RING_FUSED_ROWS`` rows.

The mask contract's NaN rule holds tile by tile: where a mask or the causal / window rule
leaves a query row of a tile nothing to attend, or a key of it no row, that row's query or
that key and value count as zeros in the tile (their probabilities there are 0 anyway), so
NaN or inf at a padded key, a masked column or a dead query row reaches no result and no
gradient (``0 * nan`` would).

The kv heads go round in passes of at most ``policy.RING_PASS_BYTES`` of K/V per message (a
pass takes whole kv heads with their G query heads, at least one). The backward pass holds
four block-sized buffers at once (the K/V being used and the one arriving, the dK/dV
being filled and the one arriving); passes divide them, so the ring's memory stays
near that of one process at the local length while the bytes sent stay exactly
(N - 1) x ``|local K, V|`` summed over the passes (a key padding shard goes with each pass).

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S / Sk global query /
key length, S_l / Sk_l this rank's lengths, Skb the length of the block at hand, D head
dim, N world size, bq / bk the rows / columns of one tile.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from headwise import policy
from headwise.distributed.layout import segments
from headwise.pieces import merge_into

__all__ = ["RingPlan", "Ring", "Traffic", "TRAFFIC", "ring_attention", "block_forward"]

# PyTorch's fused CPU flash kernel and its backward (None on builds without them: the plan then never fuses).
_FUSED_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CPU_BACKWARD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


@dataclass
class Traffic:
    """What the ring did on this rank since the last :meth:`reset` (read by the benchmark).

    ``sent_bytes``: bytes this rank sent, per pass. ``score_entries``: (query, key) score
    entries computed per (batch, head) pair, forward pass only; tiles skipped by the
    causal rule or the window are not counted.
    """

    sent_bytes: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    score_entries: int = 0

    def reset(self) -> None:
        self.sent_bytes = {"forward": 0, "backward": 0}
        self.score_entries = 0


TRAFFIC = Traffic()


def _tiles(segs: list[tuple[int, int]], size: int) -> list[tuple[int, int, int]]:
    """(local start, local stop, global start) of tiles that never straddle two segments."""
    tiles, local = [], 0
    for a, b in segs:
        for g in range(a, b, size):
            n = min(size, b - g)
            tiles.append((local, local + n, g))
            local += n
    return tiles


class RingPlan:
    """Shapes, global positions, tiles and masks of one call, shared by both passes.

    Args:
        q: local queries (B, H, S_l, D).
        k: local keys (B, Hkv, Sk_l, D).
        S, Sk: the global lengths.
        rank, world: this rank and the ring size.
        layout: how the sequences are split (see :mod:`headwise.distributed.layout`).
        dense: normalised (B|1, H|1, S_l|1, Sk) mask over every key, or None.
        is_causal, window, slopes, scale: the attention's rules.
        block_q, block_k: tile sizes.
    """

    def __init__(self, q: Tensor, k: Tensor, *, S: int, Sk: int, rank: int, world: int, layout: str,
                 dense: Tensor | None, is_causal: bool, window: int | None, slopes: Tensor | None,
                 scale: float, block_q: int | None = None, block_k: int | None = None):  # None: the policy's
        B, H, S_l, D = q.shape
        Hkv = k.shape[1]
        self.B, self.H, self.Hkv, self.G, self.S_l, self.D = B, H, Hkv, H // Hkv, S_l, D
        self.rank, self.world = rank, world
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # merge / accumulate dtype
        self.offset = Sk - S  # bottom-right causal alignment on global positions
        self.is_causal = bool(is_causal) or window is not None
        self.window = window
        self.scale = scale
        self.slopes5 = None if slopes is None else slopes.to(self.acc).reshape(1, Hkv, self.G, 1, 1)
        block_q, block_k = block_q or policy.RING_BLOCK_Q, block_k or policy.RING_BLOCK_K
        self.q_tiles = _tiles(segments(S, world, rank, layout), block_q)
        self.q_segs = _tiles(segments(S, world, rank, layout), max(S, 1))  # (local start, stop, global start)
        k_segs = [segments(Sk, world, r, layout) for r in range(world)]
        self.k_segs = [_tiles(s, max(Sk, 1)) for s in k_segs]
        self.k_lens = [sum(b - a for a, b in s) for s in k_segs]
        self.k_tiles = [_tiles(s, block_k) for s in k_segs]
        # PyTorch's fused CPU kernel serves (query segment, key segment) pairs that are fully
        # allowed or exactly diagonal, when no mask, window or ALiBi needs our own tiles.
        self.fused = (q.device.type == "cpu" and _FUSED_CPU is not None and dense is None and window is None
                      and slopes is None)
        self.dense5 = None  # (B|1, Hkv|1, G|1, S_l|1, Sk); bool stored inverted: True = blocked
        if dense is not None:
            b, h, s, _ = dense.shape
            hk, g = (Hkv, self.G) if h == H else (1, 1)
            m = dense.reshape(b, hk, g, s, Sk)
            self.dense5 = ~m if m.dtype == torch.bool else m.to(self.acc)
        # whole kv heads per pass, as many as RING_PASS_BYTES of one block's K and V allow (at least one)
        per_head = 2 * B * max(self.k_lens) * D * k.element_size()
        step = max(1, min(Hkv, policy.RING_PASS_BYTES // max(per_head, 1)))
        self.passes = [(a, min(a + step, Hkv)) for a in range(0, Hkv, step)]

    def heads(self, a: int, b: int) -> RingPlan:
        """This plan for the kv heads ``a:b`` (and their query heads) alone: one pass."""
        part = copy.copy(self)
        part.Hkv, part.H = b - a, (b - a) * self.G
        if self.dense5 is not None and self.dense5.shape[1] > 1:
            part.dense5 = self.dense5[:, a:b]
        if self.slopes5 is not None:
            part.slopes5 = self.slopes5[:, a:b]
        return part

    def fused_pairs(self, src: int, has_pad: bool) -> list[tuple[tuple, tuple, bool]] | None:
        """(query segment, key segment, top-left causal) pairs to run on the fused kernel for the block
        of rank ``src`` (blocked pairs left out), or None when some pair needs the tiles."""
        if not self.fused or has_pad:
            return None
        pairs = []
        for qseg in self.q_segs:
            for kseg in self.k_segs[src]:
                bq, bk = qseg[1] - qseg[0], kseg[1] - kseg[0]
                blocked = self.causal_tile(qseg[2], bq, kseg[2], bk, None, probe=True)
                if blocked is False:
                    continue
                if blocked is not None and not (bq == bk and qseg[2] + self.offset == kseg[2]):
                    return None  # neither fully allowed nor the exact diagonal
                # Calls of at most RING_FUSED_ROWS queries / keys: the kernel's backward allocates about
                # four query-sized buffers per call, so smaller calls keep the peak down.
                q_parts, k_parts = _tiles([(qseg[2], qseg[2] + bq)], policy.RING_FUSED_ROWS), _tiles(
                    [(kseg[2], kseg[2] + bk)], policy.RING_FUSED_ROWS)
                for i, (a0, a1, ga) in enumerate(q_parts):
                    for j, (b0, b1, gb) in enumerate(k_parts):
                        if blocked is None or j < i:
                            pairs.append(((qseg[0] + a0, qseg[0] + a1, ga), (kseg[0] + b0, kseg[0] + b1, gb), False))
                        elif j == i:  # on the diagonal: top-left causal on the part
                            pairs.append(((qseg[0] + a0, qseg[0] + a1, ga), (kseg[0] + b0, kseg[0] + b1, gb), True))
        return pairs

    @overload
    def causal_tile(self, gq0: int, bq: int, gk0: int, bk: int, device: torch.device | None,
                    probe: Literal[False] = False) -> Tensor | None | Literal[False]: ...

    @overload
    def causal_tile(self, gq0: int, bq: int, gk0: int, bk: int, device: torch.device | None,
                    probe: Literal[True]) -> bool | None: ...

    def causal_tile(self, gq0: int, bq: int, gk0: int, bk: int, device: torch.device | None,
                    probe: bool = False) -> Tensor | None | bool:
        """The causal / window rule on one tile: False = all blocked, None = all allowed,
        else a bool (bq, bk) tensor, True = blocked (``probe``: True instead of the tensor)."""
        if not self.is_causal:
            return None
        i0, i1 = gq0 + self.offset, gq0 + bq - 1 + self.offset  # first / last query, aligned to the keys
        j0, j1 = gk0, gk0 + bk - 1
        W = self.window
        if j0 > i1 or (W is not None and j1 <= i0 - W):
            return False
        if j1 <= i0 and (W is None or j0 > i1 - W):
            return None
        if probe:
            return True
        i = torch.arange(i0, i1 + 1, device=device)[:, None]  # (bq, 1)
        j = torch.arange(j0, j1 + 1, device=device)[None, :]  # (1, bk)
        blocked = j > i
        if W is not None:
            blocked |= j <= i - W
        return blocked  # (bq, bk)

    def excluded(self, q_tile: tuple[int, int, int], k_tile: tuple[int, int, int], pad: Tensor | None,
                 blocked: Tensor | None) -> Tensor | None:
        """What the masks and the causal / window rule exclude in one tile: (B|1, Hkv|1, G|1, bq|1, bk)
        bool, True = excluded; None when nothing does. ALiBi excludes nothing."""
        lq0, lq1, _ = q_tile
        lk0, lk1, gk0 = k_tile
        parts = []
        if self.dense5 is not None:
            rows = slice(lq0, lq1) if self.dense5.shape[3] != 1 else slice(None)
            m = self.dense5[:, :, :, rows, gk0:gk0 + lk1 - lk0]  # (B|1, Hkv|1, G|1, bq|1, bk)
            parts.append(m if m.dtype == torch.bool else torch.isneginf(m))
        if pad is not None:
            p = pad[:, None, None, None, lk0:lk1]  # (B|1, 1, 1, 1, bk)
            parts.append(p if p.dtype == torch.bool else torch.isneginf(p))
        if blocked is not None:
            parts.append(blocked[None, None, None])  # (bq, bk) -> (1, 1, 1, bq, bk)
        if not parts:
            return None
        out = parts[0]
        for part in parts[1:]:
            out = out | part
        return out

    @staticmethod
    def hide(qt: Tensor, kt: Tensor, vt: Tensor, excluded: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """One tile's queries (B, Hkv, G, bq, D), keys and values (B, Hkv, bk, D) with zeros at the
        rows that may attend no key of the tile and at the keys no row of it may attend.

        Their probabilities are 0 in this tile, so the tile's results are the same, but ``0 * nan``
        is NaN: what the rules exclude must not reach a result or a gradient even as NaN or inf
        (the mask contract). A key or row excluded for some rows only is a live input and is kept.
        """
        if excluded is None:
            return qt, kt, vt
        dead_rows = excluded.all(-1, keepdim=True)  # (B|1, Hkv|1, G|1, bq|1, 1)
        dead_keys = excluded.all(-2).all(2).unsqueeze(-1)  # (B|1, Hkv|1, G|1, bk) -> (B|1, Hkv|1, bk, 1)
        return torch.where(dead_rows, 0.0, qt), torch.where(dead_keys, 0.0, kt), torch.where(dead_keys, 0.0, vt)

    def scores(self, qt: Tensor, kt: Tensor, q_tile: tuple[int, int, int], k_tile: tuple[int, int, int],
               pad: Tensor | None, blocked: Tensor | None) -> Tensor:
        """Masked scaled scores (B, Hkv, G, bq, bk) of one tile's queries ``qt`` (B, Hkv, G, bq, D).

        ``pad`` is the block's key padding (B|1, Skb), bool True = blocked, or float.
        """
        lq0, lq1, gq0 = q_tile
        lk0, lk1, gk0 = k_tile
        B, Hkv, G, _, D = qt.shape
        bq, bk = lq1 - lq0, lk1 - lk0
        s = torch.matmul(qt.reshape(B, Hkv, G * bq, D), kt.transpose(-2, -1)).reshape(B, Hkv, G, bq, bk)
        s = s.mul_(self.scale)
        # (B, Hkv, G*bq, D) x (B, Hkv, D, bk) -> (B, Hkv, G, bq, bk)
        if self.dense5 is not None:
            m = self.dense5
            rows = slice(lq0, lq1) if m.shape[3] != 1 else slice(None)
            m = m[:, :, :, rows, gk0:gk0 + bk]  # (B|1, Hkv|1, G|1, bq|1, bk)
            s = s.masked_fill_(m, float("-inf")) if m.dtype == torch.bool else s.add_(m)
        if pad is not None:
            p = pad[:, None, None, None, lk0:lk1]  # (B|1, 1, 1, 1, bk)
            s = s.masked_fill_(p, float("-inf")) if p.dtype == torch.bool else s.add_(p.to(s.dtype))
        if self.slopes5 is not None:
            i = torch.arange(gq0, gq0 + bq, device=s.device)[:, None] + self.offset  # (bq, 1)
            j = torch.arange(gk0, gk0 + bk, device=s.device)[None, :]  # (1, bk)
            s = s.sub_(self.slopes5 * (i - j).abs().to(s.dtype))  # ALiBi on global distance
        if blocked is not None:
            s = s.masked_fill_(blocked, float("-inf"))
        return s


def block_forward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, src: int,
                  pad: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """Local queries against the K/V block of rank ``src``, on the ring's own tiles.

    Args:
        plan: the call's :class:`RingPlan`.
        q: queries (B, Hkv, G, S_l, D) in ``plan.acc`` (not scaled).
        k, v: the block (B, Hkv, Skb, D) in ``plan.acc``.
        src: the rank the block comes from (its global key positions follow from it).
        pad: the block's key padding (B|1, Skb): bool True = blocked, or float; or None.

    Returns:
        ``(out, lse)``: (B, Hkv, G, S_l, D) normalised over this block's keys and
        (B, Hkv, G, S_l, 1) with -inf where a row may attend none of them; None when the
        causal rule or the window blocks the whole block.
    """
    B, Hkv, G, S_l, D = q.shape
    result: tuple[Tensor, Tensor] | None = None  # (out, lse), made at the first row that attends
    for q_tile in plan.q_tiles:
        lq0, lq1, gq0 = q_tile
        bq = lq1 - lq0
        running: tuple[Tensor, Tensor, Tensor] | None = None  # (max, sum, weighted values) of the rows
        for k_tile in plan.k_tiles[src]:
            lk0, lk1, gk0 = k_tile
            blocked = plan.causal_tile(gq0, bq, gk0, lk1 - lk0, q.device)
            if blocked is False:
                continue
            TRAFFIC.score_entries += G * bq * (lk1 - lk0)
            qt, kt, vt = plan.hide(q[:, :, :, lq0:lq1], k[:, :, lk0:lk1], v[:, :, lk0:lk1],
                                   plan.excluded(q_tile, k_tile, pad, blocked))
            s = plan.scores(qt, kt, q_tile, k_tile, pad, blocked)  # (B, Hkv, G, bq, bk)
            m_new = s.amax(dim=-1, keepdim=True)  # (B, Hkv, G, bq, 1)
            if running is not None:
                m_new = torch.maximum(running[0], m_new)
            # -inf max = nothing attended yet: shift by 0 so exp(-inf - 0) = 0, never NaN.
            m_new = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            p = s.sub_(m_new).exp_()  # (B, Hkv, G, bq, bk)
            pv = torch.matmul(p.reshape(B, Hkv, G * bq, -1), vt).reshape(B, Hkv, G, bq, D)
            # (B, Hkv, G*bq, bk) x (B, Hkv, bk, D) -> (B, Hkv, G, bq, D)
            if running is None:
                running = m_new, p.sum(dim=-1, keepdim=True), pv
            else:
                m, l, acc = running
                alpha = torch.exp(m - m_new)  # rescale what was summed under the old max
                running = m_new, alpha * l + p.sum(dim=-1, keepdim=True), alpha * acc + pv
        if running is None:
            continue  # the causal rule / window blocks these rows against the whole block
        m, l, acc = running
        if result is None:
            result = q.new_zeros(B, Hkv, G, S_l, D), q.new_full((B, Hkv, G, S_l, 1), float("-inf"))
        out, lse = result
        alive = l > 0
        l_safe = torch.where(alive, l, torch.ones_like(l))
        out[:, :, :, lq0:lq1] = acc / l_safe
        lse[:, :, :, lq0:lq1] = torch.where(alive, m + torch.log(l_safe), float("-inf"))
    return result


def _fused_forward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, pairs, out: Tensor, lse: Tensor) -> None:
    """The block on PyTorch's fused CPU kernel, one call per (query, key) segment pair, each
    result merged by log-sum-exp straight into the running ``(out, lse)`` (no block-sized copy)."""
    B, Hkv, G, S_l, D = q.shape
    q4 = q.reshape(B, Hkv * G, S_l, D)  # (B, H, S_l, D); a view, also for one pass's heads
    for (lq0, lq1, _), (lk0, lk1, _), causal in pairs:
        bq = lq1 - lq0
        TRAFFIC.score_entries += G * bq * (lk1 - lk0) // (2 if causal else 1)
        o, s = _FUSED_CPU(q4[:, :, lq0:lq1], k[:, :, lk0:lk1], v[:, :, lk0:lk1], 0.0, causal, scale=plan.scale)
        # (B, H, bq, D), (B, H, bq): GQA without copies
        rows = slice(lq0, lq1)
        merge_into(out[:, :, :, rows], lse[:, :, :, rows], o.reshape(B, Hkv, G, bq, D).to(q.dtype),
              s.reshape(B, Hkv, G, bq, 1).to(q.dtype))


def _fused_backward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, pairs, dout: Tensor, lse: Tensor,
                    out: Tensor, dq: Tensor, dkv: Tensor) -> None:
    """:func:`_block_backward` on PyTorch's fused CPU kernel: given the merged output and lse,
    its backward gives exactly this block's share of the gradients."""
    B, Hkv, G, S_l, D = q.shape
    H = Hkv * G
    q4, dout4, out4 = (t.reshape(B, H, S_l, D) for t in (q, dout, out))  # (B, H, S_l, D)
    lse4 = lse.reshape(B, H, S_l)
    for (lq0, lq1, _), (lk0, lk1, _), causal in pairs:
        r, c = slice(lq0, lq1), slice(lk0, lk1)
        dq_p, dk_p, dv_p = _FUSED_CPU_BACKWARD(dout4[:, :, r], q4[:, :, r], k[:, :, c], v[:, :, c], out4[:, :, r],
                                               lse4[:, :, r], 0.0, causal, scale=plan.scale)
        dq[:, :, :, r] += dq_p.reshape(B, Hkv, G, lq1 - lq0, D)
        dkv[0, :, :, c] += dk_p
        dkv[1, :, :, c] += dv_p


def _block_backward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor, src: int, pad: Tensor | None,
                    dout: Tensor, lse: Tensor, delta: Tensor, out: Tensor, dq: Tensor, dkv: Tensor) -> None:
    """Gradients of one block, added into ``dq`` (B, Hkv, G, S_l, D) and into the block's
    travelling ``dkv`` (2, B, Hkv, Skb, D)."""
    pairs = plan.fused_pairs(src, pad is not None)
    if pairs is not None:
        return _fused_backward(plan, q, k, v, pairs, dout, lse, out, dq, dkv)
    B, Hkv, G, S_l, D = q.shape
    for q_tile in plan.q_tiles:
        lq0, lq1, gq0 = q_tile
        bq = lq1 - lq0
        dot = dout[:, :, :, lq0:lq1].reshape(B, Hkv, G * bq, D)
        for k_tile in plan.k_tiles[src]:
            lk0, lk1, gk0 = k_tile
            bk = lk1 - lk0
            blocked = plan.causal_tile(gq0, bq, gk0, bk, q.device)
            if blocked is False:
                continue
            q5, kt, vt = plan.hide(q[:, :, :, lq0:lq1], k[:, :, lk0:lk1], v[:, :, lk0:lk1],
                                   plan.excluded(q_tile, k_tile, pad, blocked))  # (B, Hkv, G, bq, D), (B, Hkv, bk, D)
            qt = q5.reshape(B, Hkv, G * bq, D)
            s = plan.scores(q5, kt, q_tile, k_tile, pad, blocked)
            p = s.sub_(lse[:, :, :, lq0:lq1]).exp_()  # (B, Hkv, G, bq, bk), the merged probabilities
            p3 = p.reshape(B, Hkv, G * bq, bk)
            dkv[1, :, :, lk0:lk1] += torch.matmul(p3.transpose(-2, -1), dot)
            # (B, Hkv, bk, G*bq) x (B, Hkv, G*bq, D) -> (B, Hkv, bk, D)
            dp = torch.matmul(dot, vt.transpose(-2, -1)).reshape(B, Hkv, G, bq, bk)
            # (B, Hkv, G*bq, D) x (B, Hkv, D, bk) -> (B, Hkv, G, bq, bk)
            ds = dp.sub_(delta[:, :, :, lq0:lq1]).mul_(p).reshape(B, Hkv, G * bq, bk)  # dS = P (dP - delta)
            dq[:, :, :, lq0:lq1] += torch.matmul(ds, kt).reshape(B, Hkv, G, bq, D).mul_(plan.scale)
            # (B, Hkv, G*bq, bk) x (B, Hkv, bk, D) -> (B, Hkv, G, bq, D)
            dkv[0, :, :, lk0:lk1] += torch.matmul(ds.transpose(-2, -1), qt).mul_(plan.scale)
            # (B, Hkv, bk, G*bq) x (B, Hkv, G*bq, D) -> (B, Hkv, bk, D)
    return None


class Ring:
    """Point-to-point traffic of one ring: send to the next rank, receive from the previous.

    isend / irecv with explicit waits (``batch_isend_irecv`` can hang on gloo). Even ranks
    post their sends first and odd ranks their receives, so two ranks that share one NCCL
    stream (N = 2) never both block in a send.
    """

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((rank + 1) % world)
        self.prev = to_global((rank - 1) % world)

    def start(self, send: list[Tensor], recv: list[Tensor], what: str, passname: str) -> _Pending:
        """Post the sends to the next rank and the receives from the previous one."""
        def sends():
            for t in send:
                TRAFFIC.sent_bytes[passname] += t.numel() * t.element_size()
            return [dist.isend(t, self.next, group=self.group) for t in send]

        def recvs():
            return [dist.irecv(t, self.prev, group=self.group) for t in recv]

        works = sends() + recvs() if self.rank % 2 == 0 else recvs() + sends()
        return _Pending(self, works, what, send + recv)

    def failure(self, what: str, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"context-parallel ring: rank {self.rank} of {self.world} failed while exchanging {what} with rank "
            f"{(self.rank + 1) % self.world} (next) / {(self.rank - 1) % self.world} (previous); a rank has died "
            f"or stopped calling attention, or the group's timeout passed. Cause: {error}"
        )


class _Pending:
    def __init__(self, ring: Ring, works: list, what: str, tensors: list[Tensor]):
        self.ring, self.works, self.what = ring, works, what
        self.tensors = tensors  # alive until the transfers are done

    def wait(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except RuntimeError as error:
            raise self.ring.failure(self.what, error) from error
        self.works, self.tensors = [], []  # a sent buffer is freed as soon as nothing else holds it


def _wire(pad: Tensor | None) -> list[Tensor]:
    """The key padding shard as sent: bool as uint8 (every backend carries bytes)."""
    if pad is None:
        return []
    return [pad.view(torch.uint8) if pad.dtype == torch.bool else pad]


def _unwire(bufs: list[Tensor], like: Tensor | None) -> Tensor | None:
    if like is None:
        return None
    return bufs[0].view(torch.bool) if like.dtype == torch.bool else bufs[0]


def _empty_block(k: Tensor, pad: Tensor | None, length: int) -> list[Tensor]:
    """Receive buffers for a block of ``length`` keys: k, v (B, Hkv, Skb, D) and the padding."""
    B, Hkv, _, D = k.shape
    bufs = [k.new_empty(B, Hkv, length, D), k.new_empty(B, Hkv, length, D)]
    if pad is not None:
        bufs.append(torch.empty(pad.shape[0], length, dtype=_wire(pad)[0].dtype, device=pad.device))
    return bufs


def _ring_forward(plan: RingPlan, ring: Ring, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, out: Tensor,
                  lse: Tensor) -> None:
    """One pass around the ring, merged into ``out`` (zeros) and ``lse`` (-inf) in place."""
    N, r = ring.world, ring.rank
    cur = [k.contiguous(), v.contiguous(), *_wire(pad)]  # what isend takes
    for step in range(N):
        src = (r - step) % N
        pending = None
        if step < N - 1:  # the next block arrives while this one is computed
            nxt = _empty_block(k, pad, plan.k_lens[(src - 1) % N])
            pending = ring.start(cur, nxt, f"the K/V block of rank {src}", "forward")
        kb, vb, pb = cur[0].to(plan.acc), cur[1].to(plan.acc), _unwire(cur[2:], pad)
        pairs = plan.fused_pairs(src, pad is not None)
        if pairs is not None:
            _fused_forward(plan, q, kb, vb, pairs, out, lse)
        else:
            block = block_forward(plan, q, kb, vb, src, pb)
            if block is not None:  # None: the causal rule / window blocks the whole block
                merge_into(out, lse, *block)
        if pending is not None:
            pending.wait()
            cur = nxt


def _ring_backward(plan: RingPlan, ring: Ring, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None,
                   dout: Tensor, out: Tensor, lse: Tensor, dq: Tensor) -> Tensor:
    """One pass around the ring: adds into ``dq`` and returns this rank's dK/dV (2, B, Hkv, Sk_l, D)."""
    N, r = ring.world, ring.rank
    delta = (dout * out).sum(dim=-1, keepdim=True)  # rowsum(dO * O): (B, Hkv, G, S_l, 1)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # dead rows: exp(-inf - 0) = 0
    cur = [k.contiguous(), v.contiguous(), *_wire(pad)]  # what isend takes
    # The dK/dV of the block at hand: zeros for this rank's own block at step 0, then, accumulated
    # straight into, the buffer the previous rank's exchange fills (one buffer per rank, not three).
    dkv = q.new_zeros(2, plan.B, plan.Hkv, plan.k_lens[r], plan.D)  # (2, B, Hkv, Skb, D)
    arriving: _Pending | None = None  # the exchange filling dkv
    for step in range(N):
        src = (r - step) % N
        pending = None
        if step < N - 1:
            nxt = _empty_block(k, pad, plan.k_lens[(src - 1) % N])
            pending = ring.start(cur, nxt, f"the K/V block of rank {src}", "backward")
        if arriving is not None:
            arriving.wait()
        _block_backward(plan, q, cur[0].to(plan.acc), cur[1].to(plan.acc), src, _unwire(cur[2:], pad), dout, lse,
                        delta, out, dq, dkv)
        # Pass block src's dK/dV on (at the last step the next rank is its owner) and take the
        # next block's from the previous rank (at the last step: this rank's own, complete).
        buf = dkv.new_empty(2, plan.B, plan.Hkv, plan.k_lens[(src - 1) % N], plan.D)
        arriving = ring.start([dkv], [buf], f"the dK/dV of rank {src}'s block", "backward")
        dkv = buf
        if pending is not None:
            pending.wait()
            cur = nxt
    if arriving is not None:
        arriving.wait()
    return dkv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pad, plan: RingPlan, ring: Ring):
        p = plan
        q5 = q.reshape(p.B, p.Hkv, p.G, p.S_l, p.D).to(p.acc)  # (B, H, S_l, D) -> (B, Hkv, G, S_l, D)
        out = torch.zeros_like(q5)
        lse = q5.new_full((*q5.shape[:-1], 1), float("-inf"))  # (B, Hkv, G, S_l, 1); stays -inf where nothing
        for a, b in p.passes:  # K/V travel in the input dtype
            _ring_forward(p.heads(a, b), ring, q5[:, a:b], k[:, a:b], v[:, a:b], pad, out[:, a:b], lse[:, a:b])
        ctx.save_for_backward(q, k, v, pad, out, lse)
        ctx.plan, ctx.ring = plan, ring
        return out.reshape(p.B, p.H, p.S_l, p.D).to(q.dtype)  # (B, Hkv, G, S_l, D) -> (B, H, S_l, D)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, pad, out, lse = ctx.saved_tensors
        p, ring = ctx.plan, ctx.ring
        q5 = q.reshape(p.B, p.Hkv, p.G, p.S_l, p.D).to(p.acc)
        dout = dout.reshape(out.shape).to(p.acc)  # (B, H, S_l, D) -> (B, Hkv, G, S_l, D)
        dq = torch.zeros_like(q5)

        def one_pass(a: int, b: int) -> Tensor:  # the dK/dV (2, B, b - a, Sk_l, D) of kv heads a:b
            return _ring_backward(p.heads(a, b), ring, q5[:, a:b], k[:, a:b], v[:, a:b], pad, dout[:, a:b],
                                  out[:, a:b], lse[:, a:b], dq[:, a:b])

        (a0, b0), *rest = p.passes
        dkv = one_pass(a0, b0)  # (2, B, Hkv, Sk_l, D) when one pass takes every kv head
        if rest:  # one buffer for every kv head, made once the first pass has freed its own
            first, dkv = dkv, dkv.new_empty(2, *k.shape)
            dkv[:, :, a0:b0] = first
            del first
            for a, b in rest:
                dkv[:, :, a:b] = one_pass(a, b)
        return dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, plan: RingPlan, ring: Ring) -> Tensor:
    """Exact attention of the local queries (B, H, S_l, D) over every rank's keys.

    ``pad``: this rank's key padding (B|1, Sk_l), bool True = blocked or float additive, or
    None; masks receive no gradient. Returns (B, H, S_l, D) in q's dtype.
    """
    return _RingAttention.apply(q, k, v, pad, plan, ring)

"""Blockwise attention with an online softmax, in plain PyTorch: O(S) memory.

The FlashAttention idea without a custom kernel: queries are taken in blocks of
``policy.CHUNKED_BLOCK_Q`` rows, keys in blocks of ``CHUNKED_BLOCK_K`` columns; each query
block keeps a running row max ``m``, running sum ``l`` and running output ``acc`` so that
the (S, Sk) score matrix never exists. Forward saves only q, k, v, the output and the log-sum-exp per row;
backward recomputes each tile (scores, probabilities, dropout mask) from them. Forward
and backward memory therefore grow as O(S) (plus one tile), not O(S^2).

Dropout draws a fresh seed per call from torch's default generator; each tile's keep
mask comes from its own generator seeded with ``seed + tile index``, so backward can
regenerate exactly the mask forward used.

Grouped-query attention runs on a (B, Hkv, G, S, D) view of q: the G query heads that
share a kv head are stacked into one matmul against that kv head, so k and v are never
copied to H heads.

Logit soft-capping (``softcap * tanh(s / softcap)``) is applied to each tile right after
its product, before ALiBi and the mask; backward recomputes the tile's ``tanh`` ``t`` and
multiplies the scores' gradient by its derivative ``1 - t^2``. Attention sinks are
applied after the tiles, from the log-sum-exp: with the keys' ``lse`` of a row and its
head's sink logit ``sink``, the row's full denominator is ``logaddexp(lse, sink)``, so the
output is ``out * sigmoid(lse - sink)``. Forward saves that full log-sum-exp, so backward's
``p = exp(s - lse)`` and ``delta = rowsum(dO * O)`` are the sink-aware ones as they stand,
and the sink's own gradient is ``-sum over rows of delta * exp(sink - lse)`` (its column's
probability times ``0 - delta``: a sink adds nothing to the output).

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length,
Sk key length, D head dim of q and k, Dv head dim of v, bq / bk the rows / columns of one tile.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from headwise import policy
from headwise.evaluate import MaskMod, evaluate_mask, mask_tile_states
from headwise.kernels import describe
from headwise.kernels.chunked_rows import rows_attention
from headwise.kernels.common import blocks, lse_dtype
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage
from headwise.rules import Rules
from headwise.tiles import EMPTY, FULL, Bounds


def _tile_drop(seed: int, tile: int, shape: tuple[int, ...], dropout_p: float,
               device: torch.device) -> Tensor:
    """Dropout mask of one tile (True = dropped), reproducible from ``(seed, tile)``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + tile)
    return torch.rand(shape, generator=gen, device=device) < dropout_p


def _causal_tile(i0: int, i1: int, j0: int, j1: int, offset: int, window: int | None,
                 device: torch.device, sink_tokens: int = 0) -> Tensor | None | bool:
    """The causal (and sliding window, with its sink tokens) rule on rows [i0, i1) x cols [j0, j1).

    Returns False when the whole tile is blocked, None when it is entirely allowed,
    else a bool (bq, bk) mask (True = may attend). A tile holding a sink key (``j0 <
    sink_tokens``) is never skipped for lying before the window.

    The same rule as :class:`headwise.masks.AlignedCausal`, decided on Python ints: the
    built-in rules read no tensor on the host (no device sync, no torch.compile graph break),
    where a mask_mod's tile map is read back with ``tolist``.
    """
    if j0 > i1 - 1 + offset:
        return False  # every key is after every query
    if window is not None and j1 - 1 <= i0 + offset - window and j0 >= sink_tokens:
        return False  # every key is before even the first query's window, and none is a sink
    inside = j1 - 1 <= i0 + offset and (window is None or j0 > i1 - 1 + offset - window or j1 <= sink_tokens)
    if inside:
        return None
    i = torch.arange(i0, i1, device=device)[:, None] + offset  # (bq, 1) aligned position
    j = torch.arange(j0, j1, device=device)[None, :]  # (1, bk)
    allowed = j <= i
    if window is not None:
        near = j > i - window
        allowed = allowed & (near | (j < sink_tokens) if sink_tokens else near)
    return allowed  # (bq, bk)


class _Plan:
    """Shapes, tiling and the mask of one call, shared by forward and backward."""

    def __init__(self, q: Tensor, k: Tensor, mask: Tensor | None, rules: Rules, block_q: int, block_k: int):
        B, H, S, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        self.B, self.H, self.Hkv, self.G, self.S, self.Sk, self.D = B, H, Hkv, H // Hkv, S, Sk, D
        self.device = q.device
        self.offset = Sk - S  # bottom-right causal alignment
        self.is_causal = rules.is_causal or rules.window is not None
        self.window = rules.window
        self.sink_tokens = rules.sink_tokens
        self.slopes5 = None  # (1, Hkv, G, 1, 1) ALiBi slopes
        if rules.alibi_slopes is not None:
            self.slopes5 = rules.alibi_slopes.to(q.dtype).reshape(1, Hkv, self.G, 1, 1)
        self.softcap = rules.softcap
        self.sinks5 = None  # (1, Hkv, G, 1, 1) sink logits
        if rules.sinks is not None:
            self.sinks5 = rules.sinks.to(q.dtype).reshape(1, Hkv, self.G, 1, 1)
        self.q_blocks = blocks(S, block_q)
        self.k_blocks = blocks(Sk, block_k)
        # A mask_mod: its tiles' states over every (b, h), (nq, nk) each: the rule ANDed with causal.
        self.rule = rules.structure(S, Sk) if rules.mask_mod is not None else None
        self.some: list[list[bool]] = []
        self.every: list[list[bool]] = []
        if self.rule is not None and torch.compiler.is_compiling():
            # the states cannot be read on the host inside a graph: every tile is evaluated
            self.some = [[True] * len(self.k_blocks) for _ in self.q_blocks]
            self.every = [[False] * len(self.k_blocks) for _ in self.q_blocks]
        elif self.rule is not None:
            states = mask_tile_states(self.rule, Bounds(S, Sk, block_q, block_k, q.device), B, H)
            self.some = (states.amax(dim=(0, 1)) != EMPTY).tolist()  # (nq, nk): some pair may attend
            self.every = (states.amin(dim=(0, 1)) == FULL).tolist()  # (nq, nk): every pair may
        self.mask5 = None
        if mask is not None:
            b, h, s, _ = mask.shape
            hk, g = (Hkv, self.G) if h == H else (1, 1)
            self.mask5 = mask.reshape(b, hk, g, s, Sk)  # (B|1, Hkv|1, G|1, S|1, Sk)
            if self.mask5.dtype == torch.bool:
                self.mask5 = ~self.mask5  # stored inverted: True = blocked, ready for masked_fill_

    def tiles(self):
        """Yield (tile index, (i0, i1), (j0, j1), rule tile) for tiles not fully blocked; the
        rule tile is None where the rules allow the whole tile, else bool, True = may attend."""
        n_k = len(self.k_blocks)
        for qi, (i0, i1) in enumerate(self.q_blocks):
            for kj, (j0, j1) in enumerate(self.k_blocks):
                causal: Tensor | bool | None = None
                if self.rule is not None:
                    if not self.some[qi][kj]:
                        continue
                    if not self.every[qi][kj]:
                        causal = self._rule_tile(i0, i1, j0, j1)
                elif self.is_causal:
                    causal = _causal_tile(i0, i1, j0, j1, self.offset, self.window, self.device, self.sink_tokens)
                    if causal is False:
                        continue
                yield qi * n_k + kj, (i0, i1), (j0, j1), causal

    def live_tiles(self) -> int:
        """How many tiles :meth:`tiles` yields, without building their masks."""
        if self.rule is not None:
            return sum(live for row in self.some for live in row)
        if not self.is_causal:
            return len(self.q_blocks) * len(self.k_blocks)
        rule = (self.offset, self.window, self.device, self.sink_tokens)
        return sum(1 for i0, i1 in self.q_blocks for j0, j1 in self.k_blocks
                   if _causal_tile(i0, i1, j0, j1, *rule) is not False)

    def _rule_tile(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        """The mask rule on one partial tile: bool (B|1, Hkv|1, G|1, bq, bk), True = may attend."""
        rule = cast(MaskMod, self.rule)  # set: only tiles() of a plan with a rule calls this
        allowed = evaluate_mask(rule, self.B, self.H, (i0, i1), (j0, j1), self.device)  # (B|1, H|1, bq|1, bk|1)
        b, h = allowed.shape[:2]
        allowed = allowed.expand(b, h, i1 - i0, j1 - j0)
        return allowed.reshape(b, self.Hkv, self.G, i1 - i0, j1 - j0) if h == self.H else allowed[:, :, None]

    def mask_tile(self, i0: int, i1: int, j0: int, j1: int) -> Tensor | None:
        m = self.mask5
        if m is None:
            return None
        rows = slice(i0, i1) if m.shape[3] != 1 else slice(None)
        return m[:, :, :, rows, j0:j1]  # (B|1, Hkv|1, G|1, bq|1, bk)


def _scores(plan: _Plan, qt: Tensor, kt: Tensor, i0: int, j0: int, mask_t: Tensor | None,
            causal: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Masked scores of one tile (B, Hkv, G, bq, bk) and, with soft-capping, the tile's
    ``tanh(s / softcap)`` (else None); ``qt`` is already scaled.

    Every step after the matmul works in place on the tile: the elementwise passes, not
    the matmuls, dominate a blockwise kernel written in PyTorch.
    """
    B, Hkv, G, bq, _ = qt.shape
    s = torch.matmul(qt.reshape(B, Hkv, G * bq, qt.shape[-1]), kt.transpose(-2, -1))
    s = s.reshape(B, Hkv, G, bq, kt.shape[-2])  # (B, Hkv, G*bq, D) x (B, Hkv, D, bk) -> (B, Hkv, G, bq, bk)
    t = None
    if plan.softcap is not None:
        t = s.div_(plan.softcap).tanh_()  # (B, Hkv, G, bq, bk), kept for backward's 1 - t^2
        s = t * plan.softcap
    if mask_t is not None:  # a bool mask is stored inverted (True = blocked)
        s = s.masked_fill_(mask_t, float("-inf")) if mask_t.dtype == torch.bool else s.add_(mask_t)
    if plan.slopes5 is not None:
        i = torch.arange(i0, i0 + bq, device=s.device)[:, None] + plan.offset  # (bq, 1)
        j = torch.arange(j0, j0 + s.shape[-1], device=s.device)[None, :]  # (1, bk)
        s = s.sub_(plan.slopes5 * (i - j).abs().to(s.dtype))  # ALiBi: (1, Hkv, G, 1, 1) x (bq, bk)
    if causal is not None:
        s = s.masked_fill_(~causal, float("-inf"))
    return s, t


def _forward(plan: _Plan, qg: Tensor, k: Tensor, v: Tensor, scale: float, dropout_p: float,
             seed: int) -> tuple[Tensor, Tensor, Tensor]:
    B, Hkv, G, S, D = qg.shape
    Dv = v.shape[-1]
    qs = qg * scale  # scale q once instead of every score tile
    out = qg.new_zeros(B, Hkv, G, S, Dv)  # (B, Hkv, G, S, Dv)
    lse = torch.zeros(B, Hkv, G, S, 1, dtype=qg.dtype, device=qg.device)
    live = torch.zeros(B, Hkv, G, S, 1, dtype=torch.bool, device=qg.device)  # rows that attend something
    running: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # query block -> (max, sum, weighted values)
    for tile, (i0, i1), (j0, j1), causal in plan.tiles():
        qt = qs[:, :, :, i0:i1]  # (B, Hkv, G, bq, D)
        kt, vt = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, Hkv, bk, D), (B, Hkv, bk, Dv)
        s, _ = _scores(plan, qt, kt, i0, j0, plan.mask_tile(i0, i1, j0, j1), causal)
        before = running.get(i0)
        m_tile = s.amax(dim=-1, keepdim=True)  # (B, Hkv, G, bq, 1)
        m_new = m_tile if before is None else torch.maximum(before[0], m_tile)
        # -inf max = nothing attended yet: shift by 0 so exp(-inf - 0) = 0, never NaN.
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = s.sub_(m_safe).exp_()  # (B, Hkv, G, bq, bk), in the scores' memory
        l_tile = p.sum(dim=-1, keepdim=True)
        if dropout_p > 0:
            p = p.masked_fill_(_tile_drop(seed, tile, p.shape, dropout_p, p.device), 0.0)
        pv = torch.matmul(p.reshape(B, Hkv, G * (i1 - i0), j1 - j0), vt).reshape(B, Hkv, G, i1 - i0, Dv)
        # (B, Hkv, G*bq, bk) x (B, Hkv, bk, Dv) -> (B, Hkv, G, bq, Dv)
        if dropout_p > 0:
            pv = pv.mul_(1 / (1 - dropout_p))  # dropout's rescaling, on the small (bq, Dv) result
        if before is None:
            running[i0] = (m_new, l_tile, pv)
        else:
            m_old, l_old, acc = before
            alpha = torch.exp(m_old - m_safe)  # rescale what was summed under the old max
            running[i0] = (m_new, alpha * l_old + l_tile, alpha * acc + pv)
    for i0, i1 in plan.q_blocks:
        if i0 not in running:
            continue  # every tile of these rows is causally blocked: zeros, lse 0 (a sink takes it all)
        m, l, acc = running.pop(i0)
        if plan.sinks5 is not None:
            # The sink joins the denominator: lse = logaddexp(m + log l, sink), and
            # acc / exp(lse - m) is the output (B, Hkv, G, bq, D).
            m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            total = torch.logaddexp(m_safe + torch.log(l), plan.sinks5)  # (B, Hkv, G, bq, 1)
            alive = total > float("-inf")  # False only where the keys and the sink are all -inf
            total = torch.where(alive, total, 0.0)
            out[:, :, :, i0:i1] = acc * torch.exp(m_safe - total)
            lse[:, :, :, i0:i1] = total
            live[:, :, :, i0:i1] = alive
            continue
        alive = l > 0
        out[:, :, :, i0:i1] = acc / torch.where(alive, l, torch.ones_like(l))
        lse[:, :, :, i0:i1] = torch.where(alive, m + torch.log(torch.where(alive, l, 1.0)), 0.0)
        live[:, :, :, i0:i1] = alive
    return out, lse, live


def _backward(plan: _Plan, qg: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
              dout: Tensor, scale: float, dropout_p: float, seed: int, mask_grad: bool, dlse: Tensor | None = None):
    B, Hkv, G, S, D = qg.shape
    Dv = v.shape[-1]
    qs = qg * scale  # the scaled queries forward used
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dmask5 = None  # the mask's gradient, when it has one
    if mask_grad and plan.mask5 is not None:
        dmask5 = torch.zeros(plan.mask5.shape, dtype=qg.dtype, device=qg.device)
    # With dropout (keep scale c = 1 / (1 - p)), ds = p * (c * dp_kept - delta)
    #   = c * p * (dp_kept - delta / c): the factor c moves onto the small matmul results.
    keep_scale = 1 / (1 - dropout_p)
    delta = (dout * out).sum(dim=-1, keepdim=True)  # (B, Hkv, G, S, Dv) -> (B, Hkv, G, S, 1)
    if dlse is not None:  # d lse / d s = p: the log-sum-exp's gradient joins delta, ds = p (dp - (delta - dlse))
        delta = delta - dlse
    delta = delta / keep_scale
    dsinks5 = None  # d sink = -sum over rows of delta * p(sink), p(sink) = exp(sink - lse)
    if plan.sinks5 is not None:
        p_sink = torch.exp(plan.sinks5 - lse)  # (B, Hkv, G, S, 1)
        dsinks5 = -(delta * keep_scale * p_sink).sum(dim=(0, 3, 4), keepdim=True)  # (1, Hkv, G, 1, 1)
    for tile, (i0, i1), (j0, j1), causal in plan.tiles():
        bq, bk = i1 - i0, j1 - j0
        qt, dot = qs[:, :, :, i0:i1], dout[:, :, :, i0:i1]  # (B, Hkv, G, bq, D), (B, Hkv, G, bq, Dv)
        kt, vt = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, Hkv, bk, D), (B, Hkv, bk, Dv)
        mask_t = plan.mask_tile(i0, i1, j0, j1)
        s, t = _scores(plan, qt, kt, i0, j0, mask_t, causal)
        p = s.sub_(lse[:, :, :, i0:i1]).exp_()  # (B, Hkv, G, bq, bk)
        dot3 = dot.reshape(B, Hkv, G * bq, Dv)
        dp = torch.matmul(dot3, vt.transpose(-2, -1)).reshape(B, Hkv, G, bq, bk)
        # (B, Hkv, G*bq, Dv) x (B, Hkv, Dv, bk) -> (B, Hkv, G, bq, bk)
        if dropout_p > 0:
            drop = _tile_drop(seed, tile, p.shape, dropout_p, p.device)
            p_used = p.masked_fill(drop, 0.0)
            dp = dp.masked_fill_(drop, 0.0)
        else:
            p_used = p
        dv_tile = torch.matmul(p_used.reshape(B, Hkv, G * bq, bk).transpose(-2, -1), dot3)
        # (B, Hkv, bk, G*bq) x (B, Hkv, G*bq, Dv) -> (B, Hkv, bk, Dv)
        dv[:, :, j0:j1] += dv_tile.mul_(keep_scale) if dropout_p > 0 else dv_tile
        ds = dp.sub_(delta[:, :, :, i0:i1]).mul_(p)  # ds / c, (B, Hkv, G, bq, bk)
        # Soft-capping: d(softcap * tanh(x / softcap)) / dx = 1 - t^2 carries ds back to q k^T * scale.
        ds_raw = ds if t is None else ds * (1 - t * t)  # (B, Hkv, G, bq, bk)
        ds3 = ds_raw.reshape(B, Hkv, G * bq, bk)
        dq[:, :, :, i0:i1] += torch.matmul(ds3, kt).reshape(B, Hkv, G, bq, D).mul_(scale * keep_scale)
        # (B, Hkv, G*bq, bk) x (B, Hkv, bk, D) -> (B, Hkv, G, bq, D)
        dk_tile = torch.matmul(ds3.transpose(-2, -1), qt.reshape(B, Hkv, G * bq, D))
        # (B, Hkv, bk, G*bq) x (B, Hkv, G*bq, D) -> (B, Hkv, bk, D)
        dk[:, :, j0:j1] += dk_tile.mul_(keep_scale) if dropout_p > 0 else dk_tile
        if dmask5 is not None:
            ds = ds * keep_scale if dropout_p > 0 else ds
            reduce_dims = [d for d in range(4) if dmask5.shape[d] == 1 and ds.shape[d] != 1]
            g = ds.sum(dim=reduce_dims, keepdim=True) if reduce_dims else ds
            rows = slice(i0, i1) if dmask5.shape[3] != 1 else slice(None)
            dmask5[:, :, :, rows, j0:j1] += g
    return dq, dk, dv, dmask5, dsinks5


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, rules, dropout_p, scale, seed, block_q, block_k, sinks):
        plan = _Plan(q, k, mask, replace(rules, sinks=sinks), block_q, block_k)
        qg = q.reshape(plan.B, plan.Hkv, plan.G, plan.S, plan.D)  # (B, H, S, D) -> (B, Hkv, G, S, D)
        out, lse, live = _forward(plan, qg, k, v, scale, dropout_p, seed)
        ctx.save_for_backward(q, k, v, out, lse, mask, sinks, live)
        ctx.args = (rules, dropout_p, scale, seed, block_q, block_k)
        row_lse = torch.where(live, lse, float("-inf")).reshape(plan.B, plan.H, plan.S)  # (B, H, S), -inf: empty rows
        return out.reshape(plan.B, plan.H, plan.S, v.shape[-1]), row_lse  # (B, Hkv, G, S, Dv) -> (B, H, S, Dv)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, mask, sinks, live = ctx.saved_tensors
        rules, dropout_p, scale, seed, block_q, block_k = ctx.args
        plan = _Plan(q, k, mask, replace(rules, sinks=sinks), block_q, block_k)
        qg = q.reshape(plan.B, plan.Hkv, plan.G, plan.S, plan.D)  # (B, Hkv, G, S, D)
        dout = dout.reshape(out.shape)  # (B, H, S, Dv) -> (B, Hkv, G, S, Dv)
        mask_grad = mask is not None and ctx.needs_input_grad[3]
        dlse5 = None if dlse is None else torch.where(live, dlse.reshape(lse.shape), 0.0)  # (B, Hkv, G, S, 1)
        dq, dk, dv, dmask5, dsinks5 = _backward(plan, qg, k, v, out, lse, dout, scale, dropout_p, seed,
                                                mask_grad, dlse5)
        dmask = dmask5.reshape(mask.shape) if dmask5 is not None else None
        dsinks = dsinks5.reshape(sinks.shape).to(sinks.dtype) if dsinks5 is not None else None  # (H,)
        return dq.reshape(q.shape), dk, dv, dmask, *([None] * 6), dsinks


def chunked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    rules: Rules,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    block_q: int | None = None,  # None: policy.CHUNKED_BLOCK_Q
    block_k: int | None = None,  # None: policy.CHUNKED_BLOCK_K
    return_lse: bool = False,  # True: the result's lse (B, H, S) too
) -> KernelResult:
    block_q, block_k = block_q or policy.CHUNKED_BLOCK_Q, block_k or policy.CHUNKED_BLOCK_K
    dtype = q.dtype
    sinks = rules.sinks
    if dtype in (torch.float16, torch.bfloat16):
        # Accumulate in fp32: the running sums lose too much in half precision.
        q, k, v = q.float(), k.float(), v.float()
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        if sinks is not None:
            sinks = sinks.float()
    if rules.score_mod is not None:  # any function of the scores: autograd through it, a row block at a time
        out, lse = rows_attention(q, k, v, attention_mask, replace(rules, sinks=sinks), dropout_p, scale, block_q,
                                  block_k)
    else:
        seed = int(torch.randint(0, 2**62, ()).item()) if dropout_p > 0 else 0
        out, lse = _ChunkedAttention.apply(q, k, v, attention_mask, replace(rules, sinks=None), dropout_p, scale, seed,
                                           block_q, block_k, sinks)
    row_lse = lse.to(lse_dtype(dtype)) if return_lse else None  # (B, H, S)
    return KernelResult(out.to(dtype), None, row_lse)  # (B, H, S, Dv)


def chunked_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`chunked_attention` for one call (the default blocks, as
    :func:`headwise.functional.attend` calls it): one fused stage with the real tiling."""
    B, H, Hkv, S, Sk, _ = call.sizes
    bq, bk = policy.CHUNKED_BLOCK_Q, policy.CHUNKED_BLOCK_K  # the tile, as chunked_attention takes it
    plan = _Plan(call.q, call.k, call.attention_mask, call.rules, bq, bk)
    computed = plan.live_tiles()
    total = len(plan.q_blocks) * len(plan.k_blocks)
    how = (f"tile by tile with a running max and sum: {computed} of {total} tiles of up to "
           f"{bq} queries x {bk} keys")
    if computed < total:
        how += " (tiles the rules block entirely are skipped)"
    if call.rules.describe():
        how += f"; {call.rules.describe()}"
    if call.sink_tokens:
        how += f"; the tiles of the {call.sink_tokens} sink keys are kept for every query"
    how += describe.shared_kv(call)
    if call.q.dtype in (torch.float16, torch.bfloat16):
        how += "; accumulated in float32"
    tile = (B, Hkv, H // Hkv, min(S, bq), min(Sk, bk))
    unmaterialised = f"scores {describe.scores_shape(call)} not materialised, one (B, Hkv, G, bq, bk) = {tile} tile"
    return [describe.fused(call, "chunked", how, unmaterialised + " at a time")]


KERNEL = Kernel(
    name="chunked",
    fn=chunked_attention,
    summary="blockwise online softmax in plain PyTorch; O(S) memory forward and backward",
    native_gqa=True,
    fused=True,
    stages=chunked_stages,
    forward_ad=False,  # an op or autograd.Function without a forward derivative
    functorch=False,  # an autograd.Function without setup_context, reads of values
)

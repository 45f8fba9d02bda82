"""The ``chunked`` kernel's path for a ``score_mod``: a block of query rows at a time, under autograd.

A ``score_mod`` is any function of the scores, and it may read tensors that need
gradients (a learned bias table), which a hand-written backward cannot see. So each block
of ``bq`` query rows runs the plain formula on its keys, from the first to the last tile
the mask rules leave non-empty, under ``torch.utils.checkpoint`` (non-reentrant) when
gradients are needed: forward keeps only the inputs, backward recomputes the block and lets
autograd carry the gradient through the user's function to whatever it read. Memory is one
block's (B, H, bq, L) scores at a time, bq from ``policy.SCORE_MOD_BLOCK_BYTES``: linear in S,
never the (S, Sk) matrix. Dropout
draws the same mask in the recomputation (checkpoint restores the RNG state).

Backward calls the score_mod again, so it must be a pure function of its arguments: one with
state, or drawing from a generator of its own, would answer otherwise the second time and
its gradient would be wrong. Forward keeps a checksum of each block's final scores, and the
recomputation compares its own: where they differ, backward raises a RuntimeError naming the
score_mod (one read of the comparison on the host per block: on an accelerator, a sync per
block of rows in backward). torch.compile traces the score_mod once, so it takes no checksum.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length,
Sk key length, D head dim, Dv value head dim, bq rows of a block, L its key columns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from headwise import policy
from headwise.evaluate import evaluate_mask, mask_tile_states
from headwise.kernels.common import blocks, lse_dtype, row_lse
from headwise.masks import masked_scores, safe_softmax
from headwise.rules import Rules
from headwise.tiles import EMPTY, Bounds


def rows_per_block(B: int, H: int, Sk: int, itemsize: int, most: int) -> int:
    """Query rows a block takes: one (B, H, rows, Sk) tensor within ``policy.SCORE_MOD_BLOCK_BYTES``
    (at least 1, at most ``most``)."""
    return max(1, min(most, policy.SCORE_MOD_BLOCK_BYTES // max(1, B * H * Sk * itemsize)))


def _key_spans(rules: Rules, B: int, H: int, S: int, Sk: int, bq: int, bk: int,
               device: torch.device) -> list[tuple[int, int] | None]:
    """Per block of rows, the key columns [c0, c1) from its first to its last non-empty tile
    (None: every tile empty); all keys where there is no mask rule."""
    rule = rules.structure(S, Sk)
    n_rows = len(blocks(S, bq))
    # a meta tensor has no tile states to read, nor has a graph under torch.compile: all keys, the same shapes
    if rule is None or device.type == "meta" or torch.compiler.is_compiling():
        return [(0, Sk)] * n_rows
    states = mask_tile_states(rule, Bounds(S, Sk, bq, bk, device), B, H)  # (B|1, H|1, nq, nk)
    some = (states.amax(dim=(0, 1)) != EMPTY)  # (nq, nk)
    spans: list[tuple[int, int] | None] = []
    for row in some.tolist():
        cols = [j for j, live in enumerate(row) if live]
        spans.append((cols[0] * bk, min(Sk, (cols[-1] + 1) * bk)) if cols else None)
    return spans


class _Replay:
    """One block's scores as forward saw them (a checksum), checked when backward recomputes them."""

    def __init__(self, rules: Rules, rows: tuple[int, int]):
        self.name = getattr(rules.score_mod, "__name__", None) or repr(rules.score_mod)
        self.rows = rows
        self.saved: Tensor | None = None

    def __call__(self, s: Tensor) -> None:
        """Take the checksum of the final scores s (B, H, bq, L) in forward; compare in backward."""
        with torch.no_grad():
            finite = torch.isfinite(s)
            x = torch.where(finite, s, 0.0)  # the masked (-inf) scores are counted, not summed
            by_key = torch.arange(1, s.shape[-1] + 1, device=s.device, dtype=s.dtype)  # (L,): a key moved shows
            sums = torch.stack([x.sum(), (x * by_key).sum(), x.abs().sum(), finite.sum().to(s.dtype)])
        if self.saved is None:
            self.saved = sums
            return
        tolerance = 1e-5 * (self.saved[2] * s.shape[-1] + 1)  # the same computation: equal but for rounding
        same = (sums[3] == self.saved[3]) & ((sums[:2] - self.saved[:2]).abs() <= tolerance).all()
        if not bool(same):
            raise RuntimeError(
                f"score_mod {self.name} gave other scores when chunked's backward recomputed them (query rows "
                f"{self.rows[0]}..{self.rows[1] - 1}), so the gradient would not be forward's. A score_mod must be "
                "a pure function of its arguments: no state, no random numbers but torch's default generator's "
                "(which is replayed); or use backend='matmul', which keeps forward's scores for backward")


def _block(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor | None, *, rules: Rules,
           rows: tuple[int, int], cols: tuple[int, int], S: int, Sk: int, scale: float,
           dropout_p: float, replay: _Replay | None = None) -> tuple[Tensor, Tensor]:
    """The textbook formula on one block: q (B, H, bq, D), k (B, H, L, D), v (B, H, L, Dv) -> the
    output (B, H, bq, Dv) and each row's log-sum-exp (B, H, bq); ``replay`` checks the final
    scores (None: no check)."""
    B, H = q.shape[:2]
    s = torch.matmul(q * scale, k.transpose(-2, -1))  # (B, H, bq, D) x (B, H, D, L) -> (B, H, bq, L)
    s = rules.scored(s, S, Sk, rows, cols)  # softcap, ALiBi, score_mod on the block
    structure = rules.structure(S, Sk)
    if structure is not None:
        s = masked_scores(s, evaluate_mask(structure, B, H, rows, cols, q.device))  # (B|1, H|1, bq, L)
    s = masked_scores(s, mask)  # the caller's mask's block (B|1, H|1, bq|1, L)
    if replay is not None:
        replay(s)
    if sinks is not None:
        column = sinks.to(s.dtype).reshape(1, H, 1, 1).expand(B, H, s.shape[2], 1)  # (B, H, bq, 1)
        s = torch.cat([s, column], dim=-1)  # (B, H, bq, L + 1): the sink is the last key
    p = safe_softmax(s)  # (B, H, bq, L | L + 1)
    lse = row_lse(s)  # (B, H, bq)
    p = p if sinks is None else p[..., :-1]  # (B, H, bq, L), the sink dropped
    if dropout_p > 0:
        p = F.dropout(p, p=dropout_p)
    return torch.matmul(p, v), lse  # (B, H, bq, L) x (B, H, L, Dv) -> (B, H, bq, Dv)


def rows_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rules: Rules, dropout_p: float,
                   scale: float, bq: int, bk: int) -> tuple[Tensor, Tensor]:
    """Attention with any rules, a block of ``bq`` query rows at a time: the output (B, H, S, Dv)
    and each row's log-sum-exp (B, H, S), ``-inf`` where nothing may be attended.

    Args:
        q: queries (B, H, S, D); k: keys (B, Hkv, Sk, D); v: values (B, Hkv, Sk, Dv).
        mask: the normalised mask (B|1, H|1, S|1, Sk) or None.
        rules: the call's rules (a score_mod among them).
        dropout_p, scale: as the kernel takes them.
        bq, bk: the rows of a block, and the tile width whose empty tiles are left out.
    """
    B, H, S, _ = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    bq = rows_per_block(B, H, Sk, q.element_size(), bq)
    if Hkv != H:  # the score_mod reads query heads: k, v per query head (a copy, O(S) memory)
        k = k.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, D) -> (B, H, Sk, D)
        v = v.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, Dv) -> (B, H, Sk, Dv)
    if S == 0:  # no rows: the textbook formula on none, so the empty result stays in q, k and v's graph
        return _block(q, k, v, mask, rules.sinks, rules=rules, rows=(0, 0), cols=(0, Sk), S=S, Sk=Sk, scale=scale,
                      dropout_p=dropout_p)
    outs, lses = [], []
    for (i0, i1), span in zip(blocks(S, bq), _key_spans(rules, B, H, S, Sk, bq, bk, q.device), strict=True):
        if span is None:  # nothing to attend: zeros, in q's graph
            outs.append(torch.where(torch.zeros((), dtype=torch.bool, device=q.device), q[:, :, i0:i1, :1], 0.0)
                        .expand(B, H, i1 - i0, Dv))
            lses.append(q.new_full((B, H, i1 - i0), float("-inf"), dtype=lse_dtype(q.dtype)))
            continue
        c0, c1 = span
        m = None
        if mask is not None:
            m = mask[:, :, slice(i0, i1) if mask.shape[2] != 1 else slice(None), c0:c1]  # (B|1, H|1, bq|1, L)
        args = (q[:, :, i0:i1], k[:, :, c0:c1], v[:, :, c0:c1], m, rules.sinks)
        kwargs: dict[str, Any] = dict(rules=rules, rows=(i0, i1), cols=(c0, c1), S=S, Sk=Sk, scale=scale,
                                      dropout_p=dropout_p)
        # A score_mod may read tensors that need gradients even when q, k, v do not: checkpoint whenever autograd is on.
        if torch.is_grad_enabled():
            if rules.score_mod is not None and not torch.compiler.is_compiling():
                kwargs["replay"] = _Replay(rules, (i0, i1))  # backward calls the score_mod again: is it the same?
            out, lse = checkpoint(_block, *args, use_reentrant=False, **kwargs)  # (B, H, bq, Dv), (B, H, bq)
        else:
            out, lse = _block(*args, **kwargs)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # (B, H, S, Dv), (B, H, S)

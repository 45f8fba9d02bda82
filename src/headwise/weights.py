"""Attention weights from any backend: recomputed from q, k and the kernel's log-sum-exp.

A fused kernel never holds the (B, H, S, Sk) probabilities, but it knows each row's
log-sum-exp: the log of its softmax denominator. With it, any probability is one score
away: ``p_ij = exp(s_ij - lse_i)``, where ``s_ij`` is the final score (scaled, soft-capped,
biased, score_mod applied, ``-inf`` where masked). So ``need_weights=True`` runs the
fastest kernel that returns the lse, then computes only the weights asked for: some heads
(``weights_heads``) and some query rows (``weights_rows``), in memory proportional to
them, (B, h, s, Sk) instead of (B, H, S, Sk).

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim; h and s the heads and rows asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from headwise.evaluate import evaluate_mask, evaluate_score_at, grid_at
from headwise.masks import masked_scores
from headwise.rules import Rules

__all__ = ["Selection", "select", "weights_from_lse"]


@dataclass(frozen=True)
class Selection:
    """The heads and query rows whose weights a call asks for (None: all of them).

    Truthy, so code that reads ``need_weights`` as a flag reads a selection as True.
    """

    heads: tuple[int, ...] | None = None
    rows: tuple[int, ...] | None = None

    def pick(self, t: Tensor, head_dim: int | None = 1, row_dim: int | None = 2) -> Tensor:
        """``t`` with only the selected heads and rows, where its dims are full (size 1 broadcasts;
        None: ``t`` has no such dim)."""
        for dim, chosen in ((head_dim, self.heads), (row_dim, self.rows)):
            if dim is not None and chosen is not None and t.shape[dim] != 1:
                t = t.index_select(dim, torch.tensor(chosen, device=t.device))
        return t


def _indices(name: str, chosen: Any, n: int, what: str) -> tuple[int, ...] | None:
    if chosen is None:
        return None
    if isinstance(chosen, slice):
        chosen = list(range(n))[chosen]
    if isinstance(chosen, Tensor):
        chosen = chosen.flatten().tolist() if not chosen.is_floating_point() else chosen
    if isinstance(chosen, int) and not isinstance(chosen, bool):
        chosen = [chosen]
    if not isinstance(chosen, Sequence) or not all(isinstance(i, int) and not isinstance(i, bool) for i in chosen):
        raise TypeError(f"{name} must be an int, a sequence of ints, a slice or an integer tensor of {what}, "
                        f"got {type(chosen).__name__}")
    bad = [i for i in chosen if not -n <= i < n]
    if bad or not chosen:
        raise ValueError(f"{name} {list(chosen)} must name at least one of the {n} {what} (0..{n - 1}, or negative "
                         f"from the end); out of range: {bad}")
    return tuple(i % n for i in chosen)


def select(need_weights: Any, heads: Any, rows: Any, H: int, S: int) -> Selection | None:
    """The :class:`Selection` a call asks for (None: no weights).

    Raises:
        ValueError / TypeError: heads or rows given without ``need_weights``, or out of range.
    """
    if isinstance(need_weights, Selection):
        return need_weights
    if not need_weights:
        if heads is not None or rows is not None:
            raise ValueError("weights_heads / weights_rows choose which attention weights to return; pass "
                             "need_weights=True too")
        return None
    return Selection(_indices("weights_heads", heads, H, "query heads"),
                     _indices("weights_rows", rows, S, "query rows"))


def weights_from_lse(q: Tensor, k: Tensor, mask: Tensor | None, rules: Rules, lse: Tensor, scale: float,
                     selection: Selection) -> Tensor:
    """The probabilities ``exp(s - lse)`` of the selected heads and rows, before dropout.

    Args:
        q: queries (B, H, S, D); k: keys (B, Hkv, Sk, D).
        mask: the normalised mask (B|1, H|1, S|1, Sk) or None.
        rules: the call's rules.
        lse: the kernel's log-sum-exp (B, H, S), sinks counted (so rows sum to 1 - p(sink)).
        scale: the multiplier of ``q k^T`` the kernel used.
        selection: which heads and rows.

    Returns:
        (B, h, s, Sk) in q's dtype; zero rows where nothing may be attended. Differentiable
        in q, k (and through lse).
    """
    B, H, S, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    heads = torch.arange(H, device=q.device) if selection.heads is None else torch.tensor(selection.heads,
                                                                                        device=q.device)
    rows = torch.arange(S, device=q.device) if selection.rows is None else torch.tensor(selection.rows,
                                                                                     device=q.device)
    qs = q.index_select(1, heads).index_select(2, rows)  # (B, h, s, D)
    ks = k.index_select(1, heads // (H // Hkv))  # (B, h, Sk, D): each selected head's kv head
    s = torch.matmul(qs * scale, ks.transpose(-2, -1))  # (B, h, s, D) x (B, h, D, Sk) -> (B, h, s, Sk)
    b, h, i, j = grid_at(B, heads, rows, Sk)
    for mod in rules.score_rules(S, Sk):  # softcap, ALiBi, score_mod at the selected positions
        s = evaluate_score_at(mod, s, b, h, i, j)
    row_lse = lse.index_select(1, heads).index_select(2, rows).unsqueeze(-1).to(s.dtype)  # (B, h, s, 1)
    dead = torch.isinf(row_lse)  # a row that attends nothing: zeros
    shift = torch.where(dead, float("inf"), row_lse)  # exp(s - inf) = 0 for every key of a dead row
    structure = rules.structure(S, Sk)
    allowed = None if structure is None else evaluate_mask(structure, B, H, (0, 0), (0, 0), q.device,
                                                           at=(b, h, i, j))  # (B|1, h|1, s|1, Sk|1)
    keep = None if mask is None else selection.pick(mask)  # (B|1, h|1, s|1, Sk)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, lse)):
        s = masked_scores(masked_scores(s, allowed), keep)
        return torch.exp(s - shift)  # (B, h, s, Sk), differentiable
    # Without gradients every step works in place: the weights are the one (B, h, s, Sk) tensor held.
    if rules.score_mod is not None:  # its result may be a broadcast view, or a tensor the caller holds
        s = s.clone(memory_format=torch.contiguous_format)
    if allowed is not None:
        s.masked_fill_(~allowed, float("-inf"))
    if keep is not None:
        s = s.masked_fill_(~keep, float("-inf")) if keep.dtype == torch.bool else s.add_(keep)
    return s.sub_(shift).exp_()  # (B, h, s, Sk)

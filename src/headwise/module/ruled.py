"""The module's calls with rules as functions: ``mask_mod`` / ``score_mod``.

A rule is the module's (given to the constructor) and the call's together: mask_mods
ANDed, score_mods one after the other. Such a call runs the dense path (the packed and
fused paths reorder or bypass the scores the rules read), never the memo (the functions
are the call's own). With a cache, the rules see the queries at their positions in the
sequence (``q_idx`` counts from the first cached token, :class:`headwise.rules.Shifted`),
so one rule serves prefill and decode; an evicting cache, whose keys are no longer at
their positions once it evicts (from the step that first evicts on), and context
parallelism refuse rules.

Legend: B batch, S query length, E embed dim.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from headwise.cache import KVCache
from headwise.module import cached, dense
from headwise.module import plan as planning
from headwise.module.layer_protocol import Layer
from headwise.module.plan import Plan
from headwise.rules import Shifted, ShiftedScore, combine_rules


def rules_of(mha: Layer, mask_mod: Any, score_mod: Any) -> tuple[Any, Any]:
    """The call's (mask_mod, score_mod): the module's and the call's combined (None: none)."""
    return (combine_rules(mha.mask_mod, mask_mod, score=False), combine_rules(mha.score_mod, score_mod, score=True))


def _check(mha: Layer, cache: KVCache | None, mask_mod: Any, score_mod: Any) -> None:
    for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a function or None, got {type(fn).__name__}")
    if mha.context_parallel is not None:
        raise ValueError("mask_mod / score_mod with context_parallel: each rank holds a shard of the sequence, and "
                         "the rules would see its local positions; give the rule as a dense mask or run in one process")
    if cache is not None and cache.evicted:
        raise ValueError(f"mask_mod / score_mod with an evicting cache that has dropped {cache.evicted} positions: its "
                         "keys are no longer at their positions; use a cache without evict=True")
    dropped = cache.held - sum(cache.kept()) if cache is not None and cache.evicts else 0
    if cache is not None and dropped:  # the step would evict before it attends: refused before anything changes
        raise ValueError(f"mask_mod / score_mod with an evicting cache whose step would drop {dropped} of its "
                         f"{cache.held} positions (window={cache.window}, sink_tokens={cache.sink_tokens}): its keys "
                         "would no longer be at their positions; use a cache without evict=True")


def plan(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
         is_causal: bool | None, need_weights: bool, cache: KVCache | None, mask_mod: Any, score_mod: Any) -> Plan:
    """The checked plan of a call with rules: the dense path (or the cached step)."""
    _check(mha, cache, mask_mod, score_mod)
    plan = planning.make_plan(mha, x, attention_mask, context, is_causal, need_weights, cache)
    if plan.path in ("fused", "packed"):
        plan = replace(plan, path="dense", why="mask_mod / score_mod: the dense path, where the rules read every "
                                               f"(query, key) position (was: {plan.path})")
    return plan


def at_positions(cache: KVCache | None, mask_mod: Any, score_mod: Any) -> tuple[Any, Any]:
    """The rules with a cached step's queries at their positions in the sequence."""
    offset = 0 if cache is None else int(cache.position) if cache.static else len(cache)
    if not offset:
        return mask_mod, score_mod
    return (None if mask_mod is None else Shifted(mask_mod, offset),
            None if score_mod is None else ShiftedScore(score_mod, offset))


def forward(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
            is_causal: bool | None, need_weights: bool, cache: KVCache | None, mask_mod: Any,
            score_mod: Any) -> Tensor | tuple[Tensor, Tensor]:
    """One call with rules: checked, planned on the dense path, and run."""
    planned = plan(mha, x, attention_mask, context, is_causal, need_weights, cache, mask_mod, score_mod)
    if cache is None:
        return dense.forward(mha, x, attention_mask, context, planned, need_weights, None,
                             rules=(mask_mod, score_mod))
    return cached.forward(mha, x, attention_mask, planned, need_weights, cache,
                          rules=at_positions(cache, mask_mod, score_mod))

"""The context-parallel path: x is this rank's shard (B, S_l, E) of the sequence, and
attention runs across the ranks (:mod:`headwise.distributed`); rotary positions are global.
A call's checks run on every rank before anything else, and one small all-gather tells every
rank whether any refused: a refusal raises on every rank, so none waits for the others.

Legend: B batch, H query heads, Hkv key/value heads, S_l this rank's positions, S the
whole sequence, D head dim, E embed dim.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from torch import Tensor

from headwise.dispatch import Dispatch
from headwise.module import projections as proj
from headwise.module.layer_protocol import Layer, Planned
from headwise.module.plan import Plan, query_padding
from headwise.positions import apply_rotary


def call(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
         is_causal: bool | None, need_weights: bool, cache: Any, mask_mod: Any, score_mod: Any,
         weights_heads: Any, weights_rows: Any) -> Tensor:
    """:meth:`MultiHeadAttention.forward` of a context-parallel module: every check first, on
    every rank together (one small all-gather), so a refusal on one rank raises on every rank
    instead of leaving the others waiting in the ranks' next exchange; then :func:`forward`."""
    from headwise.distributed.agreement import _checked_together

    def check() -> Planned:
        if cache is not None or need_weights or weights_heads is not None or weights_rows is not None:
            raise ValueError("context_parallel attends sharded whole sequences: it takes no cache= and no "
                             "need_weights=True; build the module without context_parallel for decoding")
        return mha.plan(x, attention_mask, context=context, is_causal=is_causal, mask_mod=mask_mod,
                        score_mod=score_mod)  # checks the call (rules refused); computes nothing

    plan = _checked_together(check, mha.context_parallel.group, mha.reference_weight().device)
    return forward(mha, x, attention_mask, context, plan.is_causal)


def forward(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
            causal: bool) -> Tensor:
    """x (B, S_l, E) is this rank's shard of the sequence (``context`` too) -> (B, S_l, E); checked by :func:`call`."""
    import headwise.distributed as hwd

    cp = mha.context_parallel
    padding = query_padding(x, attention_mask, context, None)  # (B, S_l) or None
    finite = False
    if padding is not None:  # what a padded position holds reaches no result and no gradient
        x, finite = proj.hide_padding(x, padding)
    if context is not None:  # NaN / inf at its padding would reach k_proj's and v_proj's gradients
        context = _hide_context_padding(attention_mask, context)
    q, k, v = proj.project_heads(mha, x, context)  # (B, H, S_l, D), (B, Hkv, Sk_l, D)
    q, k = proj.normalize(mha, q, k)
    if mha.rope is not None:  # rotate by global positions (dynamic NTK: by the global length)
        S, pos = hwd.global_positions(x.shape[1], cp.layout, cp.group, x.device)  # (S_l,); checks the split
        cos, sin = mha.rope.angles(0, S, q.dtype, x.device)  # (S, D)
        cos, sin = cos.index_select(0, pos), sin.index_select(0, pos)  # (S_l, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    out = hwd.attention(q, k, v, attention_mask, is_causal=causal, window=mha.window,
                        alibi_slopes=mha.alibi_slopes, dropout_p=mha.dropout if mha.training else 0.0,
                        method=cp.method, layout=cp.layout, group=cp.group)  # (B, H, S_l, D)
    out = mha.out_proj(out.transpose(1, 2).flatten(2))  # (B, H, S_l, D) -> (B, S_l, E)
    return out if padding is None else proj.zero_padding_(out, padding, finite)


def _hide_context_padding(mask: Tensor | None, context: Tensor) -> Tensor:
    """This rank's context shard (B, Sk_l, E) with its padded positions hidden where a 2-D mask is
    their padding (:func:`~headwise.module.projections.hide_padding`). A mask that does not fit is
    left to :func:`headwise.distributed.attention`, which refuses it on every rank: nothing here may
    raise on one rank alone."""
    if (not isinstance(mask, Tensor) or mask.dim() != 2 or mask.device != context.device
            or mask.shape[1] != context.shape[1] or mask.shape[0] not in (1, context.shape[0])):
        return context
    keys = proj.as_padding(mask).expand(context.shape[0], -1)  # (B|1, Sk_l) -> (B, Sk_l), True at a token
    return proj.hide_padding(context, keys)[0]


def dispatch(mha: Layer, attention_mask: Tensor | None, plan: Plan) -> Dispatch:
    """The method (ring or Ulysses) this call would take, and why."""
    import torch.distributed as dist

    from headwise.distributed import choose_method

    cp = mha.context_parallel
    if cp.method != "auto":
        method, why = cp.method, f"method={cp.method!r} was requested"
    else:
        world = dist.get_world_size(cp.group) if dist.is_available() and dist.is_initialized() else 1
        dense = isinstance(attention_mask, Tensor) and attention_mask.dim() > 2
        choice = choose_method(mha.num_heads, mha.num_kv_heads, world, dense_mask=dense)
        method, why = choice.method, choice.reason
    return Dispatch(method, why, MappingProxyType({}), None, path="context parallel", path_reason=plan.why)

"""The context-parallel path: x is this rank's shard (B, S_l, E) of the sequence, and
attention runs across the ranks (:mod:`headwise.distributed`); rotary positions are global.

Legend: B batch, H query heads, Hkv key/value heads, S_l this rank's positions, S the
whole sequence, D head dim, E embed dim.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from torch import Tensor

from headwise.cache import KVCache
from headwise.dispatch import Dispatch
from headwise.module import projections as proj
from headwise.module.plan import Plan, query_padding
from headwise.positions import apply_rotary

if TYPE_CHECKING:
    from headwise.module.layer import MultiHeadAttention


def forward(mha: MultiHeadAttention, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
            causal: bool, need_weights: bool, cache: KVCache | None) -> Tensor:
    """x (B, S_l, E) is this rank's shard of the sequence (``context`` too) -> (B, S_l, E)."""
    import headwise.distributed as hwd

    if cache is not None or need_weights:
        raise ValueError("context_parallel attends sharded whole sequences: it takes no cache= and no "
                         "need_weights=True; build the module without context_parallel for decoding")
    cp = mha.context_parallel
    padding = query_padding(x, attention_mask, context, None)  # (B, S_l) or None
    finite = False
    if padding is not None:  # what a padded position holds reaches no result and no gradient
        x, finite = proj.hide_padding(x, padding)
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


def dispatch(mha: MultiHeadAttention, attention_mask: Tensor | None, plan: Plan) -> Dispatch:
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

""":meth:`~headwise.MultiHeadAttention.dispatch`: which path and kernel a call would run, and
why, decided from the plan and the shapes alone (no projection or attention runs).

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, Dv value head dim, E embed dim.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import cast

import torch
from torch import Tensor

from headwise import packing
from headwise.cache import KVCache
from headwise.dispatch import Dispatch
from headwise.functional import choose_backend
from headwise.module import cached, checks, context_parallel
from headwise.module.layer_protocol import Layer
from headwise.module.plan import Plan, all_tokens, real_tokens


def dispatch(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
             plan: Plan, need_weights: bool, cache: KVCache | None, rules: tuple = (None, None)) -> Dispatch:
    """The kernel inside the planned path (on the packed path: the kernel of the bucket with
    the most tokens; the reason lists every bucket's); ``rules``: the call's (mask_mod,
    score_mod), queries at their positions."""
    if plan.path == "context parallel":
        return context_parallel.dispatch(mha, attention_mask, plan)
    if plan.path == "packed":
        return _packed(mha, x, plan)
    if plan.path == "fused":
        return Dispatch("native_mha", "torch._native_multi_head_attention: the qkv GEMM, SDPA and the output "
                        "projection in one op", MappingProxyType({}), None, path="fused", path_reason=plan.why)
    B, S = x.shape[:2]
    Sk = S if context is None else context.shape[1]
    causal, window, slopes, sink_tokens = plan.is_causal, mha.window, mha.alibi_slopes, mha.sink_tokens
    kept = 0 if cache is None else sum(cache.kept())  # the held positions the step keeps
    evicted = cache is not None and cache.evicts and (cache.evicted > 0 or kept < cache.held)
    if cache is not None and cache.static:  # every slot, through the mask forward builds
        rules, alibi = cached.static_rules(mha, cache, rules)
        attention_mask = cached.static_mask(mha, cache, attention_mask, S, causal, cache.k.dtype, alibi)
        Sk = cache.max_seq_len
        causal, window, slopes, sink_tokens = False, None, None, 0
    elif cache is not None and evicted:  # the kept positions, through the mask forward builds
        attention_mask = cached.evicting_mask(mha, cache, attention_mask, S, causal, cache.k.dtype)
        Sk = kept + S
        causal, window, slopes, sink_tokens = False, None, None, 0
    elif cache is not None:  # what forward would attend to, without appending
        attention_mask = cache.mask_for(attention_mask, S)
        Sk = len(cache) + S
    elif all_tokens(plan.lengths, S):  # every position is a token: forward attends without the mask
        attention_mask = None
    dtype = None if cache is None else cache.k.dtype  # a cache step attends in the cache's dtype (autocast too)
    q, k = _shaped(mha, x, B, mha.num_heads, S, dtype=dtype), _shaped(mha, x, B, mha.num_kv_heads, Sk, dtype=dtype)
    v = _shaped(mha, x, B, mha.num_kv_heads, Sk, mha.v_head_dim, dtype=dtype)
    d = choose_backend(q, k, v, attention_mask, is_causal=causal, dropout_p=mha.dropout if mha.training else 0.0,
                       need_weights=need_weights, backend=checks.backend(mha), window=window, alibi_slopes=slopes,
                       softcap=mha.softcap, sinks=mha.sinks, sink_tokens=sink_tokens, mask_mod=rules[0],
                       score_mod=rules[1])
    return Dispatch(d.backend, d.reason, d.passed_over, d.request, path="dense", path_reason=plan.why)


def _shaped(mha: Layer, x: Tensor, B: int, heads: int, length: int, dim: int | None = None,
            dtype: torch.dtype | None = None) -> Tensor:
    """A (B, heads, length, D) stand-in (``dim``: that last size, None: D) for a projection's
    output: the dtype (``dtype``, None: the projection's), device and grad flag it would have,
    no storage (one element, expanded)."""
    if dtype is None:
        dtype = mha.reference_weight().dtype
        if checks.autocast_on(x.device):
            dtype = torch.get_autocast_dtype(x.device.type)
    grad = torch.is_grad_enabled() and (x.requires_grad or mha.trains())
    return torch.zeros((), dtype=dtype, device=x.device, requires_grad=grad).expand(
        B, heads, length, mha.head_dim if dim is None else dim)


def _packed(mha: Layer, x: Tensor, plan: Plan) -> Dispatch:
    padding = cast(Tensor, plan.padding)  # the packed path always has x's padding
    lengths = real_tokens(padding)
    B, S = padding.shape
    T = sum(lengths)
    per_bucket = []  # (tokens, n, L, Dispatch) of each length bucket
    for n, L, _, keys in packing.bucket_shapes(lengths, lengths):
        q, k = _shaped(mha, x, n, mha.num_heads, L), _shaped(mha, x, n, mha.num_kv_heads, L)
        v = _shaped(mha, x, n, mha.num_kv_heads, L, mha.v_head_dim)
        mask = None  # the bucket's (n, L) key mask, as many real keys: all "auto" reads of it
        if keys < n * L:
            mask = torch.ones(n * L, dtype=torch.bool, device=x.device)
            mask[keys:] = False
            mask = mask.reshape(n, L)
        d = choose_backend(q, k, v, mask, is_causal=plan.is_causal, dropout_p=mha.dropout if mha.training else 0.0,
                           backend=checks.backend(mha), window=mha.window, alibi_slopes=mha.alibi_slopes,
                           softcap=mha.softcap, sinks=mha.sinks)
        per_bucket.append((n * L, n, L, d))
    if not per_bucket:  # no real token at all
        return Dispatch("none", "no real token: nothing to attend", MappingProxyType({}), None,
                        path="packed", path_reason=plan.why)
    main = max(per_bucket, key=lambda b: b[0])[3]
    buckets = ", ".join(f"{n} x {L} -> {d.backend!r}" for _, n, L, d in per_bucket)
    reason = (f"attention per length bucket (sequences x length): {buckets}; "
              f"projections and the output projection run on the {T} real tokens of {B} x {S}")
    passed = MappingProxyType({"dense path": f"pays for {B * S - T} padded positions"})
    return Dispatch(main.backend, reason, passed, main.request, path="packed", path_reason=plan.why)

"""The paged path: one decoding step of many sequences through a :class:`~headwise.PagedKVCache`.

x (B, T, E) holds the next T positions of B sequences of any lengths; each sequence's
keys and values are appended to its pages and its queries attend its own keys through
:func:`headwise.paged_attention` (bottom-right causal; shared prefixes attended once).
Rotary positions continue from each sequence's own length. A refused step (a kernel's
refusal, an interrupt) leaves the cache's sequences as they were.

Legend: B sequences, H query heads, Hkv key/value heads, T new positions, D head dim,
Dv value head dim, E embed dim.
"""

from __future__ import annotations

from collections import defaultdict
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import Tensor

from headwise import tracing as trace
from headwise.dispatch import Dispatch
from headwise.module import checks
from headwise.module import projections as proj
from headwise.module.layer_protocol import Layer
from headwise.module.plan import Plan
from headwise.paged import choose_backends, paged_attention
from headwise.paged_cache import PagedBatch, PagedKVCache

PAGED = (PagedKVCache, PagedBatch)  # what forward's cache= routes here


def forward(mha: Layer, x: Tensor, attention_mask: Any, context: Any, is_causal: bool | None,
            need_weights: bool, cache: PagedKVCache | PagedBatch, mask_mod: Any = None,
            score_mod: Any = None) -> Tensor:
    """One step for the batch's sequences (a :class:`PagedKVCache`: all its sequences, in
    the order they were added), undone if it is refused after the cache changed."""
    batch = cache if isinstance(cache, PagedBatch) else cache.batch(cache.sequences)
    _check(mha, x, batch, attention_mask, context, need_weights, mask_mod, score_mod)
    causal = mha.is_causal if is_causal is None else bool(is_causal)
    saved = batch.cache.savepoint(batch.seqs)
    try:
        return _step(mha, x, batch, causal)
    except BaseException:
        batch.cache.rollback(saved)
        raise


def plan(mha: Layer, x: Tensor, attention_mask: Any, context: Any, is_causal: bool | None,
         need_weights: bool, cache: PagedKVCache | PagedBatch, mask_mod: Any = None, score_mod: Any = None) -> Plan:
    """The paged path's :class:`Plan` after :func:`forward`'s checks (nothing changes)."""
    batch = cache if isinstance(cache, PagedBatch) else cache.batch(cache.sequences)
    _check(mha, x, batch, attention_mask, context, need_weights, mask_mod, score_mod)
    why = (f"a paged cache: each of the {len(batch.seqs)} sequences appends its {x.shape[1]} new keys to its pages "
           "and attends its own keys through paged_attention")
    return Plan("paged", why, mha.is_causal if is_causal is None else bool(is_causal), None, None)


def dispatch(mha: Layer, x: Tensor, attention_mask: Any, context: Any, is_causal: bool | None,
             need_weights: bool, cache: PagedKVCache | PagedBatch, mask_mod: Any = None,
             score_mod: Any = None) -> Dispatch:
    """The kernels of a paged step (the backend of its call with the most scores), from the
    shapes and the cache's bookkeeping alone: nothing is appended or attended."""
    step = plan(mha, x, attention_mask, context, is_causal, need_weights, cache, mask_mod, score_mod)
    batch = cache if isinstance(cache, PagedBatch) else cache.batch(cache.sequences)
    pool, T = batch.cache, x.shape[1]
    pages = pool.check_room(batch.seqs, T)  # forward's refusal of a full pool
    q = torch.zeros((), dtype=pool.k_pages.dtype, device=x.device).expand(len(batch.seqs), mha.num_heads, T,
                                                                           mha.head_dim)  # (B, H, T, D) stand-in
    calls = choose_backends(q, pool.k_pages, pool.v_pages, [pool.pages(s) for s in batch.seqs],
                            [pool.length(s) + T for s in batch.seqs], is_causal=step.is_causal, backend=mha.backend,
                            window=mha.window, alibi_slopes=checks.slopes(mha), softcap=mha.softcap,
                            sinks=checks.sinks(mha), sink_tokens=mha.sink_tokens)
    if not calls:
        return Dispatch("none", "no query: nothing to attend", MappingProxyType({}), None, path="paged",
                        path_reason=step.why)
    listed = "; ".join(f"{what}, {rows} x {keys} -> {d.backend!r}" for what, rows, keys, d in calls[:8])
    more = f"; and {len(calls) - 8} more" if len(calls) > 8 else ""
    main = max(calls, key=lambda c: c[1] * c[2])[3]
    reason = (f"{main.reason} (the call with the most scores); paged_attention's calls (query rows x keys): "
              f"{listed}{more}; the step takes {pages} of the pool's {pool.free_pages} free pages")
    return Dispatch(main.backend, reason, main.passed_over, main.request, path="paged", path_reason=step.why)


def _step(mha: Layer, x: Tensor, batch: PagedBatch, causal: bool) -> Tensor:
    if trace.ACTIVE:
        trace.begin_call()
        trace.record("input", x, "x: (B, T, E), the next T positions of B paged sequences")
    cache, seqs = batch.cache, batch.seqs
    q, k, v = proj.project_heads(mha, x, None)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, Dv)
    q, k, v = proj.in_cache_dtype(q, k, v, cache.k_pages.dtype)  # (autocast's dtype -> the pages')
    q, k = proj.normalize(mha, q, k)
    q, k = _rotate(mha, q, k, [cache.length(s) for s in seqs])
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    cache.append(seqs, k.detach(), v.detach())  # the pool is no part of autograd's graph: written in place
    out = paged_attention(q, cache.k_pages, cache.v_pages, cache.block_table(seqs), cache.seq_lens(seqs),
                                  is_causal=causal, backend=mha.backend, window=mha.window,
                                  alibi_slopes=checks.slopes(mha), softcap=mha.softcap, sinks=checks.sinks(mha),
                                  sink_tokens=mha.sink_tokens)  # (B, H, T, Dv)
    if grads:  # forward serves; backward could not reach the keys and values the pool took: said at backward
        out = _NoBackward.apply(out)
    return proj.output(mha, cast(Tensor, out), None)  # (B, H, T, Dv) -> (B, T, E)


class _NoBackward(torch.autograd.Function):
    """The identity forward; a backward that says why a paged step has no gradients."""

    @staticmethod
    def forward(ctx: Any, out: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise RuntimeError("backward through a PagedKVCache step: the step wrote its keys and values into the "
                           "pool in place, outside autograd's graph, so their gradients cannot be taken; decode "
                           "under torch.no_grad() (or torch.inference_mode()), or train without a cache (a plain "
                           "forward over the whole sequence, or a dense cache: mha.new_cache, whose steps are "
                           "differentiable)")


def _rotate(mha: Layer, q: Tensor, k: Tensor, starts: list[int]) -> tuple[Tensor, Tensor]:
    """Rotary positions from each sequence's own length, one call per distinct length."""
    if mha.rope is None:
        return q, k
    if len(set(starts)) == 1:
        return proj.rotate(mha, q, k, starts[0])
    rows: dict[int, list[int]] = defaultdict(list)
    for b, start in enumerate(starts):
        rows[start].append(b)
    q, k = q.clone(), k.clone()  # (B, H, T, D), (B, Hkv, T, D): rows rotated group by group
    for start, members in rows.items():
        index = torch.tensor(members, device=q.device)
        q_b, k_b = proj.rotate(mha, q.index_select(0, index), k.index_select(0, index), start)
        q.index_copy_(0, index, q_b)
        k.index_copy_(0, index, k_b)
    return q, k


def _check(mha: Layer, x: Any, batch: PagedBatch, attention_mask: Any, context: Any,
           need_weights: bool, mask_mod: Any, score_mod: Any) -> None:
    """What a paged step cannot take, refused before anything changes."""
    refused = [(context is not None, "context= (cross-attention): a paged cache holds self-attention keys"),
               (attention_mask is not None, "attention_mask: each sequence's length is its own in the cache, so "
                "there is no padding to mask; step sequences of other lengths of T in calls of their own"),
               (need_weights, "need_weights: no (B, H, T, Sk) weights exist across sequences of other lengths"),
               (mask_mod is not None or score_mod is not None or mha.mask_mod is not None or mha.score_mod is not None,
                "mask_mod / score_mod: use a dense cache (mha.new_cache) for rules as functions"),
               (mha.context_parallel is not None, "context_parallel: a paged cache lives in one process"),
               (mha.training and mha.dropout > 0, f"dropout={mha.dropout} in training mode: decode in eval mode "
                "(mha.eval())")]
    for refuse, why in refused:
        if refuse:
            raise ValueError(f"a paged cache step does not take {why}")
    checks.check_inputs(mha, x, None, None)
    pool, w = batch.cache.k_pages, mha.reference_weight()
    _, Hkv, _, D = pool.shape
    Dv = batch.cache.v_pages.shape[-1]
    want = (mha.num_kv_heads, mha.head_dim, mha.v_head_dim, w.dtype, w.device)
    if (Hkv, D, Dv, pool.dtype, pool.device) != want:
        raise ValueError(f"the paged cache holds kv_heads={Hkv}, head_dim={D}, value_dim={Dv}, {pool.dtype} on "
                         f"{pool.device}; this module needs kv_heads={want[0]}, head_dim={want[1]}, value_dim="
                         f"{want[2]}, {want[3]} on {want[4]}: make it with PagedKVCache.for_module(mha, ...)")
    if x.shape[0] != len(batch.seqs):
        raise ValueError(f"x has {x.shape[0]} rows but the paged batch names {len(batch.seqs)} sequences "
                         f"{list(batch.seqs)}; give one row of x per sequence (cache.batch(seqs))")
    if torch._C._functorch.maybe_current_level() is not None:
        raise ValueError("a paged cache step writes the pool's pages, which live outside torch.func's transforms "
                         "(vmap, grad, jvp, ...); call the module without cache= inside the transform, or decode "
                         "outside it")

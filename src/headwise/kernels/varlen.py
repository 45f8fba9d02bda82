"""Key-padding-free attention for dense (B, H, S, D) inputs.

Each batch row only needs its real keys: those that some query of some head may attend
(with a key padding mask, the unpadded ones). A row with many (``policy.DIRECT_MIN_LENGTH``)
attends on its own, reading a view of its first keys when the padding is on the right
(the usual layout) or gathering them otherwise; shorter rows are stacked into buckets of
similar key counts, each run with only as many key columns as its longest row has real
keys. Causality, windows and ALiBi are rebuilt from the keys' original positions, and the
rest of a mask (3-D, 4-D, float) is gathered at the kept keys' columns, so the result is
the dense result for every mask of the contract. Attention sinks join each bucket's SDPA
call as one appended zero key (see :mod:`headwise.kernels.sdpa`); a row with no real key
gives zeros with or without them. Logit soft-capping is refused, as SDPA cannot apply it.
Queries are all kept (the functional
contract gives padded queries an output too); the module's packed path
(:mod:`headwise.packing`) also drops padded queries.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, n rows in a bucket, L a bucket's key count.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import Tensor

from headwise import policy
from headwise import tracing as trace
from headwise.kernels import chunked, describe, sdpa
from headwise.kernels.buckets import attend_buckets
from headwise.kernels.common import attached_zeros, fold_rules, length_buckets
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage, Request
from headwise.kernels.sdpa import sdpa_attention, sdpa_masked, sdpa_stages, with_sink
from headwise.mask_contract import hide_excluded
from headwise.masks import AlignedCausal
from headwise.rules import Rules, document_lengths, document_rule


def _real_keys(m: Tensor, B: int, Sk: int) -> tuple[Tensor, Tensor, list[int]]:
    """The keys each batch row needs: those some query of some head may attend.

    Args:
        m: the normalised mask (B|1, H|1, S|1, Sk).
        B: batch size.
        Sk: key length.

    Returns:
        ``(keys, sizes, lengths)``: keys (B, Sk) bool, True = kept; sizes (B,) kept keys
        per row; lengths the same as a list.
    """
    attend = m if m.dtype == torch.bool else ~torch.isneginf(m)
    keys = attend.any(dim=2).any(dim=1).expand(B, Sk)  # (B, Sk) True = some query may attend the key
    sizes = keys.sum(1)  # (B,)
    return keys, sizes, sizes.tolist()


def _groups(lengths: list[int]) -> list[list[int]]:
    """Rows attended together, one SDPA call each: a long row (``policy.DIRECT_MIN_LENGTH`` real keys)
    alone, the short rows of one length bucket together; rows with no real key in none."""
    buckets = length_buckets(lengths)
    direct = policy.DIRECT_MIN_LENGTH
    groups = [[r] for rows in buckets for r in rows if lengths[r] >= direct]  # long rows: alone
    groups += [[r for r in rows if lengths[r] < direct] for rows in buckets]
    return [rows for rows in groups if rows]


def call_shapes(lengths: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """The SDPA calls :func:`varlen_attention` makes for rows of these real-key counts,
    without making them: ``(n, L)`` per call, n rows with L key columns. "auto" prices them.

    >>> call_shapes([300, 40, 38, 0])
    [(1, 300), (2, 40)]
    """
    lengths = list(lengths)
    return [(len(rows), max(lengths[r] for r in rows)) for rows in _groups(lengths)]


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    rules: Rules,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    return_lse: bool = False,  # True: the result's lse (B, H, S) too
) -> KernelResult:
    if not rules.additive:
        raise ValueError(f"the varlen kernel cannot apply softcap={rules.softcap} or a general score_mod "
                         f"({rules.describe() or 'none'}); use backend 'chunked' or 'matmul'")
    documents = document_lengths(rules, q.shape[0], q.shape[-2], k.shape[-2])
    if documents is not None and attention_mask is None:
        out, lse = _by_document(q, k, v, rules, documents, dropout_p, scale, return_lse)  # (B, H, S, Dv), (B, H, S)
        return KernelResult(out, None, lse)  # lse None unless return_lse
    if return_lse:  # the buckets' log-sum-exps are not gathered back: one SDPA call on the dense mask gives them
        return sdpa_attention(q, k, v, attention_mask=attention_mask, rules=rules, dropout_p=dropout_p, scale=scale,
                              need_weights=False, return_lse=True)
    if rules.mask_mod is not None or rules.score_mod is not None:  # the user's rules, as the mask's columns
        B, H, S, _ = q.shape
        attention_mask = fold_rules(attention_mask, replace(rules, is_causal=False, window=None, alibi_slopes=None),
                                    B, H, S, k.shape[2], q.device, q.dtype)  # (B|1, H|1, S, Sk)
        rules = replace(rules, mask_mod=None, score_mod=None)
    if attention_mask is None:  # no padding to drop: the dense kernel is the same computation
        return sdpa_attention(q, k, v, attention_mask=None, rules=rules, dropout_p=dropout_p, scale=scale,
                              need_weights=False)
    return KernelResult(_without_padding(q, k, v, attention_mask, rules, dropout_p, scale))  # (B, H, S, Dv)


def _without_padding(q: Tensor, k: Tensor, v: Tensor, m: Tensor, rules: Rules, dropout_p: float,
                     scale: float) -> Tensor:
    """Each batch row's real keys only, per row or length bucket (the module docstring); ``m`` the
    normalised mask (B|1, H|1, S|1, Sk), ``rules`` without mask_mod / score_mod: (B, H, S, Dv)."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    keys, sizes, lengths = _real_keys(m, B, Sk)  # (B, Sk), (B,), list
    # What the kept keys' columns still need beyond dropping the others: nothing for a key
    # padding mask; the mask itself for 3-D / 4-D masks and additive biases.
    rest = None if m.dtype == torch.bool and m.shape[1:3] == (1, 1) else m.expand(B, -1, -1, -1)  # (B, H|1, S|1, Sk)
    groups = _groups(lengths)
    if not groups:  # no row has a key: the contract's zero rows, in the graph of q, k and v
        return attached_zeros(q, k, v, *([] if rules.sinks is None else [rules.sinks]), size=v.shape[-1])
    span = torch.arange(Sk, device=q.device)  # (Sk,)
    # Right padding (real keys first, the usual layout) needs no gather: a row reads k[b, :, :L, :].
    prefix = bool((keys == (span[None, :] < sizes[:, None])).all())
    order = None if prefix else torch.argsort((~keys).to(torch.int8), dim=1, stable=True)  # (B, Sk) real keys first
    i = torch.arange(S, device=q.device)[:, None] + (Sk - S)  # (S, 1) aligned query positions
    # Per-row views: unbind's backward is one stack, where indexing rows out of the batch
    # would cost a (B, H, S, D) zero fill per index.
    q_rows, k_rows, v_rows = q.unbind(0), k.unbind(0), v.unbind(0)  # B x (H|Hkv, S|Sk, D)
    out_rows: dict[int, Tensor] = {}  # batch row -> (H, S, Dv); none for a row with no real key
    for rows in groups:
        L = max(lengths[r] for r in rows)
        idx = torch.tensor(rows, device=q.device)  # (n,)
        if order is None:  # prefix
            pos = span[None, :L]  # (1, L): the kept keys are the first L
            kb, vb = (torch.stack([t[r][:, :L] for r in rows]) if len(rows) > 1 else t[rows[0]][None, :, :L]
                      for t in (k_rows, v_rows))  # (n, Hkv, L, D); one row: a view
        else:
            pos = order.index_select(0, idx)[:, :L]  # (n, L) original positions of the kept keys
            kb, vb = (torch.stack([t[r].index_select(1, pos[j]) for j, r in enumerate(rows)])
                      for t in (k_rows, v_rows))  # (n, Hkv, L, D)
        qb = torch.stack([q_rows[r] for r in rows]) if len(rows) > 1 else q_rows[rows[0]][None]  # (n, H, S, D)
        allowed = None  # the bucket's shorter rows: their columns past their real keys
        if any(lengths[r] < L for r in rows):
            allowed = (span[None, :L] < sizes.index_select(0, idx)[:, None])[:, None, None, :]  # (n, 1, 1, L)
        cols = None  # the rest of the caller's mask at the kept keys' columns
        if rest is not None:
            cols = rest.index_select(0, idx)  # (n, H|1, S|1, Sk)
            cols = cols[..., :L] if prefix else cols.gather(-1, pos[:, None, None, :].expand(*cols.shape[:3], L))
        mask = _bucket_mask(rules, i, pos[:, None, None, :], allowed, cols, q.dtype)  # (n|1, H|1, S, L) or None
        if rules.sinks is not None:
            kb, vb, mask = with_sink(qb, kb, vb, mask, rules.sinks)  # one more key: (n, .., L + 1, ..)
        ob = sdpa_masked(qb, kb, vb, mask, dropout_p=dropout_p, scale=scale)  # (n, H, S, Dv)
        for r, o in zip(rows, ob.unbind(0), strict=True):
            out_rows[r] = o
    if len(out_rows) < B:  # rows with no real key output zeros (zero gradients reach q through unbind)
        zeros = q.new_zeros(H, S, v.shape[-1])
        out_rows.update({r: zeros for r in range(B) if r not in out_rows})
    return torch.stack([out_rows[r] for r in range(B)])  # (B, H, S, Dv)


def _bucket_mask(rules: Rules, i: Tensor, j: Tensor, allowed: Tensor | None, cols: Tensor | None,
                 dtype: torch.dtype) -> Tensor | None:
    """One bucket's mask for SDPA: the causal / window rule and ALiBi at the kept keys' original
    positions ``j`` (n|1, 1, 1, L) for the aligned queries ``i`` (S, 1), ANDed with ``allowed``
    (n, 1, 1, L) and the caller's mask columns ``cols`` (n, H|1, S|1, L), bool or additive."""
    bias = None
    if rules.is_causal or rules.window is not None:
        near = AlignedCausal(0, rules.window, rules.sink_tokens)(None, None, i, j)  # i aligned: (n|1, 1, S, L)
        allowed = near if allowed is None else allowed & near
    if cols is not None:
        if cols.dtype == torch.bool:
            allowed = cols if allowed is None else allowed & cols
        else:
            bias = cols
    if rules.alibi_slopes is not None:
        distance = -rules.alibi_slopes.to(dtype)[None, :, None, None] * (i - j).abs().to(dtype)  # (n|1, H, S, L)
        bias = distance if bias is None else bias + distance
    if bias is None:
        return allowed
    return bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))


def _refuses(r: Request) -> str | None:
    if r.softcap:
        return ("cannot soft-cap the scores (softcap): its buckets run F.scaled_dot_product_attention, which "
                "applies no function between q k^T and the softmax")  # a refusal ends with the able backends
    if r.score_mod == "general":
        return ("cannot run a general score_mod: its buckets run F.scaled_dot_product_attention, which takes only "
                "an additive mask")
    return None


def _by_document(q: Tensor, k: Tensor, v: Tensor, rules: Rules, documents: tuple[tuple[int, ...], ...],
                 dropout_p: float, scale: float, return_lse: bool = False) -> tuple[Tensor, Tensor | None]:
    """Attention under a document rule: each row's documents as packed sequences (their own
    positions, the causal rule and window inside each), in the length buckets of
    :func:`headwise.kernels.buckets.attend_buckets`, each bucket one call of :func:`_document_bucket`."""
    causal, window = document_rule(rules)
    # SDPA per document; its log-sum-exp comes from the CPU flash kernel, which has no dropout
    backend = "chunked" if return_lse and dropout_p > 0 else "sdpa"
    rows, lses = [], []
    for b, lengths in enumerate(documents):
        qb, kb, vb = (t[b].transpose(0, 1) for t in (q, k, v))  # (S, H, D), (Sk, Hkv, D), (Sk, Hkv, Dv)
        result = attend_buckets(qb, kb, vb, lengths, lengths, _document_bucket, is_causal=causal, window=window,
                                alibi_slopes=rules.alibi_slopes, dropout_p=dropout_p, scale=scale, backend=backend,
                                sinks=rules.sinks, return_lse=return_lse)  # (S, H, Dv) [, (S, H)]
        out, lse = result if isinstance(result, tuple) else (result, None)
        rows.append(out.transpose(0, 1))  # (H, S, Dv)
        if lse is not None:
            lses.append(lse.transpose(0, 1))  # (H, S)
    return torch.stack(rows), torch.stack(lses) if lses else None  # (B, H, S, Dv), (B, H, S)


def _document_bucket(q: Tensor, k: Tensor, v: Tensor, keys: Tensor | None = None, *, is_causal: bool,
                     window: int | None, alibi_slopes: Tensor | None, dropout_p: float, scale: float, backend: str,
                     softcap: float | None, sinks: Tensor | None, sink_tokens: int,
                     return_lse: bool) -> Tensor | tuple[Tensor, Tensor]:
    """One bucket of documents, q (n, H, Lq, D), k / v (n, Hkv, Lk, D|Dv), ``keys`` (n, Lk) bool
    where the bucket pads keys: what :func:`headwise.attention` with the named ``backend``
    ("sdpa" or "chunked") runs for it, without the checks the varlen call has made: the NaN
    contract's hiding, then the kernel. (n, H, Lq, Dv), with ``return_lse`` and (n, H, Lq)."""
    n, _, S, _ = q.shape
    mask = None if keys is None else keys.view(n, 1, 1, keys.shape[1])  # (n, Lk) -> (n, 1, 1, Lk)
    # as headwise.attention's rules: a window implies the causal rule; a single query it blocks nothing
    rules = Rules(is_causal=window is not None or (is_causal and S > 1), window=window, sink_tokens=sink_tokens,
                  alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)
    q, k, v = hide_excluded(q, k, v, mask, is_causal=rules.is_causal, window=window, sink_tokens=sink_tokens)
    kernel = chunked.KERNEL if backend == "chunked" else sdpa.KERNEL
    result = kernel.fn(q, k, v, attention_mask=mask, rules=rules, dropout_p=dropout_p, scale=scale,
                       need_weights=False, return_lse=return_lse)  # KernelResult: out (n, H, Lq, Dv), lse (n, H, Lq)
    out = result.out
    if trace.ACTIVE and trace.recording() and kernel.stages is not None:  # explain mode: the bucket's stages
        call = Call(q, k, v, attention_mask=mask, rules=rules, dropout_p=dropout_p, scale=scale, need_weights=False,
                    scale_given=True)
        for stage in kernel.stages(call):
            trace.record(stage.name, stage.shape, stage.note, fused=stage.fused, dtype=stage.dtype)
    return (out, cast(Tensor, result.lse)) if return_lse else out


def varlen_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`varlen_attention` for one call: one fused stage with the
    real groups and kept keys (without a mask the call is SDPA's, described as such)."""
    if call.attention_mask is None:
        return sdpa_stages(call)
    B, H, _, S, Sk, D = call.sizes
    _, _, lengths = _real_keys(call.attention_mask, B, Sk)
    groups = _groups(lengths)
    if not groups:
        return [KernelStage("varlen", (B, H, S, call.value_dim), call.q.dtype, "no real key in any row: zeros",
                            fused=True)]
    how = (f"per group of rows with similar real-key counts: {len(groups)} F.scaled_dot_product_attention "
           f"call{'s' if len(groups) > 1 else ''} on {sum(lengths)} of {B * Sk} keys, the widest {max(lengths)} "
           f"keys{describe.shared_kv(call)}")
    if call.sinks is not None:
        how += "; the sink logits as one appended zero key per call"
    return [describe.fused(call, "varlen", how, f"the dense scores {describe.scores_shape(call)} never exist")]


KERNEL = Kernel(
    name="varlen",
    fn=varlen_attention,
    summary="drops padded keys per batch row and runs SDPA per length bucket; cost follows real keys",
    native_gqa=True,
    fused=True,
    refuses=_refuses,
    stages=varlen_stages,
    forward_ad=False,  # an op or autograd.Function without a forward derivative
    functorch=False,  # an autograd.Function without setup_context, reads of values
)

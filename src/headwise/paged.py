"""Paged attention: each sequence's keys and values live in fixed-size pages of one pool.

A sequence's first ``seq_lens[b]`` keys are the pages ``block_table[b, 0], block_table[b, 1],
...`` read in order, ``page_size`` keys a page, the last page possibly partial. Slots past
``seq_lens[b]`` and pages no sequence reads are never read, so they may hold anything, NaN
included. Two paths, chosen by :func:`native_refusal` (which says why):

- the native CPU kernel (:mod:`headwise.paged_native`), for fp32 / bf16 CPU tensors without
  gradients, window, ALiBi, soft-capping or sinks, at most :data:`NATIVE_MAX_QUERIES` new
  queries per sequence and ``backend="auto"``: every sequence at once, each key read through
  the block table, wherever its page lies;
- otherwise each sequence on its own through :func:`headwise.attention`'s kernels, its keys a
  view of the pool where its pages are one run of consecutive ids (and the pool is laid out
  (Hkv, num_pages, page_size, D) in memory, as :class:`headwise.PagedKVCache` keeps it), else
  one ``index_select`` of exactly its pages.

Shared prefixes (cascade attention): sequences whose block tables begin with the same pages
(forks of one prompt) attend those pages once, all their queries stacked as one query block
(the prefix precedes every query, so no causal rule applies there), and their own suffixes
separately; :func:`headwise.merge_attentions` merges the two by log-sum-exp, exactly.

Legend: B batch, H query heads, Hkv key/value heads, T new tokens (queries) per sequence,
N pages in the pool, P page size, L a sequence's keys, D head dim of q and k, Dv of v.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import cast

import torch
from torch import Tensor

from headwise import invariance, native, paged_native
from headwise import tracing as trace
from headwise.dispatch import Dispatch
from headwise.functional import _prepare, attend
from headwise.pieces import merge_attentions

__all__ = ["paged_attention", "SHARED_PREFIX_MIN_KEYS", "NATIVE_MAX_QUERIES"]

# share_prefix="auto" attends a shared prefix once where that saves reading at least this
# many keys per kv head, (sequences - 1) x prefix keys: below it, the extra prefix call and
# the merge cost more than the reads they save (benchmarks/paged.py measures both ways).
SHARED_PREFIX_MIN_KEYS = 1024
# The native kernel serves steps of at most this many new queries per sequence (decoding,
# speculative verification, short chunks). A longer prefill chunk runs the per-sequence
# kernels, whose matrix products catch up with the native kernel's dot products as T grows:
# benchmarks/paged.py's "prefill chunk" rows (B=4, 1,024 keys, shuffled pages, fp32, 2 threads,
# a quiet 2-core AMD EPYC, torch 2.13), native / per-sequence time: 0.36x at T = 8, 0.70x at
# T = 32, 1.00x at T = 128.
NATIVE_MAX_QUERIES = 64


@dataclass(frozen=True)
class _Options:
    """The keywords every per-sequence call takes, as :func:`headwise.attention` names them."""

    is_causal: bool
    scale: float | None
    backend: str
    window: int | None
    alibi_slopes: Tensor | None
    softcap: float | None
    sinks: Tensor | None
    sink_tokens: int


def paged_attention(
    q: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    block_table: Tensor,
    seq_lens: Tensor | Sequence[int],
    *,
    is_causal: bool = True,
    scale: float | None = None,  # None: 1 / sqrt(D)
    backend: str = "auto",
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
    softcap: float | None = None,  # None: no logit soft-capping
    sinks: Tensor | None = None,  # None: no attention sinks
    sink_tokens: int = 0,  # 0: none; n: the first n keys stay visible under the window
    share_prefix: bool | str = "auto",  # "auto": where it saves SHARED_PREFIX_MIN_KEYS reads; True: always; False
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of T new queries per sequence over each sequence's keys, read through its pages.

    The result equals ``headwise.attention(q[b:b+1], k_b, v_b, ...)`` for each b, where
    ``k_b`` (1, Hkv, seq_lens[b], D) is the sequence's first ``seq_lens[b]`` keys gathered
    through ``block_table[b]``: the T queries are its last T positions (bottom-right causal,
    which covers decoding, chunked prefill and speculative verification with T > 1).

    Args:
        q: queries (B, H, T, D) of the T new tokens of each sequence (B = 0 or T = 0: the
            empty result, after the same checks).
        k_pages: (N, Hkv, P, D) the key pool; ``H % Hkv == 0`` (grouped-query attention).
        v_pages: (N, Hkv, P, Dv) the value pool; Dv may differ from D.
        block_table: (B, max_pages) integer page ids; only the first
            ``ceil(seq_lens[b] / P)`` of row b are read (the rest may be anything, e.g. -1).
        seq_lens: (B,) integer tensor or ints: each sequence's keys, its T new ones included.
        is_causal, scale, backend, window, alibi_slopes, softcap, sinks, sink_tokens: as
            :func:`headwise.attention` takes them, positions counted from each sequence's start.
        share_prefix: attend the pages that several sequences' block tables begin with once
            for all of them (``"auto"``: where it saves at least :data:`SHARED_PREFIX_MIN_KEYS`
            key reads; True: wherever one full page before every query is shared; False:
            never). Without ``window`` and ``alibi_slopes`` only (those depend on each query's
            distance to the prefix keys); the result is the same either way.
        return_lse: also return the (B, H, T) log-sum-exp, as :func:`headwise.attention` does.

    Returns:
        (B, H, T, Dv), and with ``return_lse`` the (B, H, T) lse after it.

    Raises:
        TypeError: non-tensor or non-integer tables and lengths, dtypes that differ, a
            ``share_prefix`` that is neither a bool nor ``"auto"``.
        ValueError: shapes that do not fit, a length outside ``T..max_pages * P``, a page id
            outside the pool, and what :func:`headwise.attention` refuses.

    >>> import torch, headwise
    >>> k_pages, v_pages = torch.randn(8, 2, 4, 16), torch.randn(8, 2, 4, 16)  # 8 pages of 4 keys
    >>> table = torch.tensor([[0, 1, 2], [5, 3, -1]])
    >>> out = headwise.paged_attention(torch.randn(2, 4, 1, 16), k_pages, v_pages, table, torch.tensor([10, 6]))
    >>> out.shape
    torch.Size([2, 4, 1, 16])
    """
    lens, table = _check(q, k_pages, v_pages, block_table, seq_lens, share_prefix)
    options = _Options(bool(is_causal), scale, backend, window, alibi_slopes, softcap, sinks, sink_tokens)
    if trace.ACTIVE:
        trace.begin_call()
    B, T, P = q.shape[0], q.shape[2], k_pages.shape[2]
    if B == 0 or T == 0:  # no query: the empty result, after headwise.attention's checks
        return _empty(q, k_pages, v_pages, options, return_lse)
    shareable = window is None and alibi_slopes is None and share_prefix is not False
    groups = _prefix_groups(table, lens, T, P, 1 if share_prefix is True else SHARED_PREFIX_MIN_KEYS) \
        if shareable else []
    out, lse = _attend_all(q, k_pages, v_pages, table, lens, groups, options, return_lse)  # (B, H, T, Dv), (B, H, T)
    if trace.ACTIVE:
        trace.record("paged attention", out, f"{B} sequences of {T} queries over their pages ({P} keys a page); "
                     + (f"{len(groups)} shared prefixes attended once" if groups else "no shared prefix"))
    return out if not return_lse else (out, cast(Tensor, lse))


def native_refusal(q: Tensor, k_pages: Tensor, v_pages: Tensor, options: _Options, *, build: bool = True) -> str | None:
    """Why the native kernel (:mod:`headwise.paged_native`) does not serve this call, in words
    (None: it serves); the PyTorch path then runs, and makes headwise.attention's checks.
    ``build``: build the extension if not tried yet (False: report it as to be built)."""
    o = options
    unsupported = [name for name, on in (("window", o.window is not None), ("alibi_slopes", o.alibi_slopes is not None),
                                         ("softcap", o.softcap is not None), ("sinks", o.sinks is not None),
                                         ("sink_tokens", bool(o.sink_tokens))) if on]
    tensors = (q, k_pages, v_pages)
    invariant = invariance.is_batch_invariant()  # the mode: the native kernel for every T, or a refusal
    if o.backend != "auto" and not (invariant and o.backend == "invariant"):
        return f"backend={o.backend!r} was asked for by name: the per-sequence path runs it"
    if unsupported:
        return f"{', '.join(unsupported)}: the native kernel applies none of them; the per-sequence kernels do"
    if q.shape[2] > NATIVE_MAX_QUERIES and not invariant:
        return (f"T={q.shape[2]} new queries per sequence, above NATIVE_MAX_QUERIES={NATIVE_MAX_QUERIES}: a prefill "
                "chunk, where the per-sequence kernels' matrix products are faster")
    if any(type(t) is not Tensor for t in tensors) or any(t.device.type != "cpu" for t in tensors):
        return f"tensors on {q.device} (or a tensor subclass): the native kernel runs on plain CPU tensors"
    if not q.dtype == k_pages.dtype == v_pages.dtype or q.dtype not in (torch.float32, torch.bfloat16):
        return f"dtypes {q.dtype}, {k_pages.dtype}, {v_pages.dtype}: the native kernel takes fp32 or bf16, all alike"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "gradients are needed: the native kernel has no backward"
    if torch._C._functorch.maybe_current_level() is not None:
        return "inside a torch.func transform: the native kernel is opaque to it"
    if q.shape[-1] != k_pages.shape[-1] or k_pages.shape[1] == 0 or q.shape[1] % k_pages.shape[1] \
            or not _valid_scale(o.scale):
        return "shapes or a scale that headwise.attention refuses: the per-sequence path says why"
    why = (None if native.load() is not None else native.unavailable()) if build else native.unavailable()
    return None if why is None else f"the native extension is not available: {why}"


def _valid_scale(scale: object) -> bool:
    return scale is None or (isinstance(scale, numbers.Real) and not isinstance(scale, bool)
                             and math.isfinite(float(scale)))


def _scale(options: _Options, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if options.scale is None else float(options.scale)


def _attend_all(q: Tensor, k_pages: Tensor, v_pages: Tensor, table: Tensor, lens: list[int],
                groups: list[tuple[list[int], int]], options: _Options,
                return_lse: bool) -> tuple[Tensor, Tensor | None]:
    """The native kernel where :func:`native_refusal` finds nothing against it, else each
    sequence apart: ``(out (B, H, T, Dv), lse (B, H, T) or None)``."""
    P = k_pages.shape[2]
    pools = (k_pages.transpose(0, 1), v_pages.transpose(0, 1))  # (Hkv, N, P, D), (Hkv, N, P, Dv)
    refused = native_refusal(q, k_pages, v_pages, options)
    if refused is not None and invariance.is_batch_invariant():
        raise ValueError(f"inside headwise.batch_invariant() paged attention runs only through the native kernel "
                         f"(fixed key blocks whatever the pages' order), which cannot serve this call: {refused}; "
                         "attend outside the mode (with headwise.batch_invariant(False): ...)")
    if refused is not None:
        return _attend_sequences(q, pools, _rows(table, lens, P), lens, groups, options, return_lse)
    if invariance.is_batch_invariant():  # a shared prefix folded in: the bits of private sequences
        return paged_native.attend(q, k_pages, v_pages, table, lens, _scale(options, q), options.is_causal, groups)

    def prefix(members: list[int], keys: int) -> tuple[Tensor, Tensor]:
        pages = table[members[0], :-(-keys // P)].tolist()
        return _stacked_prefix(q, pools, pages, members, keys, options)

    return paged_native.attend(q, k_pages, v_pages, table, lens, _scale(options, q), options.is_causal, groups,
                               prefix)


def _attend_sequences(q: Tensor, pools: tuple[Tensor, Tensor], tables: list[list[int]], lens: list[int],
                      groups: list[tuple[list[int], int]], options: _Options,
                      return_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Every sequence's attention: each group of a shared prefix at once (:func:`_attend_shared`),
    every other sequence over its own pages. ``(out (B, H, T, Dv), lse (B, H, T))``, the lse
    None unless ``return_lse``."""
    B = q.shape[0]
    outs: list[Tensor | None] = [None] * B
    lses: list[Tensor | None] = [None] * B
    for members, shared in groups:
        out, lse = _attend_shared(q, pools, tables, lens, members, shared, options)
        for n, b in enumerate(members):
            outs[b], lses[b] = out[n:n + 1], lse[n:n + 1]
    for b in range(B):
        if outs[b] is None:
            keys = _keys(pools, tables[b], 0, lens[b])
            outs[b], lses[b] = _attend(q[b:b + 1], keys, options, sinks=True, lse=return_lse)  # (1, H, T, Dv)
    out = torch.cat(cast(list[Tensor], outs))  # (B, H, T, Dv)
    return out, torch.cat(cast(list[Tensor], lses)) if return_lse else None  # (B, H, T)


def _empty(q: Tensor, k_pages: Tensor, v_pages: Tensor, options: _Options,
           return_lse: bool) -> Tensor | tuple[Tensor, Tensor]:
    """B = 0 or T = 0: (B, H, T, Dv) and the (B, H, T) lse, in the graph of the inputs. The
    call over no keys makes every check a full call makes (dtypes, heads, the options)."""
    B, _, T, _ = q.shape
    keys = [pool[:0, :, :0].reshape(B, pool.shape[1], 0, pool.shape[-1]) for pool in (k_pages, v_pages)]
    out, lse = _attend(q, (keys[0], keys[1]), options, sinks=True)  # (B, H, T, Dv), (B, H, T)
    return (out, cast(Tensor, lse)) if return_lse else out


def _attend(q: Tensor, keys: tuple[Tensor, Tensor], options: _Options, *, sinks: bool, lse: bool = True,
            is_causal: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """``attend`` over one set of keys: ``(out (.., H, S, Dv), lse (.., H, S))``, the lse None
    unless asked (a kernel's lse path may cost more); ``sinks``: count the sink logits here."""
    k, v = keys
    result = attend(q, k, v, is_causal=options.is_causal if is_causal is None else is_causal,
                    scale=options.scale, backend=options.backend, window=options.window,
                    alibi_slopes=options.alibi_slopes, softcap=options.softcap,
                    sinks=options.sinks if sinks else None, sink_tokens=options.sink_tokens, return_lse=lse)
    if not lse:
        return cast(Tensor, result), None
    out, row_lse = cast(tuple[Tensor, Tensor], result)
    return out, row_lse


def _attend_lse(q: Tensor, keys: tuple[Tensor, Tensor], options: _Options,
                is_causal: bool | None = None) -> tuple[Tensor, Tensor]:
    """:func:`_attend` with the lse and without the sinks (the shared path merges them in once)."""
    out, lse = _attend(q, keys, options, sinks=False, is_causal=is_causal)
    return out, cast(Tensor, lse)


def _attend_shared(q: Tensor, pools: tuple[Tensor, Tensor], tables: list[list[int]], lens: list[int],
                   members: list[int], shared: int, options: _Options) -> tuple[Tensor, Tensor]:
    """The members' attention: their shared prefix of ``shared`` pages once, each suffix on
    its own, merged by lse: ``(out (n, H, T, Dv), lse (n, H, T))`` in the order of ``members``.

    The prefix call folds the query heads of a kv head and all the members' queries into
    one block of rows per kv head, (1, Hkv, G*n*T, D): one pass over the prefix keys, as a
    matrix product. The sink logits, per query head, are then a part of their own in the
    merge (a part with no output and lse ``sinks[h]``)."""
    _, H, T, D = q.shape
    Hkv, _, P, _ = pools[0].shape
    n, G = len(members), H // Hkv
    out_p, lse_p = _stacked_prefix(q, pools, tables[members[0]][:shared], members, shared * P, options)
    suffixes = [_attend_lse(q[b:b + 1], _keys(pools, tables[b], shared, lens[b]), options)
                for b in members]  # each (1, H, T, Dv), (1, H, T): bottom-right causal over its own keys
    outs, lses = [out_p, torch.cat([o for o, _ in suffixes])], [lse_p, torch.cat([s for _, s in suffixes])]
    if options.sinks is not None:  # (H,) logits: probability mass that adds nothing to the output
        outs.append(torch.zeros_like(out_p))
        lses.append(options.sinks.to(lse_p.dtype).reshape(1, H, 1).expand(n, H, T))
    if trace.ACTIVE:
        trace.record("shared prefix", out_p, f"{n} sequences attend their {shared * P} shared prefix keys once "
                     f"({G * n * T} rows a kv head), their suffixes apart; merged by log-sum-exp")
    return merge_attentions(outs, lses)


def _stacked_prefix(q: Tensor, pools: tuple[Tensor, Tensor], pages: list[int], members: list[int], keys: int,
                    options: _Options) -> tuple[Tensor, Tensor]:
    """The members' attention over the first ``keys`` keys of their shared ``pages``, their
    query heads of a kv head and all their queries folded into one block of rows per kv head,
    (1, Hkv, G*n*T, D): one pass over the prefix keys, as a matrix product. ``(out (n, H, T,
    Dv), lse (n, H, T))``, without the sinks."""
    _, H, T, D = q.shape
    Hkv = pools[0].shape[0]
    n, G = len(members), H // Hkv
    index = torch.tensor(members, device=q.device)
    rows = q.index_select(0, index).reshape(n, Hkv, G, T, D)  # (n, H, T, D) -> (n, Hkv, G, T, D)
    rows = rows.permute(1, 2, 0, 3, 4).reshape(1, Hkv, G * n * T, D)  # -> (Hkv, G, n, T, D) -> (1, Hkv, G*n*T, D)
    # Every prefix key precedes every query of every member: nothing causal to mask there.
    out_p, lse_p = _attend_lse(rows, _keys(pools, pages, 0, keys), options, is_causal=False)  # (1, Hkv, G*n*T, ..)
    out_p = out_p.reshape(Hkv, G, n, T, -1).permute(2, 0, 1, 3, 4).reshape(n, H, T, -1)  # -> (n, H, T, Dv)
    lse_p = lse_p.reshape(Hkv, G, n, T).permute(2, 0, 1, 3).reshape(n, H, T)  # -> (n, H, T)
    return out_p, lse_p


def _keys(pools: tuple[Tensor, Tensor], pages: list[int], first: int, end: int) -> tuple[Tensor, Tensor]:
    """Keys ``first * P .. end - 1`` of a sequence whose pages are ``pages``: (1, Hkv, L, D)
    and (1, Hkv, L, Dv). A view of the pools where those pages are consecutive ids (and the
    pool's pages of one head are adjacent in memory); else one ``index_select`` of them."""
    k_pool, v_pool = pools  # (Hkv, N, P, D), (Hkv, N, P, Dv)
    P = k_pool.shape[2]
    used = pages[first:-(-end // P)]  # the pages holding keys first * P .. end - 1
    start, count = used[0], len(used)
    one_run = used[-1] - start == count - 1 and used == list(range(start, start + count))
    index = None if one_run else torch.tensor(used, device=k_pool.device)
    L = end - first * P
    keys = []
    for pool in (k_pool, v_pool):
        Hkv, _, _, D = pool.shape
        s_h, s_n, s_p, s_d = pool.stride()
        if index is None and s_n == P * s_p:  # one run, its slots evenly spaced: the keys in one view
            keys.append(pool.as_strided((1, Hkv, L, D), (0, s_h, s_p, s_d), pool.storage_offset() + start * s_n))
            continue
        pages_of = pool[:, start:start + count] if index is None else pool.index_select(1, index)  # (Hkv, n, P, D)
        flat = pages_of.reshape(Hkv, count * P, D)  # (Hkv, n, P, D) -> (Hkv, n*P, D)
        keys.append(flat[:, :L].unsqueeze(0))  # (1, Hkv, L, D): slots past the length never read
    return keys[0], keys[1]


def choose_backends(q: Tensor, k_pages: Tensor, v_pages: Tensor, tables: list[list[int]], lens: list[int], *,
                    is_causal: bool = True, scale: float | None = None, backend: str = "auto",
                    window: int | None = None, alibi_slopes: Tensor | None = None, softcap: float | None = None,
                    sinks: Tensor | None = None, sink_tokens: int = 0, share_prefix: bool | str = "auto",
                    return_lse: bool = False) -> list[tuple[str, int, int, Dispatch]]:
    """The kernel each call of :func:`paged_attention` would run on these shapes, and why
    (runs nothing): ``(the call, query rows, keys, Dispatch)`` per call, as it makes them.

    ``q`` (B, H, T, D) may be a stand-in without storage; ``tables``: each sequence's pages,
    of which only those before its first query are read (the shared prefixes). The other
    arguments as :func:`paged_attention` takes them."""
    options = _Options(bool(is_causal), scale, backend, window, alibi_slopes, softcap, sinks, sink_tokens)
    B, H, T, D = q.shape
    Hkv, P = k_pages.shape[1], k_pages.shape[2]
    shareable = window is None and alibi_slopes is None and share_prefix is not False
    groups = shared_prefixes(tables, lens, T, P, 1 if share_prefix is True else SHARED_PREFIX_MIN_KEYS) \
        if shareable and T else []
    why_not = native_refusal(q, k_pages, v_pages, options, build=False) if B and T else "no query"

    def call(what: str, heads: int, rows: int, keys: int, causal: bool, lse: bool, with_sinks: bool):
        q_b = torch.zeros((), dtype=q.dtype, device=q.device, requires_grad=q.requires_grad).expand(1, heads, rows, D)
        k_b, v_b = (pool.new_zeros(()).expand(1, Hkv, keys, pool.shape[-1]) for pool in (k_pages, v_pages))
        d = _prepare(q_b, k_b, v_b, None, causal, 0.0, False, options.backend, options.window, options.alibi_slopes,
                     options.softcap, options.sinks if with_sinks else None, options.sink_tokens, options.scale,
                     return_lse=lse)[2]
        if why_not is not None:
            d = replace(d, passed_over={**d.passed_over, paged_native.KERNEL: why_not})
        return what, rows, keys, d

    if why_not is None and invariance.is_batch_invariant():  # the prefix folded into the kernel: no matrix product
        return _native_calls(q, lens, groups, P, None)
    if why_not is None:
        return _native_calls(q, lens, groups, P, lambda members, keys: call(
            f"the shared prefix of sequences {members}", Hkv, H // Hkv * len(members) * T, keys, False, True, False))
    calls, grouped = [], set()
    for members, shared in groups:
        G, n = H // Hkv, len(members)
        calls.append(call(f"the shared prefix of sequences {members}", Hkv, G * n * T, shared * P, False, True, False))
        calls += [call(f"sequence {b} past it", H, T, lens[b] - shared * P, options.is_causal, True, False)
                  for b in members]
        grouped.update(members)
    calls += [call(f"sequence {b}", H, T, lens[b], options.is_causal, return_lse, True)
              for b in range(B) if b not in grouped and T]
    return calls


def _native_calls(q: Tensor, lens: list[int], groups: list[tuple[list[int], int]], P: int,
                  prefix_call: Callable[[list[int], int], tuple[str, int, int, Dispatch]] | None,
                  ) -> list[tuple[str, int, int, Dispatch]]:
    """The calls of :func:`paged_native.attend`, in its order: for each shared prefix of at
    least KEY_BLOCK keys, the members' stacked rows over it (``prefix_call``, a matrix product;
    None: the kernel's one pass folded into each member's call, the batch-invariant mode's way)
    and the kernel for the members past it; then the kernel for the other sequences."""
    B, H, T, _ = q.shape
    built = "" if native.load_state() == "built" else " (built on first use, about a minute)"
    reason = (f"the native CPU kernel{built}: each (sequence, kv head) reads its keys through the block table, in "
              f"blocks of {paged_native.KEY_BLOCK} keys at fixed offsets, with no gathered copy")
    passed = MappingProxyType({"per-sequence kernels": "the PyTorch path gathers each sequence's pages (an "
                                                       "index_select where they are not one run) and calls a kernel "
                                                       "per sequence"})
    d = Dispatch(paged_native.KERNEL, reason, passed)
    calls, grouped = [], set()
    for members, shared in groups:
        S0 = paged_native.prefix_keys(shared, P)
        if S0:
            calls.append(prefix_call(members, S0) if prefix_call is not None else (
                f"the shared prefix of sequences {members}, one pass folded into each member's state",
                H * len(members) * T, S0, d))
            calls.append((f"sequences {members} past their {S0} shared keys", H * len(members) * T,
                          max(lens[b] for b in members) - S0, d))
            grouped.update(members)
    rest = [b for b in range(B) if b not in grouped]
    if rest:
        calls.append(("every sequence over its own pages" if len(rest) == B else f"sequences {rest}",
                      H * T * len(rest), max(lens[b] for b in rest), d))
    return calls


def shared_prefixes(tables: list[list[int]], lens: list[int], T: int, P: int,
                    min_keys: int = SHARED_PREFIX_MIN_KEYS) -> list[tuple[list[int], int]]:
    """The groups of sequences whose block tables begin with the same pages: ``(members,
    pages shared)``, two members or more, where every shared page is full and precedes
    every query of every member, and the sharing saves ``(members - 1) x keys >= min_keys``.

    >>> shared_prefixes([[7, 8, 1], [7, 8, 2], [3, 4, 5]], [12, 10, 12], T=1, P=4, min_keys=1)
    [([0, 1], 2)]
    """
    by_first: dict[int, list[int]] = defaultdict(list)
    for b, pages in enumerate(tables):
        if (lens[b] - T) // P >= 1:  # a full page before its first query
            by_first[pages[0]].append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        shared = min((lens[b] - T) // P for b in members)
        first = tables[members[0]]
        for b in members[1:]:
            other = tables[b]
            shared = next((i for i in range(1, shared) if other[i] != first[i]), shared)
        if (len(members) - 1) * shared * P >= min_keys:
            groups.append((members, shared))
    return groups


def _check(q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, seq_lens: Tensor | Sequence[int],
           share_prefix: bool | str) -> tuple[list[int], Tensor]:
    """Check the pools and tables (the options are :func:`headwise.attention`'s to check):
    ``(lengths, the table as a (B, max_pages) int64 host tensor)``."""
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor {'(B, H, T, D)' if name == 'q' else '(N, Hkv, P, D)'}, "
                             f"got {shape}")
    if k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"k_pages {tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)} must agree on (N, Hkv, "
                         "P): pages, kv heads and page size; only the head dim may differ")
    if k_pages.shape[2] < 1:
        raise ValueError(f"page_size must be >= 1, got pools of shape {tuple(k_pages.shape)}")
    if not isinstance(share_prefix, (bool, str)):  # 1 == True would pass the value test below
        raise TypeError(f"share_prefix must be 'auto', True or False, got {type(share_prefix).__name__} "
                        f"{share_prefix!r}; pass bool(share_prefix)")
    if share_prefix not in (True, False, "auto"):
        raise ValueError(f"share_prefix must be 'auto', True or False, got {share_prefix!r}")
    lens = _lengths(seq_lens, q.shape[0])
    if not isinstance(block_table, Tensor) or block_table.is_floating_point() or block_table.is_complex() \
            or block_table.dtype == torch.bool:
        raise TypeError(f"block_table must be an integer tensor (B, max_pages) of page ids, got "
                        f"{block_table.dtype if isinstance(block_table, Tensor) else type(block_table).__name__}")
    B, T = q.shape[0], q.shape[2]
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be (B, max_pages) = ({B}, max_pages), one row per sequence of q, got "
                         f"{tuple(block_table.shape)}")
    N, P = k_pages.shape[0], k_pages.shape[2]
    W = block_table.shape[1]
    for b, L in enumerate(lens):
        if not T <= L <= W * P:
            raise ValueError(f"seq_lens[{b}] = {L} must lie in T..max_pages * page_size = {T}..{W * P}: "
                             "a sequence holds its T new keys, in at most the pages its block_table row names")
    table = block_table.to(device="cpu", dtype=torch.int64).contiguous()  # (B, W): a host copy only where needed
    first_bad = _first_bad_page(table, lens, P, N)
    if first_bad is not None:
        b, i = first_bad
        where = f"outside the pool's 0..{N - 1}" if N else "but the pool (k_pages, v_pages) has no pages"
        raise ValueError(f"block_table[{b}] names page {int(table[b, i])} among the {-(-lens[b] // P)} pages its "
                         f"{lens[b]} keys fill, {where}")
    return lens, table


def _first_bad_page(table: Tensor, lens: list[int], P: int, N: int) -> tuple[int, int] | None:
    """``(b, i)`` of the first page id among those the sequences read that is outside the pool
    of N pages, None where there is none (the native extension's loop where it is built)."""
    ext = native.loaded()
    if ext is not None:
        flat = ext.first_bad_page(table, lens, P, N)
        return None if flat < 0 else divmod(flat, table.shape[1])
    need = torch.tensor([-(-L // P) for L in lens], dtype=torch.int64)  # (B,) pages each sequence fills
    bad = (torch.arange(table.shape[1])[None, :] < need[:, None]) & ((table < 0) | (table >= N))  # (B, W)
    return tuple(int(x) for x in bad.nonzero()[0]) if bad.any() else None  # type: ignore[return-value]


def _rows(table: Tensor, lens: list[int], P: int) -> list[list[int]]:
    """The pages each sequence reads, as lists (the per-sequence path's form of the table)."""
    return [row[:-(-L // P)] for row, L in zip(table.tolist(), lens, strict=True)]


def _prefix_groups(table: Tensor, lens: list[int], T: int, P: int, min_keys: int) -> list[tuple[list[int], int]]:
    """:func:`shared_prefixes` of a (B, W) table tensor, reading as rows only the sequences
    whose first page another sequence also begins with (a decode step of private sequences
    reads one column)."""
    if table.shape[1] == 0:
        return []
    firsts = table[:, 0].tolist()
    counts: dict[int, int] = defaultdict(int)
    for b, first in enumerate(firsts):
        if (lens[b] - T) // P >= 1:
            counts[first] += 1
    if all(c < 2 for c in counts.values()):
        return []
    shared = [b for b, first in enumerate(firsts) if counts.get(first, 0) > 1]
    rows: list[list[int]] = [[first] for first in firsts]
    for b, row in zip(shared, table[shared].tolist(), strict=True):
        rows[b] = row[:-(-lens[b] // P)]
    return shared_prefixes(rows, lens, T, P, min_keys)


def _lengths(seq_lens: Tensor | Sequence[int], B: int) -> list[int]:
    """``seq_lens`` as B ints (a host read of a tensor)."""
    if isinstance(seq_lens, Tensor):
        if seq_lens.is_floating_point() or seq_lens.is_complex() or seq_lens.dtype == torch.bool:
            raise TypeError(f"seq_lens must be an integer tensor (B,), got {seq_lens.dtype}")
        if seq_lens.dim() != 1:
            hint = "; pass seq_lens.flatten()" if seq_lens.numel() == B else ""
            raise ValueError(f"seq_lens must be (B,) = ({B},), one length per sequence, got shape "
                             f"{tuple(seq_lens.shape)}{hint}")
        lens = seq_lens.tolist()
    elif isinstance(seq_lens, Sequence) and all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
                                                for n in seq_lens):
        lens = [int(n) for n in seq_lens]
    else:
        raise TypeError(f"seq_lens must be an integer tensor (B,) or a sequence of ints, got "
                        f"{type(seq_lens).__name__}")
    if len(lens) != B:
        raise ValueError(f"seq_lens must hold one length per sequence of q, (B,) = ({B},), got "
                         f"{tuple(seq_lens.shape) if isinstance(seq_lens, Tensor) else len(lens)}")
    return lens

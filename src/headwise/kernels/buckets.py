"""Length buckets of packed sequences: the padding-free core below the kernels.

Sequences of similar query and key lengths are gathered into a small padded batch (at most
``policy.BUCKET_SLACK`` of each side padding), or a long one attends on its own; each
bucket is handed to an ``attend`` function the caller gives, and the query rows come back
in the packed order. :mod:`headwise.packing` gives :func:`headwise.functional.attend` (every
backend, "auto" included); the varlen kernel gives its SDPA call, so no kernel reaches back
up into the functional layer.

Legend: B sequences, T real tokens (Tq queries, Tk keys), H query heads, Hkv key/value
heads, D head dim, n sequences in a bucket, Lq / Lk a bucket's query / key length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from headwise import policy
from headwise import tracing as trace
from headwise.kernels.common import attached_zeros, length_buckets, lse_dtype

_Attend = Callable[..., "Tensor | tuple[Tensor, Tensor]"]  # one bucket's attention: see attend_buckets


# --- the buckets --------------------------------------------------------------------------


def bucket_groups(lengths_q: tuple[int, ...], lengths_k: tuple[int, ...]) -> list[list[int]]:
    """Sequences to attend together, long ones first and alone.

    Sequences with queries and keys are bucketed by key length, then each bucket by query
    length, so both sides waste at most ``BUCKET_SLACK`` in padding. A sequence whose
    lengths have a harmonic mean of ``DIRECT_MIN_LENGTH`` or more attends alone. For
    self-attention that is the measured rule (length >= ``DIRECT_MIN_LENGTH``); for
    Lq != Lk it keeps the same ratio of gathered rows (``Lq + Lk``) to scores (``Lq * Lk``),
    unmeasured, so a single query against many keys (decoding) stays in a bucket.
    """
    buckets = []
    for by_k in length_buckets([lk if lq else 0 for lq, lk in zip(lengths_q, lengths_k, strict=True)]):
        buckets += [[by_k[j] for j in by_q] for by_q in length_buckets([lengths_q[b] for b in by_k])]

    direct = policy.DIRECT_MIN_LENGTH

    def alone(b: int) -> bool:  # 2 Lq Lk / (Lq + Lk) >= DIRECT_MIN_LENGTH, in integers
        return 2 * lengths_q[b] * lengths_k[b] >= direct * (lengths_q[b] + lengths_k[b])

    groups = [[b] for bucket in buckets for b in bucket if alone(b)]
    groups += [[b for b in bucket if not alone(b)] for bucket in buckets]
    return [g for g in groups if g]


def _layout(group: list[int], lengths_q, lengths_k, positional: bool,
            keys_first: bool = False) -> tuple[int, int, list[int], list[int], bool]:
    """A bucket's padded lengths (Lq, Lk), each sequence's first query / key row, and
    whether its keys need a mask (some sequence does not fill the Lk key rows from row 0).
    ``keys_first``: every sequence's keys start at row 0 (sink tokens count keys from there)."""
    Lq, Lk = max(lengths_q[b] for b in group), max(lengths_k[b] for b in group)
    if keys_first and positional:
        # Only queries shift: pad the query side until no sequence needs its keys moved.
        Lq = max(Lq, Lk - min(lengths_k[b] - lengths_q[b] for b in group))
    # Bottom-right alignment per sequence: query i sits at key position i + Lk_b - Lq_b,
    # the bucket puts row r at r + Lk - Lq. Shifting a sequence's queries (shift > 0) or
    # its keys (shift < 0) to later rows makes the two agree, so attend's own causal,
    # window and ALiBi rules hold for every sequence with no extra padding.
    shift = [(lengths_k[b] - lengths_q[b]) - (Lk - Lq) if positional else 0 for b in group]
    q_at, k_at = [max(s, 0) for s in shift], [max(-s, 0) for s in shift]  # first row of each sequence
    masked = any(k_at) or any(lengths_k[b] < Lk for b in group)
    return Lq, Lk, q_at, k_at, masked


def attend_buckets(q, k, v, lengths_q, lengths_k, attend: _Attend, *, is_causal, window, alibi_slopes, dropout_p,
                   scale, backend, softcap=None, sinks=None, sink_tokens=0, return_lse=False):
    """Attend each group of sequences (checked inputs), and put the rows back in packed order:
    (Tq, H, Dv), or with ``return_lse`` ``(out, lse (Tq, H))``.

    ``attend(qb, kb, vb[, mask], **rule)`` attends one bucket, (n, H, Lq, D) queries and
    (n, Hkv, Lk, D|Dv) keys and values, as :func:`headwise.functional.attend` takes them;
    ``mask`` (n, Lk) bool, True = one of the sequence's keys, where the bucket pads keys.
    The keywords after it reach ``attend`` as they are."""
    kwargs = {"is_causal": is_causal, "window": window, "alibi_slopes": alibi_slopes, "dropout_p": dropout_p,
              "scale": scale, "backend": backend, "softcap": softcap, "sinks": sinks, "sink_tokens": sink_tokens,
              "return_lse": return_lse}
    H, Dv = q.shape[1], v.shape[-1]
    # Where a sequence's queries and keys sit in a padded bucket only matters to a rule that
    # reads positions; without one, both sides are right-padded (the layout the varlen
    # kernel reads as key prefixes).
    positional = is_causal or window is not None or alibi_slopes is not None
    # split() views are cheap in both directions: its backward is one concatenation, where
    # slicing each sequence out of the packed rows would cost a (T, H, D) zero fill apiece.
    qs = q.split(list(lengths_q))  # B x (Lq_b, H, D)
    ks, vs = k.split(list(lengths_k)), v.split(list(lengths_k))  # B x (Lk_b, Hkv, D), B x (Lk_b, Hkv, Dv)
    pieces: list[Tensor | None] = [None] * len(lengths_q)  # each sequence's (Lq_b, H, Dv) output
    lses: list[Tensor | None] = [None] * len(lengths_q)  # each sequence's (Lq_b, H) log-sum-exp
    groups = bucket_groups(lengths_q, lengths_k)
    for number, group in enumerate(groups, 1):
        if len(group) == 1:  # alone: views of its rows, no padding and no mask
            b = group[0]
            qb, kb, vb = (t[b].transpose(0, 1)[None] for t in (qs, ks, vs))  # (1, H|Hkv, Lq_b|Lk_b, D)
            if trace.ACTIVE:
                trace.record(f"attention, bucket {number} of {len(groups)}", qb,
                             _note(group, lengths_q, lengths_k, alone=True))
            ob, lb = _with_lse(attend(qb, kb, vb, **kwargs))  # (1, H, Lq_b, Dv), (1, H, Lq_b) or None
            pieces[b] = ob[0].transpose(0, 1)  # (Lq_b, H, Dv)
            lses[b] = None if lb is None else lb[0].transpose(0, 1)  # (Lq_b, H)
            continue
        n = len(group)
        Lq, Lk, q_at, k_at, masked = _layout(group, lengths_q, lengths_k, positional, keys_first=sink_tokens > 0)
        qb = _pad_bucket([qs[b] for b in group], q_at, Lq).transpose(1, 2)  # (n, Lq, H, D) -> (n, H, Lq, D)
        kb, vb = (_pad_bucket([t[b] for b in group], k_at, Lk).transpose(1, 2) for t in (ks, vs))  # (n, Hkv, Lk, D|Dv)
        mask = None  # equal key lengths in place: no mask, the fastest path
        if masked:
            first = torch.tensor(k_at, device=q.device)[:, None]  # (n, 1)
            last = first + torch.tensor([lengths_k[b] for b in group], device=q.device)[:, None]  # (n, 1)
            span = torch.arange(Lk, device=q.device)[None, :]  # (1, Lk)
            mask = (span >= first) & (span < last)  # (n, Lk) True = one of the sequence's keys
        if trace.ACTIVE:
            trace.record(f"attention, bucket {number} of {len(groups)}", qb,
                         _note(group, lengths_q, lengths_k, alone=False, Lq=Lq, Lk=Lk, shifted=any(q_at + k_at)))
        ob, lb = _with_lse(attend(qb, kb, vb, mask, **kwargs))  # (n, H, Lq, Dv), (n, H, Lq) or None
        ob = ob.transpose(1, 2).reshape(n * Lq, H, Dv)  # (n, H, Lq, Dv) -> (n * Lq, H, Dv)
        sizes = [m for b, s in zip(group, q_at, strict=True) for m in (s, lengths_q[b], Lq - s - lengths_q[b])]
        parts = ob.split(sizes)  # padding, queries, padding, ... per sequence
        lse_parts = None if lb is None else lb.transpose(1, 2).reshape(n * Lq, H).split(sizes)  # (n, H, Lq) -> ...
        for j, b in enumerate(group):
            pieces[b] = parts[3 * j + 1]  # (Lq_b, H, Dv)
            lses[b] = None if lse_parts is None else lse_parts[3 * j + 1]  # (Lq_b, H)
    keyless = [b for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k, strict=True)) if lq and not lk]
    for b in keyless:  # no key to attend: the contract's zero rows (q's rows get zero gradients)
        pieces[b] = q.new_zeros(lengths_q[b], H, Dv)
        lses[b] = torch.full((lengths_q[b], H), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    if not groups:  # no sequence attends: zeros still in the graph of q, k and v
        out = attached_zeros(q, k, v, *([] if sinks is None else [sinks]), size=Dv)  # (Tq, H, Dv)
    else:
        out = torch.cat([p for p in pieces if p is not None])  # (Tq, H, Dv), in the packed order
    lse = None
    if return_lse:
        lse = (torch.cat([s for s in lses if s is not None]) if groups else
               torch.full((q.shape[0], H), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device))  # (Tq, H)
    if trace.ACTIVE:
        note = f"{sum(len(g) for g in groups)} sequences' query rows back in packed order, padding dropped"
        if keyless:
            note += f"; {len(keyless)} without keys output zeros"
        trace.record("merge buckets", out, note + (": (Tq, H, D)" if Dv == q.shape[-1] else ": (Tq, H, Dv)"))
    return out if lse is None else (out, lse)


def _with_lse(result: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """A bucket's ``attend`` result as ``(out, lse or None)``."""
    return (result[0], result[1]) if isinstance(result, tuple) else (result, None)


def _pad_bucket(seqs: list[Tensor], starts: list[int], L: int) -> Tensor:
    """Stack sequences (L_i, ...) into (n, L, ...), sequence i from row ``starts[i]``,
    zeros around it.

    A single concatenation, so the backward hands each sequence a view of its gradient.
    """
    rows = []
    for t, s in zip(seqs, starts, strict=True):
        after = L - s - t.shape[0]
        rows += [t.new_zeros(s, *t.shape[1:])] if s else []
        rows.append(t)
        rows += [t.new_zeros(after, *t.shape[1:])] if after else []
    return torch.cat(rows).reshape(len(seqs), L, *seqs[0].shape[1:])  # (n, L, ...)


def _note(group: list[int], lengths_q, lengths_k, *, alone: bool, Lq: int = 0, Lk: int = 0,
          shifted: bool = False) -> str:
    """One line for explain mode: which sequences a bucket holds and how it pads them."""
    lq, lk = [lengths_q[b] for b in group], [lengths_k[b] for b in group]
    if alone:
        if lq == lk:
            return f"1 sequence of length {lq[0]}, alone, no padding"
        return f"1 sequence of {lq[0]} queries and {lk[0]} keys, alone, no padding"
    if lq == lk:
        if len(set(lq)) == 1:
            return f"{len(group)} sequences of length {Lq}, no padding"
        return f"{len(group)} sequences of lengths {_listed(lq)} padded to {Lq}"
    note = (f"{len(group)} sequences: queries of lengths {_listed(lq)} padded to {Lq}, keys of lengths "
            f"{_listed(lk)} padded to {Lk}")
    if shifted:
        note += "; sequences shifted within the padding to keep each one's causal alignment"
    return note


def _listed(lengths: list[int], most: int = 6) -> str:
    if len(lengths) <= most:
        return ", ".join(map(str, lengths))
    return f"{', '.join(map(str, lengths[:most - 1]))}, ..., {lengths[-1]}"

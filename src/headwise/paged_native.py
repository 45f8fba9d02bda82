"""Paged attention through the native CPU kernel (``csrc/paged_attention.cpp``): the calls it makes.

The kernel reads each sequence's keys through its block table, in blocks of
``KEY_BLOCK`` keys at fixed offsets from the sequence's position 0, merged in key order: a
sequence's bits do not depend on its pages' order, the page size or the rest of the batch.

A shared prefix is folded in, not merged: the first ``S0`` prefix keys (a multiple of
``KEY_BLOCK``) are reduced once for every member's queries stacked as the rows of one call,
whose running state (max, sum, unnormalised output) each member's own call continues from.
The operations on each row are those of the member's private call, so sharing changes no bit.

Legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv, T new tokens per sequence,
N pages, P page size, D head dim of q and k, Dv of v, n members of a shared prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from headwise import native
from headwise import tracing as trace

__all__ = ["KERNEL", "KEY_BLOCK", "attend", "prefix_keys"]

KERNEL = "native_paged"  # its name in dispatch reports and traces
KEY_BLOCK = 32  # keys reduced together: the kernel's constant (checked against it when it loads)


def prefix_keys(shared_pages: int, P: int) -> int:
    """The keys of a shared prefix of ``shared_pages`` pages reduced once: a multiple of KEY_BLOCK."""
    return shared_pages * P // KEY_BLOCK * KEY_BLOCK


def attend(q: Tensor, k_pages: Tensor, v_pages: Tensor, table: Tensor, lens: list[int], scale: float,
           causal: bool, groups: Sequence[tuple[list[int], int]]) -> tuple[Tensor, Tensor]:
    """Every sequence's attention: ``(out (B, H, T, Dv), lse (B, H, T) fp32)``.

    ``table`` (B, W) int64 on the host, validated; ``groups``: the shared prefixes
    ``(members, pages shared)``, each folded in where it holds at least KEY_BLOCK keys."""
    ext = native.load()
    if ext is None or ext.KEY_BLOCK != KEY_BLOCK:  # the caller asked native.unavailable() first
        raise RuntimeError("internal error: the native paged kernel was routed to but is not built (or was built "
                           "from another source); please report it")
    P = k_pages.shape[2]
    lens_t = torch.tensor(lens, dtype=torch.int64)
    folded = [(members, prefix_keys(shared, P)) for members, shared in groups if prefix_keys(shared, P)]
    if not folded:  # one call for the whole batch
        return _call(ext, "every sequence over its own pages", q, k_pages, v_pages, table, lens_t, scale, causal)
    B, H, T, _ = q.shape
    out = q.new_empty(B, H, T, v_pages.shape[-1])  # (B, H, T, Dv)
    lse = q.new_empty(B, H, T, dtype=torch.float32)  # (B, H, T)
    grouped: set[int] = set()
    for members, S0 in folded:
        index = torch.tensor(members)
        state = _prefix_state(ext, q.index_select(0, index), k_pages, v_pages, table[members[0]:members[0] + 1],
                              S0, scale)
        o, s = _call(ext, f"sequences {members} past their {S0} shared keys", q.index_select(0, index), k_pages,
                     v_pages, table.index_select(0, index), lens_t.index_select(0, index), scale, causal, S0, state)
        out.index_copy_(0, index, o)
        lse.index_copy_(0, index, s)
        grouped.update(members)
    rest = [b for b in range(B) if b not in grouped]
    if rest:
        index = torch.tensor(rest)
        o, s = _call(ext, f"sequences {rest}", q.index_select(0, index), k_pages, v_pages,
                     table.index_select(0, index), lens_t.index_select(0, index), scale, causal)
        out.index_copy_(0, index, o)
        lse.index_copy_(0, index, s)
    return out, lse


def _prefix_state(ext: Any, q: Tensor, k_pages: Tensor, v_pages: Tensor, table: Tensor, S0: int,
                  scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The running state of every member's rows after the first S0 prefix keys, from one pass
    over them: ``(m (n, H, T), l (n, H, T), acc (n, H, T, Dv))`` fp32. The members' query heads
    of a kv head are the G*n query heads of one sequence over the prefix pages."""
    n, H, T, D = q.shape
    Hkv = k_pages.shape[1]
    G = H // Hkv
    rows = q.reshape(n, Hkv, G, T, D).transpose(0, 1).reshape(1, Hkv * n * G, T, D)  # -> (1, Hkv*n*G, T, D)
    # Every prefix key precedes every query of every member: nothing causal to mask there.
    acc, m, l = ext.paged_attention(rows, k_pages, v_pages, table, torch.tensor([S0]), scale, False, 0,
                                    None, None, None, False)  # (1, Hkv*n*G, T, Dv), (1, Hkv*n*G, T) x 2
    if trace.ACTIVE:
        trace.record("kernel", acc, f"backend {KERNEL!r}: the shared prefix's {S0} keys, every member's rows at once")
        trace.record("shared prefix", acc, f"{n} sequences attend their {S0} shared prefix keys once ({n * G * T} "
                     f"rows a kv head); each continues from that state over its own keys")

    def back(t: Tensor) -> Tensor:  # (1, Hkv*n*G, T, ...) -> (n, H, T, ...)
        return t.reshape(Hkv, n, G, *t.shape[2:]).transpose(0, 1).reshape(n, H, *t.shape[2:])

    return back(m), back(l), back(acc)


def _call(ext: Any, what: str, q: Tensor, k_pages: Tensor, v_pages: Tensor, table: Tensor, lens: Tensor,
          scale: float, causal: bool, start: int = 0,
          state: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One kernel call: ``(out (B', H, T, Dv), lse (B', H, T))`` for the sequences of ``table``."""
    m, l, acc = (None, None, None) if state is None else state
    out, lse = ext.paged_attention(q, k_pages, v_pages, table, lens, scale, causal, start, m, l, acc, True)
    if trace.ACTIVE:
        trace.record("kernel", out, f"backend {KERNEL!r}: {what}, read through the block table in blocks of "
                     f"{KEY_BLOCK} keys (no gathered copy)")
    return out, lse

"""Paged attention through the native CPU kernel (``csrc/paged_attention.cpp``): the calls it makes.

The kernel reads each sequence's keys through its block table, in blocks of
``KEY_BLOCK`` keys at fixed offsets from the sequence's position 0, merged in key order: a
sequence's bits do not depend on its pages' order, the page size or the rest of the batch.

A shared prefix (forks of one prompt) is attended once for all its members, over its first
``S0`` keys (a multiple of ``KEY_BLOCK``), in one of two ways:

- merged (what :func:`headwise.paged_attention` does): the members' rows stacked as one
  matrix product over the prefix (the caller's ``prefix`` function), the kernel over the
  rest of each sequence, the two merged by log-sum-exp;
- folded (``prefix=None``): the kernel reduces the prefix once for every member's rows and
  each member's call continues from that running state (max, sum, unnormalised output). The
  operations on each row are those of the member's private call, so sharing changes no bit:
  the form a batch-invariant mode (issue 37) takes; it reads the prefix once but computes
  each row as the kernel does, so it saves less time than the matrix product.

Legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv, T new tokens per sequence,
N pages, P page size, D head dim of q and k, Dv of v, n members of a shared prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from headwise import native
from headwise import tracing as trace
from headwise.pieces import merge_attentions

__all__ = ["KERNEL", "KEY_BLOCK", "attend", "prefix_keys"]

KERNEL = "native_paged"  # its name in dispatch reports and traces
KEY_BLOCK = 32  # keys reduced together: the kernel's constant (checked against it when it loads)


def prefix_keys(shared_pages: int, P: int) -> int:
    """The keys of a shared prefix of ``shared_pages`` pages reduced once: a multiple of KEY_BLOCK."""
    return shared_pages * P // KEY_BLOCK * KEY_BLOCK


PrefixAttention = Callable[[list[int], int], tuple[Tensor, Tensor]]


def attend(q: Tensor, k_pages: Tensor, v_pages: Tensor, table: Tensor, lens: list[int], scale: float,
           causal: bool, groups: Sequence[tuple[list[int], int]],
           prefix: PrefixAttention | None = None) -> tuple[Tensor, Tensor]:
    """Every sequence's attention: ``(out (B, H, T, Dv), lse (B, H, T) fp32)``.

    ``table`` (B, W) int64 on the host, validated; ``groups``: the shared prefixes
    ``(members, pages shared)``, each taken where it holds at least KEY_BLOCK keys (S0 of
    them, :func:`prefix_keys`). ``prefix``: ``prefix(members, S0) -> (out (n, H, T, Dv), lse
    (n, H, T))``, the members' attention over the prefix keys, merged by log-sum-exp with the
    kernel's over the rest (a matrix product serves the stacked rows faster than the kernel);
    None: the prefix is folded in (the bits of private sequences)."""
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
    parts = [(members, S0) for members, S0 in folded]
    rest = [b for b in range(B) if b not in {m for members, _ in folded for m in members}]
    parts += [(rest, 0)] if rest else []
    for members, S0 in parts:
        index = torch.tensor(members)
        q_m = q.index_select(0, index)  # (n, H, T, D)
        merged = prefix(members, S0) if S0 and prefix is not None else None  # (n, H, T, Dv), (n, H, T)
        state = _prefix_state(ext, q_m, k_pages, v_pages, table[members[0]:members[0] + 1], S0, scale) \
            if S0 and prefix is None else None
        what = f"sequences {members}" + (f" past their {S0} shared keys" if S0 else "")
        o, s = _call(ext, what, q_m, k_pages, v_pages, table.index_select(0, index), lens_t.index_select(0, index),
                     scale, causal, S0, state)
        if merged is not None:
            o, s = _merged(merged, (o, s))
        out.index_copy_(0, index, o)
        lse.index_copy_(0, index, s)
    return out, lse


def _merged(first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Two parts over disjoint keys merged by log-sum-exp: ``(out, lse fp32)``."""
    out, lse = merge_attentions([first[0], second[0].to(first[0].dtype)], [first[1], second[1]])
    return out, lse.float()


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

"""Fuzz the paged KV cache: ``paged_attention`` over random pools and block tables (shared
prefixes, NaN in free pages and past the lengths) against the float64 oracle, and random
``PagedKVCache`` programs (add, fork, free, append of T >= 0 keys to several sequences at
once) against a shadow of plain lists; a refused append must change nothing.

Legend: N pages, P keys a page, B sequences, T new keys a sequence, H heads, Hkv kv heads,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, note
from hypothesis import strategies as st

import headwise
from fuzz.fuzz_kit import TOL, Unchanged, assert_close, budget, refused
from headwise import masks
from headwise.testing import reference_attention


def draw_paged(draw) -> dict:
    H = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.sampled_from([None, None, 2, 3]))
    return dict(
        H=H, Hkv=draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0])), P=draw(st.integers(1, 4)),
        T=draw(st.integers(1, 3)), lens=draw(st.lists(st.integers(0, 9), min_size=1, max_size=4)),
        shared=draw(st.integers(0, 6)), dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        window=window, sink_tokens=draw(st.integers(0, 1)) if window else 0, alibi=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, 2.0])), sinks=draw(st.booleans()), Dv=draw(st.sampled_from([4, 3])),
        share_prefix=draw(st.sampled_from(["auto", True, False])), return_lse=draw(st.booleans()),
        strided_v=draw(st.booleans()), backend=draw(st.sampled_from(["auto", "auto", "matmul", "chunked", "sdpa"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _tables(cfg, gen):
    """Block tables: every sequence begins with the same ``shared`` keys' pages (a fork), the rest its own."""
    P, T = cfg["P"], cfg["T"]
    lens = [cfg["shared"] + n + T for n in cfg["lens"]]
    prefix = cfg["shared"] // P  # whole pages only are shared
    need = prefix + sum(-(-n // P) - prefix for n in lens)
    order = torch.randperm(need + 2, generator=gen).tolist()
    shared, rest = order[:prefix], order[prefix:]
    tables = []
    for n in lens:
        own = -(-n // P) - prefix
        tables.append(shared + rest[:own])
        rest = rest[own:]
    width = max(len(t) for t in tables)
    return need + 2, lens, torch.tensor([t + [-1] * (width - len(t)) for t in tables])


@budget(60)
@given(st.data())
def test_paged_attention_equals_each_sequence_alone(data):
    cfg = draw_paged(data.draw)
    note(f"paged: {cfg}")
    gen = torch.Generator().manual_seed(cfg["seed"])
    N, lens, table = _tables(cfg, gen)
    B, H, Hkv, P, T, D = len(lens), cfg["H"], cfg["Hkv"], cfg["P"], cfg["T"], 4
    k_pages = torch.full((N, Hkv, P, D), math.nan, dtype=torch.float64)
    v_pages = torch.full((N, Hkv, P, cfg["Dv"] * (2 if cfg["strided_v"] else 1)), math.nan, dtype=torch.float64)
    v_view = v_pages[..., ::2] if cfg["strided_v"] else v_pages  # (N, Hkv, P, Dv), last-dim stride 2 when strided
    keys = []
    for b, n in enumerate(lens):  # write each sequence's keys; slots past its length stay NaN
        k = torch.randn(Hkv, n, D, generator=gen, dtype=torch.float64)
        v = torch.randn(Hkv, n, cfg["Dv"], generator=gen, dtype=torch.float64)
        if b and cfg["shared"] >= P:  # the shared prefix pages hold the first sequence's keys
            whole = (cfg["shared"] // P) * P
            k[:, :whole], v[:, :whole] = keys[0][0][:, :whole], keys[0][1][:, :whole]
        for i in range(n):
            page = table[b, i // P]
            k_pages[page, :, i % P] = k[:, i]
            v_view[page, :, i % P] = v[:, i]
        keys.append((k, v))
    q = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    options = dict(window=cfg["window"], sink_tokens=cfg["sink_tokens"], softcap=cfg["softcap"],
                   alibi_slopes=masks.alibi_slopes(H).double() if cfg["alibi"] else None,
                   sinks=torch.randn(H, generator=gen, dtype=torch.float64) if cfg["sinks"] else None)
    dtype = cfg["dtype"]
    cast = {n: o.to(dtype) if isinstance(o, torch.Tensor) else o for n, o in options.items()}
    values = v_pages.to(dtype)[..., ::2] if cfg["strided_v"] else v_pages.to(dtype)  # the caller's layout, cast
    with Unchanged() as outcome:
        got = headwise.paged_attention(q.to(dtype), k_pages.to(dtype), values, table, torch.tensor(lens),
                                       backend=cfg["backend"], share_prefix=cfg["share_prefix"],
                                       return_lse=cfg["return_lse"], **cast)
    if refused(outcome):
        assert str(outcome.refused).startswith(f"backend {cfg['backend']!r}"), outcome.refused
        return
    out = got[0] if cfg["return_lse"] else got
    for b, (k, v) in enumerate(keys):
        ref = reference_attention(q[b:b + 1], k[None], v[None], is_causal=True, **options)
        assert_close(f"sequence {b}", out[b:b + 1], ref.out, TOL[dtype] * 10)
        if cfg["return_lse"]:
            assert_close(f"lse of sequence {b}", got[1][b:b + 1], ref.lse, TOL[dtype] * 10)


# ---------------------------------------------------------------- PagedKVCache programs

OPS = st.lists(st.tuples(st.sampled_from(["add", "fork", "free", "append", "append"]), st.integers(0, 7),
                         st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=14)


def _needs(cache, shadow, seqs, T) -> int:
    """Pages an append of T keys to ``seqs`` takes: new pages, and a copy of a shared partial last page."""
    P, total = cache.page_size, 0
    for s in seqs:
        n = len(shadow[s])
        total += -(-(n + T) // P) - -(-n // P)
        pages = cache.pages(s)
        if T and n % P and any(pages[-1] in cache.pages(o) for o in shadow if o != s):
            total += 1
    return total


def _step(cache, shadow, op, pick, count, T, gen) -> None:
    live = list(shadow)
    if op == "add" or not live:
        shadow[cache.add()] = []
        return
    seq = live[pick % len(live)]
    if op == "fork":
        shadow[cache.fork(seq)] = list(shadow[seq])
        return
    if op == "free":
        cache.free(seq)
        del shadow[seq]
        return
    seqs = live[pick % len(live):][:count] or [seq]
    T = T if count else 0  # count 0: an append of zero keys
    k = torch.randn(len(seqs), 2, T, 3, generator=gen)
    with Unchanged(cache) as outcome:
        cache.append(seqs, k, k * 2)
    if refused(outcome):
        assert _needs(cache, shadow, seqs, T) > cache.free_pages, f"refused with room: {outcome.refused}"
        return
    for n, s in enumerate(seqs):
        shadow[s] += list(k[n].unbind(1))  # T keys (Hkv, D)


@budget(60)
@given(OPS, st.integers(1, 3), st.integers(1, 9), st.integers(0, 2**16))
def test_paged_cache_programs_keep_every_sequences_keys(ops, P, N, seed):
    cache = headwise.PagedKVCache(num_pages=N, page_size=P, kv_heads=2, head_dim=3)
    gen = torch.Generator().manual_seed(seed)
    shadow: dict[int, list[torch.Tensor]] = {}
    for op in ops:
        _step(cache, shadow, *op, gen)
        for s, keys in shadow.items():
            assert cache.length(s) == len(keys)
            if keys:
                table = cache.block_table([s])[0]
                slots = [table[i // P] * P + i % P for i in range(len(keys))]
                got = cache.k_pages.transpose(0, 1).reshape(2, -1, 3)[:, slots]  # (Hkv, L, D)
                torch.testing.assert_close(got, torch.stack(keys, 1), rtol=0, atol=0)
                torch.testing.assert_close(cache.v_pages.transpose(0, 1).reshape(2, -1, 3)[:, slots], 2 * got)
        held = {p for s in shadow for p in cache.pages(s)}
        assert cache.pages_in_use == len(held) and cache.free_pages == N - len(held)

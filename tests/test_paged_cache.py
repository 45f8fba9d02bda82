"""headwise.PagedKVCache: pages, forks with copy on write, runs of pages, refusals that change nothing.

Legend: B sequences, Hkv key/value heads, T new tokens, N pages, P page size, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from conftest import reference_attention
from headwise.paged_cache import PagedBatch


def keys_of(cache: headwise.PagedKVCache, seq: int, pool=None):
    """(Hkv, L, D): the sequence's keys read page by page."""
    pool = cache.k_pages if pool is None else pool
    L = cache.length(seq)
    return torch.cat([pool[p] for p in cache.pages(seq)], dim=1)[:, :L] if L else pool[:0, :, 0]


def step(cache, seqs, T, Dv=None):
    Hkv, D = cache.k_pages.shape[1], cache.k_pages.shape[-1]
    k = torch.randn(len(seqs), Hkv, T, D, dtype=cache.k_pages.dtype)
    v = torch.randn(len(seqs), Hkv, T, Dv or cache.v_pages.shape[-1], dtype=cache.k_pages.dtype)
    cache.append(seqs, k, v)
    return k, v


def test_append_stores_each_sequence_page_by_page():
    cache = headwise.PagedKVCache(16, 4, 2, 8, value_dim=3)
    a, b = cache.add(), cache.add()
    k1, v1 = step(cache, [a, b], 6)
    k2, _ = step(cache, [b], 3)
    k3, v3 = step(cache, [b, a], 1)
    assert cache.seq_lens([a, b]).tolist() == [7, 10] and cache.length(b) == 10
    torch.testing.assert_close(keys_of(cache, a), torch.cat([k1[0], k3[1]], dim=1))
    torch.testing.assert_close(keys_of(cache, b), torch.cat([k1[1], k2[0], k3[0]], dim=1))
    torch.testing.assert_close(keys_of(cache, a, cache.v_pages), torch.cat([v1[0], v3[1]], dim=1))
    table = cache.block_table([a, b])
    assert table.shape == (2, 3) and table.dtype == torch.int64 and table[0, 2] == -1
    assert cache.pages_in_use == 5 and cache.free_pages == 11
    assert repr(cache) == ("PagedKVCache(num_pages=16, page_size=4, kv_heads=2, head_dim=8, value_dim=3, "
                           "sequences=2, pages_in_use=5)")


def test_sequences_grow_in_runs_of_consecutive_pages():
    """Sequences decoded a token at a time, side by side, each keep one run while there is room."""
    cache = headwise.PagedKVCache(64, 4, 1, 4)
    seqs = [cache.add() for _ in range(4)]
    for _ in range(24):
        step(cache, seqs, 1)
    for s in seqs:
        pages = cache.pages(s)
        assert pages == list(range(pages[0], pages[0] + 6)), pages


def test_fork_shares_pages_and_copies_the_partial_last_page_on_write():
    cache = headwise.PagedKVCache(16, 4, 2, 8)
    a = cache.add()
    k, _ = step(cache, [a], 6)  # one full page, one partial
    b = cache.fork(a)
    assert cache.pages(b) == cache.pages(a) and cache.pages_in_use == 2
    kb, _ = step(cache, [b], 1)  # b writes: its own copy of the partial page, the full one still shared
    assert cache.pages(b)[0] == cache.pages(a)[0] and cache.pages(b)[1] != cache.pages(a)[1]
    assert cache.pages_in_use == 3
    torch.testing.assert_close(keys_of(cache, a), k[0])  # a is untouched
    torch.testing.assert_close(keys_of(cache, b), torch.cat([k[0], kb[0]], dim=1))
    ka, _ = step(cache, [a], 1)  # a now holds its partial page alone: written in place
    assert cache.pages_in_use == 3
    torch.testing.assert_close(keys_of(cache, a), torch.cat([k[0], ka[0]], dim=1))
    cache.free(a)
    assert cache.pages_in_use == 2  # the first page stays, b holds it
    torch.testing.assert_close(keys_of(cache, b), torch.cat([k[0], kb[0]], dim=1))
    cache.free(b)
    assert cache.pages_in_use == 0 and cache.sequences == []


def test_fork_of_full_pages_copies_nothing():
    cache = headwise.PagedKVCache(16, 4, 1, 4)
    a = cache.add()
    step(cache, [a], 8)
    b = cache.fork(a)
    step(cache, [a, b], 1)
    assert cache.pages(a)[:2] == cache.pages(b)[:2] and cache.pages_in_use == 4


def test_running_out_of_pages_is_an_error_that_changes_nothing():
    cache = headwise.PagedKVCache(4, 4, 1, 4)
    a, b = cache.add(), cache.add()
    step(cache, [a, b], 5)  # 2 pages each: the pool is full
    before = (cache.block_table([a, b]), cache.seq_lens([a, b]), cache.k_pages.clone(), cache.free_pages)
    with pytest.raises(ValueError, match=r"needs 2 free pages for this step \(4 new keys each for sequences "
                                         r"\[0, 1\], pages of 4\) but has 0 of 4; free finished sequences"):
        step(cache, [a, b], 4)
    after = (cache.block_table([a, b]), cache.seq_lens([a, b]), cache.k_pages, cache.free_pages)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(torch.as_tensor(x), torch.as_tensor(y))
    c = cache.fork(a)
    with pytest.raises(ValueError, match="needs 1 free pages"):  # the copy on write needs a page too
        step(cache, [c], 1)
    assert cache.pages(c) == cache.pages(a)


def test_savepoint_and_rollback_undo_a_step():
    cache = headwise.PagedKVCache(16, 4, 1, 4)
    a = cache.add()
    k, _ = step(cache, [a], 3)
    b = cache.fork(a)
    saved = cache.savepoint([a, b])
    step(cache, [a, b], 6)
    cache.rollback(saved)
    assert cache.seq_lens([a, b]).tolist() == [3, 3] and cache.pages(a) == cache.pages(b) and cache.pages_in_use == 1
    torch.testing.assert_close(keys_of(cache, b), k[0])


def test_for_module_and_batch():
    mha = headwise.MultiHeadAttention(32, 4, num_kv_heads=2, v_head_dim=6, dtype=torch.float64)
    cache = headwise.PagedKVCache.for_module(mha, num_pages=8, page_size=2)
    assert cache.k_pages.shape == (8, 2, 2, 8) and cache.v_pages.shape == (8, 2, 2, 6)
    assert cache.k_pages.dtype == torch.float64
    a, b = cache.add(), cache.add()
    assert cache.batch([b, a]) == PagedBatch(cache, (b, a))


def test_refusals_name_the_values():
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        headwise.PagedKVCache(4, 0, 1, 4)
    cache = headwise.PagedKVCache(8, 4, 2, 4)
    a = cache.add()
    with pytest.raises(ValueError, match=r"sequence 7 is not in the cache \(live: \[0\]\)"):
        cache.fork(7)
    with pytest.raises(ValueError, match=r"a batch names each sequence once, got \[0, 0\]"):
        cache.batch([a, a])
    with pytest.raises(ValueError, match=r"k must be \(B, Hkv, T, D\) = \(1, 2, T, 4\) for 1 sequences, got "
                                         r"\(1, 3, 2, 4\)"):
        cache.append([a], torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(TypeError, match=r"v is torch.float64 on cpu; the pool is torch.float32"):
        cache.append([a], torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="k and v must hold the same T new positions, got 2 and 3"):
        cache.append([a], torch.randn(1, 2, 2, 4), torch.randn(1, 2, 3, 4))
    assert cache.length(a) == 0 and cache.pages_in_use == 0


def churned(num_pages=24, P=4, Hkv=2, D=3, seed=0, dtype=torch.float64):
    """A pool after churn: sequences grown side by side, some freed, others grown into the
    holes, forks of partial pages; the pages are out of order. The same seed, the same cache."""
    gen = torch.Generator().manual_seed(seed)
    cache = headwise.PagedKVCache(num_pages, P, Hkv, D, dtype=dtype)
    cache.k_pages.copy_(torch.randn(cache.k_pages.shape, generator=gen, dtype=dtype))  # free pages: any values
    cache.v_pages.copy_(torch.randn(cache.v_pages.shape, generator=gen, dtype=dtype))

    def grow(seqs, T):
        shape = (len(seqs), Hkv, T, D)
        k, v = (torch.randn(shape, generator=gen, dtype=dtype) for _ in range(2))
        cache.append(seqs, k, v)

    seqs = [cache.add() for _ in range(6)]
    for T in (3, 2, 5, 4):  # 14 keys each, grown side by side: the pool is full
        grow(seqs, T)
    for s in seqs[1::2]:
        cache.free(s)
    late = cache.add()
    grow([late, seqs[0]], 10)  # both take pages from the holes the others left
    forks = [cache.fork(seqs[2]), cache.fork(late)]  # each shares a partial last page
    return cache, grow, [seqs[0], seqs[2], late, *forks, seqs[4]]


def snapshot(cache):
    """Everything an append may change: the pools bit by bit and all the bookkeeping."""
    bits = [p.clone().view(torch.int64) for p in (cache.k_pages, cache.v_pages)]
    return bits, {s: (cache.pages(s), cache.length(s)) for s in cache.sequences}, bytes(cache._free), \
        cache.free_pages, list(cache._refs)


def assert_unchanged(cache, before):
    bits, rest = before[0], before[1:]
    now = snapshot(cache)
    assert all(torch.equal(a, b) for a, b in zip(bits, now[0], strict=True))
    assert now[1:] == rest


def test_churned_pages_are_out_of_order_and_forks_share_partial_pages():
    cache, _, seqs = churned()
    assert any(cache.pages(s) != sorted(cache.pages(s)) or
               cache.pages(s) != list(range(cache.pages(s)[0], cache.pages(s)[0] + len(cache.pages(s))))
               for s in seqs)
    assert cache.length(seqs[3]) % cache.page_size and cache.pages(seqs[3]) == cache.pages(seqs[1])


@pytest.mark.parametrize("full", [False, True], ids=["room", "full pool"])
def test_appending_nothing_changes_nothing(full):
    """T = 0 (or no sequence) never copies a shared partial page, takes one or writes: with a
    full pool it overwrote a page another sequence holds and took free_pages to -1."""
    cache, grow, seqs = churned()
    if full:
        filler = cache.add()
        grow([filler], cache.free_pages * cache.page_size)
        assert cache.free_pages == 0
    before = snapshot(cache)
    for batch in ([seqs[3]], seqs, []):
        assert cache.append(batch, torch.zeros(len(batch), 2, 0, 3, dtype=torch.float64),
                            torch.zeros(len(batch), 2, 0, 3, dtype=torch.float64)) is None
        assert_unchanged(cache, before)
    cache.append([], torch.zeros(0, 2, 5, 3, dtype=torch.float64), torch.zeros(0, 2, 5, 3, dtype=torch.float64))
    assert_unchanged(cache, before)


def test_a_refused_append_changes_nothing():
    """Every refusal comes before anything is written or counted: pools bit for bit, tables,
    lengths, the free list and the reference counts."""
    cache, grow, seqs = churned()
    filler = cache.add()
    grow([filler], cache.free_pages * cache.page_size - 1)  # one slot left in the last page
    before = snapshot(cache)
    k, v = torch.randn(2, 2, 1, 3, dtype=torch.float64), torch.randn(2, 2, 1, 3, dtype=torch.float64)
    refusals = [
        (ValueError, r"needs 1 free pages .* but has 0 of 24", ([seqs[0], filler], k, v)),  # a full last page
        (ValueError, r"needs 2 free pages .* but has 0 of 24", ([seqs[3], seqs[4]], k, v)),  # two copies on write
        (ValueError, r"sequence 99 is not in the cache", ([filler, 99], k, v)),
        (ValueError, rf"a batch names each sequence once, got \[{filler}, {filler}\]", ([filler, filler], k, v)),
        (ValueError, r"k must be \(B, Hkv, T, D\) = \(1, 2, T, 3\) for 1 sequences", ([filler], k, v[:1])),
        (TypeError, r"v is torch.float32 on cpu; the pool is torch.float64", ([seqs[3], filler], k, v.float())),
        (ValueError, r"k and v must hold the same T new positions, got 1 and 2", ([filler, seqs[0]], k,
                                                                                 v.repeat(1, 1, 2, 1))),
        (TypeError, r"seqs must be a list or tuple of sequence ids, got int", (filler, k[:1], v[:1])),
    ]
    for error, message, args in refusals:
        with pytest.raises(error, match=message):
            cache.append(*args)
        assert_unchanged(cache, before)
    with pytest.raises(TypeError, match="T must be an int, the new keys of each sequence, got float"):
        cache.pages_needed([filler], 1.0)
    with pytest.raises(ValueError, match="T must be >= 0, the new keys of each sequence, got -1"):
        cache.check_room([filler], -1)
    assert cache.check_room([filler], 1) == 0 and cache.pages_needed([filler, seqs[3]], 2) == 2
    cache.append([filler], k[:1], v[:1])  # the last slot still takes one key
    assert cache.free_pages == 0 and cache.length(filler) % cache.page_size == 0


def test_a_miscounted_step_stops_before_taking_a_held_page(monkeypatch):
    """The last guard: were the count of pages wrong, the allocator refuses to take a page
    with none free (it took page 0, which another sequence held) before writing anything."""
    cache, grow, seqs = churned()
    grow([cache.add()], cache.free_pages * cache.page_size)
    monkeypatch.setattr(cache, "pages_needed", lambda seqs, T: 0)
    pools = cache.k_pages.clone(), cache.v_pages.clone()
    with pytest.raises(RuntimeError, match="took a page with none free"):
        cache.append([seqs[3]], torch.zeros(1, 2, 1, 3, dtype=torch.float64),
                     torch.zeros(1, 2, 1, 3, dtype=torch.float64))
    assert torch.equal(cache.k_pages, pools[0]) and torch.equal(cache.v_pages, pools[1]) and cache.free_pages == 0


def test_forks_that_share_a_partial_page_step_together_with_one_free_page():
    """The last holder of a shared partial page writes in place, in a batched step as in
    steps one at a time: two forks and one free page are enough for both."""
    def build():
        cache = headwise.PagedKVCache(3, 4, 1, 2, dtype=torch.float64)
        a = cache.add()
        cache.append([a], torch.arange(12.0, dtype=torch.float64).reshape(1, 1, 6, 2),
                     torch.ones(1, 1, 6, 2, dtype=torch.float64))
        return cache, a, cache.fork(a)

    k, v = torch.randn(2, 1, 1, 2, dtype=torch.float64), torch.randn(2, 1, 1, 2, dtype=torch.float64)
    together, a, b = build()
    together.append([a, b], k, v)
    apart, a2, b2 = build()
    apart.append([a2], k[:1], v[:1])
    apart.append([b2], k[1:], v[1:])
    assert together.free_pages == apart.free_pages == 0
    for s, s2 in ((a, a2), (b, b2)):
        for pool, pool2 in ((together.k_pages, apart.k_pages), (together.v_pages, apart.v_pages)):
            assert torch.equal(keys_of(together, s, pool), keys_of(apart, s2, pool2))


@pytest.mark.parametrize("seed", range(6))
def test_a_batched_step_takes_the_pages_of_steps_one_at_a_time(seed):
    """On a churned pool, a step of several forks and their roots (in a random order) needs
    exactly the free pages the same appends one sequence at a time take (it is served by a
    pool with just those left), and stores the same keys."""
    gen = torch.Generator().manual_seed(100 + seed)
    together, grow, seqs = churned(num_pages=40, seed=seed)
    apart, _, _ = churned(num_pages=40, seed=seed)
    extra = together.fork(seqs[3])  # three holders of one partial page
    assert apart.fork(seqs[3]) == extra
    seqs = seqs + [extra]
    order = [seqs[i] for i in torch.randperm(len(seqs), generator=gen).tolist()]
    T = int(torch.randint(1, 6, (1,), generator=gen))
    k = torch.randn(len(order), 2, T, 3, dtype=torch.float64, generator=gen)
    v = torch.randn(len(order), 2, T, 3, dtype=torch.float64, generator=gen)
    free = apart.free_pages
    for b, s in enumerate(order):
        apart.append([s], k[b:b + 1], v[b:b + 1])
    need = free - apart.free_pages
    grow([together.add()], (together.free_pages - need) * together.page_size)  # leave just those pages
    assert together.free_pages == need == together.pages_needed(order, T)
    together.append(order, k, v)
    assert together.free_pages == 0
    for s in order:
        for pool, pool2 in ((together.k_pages, apart.k_pages), (together.v_pages, apart.v_pages)):
            assert torch.equal(keys_of(together, s, pool), keys_of(apart, s, pool2))
    q = torch.randn(len(order), 4, T, 3, dtype=torch.float64, generator=gen)  # GQA: 4 query heads, 2 kv heads
    out = headwise.paged_attention(q, together.k_pages, together.v_pages, together.block_table(order),
                                   together.seq_lens(order), share_prefix=True)
    for b, s in enumerate(order):  # each sequence's textbook attention over the keys stepped one at a time
        ref, _ = reference_attention(q[b:b + 1], keys_of(apart, s)[None], keys_of(apart, s, apart.v_pages)[None],
                                     is_causal=True)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=0, atol=1e-12)


def test_the_block_table_follows_every_change_of_pages_and_callers_get_their_own_copy():
    """block_table keeps the last table until a page changes (a decode step takes a page once
    in P steps): each change below must show in the next table."""
    cache = headwise.PagedKVCache(num_pages=12, page_size=2, kv_heads=1, head_dim=2)
    a, b = cache.add(), cache.add()

    def rows(seqs):
        return [[p for p in row if p >= 0] for row in cache.block_table(seqs).tolist()]

    def expect(seqs):
        assert rows(seqs) == [cache.pages(s) for s in seqs]

    step(cache, [a, b], 3)
    expect([a, b])
    table = cache.block_table([a, b])
    table.fill_(99)  # the caller's copy
    expect([a, b])
    step(cache, [a, b], 1)  # within the last pages: the same table
    expect([a, b])
    step(cache, [a, b], 1)  # a new page each
    expect([a, b])
    c = cache.fork(a)
    step(cache, [c], 1)  # a fresh page for c only (a's last page is full)
    expect([a, b, c])
    d = cache.fork(c)
    saved = cache.savepoint([d])
    step(cache, [d], 1)  # copy on write of the shared partial page
    expect([c, d])
    cache.rollback(saved)
    expect([c, d])
    cache.free(b)
    e = cache.add()
    step(cache, [e], 5)
    expect([a, c, d, e])

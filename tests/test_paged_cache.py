"""headwise.PagedKVCache: pages, forks with copy on write, runs of pages, refusals that change nothing.

Legend: B sequences, Hkv key/value heads, T new tokens, N pages, P page size, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import headwise
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

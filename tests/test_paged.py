"""headwise.paged_attention against the float64 textbook attention over each sequence's gathered keys.

Legend: B batch, H query heads, Hkv key/value heads, T new tokens, N pages, P page size,
L a sequence's keys, D head dim of q and k, Dv of v.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import paged
from headwise.masks import alibi_slopes
from headwise.paged import paged_attention, shared_prefixes

P = 4  # page size
# Sequences 0, 2 and 3 begin with the same two pages (a forked prompt); 1 is scattered;
# 3 is one run of consecutive pages; lengths are ragged, last pages partial.
TABLE = [[0, 1, 2, 3, -1], [9, 5, 11, -1, -1], [0, 1, 7, 8, 12], [0, 1, 13, 14, -1]]
LENS = [14, 10, 19, 13]


def pools(Hkv: int, D: int, Dv: int, *, grad: bool = False):
    """k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv) in float64: the slots the sequences hold
    are random, every other slot (free pages, slots past a length) is NaN."""
    N = 16
    k, v = torch.full((N, Hkv, P, D), torch.nan, dtype=torch.float64), torch.full((N, Hkv, P, Dv), torch.nan,
                                                                                dtype=torch.float64)
    for pages, L in zip(TABLE, LENS, strict=True):
        for i in range(L):
            page, slot = pages[i // P], i % P
            if torch.isnan(k[page, 0, slot, 0]):  # a shared page is written once
                k[page, :, slot] = torch.randn(Hkv, D, dtype=torch.float64)
                v[page, :, slot] = torch.randn(Hkv, Dv, dtype=torch.float64)
    return k.requires_grad_(grad), v.requires_grad_(grad)


def gathered(pool, pages: list[int], L: int):
    """(1, Hkv, L, D|Dv): the sequence's first L keys, page after page (differentiable)."""
    used = torch.tensor(pages[:-(-L // P)])
    return pool[used].transpose(0, 1).reshape(1, pool.shape[1], -1, pool.shape[-1])[:, :, :L]


def reference(q, k_pages, v_pages, lens=LENS, **options):
    """Each sequence's textbook (matmul) attention over its gathered keys: (B, H, T, Dv), (B, H, T)."""
    rows = [headwise.attention(q[b:b + 1], gathered(k_pages, TABLE[b], L), gathered(v_pages, TABLE[b], L),
                               backend="matmul", return_lse=True, **options) for b, L in enumerate(lens)]
    return torch.cat([o for o, _ in rows]), torch.cat([s for _, s in rows])


OPTIONS = {
    "plain": {},
    "not causal": {"is_causal": False},
    "scale": {"scale": 0.3},
    "window": {"window": 3},
    "window + sink tokens": {"window": 3, "sink_tokens": 2},
    "alibi": {"alibi_slopes": alibi_slopes(4).double()},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, float("-inf")], dtype=torch.float64)},
    "softcap + sinks": {"softcap": 2.0, "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)},
}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "T=3"])
@pytest.mark.parametrize("share", [False, True], ids=["apart", "shared"])
def test_equals_attention_over_the_gathered_keys(name, Hkv, T, share):
    k_pages, v_pages = pools(Hkv, 8, 8)
    q = torch.randn(4, 4, T, 8, dtype=torch.float64)
    out, lse = paged_attention(q, k_pages, v_pages, torch.tensor(TABLE), torch.tensor(LENS), share_prefix=share,
                               return_lse=True, **OPTIONS[name])
    ref, ref_lse = reference(q, k_pages, v_pages, is_causal=OPTIONS[name].get("is_causal", True),
                             **{k: v for k, v in OPTIONS[name].items() if k != "is_causal"})
    assert out.shape == (4, 4, T, 8) and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)


def test_value_head_dim_and_the_lse_off():
    k_pages, v_pages = pools(2, 8, 5)
    q = torch.randn(4, 4, 2, 8, dtype=torch.float64)
    out = paged_attention(q, k_pages, v_pages, torch.tensor(TABLE), LENS, share_prefix=True)
    assert out.shape == (4, 4, 2, 5)
    torch.testing.assert_close(out, reference(q, k_pages, v_pages, is_causal=True)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["plain", "window", "alibi", "softcap + sinks"])
@pytest.mark.parametrize("share", [False, True], ids=["apart", "shared"])
def test_gradients_reach_q_the_pages_and_the_sinks(name, share):
    """Gradients of the pools and q equal the reference's; NaN in unread slots reaches none."""
    options = {k: (v.clone().requires_grad_() if k == "sinks" else v) for k, v in OPTIONS[name].items()}
    k_pages, v_pages = pools(2, 8, 8, grad=True)
    q = torch.randn(4, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse = paged_attention(q, k_pages, v_pages, torch.tensor(TABLE), torch.tensor(LENS), share_prefix=share,
                               return_lse=True, **options)
    weights = torch.randn_like(out)
    inputs = [q, k_pages, v_pages] + ([options["sinks"]] if "sinks" in options else [])
    grads = torch.autograd.grad((out * weights).sum() + lse.sum(), inputs)
    ref, ref_lse = reference(q, k_pages, v_pages, is_causal=True, **options)
    ref_grads = torch.autograd.grad((ref * weights).sum() + ref_lse.sum(), inputs)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("share", [False, True], ids=["apart", "shared"])
def test_nan_in_free_pages_and_past_the_lengths_changes_nothing(share):
    k_nan, v_nan = pools(2, 8, 8)
    k_zero, v_zero = k_nan.nan_to_num(0.0), v_nan.nan_to_num(0.0)
    assert torch.isnan(k_nan).any() and not torch.isnan(k_zero).any()
    q = torch.randn(4, 4, 2, 8, dtype=torch.float64)
    a = paged_attention(q, k_nan, v_nan, torch.tensor(TABLE), torch.tensor(LENS), share_prefix=share)
    b = paged_attention(q, k_zero, v_zero, torch.tensor(TABLE), torch.tensor(LENS), share_prefix=share)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_shared_prefixes_are_found_from_the_block_tables():
    # 0, 2, 3 share pages 0, 1 (8 keys before every query of T=1); 1 shares nothing
    assert shared_prefixes(TABLE, LENS, T=1, P=P, min_keys=1) == [([0, 2, 3], 2)]
    # a prefix page must lie before every query: with T=6, sequence 3 (13 keys) has one full page before its first
    assert shared_prefixes(TABLE, LENS, T=6, P=P, min_keys=1) == [([0, 2, 3], 1)]
    # "auto" shares where the reads saved, (members - 1) x keys = 16, reach the threshold
    assert shared_prefixes(TABLE, LENS, T=1, P=P, min_keys=17) == []


def test_auto_shares_above_the_threshold_and_equals_no_sharing(monkeypatch):
    k_pages, v_pages = pools(2, 8, 8)
    q = torch.randn(4, 4, 1, 8, dtype=torch.float64)
    calls = []
    real = paged._attend_shared
    monkeypatch.setattr(paged, "_attend_shared", lambda *a: calls.append(a[4]) or real(*a))
    args = (q, k_pages, v_pages, torch.tensor(TABLE), torch.tensor(LENS))
    apart = paged_attention(*args, share_prefix=False)
    assert calls == []
    monkeypatch.setattr(paged, "SHARED_PREFIX_MIN_KEYS", 16)
    auto = paged_attention(*args)
    assert calls == [[0, 2, 3]]
    torch.testing.assert_close(auto, apart, rtol=0, atol=1e-12)
    calls.clear()
    paged_attention(*args, window=4)  # a window depends on each query's distance to the prefix: not shared
    assert calls == []


def test_one_run_of_pages_is_read_as_a_view_of_the_pool():
    cache = headwise.PagedKVCache(16, P, 2, 8, dtype=torch.float64)
    seq = cache.add()
    cache.append([seq], torch.randn(1, 2, 10, 8, dtype=torch.float64), torch.randn(1, 2, 10, 8, dtype=torch.float64))
    pools_t = (cache.k_pages.transpose(0, 1), cache.v_pages.transpose(0, 1))
    k, v = paged._keys(pools_t, cache.pages(seq), 0, 10)
    assert k.shape == (1, 2, 10, 8) and k.untyped_storage().data_ptr() == cache.k_pages.untyped_storage().data_ptr()
    scattered = paged._keys(pools_t, [5, 2, 9], 0, 10)[0]
    assert scattered.untyped_storage().data_ptr() != cache.k_pages.untyped_storage().data_ptr()


def shuffled(lens, N, gen, width=None):
    """A block table of random distinct pages out of N, in random order, -1 past each row's pages."""
    need = [-(-L // P) for L in lens]
    width = max(need, default=0) if width is None else width
    perm = torch.randperm(N, generator=gen).tolist()
    rows, used = [], 0
    for n in need:
        rows.append(perm[used:used + n] + [-1] * (width - n))
        used += n
    return torch.tensor(rows, dtype=torch.int64).reshape(len(lens), width)


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_block_tables_equal_the_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    k_pages, v_pages = torch.randn(16, 2, P, 8, dtype=torch.float64, generator=gen), \
        torch.randn(16, 2, P, 5, dtype=torch.float64, generator=gen)
    lens = torch.randint(3, 14, (4,), generator=gen).tolist()
    table = shuffled(lens, 16, gen, width=5)
    q = torch.randn(4, 4, 3, 8, dtype=torch.float64, generator=gen)
    out = paged_attention(q, k_pages, v_pages, table, lens)
    for b, L in enumerate(lens):
        pages = table[b].tolist()
        ref = headwise.attention(q[b:b + 1], gathered(k_pages, pages, L), gathered(v_pages, pages, L),
                                 backend="matmul", is_causal=True)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("B", "T"), [(0, 1), (0, 0), (4, 0)])
def test_an_empty_batch_or_step_gives_an_empty_result(B, T):
    """B = 0 or T = 0 returns (B, H, T, Dv) and the (B, H, T) lse, as torch ops do on empty
    sizes (B = 0 failed in torch.cat), after every check a full call makes."""
    k_pages, v_pages = pools(2, 8, 5, grad=True)
    q = torch.randn(B, 4, T, 8, dtype=torch.float64, requires_grad=True)
    lens = [0, 10, 19, 13][:B] if T == 0 else []
    for table in (torch.tensor(TABLE)[:B], torch.zeros(B, 0, dtype=torch.int64) if not any(lens) else None):
        if table is None:
            continue
        out, lse = paged_attention(q, k_pages, v_pages, table, lens, return_lse=True, sinks=torch.zeros(4).double())
        assert out.shape == (B, 4, T, 5) and lse.shape == (B, 4, T) and out.dtype == lse.dtype == torch.float64
        grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k_pages, v_pages))
        assert [g.shape for g in grads] == [q.shape, k_pages.shape, v_pages.shape]
        assert all(not g.any() for g in grads)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        paged_attention(q, k_pages, v_pages, torch.tensor(TABLE)[:B], lens, backend="nope")
    with pytest.raises(TypeError, match="q, k, v dtypes differ"):
        paged_attention(q.float(), k_pages, v_pages, torch.tensor(TABLE)[:B], lens)
    if B:
        with pytest.raises(ValueError, match=r"seq_lens\[0\] = 21 must lie in T..max_pages \* page_size = 0..20"):
            paged_attention(q, k_pages, v_pages, torch.tensor(TABLE), [21, 10, 19, 13])


def test_unclear_arguments_are_refused_by_name():
    k_pages, v_pages = pools(2, 8, 8)
    q = torch.randn(4, 4, 1, 8, dtype=torch.float64)
    table, lens = torch.tensor(TABLE), torch.tensor(LENS)
    with pytest.raises(ValueError, match=r"seq_lens must be \(B,\) = \(4,\), one length per sequence, got shape "
                                         r"\(4, 1\); pass seq_lens.flatten\(\)"):
        paged_attention(q, k_pages, v_pages, table, lens[:, None])
    with pytest.raises(ValueError, match=r"seq_lens must be \(B,\) = \(4,\), one length per sequence, got shape \(\)"):
        paged_attention(q, k_pages, v_pages, table, lens[0])
    with pytest.raises(ValueError, match=r"block_table\[0\] names page 0 among the 4 pages its 14 keys fill, but "
                                         r"the pool \(k_pages, v_pages\) has no pages"):
        paged_attention(q, k_pages[:0], v_pages[:0], table, lens)
    for flag in (1, 0, None, torch.tensor(True)):
        with pytest.raises(TypeError, match=rf"share_prefix must be 'auto', True or False, got {type(flag).__name__}"):
            paged_attention(q, k_pages, v_pages, table, lens, share_prefix=flag)


@pytest.mark.parametrize("name", ["plain", "window", "softcap + sinks"])
@pytest.mark.parametrize("share", [False, True], ids=["apart", "shared"])
def test_choose_backends_names_the_kernel_of_each_call_that_runs(name, share):
    """What mha.dispatch reports for a paged step: each call's kernel, in the order they run."""
    k_pages, v_pages = pools(2, 8, 8)
    q = torch.randn(4, 4, 2, 8, dtype=torch.float64)
    with headwise.trace() as t:
        paged_attention(q, k_pages, v_pages, torch.tensor(TABLE), LENS, share_prefix=share, **OPTIONS[name])
    ran = [s.note.split("'")[1] for s in t.stages if s.name == "kernel"]
    calls = paged.choose_backends(q, k_pages, v_pages, TABLE, LENS, share_prefix=share, **OPTIONS[name])
    assert [d.backend for *_, d in calls] == ran and len(ran) == (5 if share and name != "window" else 4)
    assert [(rows, keys) for _, rows, keys, _ in calls][:2] == ([(2 * 3 * 2, 8), (2, 6)] if share and name != "window"
                                                                else [(2, 14), (2, 10)])


def test_refusals_name_the_values():
    k_pages, v_pages = pools(2, 8, 8)
    q = torch.randn(4, 4, 1, 8, dtype=torch.float64)
    table, lens = torch.tensor(TABLE), torch.tensor(LENS)
    with pytest.raises(ValueError, match=r"k_pages must be a 4-D tensor \(N, Hkv, P, D\), got \(16, 2, 4\)"):
        paged_attention(q, k_pages[..., 0], v_pages, table, lens)
    with pytest.raises(ValueError, match=r"must agree on \(N, Hkv, P\)"):
        paged_attention(q, k_pages, v_pages[:8], table, lens)
    with pytest.raises(TypeError, match="block_table must be an integer tensor"):
        paged_attention(q, k_pages, v_pages, table.double(), lens)
    with pytest.raises(ValueError, match=r"block_table must be \(B, max_pages\) = \(4, max_pages\)"):
        paged_attention(q, k_pages, v_pages, table[:2], lens)
    with pytest.raises(TypeError, match="seq_lens must be an integer tensor"):
        paged_attention(q, k_pages, v_pages, table, lens.float())
    with pytest.raises(ValueError, match=r"seq_lens must hold one length per sequence of q, \(B,\) = \(4,\)"):
        paged_attention(q, k_pages, v_pages, table, [3, 4])
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 21 must lie in T..max_pages \* page_size = 1..20"):
        paged_attention(q, k_pages, v_pages, table, [14, 21, 19, 13])
    with pytest.raises(ValueError, match=r"seq_lens\[0\] = 0 must lie in T"):
        paged_attention(q, k_pages, v_pages, table, [0, 10, 19, 13])
    bad = table.clone()
    bad[1, 2] = 16
    with pytest.raises(ValueError, match=r"block_table\[1\] names page 16 .* outside the pool's 0..15"):
        paged_attention(q, k_pages, v_pages, bad, lens)
    with pytest.raises(ValueError, match="share_prefix must be 'auto', True or False, got 'yes'"):
        paged_attention(q, k_pages, v_pages, table, lens, share_prefix="yes")
    with pytest.raises(ValueError, match="sink_tokens=1 keeps the first keys visible under a sliding window"):
        paged_attention(q, k_pages, v_pages, table, lens, sink_tokens=1)  # headwise.attention's own checks
    with pytest.raises(TypeError, match="q, k, v dtypes differ"):
        paged_attention(q.float(), k_pages, v_pages, table, lens)


@pytest.mark.parametrize("Hkv", [4, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("T", [1, 6], ids=["decode, 2 shared pages", "T=6, 1 shared page"])
def test_a_value_pool_of_vllm_layout_gives_the_reference_through_a_shared_prefix(Hkv, T):
    """vLLM keeps values as (N, Hkv, Dv, P).transpose(-1, -2), last stride P: the shared prefix's
    lse path gives the reference, lse and gradients too (one shared page is read as a view of
    the pool with that stride)."""
    k_pages, v_pages = pools(Hkv, 8, 8)
    k_pages = k_pages.requires_grad_()
    v_t = v_pages.transpose(-1, -2).contiguous().requires_grad_()  # (N, Hkv, Dv, P)
    v_pages = v_t.transpose(-1, -2)  # (N, Hkv, P, Dv)
    q = torch.randn(4, 4, T, 8, dtype=torch.float64, requires_grad=True)
    out, lse = paged_attention(q, k_pages, v_pages, torch.tensor(TABLE), torch.tensor(LENS), share_prefix=True,
                               return_lse=True)
    ref, ref_lse = reference(q, k_pages, v_pages, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum() + lse.sum(), (q, k_pages, v_t))
    ref_grads = torch.autograd.grad((ref * weights).sum() + ref_lse.sum(), (q, k_pages, v_t))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)

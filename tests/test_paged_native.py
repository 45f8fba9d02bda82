"""The native paged kernel (headwise.paged_native) against the float64 reference, on block
tables as a pool leaves them after churn; the same bits whatever the pages' order, page size
or batch (issue 37); the fallback where the extension is not built.

Legend: B batch, H query heads, Hkv key/value heads, T new tokens, N pages, P page size,
L a sequence's keys, D head dim of q and k, Dv of v.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from conftest import reference_attention
from headwise import native, paged, paged_native
from headwise.paged import paged_attention

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"no native extension: {native.unavailable()}")

H, D, Dv = 4, 20, 12  # D not a multiple of the kernel's 16 lanes: its remainder loop runs too


def churned_pool(lens: list[int], Hkv: int, P: int, dtype, gen: torch.Generator, spare: int = 5):
    """Pools of N pages with every sequence's keys on pages of a random permutation, dealt
    round-robin (the sequences' pages interleave, as a pool holds them after requests came
    and went); every slot no sequence reads (free pages, slots past a length) is NaN.
    Returns (k_pages (N, Hkv, P, D), v_pages (N, Hkv, P, Dv), table (B, W), keys, values),
    keys[b] (1, Hkv, L, D) and values[b] the sequence's own keys in order."""
    need = [-(-L // P) for L in lens]
    N = sum(need) + spare
    perm = torch.randperm(N, generator=gen).tolist()
    rows: list[list[int]] = [[] for _ in lens]
    deal = [b for i in range(max(need)) for b in range(len(lens)) if i < need[b]]
    for b, page in zip(deal, perm, strict=False):
        rows[b].append(page)
    W = max(need)
    table = torch.tensor([r + [-1] * (W - len(r)) for r in rows])
    k_pages = torch.full((N, Hkv, P, D), float("nan"), dtype=dtype)
    v_pages = torch.full((N, Hkv, P, Dv), float("nan"), dtype=dtype)
    keys, values = [], []
    for b, L in enumerate(lens):
        k, v = torch.randn(1, Hkv, L, D, generator=gen).to(dtype), torch.randn(1, Hkv, L, Dv, generator=gen).to(dtype)
        place(k_pages, rows[b], k)
        place(v_pages, rows[b], v)
        keys.append(k)
        values.append(v)
    return k_pages, v_pages, table, keys, values


def place(pool, pages: list[int], x):
    """Write x (1, Hkv, L, D) into the pool's pages ``pages``, page after page."""
    P = pool.shape[2]
    for i in range(x.shape[2]):
        pool[pages[i // P], :, i % P] = x[0, :, i]


def ran(fn):
    """The backends of the kernel stages a call records."""
    with headwise.trace() as t:
        result = fn()
    return result, [s.note.split("'")[1] for s in t.stages if s.name == "kernel"]


LENS = [70, 3, 33, 129, 16]  # partial last pages, one shorter than a key block, one of exactly 129


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("T", [1, 3], ids=["decode", "T=3"])
@pytest.mark.parametrize("P", [1, 16, 7])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "not causal"])
def test_shuffled_tables_after_churn_equal_the_reference(dtype, Hkv, T, P, causal):
    gen = torch.Generator().manual_seed(P * 10 + T)
    k_pages, v_pages, table, keys, values = churned_pool(LENS, Hkv, P, dtype, gen)
    q = torch.randn(len(LENS), H, T, D, generator=gen).to(dtype)
    (out, lse), kernels = ran(lambda: paged_attention(q, k_pages, v_pages, table, torch.tensor(LENS),
                                                      is_causal=causal, scale=0.3, return_lse=True))
    assert kernels == [paged_native.KERNEL] and out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()  # the NaN slots never leak
    for b in range(len(LENS)):
        ref = reference_attention(q[b:b + 1], keys[b], values[b], is_causal=causal, scale=0.3)[0]
        ref_lse = torch.logsumexp(_scores(q[b:b + 1], keys[b], causal), dim=-1)
        if dtype == torch.float32:
            torch.testing.assert_close(out[b:b + 1].double(), ref, rtol=0, atol=2e-6)
            torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=0, atol=2e-6)
        else:  # at most twice the error of the plain computation in bf16 (STYLE.md)
            plain = headwise.attention(q[b:b + 1], keys[b], values[b], is_causal=causal, scale=0.3, backend="matmul")
            bound = 2 * (plain.double() - ref).abs().max().item() + 1e-3
            assert (out[b:b + 1].double() - ref).abs().max().item() <= bound
            torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, rtol=0, atol=1e-5)


def _scores(q, k, causal: bool):
    """The float64 (1, H, T, L) scores at scale 0.3, -inf where causal excludes a key."""
    T, L, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2) * 0.3
    if causal:
        s = s.masked_fill(torch.arange(L)[None, :] > torch.arange(T)[:, None] + L - T, float("-inf"))
    return s


def test_a_value_pool_with_strided_rows_and_an_int32_table():
    """vLLM keeps values as (N, Hkv, Dv, P).transpose(-1, -2): the kernel reads them by stride."""
    gen = torch.Generator().manual_seed(1)
    k_pages, v_pages, table, keys, values = churned_pool(LENS, 2, 16, torch.float32, gen)
    v_strided = v_pages.transpose(-1, -2).contiguous().transpose(-1, -2)  # (N, Hkv, P, Dv), last stride P
    q = torch.randn(len(LENS), H, 2, D, generator=gen)
    out = paged_attention(q, k_pages, v_strided, table.int(), LENS)
    assert torch.equal(out, paged_attention(q, k_pages, v_pages, table, LENS))
    for b in range(len(LENS)):
        ref = reference_attention(q[b:b + 1], keys[b], values[b], is_causal=True)[0]
        torch.testing.assert_close(out[b:b + 1].double(), ref, rtol=0, atol=2e-6)


def one_sequence_ways(dtype, T: int):
    """One sequence's result (B=1 slice) computed in five layouts, with its keys and queries fixed."""
    gen = torch.Generator().manual_seed(7)
    L, Hkv = 150, 2
    k, v = torch.randn(1, Hkv, L, D, generator=gen).to(dtype), torch.randn(1, Hkv, L, Dv, generator=gen).to(dtype)
    q = torch.randn(1, H, T, D, generator=gen).to(dtype)
    results = {}
    for P, order in ((16, "contiguous"), (16, "shuffled"), (5, "shuffled"), (64, "contiguous"), (1, "shuffled")):
        n = -(-L // P)
        pages = list(range(n)) if order == "contiguous" else torch.randperm(n + 3, generator=gen)[:n].tolist()
        k_pages = torch.full((n + 3, Hkv, P, D), float("nan"), dtype=dtype)
        v_pages = torch.full((n + 3, Hkv, P, Dv), float("nan"), dtype=dtype)
        place(k_pages, pages, k)
        place(v_pages, pages, v)
        results[f"P={P} {order}"] = paged_attention(q, k_pages, v_pages, torch.tensor([pages]), [L], return_lse=True)
    # a contiguous (B, Hkv, L, D) cache is a pool of B pages of L keys, table [[0], [1], ...] (issue 37's route)
    results["a contiguous cache"] = paged_attention(q, k, v, torch.tensor([[0]]), [L], return_lse=True)
    # in a batch, third of five, the others of other lengths on interleaved pages
    others = [40, 300, 7, 90]
    k_pages, v_pages, table, _, _ = churned_pool([*others[:2], L, *others[2:]], Hkv, 16, dtype, gen)
    rows = table[2, :-(-L // 16)].tolist()
    place(k_pages, rows, k)
    place(v_pages, rows, v)
    before, after = (torch.randn(2, H, T, D, generator=gen).to(dtype) for _ in range(2))
    qs = torch.cat([before, q, after])
    out, lse = paged_attention(qs, k_pages, v_pages, table, [*others[:2], L, *others[2:]], return_lse=True)
    results["third in a batch"] = (out[2:3], lse[2:3])
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 4], ids=["decode", "T=4"])
def test_a_sequence_gets_the_same_bits_whatever_its_pages_order_page_size_or_batch(dtype, T):
    results = one_sequence_ways(dtype, T)
    first_out, first_lse = results.pop("P=16 contiguous")
    for name, (out, lse) in results.items():
        assert torch.equal(out, first_out), name
        assert torch.equal(lse, first_lse), name


def forks(dtype, P: int, T: int):
    """Four forks of one prompt (3 or 4 shared pages) and a fifth sequence, on shuffled pages:
    (q, k_pages, v_pages, table, lens, rows)."""
    gen = torch.Generator().manual_seed(3)
    prefix_pages, N, Hkv = 3 if P == 12 else 4, 80, 2
    perm = torch.randperm(N, generator=gen).tolist()
    prefix, perm = perm[:prefix_pages], perm[prefix_pages:]
    lens = [prefix_pages * P + n for n in (5, 20, 1 + T, 33)]
    rows = []
    for L in lens:
        own = -(-L // P) - prefix_pages
        rows.append(prefix + perm[:own])
        perm = perm[own:]
    lens.append(50)  # one sequence that shares nothing
    rows.append(perm[:-(-50 // P)])
    W = max(len(r) for r in rows)
    table = torch.tensor([r + [-1] * (W - len(r)) for r in rows])
    k_pages = torch.randn(N, Hkv, P, D, generator=gen).to(dtype)
    v_pages = torch.randn(N, Hkv, P, Dv, generator=gen).to(dtype)
    q = torch.randn(len(lens), H, T, D, generator=gen).to(dtype)
    return q, k_pages, v_pages, table, lens, rows


FORKS = pytest.mark.parametrize(("P", "T"), [(16, 1), (12, 3)], ids=["P=16 decode", "P=12 T=3 (36 keys: 32 taken)"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@FORKS
def test_a_shared_prefix_on_shuffled_pages_equals_the_reference(dtype, P, T):
    """The prefix attended once (the members' rows stacked, a matrix product), the rest by the
    kernel, merged by log-sum-exp: the reference, and what choose_backends lists."""
    q, k_pages, v_pages, table, lens, rows = forks(dtype, P, T)
    (shared, lse), kernels = ran(lambda: paged_attention(q, k_pages, v_pages, table, lens, share_prefix=True,
                                                         return_lse=True))
    calls = paged.choose_backends(q, k_pages, v_pages, rows, lens, share_prefix=True)
    assert kernels == [d.backend for *_, d in calls] and kernels[1:] == [paged_native.KERNEL] * 2
    assert calls[0][0] == "the shared prefix of sequences [0, 1, 2, 3]" and calls[0][2] == (64 if P == 16 else 32)
    apart, lse_apart = paged_attention(q, k_pages, v_pages, table, lens, share_prefix=False, return_lse=True)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(shared, apart, rtol=0, atol=tol)
    torch.testing.assert_close(lse, lse_apart, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-4)
    Hkv = k_pages.shape[1]
    for b, L in enumerate(lens):
        pages = torch.tensor(rows[b])
        k = k_pages[pages].transpose(0, 1).reshape(1, Hkv, -1, D)[:, :, :L]
        v = v_pages[pages].transpose(0, 1).reshape(1, Hkv, -1, Dv)[:, :, :L]
        ref = reference_attention(q[b:b + 1], k, v, is_causal=True)[0]
        torch.testing.assert_close(shared[b:b + 1].double(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@FORKS
def test_a_folded_prefix_gives_the_bits_of_private_sequences(dtype, P, T):
    """paged_native.attend without a prefix function folds the prefix in: its state after the
    first S0 keys, computed once for all members, is the state each private pass reaches
    (issue 37's mode will take this path)."""
    q, k_pages, v_pages, table, lens, _ = forks(dtype, P, T)
    groups = paged.shared_prefixes([r[:-(-L // P)] for r, L in zip(table.tolist(), lens, strict=True)], lens, T, P,
                                   min_keys=1)
    assert groups == [([0, 1, 2, 3], 3 if P == 12 else 4)]
    (folded, lse), kernels = ran(lambda: paged_native.attend(q, k_pages, v_pages, table, lens, 0.25, True, groups))
    assert kernels == [paged_native.KERNEL] * 3  # the prefix once, the members past it, the fifth sequence
    private, lse_private = paged_native.attend(q, k_pages, v_pages, table, lens, 0.25, True, [])
    assert torch.equal(folded, private) and torch.equal(lse, lse_private)


def test_choose_backends_lists_the_native_calls_that_run():
    gen = torch.Generator().manual_seed(0)
    k_pages, v_pages, table, _, _ = churned_pool(LENS, 2, 16, torch.float32, gen)
    q = torch.randn(len(LENS), H, 1, D)
    _, kernels = ran(lambda: paged_attention(q, k_pages, v_pages, table, LENS))
    rows = [r[:-(-L // 16)] for r, L in zip(table.tolist(), LENS, strict=True)]
    calls = paged.choose_backends(q, k_pages, v_pages, rows, LENS)
    assert [d.backend for *_, d in calls] == kernels == [paged_native.KERNEL]
    what, n_rows, keys, d = calls[0]
    assert (what, n_rows, keys) == ("every sequence over its own pages", len(LENS) * H, max(LENS))
    assert "block table" in d.reason and "per-sequence kernels" in d.passed_over


@pytest.mark.parametrize(("change", "why"), [
    ({"window": 8}, "window: the native kernel applies none of them"),
    ({"softcap": 2.0, "sinks": torch.zeros(H)}, "softcap, sinks: the native kernel applies none of them"),
    ({"backend": "sdpa"}, "backend='sdpa' was asked for by name"),
    ({"dtype": torch.float64}, "dtypes torch.float64, torch.float64, torch.float64: the native kernel takes fp32"),
    ({"grad": True}, "gradients are needed: the native kernel has no backward"),
    ({"T": 33}, "T=33 new queries per sequence, above NATIVE_MAX_QUERIES=32: a prefill chunk"),
])
def test_what_the_native_kernel_does_not_serve_runs_the_per_sequence_path_and_says_why(change, why, monkeypatch):
    monkeypatch.setattr(paged, "NATIVE_MAX_QUERIES", 32)  # below the sequences' lengths, so a longer T fits
    gen = torch.Generator().manual_seed(0)
    dtype = change.pop("dtype", torch.float32)
    k_pages, v_pages, table, keys, values = churned_pool([70, 40, 33], 2, 16, dtype, gen)
    q = torch.randn(3, H, change.pop("T", 2), D, dtype=dtype, requires_grad=change.pop("grad", False))
    rows = [r[:-(-L // 16)] for r, L in zip(table.tolist(), [70, 40, 33], strict=True)]
    calls = paged.choose_backends(q, k_pages, v_pages, rows, [70, 40, 33], **change)
    assert all(why in d.passed_over[paged_native.KERNEL] for *_, d in calls) and len(calls) == 3
    out, kernels = ran(lambda: paged_attention(q, k_pages, v_pages, table, [70, 40, 33], **change))
    assert paged_native.KERNEL not in kernels and torch.isfinite(out).all()


def test_page_ids_outside_the_pool_are_refused_by_name_with_the_extension_loaded():
    """_check reads the table through the extension's loop once it is built: the same messages."""
    assert paged.native.loaded() is not None
    gen = torch.Generator().manual_seed(0)
    k_pages, v_pages, table, _, _ = churned_pool(LENS, 2, 16, torch.float32, gen)
    q = torch.randn(len(LENS), H, 1, D)
    bad = table.clone()
    bad[3, 8] = k_pages.shape[0]  # sequence 3's ninth and last page (129 keys)
    with pytest.raises(ValueError, match=rf"block_table\[3\] names page {k_pages.shape[0]} among the 9 pages its "
                                         rf"129 keys fill, outside the pool's 0..{k_pages.shape[0] - 1}"):
        paged_attention(q, k_pages, v_pages, bad, LENS)
    bad[3, 8], bad[1, 0] = table[3, 8], -1
    with pytest.raises(ValueError, match=r"block_table\[1\] names page -1 among the 1 pages its 3 keys fill"):
        paged_attention(q, k_pages, v_pages, bad, LENS)
    bad[1, 0], bad[1, 1] = table[1, 0], -7  # past sequence 1's one page: never read
    assert torch.equal(paged_attention(q, k_pages, v_pages, bad, LENS), paged_attention(q, k_pages, v_pages, table,
                                                                                           LENS))


def test_the_bits_do_not_depend_on_the_threads():
    """Tasks (sequence, kv head, row tile) go to whichever thread is free: the same bits."""
    gen = torch.Generator().manual_seed(5)
    k_pages, v_pages, table, _, _ = churned_pool([300, 40, 1000, 7, 129, 64], 2, 16, torch.float32, gen)
    q = torch.randn(6, H, 3, D, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(paged_attention(q, k_pages, v_pages, table, [300, 40, 1000, 7, 129, 64], return_lse=True))
    finally:
        torch.set_num_threads(threads)
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])

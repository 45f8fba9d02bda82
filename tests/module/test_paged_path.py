"""MultiHeadAttention through a PagedKVCache: ragged batches decoded together equal each
sequence's own full causal forward, in float64, for every option the module has.

Legend: B sequences, T new positions, E embed dim.
"""

from __future__ import annotations

import re

import pytest
import torch

import headwise

E = 32
MODULES = {
    "GQA + rope": dict(num_kv_heads=2, rope=True),
    "MQA + qk norm": dict(num_kv_heads=1, qk_norm="rms", rope=True),
    "window + sink tokens": dict(num_kv_heads=2, window=4, sink_tokens=2),
    "alibi": dict(alibi=True),
    "softcap + sinks": dict(num_kv_heads=2, softcap=2.0, sinks=True),
    "value head dim": dict(num_kv_heads=2, v_head_dim=6),
}


def module(**kwargs) -> headwise.MultiHeadAttention:
    mha = headwise.MultiHeadAttention(E, 4, is_causal=True, dtype=torch.float64, **kwargs).eval()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    return mha


def nan_cache(mha, num_pages=64, page_size=4) -> headwise.PagedKVCache:
    cache = headwise.PagedKVCache.for_module(mha, num_pages=num_pages, page_size=page_size)
    cache.k_pages.fill_(float("nan"))  # free pages and slots past the lengths: NaN, never read
    cache.v_pages.fill_(float("nan"))
    return cache


@pytest.mark.parametrize("name", list(MODULES))
def test_ragged_decoding_equals_each_sequences_full_forward(name):
    mha = module(**MODULES[name])
    cache = nan_cache(mha)
    prompts = [3, 9, 6]
    xs = [torch.randn(1, n + 4, E, dtype=torch.float64) for n in prompts]
    seqs = [cache.add() for _ in prompts]
    with torch.no_grad():
        for s, x, n in zip(seqs, xs, prompts, strict=True):  # chunked prefill: two calls of its own
            mha(x[:, :n - 2], cache=cache.batch([s]))
            mha(x[:, n - 2:n], cache=cache.batch([s]))
        steps = [mha(torch.cat([x[:, n:n + 1] for x, n in zip(xs, prompts, strict=True)]), cache=cache)]
        steps.append(mha(torch.cat([x[:, n + 1:n + 4] for x, n in zip(xs, prompts, strict=True)]), cache=cache))
        for b, (x, n) in enumerate(zip(xs, prompts, strict=True)):  # T = 3 (speculative verification)
            full = mha(x, is_causal=True)
            got = torch.cat([y[b:b + 1] for y in steps], dim=1)
            torch.testing.assert_close(got, full[:, n:], rtol=0, atol=1e-12)
    assert cache.seq_lens(seqs).tolist() == [n + 4 for n in prompts]


@pytest.mark.parametrize("name", ["GQA + rope", "softcap + sinks"])
def test_forks_share_the_prompt_and_decode_apart(name, monkeypatch):
    from headwise import paged

    monkeypatch.setattr(paged, "SHARED_PREFIX_MIN_KEYS", 1)  # share even this small prompt
    mha = module(**MODULES[name])
    cache = nan_cache(mha)
    prompt = torch.randn(1, 10, E, dtype=torch.float64)
    root = cache.add()
    with torch.no_grad():
        mha(prompt, cache=cache.batch([root]))
        forks = [root] + [cache.fork(root) for _ in range(3)]
        assert cache.pages_in_use == 3
        tails = torch.randn(4, 5, E, dtype=torch.float64)
        steps = [mha(tails[:, t:t + 1], cache=cache.batch(forks)) for t in range(5)]
        # the shared partial page copied by the first three writers (the last holds it alone), one new page each
        assert cache.pages_in_use == 3 + 3 + 4
        for b in range(4):
            full = mha(torch.cat([prompt, tails[b:b + 1]], dim=1), is_causal=True)
            torch.testing.assert_close(torch.cat([y[b:b + 1] for y in steps], dim=1), full[:, 10:], rtol=0,
                                       atol=1e-12)


def test_refusals_change_nothing():
    mha = module(num_kv_heads=2)
    cache = headwise.PagedKVCache.for_module(mha, num_pages=3, page_size=4)
    a, b = cache.add(), cache.add()
    x = torch.randn(2, 1, E, dtype=torch.float64)
    with torch.no_grad():
        mha(torch.randn(2, 4, E, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match="does not take attention_mask"):
            mha(x, torch.ones(2, 1, dtype=torch.bool), cache=cache)
        with pytest.raises(ValueError, match="does not take need_weights"):
            mha(x, cache=cache, need_weights=True)
        with pytest.raises(ValueError, match=r"does not take context="):
            mha(x, context=x, cache=cache)
        with pytest.raises(ValueError, match="does not take mask_mod / score_mod"):
            mha(x, cache=cache, mask_mod=headwise.masks.causal)
        with pytest.raises(ValueError, match=r"x has 2 rows but the paged batch names 1 sequences \[0\]"):
            mha(x, cache=cache.batch([a]))
        with pytest.raises(ValueError, match="needs 2 free pages for this step"):
            mha(x, cache=cache)
        other = headwise.PagedKVCache(4, 4, 1, 8, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"the paged cache holds kv_heads=1, .* this module needs kv_heads=2"):
            mha(torch.randn(0, 1, E, dtype=torch.float64), cache=other)
        mha.backend = "sdpa"
        mha.softcap = 2.0  # refused by the kernel after the append: rolled back
        with pytest.raises(ValueError, match="softcap"):
            mha(torch.randn(1, 1, E, dtype=torch.float64), cache=cache.batch([b]))
        assert cache.seq_lens([a, b]).tolist() == [4, 4] and cache.pages_in_use == 2


@pytest.mark.parametrize(("change", "message"), [
    ("mask", "attention_mask: each sequence's length is its own in the cache, so there is no padding to mask; step "
             "sequences of other lengths of T in calls of their own"),
    ("weights", "need_weights: no (B, H, T, Sk) weights exist across sequences of other lengths"),
    ("context", "context= (cross-attention): a paged cache holds self-attention keys"),
    ("call score_mod", "mask_mod / score_mod: use a dense cache (mha.new_cache) for rules as functions"),
    ("module mask_mod", "mask_mod / score_mod: use a dense cache (mha.new_cache) for rules as functions"),
    ("module score_mod", "mask_mod / score_mod: use a dense cache (mha.new_cache) for rules as functions"),
    ("dropout", "dropout=0.5 in training mode: decode in eval mode (mha.eval())"),
])
def test_each_refusal_of_a_paged_step_in_full(change, message):
    mha = module()
    cache = headwise.PagedKVCache.for_module(mha, num_pages=4, page_size=4)
    cache.add()
    x = torch.randn(1, 1, E, dtype=torch.float64)
    kwargs: dict = {}
    if change == "mask":
        kwargs["attention_mask"] = torch.ones(1, 1, dtype=torch.bool)
    elif change == "weights":
        kwargs["need_weights"] = True
    elif change == "context":
        kwargs["context"] = x
    elif change == "call score_mod":
        kwargs["score_mod"] = lambda s, b, h, q, k: s
    elif change == "module mask_mod":
        mha.mask_mod = headwise.masks.causal
    elif change == "module score_mod":
        mha.score_mod = lambda s, b, h, q, k: s
    else:
        mha.dropout = 0.5
        mha.train()
    with torch.no_grad(), pytest.raises(ValueError, match="^" + re.escape(f"a paged cache step does not take {message}")
                                        + "$"):
        mha(x, cache=cache, **kwargs)
    assert cache.seq_lens([0]).tolist() == [0]


def test_a_pool_of_another_module_is_refused_with_both_layouts():
    mha = module(num_kv_heads=2)
    other = headwise.PagedKVCache(4, 4, 1, 6, value_dim=5, dtype=torch.float32)
    other.add()
    with torch.no_grad(), pytest.raises(ValueError, match="^" + re.escape(
            "the paged cache holds kv_heads=1, head_dim=6, value_dim=5, torch.float32 on cpu; this module needs "
            "kv_heads=2, head_dim=8, value_dim=8, torch.float64 on cpu: make it with PagedKVCache.for_module(mha, "
            "...)") + "$"):
        mha(torch.randn(1, 1, E, dtype=torch.float64), cache=other)
    wide = module(v_head_dim=6)  # each of the three sizes named as the module has it
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(
            "this module needs kv_heads=4, head_dim=8, value_dim=6, torch.float64 on cpu")):
        wide(torch.randn(1, 1, E, dtype=torch.float64), cache=other)


def test_a_paged_step_with_gradients_on_decodes_and_backward_says_why_it_cannot():
    """Decoding without torch.no_grad() works, as with transformers' caches: the outputs equal the no_grad
    steps'; backward cannot reach the keys written into the pool in place, and says so, naming the cache and
    the remedy (it was a refusal at the step)."""
    mha = module()
    pools = [headwise.PagedKVCache.for_module(mha, num_pages=8, page_size=4) for _ in range(2)]
    for pool in pools:
        pool.add(), pool.add()
    x = torch.randn(2, 3, E, dtype=torch.float64)
    with torch.no_grad():
        want = [mha(x[:, :2], cache=pools[0]), mha(x[:, 2:], cache=pools[0])]
    got = [mha(x[:, :2], cache=pools[1]), mha(x[:, 2:], cache=pools[1])]
    for g, w in zip(got, want, strict=True):
        assert g.requires_grad
        torch.testing.assert_close(g, w)  # (no_grad may take the fused path: the same to rounding)
    torch.testing.assert_close(pools[1].k_pages, pools[0].k_pages)
    assert not pools[1].k_pages.requires_grad
    with pytest.raises(RuntimeError, match="^" + re.escape(
            "backward through a PagedKVCache step: the step wrote its keys and values into the pool in place, "
            "outside autograd's graph, so their gradients cannot be taken; decode under torch.no_grad() (or "
            "torch.inference_mode()), or train without a cache") + r" \(a plain forward"):
        got[1].sum().backward()


def test_a_traced_paged_step_records_its_input():
    mha = module()
    cache = headwise.PagedKVCache.for_module(mha, num_pages=4, page_size=4)
    cache.add(), cache.add()
    with torch.no_grad():
        mha(torch.randn(2, 2, E, dtype=torch.float64), cache=cache)
        with headwise.trace() as t:
            mha(torch.randn(2, 1, E, dtype=torch.float64), cache=cache)
    first = t.stages[0]
    assert (first.name, first.shape, first.note) == ("input", (2, 1, E), "x: (B, T, E), the next T positions of B "
                                                                         "paged sequences")
    assert t.names()[-2:] == ["merge heads", "output projection"]


def test_a_paged_step_under_autocast_attends_in_the_pages_dtype():
    """Under torch.autocast the projections give bfloat16; the pages keep the module's dtype,
    and the step writes and attends in it (it failed on the dtypes)."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, 4, is_causal=True, num_kv_heads=2, rope=True).eval()
    ref = headwise.MultiHeadAttention(E, 4, is_causal=True, num_kv_heads=2, rope=True, dtype=torch.float64).eval()
    ref.load_state_dict(mha.state_dict())
    cache = headwise.PagedKVCache.for_module(mha, num_pages=8, page_size=4)
    seq = cache.add()
    x = torch.randn(1, 9, E)
    with torch.no_grad():
        want = ref(x.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = torch.cat([mha(x[:, :6], cache=cache.batch([seq]))]
                            + [mha(x[:, t:t + 1], cache=cache.batch([seq])) for t in range(6, 9)], dim=1)
    assert got.dtype == torch.bfloat16 and cache.k_pages.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_a_paged_step_takes_the_calls_causal_flag():
    """is_causal given per call overrides the module's on the paged path too: a non-causal
    prompt on a causal module equals the module's full non-causal forward."""
    mha = module()
    cache = headwise.PagedKVCache.for_module(mha, num_pages=4, page_size=4)
    seq = cache.add()
    x = torch.randn(1, 5, E, dtype=torch.float64)
    with torch.no_grad():
        got = mha(x, cache=cache.batch([seq]), is_causal=False)
        torch.testing.assert_close(got, mha(x, is_causal=False), rtol=0, atol=1e-12)
        assert not torch.allclose(got, mha(x), rtol=0, atol=1e-6)


def test_a_module_with_dropout_decodes_through_pages_in_eval_mode():
    """Dropout is refused only in training mode: in eval a module built with dropout decodes."""
    mha = module(dropout=0.25)
    cache = headwise.PagedKVCache.for_module(mha, num_pages=4, page_size=4)
    seq = cache.add()
    x = torch.randn(1, 5, E, dtype=torch.float64)
    with torch.no_grad():
        got = torch.cat([mha(x[:, :3], cache=cache.batch([seq])), mha(x[:, 3:], cache=cache.batch([seq]))], dim=1)
        torch.testing.assert_close(got, mha(x), rtol=0, atol=1e-12)


def churned_cache(mha, num_pages, page_size=4, seed=0):
    """A pool left in holes of one page: a sequence of one page on each page, every other one
    freed, so the next sequences take scattered pages. Returns the cache and a survivor."""
    cache = headwise.PagedKVCache.for_module(mha, num_pages=num_pages, page_size=page_size)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        cache.k_pages.copy_(torch.randn(cache.k_pages.shape, generator=gen, dtype=torch.float64))
        cache.v_pages.copy_(torch.randn(cache.v_pages.shape, generator=gen, dtype=torch.float64))
        seqs = [cache.add() for _ in range(num_pages)]
        mha(torch.randn(num_pages, page_size, E, generator=gen, dtype=torch.float64), cache=cache.batch(seqs))
    for s in seqs:
        if cache.pages(s)[0] % 2 == 0:
            cache.free(s)
    return cache, cache.sequences[0]


def test_an_empty_step_on_a_fork_of_a_full_pool_changes_nothing():
    """T = 0 on a fork sharing a partial page, the pool full: it took a page some sequence
    held, overwrote it (free_pages -1), and the rollback restored the bookkeeping only."""
    mha = module(**MODULES["GQA + rope"])
    cache, _ = churned_cache(mha, num_pages=12)
    a = cache.add()
    x = torch.randn(1, 7, E, dtype=torch.float64)
    with torch.no_grad():
        mha(x[:, :6], cache=cache.batch([a]))
        filler = cache.add()
        mha(torch.randn(1, cache.free_pages * 4, E, dtype=torch.float64), cache=cache.batch([filler]))
        assert cache.free_pages == 0
        b = cache.fork(a)
        pools = cache.k_pages.clone(), cache.v_pages.clone()
        tables = {s: (cache.pages(s), cache.length(s)) for s in cache.sequences}
        out = mha(x[:, 6:6].expand(2, 0, E), cache=cache.batch([b, a]))
        assert out.shape == (2, 0, E)
        assert torch.equal(cache.k_pages, pools[0]) and torch.equal(cache.v_pages, pools[1])
        assert {s: (cache.pages(s), cache.length(s)) for s in cache.sequences} == tables and cache.free_pages == 0
        cache.free(b)
        torch.testing.assert_close(mha(x[:, 6:], cache=cache.batch([a])), mha(x)[:, 6:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["GQA + rope", "softcap + sinks", "window + sink tokens"])
def test_forks_sharing_a_partial_page_step_together_with_the_pages_of_steps_one_at_a_time(name):
    """Two forks and their root share a partial last page on scattered pages, and the pool
    has the two free pages three steps one at a time would take: stepped together they were
    refused as out of pages. Each output equals its sequence's full forward."""
    mha = module(**MODULES[name])
    cache, _ = churned_cache(mha, num_pages=14)
    root = cache.add()
    prompt = torch.randn(1, 10, E, dtype=torch.float64)
    tails = torch.randn(3, 2, E, dtype=torch.float64)
    with torch.no_grad():
        mha(prompt, cache=cache.batch([root]))
        assert cache.pages(root) != list(range(cache.pages(root)[0], cache.pages(root)[0] + 3))
        forks = [cache.fork(root), root, cache.fork(root)]
        filler = cache.add()
        mha(torch.randn(1, (cache.free_pages - 2) * 4, E, dtype=torch.float64), cache=cache.batch([filler]))
        assert cache.free_pages == 2
        out = mha(tails, cache=cache.batch(forks))
        assert cache.free_pages == 0
        for b in range(3):
            full = mha(torch.cat([prompt, tails[b:b + 1]], dim=1), is_causal=True)
            torch.testing.assert_close(out[b:b + 1], full[:, 10:], rtol=0, atol=1e-12)


def kernels_run(mha, x, cache):
    """The backends paged_attention's calls ran, from a trace of the step."""
    with headwise.trace() as t:
        mha(x, cache=cache)
    return [s.note.split("'")[1] for s in t.stages if s.name == "kernel"]


@pytest.mark.parametrize("name", ["GQA + rope", "softcap + sinks", "chunked", "shared prefix"])
def test_dispatch_reports_the_paged_path_and_the_kernel_that_runs(name, monkeypatch):
    """mha.dispatch (and mha.plan) take every cache forward takes: it refused a paged batch."""
    from headwise import paged

    mha = module(**MODULES.get(name, MODULES["GQA + rope"]))
    if name == "chunked":
        mha.backend = "chunked"
    if name == "shared prefix":
        monkeypatch.setattr(paged, "SHARED_PREFIX_MIN_KEYS", 1)
    cache, other = churned_cache(mha, num_pages=24)
    for s in cache.sequences[1:]:  # holes of one page and of three
        cache.free(s)
    root = cache.add()
    with torch.no_grad():
        mha(torch.randn(1, 9, E, dtype=torch.float64), cache=cache.batch([root]))
        seqs = [root, cache.fork(root), other]
        x = torch.randn(3, 2, E, dtype=torch.float64)
        state = {s: (cache.pages(s), cache.length(s)) for s in cache.sequences}, cache.free_pages
        whole = torch.randn(len(cache.sequences), 2, E, dtype=torch.float64)  # the cache: every sequence
        assert mha.plan(whole, cache=cache).path == mha.dispatch(whole, cache=cache).path == "paged"
        d = mha.dispatch(x, cache=cache.batch(seqs))
        assert mha.plan(x, cache=cache.batch(seqs)).path == d.path == "paged"
        assert ({s: (cache.pages(s), cache.length(s)) for s in cache.sequences}, cache.free_pages) == state
        ran = kernels_run(mha, x, cache.batch(seqs))
    assert d.backend == max(set(ran), key=ran.count) and d.backend in d.reason
    assert ("shared prefix" in d.reason) == (name == "shared prefix")
    assert "paged_attention" in d.path_reason and str(d).startswith("path 'paged'")


def test_dispatch_refuses_what_a_paged_step_refuses():
    mha = module()
    cache = headwise.PagedKVCache.for_module(mha, num_pages=2, page_size=4)
    a = cache.add()
    x = torch.randn(1, 1, E, dtype=torch.float64)
    with torch.no_grad():
        with pytest.raises(ValueError, match="a paged cache step does not take attention_mask"):
            mha.dispatch(x, torch.ones(1, 1, dtype=torch.bool), cache=cache)
        with pytest.raises(ValueError, match=r"x has 1 rows but the paged batch names 0 sequences"):
            mha.dispatch(x, cache=cache.batch([]))
        with pytest.raises(ValueError, match="does not take mask_mod / score_mod"):
            mha.plan(x, cache=cache, mask_mod=headwise.masks.causal)
        with pytest.raises(ValueError, match=r"needs 3 free pages for this step \(9 new keys each for sequences "
                                             r"\[0\], pages of 4\) but has 2 of 2"):
            mha.dispatch(torch.randn(1, 9, E, dtype=torch.float64), cache=cache)
    assert mha.dispatch(x, cache=cache.batch([a])).path == "paged"  # gradients on: served (backward says no)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_steps_on_interleaved_pages_run_the_native_kernel_and_equal_the_full_forward(dtype, monkeypatch):
    """fp32 / bf16 on the CPU: the module's steps run headwise.paged_native's kernel (dispatch
    says so) over pages that batched steps interleave, forks of a 40-token prompt sharing it
    (32 keys attended once), and give each sequence's full forward."""
    from headwise import native, paged, paged_native

    if native.load() is None:
        pytest.skip(f"no native extension: {native.unavailable()}")
    monkeypatch.setattr(paged, "SHARED_PREFIX_MIN_KEYS", 1)
    mha = headwise.MultiHeadAttention(E, 4, num_kv_heads=2, rope=True, is_causal=True, dtype=dtype).eval()
    cache = headwise.PagedKVCache.for_module(mha, num_pages=96, page_size=4)
    cache.k_pages.fill_(float("nan"))
    cache.v_pages.fill_(float("nan"))
    xs = [torch.randn(1, n, E, dtype=dtype) for n in (40, 9, 40, 40)]
    xs[2][:, :40], xs[3][:, :40] = xs[0][:, :40], xs[0][:, :40]
    a, b = cache.add(), cache.add()
    with torch.no_grad():
        mha(xs[0][:, :40], cache=cache.batch([a]))
        mha(xs[1][:, :5], cache=cache.batch([b]))
        seqs = [a, b, cache.fork(a), cache.fork(a)]
        tails = torch.randn(4, 6, E, dtype=dtype)
        x = torch.cat([tails[:, :1], tails[:, 1:2]], dim=1)  # T = 2, then decode steps
        d = mha.dispatch(x, cache=cache.batch(seqs))
        # the stacked prefix rows are a matrix product (the call with the most scores), the rest the kernel's
        assert d.backend == "sdpa" and f"-> {paged_native.KERNEL!r}" in d.reason and "shared prefix" in d.reason
        with headwise.trace() as t:
            steps = [mha(x, cache=cache.batch(seqs))]
        assert [s.note.split("'")[1] for s in t.stages if s.name == "kernel"] == ["sdpa", paged_native.KERNEL,
                                                                                  paged_native.KERNEL]
        steps += [mha(tails[:, i:i + 1], cache=cache.batch(seqs)) for i in range(2, 6)]
        assert any(cache.pages(s) != list(range(cache.pages(s)[0], cache.pages(s)[0] + len(cache.pages(s))))
                   for s in seqs)  # the pages interleave
        for i, (s, start) in enumerate(zip(seqs, (40, 5, 40, 40), strict=True)):
            prompt = xs[1][:, :5] if s == b else xs[0][:, :40]
            full = mha(torch.cat([prompt, tails[i:i + 1]], dim=1), is_causal=True)[:, start:]
            got = torch.cat([y[i:i + 1] for y in steps], dim=1)
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, full, rtol=0, atol=1e-5 if dtype == torch.float32 else 3e-2)

"""Paged KV cache targets (issues 27 and 36): a paged decode step, a shared prefix, a ragged batch,
each also with pages where a pool leaves them after requests came and went.

Each target times one decoding step of ``MultiHeadAttention`` (E=1024, H=16, Hkv=4, fp32,
one new token per sequence) both ways in turns (paired repeats, medians of the per-pair
ratios), in one run:

- paged decode: B=16 sequences of 2,048 keys, :class:`headwise.PagedKVCache` against the
  dynamic ``KVCache`` with the same lengths (target: at most 1.1x its time);
- shared prefix: 32 sequences forked from one 4,096-token prefix, 64-token suffixes each,
  the prefix attended once against the same paged step without sharing (target: at least
  3x faster), and the pool's pages in use against the unique tokens (target: at most 1.1x);
- ragged batch: 16 sequences of 64..4,096 keys, one paged step against the dynamic cache
  padded to the longest with a key padding mask (target: at least 1.5x faster).

Keys and values are appended to the caches directly (random, as a prefill would leave
them); every step appends one more position per sequence.

The users' cases (issue 36), each against its baseline in the same run:

- shuffled decode step: ``headwise.paged_attention`` of B=16 sequences of 2,048 keys whose
  block tables are a random permutation of the pool's pages (vLLM's tests use random
  tables), against SDPA over the same keys in one contiguous (B, Hkv, L, D) tensor (target:
  at most 1.2x its time);
- module decode in a pool sized to the work: 16 sequences prefilled with 1,024 random keys
  one at a time, then batched steps, so the steps' new pages interleave across sequences;
  ``MultiHeadAttention`` through that ``PagedKVCache`` against its dynamic ``KVCache``, at
  the first steps and after 512 more (target: at most 1.15x);
- shared prefix and ragged batch with churned pages: the pool first filled with one-page
  requests of which a random three quarters left, so the sequences' pages lie in the holes;
- prefill chunks: the native kernel against the per-sequence kernels for T = 8, 32, 128 new
  queries per sequence, which places ``paged.NATIVE_MAX_QUERIES``.

    python benchmarks/paged.py [--quick] [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import headwise
from headwise import paged
from headwise.calibration import cpu_name

PAGE = 16


def paired_ratio(slow: Callable[[], object], fast: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """Median seconds of ``slow`` and ``fast`` timed in turns, and the median of the per-pair ratios slow / fast."""
    slow(), fast()  # warm up
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((slow, a), (fast, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b, strict=True))


def churned(cache: headwise.PagedKVCache, seed: int = 0) -> headwise.PagedKVCache:
    """The pool as requests that came and went leave it: one-page requests fill it, a random
    three quarters of them leave (the rest are still running), so later pages lie in holes."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [cache.add() for _ in range(cache.num_pages)]
    Hkv, P, D = cache.k_pages.shape[1:]
    cache.append(seqs, torch.randn(len(seqs), Hkv, P, D), torch.randn(len(seqs), Hkv, P, cache.v_pages.shape[-1]))
    for i in torch.randperm(len(seqs), generator=gen)[: len(seqs) * 3 // 4].tolist():
        cache.free(seqs[i])
    return cache


def module(E: int, H: int, Hkv: int) -> headwise.MultiHeadAttention:
    torch.manual_seed(0)
    return headwise.MultiHeadAttention(E, H, num_kv_heads=Hkv, is_causal=True).eval()


def paged_cache(mha, lengths: list[int], spare: int, forks: int = 0, churn: bool = False) -> headwise.PagedKVCache:
    """A pool holding sequences of ``lengths`` random keys, with room for ``spare`` more positions each
    and for ``forks`` more sequences of ``spare`` positions (``churn``: in the holes :func:`churned` leaves)."""
    pages = sum(-(-(n + spare) // PAGE) for n in lengths) + forks * (-(-spare // PAGE) + 1)
    cache = headwise.PagedKVCache.for_module(mha, num_pages=2 * pages * (4 if churn else 1), page_size=PAGE)
    if churn:
        churned(cache)
    for n in lengths:
        seq = cache.add()
        cache.append([seq], torch.randn(1, mha.num_kv_heads, n, mha.head_dim),
                     torch.randn(1, mha.num_kv_heads, n, mha.head_dim))
    return cache


def dynamic_cache(mha, lengths: list[int], spare: int):
    """``KVCache`` of B rows padded to the longest of ``lengths`` (a key padding mask where they differ)."""
    B, L = len(lengths), max(lengths)
    cache = mha.new_cache(B, L + spare)
    k, v = torch.randn(B, mha.num_kv_heads, L, mha.head_dim), torch.randn(B, mha.num_kv_heads, L, mha.head_dim)
    if len(set(lengths)) == 1:
        cache.append(k, v)
    else:  # left padding: every row's next token goes at position L
        mask = torch.arange(L)[None, :] >= torch.tensor([L - n for n in lengths])[:, None]  # (B, L)
        cache.update(k, v, mask)
    return cache


def decode_target(B: int, L: int, E: int, H: int, Hkv: int, repeats: int) -> tuple[str, float, str]:
    mha = module(E, H, Hkv)
    dyn, pc = dynamic_cache(mha, [L] * B, repeats + 2), paged_cache(mha, [L] * B, repeats + 2)
    x = torch.randn(B, 1, E)
    with torch.inference_mode():
        t_dyn, t_paged, ratio = paired_ratio(lambda: mha(x, cache=dyn), lambda: mha(x, cache=pc), repeats)
    return ("paged decode step", 1 / ratio,
            f"paged {t_paged * 1e3:.1f} ms, dynamic KVCache {t_dyn * 1e3:.1f} ms (B={B}, {L} keys each): "
            f"paged / dynamic {1 / ratio:.2f}x (target <= 1.1x)")


def shared_target(B: int, prefix: int, suffix: int, E: int, H: int, Hkv: int,
                  repeats: int, churn: bool = False) -> list[tuple[str, float, str]]:
    mha = module(E, H, Hkv)
    cache = paged_cache(mha, [prefix], repeats + 2 + suffix, forks=B - 1, churn=churn)
    root = cache.sequences[-1]
    seqs = [root] + [cache.fork(root) for _ in range(B - 1)]
    cache.append(seqs, torch.randn(B, Hkv, suffix, mha.head_dim), torch.randn(B, Hkv, suffix, mha.head_dim))
    unique = prefix + B * suffix
    in_use = len(set().union(*(cache.pages(s) for s in seqs)))  # the pages of these sequences
    memory = in_use * PAGE / unique
    x = torch.randn(B, 1, E)
    batch = cache.batch(seqs)

    def unshared():
        saved, paged.SHARED_PREFIX_MIN_KEYS = paged.SHARED_PREFIX_MIN_KEYS, sys.maxsize
        try:
            return mha(x, cache=batch)
        finally:
            paged.SHARED_PREFIX_MIN_KEYS = saved

    with torch.inference_mode():
        t_plain, t_shared, ratio = paired_ratio(unshared, lambda: mha(x, cache=batch), repeats)
    if churn:
        return [("shared prefix, churned", ratio, f"shared {t_shared * 1e3:.1f} ms, without sharing "
                 f"{t_plain * 1e3:.1f} ms ({B} sequences on churned pages): {ratio:.1f}x faster (target >= 3x)")]
    return [("shared prefix step", ratio,
             f"shared {t_shared * 1e3:.1f} ms, without sharing {t_plain * 1e3:.1f} ms ({B} sequences, "
             f"{prefix}-token prefix, {suffix}-token suffixes): {ratio:.1f}x faster (target >= 3x)"),
            ("shared prefix pool", memory,
             f"{in_use} pages of {PAGE} = {in_use * PAGE} slots for {unique} unique tokens, before "
             f"decoding: {memory:.3f}x (target <= 1.1x); a dense cache holds {B * (prefix + suffix)}")]


def ragged_target(lengths: list[int], E: int, H: int, Hkv: int, repeats: int,
                  churn: bool = False) -> tuple[str, float, str]:
    mha = module(E, H, Hkv)
    dyn, pc = dynamic_cache(mha, lengths, repeats + 2), paged_cache(mha, lengths, repeats + 2, churn=churn)
    batch = pc.batch(pc.sequences[-len(lengths):])
    x = torch.randn(len(lengths), 1, E)
    with torch.inference_mode():
        t_dyn, t_paged, ratio = paired_ratio(lambda: mha(x, cache=dyn), lambda: mha(x, cache=batch), repeats)
    return ("ragged batch, churned" if churn else "ragged batch step", ratio,
            f"paged {t_paged * 1e3:.1f} ms, padded dynamic KVCache {t_dyn * 1e3:.1f} ms ({len(lengths)} sequences "
            f"of {min(lengths)}..{max(lengths)} keys): {ratio:.2f}x faster (target >= 1.5x)")


def shuffled_step_target(B: int, L: int, H: int, Hkv: int, D: int, repeats: int) -> tuple[str, float, str]:
    """paged_attention over block tables that are a random permutation of the pool's pages,
    against SDPA over the same keys in one contiguous (B, Hkv, L, D) tensor."""
    gen = torch.Generator().manual_seed(0)
    n = -(-L // PAGE)
    k, v = torch.randn(B, Hkv, n * PAGE, D, generator=gen), torch.randn(B, Hkv, n * PAGE, D, generator=gen)
    table = torch.randperm(B * n, generator=gen).reshape(B, n)  # (B, n) page ids in random order
    k_pages, v_pages = torch.empty(B * n, Hkv, PAGE, D), torch.empty(B * n, Hkv, PAGE, D)
    for pool, x in ((k_pages, k), (v_pages, v)):  # page i of sequence b holds its keys i*P .. i*P + P - 1
        pool[table.flatten()] = x.reshape(B, Hkv, n, PAGE, D).transpose(1, 2).reshape(B * n, Hkv, PAGE, D)
    q = torch.randn(B, H, 1, D, generator=gen)
    lens = torch.full((B,), L)
    k, v = k[:, :, :L].contiguous(), v[:, :, :L].contiguous()
    with torch.inference_mode():
        t_sdpa, t_paged, ratio = paired_ratio(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                              lambda: headwise.paged_attention(q, k_pages, v_pages, table, lens),
                                              repeats)
    return ("shuffled decode step", 1 / ratio,
            f"paged_attention {t_paged * 1e3:.2f} ms over shuffled pages, contiguous SDPA {t_sdpa * 1e3:.2f} ms "
            f"(B={B}, {L} keys each, H={H}, Hkv={Hkv}): {1 / ratio:.2f}x (target <= 1.2x)")


def prefill_chunk_rows(B: int, L: int, H: int, Hkv: int, D: int, chunks: list[int],
                       repeats: int) -> list[tuple[str, float, str]]:
    """The native kernel against the per-sequence kernels (SDPA over each sequence's gathered
    pages) for T new queries per sequence on shuffled pages: where paged.NATIVE_MAX_QUERIES lies."""
    gen = torch.Generator().manual_seed(0)
    n = -(-L // PAGE)
    k_pages, v_pages = torch.randn(B * n, Hkv, PAGE, D, generator=gen), torch.randn(B * n, Hkv, PAGE, D, generator=gen)
    table = torch.randperm(B * n, generator=gen).reshape(B, n)
    rows = []
    saved, paged.NATIVE_MAX_QUERIES = paged.NATIVE_MAX_QUERIES, sys.maxsize  # the native kernel for every T
    try:
        for T in chunks:
            q = torch.randn(B, H, T, D, generator=gen)
            with torch.inference_mode():
                t_seq, t_native, ratio = paired_ratio(
                    lambda q=q: headwise.paged_attention(q, k_pages, v_pages, table, [L] * B, backend="sdpa"),
                    lambda q=q: headwise.paged_attention(q, k_pages, v_pages, table, [L] * B), repeats)
            rows.append((f"prefill chunk T={T}", 1 / ratio,
                         f"native {t_native * 1e3:.2f} ms, per-sequence SDPA {t_seq * 1e3:.2f} ms (B={B}, {L} keys, "
                         f"shuffled pages): native / per-sequence {1 / ratio:.2f}x (NATIVE_MAX_QUERIES="
                         f"{saved} should lie where this crosses 1)"))
    finally:
        paged.NATIVE_MAX_QUERIES = saved
    return rows


def module_pool_target(B: int, prompt: int, E: int, H: int, Hkv: int, repeats: int,
                       later: int) -> list[tuple[str, float, str]]:
    """The module decoding B sequences through a pool sized to the work (prompts prefilled one
    at a time, then batched steps whose new pages interleave), against its dynamic KVCache,
    at the first steps and after ``later`` more."""
    mha = module(E, H, Hkv)
    steps = later + 2 * repeats + 4
    pages = B * -(-(prompt + steps) // PAGE)
    pc = headwise.PagedKVCache.for_module(mha, num_pages=pages, page_size=PAGE)
    for _ in range(B):
        seq = pc.add()
        pc.append([seq], torch.randn(1, Hkv, prompt, mha.head_dim), torch.randn(1, Hkv, prompt, mha.head_dim))
    dyn = dynamic_cache(mha, [prompt] * B, steps)
    x = torch.randn(B, 1, E)
    rows = []
    with torch.inference_mode():
        for when in ("first steps", f"after {later} steps"):
            if when != "first steps":
                for _ in range(later):
                    mha(x, cache=pc), mha(x, cache=dyn)
            t_dyn, t_paged, ratio = paired_ratio(lambda: mha(x, cache=dyn), lambda: mha(x, cache=pc), repeats)
            rows.append(("module pool, " + ("first" if when == "first steps" else "later"), 1 / ratio,
                         f"paged {t_paged * 1e3:.1f} ms, dynamic KVCache {t_dyn * 1e3:.1f} ms ({B} sequences of "
                         f"{prompt}-token prompts, a pool of {pages} pages, {when}): {1 / ratio:.2f}x "
                         "(target <= 1.15x)"))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the targets")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        E, H, Hkv, B, L, shared, lengths, prompt, later = 64, 4, 2, 4, 64, (4, 64, 8), [8, 24, 40, 64], 48, 8
    else:
        E, H, Hkv, B, L, shared, prompt, later = 1024, 16, 4, 16, 2048, (32, 4096, 64), 1024, 512
        lengths = torch.linspace(64, 4096, 16).round().int().tolist()
    print(f"# paged KV cache: {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s), fp32, "
          f"E={E}, H={H}, Hkv={Hkv}, median of {args.repeats} paired repeats")
    rows = [decode_target(B, L, E, H, Hkv, args.repeats), *shared_target(*shared, E, H, Hkv, args.repeats),
            ragged_target(lengths, E, H, Hkv, args.repeats),
            # the users' cases: pages where a pool leaves them
            shuffled_step_target(B, L, H, Hkv, E // H, args.repeats),
            *module_pool_target(B, prompt, E, H, Hkv, args.repeats, later),
            *shared_target(*shared, E, H, Hkv, args.repeats, churn=True),
            ragged_target(lengths, E, H, Hkv, args.repeats, churn=True),
            *prefill_chunk_rows(4, L // 2, H, Hkv, E // H, [t for t in (8, 32, 128) if t <= L // 2], args.repeats)]
    for name, value, note in rows:
        print(f"  {name:<24} {value:>6.2f}  {note}")


if __name__ == "__main__":
    main()

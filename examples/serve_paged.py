"""Serve many prompts together through a paged KV cache, and compare with one request at a time.

    python examples/serve_paged.py [--quick] [--requests 24] [--system 256]

What it does:

1. Builds a small decoder (random weights; the point is the serving, not the text): token
   embeddings, layers of causal ``headwise.MultiHeadAttention`` (grouped-query, rotary)
   and MLPs, each layer with its own ``headwise.PagedKVCache`` (one pool of pages).
2. Prefills a system prompt once. Every request forks it (``cache.fork``: its pages are
   shared, not copied), prefills its own prompt, then decodes greedily until it has its
   number of new tokens. Requests arrive while others are decoding and leave as they
   finish (``cache.free``): each step decodes one token for every running request, of
   whatever lengths, in one batch. The system prompt's pages are attended once per step
   for all the requests that share them (``share_prefix``, merged by log-sum-exp).
3. Serves the same requests one at a time, each with its own contiguous cache
   (``mha.new_cache``), checks that every request got the same tokens, and reports
   tokens/s both ways and the pool's pages against what copies of the system prompt
   would take.

Legend: B running requests, T new positions, E embed dim, V vocabulary.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from torch import nn

import headwise
from headwise.paged import SHARED_PREFIX_MIN_KEYS, shared_prefixes


class Decoder(nn.Module):
    def __init__(self, vocab: int, embed_dim: int, num_heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.attns = nn.ModuleList(headwise.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_heads // 4,
                                                               is_causal=True, rope=True) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.LayerNorm(embed_dim), nn.Linear(embed_dim, 2 * embed_dim),
                                                nn.GELU(), nn.Linear(2 * embed_dim, embed_dim)) for _ in range(layers))
        self.head = nn.Linear(embed_dim, vocab)

    def forward(self, ids: torch.Tensor, caches: list) -> torch.Tensor:
        """ids (B, T) -> logits of the last position (B, V); ``caches``: one per layer (a
        contiguous KV cache, or the layer's paged cache's ``batch([...])`` of B sequences)."""
        x = self.embed(ids)  # (B, T, E)
        for attn, mlp, cache in zip(self.attns, self.mlps, caches, strict=True):
            x = x + attn(x, cache=cache)  # (B, T, E)
            x = x + mlp(x)
        return self.head(x[:, -1])  # (B, V)


class Pools:
    """One PagedKVCache per layer, whose sequences are added, forked and freed together (so
    a sequence has the same id in every layer's pool)."""

    def __init__(self, model: Decoder, num_pages: int, page_size: int):
        self.caches = [headwise.PagedKVCache.for_module(attn, num_pages=num_pages, page_size=page_size)
                       for attn in model.attns]

    def _same(self, ids: list[int]) -> int:
        if len(set(ids)) != 1:
            raise RuntimeError(f"the layers' pools disagree on a sequence id: {ids}")
        return ids[0]

    def add(self) -> int:
        return self._same([c.add() for c in self.caches])

    def fork(self, seq: int) -> int:
        return self._same([c.fork(seq) for c in self.caches])

    def free(self, seq: int) -> None:
        for c in self.caches:
            c.free(seq)

    def batch(self, seqs: list[int]) -> list:
        return [c.batch(seqs) for c in self.caches]


@dataclass
class Request:
    arrival: int  # the decoding step at which it joins
    prompt: torch.Tensor  # (T,)
    new_tokens: int
    out: list[int] = field(default_factory=list)
    seq: int = -1


def make_requests(n: int, vocab: int, gen: torch.Generator) -> list[Request]:
    """Requests with prompts of 3 to 40 tokens and 8 to 32 new tokens, arriving one a step."""
    return [Request(arrival=i, prompt=torch.randint(vocab, (int(torch.randint(3, 41, (), generator=gen)),),
                                                        generator=gen),
                    new_tokens=int(torch.randint(8, 33, (), generator=gen))) for i in range(n)]


@torch.no_grad()
def serve_paged(model: Decoder, system: torch.Tensor, requests: list[Request], pools: Pools) -> dict:
    """Every request through the pools; returns the steps taken and the largest batch."""
    root = pools.add()
    model(system[None], pools.batch([root]))  # the system prompt, prefilled once
    waiting, running, step, widest = list(requests), [], 0, 0
    most_pages = shared = 0
    while waiting or running:
        while waiting and waiting[0].arrival <= step:  # requests join mid-stream
            r = waiting.pop(0)
            r.seq = pools.fork(root)  # shares the system prompt's pages
            r.out.append(int(model(r.prompt[None], pools.batch([r.seq])).argmax()))  # its own prompt
            running.append(r)
        if running:
            last = torch.tensor([[r.out[-1]] for r in running])  # (B, 1)
            nxt = model(last, pools.batch([r.seq for r in running])).argmax(-1)  # (B,): one step for all
            for r, t in zip(running, nxt.tolist(), strict=True):
                r.out.append(t)
            widest = max(widest, len(running))
            shared += bool(_shares_prefix(pools.caches[0], [r.seq for r in running]))
            most_pages = max(most_pages, pools.caches[0].pages_in_use)
            for r in [r for r in running if len(r.out) >= r.new_tokens]:  # finished: leave, pages freed
                pools.free(r.seq)
                running.remove(r)
        step += 1
    return {"steps": step, "widest": widest, "most_pages": most_pages, "shared_steps": shared}


def _shares_prefix(cache: headwise.PagedKVCache, seqs: list[int]) -> list:
    """The groups of ``seqs`` whose shared first pages the step just taken attended once: what
    ``paged_attention(share_prefix="auto")`` finds in their block tables."""
    tables, lens = [cache.pages(s) for s in seqs], [cache.length(s) for s in seqs]
    return shared_prefixes(tables, lens, 1, cache.page_size)


@torch.no_grad()
def serve_one_at_a_time(model: Decoder, system: torch.Tensor, requests: list[Request]) -> list[list[int]]:
    """Each request alone, with contiguous caches: system prompt and prompt, then one token a step."""
    outs = []
    for r in requests:
        length = len(system) + len(r.prompt) + r.new_tokens
        caches = [attn.new_cache(batch_size=1, max_seq_len=length) for attn in model.attns]
        out = [int(model(torch.cat([system, r.prompt])[None], caches).argmax())]
        while len(out) < r.new_tokens:
            out.append(int(model(torch.tensor([[out[-1]]]), caches).argmax()))
        outs.append(out)
    return outs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests: seconds (CI)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--system", type=int, default=256, help="system prompt tokens (a multiple of 16)")
    args = parser.parse_args(argv)
    n, system_len = (10, 256) if args.quick else (args.requests, args.system)
    torch.manual_seed(0)
    vocab, page_size = 256, 16
    model = Decoder(vocab, embed_dim=128, num_heads=8, layers=2).eval()
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(vocab, (system_len,), generator=gen)  # (T,)
    requests = make_requests(n, vocab, gen)
    tokens = sum(r.new_tokens for r in requests)
    print(f"{n} requests (prompts of {min(len(r.prompt) for r in requests)}-{max(len(r.prompt) for r in requests)} "
          f"tokens, {tokens} tokens to generate) after a shared system prompt of {system_len} tokens; "
          f"a decoder of {len(model.attns)} layers, E = 128, 8 query heads, 2 key/value heads")

    pools = Pools(model, num_pages=1024, page_size=page_size)
    start = time.perf_counter()
    served = serve_paged(model, system, requests, pools)
    paged_s = time.perf_counter() - start
    print(f"paged: {served['steps']} steps, up to {served['widest']} requests a step, joining and leaving "
          f"mid-stream: {tokens / paged_s:.0f} tokens/s")
    copies = served["widest"] * (system_len // page_size)
    print(f"  the system prompt was attended once for all running requests in {served['shared_steps']} "
          f"of the decoding steps (share_prefix='auto': where that saves reading {SHARED_PREFIX_MIN_KEYS} "
          f"keys or more)")
    print(f"  the system prompt's {system_len // page_size} pages are shared, not copied: at most "
          f"{served['most_pages']} pages in use per layer (copies of the system prompt alone would take {copies}); "
          f"now {pools.caches[0].pages_in_use} in use (the system prompt's)")

    start = time.perf_counter()
    alone = serve_one_at_a_time(model, system, requests)
    alone_s = time.perf_counter() - start
    same = all(r.out == o for r, o in zip(requests, alone, strict=True))
    print(f"one at a time: {tokens / alone_s:.0f} tokens/s; paged serving ran {alone_s / paged_s:.1f}x as fast")
    print(f"every request got the same tokens both ways: {same}")
    return {"same": same, "tokens": tokens, "served": served, "speedup": alone_s / paged_s,
            "pages_left": pools.caches[0].pages_in_use, "system_pages": system_len // page_size}


if __name__ == "__main__":
    main()

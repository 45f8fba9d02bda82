"""Train a tiny character-level GPT built on headwise.MultiHeadAttention, then sample from it
with the KV cache.

    python examples/train_gpt.py [--quick] [--steps 600] [--text examples/data/lighthouse.txt]

What it does:

1. Reads a small text bundled with the repository (``examples/data/lighthouse.txt``, a
   public-domain story) and turns it into characters: one token per character.
2. Builds a GPT: token embeddings, a few blocks of (LayerNorm, causal
   ``headwise.MultiHeadAttention`` with rotary positions and grouped-query heads,
   LayerNorm, MLP), a last LayerNorm and the output layer. Trains it with AdamW on random
   windows of the text and prints the loss.
3. Samples a continuation of a prompt with one KV cache per layer
   (``mha.new_cache``): the prompt is prefilled in one call, then each new character is
   one step of one position.
4. Checks that generation with the cache is the same as without it: at every step the
   cached model's logits equal those of one causal forward over the whole sequence so far
   (greedy decoding, to 1e-4), so the same characters come out.

Legend: B batch, S sequence length, E embed dim, V vocabulary (the text's characters).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import headwise

TEXT = Path(__file__).resolve().parent / "data" / "lighthouse.txt"


class Block(nn.Module):
    """A pre-norm transformer block whose attention is headwise's."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attn = headwise.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_heads // 2,
                                                is_causal=True, rope=True)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim))

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache=cache)  # (B, S, E); with a cache S is the new positions
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, embed_dim: int, num_heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, vocab)

    def forward(self, ids: torch.Tensor, caches=None) -> torch.Tensor:
        """ids (B, S) -> logits (B, S, V); ``caches``: one KV cache per block, or None."""
        x = self.embed(ids)  # (B, S, E)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))  # (B, S, V)

    def new_caches(self, batch_size: int, max_seq_len: int) -> list:
        return [block.attn.new_cache(batch_size=batch_size, max_seq_len=max_seq_len) for block in self.blocks]


def train(model: GPT, data: torch.Tensor, steps: int, block: int, batch: int, lr: float) -> list[float]:
    """AdamW on random windows of ``data``; returns the loss of every step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    losses = []
    model.train()
    for step in range(steps):
        starts = torch.randint(len(data) - block - 1, (batch,), generator=gen)
        window = torch.stack([data[s:s + block + 1] for s in starts.tolist()])  # (B, S + 1)
        logits = model(window[:, :-1])  # (B, S, V)
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"step {step:4d}: loss {loss.item():.3f}")
    return losses


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, new_tokens: int, *, cached: bool) -> tuple[torch.Tensor, list]:
    """Greedy continuation of ``prompt`` (1, S): with one KV cache per block (prefill, then one
    position a step), or by a causal forward over the whole sequence at every step.

    Returns:
        The tokens (1, S + new_tokens) and each step's last logits (1, V).
    """
    model.eval()
    ids, steps = prompt, []
    caches = model.new_caches(1, prompt.shape[1] + new_tokens) if cached else None
    logits = model(ids, caches)  # (1, S, V): the prompt in one call
    for _ in range(new_tokens):
        last = logits[:, -1]  # (1, V)
        steps.append(last)
        nxt = last.argmax(-1, keepdim=True)  # (1, 1)
        ids = torch.cat([ids, nxt], dim=1)
        logits = model(nxt, caches) if cached else model(ids)  # (1, 1, V) or (1, S', V)
    return ids, steps


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few training steps: seconds (CI)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--prompt", default="The keeper ")
    parser.add_argument("--new-tokens", type=int, default=200)
    args = parser.parse_args(argv)
    steps, new_tokens = (40, 40) if args.quick else (args.steps, args.new_tokens)
    torch.manual_seed(0)

    text = args.text.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])  # (N,) one token per character
    model = GPT(len(chars), embed_dim=64, num_heads=4, layers=2)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.text.name}: {len(text)} characters, vocabulary of {len(chars)}; GPT of {params:,} parameters "
          f"(2 blocks, E = 64, 4 query heads sharing 2 key/value heads, rotary positions)")

    start = time.perf_counter()
    losses = train(model, data, steps, block=64, batch=16, lr=3e-3)
    print(f"trained {steps} steps in {time.perf_counter() - start:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    prompt = torch.tensor([[index[c] for c in args.prompt if c in index]])  # (1, S)
    start = time.perf_counter()
    ids, cached_logits = generate(model, prompt, new_tokens, cached=True)
    took = time.perf_counter() - start
    print(f"sampled {new_tokens} characters with the KV cache in {took:.2f} s:")
    print("  " + repr("".join(chars[i] for i in ids[0].tolist())))

    full_ids, full_logits = generate(model, prompt, new_tokens, cached=False)
    diff = max((a - b).abs().max().item() for a, b in zip(cached_logits, full_logits, strict=True))
    same = torch.equal(ids, full_ids)
    print(f"cached generation vs the uncached forward: same characters {same}, "
          f"max |logits difference| {diff:.1e} over {new_tokens} steps")
    return {"losses": losses, "same": same, "max_diff": diff, "text": "".join(chars[i] for i in ids[0].tolist())}


if __name__ == "__main__":
    main()

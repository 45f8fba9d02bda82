"""The same bits from the sampler and the trainer: a tiny GPT generates a batch of
continuations with the KV cache, then one teacher-forced forward over the generated texts
recomputes every sampled token's logits, and inside ``headwise.batch_invariant()`` the two
agree bit for bit (``torch.equal``). This is what RL fine-tuning needs: the log-probabilities
that the sampler produced, recomputed by the trainer, exactly.

    python examples/same_bits.py [--quick] [--steps 300] [--new-tokens 60]

What it does:

1. Trains the tiny character GPT of ``examples/train_gpt.py`` for a few steps (its MLP and
   output layer are :class:`headwise.invariance.Linear`, ``nn.Linear`` that keeps a row's
   bits inside the mode; its attention is ``headwise.MultiHeadAttention``).
2. The sampler: four prompts of different lengths in one paged KV cache per block, each
   prefilled on its own, then decoded together (a batch of 4, one position a step, sampling
   with a seeded generator at temperature 1), recording the logits of every sampled token.
3. The trainer: the four generated texts, right-padded into one batch, through one causal
   forward; the logits at the same positions, and the log-probabilities of the sampled tokens.
4. Prints, inside the mode and outside it, whether the sampler's and the trainer's logits are
   equal bit for bit, and the largest difference.

Legend: B batch, S sequence length, E embed dim, V vocabulary (the text's characters).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import headwise
from headwise.invariance import Linear

try:  # run as a script from examples/, or imported by the tests
    from train_gpt import GPT, TEXT, train
except ImportError:  # pragma: no cover
    from examples.train_gpt import GPT, TEXT, train


def invariant_linears(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` outside the attention modules as a :class:`headwise.invariance.Linear`
    (the same parameters, no copy); headwise's attention tiles its own projections in the mode."""
    for module in list(model.modules()):
        if isinstance(module, headwise.MultiHeadAttention):
            continue
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                swapped = Linear(child.in_features, child.out_features, bias=child.bias is not None)
                swapped.weight, swapped.bias = child.weight, child.bias
                setattr(module, name, swapped)
    return model


@torch.no_grad()
def sample(model: GPT, prompts: list[torch.Tensor], new_tokens: int, seed: int) -> tuple[list, list]:
    """The sampler: one paged KV cache per block (``headwise.PagedKVCache``), each prompt prefilled
    on its own, then all sequences decoded together, one position a step, their pages
    interleaving in the pool. Returns each sequence's tokens and the logits (new_tokens, V) that
    chose its new tokens."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    pools = [headwise.PagedKVCache.for_module(block.attn, num_pages=64, page_size=8) for block in model.blocks]
    seqs = [[pool.add() for pool in pools] for _ in prompts]  # each sequence's id in every block's pool
    last = [model(p[None], [pool.batch([ids[i]]) for i, pool in enumerate(pools)])[0, -1]
            for p, ids in zip(prompts, seqs, strict=True)]  # B x (V,): each prompt prefilled alone
    tokens, logits = [p.tolist() for p in prompts], [[] for _ in prompts]
    for _ in range(new_tokens):
        for b in range(len(prompts)):
            logits[b].append(last[b])
            tokens[b].append(int(torch.multinomial(F.softmax(last[b].float(), -1), 1, generator=gen)))
        step = torch.tensor([[t[-1]] for t in tokens])  # (B, 1): every sequence's newest token
        batches = [pool.batch([ids[i] for ids in seqs]) for i, pool in enumerate(pools)]
        last = list(model(step, batches)[:, -1])  # (B, 1, V) -> B x (V,): one step of the whole batch
    return tokens, [torch.stack(rows) for rows in logits]


@torch.no_grad()
def teacher_forced(model: GPT, tokens: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """The trainer: every text, right-padded into one batch, through one causal forward; the logits
    (new_tokens, V) at the positions that chose each sampled token."""
    model.eval()
    S = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), S, dtype=torch.long)  # (B, S)
    for b, t in enumerate(tokens):
        ids[b, :len(t)] = torch.tensor(t)
    out = model(ids)  # (B, S, V): padding after each text changes nothing before it (causal)
    return [out[b, n - 1:len(t) - 1] for b, (t, n) in enumerate(zip(tokens, prompt_lens, strict=True))]


def compare(sampled: list[torch.Tensor], forced: list[torch.Tensor]) -> tuple[bool, float, bool]:
    """(logits equal bit for bit, max |difference|, log-probabilities equal bit for bit)."""
    equal = all(torch.equal(a, b) for a, b in zip(sampled, forced, strict=True))
    diff = max((a - b).abs().max().item() for a, b in zip(sampled, forced, strict=True))
    logp = all(torch.equal(F.log_softmax(a, -1), F.log_softmax(b, -1)) for a, b in zip(sampled, forced, strict=True))
    return equal, diff, logp


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few training steps: seconds (CI)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=60)
    args = parser.parse_args(argv)
    steps, new_tokens = (30, 24) if args.quick else (args.steps, args.new_tokens)
    torch.manual_seed(0)

    text = TEXT.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])  # (N,) one token per character
    model = invariant_linears(GPT(len(chars), embed_dim=64, num_heads=4, layers=2))
    losses = train(model, data, steps, block=64, batch=16, lr=3e-3)
    print(f"trained {steps} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    prompts = [torch.tensor([index[c] for c in p if c in index])
               for p in ("The keeper ", "At night the ", "She ", "Out on the rocks, ")]
    results = {}
    for mode in (True, False):
        with headwise.batch_invariant(mode):
            start = time.perf_counter()
            tokens, sampled = sample(model, prompts, new_tokens, seed=1)
            forced = teacher_forced(model, tokens, [len(p) for p in prompts])
            took = time.perf_counter() - start
        equal, diff, logp = compare(sampled, forced)
        where = "inside headwise.batch_invariant()" if mode else "outside the mode"
        print(f"{where}: sampler vs trainer logits equal bit for bit: {equal} (max |difference| {diff:.1e}); "
              f"log-probabilities equal: {logp}; {len(prompts)} sequences x {new_tokens} tokens in {took:.2f} s")
        results[mode] = {"equal": equal, "diff": diff, "logp": logp}
    print("first continuation: " + repr("".join(chars[i] for i in tokens[0])))
    return results


if __name__ == "__main__":
    main()

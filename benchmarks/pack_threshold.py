"""Where dropping padding starts to pay: the thresholds behind "auto".

Two decisions are measured on the same inputs, side by side, over padding shares:

* module: ``MultiHeadAttention`` dense (``backend="sdpa"``) vs packed (``packing=True``,
  projections and attention on the real tokens only): sets ``policy.PACK_MIN_PADDING``;
* kernel: ``headwise.attention`` with a key padding mask, ``sdpa`` vs ``varlen`` (padded
  keys dropped per row): sets ``policy.VARLEN_MIN_PADDING``.

    python benchmarks/pack_threshold.py [--batch 32 --seq 512 --dim 512 --heads 8]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import headwise
from headwise.bench import round_robin_ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    B, S, E, H = args.batch, args.seq, args.dim, args.heads
    gen = torch.Generator().manual_seed(0)
    dense = headwise.MultiHeadAttention(E, H, backend="sdpa")
    packed = headwise.MultiHeadAttention(E, H, packing=True)
    packed.load_state_dict(dense.state_dict())
    x = torch.randn(B, S, E, generator=gen, requires_grad=True)
    q, k, v = (torch.randn(B, H, S, E // H, generator=gen, requires_grad=True) for _ in range(3))
    table = Table(title=f"dense vs padding-free, B={B} S={S} E={E} H={H}, median of {args.repeats}, each pair "
                  "timed in turns (ratio > 1: dropping padding is faster)")
    for column in ("padding", "module fwd dense / packed ms", "ratio", "fwd+bwd dense / packed ms", "ratio",
                   "kernel fwd sdpa / varlen ms", "ratio", "fwd+bwd sdpa / varlen ms", "ratio"):
        table.add_column(column, justify="right")

    def forward(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def train(fn):
        return lambda: fn().sum().backward()

    for share in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7):
        # lengths uniform in [S (1 - 2 share), S]: on average `share` of the batch is padding
        lengths = (S * (1 - 2 * share * torch.rand(B, generator=gen))).round().clamp(1, S).long()
        mask = torch.arange(S)[None, :] < lengths[:, None]  # (B, S)
        real = 1 - mask.float().mean().item()
        pairs = [(lambda m=mask: dense(x, m), lambda m=mask: packed(x, m)),
                 (lambda m=mask: headwise.attention(q, k, v, m, backend="sdpa"),
                  lambda m=mask: headwise.attention(q, k, v, m, backend="varlen"))]
        cells = [f"{real:.0%}"]
        for slow, fast in pairs:
            for wrap in (forward, train):
                a, b = round_robin_ms([wrap(slow), wrap(fast)], args.repeats)
                cells += [f"{a:.0f} / {b:.0f}", f"{a / b:.2f}x"]
        table.add_row(*cells)
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

"""Where dropping padding starts to pay: the thresholds behind "auto".

Two decisions are measured on the same inputs, side by side, over padding shares:

* module: ``MultiHeadAttention`` dense (``backend="sdpa"``) vs packed (``backend="varlen"``,
  projections and attention on the real tokens only): sets ``PACK_MIN_PADDING``;
* kernel: ``headwise.attention`` with a key padding mask, ``sdpa`` vs ``varlen`` (padded
  keys dropped per row): sets ``dispatch.VARLEN_MIN_PADDING``.

    python benchmarks/pack_threshold.py [--batch 32 --seq 512 --dim 512 --heads 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import headwise


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


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
    dense = headwise.MultiHeadAttention(E, H, backend="sdpa").eval()
    packed = headwise.MultiHeadAttention(E, H, backend="varlen").eval()
    packed.load_state_dict(dense.state_dict())
    x = torch.randn(B, S, E, generator=gen)
    q, k, v = (torch.randn(B, H, S, E // H, generator=gen) for _ in range(3))
    table = Table(title=f"dense vs padding-free, B={B} S={S} E={E} H={H}, forward, median of {args.repeats} "
                  "(ratio > 1: dropping padding is faster)")
    for column in ("padding", "module dense ms", "module packed ms", "ratio", "kernel sdpa ms",
                   "kernel varlen ms", "ratio"):
        table.add_column(column, justify="right")
    with torch.inference_mode():
        for share in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7):
            # lengths uniform in [S (1 - 2 share), S]: on average `share` of the batch is padding
            lengths = (S * (1 - 2 * share * torch.rand(B, generator=gen))).round().clamp(1, S).long()
            mask = torch.arange(S)[None, :] < lengths[:, None]  # (B, S)
            real = 1 - mask.float().mean().item()
            md = median_ms(lambda m=mask: dense(x, m), args.repeats)
            mp = median_ms(lambda m=mask: packed(x, m), args.repeats)
            kd = median_ms(lambda m=mask: headwise.attention(q, k, v, m, backend="sdpa"), args.repeats)
            kv = median_ms(lambda m=mask: headwise.attention(q, k, v, m, backend="varlen"), args.repeats)
            table.add_row(f"{real:.0%}", f"{md:.0f}", f"{mp:.0f}", f"{md / mp:.2f}x", f"{kd:.0f}", f"{kv:.0f}",
                          f"{kd / kv:.2f}x")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()

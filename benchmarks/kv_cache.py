"""Incremental decoding with the KV cache vs recomputing causal attention at every step.

Generates N positions one at a time through one attention layer (B=1, E=512, H=8 by
default): with a cache, each step projects one token and attends to the cached keys;
without, each step reruns a causal forward over the whole prefix and keeps its last
row. Both paths give the same outputs (checked here too); the table prints the time
of each and the ratio, measured side by side in one run.

    python benchmarks/kv_cache.py [--positions 512]
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import headwise


def decode_with_cache(mha, x):
    cache = mha.new_cache(x.shape[0], x.shape[1])
    return torch.cat([mha(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(x.shape[1])], 1)


def decode_recomputing(mha, x):
    return torch.cat([mha(x[:, :t + 1], is_causal=True)[:, -1:] for t in range(x.shape[1])], 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    B, E, H = 1, 512, 8
    table = Table(title=f"decoding {args.positions} positions one at a time (B={B}, E={E}, H={H}, "
                  f"{torch.get_num_threads()} threads, best of {args.repeats})")
    for column in ("layer", "with cache", "recomputing", "speed-up", "max |difference|"):
        table.add_column(column, justify="right")
    for label, kwargs in (("MHA", {}), ("GQA Hkv=2 + rope", {"num_kv_heads": 2, "rope": True})):
        mha = headwise.MultiHeadAttention(E, H, **kwargs).eval()
        x = torch.randn(B, args.positions, E)
        best = {}
        with torch.inference_mode():
            outs = {}
            for name, fn in (("cache", decode_with_cache), ("recompute", decode_recomputing)):
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    outs[name] = fn(mha, x)
                    times.append(time.perf_counter() - start)
                best[name] = min(times)
        diff = (outs["cache"] - outs["recompute"]).abs().max().item()
        table.add_row(label, f"{best['cache'] * 1e3:.0f} ms", f"{best['recompute'] * 1e3:.0f} ms",
                      f"{best['recompute'] / best['cache']:.1f}x", f"{diff:.1e}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()

"""What headwise costs per call beyond the arithmetic: a tiny attention call and a decode step.

Two pairs, timed in one run with interleaved repeats (each repeat times both sides in
turn), medians reported:

* ``headwise.attention(q, k, v)`` against ``F.scaled_dot_product_attention`` on
  q (1, 8, 1, 64) and k, v (1, 8, 64, 64): validation, mask handling and dispatch on top
  of SDPA. Target: <= 2x.
* one decode step of ``MultiHeadAttention(512, 8)`` with its KV cache, after a 512-token
  prompt, against a minimal module: one fused qkv ``nn.Linear``, SDPA on a preallocated
  cache, the out ``nn.Linear``. Target: <= 1.15x.

    python benchmarks/overhead.py [--repeats 15] [--calls 200] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import headwise
from headwise.bench import cpu_name, decode_steps_us


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def tiny_pair(args) -> tuple[list[float], list[float]]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=gen)
    k, v = torch.randn(2, 1, 8, 64, 64, generator=gen)
    ours = lambda: headwise.attention(q, k, v)  # noqa: E731
    theirs = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    torch.testing.assert_close(ours(), theirs())
    for f in (ours, theirs):
        per_call_us(f, args.calls)  # warm up
    a, b = [], []
    for _ in range(args.repeats):
        a.append(per_call_us(ours, args.calls))
        b.append(per_call_us(theirs, args.calls))
    return a, b


def decode_pair(args) -> tuple[list[float], list[float]]:
    return decode_steps_us(512, 8, prompt=512, steps=args.steps, repeats=args.repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="tiny calls per repeat")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per repeat")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    rows = [("headwise.attention vs F.sdpa, q (1, 8, 1, 64), k/v (1, 8, 64, 64)", *tiny_pair(args), 2.0),
            ("decode step, E=512 H=8 after 512 tokens, vs a minimal module", *decode_pair(args), 1.15)]
    table = Table(title=f"per-call overhead on {cpu_name()} ({torch.get_num_threads()} threads, torch "
                        f"{torch.__version__}); medians of {args.repeats} interleaved repeats")
    for col in ("call", "headwise us", "baseline us", "ratio", "target"):
        table.add_column(col, justify="left" if col == "call" else "right")
    for name, ours, theirs, target in rows:
        ratio = statistics.median(o / t for o, t in zip(ours, theirs, strict=True))
        table.add_row(name, f"{statistics.median(ours):.1f}", f"{statistics.median(theirs):.1f}",
                      f"{ratio:.2f}x", f"<= {target}x ({'met' if ratio <= target else 'missed'})")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

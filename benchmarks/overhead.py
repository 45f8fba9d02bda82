"""What headwise costs per call beyond the arithmetic: a tiny attention call and a decode step.

Two pairs, timed in one run with interleaved repeats (each repeat times both sides in
turn), medians reported (``--fused`` times a third table instead, below):

* ``headwise.attention(q, k, v)`` against ``F.scaled_dot_product_attention`` on
  q (1, 8, 1, 64) and k, v (1, 8, 64, 64): validation, mask handling and dispatch on top
  of SDPA. Target: <= 2x.
* one decode step of ``MultiHeadAttention(512, 8)`` with its KV cache, after a 512-token
  prompt, against a minimal module: one fused qkv ``nn.Linear``, SDPA on a preallocated
  cache, the out ``nn.Linear``. Target: <= 1.15x.

``--fused`` measures ``policy.FUSED_MAX_ELEMENTS``: the module's fused path
(``torch._native_multi_head_attention``, one op) against its dense path (``backend="sdpa"``:
the qkv GEMM, SDPA and the output projection from Python), without gradients, over a range
of B x S x E, paired in turns; the fused path pays where the ratio is below 1.

    python benchmarks/overhead.py [--repeats 15] [--calls 200] [--steps 64] [--threads N]
    python benchmarks/overhead.py --fused [--repeats 9] [--threads 1] [--cpu-time]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

import headwise
from headwise.bench import decode_steps_us
from headwise.calibration import cpu_name
from headwise.module import fused


def per_call_us(fn, calls: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls * 1e6


def tiny_pair(args) -> tuple[list[float], list[float]]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 1, 64, generator=gen)
    k, v = torch.randn(2, 1, 8, 64, 64, generator=gen)
    ours = lambda: headwise.attention(q, k, v)  # noqa: E731
    theirs = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    torch.testing.assert_close(ours(), theirs())
    clock = time.process_time if args.cpu_time else time.perf_counter
    for f in (ours, theirs):
        per_call_us(f, args.calls)  # warm up
    a, b = [], []
    for _ in range(args.repeats):
        a.append(per_call_us(ours, args.calls, clock))
        b.append(per_call_us(theirs, args.calls, clock))
    return a, b


FUSED_SHAPES = [(1, 8, 64, 2), (1, 32, 128, 2), (2, 32, 128, 2), (1, 32, 256, 4), (8, 32, 128, 2),
                (1, 128, 256, 4), (1, 32, 1024, 16), (4, 64, 256, 4), (8, 32, 256, 4), (1, 512, 128, 2),
                (32, 32, 128, 2), (8, 128, 256, 4)]  # (B, S, E, H), from 512 to 262144 elements


def fused_rows(args, shapes=FUSED_SHAPES) -> list[tuple[int, int, int, int, float, float]]:
    """(B, S, E, H, fused us, dense us) per shape: medians of paired repeats, no gradients."""
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = []
    for B, S, E, H in shapes:
        torch.manual_seed(0)
        mha = headwise.MultiHeadAttention(E, H, backend="sdpa").eval()  # backend="sdpa": the dense path
        x = torch.randn(B, S, E)
        calls = max(2, int(args.calls * 4096 / (B * S * E)))  # about as long a repeat at every size
        with torch.no_grad():
            fused_call, dense = functools.partial(fused.forward, mha, x), functools.partial(mha, x)
            torch.testing.assert_close(fused_call(), dense(), atol=1e-5, rtol=1e-5)
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(args.repeats):
                for fn, acc in zip((fused_call, dense), times, strict=True):
                    start = clock()
                    for _ in range(calls):
                        fn()
                    acc.append((clock() - start) / calls * 1e6)
        rows.append((B, S, E, H, statistics.median(times[0]), statistics.median(times[1])))
    return rows


def decode_pair(args) -> tuple[list[float], list[float]]:
    return decode_steps_us(512, 8, prompt=512, steps=args.steps, repeats=args.repeats,
                           clock=time.process_time if args.cpu_time else time.perf_counter)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="tiny calls per repeat")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per repeat")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--fused", action="store_true",
                        help="the fused path against the dense one, by size (policy.FUSED_MAX_ELEMENTS)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time, not the wall clock (with --threads 1, a busy "
                             "machine disturbs it less)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    if args.fused:
        table = Table(title=f"fused / dense module path, no gradients, on {cpu_name()} ({torch.get_num_threads()} "
                            f"threads, torch {torch.__version__}); medians of {args.repeats} paired repeats, "
                            f"{'CPU' if args.cpu_time else 'wall'} time")
        for col in ("B", "S", "E", "H", "B x S x E", "fused us", "dense us", "fused / dense", "auto takes"):
            table.add_column(col, justify="right")
        for B, S, E, H, fused, dense in fused_rows(args):
            n = B * S * E
            table.add_row(str(B), str(S), str(E), str(H), str(n), f"{fused:.1f}", f"{dense:.1f}",
                          f"{fused / dense:.3f}x", "fused" if n <= headwise.policy.FUSED_MAX_ELEMENTS else "dense")
        Console(width=160).print(table)
        return

    rows = [("headwise.attention vs F.sdpa, q (1, 8, 1, 64), k/v (1, 8, 64, 64)", *tiny_pair(args), 2.0),
            ("decode step, E=512 H=8 after 512 tokens, vs a minimal module", *decode_pair(args), 1.15)]
    table = Table(title=f"per-call overhead on {cpu_name()} ({torch.get_num_threads()} threads, torch "
                        f"{torch.__version__}); medians of {args.repeats} interleaved repeats, "
                        f"{'CPU' if args.cpu_time else 'wall'} time")
    for col in ("call", "headwise us", "baseline us", "ratio", "target"):
        table.add_column(col, justify="left" if col == "call" else "right")
    for name, ours, theirs, target in rows:
        ratio = statistics.median(o / t for o, t in zip(ours, theirs, strict=True))
        table.add_row(name, f"{statistics.median(ours):.1f}", f"{statistics.median(theirs):.1f}",
                      f"{ratio:.2f}x", f"<= {target}x ({'met' if ratio <= target else 'missed'})")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()

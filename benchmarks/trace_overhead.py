"""What explain mode's hooks cost outside a trace block, measured against the noise.

Every hook (in the module, the packed path and the functional layer; kernels hold none)
is ``if tracing.ACTIVE: ...``. This script counts how many guards one forward evaluates
(by swapping ACTIVE for an object that counts its truth tests), times one guard, and
sets guards x cost beside the forward's own time and its run-to-run spread.

    python benchmarks/trace_overhead.py
"""

from __future__ import annotations

import statistics
import time
import timeit

import torch
from rich.console import Console
from rich.table import Table

import headwise
from headwise import tracing


class _CountingFlag:
    def __init__(self) -> None:
        self.tests = 0

    def __bool__(self) -> bool:
        self.tests += 1
        return False


def guards_per_forward(mha, x, mask) -> int:
    saved, tracing.ACTIVE = tracing.ACTIVE, _CountingFlag()
    try:
        with torch.no_grad():
            mha(x, mask)
        return tracing.ACTIVE.tests
    finally:
        tracing.ACTIVE = saved


def guard_cost_seconds() -> float:
    def guarded():
        if tracing.ACTIVE:
            pass

    def bare():
        pass

    n = 2_000_000
    return max(0.0, (min(timeit.repeat(guarded, number=n, repeat=5))
                     - min(timeit.repeat(bare, number=n, repeat=5))) / n)


def forward_times(mha, x, mask, repeats: int) -> list[float]:
    with torch.no_grad():
        for _ in range(5):
            mha(x, mask)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mha(x, mask)
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    torch.manual_seed(0)
    guard = guard_cost_seconds()
    table = Table(title=f"explain-mode hooks outside a trace block (one guard = {guard * 1e9:.0f} ns)")
    for column in ("B, S, E, H", "backend", "forward median", "run-to-run spread (MAD)",
                   "guards / forward", "hook cost", "hook cost / forward"):
        table.add_column(column, justify="right")
    for (B, S, E, H), backend in [((1, 16, 512, 8), "auto"), ((1, 16, 512, 8), "matmul"),
                                  ((8, 128, 512, 8), "auto"), ((8, 128, 512, 8), "matmul")]:
        mha = headwise.MultiHeadAttention(E, H, backend=backend).eval()
        x = torch.randn(B, S, E)
        mask = torch.ones(B, S, dtype=torch.bool)
        times = forward_times(mha, x, mask, repeats=200 if S < 100 else 30)
        median = statistics.median(times)
        spread = statistics.median(abs(t - median) for t in times)
        guards = guards_per_forward(mha, x, mask)
        cost = guards * guard
        table.add_row(f"{B}, {S}, {E}, {H}", backend, f"{median * 1e6:.0f} us", f"{spread * 1e6:.1f} us",
                      str(guards), f"{cost * 1e6:.2f} us", f"{cost / median:.3%}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()

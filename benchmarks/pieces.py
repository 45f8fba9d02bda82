"""Attention in pieces, measured: the targets of return_lse and weights from any backend (issue 26).

Two tables from one run, CPU fp32, times paired in turns (medians), each memory figure from
a fresh subprocess (the resident set's peak rise during the call):

* **One head's weights**, S = 4096, H = 16, D = 64, B = 1, forward (no gradients):
  ``headwise.attention(q, k, v, need_weights=True, weights_heads=0)`` against the same call
  without weights. Targets: <= 1.2x the time and <= 1.2x the peak memory. The former path
  (``backend="matmul"``, every head's S x S probabilities) is shown for scale.
* **return_lse=True** against the plain forward on ``sdpa`` and ``chunked``, S = 2048, H = 8,
  D = 64, causal, forward. Target: <= 1.05x.

    python benchmarks/pieces.py [--quick] [--repeats 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

import headwise
from headwise.bench import PEAK_CHILD_ENV, peak_rise_mib, round_robin_ms
from headwise.calibration import cpu_name

SIDES = {
    "without weights": dict(),
    "one head's weights": dict(need_weights=True, weights_heads=0),
    "every head's weights (matmul)": dict(need_weights=True, backend="matmul"),
}


def _inputs(S: int, H: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, S, D, generator=gen) for _ in range(3))


def weights_time(S: int, H: int, D: int, repeats: int) -> dict[str, float]:
    """Median ms of each side of the weights table."""
    q, k, v = _inputs(S, H, D)
    with torch.no_grad():
        ms = round_robin_ms([lambda kw=kw: headwise.attention(q, k, v, **kw) for kw in SIDES.values()], repeats)
    return dict(zip(SIDES, ms, strict=True))


def _peak_side(side: str, S: int, H: int, D: int) -> None:
    """Child: one side of the weights table, its peak memory rise printed as JSON."""
    torch.set_num_threads(1)
    kwargs = SIDES[side]
    with torch.no_grad():
        headwise.attention(*_inputs(256, H, D), **kwargs)  # warm-up: lazy initialisation is not the call's memory
        whole = peak_rise_mib(lambda: headwise.attention(*_inputs(S, H, D), **kwargs))  # q, k, v and the call
        q, k, v = _inputs(S, H, D)
        call = peak_rise_mib(lambda: headwise.attention(q, k, v, **kwargs))  # the call alone
    print(json.dumps({"peak_mib": whole, "call_mib": call}))


def weights_memory(S: int, H: int, D: int) -> dict[str, dict[str, float]]:
    """Peak MiB rise of each side, each in a fresh process: with its inputs made (``peak_mib``)
    and of the call alone (``call_mib``)."""
    peaks = {}
    for side in SIDES:
        command = [sys.executable, __file__, "--peak-side", side, "--size", f"{S},{H},{D}"]
        out = subprocess.run(command, capture_output=True, text=True, check=True,
                         env={**os.environ, **PEAK_CHILD_ENV})
        peaks[side] = json.loads(out.stdout.strip().splitlines()[-1])
    return peaks


def lse_overhead(S: int, H: int, D: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per backend, median ms of the plain causal forward and of the same with return_lse."""
    q, k, v = _inputs(S, H, D, seed=1)
    rows = {}
    with torch.no_grad():
        for backend in ("sdpa", "chunked"):
            plain, lse = round_robin_ms([lambda b=backend: headwise.attention(q, k, v, is_causal=True, backend=b),
                                         lambda b=backend: headwise.attention(q, k, v, is_causal=True, backend=b,
                                                                              return_lse=True)], repeats)
            rows[backend] = (plain, lse)
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the targets")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--peak-side", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_side:
        _peak_side(args.peak_side, *(int(n) for n in args.size.split(",")))
        return
    torch.set_num_threads(args.threads)
    (S, H, D), (S2, H2) = ((512, 4, 32), (256, 2)) if args.quick else ((4096, 16, 64), (2048, 8))
    print(f"# attention in pieces: {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"median of {args.repeats} paired repeats")
    times, peaks = weights_time(S, H, D, args.repeats), weights_memory(S, H, D)
    base_t, base = times["without weights"], peaks["without weights"]
    print(f"\nweights, S = {S}, H = {H}, D = {D}, forward: ms and peak MiB rise (with q, k, v made / the call "
          "alone), ratios to the call without weights")
    for side in SIDES:
        m = peaks[side]
        print(f"  {side:<30} {times[side]:>9.2f} ms  {m['peak_mib']:>7.1f} / {m['call_mib']:>7.1f} MiB   time "
              f"{times[side] / base_t:.2f}x, memory {_ratio(m['peak_mib'], base['peak_mib'])} / "
              f"{_ratio(m['call_mib'], base['call_mib'])}")
    print(f"  (one head's weights are {S * S * 4 / 2**20:.0f} MiB themselves; target <= 1.2x time and memory)")
    print(f"\nreturn_lse, S = {S2}, H = {H2}, D = {D}, causal forward: ms (target <= 1.05x)")
    for backend, (plain, lse) in lse_overhead(S2, H2, D, args.repeats).items():
        print(f"  {backend:<8} plain {plain:>9.2f} ms   return_lse {lse:>9.2f} ms   {lse / plain:.3f}x")


if __name__ == "__main__":
    main()

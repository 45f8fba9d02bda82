"""Does "auto" ever lose? The default module against two minimal SDPA modules, over a grid of shapes.

The minimal modules are what people write by hand, in the two layouts they write:
one fused qkv ``nn.Linear`` (nanoGPT; ``headwise.bench.SDPAModule``), or ``q_proj``,
``k_proj``, ``v_proj`` (transformers, torchtune; ``headwise.bench.SDPALinearsModule``), then
``F.scaled_dot_product_attention`` with the same key padding mask and the out ``nn.Linear``,
each with the headwise module's weights. Each row times the three in turns within every
repeat (forward under no_grad, and forward + backward) and reports paired medians of
time(headwise) / time(minimal) against each: below 1 headwise is faster.

    python benchmarks/auto_grid.py [--quick] [--repeats 9] [--budget 1.0] [--threads N] [--paths] [--why] [--shard K/N]

``--shard K/N`` times every N-th row from the K-th (1-based), so N processes, one per core,
share the full grid.

``--paths`` also times the module on each fixed path (``packing=False`` / ``True``) in the same
turns, and reports time(auto's path) / time(the other): above 1, the cost model chose wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

import headwise
from headwise.bench import SDPALinearsModule, SDPAModule, copy_weights
from headwise.calibration import cpu_name

# The issue's rows first, then the grid.
ISSUE_ROWS = [(1, 32, 256, 4, 0.0), (8, 64, 128, 4, 0.42), (8, 128, 256, 4, 0.32), (16, 128, 384, 6, 0.21),
              (32, 128, 384, 12, 0.43), (8, 512, 768, 12, 0.0), (8, 512, 768, 12, 0.31), (32, 512, 512, 8, 0.4)]


def grid(quick: bool) -> list[tuple[int, int, int, int, float]]:
    if quick:
        return ISSUE_ROWS
    rows = list(ISSUE_ROWS)
    for B, S, E, pad in itertools.product((1, 8, 32), (32, 128, 512, 2048), (128, 512, 1024), (0.0, 0.3, 0.6)):
        if B * S * E > 8 * 2048 * 1024 or (B == 1 and pad):
            continue  # too slow for a CPU run / one row has no padding to speak of
        rows.append((B, S, E, max(E // 64, 1), pad))
    return rows


def lengths(B: int, S: int, pad: float, gen: torch.Generator) -> torch.Tensor:
    """B lengths with about ``pad`` of the batch padding: uniform around the mean, the first full."""
    if pad == 0:
        return torch.full((B,), S)
    mean = S * (1 - pad)
    low = max(1, int(2 * mean - S))
    out = torch.randint(low, S + 1, (B,), generator=gen)
    out[0] = S
    return out


@dataclass
class Row:
    padding: float  # share of the batch that is padding
    path: dict  # "fwd" / "train" -> the path "auto" planned
    ratio: dict  # "fwd" / "train" -> paired median time(headwise) / time(minimal)
    other: dict  # "fwd" / "train" -> paired median time(auto's path) / time(the other path); {} without --paths
    why: dict  # "fwd" / "train" -> plan().why
    linears: dict = field(default_factory=dict)  # "fwd" / "train" -> time(headwise) / time(q/k/v Linears module)
    pairs: dict = field(default_factory=dict)  # "fwd" / "train" -> how many paired timings the ratio rests on


def pair(B, S, E, H, pad, repeats, paths=False, window=10e-3, budget=0.0) -> Row:
    """Time one row: ``repeats`` (at least) paired timings of about ``window`` seconds each
    per module, in turns; more where the row is cheap, up to about ``budget`` seconds of
    timing per kind (forward, forward + backward): a small call's ratio then rests on
    more pairs, and the worst row of the grid on less noise."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ours = headwise.MultiHeadAttention(E, H)
    ref = SDPAModule(E, H)
    copy_weights(ref, ours)  # (3E, E): q, k, v rows stacked
    linears = SDPALinearsModule.like(ours)  # the other layout people write: q_proj, k_proj, v_proj, out_proj
    x = torch.randn(B, S, E, generator=gen)
    n = lengths(B, S, pad, gen)
    mask = None if pad == 0 else torch.arange(S)[None, :] < n[:, None]  # (B, S) True = token
    real = 1 - float(n.sum()) / (B * S)
    xg = x.clone().requires_grad_()
    others = {}
    if paths and mask is not None:  # the same weights on each fixed path
        for packing in (False, True):
            others[packing] = headwise.MultiHeadAttention(E, H, packing=packing)
            others[packing].load_state_dict(ours.state_dict())

    def fwd(m):
        with torch.no_grad():
            m(x, mask)

    def train(m):
        m(xg, mask).sum().backward()

    row = Row(real, {}, {}, {}, {})
    for kind, fn in (("fwd", fwd), ("train", train)):
        for _ in range(2):  # warm up; where the estimates are close, the second call measures both paths
            fn(ours)
        with torch.no_grad() if kind == "fwd" else contextlib.nullcontext():
            plan = ours.plan(x if kind == "fwd" else xg, mask)  # the path the timed calls take
        row.path[kind], row.why[kind] = plan.path, plan.why
        mods = [ours, ref, linears]
        if others:  # auto's own path, then the other one
            mods += [others[plan.path == "packed"], others[plan.path != "packed"]]
        for m in mods[1:]:
            fn(m)  # warm up
        once = max(min(_once(fn, ref) for _ in range(3)), 1e-6)  # the least of three: a first call may be slow
        calls = max(1, int(window / once))  # about `window` seconds per timing
        turn = calls * once * len(mods)  # one repeat: each module timed once
        ratios, versus, layout = [], [], []
        for _ in range(max(repeats, min(int(budget / turn), 20 * repeats))):
            t = [_timed(fn, m, calls) for m in mods]  # in turns
            ratios.append(t[0] / t[1])
            layout.append(t[0] / t[2])
            if others:
                versus.append(t[3] / t[4])
        row.ratio[kind] = statistics.median(ratios)
        row.linears[kind] = statistics.median(layout)
        row.pairs[kind] = len(ratios)
        if others:
            row.other[kind] = statistics.median(versus)
    return row


CLOCK = time.perf_counter  # --cpu-time: time.process_time


def _once(fn, m) -> float:
    start = CLOCK()
    fn(m)
    return CLOCK() - start


def _timed(fn, m, calls) -> float:
    start = CLOCK()
    for _ in range(calls):
        fn(m)
    return (CLOCK() - start) / calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the issue's rows only")
    parser.add_argument("--repeats", type=int, default=9, help="paired timings per row and kind, at least")
    parser.add_argument("--budget", type=float, default=1.0,
                        help="seconds of timing per row and kind: a cheap row gets more repeats (up to 20x --repeats) "
                             "within it")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--paths", action="store_true",
                        help="also time the dense and the packed path of each padded row: did auto pick the faster?")
    parser.add_argument("--why", action="store_true", help="print auto's reason for each row's path")
    parser.add_argument("--shard", default="1/1", help="K/N: every N-th row from the K-th (N processes, one per core)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time, not the wall clock: with --threads 1 it counts only "
                             "this process's work, so a machine shared with other jobs disturbs it less")
    args = parser.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"default MultiHeadAttention / minimal SDPA modules (fused qkv; q/k/v Linears) on {cpu_name()} "
                        f"({torch.get_num_threads()} threads, torch {torch.__version__}); paired medians of "
                        f"{args.repeats}+ repeats in turns (up to {args.budget:g} s a row), "
                        f"{'CPU' if args.cpu_time else 'wall'} time "
                        "(< 1: headwise faster)" + ("" if args.shard == "1/1" else f"; rows {args.shard}"))
    for col in ("B", "S", "E", "H", "padding", "path", "forward", "forward+backward", "fwd, q/k/v", "f+b, q/k/v"):
        table.add_column(col, justify="right")
    if args.paths:
        table.add_column("auto's path / the other, fwd", justify="right")
        table.add_column("fwd+bwd", justify="right")
    worst = (0.0, 0.0)
    worst_linears = (0.0, 0.0)
    right, priced = 0, 0
    console = Console(width=180)
    k, n = (int(part) for part in args.shard.split("/"))
    for B, S, E, H, pad in grid(args.quick)[k - 1::n]:
        row = pair(B, S, E, H, pad, args.repeats, args.paths, budget=args.budget)
        f, t = row.ratio["fwd"], row.ratio["train"]
        worst = (max(worst[0], f), max(worst[1], t))
        lf, lt = row.linears["fwd"], row.linears["train"]
        worst_linears = (max(worst_linears[0], lf), max(worst_linears[1], lt))
        path = row.path["fwd"] if row.path["fwd"] == row.path["train"] else f"{row.path['fwd']} / {row.path['train']}"
        cells = [str(B), str(S), str(E), str(H), f"{row.padding:.0%}", path, f"{f:.2f}x", f"{t:.2f}x", f"{lf:.2f}x",
                 f"{lt:.2f}x"]
        if args.paths:
            cells += [f"{row.other[k]:.2f}x" if k in row.other else "" for k in ("fwd", "train")]
            priced += len(row.other)
            right += sum(v <= 1.0 for v in row.other.values())
        table.add_row(*cells)
        print("  ".join(cells), file=sys.stderr, flush=True)  # progress: the full grid takes a while
        if args.why:
            console.print(f"B={B} S={S} E={E}: forward: {row.why['fwd']}; forward+backward: {row.why['train']}")
    console.print(table)
    console.print(f"worst row against the fused-qkv module: forward {worst[0]:.2f}x, forward+backward "
                  f"{worst[1]:.2f}x (target <= 1.05x)")
    console.print(f"worst row against the q/k/v-Linears module: forward {worst_linears[0]:.2f}x, forward+backward "
                  f"{worst_linears[1]:.2f}x (target <= 1.05x)")
    if args.paths:
        console.print(f"auto took the faster path in {right} of {priced} padded cases (forward and forward+backward)")


if __name__ == "__main__":
    main()

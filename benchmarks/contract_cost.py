"""What the auto grid's small rows pay for: the module's contract and its separate projections.

``benchmarks/auto_grid.py`` pairs the module with the minimal module people write (one fused
qkv ``nn.Linear``, SDPA, the out ``nn.Linear``). Where a small row runs over 1.05x, this takes
the gap apart, every variant timed in turns within one run (paired medians, CPU time):

- forward with a padding mask (no_grad): the minimal module; the minimal module plus the three
  ops the contract adds (reading the real tokens per row, one sum that says whether x is
  finite, zeroing the padded outputs); headwise; headwise with those three ops replaced by
  their answers for this input (an ablation: the module code is patched for the run, then
  restored).
- forward + backward without a mask: the minimal module; the same written with three q, k, v
  ``nn.Linear`` (the module's layout, which PEFT, safetensors and hooks see); that plus the NaN
  contract's check of q (one sum, one host read); headwise.

    python benchmarks/contract_cost.py [--repeats 30] [--threads 1]

Each ratio is time(variant) / time(minimal module): above 1, slower.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import headwise
from headwise.bench import SDPAModule, copy_weights
from headwise.calibration import cpu_name
from headwise.module import plan as planning
from headwise.module import projections as proj

PADDED = [(8, 32, 128, 2, (32, 26, 30, 17, 32, 28, 24, 21)), (8, 32, 128, 2, (32, 12, 20, 15, 25, 9, 18, 20))]
TRAINING = [(1, 32, 128, 2), (1, 128, 128, 2)]


class ThreeLinears(nn.Module):
    """The minimal module with the q, k, v projections as three ``nn.Linear`` (headwise's
    layout); ``check_q``: also the NaN contract's check of q (a sum and one host read)."""

    def __init__(self, E: int, H: int, check_q: bool) -> None:
        super().__init__()
        self.H, self.check_q = H, check_q
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, S, E = x.shape
        q, k, v = (p(x).view(B, S, self.H, E // self.H).transpose(1, 2)  # (B, S, E) -> (B, H, S, D)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.check_q:
            math.isfinite(q.detach().sum())
        o = F.scaled_dot_product_attention(q, k, v)  # (B, H, S, D)
        return self.out_proj(o.transpose(1, 2).reshape(B, S, E))  # (B, S, E)


@contextlib.contextmanager
def without_contract_ops(lengths: tuple[int, ...]) -> Iterator[None]:
    """headwise's three padding ops replaced by their answers for a mask of these real tokens
    per row (read once, before timing) and a finite x: the lengths, x as it is, the outputs as
    they are."""
    saved = proj.hide_padding, proj.zero_padding_, planning.real_tokens
    proj.hide_padding = lambda x, padding: (x, True)
    proj.zero_padding_ = lambda out, padding, finite=False: out
    planning.real_tokens = lambda padding: lengths
    try:
        yield
    finally:
        proj.hide_padding, proj.zero_padding_, planning.real_tokens = saved


def paired(variants: dict[str, Callable[[], object]], repeats: int, window: float = 0.01) -> dict[str, float]:
    """Paired median of time(variant) / time(the first variant), each timed in turns for about
    ``window`` seconds per repeat."""
    for fn in variants.values():
        fn()
        fn()
    first = next(iter(variants.values()))
    start = time.process_time()
    first()
    calls = max(2, int(window / max(time.process_time() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.process_time()
            for _ in range(calls):
                fn()
            times[name].append((time.process_time() - start) / calls)
    base = times[next(iter(variants))]
    out = {name: statistics.median(a / b for a, b in zip(t, base, strict=True)) for name, t in times.items()}
    out["base_us"] = statistics.median(base) * 1e6
    return out


def padded_row(B: int, S: int, E: int, H: int, lengths: tuple[int, ...], repeats: int,
               window: float = 0.01) -> dict[str, float]:
    torch.manual_seed(0)
    mha, minimal = headwise.MultiHeadAttention(E, H).eval(), SDPAModule(E, H).eval()
    copy_weights(minimal, mha)
    x = torch.randn(B, S, E)
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # (B, S) True = token
    real_tokens, hide_padding, zero_padding_ = planning.real_tokens, proj.hide_padding, proj.zero_padding_

    def plus_ops() -> None:  # the module's own three functions, around the minimal module
        real_tokens(mask)
        _, finite = hide_padding(x, mask)
        zero_padding_(minimal(x, mask), mask, finite)

    def without_ops() -> None:
        with without_contract_ops(tuple(lengths)):  # swaps three names: about a microsecond
            mha(x, mask)

    with torch.no_grad():
        return paired({"minimal": lambda: minimal(x, mask), "minimal + the three ops": plus_ops,
                       "headwise": lambda: mha(x, mask), "headwise without them": without_ops}, repeats, window)


def training_row(B: int, S: int, E: int, H: int, repeats: int, window: float = 0.01) -> dict[str, float]:
    torch.manual_seed(0)
    mha, minimal = headwise.MultiHeadAttention(E, H), SDPAModule(E, H)
    copy_weights(minimal, mha)
    three, checked = ThreeLinears(E, H, check_q=False), ThreeLinears(E, H, check_q=True)
    for m in (three, checked):
        m.load_state_dict(mha.state_dict())  # the same four Linears' keys
    x = torch.randn(B, S, E, requires_grad=True)
    return paired({name: (lambda m=m: m(x).sum().backward()) for name, m in (
        ("minimal", minimal), ("three Linears", three), ("three Linears + the q check", checked),
        ("headwise", mha))}, repeats, window)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="paired timings per variant")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    console = Console(width=160)
    title = (f"time / the minimal module's, on {cpu_name()} ({torch.get_num_threads()} threads, torch "
             f"{torch.__version__}); paired medians of {args.repeats} repeats in turns, CPU time")
    table = Table(title="forward with padding, " + title)
    for col in ("B", "S", "E", "padding", "minimal (us)", "+ the three ops", "headwise", "headwise without them"):
        table.add_column(col, justify="right")
    for B, S, E, H, lengths in PADDED:
        r = padded_row(B, S, E, H, lengths, args.repeats)
        table.add_row(str(B), str(S), str(E), f"{1 - sum(lengths) / (B * S):.0%}", f"{r['base_us']:.0f}",
                      f"{r['minimal + the three ops']:.3f}x", f"{r['headwise']:.3f}x",
                      f"{r['headwise without them']:.3f}x")
    console.print(table)
    table = Table(title="forward + backward, " + title)
    for col in ("B", "S", "E", "minimal (us)", "three Linears", "+ the q check", "headwise"):
        table.add_column(col, justify="right")
    for B, S, E, H in TRAINING:
        r = training_row(B, S, E, H, args.repeats)
        table.add_row(str(B), str(S), str(E), f"{r['base_us']:.0f}", f"{r['three Linears']:.3f}x",
                      f"{r['three Linears + the q check']:.3f}x", f"{r['headwise']:.3f}x")
    console.print(table)


if __name__ == "__main__":
    main()

"""What the batch-invariant mode costs: the module inside ``headwise.batch_invariant()``
against the default mode, measured side by side in one run (issue 37's targets: each
within 1.3x).

- a padded prefill: B=8 sequences of random lengths up to S (right padding), E=512, H=8,
  causal, forward without gradients;
- a decode step: 8 sequences with 1,024 positions cached (a dynamic cache), one new token each.

    python benchmarks/invariance.py [--repeats 7] [--dtype fp32|bf16|both]

Times are medians of round-robin rounds (``headwise.bench.round_robin``); take figures on a
quiet machine, and name its CPU (printed in the title).
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import headwise
from headwise.bench import round_robin
from headwise.calibration import cpu_name

E, H, B = 512, 8, 8


def prefill_case(S: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(S)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).to(dtype).eval()
    x = torch.randn(B, S, E, generator=gen).to(dtype)
    lens = torch.randint(S // 2, S + 1, (B,), generator=gen)
    lens[0] = S
    mask = torch.arange(S)[None] < lens[:, None]  # (B, S) right padding
    return lambda: mha(x, attention_mask=mask)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    args = parser.parse_args(argv)
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}[args.dtype]
    table = Table(title=f"the batch-invariant mode vs the default ({cpu_name()}, {torch.get_num_threads()} threads, "
                  f"median of >= {args.repeats} rounds)")
    for column in ("case", "dtype", "default", "invariant", "ratio"):
        table.add_column(column, justify="right")
    for dtype in dtypes:
        name = "fp32" if dtype == torch.float32 else "bf16"
        for S in (128, 256, 512):
            fn = prefill_case(S, dtype)

            def inside(fn=fn):
                with headwise.batch_invariant():
                    return fn()

            with torch.inference_mode():
                timing = round_robin([fn, inside], args.repeats, 3 * args.repeats)
            default, invariant = timing.ms
            table.add_row(f"prefill B={B} S<={S} E={E}", name, f"{default:.2f} ms", f"{invariant:.2f} ms",
                          f"{invariant / default:.2f}x")
        default, invariant = decode_ms(dtype, args.repeats)
        table.add_row(f"decode step, {B} seqs x 1,024 cached", name, f"{default * 1e3:.0f} us",
                      f"{invariant * 1e3:.0f} us", f"{invariant / default:.2f}x")
    Console(width=100).print(table)


def decode_ms(dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """Median ms of one decode step after 1,024 cached positions, default and in the mode:
    each step appends one position (the caches hold room for every round)."""
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).to(dtype).eval()
    rounds = 3 * repeats + 2
    caches = {}
    with torch.inference_mode():
        prompt = torch.randn(B, 1024, E).to(dtype)
        for mode in (False, True):
            caches[mode] = mha.new_cache(B, 1024 + rounds + 1)
            with headwise.batch_invariant(mode):
                mha(prompt, cache=caches[mode])
    x = torch.randn(B, 1, E).to(dtype)

    def step(mode: bool):
        with headwise.batch_invariant(mode):
            return mha(x, cache=caches[mode])

    with torch.inference_mode():
        return tuple(round_robin([lambda: step(False), lambda: step(True)], repeats, 3 * repeats).ms)  # type: ignore[return-value]


if __name__ == "__main__":
    main()

"""The ``headwise`` command line: the only place in the package that writes to stdout.

Legend: B batch, H heads, S sequence length, E embed dim.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.table import Table

import headwise
from headwise.reference import MultiHeadAttentionFormal, to_headwise_state_dict


def _demo(args: argparse.Namespace, console: Console) -> int:
    """The first document's example, run through every backend."""
    torch.manual_seed(args.seed)
    B, S, E, H = 3, 2, 128, 8
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])  # (B, S): 1 = token, 0 = padding
    x = torch.rand(B, S, E)

    console.rule("[bold]headwise demo[/]: the first document's example")
    console.print(f"X: {tuple(x.shape)} (batch_size, seq_len, hidden_dim), {H} heads, "
                  f"head_dim = {E} // {H} = {E // H}")
    console.print(f"mask {tuple(mask.shape)} (batch_size, seq_len), 1 = attend, 0 = padding:")
    console.print(mask)
    unsqueezed = mask.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, S)
    expanded = unsqueezed.expand(B, H, S, S)  # (B, H, S, S), a view: no copy
    console.print(f"mask.unsqueeze(1).unsqueeze(2): {tuple(unsqueezed.shape)} "
                  "(batch_size, 1, 1, seq_len)")
    console.print(f".expand({B}, {H}, {S}, {S}): {tuple(expanded.shape)} "
                  f"(batch_size, head_num, seq_len, seq_len); shares storage with the mask: "
                  f"{expanded.untyped_storage().data_ptr() == mask.untyped_storage().data_ptr()}")
    console.print("batch row 1, head 0 after expansion (query x key):")
    console.print(expanded[1, 0])
    console.print("headwise takes the (B, S) mask as it is and broadcasts it inside; "
                  "the expanded form gives the same result.\n")

    reference = MultiHeadAttentionFormal(E, H).eval()
    with torch.no_grad():
        expected = reference(x, expanded)
    table = Table(title="every backend vs the document's MultiHeadAttentionFormal (fp32)")
    table.add_column("backend")
    table.add_column("output shape")
    table.add_column("max |difference|", justify="right")
    table.add_column("note")
    for name in ["auto", *headwise.available_backends()]:
        mha = headwise.MultiHeadAttention(E, H, backend=name).eval()
        mha.load_state_dict(to_headwise_state_dict(reference))
        with torch.no_grad():
            out = mha(x, mask)
        diff = (out - expected).abs().max().item()
        note = f"chose {mha.dispatch(x, mask).backend!r}" if name == "auto" else ""
        table.add_row(name, str(tuple(out.shape)), f"{diff:.2e}", note)
    console.print(table)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headwise",
        description="Multi-head attention, correct for every mask, and able to explain itself.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="run the first document's example through every backend",
                          description="Run the first document's example (X (3, 2, 128), 8 heads, "
                          "mask [[1, 1], [1, 0], [1, 0]]) through every backend.")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``headwise`` command; returns the exit code.

    >>> main(["demo"])  # doctest: +SKIP
    0
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (code 0) or a bad argument (code 2)
        return int(exc.code or 0)
    console = Console()
    try:
        return args.run(args, console)
    except (ValueError, TypeError) as exc:
        print(f"headwise {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

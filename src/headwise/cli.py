"""The ``headwise`` command line: the only place in the package that writes to stdout.

Legend: B batch, H heads, S sequence length, E embed dim.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

import headwise
from headwise.apps.checks import positive_float, positive_int, writable_file
from headwise.apps.embed import add_embed_parser
from headwise.equivalences import measure
from headwise.explain import ExplainConfig, explain, markdown_page
from headwise.plot import plot_attention, plot_tile_map
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
    table.add_column("max |difference| (real tokens)", justify="right")
    table.add_column("padding -> 0")
    table.add_column("note")
    # every kernel on the dense path, then "auto" and the padding-free path (packing=True)
    rows: list[tuple[str, dict[str, Any]]] = [(name, {"backend": name, "packing": False})
                                              for name in headwise.available_backends()]
    rows += [("auto", {}), ("packing=True", {"packing": True})]
    for name, kwargs in rows:
        mha = headwise.MultiHeadAttention(E, H, **kwargs).eval()
        mha.load_state_dict(to_headwise_state_dict(reference))
        with torch.no_grad():  # the dispatch of this call: without gradients (flex serves the CPU only so)
            out = mha(x, mask)
            d = mha.dispatch(x, mask)
        real = mask.bool()  # padded positions: ours are zeros, the document's are unused values
        diff = (out[real] - expected[real]).abs().max().item()
        note = f"{d.path} path, kernel {d.backend!r}" if name in ("auto", "packing=True") else ""
        zeros = "yes" if bool((out[~real] == 0).all()) else "no"
        table.add_row(name, str(tuple(out.shape)), f"{diff:.2e}", zeros, note)
    console.print(table)
    _demo_trace(console, x, mask, reference)
    return 0


def _demo_trace(console: Console, x, mask, reference) -> None:
    """The document's stage1..stage4 prints, as one table from a traced run."""
    mha = headwise.MultiHeadAttention(x.shape[-1], 8, backend="matmul").eval()
    mha.load_state_dict(to_headwise_state_dict(reference))
    with torch.no_grad(), headwise.trace() as t:
        mha(x, mask)
    console.print(t.table(title="the same example, stage by stage (backend 'matmul')"))


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise ValueError(f"--mask lengths expects comma-separated integers like 10,7,3,5, got {text!r}") from None


def _explain(args: argparse.Namespace, console: Console) -> int:
    kind, spec = args.mask if args.mask else (None, None)
    if kind not in (None, "lengths"):
        raise ValueError(f"--mask kind must be 'lengths', got {kind!r}; e.g. --mask lengths 10,7,3,5")
    config = ExplainConfig(batch=args.batch, seq=args.seq, dim=args.dim, heads=args.heads,
                           lengths=_lengths(spec) if spec else None, causal=args.causal,
                           kv_heads=args.kv_heads, backend=args.backend, seed=args.seed,
                           softcap=args.softcap, sinks=args.sinks, rule=args.rule, tile=args.tile)
    if args.tiles:
        if args.rule is None:
            raise ValueError(f"--tiles {args.tiles} draws a rule's tile map: give --rule too, e.g. --rule document:4,6")
        writable_file("--tiles", args.tiles)  # checked before the work
    config.validate()  # sizes included: refused here, before anything is allocated
    row = _plot_row(args, config)  # checked before the work, as the path is
    explained = explain(config)
    if args.markdown:
        console.file.write(markdown_page(explained))
        return 0
    console.print(explained.trace.table(
        title=f"B={config.batch} S={config.seq} E={config.dim} H={config.heads}"
        + (f" Hkv={config.kv_heads}" if config.kv_heads else "")
        + (f" lengths={list(config.lengths)}" if config.lengths else "")
        + (" causal" if config.causal else "")
        + (f" softcap={config.softcap:g}" if config.softcap is not None else "")
        + (" sinks" if config.sinks else "") + (f" rule {config.rule}" if config.rule else "")
        + f", backend {config.backend!r}"))
    if explained.tiles is not None:
        console.print(f"tile map: {explained.tiles.describe()}")
        if args.tiles:
            width, height = plot_tile_map(explained.tiles.states[0, 0], args.tiles, block=explained.tiles.block,
                                          title=explained.tiles.describe().split(": ")[0])
            console.print(f"wrote {args.tiles} ({width} x {height} px, batch row 0, head 0)")
    if args.plot:
        width, height = plot_attention(explained.allowed[row], explained.weights[row], args.plot,
                                       title=f"batch row {row}: mask and attention weights per head")
        console.print(f"wrote {args.plot} ({width} x {height} px, batch row {row})")
    return 0


def _plot_row(args: argparse.Namespace, config: ExplainConfig) -> int:
    """The batch row ``--plot`` draws, after checking ``--plot``'s path and ``--plot-batch``."""
    row = args.plot_batch
    if not args.plot:
        if row is not None:
            raise ValueError(f"--plot-batch {row} needs --plot FILE.png: it picks the batch row to draw")
        return 0
    writable_file("--plot", args.plot)
    if row is None:  # the row with the most padding shows the mask best
        return 0 if config.lengths is None else min(range(config.batch), key=config.lengths.__getitem__)
    if not 0 <= row < config.batch:
        raise ValueError(f"--plot-batch {row} is outside [0, {config.batch}) (--batch {config.batch}); "
                         f"give a row from 0 to {config.batch - 1}")
    return row


def _equivalences(args: argparse.Namespace, console: Console) -> int:
    def yes_no(flag: bool | None) -> str:
        return "fails" if flag is None else ("yes" if flag else "no")

    rows = measure(seed=args.seed)
    table = Table(title="equivalent forms from the first document, measured on random tensors")
    # A narrow terminal wraps a cell (folding a long form) rather than cutting it short, and the
    # forms keep the room: the other columns have fixed widths, their long headers wrapping.
    narrow = console.width < 120
    table.add_column("step", overflow="fold", width=9 if narrow else 16)
    table.add_column("form", overflow="fold")
    for column in ("needs contiguous input", "view of a contiguous input", "view of a non-contiguous input"):
        table.add_column(column, overflow="fold", width=8 if narrow else 14)
    table.add_column("max |diff| vs first form", overflow="fold", max_width=12 if narrow else 24)
    for row in rows:
        diff = f"{row.max_diff:.1e}" if row.max_diff is not None else f"fails: {(row.error or '')[:70]}"
        needs = "fails" if row.view_of_contiguous is None else ("yes" if row.needs_contiguous else "no")
        table.add_row(*(Text(c) for c in (
            row.group, row.form, needs,
            yes_no(row.view_of_contiguous), yes_no(row.view_of_noncontiguous), diff)))
    console.print(table)
    console.print("non-contiguous input: the layout the documents' split heads leave, "
                  "memory in (B, S, H, D) order seen as (B, H, S, D).")
    return 0


def _bench(args: argparse.Namespace, console: Console) -> int:
    from headwise import bench

    if args.repeats is not None and args.max_repeats is not None and args.max_repeats < args.repeats:
        raise ValueError(f"--max-repeats ({args.max_repeats}) must be >= --repeats ({args.repeats}); "
                         f"e.g. --max-repeats {5 * args.repeats}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            writable_file(option, path)
    with console.status("measuring") as status:
        report = bench.run(quick=args.quick, repeats=args.repeats, memory=not args.no_memory,
                           limit_gib=args.memory_limit, progress=lambda m: status.update(f"measuring {m}"),
                           max_repeats=args.max_repeats)
    for part in _modules_tables(report):
        console.print(part)
    memory = any(r["forward_peak_mib"] is not None or r["train_peak_mib"] is not None for r in report["results"])
    if memory:
        console.print(_memory_table(report))
    else:  # a column of blanks explains nothing: say why there is none
        console.print("peak memory: not measured (--quick and --no-memory skip it; a full run measures it "
                      "in a fresh subprocess per case)")
    for r in report["results"]:
        if r["note"]:
            console.print(Text(f"note: {r['case']['label']}, {r['impl']}: {r['note']}"))
    console.print(_core_table(report))
    console.print(_decode_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        console.print(f"wrote {args.json}")
    if args.plot:
        bench.plot(report, args.plot)
        console.print(f"wrote {args.plot}")
    _warn_unstable(report)
    return 0


def _bench_table(title: str) -> Table:
    """A table of figures that fits an 80-column terminal: no vertical rules, the title wrapped."""
    from rich import box

    return Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)


def _modules_tables(report: dict) -> list:
    """What each case's implementations took: forward and forward + backward medians and their
    ratios to the SDPA module and torch's MHA; one table per case, titled with the case."""
    from headwise import bench

    machine = report["machine"]
    threads = f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}"
    out: list = [Text(f"modules ({threads}, torch {machine['torch']}): median ms; /SDPA and "
                      "/MHA: time / the SDPA module's and torch MHA's (< 1 is faster); f+b: forward + backward")]
    rows = report["results"]
    for label in dict.fromkeys(r["case"]["label"] for r in rows):
        table = _bench_table(label)
        table.add_column("implementation", min_width=16, no_wrap=True)
        for column in ("fwd ms", "/SDPA", "/MHA", "f+b ms", "/SDPA", "/MHA"):
            table.add_column(column, justify="right", min_width=6, no_wrap=True)
        group = [r for r in rows if r["case"]["label"] == label]
        base = {r["impl"]: r for r in group}
        sdpa, mha = base.get("SDPA module", {}), base.get("torch MHA", {})
        for r in group:
            table.add_row(r["impl"] + (" *" if r["note"] else ""), bench.fmt_ms(r["forward_ms"]) or "-",
                          bench.ratio(r["forward_ms"], sdpa.get("forward_ms")),
                          bench.ratio(r["forward_ms"], mha.get("forward_ms")), bench.fmt_ms(r["train_ms"]) or "-",
                          bench.ratio(r["train_ms"], sdpa.get("train_ms")),
                          bench.ratio(r["train_ms"], mha.get("train_ms")))
        if any(r["note"] for r in group):
            table.caption, table.caption_justify = "*: see the notes below", "left"
        out.append(table)
    return out


def _memory_table(report: dict) -> Table:
    """Peak memory of each case's implementations (a fresh subprocess's rise of its resident set)."""
    from headwise import bench

    table = _bench_table("peak memory: the rise of a fresh subprocess's resident set")
    table.add_column("case", max_width=24, overflow="fold")
    table.add_column("implementation", no_wrap=True)
    for column in ("peak fwd", "peak f+b"):
        table.add_column(column, justify="right", no_wrap=True)
    rows = report["results"]
    for label in dict.fromkeys(r["case"]["label"] for r in rows):
        group = [r for r in rows if r["case"]["label"] == label]
        for i, r in enumerate(group):
            table.add_row(label if i == 0 else "", r["impl"], bench.fmt_mib(r["forward_peak_mib"]) or "-",
                          bench.fmt_mib(r["train_peak_mib"]) or "-", end_section=i == len(group) - 1)
    return table


def _core_table(report: dict) -> Table:
    from headwise import bench

    table = _bench_table("attention core, forward (B=1, H=8, D=64): GFLOP/s = 4*B*H*S*Sk*D / time; matmul: an "
                         "fp32 matmul's GFLOP/s, timed in the same rounds")
    table.add_column("implementation", no_wrap=True)
    for column in ("S", "ms", "GFLOP/s", "matmul", "% of matmul"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in report["core"]:
        table.add_row(r["impl"], str(r["S"]), bench.fmt_ms(r["ms"]), f"{r['gflops']:.0f}",
                      f"{r['matmul_gflops']:.0f}", f"{r['of_matmul']:.0%}")
    return table


def _decode_table(report: dict) -> Table:
    table = _bench_table("decoding, one token per step after a prompt (B=1): the module with its KV cache vs a "
                         "plain decoder (fused qkv, SDPA on a preallocated cache); median us per step")
    for column in ("E", "H", "prompt", "headwise us", "SDPA decoder us", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in report["decode"]:
        table.add_row(str(r["E"]), str(r["H"]), str(r["prompt"]), f"{r['ours_us']:.0f}", f"{r['sdpa_us']:.0f}",
                      f"{r['ratio']:.2f}x")
    return table


def _warn_unstable(report: dict) -> None:
    """On stderr: the medians that did not settle, each with its spread (the tables stay on stdout)."""
    unstable = report.get("unstable", [])
    if not unstable:
        return
    medians = sum((r["forward_ms"] is not None) + (r["train_ms"] is not None) for r in report["results"]) \
        + len(report.get("core", [])) + len(report.get("decode", []))
    shown = "; ".join(unstable[:3]) + (f"; and {len(unstable) - 3} more" if len(unstable) > 3 else "")
    text = (f"headwise bench: warning: {len(unstable)} of {medians} medians are not stable within "
            f"+-{report['tolerance']:.0%} after {report['max_repeats']} repeats: {shown}. The timings of a "
            "busy machine or a first run (the CPU's clock and caches still warming up) move from round to "
            "round; the tables show those medians too, but their ratios may be far off. Rerun on a quiet "
            "machine, or raise --max-repeats.")
    print(textwrap.fill(text, width=_terminal_width() or 80, subsequent_indent="  "), file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (exit 2), not usage plus a line."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class _HelpFormatter(argparse.HelpFormatter):
    """Help wrapped to the real terminal (argparse reads COLUMNS, else assumes 80 columns)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_terminal_width())


def _terminal_width() -> int | None:
    """Columns of the terminal the output goes to: COLUMNS, else the terminal's size; None when
    neither is known (piped output), which leaves the choice to rich and argparse (80)."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="headwise",
        description="Multi-head attention, correct for every mask, and able to explain itself.",
    )
    parser.add_argument("--version", action="version", version=f"headwise {headwise.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    demo = sub.add_parser("demo", help="run the first document's example through every backend",
                          description="Run the first document's example (X (3, 2, 128), 8 heads, "
                          "mask [[1, 1], [1, 0], [1, 0]]) through every backend, then show its "
                          "stages as one table.")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(run=_demo)

    ex = sub.add_parser("explain", help="trace any configuration stage by stage",
                        description="Trace one configuration (default: the second document's "
                        "example, B=4 S=10 E=512 H=8) and print every stage's shape.")
    ex.add_argument("--batch", type=int, default=4, help="B (default 4)")
    ex.add_argument("--seq", type=int, default=10,
                    help="S (default 10; explain keeps (B, H, S, S) tensors, so B, H and S are limited to about "
                    "2 GiB of them)")
    ex.add_argument("--dim", type=int, default=512, help="E (default 512)")
    ex.add_argument("--heads", type=int, default=8, help="H (default 8)")
    ex.add_argument("--mask", nargs=2, metavar=("KIND", "SPEC"),
                    help="padding mask, e.g. --mask lengths 10,7,3,5 (one length per batch row)")
    ex.add_argument("--causal", action="store_true", help="causal masking")
    ex.add_argument("--kv-heads", type=int, default=None, help="Hkv for grouped-query attention")
    ex.add_argument("--backend", default="matmul",
                    help="kernel to trace (default matmul, which shows every stage; "
                    "'auto' shows what auto runs)")
    ex.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ex.add_argument("--plot", metavar="FILE.png", help="also draw the mask and each head's weights")
    ex.add_argument("--plot-batch", type=int, default=None,
                    help="batch row to plot, with --plot (default: the one with the most padding)")
    ex.add_argument("--markdown", action="store_true",
                    help="print the 'How multi-head attention works' page instead of the table")
    ex.add_argument("--softcap", type=float, default=None,
                    help="logit soft-capping: scores -> softcap * tanh(scores / softcap), as in Gemma 2")
    ex.add_argument("--sinks", action="store_true",
                    help="attention sinks: one random sink logit per head (from --seed), as in gpt-oss")
    ex.add_argument("--rule", metavar="KIND:SPEC", default=None,
                    help="a mask_mod: document:4,6 (document lengths summing to --seq), prefix:3 or window:4")
    ex.add_argument("--tiles", metavar="FILE.png", help="with --rule, draw its tile map (empty, partial, full)")
    ex.add_argument("--tile", type=int, default=4, help="the tile map's tile size, with --rule (default 4)")
    ex.set_defaults(run=_explain)

    eq = sub.add_parser("equivalences", help="measure the documents' equivalent forms side by side",
                        description="Run each equivalence the first document tabulates on random "
                        "tensors and measure contiguity needs, views and differences.")
    eq.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    eq.set_defaults(run=_equivalences)
    add_embed_parser(sub)

    be = sub.add_parser("bench", help="time and memory against torch's MHA and an SDPA module",
                        description="Compare headwise (auto and backends), the document's class, "
                        "torch.nn.MultiheadAttention and a plain SDPA module on the same inputs: forward "
                        "and forward+backward time and peak memory, dense, padded and long sequences, "
                        "plus the attention core's FLOP rate against the machine's matmul rate.")
    be.add_argument("--quick", action="store_true", help="small shapes, under a minute (CI smoke)")
    be.add_argument("--repeats", type=positive_int, default=None,
                    help="timed repeats per case, at least (default 5, quick 3)")
    be.add_argument("--max-repeats", type=positive_int, default=None,
                    help="timed repeats per case, at most (default 5 x --repeats): rounds go on until every "
                    "median is stable within +-5%%, and a warning names those that are not")
    be.add_argument("--json", metavar="FILE", help="also write every measurement as JSON")
    be.add_argument("--plot", metavar="FILE.png", help="draw time and memory against sequence length")
    be.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    be.add_argument("--memory-limit", type=positive_float, default=16.0,
                    help="GiB a case may use before it is reported out of memory (default 16)")
    be.set_defaults(run=_bench)

    _add_tune_parser(sub)
    return parser


def _add_tune_parser(sub: Any) -> None:
    tu = sub.add_parser("tune", help="measure this machine's unit costs for auto",
                        description="Measure the unit costs that auto weighs between the dense path, packing "
                        "and the varlen kernel on this machine (about a second), store them per CPU, torch "
                        "version and thread count, and print them beside the built-in ones. auto measures "
                        "them at first use; run this again after a change of machine load or settings.")
    tu.add_argument("--repeats", type=positive_int, default=5, help="timed loops per point, the least kept "
                    "(default 5)")
    tu.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads to measure with (default: torch's; costs are stored per count)")
    tu.add_argument("--show", action="store_true", help="print the stored costs without measuring")
    tu.set_defaults(run=_tune)


def _tune(args: argparse.Namespace, console: Console) -> int:
    """``headwise tune``: measure (or show) this machine's unit costs, beside the built-in ones."""
    from headwise import calibration, policy, tune

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.show:
        found = calibration.stored()
        if found is None:
            console.print(f"no calibration stored for {calibration.machine_key()} in {calibration.cache_file()}")
            return 1
    else:
        try:
            found = calibration.calibrate(timing=tune.Timing(repeats=args.repeats))
        except calibration.MeasurementError as e:  # a busy machine: say so, store nothing
            print(f"headwise tune: {e}", file=sys.stderr)
            return 1
    table = Table(title=f"unit costs: {found.key}", title_justify="left")
    table.add_column("cost")
    for head in ("fwd, built in", "fwd, here", "train, built in", "train, here"):
        table.add_column(head, justify="right")
    built_in = (policy.BUILT_IN_INFERENCE_COSTS, policy.BUILT_IN_TRAINING_COSTS)
    for field in ("call_us", "pack_us", "bucket_us", "gemm_ps", "attn_ps", "copy_ps"):
        cells = [getattr(c, field) for c in (built_in[0], found.inference, built_in[1], found.training)]
        table.add_row(field, *(f"{v:,.1f}" for v in cells))
    console.print(table)
    console.print(f"measured {found.measured_at} in {found.seconds:.1f} s; stored in {calibration.cache_file()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``headwise`` command; returns the exit code.

    >>> main(["explain", "--seq", "2", "--dim", "8", "--heads", "2", "--markdown"]) == 0  # doctest: +ELLIPSIS
    # How multi-head attention works
    ...
    True
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or --version (code 0) or a bad argument (code 2)
        return int(exc.code or 0)
    if args.command is None:  # bare `headwise`: what it can do, as a usage error
        parser.print_help()
        return 2
    console = Console(width=_terminal_width())  # None: rich's own guess (80 columns when piped)
    try:
        return args.run(args, console)
    except (ValueError, TypeError, ImportError) as exc:  # the caller's mistake: a usage error
        print(f"headwise {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"headwise {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the machine's (a full disk, no memory) or a bug: still one line
        if os.environ.get("HEADWISE_TRACEBACK"):
            raise
        detail = str(exc) or type(exc).__name__
        if not isinstance(exc, OSError | MemoryError):
            detail = f"{type(exc).__name__}: {detail} (HEADWISE_TRACEBACK=1 shows where)"
        print(f"headwise {args.command}: error: {detail}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

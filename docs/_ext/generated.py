"""Sphinx extension: the site's generated content, made by running headwise while the site builds.

A build computes what is deterministic and never times anything. At every build it writes,
into ``docs/_generated/`` (not committed),

- ``how-attention-works.md``: ``headwise explain --mask lengths 10,7,3,5 --markdown``;
- ``weights-padding.png`` and ``weights-causal.png``: ``headwise explain ... --plot``, a mask
  and every head's attention weights;
- ``equivalences.md``: the table ``headwise equivalences`` prints, from the same computations
  (shapes, views and differences: no timings);
- ``bench.md`` and ``bench.png``: the tables and the plot of the benchmark run committed in
  ``docs/_measured/bench.json``, with the machine, torch version and date it was measured on.
  That file is measured by one command, ``python tools/measure_docs.py``, on a quiet machine;
  a build only renders it, so a busy build machine cannot publish its own noise.

The pages pull them in with ``{include}`` and ``![...](_generated/...)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

from headwise.bench import fmt_mib, fmt_ms, plot, ratio
from headwise.equivalences import measure

logger = logging.getLogger(__name__)

GENERATED = Path(__file__).resolve().parents[1] / "_generated"
MEASURED = Path(__file__).resolve().parents[1] / "_measured" / "bench.json"  # tools/measure_docs.py writes it
EXPLAIN = ("explain", "--mask", "lengths", "10,7,3,5")  # the example README.md and the tests use


def headwise_cli(*args: str) -> str:
    """Run ``headwise ARGS`` in a fresh interpreter; returns its standard output."""
    logger.info("[generated] headwise %s", " ".join(args))
    run = subprocess.run([sys.executable, "-m", "headwise", *args], capture_output=True, text=True, check=False,
                         stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "160"})
    if run.returncode != 0:
        raise ExtensionError(f"headwise {' '.join(args)} exited with {run.returncode}:\n{run.stderr}")
    return run.stdout


def _table(header: list[str], rows: list[list[str]], left: int = 0) -> str:
    """A Markdown table; the columns after the first ``left`` hold numbers and align right."""
    rules = ["---" if i < left else "---:" for i in range(len(header))] if left else ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rules) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def equivalences_markdown() -> str:
    """``headwise equivalences``'s table as Markdown, from the same measurements."""
    def yes_no(flag: bool | None) -> str:
        return "fails" if flag is None else ("yes" if flag else "no")

    rows, previous = [], None
    for row in measure(seed=0):
        diff = f"{row.max_diff:.1e}" if row.max_diff is not None else f"fails: {(row.error or '')[:60]}"
        needs = "fails" if row.view_of_contiguous is None else ("yes" if row.needs_contiguous else "no")
        step, previous = ("" if row.group == previous else row.group), row.group  # each step named once
        rows.append([step, f"`{row.form}`", needs, yes_no(row.view_of_contiguous),
                     yes_no(row.view_of_noncontiguous), diff])
    return _table(["step", "form", "needs contiguous input", "view of a contiguous input",
                   "view of a non-contiguous input", "max abs diff vs the first form"], rows)


def bench_markdown(report: dict) -> str:
    """The tables ``headwise bench`` prints, as Markdown, under the machine, torch version and date
    of the measurement (``report["measured"]``, written by ``tools/measure_docs.py``)."""
    machine, measured = report["machine"], report["measured"]
    head = (f"Measured on **{measured['cpu']}** ({machine['cpus']} CPUs, {machine['threads']} torch threads, "
            f"torch {machine['torch']}) on {measured['date']} with `{measured['command']}`, not while this "
            "site was built. Median milliseconds; a ratio is time / baseline, so below 1 is faster than the "
            "baseline.\n\n")
    if report.get("unstable"):
        head += ("**Not stable:** " + "; ".join(report["unstable"][:5])
                 + ("; ..." if len(report["unstable"]) > 5 else "") + ".\n\n")
    memory = any(r["forward_peak_mib"] or r["train_peak_mib"] for r in report["results"])
    header = ["case", "implementation", "fwd ms", "/ SDPA module", "/ torch MHA", "fwd+bwd ms", "/ SDPA module",
              "/ torch MHA"] + (["peak fwd", "peak fwd+bwd"] if memory else [])
    rows = []
    for label in dict.fromkeys(r["case"]["label"] for r in report["results"]):
        group = [r for r in report["results"] if r["case"]["label"] == label]
        base = {r["impl"]: r for r in group}
        sdpa, mha = base.get("SDPA module", {}), base.get("torch MHA", {})
        for i, r in enumerate(group):
            row = [label if i == 0 else "", r["impl"], fmt_ms(r["forward_ms"]),
                   ratio(r["forward_ms"], sdpa.get("forward_ms")),
                   ratio(r["forward_ms"], mha.get("forward_ms")), fmt_ms(r["train_ms"]),
                   ratio(r["train_ms"], sdpa.get("train_ms")), ratio(r["train_ms"], mha.get("train_ms"))]
            if memory:
                row += [fmt_mib(r["forward_peak_mib"]), fmt_mib(r["train_peak_mib"])]
            rows.append(row)
    core = [[r["impl"], str(r["S"]), fmt_ms(r["ms"]), f"{r['gflops']:.0f}", f"{r['matmul_gflops']:.0f}",
             f"{r['of_matmul']:.0%}"] for r in report["core"]]
    return (head + "### Modules, forward and forward + backward\n\n" + _table(header, rows, left=2)
            + "\n### The attention core against the machine's matmul rate\n\n"
            "Forward only, B = 1, H = 8, D = 64: FLOPs 4·B·H·S·Sk·D / time, next to an fp32 matmul timed in "
            "the same rounds.\n\n"
            + _table(["implementation", "S", "ms", "GFLOP/s", "matmul GFLOP/s", "% of matmul rate"], core, left=1)
            + "\n### Decoding\n\nOne token per step after a prompt (B = 1): the module with its KV cache against a "
            "plain decoder (a fused qkv `nn.Linear`, SDPA on a preallocated cache); median microseconds per step.\n\n"
            + _table(["E", "H", "prompt", "headwise us", "SDPA decoder us", "ratio"],
                     [[str(r["E"]), str(r["H"]), str(r["prompt"]), f"{r['ours_us']:.0f}", f"{r['sdpa_us']:.0f}",
                       f"{r['ratio']:.2f}x"] for r in report.get("decode", [])], left=0))


def generate(app: Sphinx) -> None:
    """Write everything in ``docs/_generated/`` anew (no timing: the benchmark tables are committed)."""
    GENERATED.mkdir(exist_ok=True)
    (GENERATED / "how-attention-works.md").write_text(headwise_cli(*EXPLAIN, "--markdown"))
    headwise_cli(*EXPLAIN, "--plot", str(GENERATED / "weights-padding.png"))
    headwise_cli(*EXPLAIN, "--causal", "--kv-heads", "2", "--plot", str(GENERATED / "weights-causal.png"))
    (GENERATED / "equivalences.md").write_text(equivalences_markdown())
    if not MEASURED.is_file():
        raise ExtensionError(f"{MEASURED} is missing; measure it with: python tools/measure_docs.py")
    report = json.loads(MEASURED.read_text())
    (GENERATED / "bench.md").write_text(bench_markdown(report))
    plot(report, str(GENERATED / "bench.png"))  # drawn from the committed numbers: nothing is timed


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", generate)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

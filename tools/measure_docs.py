"""Measure the benchmark tables the documentation site publishes: the one command that does.

A site build never times anything (a busy build machine once published "130.79x"); it renders
``docs/_measured/bench.json``, which this script writes, with the CPU, torch version, date and
command line of the measurement. Run it on a quiet machine and commit the file::

    python tools/measure_docs.py                           # the quick run the page describes
    python tools/measure_docs.py --repeats 1 --max-repeats 1   # a smoke run: the format, not figures

It exits 1 (the file is still written, marked) when some medians did not settle: rerun on a
quieter machine, or with a larger ``--max-repeats``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from headwise import bench, calibration

OUT = Path(__file__).resolve().parents[1] / "docs" / "_measured" / "bench.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full run (minutes, peak memory too), not --quick")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case, at least (bench's default)")
    parser.add_argument("--max-repeats", type=int, default=None,
                        help="timed repeats per case, at most (bench's default: 5 x --repeats)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"where to write (default {OUT})")
    args = parser.parse_args(argv)

    report = bench.run(quick=not args.full, repeats=args.repeats, max_repeats=args.max_repeats, memory=args.full,
                       progress=lambda message: print(f"measuring {message}", file=sys.stderr))
    command = " ".join(["python tools/measure_docs.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])])
    report["measured"] = {
        "cpu": calibration.cpu_name(),
        "torch": report["machine"]["torch"],
        "date": datetime.date.today().isoformat(),
        "command": command.strip(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({report['measured']['cpu']}, torch {report['measured']['torch']})")
    for line in report["unstable"]:
        print(f"not stable: {line}", file=sys.stderr)
    return 1 if report["unstable"] else 0


if __name__ == "__main__":
    sys.exit(main())

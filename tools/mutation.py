"""Mutation testing of the core: how many planted bugs does the test suite catch?

Runs mutmut (3.x) over the files that hold the contract — masks, the functional API, the
module (``module/``, its parts), the cache, rotary positions and the ``sdpa`` and ``chunked`` kernels — against a
fast selection of the tests, in a scratch copy of the repository (mutmut writes a
``mutants/`` tree next to the code it mutates). Prints the kill rate per file and every
surviving mutant that is not listed in ``tools/mutation_equivalents.txt`` (mutants that
cannot change behaviour, each with its reason).

Why mutmut: it is maintained, and it puts every mutant of a file into one copy of the
code behind a switch, so each mutant costs one forked pytest run of only the tests that
reach the mutated function; torch is imported once (cosmic-ray starts a process, and
imports torch, per mutant: about 10x slower here). mutmut skips functions with
decorators other than staticmethod/classmethod, which is one reason the kernels are
listed in ``headwise.kernels.BUILTIN`` instead of registered by decorator.

Usage::

    python tools/mutation.py                      # all files (about 15-25 minutes on 2 cores)
    python tools/mutation.py --files masks.py     # one file
    python tools/mutation.py --show               # also print each survivor's diff
    python tools/mutation.py --keep               # keep the scratch copy (its path is printed), then:
    python tools/mutation.py --rerun DIR          # the current tests against that copy's survivors only
    python tools/mutation.py --report DIR         # the table of a kept copy, running nothing
    python tools/mutation.py --module --sample 400 --seed 1   # a uniform random sample of the module's mutants

``--sample N`` estimates a kill rate that a full run cannot reach in a session (module code alone has
about 4,700 mutants; two cores check 6-70 a minute): every mutant of the files is generated, the
known-equivalent ones are set aside, N of the others are drawn uniformly at random (``--seed``) and only
those are run. The table then counts the drawn mutants only, and the last line gives the estimate with
its 95% Wilson interval: the whole population's rate lies in it for about 95 of 100 draws. ``--rerun``
and ``--report`` of a kept sample stay within its drawn mutants.

Not run in CI: it is a measurement of the tests, not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = ["module/layer.py", "module/plan.py", "module/dense.py", "module/packed.py", "module/cached.py",
          "module/fused.py", "module/memo.py", "module/checks.py", "module/projections.py", "module/report.py",
          "module/qkv.py", "module/ruled.py", "module/paged.py", "module/torch_mha.py"]
FILES = ["masks.py", "mask_contract.py", "functional.py", *MODULE, "cache.py", "positions.py", "kernels/sdpa.py",
         "kernels/chunked.py"]
# The tests that exercise those files (explain mode's included: its stages are output too),
# without the slow Triton interpreter, the Hugging Face models and the benchmark's subprocesses.
TESTS = ["tests/test_masks.py", "tests/test_mask_contract.py", "tests/test_functional.py", "tests/test_module.py",
         "tests/test_module_refusals.py", "tests/test_nan_contract.py",
         "tests/test_module_oracles.py", "tests/test_cache.py", "tests/test_positions.py",
         "tests/test_dispatch.py", "tests/test_packing.py", "tests/test_reference.py", "tests/test_tracing.py",
         "tests/test_explain.py",
         "tests/kernels/test_parity.py", "tests/kernels/test_chunked.py",
         "tests/kernels/test_varlen_kernel.py", "tests/kernels/test_registry.py",
         "tests/module/test_cached.py", "tests/module/test_qkv.py", "tests/module/test_paged_path.py",
         "tests/module/test_ecosystem.py", "tests/test_rules.py", "tests/test_module_softcap_sinks.py",
         "tests/module/test_report.py", "tests/module/test_ruled.py", "tests/module/test_packed.py",
         "tests/module/test_torch_mha.py", "tests/module/test_meta.py",
         "tests/module/test_plan.py", "tests/module/test_checks.py", "tests/module/test_fused.py",
         "tests/module/test_projections.py", "tests/module/test_context_parallel_path.py", "tests/test_weights.py"]
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.txt"


def equivalents() -> dict[str, str]:
    """Known-equivalent mutants, one a line: ``<function> | <mutated line, stripped> | reason``.

    They are matched on the function and the text of the mutated line, not on mutmut's
    numbering, which shifts whenever the function changes.
    """
    known = {}
    for line in EQUIVALENTS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            function, mutated, reason = (part.strip() for part in line.split(" | ", 2))
            known[f"{function} | {mutated}"] = reason
    return known


_DIFFS = """
import json, sys
from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
names = json.load(sys.stdin)
json.dump({name: get_diff_for_mutant(name, path=find_mutant(name).path) for name in names}, sys.stdout)
"""


def diffs(work: Path, names: list[str]) -> dict[str, str]:
    """Each mutant's diff, as ``mutmut show`` prints it (one process for all of them)."""
    done = subprocess.run([sys.executable, "-c", _DIFFS], cwd=work, input=json.dumps(names), capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


_GENERATE = """
import os
from mutmut.__main__ import create_mutants, store_lines_covered_by_tests
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); store_lines_covered_by_tests()
create_mutants(int(os.environ["MUTATION_JOBS"]))
"""


def draw(work: Path, files: list[str], size: int, seed: int, env: dict[str, str]) -> tuple[list[str], int, int]:
    """Generate every mutant of ``files`` (running nothing), then draw ``size`` of those not known to be
    equivalent, uniformly at random. Returns the drawn names, the number of mutants and the number
    set aside as known-equivalent."""
    subprocess.run([sys.executable, "-c", _GENERATE], cwd=work, env=env,
                   capture_output=True, text=True, check=True)
    names = [name for f in files
             for name in json.loads((work / "mutants" / "src" / "headwise" / f"{f}.meta").read_text())
             ["exit_code_by_key"]]
    known = equivalents()
    frame = sorted(name for name, diff in diffs(work, names).items()
                   if " | ".join(mutated_line(name, diff)) not in known)
    return random.Random(seed).sample(frame, min(size, len(frame))), len(names), len(names) - len(frame)


def wilson(killed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``killed / n`` (sound near 100%, unlike p +- 2 se)."""
    p = killed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def mutated_line(name: str, diff: str) -> tuple[str, str]:
    """The function and the first changed line of mutant ``name``."""
    added = next((ln[1:].split("  #")[0].strip() for ln in diff.splitlines()
                  if ln.startswith("+") and not ln.startswith("+++")), "")
    function = re.sub(r"__mutmut_\d+$", "", name).replace(".x_", ".").replace(".xǁ", ".").replace("ǁ", ".")
    return function, added


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=FILES, help="files under src/headwise to mutate")
    parser.add_argument("--module", action="store_true", help="the module's files only (module/*.py)")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="run only N mutants drawn at random (known-equivalent ones set aside); estimate the rate")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (--sample)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="mutants run at once")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    parser.add_argument("--rerun", metavar="DIR", type=Path,
                        help="a copy kept by --keep: run the current tests against the mutants that were not killed")
    parser.add_argument("--report", metavar="DIR", type=Path, help="a copy kept by --keep: its table, running nothing")
    args = parser.parse_args(argv)
    if args.module:
        args.files = MODULE
    if args.sample is not None and (args.rerun or args.report):
        parser.error("--sample makes a fresh copy; it does not combine with --rerun or --report")
    try:
        from mutmut.stats import status_by_exit_code  # mutmut's own reading of a mutant's exit code
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mutmut>=3.8,<4"], check=True)
        from mutmut.stats import status_by_exit_code

    reset: set[str] = set()  # --rerun: the mutants it tries again
    if args.report:
        work = args.report.resolve()
        args.keep = True
    elif args.rerun:
        work = args.rerun.resolve()
        reset = _reset_survivors(work, args.files, status_by_exit_code)
        shutil.rmtree(work / "tests")
        shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)  # map the new tests to functions
        args.keep = True
    else:
        work = Path(tempfile.mkdtemp(prefix="headwise-mutation-"))
        tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
        for rel in tracked:
            if (ROOT / rel).is_file():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, work / rel)
    config = {
        "source_paths": ["src/headwise"],
        "only_mutate": [f"src/headwise/{f}" for f in args.files],
        "pytest_add_cli_args_test_selection": [t for t in TESTS if (work / t).exists()],
        "pytest_add_cli_args": ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"],
        "process_isolation": "forkserver",  # torch is not fork-safe after the stats run
        "also_copy": ["docs/"],  # explain mode's generated page, which a test compares
    }
    if not args.report:  # (re)write the [tool.mutmut] section: a rerun takes today's test selection
        pyproject = work / "pyproject.toml"
        text = pyproject.read_text().split("\n[tool.mutmut]\n")[0]
        pyproject.write_text(text + "\n[tool.mutmut]\n" + "".join(f"{key} = {json.dumps(value)}\n"
                                                                  for key, value in config.items()))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MUTATION_JOBS=str(args.jobs))
    start = time.perf_counter()
    drawn: list[str] = []
    if args.sample is not None:
        drawn, population, set_aside = draw(work, args.files, args.sample, args.seed, env)
        (work / "drawn.json").write_text(json.dumps({"names": drawn, "population": population,
                                                     "set_aside": set_aside, "seed": args.seed}))
    elif (work / "drawn.json").exists():  # a kept sample (--rerun, --report): only its drawn mutants count
        kept = json.loads((work / "drawn.json").read_text())
        drawn, population, set_aside, args.seed = kept["names"], kept["population"], kept["set_aside"], kept["seed"]
    names = [n for n in drawn if n in reset] if args.rerun else drawn  # (mutmut runs every mutant given none)
    if not args.report and (names or not drawn):
        done = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.jobs), *names],
                              cwd=work, env=env, capture_output=True, text=True, check=False)
        if done.returncode:  # e.g. the unmutated tests fail there: every verdict would be stale
            tail = (done.stdout + done.stderr).replace("\r", "\n").strip().splitlines()[-5:]
            print(f"mutmut run failed (exit {done.returncode}) in {work}:", *tail, sep="\n", file=sys.stderr)
            return 1
    minutes = (time.perf_counter() - start) / 60

    known = equivalents()
    per_file: dict[str, Counter] = {}
    codes = {}
    chosen = set(drawn)
    for f in args.files:
        meta = work / "mutants" / "src" / "headwise" / f"{f}.meta"
        per_file[f] = Counter()
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if not drawn or name in chosen:
                codes[name] = (f, status_by_exit_code[code])
    survived = [name for name, (_, status) in codes.items() if status == "survived"]
    survivors = []
    for name, diff in diffs(work, survived).items():
        function, added = mutated_line(name, diff)
        if f"{function} | {added}" in known:
            codes[name] = (codes[name][0], "equivalent")
        else:
            survivors.append((name, function, added, diff))
    for f, status in codes.values():
        per_file[f][status] += 1

    total = Counter()
    if args.report:
        print(f"mutation testing: the results kept in {work}")
    else:
        selection = config["pytest_add_cli_args_test_selection"]
        print(f"mutation testing: {minutes:.1f} min, tests: {len(selection)} files")
    print(f"{'file':<22} {'mutants':>7} {'killed':>7} {'equiv':>6} {'survived':>8} {'no tests':>8} {'other':>6}"
          f" {'kill rate':>9}")
    for f, counts in per_file.items():
        total.update(counts)
        print(_row(f, counts))
    print(_row("all", total))
    if drawn:
        killed = total["killed"] + total["timeout"]
        considered = sum(total.values()) - total["equivalent"]
        low, high = wilson(killed, considered)
        print(f"sample: {len(drawn)} of the {population - set_aside} mutants not known to be equivalent "
              f"({population} in all, {set_aside} set aside), seed {args.seed}: kill rate {killed / considered:.1%},"
              f" 95% interval {low:.1%}-{high:.1%}")
    for name, function, added, diff in survivors:
        print(f"survived: {name}\n    {function} | {added}")
        if args.show:
            print("\n".join("    " + ln for ln in diff.splitlines()))
    if args.keep:
        print(f"scratch copy kept at {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _reset_survivors(work: Path, files: list[str], status_by_exit_code) -> set[str]:
    """Mark every mutant that was not killed as unchecked, so the next run tries it again; their names."""
    reset = set()
    for f in files:
        meta = work / "mutants" / "src" / "headwise" / f"{f}.meta"
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        for name, code in codes.items():
            if status_by_exit_code[code] in ("survived", "no tests", "not checked"):
                codes[name] = None
                reset.add(name)
        meta.write_text(json.dumps(data, indent=4))
    return reset


def _row(label: str, counts: Counter) -> str:
    """One table row. A timeout counts as killed (the tests noticed); equivalent mutants are
    left out of the rate (no test can kill them); "no tests" counts as not killed."""
    n = sum(counts.values())
    killed = counts["killed"] + counts["timeout"]
    equivalent, survived, untested = counts["equivalent"], counts["survived"], counts["no tests"]
    other = n - killed - equivalent - survived - untested
    considered = n - equivalent
    rate = f"{killed / considered:.1%}" if considered else "-"
    return f"{label:<22} {n:>7} {killed:>7} {equivalent:>6} {survived:>8} {untested:>8} {other:>6} {rate:>9}"


if __name__ == "__main__":
    raise SystemExit(main())

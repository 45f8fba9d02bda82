"""Measure the unit costs behind "auto"'s packing estimate (``headwise.policy.Costs``).

The procedure is :mod:`headwise.tune`'s (the one "auto" runs at first use and ``headwise
tune`` runs on demand), with longer loops and more repeats: each constant comes from
primitive operations or from the module at tiny shapes, never from the module rows the
choice is judged on (``benchmarks/auto_grid.py`` does that).

Forward under no_grad gives ``INFERENCE_COSTS``; forward + backward ``TRAINING_COSTS``.
Paste the two printed lines into ``src/headwise/policy.py`` to change the built-in costs
(those a machine uses with ``HEADWISE_TUNE=off``, or until it is measured).

    python benchmarks/pack_cost.py [--threads 1] [--repeats 15] [--cpu-time]
"""

from __future__ import annotations

import argparse
import time

import torch

from headwise import tune
from headwise.calibration import cpu_name


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time (with --threads 1, other jobs on the machine "
                             "disturb it less)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    timing = tune.Timing(args.repeats, 5e-3, time.process_time if args.cpu_time else time.perf_counter)
    clock = "CPU" if args.cpu_time else "wall"
    print(f"# benchmarks/pack_cost.py, {torch.get_num_threads()} thread(s), {clock} time, {cpu_name()}, "
          f"torch {torch.__version__}")
    for name, training in (("INFERENCE_COSTS", False), ("TRAINING_COSTS", True)):
        c = tune.measure_costs(training, timing)
        print(f"{name} = Costs(call_us={c.call_us:.1f}, pack_us={c.pack_us:.1f}, bucket_us={c.bucket_us:.1f}, "
              f"gemm_ps={c.gemm_ps:.2f}, attn_ps={c.attn_ps:.2f}, copy_ps={c.copy_ps:.1f})")


if __name__ == "__main__":
    main()

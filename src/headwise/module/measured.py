"""A packing choice measured, not estimated: the dense and the packed path of one call timed
in turns, the faster kept for the call's shape.

Where "auto"'s estimates price the two paths within ``policy.PACK_MEASURE_BAND`` of each
other, their error (a fifth, even with this machine's own unit costs) decides the choice, so a
call without gradients measures it instead (:func:`headwise.module.plan.choose_packing` says
when), as ``torch.backends.cudnn.benchmark`` does for convolutions. Both paths give the same
result up to rounding (tests/module/test_measured.py compares them with a float64 computation);
the call returns the faster path's output, and every later call of the shape (batch, length,
heads, dtype, padding in steps of 5%, attention calls, threads) takes that path without
measuring. A shape is measured at its second call (:func:`headwise.module.plan.recurs`); its
first runs the estimates' path.

Legend: B batch, S query length, E embed dim.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import cast

from torch import Tensor

from headwise.module import dense, packed
from headwise.module.layer_protocol import Layer
from headwise.module.memo import Repeat
from headwise.module.plan import Measured, Plan, remember_measured

# Each path runs this many times, in turns that alternate which one goes first; the least time
# counts. With 2 a noisy machine picked the slower path for benchmarks/auto_grid.py's B=8 S=128
# E=256 row (36% padding) in 1 of 4 tries (Intel Xeon, 2 cores: dense 4.2-4.8 ms, packed 4.7-4.9),
# with 3 in none of 5.
TURNS = 3
_clock = time.perf_counter  # tests replace it


def run(mha: Layer, x: Tensor, attention_mask: Tensor, plan: Plan, shape: tuple, key: tuple | None) -> Tensor:
    """Run the dense and the packed path in turns, remember the faster under ``shape`` (the
    plan's ``measure``) and return its output (B, S, E).
    ``key``: the call's memo key (None: not remembered).

    Each path is timed as the shape's later calls would run it: the dense path's first run
    checks and dispatches its attention call and the memo keeps it under ``key``, so its other
    runs are the memo's repeats (``dense.forward_repeat``); the packed path runs in full every
    call. The memo then holds the faster path for ``key``."""
    dense_plan, packed_plan = replace(plan, path="dense", measure=None), replace(plan, path="packed", measure=None)

    def run_dense() -> Tensor:
        repeat = None if key is None else mha._repeats.get(key)
        if repeat is not None and repeat.attention is not None:  # as the memo repeats it
            return dense.forward_repeat(mha, x, plan.padding if repeat.padded else None, repeat.attention)
        return cast(Tensor, dense.forward(mha, x, attention_mask, None, dense_plan, False, key))  # (B, S, E)

    paths = {"dense": run_dense, "packed": lambda: packed.forward(mha, x, packed_plan)}
    least = dict.fromkeys(paths, math.inf)
    outputs: dict[str, Tensor] = {}
    for turn in range(TURNS):
        for path in ("dense", "packed") if turn % 2 == 0 else ("packed", "dense"):
            start = _clock()
            outputs[path] = paths[path]()  # (B, S, E)
            least[path] = min(least[path], _clock() - start)
    faster = min(least, key=least.__getitem__)
    found = Measured(faster, least["dense"] * 1e6, least["packed"] * 1e6)
    remember_measured(shape, found)
    if faster == "packed":  # the memo holds the dense path's prepared call: the shape packs instead
        mha._repeats.remember(key, Repeat("packed", f"{plan.why}; {found}", plan.is_causal, None, True))
    return outputs[faster]

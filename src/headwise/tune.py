"""Measure the unit costs behind "auto"'s estimates (:class:`headwise.policy.Costs`) on this machine.

:mod:`headwise.calibration` runs :func:`measure` at the first decision that reads the costs
and stores the result; ``headwise tune`` and ``benchmarks/pack_cost.py`` run it on demand.
Each constant comes from primitive operations or from the module at a tiny shape, never
from the module rows the choice is judged on (``benchmarks/auto_grid.py`` does that):

* ``gemm_ps``: the slope of a least-squares fit of time against multiply-adds, over the
  module's two projections (E -> 3E, E -> E) at several row counts and widths;
* ``attn_ps``: the same for SDPA with a key padding mask;
* ``copy_ps``: the same for a concatenation of row blocks and a scatter of rows (what
  packing, bucketing and unpacking do);
* ``bucket_us``: the slope of ``packing.attend_packed`` against its number of attention
  calls, at sizes where the arithmetic is negligible;
* ``call_us``: the dense module at a tiny shape, less what the slopes above price;
* ``pack_us``: the packed module on the same input, less the dense call, its attention
  calls and what the slopes price.

A forward under ``no_grad`` gives the inference costs; a forward and its backward the
training costs. The measurement runs in its own RNG state, outside autocast and inference
mode, so the caller's state is untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from headwise import packing, policy
from headwise.calibration import MeasurementError
from headwise.module.layer import MultiHeadAttention

__all__ = ["Timing", "measure", "measure_costs"]


# A fit of time against work must explain at least this share of the variance (R^2) for its
# slope to be kept: on a machine busy with other work the points scatter, and a slope drawn
# through them would misprice every decision made with it until the next measurement.
MIN_R2 = 0.8


@dataclass(frozen=True)
class Timing:
    """How long each timing runs: ``repeats`` loops of about ``loop_s`` seconds, the least
    taken (the run least disturbed by other work); ``clock`` is the clock
    (``time.perf_counter``; ``time.process_time`` counts only this process's CPU time)."""

    repeats: int = 5
    loop_s: float = 2e-3
    clock: Callable[[], float] = time.perf_counter


def _seconds(fn: Callable[[], object], timing: Timing) -> float:
    """Least seconds of ``fn`` over the repeats (after one warm-up call)."""
    clock = timing.clock
    fn()
    start = clock()
    fn()
    once = clock() - start
    calls = max(1, int(timing.loop_s / max(once, 1e-7)))
    times = []
    for _ in range(timing.repeats):
        start = clock()
        for _ in range(calls):
            fn()
        times.append((clock() - start) / calls)
    return min(times)


def _slope(points: Sequence[tuple[float, float]], what: str) -> float:
    """Least-squares slope of seconds against units, in picoseconds per unit.

    Raises:
        MeasurementError: the slope is not positive, or the fit explains less than
            :data:`MIN_R2` of the variance.
    """
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], dim=1)  # (n, 2): intercept, slope
    fit = torch.linalg.lstsq(design, ys[:, None]).solution  # (2, 1)
    residual = float(((design @ fit)[:, 0] - ys).pow(2).sum())
    r2 = 1.0 - residual / max(float((ys - ys.mean()).pow(2).sum()), 1e-30)
    slope = float(fit[1, 0])
    if slope <= 0 or r2 < MIN_R2:
        raise MeasurementError(f"{what}: time against work fits with slope {slope * 1e12:.3g} and R^2 {r2:.2f} "
                               f"(kept from R^2 {MIN_R2} and a positive slope): the machine was busy? "
                               "`headwise tune` measures again")
    return slope * 1e12


def _run(fn: Callable[[], torch.Tensor], training: bool) -> Callable[[], object]:
    """``fn()`` under no_grad, or with a backward through its output."""
    def forward() -> None:
        with torch.no_grad():
            fn()

    def train() -> None:
        out = fn()
        out.backward(torch.ones_like(out))

    return train if training else forward


def gemm_ps(training: bool, timing: Timing) -> float:
    points = []
    for N, E in ((256, 128), (1024, 128), (512, 256), (1024, 256), (512, 512), (1024, 512)):
        x = torch.randn(N, E)
        w_in, w_out = torch.randn(3 * E, E) / E**0.5, torch.randn(E, E) / E**0.5
        b_in, b_out = torch.zeros(3 * E), torch.zeros(E)
        if training:
            for t in (x, w_in, w_out, b_in, b_out):
                t.requires_grad_()

        def fn(x=x, w_in=w_in, w_out=w_out, b_in=b_in, b_out=b_out, E=E):
            h = F.linear(x, w_in, b_in)[:, :E]  # (N, 3E) -> the q part stands for the attention output
            return F.linear(h, w_out, b_out)  # (N, E)

        points.append((N * E * 4 * E, _seconds(_run(fn, training), timing)))
    return _slope(points, "gemm_ps")


def attn_ps(training: bool, timing: Timing) -> float:
    points = []
    for n, H, L, D in ((8, 4, 64, 32), (8, 4, 128, 64), (16, 8, 128, 64), (4, 8, 256, 64), (8, 8, 256, 64)):
        q, k, v = (torch.randn(n, H, L, D, requires_grad=training) for _ in range(3))
        mask = torch.ones(n, 1, 1, L, dtype=torch.bool)
        mask[1:, ..., L - L // 4:] = False  # padded keys in all rows but the first

        def fn(q=q, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (n, H, L, D)

        points.append((2 * n * L * L * H * D, _seconds(_run(fn, training), timing)))
    return _slope(points, "attn_ps")


def copy_ps(training: bool, timing: Timing) -> float:
    points = []
    for N, E in ((512, 128), (2048, 128), (2048, 256), (4096, 256)):
        x = torch.randn(N, E, requires_grad=training)
        rows = torch.randperm(2 * N)[:N].sort().values  # where N rows go in 2N

        def fn(x=x, rows=rows, N=N, E=E):
            pieces = x.split(N // 8)  # 8 blocks, concatenated back (bucketing, merging): N E written
            return x.new_zeros(2 * N, E).index_copy_(0, rows, torch.cat(pieces))  # unpacking: 2 N E + N E

        points.append((4 * N * E, _seconds(_run(fn, training), timing)))  # elements written
    return _slope(points, "copy_ps")


def bucket_us(training: bool, timing: Timing) -> float:
    points = []
    for count in range(1, 5):
        lengths = tuple(L for i in range(count) for L in (10 * 2**i, 10 * 2**i - 1))  # pairs: one bucket each
        T = sum(lengths)
        q, k, v = (torch.randn(T, 1, 8, requires_grad=training) for _ in range(3))

        def fn(q=q, k=k, v=v, lengths=lengths):
            return packing.attend_packed(q, k, v, lengths, lengths)  # (T, 1, 8)

        points.append((len(packing.bucket_shapes(lengths, lengths)), _seconds(_run(fn, training), timing)))
    return _slope(points, "bucket_us") / 1e6


def module_us(training: bool, timing: Timing, costs: policy.Costs) -> tuple[float, float]:
    """(call_us, pack_us): the tiny module's time less what the other constants price."""
    B, S, E, H = 2, 8, 32, 2
    dense = MultiHeadAttention(E, H, packing=False)
    packed = MultiHeadAttention(E, H, packing=True)
    packed.load_state_dict(dense.state_dict())
    x = torch.randn(B, S, E, requires_grad=training)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, -1] = False  # one padded token: both paths take their masked branches
    lengths = tuple(mask.sum(1).tolist())
    buckets = packing.bucket_shapes(lengths, lengths)
    priced = policy.estimate_packing(B, S, E, H, H, buckets, training=training,
                                     costs=policy.Costs(0.0, 0.0, 0.0, costs.gemm_ps, costs.attn_ps, costs.copy_ps))
    t_dense = _seconds(_run(lambda: dense(x, mask), training), timing) * 1e6
    t_packed = _seconds(_run(lambda: packed(x, mask), training), timing) * 1e6
    call = t_dense - priced.dense_us
    return call, t_packed - call - len(buckets) * costs.bucket_us - priced.packed_us


def measure_costs(training: bool, timing: Timing | None = None) -> policy.Costs:
    """The unit costs of a forward (``training=False``) or a forward and backward.

    Raises:
        MeasurementError: a fit too noisy to keep, or a fixed cost (``call_us``) at or below
            zero. ``pack_us``, a remainder of small differences, is kept at least 0.
    """
    timing = timing or Timing()
    with _quiet_state():
        partial = policy.Costs(0.0, 0.0, bucket_us(training, timing), gemm_ps(training, timing),
                               attn_ps(training, timing), copy_ps(training, timing))
        call, pack = module_us(training, timing, partial)
    if call <= 0:
        raise MeasurementError(f"call_us: the tiny module took {call:.3g} us less than its arithmetic prices: the "
                               "machine was busy? `headwise tune` measures again")
    return dataclasses.replace(partial, call_us=call, pack_us=max(0.0, pack))


def measure(timing: Timing | None = None) -> tuple[policy.Costs, policy.Costs]:
    """(inference costs, training costs) of this machine: about a second with the default timing."""
    return measure_costs(False, timing), measure_costs(True, timing)


@contextlib.contextmanager
def _quiet_state() -> Iterator[None]:
    """Leave the caller's state as it was: its RNG, autocast, inference mode and grad mode."""
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False), torch.enable_grad(), \
            torch.autocast("cpu", enabled=False):
        torch.manual_seed(0)
        yield

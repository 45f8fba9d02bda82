"""Measure the unit costs behind "auto"'s packing estimate (``headwise.policy.Costs``).

Each constant comes from primitive operations or from the module at tiny shapes, never
from the module rows the choice is judged on (``benchmarks/auto_grid.py`` does that):

* ``gemm_ps``: the slope of a linear fit of time against multiply-adds, over the module's
  two projections (E -> 3E, E -> E) at several row counts and widths;
* ``attn_ps``: the same for SDPA with a key padding mask;
* ``copy_ps``: the same for a concatenation of row blocks and a scatter of rows (what
  packing, bucketing and unpacking do);
* ``bucket_us``: the slope of ``packing.attend_packed`` against its number of attention
  calls, at sizes where the arithmetic is negligible;
* ``call_us``: the dense module at a tiny shape, less what the slopes above price;
* ``pack_us``: the packed module on the same input, less the dense call, its attention
  calls and what the slopes price.

Forward under no_grad gives ``INFERENCE_COSTS``; forward + backward ``TRAINING_COSTS``.
Paste the two printed lines into ``src/headwise/policy.py``.

    python benchmarks/pack_cost.py [--threads 1] [--repeats 15] [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import headwise
from headwise import packing, policy
from headwise.bench import cpu_name

CLOCK = time.perf_counter  # --cpu-time: time.process_time


def _seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn``, each timing a loop of about 5 ms."""
    fn()
    start = CLOCK()
    fn()
    once = CLOCK() - start
    calls = max(1, int(5e-3 / max(once, 1e-7)))
    times = []
    for _ in range(repeats):
        start = CLOCK()
        for _ in range(calls):
            fn()
        times.append((CLOCK() - start) / calls)
    return statistics.median(times)


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of seconds against units, in picoseconds per unit."""
    xs = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ys = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(xs), xs], dim=1)  # (n, 2): intercept, slope
    fit = torch.linalg.lstsq(design, ys[:, None]).solution  # (2, 1)
    return float(fit[1, 0]) * 1e12


def _run(fn: Callable[[bool], object], training: bool) -> Callable[[], object]:
    """``fn(training)`` under no_grad, or with a backward through its output."""
    def forward() -> None:
        with torch.no_grad():
            fn(False)

    def train() -> None:
        out = fn(True)
        out.backward(torch.ones_like(out))

    return train if training else forward


def gemm_ps(training: bool, repeats: int) -> float:
    points = []
    for N, E in ((256, 128), (1024, 128), (512, 256), (2048, 256), (1024, 512), (4096, 512)):
        x = torch.randn(N, E)
        w_in, w_out = torch.randn(3 * E, E) / E**0.5, torch.randn(E, E) / E**0.5
        b_in, b_out = torch.zeros(3 * E), torch.zeros(E)
        if training:
            for t in (x, w_in, w_out, b_in, b_out):
                t.requires_grad_()

        def fn(grad: bool, x=x, w_in=w_in, w_out=w_out, b_in=b_in, b_out=b_out, E=E):
            h = F.linear(x, w_in, b_in)[:, :E]  # (N, 3E) -> the q part stands for the attention output
            return F.linear(h, w_out, b_out)  # (N, E)

        points.append((N * E * 4 * E, _seconds(_run(fn, training), repeats)))
    return _slope(points)


def attn_ps(training: bool, repeats: int) -> float:
    points = []
    for n, H, L, D in ((8, 4, 64, 32), (8, 4, 128, 64), (16, 8, 128, 64), (4, 8, 256, 64), (8, 8, 256, 64),
                       (2, 8, 512, 64)):
        q, k, v = (torch.randn(n, H, L, D, requires_grad=training) for _ in range(3))
        mask = torch.ones(n, 1, 1, L, dtype=torch.bool)
        mask[1:, ..., L - L // 4:] = False  # padded keys in all rows but the first

        def fn(grad: bool, q=q, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (n, H, L, D)

        points.append((2 * n * L * L * H * D, _seconds(_run(fn, training), repeats)))
    return _slope(points)


def copy_ps(training: bool, repeats: int) -> float:
    points = []
    for N, E in ((512, 128), (2048, 128), (2048, 512), (8192, 512)):
        x = torch.randn(N, E, requires_grad=training)
        rows = torch.randperm(2 * N)[:N].sort().values  # where N rows go in 2N

        def fn(grad: bool, x=x, rows=rows, N=N, E=E):
            pieces = x.split(N // 8)  # 8 blocks, concatenated back (bucketing, merging): N E written
            return x.new_zeros(2 * N, E).index_copy_(0, rows, torch.cat(pieces))  # unpacking: 2 N E + N E

        points.append((4 * N * E, _seconds(_run(fn, training), repeats)))  # elements written
    return _slope(points)


def bucket_us(training: bool, repeats: int) -> float:
    points = []
    for count in range(1, 5):
        lengths = tuple(L for i in range(count) for L in (10 * 2**i, 10 * 2**i - 1))  # pairs: one bucket each
        assert len(packing.bucket_shapes(lengths, lengths)) == count
        T = sum(lengths)
        q, k, v = (torch.randn(T, 1, 8, requires_grad=training) for _ in range(3))

        def fn(grad: bool, q=q, k=k, v=v, lengths=lengths):
            return packing.attend_packed(q, k, v, lengths, lengths)  # (T, 1, 8)

        points.append((count, _seconds(_run(fn, training), repeats)))
    return _slope(points) / 1e6


def module_us(training: bool, repeats: int, costs: policy.Costs) -> tuple[float, float]:
    """(call_us, pack_us): the tiny module's time less what the other constants price."""
    B, S, E, H = 2, 8, 32, 2
    torch.manual_seed(0)
    dense = headwise.MultiHeadAttention(E, H, packing=False)
    packed = headwise.MultiHeadAttention(E, H, packing=True)
    packed.load_state_dict(dense.state_dict())
    x = torch.randn(B, S, E, requires_grad=training)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, -1] = False  # one padded token: both paths take their masked branches
    lengths = tuple(mask.sum(1).tolist())
    buckets = packing.bucket_shapes(lengths, lengths)
    priced = policy.estimate_packing(B, S, E, H, H, buckets, training=training,
                                     costs=policy.Costs(0.0, 0.0, 0.0, costs.gemm_ps, costs.attn_ps, costs.copy_ps))
    t_dense = _seconds(_run(lambda grad: dense(x, mask), training), repeats) * 1e6
    t_packed = _seconds(_run(lambda grad: packed(x, mask), training), repeats) * 1e6
    call = t_dense - priced.dense_us
    return call, t_packed - call - len(buckets) * costs.bucket_us - priced.packed_us


def measure(training: bool, repeats: int) -> policy.Costs:
    partial = policy.Costs(0.0, 0.0, bucket_us(training, repeats), gemm_ps(training, repeats),
                           attn_ps(training, repeats), copy_ps(training, repeats))
    call, pack = module_us(training, repeats, partial)
    return policy.Costs(call, pack, partial.bucket_us, partial.gemm_ps, partial.attn_ps, partial.copy_ps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU time (with --threads 1, other jobs on the machine "
                             "disturb it less)")
    args = parser.parse_args(argv)
    global CLOCK
    if args.cpu_time:
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = "CPU" if args.cpu_time else "wall"
    print(f"# benchmarks/pack_cost.py, {torch.get_num_threads()} thread(s), {clock} time, {cpu_name()}, "
          f"torch {torch.__version__}")
    for name, training in (("INFERENCE_COSTS", False), ("TRAINING_COSTS", True)):
        c = measure(training, args.repeats)
        print(f"{name} = Costs(call_us={c.call_us:.1f}, pack_us={c.pack_us:.1f}, bucket_us={c.bucket_us:.1f}, "
              f"gemm_ps={c.gemm_ps:.2f}, attn_ps={c.attn_ps:.2f}, copy_ps={c.copy_ps:.1f})")


if __name__ == "__main__":
    main()

"""Context parallelism on this CPU: N single-thread ranks (gloo, zigzag ring) vs one process with N threads.

Causal self-attention, B=1, fp32, one table from one run. For each length S and N:

* one process with N threads runs ``headwise.attention`` (``"auto"``: SDPA's fused kernel)
  on the whole sequence;
* N processes with one thread each run ``headwise.distributed.attention(method="ring",
  layout="zigzag")`` on their shards.

Forward and forward+backward times (the slowest rank's), the peak resident memory each
process gained over its state before the inputs existed, the bytes each rank sent in one
forward (next to (N-1) x its K/V shard), and the causal work per rank under both layouts
(allowed (query, key) pairs, in units of one (S/2N)^2 chunk pair). The one-process and the
ring runs take turns in every repeat, so both see the same machine load.

    python benchmarks/context_parallel.py [--lengths 8192 32768] [--heads 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _inputs(S, H, D):
    """q, k, v (1, H, S, D) of random values; S is the whole or a rank's part of the sequence."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, H, S, D, generator=gen) for _ in range(3))


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def child_single(args) -> dict:
    import torch

    import headwise

    torch.set_num_threads(args.threads)
    base = _peak_mib()
    q, k, v = _inputs(args.length, args.heads, args.head_dim)
    dout = torch.randn_like(q)
    fwd = _time(lambda: headwise.attention(q, k, v, is_causal=True))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fb = _time(lambda: headwise.attention(q, k, v, is_causal=True).backward(dout))
    return {"fwd": fwd, "fb": fb, "peak": _peak_mib() - base}


def child_rank(args) -> dict:
    import torch
    import torch.distributed as dist

    import headwise.distributed as hwd
    from headwise.distributed.layout import local_length
    from headwise.distributed.ring import TRAFFIC

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    base = _peak_mib()
    # this rank's shard only: a whole sequence would raise the peak this table reports
    q, k, v = _inputs(local_length(args.length, args.world, args.rank, args.layout), args.heads, args.head_dim)
    dout = torch.randn_like(q)

    def run(backward):
        dist.barrier()
        if backward:
            hwd.attention(q, k, v, is_causal=True, layout=args.layout).backward(dout)
        else:
            hwd.attention(q, k, v, is_causal=True, layout=args.layout)

    TRAFFIC.reset()
    fwd = _time(lambda: run(False))
    sent = TRAFFIC.sent_bytes["forward"]
    for t in (q, k, v):
        t.requires_grad_()
    fb = _time(lambda: run(True))
    out = {"fwd": fwd, "fb": fb, "peak": _peak_mib() - base, "sent": sent,
           "kv": k.numel() * k.element_size() + v.numel() * v.element_size()}
    dist.barrier()  # leave together: a gloo peer that exits early can abort the others
    dist.destroy_process_group()
    return out


def causal_work(S: int, N: int, layout: str) -> list[float]:
    """Allowed causal (query, key) pairs per rank, in units of one (S/2N)^2 chunk pair."""
    from headwise.distributed.layout import segments

    unit = (S / (2 * N)) ** 2
    # query i attends keys 0..i: a segment [a, b) holds sum(i + 1) pairs
    return [sum((b * (b + 1) - a * (a + 1)) / 2 for a, b in segments(S, N, r, layout)) / unit for r in range(N)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(extra: list[str], threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen([sys.executable, str(HERE), *extra], env=env, stdout=subprocess.PIPE, text=True)


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"a benchmark child failed (exit {p.returncode})")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def measure(args) -> dict:
    common = ["--heads", str(args.heads), "--head-dim", str(args.head_dim)]
    results: dict = {}
    for _ in range(args.repeats):
        for S in args.lengths:
            for N in args.worlds:
                single = _collect([_spawn(["--child", "single", "--threads", str(N), "--length", str(S), *common],
                                          N)], args.timeout)[0]
                results.setdefault((S, N, "single"), []).append(single)
                if N == 1:
                    continue  # one rank is headwise.attention itself
                port = _free_port()
                ranks = _collect([_spawn(["--child", "rank", "--rank", str(r), "--world", str(N), "--port", str(port),
                                          "--length", str(S), "--layout", "zigzag", *common], 1)
                                  for r in range(N)], args.timeout)
                results.setdefault((S, N, "ring"), []).append(ranks)
    return results


def table(args, results) -> str:
    from rich.console import Console
    from rich.table import Table

    from headwise.calibration import cpu_name

    def best(runs, key):
        return min(r[key] for r in runs)

    t = Table(title=f"causal attention, B=1, H={args.heads}, D={args.head_dim}, fp32, on {cpu_name()} "
                    f"({os.cpu_count()} cores); one process with N threads vs N ranks x 1 thread (gloo, zigzag ring); "
                    f"best of {args.repeats}, taken in turns")
    for col in ("S", "N", "1 proc fwd s", "1 proc fwd+bwd s", "1 proc peak MiB", "ring fwd s", "ring fwd+bwd s",
                "ring/1 proc throughput (fwd+bwd)", "ring peak MiB/rank", "sent/rank fwd MiB ((N-1)|KV|)",
                "causal work/rank zigzag", "causal work/rank contiguous"):
        t.add_column(col, justify="right")
    for S in args.lengths:
        for N in args.worlds:
            single = results[(S, N, "single")]
            row = [str(S), str(N), f"{best(single, 'fwd'):.2f}", f"{best(single, 'fb'):.2f}",
                   f"{max(r['peak'] for r in single):.0f}"]
            if N == 1:
                row += ["= 1 proc"] * 3 + ["", "0", "", ""]
            else:
                runs = results[(S, N, "ring")]
                fwd = min(max(r["fwd"] for r in ranks) for ranks in runs)
                fb = min(max(r["fb"] for r in ranks) for ranks in runs)
                peak = max(r["peak"] for ranks in runs for r in ranks)
                sent = [r["sent"] for r in runs[0]]
                expect = [(N - 1) * r["kv"] for r in runs[0]]
                exact = "exact" if sent == expect else "DIFFERS"
                row += [f"{fwd:.2f}", f"{fb:.2f}", f"{best(single, 'fb') / fb:.2f}x", f"{peak:.0f}",
                        f"{max(sent) / 2**20:.1f} ({max(expect) / 2**20:.1f}, {exact})"]
                row += [" ".join(f"{w:.1f}" for w in causal_work(S, N, lay)) for lay in ("zigzag", "contiguous")]
            t.add_row(*row)
    console = Console(width=260, record=True)
    console.print(t)
    one = {S: max(r["peak"] for r in results[(S, 1, "single")]) for S in args.lengths}
    notes = []
    S0 = min(args.lengths)
    if 2 in args.worlds:
        for S in args.lengths:
            ratio = min(r["fb"] for r in results[(S, 2, "single")]) / min(
                max(r["fb"] for r in ranks) for ranks in results[(S, 2, "ring")])
            notes.append(f"target zigzag ring N=2 >= 0.85x one process, S={S}: {ratio:.2f}x "
                         f"({'met' if ratio >= 0.85 else 'missed'})")
    if 4 in args.worlds and 4 * S0 in args.lengths:
        ring_peak = max(r["peak"] for ranks in results[(4 * S0, 4, "ring")] for r in ranks)
        ratio = ring_peak / one[S0]
        notes.append(f"target weak scaling: ring N=4 at S={4 * S0} peak/rank {ring_peak:.0f} MiB vs one process at "
                     f"S={S0} {one[S0]:.0f} MiB: {ratio:.2f}x ({'met' if ratio <= 1.3 else 'missed'}, target <= 1.3x)")
    for n in notes:
        console.print(n)
    return console.export_text()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--child", choices=["single", "rank"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--length", type=int)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--layout", default="zigzag")
    args = parser.parse_args(argv)
    if args.child:
        out = child_single(args) if args.child == "single" else child_rank(args)
        print(json.dumps(out))
        return
    table(args, measure(args))


if __name__ == "__main__":
    main()

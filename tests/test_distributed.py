"""headwise.distributed: context-parallel attention on 1-4 CPU processes (gloo), against float64.

One process group per world size runs every case (spawning costs seconds, a case
milliseconds): each rank builds the same global inputs from the case's seed, shards them,
runs ``hwd.attention`` forward and backward, and rank 0 writes the unsharded output and
gradients to a file; the parent compares them with a float64 reference written out here
with explicit index arithmetic. Every launch has a hard timeout, so a hang fails.

The file is also the worker: ``python tests/test_distributed.py worker RANK WORLD PORT CASES OUT``.

Legend: B batch, H query heads, Hkv key/value heads, S / Sk global query / key length,
D head dim, N world size.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

WORLD_SIZES = (1, 2, 3, 4)
TIMEOUT_S = 120  # per process group; a deadlock fails the tests instead of hanging CI
TOL = {"float64": (1e-10, 1e-10), "float32": (1e-5, 1e-4)}  # (forward, gradients), max abs error
HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


# ---------------------------------------------------------------- the cases

def _case(name, dtype="float64", method="ring", layout="zigzag", *, mask=None, causal=False, window=None,
          alibi=False, heads="mha", dS=0, tiles=(4, 3), tiny=False, S=None, fused=True, passes=None, **extra):
    # S: the global query length at every world size (None: 3 for tiny, else 2N*3 + 1)
    # passes: "one" sends every kv head in one message, "per-head" one kv head per pass (policy.RING_PASS_BYTES);
    # None: one pass for the plain and causal cases, one pass per kv head for the rest
    if passes is None:
        passes = "one" if name.startswith(("plain", "causal")) else "per-head"
    return {"name": name, "dtype": dtype, "method": method, "layout": layout, "mask": mask, "causal": causal,
            "window": window, "alibi": alibi, "heads": heads, "dS": dS, "tiles": list(tiles), "tiny": tiny, "S": S,
            "fused": fused, "passes": passes, **extra}


def cases() -> list[dict]:
    """Every attention case, run at every world size (S = 2N*3 + 1: uneven shards)."""
    out = []
    for dtype in ("float64", "float32"):
        for method in ("ring", "ulysses"):
            for layout in ("zigzag", "contiguous"):
                tag = f"{dtype}-{method}-{layout}"
                out.append(_case(f"plain-{tag}", dtype, method, layout))
                out.append(_case(f"causal-{tag}", dtype, method, layout, causal=True))
                out.append(_case(f"causal-unfused-{tag}", dtype, method, layout, causal=True, heads="gqa", fused=False))
                out.append(_case(f"gqa-causal-{tag}", dtype, method, layout, causal=True, heads="gqa"))
                out.append(_case(f"mqa-causal-{tag}", dtype, method, layout, causal=True, heads="mqa"))
                out.append(_case(f"window-{tag}", dtype, method, layout, window=5))
                out.append(_case(f"alibi-causal-{tag}", dtype, method, layout, causal=True, alibi=True))
                out.append(_case(f"causal-longer-keys-{tag}", dtype, method, layout, causal=True, dS=5))
                out.append(_case(f"causal-shorter-keys-{tag}", dtype, method, layout, causal=True, dS=-4))
                for mask in ("pad-bool", "pad-float", "dense-bool", "dense-float", "int-3d", "rows-broadcast"):
                    out.append(_case(f"{mask}-{tag}", dtype, method, layout, mask=mask, causal=mask == "pad-bool"))
    out += [
        _case("alibi-cross-noncausal", alibi=True, dS=3),
        _case("window-gqa-pad-cross", window=4, heads="gqa", mask="pad-bool", dS=2),
        _case("dense-mqa-window-alibi", window=6, heads="mqa", mask="dense-bool", alibi=True),
        _case("causal-big-tiles", causal=True, tiles=(256, 512)),
        _case("auto-gqa", method="auto", causal=True, heads="gqa"),
        _case("auto-dense", method="auto", mask="dense-float"),
        _case("tiny-causal-ring", causal=True, tiny=True),
        _case("tiny-causal-ulysses", method="ulysses", causal=True, tiny=True),
        _case("float16-ring-causal", "float16", causal=True, heads="gqa"),
        _case("bfloat16-ring-pad", "bfloat16", mask="pad-bool"),
    ]
    # Dense masks where a rank holds one query (or none): its (.., 1, Sk) shard is its query's row,
    # not a row to broadcast (S = 2 or 3: shards of 1 and 2 queries on 2 ranks, 1/1/1 or 1/1/0 on 3).
    for method in ("ring", "ulysses"):
        for layout in ("zigzag", "contiguous"):
            for S in (2, 3):
                for mask in ("dense-bool", "dense-float", "int-3d", "rows-broadcast"):
                    out.append(_case(f"one-query-S{S}-{mask}-{method}-{layout}", method=method, layout=layout,
                                     mask=mask, S=S, causal=mask == "dense-bool"))
    return out


ERROR_CASES = {
    # name: (exception type, regex every rank's message must match)
    "flags-disagree": ("ValueError", r"disagree on is_causal: \[1\.0, 0\.0"),
    "lengths-misfit": ("ValueError", r"q shards hold \[\d+(, \d+)+\] positions .* splits \d+ positions as"),
    "ulysses-heads": ("ValueError", r"splits the \d query heads over \d ranks, and \d does not divide \d"),
    "one-rank-bad": ("ValueError", r"(must be 4-D \(B, H, S, D\)|rank\(s\) \[1\] of \d rejected their inputs)"),
    "dropout": ("ValueError", r"no dropout \(got dropout_p=0\.1\)"),
    "mask-keys": ("ValueError", r"attention_mask covers \d+ keys, but the k shards hold Sk = \d+"),
    "value-dim": ("ValueError", r"needs v's head dim to be k's \(the ring sends k and v as one block\): got D = 8, "
                                r"Dv = 5"),
    "unshard-misfit": ("ValueError", r"unshard got shards of lengths \[\d+(, \d+)+\] along dim 2, but layout 'zigzag'"),
    # every disagreement between ranks is the same ValueError on every rank, naming the ranks' values
    "unshard-heads": ("ValueError", r"unshard: the ranks disagree on the shape outside dim 2: \[\(2, 4, \*, 8\), "
                                    r"\(2, 3, \*, 8\)"),
    "unshard-dtype": ("ValueError", r"unshard: the ranks disagree on the dtype: \['float32', 'float64'"),
    "unshard-layout": ("ValueError", r"unshard: the ranks disagree on the layout: \['zigzag', 'contiguous'"),
    "unshard-ndim": ("ValueError", r"unshard: the ranks disagree on the number of dims: \[4, 3"),
    "unshard-dim": ("ValueError", r"unshard: the ranks disagree on the sequence dim: \[2, 1"),
    "unshard-bad-dim": ("ValueError", r"(unshard: dim 7 is out of range for a 4-D tensor|rank\(s\) \[1\] of \d "
                                      r"rejected their inputs)"),
    "shard-length": ("ValueError", r"^shard: the ranks disagree on the shape: \[\(2, 4, (\d+), 8\), "
                                   r"\(2, 4, (?!\1)\d+, 8\)"),
    "mask-rows-mixed": ("ValueError", r"attention_mask has \[3, 1(, 2)*\] rows on ranks 0\.\.\d for \[3(, 2)+\] "
                                      r"queries"),
    # a backward that runs on some ranks only would wait for the others until the group's timeout
    "grad-disagree": ("ValueError", r"the ranks disagree on needs grad: \[1\.0, 0\.0"),
    "unshard-grad": ("ValueError", r"unshard: the ranks disagree on needs grad: \[True, False"),
    "module-rope-misfit": ("ValueError", r"x shards hold \[\d+(, \d+)+\] positions on ranks 0\.\.\d, but layout "
                                         r"'zigzag' splits \d+ positions as"),
}


def sizes(case: dict, world: int) -> tuple[int, int]:
    S = case["S"] or (3 if case["tiny"] else 2 * world * 3 + 1)
    return S, max(1, S + case["dS"])


def make_inputs(case: dict, world: int) -> dict:
    """The case's global tensors, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(_seed(case["name"]))
    dtype = getattr(torch, case["dtype"])
    B, H, D = 2, 6 if world == 3 else 4, 8  # ulysses needs N | H
    Hkv = {"mha": H, "gqa": H // 2, "mqa": 1}[case["heads"]]
    S, Sk = sizes(case, world)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    t = {"q": randn(B, H, S, D), "k": randn(B, Hkv, Sk, D), "v": randn(B, Hkv, Sk, D), "dout": randn(B, H, S, D)}
    kind = case["mask"]
    mask = None
    if kind in ("pad-bool", "pad-float"):
        keep = torch.ones(B, Sk, dtype=torch.bool)
        keep[0, Sk // 2:] = False  # right padding
        keep[1, :] = False  # a fully padded row: every query of batch row 1 attends nothing
        mask = keep if kind == "pad-bool" else torch.zeros(B, Sk, dtype=torch.float64).masked_fill(~keep, -math.inf)
        if kind == "pad-float":
            mask[0, :2] = randn(2)  # a real additive bias too
    elif kind in ("dense-bool", "dense-float"):
        keep = torch.rand(B, H, S, Sk, generator=gen) > 0.4
        keep[0, 1, min(2, S - 1)] = False  # a fully masked query row
        if kind == "dense-bool":
            mask = keep
        else:
            mask = randn(B, 1, S, Sk).masked_fill(~keep[:, :1], -math.inf)
    elif kind == "int-3d":
        mask = (torch.rand(B, S, Sk, generator=gen) > 0.3).to(torch.int64)
    elif kind == "rows-broadcast":
        mask = torch.rand(1, 1, 1, Sk, generator=gen) > 0.5
    t["mask"] = mask
    t["slopes"] = 0.5 ** torch.arange(1, H + 1, dtype=torch.float64) if case["alibi"] else None
    if dtype != torch.float64:
        for name in ("q", "k", "v", "dout"):
            t[name] = t[name].to(dtype)
        if mask is not None and mask.is_floating_point():
            t["mask"] = mask.to(dtype)
    return t


def _seed(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 2**31


def reference(q, k, v, mask=None, *, causal=False, window=None, slopes=None):
    """softmax(q k^T / sqrt(D) + mask) v in float64, the contract written out by index.

    Query i sits at key position i + Sk - S (bottom-right); causal allows keys j <= that,
    a window also needs j > it - window; ALiBi adds -slope_h * |i + Sk - S - j|; a row
    with no allowed key outputs zeros.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, H, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, Sk, D): query head h reads kv head h // (H // Hkv)
    v = v.repeat_interleave(H // Hkv, dim=1)
    allowed = torch.ones(B, H, S, Sk, dtype=torch.bool)
    bias = torch.zeros(B, H, S, Sk, dtype=torch.float64)
    if mask is not None:
        m = mask[:, None, None, :] if mask.dim() == 2 else mask[:, None] if mask.dim() == 3 else mask
        m = m.expand(B, H, S, Sk)
        if m.is_floating_point():
            allowed = allowed & (m.double() != -math.inf)
            bias = torch.where(allowed, m.double(), 0.0)
        else:
            allowed = allowed & (m != 0)
    i = torch.arange(S)[:, None] + (Sk - S)  # (S, 1) query position among the keys
    j = torch.arange(Sk)[None, :]  # (1, Sk)
    if causal or window is not None:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window)
    if slopes is not None:
        bias = bias - slopes.double()[None, :, None, None] * (i - j).abs().double()
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D) + bias  # (B, H, S, Sk)
    s = s.masked_fill(~allowed, -math.inf)
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    e = torch.exp(s - top)  # exactly 0 where not allowed
    total = e.sum(-1, keepdim=True)
    return (e / torch.where(total > 0, total, 1.0)) @ v  # (B, H, S, D)


# ---------------------------------------------------------------- the worker (one process per rank)

FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _run_case(hwd, case, world):
    import headwise.distributed.ring as ring
    from headwise import policy

    policy.RING_BLOCK_Q, policy.RING_BLOCK_K = case["tiles"]
    policy.RING_FUSED_ROWS = case["tiles"][0]  # fused calls split into parts too
    ring._FUSED_CPU = FUSED if case["fused"] else None  # unfused: the ring's own tiles on every block
    policy.RING_PASS_BYTES = 2**40 if case["passes"] == "one" else 1  # 1 byte: each kv head goes round alone
    t = make_inputs(case, world)
    lay = case["layout"]
    q, k, v = (hwd.shard(t[n], dim=2, layout=lay).detach().requires_grad_() for n in ("q", "k", "v"))
    mask = t["mask"]
    # a 2-D key padding mask is sharded with its keys, the others along the queries ((.., 1, Sk) broadcasts)
    if mask is not None and (mask.dim() == 2 or mask.shape[-2] > 1):
        mask = hwd.shard(mask, dim=1 if mask.dim() == 2 else -2, layout=lay)
    slopes = None if t["slopes"] is None else t["slopes"].to(q.dtype)
    out = hwd.attention(q, k, v, mask, is_causal=case["causal"], window=case["window"], alibi_slopes=slopes,
                        method=case["method"], layout=lay)
    out.backward(hwd.shard(t["dout"], dim=2, layout=lay))
    return {n: hwd.unshard(x.detach(), dim=2, layout=lay) for n, x in
            (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def _run_error(hwd, name, rank, world):
    B, H, D = 2, 4, 8
    S = 2 * world + 1
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen)
    sq = hwd.shard(q, dim=2)
    if name == "flags-disagree":
        hwd.attention(sq, sq, sq, is_causal=rank == 0)
    elif name == "lengths-misfit":  # rank r passes rank N-1-r's shard: the lengths fit no sequence
        from headwise.distributed.layout import positions_of

        other = q.index_select(2, positions_of(S, world, world - 1 - rank, "zigzag"))
        hwd.attention(other, other, other)
    elif name == "ulysses-heads":
        odd = torch.randn(B, world + 1, S, D, generator=gen)
        s = hwd.shard(odd, dim=2)
        hwd.attention(s, s, s, method="ulysses")
    elif name == "one-rank-bad":
        hwd.attention(sq[0] if rank == 1 else sq, sq, sq)
    elif name == "dropout":
        hwd.attention(sq, sq, sq, dropout_p=0.1)
    elif name == "value-dim":
        hwd.attention(sq, sq, sq[..., :5])
    elif name == "unshard-misfit":  # rank r passes rank N-1-r's shard
        from headwise.distributed.layout import positions_of

        hwd.unshard(q.index_select(2, positions_of(S, world, world - 1 - rank, "zigzag")), dim=2)
    elif name == "mask-keys":
        hwd.attention(sq, sq, sq, torch.ones(B, 1, sq.shape[2], S + 1, dtype=torch.bool))
    elif name == "unshard-heads":  # rank 1's shard has 3 heads, the others 4
        hwd.unshard(sq[:, :3] if rank == 1 else sq, dim=2)
    elif name == "unshard-dtype":
        hwd.unshard(sq.double() if rank == 1 else sq, dim=2)
    elif name == "unshard-layout":
        hwd.unshard(sq, dim=2, layout="contiguous" if rank == 1 else "zigzag")
    elif name == "unshard-ndim":
        hwd.unshard(sq[0] if rank == 1 else sq, dim=-2)
    elif name == "unshard-dim":  # rank 1 names the heads: (B, H, S_l, D) read as split along H
        hwd.unshard(sq, dim=1 if rank == 1 else 2)
    elif name == "unshard-bad-dim":
        hwd.unshard(sq, dim=7 if rank == 1 else 2)
    elif name == "shard-length":  # rank 1 holds a longer sequence than the others
        hwd.shard(torch.cat([q, q[:, :, :1]], dim=2) if rank == 1 else q, dim=2)
    elif name == "grad-disagree":
        g = sq.detach().requires_grad_(rank == 0)
        hwd.attention(g, sq, sq)
    elif name == "unshard-grad":
        hwd.unshard(sq.detach().requires_grad_(rank == 0), dim=2)
    elif name == "mask-rows-mixed":  # rank 1 broadcasts one row, rank 0 passes its queries' rows
        rows = 1 if rank == 1 else sq.shape[2]
        hwd.attention(sq, sq, sq, torch.ones(B, 1, rows, S, dtype=torch.bool))
    elif name == "module-rope-misfit":  # rank r passes rank N-1-r's shard to a module with rope
        import headwise
        from headwise.distributed.layout import positions_of

        mha = headwise.MultiHeadAttention(16, 4, rope=True, context_parallel=hwd.ContextParallel())
        x = torch.randn(1, S, 16, generator=gen)
        mha(x.index_select(1, positions_of(S, world, world - 1 - rank, "zigzag")))


def _run_module(hwd, name, world):
    """The module with context_parallel against nothing: rank 0 returns its unsharded results."""
    import headwise

    dtype = torch.float64 if name.endswith("float64") else torch.float32
    spec = MODULE_CASES[name.rsplit("-", 1)[0]]
    torch.manual_seed(7)
    mha = headwise.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype, **spec,
                                      context_parallel=hwd.ContextParallel())
    x, mask, dout = module_inputs(world, dtype)
    xs = hwd.shard(x, dim=1).detach().requires_grad_()
    y = mha(xs, hwd.shard(mask, dim=1))
    y.backward(hwd.shard(dout, dim=1))
    grads = {}
    for pname, p in mha.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g)  # data parallel over the sequence: the gradients add up
        grads[pname] = g
    return {"out": hwd.unshard(y.detach(), dim=1), "dx": hwd.unshard(xs.grad, dim=1), **grads}


MODULE_CASES = {
    "rope-causal-pad": {"rope": True, "is_causal": True},
    "rope-window-alibi": {"rope": True, "window": 5, "alibi": True},
    # dynamic NTK grows with the global length (S > 4 here); q/k norm weights get gradients from every rank
    "dynamic_ntk-qk_norm": {"is_causal": True, "qk_norm": "rms",
                            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}},
    "yarn-partial": {"is_causal": True, "rotary_dim": 2,
                     "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}},
}


def module_inputs(world: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    B, S, E = 2, 2 * world * 3 + 1, 16
    x = torch.randn(B, S, E, generator=gen, dtype=torch.float64).to(dtype)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, S - 3:] = False  # right padding in batch row 1
    return x, mask, torch.randn(B, S, E, generator=gen, dtype=torch.float64).to(dtype)


def _worker(rank: int, world: int, port: int, cases_path: str, out_path: str) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    spec = json.loads(Path(cases_path).read_text())
    timeout = datetime.timedelta(seconds=spec.get("group_timeout_s", 60))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    import headwise.distributed as hwd

    results = {}
    if spec.get("die"):  # fault injection: rank 1 dies in the middle of the ring
        import headwise.distributed.ring as ring

        if rank == 1:  # dies after the metadata exchange, before its first K/V block goes out
            def dying(*args, **kwargs):
                os._exit(3)

            ring.Ring.start = dying
        q = torch.randn(1, 2, 64, 8)
        sq = hwd.shard(q, dim=2)
        start = time.monotonic()
        try:
            hwd.attention(sq, sq, sq, is_causal=False)
            results["die"] = ("no error", "", time.monotonic() - start)
        except Exception as error:  # noqa: BLE001  (the test checks the type and message)
            results["die"] = (type(error).__name__, str(error), time.monotonic() - start)
        torch.save(results, f"{out_path}.{rank}")
        os._exit(0)  # the group is broken: skip destroy_process_group
    for case in spec["cases"]:
        try:
            results[case["name"]] = _run_case(hwd, case, world)
        except Exception as error:  # noqa: BLE001  (reported per case by the parent)
            results[case["name"]] = f"{type(error).__name__}: {error}"
    for name in spec["errors"]:
        try:
            _run_error(hwd, name, rank, world)
            results[name] = ("no error", "")
        except Exception as error:  # noqa: BLE001
            results[name] = (type(error).__name__, str(error))
    for name in spec["modules"]:
        try:
            results[name] = _run_module(hwd, name, world)
        except Exception as error:  # noqa: BLE001
            results[name] = f"{type(error).__name__}: {error}"
    for name in spec.get("scenarios", []):
        results[name] = _run_scenario(hwd, name, rank, world)
    if rank != 0:  # only rank 0 keeps tensors; every rank keeps its errors
        results = {n: r for n, r in results.items() if isinstance(r, (tuple, str))}
    torch.save(results, f"{out_path}.{rank}")
    dist.barrier()  # leave together: a gloo peer that exits early can abort the others
    dist.destroy_process_group()


# ---------------------------------------------------------------- the parent

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, spec: dict, tmp: Path, timeout: float = TIMEOUT_S, reporting: int | None = None) -> list[dict]:
    """Run the worker on ``world`` processes; every rank's results, or a failure on timeout."""
    import fresh_process  # tests/: `python tests/test_distributed.py worker ...` per rank, torch imported
    cases_path, out_path = tmp / f"spec{world}.json", tmp / f"out{world}"
    cases_path.write_text(json.dumps(spec))
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = [fresh_process.start(script=HERE, args=("worker", str(r), str(world), str(port), str(cases_path),
                                                    str(out_path)), env=env, stderr_to_stdout=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(p.output()[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"world size {world}: the process group did not finish within {timeout} s (deadlock?)")
    results = []
    for r in range(world if reporting is None else reporting):
        path = Path(f"{out_path}.{r}")
        if not path.exists():
            pytest.fail(f"world size {world}: rank {r} wrote no results; its output:\n{logs[r][-3000:]}")
        results.append(torch.load(path, weights_only=False))
    return results


_GROUPS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    def get(world: int) -> list[dict]:
        if world not in _GROUPS:
            spec = {"cases": cases(), "errors": list(ERROR_CASES) if world > 1 else [],
                    "modules": [f"{m}-{d}" for m in MODULE_CASES for d in ("float64", "float32")]}
            _GROUPS[world] = _launch_once(f"world{world}", world, spec, tmp_path_factory)
        return _GROUPS[world]
    return get


def _launch_once(name: str, world: int, spec: dict, tmp_path_factory, **options) -> list[dict]:
    """:func:`launch`, once per test session. Under pytest-xdist each worker holds this module's
    tests of every world size, and each launched every group again (4 + 4 processes on 2 cores, the
    suite's largest cost): the first worker to need a group runs it in the session's shared temp
    folder, the others wait for it and read its results."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return launch(world, spec, tmp_path_factory.mktemp(name), **options)
    from filelock import FileLock  # torch's own dependency

    shared = tmp_path_factory.getbasetemp().parent / f"distributed-{name}"  # above each worker's
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / "lock")):
        if not (shared / "done").is_file():  # a launch that failed wrote no marker: the next one retries
            launch(world, spec, shared, **options)
            (shared / "done").write_text(json.dumps(spec))
        assert (shared / "done").read_text() == json.dumps(spec), "the workers' specs of one group differ"
        return [torch.load(shared / f"out{world}.{r}", weights_only=False) for r in range(world)]


def _expected(case: dict, world: int) -> dict:
    t = make_inputs(case, world)
    leaves = {n: t[n].double().requires_grad_() for n in ("q", "k", "v")}
    mask = t["mask"]
    out = reference(leaves["q"], leaves["k"], leaves["v"], None if mask is None else
                    (mask.double() if mask.is_floating_point() else mask),
                    causal=case["causal"], window=case["window"], slopes=t["slopes"])
    out.backward(t["dout"].double())
    return {"out": out.detach(), "dq": leaves["q"].grad, "dk": leaves["k"].grad, "dv": leaves["v"].grad}


def _tolerance(dtype: str) -> tuple[float, float]:
    # half precision: about twice the error of rounding inputs and output to that dtype
    return TOL.get(dtype, (2e-2, 5e-2) if dtype == "bfloat16" else (4e-3, 1e-2))


ERRORS: dict[tuple[int, str, str], float] = {}  # (world, case, tensor) -> max abs error, for the report


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c["name"])
def test_attention_matches_float64_reference(group_results, world, case):
    got = group_results(world)[0][case["name"]]
    assert not isinstance(got, str), got
    want = _expected(case, world)
    fwd_tol, grad_tol = _tolerance(case["dtype"])
    for name, ref in want.items():
        g = got[name].double()
        assert g.shape == ref.shape, name
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        err = (g - ref).abs().max().item() if ref.numel() else 0.0
        ERRORS[(world, case["name"], name)] = err
        assert err <= (fwd_tol if name == "out" else grad_tol), f"{name}: max error {err:.3g}"


@pytest.mark.parametrize("world", WORLD_SIZES[1:])
def test_error_does_not_grow_with_world_size(group_results, world):
    """fp32 errors at N ranks stay within a small factor of one process's (merges are fp32)."""
    names = [c["name"] for c in cases() if c["dtype"] == "float32" and c["method"] == "ring"]
    for tensor in ("out", "dq", "dk", "dv"):
        base = max(_err(group_results, 1, n, tensor) for n in names)
        here = max(_err(group_results, world, n, tensor) for n in names)
        assert here <= 4 * base + 1e-6, f"{tensor}: {here:.3g} at N={world} vs {base:.3g} at N=1"


def _err(group_results, world, name, tensor):
    case = next(c for c in cases() if c["name"] == name)
    got = group_results(world)[0][name]
    ref = _expected(case, world)[tensor]
    return (got[tensor].double() - ref).abs().max().item() if ref.numel() else 0.0


@pytest.mark.parametrize("world", WORLD_SIZES[1:])
@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_input_raises_on_every_rank(group_results, world, name):
    kind, pattern = ERROR_CASES[name]
    for rank, results in enumerate(group_results(world)):
        got_kind, message = results[name]
        assert got_kind == kind, f"rank {rank}: {got_kind}: {message}"
        assert __import__("re").search(pattern, message), f"rank {rank}: {message}"


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", [f"{m}-{d}" for m in MODULE_CASES for d in ("float64", "float32")])
def test_module_matches_single_process_module(group_results, world, name):
    import headwise

    got = group_results(world)[0][name]
    assert not isinstance(got, str), got
    spec = MODULE_CASES[name.rsplit("-", 1)[0]]
    torch.manual_seed(7)
    mha = headwise.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64, **spec)
    if name.endswith("float32"):  # the same initial weights as the float32 module, in float64
        torch.manual_seed(7)
        mha.load_state_dict(headwise.MultiHeadAttention(16, 4, num_kv_heads=2, **spec).double().state_dict())
    x, mask, dout = module_inputs(world, torch.float64)
    x = x.requires_grad_()
    y = mha(x, mask)
    y.backward(dout)
    tol = 1e-10 if name.endswith("float64") else 1e-5
    assert (got["out"].double() - y.detach()).abs().max() <= tol
    assert (got["dx"].double() - x.grad).abs().max() <= 10 * tol
    for pname, p in mha.named_parameters():
        assert (got[pname].double() - p.grad).abs().max() <= 10 * tol, pname


def test_uninitialised_group_raises():
    import headwise.distributed as hwd

    assert not torch.distributed.is_initialized()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised: call"):
        hwd.attention(q, q, q)
    with pytest.raises(RuntimeError, match="not initialised"):
        hwd.shard(q, dim=2)
    with pytest.raises(RuntimeError, match="not initialised"):
        hwd.global_positions(4)


def test_a_dead_rank_fails_the_others_quickly(tmp_path):
    results = launch(2, {"die": True, "group_timeout_s": 10, "cases": [], "errors": [], "modules": []}, tmp_path,
                     timeout=60, reporting=1)
    kind, message, seconds = results[0]["die"]
    assert kind == "RuntimeError", message
    assert "context-parallel ring: rank 0 of 2 failed while exchanging" in message
    assert seconds < 15


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_layouts_cover_every_position_once(layout, world):
    from headwise.distributed.layout import local_length, positions_of

    for length in [0, 1, 2, 7, 2 * world, 2 * world * 3 + 1, 50]:
        shards = [positions_of(length, world, r, layout) for r in range(world)]
        assert sorted(torch.cat(shards).tolist()) == list(range(length))
        sizes = [len(s) for s in shards]
        assert sizes == [local_length(length, world, r, layout) for r in range(world)]
        assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)
        for s in shards:  # one run of consecutive positions (contiguous), at most two (zigzag)
            breaks = int((torch.diff(s) != 1).sum()) if len(s) > 1 else 0
            assert breaks <= (0 if layout == "contiguous" else 1)


def test_zigzag_pairs_chunk_r_with_chunk_2n_minus_1_minus_r():
    from headwise.distributed.layout import positions_of, segments

    assert segments(16, 4, 0, "zigzag") == [(0, 2), (14, 16)]
    assert segments(16, 4, 3, "zigzag") == [(6, 8), (8, 10)]
    assert positions_of(9, 2, 0, "zigzag").tolist() == [0, 1, 2, 7, 8]  # chunks of 3, 2, 2, 2
    assert positions_of(9, 2, 1, "contiguous").tolist() == [5, 6, 7, 8]


def test_choose_method_says_why():
    import headwise.distributed as hwd

    assert hwd.choose_method(8, 8, 4).method == "ulysses"
    assert hwd.choose_method(8, 2, 4).method == "ulysses" and "replicated" in hwd.choose_method(8, 2, 4).reason
    assert hwd.choose_method(6, 6, 4).method == "ring" and "6 query / 6 kv heads do not split over 4" in str(
        hwd.choose_method(6, 6, 4))
    assert hwd.choose_method(8, 8, 4, dense_mask=True).method == "ring"


def test_module_refuses_what_context_parallel_cannot_do():
    import headwise
    import headwise.distributed as hwd

    with pytest.raises(ValueError, match="method must be one of"):
        hwd.ContextParallel(method="zig")
    with pytest.raises(ValueError, match="layout must be one of"):
        hwd.ContextParallel(layout="striped")
    with pytest.raises(TypeError, match="context_parallel must be a headwise.distributed.ContextParallel"):
        headwise.MultiHeadAttention(16, 4, context_parallel="ring")
    mha = headwise.MultiHeadAttention(16, 4, context_parallel=hwd.ContextParallel())
    assert "context_parallel=ContextParallel(group=None, method='ring', layout='zigzag')" in repr(mha)
    x = torch.randn(1, 5, 16)
    with pytest.raises(ValueError, match="takes no cache= and no need_weights=True"):
        mha(x, need_weights=True)
    with torch.no_grad(), pytest.raises(ValueError, match="takes no cache="):  # a cache step needs no_grad anyway
        mha(x, cache=mha.new_cache(1, 8), is_causal=True)
    with pytest.raises(ValueError, match="forward_packed runs in one process"):
        mha.forward_packed(x[0], torch.tensor([0, 5]))


# ---------------------------------------------------------------- issue 35: NaN, +inf and refusals on 2 ranks

# NaN / inf where a rule excludes a position for every query: (method, mask kind, causal, window, S, Sk)
NAN_CASES = {
    "pad-bool-ring": ("ring", "pad-bool", False, None, 7, 7),
    "pad-float-ring": ("ring", "pad-float", False, None, 7, 9),
    "dense-bool-ring": ("ring", "dense-bool", False, None, 7, 7),
    "dense-float-ring": ("ring", "dense-float", False, None, 6, 7),
    "window-cross-ring": ("ring", None, True, 3, 5, 12),  # keys 0..4 precede every query's window
    "causal-dead-rows-ring": ("ring", None, True, None, 9, 4),  # queries 0..4 may attend nothing
    "causal-dead-rows-unfused-ring": ("ring", None, True, None, 9, 4),  # the ring's own tiles, not the CPU's kernel
    "pad-bool-ulysses": ("ulysses", "pad-bool", False, None, 7, 7),
    "dense-float-ulysses": ("ulysses", "dense-float", False, None, 6, 7),
}


def nan_inputs(name: str) -> dict:
    """Global float64 q, k, v, dout and mask of a NaN case; ``hidden``: the same with zeros where
    NaN / inf stand (what no query may use), the input of the reference."""
    _, kind, causal, window, S, Sk = NAN_CASES[name]
    gen = torch.Generator().manual_seed(_seed(name))
    B, H, Hkv, D = 2, 4, 2, 4
    q, dout = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, Sk, D, generator=gen, dtype=torch.float64) for _ in range(2))
    dead_keys = torch.zeros(B, Sk, dtype=torch.bool)  # excluded for every query
    dead_rows = torch.zeros(B, S, dtype=torch.bool)  # may attend no key
    mask = None
    if kind in ("pad-bool", "pad-float"):
        dead_keys[0, Sk - 3:] = True  # right padding
        dead_keys[1, 2] = True  # a hole
        mask = ~dead_keys if kind == "pad-bool" else torch.zeros(B, Sk, dtype=torch.float64).masked_fill(
            dead_keys, -math.inf) + 0.1 * torch.randn(B, Sk, generator=gen, dtype=torch.float64)
    elif kind in ("dense-bool", "dense-float"):
        keep = torch.rand(B, H, S, Sk, generator=gen) > 0.3
        dead_keys[:, 3] = True  # a column no query of any head may attend
        dead_rows[0, 4] = True  # a query row of every head that may attend nothing
        keep &= ~dead_keys[:, None, None, :] & ~dead_rows[:, None, :, None]
        mask = keep if kind == "dense-bool" else torch.randn(B, H, S, Sk, generator=gen,
                                                             dtype=torch.float64).masked_fill(~keep, -math.inf)
    elif window is not None:
        dead_keys[:, :Sk - S - window + 1] = True
    else:
        dead_rows[:, :S - Sk] = True
    hidden = {"q": q, "k": k, "v": v}
    q, k, v = q.clone(), k.clone(), v.clone()
    q.masked_fill_(dead_rows[:, None, :, None], math.nan)
    k.masked_fill_(dead_keys[:, None, :, None], math.nan)
    v.masked_fill_(dead_keys[:, None, :, None], math.inf)
    return {"q": q, "k": k, "v": v, "dout": dout, "mask": mask, "hidden": hidden}


def _run_nan_case(hwd, name):
    method, kind, causal, window, _, _ = NAN_CASES[name]
    import headwise.distributed.ring as ring

    t = nan_inputs(name)
    q, k, v = (hwd.shard(t[n], dim=2).requires_grad_() for n in ("q", "k", "v"))
    mask = t["mask"]
    if mask is not None:
        mask = hwd.shard(mask, dim=1 if mask.dim() == 2 else 2)
    fused, ring._FUSED_CPU = ring._FUSED_CPU, None if "unfused" in name else ring._FUSED_CPU
    try:
        out = hwd.attention(q, k, v, mask, is_causal=causal, window=window, method=method)
        out.backward(hwd.shard(t["dout"], dim=2))
    finally:
        ring._FUSED_CPU = fused
    return {n: hwd.unshard(x.detach(), dim=2) for n, x in (("out", out), ("dq", q.grad), ("dk", k.grad),
                                                              ("dv", v.grad))}


# rank 1 refuses (or both do); every rank must raise, none may hang: name -> (type, regex every rank matches)
REFUSALS = {
    "inf-pad-ring": ("ValueError", r"attention_mask holds \+inf"),
    "inf-dense-ring": ("ValueError", r"attention_mask holds \+inf"),
    "inf-head0-ulysses": ("ValueError", r"attention_mask holds \+inf"),
    "inf-head0-one-rank-ulysses": ("ValueError", r"attention_mask holds \+inf"),
    "unknown-keyword-ulysses": ("TypeError", r"unexpected keyword argument 'bogus'"),
    "unknown-keyword-ring": ("TypeError", r"unexpected keyword argument 'bogus'"),
    "alibi-differ-ring": ("ValueError", r"the ranks disagree on alibi_slopes"),
    "alibi-differ-ulysses": ("ValueError", r"the ranks disagree on alibi_slopes"),
    "module-float64-x": ("TypeError", None),  # None: the message of the module in one process
    "module-wrong-E": ("ValueError", None),
    "module-need-weights": ("ValueError", r"takes no cache= and no need_weights=True"),
    "module-mask-mod": ("ValueError", r"mask_mod / score_mod with context_parallel"),
}

# the ranks that refuse (else rank 1); ranks that disagree all raise the same error themselves
REFUSERS = {"inf-dense-ring": (0,), "inf-head0-ulysses": (0, 1), "alibi-differ-ring": (0, 1),
            "alibi-differ-ulysses": (0, 1)}


def refusing_call(name: str, rank: int | None, world: int):
    """(what to call, the module or None) of a refusal on ``rank``; ``rank=None``: the call of
    the module in one process on rank 1's arguments (whose message rank 1 must give)."""
    import headwise
    import headwise.distributed as hwd
    from headwise.distributed.layout import positions_of

    B, H, S, D = 2, 4, 7, 8
    gen = torch.Generator().manual_seed(_seed(name))
    mine = positions_of(S, world, 1 if rank is None else rank, "zigzag")  # this rank's shard
    q = torch.randn(B, H, S, D, generator=gen).index_select(2, mine)
    method = name.rsplit("-", 1)[-1]
    if name.startswith("inf-"):
        heads = H if "head0" in name else 1
        mask = torch.zeros(B, heads, len(mine), S)  # float (.., S_l, Sk): an additive bias
        if rank in REFUSERS.get(name, (1,)):
            mask[0, 0, 0, 1] = math.inf
        if name == "inf-pad-ring":  # (B, Sk_l) key padding, +inf on rank 1 only
            mask = mask[:, 0, 0, :len(mine)]
        return (lambda: hwd.attention(q, q, q, mask, method=method)), None
    if name.startswith("unknown-keyword"):
        extra: dict[str, Any] = {"bogus": 1} if rank == 1 else {}
        return (lambda: hwd.attention(q, q, q, method=method, **extra)), None
    if name.startswith("alibi-differ"):
        slopes = 0.5 ** torch.arange(1, H + 1, dtype=torch.float32) * (2.0 if rank == 1 else 1.0)
        return (lambda: hwd.attention(q, q, q, alibi_slopes=slopes, method=method)), None
    torch.manual_seed(11)
    mha = headwise.MultiHeadAttention(16, 4, context_parallel=None if rank is None else hwd.ContextParallel())
    x = torch.randn(B, S, 16, generator=gen).index_select(1, mine)
    bad = rank != 0
    args, kwargs = (x,), dict[str, Any]()
    if name == "module-float64-x" and bad:
        args = (x.double(),)
    elif name == "module-wrong-E" and bad:
        args = (x[..., :8],)
    elif name == "module-need-weights" and bad:
        kwargs = {"need_weights": True}
    elif name == "module-mask-mod" and bad:
        kwargs = {"mask_mod": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx}
    return (lambda: mha(*args, **kwargs)), mha


def _run_refusal(hwd, name, rank, world):
    """(error type, message, module state unchanged, the next good call ran) on this rank."""
    call, mha = refusing_call(name, rank, world)
    before = None if mha is None else {n: t.clone() for n, t in mha.state_dict().items()}
    try:
        call()
        kind, message = "no error", ""
    except Exception as error:  # noqa: BLE001  (the test checks the type and message)
        kind, message = type(error).__name__, str(error)
    same = mha is None or before is not None and all(torch.equal(t, mha.state_dict()[n]) for n, t in before.items())
    x = torch.randn(1, 2, 8, 4)  # the ranks are still in step: a good call goes through
    after: bool | str
    try:
        after = bool(torch.isfinite(hwd.attention(x, x, x)).all())
    except Exception as error:  # noqa: BLE001
        after = f"{type(error).__name__}: {error}"
    return kind, message, same, after


MODULE_NAN_CASES = ("ring", "ulysses")


def module_nan_inputs(world: int):
    """Cross-attention: x (B, S, E), context (B, Sk, E) with NaN / inf at its padded positions,
    the (B, Sk) keep mask, dout."""
    gen = torch.Generator().manual_seed(5)
    B, S, Sk, E = 2, 2 * world + 1, 2 * world * 2 + 1, 16
    x = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    context = torch.randn(B, Sk, E, generator=gen, dtype=torch.float64)
    keep = torch.ones(B, Sk, dtype=torch.bool)
    keep[0, Sk - 3:] = False
    keep[1, 1] = False
    context[~keep] = math.nan
    context[1, 1, 0] = math.inf
    return x, context, keep, torch.randn(B, S, E, generator=gen, dtype=torch.float64)


def module_for_nan(method: str | None):
    import headwise
    import headwise.distributed as hwd

    torch.manual_seed(9)
    cp = None if method is None else hwd.ContextParallel(method=method)
    return headwise.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.float64, context_parallel=cp)


def _run_module_nan(hwd, method, world):
    mha = module_for_nan(method)
    x, context, keep, dout = module_nan_inputs(world)
    xs, cs = hwd.shard(x, dim=1).requires_grad_(), hwd.shard(context, dim=1).requires_grad_()
    y = mha(xs, hwd.shard(keep, dim=1), context=cs)
    y.backward(hwd.shard(dout, dim=1))
    grads = {}
    for pname, p in mha.named_parameters():
        g = p.grad.clone()
        torch.distributed.all_reduce(g)  # the gradients of every rank's part of the sequence add up
        grads[pname] = g
    return {"out": hwd.unshard(y.detach(), dim=1), "dx": hwd.unshard(xs.grad, dim=1),
            "dcontext": hwd.unshard(cs.grad, dim=1), **grads}


def _run_scenario(hwd, name, rank, world):
    try:
        if name in NAN_CASES:
            return _run_nan_case(hwd, name)
        if name in REFUSALS:
            return _run_refusal(hwd, name, rank, world)
        return _run_module_nan(hwd, name.removeprefix("module-nan-"), world)
    except Exception as error:  # noqa: BLE001  (reported by the parent)
        return f"{type(error).__name__}: {error}"


SCENARIOS = [*NAN_CASES, *REFUSALS, *(f"module-nan-{m}" for m in MODULE_NAN_CASES)]


@pytest.fixture(scope="module")
def scenario_results(tmp_path_factory):
    """Every scenario on one group of 2 ranks, with a short gloo timeout: a hang fails within a minute."""
    spec = {"cases": [], "errors": [], "modules": [], "scenarios": SCENARIOS, "group_timeout_s": 60}
    return _launch_once("issue35", 2, spec, tmp_path_factory, timeout=240)


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_where_no_query_looks_stays_out(scenario_results, name):
    """NaN / inf at keys or query rows excluded for every query: outputs and every gradient
    equal the float64 reference on the same inputs with zeros there (one process)."""
    got = scenario_results[0][name]
    assert not isinstance(got, str), got
    t = nan_inputs(name)
    _, _, causal, window, _, _ = NAN_CASES[name]
    leaves = {n: t["hidden"][n].clone().requires_grad_() for n in ("q", "k", "v")}
    out = reference(leaves["q"], leaves["k"], leaves["v"], t["mask"], causal=causal, window=window)
    out.backward(t["dout"])
    want = {"out": out.detach(), **{f"d{n}": leaves[n].grad for n in ("q", "k", "v")}}
    for n, ref in want.items():
        assert torch.isfinite(got[n]).all(), f"{n} has NaN/inf"
        torch.testing.assert_close(got[n], ref, rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refusal_reaches_every_rank(scenario_results, name):
    """Every rank raises (none waits for the group's timeout); the refusing rank gives its own
    message, the others name it and its message; the module is unchanged; the group stays in step."""
    kind, pattern = REFUSALS[name]
    if pattern is None:  # what the module says in one process on rank 1's arguments
        call, _ = refusing_call(name, None, 2)
        with pytest.raises({"TypeError": TypeError, "ValueError": ValueError}[kind]) as info:
            call()
        pattern = __import__("re").escape(str(info.value))
    for rank, results in enumerate(scenario_results):
        got = results[name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        got_kind, message, same, after = got
        assert got_kind == kind, f"rank {rank}: {got_kind}: {message}"
        assert __import__("re").search(pattern, message), f"rank {rank}: {message}"
        refusers = REFUSERS.get(name, (1,))
        if rank not in refusers:
            assert f"rank(s) {list(refusers)} of 2 rejected" in message, message
        assert same, f"rank {rank}: the module's state changed"
        assert after is True, f"rank {rank}: the next call: {after}"


@pytest.mark.parametrize("method", MODULE_NAN_CASES)
def test_module_cross_attention_hides_padded_context(scenario_results, method):
    """NaN / inf at the padded context positions: the same finite results as the module in one process."""
    got = scenario_results[0][f"module-nan-{method}"]
    assert not isinstance(got, str), got
    mha = module_for_nan(None)
    x, context, keep, dout = module_nan_inputs(2)
    x, context = x.requires_grad_(), context.requires_grad_()
    y = mha(x, keep, context=context)
    y.backward(dout)
    want = {"out": y.detach(), "dx": x.grad, "dcontext": context.grad,
            **{n: p.grad for n, p in mha.named_parameters()}}
    for n, ref in want.items():
        assert torch.isfinite(ref).all(), f"one process: {n}"
        assert torch.isfinite(got[n]).all(), f"{n} has NaN/inf"
        torch.testing.assert_close(got[n], ref, rtol=0, atol=1e-10, msg=n)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(*map(int, sys.argv[2:5]), *sys.argv[5:7])

"""Rules as functions, measured: the targets of mask_mod / score_mod (issue 23).

Four tables from one run, every ratio from times paired in turns (each repeat runs every
side once, medians reported), CPU fp32:

* **Document-causal**, forward + backward: 16 documents of random lengths in one row of
  S = 8192, H = 8, D = 64. ``headwise.attention(..., mask_mod=and_masks(causal,
  document(ids)))`` with "auto", against SDPA with the rule materialised as a (S, S) bool
  mask, and against ``headwise.packed_attention`` on the same documents. Targets: auto
  >= 4x faster than the materialised mask; <= 1.3x packed_attention. The ``chunked``
  kernel (tile skipping) is shown too.
* **T5 bias as a score_mod**, forward + backward with the bias table learned: peak memory
  above the process's level before the run (each side in a subprocess of its own) of
  ``score_mod=relative_position_bias(table)`` against SDPA with the same bias materialised
  as a (1, H, S, S) float mask. Target: <= 10%.
* **Tile map** of document-causal at S = Sk = 32768, 128 x 128 tiles: build time. Target:
  <= 50 ms.
* **Against compiled FlexAttention on CPU**, inference, the same document-causal rule
  (compiled once, outside the timing): the ratio, goal >= 1x; and ``backend="flex"``, the same
  compiled flex_attention behind headwise's contract (its BlockMask from headwise's tile map,
  kept per rule and shape), which shows what the contract costs around it.

    python benchmarks/rules.py [--quick] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import headwise
from headwise import masks
from headwise.bench import PEAK_CHILD_ENV, cpu_name, peak_rise_mib, round_robin_ms
from headwise.masks import tile_map


def documents(S: int, n: int, seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Ids (S,) of ``n`` documents of random lengths (at least 16 tokens each), and the lengths."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(S // 16 - 1, generator=gen)[:n - 1] + 1).values * 16
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([S])])).tolist()
    ids = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))
    return ids, lengths


def paired(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed in turns (:func:`headwise.bench.round_robin_ms`)."""
    return dict(zip(fns, (ms / 1e3 for ms in round_robin_ms(list(fns.values()), repeats)), strict=True))


def document_causal(S: int, H: int, D: int, repeats: int) -> list[tuple[str, float, str]]:
    ids, lengths = documents(S, 16)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, S, D, generator=gen, requires_grad=True) for _ in range(3))
    rule = masks.and_masks(masks.causal, masks.document(ids))
    dense = (ids[:, None] == ids[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()  # (S, S)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_(True) for t in (q, k, v)]  # (S, H, D)
    grad = torch.randn(1, H, S, D, generator=gen)

    def step(fn, inputs, g):
        out = fn()
        torch.autograd.grad(out, inputs, g)

    fns = {
        "auto": lambda: step(lambda: headwise.attention(q, k, v, mask_mod=rule), (q, k, v), grad),
        "chunked": lambda: step(lambda: headwise.attention(q, k, v, mask_mod=rule, backend="chunked"), (q, k, v),
                                grad),
        "sdpa, materialised mask": lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
                                                (q, k, v), grad),
        "packed_attention": lambda: step(lambda: headwise.packed_attention(*packed, cu, cu, is_causal=True), packed,
                                         grad[0].transpose(0, 1)),
    }
    torch.testing.assert_close(headwise.attention(q, k, v, mask_mod=rule),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=2e-5, rtol=2e-5)
    t = paired(fns, repeats)
    chosen = headwise.choose_backend(q, k, v, mask_mod=rule).backend
    return [("auto (" + chosen + ")", t["auto"], f"{t['sdpa, materialised mask'] / t['auto']:.1f}x faster than "
             f"the materialised mask (target >= 4x); {t['auto'] / t['packed_attention']:.2f}x packed_attention "
             "(target <= 1.3x)"),
            ("chunked (tiles skipped)", t["chunked"], f"{t['sdpa, materialised mask'] / t['chunked']:.1f}x faster "
             "than the materialised mask"),
            ("sdpa, materialised mask", t["sdpa, materialised mask"], ""),
            ("packed_attention", t["packed_attention"], "")]


def _peak_child(side: str, S: int, H: int) -> float:
    """Peak resident-set rise (MiB) of one fresh process running ``side`` ("score_mod" or "materialised")."""
    command = [sys.executable, __file__, "--peak-side", side, "--peak-S", str(S), "--peak-H", str(H)]
    out = subprocess.run(command, capture_output=True, text=True, check=True,
                         env={**os.environ, **PEAK_CHILD_ENV})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _peak_side(side: str, S: int, H: int) -> None:
    """Run one side of the T5 table in this process and print its peak RSS (MiB)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(32, H, generator=gen, requires_grad=True)
    rule = masks.relative_position_bias(table)

    def run(n: int) -> None:
        q, k, v = (torch.randn(1, H, n, 64, generator=gen, requires_grad=True) for _ in range(3))
        if side == "score_mod":
            headwise.attention(q, k, v, score_mod=rule).sum().backward()
        else:
            b, h, i, j = headwise.evaluate.grid(1, H, (0, n), (0, n), None)
            bias = rule.bias(b, h, i, j)  # (1, H, S, S) float32, from the table: gradients reach it
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()

    run(256)  # warm-up: lazy initialisation and thread pools are not the run's memory
    print(json.dumps({"peak_mib": peak_rise_mib(lambda: run(S))}))


def t5_memory(S: int, H: int) -> list[tuple[str, float, str]]:
    ours = _peak_child("score_mod", S, H)
    theirs = _peak_child("materialised", S, H)
    return [("score_mod=relative_position_bias", ours, f"{ours / theirs:.1%} of the materialised run (target <= 10%)"),
            ("sdpa, materialised bias", theirs, f"the bias alone is {H * S * S * 4 / 2**30:.2f} GiB")]


def tile_map_time(S: int, repeats: int) -> list[tuple[str, float, str]]:
    ids, _ = documents(S, 16)
    rule = masks.and_masks(masks.causal, masks.document(ids))
    t = paired({"tile_map": lambda: tile_map(rule, 1, 8, S, S, block=(128, 128))}, repeats)["tile_map"]
    shares = tile_map(rule, 1, 8, S, S).describe()
    return [(f"tile_map, S = Sk = {S}", t, f"{t * 1e3:.1f} ms (target <= 50 ms); {shares}")]


def against_flex(S: int, H: int, D: int, repeats: int) -> list[tuple[str, float, str]]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:  # pragma: no cover - torch without FlexAttention
        return [("compiled flex_attention", float("nan"), f"not available: {e}")]
    ids, _ = documents(S, 16)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, S, D, generator=gen) for _ in range(3))

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (ids[q_idx] == ids[kv_idx])

    try:
        block_mask = create_block_mask(doc_causal, None, None, S, S, device="cpu")
        flex = torch.compile(flex_attention)
        with torch.no_grad():
            flex(q, k, v, block_mask=block_mask)  # compiled here, outside the timing
    except Exception as e:  # noqa: BLE001 - whatever stops compiling, say it
        return [("compiled flex_attention", float("nan"), f"could not run: {type(e).__name__}: {e}"[:200])]
    rule = masks.and_masks(masks.causal, masks.document(ids))
    with torch.no_grad():
        want = flex(q, k, v, block_mask=block_mask)
        for backend in ("auto", "flex"):  # backend "flex" compiles here, outside the timing
            torch.testing.assert_close(headwise.attention(q, k, v, mask_mod=rule, backend=backend), want,
                                       atol=2e-5, rtol=2e-5)
        t = paired({"ours": lambda: headwise.attention(q, k, v, mask_mod=rule),
                    "flex": lambda: flex(q, k, v, block_mask=block_mask),
                    "backend flex": lambda: headwise.attention(q, k, v, mask_mod=rule, backend="flex")}, repeats)
    return [("headwise.attention (auto)", t["ours"], f"{t['flex'] / t['ours']:.2f}x the speed of compiled flex "
             "(goal >= 1x)"), ("compiled flex_attention", t["flex"], ""),
            ("headwise backend='flex'", t["backend flex"], f"{t['flex'] / t['backend flex']:.2f}x the speed of "
             "compiled flex (the contract around the same kernel)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not the targets")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention (it compiles for minutes)")
    parser.add_argument("--peak-side", help=argparse.SUPPRESS)
    parser.add_argument("--peak-S", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--peak-H", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_side:
        _peak_side(args.peak_side, args.peak_S, args.peak_H)
        return
    torch.set_num_threads(args.threads)
    S, H, D, big = (1024, 2, 32, 4096) if args.quick else (8192, 8, 64, 32768)
    print(f"# rules as functions: {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"median of {args.repeats} paired repeats")
    tables = [(f"document-causal, S = {S}, H = {H}, D = {D}, 16 documents, forward + backward (s)",
               document_causal(S, H, D, args.repeats)),
              (f"T5 bias as score_mod, S = {S}, H = {H}, forward + backward: peak MiB above baseline",
               t5_memory(S, H)),
              ("tile map, 128 x 128 tiles (s)", tile_map_time(big, args.repeats))]
    if not args.no_flex:
        tables.append((f"inference against compiled FlexAttention, S = {S}, H = {H}, D = {D} (s)",
                       against_flex(S, H, D, args.repeats)))
    for title, rows in tables:
        print(f"\n{title}")
        for name, value, note in rows:
            print(f"  {name:<36} {value:>10.4g}  {note}")


if __name__ == "__main__":
    main()

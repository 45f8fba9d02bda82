"""Rules as functions, measured: the targets of mask_mod / score_mod (issues 23 and 36).

Four tables from one run, every ratio from times paired in turns (each repeat runs every
side once, medians reported), CPU fp32. Each rule is measured twice, as our helpers build it
(``masks.and_masks(masks.causal, masks.document(ids))``) and as FlexAttention users write it,
a plain function: ``lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)``.

* **Document-causal**, forward + backward: 16 documents of random lengths in one row of
  S = 8192, H = 8, D = 64. ``headwise.attention(..., mask_mod=rule)`` with "auto", against
  SDPA with the rule materialised as a (S, S) bool mask, and against
  ``headwise.packed_attention`` on the same documents. Targets (for the plain function):
  >= 4x faster than the materialised mask; <= 1.3x packed_attention. The plain function is
  also timed with nothing remembered (its tiles and its reading as documents built anew on
  every call, as when the documents change every batch). The ``chunked`` kernel (tile
  skipping) is shown too.
* **T5 bias as a score_mod**, forward + backward with the bias table learned: peak memory
  above the process's level before the run (each side in a subprocess of its own) of
  ``score_mod=relative_position_bias(table)`` against SDPA with the same bias materialised
  as a (1, H, S, S) float mask. Target: <= 10%.
* **Tile map** of document-causal at S = Sk = 32768, 128 x 128 tiles: build time, of the
  helpers (target <= 50 ms) and of the plain function (target <= 100 ms; built anew each
  time, and served from memory), and torch's ``create_block_mask`` on the same function.
* **Against compiled FlexAttention on CPU**, inference, the same document-causal rule
  (compiled once, outside the timing), headwise given the helpers and the plain function:
  the ratio, goal >= 1x; and ``backend="flex"``, the same compiled flex_attention behind
  headwise's contract (its BlockMask from headwise's tile map, kept per rule and shape),
  which shows what the contract costs around it.

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
from headwise import masks, symbolic
from headwise.bench import PEAK_CHILD_ENV, peak_rise_mib, round_robin_ms
from headwise.calibration import cpu_name
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


def plain_document_causal(ids: torch.Tensor):
    """The document-causal rule as a FlexAttention user writes it."""
    def doc_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return doc_causal


def _afresh(fn):
    """``fn`` with nothing remembered of its rule: as on the first batch of new documents."""
    def run():
        symbolic.forget()
        return fn()

    return run


def document_causal(S: int, H: int, D: int, repeats: int) -> list[tuple[str, float, str]]:
    ids, lengths = documents(S, 16)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, S, D, generator=gen, requires_grad=True) for _ in range(3))
    helpers, plain = masks.and_masks(masks.causal, masks.document(ids)), plain_document_causal(ids)
    dense = (ids[:, None] == ids[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()  # (S, S)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    packed = [t.detach()[0].transpose(0, 1).contiguous().requires_grad_(True) for t in (q, k, v)]  # (S, H, D)
    grad = torch.randn(1, H, S, D, generator=gen)

    def step(fn, inputs, g):
        out = fn()
        torch.autograd.grad(out, inputs, g)

    def ours(rule, backend="auto"):
        return lambda: step(lambda: headwise.attention(q, k, v, mask_mod=rule, backend=backend), (q, k, v), grad)

    packed_step = lambda: step(lambda: headwise.packed_attention(*packed, cu, cu, is_causal=True),  # noqa: E731
                               packed, grad[0].transpose(0, 1))
    fns = {
        "helpers": ours(helpers), "plain": ours(plain), "chunked": ours(plain, "chunked"),
        "sdpa": lambda: step(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), (q, k, v), grad),
        "packed": packed_step,
    }
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    for rule in (helpers, plain):
        torch.testing.assert_close(headwise.attention(q, k, v, mask_mod=rule), want, atol=2e-5, rtol=2e-5)
    t = paired(fns, repeats)
    # apart: forgetting in turns with the others would make the plain function's remembered turn forget too
    afresh = paired({"plain, afresh": _afresh(ours(plain)), "packed": packed_step, "sdpa": fns["sdpa"]}, repeats)
    t["plain, afresh"] = afresh["plain, afresh"] * t["packed"] / afresh["packed"]  # in units of this run's packed

    def against(name: str, targets: bool) -> str:
        aims = (" (target >= 4x)", " (target <= 1.3x)") if targets else ("", "")
        return (f"{t['sdpa'] / t[name]:.1f}x faster than the materialised mask{aims[0]}; "
                f"{t[name] / t['packed']:.2f}x packed_attention{aims[1]}")

    chosen = {name: headwise.choose_backend(q, k, v, mask_mod=rule).backend
              for name, rule in (("helpers", helpers), ("plain", plain))}
    return [(f"helpers, auto ({chosen['helpers']})", t["helpers"], against("helpers", False)),
            (f"plain function, auto ({chosen['plain']})", t["plain"], against("plain", True)),
            ("plain function, nothing remembered", t["plain, afresh"], against("plain, afresh", False)),
            ("plain function, chunked", t["chunked"], against("chunked", False)),
            ("sdpa, materialised mask", t["sdpa"], ""),
            ("packed_attention", t["packed"], "")]


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


def tile_map_time(S: int, repeats: int, flex: bool = False) -> list[tuple[str, float, str]]:
    ids, _ = documents(S, 16)
    helpers, plain = masks.and_masks(masks.causal, masks.document(ids)), plain_document_causal(ids)
    fns = {"helpers": lambda: tile_map(helpers, 1, 8, S, S, block=(128, 128)),
           "plain": _afresh(lambda: tile_map(plain, 1, 8, S, S, block=(128, 128))),
           "plain, remembered": lambda: tile_map(plain, 1, 8, S, S, block=(128, 128))}
    assert torch.equal(fns["helpers"]().states, fns["plain"]().states)
    t = paired({name: fns[name] for name in ("helpers", "plain")}, repeats)
    t.update(paired({"plain, remembered": fns["plain, remembered"]}, repeats))  # apart: "plain" forgets
    shares = tile_map(helpers, 1, 8, S, S).describe()
    rows = [(f"helpers, S = Sk = {S}", t["helpers"], f"{t['helpers'] * 1e3:.1f} ms (target <= 50 ms); {shares}"),
            ("plain function, built", t["plain"], f"{t['plain'] * 1e3:.1f} ms (target <= 100 ms)"),
            ("plain function, remembered", t["plain, remembered"], f"{t['plain, remembered'] * 1e3:.2f} ms")]
    if flex:
        rows.append(_create_block_mask(plain, S, t["plain"]))
    return rows


def _create_block_mask(rule, S: int, ours: float) -> tuple[str, float, str]:
    """torch's create_block_mask on the same plain function (timed once: it takes seconds)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as e:  # pragma: no cover - torch without FlexAttention
        return ("torch create_block_mask", float("nan"), f"not available: {e}")
    t = paired({"torch": lambda: create_block_mask(rule, None, None, S, S, device="cpu")}, 1)["torch"]
    return ("torch create_block_mask", t, f"{t / ours:.1f}x the plain function's build")


def against_flex(S: int, H: int, D: int, repeats: int) -> list[tuple[str, float, str]]:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:  # pragma: no cover - torch without FlexAttention
        return [("compiled flex_attention", float("nan"), f"not available: {e}")]
    ids, _ = documents(S, 16)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, S, D, generator=gen) for _ in range(3))
    doc_causal = plain_document_causal(ids)
    try:
        block_mask = create_block_mask(doc_causal, None, None, S, S, device="cpu")
        flex = torch.compile(flex_attention)
        with torch.no_grad():
            flex(q, k, v, block_mask=block_mask)  # compiled here, outside the timing
    except Exception as e:  # noqa: BLE001 - whatever stops compiling, say it
        return [("compiled flex_attention", float("nan"), f"could not run: {type(e).__name__}: {e}"[:200])]
    helpers = masks.and_masks(masks.causal, masks.document(ids))
    with torch.no_grad():
        want = flex(q, k, v, block_mask=block_mask)
        for rule in (helpers, doc_causal):
            torch.testing.assert_close(headwise.attention(q, k, v, mask_mod=rule), want, atol=2e-5, rtol=2e-5)
        # backend "flex" compiles here, outside the timing
        torch.testing.assert_close(headwise.attention(q, k, v, mask_mod=doc_causal, backend="flex"), want,
                                   atol=2e-5, rtol=2e-5)
        t = paired({"helpers": lambda: headwise.attention(q, k, v, mask_mod=helpers),
                    "plain": lambda: headwise.attention(q, k, v, mask_mod=doc_causal),
                    "flex": lambda: flex(q, k, v, block_mask=block_mask),
                    "backend flex": lambda: headwise.attention(q, k, v, mask_mod=doc_causal, backend="flex")},
                   repeats)
    return [("headwise (auto), helpers", t["helpers"], f"{t['flex'] / t['helpers']:.2f}x the speed of compiled flex"),
            ("headwise (auto), plain function", t["plain"],
             f"{t['flex'] / t['plain']:.2f}x the speed of compiled flex (goal >= 1x)"),
            ("compiled flex_attention", t["flex"], "given the plain function's create_block_mask"),
            ("headwise backend='flex', plain function", t["backend flex"],
             f"{t['flex'] / t['backend flex']:.2f}x the speed of compiled flex (the contract around the same "
             "kernel)")]


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
              ("tile map of document-causal, 128 x 128 tiles (s)", tile_map_time(big, args.repeats, not args.no_flex))]
    if not args.no_flex:
        tables.append((f"inference against compiled FlexAttention, S = {S}, H = {H}, D = {D} (s)",
                       against_flex(S, H, D, args.repeats)))
    for title, rows in tables:
        print(f"\n{title}")
        for name, value, note in rows:
            print(f"  {name:<36} {value:>10.4g}  {note}")


if __name__ == "__main__":
    main()

"""Attention variants as rules: document masking, prefix-LM, a sliding window and a T5 bias,
each a ``mask_mod`` or ``score_mod``, with a picture of its tile map.

    python examples/rules_gallery.py [--quick] [--out DIR]

A rule is a small function (FlexAttention's signatures): ``mask_mod(b, h, q_idx, kv_idx) ->
bool`` says which keys a query may attend, ``score_mod(score, b, h, q_idx, kv_idx) ->
score`` changes a score. For each of the four, this script:

1. runs ``headwise.attention(q, k, v, mask_mod=..., score_mod=...)`` with ``"auto"`` and
   prints the kernel it chose and why;
2. checks the output against the textbook formula written out here (scores, the rule's
   mask as -inf, its bias added, softmax, weighted sum), in float64;
3. builds the rule's tile map (``headwise.masks.tile_map``: which (128, 128) tiles are
   empty, full or partial; a kernel skips the empty ones and runs the full ones without a
   mask) and draws it into ``--out`` (default: a new temporary folder), one PNG per rule.

The rules are ``headwise.masks``' helpers; a plain Python function of the same signature
works too (the sliding window is also written as one, and gives the same output).

Legend: B batch, H heads, S query length, Sk key length, D head dim.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import headwise
from headwise import masks
from headwise.plot import plot_tile_map


def textbook(q, k, v, mask_mod=None, score_mod=None):
    """softmax(q k^T / sqrt(D) + bias, masked) v, the rules evaluated on the whole grid."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q_idx = torch.arange(S).view(1, 1, S, 1)
    kv_idx = torch.arange(Sk).view(1, 1, 1, Sk)
    scores = q @ k.transpose(-2, -1) / D**0.5  # (B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)
    if score_mod is not None:
        scores = score_mod(scores, b, h, q_idx, kv_idx)
    if mask_mod is not None:
        allowed = torch.broadcast_to(mask_mod(b, h, q_idx, kv_idx), scores.shape)  # (B, H, S, Sk)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # (B, H, S, Sk) x (B, H, Sk, D) -> (B, H, S, D)


def window_by_hand(window: int):
    """The sliding window as a plain function: what ``masks.sliding_window`` encodes."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)
    return mask_mod


def gallery(S: int, H: int) -> dict:
    """The four rules for sequences of S tokens: name -> (mask_mod, score_mod, what it is)."""
    lengths = torch.tensor([S // 8, S // 4, S // 2, S - S // 8 - S // 4 - S // 2])
    doc_ids = torch.repeat_interleave(torch.arange(4), lengths)  # (S,) the document of each token
    table = torch.randn(32, H) * 0.5  # T5's learned (buckets, H) table: random here
    return {
        "document": (masks.and_masks(masks.causal, masks.document(doc_ids)), None,
                     f"4 packed documents of {torch.bincount(doc_ids).tolist()} tokens, causal within each"),
        "prefix_lm": (masks.prefix_lm(S // 4), None,
                      f"the first {S // 4} tokens (the prefix) see each other; the rest is causal"),
        "sliding_window": (masks.sliding_window(S // 8), None, f"causal, each query sees its last {S // 8} keys"),
        "t5_bias": (masks.causal, masks.relative_position_bias(table, bidirectional=False),
                    "causal, plus T5's learned bias of the bucketed distance, per head"),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 512 instead of 2048 (CI)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the pictures (default: a new temp dir)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="headwise-rules-"))
    out.mkdir(parents=True, exist_ok=True)
    B, H, S, D = 1, 4, (512 if args.quick else 2048), 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    results = {}
    for name, (mask_mod, score_mod, what) in gallery(S, H).items():
        choice = headwise.choose_backend(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        got = headwise.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)  # (B, H, S, D)
        diff = (got - textbook(q, k, v, mask_mod, score_mod)).abs().max().item()
        tiles = masks.tile_map(mask_mod, B, H, S, S, block=(128, 128))
        picture = out / f"{name}.png"
        plot_tile_map(tiles.states[0, 0], str(picture), block=tiles.block, title=f"{name}: {what}")
        shares = tiles.shares()
        print(f"{name}: {what}")
        print(f"  auto ran {choice.backend!r}; max |difference| from the textbook formula {diff:.1e} (float64)")
        print(f"  tiles of 128 x 128: {shares['empty']:.0%} empty (chunked and triton skip them), "
              f"{shares['full']:.0%} full, {shares['partial']:.0%} partial -> {picture}")
        results[name] = {"backend": choice.backend, "max_diff": diff, "picture": picture, "shares": shares}
    by_hand = headwise.attention(q, k, v, mask_mod=window_by_hand(S // 8))
    same = torch.allclose(by_hand, headwise.attention(q, k, v, mask_mod=masks.sliding_window(S // 8)))
    print(f"the sliding window written as a plain function gives the same output: {same}")
    print(f"pictures in {out}")
    results["plain_function_same"] = same
    return results


if __name__ == "__main__":
    main()

"""Tests for ``headwise.evaluate``: a rule function called on the score grid, the broadcast way
or, for a function written for Flex's scalar indices, the Flex way.

Legend: B batch, H query heads, S query length, Sk key length.
"""

from __future__ import annotations

import pytest
import torch

from headwise.evaluate import evaluate_mask, evaluate_score, evaluate_score_at, grid_at
from headwise.masks import tile_map

H = 4
KEEP = torch.rand(4, 12, generator=torch.Generator().manual_seed(5)) > 0.3  # (B, Sk) per batch row
ROW_BIAS = torch.randn(4, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)  # (B, S)
HEAD_BIAS = torch.randn(H, 12, 12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)  # (H, S, Sk)
ALLOWED = torch.rand(H, 12, 12, generator=torch.Generator().manual_seed(8)) > 0.4  # (H, S, Sk)


@pytest.mark.parametrize("sizes", [(2, 12), (4, 4)], ids=["B<S", "B==S"])
def test_every_evaluation_of_a_rule_reads_a_flex_function_the_flex_way(sizes):
    Bn, S = sizes
    keep = lambda b, h, q_idx, kv_idx: KEEP[b][kv_idx] & ALLOWED[h][q_idx][kv_idx]  # noqa: E731
    bias = lambda s, b, h, q_idx, kv_idx: s * 2 + ROW_BIAS[b][q_idx] + HEAD_BIAS[h][q_idx][kv_idx]  # noqa: E731
    want_mask = KEEP[:Bn, None, None, :S] & ALLOWED[None, :, :S, :S]  # (B, H, S, Sk)
    scores = torch.randn(Bn, H, S, S, dtype=torch.float64)
    want_scores = scores * 2 + ROW_BIAS[:Bn, None, :S, None] + HEAD_BIAS[None, :, :S, :S]
    got = evaluate_mask(keep, Bn, H, (1, S), (2, S), None)
    assert torch.equal(got.expand(Bn, H, S - 1, S - 2), want_mask[:, :, 1:, 2:])
    torch.testing.assert_close(evaluate_score(bias, scores[:, :, 1:, 2:], (1, S), (2, S)), want_scores[:, :, 1:, 2:])
    heads, rows = torch.tensor([3, 1]), torch.tensor([S - 1, 0])
    at = grid_at(Bn, heads, rows, S)
    torch.testing.assert_close(evaluate_score_at(bias, scores[:, heads][:, :, rows], *at),
                               want_scores[:, heads][:, :, rows])
    assert torch.equal(evaluate_mask(keep, Bn, H, (0, 0), (0, 0), None, at=at).expand(Bn, 2, 2, S),
                       want_mask[:, heads][:, :, rows])
    tiles = tile_map(keep, Bn, H, S, S, block=(2, 3)).states  # (B, H, nq, nk)
    padded = torch.nn.functional.pad(want_mask.to(torch.int8), (0, (-S) % 3, 0, (-S) % 2), mode="replicate")
    blocks = padded.reshape(Bn, H, -1, 2, padded.shape[-1] // 3, 3)
    want_tiles = torch.where(blocks.amin((3, 5)) == 1, 2, torch.where(blocks.amax((3, 5)) == 1, 1, 0))
    assert torch.equal(tiles.expand_as(want_tiles).long(), want_tiles.long())

"""Tile sizes: per kernel and head-dim bound on a GPU (first choice first), one small tile in
Triton's interpreter, and the map tile of a mask_mod's tile map, which every kernel tile divides.

Legend: D head dim, BM / BN the rows / columns of one tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of one kernel.

    Attributes:
        block_m: query rows per tile (BM).
        block_n: key columns per tile (BN).
        num_warps: warps per program.
        num_stages: software pipelining depth of the inner loop.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# Tile sizes per kernel and head dim bound, first choice first. Chosen by compiling for
# sm_90 (H100/H200) and reading ptxas's register and spill counts: the first choice of
# each compiles with software pipelining, fits shared memory and spills at most 120
# bytes (dkdv, D = 128). A config that does not fit the GPU (Triton raises
# OutOfResources) falls through to the next. benchmarks/gpu.py --config overrides them.
GPU_CONFIGS: dict[str, dict[int, tuple[TileConfig, ...]]] = {
    "forward": {  # block_m query rows held by the program, block_n key columns streamed
        64: (TileConfig(128, 64, 4, 3), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 1)),
        128: (TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 1)),
    },
    "dkdv": {  # block_n key rows held by the program, block_m query rows streamed
        64: (TileConfig(32, 128, 8, 3), TileConfig(32, 64, 4, 2), TileConfig(16, 32, 4, 1)),
        128: (TileConfig(32, 128, 8, 3), TileConfig(16, 64, 4, 2), TileConfig(16, 32, 4, 1)),
    },
    "dq": {  # block_m query rows held by the program, block_n key columns streamed
        64: (TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 2), TileConfig(32, 16, 4, 1)),
        128: (TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 2), TileConfig(32, 16, 4, 1)),
    },
}
# fp32 inputs multiply on CUDA cores (IEEE) unless torch allows TF32: the tiles above
# would spill tens of kilobytes of registers, so they get small ones (no spills at
# D <= 64, under 1 KiB at D = 128). fp32 is the exact path; fp16 / bf16 the fast one.
GPU_FP32_CONFIGS: dict[str, dict[int, tuple[TileConfig, ...]]] = {
    "forward": {128: (TileConfig(32, 16, 4, 2), TileConfig(16, 16, 4, 1))},
    "dkdv": {128: (TileConfig(16, 16, 4, 2), TileConfig(16, 16, 4, 1))},
    "dq": {64: (TileConfig(32, 16, 4, 2), TileConfig(16, 16, 4, 1)),
           128: (TileConfig(16, 32, 4, 2), TileConfig(16, 16, 4, 1))},
}
# The interpreter runs tiles as numpy arrays: small tiles keep the tests' shapes small
# while still spanning several tiles (16 is tl.dot's smallest dimension on GPUs).
INTERPRET_CONFIG = TileConfig(16, 16, 1, 1)
# The tile map of a mask_mod, (rows, columns) per map tile: a multiple of every kernel tile
# above, so one map serves forward, dq and dkdv, each walking a map tile as several of its
# own tiles (FlexAttention's BlockMask does the same with 128 x 128). It is tile_map()'s
# default block, so a TileMap built with the defaults for the call's shape is reused as is.
# The interpreter's map tile spans 2 x 2 of its kernel tiles, so the tests walk map tiles
# in pieces as the GPU does.
RULE_BLOCK = (128, 128)
INTERPRET_RULE_BLOCK = (32, 32)


def _configs(kind: str, head_dim: int, dtype: torch.dtype, interpret: bool) -> tuple[TileConfig, ...]:
    if interpret:
        return (INTERPRET_CONFIG,)
    table = (GPU_FP32_CONFIGS if dtype == torch.float32 else GPU_CONFIGS)[kind]
    return table[min(bound for bound in table if bound >= head_dim)]


def _rule_block(interpret: bool) -> tuple[int, int]:
    return INTERPRET_RULE_BLOCK if interpret else RULE_BLOCK

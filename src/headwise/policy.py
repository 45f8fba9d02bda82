"""Every measured threshold behind ``"auto"`` and the tiled loops, in one place.

Each value names the benchmark that sets it and the machine it was measured on. On
another machine, rerun the benchmark and change the value here: the code reads these
names at call time (tests patch them here too). The rules that use them are in
:mod:`headwise.dispatch` (which kernel), :class:`headwise.MultiHeadAttention` (whether to
pack), :mod:`headwise.packing` / :mod:`headwise.kernels.varlen` (length buckets),
:mod:`headwise.kernels.chunked` and :mod:`headwise.distributed.ring` (tiles).

"The 2-core CPU" below is the 2-core x86 machine of the sessions that built headwise,
torch 2.13 CPU; where the model was recorded it is named. :func:`reads_values` is the one
rule for when a decision may look at tensor values (no host sync, no graph break).
"""

from __future__ import annotations

import torch


def reads_values(t: torch.Tensor) -> bool:
    """Whether "auto" may read ``t``'s values to decide: only for a CPU tensor outside
    torch.compile. On an accelerator a read would sync the host with the device on every
    call, and under torch.compile it would break the graph; there the decisions that would
    read values (packing, the key-dropping kernel, skipping the dead-row guard) take the
    path that needs no read.

    >>> reads_values(torch.ones(2))
    True
    """
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


# ---- the module's padding-free path ---------------------------------------------------
# "auto" packs a self-attention batch (drops its padding before the projections) when at
# least this share of it is padding. benchmarks/pack_threshold.py (module rows, forward and
# forward + backward, S=128 and 512): packing was 1.06-1.25x faster from 10% padding on the
# 2-core CPU (model not recorded).
PACK_MIN_PADDING = 0.1

# ---- "auto" among the kernels (headwise.dispatch) --------------------------------------
# Share of padded keys from which the "varlen" kernel (drops padded keys per row) beats
# SDPA with the mask. benchmarks/pack_threshold.py (kernel rows, B=32, H=8, D=64): the
# crossover was about 10% at Sk=2048, 20% at 512, 25% at 256, but 55-70% at 128, on the
# 2-core CPU (model not recorded).
VARLEN_MIN_PADDING = 0.3
VARLEN_SHORT_KEYS = 256  # below this many keys, VARLEN_MIN_PADDING_SHORT applies
VARLEN_MIN_PADDING_SHORT = 0.7

# Above this many bytes of (B, H, S, Sk) scores, an unfused path risks memory more than
# the chunked kernel costs in speed (dropout on CPU keeps SDPA off its fused kernel). A
# memory budget rather than a crossover: `headwise bench` (full run) shows the chunked
# kernel's O(S) peak beside the materialising paths.
SCORES_BUDGET_BYTES = 256 * 2**20

# ---- length buckets (packing.py, kernels/varlen.py) -------------------------------------
# A length bucket takes sequences down to (1 - BUCKET_SLACK) of its longest one, so at most
# this share of a bucket is padding. Chosen, not swept: benchmarks/pack_threshold.py
# measures the packed path with it (2-core CPU); rerun it with other values to tune.
BUCKET_SLACK = 0.15
# From this length on a sequence (or a batch row's real keys) attends on its own, on views
# of its rows: no gather and no mask; stacking it into a bucket would cost about what the
# bucket's padding saves. benchmarks/pack_threshold.py (varlen kernel rows with buckets and
# with rows alone), 2-core CPU (model not recorded).
DIRECT_MIN_LENGTH = 128

# ---- tiles -------------------------------------------------------------------------------
# The chunked kernel's tile: BLOCK_Q queries x BLOCK_K keys (512 KiB of fp32 scores, an L2's
# worth). Chosen when the kernel was written, not swept; `headwise bench` (attention core
# rows) shows the kernel's rate beside SDPA and a plain matmul: rerun it with other values
# to tune.
CHUNKED_BLOCK_Q = 256
CHUNKED_BLOCK_K = 512

# The context-parallel ring's own tiles (blocks with a mask, window or ALiBi): the chunked
# kernel's, not swept separately.
RING_BLOCK_Q = 256
RING_BLOCK_K = 512
# The ring's calls to PyTorch's fused CPU kernel take at most this many queries / keys:
# its backward allocates about four query-sized buffers per call.
# benchmarks/context_parallel.py on the 2-core AMD EPYC (Zen 5).
RING_FUSED_ROWS = 1024
# K and V of one block per ring message; more kv heads go round in several passes. The
# backward holds four block-sized buffers, so this bounds the ring's memory beside the
# shard: benchmarks/context_parallel.py on the 2-core AMD EPYC (Zen 5), N=4 at S=32768,
# per-rank peak 139 MiB = 1.03x one process at S=8192 (189 MiB = 1.41x in one pass), at the
# same throughput.
RING_PASS_BYTES = 4 * 2**20

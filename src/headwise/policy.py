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

import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad


def reads_values(t: torch.Tensor) -> bool:
    """Whether "auto" may read ``t``'s values to decide: only for a CPU tensor outside
    torch.compile. On an accelerator a read would sync the host with the device on every
    call, under torch.compile it would break the graph, and inside a ``torch.func`` transform
    or a ``__torch_dispatch__`` mode it may fail (``vmap`` and ``FakeTensorMode`` have no
    ``.item()``); there the decisions that would read values
    (packing, the key-dropping kernel, skipping the dead-row guard) take the path that needs
    no read.

    >>> reads_values(torch.ones(2))
    True
    """
    return (t.is_cpu and not torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is None
            and torch._C._len_torch_dispatch_stack() == 0)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``, ...) is active (False
    under torch.compile, which traces the transforms itself).

    >>> functorch_active()
    False
    """
    return not torch.compiler.is_compiling() and torch._C._functorch.maybe_current_level() is not None


def forward_ad_active() -> bool:
    """Whether forward-mode AD is active (a ``torch.autograd.forward_ad`` dual level or a
    ``torch.func.jvp``), so that "auto" picks a kernel that carries tangents. Global flags
    only; False under torch.compile, which traces the transforms itself.

    >>> forward_ad_active()
    False
    """
    if torch.compiler.is_compiling():
        return False
    if forward_ad._current_level >= 0:
        return True
    if torch._C._functorch.maybe_current_level() is None:
        return False
    stack = torch._C._functorch.get_interpreter_stack() or []
    return any(i.key() == torch._C._functorch.TransformType.Jvp for i in stack)


# ---- the module's padding-free path ---------------------------------------------------
# "auto" packs a self-attention batch (drops its padding before the projections) when the
# cost model below prices the packed path under the dense one; below this share of padding
# it does not price them at all (nothing to save). benchmarks/pack_threshold.py (module
# rows, S=128 and 512): packing never paid under 10% padding on the 2-core CPU.
PACK_MIN_PADDING = 0.1

# ... and only where the packed price is under this share of the dense one. The unit costs
# below moved up to 20% between two calibration runs, and a close call decided for packing
# can cost more than the tie suggests: auto_grid's B=32 S=32 E=128 training row with 48%
# padding was priced packed 4,910 us vs dense 4,936 us, and packed ran 1.12-1.18x the dense
# path (benchmarks/auto_grid.py --paths, AMD EPYC Zen 5, one thread). Where packing is priced
# this close, dense keeps the minimal module's speed.
PACK_MARGIN = 0.9

# ... but a forward without gradients whose packed price is within this band of the dense one
# (packed / dense) is measured instead: the second call of a shape runs both paths in turns and
# keeps the faster (module/measured.py), as cudnn.benchmark does; below the band the module
# packs, above it stays dense, on the estimate alone. A linear model fitted on small operations
# misses by a fifth even with this machine's own unit costs: on an Intel Xeon (AMX, 2 cores),
# auto_grid's B=16 S=128 E=384 forward with 22% padding was priced packed 15.7 ms vs dense
# 17.5 ms (0.90) and ran 16.9 vs 14.3 ms (1.18); B=8 S=128 E=256 with 36%, packed under one day's
# calibration, ran 1.19x the dense path, and the next day's priced it 0.985. With the built-in
# (AMD) costs there, the same row packed and ran 1.09x; measured, it stays dense.
# HEADWISE_TUNE=off (the test suite's setting) measures nothing here either.
PACK_MEASURE_BAND = (0.6, 1.25)


@dataclass(frozen=True)
class Costs:
    """The unit costs that ``"auto"`` weighs between the dense path, packing and ``varlen``.

    :func:`estimate_packing` and :func:`estimate_varlen` read them.

    Measured by ``benchmarks/pack_cost.py`` from primitive operations (a linear layer, SDPA,
    a concatenation) and from the module at tiny shapes, never from the module rows the
    choice is judged on (``benchmarks/auto_grid.py``).

    Attributes:
        call_us: fixed cost of one dense module call (checks, dispatch, small ops), in us.
        pack_us: what the packed path adds to it once per call (finding the tokens, their
            offsets, the buckets, the scatter back), in us.
        bucket_us: fixed cost of one attention call of the packed path (one length bucket,
            or one sequence attending alone), in us.
        gemm_ps: picoseconds per multiply-add of the projections.
        attn_ps: picoseconds per multiply-add of attention (``q k^T`` and ``p v``).
        copy_ps: picoseconds per element gathered, padded, concatenated or scattered.
    """

    call_us: float
    pack_us: float
    bucket_us: float
    gemm_ps: float
    attn_ps: float
    copy_ps: float


# benchmarks/pack_cost.py --threads 1 --cpu-time, AMD EPYC (Zen 5), torch 2.13 CPU, the mean
# of two runs (they differed by under 20%, copy_ps in training by 47%): forward under no_grad
# (INFERENCE_COSTS) and forward + backward (TRAINING_COSTS).
# These are the built-in costs: headwise.calibration measures this machine's at first use
# (stored per CPU, torch version and thread count; `headwise tune` measures again) and assigns
# them to INFERENCE_COSTS and TRAINING_COSTS; HEADWISE_TUNE=off keeps these.
BUILT_IN_INFERENCE_COSTS = Costs(call_us=59.3, pack_us=40.8, bucket_us=84.4, gemm_ps=18.2, attn_ps=23.2,
                                 copy_ps=1064.0)
BUILT_IN_TRAINING_COSTS = Costs(call_us=181.2, pack_us=72.6, bucket_us=176.0, gemm_ps=56.7, attn_ps=79.1,
                                copy_ps=1091.0)
INFERENCE_COSTS = BUILT_IN_INFERENCE_COSTS
TRAINING_COSTS = BUILT_IN_TRAINING_COSTS


@dataclass(frozen=True)
class VarlenEstimate:
    """The two prices :func:`estimate_varlen` put on one attention call (microseconds);
    ``str()`` gives the sentence in the dispatch reason.

    Attributes:
        sdpa_us: SDPA over all Sk keys with the mask.
        varlen_us: the ``varlen`` kernel: one SDPA call per group of rows on their real keys.
        calls: the ``varlen`` kernel's SDPA calls.
    """

    sdpa_us: float
    varlen_us: float
    calls: int

    @property
    def drops(self) -> bool:
        return self.varlen_us < self.sdpa_us

    def __str__(self) -> str:
        return (f"estimated varlen {_us(self.varlen_us)} ({self.calls} call{'s' if self.calls != 1 else ''}) "
                f"vs sdpa {_us(self.sdpa_us)}")


def _us(value: float) -> str:
    """An estimate in microseconds as dispatch prints it: "<1 us" for a tiny call, never "0 us"."""
    return "<1 us" if value < 1 else f"{value:,.0f} us"


def estimate_varlen(
    batch: int,
    heads: int,
    kv_heads: int,
    q_len: int,
    k_len: int,
    head_dim: int,
    calls: Sequence[tuple[int, int]],
    *,
    is_causal: bool = False,
    training: bool = False,
    costs: Costs | None = None,
) -> VarlenEstimate:
    """Price SDPA with a key padding mask against the ``varlen`` kernel, which drops the
    padded keys: its saved multiply-adds against its fixed cost per call and its gathers.

    Args:
        batch, heads, kv_heads, q_len, k_len, head_dim: B, H, Hkv, S, Sk and D.
        calls: ``headwise.kernels.varlen.call_shapes(key_lengths)``: ``(n, L)`` per call.
        is_causal: causal attention (half the scores are computed).
        training: price forward + backward (:data:`TRAINING_COSTS`).
        costs: other unit costs (None: this module's, read at call time).

    Returns:
        A :class:`VarlenEstimate`.

    >>> e = estimate_varlen(2, 8, 8, 512, 512, 64, [(1, 512), (1, 100)])
    >>> e.drops  # the second row has a fifth of the keys
    True
    """
    c = costs or (TRAINING_COSTS if training else INFERENCE_COSTS)
    E, kv = heads * head_dim, kv_heads * head_dim
    half = 0.5 if is_causal else 1.0
    sdpa = c.attn_ps * 2 * batch * q_len * k_len * E * half
    varlen = c.copy_ps * batch * q_len * E  # the rows stacked back
    for n, L in calls:
        varlen += c.bucket_us * 1e6 + c.attn_ps * 2 * n * q_len * L * E * half
        if n > 1:  # rows stacked into the call
            varlen += c.copy_ps * n * (q_len * E + 2 * L * kv)
    return VarlenEstimate(sdpa / 1e6, varlen / 1e6, len(calls))


@dataclass(frozen=True)
class PackingEstimate:
    """The two prices :func:`estimate_packing` put on one call (microseconds, this machine's
    unit costs); ``str()`` gives the sentence ``dispatch()`` prints.

    Attributes:
        dense_us: the dense path: projections and attention over all B x S positions.
        packed_us: the packed path: projections on the T real tokens, one attention call
            per bucket, the gathers and the scatter back.
        buckets: the packed path's attention calls.
    """

    dense_us: float
    packed_us: float
    buckets: int

    @property
    def packs(self) -> bool:
        return self.packed_us < self.dense_us

    def __str__(self) -> str:
        return (f"estimated packed {_us(self.packed_us)} ({self.buckets} attention "
                f"call{'s' if self.buckets != 1 else ''}) vs dense {_us(self.dense_us)}")


def estimate_packing(
    batch: int,
    seq: int,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    buckets: Sequence[tuple[int, int, int, int]],
    *,
    is_causal: bool = False,
    training: bool = False,
    costs: Costs | None = None,
) -> PackingEstimate:
    """Price the module's dense path and its packed path for one self-attention call.

    Each path costs a fixed part (``call_us``, plus ``pack_us`` and ``bucket_us`` per
    attention call for packing) and a part that grows with the work: multiply-adds of the
    projections (``B S`` rows dense, ``T`` packed) and of attention (``B S^2`` dense, the
    buckets' ``n Lq Lk`` packed), and the elements packing moves.

    Args:
        batch, seq: B and S of the padded batch.
        embed_dim, num_heads, num_kv_heads: E, H and Hkv.
        buckets: ``packing.bucket_shapes(lengths, lengths)``: ``(n, Lq, Lk, keys)`` per
            attention call of the packed path.
        is_causal: causal attention (half the scores are computed).
        training: price forward + backward (:data:`TRAINING_COSTS`) instead of the
            forward (:data:`INFERENCE_COSTS`).
        costs: other unit costs (None: this module's, read at call time).

    Returns:
        A :class:`PackingEstimate`.

    >>> e = estimate_packing(32, 512, 512, 8, 8, [(32, 512, 512, 32 * 512)])
    >>> e.packed_us > e.dense_us  # no padding to drop: packing only adds work
    True
    """
    c = costs or (TRAINING_COSTS if training else INFERENCE_COSTS)
    B, S, E, H = batch, seq, embed_dim, num_heads
    kv = num_kv_heads * (E // H)
    half = 0.5 if is_causal else 1.0
    per_row = E * (E + 2 * kv) + E * E  # projection multiply-adds per token: qkv in, out

    def attention(n: int, Lq: int, Lk: int) -> float:
        return c.attn_ps * 2 * n * Lq * Lk * E * half  # q k^T and p v, all heads

    dense = (c.call_us * 1e6 + c.gemm_ps * B * S * per_row + attention(B, S, S)
             + c.copy_ps * 2 * B * S * E)  # ps: heads merged, padding zeroed
    T = sum(keys for _, _, _, keys in buckets)  # self-attention: the real keys are the real tokens
    packed = (c.call_us + c.pack_us) * 1e6 + c.gemm_ps * T * per_row + c.copy_ps * (3 * T * E + B * S * E)
    for n, Lq, Lk, _ in buckets:
        packed += c.bucket_us * 1e6 + attention(n, Lq, Lk)
        if n > 1:  # gathered into a padded bucket and back
            packed += c.copy_ps * n * (2 * Lq * E + 2 * Lk * kv)
    return PackingEstimate(dense / 1e6, packed / 1e6, len(buckets))

# ---- "auto" among the kernels (headwise.dispatch) --------------------------------------
# "auto" runs the "varlen" kernel (drops padded keys per row) where estimate_varlen prices
# it under SDPA with the mask; below this share of padded keys it does not price them.
# benchmarks/pack_threshold.py (kernel rows, B=32, H=8, D=64): the crossover was about 10%
# at Sk=2048, 20% at 512, 25% at 256, but 55-70% at 128, on the 2-core CPU (model not
# recorded); the fixed cost per call of the model reproduces the late crossover of short keys.
VARLEN_MIN_PADDING = 0.1
# The thresholds by key count that the cost model replaced; read by nothing, kept so that
# code which reads them still runs.
VARLEN_SHORT_KEYS = 256
VARLEN_MIN_PADDING_SHORT = 0.7

# Above this many bytes of (B, H, S, Sk) scores, an unfused path risks memory more than
# the chunked kernel costs in speed (dropout on CPU keeps SDPA off its fused kernel). A
# memory budget rather than a crossover: `headwise bench` (full run) shows the chunked
# kernel's O(S) peak beside the materialising paths.
SCORES_BUDGET_BYTES = 256 * 2**20

# Attention sinks on CPU: from this many scores per head (S x Sk), "auto" runs the chunked
# kernel (sinks from its log-sum-exp) instead of SDPA with one zero key and a float mask
# column for the sinks (the explicit mask keeps SDPA off its fused kernel), when gradients
# are needed or the mask is per query. Measured with headwise.attention on B=2, H=8,
# Hkv=2, D=64, fp32, 1 thread, 2-core AMD EPYC (best of 3-5, noisy within ~20%), forward /
# forward+backward ms, sdpa vs chunked: S=512 full 23/170 vs 20/115, causal 30/115 vs
# 50/145; S=768 full 51/349 vs 84/262, causal 77/327 vs 74/237; S=1024 full 96/604 vs
# 149/483, causal 146/719 vs 149/464; S=2048 full 344/2842 vs 504/1497, causal 496/2253 vs
# 370/1261; B=1 S=4096 causal forward 1733 vs 669.
SINKS_CHUNKED_MIN_SCORES = 768 * 768

# ---- rules as functions (dispatch.py, kernels/chunked.py) --------------------------------
# A mask_mod whose tiles are known (a helper of headwise.masks or a tile map) with at
# least this share of empty 128 x 128 tiles, from RULES_CHUNKED_MIN_SCORES scores per head
# (S x Sk): "auto" runs chunked, which skips the empty tiles, over SDPA with the rule
# materialised as a (B|1, H|1, S, Sk) mask, which computes every tile.
# benchmarks/rules.py prints both for document-causal masks.
RULES_CHUNKED_MIN_EMPTY = 0.5
RULES_CHUNKED_MIN_SCORES = 1024 * 1024
# chunked runs a score_mod a block of query rows at a time under autograd; the block holds a
# handful of (B, H, rows, keys) tensors while its backward runs (the scores, the function's
# intermediates, the probabilities and their gradients), so its rows are as many as keep one
# such tensor within this many bytes (at least 1, at most CHUNKED_BLOCK_Q). A learned T5
# bias at S = 8192, H = 8, forward + backward, peaked at 347 MiB with 16 MiB (64 rows a block)
# and 597 MiB with 64 MiB (256 rows), against 8.6 GiB with the bias materialised for SDPA
# (AMD EPYC, live memory: benchmarks/rules.py prints both sides).
SCORE_MOD_BLOCK_BYTES = 16 * 2**20

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


# The module's fused path (torch._native_multi_head_attention, nn.MultiheadAttention's inference
# op: projections, SDPA and the output projection in one call) for calls without gradients of at
# most this many elements in x, B * S * E. It saves the Python between the ops (8-12 us a call) but
# its kernels are slower as calls grow: benchmarks/overhead.py --fused --threads 1 --cpu-time on
# the 2-core AMD EPYC (Zen 5), torch 2.13, fused / dense module path: 0.62x at 512 elements
# (1 x 8 x 64), 0.83x at 4096, 0.90-0.93x at 8192, 0.97-0.98x at 32768, 0.99-1.00x at 65536,
# 1.005x at 131072 and 262144 (measured when the module kept one fused qkv parameter; with the
# per-call copy below, 0.60-0.92x up to 32768 and 0.91-0.93x at 65536 and 131072).
FUSED_MAX_ELEMENTS = 32768

# The fused op takes q, k and v as one (3E, E) weight; the module's projections are three
# nn.Linear, so each fused call concatenates them (a cached copy could go stale: a write through
# .data bumps no version counter). The copy pays while its 3 E^2 elements are at most this many
# times x's B * S * E: benchmarks/overhead.py --fused --threads 1 --cpu-time on the 2-core AMD
# EPYC (Zen 5), torch 2.13, with the copy: 0.39x at 1 x 8 x 64 (ratio 24), 0.88x at 1 x 32 x 256
# (24), 0.92x at 1 x 128 x 256 (6), but 1.26x at 1 x 32 x 1024 (96).
FUSED_MAX_WEIGHT_COPY = 32

# Decisions are remembered per call signature (the functional memo, the module's), and each
# remembered one read the values above. Assigning any name of this module (a retuned
# threshold, a test's monkeypatch) counts one more GENERATION, and the memos key on it, so
# no decision outlives the values it was made from.
GENERATION = 0


class _Policy(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name != "GENERATION":
            super().__setattr__("GENERATION", self.GENERATION + 1)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        super().__setattr__("GENERATION", self.GENERATION + 1)


sys.modules[__name__].__class__ = _Policy

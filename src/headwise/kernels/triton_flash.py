"""FlashAttention-2 in Triton: one fused GPU kernel for padding, causal, window, GQA, ALiBi.

The algorithm is :mod:`headwise.kernels.chunked` (read that first), written as Triton
kernels so each tile lives in registers and shared memory, not in PyTorch tensors:

* forward: one program per (query block, head, batch) walks the key tiles with an online
  softmax (running max ``m``, running sum ``l``, running output ``acc``, all fp32) and
  saves the output and the log-sum-exp of every row;
* backward ``delta``: ``rowsum(dO * O)`` per row, the softmax backward's constant;
* backward ``dk, dv``: one program per (key block, kv head, batch) walks the query tiles
  of the G query heads that share that kv head, so grouped-query attention needs neither
  a copy of k/v nor atomics;
* backward ``dq``: one program per (query block, head, batch) walks the key tiles again.

What makes it headwise's and not the Triton tutorial's:

* Key padding masks in any pattern (right or left padding, holes): the mask becomes a
  float key bias ``(B|1, Sk)`` (``-inf`` = padding) and, per batch row, a sorted list of
  the key tiles holding at least one real key. The forward and ``dq`` loops walk only that
  list, so a fully padded tile is never loaded, let alone multiplied. A ``dk, dv`` program
  whose key tile is fully padded skips its query loop and writes zeros.
* Bottom-right causal alignment (query ``i`` sees key ``j <= i + Sk - S``), a sliding
  window (also ``j > i + Sk - S - window``) and ALiBi (``-slope_h * |i + Sk - S - j|``):
  the loop bounds skip tiles that are fully blocked, and only the tiles that straddle a
  boundary pay for the position mask.
* FlexAttention's ``mask_mod`` (the causal / window rule ANDed in) through a tile map at
  (128, 128) map tiles, built per call on the host (:func:`_rule_tiles`): per (b, h) and
  map row (column, for dkdv) the partial tiles, then the full ones; empty tiles are not
  listed, so never visited; full tiles run with no mask at all; only the partial tiles'
  pairs are evaluated, packed 32 to an int32 word, and loaded with their tile. Every kernel
  tile divides the map tile, so forward, dq and dkdv share one map, each walking a map tile
  as several of its own. States of size 1 in b or h broadcast (stride 0); a user's
  :class:`headwise.masks.TileMap` of the call's shape at that block is read as is. A key
  tile that is all padding is empty for its batch row. A ``score_mod`` is refused: a
  Python function cannot run in the precompiled kernel, and a bias score_mod would need
  a dense bias, where the kernel reads one bias per key.
* A row that may attend nothing gets output 0 and log-sum-exp ``+inf``, so backward's
  ``p = exp2(s - lse)`` is 0 there and no NaN appears, forward or backward.
* ``return_lse``: the saved log-sum-exp is the caller's, in natural units (``-inf`` for a
  dead row). Its gradient ``g`` needs no kernel of its own: ``d lse_i / d s_ij = p_ij``, so
  ``ds = p (dp - delta + g)`` and the delta kernel stores ``delta - g`` (nothing on a dead
  row); dq, dk, dv and the sinks' gradient then read it as before.
* Logit soft-capping: each tile's product becomes ``softcap * tanh(q k^T * scale / softcap)``
  before the bias and ALiBi; backward multiplies the scores' gradient by ``1 - tanh^2``.
  ``tanh`` is built from ``exp2`` (Triton's interpreter has no libdevice), with a short
  series near 0 so small scores keep their relative precision.
* Attention sinks: after the key tiles the head's sink logit joins the running max and
  sum as one more column with no value, so the saved log-sum-exp already includes it;
  backward's ``p`` and ``delta`` are then the sink-aware ones, and the sinks' gradient
  ``-sum over rows of delta * exp(sink - lse)`` is summed on the host.
* Scores are kept in base 2 (``qk_scale = scale * log2(e)``), as in the tutorial: one
  ``exp2`` per score. The key bias and the ALiBi slopes are converted on the host.

Inputs are fp16, bf16 (fp32 accumulation) or fp32 (IEEE matmuls unless
``torch.set_float32_matmul_precision`` allows TF32). The kernels run under
``torch.library.custom_op`` with fake implementations, so ``torch.compile`` traces around
them, and on the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` (slow; for
tests). Triton is imported on first use only: ``import headwise`` never needs it.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length,
Sk key length, D head dim, BD the power of two >= max(D, 16) that a tile spans, BM / BN
the rows / columns of one tile, T key tiles per row, MAP_M / MAP_N the rows / columns of
one map tile of a mask_mod, nq / nk the map tiles along S / Sk, P partial map tiles.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise.evaluate import MaskMod, evaluate_mask, mask_tile_states
from headwise.kernels import describe
from headwise.kernels.common import attached_zeros
from headwise.kernels.registry import Call, Kernel, KernelStage, Request
from headwise.rules import Rules
from headwise.tiles import EMPTY, FULL, PARTIAL, Bounds

if TYPE_CHECKING:  # the device code's ``tl``; at run time it lives in _compiled()'s namespace
    import triton.language as tl

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 128
_INSTALL = "pip install 'headwise[triton]'"


# --------------------------------------------------------------------------------------
# Device code. Plain functions here; _compiled() turns them into Triton kernels (or into
# the interpreter's) in a namespace of their own, on first use. ``tl`` is only a name
# inside that namespace, so these bodies are never run as Python.
# --------------------------------------------------------------------------------------


def _load_tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols,
               CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load ``base[rows, cols]`` (len(rows), len(cols)), zeros outside the bounds checked."""
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


def _store_tile(base, x, rows, cols, stride_r, stride_c, n_rows, n_cols, PRECISION: tl.constexpr):
    """Store ``x`` (len(rows), len(cols)) into ``base[rows, cols]`` in base's dtype, inside the bounds."""
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    x = _lowp(x, base.dtype.element_ty, PRECISION).to(base.dtype.element_ty)
    tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``a @ b (+ acc)`` in fp32. PRECISION is tl.dot's input precision, or "fp32-operands":
    upcast first, which is exact for bf16 values and works around Triton 3.x's interpreter
    multiplying bf16 bit patterns as integers."""
    if PRECISION == "fp32-operands":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


def _lowp(x, dtype, PRECISION: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even as GPUs do. Under "fp32-operands" (bf16 in
    the interpreter, whose fp32 -> bf16 cast truncates) the rounding is done on the bits
    and the value stays fp32, exactly a bf16 number, for :func:`_dot` to consume."""
    if PRECISION == "fp32-operands":
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def _mask_scores(s, i, j, bias, slope, Sk, offset, window,
                 MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Add the key bias and ALiBi to base-2 scores ``s``; block what the position rules forbid.

    ``i`` (query rows) and ``j`` (key columns) broadcast to ``s``'s shape, as does ``bias``.
    ``MASK_POS`` is False on tiles the loop bounds proved fully inside every rule.
    """
    if HAS_BIAS:
        s = s + bias
    if HAS_ALIBI:
        s = s - slope * tl.abs(i + offset - j).to(tl.float32)
    if MASK_POS:
        allowed = j < Sk
        if IS_CAUSAL:
            allowed = allowed & (j <= i + offset)
        if HAS_WINDOW:
            allowed = allowed & (j > i + offset - window)
        s = tl.where(allowed, s, float("-inf"))
    return s


def _key_tile_bounds(m0, S, Sk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles the query rows [m0, m0 + BM) may see, split where the position mask applies.

    Returns tile indices ``lo <= full_lo <= full_hi <= hi``: tiles in [full_lo, full_hi)
    are allowed for every row of the block and fully inside Sk (no position mask); tiles
    in [lo, full_lo) and [full_hi, hi) need it; tiles outside [lo, hi) are fully blocked.
    """
    offset = Sk - S
    lo = 0
    hi = Sk
    first_full = 0
    end_full = Sk
    if IS_CAUSAL:  # row i sees keys j <= i + offset
        hi = tl.minimum(tl.maximum(m0 + BLOCK_M + offset, 0), Sk)
        end_full = tl.minimum(tl.maximum(m0 + 1 + offset, 0), Sk)
    if HAS_WINDOW:  # ... and keys j > i + offset - window
        lo = tl.maximum(m0 + offset - window + 1, 0)
        first_full = tl.maximum(m0 + BLOCK_M + offset - window, 0)
    t_lo = lo // BLOCK_N
    t_hi = (hi + BLOCK_N - 1) // BLOCK_N
    t_full_lo = tl.minimum(tl.maximum((first_full + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(end_full // BLOCK_N, t_full_lo), t_hi)
    return t_lo, t_full_lo, t_full_hi, t_hi


def _query_tile_bounds(n0, S, Sk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query tiles that may see keys [n0, n0 + BN), split like :func:`_key_tile_bounds`."""
    offset = Sk - S
    lo = 0
    hi = S
    first_full = 0
    end_full = S
    if IS_CAUSAL:  # key j is seen by rows i >= j - offset
        lo = tl.minimum(tl.maximum(n0 - offset, 0), S)
        first_full = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - offset, 0), S)
    if HAS_WINDOW:  # ... and rows i < j - offset + window
        hi = tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - offset + window, 0), S)
        end_full = tl.minimum(tl.maximum(n0 - offset + window, 0), S)
    t_lo = lo // BLOCK_M
    t_hi = (hi + BLOCK_M - 1) // BLOCK_M
    t_full_lo = tl.minimum(tl.maximum((first_full + BLOCK_M - 1) // BLOCK_M, t_lo), t_hi)
    t_full_hi = tl.minimum(tl.maximum(end_full // BLOCK_M, t_full_lo), t_hi)
    return t_lo, t_full_lo, t_full_hi, t_hi


def _tanh(x):
    """tanh from exp2: ``(1 - e) / (1 + e)``, ``e = exp(-2|x|)``, signed; below |x| = 1/16 its
    series ``x - x^3/3 + 2x^5/15 - 17x^7/315`` (error < 1e-12), where ``1 - e`` would cancel."""
    a = tl.abs(x)
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2|x|), 2 * log2(e)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = a * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(a < 0.0625, small, big)
    return tl.where(x < 0, -t, t)


def _capped(raw, qk_scale, cap_in, cap_out, HAS_SOFTCAP: tl.constexpr):
    """Base-2 scores of a raw product ``q k^T`` and, with soft-capping, ``t = tanh(raw * scale /
    softcap)`` for backward's ``1 - t^2`` (else 0.0): ``cap_in = scale / softcap``,
    ``cap_out = softcap * log2(e)``."""
    if HAS_SOFTCAP:
        t = _tanh(raw * cap_in)
        s = t * cap_out
    else:
        t = 0.0
        s = raw * qk_scale
    return s, t


def _scores_at(q, K, Bias, slope, keep, offs_m, offs_n, offs_d, s_ks, s_kd, Sk, offset, window, qk_scale,
               cap_in, cap_out,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, USE_BITS: tl.constexpr, PRECISION: tl.constexpr):
    """The keys at ``offs_n`` (BN, BD) and their masked, scaled (and capped) scores (BM, BN),
    with the tile's tanh (0.0 without soft-capping). ``keep`` (BM, BN) is a partial tile's
    mask_mod bits (True = may attend), read only with ``USE_BITS``. Shared by forward and dq."""
    k = _load_tile(K, offs_n, offs_d, s_ks, s_kd, Sk, HEAD_D, MASK_POS, BLOCK_D != HEAD_D)  # (BN, BD)
    s, t = _capped(_dot(q, tl.trans(k), None, PRECISION), qk_scale, cap_in, cap_out, HAS_SOFTCAP)
    # (BM, BD) x (BD, BN) -> (BM, BN)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(Bias + offs_n, mask=offs_n < Sk, other=float("-inf"))[None, :]
    s = _mask_scores(s, offs_m[:, None], offs_n[None, :], bias, slope, Sk, offset, window,
                     MASK_POS, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI)
    if USE_BITS:
        s = tl.where(keep, s, float("-inf"))
    return k, s, t


def _tile_scores(q, K, Bias, Tiles, slope, offs_m, offs_d, s_ks, s_kd, pos, Sk, offset, window, qk_scale,
                 cap_in, cap_out,
                 HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 PRECISION: tl.constexpr):
    """The key tile at ``pos`` of the loop (of the live-tile list with a mask): its key
    offsets, keys (BN, BD), masked, scaled (and capped) scores (BM, BN) and the tile's tanh
    (0.0 without soft-capping). Shared by forward and dq."""
    if HAS_BIAS:
        tile = tl.load(Tiles + pos)
    else:
        tile = pos
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k, s, t = _scores_at(q, K, Bias, slope, 0, offs_m, offs_n, offs_d, s_ks, s_kd, Sk, offset, window, qk_scale,
                         cap_in, cap_out, HEAD_D, BLOCK_D, MASK_POS, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI,
                         HAS_SOFTCAP, False, PRECISION)
    return offs_n, k, s, t


def _online_softmax(acc, l_i, m_i, s, V, offs_n, offs_d, s_vs, s_vd, Sk,
                    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_POS: tl.constexpr,
                    PRECISION: tl.constexpr):
    """One key tile's scores ``s`` (BM, BN) into the running max, sum and output."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # -inf max = nothing attended yet: shift by 0 so exp2(-inf - 0) = 0, never NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)  # rescales what was summed under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, MASK_POS, BLOCK_D != HEAD_D)  # (BN, BD)
    acc = _dot(_lowp(p, v.dtype, PRECISION), v, acc * alpha[:, None], PRECISION)
    # (BM, BN) x (BN, BD) -> (BM, BD)
    return acc, l_i, m_new


def _fwd_inner(acc, l_i, m_i, q, K, V, Bias, Tiles, slope, offs_m, offs_d,
               s_ks, s_kd, s_vs, s_vd, start, end, Sk, offset, window, qk_scale, cap_in, cap_out,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               PRECISION: tl.constexpr):
    """Online softmax over key tiles ``start..end`` (positions in the live-tile list with a mask)."""
    for pos in range(start, end):
        offs_n, k, s, _ = _tile_scores(q, K, Bias, Tiles, slope, offs_m, offs_d, s_ks, s_kd, pos, Sk, offset,
                                       window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_N, MASK_POS,
                                       IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
                                       PRECISION)  # s: (BM, BN)
        acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, BLOCK_D,
                                        MASK_POS, PRECISION)
    return acc, l_i, m_i


def _tile_bits(Bits, r, c, WORDS: tl.constexpr):
    """A partial map tile's mask_mod bits at rows ``r`` x columns ``c`` (positions inside the
    map tile, broadcasting to the result's shape), True = may attend. ``Bits`` points at the
    tile's (MAP_M, WORDS) int32 words: column ``c`` is bit ``c % 32`` of word ``c // 32``."""
    words = tl.load(Bits + r * WORDS + (c >> 5))
    return ((words >> (c & 31)) & 1) != 0


def _fwd_rule(acc, l_i, m_i, q, K, V, Bias, Lists, Counts, Bits, slope, m0, offs_m, offs_d,
              s_ks, s_kd, s_vs, s_vd, s_lk, Sk, offset, qk_scale, cap_in, cap_out,
              HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              MAP_M: tl.constexpr, MAP_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the key tiles of the mask rules' tile map: this block's map row lists
    its partial map tiles (walked with their bits) and then its full ones (no mask); empty map
    tiles are not listed, so never visited. A (MAP_M, MAP_N) map tile is MAP_N // BN key tiles.

    ``Lists`` points at the row's tile columns (and, ``s_lk`` further, their bit slots),
    ``Counts`` at its (partial, full) counts.
    """
    n_part = tl.load(Counts)
    n_full = tl.load(Counts + 1)
    rows = (m0 % MAP_M + tl.arange(0, BLOCK_M))[:, None]  # (BM, 1): the block's rows inside its map tile
    for pos in range(0, n_part):
        kj = tl.load(Lists + pos)
        tile_bits = Bits + tl.load(Lists + s_lk + pos).to(tl.int64) * (MAP_M * (MAP_N // 32))
        for n0 in range(kj * MAP_N, tl.minimum(kj * MAP_N + MAP_N, Sk), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            keep = _tile_bits(tile_bits, rows, (offs_n - kj * MAP_N)[None, :], MAP_N // 32)  # (BM, BN)
            _, s, _ = _scores_at(q, K, Bias, slope, keep, offs_m, offs_n, offs_d, s_ks, s_kd, Sk, offset, 0,
                                 qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, True, False, False, HAS_BIAS,
                                 HAS_ALIBI, HAS_SOFTCAP, True, PRECISION)  # s: (BM, BN)
            acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, BLOCK_D,
                                            True, PRECISION)
    for pos in range(n_part, n_part + n_full):  # a full map tile lies inside Sk: no bounds checks
        kj = tl.load(Lists + pos)
        for n0 in range(kj * MAP_N, kj * MAP_N + MAP_N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            _, s, _ = _scores_at(q, K, Bias, slope, 0, offs_m, offs_n, offs_d, s_ks, s_kd, Sk, offset, 0,
                                 qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, False, False, False, HAS_BIAS,
                                 HAS_ALIBI, HAS_SOFTCAP, False, PRECISION)  # s: (BM, BN)
            acc, l_i, m_i = _online_softmax(acc, l_i, m_i, s, V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, BLOCK_D,
                                            False, PRECISION)
    return acc, l_i, m_i


def _fwd_kernel(Q, K, V, Out, Lse, Bias, Tiles, Cum, Slopes, Sinks, Lists, Counts, Bits,
                s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                s_ob, s_oh, s_os, s_od, s_biasb, s_tb, s_cb, s_lk, s_lb, s_lh, s_lo, s_nb, s_nh, s_no,
                G, S, Sk, qk_scale, window, cap_in, cap_out,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr,
                HAS_RULE: tl.constexpr, MAP_M: tl.constexpr, MAP_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    H = tl.num_programs(1)
    hk = (h // G).to(tl.int64)  # query head h reads kv head h // G
    offset = Sk - S
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * s_qb + h.to(tl.int64) * s_qh, offs_m, offs_d, s_qs, s_qd, S, HEAD_D,
                   True, BLOCK_D != HEAD_D)  # (BM, BD)
    K = K + b * s_kb + hk * s_kh
    V = V + b * s_vb + hk * s_vh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_RULE:  # the mask rules' tile map (causal / window folded in, padded tiles empty)
        if HAS_BIAS:
            Bias = Bias + b * s_biasb
        qi = m0 // MAP_M  # this block's row of map tiles
        acc, l_i, m_i = _fwd_rule(acc, l_i, m_i, q, K, V, Bias, Lists + b * s_lb + h * s_lh + qi * s_lo,
                                  Counts + b * s_nb + h * s_nh + qi * s_no, Bits, slope, m0, offs_m, offs_d,
                                  s_ks, s_kd, s_vs, s_vd, s_lk, Sk, offset, qk_scale, cap_in, cap_out, HEAD_D,
                                  BLOCK_D, BLOCK_M, BLOCK_N, MAP_M, MAP_N, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
                                  PRECISION)
    else:
        t_lo, t_full_lo, t_full_hi, t_hi = _key_tile_bounds(m0, S, Sk, window, BLOCK_M, BLOCK_N,
                                                            IS_CAUSAL, HAS_WINDOW)
        if HAS_BIAS:  # walk only the live tiles: positions in this row's sorted list
            Bias = Bias + b * s_biasb
            Tiles = Tiles + b * s_tb
            Cum = Cum + b * s_cb
            t_lo, t_full_lo = tl.load(Cum + t_lo), tl.load(Cum + t_full_lo)
            t_full_hi, t_hi = tl.load(Cum + t_full_hi), tl.load(Cum + t_hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, Bias, Tiles, slope, offs_m, offs_d,
                                   s_ks, s_kd, s_vs, s_vd, t_lo, t_full_lo, Sk, offset, window, qk_scale,
                                   cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW,
                                   HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, Bias, Tiles, slope, offs_m, offs_d,
                                   s_ks, s_kd, s_vs, s_vd, t_full_lo, t_full_hi, Sk, offset, window,
                                   qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_N, False, IS_CAUSAL,
                                   HAS_WINDOW, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, Bias, Tiles, slope, offs_m, offs_d,
                                   s_ks, s_kd, s_vs, s_vd, t_full_hi, t_hi, Sk, offset, window, qk_scale,
                                   cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_N, True, IS_CAUSAL, HAS_WINDOW,
                                   HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
    if HAS_SINKS:  # the sink: one more column of the softmax (base 2), with no value
        sink = tl.load(Sinks + h)
        m_new = tl.maximum(m_i, sink)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.math.exp2(sink - m_shift)
        acc = acc * alpha[:, None]
        m_i = m_new
    dead = l_i == 0.0  # rows that may attend nothing: output 0, lse +inf (backward's p = 0)
    l_safe = tl.where(dead, 1.0, l_i)
    out = acc / l_safe[:, None]
    _store_tile(Out + b * s_ob + h.to(tl.int64) * s_oh, out, offs_m, offs_d, s_os, s_od, S, HEAD_D, PRECISION)
    lse = tl.where(dead, float("inf"), m_i + tl.math.log2(l_safe))
    tl.store(Lse + (b * H + h) * S + offs_m, lse, mask=offs_m < S)


def _bwd_delta_kernel(Out, DO, Delta, Lse, DLse, s_ob, s_oh, s_os, s_od, s_dob, s_doh, s_dos, s_dod, S,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      HAS_DLSE: tl.constexpr):
    """delta = rowsum(dO * O) (B, H, S) fp32: the softmax backward's per-row constant.

    With ``HAS_DLSE`` the gradient of the base-2 log-sum-exp ``Lse`` joins it: d lse / d s_ij
    = log2(e) p_ij per natural-unit score, so ``ds = p (dp - delta + log2(e) dlse)`` and
    delta takes ``- log2(e) dlse``; a dead row (lse ``+inf``) takes nothing."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    H = tl.num_programs(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_tile(Out + b * s_ob + h * s_oh, offs_m, offs_d, s_os, s_od, S, HEAD_D, True, BLOCK_D != HEAD_D)
    do = _load_tile(DO + b * s_dob + h * s_doh, offs_m, offs_d, s_dos, s_dod, S, HEAD_D, True,
                    BLOCK_D != HEAD_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # (BM, BD) -> (BM,)
    if HAS_DLSE:
        lse = tl.load(Lse + (b * H + h) * S + offs_m, mask=offs_m < S, other=float("inf"))
        dlse = tl.load(DLse + (b * H + h) * S + offs_m, mask=offs_m < S, other=0.0)
        delta -= tl.where(lse == float("inf"), 0.0, dlse * 1.4426950408889634)  # log2(e)
    tl.store(Delta + (b * H + h) * S + offs_m, delta, mask=offs_m < S)


def _dkdv_step(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, keep_t, offs_m, offs_n, offs_d,
               s_qs, s_qd, s_dos, s_dod, S, Sk, offset, window, qk_scale, cap_in, cap_out,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_GRAD: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, USE_BITS: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dk, dv (and the key bias gradient) of one key tile over the query tile at ``offs_m``.

    Works on transposed tiles (BN, BM) so that dk and dv come out as (BN, BD) directly.
    Rows past S load as zeros with lse = +inf, so their p (and everything after) is 0.
    ``keep_t`` (BN, BM) is a partial map tile's mask_mod bits, read only with ``USE_BITS``.
    """
    q = _load_tile(Q, offs_m, offs_d, s_qs, s_qd, S, HEAD_D, True, BLOCK_D != HEAD_D)  # (BM, BD)
    do = _load_tile(DO, offs_m, offs_d, s_dos, s_dod, S, HEAD_D, True, BLOCK_D != HEAD_D)  # (BM, BD)
    lse = tl.load(Lse + offs_m, mask=offs_m < S, other=float("inf"))  # (BM,)
    delta = tl.load(Delta + offs_m, mask=offs_m < S, other=0.0)  # (BM,)
    s_t, t_t = _capped(_dot(k, tl.trans(q), None, PRECISION), qk_scale, cap_in, cap_out, HAS_SOFTCAP)
    # (BN, BD) x (BD, BM) -> (BN, BM)
    s_t = _mask_scores(s_t, offs_m[None, :], offs_n[:, None], bias, slope, Sk, offset, window,
                       MASK_POS, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI)
    if USE_BITS:
        s_t = tl.where(keep_t, s_t, float("-inf"))
    p_t = tl.math.exp2(s_t - lse[None, :])  # (BN, BM)
    dv = _dot(_lowp(p_t, do.dtype, PRECISION), do, dv, PRECISION)
    # (BN, BM) x (BM, BD) -> (BN, BD)
    dp_t = _dot(v, tl.trans(do), None, PRECISION)
    # (BN, BD) x (BD, BM) -> (BN, BM)
    ds_t = p_t * (dp_t - delta[None, :])  # (BN, BM): dL/d(scaled score + bias)
    if BIAS_GRAD:
        dbias += tl.sum(ds_t, 1)
    if HAS_SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)  # through softcap * tanh(x / softcap): dL/d(scaled score)
    dk = _dot(_lowp(ds_t, q.dtype, PRECISION), q, dk, PRECISION)
    # (BN, BM) x (BM, BD) -> (BN, BD)
    return dk, dv, dbias


def _dkdv_inner(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, offs_n, offs_d,
                s_qs, s_qd, s_dos, s_dod, start, end, S, Sk, offset, window, qk_scale, cap_in, cap_out,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_GRAD: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dk, dv (and the key bias gradient) of one key tile over query tiles start..end."""
    for t in range(start, end):
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        dk, dv, dbias = _dkdv_step(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, 0, offs_m, offs_n, offs_d,
                                   s_qs, s_qd, s_dos, s_dod, S, Sk, offset, window, qk_scale, cap_in, cap_out,
                                   HEAD_D, BLOCK_D, MASK_POS, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI,
                                   BIAS_GRAD, HAS_SOFTCAP, False, PRECISION)
    return dk, dv, dbias


def _dkdv_rule(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, padded, Lists, Counts, Bits, n0, offs_n, offs_d,
               s_qs, s_qd, s_dos, s_dod, s_lk, S, Sk, offset, qk_scale, cap_in, cap_out,
               HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               MAP_M: tl.constexpr, MAP_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
               BIAS_GRAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """dk, dv over the query tiles of the tile map's column: its partial map tiles (with their
    bits), then its full ones; :func:`_fwd_rule` transposed. ``Lists`` / ``Counts`` point at
    the column's map rows and their (partial, full) counts; a key tile that is all padding
    (``padded``) visits none."""
    n_part = tl.load(Counts)
    n_full = tl.load(Counts + 1)
    if HAS_BIAS:
        n_part = tl.where(padded, 0, n_part)
        n_full = tl.where(padded, 0, n_full)
    cols = (n0 % MAP_N + tl.arange(0, BLOCK_N))[:, None]  # (BN, 1): the program's keys inside its map tile
    for pos in range(0, n_part):
        qi = tl.load(Lists + pos)
        tile_bits = Bits + tl.load(Lists + s_lk + pos).to(tl.int64) * (MAP_M * (MAP_N // 32))
        for m0 in range(qi * MAP_M, tl.minimum(qi * MAP_M + MAP_M, S), BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            keep_t = _tile_bits(tile_bits, (offs_m - qi * MAP_M)[None, :], cols, MAP_N // 32)  # (BN, BM)
            dk, dv, dbias = _dkdv_step(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, keep_t, offs_m, offs_n,
                                       offs_d, s_qs, s_qd, s_dos, s_dod, S, Sk, offset, 0, qk_scale, cap_in,
                                       cap_out, HEAD_D, BLOCK_D, True, False, False, HAS_BIAS, HAS_ALIBI,
                                       BIAS_GRAD, HAS_SOFTCAP, True, PRECISION)
    for pos in range(n_part, n_part + n_full):  # a full map tile lies inside Sk: no key bounds checks
        qi = tl.load(Lists + pos)
        for m0 in range(qi * MAP_M, tl.minimum(qi * MAP_M + MAP_M, S), BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            dk, dv, dbias = _dkdv_step(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, 0, offs_m, offs_n,
                                       offs_d, s_qs, s_qd, s_dos, s_dod, S, Sk, offset, 0, qk_scale, cap_in,
                                       cap_out, HEAD_D, BLOCK_D, False, False, False, HAS_BIAS, HAS_ALIBI,
                                       BIAS_GRAD, HAS_SOFTCAP, False, PRECISION)
    return dk, dv, dbias


def _bwd_dkdv_kernel(Q, K, V, DO, Lse, Delta, DK, DV, DBias, Bias, Slopes, Lists, Counts, Bits,
                     s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                     s_dob, s_doh, s_dos, s_dod, s_dkb, s_dkh, s_dks, s_dkd,
                     s_dvb, s_dvh, s_dvs, s_dvd, s_biasb, s_lk, s_lb, s_lh, s_lo, s_nb, s_nh, s_no,
                     G, S, Sk, qk_scale, scale, window, cap_in, cap_out,
                     HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_GRAD: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                     HAS_RULE: tl.constexpr, MAP_M: tl.constexpr, MAP_N: tl.constexpr):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    Hkv = tl.num_programs(1)
    H = Hkv * G
    offset = Sk - S
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    hk64 = hk.to(tl.int64)
    k = _load_tile(K + b * s_kb + hk64 * s_kh, offs_n, offs_d, s_ks, s_kd, Sk, HEAD_D, True,
                   BLOCK_D != HEAD_D)  # (BN, BD)
    v = _load_tile(V + b * s_vb + hk64 * s_vh, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, True,
                   BLOCK_D != HEAD_D)  # (BN, BD)
    t_lo, t_full_lo, t_full_hi, t_hi = _query_tile_bounds(n0, S, Sk, window, BLOCK_M, BLOCK_N,
                                                          IS_CAUSAL, HAS_WINDOW)
    bias = 0.0
    padded = False
    if HAS_BIAS:
        bias_n = tl.load(Bias + b * s_biasb + offs_n, mask=offs_n < Sk, other=float("-inf"))
        padded = tl.max(bias_n, 0) == float("-inf")  # the whole key tile is padding
        t_full_lo = tl.where(padded, t_lo, t_full_lo)
        t_full_hi = tl.where(padded, t_lo, t_full_hi)
        t_hi = tl.where(padded, t_lo, t_hi)
        bias = bias_n[:, None]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dbias = tl.zeros([BLOCK_N], tl.float32)
    for g in range(G):  # the query heads that read this kv head
        h = hk64 * G + g
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + h)
        Qh = Q + b * s_qb + h * s_qh
        DOh = DO + b * s_dob + h * s_doh
        Lse_h = Lse + (b * H + h) * S
        Delta_h = Delta + (b * H + h) * S
        if HAS_RULE:  # the tile map's column of this key tile (causal / window folded in)
            kj = n0 // MAP_N
            dk, dv, dbias = _dkdv_rule(dk, dv, dbias, k, v, Qh, DOh, Lse_h, Delta_h, bias, slope, padded,
                                       Lists + b * s_lb + h * s_lh + kj * s_lo,
                                       Counts + b * s_nb + h * s_nh + kj * s_no, Bits, n0, offs_n, offs_d, s_qs,
                                       s_qd, s_dos, s_dod, s_lk, S, Sk, offset,
                                       qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, MAP_M, MAP_N,
                                       HAS_BIAS, HAS_ALIBI, BIAS_GRAD, HAS_SOFTCAP, PRECISION)
        else:
            dk, dv, dbias = _dkdv_inner(dk, dv, dbias, k, v, Qh, DOh, Lse_h, Delta_h, bias, slope, offs_n,
                                        offs_d, s_qs, s_qd, s_dos, s_dod, t_lo, t_full_lo, S, Sk, offset,
                                        window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_M, True,
                                        IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, BIAS_GRAD, HAS_SOFTCAP,
                                        PRECISION)
            dk, dv, dbias = _dkdv_inner(dk, dv, dbias, k, v, Qh, DOh, Lse_h, Delta_h, bias, slope, offs_n,
                                        offs_d, s_qs, s_qd, s_dos, s_dod, t_full_lo, t_full_hi, S, Sk,
                                        offset, window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_M,
                                        False, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, BIAS_GRAD,
                                        HAS_SOFTCAP, PRECISION)
            dk, dv, dbias = _dkdv_inner(dk, dv, dbias, k, v, Qh, DOh, Lse_h, Delta_h, bias, slope, offs_n,
                                        offs_d, s_qs, s_qd, s_dos, s_dod, t_full_hi, t_hi, S, Sk, offset,
                                        window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_M, True,
                                        IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, BIAS_GRAD, HAS_SOFTCAP,
                                        PRECISION)
    _store_tile(DK + b * s_dkb + hk64 * s_dkh, dk * scale, offs_n, offs_d, s_dks, s_dkd, Sk, HEAD_D, PRECISION)
    _store_tile(DV + b * s_dvb + hk64 * s_dvh, dv, offs_n, offs_d, s_dvs, s_dvd, Sk, HEAD_D, PRECISION)
    if BIAS_GRAD:  # (B, Hkv, Sk) partial sums; the host adds the kv heads
        tl.store(DBias + (b * Hkv + hk) * Sk + offs_n, dbias, mask=offs_n < Sk)


def _dq_step(dq, s, t, k, do, lse, delta, V, offs_n, offs_d, s_vs, s_vd, Sk,
             HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MASK_POS: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dq over one key tile: its masked scores ``s`` (BM, BN), tanh ``t`` and keys ``k``."""
    v = _load_tile(V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, MASK_POS, BLOCK_D != HEAD_D)  # (BN, BD)
    p = tl.math.exp2(s - lse[:, None])  # (BM, BN)
    dp = _dot(do, tl.trans(v), None, PRECISION)
    # (BM, BD) x (BD, BN) -> (BM, BN)
    ds = p * (dp - delta[:, None])  # (BM, BN)
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)  # through softcap * tanh(x / softcap)
    dq = _dot(_lowp(ds, k.dtype, PRECISION), k, dq, PRECISION)
    # (BM, BN) x (BN, BD) -> (BM, BD)
    return dq


def _dq_inner(dq, q, do, lse, delta, K, V, Bias, Tiles, slope, offs_m, offs_d,
              s_ks, s_kd, s_vs, s_vd, start, end, Sk, offset, window, qk_scale, cap_in, cap_out,
              HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              PRECISION: tl.constexpr):
    for pos in range(start, end):
        offs_n, k, s, t = _tile_scores(q, K, Bias, Tiles, slope, offs_m, offs_d, s_ks, s_kd, pos, Sk, offset,
                                       window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_N, MASK_POS,
                                       IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
                                       PRECISION)  # s: (BM, BN)
        dq = _dq_step(dq, s, t, k, do, lse, delta, V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, BLOCK_D, MASK_POS,
                      HAS_SOFTCAP, PRECISION)
    return dq


def _dq_rule(dq, q, do, lse, delta, K, V, Bias, Lists, Counts, Bits, slope, m0, offs_m, offs_d,
             s_ks, s_kd, s_vs, s_vd, s_lk, Sk, offset, qk_scale, cap_in, cap_out,
             HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             MAP_M: tl.constexpr, MAP_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
             HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """dq over the key tiles of the tile map's row, as :func:`_fwd_rule` walks them."""
    n_part = tl.load(Counts)
    n_full = tl.load(Counts + 1)
    rows = (m0 % MAP_M + tl.arange(0, BLOCK_M))[:, None]  # (BM, 1): the block's rows inside its map tile
    for pos in range(0, n_part):
        kj = tl.load(Lists + pos)
        tile_bits = Bits + tl.load(Lists + s_lk + pos).to(tl.int64) * (MAP_M * (MAP_N // 32))
        for n0 in range(kj * MAP_N, tl.minimum(kj * MAP_N + MAP_N, Sk), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            keep = _tile_bits(tile_bits, rows, (offs_n - kj * MAP_N)[None, :], MAP_N // 32)  # (BM, BN)
            k, s, t = _scores_at(q, K, Bias, slope, keep, offs_m, offs_n, offs_d, s_ks, s_kd, Sk, offset, 0,
                                 qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, True, False, False, HAS_BIAS,
                                 HAS_ALIBI, HAS_SOFTCAP, True, PRECISION)  # s: (BM, BN)
            dq = _dq_step(dq, s, t, k, do, lse, delta, V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, BLOCK_D, True,
                          HAS_SOFTCAP, PRECISION)
    for pos in range(n_part, n_part + n_full):  # a full map tile lies inside Sk: no bounds checks
        kj = tl.load(Lists + pos)
        for n0 in range(kj * MAP_N, kj * MAP_N + MAP_N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, s, t = _scores_at(q, K, Bias, slope, 0, offs_m, offs_n, offs_d, s_ks, s_kd, Sk, offset, 0,
                                 qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, False, False, False, HAS_BIAS,
                                 HAS_ALIBI, HAS_SOFTCAP, False, PRECISION)  # s: (BM, BN)
            dq = _dq_step(dq, s, t, k, do, lse, delta, V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, BLOCK_D, False,
                          HAS_SOFTCAP, PRECISION)
    return dq


def _bwd_dq_kernel(Q, K, V, DO, Lse, Delta, DQ, Bias, Tiles, Cum, Slopes, Lists, Counts, Bits,
                   s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                   s_dob, s_doh, s_dos, s_dod, s_dqb, s_dqh, s_dqs, s_dqd, s_biasb, s_tb, s_cb,
                   s_lk, s_lb, s_lh, s_lo, s_nb, s_nh, s_no,
                   G, S, Sk, qk_scale, scale, window, cap_in, cap_out,
                   HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   PRECISION: tl.constexpr, HAS_RULE: tl.constexpr, MAP_M: tl.constexpr, MAP_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    H = tl.num_programs(1)
    h64 = h.to(tl.int64)
    hk = (h // G).to(tl.int64)
    offset = Sk - S
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * s_qb + h64 * s_qh, offs_m, offs_d, s_qs, s_qd, S, HEAD_D, True, BLOCK_D != HEAD_D)
    do = _load_tile(DO + b * s_dob + h64 * s_doh, offs_m, offs_d, s_dos, s_dod, S, HEAD_D, True,
                    BLOCK_D != HEAD_D)  # (BM, BD)
    lse = tl.load(Lse + (b * H + h) * S + offs_m, mask=offs_m < S, other=float("inf"))
    delta = tl.load(Delta + (b * H + h) * S + offs_m, mask=offs_m < S, other=0.0)
    K = K + b * s_kb + hk * s_kh
    V = V + b * s_vb + hk * s_vh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + h)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_RULE:  # the tile map's row of this query block (causal / window folded in)
        if HAS_BIAS:
            Bias = Bias + b * s_biasb
        qi = m0 // MAP_M
        dq = _dq_rule(dq, q, do, lse, delta, K, V, Bias, Lists + b * s_lb + h * s_lh + qi * s_lo,
                      Counts + b * s_nb + h * s_nh + qi * s_no, Bits, slope, m0, offs_m, offs_d, s_ks, s_kd, s_vs,
                      s_vd, s_lk, Sk, offset, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D, BLOCK_M, BLOCK_N, MAP_M,
                      MAP_N, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
    else:
        t_lo, t_full_lo, t_full_hi, t_hi = _key_tile_bounds(m0, S, Sk, window, BLOCK_M, BLOCK_N,
                                                            IS_CAUSAL, HAS_WINDOW)
        if HAS_BIAS:
            Bias = Bias + b * s_biasb
            Tiles = Tiles + b * s_tb
            Cum = Cum + b * s_cb
            t_lo, t_full_lo = tl.load(Cum + t_lo), tl.load(Cum + t_full_lo)
            t_full_hi, t_hi = tl.load(Cum + t_full_hi), tl.load(Cum + t_hi)
        dq = _dq_inner(dq, q, do, lse, delta, K, V, Bias, Tiles, slope, offs_m, offs_d, s_ks, s_kd, s_vs,
                       s_vd, t_lo, t_full_lo, Sk, offset, window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D,
                       BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
        dq = _dq_inner(dq, q, do, lse, delta, K, V, Bias, Tiles, slope, offs_m, offs_d, s_ks, s_kd, s_vs,
                       s_vd, t_full_lo, t_full_hi, Sk, offset, window, qk_scale, cap_in, cap_out, HEAD_D,
                       BLOCK_D, BLOCK_N, False, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
        dq = _dq_inner(dq, q, do, lse, delta, K, V, Bias, Tiles, slope, offs_m, offs_d, s_ks, s_kd, s_vs,
                       s_vd, t_full_hi, t_hi, Sk, offset, window, qk_scale, cap_in, cap_out, HEAD_D, BLOCK_D,
                       BLOCK_N, True, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, PRECISION)
    _store_tile(DQ + b * s_dqb + h64 * s_dqh, dq * scale, offs_m, offs_d, s_dqs, s_dqd, S, HEAD_D, PRECISION)


_DEVICE_CODE = (_load_tile, _store_tile, _dot, _lowp, _mask_scores, _key_tile_bounds, _query_tile_bounds,
                _tanh, _capped, _scores_at, _tile_scores, _online_softmax, _tile_bits,
                _fwd_inner, _fwd_rule, _fwd_kernel, _bwd_delta_kernel, _dkdv_step, _dkdv_inner, _dkdv_rule,
                _bwd_dkdv_kernel, _dq_step, _dq_inner, _dq_rule, _bwd_dq_kernel)


# --------------------------------------------------------------------------------------
# Host side: availability, compilation, tile sizes, launches.
# --------------------------------------------------------------------------------------


def _interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read on each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _interpreted(device: torch.device) -> bool:
    """CPU tensors can only go through Triton's interpreter; GPU tensors get compiled kernels."""
    return device.type == "cpu"


# Looked up once, at import: a find_spec walks sys.path (tens of microseconds), and dispatch
# asks on every new request shape (each decoding step is one). A constant, not a list filled
# on the first look-up: torch.compile traces this (dispatch runs inside the graph) and guards
# on what it reads, so a list that fills after the first compiled call recompiled the second.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _triton_installed() -> bool:
    return _TRITON_INSTALLED


def _available() -> str | None:
    if not _triton_installed():
        return f"triton is not installed ({_INSTALL})"
    if _interpreting() or torch.cuda.is_available():
        return None
    return ("needs a CUDA GPU; none is visible (set TRITON_INTERPRET=1 to run Triton's CPU "
            "interpreter, slowly, e.g. for tests)")


def _refuses(r: Request) -> str | None:
    if r.device.type != "cuda" and not (r.device.type == "cpu" and _interpreting()):
        return (f"runs on CUDA tensors, got device {str(r.device)!r}; move q, k, v to a GPU "
                "(or set TRITON_INTERPRET=1 to run CPU tensors through Triton's interpreter)")
    if r.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return (f"supports float16, bfloat16 and float32, got {r.dtype}; cast q, k, v or use "
                "backend 'chunked'")
    if r.device.type == "cuda" and r.dtype == torch.bfloat16:
        major, minor = torch.cuda.get_device_capability(r.device)
        if major < 8:
            return (f"bfloat16 needs compute capability >= 8.0, this GPU has {major}.{minor}; "
                    "use float16")
    if r.head_dim > MAX_HEAD_DIM:
        return f"supports head_dim <= {MAX_HEAD_DIM}, got {r.head_dim}; use backend 'sdpa' or 'chunked'"
    if r.mask_kind != "none" and not r.key_padding_only:
        return (f"takes key padding masks (B|1, 1, 1, Sk) only, got a mask of shape {r.mask_shape}; "
                "use backend 'sdpa' or 'chunked' for per-query or per-head masks")
    if r.dropout_p > 0:
        return f"has no dropout (dropout_p={r.dropout_p}); use backend 'sdpa' or 'chunked'"
    if r.own_value_dim:
        return (f"loads q, k and v tiles with one head-dim block (BLOCK_D), so v's head dim must be q's: got "
                f"Dv = {r.value_dim} != D = {r.head_dim}; use backend 'sdpa' or 'chunked'")
    if r.sink_tokens:
        return (f"skips key tiles by the window alone and has no sink tokens (sink_tokens={r.sink_tokens}); "
                "use backend 'sdpa' or 'chunked'")
    if r.score_mod == "additive":
        grad = " and its table's gradient" if r.score_mod_grad else ""
        return ("takes no dense score bias, only a key padding mask (one bias per key), so an additive score_mod "
                f"(a bias of b, h, q_idx and kv_idx) cannot reach its scores{grad}; use backend 'sdpa' (the bias "
                "as a float mask) or 'chunked'")
    if r.score_mod:
        grad = ", nor its gradient" if r.score_mod_grad else ""
        return ("runs one precompiled kernel, inside which a Python score_mod cannot run"
                f"{grad}; use backend 'chunked' (any score_mod, a block of rows at a time under autograd)")
    return None


@functools.cache
def _compiled(interpret: bool) -> types.SimpleNamespace:
    """The device code as Triton kernels (``interpret``: as the CPU interpreter's functions).

    Each mode gets its own namespace, so the helpers the kernels call resolve to kernels of
    the same mode and nothing is written into this module's globals.
    """
    import triton
    import triton.language as tl

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction as jit
    else:
        jit = triton.jit
    ns: dict = {"tl": tl, "triton": triton}
    for fn in _DEVICE_CODE:
        clone = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
        # The annotations are strings (postponed evaluation); older Triton interpreters
        # recognise only the tl.constexpr object itself.
        clone.__annotations__ = {name: tl.constexpr if hint == "tl.constexpr" else hint
                                 for name, hint in fn.__annotations__.items()}
        clone.__module__, clone.__qualname__, clone.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
        ns[fn.__name__] = jit(clone)
    return types.SimpleNamespace(**{fn.__name__: ns[fn.__name__] for fn in _DEVICE_CODE})


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
_FAILED: set[tuple] = set()  # (kernel, config, specialisation) that ran out of GPU resources


def _configs(kind: str, head_dim: int, dtype: torch.dtype, interpret: bool) -> tuple[TileConfig, ...]:
    if interpret:
        return (INTERPRET_CONFIG,)
    table = (GPU_FP32_CONFIGS if dtype == torch.float32 else GPU_CONFIGS)[kind]
    return table[min(bound for bound in table if bound >= head_dim)]


def _launch(kind: str, head_dim: int, dtype: torch.dtype, interpret: bool, key: tuple, run) -> None:
    """Call ``run(config)`` with the first config of ``kind`` that fits the GPU.

    A config that raises Triton's OutOfResources (shared memory or registers) is
    remembered for this specialisation ``key`` and skipped from then on.
    """
    configs = _configs(kind, head_dim, dtype, interpret)
    if interpret:
        run(configs[0])
        return
    from triton.runtime.errors import OutOfResources

    errors = []
    for config in configs:
        if (kind, config, key) in _FAILED:
            continue
        try:
            run(config)
            return
        except OutOfResources as e:
            _FAILED.add((kind, config, key))
            errors.append(f"{config}: {e}")
    raise RuntimeError(f"no tile config of the triton {kind} kernel fits this GPU: {'; '.join(errors)}")


def _block_d(head_dim: int) -> int:
    """A tile's head-dim extent: a power of two, at least tl.dot's minimum of 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def _precision(dtype: torch.dtype, interpret: bool) -> str:
    """:func:`_dot`'s precision: IEEE fp32 unless torch's own setting allows TF32."""
    if dtype == torch.bfloat16 and interpret:
        return "fp32-operands"
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored for fp16 / bf16 inputs


def _live_key_tiles(key_bias: Tensor, block_n: int) -> tuple[Tensor, Tensor]:
    """Per batch row, the key tiles that hold a real key, for the kernels to walk.

    Args:
        key_bias: (B|1, Sk) fp32, ``-inf`` at padding.
        block_n: keys per tile.

    Returns:
        ``tiles`` (B|1, T) int32: the live tiles' indices in ascending order, then the
        dead ones; ``cum`` (B|1, T + 1) int32: ``cum[t]`` live tiles before tile ``t``, so
        the live tiles of [t0, t1) sit at positions [cum[t0], cum[t1]) of ``tiles``.
        Computed on the device: no synchronisation with the host.
    """
    Bb, Sk = key_bias.shape
    T = -(-Sk // block_n)
    live = F.pad(key_bias > float("-inf"), (0, T * block_n - Sk), value=False)  # (B|1, T*BN)
    live = live.reshape(Bb, T, block_n).any(-1)  # (B|1, T)
    tiles = torch.argsort((~live).to(torch.uint8), dim=-1, stable=True).to(torch.int32)  # (B|1, T)
    cum = F.pad(live.to(torch.int32).cumsum(-1), (1, 0)).to(torch.int32)  # (B|1, T + 1)
    return tiles, cum


def _rule_block(interpret: bool) -> tuple[int, int]:
    return INTERPRET_RULE_BLOCK if interpret else RULE_BLOCK


# Pairs a mask_mod is evaluated on at once while the partial tiles' bits are built: bounds
# the memory of one evaluation to a few tens of MiB (the bool result and its index tensors).
_BITS_EVAL_PAIRS = 1 << 24


def _partial_bits(rule: MaskMod, states: Tensor, B: int, H: int, S: int, Sk: int,
                  block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """The mask_mod's pairs on the partial tiles only.

    ``rule`` is evaluated (the call's contract: ``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), index
    ranges) a row of map tiles at a time, on the span of key tiles that holds the row's partial
    tiles, in pieces of at most ``_BITS_EVAL_PAIRS`` pairs; rows and spans without a partial
    tile are never evaluated.

    Args:
        rule: the mask rules as one mask_mod.
        states: int8 (B|1, H|1, nq, nk) tile states of ``rule`` at ``block``.
        B, H, S, Sk: the call's sizes.
        block: (bq, bk), the map tile.

    Returns:
        ``slots`` int32 (B|1, H|1, nq, nk): each partial tile's index into ``bits``, -1 for the
        others; ``bits`` bool (P, bq, bk), True = may attend (pairs past S or Sk False).
    """
    bq, bk = block
    device = states.device
    partial = states == PARTIAL  # (B|1, H|1, nq, nk)
    P = int(partial.sum())
    slots = torch.full(states.shape, -1, dtype=torch.int32, device=device)
    slots[partial] = torch.arange(P, dtype=torch.int32, device=device)
    bits = torch.zeros(P, bq, bk, dtype=torch.bool, device=device)
    if P == 0:
        return slots, bits
    cols = torch.arange(states.shape[-1], device=device)
    in_row = partial.any(dim=(0, 1))  # (nq, nk): some (b, h) has this tile partial
    first = torch.where(in_row, cols, states.shape[-1]).amin(-1).tolist()  # (nq,) first partial column
    last = torch.where(in_row, cols, -1).amax(-1).tolist()  # (nq,) last partial column
    step = max(1, _BITS_EVAL_PAIRS // (B * H * bq * bk))  # tile columns per evaluation
    for qi, (lo, hi) in enumerate(zip(first, last, strict=True)):
        i0, i1 = qi * bq, min(qi * bq + bq, S)
        for c0 in range(lo, hi + 1, step):
            c1 = min(c0 + step, hi + 1)  # tile columns [c0, c1)
            index = partial[:, :, qi, c0:c1].nonzero()  # (p, 3): b, h, tile column - c0
            if index.shape[0] == 0:
                continue
            j0, j1 = c0 * bk, min(c1 * bk, Sk)
            allowed = evaluate_mask(rule, B, H, (i0, i1), (j0, j1), device)  # (B|1, H|1, rows|1, cols|1)
            b1, h1 = allowed.shape[:2]
            tiles = torch.zeros(b1, h1, bq, (c1 - c0) * bk, dtype=torch.bool, device=device)
            tiles[:, :, :i1 - i0, :j1 - j0] = allowed
            tiles = tiles.reshape(b1, h1, bq, c1 - c0, bk).transpose(2, 3)  # (b1, h1, c1 - c0, bq, bk)
            b, h, c = index.unbind(-1)
            at = slots[b, h, qi, c0 + c].long()  # (p,)
            bits[at] = tiles[b.clamp(max=b1 - 1), h.clamp(max=h1 - 1), c]  # (p, bq, bk)
    return slots, bits


def _pack_bits(bits: Tensor) -> Tensor:
    """Bits (P, bq, bk) bool, bk a multiple of 32, as int32 words (max(P, 1), bq, bk // 32):
    column ``c`` is bit ``c % 32`` of word ``c // 32`` (one slot of zeros when P = 0, so
    the kernel always gets a real pointer)."""
    P, bq, bk = bits.shape
    if P == 0:
        return torch.zeros(1, bq, bk // 32, dtype=torch.int32, device=bits.device)
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device)
    words = (bits.reshape(P, bq, bk // 32, 32).to(torch.int64) * weights).sum(-1)  # (P, bq, bk // 32) in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def _tile_lists(states: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Per (b, h) and map row, what the kernels walk: the partial tiles, then the full ones.

    Args:
        states: int8 (B|1, H|1, n_outer, n_inner): the tile map, rows outer (forward, dq) or
            columns outer (dkdv, the map transposed).
        slots: int32 (B|1 or more, H|1, n_outer, n_inner), each partial tile's bits slot.

    Returns:
        ``lists`` int32 (2, B|1, H|1, n_outer, n_inner): ``lists[0]`` the tiles' inner indices,
        partial ones first, then full, then empty (ascending within each); ``lists[1]`` their
        bits slots. ``counts`` int32 (B|1, H|1, n_outer, 2): (partial, full) tiles per row.
    """
    rank = torch.tensor([2, 0, 1], device=states.device)[states.long()]  # EMPTY 2, PARTIAL 0, FULL 1
    order = torch.argsort(rank, dim=-1, stable=True)  # (B|1, H|1, n_outer, n_inner)
    slot = slots.expand(states.shape).gather(-1, order)
    lists = torch.stack((order.to(torch.int32), slot)).contiguous()
    counts = torch.stack(((states == PARTIAL).sum(-1), (states == FULL).sum(-1)), dim=-1).to(torch.int32)
    return lists, counts.contiguous()


def _rule_tiles(rule: MaskMod, key_bias: Tensor | None, B: int, H: int, S: int, Sk: int,
                block: tuple[int, int], device: torch.device) -> list[Tensor]:
    """The tile map the kernels walk for a mask_mod (the causal / window rule ANDed in).

    Its states come from the rule (a helper's bounds, a :class:`headwise.masks.TileMap` of
    this shape and block as is, a plain function evaluated); only the partial tiles' bits
    are built. A full tile that runs past Sk counts as partial (its bits end at Sk), so the
    kernels read full tiles with no bounds check; a key tile that is all padding in a batch
    row's key mask is empty for that row.

    Returns:
        ``[row_lists, row_counts, col_lists, col_counts, bits]``: :func:`_tile_lists` of the
        map (forward, dq) and of its transpose (dkdv), and the partial tiles' bits as
        :func:`_pack_bits` words (P, bq, bk // 32).
    """
    bq, bk = block
    states = mask_tile_states(rule, Bounds(S, Sk, bq, bk, device), B, H).to(device)  # (B|1, H|1, nq, nk)
    if Sk % bk:
        edge = states[..., -1:]
        states = torch.cat([states[..., :-1], torch.where(edge == FULL, PARTIAL, edge).to(torch.int8)], dim=-1)
    slots, bits = _partial_bits(rule, states, B, H, S, Sk, block)
    if key_bias is not None:  # (B|1, Sk): tiles holding no real key are empty for that row
        nk = states.shape[-1]
        live = F.pad(key_bias > float("-inf"), (0, nk * bk - Sk), value=False)
        live = live.reshape(key_bias.shape[0], 1, 1, nk, bk).any(-1)  # (B|1, 1, 1, nk)
        states = torch.where(live, states, EMPTY).to(torch.int8)  # (B|1, H|1, nq, nk)
    rows = _tile_lists(states, slots)
    cols = _tile_lists(states.transpose(-2, -1), slots.transpose(-2, -1))
    return [*rows, *cols, _pack_bits(bits)]


def _rule_args(rule_tiles: list[Tensor], cols: bool, fallback: Tensor) -> tuple:
    """The rule pointers (Lists, Counts, Bits) and strides (s_lk, s_lb, s_lh, s_lo, s_nb, s_nh,
    s_no) of one launch: the map's rows (forward, dq) or columns (dkdv); placeholders without a rule."""
    if not rule_tiles:
        return (fallback, fallback, fallback), (0,) * 7
    lists, counts = rule_tiles[2:4] if cols else rule_tiles[0:2]

    def stride(t: Tensor, dim: int) -> int:
        return 0 if t.shape[dim] == 1 else t.stride(dim)  # a broadcast batch or head dim

    return ((lists, counts, rule_tiles[4]),
            (lists.stride(0), stride(lists, 1), stride(lists, 2), lists.stride(3),
             stride(counts, 0), stride(counts, 1), counts.stride(2)))


def _rule_flags(rule_block: list[int]) -> dict:
    """The rule path's constexprs: on with a map block (MAP_M, MAP_N), off (zeros) without."""
    if not rule_block:
        return dict(HAS_RULE=False, MAP_M=0, MAP_N=0)
    return dict(HAS_RULE=True, MAP_M=rule_block[0], MAP_N=rule_block[1])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on the tensors' GPU: Triton launches on the current device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _cap_factors(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(cap_in, cap_out)``: base-2 capped scores are ``tanh(q k^T * cap_in) * cap_out``."""
    return (0.0, 0.0) if softcap is None else (scale / softcap, softcap * LOG2E)


@torch.library.custom_op("headwise::triton_flash_forward", mutates_args=())
def _flash_forward(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor | None,
                   alibi_slopes: Tensor | None, scale: float, is_causal: bool,
                   window: int | None, softcap: float | None, sinks: Tensor | None,
                   rule_tiles: list[Tensor], rule_block: list[int]) -> tuple[Tensor, Tensor]:
    """Output (B, H, S, D) and base-2 log-sum-exp (B, H, S) fp32 (``+inf``: dead row), the
    sinks' column (``sinks`` (H,) fp32) included. ``rule_tiles``: :func:`_rule_tiles` of a
    mask_mod at ``rule_block`` (then ``is_causal`` and ``window`` are folded into it), or []."""
    B, H, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out = q.new_empty(B, H, S, D)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    interpret = _interpreted(q.device)
    kernels = _compiled(interpret)
    bias2 = None if key_bias is None else (key_bias * LOG2E).contiguous()  # (B|1, Sk), base-2 units
    slopes2 = None if alibi_slopes is None else (alibi_slopes * LOG2E).contiguous()  # (H,)
    sinks2 = None if sinks is None else (sinks * LOG2E).contiguous()  # (H,), base-2 units
    flags = dict(HEAD_D=D, BLOCK_D=_block_d(D), IS_CAUSAL=is_causal or window is not None,
                 HAS_WINDOW=window is not None, HAS_BIAS=key_bias is not None,
                 HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=softcap is not None,
                 PRECISION=_precision(q.dtype, interpret), **_rule_flags(rule_block))
    rule_ptrs, rule_strides = _rule_args(rule_tiles, False, lse)

    def run(c: TileConfig) -> None:
        # With a mask_mod the tile map says which key tiles hold real keys.
        tiles, cum = (lse, lse) if bias2 is None or rule_tiles else _live_key_tiles(bias2, c.block_n)
        bias_stride = 0 if bias2 is None or bias2.shape[0] == 1 else bias2.stride(0)
        kernels._fwd_kernel[(_cdiv(S, c.block_m), H, B)](
            q, k, v, out, lse, q if bias2 is None else bias2, tiles, cum,
            q if slopes2 is None else slopes2, q if sinks2 is None else sinks2, *rule_ptrs,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            bias_stride, 0 if tiles.shape[0] == 1 else tiles.stride(0),
            0 if cum.shape[0] == 1 else cum.stride(0), *rule_strides,
            H // Hkv, S, Sk, scale * LOG2E, window or 0, *_cap_factors(scale, softcap),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
            HAS_SINKS=sinks is not None, **flags,
        )

    with _on(q.device):
        _launch("forward", D, q.dtype, interpret, (q.dtype, tuple(flags.items()), sinks is not None), run)
    return out, lse


@_flash_forward.register_fake
def _(q, k, v, key_bias, alibi_slopes, scale, is_causal, window, softcap, sinks, rule_tiles, rule_block):
    B, H, S, D = q.shape
    return q.new_empty(B, H, S, D), q.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("headwise::triton_flash_backward", mutates_args=())
def _flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    dlse: Tensor | None, key_bias: Tensor | None, alibi_slopes: Tensor | None, scale: float,
                    is_causal: bool, window: int | None,
                    bias_grad: bool, softcap: float | None,
                    sinks: Tensor | None, rule_tiles: list[Tensor],
                    rule_block: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq (B, H, S, D), dk and dv (B, Hkv, Sk, D), d key_bias (B|1, Sk) fp32 when
    ``bias_grad`` (else an empty tensor), and d sinks (H,) fp32 when ``sinks`` is given
    (else an empty tensor). ``dlse``: the gradient of the forward's base-2 lse (B, H, S)
    fp32, or None where nothing read it; it joins ``delta`` (dead rows take none).
    ``rule_tiles`` / ``rule_block``: the forward's tile map, or []."""
    B, H, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    interpret = _interpreted(q.device)
    kernels = _compiled(interpret)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    bias2 = None if key_bias is None else (key_bias * LOG2E).contiguous()  # (B|1, Sk)
    slopes2 = None if alibi_slopes is None else (alibi_slopes * LOG2E).contiguous()  # (H,)
    dbias = torch.empty(B, Hkv, Sk, dtype=torch.float32, device=q.device) if bias_grad else delta
    bias_stride = 0 if bias2 is None or bias2.shape[0] == 1 else bias2.stride(0)
    flags = dict(HEAD_D=D, BLOCK_D=_block_d(D), IS_CAUSAL=is_causal or window is not None,
                 HAS_WINDOW=window is not None, HAS_BIAS=key_bias is not None,
                 HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=softcap is not None,
                 PRECISION=_precision(q.dtype, interpret), **_rule_flags(rule_block))
    cap_in, cap_out = _cap_factors(scale, softcap)
    row_ptrs, row_strides = _rule_args(rule_tiles, False, lse)
    col_ptrs, col_strides = _rule_args(rule_tiles, True, lse)

    def run_dkdv(c: TileConfig) -> None:
        kernels._bwd_dkdv_kernel[(_cdiv(Sk, c.block_n), Hkv, B)](
            q, k, v, dout, lse, delta, dk, dv, dbias, q if bias2 is None else bias2,
            q if slopes2 is None else slopes2, *col_ptrs,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            bias_stride, *col_strides, G, S, Sk, scale * LOG2E, scale, window or 0, cap_in, cap_out,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BIAS_GRAD=bias_grad,
            num_warps=c.num_warps, num_stages=c.num_stages, **flags,
        )

    def run_dq(c: TileConfig) -> None:
        tiles, cum = (lse, lse) if bias2 is None or rule_tiles else _live_key_tiles(bias2, c.block_n)
        kernels._bwd_dq_kernel[(_cdiv(S, c.block_m), H, B)](
            q, k, v, dout, lse, delta, dq, q if bias2 is None else bias2, tiles, cum,
            q if slopes2 is None else slopes2, *row_ptrs,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
            bias_stride, 0 if tiles.shape[0] == 1 else tiles.stride(0),
            0 if cum.shape[0] == 1 else cum.stride(0), *row_strides,
            G, S, Sk, scale * LOG2E, scale, window or 0, cap_in, cap_out,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
            **flags,
        )

    key = (q.dtype, tuple(flags.items()), bias_grad)
    block_m = _configs("dq", D, q.dtype, interpret)[0].block_m
    with _on(q.device):
        kernels._bwd_delta_kernel[(_cdiv(S, block_m), H, B)](
            out, dout, delta, lse, delta if dlse is None else dlse.float().contiguous(),
            *out.stride(), *dout.stride(), S,
            HEAD_D=D, BLOCK_D=_block_d(D), BLOCK_M=block_m, HAS_DLSE=dlse is not None,
        )
        _launch("dkdv", D, q.dtype, interpret, key, run_dkdv)
        _launch("dq", D, q.dtype, interpret, key, run_dq)
    dsinks = q.new_empty(0, dtype=torch.float32)
    if sinks is not None:  # d sink_h = -sum over rows of delta * p(sink), p(sink) = 2^(sink * log2(e) - lse);
        # delta holds the lse's gradient already: d lse / d sink = p(sink) too
        p_sink = torch.exp2(sinks[None, :, None] * LOG2E - lse)  # (B, H, S); 0 where lse = +inf
        dsinks = -(delta * p_sink).sum(dim=(0, 2))  # (H,)
    if not bias_grad:
        return dq, dk, dv, q.new_empty(0, dtype=torch.float32), dsinks
    dbias = dbias.sum(1)  # (B, Hkv, Sk) -> (B, Sk): the kv heads share one key bias
    if key_bias is not None and key_bias.shape[0] == 1:  # (bias_grad implies a key bias)
        dbias = dbias.sum(0, keepdim=True)  # (B, Sk) -> (1, Sk): the batch shared it too
    return dq, dk, dv, dbias, dsinks


@_flash_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, key_bias, alibi_slopes, scale, is_causal, window, bias_grad, softcap, sinks,
      rule_tiles, rule_block):
    dbias = key_bias.new_empty(key_bias.shape) if bias_grad else q.new_empty(0, dtype=torch.float32)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, key_bias, alibi_slopes, scale, is_causal, window, softcap, sinks, rule_tiles, rule_block = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_bias, alibi_slopes, sinks, *rule_tiles)
    ctx.args = (scale, is_causal, window, softcap, rule_block)
    ctx.set_materialize_grads(False)  # an lse nobody read arrives as None: backward skips its term


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, key_bias, alibi_slopes, sinks, *rule_tiles = ctx.saved_tensors
    scale, is_causal, window, softcap, rule_block = ctx.args
    bias_grad = key_bias is not None and ctx.needs_input_grad[3]
    if dout is None:  # only the lse was read
        dout = torch.zeros_like(out)
    dq, dk, dv, dbias, dsinks = _flash_backward(dout, q, k, v, out, lse, dlse, key_bias, alibi_slopes, scale,
                                                is_causal, window, bias_grad, softcap, sinks, rule_tiles,
                                                rule_block)
    return (dq, dk, dv, dbias if bias_grad else None, None, None, None, None, None,
            dsinks if sinks is not None else None,
            [None] * len(rule_tiles), None if rule_block else [])  # the inputs' structure: a list of ints is one leaf


_flash_forward.register_autograd(_backward, setup_context=_setup_context)


def _key_bias(mask: Tensor | None, Sk: int) -> Tensor | None:
    """A normalised key padding mask (B|1, 1, 1, Sk) as an additive fp32 key bias (B|1, Sk)."""
    if mask is None:
        return None
    m = mask.reshape(mask.shape[0], Sk)  # (B|1, 1, 1, Sk) -> (B|1, Sk)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(~m, float("-inf"))
    return m.float().contiguous()


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    rules: Rules,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    return_lse: bool = False,  # True: return (out, None, lse), lse (B, H, S)
) -> tuple[Tensor | None, ...]:
    """Fused attention on a GPU (or Triton's interpreter); see the module docstring.

    Args:
        q: (B, H, S, D) fp16, bf16 or fp32, D <= 128.
        k, v: (B, Hkv, Sk, D), H % Hkv == 0.
        attention_mask: None or a key padding mask (B|1, 1, 1, Sk), bool or additive float.
        rules: the call's rules: the bottom-right causal rule, a window, ALiBi slopes, softcap,
            sinks and a mask_mod (walked as a tile map, see :func:`_rule_tiles`); no sink
            tokens and no score_mod.
        dropout_p: must be 0.
        scale: multiplier of q k^T.
        need_weights: must be False (the registry never asks this kernel for weights).
        return_lse: also return each row's log-sum-exp, the forward's own (converted from
            base 2); its gradient joins the backward's ``delta``.

    Returns:
        ``(out, None)`` with out (B, H, S, D) in q's dtype; with ``return_lse``
        ``(out, None, lse)``, lse (B, H, S) fp32: the natural log of each row's softmax
        denominator, sinks counted, ``-inf`` for a row that attends nothing.

    Raises:
        ValueError: a mask that is not a key padding mask, dropout_p > 0, v with a head dim
            of its own, sink tokens or a score_mod (dispatch refuses them before calling;
            this guards direct calls).

    >>> from headwise.masks import document  # doctest: +SKIP
    >>> out, _ = triton_attention(q, k, v, attention_mask=None, rules=Rules(is_causal=True,
    ...     mask_mod=document(doc_ids)), dropout_p=0.0, scale=0.125, need_weights=False)  # doctest: +SKIP
    """
    if attention_mask is not None and attention_mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"the triton kernel takes key padding masks (B|1, 1, 1, Sk) only, got shape "
            f"{tuple(attention_mask.shape)}; use backend 'sdpa' or 'chunked'"
        )
    if dropout_p > 0:
        raise ValueError(f"the triton kernel has no dropout (dropout_p={dropout_p}); use backend 'sdpa' or 'chunked'")
    if rules.score_mod is not None:
        raise ValueError(f"the triton kernel takes no score_mod ({rules.describe()}): a Python function cannot "
                         "run inside its precompiled kernel; use backend 'chunked' (or 'sdpa' for a bias score_mod)")
    is_causal, window, alibi_slopes = rules.is_causal or rules.window is not None, rules.window, rules.alibi_slopes
    softcap, sinks, sink_tokens = rules.softcap, rules.sinks, rules.sink_tokens
    if v.shape[-1] != q.shape[-1] or sink_tokens:
        raise ValueError(f"the triton kernel needs v's head dim to be q's (got Dv = {v.shape[-1]}, D = {q.shape[-1]}) "
                         f"and takes no sink tokens (got {sink_tokens}); use backend 'sdpa' or 'chunked'")
    B, H, S, D = q.shape
    Sk = k.shape[2]
    if S == 0 or Sk == 0:  # nothing to compute; rows with no keys are zeros by the contract
        out = attached_zeros(q, k, v, *([] if sinks is None else [sinks]))  # (B, H, S, D): zero gradients
        if return_lse:
            return out, None, torch.full((B, H, S), float("-inf"), device=q.device)  # (B, H, S) fp32
        return out, None
    key_bias = _key_bias(attention_mask, Sk)  # (B|1, Sk) fp32 or None
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()  # (H,)
    sinks32 = None if sinks is None else sinks.float().contiguous()  # (H,)
    rule_tiles: list[Tensor] = []
    rule_block: list[int] = []
    if rules.mask_mod is not None:  # one tile map of every mask rule: causal and window are in it
        block = _rule_block(_interpreted(q.device))
        structure = cast(MaskMod, rules.structure(S, Sk))  # not None: a mask_mod is given
        rule_tiles = _rule_tiles(structure, key_bias, B, H, S, Sk, block, q.device)
        rule_block = list(block)
        is_causal, window = False, None
    out, lse2 = _flash_forward(q, k, v, key_bias, slopes, float(scale), bool(is_causal), window,
                               None if softcap is None else float(softcap), sinks32, rule_tiles, rule_block)
    if return_lse:  # base 2, +inf where dead -> natural log, -inf there (and no gradient there)
        return out, None, torch.where(lse2 == float("inf"), float("-inf"), lse2 * math.log(2))  # (B, H, S)
    return out, None


def _tile_map_note(call: Call) -> str:
    """Explain mode's words for a mask_mod: the tile map the kernels walk, with its shares."""
    B, H, _, S, Sk, _ = call.sizes
    bq, bk = _rule_block(_interpreted(call.q.device))
    rule = cast(MaskMod, call.rules.structure(S, Sk))  # not None: only called with a mask_mod
    states = mask_tile_states(rule, Bounds(S, Sk, bq, bk, call.q.device), B, H)  # (B|1, H|1, nq, nk)
    nq, nk = states.shape[-2:]
    share = {name: float((states == value).float().mean()) for name, value in
             (("empty", EMPTY), ("full", FULL), ("partial", PARTIAL))}
    causal = f" ({describe.causal_rule(call)} ANDed in)" if call.is_causal else ""
    name = getattr(call.rules.mask_mod, "__name__", None) or repr(call.rules.mask_mod)
    return (f"mask_mod {name}{causal} as a tile map of {nq} x {nk} tiles of {bq} x {bk} per "
            f"(b, h): {share['empty']:.0%} empty (skipped), {share['full']:.0%} full (no mask), "
            f"{share['partial']:.0%} partial (their {bq} x {bk} bits loaded, built for those tiles only)")


def triton_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`triton_attention` for one call: one fused stage."""
    B, H, _, S, Sk, D = call.sizes
    if S == 0 or Sk == 0:
        return [KernelStage("triton", (B, H, S, D), call.q.dtype, "nothing to compute: zeros", fused=True)]
    how = "tile by tile in one Triton kernel (FlashAttention-2)"
    if call.attention_mask is not None:
        how += (f"; the {tuple(call.attention_mask.shape)} key mask read as one bias per key, key tiles that "
                "are all padding skipped")
    if call.rules.mask_mod is not None:
        how += f"; {_tile_map_note(call)}"
    elif call.is_causal:
        how += f"; {describe.causal_rule(call)}, tiles it blocks entirely skipped"
    if call.softcap is not None:
        how += f"; each tile capped at {call.softcap:.4g} with tanh before the mask"
    if call.sinks is not None:
        how += "; the sink logits join the running max and sum after the key tiles"
    how += describe.shared_kv(call)
    return [describe.fused(call, "triton", how, f"scores {describe.scores_shape(call)} not materialised")]


KERNEL = Kernel(
    name="triton",
    fn=triton_attention,
    summary=("FlashAttention-2 in Triton: key padding, causal, window, GQA, ALiBi, softcap, sinks, mask_mod "
             "(a tile map: empty tiles skipped, bits for partial ones); skips padded tiles"),
    native_gqa=True,
    fused=True,
    available=_available,
    refuses=_refuses,
    stages=triton_stages,
    forward_ad=False,  # an op or autograd.Function without a forward derivative
    functorch=False,  # an autograd.Function without setup_context, reads of values
)

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
* A row that may attend nothing gets output 0 and log-sum-exp ``+inf``, so backward's
  ``p = exp2(s - lse)`` is 0 there and no NaN appears, forward or backward.
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
the rows / columns of one tile, T key tiles per row.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise.kernels import describe
from headwise.kernels.common import attached_zeros
from headwise.kernels.registry import Call, Kernel, KernelStage, Request
from headwise.rules import Rules

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
    k = _load_tile(K, offs_n, offs_d, s_ks, s_kd, Sk, HEAD_D, MASK_POS, BLOCK_D != HEAD_D)  # (BN, BD)
    s, t = _capped(_dot(q, tl.trans(k), None, PRECISION), qk_scale, cap_in, cap_out, HAS_SOFTCAP)
    # (BM, BD) x (BD, BN) -> (BM, BN)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(Bias + offs_n, mask=offs_n < Sk, other=float("-inf"))[None, :]
    s = _mask_scores(s, offs_m[:, None], offs_n[None, :], bias, slope, Sk, offset, window,
                     MASK_POS, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI)
    return offs_n, k, s, t


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
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # -inf max = nothing attended yet: shift by 0 so exp2(-inf - 0) = 0, never NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)  # rescales what was summed under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(V, offs_n, offs_d, s_vs, s_vd, Sk, HEAD_D, MASK_POS, BLOCK_D != HEAD_D)  # (BN, BD)
        acc = _dot(_lowp(p, v.dtype, PRECISION), v, acc * alpha[:, None], PRECISION)
        # (BM, BN) x (BN, BD) -> (BM, BD)
        m_i = m_new
    return acc, l_i, m_i


def _fwd_kernel(Q, K, V, Out, Lse, Bias, Tiles, Cum, Slopes, Sinks,
                s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                s_ob, s_oh, s_os, s_od, s_biasb, s_tb, s_cb,
                G, S, Sk, qk_scale, window, cap_in, cap_out,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr):
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
    t_lo, t_full_lo, t_full_hi, t_hi = _key_tile_bounds(m0, S, Sk, window, BLOCK_M, BLOCK_N,
                                                        IS_CAUSAL, HAS_WINDOW)
    if HAS_BIAS:  # walk only the live tiles: positions in this row's sorted list
        Bias = Bias + b * s_biasb
        Tiles = Tiles + b * s_tb
        Cum = Cum + b * s_cb
        t_lo, t_full_lo = tl.load(Cum + t_lo), tl.load(Cum + t_full_lo)
        t_full_hi, t_hi = tl.load(Cum + t_full_hi), tl.load(Cum + t_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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


def _bwd_delta_kernel(Out, DO, Delta, s_ob, s_oh, s_os, s_od, s_dob, s_doh, s_dos, s_dod, S,
                      HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) (B, H, S) fp32: the softmax backward's per-row constant."""
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
    tl.store(Delta + (b * H + h) * S + offs_m, delta, mask=offs_m < S)


def _dkdv_inner(dk, dv, dbias, k, v, Q, DO, Lse, Delta, bias, slope, offs_n, offs_d,
                s_qs, s_qd, s_dos, s_dod, start, end, S, Sk, offset, window, qk_scale, cap_in, cap_out,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                MASK_POS: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_GRAD: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate dk, dv (and the key bias gradient) of one key tile over query tiles start..end.

    Works on transposed tiles (BN, BM) so that dk and dv come out as (BN, BD) directly.
    Rows past S load as zeros with lse = +inf, so their p (and everything after) is 0.
    """
    for t in range(start, end):
        offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _load_tile(Q, offs_m, offs_d, s_qs, s_qd, S, HEAD_D, True, BLOCK_D != HEAD_D)  # (BM, BD)
        do = _load_tile(DO, offs_m, offs_d, s_dos, s_dod, S, HEAD_D, True, BLOCK_D != HEAD_D)  # (BM, BD)
        lse = tl.load(Lse + offs_m, mask=offs_m < S, other=float("inf"))  # (BM,)
        delta = tl.load(Delta + offs_m, mask=offs_m < S, other=0.0)  # (BM,)
        s_t, t_t = _capped(_dot(k, tl.trans(q), None, PRECISION), qk_scale, cap_in, cap_out, HAS_SOFTCAP)
        # (BN, BD) x (BD, BM) -> (BN, BM)
        s_t = _mask_scores(s_t, offs_m[None, :], offs_n[:, None], bias, slope, Sk, offset, window,
                           MASK_POS, IS_CAUSAL, HAS_WINDOW, HAS_BIAS, HAS_ALIBI)
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


def _bwd_dkdv_kernel(Q, K, V, DO, Lse, Delta, DK, DV, DBias, Bias, Slopes,
                     s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                     s_dob, s_doh, s_dos, s_dod, s_dkb, s_dkh, s_dks, s_dkd,
                     s_dvb, s_dvh, s_dvs, s_dvd, s_biasb,
                     G, S, Sk, qk_scale, scale, window, cap_in, cap_out,
                     HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, BIAS_GRAD: tl.constexpr,
                     HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
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


def _bwd_dq_kernel(Q, K, V, DO, Lse, Delta, DQ, Bias, Tiles, Cum, Slopes,
                   s_qb, s_qh, s_qs, s_qd, s_kb, s_kh, s_ks, s_kd, s_vb, s_vh, s_vs, s_vd,
                   s_dob, s_doh, s_dos, s_dod, s_dqb, s_dqh, s_dqs, s_dqd, s_biasb, s_tb, s_cb,
                   G, S, Sk, qk_scale, scale, window, cap_in, cap_out,
                   HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   PRECISION: tl.constexpr):
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
    t_lo, t_full_lo, t_full_hi, t_hi = _key_tile_bounds(m0, S, Sk, window, BLOCK_M, BLOCK_N,
                                                        IS_CAUSAL, HAS_WINDOW)
    if HAS_BIAS:
        Bias = Bias + b * s_biasb
        Tiles = Tiles + b * s_tb
        Cum = Cum + b * s_cb
        t_lo, t_full_lo = tl.load(Cum + t_lo), tl.load(Cum + t_full_lo)
        t_full_hi, t_hi = tl.load(Cum + t_full_hi), tl.load(Cum + t_hi)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
                _tanh, _capped, _tile_scores,
                _fwd_inner, _fwd_kernel, _bwd_delta_kernel, _dkdv_inner, _bwd_dkdv_kernel,
                _dq_inner, _bwd_dq_kernel)


# --------------------------------------------------------------------------------------
# Host side: availability, compilation, tile sizes, launches.
# --------------------------------------------------------------------------------------


def _interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read on each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _interpreted(device: torch.device) -> bool:
    """CPU tensors can only go through Triton's interpreter; GPU tensors get compiled kernels."""
    return device.type == "cpu"


_TRITON_INSTALLED: list[bool] = []  # filled on the first look-up


def _triton_installed() -> bool:
    """Looked up once: a find_spec walks sys.path (tens of microseconds), and dispatch asks on
    every new request shape (each decoding step is one). A module-level list, not lru_cache:
    torch.compile traces through this function (dispatch runs inside the graph) and warns
    about an lru_cache wrapper it has to ignore."""
    if not _TRITON_INSTALLED:
        _TRITON_INSTALLED.append(importlib.util.find_spec("triton") is not None)
    return _TRITON_INSTALLED[0]


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
    if r.mask_mod or r.score_mod:
        return ("compiles its rules into the kernel ahead of the call and takes no mask_mod or score_mod; "
                "use backend 'chunked' or 'sdpa'")
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
                   window: int | None, softcap: float | None, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """Output (B, H, S, D) and base-2 log-sum-exp (B, H, S) fp32 (``+inf``: dead row), the
    sinks' column (``sinks`` (H,) fp32) included."""
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
                 PRECISION=_precision(q.dtype, interpret))

    def run(c: TileConfig) -> None:
        tiles, cum = (lse, lse) if bias2 is None else _live_key_tiles(bias2, c.block_n)
        bias_stride = 0 if bias2 is None or bias2.shape[0] == 1 else bias2.stride(0)
        kernels._fwd_kernel[(_cdiv(S, c.block_m), H, B)](
            q, k, v, out, lse, q if bias2 is None else bias2, tiles, cum,
            q if slopes2 is None else slopes2, q if sinks2 is None else sinks2,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            bias_stride, 0 if tiles.shape[0] == 1 else tiles.stride(0),
            0 if cum.shape[0] == 1 else cum.stride(0),
            H // Hkv, S, Sk, scale * LOG2E, window or 0, *_cap_factors(scale, softcap),
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
            HAS_SINKS=sinks is not None, **flags,
        )

    with _on(q.device):
        _launch("forward", D, q.dtype, interpret, (q.dtype, tuple(flags.items()), sinks is not None), run)
    return out, lse


@_flash_forward.register_fake
def _(q, k, v, key_bias, alibi_slopes, scale, is_causal, window, softcap, sinks):
    B, H, S, D = q.shape
    return q.new_empty(B, H, S, D), q.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("headwise::triton_flash_backward", mutates_args=())
def _flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    key_bias: Tensor | None, alibi_slopes: Tensor | None, scale: float,
                    is_causal: bool, window: int | None,
                    bias_grad: bool, softcap: float | None,
                    sinks: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq (B, H, S, D), dk and dv (B, Hkv, Sk, D), d key_bias (B|1, Sk) fp32 when
    ``bias_grad`` (else an empty tensor), and d sinks (H,) fp32 when ``sinks`` is given
    (else an empty tensor)."""
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
                 PRECISION=_precision(q.dtype, interpret))
    cap_in, cap_out = _cap_factors(scale, softcap)

    def run_dkdv(c: TileConfig) -> None:
        kernels._bwd_dkdv_kernel[(_cdiv(Sk, c.block_n), Hkv, B)](
            q, k, v, dout, lse, delta, dk, dv, dbias, q if bias2 is None else bias2,
            q if slopes2 is None else slopes2,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
            bias_stride, G, S, Sk, scale * LOG2E, scale, window or 0, cap_in, cap_out,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BIAS_GRAD=bias_grad,
            num_warps=c.num_warps, num_stages=c.num_stages, **flags,
        )

    def run_dq(c: TileConfig) -> None:
        tiles, cum = (lse, lse) if bias2 is None else _live_key_tiles(bias2, c.block_n)
        kernels._bwd_dq_kernel[(_cdiv(S, c.block_m), H, B)](
            q, k, v, dout, lse, delta, dq, q if bias2 is None else bias2, tiles, cum,
            q if slopes2 is None else slopes2,
            *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
            bias_stride, 0 if tiles.shape[0] == 1 else tiles.stride(0),
            0 if cum.shape[0] == 1 else cum.stride(0),
            G, S, Sk, scale * LOG2E, scale, window or 0, cap_in, cap_out,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
            **flags,
        )

    key = (q.dtype, tuple(flags.items()), bias_grad)
    block_m = _configs("dq", D, q.dtype, interpret)[0].block_m
    with _on(q.device):
        kernels._bwd_delta_kernel[(_cdiv(S, block_m), H, B)](
            out, dout, delta, *out.stride(), *dout.stride(), S,
            HEAD_D=D, BLOCK_D=_block_d(D), BLOCK_M=block_m,
        )
        _launch("dkdv", D, q.dtype, interpret, key, run_dkdv)
        _launch("dq", D, q.dtype, interpret, key, run_dq)
    dsinks = q.new_empty(0, dtype=torch.float32)
    if sinks is not None:  # d sink_h = -sum over rows of delta * p(sink), p(sink) = 2^(sink * log2(e) - lse)
        p_sink = torch.exp2(sinks[None, :, None] * LOG2E - lse)  # (B, H, S); 0 where lse = +inf
        dsinks = -(delta * p_sink).sum(dim=(0, 2))  # (H,)
    if not bias_grad:
        return dq, dk, dv, q.new_empty(0, dtype=torch.float32), dsinks
    dbias = dbias.sum(1)  # (B, Hkv, Sk) -> (B, Sk): the kv heads share one key bias
    if key_bias is not None and key_bias.shape[0] == 1:  # (bias_grad implies a key bias)
        dbias = dbias.sum(0, keepdim=True)  # (B, Sk) -> (1, Sk): the batch shared it too
    return dq, dk, dv, dbias, dsinks


@_flash_backward.register_fake
def _(dout, q, k, v, out, lse, key_bias, alibi_slopes, scale, is_causal, window, bias_grad, softcap, sinks):
    dbias = key_bias.new_empty(key_bias.shape) if bias_grad else q.new_empty(0, dtype=torch.float32)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, key_bias, alibi_slopes, scale, is_causal, window, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_bias, alibi_slopes, sinks)
    ctx.args = (scale, is_causal, window, softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, key_bias, alibi_slopes, sinks = ctx.saved_tensors
    scale, is_causal, window, softcap = ctx.args
    bias_grad = key_bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias, dsinks = _flash_backward(dout, q, k, v, out, lse, key_bias, alibi_slopes, scale,
                                                is_causal, window, bias_grad, softcap, sinks)
    return (dq, dk, dv, dbias if bias_grad else None, None, None, None, None, None,
            dsinks if sinks is not None else None)


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
) -> tuple[Tensor, Tensor | None]:
    """Fused attention on a GPU (or Triton's interpreter); see the module docstring.

    Args:
        q: (B, H, S, D) fp16, bf16 or fp32, D <= 128.
        k, v: (B, Hkv, Sk, D), H % Hkv == 0.
        attention_mask: None or a key padding mask (B|1, 1, 1, Sk), bool or additive float.
        rules: the call's rules: the bottom-right causal rule, a window, ALiBi slopes, softcap
            and sinks; no sink tokens, mask_mod or score_mod.
        dropout_p: must be 0.
        scale: multiplier of q k^T.
        need_weights: must be False (the registry never asks this kernel for weights).

    Returns:
        ``(out, None)`` with out (B, H, S, D) in q's dtype.

    Raises:
        ValueError: a mask that is not a key padding mask, dropout_p > 0, v with a head dim
            of its own or sink tokens (dispatch refuses them before calling; this guards
            direct calls).
    """
    if attention_mask is not None and attention_mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"the triton kernel takes key padding masks (B|1, 1, 1, Sk) only, got shape "
            f"{tuple(attention_mask.shape)}; use backend 'sdpa' or 'chunked'"
        )
    if dropout_p > 0:
        raise ValueError(f"the triton kernel has no dropout (dropout_p={dropout_p}); use backend 'sdpa' or 'chunked'")
    if rules.mask_mod is not None or rules.score_mod is not None:
        raise ValueError(f"the triton kernel takes no mask_mod or score_mod ({rules.describe()}); "
                         "use backend 'chunked' or 'sdpa'")
    is_causal, window, alibi_slopes = rules.is_causal or rules.window is not None, rules.window, rules.alibi_slopes
    softcap, sinks, sink_tokens = rules.softcap, rules.sinks, rules.sink_tokens
    if v.shape[-1] != q.shape[-1] or sink_tokens:
        raise ValueError(f"the triton kernel needs v's head dim to be q's (got Dv = {v.shape[-1]}, D = {q.shape[-1]}) "
                         f"and takes no sink tokens (got {sink_tokens}); use backend 'sdpa' or 'chunked'")
    B, H, S, D = q.shape
    Sk = k.shape[2]
    if S == 0 or Sk == 0:  # nothing to compute; rows with no keys are zeros by the contract
        return attached_zeros(q, k, v, *([] if sinks is None else [sinks])), None  # (B, H, S, D): zero gradients
    key_bias = _key_bias(attention_mask, Sk)  # (B|1, Sk) fp32 or None
    slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()  # (H,)
    sinks32 = None if sinks is None else sinks.float().contiguous()  # (H,)
    out, _ = _flash_forward(q, k, v, key_bias, slopes, float(scale), bool(is_causal), window,
                            None if softcap is None else float(softcap), sinks32)
    return out, None


def triton_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`triton_attention` for one call: one fused stage."""
    B, H, _, S, Sk, D = call.sizes
    if S == 0 or Sk == 0:
        return [KernelStage("triton", (B, H, S, D), call.q.dtype, "nothing to compute: zeros", fused=True)]
    how = "tile by tile in one Triton kernel (FlashAttention-2)"
    if call.attention_mask is not None:
        how += (f"; the {tuple(call.attention_mask.shape)} key mask read as one bias per key, key tiles that "
                "are all padding skipped")
    if call.is_causal:
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
    summary="FlashAttention-2 in Triton: key padding, causal, window, GQA, ALiBi, softcap, sinks; skips padded tiles",
    native_gqa=True,
    fused=True,
    available=_available,
    refuses=_refuses,
    stages=triton_stages,
)

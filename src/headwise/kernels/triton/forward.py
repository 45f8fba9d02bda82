"""The forward kernel: one program per (query block, head, batch) walks the key tiles with an
online softmax (running max ``m``, running sum ``l``, running output ``acc``, all fp32) and
saves the output and the base-2 log-sum-exp of every row (``+inf`` for a row that may attend
nothing, whose output is 0).

It walks the key tiles one of two ways: by the loop bounds of the causal / window rule (only
the tiles that straddle a boundary pay for the position mask), through the sorted list of
live key tiles when there is a key padding mask; or by a mask_mod's tile map (partial tiles
with their bits, then full ones with no mask). The attention sinks join after the key tiles.

These are plain functions, never run as Python: :mod:`headwise.kernels.triton.jit` copies
them into one namespace per mode, where ``tl`` is ``triton.language`` and each is a Triton
function, so a kernel's call to a helper resolves there, whichever file defined it (the
imports between the device files are for readers and linters).

Legend: B batch, H query heads, G = H // Hkv, S query length, Sk key length, D head dim, BD
the power of two >= max(D, 16) that a tile spans, BM / BN the rows / columns of one tile,
MAP_M / MAP_N the rows / columns of one map tile of a mask_mod.
"""

from __future__ import annotations  # tl.constexpr hints stay strings: tl exists only where jit puts it

from typing import TYPE_CHECKING

from headwise.kernels.triton.tiles import (
    _dot,
    _key_tile_bounds,
    _load_tile,
    _lowp,
    _scores_at,
    _store_tile,
    _tile_bits,
    _tile_scores,
)

if TYPE_CHECKING:  # the device code's ``tl``; at run time it lives in jit._compiled()'s namespace
    import triton.language as tl


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

"""The backward kernels, three launches:

* ``delta``: ``rowsum(dO * O)`` per row, the softmax backward's constant (less the
  log-sum-exp's gradient, when the caller read it);
* ``dk, dv``: one program per (key block, kv head, batch) walks the query tiles of the G
  query heads that share that kv head, so grouped-query attention needs neither a copy of
  k/v nor atomics; a key tile that is all padding skips its query loop and writes zeros;
* ``dq``: one program per (query block, head, batch) walks the key tiles as the forward did.

These are plain functions, never run as Python: :mod:`headwise.kernels.triton.jit` copies
them into one namespace per mode, where ``tl`` is ``triton.language`` and each is a Triton
function, so a kernel's call to a helper resolves there, whichever file defined it (the
imports between the device files are for readers and linters).

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length, Sk key
length, D head dim, BD the power of two >= max(D, 16) that a tile spans, BM / BN the rows /
columns of one tile, MAP_M / MAP_N the rows / columns of one map tile of a mask_mod.
"""

from __future__ import annotations  # tl.constexpr hints stay strings: tl exists only where jit puts it

from typing import TYPE_CHECKING

from headwise.kernels.triton.tiles import (
    _capped,
    _dot,
    _key_tile_bounds,
    _load_tile,
    _lowp,
    _mask_scores,
    _query_tile_bounds,
    _scores_at,
    _store_tile,
    _tile_bits,
    _tile_scores,
)

if TYPE_CHECKING:  # the device code's ``tl``; at run time it lives in jit._compiled()'s namespace
    import triton.language as tl


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
    bits), then its full ones; :func:`~headwise.kernels.triton.forward._fwd_rule` transposed.
    ``Lists`` / ``Counts`` point at the column's map rows and their (partial, full) counts; a
    key tile that is all padding (``padded``) visits none."""
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
    """dq over the key tiles of the tile map's row, as :func:`~headwise.kernels.triton.forward._fwd_rule` walks them."""
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

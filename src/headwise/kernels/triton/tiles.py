"""Device code that forward and backward share: one tile's loads, stores and products, its
masked, scaled (and capped) scores, and the bounds of a program's walk over tiles.

These are plain functions, never run as Python: :mod:`headwise.kernels.triton.jit` copies
them into one namespace per mode, where ``tl`` is ``triton.language`` and each is a Triton
function, so a kernel's call to a helper resolves there, whichever file defined it (the
imports between the device files are for readers and linters).

Legend: S query length, Sk key length, D head dim, BD the power of two >= max(D, 16) that a
tile spans, BM / BN the rows / columns of one tile, MAP_M / MAP_N the rows / columns of one
map tile of a mask_mod.
"""

from __future__ import annotations  # tl.constexpr hints stay strings: tl exists only where jit puts it

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the device code's ``tl``; at run time it lives in jit._compiled()'s namespace
    import triton.language as tl


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


def _tile_bits(Bits, r, c, WORDS: tl.constexpr):
    """A partial map tile's mask_mod bits at rows ``r`` x columns ``c`` (positions inside the
    map tile, broadcasting to the result's shape), True = may attend. ``Bits`` points at the
    tile's (MAP_M, WORDS) int32 words: column ``c`` is bit ``c % 32`` of word ``c // 32``."""
    words = tl.load(Bits + r * WORDS + (c >> 5))
    return ((words >> (c & 31)) & 1) != 0

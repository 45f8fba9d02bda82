"""Launching the kernels: forward and backward as ``torch.library`` custom ops (with fake
implementations, so ``torch.compile`` traces around them) and the forward's autograd, each
launch with the first tile config that fits the GPU; and the Python entry
:func:`triton_attention`, which checks a call and turns its rules into the ops' arguments.

Scores are kept in base 2 (``qk_scale = scale * log2(e)``), as in the Triton tutorial: the
key bias, the ALiBi slopes and the sinks are converted here, and the log-sum-exp back.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length, Sk key
length, D head dim, BM / BN the rows / columns of one tile.
"""

from __future__ import annotations

import contextlib
import math
from typing import cast

import torch
from torch import Tensor

from headwise.evaluate import MaskMod
from headwise.kernels.common import attached_zeros
from headwise.kernels.registry import KernelResult
from headwise.kernels.triton.configs import TileConfig, _configs, _rule_block
from headwise.kernels.triton.jit import _compiled
from headwise.kernels.triton.support import _interpreted
from headwise.kernels.triton.tile_maps import _live_key_tiles, _rule_tiles
from headwise.rules import Rules

LOG2E = math.log2(math.e)
_FAILED: set[tuple] = set()  # (kernel, config, specialisation) that ran out of GPU resources


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
    """:func:`~headwise.kernels.triton.tiles._dot`'s precision: IEEE fp32 unless torch's own setting allows TF32."""
    if dtype == torch.bfloat16 and interpret:
        return "fp32-operands"
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored for fp16 / bf16 inputs


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
    sinks' column (``sinks`` (H,) fp32) included. ``rule_tiles``:
    :func:`~headwise.kernels.triton.tile_maps._rule_tiles` of a mask_mod at ``rule_block``
    (then ``is_causal`` and ``window`` are folded into it), or []."""
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
    return_lse: bool = False,  # True: the result's lse (B, H, S) too
) -> KernelResult:
    """Fused attention on a GPU (or Triton's interpreter); see :mod:`headwise.kernels.triton`.

    Args:
        q: (B, H, S, D) fp16, bf16 or fp32, D <= 128.
        k, v: (B, Hkv, Sk, D), H % Hkv == 0.
        attention_mask: None or a key padding mask (B|1, 1, 1, Sk), bool or additive float.
        rules: the call's rules: the bottom-right causal rule, a window, ALiBi slopes, softcap,
            sinks and a mask_mod (walked as a tile map, see
            :func:`~headwise.kernels.triton.tile_maps._rule_tiles`); no sink tokens and no score_mod.
        dropout_p: must be 0.
        scale: multiplier of q k^T.
        need_weights: must be False (the registry never asks this kernel for weights).
        return_lse: also return each row's log-sum-exp, the forward's own (converted from
            base 2); its gradient joins the backward's ``delta``.

    Returns:
        ``KernelResult(out, None, lse)`` with out (B, H, S, D) in q's dtype; lse (B, H, S)
        fp32 with ``return_lse`` (else None): the natural log of each row's softmax
        denominator, sinks counted, ``-inf`` for a row that attends nothing.

    Raises:
        ValueError: a mask that is not a key padding mask, dropout_p > 0, v with a head dim
            of its own, sink tokens or a score_mod (dispatch refuses them before calling;
            this guards direct calls).

    >>> from headwise.masks import document  # doctest: +SKIP
    >>> out = triton_attention(q, k, v, attention_mask=None, rules=Rules(is_causal=True,
    ...     mask_mod=document(doc_ids)), dropout_p=0.0, scale=0.125, need_weights=False).out  # doctest: +SKIP
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
            return KernelResult(out, None, torch.full((B, H, S), float("-inf"), device=q.device))  # (B, H, S) fp32
        return KernelResult(out)
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
        lse = torch.where(lse2 == float("inf"), float("-inf"), lse2 * math.log(2))  # (B, H, S)
        return KernelResult(out, None, lse)
    return KernelResult(out)

"""The batch-invariant kernel: a row's bits depend on its own query and keys, nothing else.

It runs headwise's native CPU kernel (``csrc/paged_attention.cpp``) over the contiguous
(B, Hkv, Sk, D) keys, read as B pages of Sk keys. Every row reduces its keys in blocks of
``KEY_BLOCK`` keys at offsets 0, 32, 64, ... counted from its sequence's first real key,
merged in key order, with every score made by the same instructions; the backward sums
each row's keys in key order (dq) and each key's rows in row order (dk, dv). So a row's
output and input gradients do not depend on the batch size, its position in the batch,
the padding around it (right or left: the first real key is where its blocks start) or the
number of query rows in the call: the first n rows of a causal call equal a call of n
rows. :func:`headwise.batch_invariant` routes every attention here.

What it takes: fp32 or bf16 CPU tensors, GQA, Dv != D, the causal rule (bottom-right) and
a bool mask shared by the heads under which each query attends one run of keys from its
row's first key: key padding on the right or the left, causal or not, or a static cache's
mask of written slots (a hole, a window or a per-head mask is refused). No window, ALiBi,
soft-capping, sinks, rules as functions or dropout (refused with the reason).

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv of v.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from headwise import native
from headwise import tracing as trace
from headwise.kernels import describe
from headwise.kernels.common import attached_zeros
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage, Request
from headwise.rules import Rules

NAME = "invariant"
KEY_BLOCK = 32  # the native kernel's constant (checked against it when it loads)


class Placement(NamedTuple):
    """Where each row's keys lie, as the native kernel reads them (each int64, on the host).

    Attributes:
        lens: (B,) the keys of each row: ``offset[b] .. offset[b] + lens[b] - 1`` of its Sk.
        offset: (B,) each row's first key, where its blocks of keys start.
        query_pos: (B,) bottom-right causal: query i sits at key ``query_pos[b] + i`` of the row's own.
        row_end: (B, S) or None: query i attends the row's keys ``0 .. row_end[b, i] - 1`` (a
            per-query mask; then ``query_pos`` is not read).
    """

    lens: Tensor
    offset: Tensor
    query_pos: Tensor
    row_end: Tensor | None


def placement(mask: Tensor | None, B: int, S: int, Sk: int, causal: bool) -> Placement:
    """Each row's keys from a normalised bool mask (B|1, 1, S|1, Sk) and the causal rule.

    Raises:
        ValueError: a query whose keys are not one run from its row's first key (a hole in
            the padding, a window): the kernel's blocks start at that key.
    """
    if mask is None:
        lens = torch.full((B,), Sk, dtype=torch.int64)
        offset = torch.zeros(B, dtype=torch.int64)
        ends = None
    else:
        allowed = mask[:, 0].expand(B, mask.shape[2], Sk).cpu()  # (B, S|1, Sk) True = may attend
        count = allowed.sum(-1)  # (B, S|1)
        span = torch.arange(Sk)
        first = torch.where(allowed, span, Sk).amin(-1)  # (B, S|1): Sk where none
        last = torch.where(allowed, span, -1).amax(-1)  # (B, S|1): -1 where none
        offset = first.amin(-1).clamp(max=Sk)  # (B,): the row's first key
        offset = torch.where(offset < Sk, offset, 0)
        bad = (count > 0) & ((last - first + 1 != count) | (first != offset[:, None]))  # (B, S|1)
        if bool(bad.any()):
            b, i = (int(n) for n in bad.nonzero()[0])
            raise ValueError(f"backend {NAME!r} takes each query's keys as one run from its row's first key (padding "
                             f"on the right or the left, causal), but row {b}, query {i} may attend {int(count[b, i])} "
                             f"keys over positions {int(first[b, i])}..{int(last[b, i])} (the row's first is "
                             f"{int(offset[b])}); pack each row's tokens together, or attend outside "
                             "headwise.batch_invariant()")
        ends = torch.where(count > 0, last + 1 - offset[:, None], 0)  # (B, S|1) keys 0 .. end - 1 of the row's
        lens = ends.amax(-1)  # (B,)
        if mask.shape[2] == 1:  # a key padding mask: the kernel's own causal rule, per row
            ends = None
    query_pos = (Sk - S) - offset  # bottom-right causal: query i may attend key j <= i + Sk - S of the Sk
    if ends is not None and causal:  # a per-query mask and the causal rule: both, as one end per query
        ends = torch.minimum(ends, (query_pos[:, None] + torch.arange(S) + 1).clamp(min=0))
    row_end = None if ends is None else ends.expand(B, S).contiguous()
    return Placement(lens.contiguous(), offset.contiguous(), query_pos.contiguous(), row_end)


def _extension() -> Any:
    ext = native.load()
    if ext is None:
        raise RuntimeError(f"backend {NAME!r} needs headwise's native kernel, which is not available: "
                           f"{native.unavailable()}; install a C++ compiler and ninja (pip install ninja), or "
                           "attend outside headwise.batch_invariant()")
    if ext.KEY_BLOCK != KEY_BLOCK:
        raise RuntimeError("internal error: the native kernel was built from another source; please report it")
    return ext


class _Attention(torch.autograd.Function):
    """The native kernel forward, its fixed-order backward: ``(out (B, H, S, Dv), lse (B, H, S) fp32)``."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, place: Placement, scale: float,
                causal: bool) -> tuple[Tensor, Tensor]:
        ext = _extension()
        table = torch.arange(q.shape[0], dtype=torch.int64).view(-1, 1)  # (B, 1): sequence b is page b
        # k, v (B, Hkv, Sk, D) are the kernel's (N, Hkv, P, D) pool: B pages of Sk keys
        out, lse = ext.paged_attention(q, k, v, table, place.lens, scale, causal, 0, None, None, None, True,
                                       place.offset, place.query_pos, place.row_end)  # (B, H, S, Dv), (B, H, S)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.place, ctx.scale, ctx.causal = place, scale, causal
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        place = ctx.place
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _extension().attention_backward(q, k, v, out, dout, lse, place.lens, ctx.scale, ctx.causal,
                                                     place.offset, place.query_pos, place.row_end, dlse)
        return dq, dk, dv, None, None, None


def invariant_attention(q: Tensor, k: Tensor, v: Tensor, *, attention_mask: Tensor | None, rules: Rules,
                        dropout_p: float, scale: float | None, need_weights: bool,
                        return_lse: bool = False) -> KernelResult:
    """Attention whose every row has the same bits whatever the batch around it (see the module docstring)."""
    B, H, S, D = q.shape
    Sk, Dv = k.shape[2], v.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if S == 0 or Sk == 0 or B == 0:  # nothing to attend: the contract's zero rows, in the graph of q, k, v
        out = attached_zeros(q, k, v, size=Dv) if Sk == 0 else q.new_zeros(B, H, S, Dv)
        lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
        return KernelResult(out, None, lse if return_lse else None)
    place = placement(attention_mask, B, S, Sk, rules.is_causal)
    out, lse = _Attention.apply(q, k, v, place, scale, rules.is_causal)  # (B, H, S, Dv), (B, H, S)
    if trace.ACTIVE:
        trace.record("kernel", out, f"backend {NAME!r}: every row over its own keys in blocks of {KEY_BLOCK} at fixed "
                     "offsets from its first real key")
    return KernelResult(out, None, lse if return_lse else None)


def _refuses(request: Request) -> str | None:
    if request.device.type != "cpu":
        return f"runs on the CPU only (a native C++ kernel), not on {request.device.type}"
    if request.dtype not in (torch.float32, torch.bfloat16):
        return f"takes fp32 or bf16, not {request.dtype}"
    if request.mask_kind == "float":
        return "takes a bool mask (True = may attend), not a float mask"
    if request.mask_kind == "bool" and request.mask_shape is not None and request.mask_shape[1] != 1:
        return "takes a mask shared by the heads (B, 1, S, Sk): each query's keys one run from its row's first key"
    asked = [name for name, given in (("window", request.window is not None), ("ALiBi", request.alibi),
                                      ("soft-capping", request.softcap), ("sinks", request.sinks),
                                      ("mask_mod", request.mask_mod), ("score_mod", request.score_mod),
                                      ("dropout", request.dropout_p > 0)) if given]
    if asked:
        return f"applies no {', '.join(asked)} (only causal and key padding)"
    if request.batch_invariant:
        ext_why = None if native.load() is not None else native.unavailable()
        if ext_why is not None:
            return f"needs headwise's native kernel, which is not available: {ext_why}"
    return None


def _stages(call: Call) -> list[KernelStage]:
    B, H, S, Sk = describe.scores_shape(call)
    return [describe.fused(call, NAME, f"in headwise's native kernel, each row over its keys in blocks of {KEY_BLOCK} "
                           f"at fixed offsets{describe.shared_kv(call)}",
                           f"the (B, H, S, Sk) = ({B}, {H}, {S}, {Sk}) scores are never materialised")]


KERNEL = Kernel(
    name=NAME,
    fn=invariant_attention,
    summary="a row's bits whatever the batch, padding or query count: fixed key blocks (native, CPU)",
    native_gqa=True,
    fused=True,
    available=native.unavailable,
    refuses=_refuses,
    stages=_stages,
    forward_ad=False,
    functorch=False,
    invariant=True,
)

"""The packed path: only the real tokens, end to end (padding-free).

(B, S, E) with a padding mask -> pack the real tokens to (T, E) -> projections on T rows ->
attention per length bucket -> output projection -> unpack to (B, S, E), zeros at the
padding. :meth:`~headwise.MultiHeadAttention.forward_packed` enters in the middle, with
tokens already packed.

Legend: B batch, H query heads, Hkv key/value heads, S padded length, T packed tokens,
D head dim, Dv value head dim, E embed dim.
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import torch
from torch import Tensor

from headwise import packing, policy
from headwise import tracing as trace
from headwise.module import checks
from headwise.module import projections as proj
from headwise.module.layer_protocol import Layer
from headwise.module.plan import Plan


def forward(mha: Layer, x: Tensor, plan: Plan) -> Tensor:
    """(B, S, E) -> pack the real tokens -> attend per length bucket -> unpack to (B, S, E)."""
    if trace.ACTIVE:
        trace.begin_call()
        trace.record("input", x, "x: (B, S, E)")
    padding = cast(Tensor, plan.padding)  # the plan packs only by a padding mask
    packed, info = packing.pack(x, padding)  # (T, E): the real tokens only
    if trace.ACTIVE:
        B, S = padding.shape
        trace.record("pack", packed, f"keep the {info.tokens} real tokens of {B} x {S} positions "
                     f"(drop {B * S - info.tokens} padded), {B} sequences end to end")
    out = attend(mha, packed, info.cu_seqlens, info.lengths, info.positions, plan.is_causal,
                 rope_len=padding.shape[1])  # dynamic NTK scales by S, as the dense path
    out = packing.unpack(out, info)  # (B, S, E), zeros at the padding
    if trace.ACTIVE:
        trace.record("unpack", out, "scatter the tokens back to (B, S, E); padded positions output zeros")
    return out


def attend(mha: Layer, x: Tensor, cu_seqlens: Tensor, lengths: tuple[int, ...],
           positions: Tensor | None, causal: bool, rope_len: int | None = None) -> Tensor:
    """(T, E) tokens -> (T, E) outputs, every stage traced. ``rope_len``: the length dynamic
    NTK scales by (None: the last position + 1)."""
    T = x.shape[0]
    q, k, v = proj.project(mha, x, None)  # (T, E), (T, Hkv*D), (T, Hkv*Dv)
    q = q.unflatten(-1, (mha.num_heads, mha.head_dim))  # (T, E) -> (T, H, D)
    k = k.unflatten(-1, (mha.num_kv_heads, mha.head_dim))  # (T, Hkv*D) -> (T, Hkv, D)
    v = v.unflatten(-1, (mha.num_kv_heads, mha.v_head_dim))  # (T, Hkv*Dv) -> (T, Hkv, Dv)
    if trace.ACTIVE:
        trace.record("split heads q", q, "unflatten(-1, (H, D)): packed rows need no transpose")
        trace.record("split heads k, v", k, "the same with H = Hkv")
    q, k = proj.normalize(mha, q, k)
    if mha.rope is not None:
        if positions is None:
            # output_size: no read of the repeats (a device sync; a meta tensor has no values)
            starts = torch.repeat_interleave(cu_seqlens[:-1], torch.tensor(lengths, device=x.device), output_size=T)
            positions = torch.arange(T, device=x.device) - starts  # (T,) position within each sequence
        q, k = mha.rope.at(q, positions, seq_len=rope_len), mha.rope.at(k, positions, seq_len=rope_len)
        if trace.ACTIVE:
            trace.record("rotary positions", q, f"{mha.rope.describe()}, each token's position in its sequence")
    out = packing.attend_packed(
        q, k, v, lengths, lengths, is_causal=causal, dropout_p=mha.dropout if mha.training else 0.0,
        backend=checks.backend(mha), window=mha.window, alibi_slopes=checks.slopes(mha), softcap=mha.softcap,
        sinks=checks.sinks(mha), sink_tokens=mha.sink_tokens,
    )  # (T, H, Dv), attention within each sequence
    out = cast(Tensor, out).flatten(1)  # (T, H, Dv) -> (T, H*Dv); no return_lse: a tensor
    if trace.ACTIVE:
        trace.record("merge heads", out, "flatten(1): (T, H, D) -> (T, E), a view" if mha.v_head_dim == mha.head_dim
                     else "flatten(1): (T, H, Dv) -> (T, H*Dv), a view")
    out_proj: Any = mha._modules["out_proj"]
    out = proj.linear(out_proj, out, proj.plain_linears(mha))  # (T, H*Dv) -> (T, E): tiled in the batch-invariant mode
    if trace.ACTIVE:
        trace.record("output projection", out, "out_proj: (T, E) x (E, E)^T + b, on the real tokens only")
    return out


def lengths_of(cu_seqlens: Tensor, lengths: tuple[int, ...] | None, T: int) -> tuple[int, ...]:
    """The sequence lengths of packed offsets ``cu_seqlens`` (B + 1,) over T rows, checked.

    Where the offsets' values can be read (CPU, outside torch.compile) they must start at 0,
    never decrease and end at T, and given ``lengths`` must be their differences; on an
    accelerator, given ``lengths`` are trusted (reading the offsets would sync)."""
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor of int32/int64 offsets, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor (int32 or int64 offsets), got {cu_seqlens.dtype}; "
                        "pass cu_seqlens.long()")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D (B + 1,) offsets, got shape {tuple(cu_seqlens.shape)}")
    if lengths is not None:
        lengths = tuple(int(n) for n in lengths)
        if len(lengths) != cu_seqlens.numel() - 1:
            raise ValueError(f"lengths {lengths} name {len(lengths)} sequences but cu_seqlens "
                             f"{tuple(cu_seqlens.shape)} holds {cu_seqlens.numel() - 1}")
        if not policy.reads_values(cu_seqlens):
            return lengths
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 (sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]), got "
                         f"{offsets[:4]}{' ...' if len(offsets) > 4 else ''}")
    steps = tuple(b - a for a, b in itertools.pairwise(offsets))
    if any(n < 0 for n in steps):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens must end at the {T} rows of x, got {offsets[-1]} ({offsets})")
    if lengths is not None and lengths != steps:
        raise ValueError(f"lengths {lengths} are not the differences of cu_seqlens {offsets} ({steps}); "
                         "pass lengths=None to read them from cu_seqlens")
    return steps

"""The stages around the kernel: the q, k, v projections and the head split, q/k norm and
rotary positions, then merging the heads, the output projection and zeroing the padding.

Every projection is the module's own submodule call (``mha.q_proj(x)``), so a hook, a PEFT
wrapper or a replaced module runs as on any PyTorch layer. Where nothing hooks or wraps
them, the call is ``F.linear`` on their weights, and, where no gradient reaches the weights,
one GEMM over the q, k and v weights, which lie in adjacent memory (``module/qkv.py``).

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, Dv value head dim, E embed dim, T packed tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from headwise import invariance, policy
from headwise import tracing as trace
from headwise.module import qkv
from headwise.module.layer_protocol import Layer


def plain_linears(mha: Layer) -> bool:
    """Whether ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` are ``nn.Linear`` that nothing
    hooks (their own hooks or global ones) or wraps, outside a JIT trace: then
    ``F.linear(x, m.weight, m.bias)`` is exactly ``m(x)``, without ``nn.Module``'s call
    machinery (about 2.5 us a call on one Zen 5 thread). A replaced, wrapped (PEFT) or hooked
    projection is called as a module."""
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks
            or torch._C._get_tracing_state()):
        return False
    modules = mha._modules
    for name in _LINEARS:
        m = modules[name]
        if (type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks):
            return False
    return True


_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj")


def linear(m: nn.Module, x: Tensor, plain: bool) -> Tensor:
    """``m(x)``; ``plain``: :func:`plain_linears` holds, so F.linear on its weights is the same
    call (read from the parameter dict: ``nn.Module.__getattr__`` costs about a microsecond a
    name)."""
    if plain:
        params: Any = m._parameters
        if invariance.is_batch_invariant():  # fixed row tiles: a row's bits whatever the other rows
            return invariance.linear(x, params["weight"], params["bias"])
        return F.linear(x, params["weight"], params["bias"])
    return m(x)


def rows_for(mha: Layer, context: Tensor | None, plain: bool) -> qkv.Pack | None:
    """The q, k, v rows one GEMM may project with (:func:`headwise.module.qkv.packed`):
    self-attention whose projections nothing hooks or wraps (``plain``); else None."""
    if not plain or context is not None or invariance.is_batch_invariant():  # the mode: tiled (_project)
        return None
    return qkv.packed(mha, torch.is_grad_enabled())


def project(mha: Layer, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The three projections of (B, S, E) inputs (keys and values from ``context`` if given),
    or of packed (T, E) tokens: (.., E), (.., Hkv*D), (.., Hkv*Dv)."""
    plain = plain_linears(mha)
    return _project(mha, x, context, plain, rows_for(mha, context, plain))


def _project(mha: Layer, x: Tensor, context: Tensor | None, plain: bool,
             pack: qkv.Pack | None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`project` with :func:`plain_linears` and :func:`rows_for` read."""
    if pack is not None:  # one GEMM over the adjacent q, k, v weights (no copy)
        qkv_out = F.linear(x, pack.weight, pack.bias)  # (.., E) -> (.., H*D + Hkv*D + Hkv*Dv)
        q, k, v = qkv_out.split_with_sizes(pack.rows, -1)  # views: (.., H*D), (.., Hkv*D), (.., Hkv*Dv)
    elif (plain and context is None and invariance.is_batch_invariant()
          and (stacked := qkv.stacked(mha, torch.is_grad_enabled())) is not None):
        weight, bias, rows = stacked  # the mode's self-attention: one tiled GEMM over the stacked q, k, v rows
        qkv_out = invariance.linear(x, weight, bias)  # (.., E) -> (.., H*D + Hkv*D + Hkv*Dv), fixed row tiles
        q, k, v = qkv_out.split_with_sizes(rows, -1)  # views: (.., H*D), (.., Hkv*D), (.., Hkv*Dv)
    else:
        src = x if context is None else context
        modules: dict[str, Any] = mha._modules
        q = linear(modules["q_proj"], x, plain)  # (.., E) -> (.., H*D)
        k = linear(modules["k_proj"], src, plain)  # (.., E) -> (.., Hkv*D)
        v = linear(modules["v_proj"], src, plain)  # (.., E) -> (.., Hkv*Dv)
    if trace.ACTIVE:
        record_projections(q, k, v, x.dim() == 3, context is None)
    return q, k, v


def record_projections(q: Tensor, k: Tensor, v: Tensor, batched: bool, self_attention: bool) -> None:
    rows, keys = ("B, S", "B, Sk") if batched else ("T", "T")
    src = "x" if self_attention else "context"
    trace.record("q projection", q, f"q_proj(x): ({rows}, E) x (E, E)^T + b")
    trace.record("k projection", k, f"k_proj({src}): ({keys}, E) x (Hkv*D, E)^T + b")
    if v.shape[-1] == k.shape[-1]:
        trace.record("v projection", v, f"v_proj({src}): ({keys}, E) x (Hkv*D, E)^T + b")
    else:  # v_head_dim: values of their own head dim
        trace.record("v projection", v, f"v_proj({src}): ({keys}, E) x (Hkv*Dv, E)^T + b, Hkv*Dv = {v.shape[-1]}")


def project_heads(mha: Layer, x: Tensor, context: Tensor | None,
                  plain: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(B, S, E) inputs -> q (B, H, S, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv).
    ``plain``: :func:`plain_linears`, where the caller read it for this call (None: read here)."""
    if plain is None:
        plain = plain_linears(mha)
    pack = rows_for(mha, context, plain)
    if pack is not None and mha.v_head_dim == mha.head_dim and not trace.ACTIVE:
        return heads_from_rows(mha, x, pack)
    q, k, v = _project(mha, x, context, plain, pack)
    # Plain views, not einops.rearrange: its recipe lookup costs ~20 us a call, a quarter of
    # a small forward (measured at B=1, S=8, E=64); `headwise equivalences` checks they agree.
    q = q.unflatten(-1, (mha.num_heads, -1)).transpose(1, 2)  # (B, S, E) -> (B, S, H, D) -> (B, H, S, D)
    k = k.unflatten(-1, (mha.num_kv_heads, -1)).transpose(1, 2)  # -> (B, Hkv, Sk, D)
    v = v.unflatten(-1, (mha.num_kv_heads, -1)).transpose(1, 2)  # -> (B, Hkv, Sk, Dv)
    if trace.ACTIVE:
        trace.record("split heads q", q, "unflatten(-1, (H, D)).transpose(1, 2) = "
                     "rearrange 'b s (h d) -> b h s d'")
        trace.record("split heads k, v", k, "the same with H = Hkv" if v.shape[-1] == k.shape[-1] else
                     f"the same with H = Hkv; v: (B, Hkv, Sk, Dv) = {tuple(v.shape)}")
    return q, k, v


def heads_from_rows(mha: Layer, x: Tensor, pack: qkv.Pack) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`project_heads` in three ops where one GEMM over the q, k, v rows serves and v
    has head dim D: the (B, S, (H + 2 Hkv) D) result split into heads at once, as after a
    fused qkv ``nn.Linear`` (five view ops fewer than per projection, each a microsecond or
    two from Python)."""
    B, S, _ = x.shape
    heads = F.linear(x, pack.weight, pack.bias)  # (B, S, E) -> (B, S, (H + 2 Hkv) D)
    n = mha.num_heads + 2 * mha.num_kv_heads  # named, not -1: an empty step (S = 0) has no size to infer
    heads = heads.view(B, S, n, mha.head_dim).transpose(1, 2)  # -> (B, S, H + 2 Hkv, D) -> (B, H + 2 Hkv, S, D)
    q, k, v = heads.split_with_sizes((mha.num_heads, mha.num_kv_heads, mha.num_kv_heads), 1)
    return q, k, v  # (B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, D)


def normalize(mha: Layer, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """RMSNorm of each head's q and k over D, before rotary (no-op without qk_norm)."""
    if mha.q_norm is None or mha.k_norm is None:
        return q, k
    q, k = mha.q_norm(q), mha.k_norm(k)  # (.., H|Hkv, .., D): normalised over the last dim, D
    if trace.ACTIVE:
        trace.record("q/k norm", q, f"RMSNorm of each head's q and k over D = {mha.head_dim} "
                     f"(x / sqrt(mean(x^2) + {mha.q_norm.eps:g}) x q_norm.weight / k_norm.weight), before rotary")
    return q, k


def rotate(mha: Layer, q: Tensor, k: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """Rotary embeddings for positions ``start, start + 1, ...`` (no-op without rope)."""
    if mha.rope is None:
        return q, k
    q, k = mha.rope(q, start), mha.rope(k, start)  # (B, H|Hkv, S, D)
    if trace.ACTIVE:
        trace.record("rotary positions", q, f"{mha.rope.describe()}, positions from {start}")
    return q, k


def output(mha: Layer, out: Tensor, padding: Tensor | None, finite: bool = False,
           plain: bool | None = None) -> Tensor:
    """Merge the heads of the attention output (B, H, S, Dv), project, and zero the padded
    positions (``padding`` (B, S), False = padded; None: none; ``finite``: the input was
    finite, see :func:`zero_padding_`; ``plain``: as :func:`project_heads` takes it): (B, S, E)."""
    out = out.transpose(1, 2).flatten(2)  # (B, H, S, Dv) -> (B, S, H, Dv) -> (B, S, H*Dv), one copy
    same = mha.v_head_dim == mha.head_dim
    if trace.ACTIVE:
        trace.record("merge heads", out, "transpose(1, 2).flatten(2) = rearrange 'b h s d -> b s (h d)' "
                     "= transpose(1, 2).contiguous().view(B, S, " + ("E)" if same else "H * Dv)"))
    out_proj: Any = mha._modules["out_proj"]
    out = linear(out_proj, out, plain_linears(mha) if plain is None else plain)  # (B, S, H*Dv) -> (B, S, E)
    if trace.ACTIVE:
        trace.record("output projection", out, "out_proj: (B, S, E) x (E, E)^T + b"
                     if same else "out_proj: (B, S, H*Dv) x (E, H*Dv)^T + b")
    if padding is not None:  # padded query positions output zeros, as the packed path gives
        out = zero_padding_(out, padding, finite)
        if trace.ACTIVE:
            trace.record("zero padding", out, "padded positions (2-D mask False) output zeros")
    return out


def zero_padding(t: Tensor, padding: Tensor) -> Tensor:
    """``t`` (B, S, E) with zeros where ``padding`` (B, S) is False (padded positions), whatever
    ``t`` holds there, NaN and inf included (the NaN/inf contract: a padded position never
    reaches a result).

    Not a product with the 0/1 mask (``NaN * 0`` is NaN), and not a broadcast ``masked_fill``
    or ``torch.where`` (on the CPU about 7x the product's time). Where the mask's values can
    be read, ``index_fill`` of the padded rows: about 2x the product forward and faster in
    backward (measured at B=8, S=64, E=128 on one Zen 5 thread). A copy: the input is never
    written (:func:`zero_padding_` writes a fresh output in place).
    """
    if not policy.reads_values(padding):  # on an accelerator, or traced: no host read of the mask
        return torch.where(padding.unsqueeze(-1), t, t.new_zeros(()))  # (B, S, E)
    rows = (~padding).flatten().nonzero().squeeze(1)  # (P,) flat indices of the padded positions
    if rows.numel() == 0:
        return t
    flat = t.reshape(-1, t.shape[-1])  # (B * S, E)
    return flat.index_fill(0, rows, 0).view(t.shape)  # (B, S, E)


def hide_padding(x: Tensor, padding: Tensor) -> tuple[Tensor, bool]:
    """x (B, S, E) whose padded positions (``padding`` (B, S) False) may reach no result and no
    gradient, and whether x is finite everywhere.

    A finite padded position is harmless (its keys are masked, its outputs zeroed, its
    gradients zero). Where x's values can be read, one sum over x tells (finite unless x
    holds NaN or inf, or overflows): then x itself, and the output's padding can be zeroed
    by a product (:func:`zero_padding_` with ``finite``). Otherwise, zeros at the padded
    positions (a copy; x itself is never written).
    """
    if policy.reads_values(padding) and math.isfinite((x.detach() if x.requires_grad else x).sum()):
        return x, True
    return zero_padding(x, padding), False


def zero_padding_(out: Tensor, padding: Tensor, finite: bool = False) -> Tensor:
    """:func:`zero_padding` in place where ``out`` (a fresh, contiguous output) takes no
    gradient, which saves allocating a (B, S, E) buffer. ``finite``: the call's input was
    finite everywhere (:func:`hide_padding`), so ``out`` is finite at the padding and a
    product with the 0/1 mask zeroes it (about 2x faster than ``index_fill`` of the rows)."""
    if finite:
        keep = padding.unsqueeze(-1)  # (B, S, 1): 1 at a token, 0 at padding
        return out * keep if out.requires_grad or not out.is_contiguous() else out.mul_(keep)
    if out.requires_grad or not out.is_contiguous() or not policy.reads_values(padding):
        return zero_padding(out, padding)
    rows = (~padding).flatten().nonzero().squeeze(1)  # (P,) flat indices of the padded positions
    out.view(-1, out.shape[-1]).index_fill_(0, rows, 0)  # (B * S, E), in place
    return out


def in_cache_dtype(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """A cache step's q, k, v in the cache's ``dtype``. Under ``torch.autocast`` the projections
    give autocast's dtype, while a cache keeps the one it was made with (the module's): the
    step writes and attends in that one, and the output projection runs under autocast again.
    Elsewhere the checks made them equal, and nothing is copied."""
    if k.dtype == dtype and q.dtype == dtype:
        return q, k, v
    return q.to(dtype), k.to(dtype), v.to(dtype)


def as_padding(mask: Tensor) -> Tensor:
    """A 2-D key mask as (B|1, Sk) bool, True at a key: bool/integer True / nonzero, float not -inf."""
    if mask.dtype == torch.bool:
        return mask
    return ~torch.isneginf(mask) if mask.is_floating_point() else mask != 0

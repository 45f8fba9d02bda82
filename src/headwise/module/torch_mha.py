"""Conversion between :class:`headwise.MultiHeadAttention` and ``torch.nn.MultiheadAttention``
(the code of :meth:`headwise.MultiHeadAttention.from_torch` / ``to_torch``).

torch keeps q, k and v in one ``in_proj_weight`` (3E, E); headwise keeps three
projections, as the documents and Hugging Face models do. Both ways copy the weights.
Masks translate with :func:`headwise.masks.from_torch_masks` (torch's bool True means
*ignore*).

Legend: E embed dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from headwise.module.layer_protocol import Layer

__all__ = ["from_torch", "to_torch"]

_Built = TypeVar("_Built", bound=Layer)  # the class built: MultiHeadAttention or a subclass


def from_torch(module_class: Callable[..., _Built], m: nn.MultiheadAttention, **kwargs) -> _Built:
    """A batch-first :class:`~headwise.MultiHeadAttention` with ``m``'s weights (either ``batch_first``).

    Args:
        module_class: the class to build (:class:`~headwise.MultiHeadAttention` or a subclass).
        m: the torch module.
        **kwargs: other constructor arguments for the new module (``is_causal``, ``backend``, ...).

    Returns:
        The new module, in ``m``'s training mode, on its device and dtype; inputs (B, S, E).

    Raises:
        TypeError: ``m`` is not an ``nn.MultiheadAttention``.
        ValueError: features headwise does not model (``kdim``/``vdim`` other than
            ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``), or a ``v_head_dim`` of its
            own in ``kwargs`` (torch's value heads are ``E // H`` wide).

    >>> import headwise
    >>> from_torch(headwise.MultiHeadAttention, nn.MultiheadAttention(32, 4, batch_first=True)).num_heads
    4
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch expects torch.nn.MultiheadAttention, got {type(m).__name__}")
    if not m._qkv_same_embed_dim:
        raise ValueError(
            f"kdim ({m.kdim}) and vdim ({m.vdim}) must equal embed_dim ({m.embed_dim}); "
            "headwise projects keys and values from embed_dim-wide inputs"
        )
    v_head_dim = kwargs.get("v_head_dim")
    if v_head_dim is not None and v_head_dim != m.embed_dim // m.num_heads:
        raise ValueError(
            f"v_head_dim={v_head_dim}: torch.nn.MultiheadAttention's value heads are embed_dim // num_heads = "
            f"{m.embed_dim // m.num_heads} wide (its vdim is the width of the value input, not of a head); "
            "drop v_head_dim= to convert"
        )
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError(
            "add_bias_kv=True and add_zero_attn=True are not supported; "
            "append the extra key/value position to the inputs instead"
        )
    w = m.in_proj_weight  # (3E, E): q, k, v stacked
    bias = m.in_proj_bias is not None
    out = module_class(m.embed_dim, m.num_heads, m.dropout, bias=bias, device=w.device,
                                               dtype=w.dtype, **kwargs)
    E = m.embed_dim
    with torch.no_grad():
        for i, proj in enumerate((out.q_proj, out.k_proj, out.v_proj)):
            proj.weight.copy_(w[i * E:(i + 1) * E])  # (E, E)
            if bias:
                proj.bias.copy_(m.in_proj_bias[i * E:(i + 1) * E])
        out.out_proj.weight.copy_(m.out_proj.weight)
        if bias:
            out.out_proj.bias.copy_(m.out_proj.bias)
    return out.train(m.training)


def to_torch(mha: Layer, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """The equivalent ``torch.nn.MultiheadAttention``, weights copied.

    Args:
        mha: the headwise module.
        batch_first: the layout of the torch module's inputs.

    Raises:
        ValueError: what torch's module has no counterpart for: grouped-query heads,
            rotary positions, ALiBi, a sliding window (with or without sink tokens), q/k
            normalisation, soft-capping, sinks, a value head dim of its own, a causal
            default (torch's module takes causality per call, with a mask), biases on some
            projections only; and projections that are wrapped or replaced (merge first).
    """
    if mha.num_kv_heads != mha.num_heads:
        raise ValueError(
            f"torch.nn.MultiheadAttention has no grouped-query attention; this module has "
            f"num_kv_heads={mha.num_kv_heads} < num_heads={mha.num_heads}"
        )
    if mha.v_head_dim != mha.head_dim:
        raise ValueError(
            f"torch.nn.MultiheadAttention's value heads are embed_dim // num_heads = {mha.head_dim} wide; this "
            f"module has v_head_dim={mha.v_head_dim} (torch's vdim is the width of the value input, not of a "
            "head, so it cannot hold it)"
        )
    extras = [name for name, on in (("rope", mha.rope is not None),
                                    ("alibi", mha.alibi_slopes is not None),
                                    ("window", mha.window is not None),
                                    ("qk_norm", mha.qk_norm is not None),
                                    ("softcap", mha.softcap is not None),
                                    ("sinks", mha.sinks is not None)) if on]
    if extras:
        raise ValueError(f"torch.nn.MultiheadAttention has no {', '.join(extras)}; "
                         "build this module without them to convert it")
    if mha.is_causal:
        raise ValueError("this module is causal (is_causal=True) and torch.nn.MultiheadAttention has no causal "
                         "setting, only a per-call mask: build the module with is_causal=False to convert it, "
                         "and call the torch module with attn_mask=nn.Transformer.generate_square_subsequent_mask(S)"
                         " and is_causal=True")
    projections = (mha.q_proj, mha.k_proj, mha.v_proj)
    plain = [type(p) is nn.Linear for p in (*projections, mha.out_proj)]
    if not all(plain):
        names = [n for n, ok in zip(("q_proj", "k_proj", "v_proj", "out_proj"), plain, strict=True) if not ok]
        raise ValueError(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} not a plain nn.Linear (wrapped or "
                         "replaced, e.g. by PEFT); merge or unwrap first (PEFT: model.merge_and_unload())")
    biased = [p.bias is not None for p in (*projections, mha.out_proj)]
    if any(biased) and not all(biased):
        raise ValueError("torch.nn.MultiheadAttention has biases on all four projections or on none; this module "
                         f"has them on some ({biased}): give the others zero biases to convert it")
    w = mha.out_proj.weight
    m = nn.MultiheadAttention(mha.embed_dim, mha.num_heads, mha.dropout, bias=all(biased),
                              batch_first=batch_first, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))  # (3E, E): q, k, v rows stacked
        if all(biased):
            m.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
            m.out_proj.bias.copy_(mha.out_proj.bias)
        m.out_proj.weight.copy_(mha.out_proj.weight)
    return m.train(mha.training)

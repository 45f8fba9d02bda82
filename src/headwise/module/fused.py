"""The fused path: ``nn.MultiheadAttention``'s fused inference op for small calls.

``torch._native_multi_head_attention`` runs the qkv GEMM, SDPA and the output projection in
one C++ call, without the Python between them (8-12 us a call on one Zen 5 thread), but
with slower kernels than the dense path's as calls grow. So it takes small plain
self-attention calls without gradients: up to ``policy.FUSED_MAX_ELEMENTS`` elements in x
(``benchmarks/overhead.py --fused`` measures the crossover), no padding, no causal rule,
none of the module's extras.

The op reads the projections' weights instead of calling the modules, so it runs only
while all four are plain ``nn.Linear`` with biases, no hooks (theirs or global) and nothing
wrapping them; :func:`allowed` checks that on every call, remembered or not. The q, k and v
weights are rows of one storage (``module/qkv.py``), which the op takes as its (3E, E)
weight without a copy; where they no longer are (a weight given other memory), they are
concatenated for the call (never a cached copy, which a write through ``.data``, as PEFT's
``merge_and_unload`` does, could leave stale).

Legend: B batch, S query length, E embed dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from headwise import invariance, policy
from headwise import tracing as trace
from headwise.cache import KVCache
from headwise.module import checks, qkv
from headwise.module.layer_protocol import Layer


def global_module_hooks() -> bool:
    """Whether global nn.Module hooks (``register_module_forward_hook``) are set: the fused path
    would skip them for the projections."""
    return bool(getattr(torch_module, "_global_forward_hooks", None)
                or getattr(torch_module, "_global_forward_pre_hooks", None))


def _plain(m: nn.Module | None) -> bool:
    """A plain ``nn.Linear`` with a bias, no hooks, no parametrization (whose class differs) and
    plain weights (not a tensor subclass, as quantisation makes them). Reads the parameter dict
    itself: ``nn.Module.__getattr__`` costs about a microsecond a name, on every call."""
    if (m is None or type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
            or m._backward_pre_hooks):
        return False
    params = m._parameters
    bias = params.get("bias")  # .get: weight_norm / prune / spectral_norm take "weight" out of the dict
    return bias is not None and type(params.get("weight")) in _PLAIN and type(bias) in _PLAIN


_PLAIN = (nn.Parameter, torch.Tensor)
_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj")


def allowed(mha: Layer) -> bool:
    """Whether the op may read the projections' weights in place of calling them (not where
    a weight may be a dual or functorch-wrapped tensor: the op has no forward AD and no
    batching rule, see :func:`headwise.module.qkv.transformed`)."""
    if mha._forward_hooks or mha._forward_pre_hooks or global_module_hooks() or qkv.transformed():
        return False
    modules = mha._modules
    return all(_plain(modules[name]) for name in _LINEARS)


def why(mha: Layer, x: Tensor, padded: bool, context: Tensor | None, cache: KVCache | None,
        need_weights: bool, causal: bool) -> str | None:
    """Why "auto" runs this call on the fused path, or None where it does not."""
    if (mha.backend != "auto" or context is not None or cache is not None or need_weights
            or torch.is_grad_enabled() or trace.ACTIVE or torch.compiler.is_compiling()
            or invariance.is_batch_invariant()):  # torch's fused op blocks its GEMMs by the batch
        return None
    if (causal and x.shape[1] > 1) or padded:
        return None
    if (mha.num_kv_heads != mha.num_heads or mha.v_head_dim != mha.head_dim or mha.rope is not None
            or mha.q_norm is not None or mha.window is not None or checks.slopes(mha) is not None
            or mha.softcap is not None or checks.sinks(mha) is not None or (mha.training and mha.dropout > 0)):
        return None
    if not allowed(mha):
        return None
    w = mha.out_proj.weight
    if (not x.is_cpu or x.dtype not in (torch.float32, torch.float64) or x.dtype != w.dtype
            or torch.is_autocast_enabled("cpu") or not hasattr(torch, "_native_multi_head_attention")):
        return None
    n, E = x.numel(), mha.embed_dim
    if n > policy.FUSED_MAX_ELEMENTS or 3 * E * E > policy.FUSED_MAX_WEIGHT_COPY * n:
        return None
    return (f"B x S x E = {n} <= FUSED_MAX_ELEMENTS {policy.FUSED_MAX_ELEMENTS} without gradients: "
            "nn.MultiheadAttention's fused inference op (torch._native_multi_head_attention) runs the "
            "projections, attention and output projection in one call, without the Python between them "
            f"(and the q, k, v weights it copies, 3 E^2 = {3 * E * E}, are at most FUSED_MAX_WEIGHT_COPY "
            f"{policy.FUSED_MAX_WEIGHT_COPY} x B x S x E)")


def forward(mha: Layer, x: Tensor) -> Tensor:
    """(B, S, E) -> (B, S, E) in one op (the caller checked :func:`why` and :func:`allowed`)."""
    modules: dict[str, Any] = mha._modules
    out = modules["out_proj"]._parameters
    pack = qkv.packed(mha, False)
    if pack is not None and pack.bias is not None:
        qkv_weight, qkv_bias = pack.weight, pack.bias  # (3E, E), (3E,): the weights' own rows
    else:
        q, k, v = (modules[name]._parameters for name in _LINEARS[:3])
        qkv_weight = torch.cat([q["weight"], k["weight"], v["weight"]])  # (3E, E): q, k, v rows stacked
        qkv_bias = torch.cat([q["bias"], k["bias"], v["bias"]])  # (3E,)
    return torch._native_multi_head_attention(  # (B, S, E); its weights output: None
        x, x, x, mha.embed_dim, mha.num_heads, qkv_weight, qkv_bias, out["weight"], out["bias"], None, False)[0]

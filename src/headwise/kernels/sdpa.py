"""PyTorch's ``scaled_dot_product_attention``, held to headwise's mask contract.

Three things differ between torch's SDPA and our contract, and are handled here:

* ``is_causal=True`` in SDPA is top-left aligned; ours is bottom-right. They agree only
  when S == Sk, so that is the only case handed to SDPA's own causal path; otherwise the
  causal rule is folded into an explicit mask.
* SDPA cannot take a mask and ``is_causal`` together: they are combined into one mask,
  with the sliding window and the ALiBi bias when asked for.
* A query row that may attend nothing must give zeros and zero gradients on every torch
  version: such rows are unblocked before the call (so no 0/0 arises inside SDPA) and
  zeroed after it (so no gradient leaves them).

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise import tracing as trace
from headwise.kernels.registry import Kernel
from headwise.masks import alibi_bias, combined_mask, row_is_dead

_FUSED_NOTE = "scores, scaling, mask, softmax, dropout, weighted sum in F.scaled_dot_product_attention"

# enable_gqa arrived in torch 2.5; before it, kv heads are repeated (a copy).
_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float, scale: float) -> Tensor:
    """SDPA with one explicit mask (B|1, H|1, S|1, Sk), dead rows made safe: (B, H, S, D).

    Rows that may attend nothing are unblocked before the call (no 0/0 inside SDPA) and
    zeroed after it (no gradient leaves them). ``mask=None``: every key visible. Shared
    with the ``varlen`` kernel.
    """
    k, v, extra = _grouped(q, k, v)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, **extra)  # (B, H, S, D)
    dead = row_is_dead(mask)  # (B|1, H|1, S|1, 1)
    if dead.device.type == "cpu" and not bool(dead.any()):
        dead = None  # known live (reading it is free on the CPU): skip two passes over mask and output
    else:
        mask = mask | dead if mask.dtype == torch.bool else mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         **extra)  # (B, H, S, D)
    return out if dead is None else out.masked_fill(dead, 0.0)


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, dict]:
    """k, v and SDPA's extra arguments for grouped-query heads."""
    if k.shape[1] == q.shape[1]:
        return k, v, {}
    if SDPA_HAS_GQA:
        return k, v, {"enable_gqa": True}
    G = q.shape[1] // k.shape[1]
    # (B, Hkv, Sk, D) -> (B, H, Sk, D): a copy, only on torch < 2.5
    return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), {}


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    window: int | None = None,  # None: unlimited; else a causal sliding window of this many keys
    alibi_slopes: Tensor | None = None,  # None: no ALiBi; else (H,) slopes
) -> tuple[Tensor, Tensor | None]:
    S, Sk = q.shape[-2], k.shape[-2]
    structured = window is not None or alibi_slopes is not None
    if attention_mask is None and not structured and (not is_causal or S == Sk):
        k, v, extra = _grouped(q, k, v)
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        )  # (B, H, S, D)
        if trace.ACTIVE:
            trace.record("sdpa", out, _FUSED_NOTE + (" (causal)" if is_causal else ""), fused=True)
        return out, None
    mask = combined_mask(attention_mask, is_causal, S, Sk, q.device, window)  # (B|1, H|1, S|1, Sk)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes.to(q.dtype), S, Sk)  # (1, H, S, Sk)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = mask + bias
    out = sdpa_masked(q, k, v, mask, dropout_p=dropout_p, scale=scale)  # (B, H, S, D)
    if trace.ACTIVE:
        kind = str(mask.dtype).removeprefix("torch.")
        trace.record("sdpa", out, f"{_FUSED_NOTE} with a {tuple(mask.shape)} {kind} mask "
                     "(causal, window, ALiBi folded in); rows with nothing to attend zeroed", fused=True)
    return out, None


KERNEL = Kernel(
    name="sdpa",
    fn=sdpa_attention,
    summary="torch.nn.functional.scaled_dot_product_attention (fused where torch can)",
    native_gqa=SDPA_HAS_GQA,
    fused=True,
)

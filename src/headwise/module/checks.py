"""What :class:`~headwise.MultiHeadAttention` refuses, and with which words: the constructor's
settings and each call's inputs, checked before anything runs or changes.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, Dv value head dim, E embed dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from headwise.cache import KVCache
from headwise.kernels.registry import get_kernel
from headwise.masks import normalize_mask
from headwise.module import qkv
from headwise.module.layer_protocol import Layer


def divisors_near(n: int, around: int) -> str:
    """'4 or 5' style hint: the divisors of ``n`` just below and above ``around``."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divs if d < around]
    above = [d for d in divs if d > around]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(d) for d in picks)


def check_sizes(embed_dim: Any, num_heads: Any, num_kv_heads: Any, v_head_dim: Any) -> None:
    """The sizes: positive ints that divide (``embed_dim`` by ``num_heads``, ``num_heads`` by
    ``num_kv_heads``), and ``v_head_dim`` None or a positive int."""
    for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if embed_dim % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim}); "
                         f"try num_heads={divisors_near(embed_dim, num_heads)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}); "
                         f"try num_kv_heads={divisors_near(num_heads, num_kv_heads)}")
    if v_head_dim is not None and (isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int)
                                   or v_head_dim <= 0):
        raise ValueError(f"v_head_dim must be a positive int or None (None: head_dim), got {v_head_dim!r}")


def check_options(*, dropout: Any, packing: Any, window: Any, qk_norm: Any, qk_norm_eps: Any, softcap: Any,
                  sinks: Any, sink_tokens: Any) -> None:
    """The attention options, each alone."""
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(dropout).__name__} ({dropout!r})")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if not (packing == "auto" or packing is True or packing is False):
        raise ValueError(f"packing must be 'auto', True or False, got {packing!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (keys per query, its own included), got {window!r}")
    if qk_norm not in (None, "rms"):
        raise ValueError(f"qk_norm must be None or 'rms' (RMSNorm of each head's q and k), got {qk_norm!r}")
    if isinstance(qk_norm_eps, bool) or not isinstance(qk_norm_eps, (int, float)) or not qk_norm_eps > 0:
        raise ValueError(f"qk_norm_eps must be a positive number, got {qk_norm_eps!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__} ({softcap!r})")
        if not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be a finite number > 0 (Gemma 2 uses 50.0), got {softcap}")
    if not isinstance(sinks, bool):
        raise TypeError(f"sinks must be True or False (a learnable sink logit per head), got "
                        f"{type(sinks).__name__} ({sinks!r})")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if sink_tokens and window is None:
        raise ValueError(f"sink_tokens={sink_tokens} keeps the first positions visible under a sliding window; "
                         "give window=W too")


def check_context_parallel(context_parallel: Any, *, softcap: Any, sinks: bool, sink_tokens: int,
                           v_head_dim: int | None, head_dim: int) -> None:
    """What context parallelism cannot take (its ring merges and Ulysses' kernels)."""
    if context_parallel is None:
        return
    from headwise.distributed import ContextParallel

    if not isinstance(context_parallel, ContextParallel):
        raise TypeError("context_parallel must be a headwise.distributed.ContextParallel or None, got "
                        f"{type(context_parallel).__name__}")
    if softcap is not None or sinks:
        raise ValueError("context_parallel has no logit soft-capping or attention sinks (its ring merges and "
                         "Ulysses' kernels take neither); build the module without softcap/sinks, or without "
                         "context_parallel")
    if sink_tokens or (v_head_dim or head_dim) != head_dim:
        raise ValueError(f"context_parallel has no sink tokens and no v_head_dim of its own (got sink_tokens="
                         f"{sink_tokens}, v_head_dim={v_head_dim}); build the module without context_parallel")


# Whether autocast is on for any device type (torch's own flag read; the public per-type query
# is the fallback where this private one is missing).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def autocast_on(device: torch.device) -> bool:
    """Whether autocast is on for this device type (False for a type autocast does not know,
    such as ``meta``)."""
    if not _ANY_AUTOCAST():  # one flag read; the per-type query parses the type's name (~1.5 us)
        return False
    try:
        return torch.is_autocast_enabled(device.type)
    except RuntimeError:  # "unknown device type for autocast"
        return False


def reference_weight(mha: Layer) -> Tensor:
    """:meth:`~headwise.MultiHeadAttention.reference_weight`, read from the parameter dict
    where ``out_proj`` is a plain ``nn.Linear`` (``nn.Module.__getattr__`` costs about a
    microsecond a name, and every call reads it two or three times)."""
    out = mha._modules.get("out_proj")
    w = out._parameters.get("weight") if type(out) is nn.Linear else None
    return w if isinstance(w, Tensor) else mha.reference_weight()


def check_backend(backend: str, packing: bool | str) -> tuple[str, bool | str]:
    """The constructor's (backend, packing): a known backend (ValueError listing them)."""
    if backend != "auto":
        get_kernel(backend)  # ValueError listing the known backends
    return backend, packing


def backend(mha: Layer) -> str:
    """The kernel the module's attention calls ask for: ``mha.backend``, except that "auto"
    runs the plain-math ``"matmul"`` inside a ``torch.func`` transform or a forward-AD dual
    level: every op of it has forward AD and a batching rule, while SDPA's CPU kernel has
    neither and chunked's autograd Function has no forward AD."""
    if mha.backend != "auto" or not qkv.functorch_or_dual():
        return mha.backend
    return "matmul"


def slopes(mha: Layer) -> Tensor | None:
    """``mha.alibi_slopes`` (H,) or None, read from the buffer dict: a registered buffer's
    attribute read goes through ``nn.Module.__getattr__`` (about a microsecond on one Zen 5
    thread, a visible share of a decoding step)."""
    return mha._buffers.get("alibi_slopes")


def sinks(mha: Layer) -> Tensor | None:
    """``mha.sinks`` (H,) or None, read from the parameter dict (see :func:`slopes`)."""
    return mha._parameters.get("sinks")


def check_tensor(mha: Layer, name: str, t: Tensor) -> None:
    """``t`` (x or context) must be floating, on the parameters' device, and of their dtype
    (under autocast, any floating dtype: autocast casts the projections' inputs)."""
    w = reference_weight(mha)
    if not t.is_floating_point():
        raise TypeError(f"{name} has dtype {t.dtype}; the module takes floating inputs (its parameters are "
                        f"{w.dtype}): pass {name}.to({w.dtype})")
    if t.device != w.device:
        raise ValueError(f"{name} is on {t.device} but the module's parameters are on {w.device}; move one "
                         f"to the other: {name}.to({str(w.device)!r}) or mha.to({str(t.device)!r})")
    if t.dtype == w.dtype:
        return
    # autocast casts float32 / float16 / bfloat16 tensors, never float64 ones (x's or the weights')
    castable = torch.float64 not in (t.dtype, w.dtype)
    if castable and autocast_on(t.device):
        return
    under = " under torch.autocast, which does not cast float64" if not castable and autocast_on(t.device) else ""
    raise TypeError(f"{name} has dtype {t.dtype} but the module's parameters are {w.dtype}{under}; convert one "
                    f"to the other: {name}.to({w.dtype}) or mha.to({t.dtype})"
                    + (" (or run under torch.autocast)" if castable else ""))


def check_inputs(mha: Layer, x: Any, context: Any, cache: Any) -> None:
    """x (B, S, E), context (B, Sk, E) or None, and a cache that fits this module."""
    if cache is not None:
        check_cache(mha, cache, x, context)
    if mha.rope is not None and context is not None:
        raise ValueError("rotary embeddings (rope) are for self-attention; drop context= or rope")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != mha.embed_dim:
        raise ValueError(f"x must be (B, S, E) with E = embed_dim = {mha.embed_dim}, got shape {tuple(x.shape)}"
                         + ("; add a batch dimension with x.unsqueeze(0)" if x.dim() == 2 else ""))
    check_tensor(mha, "x", x)
    if context is None:
        return
    if not isinstance(context, Tensor):
        raise TypeError(f"context must be a torch.Tensor or None, got {type(context).__name__}")
    if context.dim() != 3 or context.shape[-1] != mha.embed_dim:
        raise ValueError(f"context must be (B, Sk, E) with E = embed_dim = {mha.embed_dim}, got shape "
                         f"{tuple(context.shape)}")
    if context.shape[0] != x.shape[0]:
        raise ValueError(f"context batch ({context.shape[0]}) differs from x batch ({x.shape[0]})")
    check_tensor(mha, "context", context)


def check_cache(mha: Layer, cache: Any, x: Any, context: Any) -> None:
    """A cache from this module's :meth:`new_cache` (or one of the same shapes), stepped
    without gradients, with room for x's positions."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must come from mha.new_cache(...), got {type(cache).__name__}")
    if context is not None:
        raise ValueError("cache is for self-attention; cross-attention (context=...) takes no cache")
    if torch._C._functorch.maybe_current_level() is not None:
        raise ValueError("a cache step writes the cache's buffers, which live outside torch.func's transforms (vmap, "
                         "grad, jvp, ...) and cannot hold their values; call the module without cache= inside the "
                         "transform, or decode outside it")
    _, Hkv, _, D = cache.k.shape
    Dv, w = cache.v.shape[-1], reference_weight(mha)
    want = (mha.num_kv_heads, mha.head_dim, mha.v_head_dim, w.dtype, w.device)
    if (Hkv, D, Dv, cache.k.dtype, cache.k.device) != want:
        raise ValueError(f"the cache holds kv_heads={Hkv}, head_dim={D}, value_dim={Dv}, {cache.k.dtype} on "
                         f"{cache.k.device}; this module needs kv_heads={want[0]}, head_dim={want[1]}, "
                         f"value_dim={want[2]}, {want[3]} on {want[4]}: make the cache with this module's "
                         "new_cache(batch_size, max_seq_len)")
    if isinstance(x, Tensor) and x.dim() == 3:
        cache.check(x.shape[0], x.shape[1])



def check_mask(mha: Layer, x: Tensor, mask: Any, context: Tensor | None,
               cache: KVCache | None) -> None:
    """Refuse, before anything runs or changes, a mask that :meth:`forward` would refuse
    (the kernels' :func:`~headwise.masks.normalize_mask`, and a cache's own rules)."""
    if mask is None or mha.context_parallel is not None:  # context parallelism checks its shards itself
        return
    B, S = x.shape[:2]
    Sk = S if context is None else context.shape[1]
    if cache is not None:
        if isinstance(mask, Tensor):
            cache.check_mask(mask, S)  # what a cache step takes (before normalize_mask's general rules)
        if cache.static:  # (B, T), checked by the cache; its length is a tensor (no host read)
            Sk = S if isinstance(mask, Tensor) and mask.dim() == 2 else cache.max_seq_len
        else:
            Sk = sum(cache.kept()) + S  # the keys the step attends
            if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[-1] in (S, len(cache) + S):
                Sk = mask.shape[-1]  # the new positions' padding, or every position's (remembered)
    normalize_mask(mask, batch=B, heads=mha.num_heads, q_len=S, k_len=Sk, device=x.device,
                   dtype=reference_weight(mha).dtype)

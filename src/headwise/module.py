"""``MultiHeadAttention``: projections and head bookkeeping around :func:`headwise.attention`.

The module owns the parameters; the kernels (``headwise.kernels``) own the arithmetic.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim (of q and k), Dv value head dim (``v_head_dim``, D unless given), E embed dim.

The q, k and v projections live in one parameter, ``qkv_weight`` (E + Hkv * D + Hkv * Dv, E)
(and ``qkv_bias``), so self-attention projects with one GEMM, as a hand-written module
with a fused qkv ``nn.Linear`` does; ``q_proj``, ``k_proj`` and ``v_proj`` stay, as views
of its rows (``mha.q_proj.weight`` reads and writes the fused parameter; an optimizer
trains the fused one).

State dict (separate projections, as the documents and Hugging Face models keep them; a
fused ``qkv_weight`` / ``qkv_bias`` entry loads too)::

    q_proj.weight   (E, E)         q_proj.bias   (E,)
    k_proj.weight   (Hkv * D, E)   k_proj.bias   (Hkv * D,)
    v_proj.weight   (Hkv * Dv, E)  v_proj.bias   (Hkv * Dv,)
    out_proj.weight (E, H * Dv)    out_proj.bias (E,)
    sinks           (H,)           with sinks=True only

(no ``*.bias`` entries when ``bias=False``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from headwise import convert, functional, packing, policy
from headwise import tracing as trace
from headwise.cache import KVCache
from headwise.deprecation import moved, warn_once
from headwise.dispatch import Dispatch
from headwise.functional import Prepared, attend, choose_backend
from headwise.kernels.registry import get_kernel
from headwise.masks import _canonical as canonical_mask
from headwise.masks import alibi_slopes, normalize_mask
from headwise.positions import RotaryEmbedding, apply_rotary

__all__ = ["FusedProjection", "MultiHeadAttention", "Plan"]

__getattr__ = moved(__name__, {"PACK_MIN_PADDING": (policy, "headwise.policy.PACK_MIN_PADDING")})


class FusedProjection(nn.Module):
    """``q_proj`` / ``k_proj`` / ``v_proj`` of a :class:`MultiHeadAttention`: rows ``[start,
    stop)`` of its fused ``qkv_weight`` / ``qkv_bias``, as an ``nn.Linear`` would show them.

    ``weight`` and ``bias`` are views (no parameters of its own): writing into them writes
    the fused parameter, and gradients reach the fused parameter.
    """

    _owner: MultiHeadAttention

    def __init__(self, owner: MultiHeadAttention, start: int, stop: int) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not a submodule: the owner holds this one
        self.start, self.stop = start, stop
        self.in_features, self.out_features = owner.embed_dim, stop - start

    @property
    def weight(self) -> Tensor:
        return self._owner.qkv_weight[self.start:self.stop]  # (out_features, E), a view

    @property
    def bias(self) -> Tensor | None:
        b = self._owner.qkv_bias
        return None if b is None else b[self.start:self.stop]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # (.., E) -> (.., out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rows {self.start}:{self.stop} of qkv_weight")


@dataclass(frozen=True)
class Plan:
    """How one call of the module runs, decided before any arithmetic.

    :meth:`MultiHeadAttention.forward` follows it and :meth:`MultiHeadAttention.dispatch`
    reports it, so the two cannot disagree.

    Attributes:
        path: ``"dense"`` (the (B, S) batch, padding included), ``"packed"`` (only the real
            tokens: projections on (T, E), attention per length bucket), ``"fused"`` (a small
            call without gradients: ``nn.MultiheadAttention``'s fused inference op runs the
            projections, attention and output projection in one call) or
            ``"context parallel"`` (this rank's shard of the sequence).
        why: why this path, in one sentence.
        is_causal: the causal flag in effect (the call's, else the constructor's).
        padding: (B, S) bool, True where x holds a real token, when a 2-D mask describes
            x's tokens; else None.
        lengths: the real tokens of each row of ``padding``, where its values were read
            (on the CPU, outside torch.compile); else None.
    """

    path: str
    why: str
    is_causal: bool
    padding: Tensor | None
    lengths: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Repeat:
    """What a repeated call signature of :meth:`MultiHeadAttention.forward` reuses: its plan
    but the tensors, and on the dense path the attention call that
    :func:`headwise.functional.prepare` checked and dispatched (None: ``attend`` runs in full)."""

    path: str
    why: str
    is_causal: bool
    attention: Prepared | None
    padded: bool  # the mask has padding (False: every position is a token, the mask is dropped)

    def current(self) -> bool:
        """Whether the remembered attention call's kernel is still the registered one."""
        return self.attention is None or self.attention.current()


_REPEATS_LIMIT = 64  # call signatures a module remembers; it starts over when full


def _all_tokens(lengths: tuple[int, ...] | None, S: int) -> bool:
    """Whether read real-token counts say every one of the S positions is a token (no padding)."""
    return lengths is not None and all(n == S for n in lengths)


def _global_module_hooks() -> bool:
    """Whether global nn.Module hooks (``register_module_forward_hook``) are set: the fused path
    would skip them for ``out_proj``."""
    from torch.nn.modules import module as torch_module

    return bool(getattr(torch_module, "_global_forward_hooks", None)
                or getattr(torch_module, "_global_forward_pre_hooks", None))


def _divisors_near(n: int, around: int) -> str:
    """'4 or 5' style hint: the divisors of ``n`` just below and above ``around``."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divs if d < around]
    above = [d for d in divs if d > around]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(d) for d in picks)


@functools.lru_cache(maxsize=1024)
def _price_packing(lengths: tuple[int, ...], S: int, E: int, H: int, Hkv: int, causal: bool, training: bool,
                   costs: policy.Costs, limit: float, bucketing: tuple[float, int]) -> tuple[str, str]:
    """"auto"'s packing choice for a (B, S) batch of these real lengths: ("packed" or "dense", why).

    A pure function of its arguments (the unit costs, the threshold and the bucketing
    policy ``bucketing`` that ``packing.bucket_shapes`` reads are among them), so a training
    loop over recurring batch shapes pays a look-up, not the bucketing and pricing.
    """
    B = len(lengths)
    share = 1.0 - sum(lengths) / max(B * S, 1)
    if share < limit:
        return "dense", f"{share:.0%} of the batch is padding (< PACK_MIN_PADDING {limit:.0%}): nothing to save"
    buckets = packing.bucket_shapes(lengths, lengths)
    estimate = policy.estimate_packing(B, S, E, H, Hkv, buckets, is_causal=causal, training=training, costs=costs)
    kind = "forward + backward" if training else "forward"
    if estimate.packs:
        return "packed", f"{share:.0%} of the batch is padding; {kind} {estimate}"
    return "dense", f"{share:.0%} of the batch is padding, but {kind} {estimate}"


def _zero_padding(t: Tensor, padding: Tensor) -> Tensor:
    """``t`` (B, S, E) with zeros where ``padding`` (B, S) is False (padded positions), whatever
    ``t`` holds there, NaN and inf included (the NaN/inf contract: a padded position never
    reaches a result).

    Not a product with the 0/1 mask (``NaN * 0`` is NaN), and not a broadcast ``masked_fill``
    or ``torch.where`` (on the CPU about 7x the product's time). Where the mask's values can
    be read, ``index_fill`` of the padded rows: about 2x the product forward and faster in
    backward (measured at B=8, S=64, E=128 on one Zen 5 thread). In place on a fresh tensor
    without autograd (``out_proj``'s output), which saves allocating a (B, S, E) buffer;
    otherwise a copy (x itself is never written).
    """
    if not policy.reads_values(padding):  # on an accelerator, or traced: no host read of the mask
        return torch.where(padding.unsqueeze(-1), t, t.new_zeros(()))  # (B, S, E)
    rows = (~padding).flatten().nonzero().squeeze(1)  # (P,) flat indices of the padded positions
    if rows.numel() == 0:
        return t
    flat = t.reshape(-1, t.shape[-1])  # (B * S, E)
    return flat.index_fill(0, rows, 0).view(t.shape)  # (B, S, E)


def _packed_lengths(cu_seqlens: Tensor, lengths: tuple[int, ...] | None, T: int) -> tuple[int, ...]:
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
    steps = [b - a for a, b in itertools.pairwise(offsets)]
    if any(n < 0 for n in steps):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens must end at the {T} rows of x, got {offsets[-1]} ({offsets})")
    if lengths is not None and lengths != tuple(steps):
        raise ValueError(f"lengths {lengths} are not the differences of cu_seqlens {offsets} ({tuple(steps)}); "
                         "pass lengths=None to read them from cu_seqlens")
    return tuple(steps)


def _as_padding(mask: Tensor) -> Tensor:
    """A 2-D key mask as (B|1, Sk) bool, True at a key: bool/integer True / nonzero, float not -inf."""
    if mask.dtype == torch.bool:
        return mask
    return ~torch.isneginf(mask) if mask.is_floating_point() else mask != 0


def _zero_padding_(out: Tensor, padding: Tensor) -> Tensor:
    """:func:`_zero_padding` in place where ``out`` (a fresh, contiguous output) takes no gradient."""
    if out.requires_grad or not out.is_contiguous() or not policy.reads_values(padding):
        return _zero_padding(out, padding)
    rows = (~padding).flatten().nonzero().squeeze(1)  # (P,) flat indices of the padded positions
    out.view(-1, out.shape[-1]).index_fill_(0, rows, 0)  # (B * S, E), in place
    return out


class MultiHeadAttention(nn.Module):
    """Multi-head attention with one NaN-free mask contract and interchangeable kernels.

    Args:
        embed_dim: E, the model width; input and output are (B, S, E).
        num_heads: H, the number of query heads; ``E % H == 0`` and ``D = E // H``.
        dropout: dropout probability on the attention weights, in [0, 1), active in
            training mode only.
        bias: add biases to the four projections.
        num_kv_heads: Hkv, the number of key/value heads (None: H, plain multi-head;
            1: multi-query; otherwise grouped-query with ``H % Hkv == 0``).
        is_causal: default causal flag for :meth:`forward`.
        backend: the kernel: ``"auto"`` or a name from :func:`headwise.available_backends`.
        packing: the padding-free path for self-attention with a 2-D padding mask: ``True``
            always takes it (projections on the real tokens only, attention per length
            bucket), ``False`` never, ``"auto"`` where the kernel is ``"auto"`` and
            :func:`headwise.policy.estimate_packing` prices the packed path under the dense
            one (:meth:`plan` gives both prices). (``backend="varlen"`` used to
            mean ``packing=True``; without ``packing=`` it still does, with a warning; with
            ``packing=`` given it names the kernel.)
        rope_parameters: Hugging Face's ``config.rope_parameters`` dict (``rope_type``
            "default", "linear", "dynamic", "llama3" or "yarn" with its keys; ``rope_theta``
            and ``partial_rotary_factor`` optional; "dynamic" also takes the config's
            ``max_position_embeddings``): rotary positions scaled as transformers scales
            them; see :class:`~headwise.positions.RotaryEmbedding`. Turns rope on.
        rotary_dim: R <= D: only the first R dims of each head rotate, the rest pass
            through (partial rotary, GPT-NeoX / Phi). Turns rope on.
        qk_norm: ``"rms"``: an RMSNorm over D of each head's q and k, after the head split
            and before rope, with learned weights ``q_norm.weight`` and ``k_norm.weight``
            (D,) shared by the heads (``torch.nn.RMSNorm``), as Qwen3 does. None: none.
        qk_norm_eps: the epsilon of those norms.
        softcap: logit soft-capping, ``softcap * tanh(scores / softcap)`` on the scaled
            scores before ALiBi and the mask, as Gemma 2 does (None: none).
        sinks: True adds a learnable ``sinks`` parameter (H,), one sink logit per query
            head, initialised to zeros (each row's softmax then starts with one extra
            ``exp(0)`` in its denominator); the sink takes probability mass and adds
            nothing to the output, as in gpt-oss. It is in the state dict as ``sinks``.
        sink_tokens: with ``window``, the first ``sink_tokens`` positions stay visible to every
            later query (StreamingLLM's attention sinks; see :func:`headwise.attention`).
        v_head_dim: Dv, the values' head dim (None: D = E // H): ``v_proj`` is (Hkv * Dv, E)
            and ``out_proj`` (E, H * Dv), as multi-head latent attention (DeepSeek-V2) has.
        context_parallel: a :class:`headwise.distributed.ContextParallel`: :meth:`forward`
            then takes this rank's shard (B, S_l, E) of the sequence (and of a 2-D mask)
            and attends over every rank's keys (rotary positions are global); no cache,
            weights, packed path or dropout.
        device, dtype: where and how to create the parameters.

    Raises:
        ValueError: sizes that do not divide, dropout outside [0, 1), unknown backend,
            packing not "auto" / True / False, rope parameters that do not fit (named),
            qk_norm not None / "rms", softcap not > 0, softcap or sinks with
            context_parallel.
        TypeError: sizes that are not integers, softcap not a number, sinks not a bool.

    >>> mha = MultiHeadAttention(128, 8)
    >>> x = torch.rand(3, 2, 128)
    >>> mha(x, torch.tensor([[1, 1], [1, 0], [1, 0]])).shape
    torch.Size([3, 2, 128])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        bias: bool = True,
        num_kv_heads: int | None = None,  # None: num_heads (no grouping)
        is_causal: bool = False,
        backend: str = "auto",
        packing: bool | str = "auto",  # "auto": where the cost model prices it lower (policy.estimate_packing)
        rope: bool = False,
        rope_base: float | None = None,  # None: 10000 when rope=True; a value turns rope on
        alibi: bool = False,
        window: int | None = None,  # None: unlimited; W: query i sees keys (i - W, i]
        rope_parameters: Mapping[str, Any] | None = None,  # None: plain rope; else Hugging Face's, turns rope on
        rotary_dim: int | None = None,  # None: all D dims rotate (or partial_rotary_factor); a value turns rope on
        qk_norm: str | None = None,  # None: no normalisation; "rms": RMSNorm of each head's q and k before rope
        qk_norm_eps: float = 1e-6,
        softcap: float | None = None,  # None: no logit soft-capping
        sinks: bool = False,  # True: a learnable (H,) sink logit per head (gpt-oss)
        sink_tokens: int = 0,  # 0: none; n: keys 0..n-1 stay visible under the window (StreamingLLM)
        v_head_dim: int | None = None,  # None: head_dim; Dv: the values' (and out_proj's input's) size per head
        context_parallel=None,  # None: one process; a headwise.distributed.ContextParallel splits the sequence
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if embed_dim % num_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must divide embed_dim ({embed_dim}); "
                f"try num_heads={_divisors_near(embed_dim, num_heads)}"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}); "
                f"try num_kv_heads={_divisors_near(num_heads, num_kv_heads)}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if not (packing == "auto" or packing is True or packing is False):
            raise ValueError(f"packing must be 'auto', True or False, got {packing!r}")
        if backend == "varlen" and packing == "auto":  # the module's old name for its packed path
            warn_once("MultiHeadAttention(backend='varlen')",
                      "MultiHeadAttention(backend='varlen') is now packing=True: 'varlen' names the kernel that "
                      "drops padded keys, and the module's padding-free path is packing=; backend='varlen' keeps "
                      "meaning packing=True with 'auto' kernels for now (with packing= given, 'varlen' is the kernel)")
            backend, packing = "auto", True
        if backend != "auto":
            get_kernel(backend)  # ValueError listing the known backends
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
        if context_parallel is not None and (softcap is not None or sinks):
            raise ValueError("context_parallel has no logit soft-capping or attention sinks (its ring merges and "
                             "Ulysses' kernels take neither); build the module without softcap/sinks, or without "
                             "context_parallel")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and window is None:
            raise ValueError(f"sink_tokens={sink_tokens} keeps the first positions visible under a sliding window; "
                             "give window=W too")
        if v_head_dim is not None and (isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int)
                                       or v_head_dim <= 0):
            raise ValueError(f"v_head_dim must be a positive int or None (None: head_dim), got {v_head_dim!r}")
        if context_parallel is not None and (sink_tokens or (v_head_dim or embed_dim // num_heads)
                                             != embed_dim // num_heads):
            raise ValueError(f"context_parallel has no sink tokens and no v_head_dim of its own (got sink_tokens="
                             f"{sink_tokens}, v_head_dim={v_head_dim}); build the module without context_parallel")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.v_head_dim = self.head_dim if v_head_dim is None else v_head_dim
        self.sink_tokens = sink_tokens
        self.dropout = float(dropout)
        self.is_causal = bool(is_causal)
        self.backend = backend
        self.packing = packing
        kv_dim, v_dim = num_kv_heads * self.head_dim, num_kv_heads * self.v_head_dim
        rows = embed_dim + kv_dim + v_dim
        self.qkv_weight = nn.Parameter(torch.empty(rows, embed_dim, device=device, dtype=dtype))  # q, k, v rows
        self.qkv_bias = nn.Parameter(torch.empty(rows, device=device, dtype=dtype)) if bias else None
        self._reset_qkv()
        self.q_proj = FusedProjection(self, 0, embed_dim)
        self.k_proj = FusedProjection(self, embed_dim, embed_dim + kv_dim)
        self.v_proj = FusedProjection(self, embed_dim + kv_dim, rows)
        self.register_load_state_dict_pre_hook(self._fuse_loaded_projections)
        self.out_proj = nn.Linear(num_heads * self.v_head_dim, embed_dim, bias=bias, device=device,
                                  dtype=dtype)  # (E, H * Dv)
        self.window = window
        self.rope = None
        if rope or rope_base is not None or rope_parameters is not None or rotary_dim is not None:
            self.rope = RotaryEmbedding(self.head_dim, rope_base, rotary_dim=rotary_dim, scaling=rope_parameters)
        self.qk_norm = qk_norm
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if qk_norm == "rms":  # one weight of size D, shared by the heads (Qwen3's q_norm / k_norm)
            self.q_norm = nn.RMSNorm(self.head_dim, eps=float(qk_norm_eps), device=device, dtype=dtype)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=float(qk_norm_eps), device=device, dtype=dtype)
        if context_parallel is not None:
            from headwise.distributed import ContextParallel

            if not isinstance(context_parallel, ContextParallel):
                raise TypeError("context_parallel must be a headwise.distributed.ContextParallel or None, got "
                                f"{type(context_parallel).__name__}")
        self.context_parallel = context_parallel
        self.alibi_slopes: Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None,
                             persistent=False)
        self.softcap = None if softcap is None else float(softcap)
        self.sinks: nn.Parameter | None
        if sinks:  # zeros: each row's denominator starts with exp(0) for the sink
            self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
        else:
            self.register_parameter("sinks", None)
        # forward's decisions per call signature (see _signature); any setting changed clears it
        self._repeats: dict[tuple, _Repeat] = {}

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        repeats = self.__dict__.get("_repeats")
        if repeats:  # a setting changed (backend, packing, dropout, a parameter, ...): decide afresh
            repeats.clear()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.__dict__.get("_repeats", {}).clear()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_repeats"] = {}  # the remembered kernels are this process's registrations
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_repeats", {})  # pickled before forward remembered signatures

    def _reset_qkv(self) -> None:
        """nn.Linear's initialisation for each of the three projections (fan_in = E for all)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.qkv_weight, a=math.sqrt(5))  # the same per block: fan_in is E
            if self.qkv_bias is not None:
                bound = 1 / math.sqrt(self.embed_dim)
                nn.init.uniform_(self.qkv_bias, -bound, bound)

    def _fuse_loaded_projections(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                                 unexpected_keys, error_msgs) -> None:
        """Load hook: q_proj.* / k_proj.* / v_proj.* entries (the saved layout, and older
        checkpoints) become the fused qkv_weight / qkv_bias."""
        for kind in ("weight", "bias"):
            names = [f"{prefix}{p}.{kind}" for p in ("q_proj", "k_proj", "v_proj")]
            present = [n in state_dict for n in names]
            if all(present) and f"{prefix}qkv_{kind}" not in state_dict:
                state_dict[f"{prefix}qkv_{kind}"] = torch.cat([state_dict.pop(n) for n in names])
            elif any(present):  # a partial set: leave the pieces for load_state_dict to report
                continue

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Save the q, k, v projections under their own names, as the documents' modules do."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for kind in ("weight", "bias"):
            fused = destination.pop(f"{prefix}qkv_{kind}", None)
            if fused is None:
                continue
            for name, proj in (("q_proj", self.q_proj), ("k_proj", self.k_proj), ("v_proj", self.v_proj)):
                destination[f"{prefix}{name}.{kind}"] = fused[proj.start:proj.stop]

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        rope = self.rope
        extras = "".join([
            f", rope_base={rope.base:g}" if rope is not None else "",
            f", rope_type={rope.rope_type!r}" if rope is not None and rope.rope_type != "default" else "",
            f", rotary_dim={rope.rotary_dim}" if rope is not None and rope.rotary_dim != self.head_dim else "",
            f", qk_norm={self.qk_norm!r}" if self.qk_norm is not None else "",
            ", alibi=True" if self.alibi_slopes is not None else "",
            f", window={self.window}" if self.window is not None else "",
            f", softcap={self.softcap:g}" if self.softcap is not None else "",
            ", sinks=True" if self.sinks is not None else "",
            f", sink_tokens={self.sink_tokens}" if self.sink_tokens else "",
            f", v_head_dim={self.v_head_dim}" if self.v_head_dim != self.head_dim else "",
            f", context_parallel={self.context_parallel}" if self.context_parallel is not None else "",
        ])
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, is_causal={self.is_causal}, "
            f"backend={self.backend!r}" + (f", packing={self.packing!r}" if self.packing != "auto" else "")
            + extras
        )

    def new_cache(self, batch_size: int, max_seq_len: int, *, static: bool = False,
                  evict: bool = False) -> KVCache:
        """A preallocated key/value cache for incremental decoding with this module.

        Args:
            batch_size: B of the batches that will be decoded.
            max_seq_len: the most positions the cache will hold (prompt included).
            static: same shapes at every step (writes at a position tensor, attention over
                all ``max_seq_len`` positions through a mask): one ``torch.compile`` graph
                for every decoding step; see :class:`~headwise.cache.KVCache`.
            evict: (a module with a window) drop what the window can no longer see, keeping
                the ``sink_tokens`` first positions and the last ``window - 1``: the cache
                then holds at most ``sink_tokens + window - 1 + T`` positions for a step of
                T, however long the sequence, and ``max_seq_len`` need only cover that.
                Opt-in: the buffers then no longer hold position p at slot p.

        Returns:
            An empty :class:`~headwise.cache.KVCache` on this module's device and dtype.

        Raises:
            ValueError: non-positive sizes; ``evict=True`` without a window or with ``static=True``.

        >>> mha = MultiHeadAttention(32, 4, window=4, sink_tokens=1)
        >>> cache = mha.new_cache(1, 8, evict=True)
        >>> with torch.no_grad():
        ...     for _ in range(20):
        ...         _ = mha(torch.rand(1, 1, 32), cache=cache)
        >>> len(cache), cache.held
        (20, 5)
        """
        if evict and self.window is None:
            raise ValueError("evict=True drops what a sliding window can no longer see; this module has no window "
                             "(MultiHeadAttention(..., window=W)), so every cached position stays visible")
        w = self.qkv_weight
        return KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim,
                       device=w.device, dtype=w.dtype, static=static, value_dim=self.v_head_dim,
                       window=self.window if evict else None, sink_tokens=self.sink_tokens if evict else 0)

    def _check(self, x: Tensor, context: Tensor | None, cache: KVCache | None = None) -> None:
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must come from mha.new_cache(...), got {type(cache).__name__}")
            if context is not None:
                raise ValueError("cache is for self-attention; cross-attention (context=...) takes no cache")
            if isinstance(x, Tensor) and x.dim() == 3:
                cache.check(x.shape[0], x.shape[1])
        if self.rope is not None and context is not None:
            raise ValueError("rotary embeddings (rope) are for self-attention; drop context= or rope")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must be (B, S, E) with E = embed_dim = {self.embed_dim}, got shape "
                f"{tuple(x.shape)}"
                + ("; add a batch dimension with x.unsqueeze(0)" if x.dim() == 2 else "")
            )
        self._check_dtype_device("x", x)
        if context is None:
            return
        if not isinstance(context, Tensor):
            raise TypeError(f"context must be a torch.Tensor or None, got {type(context).__name__}")
        if context.dim() != 3 or context.shape[-1] != self.embed_dim:
            raise ValueError(
                f"context must be (B, Sk, E) with E = embed_dim = {self.embed_dim}, got shape "
                f"{tuple(context.shape)}"
            )
        if context.shape[0] != x.shape[0]:
            raise ValueError(
                f"context batch ({context.shape[0]}) differs from x batch ({x.shape[0]})"
            )
        self._check_dtype_device("context", context)

    def _check_dtype_device(self, name: str, t: Tensor) -> None:
        """``t`` (x or context) must be floating, on the parameters' device, and of their dtype
        (under autocast, any floating dtype: autocast casts the projections' inputs)."""
        w = self.qkv_weight
        if not t.is_floating_point():
            raise TypeError(f"{name} has dtype {t.dtype}; the module takes floating inputs (its parameters are "
                            f"{w.dtype}): pass {name}.to({w.dtype})")
        if t.device != w.device:
            raise ValueError(f"{name} is on {t.device} but the module's parameters are on {w.device}; move one "
                             f"to the other: {name}.to({str(w.device)!r}) or mha.to({str(t.device)!r})")
        if t.dtype != w.dtype and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(f"{name} has dtype {t.dtype} but the module's parameters are {w.dtype}; convert one "
                            f"to the other: {name}.to({w.dtype}) or mha.to({t.dtype}) (or run under "
                            "torch.autocast)")

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The three projections of (B, S, E) inputs, or of packed (T, E) tokens."""
        E, kv, kv_v = self.embed_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.v_head_dim
        if context is None:  # self-attention: one GEMM for q, k and v
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split([E, kv, kv_v], dim=-1)
            # (.., E) -> (.., E), (.., Hkv*D), (.., Hkv*Dv)
        else:  # cross-attention: q from x, k and v (one GEMM) from the context
            b = self.qkv_bias
            q = F.linear(x, self.qkv_weight[:E], None if b is None else b[:E])  # (.., E)
            k, v = F.linear(context, self.qkv_weight[E:], None if b is None else b[E:]).split([kv, kv_v], dim=-1)
        if trace.ACTIVE:
            self._record_projections(q, k, v, x.dim() == 3, context is None)
        return q, k, v

    @staticmethod
    def _record_projections(q: Tensor, k: Tensor, v: Tensor, batched: bool, self_attention: bool) -> None:
        rows, keys = ("B, S", "B, Sk") if batched else ("T", "T")
        src = "x" if self_attention else "context"
        trace.record("q projection", q, f"q_proj(x): ({rows}, E) x (E, E)^T + b")
        trace.record("k projection", k, f"k_proj({src}): ({keys}, E) x (Hkv*D, E)^T + b")
        if v.shape[-1] == k.shape[-1]:
            trace.record("v projection", v, f"v_proj({src}): ({keys}, E) x (Hkv*D, E)^T + b")
        else:  # v_head_dim: values of their own head dim
            trace.record("v projection", v, f"v_proj({src}): ({keys}, E) x (Hkv*Dv, E)^T + b, Hkv*Dv = {v.shape[-1]}")

    def _project_heads(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """(B, S, E) inputs -> q (B, H, S, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv): projections, then heads."""
        if context is not None or self.v_head_dim != self.head_dim:  # heads of two widths: split q, k, v first
            return self._split_heads(*self._project(x, context))
        # Self-attention: the heads of the one qkv GEMM's output, q, k and v side by side, are
        # split in one go: 5 view ops where splitting q, k, v first takes 7. Splitting before
        # the transpose keeps the backward to one copy (the split's concatenation lands in the
        # GEMM's layout); split after it, the backward copied twice (~5% of a training step
        # at B=8, S=64, E=128 on one Zen 5 thread).
        # Without gradients and with as many kv heads as query heads, one permute and an
        # unbind do it in 3 view ops (~3 us less a call).
        H, Hkv = self.num_heads, self.num_kv_heads
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # (B, S, E + 2 * Hkv * D)
        if Hkv == H and not qkv.requires_grad:
            q, k, v = qkv.unflatten(-1, (3, H, self.head_dim)).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, S, D)
        else:
            heads = qkv.unflatten(-1, (H + 2 * Hkv, self.head_dim))  # -> (B, S, H + 2 Hkv, D)
            q, k, v = (t.transpose(1, 2) for t in heads.split([H, Hkv, Hkv], dim=2))  # (B, H|Hkv, S, D)
        if trace.ACTIVE:
            E, kv = self.embed_dim, Hkv * self.head_dim
            q_rows, k_rows, v_rows = qkv.split([E, kv, kv], dim=-1)  # (B, S, E), (B, S, Hkv*D) x 2
            self._record_projections(q_rows, k_rows, v_rows, True, True)
            self._record_heads(q, k, v)
        return q, k, v

    def _split_heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, S, E) -> (B, H, S, D), (B, Sk, Hkv*D) -> (B, Hkv, Sk, D) and (B, Sk, Hkv*Dv) -> (B, Hkv, Sk, Dv)."""
        # Plain views, not einops.rearrange: its recipe lookup costs ~20 us a call, a quarter of
        # a small forward (measured at B=1, S=8, E=64); `headwise equivalences` checks they agree.
        q = q.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, S, E) -> (B, S, H, D) -> (B, H, S, D)
        k = k.unflatten(-1, (self.num_kv_heads, -1)).transpose(1, 2)  # -> (B, Hkv, Sk, D)
        v = v.unflatten(-1, (self.num_kv_heads, -1)).transpose(1, 2)  # -> (B, Hkv, Sk, Dv)
        if trace.ACTIVE:
            self._record_heads(q, k, v)
        return q, k, v

    @staticmethod
    def _record_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
        trace.record("split heads q", q, "unflatten(-1, (H, D)).transpose(1, 2) = "
                     "rearrange 'b s (h d) -> b h s d'")
        trace.record("split heads k, v", k, "the same with H = Hkv" if v.shape[-1] == k.shape[-1] else
                     f"the same with H = Hkv; v: (B, Hkv, Sk, Dv) = {tuple(v.shape)}")

    def _normalize(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """RMSNorm of each head's q and k over D, before rotary (no-op without qk_norm)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        q, k = self.q_norm(q), self.k_norm(k)  # (.., H|Hkv, .., D): normalised over the last dim, D
        if trace.ACTIVE:
            trace.record("q/k norm", q, f"RMSNorm of each head's q and k over D = {self.head_dim} "
                         f"(x / sqrt(mean(x^2) + {self.q_norm.eps:g}) x q_norm.weight / k_norm.weight), before rotary")
        return q, k

    def _rotate(self, q: Tensor, k: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Apply rotary embeddings for positions ``start, start + 1, ...`` (no-op without rope)."""
        if self.rope is None:
            return q, k
        q, k = self.rope(q, start), self.rope(k, start)  # (B, H|Hkv, S, D)
        if trace.ACTIVE:
            trace.record("rotary positions", q, f"{self.rope.describe()}, positions from {start}")
        return q, k

    def plan(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context: Tensor | None = None,
        is_causal: bool | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> Plan:
        """Which path :meth:`forward` takes on these inputs, and why (checks them; computes nothing).

        Takes :meth:`forward`'s arguments. :meth:`dispatch` adds the kernel.

        Raises:
            ValueError / TypeError: inputs that :meth:`forward` would refuse.

        >>> mha = MultiHeadAttention(32, 4)
        >>> plan = mha.plan(torch.rand(2, 4, 32), torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]))
        >>> plan.path, plan.lengths  # 8 positions: packing's fixed costs outweigh the 3 it drops
        ('dense', (4, 1))
        """
        return self._plan(x, attention_mask, context, is_causal, need_weights, cache)

    def _plan(self, x: Tensor, attention_mask: Tensor | None, context: Tensor | None, is_causal: bool | None,
              need_weights: bool, cache: KVCache | None, read: tuple | None = None) -> Plan:
        """:meth:`plan`; ``read``: (x's padding, its real tokens per row) where :meth:`_signature`
        has read them from this mask already."""
        self._check(x, context, cache)
        self._check_mask(x, attention_mask, context, cache)
        causal = self.is_causal if is_causal is None else bool(is_causal)
        if self.context_parallel is not None:
            return Plan("context parallel", f"context_parallel={self.context_parallel}: x is this rank's shard of "
                        "the sequence, attention runs across the ranks", causal, None)
        if read is not None:
            padding, lengths = read
        else:
            padding = self._query_padding(x, attention_mask, context, cache)  # (B, S) or None
            lengths = None
            if padding is not None and policy.reads_values(padding):  # a free read on the CPU, once per call
                lengths = tuple(padding.sum(1).tolist())  # (B,) real tokens per row
        fused = self._fuses(x, attention_mask, lengths, context, cache, need_weights, causal)
        if fused is not None:
            return Plan("fused", fused, causal, padding, lengths)
        path, why = self._packing(x, padding, lengths, cache, need_weights, causal)
        return Plan(path, why, causal, padding, lengths)

    def _check_mask(self, x: Tensor, mask: Tensor | None, context: Tensor | None, cache: KVCache | None) -> None:
        """Refuse, before anything runs or changes, a mask that :meth:`forward` would refuse
        (the kernels' :func:`~headwise.masks.normalize_mask`, and a cache's own rules)."""
        if mask is None or self.context_parallel is not None:  # context parallelism checks its shards itself
            return
        B, S = x.shape[:2]
        Sk = S if context is None else context.shape[1]
        if cache is not None:
            if isinstance(mask, Tensor):
                cache.check_mask(mask, S)  # what a cache step takes (before normalize_mask's general rules)
            Sk = cache.max_seq_len if cache.static else sum(cache.kept()) + S  # the keys the step attends
            if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[-1] in (S, len(cache) + S):
                Sk = mask.shape[-1]  # the new positions' padding, or every position's (remembered)
        normalize_mask(mask, batch=B, heads=self.num_heads, q_len=S, k_len=Sk, device=x.device,
                       dtype=self.qkv_weight.dtype)

    def _fuses(self, x: Tensor, mask: Tensor | None, lengths: tuple[int, ...] | None, context: Tensor | None,
               cache: KVCache | None, need_weights: bool, causal: bool) -> str | None:
        """Why "auto" runs this call on the fused path, or None where it does not.

        The fused path is ``torch._native_multi_head_attention``, the op behind
        ``nn.MultiheadAttention``'s inference fast path: the qkv GEMM, SDPA and the output
        projection in one C++ call, without the Python between them (8-12 us a call on one
        Zen 5 thread), but with slower kernels than the dense path's as calls grow. So it
        takes small plain self-attention calls without gradients: up to
        ``policy.FUSED_MAX_ELEMENTS`` elements in x (``benchmarks/overhead.py --fused``
        measures the crossover), no mask (or one without padding), no causal rule, none of
        the module's extras (GQA, rope, q/k norm, window, ALiBi, soft-capping, sinks, a
        value head dim), biases, and a plain ``out_proj`` without hooks (the op reads its
        weights, so a hook or a wrapper would not run).
        """
        if (self.backend != "auto" or context is not None or cache is not None or need_weights
                or torch.is_grad_enabled() or trace.ACTIVE or torch.compiler.is_compiling()):
            return None
        S = x.shape[1]
        if (causal and S > 1) or (mask is not None and not _all_tokens(lengths, S)):
            return None
        if (self.num_kv_heads != self.num_heads or self.v_head_dim != self.head_dim or self.rope is not None
                or self.q_norm is not None or self.window is not None or self.alibi_slopes is not None
                or self.softcap is not None or self.sinks is not None or (self.training and self.dropout > 0)):
            return None
        out = self.out_proj
        if (self.qkv_bias is None or type(out) is not nn.Linear or out.bias is None or out._forward_hooks
                or out._forward_pre_hooks or _global_module_hooks()):
            return None
        if (not x.is_cpu or x.dtype not in (torch.float32, torch.float64) or x.dtype != self.qkv_weight.dtype
                or torch.is_autocast_enabled("cpu") or not hasattr(torch, "_native_multi_head_attention")):
            return None
        n = x.numel()
        if n > policy.FUSED_MAX_ELEMENTS:
            return None
        return (f"B x S x E = {n} <= FUSED_MAX_ELEMENTS {policy.FUSED_MAX_ELEMENTS} without gradients: "
                "nn.MultiheadAttention's fused inference op (torch._native_multi_head_attention) runs the "
                "projections, attention and output projection in one call, without the Python between them")

    def _packing(self, x: Tensor, padding: Tensor | None, lengths: tuple[int, ...] | None, cache: KVCache | None,
                 need_weights: bool, causal: bool) -> tuple[str, str]:
        """("packed" or "dense", why): by request, or where "auto" prices packing below the
        dense path (:func:`headwise.policy.estimate_packing`)."""
        if padding is None:
            return "dense", "no 2-D padding mask of x's own tokens (self-attention) to pack by"
        if cache is not None:
            return "dense", "decoding with a cache keeps the (B, S) layout"
        if need_weights:
            return "dense", "need_weights=True returns (B, H, S, Sk) weights over the padded layout"
        if self.window is not None or self.alibi_slopes is not None:
            return "dense", "window / ALiBi count positions, which change for tokens after a hole once packed"
        if self.packing is True:
            return "packed", "packing=True packs the real tokens"
        if self.packing is False:
            return "dense", "packing=False"
        if self.backend != "auto":
            return "dense", f"backend={self.backend!r} runs on the (B, S) batch (packing=True packs for it)"
        if torch.compiler.is_compiling():
            return "dense", "under torch.compile: packing needs data-dependent shapes (packing=True packs anyway)"
        if lengths is None:
            return "dense", (f"the padding share of a {padding.device.type} mask is not read: it would sync the host "
                             "with the device on every call (packing=True packs anyway)")
        training = torch.is_grad_enabled() and (x.requires_grad or self.qkv_weight.requires_grad)
        costs = policy.TRAINING_COSTS if training else policy.INFERENCE_COSTS
        return _price_packing(lengths, padding.shape[1], self.embed_dim, self.num_heads,
                              self.num_kv_heads, causal, training, costs, policy.PACK_MIN_PADDING,
                              (policy.BUCKET_SLACK, policy.DIRECT_MIN_LENGTH))

    def forward(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context: Tensor | None = None,  # None: self-attention
        is_causal: bool | None = None,  # None: the constructor's value
        need_weights: bool = False,
        cache: KVCache | None = None,  # None: no incremental decoding
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to ``x`` (or to ``context``).

        Args:
            x: (B, S, E) queries (and keys/values for self-attention).
            attention_mask: see the mask contract: bool/integer True = attend, float
                additive; (B, Sk), (B, S, Sk) or broadcastable to (B, H, S, Sk).
            context: (B, Sk, E) keys/values source for cross-attention.
            is_causal: bottom-right causal masking, ANDed with the mask.
            need_weights: also return the (B, H, S, Sk) softmax probabilities (before
                dropout, per head: not averaged as ``nn.MultiheadAttention`` does).
            cache: from :meth:`new_cache`: ``x`` holds the next T positions; their keys
                and values are appended and the queries attend to every cached position
                (Sk = len(cache) after appending; causal alignment is bottom-right). A 2-D
                bool/integer mask may cover the T new positions (it is remembered) or all
                Sk positions. Decode under ``torch.no_grad()``. A static cache
                (``new_cache(..., static=True)``) attends over all its slots through a mask
                of the written ones and takes a (B, T) mask of the new positions. An evicting
                cache (``new_cache(..., evict=True)``) attends over the positions it kept
                through a mask of their true positions.

        Returns:
            (B, S, E), or ``(output, weights)`` when ``need_weights``. Padded positions of
            a 2-D self-attention mask output zeros, whichever path runs (see :meth:`plan`).

        Raises:
            ValueError / TypeError: inputs or mask that do not fit; see the messages.
        """
        signature = self._signature(x, attention_mask, context, is_causal, need_weights, cache)
        key, x_padding, x_lengths = (None, None, None) if signature is None else signature
        repeat = None if key is None else self._repeats.get(key)
        if repeat is not None and repeat.current():  # a remembered signature: its checks passed, its plan holds
            if repeat.attention is not None:
                return self._forward_repeat(x, x_padding if repeat.padded else None, repeat.attention)
            plan = Plan(repeat.path, repeat.why, repeat.is_causal, x_padding, x_lengths)
        else:  # a new signature, or one that is not remembered
            repeat = None
            plan = self._plan(x, attention_mask, context, is_causal, need_weights, cache,
                              None if key is None else (x_padding, x_lengths))
        if plan.path == "context parallel":
            return self._forward_context_parallel(x, attention_mask, context, plan.is_causal, need_weights, cache)
        if plan.path == "fused":
            out = self._forward_fused(x)
        elif plan.path == "packed":
            out = self._forward_packed_path(x, plan)
        elif cache is None or torch.compiler.is_compiling():
            return self._forward_dense(x, attention_mask, context, plan, need_weights, cache, key, repeat)
        else:  # a refused step (a kernel's refusal, an interrupt) leaves the cache as it was
            saved = cache.savepoint(x.shape[1])
            try:
                return self._forward_dense(x, attention_mask, context, plan, need_weights, cache, key, repeat)
            except BaseException:
                cache.rollback(saved)
                raise
        if key is not None and repeat is None:  # remembered once it ran: a refused call changes no memo
            self._remember(key, _Repeat(plan.path, plan.why, plan.is_causal, None, plan.path == "packed"))
        return out

    def _forward_packed_path(self, x: Tensor, plan: Plan) -> Tensor:
        """The packed path of :meth:`forward`: (B, S, E) -> pack the real tokens -> attend per
        length bucket -> unpack to (B, S, E), zeros at the padding."""
        if trace.ACTIVE:
            trace.begin_call()
            trace.record("input", x, "x: (B, S, E)")
        padding = cast(Tensor, plan.padding)  # the packed path always has x's padding
        packed, info = packing.pack(x, padding)  # (T, E): the real tokens only
        if trace.ACTIVE:
            B, S = padding.shape
            trace.record("pack", packed, f"keep the {info.tokens} real tokens of {B} x {S} positions "
                         f"(drop {B * S - info.tokens} padded), {B} sequences end to end")
        out = self._attend_packed(packed, info.cu_seqlens, info.lengths, info.positions, plan.is_causal,
                                  rope_len=padding.shape[1])  # dynamic NTK scales by S, as the dense path
        out = packing.unpack(out, info)  # (B, S, E), zeros at the padding
        if trace.ACTIVE:
            trace.record("unpack", out, "scatter the tokens back to (B, S, E); padded positions output zeros")
        return out

    def _forward_dense(self, x: Tensor, attention_mask: Tensor | None, context: Tensor | None, plan: Plan,
                       need_weights: bool, cache: KVCache | None, key: tuple | None,
                       repeat: _Repeat | None) -> Tensor | tuple[Tensor, Tensor]:
        """The dense path of :meth:`forward` (the (B, S) batch, padding included; cache steps too)."""
        if trace.ACTIVE:
            trace.begin_call()
            trace.record("input", x, "x: (B, S, E)" + ("; context: (B, Sk, E)" if context is not None else ""))
        causal, window, slopes, sink_tokens = plan.is_causal, self.window, self.alibi_slopes, self.sink_tokens
        padding = plan.padding
        if cache is None and _all_tokens(plan.lengths, x.shape[1]):
            attention_mask = padding = None  # every position is a token: the mask allows all, nothing to zero
            if trace.ACTIVE:
                trace.record("padding mask", x, "every position of the 2-D mask is a real token: attend without it")
        if padding is not None:  # what a padded position holds (NaN, inf) reaches no result and no gradient
            x = _zero_padding(x, padding)
        if context is not None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
            context = _zero_padding(context, _as_padding(attention_mask))  # the context's padded keys, the same
        q, k, v = self._project_heads(x, context)  # (B, H, S, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)
        q, k = self._normalize(q, k)
        if cache is not None and cache.static:  # same shapes every step; positions are tensors
            q, k, v, attention_mask = self._static_step(q, k, v, cache, attention_mask, causal)
            causal, window, slopes, sink_tokens = False, None, None, 0  # all in the mask now
        else:
            q, k = self._rotate(q, k, 0 if cache is None else len(cache))
            if cache is not None:
                k, v, attention_mask = cache.update(k, v, attention_mask)  # (B, Hkv, Sk, D|Dv): every cached position
                if cache.evicted:  # key j is no longer position j: the rules read the kept keys' positions
                    T = q.shape[2]
                    queries = torch.arange(len(cache) - T, len(cache), device=q.device)  # (T,)
                    kept = attention_mask[:, None, None, :] if attention_mask is not None else k.new_ones(
                        1, 1, 1, k.shape[2], dtype=torch.bool)  # (B|1, 1, 1, L)
                    attention_mask = self._rules_mask(queries, cache.key_positions(), kept, causal, q.dtype)
                    causal, window, slopes, sink_tokens = False, None, None, 0  # all in the mask now
                if trace.ACTIVE:
                    note = f"append {x.shape[1]} positions; attend to all {cache.held} cached"
                    if cache.evicted:
                        note += (f" (evicted {cache.evicted} of {len(cache)}: kept the {cache.sink_tokens} sink "
                                 f"positions and the window's last ones, ruled by their true positions)")
                    trace.record("kv cache", k, note)
        dropout_p = self.dropout if self.training else 0.0
        key_lengths = plan.lengths if cache is None and padding is not None else None  # the mask's, read once
        if key is not None and repeat is None:  # remember the plan, and the attention call where attend can
            attention = None
            if window is None and slopes is None and self.softcap is None and self.sinks is None:
                mask_4d = None if padding is None else canonical_mask(padding)  # (B, 1, 1, S)
                attention = functional.prepare(q, k, v, attention_mask, mask_4d, is_causal=causal,
                                               dropout_p=dropout_p, backend=self.backend, key_lengths=key_lengths)
            if attention is not None:  # what attend would run now, without looking it up again
                out = self._output(attention(q, k, v, mask_4d), padding)  # (B, S, E)
                self._remember(key, _Repeat(plan.path, plan.why, plan.is_causal, attention, padding is not None))
                return out
            remember = _Repeat(plan.path, plan.why, plan.is_causal, None, padding is not None)
        out = attend(
            q, k, v, attention_mask,
            is_causal=causal,
            dropout_p=dropout_p,
            backend=self.backend,
            need_weights=need_weights,
            window=window,
            alibi_slopes=slopes,
            softcap=self.softcap,
            sinks=self.sinks,
            sink_tokens=sink_tokens,
            key_lengths=key_lengths,
        )
        out, weights = out if need_weights else (out, None)
        out = self._output(out, padding)  # (B, S, E)
        if key is not None and repeat is None:  # remembered once it ran: a refused call changes no memo
            self._remember(key, remember)
        if not need_weights:
            return out
        weights = cast(Tensor, weights)  # (B, H, S, Sk)
        if padding is not None:  # a padded query's output is zeros, and so are its weights
            weights = weights.masked_fill(~padding[:, None, :, None], 0)
        return out, weights

    def _forward_fused(self, x: Tensor) -> Tensor:
        """The fused path (see :meth:`_fuses`): (B, S, E) -> (B, S, E) in one op."""
        out = self.out_proj
        return torch._native_multi_head_attention(  # (B, S, E); its weights output: None
            x, x, x, self.embed_dim, self.num_heads, self.qkv_weight, cast(Tensor, self.qkv_bias), out.weight, out.bias,
            None, False)[0]

    def _forward_repeat(self, x: Tensor, padding: Tensor | None, attention: Prepared) -> Tensor:
        """:meth:`forward` of a remembered signature on the dense path: no checks, no plan,
        the attention call :func:`headwise.functional.prepare` made for it. (B, S, E) -> (B, S, E).
        ``padding``: (B, S), False at padding; None where there is none (no mask, or all tokens)."""
        if padding is not None:  # what a padded position holds reaches no result and no gradient
            x = _zero_padding(x, padding)
        q, k, v = self._project_heads(x, None)  # (B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
        if self.rope is not None or self.q_norm is not None:
            q, k = self._rotate(*self._normalize(q, k), 0)
        out = attention(q, k, v, None if padding is None else canonical_mask(padding))  # (B, H, S, Dv)
        return self._output(out, padding)

    def _output(self, out: Tensor, padding: Tensor | None) -> Tensor:
        """Merge the heads of the attention output (B, H, S, Dv), project, and zero the
        padded positions (``padding`` (B, S), False = padded; None: none): (B, S, E)."""
        out = out.transpose(1, 2).flatten(2)  # (B, H, S, Dv) -> (B, S, H, Dv) -> (B, S, H*Dv), one copy
        if trace.ACTIVE:
            trace.record("merge heads", out, "transpose(1, 2).flatten(2) = rearrange 'b h s d -> b s (h d)' "
                         "= transpose(1, 2).contiguous().view(B, S, " + ("E)" if self.v_head_dim == self.head_dim
                                                                          else "H * Dv)"))
        out = self.out_proj(out)  # (B, S, H*Dv) -> (B, S, E)
        if trace.ACTIVE:
            trace.record("output projection", out, "out_proj: (B, S, E) x (E, E)^T + b"
                         if self.v_head_dim == self.head_dim else "out_proj: (B, S, H*Dv) x (E, H*Dv)^T + b")
        if padding is not None:  # padded query positions output zeros, as the packed path gives
            out = _zero_padding_(out, padding)
            if trace.ACTIVE:
                trace.record("zero padding", out, "padded positions (2-D mask False) output zeros")
        return out

    def _static_step(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, mask: Tensor | None,
                     causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Write this step into a static cache; return q, k, v over every slot and the mask.

        The mask (B, 1, T, L), or (B, H, T, L) float with ALiBi, allows the written, unpadded
        slots, with causality, the window and ALiBi measured from the positions tensor (not
        from the slot count, which is always L = max_seq_len).
        """
        positions = cache.position + torch.arange(q.shape[2], device=q.device)  # (T,) where this step goes
        if self.rope is not None:  # at the position tensor; dynamic NTK's length is one too (no host read)
            cos, sin = self.rope.cos_sin(positions, q.dtype, seq_len=cache.position + q.shape[2])  # (T, R)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if trace.ACTIVE:
                trace.record("rotary positions", q, f"{self.rope.describe()}, positions from the cache's "
                             "position tensor")
        k, v, _ = cache.update_static(k, v, mask)  # (B, Hkv, L, D), (B, Hkv, L, Dv): every slot
        j = torch.arange(cache.max_seq_len, device=q.device)  # (L,) slot positions
        written = (j < cache.position)[None, None, None, :] & cache.key_mask[:, None, None, :]  # (B, 1, 1, L)
        if trace.ACTIVE:
            trace.record("kv cache", k, f"static: write {q.shape[2]} positions at the position tensor "
                         f"(index_copy_); attend to all {cache.max_seq_len} slots through a mask of the written ones")
        return q, k, v, self._rules_mask(positions, j, written, causal, q.dtype)

    def _rules_mask(self, queries: Tensor, keys: Tensor, allowed: Tensor, causal: bool,
                    dtype: torch.dtype) -> Tensor:
        """The module's positional rules as one mask, for keys that are not positions 0..L-1.

        Args:
            queries: (T,) the queries' positions.
            keys: (L,) the keys' positions.
            allowed: (B|1, 1, 1, L) bool, the keys that may be attended at all.
            causal: apply the causal rule (a window implies it).
            dtype: the float mask's dtype when ALiBi makes it a bias.

        Returns:
            (B|1, 1, T, L) bool with causality, the window and its sink tokens ANDed in, or
            (B|1, H, T, L) float with ALiBi's bias and ``-inf`` where blocked.
        """
        i, j = queries[:, None], keys[None, :]  # (T, 1), (1, L)
        if causal or self.window is not None:
            near = j <= i  # (T, L)
            if self.window is not None:
                band = j > i - self.window  # (T, L)
                near = near & (band | (j < self.sink_tokens) if self.sink_tokens else band)
            allowed = allowed & near  # (B|1, 1, T, L)
        allowed = allowed.expand(-1, -1, queries.shape[0], -1)  # (B|1, 1, T, L)
        if self.alibi_slopes is None:
            return allowed
        distance = (i - j).abs().to(dtype)  # (T, L)
        bias = -self.alibi_slopes.to(dtype)[:, None, None] * distance  # (H, T, L)
        return bias[None].masked_fill(~allowed, float("-inf"))  # (B|1, H, T, L)

    def _forward_context_parallel(self, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
                                  causal: bool, need_weights: bool, cache: KVCache | None) -> Tensor:
        """x (B, S_l, E) is this rank's shard of the sequence (``context`` too); see headwise.distributed."""
        import headwise.distributed as hwd

        if cache is not None or need_weights:
            raise ValueError("context_parallel attends sharded whole sequences: it takes no cache= and no "
                             "need_weights=True; build the module without context_parallel for decoding")
        cp = self.context_parallel
        padding = self._query_padding(x, attention_mask, context, None)  # (B, S_l) or None
        if padding is not None:  # what a padded position holds reaches no result and no gradient
            x = _zero_padding(x, padding)
        q, k, v = self._project_heads(x, context)  # (B, H, S_l, D), (B, Hkv, Sk_l, D)
        q, k = self._normalize(q, k)
        if self.rope is not None:  # rotate by global positions (dynamic NTK: by the global length)
            S, pos = hwd.global_positions(x.shape[1], cp.layout, cp.group, x.device)  # (S_l,); checks the split
            cos, sin = self.rope.angles(0, S, q.dtype, x.device)  # (S, D)
            cos, sin = cos.index_select(0, pos), sin.index_select(0, pos)  # (S_l, D)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = hwd.attention(q, k, v, attention_mask, is_causal=causal, window=self.window,
                            alibi_slopes=self.alibi_slopes, dropout_p=self.dropout if self.training else 0.0,
                            method=cp.method, layout=cp.layout, group=cp.group)  # (B, H, S_l, D)
        out = self.out_proj(out.transpose(1, 2).flatten(2))  # (B, H, S_l, D) -> (B, S_l, E)
        return out if padding is None else _zero_padding_(out, padding)

    def _signature(self, x: Tensor, attention_mask: Tensor | None, context: Tensor | None, is_causal: bool | None,
                   need_weights: bool, cache: KVCache | None) -> tuple[tuple, Tensor | None, tuple | None] | None:
        """The key a self-attention call of :meth:`forward` is remembered under, with x's padding
        (B, S) and its real tokens per row; None where every call plans afresh.

        The key holds what :meth:`plan` and the kernel's checks and choice read: x's shape,
        dtype and device, the mask's shape, dtype, device and real tokens per row, the causal
        flag, the grad state, the training flag and ``policy.GENERATION`` (the thresholds'
        version). Module settings are not in it: setting any attribute clears the memo (a
        frozen ``qkv_weight`` beside a trained bias or q/k norm counts as no gradients, which
        only steers the kernel's cost estimate). Not remembered: cross-attention, a cache, weights,
        context parallelism, 3-D / 4-D / float masks, masks whose values are not read (on an
        accelerator), a trace, torch.compile, autocast, and "auto" logging its choices.
        """
        if (context is not None or cache is not None or need_weights or self.context_parallel is not None
                or trace.ACTIVE or torch.compiler.is_compiling() or functional.logs_choices()):
            return None
        try:
            if torch.is_autocast_enabled("cpu" if x.is_cpu else x.device.type):  # q's dtype is autocast's, not x's
                return None
            padding, lengths, masked = None, None, None
            if attention_mask is not None:
                padding = self._query_padding(x, attention_mask, None, None)  # (B, S) or None
                if padding is None or not policy.reads_values(padding):
                    return None
                lengths = tuple(padding.sum(1).tolist())  # (B,) real tokens per row
                masked = (attention_mask.shape, attention_mask.dtype, attention_mask.device, lengths)
            causal = self.is_causal if is_causal is None else bool(is_causal)
            # 0: no grad mode (the fused path may run); 1: grad mode, none flows; 2: gradients flow
            grads = 0 if not torch.is_grad_enabled() else 1 + (x.requires_grad or self.qkv_weight.requires_grad)
            key = (x.shape, x.dtype, x.device, masked, causal, grads, self.training, policy.GENERATION)
            return key, padding, lengths
        except (AttributeError, TypeError):  # not tensors: plan names the error
            return None

    def _remember(self, key: tuple, repeat: _Repeat) -> None:
        if len(self._repeats) >= _REPEATS_LIMIT:
            self._repeats.clear()
        self._repeats[key] = repeat

    def _query_padding(self, x: Tensor, mask: Tensor | None, context: Tensor | None,
                       cache: KVCache | None) -> Tensor | None:
        """(B, S) bool marking x's real tokens, when a 2-D mask also describes the queries.

        That is self-attention with a bool/integer (B, S) padding mask, or a cache step
        whose 2-D mask covers the new positions (or all of them).
        """
        if (context is not None or not isinstance(mask, Tensor) or mask.dim() != 2
                or mask.is_floating_point() or mask.is_complex() or mask.device != x.device):
            return None  # not a padding mask of x's tokens (normalize_mask reports any error)
        S = x.shape[1]
        if mask.dtype != torch.bool:
            mask = mask != 0  # integer: nonzero = a token
        if cache is None:
            return mask if mask.shape == x.shape[:2] else None
        return mask[:, -S:] if mask.shape[0] == x.shape[0] else None

    def forward_packed(
        self,
        x: Tensor,
        cu_seqlens: Tensor,
        *,
        is_causal: bool | None = None,
        positions: Tensor | None = None,
        lengths: tuple[int, ...] | None = None,
    ) -> Tensor:
        """Self-attention on packed tokens: the padding-free path.

        Args:
            x: (T, E) the real tokens of B sequences, one after another.
            cu_seqlens: (B + 1,) offsets: sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1].
            is_causal: as in :meth:`forward` (None: the constructor's value).
            positions: (T,) rotary positions of the tokens (None: 0, 1, ... within each
                sequence).
            lengths: the B lengths as ints, if known.

        Returns:
            (T, E). Projections run on T rows and attention per length bucket, so the
            cost follows the real token count.

        Raises:
            ValueError: ``x`` not (T, E); ``cu_seqlens`` not 1-D, not starting at 0, decreasing
                or not ending at T; ``lengths`` that are not its differences.
            TypeError: ``cu_seqlens`` not an integer tensor; ``x`` not of the module's dtype.
        """
        if self.context_parallel is not None:
            raise ValueError("forward_packed runs in one process; context_parallel takes (B, S_l, E) shards in forward")
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"packed x must be (T, E) with E = embed_dim = {self.embed_dim}, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        self._check_dtype_device("x", x)
        lengths = _packed_lengths(cu_seqlens, lengths, x.shape[0])
        if trace.ACTIVE:
            trace.begin_call()
            trace.record("input (packed)", x, f"x: (T, E), {len(lengths)} sequences end to end, no padding")
        return self._attend_packed(x, cu_seqlens, tuple(lengths), positions,
                                   self.is_causal if is_causal is None else bool(is_causal))

    def _attend_packed(self, x: Tensor, cu_seqlens: Tensor, lengths: tuple[int, ...], positions: Tensor | None,
                       causal: bool, rope_len: int | None = None) -> Tensor:
        """The packed path from (T, E) tokens to (T, E) outputs, every stage traced.

        ``rope_len``: the length dynamic NTK scales by (None: the last position + 1).
        """
        T = x.shape[0]
        q, k, v = self._project(x, None)  # (T, E), (T, Hkv*D), (T, Hkv*Dv)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # (T, E) -> (T, H, D)
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # (T, Hkv*D) -> (T, Hkv, D)
        v = v.unflatten(-1, (self.num_kv_heads, self.v_head_dim))  # (T, Hkv*Dv) -> (T, Hkv, Dv)
        if trace.ACTIVE:
            trace.record("split heads q", q, "unflatten(-1, (H, D)): packed rows need no transpose")
            trace.record("split heads k, v", k, "the same with H = Hkv")
        q, k = self._normalize(q, k)
        if self.rope is not None:
            if positions is None:
                starts = torch.repeat_interleave(cu_seqlens[:-1], torch.tensor(lengths, device=x.device))
                positions = torch.arange(T, device=x.device) - starts  # (T,) position within each sequence
            q, k = self.rope.at(q, positions, seq_len=rope_len), self.rope.at(k, positions, seq_len=rope_len)
            if trace.ACTIVE:
                trace.record("rotary positions", q, f"{self.rope.describe()}, each token's position in its "
                             "sequence")
        out = packing.attend_packed(
            q, k, v, lengths, lengths,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend, window=self.window, alibi_slopes=self.alibi_slopes,
            softcap=self.softcap, sinks=self.sinks, sink_tokens=self.sink_tokens,
        )  # (T, H, Dv), attention within each sequence
        out = out.flatten(1)  # (T, H, Dv) -> (T, H*Dv)
        if trace.ACTIVE:
            same = self.v_head_dim == self.head_dim
            trace.record("merge heads", out, "flatten(1): (T, H, D) -> (T, E), a view" if same
                         else "flatten(1): (T, H, Dv) -> (T, H*Dv), a view")
        out = self.out_proj(out)  # (T, H*Dv) -> (T, E)
        if trace.ACTIVE:
            trace.record("output projection", out, "out_proj: (T, E) x (E, E)^T + b, on the real tokens only")
        return out

    def dispatch(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context: Tensor | None = None,
        is_causal: bool | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
    ) -> Dispatch:
        """Which path and kernel :meth:`forward` would run on these inputs, and why.

        Decides from :meth:`plan` and the shapes alone: no projection or attention runs.
        ``.path`` names the path, ``.backend`` the kernel inside it (on the packed path: the
        kernel of the bucket with the most tokens; the reason lists every bucket's).

        >>> print(MultiHeadAttention(64, 4).dispatch(torch.rand(1, 3, 64)).backend)
        sdpa
        """
        plan = self.plan(x, attention_mask, context=context, is_causal=is_causal, need_weights=need_weights,
                         cache=cache)
        if plan.path == "context parallel":
            return self._dispatch_context_parallel(x, attention_mask, plan)
        if plan.path == "packed":
            return self._dispatch_packed(x, plan)
        if plan.path == "fused":
            return Dispatch("native_mha", "torch._native_multi_head_attention: the qkv GEMM, SDPA and the output "
                            "projection in one op", MappingProxyType({}), None, path="fused", path_reason=plan.why)
        B, S = x.shape[:2]
        Sk = S if context is None else context.shape[1]
        causal, window, slopes, sink_tokens = plan.is_causal, self.window, self.alibi_slopes, self.sink_tokens
        kept = 0 if cache is None else sum(cache.kept())  # the held positions the step keeps
        evicted = cache is not None and cache.evicts and (cache.evicted > 0 or kept < cache.held)
        if cache is not None and (cache.static or evicted):
            # every slot (static) or the kept ones (evicted), through a mask that holds the rules
            Sk = cache.max_seq_len if cache.static else kept + S
            float_mask = slopes is not None  # ALiBi joins the mask as a bias
            attention_mask = torch.zeros(B, self.num_heads if float_mask else 1, S, Sk, device=x.device,
                                         dtype=self.qkv_weight.dtype if float_mask else torch.bool)
            if evicted and not float_mask:  # eviction keeps what the step's queries can see: (nearly) all True
                attention_mask = ~attention_mask
            causal, window, slopes, sink_tokens = False, None, None, 0
        elif cache is not None:  # what forward would attend to, without appending
            attention_mask = cache.mask_for(attention_mask, S)
            Sk = len(cache) + S
        q, k = self._shaped(x, B, self.num_heads, S), self._shaped(x, B, self.num_kv_heads, Sk)
        v = self._shaped(x, B, self.num_kv_heads, Sk, self.v_head_dim)
        d = choose_backend(
            q, k, v, attention_mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            backend=self.backend,
            window=window,
            alibi_slopes=slopes,
            softcap=self.softcap,
            sinks=self.sinks,
            sink_tokens=sink_tokens,
        )
        return Dispatch(d.backend, d.reason, d.passed_over, d.request, path="dense", path_reason=plan.why)

    def _shaped(self, x: Tensor, B: int, heads: int, length: int, dim: int | None = None) -> Tensor:
        """A (B, heads, length, D) stand-in (``dim``: that last size, None: D) for a projection's
        output: the dtype, device and grad flag it would have, no storage (one element, expanded)."""
        dtype = self.qkv_weight.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        grad = torch.is_grad_enabled() and (x.requires_grad or self.qkv_weight.requires_grad)
        return torch.zeros((), dtype=dtype, device=x.device, requires_grad=grad).expand(
            B, heads, length, self.head_dim if dim is None else dim)

    def _dispatch_packed(self, x: Tensor, plan: Plan) -> Dispatch:
        padding = cast(Tensor, plan.padding)  # the packed path always has x's padding
        lengths = tuple(padding.sum(1).tolist())
        B, S = padding.shape
        T = sum(lengths)
        per_bucket = []  # (tokens, n, L, Dispatch) of each length bucket
        for n, L, _, keys in packing.bucket_shapes(lengths, lengths):
            q, k = self._shaped(x, n, self.num_heads, L), self._shaped(x, n, self.num_kv_heads, L)
            v = self._shaped(x, n, self.num_kv_heads, L, self.v_head_dim)
            mask = None  # the bucket's (n, L) key mask, as many real keys: all "auto" reads of it
            if keys < n * L:
                mask = torch.ones(n * L, dtype=torch.bool, device=x.device)
                mask[keys:] = False
                mask = mask.reshape(n, L)
            d = choose_backend(q, k, v, mask, is_causal=plan.is_causal,
                               dropout_p=self.dropout if self.training else 0.0, backend=self.backend,
                               window=self.window, alibi_slopes=self.alibi_slopes, softcap=self.softcap,
                               sinks=self.sinks)
            per_bucket.append((n * L, n, L, d))
        if not per_bucket:  # no real token at all
            return Dispatch("none", "no real token: nothing to attend", MappingProxyType({}), None,
                            path="packed", path_reason=plan.why)
        main = max(per_bucket, key=lambda b: b[0])[3]
        buckets = ", ".join(f"{n} x {L} -> {d.backend!r}" for _, n, L, d in per_bucket)
        reason = (f"attention per length bucket (sequences x length): {buckets}; "
                  f"projections and the output projection run on the {T} real tokens of {B} x {S}")
        passed = MappingProxyType({"dense path": f"pays for {B * S - T} padded positions"})
        return Dispatch(main.backend, reason, passed, main.request, path="packed", path_reason=plan.why)

    def _dispatch_context_parallel(self, x: Tensor, attention_mask: Tensor | None, plan: Plan) -> Dispatch:
        import torch.distributed as dist

        from headwise.distributed import choose_method

        cp = self.context_parallel
        if cp.method != "auto":
            method, why = cp.method, f"method={cp.method!r} was requested"
        else:
            world = dist.get_world_size(cp.group) if dist.is_available() and dist.is_initialized() else 1
            dense = isinstance(attention_mask, Tensor) and attention_mask.dim() > 2
            choice = choose_method(self.num_heads, self.num_kv_heads, world, dense_mask=dense)
            method, why = choice.method, choice.reason
        return Dispatch(method, why, MappingProxyType({}), None, path="context parallel", path_reason=plan.why)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, **kwargs) -> MultiHeadAttention:
        """Build one from a ``torch.nn.MultiheadAttention``; see :func:`headwise.convert.from_torch`."""
        return convert.from_torch(m, module_class=cls, **kwargs)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The equivalent ``torch.nn.MultiheadAttention``; see :func:`headwise.convert.to_torch`."""
        return convert.to_torch(self, batch_first=batch_first)

"""``MultiHeadAttention``: projections and head bookkeeping around :func:`headwise.attention`.

The module owns the parameters; the kernels (``headwise.kernels``) own the arithmetic.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.

State dict (separate projections, as the documents and Hugging Face models keep them)::

    q_proj.weight   (E, E)         q_proj.bias   (E,)
    k_proj.weight   (Hkv * D, E)   k_proj.bias   (Hkv * D,)
    v_proj.weight   (Hkv * D, E)   v_proj.bias   (Hkv * D,)
    out_proj.weight (E, E)         out_proj.bias (E,)

(no ``*.bias`` entries when ``bias=False``).
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import Tensor, nn

from headwise import tracing as trace
from headwise import varlen
from headwise.cache import KVCache
from headwise.dispatch import Dispatch
from headwise.functional import attend, choose_backend
from headwise.kernels.registry import get_kernel
from headwise.masks import alibi_slopes
from headwise.positions import RotaryEmbedding, apply_rotary

__all__ = ["MultiHeadAttention", "PACK_MIN_PADDING"]

# "auto" packs a self-attention batch (drops its padding before the projections) when at
# least this fraction of it is padding; benchmarks/pack_threshold.py measured packing
# 1.06-1.25x faster at 10% padding (forward and forward + backward, S=128 and 512).
PACK_MIN_PADDING = 0.1


def _divisors_near(n: int, around: int) -> str:
    """'4 or 5' style hint: the divisors of ``n`` just below and above ``around``."""
    divs = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divs if d < around]
    above = [d for d in divs if d > around]
    picks = ([below[-1]] if below else []) + ([above[0]] if above else [])
    return " or ".join(str(d) for d in picks)


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
        backend: ``"auto"`` or a name from :func:`headwise.available_backends`.
        context_parallel: a :class:`headwise.distributed.ContextParallel`: :meth:`forward`
            then takes this rank's shard (B, S_l, E) of the sequence (and of a 2-D mask)
            and attends over every rank's keys (rotary positions are global); no cache,
            weights, packed path or dropout.
        device, dtype: where and how to create the parameters.

    Raises:
        ValueError: sizes that do not divide, dropout outside [0, 1), unknown backend.
        TypeError: sizes that are not integers.

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
        rope: bool = False,
        rope_base: float | None = None,  # None: 10000 when rope=True; a value turns rope on
        alibi: bool = False,
        window: int | None = None,  # None: unlimited; W: query i sees keys (i - W, i]
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
        if backend not in ("auto", "varlen"):
            get_kernel(backend)  # ValueError listing the known backends
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int (keys per query, its own included), got {window!r}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.is_causal = bool(is_causal)
        self.backend = backend
        kv_dim = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.window = window
        self.rope = None
        if rope or rope_base is not None:
            self.rope = RotaryEmbedding(self.head_dim, 10000.0 if rope_base is None else rope_base)
        if context_parallel is not None:
            from headwise.distributed import ContextParallel

            if not isinstance(context_parallel, ContextParallel):
                raise TypeError("context_parallel must be a headwise.distributed.ContextParallel or None, got "
                                f"{type(context_parallel).__name__}")
        self.context_parallel = context_parallel
        self.alibi_slopes: Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None,
                             persistent=False)

    def extra_repr(self) -> str:
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        extras = "".join([
            f", rope_base={self.rope.base:g}" if self.rope is not None else "",
            ", alibi=True" if self.alibi_slopes is not None else "",
            f", window={self.window}" if self.window is not None else "",
            f", context_parallel={self.context_parallel}" if self.context_parallel is not None else "",
        ])
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, "
            f"head_dim={self.head_dim}, dropout={self.dropout}, is_causal={self.is_causal}, "
            f"backend={self.backend!r}{extras}"
        )

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """A preallocated key/value cache for incremental decoding with this module.

        Args:
            batch_size: B of the batches that will be decoded.
            max_seq_len: the most positions the cache will hold (prompt included).

        Returns:
            An empty :class:`~headwise.cache.KVCache` on this module's device and dtype.

        Raises:
            ValueError: non-positive sizes.
        """
        w = self.k_proj.weight
        return KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim,
                       device=w.device, dtype=w.dtype)

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

    def _project(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        source = x if context is None else context
        q, k, v = self.q_proj(x), self.k_proj(source), self.v_proj(source)  # (B, S, E), (B, Sk, Hkv*D)
        if trace.ACTIVE:
            src = "x" if context is None else "context"
            trace.record("q projection", q, "q_proj(x): (B, S, E) x (E, E)^T + b")
            trace.record("k projection", k, f"k_proj({src}): (B, Sk, E) x (Hkv*D, E)^T + b")
            trace.record("v projection", v, f"v_proj({src}): (B, Sk, E) x (Hkv*D, E)^T + b")
        # Plain views, not einops.rearrange: its recipe lookup costs ~20 us a call, a quarter of
        # a small forward (measured at B=1, S=8, E=64); `headwise equivalences` checks they agree.
        q = q.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, S, E) -> (B, S, H, D) -> (B, H, S, D)
        k = k.unflatten(-1, (self.num_kv_heads, -1)).transpose(1, 2)  # -> (B, Hkv, Sk, D)
        v = v.unflatten(-1, (self.num_kv_heads, -1)).transpose(1, 2)  # -> (B, Hkv, Sk, D)
        if trace.ACTIVE:
            trace.record("split heads q", q, "unflatten(-1, (H, D)).transpose(1, 2) = "
                         "rearrange 'b s (h d) -> b h s d'")
            trace.record("split heads k, v", k, "the same with H = Hkv")
        return q, k, v

    def _rotate(self, q: Tensor, k: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Apply rotary embeddings for positions ``start, start + 1, ...`` (no-op without rope)."""
        if self.rope is None:
            return q, k
        q, k = self.rope(q, start), self.rope(k, start)  # (B, H|Hkv, S, D)
        if trace.ACTIVE:
            trace.record("rotary positions", q, f"rotate q and k pairs (i, i + D/2) by position x "
                         f"{self.rope.base:g}^(-2i/D), positions from {start}")
        return q, k

    @staticmethod
    def _cache_mask(cache: KVCache, mask: Tensor | None, new: int, *, remember: bool = True) -> Tensor | None:
        """The mask over every cached position for this step; remembers 2-D padding masks."""
        start, total = len(cache), len(cache) + new
        if mask is None:
            return cache.key_mask[:, :total] if cache.padded else None  # (B, Sk)
        if mask.dim() != 2 or mask.shape[-1] not in (new, total):
            return mask  # 3-D / 4-D masks already cover (S, Sk); normalize_mask checks them
        if mask.is_floating_point():
            raise TypeError(
                "with a cache, give the 2-D padding mask as bool or integer (True / 1 = token); "
                "a floating (B, Sk) bias cannot be remembered across steps"
            )
        if mask.shape[0] != cache.batch_size:
            raise ValueError(f"attention_mask batch ({mask.shape[0]}) differs from the cache's "
                             f"batch_size ({cache.batch_size})")
        mask = mask.to(cache.key_mask.device) != 0
        if mask.shape[-1] == new:
            mask = torch.cat([cache.key_mask[:, :start], mask], dim=1)  # (B, Sk)
        if remember:
            cache.key_mask[:, :total] = mask
            cache.padded = True
        return mask

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
                Sk positions. Decode under ``torch.no_grad()``.

        Returns:
            (B, S, E), or ``(output, weights)`` when ``need_weights``.

        Raises:
            ValueError / TypeError: inputs or mask that do not fit; see the messages.
        """
        self._check(x, context, cache)
        causal = self.is_causal if is_causal is None else is_causal
        if self.context_parallel is not None:
            return self._forward_context_parallel(x, attention_mask, context, causal, need_weights, cache)
        padding = self._query_padding(x, attention_mask, context, cache)  # (B, S) or None
        if self._packs(padding, cache, need_weights):
            packed, info = varlen.pack(x, padding)  # (T, E): the real tokens only
            out = self.forward_packed(packed, info.cu_seqlens, is_causal=causal, positions=info.positions,
                                      lengths=info.lengths)
            return varlen.unpack(out, info)  # (B, S, E), zeros at the padding
        if trace.ACTIVE:
            trace.begin_call()
            trace.record("input", x, "x: (B, S, E)" + ("; context: (B, Sk, E)" if context is not None else ""))
        q, k, v = self._project(x, context)
        q, k = self._rotate(q, k, 0 if cache is None else len(cache))
        if cache is not None:
            attention_mask = self._cache_mask(cache, attention_mask, x.shape[1])
            k, v = cache.append(k, v)  # (B, Hkv, Sk, D): every cached position
            if trace.ACTIVE:
                trace.record("kv cache", k, f"append {x.shape[1]} positions; attend to all {len(cache)} cached")
        out = attend(
            q, k, v, attention_mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self._kernel_backend(),
            need_weights=need_weights,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
        )
        out, weights = out if need_weights else (out, None)
        out = out.transpose(1, 2).flatten(2)  # (B, H, S, D) -> (B, S, H, D) -> (B, S, E), one copy
        if trace.ACTIVE:
            trace.record("merge heads", out, "transpose(1, 2).flatten(2) = rearrange 'b h s d -> b s (h d)' "
                         "= transpose(1, 2).contiguous().view(B, S, E)")
        out = self.out_proj(out)  # (B, S, E)
        if trace.ACTIVE:
            trace.record("output projection", out, "out_proj: (B, S, E) x (E, E)^T + b")
        if padding is not None:  # padded query positions output zeros, as the packed path gives
            out = out.masked_fill(~padding[..., None], 0.0)
            if trace.ACTIVE:
                trace.record("zero padding", out, "padded positions (2-D mask False) output zeros")
        return (out, weights) if need_weights else out

    def _forward_context_parallel(self, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
                                  causal: bool, need_weights: bool, cache: KVCache | None) -> Tensor:
        """x (B, S_l, E) is this rank's shard of the sequence (``context`` too); see headwise.distributed."""
        import headwise.distributed as hwd

        if cache is not None or need_weights:
            raise ValueError("context_parallel attends sharded whole sequences: it takes no cache= and no "
                             "need_weights=True; build the module without context_parallel for decoding")
        cp = self.context_parallel
        q, k, v = self._project(x, context)  # (B, H, S_l, D), (B, Hkv, Sk_l, D)
        if self.rope is not None:  # rotate by global positions
            S = hwd.global_length(x.shape[1], cp.group, x.device)
            cos, sin = self.rope.angles(0, S, q.dtype, x.device)  # (S, D)
            pos = hwd.positions(S, cp.layout, cp.group, x.device)  # (S_l,)
            cos, sin = cos.index_select(0, pos), sin.index_select(0, pos)  # (S_l, D)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = hwd.attention(q, k, v, attention_mask, is_causal=causal, window=self.window,
                            alibi_slopes=self.alibi_slopes, dropout_p=self.dropout if self.training else 0.0,
                            method=cp.method, layout=cp.layout, group=cp.group)  # (B, H, S_l, D)
        out = self.out_proj(out.transpose(1, 2).flatten(2))  # (B, H, S_l, D) -> (B, S_l, E)
        padding = self._query_padding(x, attention_mask, context, None)
        return out if padding is None else out.masked_fill(~padding[..., None], 0.0)

    def _kernel_backend(self) -> str:
        # "varlen" names the module's packed path; inside it (and when it does not apply),
        # the kernels are chosen by "auto".
        return "auto" if self.backend == "varlen" else self.backend

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
        if cache is None:
            return (mask != 0) if mask.shape == x.shape[:2] else None
        return (mask[:, -S:] != 0) if mask.shape[0] == x.shape[0] else None

    def _packs(self, padding: Tensor | None, cache: KVCache | None, need_weights: bool) -> bool:
        """Whether the padding-free path runs: by request, or where "auto" measured it pays."""
        if padding is None or cache is not None or need_weights:
            return False  # nothing to pack, decoding, or weights over the padded layout
        if self.window is not None or self.alibi_slopes is not None:
            return False  # positions of tokens after a hole differ once packed
        if self.backend == "varlen":
            return True
        if self.backend != "auto":
            return False
        return 1.0 - float(padding.float().mean()) >= PACK_MIN_PADDING

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
            ValueError: ``x`` not (T, E), or rows that do not match ``cu_seqlens``.
        """
        if self.context_parallel is not None:
            raise ValueError("forward_packed runs in one process; context_parallel takes (B, S_l, E) shards in forward")
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"packed x must be (T, E) with E = embed_dim = {self.embed_dim}, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        if lengths is None:
            lengths = tuple(torch.diff(cu_seqlens).tolist())
        if trace.ACTIVE:
            trace.begin_call()
            trace.record("input (packed)", x, f"x: (T, E), {len(lengths)} sequences, no padding")
        T = x.shape[0]
        q = self.q_proj(x).reshape(T, self.num_heads, self.head_dim)  # (T, E) -> (T, H, D)
        k = self.k_proj(x).reshape(T, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(x).reshape(T, self.num_kv_heads, self.head_dim)
        if self.rope is not None:
            if positions is None:
                starts = torch.repeat_interleave(cu_seqlens[:-1], torch.tensor(lengths, device=x.device))
                positions = torch.arange(T, device=x.device) - starts  # (T,) position within each sequence
            q, k = self.rope.at(q, positions), self.rope.at(k, positions)
        out = varlen.packed_attention(
            q, k, v, cu_seqlens, lengths=lengths,
            is_causal=self.is_causal if is_causal is None else is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self._kernel_backend(), window=self.window, alibi_slopes=self.alibi_slopes,
        )  # (T, H, D)
        out = self.out_proj(out.reshape(T, self.embed_dim))  # (T, E)
        if trace.ACTIVE:
            trace.record("output projection (packed)", out, "out_proj on (T, E); attention ran per length bucket")
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
        """Which kernel :meth:`forward` would run on these inputs, and why (runs nothing).

        >>> print(MultiHeadAttention(64, 4).dispatch(torch.rand(1, 3, 64)).backend)
        sdpa
        """
        self._check(x, context, cache)
        padding = self._query_padding(x, attention_mask, context, cache)
        if self._packs(padding, cache, need_weights):
            share = 1.0 - float(padding.float().mean())
            why = ("backend='varlen' packs the real tokens" if self.backend == "varlen" else
                   f"{share:.0%} of the batch is padding (>= PACK_MIN_PADDING {PACK_MIN_PADDING:.0%})")
            return Dispatch("varlen", f"module packed path: {why}; projections and feed-through run on the "
                            "real tokens only, attention per length bucket ('auto' inside each bucket)",
                            MappingProxyType({"dense path": "pays for the padding"}), None)
        with torch.no_grad():
            q, k, v = self._project(x, context)
            if cache is not None:  # what forward would attend to, without appending
                L = len(cache)
                attention_mask = self._cache_mask(cache, attention_mask, x.shape[1], remember=False)
                k = torch.cat([cache.k[:, :, :L], k], dim=2)  # (B, Hkv, L + T, D)
                v = torch.cat([cache.v[:, :, :L], v], dim=2)
        return choose_backend(
            q, k, v, attention_mask,
            is_causal=self.is_causal if is_causal is None else is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            backend=self.backend,
            window=self.window,
            alibi_slopes=self.alibi_slopes,
        )

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, **kwargs) -> MultiHeadAttention:
        """Build one from a ``torch.nn.MultiheadAttention`` (either ``batch_first``), copying weights.

        The result is always batch-first: inputs (B, S, E). Translate torch's masks with
        :func:`headwise.masks.from_torch_masks` (torch's bool True means *ignore*).

        Args:
            m: the torch module.
            **kwargs: ``is_causal`` / ``backend`` for the new module.

        Raises:
            TypeError: ``m`` is not an ``nn.MultiheadAttention``.
            ValueError: features headwise does not model (``kdim``/``vdim`` other than
                ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``).
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects torch.nn.MultiheadAttention, got {type(m).__name__}")
        if not m._qkv_same_embed_dim:
            raise ValueError(
                f"kdim ({m.kdim}) and vdim ({m.vdim}) must equal embed_dim ({m.embed_dim}); "
                "headwise projects keys and values from embed_dim-wide inputs"
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError(
                "add_bias_kv=True and add_zero_attn=True are not supported; "
                "append the extra key/value position to the inputs instead"
            )
        w = m.in_proj_weight
        bias = m.in_proj_bias is not None
        out = cls(m.embed_dim, m.num_heads, m.dropout, bias=bias, device=w.device, dtype=w.dtype,
                  **kwargs)
        E = m.embed_dim
        with torch.no_grad():
            for i, proj in enumerate((out.q_proj, out.k_proj, out.v_proj)):
                proj.weight.copy_(w[i * E:(i + 1) * E])
                if bias:
                    proj.bias.copy_(m.in_proj_bias[i * E:(i + 1) * E])
            out.out_proj.weight.copy_(m.out_proj.weight)
            if bias:
                out.out_proj.bias.copy_(m.out_proj.bias)
        return out.train(m.training)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The equivalent ``torch.nn.MultiheadAttention``, weights copied.

        Raises:
            ValueError: grouped-query modules (torch has no kv-head count).
        """
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"torch.nn.MultiheadAttention has no grouped-query attention; this module has "
                f"num_kv_heads={self.num_kv_heads} < num_heads={self.num_heads}"
            )
        extras = [name for name, on in (("rope", self.rope is not None),
                                        ("alibi", self.alibi_slopes is not None),
                                        ("window", self.window is not None)) if on]
        if extras:
            raise ValueError(f"torch.nn.MultiheadAttention has no {', '.join(extras)}; "
                             "build this module without them to convert it")
        w = self.q_proj.weight
        bias = self.q_proj.bias is not None
        m = nn.MultiheadAttention(self.embed_dim, self.num_heads, self.dropout, bias=bias,
                                  batch_first=batch_first, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            m.in_proj_weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight,
                                              self.v_proj.weight]))
            if bias:
                m.in_proj_bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias,
                                                self.v_proj.bias]))
            m.out_proj.weight.copy_(self.out_proj.weight)
            if bias:
                m.out_proj.bias.copy_(self.out_proj.bias)
        return m.train(self.training)

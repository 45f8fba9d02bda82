"""``MultiHeadAttention``: the layer. It owns the parameters, as ordinary submodules, and
``forward`` dispatches each call to one path; the kernels (``headwise.kernels``) own the
arithmetic.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim (of q and k), Dv value head dim (``v_head_dim``, D unless given), E embed dim.

The parts are ordinary PyTorch modules, so a user's tools reach them as on any layer (PEFT
wraps ``q_proj`` by name, hooks run on every call, safetensors saves each weight)::

    q_proj   nn.Linear(E, H * D)      k_proj   nn.Linear(E, Hkv * D)
    v_proj   nn.Linear(E, Hkv * Dv)   out_proj nn.Linear(H * Dv, E)
    q_norm, k_norm  nn.RMSNorm(D)     with qk_norm="rms" only
    rope     RotaryEmbedding          with rotary positions only
    sinks    Parameter (H,)           with sinks=True only

State dict: ``q_proj.weight``, ``q_proj.bias``, ... ``out_proj.bias`` (no ``*.bias`` with
``bias=False``), ``sinks``, ``q_norm.weight``, ``k_norm.weight``. A checkpoint of the fused
layout earlier versions kept (``qkv_weight`` (E + Hkv*D + Hkv*Dv, E), ``qkv_bias``) loads too.

The paths, one file each beside this one: ``dense`` (the (B, S) batch), ``packed`` (the real
tokens only), ``cached`` (a decoding step), ``fused`` (``nn.MultiheadAttention``'s fused
inference op), ``context_parallel``; ``plan`` chooses among them, ``memo`` remembers the
choice per call signature, ``report`` says what :meth:`dispatch` would run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from headwise import tracing as trace
from headwise.cache import KVCache
from headwise.dispatch import Dispatch
from headwise.evaluate import MaskMod, ScoreMod
from headwise.masks import alibi_slopes
from headwise.module import cached, checks, context_parallel, dense, fused, packed, qkv, report, ruled, torch_mha
from headwise.module import measured as measuring
from headwise.module import memo as memos
from headwise.module import paged as paged_path
from headwise.module import plan as planning
from headwise.module.plan import Plan
from headwise.positions import RotaryEmbedding
from headwise.weights import select as select_weights

__all__ = ["MultiHeadAttention"]


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
        mask_mod: MaskMod | None = None,  # None: no mask rule; else ANDed into every call's (see forward)
        score_mod: ScoreMod | None = None,  # None: no score rule; else applied in every call, before the call's
        context_parallel=None,  # None: one process; a headwise.distributed.ContextParallel splits the sequence
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        checks.check_sizes(embed_dim, num_heads, num_kv_heads, v_head_dim)
        checks.check_options(dropout=dropout, packing=packing, window=window, qk_norm=qk_norm,
                             qk_norm_eps=qk_norm_eps, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens)
        checks.check_context_parallel(context_parallel, softcap=softcap, sinks=sinks, sink_tokens=sink_tokens,
                                      v_head_dim=v_head_dim, head_dim=embed_dim // num_heads)
        backend, packing = checks.check_backend(backend, packing)
        self._repeats = memos.Memo()  # forward's decisions per call signature; any setting changed clears it
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.v_head_dim = self.head_dim if v_head_dim is None else v_head_dim
        self.sink_tokens, self.window = sink_tokens, window
        self.dropout, self.is_causal = float(dropout), bool(is_causal)
        self.backend, self.packing = backend, packing
        self.softcap = None if softcap is None else float(softcap)
        self.context_parallel = context_parallel
        self.mask_mod, self.score_mod = mask_mod, score_mod
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self._add_projections(bias, factory)
        rotary = rope or rope_base is not None or rope_parameters is not None or rotary_dim is not None
        self.rope = RotaryEmbedding(self.head_dim, rope_base, rotary_dim=rotary_dim,
                                    scaling=rope_parameters) if rotary else None
        self._add_norms(qk_norm, qk_norm_eps, factory)
        self.alibi_slopes: Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None,
                             persistent=False)
        self.sinks: nn.Parameter | None
        # zeros: each row's denominator starts with exp(0) for the sink
        self.register_parameter("sinks", nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None)
        self.register_load_state_dict_pre_hook(_load_hook)
        self.register_load_state_dict_post_hook(qkv.after_load)
        self.register_load_state_dict_post_hook(_undo_refused_load)

    def _add_projections(self, bias: bool, factory: dict[str, Any]) -> None:
        """q_proj, k_proj, v_proj and out_proj as ``nn.Linear``, the q, k, v weights in
        adjacent memory (one GEMM without gradients, module/qkv.py)."""
        E, H, Hkv, D, Dv = self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        self.q_proj = nn.Linear(E, H * D, bias=bias, **factory)  # (H*D, E)
        self.k_proj = nn.Linear(E, Hkv * D, bias=bias, **factory)  # (Hkv*D, E)
        self.v_proj = nn.Linear(E, Hkv * Dv, bias=bias, **factory)  # (Hkv*Dv, E)
        self.out_proj = nn.Linear(H * Dv, E, bias=bias, **factory)  # (E, H*Dv)
        qkv.pack(self)

    def _add_norms(self, qk_norm: str | None, eps: float, factory: dict[str, Any]) -> None:
        """q_norm and k_norm with qk_norm="rms": one weight of size D, shared by the heads
        (Qwen3's q_norm / k_norm); else None."""
        self.qk_norm = qk_norm
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if qk_norm == "rms":
            self.q_norm = nn.RMSNorm(self.head_dim, eps=float(eps), **factory)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=float(eps), **factory)

    def reset_parameters(self) -> None:
        """Initialise every parameter as a new module would: each projection as ``nn.Linear``
        does, the norms to ones, the sinks to zeros (and ALiBi's slopes afresh). After
        ``to_empty()`` of a module built on the ``meta`` device, this makes it usable.

        >>> mha = MultiHeadAttention(32, 4, device="meta").to_empty(device="cpu")
        >>> mha.reset_parameters()
        >>> bool(mha.q_proj.weight.isfinite().all())
        True
        """
        for m in (self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.q_norm, self.k_norm):
            if m is not None and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():
            if self.sinks is not None:
                self.sinks.zero_()
            if self.alibi_slopes is not None:
                self.alibi_slopes.copy_(alibi_slopes(self.num_heads))

    def reference_weight(self) -> Tensor:
        """A weight of the module, whose dtype and device its inputs and caches must have:
        ``out_proj.weight``; where a parametrisation computes it (``weight_norm``, ``prune``,
        ``spectral_norm``, ``torch.nn.utils.parametrize``), the first parameter of ``out_proj``
        (what it is computed from: after ``to()`` the old-style attribute is stale until the
        next call, and reading a new-style one would run the parametrisation); the first
        parameter of the module where ``out_proj`` was replaced by a module without one."""
        out = self.out_proj
        w = out._parameters.get("weight")
        if w is None and ("weight" in out.__dict__ or nn.utils.parametrize.is_parametrized(out, "weight")):
            w = next(out.parameters(), None)
        elif w is None:
            w = getattr(out, "weight", None)  # a wrapper's (PEFT's LoRA forwards it to its base layer)
        return w if isinstance(w, Tensor) else next(self.parameters())

    def trains(self) -> bool:
        """Whether gradients would reach the module's parameters (any of them requires grad)."""
        q = self._modules.get("q_proj")  # the dicts, not __getattr__ (~1 us a name): every training call asks
        weight = q._parameters.get("weight") if type(q) is nn.Linear else None
        if weight is not None and weight.requires_grad:
            return True
        return any(p.requires_grad for p in self.parameters())

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        repeats = self.__dict__.get("_repeats")
        if repeats:  # a setting changed (backend, packing, dropout, a parameter, a projection): decide afresh
            repeats.clear()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.__dict__.get("_repeats", {}).clear()

    def _apply(self, fn, recurse: bool = True):
        """``to()``, ``double()``, ``to_empty()``, ...: the parameters' dtype or device changes
        without an attribute being assigned, so the memo (keyed on x's) starts over too."""
        self._repeats.clear()
        before = qkv.before_apply(self)
        out = super()._apply(fn, recurse)
        qkv.after_apply(self, before)  # weights converted one by one: back into rows (module/qkv.py)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a strict load that it refuses for missing or unexpected
        keys changes nothing (torch copies every key that fits first). (Loaded as a part of a
        larger module, the strict flag is the caller's alone, and torch's behaviour holds.)"""
        self.__dict__["_strict_load"] = strict
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self.__dict__.pop("_strict_load", None)
            self.__dict__.pop("_before_load", None)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not isinstance(self.__dict__.get("_repeats"), memos.Memo):  # pickled by an earlier version
            self.__dict__["_repeats"] = memos.Memo()

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
        w = self.reference_weight()
        return KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim,
                       device=w.device, dtype=w.dtype, static=static, value_dim=self.v_head_dim,
                       window=self.window if evict else None, sink_tokens=self.sink_tokens if evict else 0)

    def forward(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context: Tensor | None = None,  # None: self-attention
        is_causal: bool | None = None,  # None: the constructor's value
        need_weights: bool = False,
        cache: KVCache | None = None,  # None: no incremental decoding
        mask_mod: MaskMod | None = None,  # None: the module's rule alone (if any)
        score_mod: ScoreMod | None = None,  # None: the module's rule alone (if any)
        weights_heads: Any = None,  # None: every head's weights (with need_weights)
        weights_rows: Any = None,  # None: every query row's weights (with need_weights)
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``x`` to ``x`` (or to ``context``).

        Args:
            x: (B, S, E) queries (and keys/values for self-attention).
            attention_mask: see the mask contract: bool/integer True = attend, float
                additive; (B, Sk), (B, S, Sk) or broadcastable to (B, H, S, Sk).
            context: (B, Sk, E) keys/values source for cross-attention.
            is_causal: bottom-right causal masking, ANDed with the mask.
            need_weights: also return the (B, H, S, Sk) softmax probabilities (before
                dropout, per head: not averaged as ``nn.MultiheadAttention`` does), computed
                from the kernel's log-sum-exp (any backend; see :mod:`headwise.weights`).
            cache: from :meth:`new_cache`: ``x`` holds the next T positions; their keys
                and values are appended and the queries attend to every cached position
                (Sk = len(cache) after appending; causal alignment is bottom-right). A 2-D
                bool/integer mask may cover the T new positions (it is remembered) or all
                Sk positions. With gradients on, a step writes the cache out of place and
                backward through every step is exact; decode under ``torch.no_grad()`` for speed. A static cache
                (``new_cache(..., static=True)``) attends over all its slots through a mask
                of the written ones and takes a (B, T) mask of the new positions. An evicting
                cache (``new_cache(..., evict=True)``) attends over the positions it kept
                through a mask of their true positions.
            mask_mod: FlexAttention's ``(b, h, q_idx, kv_idx) -> bool`` for this call (document
                boundaries change with every batch), ANDed with the constructor's mask_mod,
                the mask and the causal rule; see :func:`headwise.attention`. With a cache,
                ``q_idx`` is the query's position in the sequence.
            score_mod: FlexAttention's ``(score, b, h, q_idx, kv_idx) -> score`` for this call,
                applied after the constructor's.
            weights_heads, weights_rows: with ``need_weights``, only these heads' and query
                rows' weights: (B, h, s, Sk), as :func:`headwise.attention` takes them.

        Returns:
            (B, S, E), or ``(output, weights)`` when ``need_weights``. Padded positions of
            a 2-D self-attention mask output zeros, whichever path runs (see :meth:`plan`).

        Raises:
            ValueError / TypeError: inputs or mask that do not fit; see the messages.
        """
        if self.context_parallel is not None:  # module/context_parallel.py: checked on every rank together
            return context_parallel.call(self, x, attention_mask, context, is_causal, need_weights, cache, mask_mod,
                                         score_mod, weights_heads, weights_rows)
        if isinstance(cache, paged_path.PAGED):  # a PagedKVCache (or its batch()): module/paged.py
            return paged_path.forward(self, x, attention_mask, context, is_causal, need_weights, cache, mask_mod,
                                      score_mod)
        if need_weights or weights_heads is not None or weights_rows is not None:
            if not isinstance(x, Tensor) or x.dim() != 3:  # the rows are x's: name what is wrong with x first
                checks.check_inputs(self, x, context, cache)
            # a Selection is truthy: the paths read it as need_weights=True and hand it on to attend
            need_weights = cast(bool, select_weights(need_weights, weights_heads, weights_rows, self.num_heads,
                                                     x.shape[1]))
        if mask_mod is not None or score_mod is not None or self.mask_mod is not None or self.score_mod is not None:
            mask_mod, score_mod = ruled.rules_of(self, mask_mod, score_mod)
            return ruled.forward(self, x, attention_mask, context, is_causal, need_weights, cache, mask_mod, score_mod)
        return self._route(x, attention_mask, context, is_causal, need_weights, cache)

    def _route(self, x: Tensor, attention_mask: Tensor | None, context: Tensor | None, is_causal: bool | None,
               need_weights: bool, cache: KVCache | None) -> Tensor | tuple[Tensor, Tensor]:
        """:meth:`forward` without rules or a paged cache: a remembered call signature's way
        (``module/memo.py``), else the checks, the plan and its path."""
        # inside torch.func or forward AD, "auto" runs another kernel (checks.backend): nothing remembered
        signature = None if qkv.functorch_or_dual() else memos.signature(self, x, attention_mask, context, is_causal,
                                                                         need_weights, cache)
        key, padding, lengths = (None, None, None) if signature is None else signature
        repeat = None if key is None else self._repeats.get(key)
        if repeat is not None and repeat.current():  # a remembered signature: its checks passed, its plan holds
            if cache is not None and cached.repeats(self, cache, repeat.attention is not None):
                return cached.forward_repeat(self, x, cache, repeat)
            if repeat.attention is not None and cache is None:
                return dense.forward_repeat(self, x, padding if repeat.padded else None, repeat.attention)
            plan = Plan(repeat.path, repeat.why, repeat.is_causal, padding, lengths)
            key = None  # remembered already
        else:
            plan = planning.make_plan(self, x, attention_mask, context, is_causal, need_weights, cache,
                                      None if key is None else (padding, lengths))
            if plan.measure is not None:  # the estimates cannot choose: a recurring shape is measured
                if planning.recurs(plan.measure):  # both paths timed, the faster kept
                    return measuring.run(self, x, cast(Tensor, attention_mask), plan, plan.measure, key)
                key = None  # its first call: the estimates' path, not remembered, so the next call measures
        if plan.path == "fused" and fused.allowed(self):  # nothing hooks or wraps the projections since
            out = fused.forward(self, x)
        elif plan.path == "packed":
            out = packed.forward(self, x, plan)
        elif cache is not None:
            return cached.forward(self, x, attention_mask, plan, need_weights, cache, key=key)
        else:
            return dense.forward(self, x, attention_mask, context, plan, need_weights, key)
        self._repeats.remember(key, memos.Repeat(plan.path, plan.why, plan.is_causal, None, plan.path == "packed"))
        return out

    def plan(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context: Tensor | None = None,
        is_causal: bool | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        mask_mod: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
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
        if isinstance(cache, paged_path.PAGED):  # module/paged.py
            return paged_path.plan(self, x, attention_mask, context, is_causal, need_weights, cache, mask_mod,
                                   score_mod)
        if mask_mod is not None or score_mod is not None or self.mask_mod is not None or self.score_mod is not None:
            return ruled.plan(self, x, attention_mask, context, is_causal, need_weights, cache,
                              *ruled.rules_of(self, mask_mod, score_mod))
        return planning.make_plan(self, x, attention_mask, context, is_causal, need_weights, cache)

    def dispatch(
        self,
        x: Tensor,
        attention_mask: Tensor | None = None,
        *,
        context: Tensor | None = None,
        is_causal: bool | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        mask_mod: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Dispatch:
        """Which path and kernel :meth:`forward` would run on these inputs, and why.

        Decides from :meth:`plan` and the shapes alone: no projection or attention runs.
        ``.path`` names the path, ``.backend`` the kernel inside it (on the packed path: the
        kernel of the bucket with the most tokens; the reason lists every bucket's).

        >>> print(MultiHeadAttention(64, 4).dispatch(torch.rand(1, 3, 64)).backend)
        sdpa
        """
        if isinstance(cache, paged_path.PAGED):  # module/paged.py
            return paged_path.dispatch(self, x, attention_mask, context, is_causal, need_weights, cache, mask_mod,
                                       score_mod)
        plan = self.plan(x, attention_mask, context=context, is_causal=is_causal, need_weights=need_weights,
                         cache=cache, mask_mod=mask_mod, score_mod=score_mod)
        rules = ruled.at_positions(cache, *ruled.rules_of(self, mask_mod, score_mod))
        return report.dispatch(self, x, attention_mask, context, plan, need_weights, cache, rules)

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
        checks.check_tensor(self, "x", x)
        lengths = packed.lengths_of(cu_seqlens, lengths, x.shape[0])
        if trace.ACTIVE:
            trace.begin_call()
            trace.record("input (packed)", x, f"x: (T, E), {len(lengths)} sequences end to end, no padding")
        return packed.attend(self, x, cu_seqlens, lengths, positions,
                             self.is_causal if is_causal is None else bool(is_causal))

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, **kwargs) -> MultiHeadAttention:
        """Build one from a ``torch.nn.MultiheadAttention``; see :func:`headwise.module.torch_mha.from_torch`."""
        return torch_mha.from_torch(cls, m, **kwargs)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The equivalent ``torch.nn.MultiheadAttention``; see :func:`headwise.module.torch_mha.to_torch`.

        Raises:
            ValueError: a causal module (torch's takes causality per call: build this one
                with ``is_causal=False`` and pass torch's module a causal ``attn_mask``), and
                what else torch's module has no counterpart for (named).
        """
        return torch_mha.to_torch(self, batch_first=batch_first)


def _load_hook(module: MultiHeadAttention, state_dict: dict, prefix: str, local_metadata, strict: bool,
               missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """Before the module loads: split an earlier version's fused ``qkv_weight`` / ``qkv_bias``
    into the projections' keys, then check every shape, so that a mismatch loads nothing of
    this module (torch's own loading would copy the keys that fit and report the others)."""
    refused = not _split_fused(module, state_dict, prefix, error_msgs)
    own = module.state_dict(prefix=prefix, keep_vars=True)
    wrong = [(name, tuple(state_dict[name].shape), tuple(t.shape)) for name, t in own.items()
             if isinstance(state_dict.get(name), Tensor) and state_dict[name].shape != t.shape]
    if not wrong and not refused:
        if module.__dict__.get("_strict_load") and (any(name not in state_dict for name in own)
                       or any(name.startswith(prefix) and name not in own for name in state_dict)):
            # torch would copy what fits, then refuse the missing or unexpected keys (a part's own
            # hook may still supply them: _undo_refused_load decides from what torch reports)
            module.__dict__["_before_load"] = (prefix, {n: t.detach().clone() for n, t in own.items()
                                                        if isinstance(t, Tensor)})
        return
    for name, got, want in wrong:
        error_msgs.append(f"size mismatch for {name}: the checkpoint has shape {got}, this module needs {want} "
                          f"(embed_dim={module.embed_dim}, num_heads={module.num_heads}, "
                          f"num_kv_heads={module.num_kv_heads}, head_dim={module.head_dim}, "
                          f"v_head_dim={module.v_head_dim}); nothing of this module was loaded")
    for name, t in own.items():  # load what the module holds: nothing changes
        if name in state_dict:
            state_dict[name] = t.detach()


def _undo_refused_load(module: MultiHeadAttention, incompatible_keys) -> None:
    """A ``load_state_dict`` post-hook: where a strict load of this module reports missing or
    unexpected keys (it raises once every part has loaded), put back the values
    :func:`_load_hook` saved, so that a refused load changes nothing, as a refused shape does.
    (torch hands the hooks ``strict=True`` always: :meth:`MultiHeadAttention.load_state_dict`
    notes the caller's.)"""
    saved = module.__dict__.pop("_before_load", None)
    if saved is None:
        return
    prefix, values = saved
    if not any(name.startswith(prefix) for name in (*incompatible_keys.missing_keys,
                                                    *incompatible_keys.unexpected_keys)):
        return
    own = module.state_dict(prefix=prefix, keep_vars=True)
    with torch.no_grad():
        for name, t in values.items():
            if isinstance(own.get(name), Tensor):
                own[name].copy_(t)


def _split_fused(module: MultiHeadAttention, state_dict: dict, prefix: str, error_msgs: list) -> bool:
    """``qkv_weight`` (E + Hkv*D + Hkv*Dv, E) / ``qkv_bias``, as earlier versions saved them,
    become ``q_proj.*``, ``k_proj.*`` and ``v_proj.*``; False where one does not fit (reported)."""
    fits = True
    sizes = [module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim,
             module.num_kv_heads * module.v_head_dim]
    for kind in ("weight", "bias"):
        fused_name = f"{prefix}qkv_{kind}"
        if fused_name not in state_dict:
            continue
        fused_t = state_dict.pop(fused_name)
        if not isinstance(fused_t, Tensor) or fused_t.shape[0] != sum(sizes):
            got = tuple(fused_t.shape) if isinstance(fused_t, Tensor) else type(fused_t).__name__
            error_msgs.append(f"size mismatch for {fused_name} (the fused layout of earlier versions): the "
                              f"checkpoint has {got}, this module needs {sum(sizes)} rows = q {sizes[0]} + k "
                              f"{sizes[1]} + v {sizes[2]}; nothing of this module was loaded")
            fits = False
            continue
        for name, part in zip(("q_proj", "k_proj", "v_proj"), fused_t.split(sizes), strict=True):
            state_dict.setdefault(f"{prefix}{name}.{kind}", part)
    return fits

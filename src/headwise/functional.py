"""The functional API: validate once, normalise the mask, dispatch to a kernel.

The rules (:func:`attention`'s keywords from ``window`` to ``score_mod``; ``S`` queries, ``Sk``
keys, query ``i`` at key position ``i + Sk - S``, bottom-right aligned):

* the order of operations: ``s = q k^T * scale``; ``s = softcap * tanh(s / softcap)``;
  ALiBi's bias; ``s = score_mod(s, b, h, i, j)``; the mask (the attention mask, the causal /
  window rule and ``mask_mod``, ANDed); softmax over ``[s, sink_h]`` with the sink column
  dropped; dropout; ``@ v``;
* ``window``: query ``i`` attends only keys ``j`` with ``i + Sk - S - window < j <= i + Sk - S``
  (it implies causal);
* ``alibi_slopes`` (H,): adds ``-slope_h * |i + Sk - S - j|`` to the scores;
* ``softcap``: the scaled scores become ``softcap * tanh(scores / softcap)``, before ALiBi
  and the mask;
* ``sinks`` (H,): each row's softmax gets one more column ``sinks[h]`` that takes
  probability mass and adds nothing to the output; gradients reach ``sinks`` too;
* ``sink_tokens``: StreamingLLM's attention sinks, with a window only: the first
  ``sink_tokens`` keys stay visible too, so query ``i`` attends key ``j`` iff
  ``i + Sk - S - window < j <= i + Sk - S`` or ``j < sink_tokens and j <= i + Sk - S``;
* ``mask_mod``: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may
  attend), ANDed with everything above. The indices are int64 tensors that broadcast, ``b``
  (B, 1, 1, 1), ``h`` (1, H, 1, 1) (the query head), ``q_idx`` (1, 1, S, 1), ``kv_idx``
  (1, 1, 1, Sk), raw positions also when S != Sk. The helpers of :mod:`headwise.masks`
  (``causal``, ``sliding_window``, ``document``, ``prefix_lm``, ``and_masks``, ``or_masks``)
  know their tiles, so blockwise kernels skip empty ones; a :class:`headwise.masks.TileMap`
  is reused as built. A FlexAttention ``BlockMask`` may be given as ``attention_mask``
  instead: attended as Flex attends it, its full blocks whole and its partial blocks where
  its own mask_mod allows (:class:`headwise.rules.BlockRule`);
* ``score_mod``: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on the
  scaled score, after softcap and ALiBi and before the mask. Tensors it reads get their
  gradients (``headwise.masks.relative_position_bias`` is T5's learned bias). It must be a
  pure function of its arguments (no state, no random numbers but torch's default
  generator's): the ``chunked`` kernel calls it again in backward, and raises a
  RuntimeError where it answers otherwise.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import Tensor

from headwise import invariance, policy
from headwise import tracing as trace
from headwise.dispatch import Dispatch, select
from headwise.dispatch import logger as dispatch_logger
from headwise.evaluate import MaskMod, ScoreMod
from headwise.kernels import get_kernel, kernels  # the package: its BUILTIN list is the registry's start
from headwise.kernels.common import attached_zeros, lse_dtype
from headwise.kernels.registry import (
    BoundFn,
    Call,
    Kernel,
    Request,
    call_kernel,
    find_kernel,
    kernel_arguments,
    run_kernel,
    takes,
)
from headwise.mask_contract import check_mask_values, hide_excluded
from headwise.masks import Document, TileMap, _canonical, and_masks, is_block_mask, normalize_mask
from headwise.recognise import read as read_rule
from headwise.rules import Rules, check_functions, document_lengths, from_block_mask, knows_tiles, score_mod_needs_grad
from headwise.weights import Selection, weights_from_lse
from headwise.weights import select as select_weights

__all__ = ["attention", "available_backends", "choose_backend"]


def _check_structure(q: Tensor, window: int | None, alibi_slopes: Tensor | None,
                     softcap: float | None = None, sinks: Tensor | None = None, sink_tokens: int = 0) -> None:
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {type(window).__name__} ({window!r})")
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys per query, its own included), got {window}")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int):
        raise TypeError(f"sink_tokens must be an int, got {type(sink_tokens).__name__} ({sink_tokens!r})")
    if sink_tokens < 0:
        raise ValueError(f"sink_tokens must be >= 0 (the first keys kept visible under the window), got {sink_tokens}")
    if sink_tokens and window is None:
        raise ValueError(f"sink_tokens={sink_tokens} keeps the first keys visible under a sliding window; "
                         "give window=W too (without a window every earlier key is visible already)")
    if alibi_slopes is not None:
        H = q.shape[1]
        if not isinstance(alibi_slopes, Tensor) or not alibi_slopes.is_floating_point():
            raise TypeError(
                "alibi_slopes must be a floating tensor of shape (H,); "
                "headwise.masks.alibi_slopes(num_heads) gives the paper's"
            )
        if alibi_slopes.shape != (H,):
            raise ValueError(
                f"alibi_slopes must have shape (H,) = ({H},), got {tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(
                f"alibi_slopes is on {alibi_slopes.device} but the queries are on {q.device}"
            )
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__} ({softcap!r})")
        if not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be a finite number > 0 (Gemma 2 uses 50.0), got {softcap}")
    if sinks is not None:
        H = q.shape[1]
        if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
            raise TypeError(
                f"sinks must be a floating tensor of shape (H,), one logit per query head, got "
                f"{type(sinks).__name__ if not isinstance(sinks, Tensor) else sinks.dtype}; "
                "e.g. torch.zeros(num_heads)"
            )
        if sinks.shape != (H,):
            raise ValueError(f"sinks must have shape (H,) = ({H},), one logit per query head, "
                             f"got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but the queries are on {q.device}; "
                             "move it with sinks.to(q.device)")
        if policy.reads_values(sinks) and bool(torch.isposinf(sinks).any()):
            heads = torch.isposinf(sinks).nonzero().flatten().tolist()
            raise ValueError(f"sinks holds +inf (head {', '.join(map(str, heads))}): the sink would take every "
                             "row's whole probability and the softmax gives NaN; give finite logits (-inf: no sink)")


def _check_numbers(dropout_p, scale) -> None:
    """``dropout_p`` and ``scale`` are real numbers (numpy's too), never bools or strings."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__} ({dropout_p!r})")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            shown = "" if isinstance(scale, Tensor) else f" ({scale!r})"
            raise TypeError(f"scale must be a float or None (None: 1 / sqrt(D)), got {type(scale).__name__}"
                            f"{shown}; pass float(scale)")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be finite, got {scale}; None gives 1 / sqrt(D)")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, backend: str, scale=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}; "
                "split heads first, e.g. x.reshape(B, S, H, D).transpose(1, 2)"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); "
            "move them to one device"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, Hkv, Sk): k is (B, Hkv, Sk, D), "
            "v (B, Hkv, Sk, Dv); only the last dimension (the head dim) may differ"
        )
    B, H, _, D = q.shape
    if D == 0:
        raise ValueError(f"head dim D must be >= 1, got q of shape {tuple(q.shape)}; "
                         "give q and k at least one feature per head")
    if k.shape[0] != B:
        raise ValueError(f"q has batch {B} but k and v have batch {k.shape[0]}")
    if k.shape[-1] != D:
        raise ValueError(
            f"q head dim ({D}) differs from k head dim ({k.shape[-1]}); "
            "project q and k to the same head_dim (v may have its own)"
        )
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv:
        raise ValueError(
            f"q has {H} heads, which is not a multiple of k/v's {Hkv} heads; "
            "grouped-query attention needs num_heads % num_kv_heads == 0"
        )
    _check_numbers(dropout_p, scale)
    if backend != "auto":
        get_kernel(backend)  # raises ValueError listing the known names


def _effective_causal(is_causal: bool, window: int | None, q_len: int) -> bool:
    """Whether the causal rule can block anything: a window implies it; a single query
    sits at the last position, where bottom-right causality blocks no key."""
    if window is not None:
        return True
    return bool(is_causal) and q_len > 1


def _key_lengths(mask: Tensor | None) -> tuple[int, ...] | None:
    """Real keys per batch row of a bool key padding mask (B|1, 1, 1, Sk) whose values
    :func:`headwise.policy.reads_values` lets "auto" read; else unknown (None)."""
    if (mask is None or mask.dtype != torch.bool or mask.shape[1:3] != (1, 1) or mask.numel() == 0
            or not policy.reads_values(mask)):
        return None
    return tuple(mask.sum(-1).flatten().tolist())  # (B|1,)


def _key_padding(lengths: tuple[int, ...] | None, k_len: int) -> float | None:
    """Share of padded keys, rounded to 0.05, from :func:`_key_lengths` (None: unknown)."""
    if lengths is None:
        return None
    return round(20 * (1.0 - sum(lengths) / (len(lengths) * k_len))) / 20


def _request(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float,
             need_weights: bool, window: int | None, alibi: bool, softcap: bool = False,
             sinks: bool = False, value_dim: int | None = None, sink_tokens: int = 0,
             rules: Rules | None = None) -> Request:
    B, H, S, D = q.shape
    lengths = _key_lengths(mask)
    extra = {} if rules is None or (rules.mask_mod is None and rules.score_mod is None) else _rule_fields(
        rules, B, H, S, k.shape[2], q.device)
    return Request(
        device=q.device,
        dtype=q.dtype,
        batch=B,
        heads=H,
        kv_heads=k.shape[1],
        q_len=S,
        k_len=k.shape[2],
        head_dim=D,
        mask_kind="none" if mask is None else ("bool" if mask.dtype == torch.bool else "float"),
        mask_shape=None if mask is None else tuple(mask.shape),
        is_causal=_effective_causal(is_causal, window, S),
        window=window,
        alibi=alibi,
        dropout_p=float(dropout_p),
        need_weights=need_weights,
        requires_grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad),
        key_padding=_key_padding(lengths, k.shape[2]),
        key_lengths=lengths,
        softcap=softcap,
        sinks=sinks,
        value_dim=None if value_dim == D else value_dim,  # None: Dv == D, the usual request
        sink_tokens=sink_tokens,
        forward_ad=policy.forward_ad_active(),
        functorch=policy.functorch_active(),
        batch_invariant=invariance.is_batch_invariant(),
        **extra,
    )


def _rule_fields(rules: Rules, B: int, H: int, S: int, Sk: int, device: torch.device) -> dict:
    """What "auto" and the kernels' refusals read of a mask_mod / score_mod: whether each is
    given, whether the score rule is a bias and needs gradients, the share of empty tiles
    (where the mask rule knows its tiles without evaluating every pair) and the documents."""
    fields: dict = {"mask_mod": rules.mask_mod is not None}
    if rules.score_mod is not None:
        fields["score_mod"] = "additive" if getattr(rules.score_mod, "additive", False) else "general"
        fields["score_mod_grad"] = score_mod_needs_grad(rules.score_mod, device)
    structure = rules.structure(S, Sk)
    if rules.mask_mod is not None and knows_tiles(structure):
        block = (policy.CHUNKED_BLOCK_Q, policy.CHUNKED_BLOCK_K)
        states = rules.tile_states(B, H, S, Sk, block, device)  # (B|1, H|1, nq, nk)
        # a meta tensor has no values to count, an empty grid no share, and under torch.compile
        # the share would be a data-dependent number that the ranking cannot branch on
        if (states is not None and states.device.type != "meta" and states.numel() > 0
                and not torch.compiler.is_compiling()):
            fields["empty_tiles"] = round(20 * float(states.eq(0).float().mean())) / 20
        fields["documents"] = document_lengths(rules, B, S, Sk)
    return fields


def _prepare(q, k, v, attention_mask, is_causal, dropout_p, need_weights, backend,
             window=None, alibi_slopes=None, softcap=None, sinks=None, sink_tokens=0, scale=None,
             mask_mod=None, score_mod=None, return_lse=False):
    """Check the call, normalise its mask and choose its kernel: ``(mask, rules, dispatch)``.

    With ``need_weights``, a backend that returns the log-sum-exp (every one, for "auto") is
    asked for it instead of the weights, which :mod:`headwise.weights` computes from it:
    ``dispatch.request.need_weights`` is then False and its ``return_lse`` True.
    """
    _check_inputs(q, k, v, dropout_p, backend, scale)
    _check_structure(q, window, alibi_slopes, softcap, sinks, sink_tokens)
    check_functions(mask_mod, score_mod)
    B, H, S, _ = q.shape
    if is_block_mask(attention_mask):  # FlexAttention's BlockMask: its mask_mod
        block_rule = from_block_mask(attention_mask, S, k.shape[2], B=B, H=H)
        mask_mod = block_rule if mask_mod is None else and_masks(block_rule, mask_mod)
        attention_mask = None
    if isinstance(mask_mod, Document):
        mask_mod.check(S, k.shape[2], B)
    traced = read_rule(mask_mod, B, H, S, k.shape[2], q.device)  # a plain function: traced once, perhaps helpers
    mask_mod = mask_mod if traced is None else traced
    mask = normalize_mask(attention_mask, batch=B, heads=H, q_len=S, k_len=k.shape[2],
                          device=q.device, dtype=q.dtype)
    rules = Rules(is_causal=_effective_causal(is_causal, window, S), window=window, sink_tokens=sink_tokens,
                  alibi_slopes=alibi_slopes, softcap=None if softcap is None else float(softcap), sinks=sinks,
                  mask_mod=mask_mod, score_mod=score_mod)
    via_lse = bool(need_weights) and (backend == "auto" or takes(get_kernel(backend).fn, "return_lse"))
    request = _request(q, k, mask, is_causal, dropout_p, bool(need_weights) and not via_lse, window,
                       alibi_slopes is not None, softcap is not None, sinks is not None, v.shape[-1],
                       sink_tokens, rules)
    if return_lse or via_lse:
        request = replace(request, return_lse=True)
    dispatch = select(request, backend)
    if via_lse:
        dispatch = replace(dispatch, reason=dispatch.reason + "; the weights asked for are computed from its "
                           "log-sum-exp, exp(scores - lse), only for the heads and rows asked for")
    return mask, rules, dispatch


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,  # None: 1 / sqrt(D)
    backend: str = "auto",
    need_weights: bool = False,
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
    softcap: float | None = None,  # None: no logit soft-capping
    sinks: Tensor | None = None,  # None: no attention sinks
    sink_tokens: int = 0,  # 0: none; n: the first n keys stay visible under the window
    mask_mod: MaskMod | None = None,  # None: no mask rule beyond the keywords
    score_mod: ScoreMod | None = None,  # None: no score rule beyond the keywords
    return_lse: bool = False,
    weights_heads: Sequence[int] | slice | Tensor | int | None = None,  # None: every head's weights
    weights_rows: Sequence[int] | slice | Tensor | int | None = None,  # None: every query row's weights
) -> Tensor | tuple[Tensor, ...]:
    """Scaled dot-product attention with headwise's mask contract.

    ``softmax(q k^T * scale + mask) v``, per head; a query row that may attend nothing
    returns zeros (and zero gradients), never NaN. The rules (``window`` to ``score_mod``)
    act in the order, and exactly as, the module docstring's "The rules" says.

    Args:
        q: queries (B, H, S, D).
        k: keys (B, Hkv, Sk, D); ``H % Hkv == 0`` (Hkv < H: grouped-query attention,
            query head ``h`` reads kv head ``h // (H // Hkv)``).
        v: values (B, Hkv, Sk, Dv); Dv may differ from D (as multi-head latent attention's).
        attention_mask: bool/integer (True = attend) or float (additive) mask, 2-D (B, Sk)
            key padding, 3-D (B, S, Sk), 4-D broadcastable to (B, H, S, Sk), or a FlexAttention BlockMask.
        is_causal: query ``i`` may attend key ``j`` iff ``j <= i + Sk - S``; ANDed with the mask.
        dropout_p: dropout on the attention probabilities, applied whenever > 0 (as in
            ``F.scaled_dot_product_attention``; the module passes 0 in eval mode).
        scale: multiplier of ``q k^T``.
        backend: ``"auto"`` or a name from :func:`available_backends`.
        need_weights: also return the probabilities before dropout, from any backend's
            log-sum-exp (``p = exp(s - lse)``, :mod:`headwise.weights`), for the heads and rows asked for.
        weights_heads, weights_rows: with ``need_weights``, the query heads and rows whose weights to
            compute: an int, ints, a slice or an integer tensor (None: all); memory follows the choice.
        window: a sliding window of ``window`` keys per query, its own included (implies causal).
        alibi_slopes: (H,) ALiBi slopes (``headwise.masks.alibi_slopes(H)`` gives the paper's).
        softcap: Gemma 2's logit soft-capping, a float > 0 (Gemma 2 uses 50.0).
        sinks: (H,) floating sink logits on q's device, one per query head (gpt-oss); differentiable.
        sink_tokens: with a window, the first ``sink_tokens`` keys stay visible too (StreamingLLM).
        mask_mod: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend).
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, a pure function.
        return_lse: also return each row's log-sum-exp, the natural log of its softmax denominator over the
            final scores (sinks counted, ``-inf`` for a row that attends nothing; differentiable):
            :func:`headwise.merge_attentions` merges attentions over disjoint keys by it.

    Returns:
        ``out`` (B, H, S, Dv), ``(out, weights)``, ``(out, lse)`` or ``(out, weights, lse)``: the
        weights (B, h, s, Sk) of the heads and rows asked for, (B, H, S, Sk) by default (with ``sinks``
        a row sums to ``1 - p(sink)``); the lse (B, H, S) in float32 (float64 for float64 inputs).

    Raises:
        TypeError: non-tensor or non-floating inputs, dtypes that differ, a bad mask dtype.
        ValueError: shapes that do not fit, devices that differ, dropout outside [0, 1), sink tokens
            without a window, an unknown backend, or a backend that cannot serve the request.

    >>> q = k = v = torch.randn(2, 8, 5, 16)
    >>> attention(q, k, v, torch.tensor([[1, 1, 1, 0, 0], [1] * 5])).shape
    torch.Size([2, 8, 5, 16])
    >>> out, w = attention(q, k, v, softcap=50.0, sinks=torch.zeros(8), need_weights=True)
    >>> bool((w.sum(-1) < 1).all())  # the sinks hold the rest of each row
    True
    >>> attention(q, k, torch.randn(2, 8, 5, 24), window=2, sink_tokens=1).shape  # Dv = 24
    torch.Size([2, 8, 5, 24])
    """
    if trace.ACTIVE:
        trace.begin_call()
    return attend(q, k, v, attention_mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
                  backend=backend, need_weights=need_weights, window=window, alibi_slopes=alibi_slopes,
                  softcap=softcap, sinks=sinks, sink_tokens=sink_tokens, mask_mod=mask_mod, score_mod=score_mod,
                  return_lse=return_lse, weights_heads=weights_heads, weights_rows=weights_rows)


# A repeated call (same signature: shapes, dtypes, devices, flags) reuses the kernel and
# arguments that validation and dispatch chose the first time: every check they made reads
# only what the signature holds, so it would pass again. For "auto" without dropout or a
# mask the decision reads no length beyond S > 1 (the causal rule), Sk > 0 and S == Sk, so
# a decoding step, whose Sk grows by one, still repeats. A masked call's signature holds
# the mask's shape, dtype and device and, for "auto", its real keys per row (what the
# checks and the decision read); its mask itself is the call's own. Calls with a window,
# ALiBi, weights, soft-capping or sinks take the full path. Kept outside traces and
# torch.compile (which traces the full path once per graph anyway).
_REPEATS: dict[tuple, Prepared] = {}
_REPEATS_LIMIT = 512  # signatures remembered; the memo starts over when full


@dataclass(frozen=True, eq=False)
class Prepared:
    """One call signature's checked decision: the kernel and its arguments, the mask aside.

    :func:`prepare` makes one on a signature's first call and remembers it. Calling it runs
    the kernel on a later call's tensors (``mask``: that call's mask in the 4-D form,
    :func:`headwise.masks._canonical`) and returns the output (B, H, S, Dv).
    """

    kernel: Kernel
    rules: Rules
    args: dict  # every keyword of the kernel's call but the mask, rules included (kernel_arguments)
    unmasked: BoundFn | None = None  # the kernel's shortcut for a call without a mask (Kernel.bind), or None
    masked: BoundFn | None = None  # its shortcut for a masked call whose excluded positions are finite, or None

    def current(self) -> bool:
        """Whether the kernel is still the one registered under its name."""
        return find_kernel(self.kernel.name) is self.kernel

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                 excluded_finite: bool = False) -> Tensor:
        """``excluded_finite``: the caller made what ``mask`` excludes for every query finite
        (the module zeroes padded positions of x before projecting them), so the NaN
        contract's :func:`~headwise.mask_contract.hide_excluded` has nothing to hide."""
        if mask is None:
            if self.unmasked is not None:  # bound for no mask and no causal rule: nothing to hide
                return self.unmasked(q, k, v, None)  # (B, H, S, Dv)
        else:
            check_mask_values(mask)
            if excluded_finite and self.masked is not None:
                return self.masked(q, k, v, mask)  # (B, H, S, Dv)
        if not excluded_finite:
            q, k, v = hide_excluded(q, k, v, mask, is_causal=self.rules.is_causal)  # the NaN contract
        return run_kernel(self.kernel.fn, q, k, v, mask, self.args).out  # (B, H, S, Dv)


def logs_choices() -> bool:
    """Whether "auto" logs its choice (at DEBUG): then every call goes through dispatch to say it."""
    return dispatch_logger.isEnabledFor(logging.DEBUG)


def _signature(q, k, v, is_causal, dropout_p, scale, backend, mask=None, lengths=None) -> tuple:
    """What the checks and the decision read, as a dict key (AttributeError for non-tensors).

    With a mask: its shape, dtype and device (what its validation reads), the full q, k, v
    shapes (the mask was validated against S and Sk) and ``lengths``, the real keys per row
    that "auto" reads (:func:`_key_lengths`; None for a named kernel or an unread mask).
    """
    qs, ks, vs = q.shape, k.shape, v.shape
    shapes: tuple
    if mask is not None:
        shapes = (qs, ks, vs, mask.shape, mask.dtype, mask.device, lengths)
    elif backend == "auto" and not dropout_p and len(qs) == 4 and len(ks) == 4:
        # (B, H, D), (B, Hkv, D), S > 1, Sk > 0, S == Sk (causal with S != Sk ranks differently
        # on CUDA in half precision), k, v alike but for v's head dim, and Dv: all the checks and "auto" read
        shapes = (qs[0], qs[1], qs[3], ks[0], ks[1], ks[3], qs[2] > 1, ks[2] > 0, qs[2] == ks[2], ks[:3] == vs[:3],
                  vs[3:])
    else:
        shapes = (qs, ks, vs)
    return (shapes, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, is_causal, dropout_p, scale, backend,
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad), policy.forward_ad_active(),
            policy.functorch_active(), policy.GENERATION, invariance.is_batch_invariant())


def prepare(q, k, v, attention_mask=None, mask_4d=None, *, is_causal=False, dropout_p=0.0, scale=None,
            backend="auto", key_lengths=None) -> Prepared | None:
    """The remembered decision for a call with none of window, ALiBi, weights, soft-capping,
    sinks and sink tokens (the caller sees to that), made on its signature's first call.

    Args:
        q, k, v, attention_mask, is_causal, dropout_p, scale, backend: as :func:`attention` takes them.
        mask_4d: ``attention_mask`` in the 4-D form (:func:`headwise.masks._canonical`).
        key_lengths: the real keys per row of a 2-D bool/integer ``attention_mask``, where
            the caller has read them already; None: read here when "auto" needs them.

    Returns:
        The :class:`Prepared` call, or None where the call takes :func:`attend`'s full path:
        in a trace, under torch.compile, while "auto" logs its choices, with no keys, or
        with arguments that are not tensors (the full path names the error).

    Raises:
        What :func:`attention` raises for inputs it refuses, on a signature's first call.
    """
    if trace.ACTIVE or torch.compiler.is_compiling() or logs_choices():
        return None
    try:
        lengths = None
        if attention_mask is not None and backend == "auto":  # what the decision reads of the mask
            reads = key_lengths is not None and policy.reads_values(attention_mask)
            lengths = key_lengths if reads else _key_lengths(mask_4d)
        key = _signature(q, k, v, is_causal, dropout_p, scale, backend, attention_mask, lengths)
        prepared = _REPEATS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable flags
        return None
    if prepared is not None and find_kernel(prepared.kernel.name) is prepared.kernel:  # prepared.current(), inlined
        return prepared
    if k.shape[-2] == 0:  # no keys: the full path checks the call and gives the contract's zeros
        return None
    _, rules, dispatch = _prepare(q, k, v, attention_mask, is_causal, dropout_p, False, backend, scale=scale)
    args = _arguments(dropout_p, scale, q.shape[-1])
    # Read key counts, none zero and no causal rule: every query row has a key, so a kernel
    # that guards rows with none may skip the guard. Only where "auto" read them: they are
    # in the signature, so every later call of it has them too.
    if (lengths is not None and 0 not in lengths and not dispatch.request.is_causal
            and takes(dispatch.kernel.fn, "known_live", by_name=True)):
        args["known_live"] = True
    if len(_REPEATS) >= _REPEATS_LIMIT:
        _REPEATS.clear()
    kernel = dispatch.kernel
    keywords = kernel_arguments(kernel.fn, rules, args)
    bind = kernel.bind
    bound = (None, None) if bind is None else (bind(kernel.fn, rules, keywords, q, k, False),
                                               bind(kernel.fn, rules, keywords, q, k, True))
    _REPEATS[key] = prepared = Prepared(kernel, rules, keywords, *bound)
    return prepared


def _arguments(dropout_p, scale, D: int, need_weights=False) -> dict:
    """The kernel's keyword arguments but the mask and the rules."""
    return dict(dropout_p=float(dropout_p), scale=1.0 / math.sqrt(D) if scale is None else float(scale),
                need_weights=need_weights)


def attend(q, k, v, attention_mask=None, *, is_causal=False, dropout_p=0.0, scale=None,
           backend="auto", need_weights=False, window=None, alibi_slopes=None, softcap=None, sinks=None,
           sink_tokens=0, key_lengths=None, excluded_finite=False, mask_mod=None, score_mod=None, return_lse=False,
           weights_heads=None, weights_rows=None):
    """:func:`attention` without opening a new call in an active trace (the module opens it).

    In a trace it records the mask layout, the kernel chosen and, after the kernel ran, the
    stages the kernel declares for this call (kernels hold no hooks of their own).
    ``key_lengths``: the real keys per row of a 2-D bool/integer ``attention_mask``, where
    the caller has read them already (the module has); None: read them here when needed.
    ``excluded_finite``: the caller made what the mask excludes for every query finite (the
    module zeroes padded positions of x): the NaN contract's hiding is skipped.
    ``need_weights`` may be a :class:`headwise.weights.Selection` (the module passes one).
    """
    # The memo's signature holds no softcap, sinks, sink tokens or rule functions: calls with any take the full path.
    if (window is None and alibi_slopes is None and not need_weights and softcap is None and sinks is None
            and not sink_tokens and mask_mod is None and score_mod is None and not return_lse
            and weights_heads is None and weights_rows is None):
        try:
            mask_4d = None if attention_mask is None else _canonical(attention_mask, q.dtype)
        except (AttributeError, TypeError):  # not tensors: the full path names the error
            pass
        else:
            prepared = prepare(q, k, v, attention_mask, mask_4d, is_causal=is_causal, dropout_p=dropout_p,
                               scale=scale, backend=backend, key_lengths=key_lengths)
            if prepared is not None:  # prepared(q, k, v, mask_4d), one Python call fewer
                if attention_mask is not None:
                    check_mask_values(attention_mask)
                if not excluded_finite:  # the NaN contract
                    q, k, v = hide_excluded(q, k, v, mask_4d, is_causal=prepared.rules.is_causal)
                return run_kernel(prepared.kernel.fn, q, k, v, mask_4d, prepared.args).out  # (B, H, S, Dv)
    mask, rules, dispatch = _prepare(q, k, v, attention_mask, is_causal, dropout_p, need_weights,
                                     backend, window, alibi_slopes, softcap, sinks, sink_tokens, scale,
                                     mask_mod, score_mod, return_lse)
    # The weights come from the kernel's log-sum-exp where the backend returns it (any, for "auto").
    via_lse = bool(need_weights) and not dispatch.request.need_weights
    if attention_mask is not None and mask is not None:
        check_mask_values(attention_mask)
    B, H, S, D = q.shape
    selection = select_weights(need_weights, weights_heads, weights_rows, H, S)  # None: no weights asked
    if trace.ACTIVE and trace.recording():
        _record_call(q, k, attention_mask, mask, rules, dispatch)
    if k.shape[2] == 0 or S == 0 or B == 0:  # nothing to attend, or no row to attend from: no kernel runs
        return _empty(q, k, v, sinks, selection, return_lse)
    args = _arguments(dropout_p, scale, D, selection is not None and not via_lse)
    if return_lse or via_lse:
        args["return_lse"] = True
    # What the mask excludes for every query must not reach a result, even as NaN or inf.
    if not excluded_finite:
        q, k, v = hide_excluded(q, k, v, mask, is_causal=rules.is_causal, window=window, sink_tokens=sink_tokens,
                                mask_mod=rules.structure(S, k.shape[2]) if rules.mask_mod is not None else None)
    result = call_kernel(dispatch.kernel.fn, q, k, v, mask, rules, args)
    if trace.ACTIVE and trace.recording():
        call = Call(q, k, v, attention_mask=mask, rules=rules, dropout_p=args["dropout_p"], scale=args["scale"],
                    need_weights=args["need_weights"], scale_given=scale is not None)
        _record_kernel_stages(dispatch.kernel, call, result.out)
    weights = result.weights
    if selection is not None:  # (B, h, s, Sk): only what was asked for
        weights = (_weights(q, k, mask, rules, cast(Tensor, result.lse), args["scale"], selection) if via_lse
                   else selection.pick(cast(Tensor, weights)))
    return _results(result.out, weights, result.lse if return_lse else None)


def _record_call(q: Tensor, k: Tensor, attention_mask: Tensor | None, mask: Tensor | None, rules: Rules,
                 dispatch: Dispatch) -> None:
    """Explain mode: the mask's layout, the kernel chosen and why, and the rule functions."""
    if attention_mask is not None and mask is not None:
        trace.record("mask layout", mask, f"{attention_mask.dim()}-D {tuple(attention_mask.shape)} "
                     f"{str(attention_mask.dtype).removeprefix('torch.')} -> {tuple(mask.shape)}: "
                     "broadcasts over (B, H, S, Sk), no copy")
    trace.record("kernel", q, f"backend {dispatch.backend!r}: {dispatch.reason}")
    if rules.mask_mod is not None or rules.score_mod is not None:
        B, H, S, _ = q.shape
        trace.record("rules", q, _rules_note(rules, B, H, S, k.shape[2], q.device))


def _empty(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, selection: Selection | None,
           return_lse: bool) -> Tensor | tuple[Tensor, ...]:
    """Sk = 0 (the contract's zero rows), S = 0 or B = 0 (no rows): the results (B, H, S, Dv) in
    the graph of the inputs, without a kernel (torch's CPU flash kernel divides by zero on S = 0).
    The lse is -inf, or the sink's logit where sinks join the softmax: the one column left."""
    B, H, S, _ = q.shape
    Sk = k.shape[2]
    out = attached_zeros(q, k, v, *([] if sinks is None else [sinks]), size=v.shape[-1])  # zero gradients
    if trace.ACTIVE:
        size = "Sk" if Sk == 0 else "S" if S == 0 else "B"
        result = "output zeros" if Sk == 0 else "an empty output"
        trace.record("no keys" if Sk == 0 else "no rows", out, f"{size} = 0: the kernel is not called; {result}")
    if sinks is None:
        lse = torch.full((B, H, S), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)  # (B, H, S)
    else:  # (H,) -> (B, H, S): logsumexp over the sink column alone
        lse = sinks.to(lse_dtype(q.dtype)).reshape(1, H, 1).expand(B, H, S)
    weights = None if selection is None else selection.pick(q.new_zeros(B, H, S, Sk))
    return _results(out, weights, lse if return_lse else None)


def _weights(q: Tensor, k: Tensor, mask: Tensor | None, rules: Rules, lse: Tensor, scale: float,
             selection: Selection) -> Tensor:
    """The weights asked for, from the kernel's log-sum-exp (:func:`headwise.weights.weights_from_lse`)."""
    weights = weights_from_lse(q, k, mask, rules, lse, scale, selection)  # (B, h, s, Sk)
    if trace.ACTIVE and trace.recording():
        trace.record("weights", weights, "exp(scores - lse) for the heads and rows asked for, "
                     f"{tuple(weights.shape)}: the kernel's log-sum-exp, no (B, H, S, Sk) softmax kept")
    return weights


def _results(out: Tensor, weights: Tensor | None, lse: Tensor | None) -> Tensor | tuple[Tensor, ...]:
    """``out``, with the weights and the lse after it where they were asked for (None: not asked)."""
    if weights is None and lse is None:
        return out
    return (out, *(t for t in (weights, lse) if t is not None))


def _rules_note(rules: Rules, B: int, H: int, S: int, Sk: int, device: torch.device) -> str:
    """Explain mode's words for the call's rule functions, with the tile map where the rule knows it."""
    note = rules.describe()
    structure = rules.structure(S, Sk)
    if rules.mask_mod is not None and knows_tiles(structure):
        block = (policy.CHUNKED_BLOCK_Q, policy.CHUNKED_BLOCK_K)
        states = rules.tile_states(B, H, S, Sk, block, device)
        if structure is not None and states is not None:
            note += "; " + TileMap(structure, (B, H, S, Sk), block, states).describe()
    return note


def _record_kernel_stages(kernel: Kernel, call: Call, out: Tensor) -> None:
    """Explain mode: record the stages ``kernel`` declares for ``call``, in its order."""
    if kernel.stages is None:  # a registered kernel that describes nothing: its output, opaque
        trace.record(kernel.name, out, f"backend {kernel.name!r} describes no stages (Kernel.stages); "
                     "its output", fused=kernel.fused)
        return
    for stage in kernel.stages(call):
        trace.record(stage.name, stage.shape, stage.note, fused=stage.fused, dtype=stage.dtype)


def choose_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
    window: int | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    sink_tokens: int = 0,
    mask_mod: MaskMod | None = None,
    score_mod: ScoreMod | None = None,
    return_lse: bool = False,
) -> Dispatch:
    """Which backend :func:`attention` would run for these arguments, and why.

    Takes the same arguments as :func:`attention` and runs nothing.

    Returns:
        A :class:`~headwise.dispatch.Dispatch`; ``print`` it for the reasons.

    >>> q = torch.randn(1, 2, 3, 4)
    >>> choose_backend(q, q, q).backend
    'sdpa'
    """
    return _prepare(q, k, v, attention_mask, is_causal, dropout_p, need_weights, backend,
                    window, alibi_slopes, softcap, sinks, sink_tokens, mask_mod=mask_mod, score_mod=score_mod,
                    return_lse=return_lse)[2]


def available_backends() -> list[str]:
    """Names of the backends usable on this machine (``"auto"`` is always usable too).

    >>> "matmul" in available_backends()
    True
    """
    return [name for name, kernel in kernels().items() if kernel.available() is None]

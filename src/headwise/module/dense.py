"""The dense path: attention over the (B, S) batch as it is, padding included.

(B, S, E) -> projections and heads -> q/k norm, rotary -> the kernel -> merge heads, output
projection -> zeros at the padded positions. What a padded position of x (or of the
context) holds never reaches a result or a gradient: it is zeroed before the projections.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, Dv value head dim, E embed dim.
"""

from __future__ import annotations

from torch import Tensor

from headwise import functional
from headwise import tracing as trace
from headwise.functional import Prepared, attend
from headwise.masks import _canonical as canonical_mask
from headwise.module import checks
from headwise.module import projections as proj
from headwise.module.layer_protocol import Layer
from headwise.module.memo import Repeat, preparable
from headwise.module.plan import Plan, all_tokens
from headwise.weights import Selection


def forward(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None, plan: Plan,
            need_weights: bool, key: tuple | None, rules: tuple = (None, None)) -> Tensor | tuple[Tensor, Tensor]:
    """Self- or cross-attention without a cache; ``key``: the call's memo key (None: not
    remembered), under which the plan and the prepared kernel call are stored once it ran;
    ``rules``: the call's (mask_mod, score_mod)."""
    if trace.ACTIVE:
        trace.begin_call()
        trace.record("input", x, "x: (B, S, E)" + ("; context: (B, Sk, E)" if context is not None else ""))
    padding = plan.padding
    if all_tokens(plan.lengths, x.shape[1]):
        attention_mask = padding = None  # every position is a token: the mask allows all, nothing to zero
        if trace.ACTIVE:
            trace.record("padding mask", x, "every position of the 2-D mask is a real token: attend without it")
    finite = False  # x is finite everywhere (read where it is free)
    if padding is not None:  # what a padded position holds (NaN, inf) reaches no result and no gradient
        x, finite = proj.hide_padding(x, padding)
    if context is not None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        keys = proj.as_padding(attention_mask).expand(context.shape[0], -1)  # (B, Sk): the context's padding
        context, _ = proj.hide_padding(context, keys)
    q, k, v = proj.project_heads(mha, x, context)  # (B, H, S, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)
    q, k = proj.rotate(mha, *proj.normalize(mha, q, k), 0)
    # x's padded positions are finite (or were zeroed): with its own padding mask, what the mask
    # excludes for every query (padded keys, the queries of an all-padding row) is finite
    hidden = padding is not None and context is None and attention_mask is not None and attention_mask.dim() == 2
    dropout_p = mha.dropout if mha.training else 0.0
    key_lengths = plan.lengths if padding is not None else None  # the mask's, read once
    if key is not None and preparable(mha):  # the attention call, checked and dispatched once for the memo
        mask_4d = None if padding is None else canonical_mask(padding)  # (B, 1, 1, S)
        attention = functional.prepare(q, k, v, attention_mask, mask_4d, is_causal=plan.is_causal,
                                       dropout_p=dropout_p, backend=checks.backend(mha), key_lengths=key_lengths)
        if attention is not None:
            out = proj.output(mha, attention(q, k, v, mask_4d, excluded_finite=hidden), padding, finite)
            mha._repeats.remember(key, Repeat(plan.path, plan.why, plan.is_causal, attention, padding is not None))
            return out
    out = attend(q, k, v, attention_mask, is_causal=plan.is_causal, dropout_p=dropout_p, backend=checks.backend(mha),
                 need_weights=need_weights, window=mha.window, alibi_slopes=checks.slopes(mha),
                 softcap=mha.softcap, sinks=checks.sinks(mha), sink_tokens=mha.sink_tokens, key_lengths=key_lengths,
                 excluded_finite=hidden, mask_mod=rules[0], score_mod=rules[1])
    out, weights = out if need_weights else (out, None)
    out = proj.output(mha, out, padding, finite)  # (B, S, E)
    mha._repeats.remember(key, Repeat(plan.path, plan.why, plan.is_causal, None, padding is not None))
    if weights is None:
        return out
    if padding is not None:  # a padded query's output is zeros, and so are its weights
        rows = padding if not isinstance(need_weights, Selection) else need_weights.pick(padding, None, 1)  # (B, s)
        weights = weights.masked_fill(~rows[:, None, :, None], 0)  # (B, H, S, Sk)
    return out, weights


def forward_repeat(mha: Layer, x: Tensor, padding: Tensor | None, attention: Prepared) -> Tensor:
    """A remembered signature on the dense path: no checks, no plan, the attention call
    :func:`headwise.functional.prepare` made for it. (B, S, E) -> (B, S, E).
    ``padding``: (B, S), False at padding; None where there is none (no mask, or all tokens)."""
    finite = False
    if padding is not None:  # what a padded position holds reaches no result and no gradient
        x, finite = proj.hide_padding(x, padding)
    plain = proj.plain_linears(mha)  # read once a call: only the kernel runs between the projections
    q, k, v = proj.project_heads(mha, x, None, plain)  # (B, H, S, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
    if mha.rope is not None or mha.q_norm is not None:
        q, k = proj.rotate(mha, *proj.normalize(mha, q, k), 0)
    mask = None if padding is None else canonical_mask(padding)  # (B, 1, 1, S)
    out = attention(q, k, v, mask, excluded_finite=True)  # (B, H, S, Dv): padded x was zeroed, as above
    return proj.output(mha, out, padding, finite, plain)

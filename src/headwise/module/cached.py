"""The cached path: one decoding step through a :class:`~headwise.cache.KVCache`.

x (B, T, E) holds the next T positions; their keys and values are appended and the queries
attend to every cached position. A dynamic cache attends over what it holds (bottom-right
causal); a static cache over all its slots through a mask of the written ones; an evicting
cache over the positions it kept through a mask of their true positions. A refused step
(a kernel's refusal, an interrupt) leaves the cache exactly as it was.

Legend: B batch, H query heads, Hkv key/value heads, T new positions, L cached positions,
D head dim, Dv value head dim, E embed dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwise import functional
from headwise import tracing as trace
from headwise.cache import KVCache
from headwise.functional import Prepared, attend
from headwise.masks import AlignedCausal
from headwise.module import checks, memo
from headwise.module import projections as proj
from headwise.module.layer_protocol import Layer
from headwise.module.plan import Plan
from headwise.positions import apply_rotary
from headwise.rules import Alibi, Composed
from headwise.weights import Selection


def forward(mha: Layer, x: Tensor, attention_mask: Tensor | None, plan: Plan, need_weights: bool,
            cache: KVCache, rules: tuple = (None, None), key: tuple | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """One step, undone if it is refused after the cache changed; ``rules``: the call's
    (mask_mod, score_mod), their queries already at their positions; ``key``: the call's
    memo key (None: not remembered), under which the plan (and the prepared attention call
    where :func:`repeats`) is stored once the step ran."""
    if key is not None and attention_mask is None and repeats(mha, cache):
        step, attention = _remembered(mha, x, cache, plan.is_causal, None)
        mha._repeats.remember(key, memo.Repeat(plan.path, plan.why, plan.is_causal, attention, False))
        return step
    if torch.compiler.is_compiling():  # a compiled step raises no refusal at run time
        return _step(mha, x, attention_mask, plan, need_weights, cache, rules)
    saved = cache.savepoint(x.shape[1], masked=attention_mask is not None)
    try:
        out = _step(mha, x, attention_mask, plan, need_weights, cache, rules)
    except BaseException:
        cache.rollback(saved)
        raise
    mha._repeats.remember(key, memo.Repeat(plan.path, plan.why, plan.is_causal, None, False))
    return out


def repeats(mha: Layer, cache: KVCache, prepared: bool = False) -> bool:
    """Whether a remembered step may take :func:`forward_repeat`: a dynamic cache that neither
    evicts nor holds a padding mask, and an attention call that
    :func:`headwise.functional.prepare` remembers. ``prepared``: the memo's step holds such a
    call already (the module's settings were preparable then, and setting one clears the memo)."""
    return not (cache.static or cache.window is not None or cache.padded) and (prepared or memo.preparable(mha))


def forward_repeat(mha: Layer, x: Tensor, cache: KVCache, repeat: memo.Repeat) -> Tensor:
    """A remembered decoding step without a mask, where :func:`repeats` (the module's memo:
    this signature's checks and plan passed before; the cache's room and batch are checked as
    it appends). (B, T, E) -> (B, T, E)."""
    return _remembered(mha, x, cache, repeat.is_causal, repeat.attention)[0]


def _remembered(mha: Layer, x: Tensor, cache: KVCache, causal: bool,
                attention: Prepared | None) -> tuple[Tensor, Prepared | None]:
    """Project, append, attend, project out; undone if it is refused after the cache changed.

    ``attention``: the call :func:`headwise.functional.prepare` made for this signature's
    earlier steps, or None (prepared here). Returns the output (B, T, E) and the prepared
    call where a later step of the signature may reuse it: "auto" without dropout, whose
    decision reads no key length but Sk > 0 and S == Sk (the memo's key holds whether the
    cache was empty, so S == Sk is the same on every step of it)."""
    saved = cache.savepoint(x.shape[1], masked=False)
    try:
        plain = proj.plain_linears(mha)  # read once a step: only the kernel runs between the projections
        q, k, v = proj.project_heads(mha, x, None, plain)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, Dv)
        if mha.rope is not None or mha.q_norm is not None:
            q, k = proj.rotate(mha, *proj.normalize(mha, q, k), len(cache))
        k, v = cache.append(k, v)  # (B, Hkv, L, D), (B, Hkv, L, Dv): every cached position
        dropout_p = mha.dropout if mha.training else 0.0
        if attention is None:
            attention = functional.prepare(q, k, v, is_causal=causal, dropout_p=dropout_p, backend=checks.backend(mha))
        if attention is None:  # no keys at all: the full path's zeros
            out = attend(q, k, v, None, is_causal=causal, dropout_p=dropout_p, backend=checks.backend(mha))
        else:
            out = attention(q, k, v)  # (B, H, T, Dv)
        out = proj.output(mha, out, None, plain=plain)  # (B, T, E)
    except BaseException:
        cache.rollback(saved)
        raise
    return out, attention if mha.backend == "auto" and not dropout_p else None


def _step(mha: Layer, x: Tensor, attention_mask: Tensor | None, plan: Plan, need_weights: bool,
          cache: KVCache, rules: tuple = (None, None)) -> Tensor | tuple[Tensor, Tensor]:
    if trace.ACTIVE:
        trace.begin_call()
        trace.record("input", x, "x: (B, S, E)")
    # x's padded positions are not zeroed here: their keys and values are cached as they are
    # (a later mask may declare them tokens), and the kernels hide what no query may attend
    # (NaN included); with gradients, _hidden_projections keeps them out of the gradients
    padding = plan.padding  # (B, T): the new positions' padding, or None
    plain = proj.plain_linears(mha)  # read once a step: only the kernel runs between the projections
    q, k, v = proj.project_heads(mha, x, None, plain)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, Dv)
    if padding is not None and q.requires_grad:
        q, k, v = _hidden_projections(mha, x, padding, plain, (q, k, v))
    q, k, v = proj.in_cache_dtype(q, k, v, cache.k.dtype)  # (autocast's dtype -> the cache's)
    q, k = proj.normalize(mha, q, k)
    causal, window, slopes, sink_tokens = plan.is_causal, mha.window, checks.slopes(mha), mha.sink_tokens
    if cache.static:  # same shapes every step; positions are tensors
        rules, alibi = static_rules(mha, cache, rules)
        q, k, v, attention_mask = _static(mha, q, k, v, cache, attention_mask, causal, alibi)
        causal, window, slopes, sink_tokens = False, None, None, 0  # all in the mask now
    else:
        q, k = proj.rotate(mha, q, k, len(cache))
        k, v, attention_mask = cache.update(k, v, attention_mask)  # (B, Hkv, L, D|Dv): every cached position
        if cache.evicted:  # key j is no longer position j: the rules read the kept keys' positions
            T = q.shape[2]
            queries = torch.arange(len(cache) - T, len(cache), device=q.device)  # (T,)
            kept = attention_mask[:, None, None, :] if attention_mask is not None else k.new_ones(
                1, 1, 1, k.shape[2], dtype=torch.bool)  # (B|1, 1, 1, L)
            attention_mask = rules_mask(mha, queries, cache.key_positions(), kept, causal, q.dtype)
            causal, window, slopes, sink_tokens = False, None, None, 0  # all in the mask now
        if trace.ACTIVE:
            _record(cache, x.shape[1], k)
    out = attend(q, k, v, attention_mask, is_causal=causal, dropout_p=mha.dropout if mha.training else 0.0,
                 backend=checks.backend(mha), need_weights=need_weights, window=window, alibi_slopes=slopes,
                 softcap=mha.softcap, sinks=checks.sinks(mha), sink_tokens=sink_tokens, mask_mod=rules[0],
                 score_mod=rules[1])
    out, weights = out if need_weights else (out, None)
    out = proj.output(mha, out, padding, plain=plain)  # (B, T, E)
    if weights is None:
        return out
    if padding is not None:  # a padded query's output is zeros, and so are its weights
        rows = padding if not isinstance(need_weights, Selection) else need_weights.pick(padding, None, 1)  # (B, s)
        weights = weights.masked_fill(~rows[:, None, :, None], 0)  # (B, H, T, L)
    return out, weights


def _hidden_projections(mha: Layer, x: Tensor, padding: Tensor, plain: bool,
                        qkv: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """A step's q, k, v (B, H|Hkv, T, D|Dv) whose padded positions (``padding`` (B, T) False)
    reach no gradient: their values as projected, detached; where x is not finite there, the
    graph runs through the projections of x with zeros there (a NaN times a zero gradient
    would still be NaN in the weights' gradients)."""
    hidden, finite = proj.hide_padding(x, padding)
    graph = qkv if finite else proj.project_heads(mha, hidden, None, plain)
    keep = padding[:, None, :, None]  # (B, 1, T, 1)
    q, k, v = (torch.where(keep, g, t.detach()) for g, t in zip(graph, qkv, strict=True))
    return q, k, v


def _record(cache: KVCache, T: int, k: Tensor) -> None:
    note = f"append {T} positions; attend to all {cache.held} cached"
    if cache.evicted:
        note += (f" (evicted {cache.evicted} of {len(cache)}: kept the {cache.sink_tokens} sink "
                 f"positions and the window's last ones, ruled by their true positions)")
    trace.record("kv cache", k, note)


def _static(mha: Layer, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, mask: Tensor | None,
            causal: bool, alibi: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Write this step into a static cache; return q, k, v over every slot and the mask.

    The mask (B, 1, T, L), or (B, H, T, L) float with ALiBi (``alibi``, see
    :func:`static_rules`), allows the written, unpadded slots, with causality, the window and
    ALiBi measured from the positions tensor (not from the slot count, which is always
    L = max_seq_len).
    """
    positions = cache.position + torch.arange(q.shape[2], device=q.device)  # (T,) where this step goes
    if mha.rope is not None:  # at the position tensor; dynamic NTK's length is one too (no host read)
        cos, sin = mha.rope.cos_sin(positions, q.dtype, seq_len=cache.position + q.shape[2])  # (T, R)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if trace.ACTIVE:
            trace.record("rotary positions", q, f"{mha.rope.describe()}, positions from the cache's "
                         "position tensor")
    allowed = static_mask(mha, cache, mask, q.shape[2], causal, q.dtype, alibi)  # before the write: it reads the cache
    k, v, _ = cache.update_static(k, v, mask)  # (B, Hkv, L, D), (B, Hkv, L, Dv): every slot
    if trace.ACTIVE:
        trace.record("kv cache", k, f"static: write {q.shape[2]} positions at the position tensor "
                     f"(index_copy_); attend to all {cache.max_seq_len} slots through a mask of the written ones")
    return q, k, v, allowed


def static_rules(mha: Layer, cache: KVCache, rules: tuple) -> tuple[tuple, bool]:
    """A static step's (mask_mod, score_mod) and whether its mask carries ALiBi (read before
    the step). ALiBi goes in the mask, which the kernels add after the score_mod; but a
    score_mod reads the scores after ALiBi, so with one ALiBi leads it instead, at the
    queries' positions (slot j holds position j)."""
    slopes = checks.slopes(mha)
    if slopes is None or rules[1] is None:
        return rules, True
    return (rules[0], Composed(Alibi(slopes, int(cache.position)), rules[1])), False


def static_mask(mha: Layer, cache: KVCache, mask: Tensor | None, T: int, causal: bool,
                dtype: torch.dtype, alibi: bool = True) -> Tensor:
    """The mask a static cache's step of T positions attends through, read before the step
    (changes nothing; :meth:`~headwise.MultiHeadAttention.dispatch` reads it too): the slots
    written by then, unpadded (``mask``: the step's (B, T) padding, or None), under the
    module's rules (:func:`rules_mask`, positions from the position tensor; ``alibi``: with
    ALiBi's bias, see :func:`static_rules`)."""
    positions = cache.position + torch.arange(T, device=cache.position.device)  # (T,) where this step goes
    key_mask = cache.key_mask  # (B, L)
    if mask is not None:  # the step's own padding, where update_static will put it
        key_mask = key_mask.index_copy(1, positions, mask.to(key_mask.device) != 0)
    j = torch.arange(cache.max_seq_len, device=cache.position.device)  # (L,) slot positions
    written = (j < cache.position + T)[None, None, None, :] & key_mask[:, None, None, :]  # (B, 1, 1, L)
    return rules_mask(mha, positions, j, written, causal, dtype, alibi)


def evicting_mask(mha: Layer, cache: KVCache, mask: Tensor | None, T: int, causal: bool,
                  dtype: torch.dtype) -> Tensor:
    """The mask an evicting cache's step of T positions attends through once it has evicted,
    read before the step (changes nothing): what :meth:`~headwise.MultiHeadAttention.dispatch`
    reports. The kept keys (the sinks, the recent ones, the new ones) at their true positions,
    their padding (``mask``: the step's, as :meth:`~headwise.cache.KVCache.mask_for` takes
    it), under the module's rules (:func:`rules_mask`)."""
    sinks, recent = cache.kept()
    held, seen = cache.held, len(cache)
    device = cache.key_mask.device
    positions = cache.key_positions()  # (held,)
    keys = torch.cat([positions[:sinks], positions[held - recent:held],
                      torch.arange(seen, seen + T, device=device)])  # (L,) the keys after eviction
    given = cache.mask_for(mask, T)  # (B, held + T) or None
    allowed = torch.ones(1, 1, 1, keys.shape[0], dtype=torch.bool, device=device) if given is None else torch.cat(
        [given[:, :sinks], given[:, held - recent:]], dim=1)[:, None, None, :]  # (B|1, 1, 1, L)
    return rules_mask(mha, torch.arange(seen, seen + T, device=device), keys, allowed, causal, dtype)


def rules_mask(mha: Layer, queries: Tensor, keys: Tensor, allowed: Tensor, causal: bool,
               dtype: torch.dtype, alibi: bool = True) -> Tensor:
    """The module's positional rules as one mask, for keys that are not positions 0..L-1.

    Args:
        queries: (T,) the queries' positions.
        keys: (L,) the keys' positions.
        allowed: (B|1, 1, 1, L) bool, the keys that may be attended at all.
        causal: apply the causal rule (a window implies it).
        dtype: the float mask's dtype when ALiBi makes it a bias.
        alibi: add the module's ALiBi (False: a score_mod carries it, see :func:`static_rules`).

    Returns:
        (B|1, 1, T, L) bool with causality, the window and its sink tokens ANDed in, or
        (B|1, H, T, L) float with ALiBi's bias and ``-inf`` where blocked.
    """
    i, j = queries[:, None], keys[None, :]  # (T, 1), (1, L)
    if causal or mha.window is not None:  # the one causal / window rule, at the true positions
        allowed = allowed & AlignedCausal(0, mha.window, mha.sink_tokens)(None, None, i, j)  # (B|1, 1, T, L)
    allowed = allowed.expand(-1, -1, queries.shape[0], -1)  # (B|1, 1, T, L)
    if mha.alibi_slopes is None or not alibi:
        return allowed
    distance = (i - j).abs().to(dtype)  # (T, L)
    bias = -mha.alibi_slopes.to(dtype)[:, None, None] * distance  # (H, T, L)
    return bias[None].masked_fill(~allowed, float("-inf"))  # (B|1, H, T, L)

"""The module's calls with rules (module/ruled.py) against a float64 oracle: the same module
on the textbook kernel with every rule written out as one dense mask and bias, for calls
that also carry a padding mask, a context (cross-attention), a cache (queries at their
positions), weights, and both the module's and the call's rules.

Legend: B batch, S query length, Sk key length, E embed dim, H heads.
"""

from __future__ import annotations

import re

import pytest
import torch

import headwise
from headwise.masks import sliding_window

E, H = 32, 4


def module(**kwargs) -> headwise.MultiHeadAttention:
    torch.manual_seed(0)
    return headwise.MultiHeadAttention(E, H, dtype=torch.float64, **kwargs).eval()


def band(b, h, q_idx, kv_idx):  # a mask_mod: keys within 2 positions either side
    return (q_idx - kv_idx).abs() <= 2


def tilt(score, b, h, q_idx, kv_idx):  # a score_mod that reads every index
    return score + 0.1 * (h + 1) * (q_idx - kv_idx) + 0.05 * b


def dense_rules(B: int, S: int, Sk: int, offset: int = 0, mask_mod=band, score_mod=tilt) -> torch.Tensor:
    """The rules as one additive (B, H, S, Sk) float64 mask, queries at offset + 0..S-1."""
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    q = torch.arange(offset, offset + S)[None, None, :, None]
    k = torch.arange(Sk)[None, None, None, :]
    bias = torch.zeros(B, H, S, Sk, dtype=torch.float64)
    if score_mod is not None:
        bias = score_mod(bias, b, h, q, k)
    if mask_mod is not None:
        bias = bias.masked_fill(~mask_mod(b, h, q, k).expand(B, H, S, Sk), float("-inf"))
    return bias


def oracle(mha) -> headwise.MultiHeadAttention:
    ref = headwise.MultiHeadAttention(E, H, dtype=torch.float64, backend="matmul", packing=False).eval()
    ref.load_state_dict(mha.state_dict())
    return ref


def test_rules_with_a_padding_mask_equal_the_dense_oracle():
    mha = module()
    x = torch.randn(2, 6, E, dtype=torch.float64)
    keys = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # (B, S)
    with torch.no_grad():
        got = mha(x, keys, mask_mod=band, score_mod=tilt)
        mask = dense_rules(2, 6, 6).masked_fill(~keys[:, None, None, :], float("-inf"))
        want = oracle(mha)(x, mask) * keys[..., None]  # padded queries output zeros
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_rules_in_cross_attention_see_the_context_positions():
    mha = module()
    x, context = torch.randn(2, 4, E, dtype=torch.float64), torch.randn(2, 7, E, dtype=torch.float64)
    keys = torch.tensor([[1] * 7, [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)  # the context's padding
    with torch.no_grad():
        got = mha(x, keys, context=context, mask_mod=band, score_mod=tilt)
        mask = dense_rules(2, 4, 7).masked_fill(~keys[:, None, None, :], float("-inf"))
        want = oracle(mha)(x, mask, context=context)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_cached_rules_see_the_queries_at_their_positions_with_weights(static):
    """Prefill then steps: each step's rules (mask and score) read q_idx as the position in
    the sequence, and its weights are the full forward's rows."""
    mha = module(is_causal=True)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    with torch.no_grad():
        want, want_w = mha(x, mask_mod=band, score_mod=tilt, need_weights=True)
        cache = mha.new_cache(2, 7, static=static)
        got, got_w = mha(x[:, :4], cache=cache, mask_mod=band, score_mod=tilt, need_weights=True)
        torch.testing.assert_close(got, want[:, :4], rtol=0, atol=1e-12)
        for i in range(4, 7):
            out, w = mha(x[:, i:i + 1], cache=cache, mask_mod=band, score_mod=tilt, need_weights=True)
            torch.testing.assert_close(out, want[:, i:i + 1], rtol=0, atol=1e-12)
            torch.testing.assert_close(w[..., :i + 1], want_w[:, :, i:i + 1, :i + 1], rtol=0, atol=1e-12)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    ref = oracle(mha)(x, dense_rules(2, 7, 7).masked_fill(~causal, float("-inf")))
    torch.testing.assert_close(want, ref, rtol=0, atol=1e-12)


def test_the_modules_rules_and_the_calls_combine():
    """The constructor's mask_mod ANDed with the call's; its score_mod applied before the call's."""
    window = sliding_window(3)
    mha = module(mask_mod=band, score_mod=tilt)
    x = torch.randn(2, 6, E, dtype=torch.float64)

    def double(score, b, h, q_idx, kv_idx):
        return 2 * score

    with torch.no_grad():
        got = mha(x, mask_mod=window, score_mod=double)
        both = dense_rules(2, 6, 6, score_mod=lambda s, b, h, q, k: 2 * tilt(s, b, h, q, k))  # 2 (s + tilt)
        allowed = window(None, None, torch.arange(6)[:, None], torch.arange(6)[None, :])
        ref = oracle(mha)
        ref.q_proj.weight.mul_(2)  # 2 q k^T: the doubled score
        ref.q_proj.bias.mul_(2)
        want = ref(x, both.masked_fill(~allowed, float("-inf")))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_rules_take_the_dense_path_and_say_why():
    mha = module(packing=True)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    keys = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    with torch.no_grad():
        plan = mha.plan(x, keys, mask_mod=band)
        small = mha.plan(x, mask_mod=band)  # without gradients, unmasked: the fused path's call
    assert plan.path == "dense"
    assert plan.why.startswith("mask_mod / score_mod: the dense path, where the rules read every (query, key) "
                               "position (was: packed)")
    assert small.path == "dense" and small.why.endswith("(was: fused)")
    for is_causal in (True, False):  # the call's causal flag reaches the plan as forward takes it
        assert mha.plan(x, keys, mask_mod=band, is_causal=is_causal).is_causal is is_causal
    assert module(is_causal=True).plan(x, mask_mod=band).is_causal


@pytest.mark.parametrize("bad", ["mask_mod", "score_mod"])
def test_a_rule_that_is_not_a_function_is_refused_by_name(bad):
    mha = module()
    with pytest.raises(TypeError, match=re.escape(f"{bad} must be a function or None, got int")):
        mha(torch.randn(1, 3, E, dtype=torch.float64), **{bad: 3})


def test_rules_with_an_evicting_cache_that_dropped_positions_are_refused():
    mha = module(window=2)
    cache = mha.new_cache(1, 8, evict=True)
    with torch.no_grad():
        mha(torch.randn(1, 5, E, dtype=torch.float64), cache=cache)
        mha(torch.randn(1, 1, E, dtype=torch.float64), cache=cache)
        with pytest.raises(ValueError, match=re.escape(
                f"mask_mod / score_mod with an evicting cache that has dropped {cache.evicted} positions: its keys "
                "are no longer at their positions; use a cache without evict=True")):
            mha(torch.randn(1, 1, E, dtype=torch.float64), cache=cache, mask_mod=band)


@pytest.mark.parametrize("rule", ["mask_mod", "score_mod"])
def test_rules_with_a_step_that_would_evict_are_refused_before_anything_changes(rule):
    # the check ran before the step evicted: the first evicting step attended with its rules
    # reading slots as positions (0.44 off) instead of being refused
    mha = module(window=2, is_causal=True)
    rules = {"mask_mod": sliding_window(2), "score_mod": lambda s, b, h, q_idx, kv_idx: s * 0.5}
    cache = mha.new_cache(1, 4, evict=True)
    x = torch.randn(1, 6, E, dtype=torch.float64)
    with torch.no_grad():
        first = mha(x[:, :3], cache=cache, **{rule: rules[rule]})  # nothing to evict yet: served
        torch.testing.assert_close(first, mha(x[:, :3], **{rule: rules[rule]}), atol=1e-12, rtol=1e-12)
        before = (len(cache), cache.held, cache.evicted, cache.k.clone(), cache.v.clone())
        with pytest.raises(ValueError, match=re.escape(
                "mask_mod / score_mod with an evicting cache whose step would drop 2 of its 3 positions "
                "(window=2, sink_tokens=0): its keys would no longer be at their positions; use a cache "
                "without evict=True")):
            mha(x[:, 3:], cache=cache, **{rule: rules[rule]})
        assert (len(cache), cache.held, cache.evicted) == before[:3]
        assert torch.equal(cache.k, before[3]) and torch.equal(cache.v, before[4])
        torch.testing.assert_close(mha(x[:, 3:], cache=cache), mha(x)[:, 3:], atol=1e-12, rtol=1e-12)

"""The module's seams (issue 25): what it refuses, it refuses before anything changes.

A refused call leaves a cache (dynamic, static, evicting) and the module's memo exactly as
they were; ``plan()`` and ``dispatch()`` refuse what ``forward`` refuses; ``forward_packed``
checks its offsets; padded positions of x never reach a result; ``need_weights`` gives
zeros for padded query rows; ``dispatch()`` reports one padding share.

Legend: B batch, H query heads, S query length, Sk key length, E embed dim.
"""

from __future__ import annotations

import re

import pytest
import torch

import headwise
from headwise.cache import KVCache

E, H = 32, 4


def _snapshot(cache: KVCache) -> dict:
    """Everything a step could change in a cache, copied."""
    return {
        "len": len(cache), "held": cache.held, "evicted": cache.evicted, "padded": cache.padded,
        "position": int(cache.position), "k": cache.k.clone(), "v": cache.v.clone(),
        "key_mask": cache.key_mask.clone(),
    }


def _assert_same(cache: KVCache, before: dict) -> None:
    after = _snapshot(cache)
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[name], value), name
        else:
            assert after[name] == value, name


def _module(kind: str) -> headwise.MultiHeadAttention:
    if kind == "evicting":
        return headwise.MultiHeadAttention(E, H, window=3, sink_tokens=1)
    return headwise.MultiHeadAttention(E, H, is_causal=True)


def _cache(kind: str, mha: headwise.MultiHeadAttention | None = None):
    """A module and a cache of this kind that has taken a 5-token prompt with padding."""
    mha = _module(kind) if mha is None else mha
    if kind == "evicting":
        cache = mha.new_cache(2, 8, evict=True)
    else:
        cache = mha.new_cache(2, 16, static=kind == "static")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        mha(torch.rand(2, 5, E, generator=gen), torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]), cache=cache)
        if kind == "evicting":  # one more step, so the next one evicts before it appends
            mha(torch.rand(2, 1, E, generator=gen), cache=cache)
    return mha, cache


def _refuse(*args, **kwargs):
    """A kernel that refuses every call, after the cache was updated."""
    raise ValueError("the kernel refuses")


REFUSED_STEPS = [  # (mask, error, message) of a one-token step after the prompt
    (torch.ones(2, 3, dtype=torch.bool), ValueError, r"\(2, 3\)"),
    (torch.ones(2, 2, 3, dtype=torch.bool), ValueError, r"\(2, 2, 3\)"),
    (torch.ones(2, 1, dtype=torch.complex64), TypeError, "complex64"),
    (torch.ones(3, 1, dtype=torch.bool), ValueError, "batch"),
    (torch.ones(1, dtype=torch.bool), ValueError, "1-D"),
    (torch.full((2, 1), float("nan")), TypeError, "bool or integer"),
    ([[1], [1]], TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("kind", ["dynamic", "static", "evicting"])
@pytest.mark.parametrize("mask, error, match", REFUSED_STEPS)
def test_a_refused_cache_step_leaves_the_cache_as_it_was(kind, mask, error, match):
    mha, cache = _cache(kind)
    before = _snapshot(cache)
    with torch.no_grad(), pytest.raises(error, match=match):
        mha(torch.rand(2, 1, E), mask, cache=cache)
    _assert_same(cache, before)


@pytest.mark.parametrize("kind", ["dynamic", "static", "evicting"])
def test_after_a_refused_step_the_next_step_equals_a_cache_that_never_saw_it(kind):
    mha, cache = _cache(kind)
    _, twin = _cache(kind, mha)
    step = torch.rand(2, 1, E)
    with torch.no_grad():
        with pytest.raises(ValueError):
            mha(torch.rand(2, 1, E), torch.ones(2, 3, dtype=torch.bool), cache=cache)
        torch.testing.assert_close(mha(step, cache=cache), mha(step, cache=twin), rtol=0, atol=0)
    assert len(cache) == len(twin)


@pytest.mark.parametrize("kind", ["dynamic", "static", "evicting"])
def test_a_step_refused_by_the_kernel_after_the_cache_update_rolls_it_back(kind, monkeypatch):
    """An error raised after the keys were appended (here: by the kernel) undoes the append."""
    mha, cache = _cache(kind)
    before = _snapshot(cache)
    monkeypatch.setattr("headwise.module.cached.attend", _refuse)
    with torch.no_grad(), pytest.raises(ValueError, match="the kernel refuses"):
        mha(torch.rand(2, 1, E), cache=cache)
    _assert_same(cache, before)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_refused_step_of_more_positions_than_embed_dim_is_undone_whole(kind, monkeypatch):
    """The savepoint covers the step's T positions, not some other size of x: a step of 12
    positions through a module of E = 8, refused after the update, leaves every slot as it was."""
    mha = headwise.MultiHeadAttention(8, 2, is_causal=True)
    cache = mha.new_cache(2, 24, static=kind == "static")
    with torch.no_grad():
        mha(torch.rand(2, 3, 8), torch.ones(2, 3, dtype=torch.bool), cache=cache)
    before = _snapshot(cache)
    monkeypatch.setattr("headwise.module.cached.attend", _refuse)
    with torch.no_grad(), pytest.raises(ValueError, match="the kernel refuses"):
        mha(torch.rand(2, 12, 8), torch.ones(2, 12, dtype=torch.bool), cache=cache)
    _assert_same(cache, before)


def test_a_cache_refuses_a_complex_mask_as_forward_without_one_does():
    mha, cache = _cache("dynamic")
    complex_mask = torch.ones(2, 1, dtype=torch.complex64)
    with pytest.raises(TypeError, match="complex64") as without:
        mha(torch.rand(2, 1, E), complex_mask)
    with torch.no_grad(), pytest.raises(TypeError, match="complex64") as with_cache:
        mha(torch.rand(2, 1, E), complex_mask, cache=cache)
    assert str(with_cache.value) == str(without.value)


def test_a_static_cache_at_a_negative_position_is_a_clear_error():
    mha, cache = _cache("static")
    cache.position.fill_(-3)
    with torch.no_grad(), pytest.raises(ValueError, match=r"position -3.*cache.reset\(\)"):
        mha(torch.rand(2, 1, E), cache=cache)
    with pytest.raises(ValueError, match=r"position -3"):
        len(cache)


BAD_INPUTS = [  # (x, mask, error, message): what forward refuses
    (torch.rand(2, 4, E).long(), None, TypeError, r"x has dtype torch.int64.*floating"),
    (torch.rand(2, 4, E).double(), None, TypeError, r"x has dtype torch.float64 but the module's parameters are "
                                                     r"torch.float32"),
    (torch.rand(2, 4, E), torch.ones(4, dtype=torch.bool), ValueError, "1-D"),
    (torch.rand(2, 4, E), torch.ones(2, 4, dtype=torch.complex64), TypeError, "complex64"),
    (torch.rand(2, 4, E), torch.ones(3, 4, dtype=torch.bool), ValueError, r"\(3, 4\)"),
    (torch.rand(2, 4, E), "mask", TypeError, "torch.Tensor"),
]


@pytest.mark.parametrize("x, mask, error, match", BAD_INPUTS)
def test_plan_and_dispatch_refuse_what_forward_refuses(x, mask, error, match):
    mha = headwise.MultiHeadAttention(E, H)
    for call in (mha, mha.plan, mha.dispatch):
        with pytest.raises(error, match=match):
            call(x, mask)


def test_a_refused_call_leaves_the_modules_memo_as_it_was():
    mha = headwise.MultiHeadAttention(E, H, packing=True, backend="triton")  # packs, then triton refuses the CPU
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    with torch.no_grad(), pytest.raises(ValueError, match="triton"):
        mha(torch.rand(2, 4, E), mask)
    assert mha._repeats == {}


PACKED_ERRORS = [  # (cu_seqlens, lengths, error, message)
    (torch.tensor([0, 2, 6]), (3, 3), ValueError, r"lengths \(3, 3\) .* cu_seqlens"),
    (torch.tensor([1, 3, 6]), None, ValueError, r"cu_seqlens must start at 0"),
    (torch.tensor([0.0, 3.0, 6.0]), None, TypeError, r"cu_seqlens must be an integer tensor.*float32"),
    (torch.tensor([0, 4, 3, 6]), None, ValueError, r"non-decreasing"),
    (torch.tensor([0, 3, 5]), None, ValueError, r"end at the 6 rows"),
    (torch.tensor([[0, 3, 6]]), None, ValueError, r"1-D"),
    ([0, 3, 6], None, TypeError, r"torch.Tensor"),
]


@pytest.mark.parametrize("cu_seqlens, lengths, error, match", PACKED_ERRORS)
def test_forward_packed_checks_its_offsets(cu_seqlens, lengths, error, match):
    mha = headwise.MultiHeadAttention(E, H)
    with pytest.raises(error, match=match):
        mha.forward_packed(torch.rand(6, E), cu_seqlens, lengths=lengths)


def test_forward_packed_with_matching_lengths_equals_the_dense_path():
    mha = headwise.MultiHeadAttention(E, H, packing=False)
    x = torch.rand(2, 4, E)
    out = mha.forward_packed(torch.cat([x[0, :3], x[1, :2]]), torch.tensor([0, 3, 5]), lengths=(3, 2))
    dense = mha(x, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    torch.testing.assert_close(out, torch.cat([dense[0, :3], dense[1, :2]]))


def _poisoned(x: torch.Tensor, padding: torch.Tensor, value: float) -> torch.Tensor:
    return x.masked_fill(~padding[..., None], value)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"num_kv_heads": 2, "rope": True}])
def test_padded_positions_of_x_never_reach_a_result_or_a_gradient(packing, value, kwargs):
    mha = headwise.MultiHeadAttention(E, H, packing=packing, **kwargs)
    padding = torch.tensor([[True, True, True, False], [True, True, False, False]])
    x = torch.rand(2, 4, E)
    results = []
    for planted in (0.0, value):
        mha.zero_grad()
        xi = _poisoned(x, padding, planted).requires_grad_()
        out = mha(xi, padding)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, xi.grad, {n: p.grad.clone() for n, p in mha.named_parameters()}))
    (out0, gx0, grads0), (out1, gx1, grads1) = results
    assert torch.equal(out0, out1)
    assert torch.equal(gx0, gx1)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name


def test_padded_context_positions_never_reach_a_cross_attention_result_or_gradient():
    mha = headwise.MultiHeadAttention(E, H)
    keys = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    x, context = torch.rand(2, 3, E), torch.rand(2, 5, E)
    results = []
    for planted in (0.0, float("nan")):
        mha.zero_grad()
        out = mha(x, keys, context=_poisoned(context, keys.bool(), planted))
        out.sum().backward()
        results.append((out, {n: p.grad.clone() for n, p in mha.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name in results[0][1]:
        assert torch.equal(results[0][1][name], results[1][1][name]), name


def test_nan_in_a_real_token_still_reaches_the_rows_that_attend_it():
    mha = headwise.MultiHeadAttention(E, H)
    x = torch.rand(2, 4, E)
    x[0, 1] = float("nan")
    out = mha(x, torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert out[0, :3].isnan().all() and not out[0, 3].isnan().any()  # padded row 3: zeros
    assert not out[1].isnan().any()


def test_padded_x_with_a_cache_step_never_reaches_the_next_steps():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    outs = []
    for planted in (0.0, float("nan")):
        cache = mha.new_cache(2, 8)
        prompt = torch.rand(2, 4, E, generator=torch.Generator().manual_seed(1))
        padding = torch.tensor([[True, True, True, True], [False, True, True, True]])
        with torch.no_grad():
            first = mha(_poisoned(prompt, padding, planted), padding, cache=cache)
            step = mha(torch.rand(2, 1, E, generator=torch.Generator().manual_seed(2)), cache=cache)
        outs.append((first, step))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_need_weights_gives_zero_weights_for_padded_query_rows():
    mha = headwise.MultiHeadAttention(E, H)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out, weights = mha(torch.rand(2, 4, E), mask, need_weights=True)  # (B, H, S, Sk)
    padded = ~mask.bool()
    assert torch.equal(weights[padded[:, None, :, None].expand_as(weights)],
                       torch.zeros(int(padded.sum()) * H * 4))
    real = weights.transpose(1, 2)[mask.bool()]  # (tokens, H, Sk): real rows still sum to one
    torch.testing.assert_close(real.sum(-1), torch.ones(real.shape[:2]))
    assert torch.equal(out[padded], torch.zeros(int(padded.sum()), E))


def test_a_weights_selection_without_need_weights_is_refused():
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = torch.randn(2, 5, E)
    for selection in ({"weights_heads": [1]}, {"weights_rows": [0, 2]}):
        with pytest.raises(ValueError, match=r"weights_heads / weights_rows .* pass need_weights=True too"):
            mha(x, **selection)
    out, weights = mha(x, need_weights=True, weights_heads=[1], weights_rows=[0, 2])
    assert out.shape == (2, 5, E) and weights.shape == (2, 1, 2, 5)


@pytest.mark.parametrize("x, error, match", [
    (torch.randn(5, E), ValueError, r"x must be \(B, S, E\).*got shape \(5, 32\); add a batch dimension"),
    (torch.randn(1, 2, 5, E), ValueError, r"x must be \(B, S, E\).*got shape \(1, 2, 5, 32\)"),
    ([[0.0] * E], TypeError, r"x must be a torch.Tensor, got list"),
], ids=["2-D", "4-D", "list"])
def test_weights_rows_of_an_x_that_is_not_3_d_name_x_first(x, error, match):
    """The rows are x's rows: an x of the wrong rank is named before the selection is read
    (row 4 is past the 4-D x's second dimension, 2, too)."""
    with pytest.raises(error, match=match):
        headwise.MultiHeadAttention(E, H)(x, need_weights=True, weights_rows=[4])


def test_dispatch_reports_one_padding_share_for_one_mask():
    mha = headwise.MultiHeadAttention(E, H)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])  # 4 of 12 positions are padding
    text = str(mha.dispatch(torch.rand(2, 6, E), mask))
    shares = {int(s) for s in __import__("re").findall(r"(\d+)% of the", text)}
    assert shares == {33}, text


def test_a_module_moved_to_another_dtype_plans_its_next_call_afresh():
    mha = headwise.MultiHeadAttention(E, H)
    x, mask = torch.rand(2, 4, E), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with torch.no_grad():
        mha(x, mask)
        assert mha._repeats  # remembered
        mha.double()  # no attribute is assigned: the parameters change in place
        assert not mha._repeats
        with pytest.raises(TypeError, match="x has dtype torch.float32 but the module's parameters are torch.float64"):
            mha(x, mask)


@pytest.mark.parametrize("x_dtype, module_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_autocast_does_not_cast_float64_so_a_float64_mismatch_is_refused_with_the_casts(x_dtype, module_dtype):
    # autocast casts float32 / float16 / bfloat16 tensors, never float64 ones: without the check the
    # projection raised torch's own "mat1 and mat2 must have the same dtype"
    mha = headwise.MultiHeadAttention(E, H).to(module_dtype)
    x = torch.randn(2, 3, E, dtype=x_dtype)
    message = (f"x has dtype {x_dtype} but the module's parameters are {module_dtype} under torch.autocast, which "
               f"does not cast float64; convert one to the other: x.to({module_dtype}) or mha.to({x_dtype})")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=re.escape(message) + "$"):
        mha(x)


def test_under_autocast_a_float32_input_to_a_bfloat16_module_runs():
    mha = headwise.MultiHeadAttention(E, H).to(torch.bfloat16)
    x = torch.randn(2, 3, E)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, E)

"""KV cache: decoding step by step equals one causal forward over the whole sequence."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from conftest import contract_backends
from headwise.cache import KVCache

BACKENDS = [name for name in contract_backends() if name != "varlen"]  # module: "varlen" = packing=True
B, S, E, H = 3, 10, 32, 4
FEATURES = {
    "plain": {},
    "gqa": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "rope": {"rope": True},
    "rope_base": {"rope_base": 500.0, "num_kv_heads": 2},
    "alibi": {"alibi": True},
    "window": {"window": 3},
    "all": {"num_kv_heads": 2, "rope": True, "window": 4},
    "scaled_rope+qk_norm": {"num_kv_heads": 2, "qk_norm": "rms", "rotary_dim": 4, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}},
    "sinks": {"num_kv_heads": 2, "rope": True, "sinks": True},
    "softcap_sinks": {"num_kv_heads": 2, "window": 4, "softcap": 1.0, "sinks": True},
    "sink_tokens": {"window": 3, "sink_tokens": 2},
    "value_dim": {"v_head_dim": 6, "num_kv_heads": 2, "rope": True},
}


def _padding(kind: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.ones(B, S, dtype=torch.bool)
    if kind == "left":  # prompts of 10, 7 and 4 tokens, padded on the left
        mask[1, :3] = False
        mask[2, :6] = False
    else:  # right: padding after the prompt, then generated tokens
        mask[1, 4:6] = False
        mask[2, 2:7] = False
    return mask


def _decode(mha, x, mask, splits, static=False):
    cache = mha.new_cache(B, S + 2, static=static)
    outs, start = [], 0
    for n in splits:
        step_mask = None if mask is None else mask[:, start:start + n]
        outs.append(mha(x[:, start:start + n], step_mask, cache=cache, is_causal=True))
        start += n
    assert len(cache) == S
    return torch.cat(outs, dim=1)


SPLITS = pytest.mark.parametrize("splits", [[1] * S, [4, 1, 1, 1, 1, 1, 1], [6, 4]],
                                 ids=["steps", "prefill+steps", "chunks"])


def _check_decoding_equals_one_causal_forward(backend, feature, padding, splits, static=False):
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, backend=backend, **FEATURES[feature]).eval()
    if mha.sinks is not None:  # learned sinks, not the zeros they start from
        torch.nn.init.normal_(mha.sinks, std=2.0)
    x = torch.randn(B, S, E)
    mask = _padding(padding)
    if backend == "sdpa" and mha.softcap is not None:  # SDPA cannot cap: refused, at the first call
        with pytest.raises(ValueError, match="backend 'sdpa' cannot soft-cap the scores"):
            mha(x, mask, is_causal=True)
        return
    with torch.no_grad():
        full = mha(x, mask, is_causal=True)
        stepped = _decode(mha, x, mask, splits, static=static)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@SPLITS
def test_decoding_equals_one_causal_forward(backend, feature, padding, splits):
    _check_decoding_equals_one_causal_forward(backend, feature, padding, splits)


@pytest.mark.parametrize("backend", ["auto", "matmul", "chunked"])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@SPLITS
def test_static_cache_decoding_equals_one_causal_forward(backend, feature, padding, splits):
    """Same shapes every step (index_copy_ at the position tensor, a mask over all slots)."""
    _check_decoding_equals_one_causal_forward(backend, feature, padding, splits, static=True)


def test_static_cache_bookkeeping_and_errors():
    mha = headwise.MultiHeadAttention(E, H).eval()
    cache = mha.new_cache(B, 4, static=True)
    assert cache.static and len(cache) == 0 and "static=True" in repr(cache)
    with torch.no_grad():
        mha(torch.randn(B, 3, E), cache=cache, is_causal=True)
        assert len(cache) == 3 and int(cache.position) == 3
        with pytest.raises(ValueError, match="holds 3 of max_seq_len 4 positions and cannot take 2 more"):
            mha(torch.randn(B, 2, E), cache=cache)
        with pytest.raises(ValueError, match=r"a static cache takes a \(B, T\) = \(3, 1\) padding mask of the new "):
            mha(torch.randn(B, 1, E), torch.ones(B, 4, dtype=torch.bool), cache=cache)
    with pytest.raises(ValueError, match=r"cache.append grows a dynamic cache; this one is static"):
        cache.append(torch.randn(B, H, 1, E // H), torch.randn(B, H, 1, E // H))
    cache.reset()
    assert len(cache) == 0 and bool(cache.key_mask.all())
    with torch.no_grad():
        d = mha.dispatch(torch.randn(B, 1, E), cache=cache, is_causal=True)
    assert d.request.k_len == 4 and d.request.mask_shape == (B, 1, 1, 4) and not d.request.is_causal


@given(splits=st.lists(st.integers(1, 4), min_size=1, max_size=10).filter(lambda s: sum(s) <= S),
       feature=st.sampled_from(list(FEATURES)), padding=st.sampled_from(["none", "left", "right"]))
def test_property_any_prefill_step_split(splits, feature, padding):
    torch.manual_seed(1)
    mha = headwise.MultiHeadAttention(E, H, **FEATURES[feature]).eval()
    n = sum(splits)
    x = torch.randn(B, n, E)
    mask = _padding(padding)
    mask = None if mask is None else mask[:, :n]
    with torch.no_grad():
        full = mha(x, mask, is_causal=True)
        cache = mha.new_cache(B, n)
        outs, start = [], 0
        for k in splits:
            outs.append(mha(x[:, start:start + k], None if mask is None else mask[:, start:start + k],
                            cache=cache, is_causal=True))
            start += k
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_full_length_masks_each_step_also_work():
    torch.manual_seed(2)
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, mask = torch.randn(B, S, E), _padding("left")
    with torch.no_grad():
        full = mha(x, mask, is_causal=True)
        cache = mha.new_cache(B, S)
        outs = [mha(x[:, t:t + 1], mask[:, :t + 1], cache=cache, is_causal=True) for t in range(S)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_bookkeeping():
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2)
    cache = mha.new_cache(2, 8)
    assert isinstance(cache, KVCache) and len(cache) == 0
    assert cache.k.shape == (2, 2, 8, 8) and cache.k.dtype == mha.k_proj.weight.dtype
    with torch.no_grad():
        mha(torch.randn(2, 5, E), cache=cache, is_causal=True)
    assert len(cache) == 5 and "length=5" in repr(cache)
    cache.reset()
    assert len(cache) == 0 and not cache.padded
    assert not any("cache" in key for key in mha.state_dict())


def test_append_returns_views_of_the_buffers():
    cache = KVCache(1, 4, 2, 3)
    k = torch.randn(1, 2, 2, 3)
    k_all, v_all = cache.append(k, k)
    assert k_all.shape == (1, 2, 2, 3) and k_all.untyped_storage().data_ptr() == cache.k.untyped_storage().data_ptr()


def test_overflow_and_batch_errors_name_the_numbers():
    mha = headwise.MultiHeadAttention(E, H)
    cache = mha.new_cache(2, 4)
    with torch.no_grad():
        mha(torch.randn(2, 3, E), cache=cache)
        with pytest.raises(ValueError, match=r"holds 3 of max_seq_len 4 positions and cannot take 2 more"):
            mha(torch.randn(2, 2, E), cache=cache)
        with pytest.raises(ValueError, match=r"made for batch_size 2, got a batch of 5"):
            mha(torch.randn(5, 1, E), cache=cache)
    assert len(cache) == 3  # a refused step leaves the cache as it was
    with pytest.raises(ValueError, match=r"max_seq_len must be a positive int, got 0"):
        mha.new_cache(2, 0)


def test_cache_argument_errors():
    mha = headwise.MultiHeadAttention(E, H)
    cache = mha.new_cache(2, 4)
    x = torch.randn(2, 1, E)
    with pytest.raises(ValueError, match=r"cache is for self-attention"):
        mha(x, context=torch.randn(2, 3, E), cache=cache)
    with pytest.raises(TypeError, match=r"cache must come from mha.new_cache"):
        mha(x, cache={"k": None})
    with pytest.raises(TypeError, match=r"as bool or integer"):
        mha(x, torch.zeros(2, 1), cache=cache)
    with pytest.raises(ValueError, match=r"attention_mask batch \(3\) differs from the cache's batch_size \(2\)"):
        mha(x, torch.ones(3, 1, dtype=torch.bool), cache=cache)


def test_dispatch_with_cache_sees_every_cached_key_and_changes_nothing():
    mha = headwise.MultiHeadAttention(E, H)
    cache = mha.new_cache(2, 8)
    with torch.no_grad():
        mha(torch.randn(2, 5, E), torch.ones(2, 5, dtype=torch.bool), cache=cache, is_causal=True)
    with torch.no_grad():  # as forward, dispatch refuses a cache step with gradients
        d = mha.dispatch(torch.randn(2, 1, E), cache=cache, is_causal=True)
    assert d.request.k_len == 6 and d.request.q_len == 1 and d.request.mask_shape == (2, 1, 1, 6)
    assert len(cache) == 5


def test_weights_with_cache_cover_every_cached_position():
    mha = headwise.MultiHeadAttention(E, H).eval()
    cache = mha.new_cache(1, 6)
    with torch.no_grad():
        mha(torch.randn(1, 4, E), cache=cache, is_causal=True)
        _, w = mha(torch.randn(1, 1, E), cache=cache, is_causal=True, need_weights=True)
    assert w.shape == (1, H, 1, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, H, 1))


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
    ({"batch_size": True}, "batch_size must be a positive int, got True"),
    ({"max_seq_len": -1}, "max_seq_len must be a positive int, got -1"),
])
def test_cache_sizes_must_be_positive_ints(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCache(**{"batch_size": 2, "max_seq_len": 4, **kwargs}, kv_heads=2, head_dim=4)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_buffers_follow_the_modules_device_and_dtype(device):
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2, device=device, dtype=torch.float64)
    cache = mha.new_cache(batch_size=3, max_seq_len=5)
    assert (cache.k.shape, cache.k.dtype, cache.v.dtype) == ((3, 2, 5, E // H), torch.float64, torch.float64)
    assert {cache.k.device.type, cache.v.device.type, cache.key_mask.device.type} == {device}


def test_a_reset_cache_forgets_the_old_padding():
    torch.manual_seed(3)
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = torch.randn(B, 4, E)
    cache = mha.new_cache(B, 4)
    with torch.no_grad():
        mha(x[:, :3], torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]]), cache=cache, is_causal=True)
        cache.reset()
        assert len(cache) == 0 and not cache.padded and cache.key_mask.all()
        mha(x[:, :3], cache=cache, is_causal=True)  # a new prompt without padding
        assert mha.dispatch(x[:, 3:], cache=cache, is_causal=True).request.mask_kind == "none"
        step = mha(x[:, 3:], torch.tensor([[1], [1], [0]]), cache=cache, is_causal=True)
        full = mha(x, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]), is_causal=True)
    torch.testing.assert_close(step, full[:, 3:], atol=1e-5, rtol=1e-5)


# --- eviction: the window's sink tokens and last W - 1 positions, nothing else -----------------

EVICTING = {
    "window": {"window": 4},
    "sinks": {"window": 4, "sink_tokens": 2},
    "everything": {"window": 3, "sink_tokens": 1, "rope": True, "alibi": True, "v_head_dim": 6, "num_kv_heads": 2},
}


def _long_mask(n: int) -> torch.Tensor:
    """Left padding (rows 1 and 2 start late) and a hole in the middle of row 0."""
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :3], mask[2, :9], mask[0, 20:23] = False, False, False
    return mask


@pytest.mark.parametrize("backend", ["auto", "matmul", "chunked"])
@pytest.mark.parametrize("feature", list(EVICTING))
@pytest.mark.parametrize("padding", ["none", "padded"])
def test_evicting_cache_decoding_equals_the_full_forward(backend, feature, padding):
    """A long decode that evicts equals one forward over the whole sequence with the same window
    and sink rule (float64, 1e-10), while the cache never holds more than sinks + W - 1 + step."""
    torch.manual_seed(4)
    kwargs = EVICTING[feature]
    mha = headwise.MultiHeadAttention(E, H, backend=backend, dtype=torch.float64, **kwargs).eval()
    n = 40
    x = torch.randn(B, n, E, dtype=torch.float64)
    mask = _long_mask(n) if padding == "padded" else None
    bound = kwargs.get("sink_tokens", 0) + kwargs["window"] - 1
    splits = [5] + [1] * 20 + [3] + [1] * 12  # prefill, steps, a chunk, steps
    cache = mha.new_cache(B, bound + 5, evict=True)
    outs, start = [], 0
    with torch.no_grad():
        full = mha(x, mask, is_causal=True)
        for T in splits:
            outs.append(mha(x[:, start:start + T], None if mask is None else mask[:, start:start + T],
                            cache=cache, is_causal=True))
            start += T
            assert cache.held <= bound + T and cache.k.shape[2] == bound + 5
    assert len(cache) == n and cache.evicted == n - cache.held > 0
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=1e-10)


def test_evicting_cache_takes_full_length_masks_too():
    """A 2-D mask over every position seen so far: the cache keeps the columns of the positions it holds."""
    torch.manual_seed(5)
    mha = headwise.MultiHeadAttention(E, H, window=3, sink_tokens=1, dtype=torch.float64).eval()
    x, mask = torch.randn(B, 16, E, dtype=torch.float64), _long_mask(16)
    cache = mha.new_cache(B, 4, evict=True)
    with torch.no_grad():
        full = mha(x, mask, is_causal=True)
        outs = [mha(x[:, t:t + 1], mask[:, :t + 1], cache=cache, is_causal=True) for t in range(16)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=1e-10)


def test_eviction_bookkeeping():
    """The slots hold the sinks, then the most recent positions; reset forgets the evictions."""
    cache = KVCache(1, 6, 1, 2, window=3, sink_tokens=2, value_dim=5)
    assert cache.v.shape == (1, 1, 6, 5) and cache.evicts
    for t in range(9):
        k = torch.full((1, 1, 1, 2), float(t))
        k_all, v_all, _ = cache.update(k, torch.full((1, 1, 1, 5), float(t)))
        assert k_all[0, 0, :, 0].tolist() == cache.key_positions().tolist()  # each slot holds its position
    assert cache.key_positions().tolist() == [0, 1, 6, 7, 8] and (len(cache), cache.held, cache.evicted) == (9, 5, 4)
    assert cache.kept() == (2, 2)  # the next step keeps the sinks and positions 7, 8
    assert "window=3, sink_tokens=2, held=5" in repr(cache) and "value_dim=5" in repr(cache)
    cache.reset()
    assert (len(cache), cache.held, cache.evicted) == (0, 0, 0) and cache.key_positions().tolist() == []


def test_dispatch_with_an_evicting_cache_changes_nothing():
    torch.manual_seed(6)
    mha = headwise.MultiHeadAttention(E, H, window=3, sink_tokens=1).eval()
    cache = mha.new_cache(B, 5, evict=True)
    with torch.no_grad():
        for _ in range(8):
            mha(torch.randn(B, 1, E), cache=cache)
    before = (len(cache), cache.held, cache.evicted, cache.k.clone())
    with torch.no_grad():
        d = mha.dispatch(torch.randn(B, 1, E), cache=cache)
    assert d.request.k_len == sum(cache.kept()) + 1 == 4 and not d.request.is_causal and d.request.sink_tokens == 0
    assert (len(cache), cache.held, cache.evicted) == before[:3] and torch.equal(cache.k, before[3])


def test_eviction_errors_name_the_values_and_the_remedy():
    with pytest.raises(ValueError, match="^" + re.escape(
            "evict=True drops what a sliding window can no longer see; this module has no window "
            "(MultiHeadAttention(..., window=W)), so every cached position stays visible") + "$"):
        headwise.MultiHeadAttention(E, H).new_cache(B, 8, evict=True)
    mha = headwise.MultiHeadAttention(E, H, window=3, sink_tokens=2)
    with pytest.raises(ValueError, match=r"a static cache keeps every position at its own slot .* use static=False "
                                         r"for an evicting cache"):
        mha.new_cache(B, 8, static=True, evict=True)
    cache = mha.new_cache(B, 6, evict=True)
    with torch.no_grad():
        mha(torch.randn(B, 6, E), cache=cache)
        with pytest.raises(ValueError, match=r"the evicting cache keeps 4 positions \(sink_tokens 2 and the last "
                                             r"window - 1 = 2\) of max_seq_len 6 slots and cannot take 3 more; make "
                                             r"one with max_seq_len >= sink_tokens \+ window - 1 \+ 3 = 7"):
            mha(torch.randn(B, 3, E), cache=cache)
        with pytest.raises(ValueError, match=r"an evicting cache takes a 2-D \(B, T\) or \(B, len\(cache\) \+ T\) "
                                             r"padding mask, got a 3-D mask of shape \(3, 1, 7\)"):
            mha(torch.randn(B, 1, E), torch.ones(B, 1, 7, dtype=torch.bool), cache=cache)
    with pytest.raises(ValueError, match=r"sink_tokens=1 are what eviction keeps besides the window; give window=W"):
        KVCache(1, 4, 1, 2, sink_tokens=1)
    with pytest.raises(ValueError, match=r"window must be a positive int or None, got 0"):
        KVCache(1, 4, 1, 2, window=0)
    with pytest.raises(ValueError, match=r"sink_tokens must be an int >= 0, got -1"):
        KVCache(1, 4, 1, 2, window=2, sink_tokens=-1)


@pytest.mark.parametrize("history", ["fresh", "after reset", "after a longer sequence"])
@pytest.mark.parametrize("masked", [False, True])
def test_rollback_restores_every_slot_a_step_wrote(history, masked):
    # savepoint copies nothing for slots no step has written (they hold zeros) and copies the
    # others (stale keys after reset(), a longer earlier sequence): either way rollback is exact
    gen = torch.Generator().manual_seed(11)
    cache = KVCache(2, 8, 2, 4)
    if history != "fresh":
        cache.update(torch.randn(2, 2, 6 if history == "after a longer sequence" else 3, 4, generator=gen),
                     torch.randn(2, 2, 6 if history == "after a longer sequence" else 3, 4, generator=gen))
        cache.reset()
    cache.update(torch.randn(2, 2, 3, 4, generator=gen), torch.randn(2, 2, 3, 4, generator=gen))
    before = (len(cache), cache.padded, cache.k.clone(), cache.v.clone(), cache.key_mask.clone())
    mask = torch.tensor([[1, 0], [1, 1]]) if masked else None
    saved = cache.savepoint(2, masked=masked)
    cache.update(torch.randn(2, 2, 2, 4, generator=gen), torch.randn(2, 2, 2, 4, generator=gen), mask)
    assert not torch.equal(cache.k, before[2])
    cache.rollback(saved)
    assert (len(cache), cache.padded) == before[:2]
    for got, want in zip((cache.k, cache.v, cache.key_mask), before[2:], strict=True):
        assert torch.equal(got, want)
    cache.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))  # and the next step appends where it should
    assert len(cache) == 4 and torch.equal(cache.k[:, :, 3], torch.ones(2, 2, 4))


def _step(cache: KVCache, k: torch.Tensor, v: torch.Tensor, how: str):
    if how == "update_static":
        return cache.update_static(k, v)[:2]
    return getattr(cache, how)(k, v)[:2]


@pytest.mark.parametrize("how, kwargs", [("update", {}), ("append", {}), ("update_static", {"static": True}),
                                         ("update", {"window": 2, "sink_tokens": 1})],
                         ids=["update", "append", "update_static", "evicting"])
def test_steps_of_values_that_take_gradients_write_new_buffers_and_backward_is_exact(how, kwargs):
    # with gradients, every write is out of place: what an earlier step returned (and saved for
    # backward) is never written, and the gradient of each step's keys is what read them
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(1, 6, 1, 2, dtype=torch.float64, **kwargs)
    ks = [torch.randn(1, 1, T, 2, generator=gen, dtype=torch.float64, requires_grad=True) for T in (2, 1, 1)]
    vs = [torch.randn(1, 1, T, 2, generator=gen, dtype=torch.float64, requires_grad=True) for T in (2, 1, 1)]
    first, loss = None, 0
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        held_k, held_v = _step(cache, k, v, how)
        first = held_k if first is None else first
        loss = loss + (i + 1) * (held_k.sum() + 2 * held_v.sum())
    assert torch.equal(first[:, :, :2], ks[0])  # what the first step returned was never written since
    loss.backward()
    # each key's gradient: the sum of the weights (i + 1) of the steps that held it
    if kwargs.get("window"):  # window 2, 1 sink: position 1 is evicted before the third step
        want_k = [torch.tensor([6.0, 3.0]), torch.tensor([5.0]), torch.tensor([3.0])]
    else:
        want_k = [torch.tensor([6.0, 6.0]), torch.tensor([5.0]), torch.tensor([3.0])]
    for k, v, want in zip(ks, vs, want_k, strict=True):
        torch.testing.assert_close(k.grad[0, 0, :, 0], want.double(), atol=0, rtol=0)
        torch.testing.assert_close(v.grad[0, 0, :, 0], 2 * want.double(), atol=0, rtol=0)
    with torch.no_grad():  # without gradients the buffers lose their graph: in place again from here
        _step(cache, torch.ones(1, 1, 1, 2, dtype=torch.float64), torch.ones(1, 1, 1, 2, dtype=torch.float64), how)
    assert not cache.k.requires_grad


def test_rollback_of_a_step_with_gradients_puts_the_old_buffers_back():
    cache = KVCache(1, 4, 1, 2)
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    k, v = cache.k, cache.v
    saved = cache.savepoint(1, masked=False)
    cache.update(torch.full((1, 1, 1, 2), 5.0, requires_grad=True), torch.zeros(1, 1, 1, 2))
    assert cache.k is not k and cache.k.requires_grad
    cache.rollback(saved)
    assert cache.k is k and cache.v is v and len(cache) == 2 and not k.requires_grad
    assert torch.equal(k[:, :, :3], torch.tensor([[[[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]]]))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_steps_under_inference_mode_and_no_grad_after_steps_with_gradients_keep_backward_exact(static):
    cache = KVCache(1, 6, 1, 2, static=static)
    k = torch.ones(1, 1, 2, 2, requires_grad=True)
    held = cache.update_static(k, k)[0] if static else cache.update(k, k)[0]
    with torch.inference_mode():
        cache.update_static(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2)) if static else cache.append(
            torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    with torch.no_grad():
        cache.update_static(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2)) if static else cache.append(
            torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    assert len(cache) == 4 and not cache.k.is_inference()
    (held[:, :, :2] * 3).sum().backward()
    torch.testing.assert_close(k.grad, torch.full((1, 1, 2, 2), 3.0), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["same dtype", "float64 steps"])
def test_append_writes_each_step_in_place_and_returns_every_position(dtype):
    cache = KVCache(2, 6, 3, 4)
    steps = [torch.randn(2, T, 3, 4, dtype=dtype).transpose(1, 2) for T in (2, 1, 3)]  # (B, Hkv, T, D), strided
    k_buffer = cache.k
    for i, step in enumerate(steps):
        k_all, v_all = cache.append(step, -step)
        n = sum(s.shape[2] for s in steps[:i + 1])
        written = torch.cat(steps[:i + 1], 2).float()  # (B, Hkv, n, D)
        assert len(cache) == cache.held == cache._written == n
        assert torch.equal(k_all, written) and torch.equal(v_all, -written)
        assert k_all.data_ptr() == cache.k.data_ptr() and cache.k is k_buffer  # views of the same buffers
    assert not cache.k[:, :, 6:].any()


def test_append_refuses_what_does_not_fit_after_steps_and_changes_nothing():
    cache = KVCache(2, 4, 3, 4)
    for _ in range(3):
        cache.append(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    k, v = cache.k.clone(), cache.v.clone()
    with pytest.raises(ValueError, match=r"holds 3 of max_seq_len 4 positions and cannot take 2 more"):
        cache.append(torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4))
    with pytest.raises(ValueError, match=r"made for batch_size 2, got a batch of 1"):
        cache.append(torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4))
    assert len(cache) == cache._written == 3 and torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_append_of_values_that_take_gradients_leaves_the_old_buffers_as_they_were():
    cache = KVCache(1, 4, 2, 3)
    cache.append(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3))
    old_k, before = cache.k, cache.k.clone()
    k = torch.randn(1, 2, 1, 3, requires_grad=True)
    k_all, _ = cache.append(k, k.detach())
    assert cache.k is not old_k and torch.equal(old_k, before)  # a new buffer, out of place
    k_all.sum().backward()
    assert torch.equal(k.grad, torch.ones_like(k))

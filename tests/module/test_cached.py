"""The cached path's remembered step (module/cached.py): a decoding loop's repeated call
signature skips the checks and the plan, and still equals the full path in float64, sees
every change a step must see (a padded cache, hooks, weights written in place, a replaced
kernel) and refuses what the full path refuses, changing nothing.

Legend: B batch, T new positions, E embed dim.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import headwise
from headwise.kernels import registry
from headwise.module import cached
from headwise.module import plan as planning

E, H = 32, 4
MODULES = {
    "plain": {},
    "GQA + rope": dict(num_kv_heads=2, rope=True),
    "MQA + qk norm + rope": dict(num_kv_heads=1, qk_norm="rms", rope=True),
    "value head dim": dict(num_kv_heads=2, v_head_dim=6),
    "no bias": dict(bias=False),
    "chunked kernel": dict(backend="chunked"),
}


def module(**kwargs) -> headwise.MultiHeadAttention:
    torch.manual_seed(0)
    return headwise.MultiHeadAttention(E, H, is_causal=True, dtype=torch.float64, **kwargs).eval()


def counting(monkeypatch) -> tuple[list, list]:
    """Lists that grow by one per planned call and per remembered step."""
    planned, repeated = [], []
    real_plan, real_repeat = planning.make_plan, cached.forward_repeat
    monkeypatch.setattr(planning, "make_plan", lambda *a, **kw: planned.append(1) or real_plan(*a, **kw))
    monkeypatch.setattr(cached, "forward_repeat", lambda *a, **kw: repeated.append(1) or real_repeat(*a, **kw))
    return planned, repeated


def decode(mha, x, cache, prompt: int, chunks=(1,)) -> torch.Tensor:
    """x (B, S, E) fed to ``cache`` as a prompt, then in steps of the sizes in ``chunks`` (cycled)."""
    outs = [mha(x[:, :prompt], cache=cache)]
    i, n = prompt, 0
    while i < x.shape[1]:
        T = min(chunks[n % len(chunks)], x.shape[1] - i)
        outs.append(mha(x[:, i:i + T], cache=cache))
        i, n = i + T, n + 1
    return torch.cat(outs, dim=1)  # (B, S, E)


@pytest.mark.parametrize("name", list(MODULES))
def test_remembered_steps_equal_the_full_causal_forward(name, monkeypatch):
    planned, repeated = counting(monkeypatch)
    mha = module(**MODULES[name])
    x = torch.randn(2, 14, E, dtype=torch.float64)
    with torch.no_grad():
        want = mha(x)  # (B, S, E), causal
        for chunks in ((1,), (1, 3)):  # T = 3: bottom-right causal within a step
            got = decode(mha, x, mha.new_cache(2, 14), prompt=4, chunks=chunks)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert len(repeated) >= 10  # most steps took the remembered way
    assert len(planned) <= 6  # the prompts, the first step of each size, the forward


def test_a_step_from_an_empty_cache_is_remembered_apart():
    """The memo's key holds whether the cache is empty: the first step attends with S == Sk,
    which "auto" may decide otherwise than a later step of the same size."""
    mha = module()
    x = torch.randn(1, 3, E, dtype=torch.float64)
    with torch.no_grad():
        want = mha(x)
        for _ in range(2):  # a fresh cache each time: its first step is the remembered empty one
            torch.testing.assert_close(decode(mha, x, mha.new_cache(1, 3), prompt=1), want, rtol=0, atol=1e-12)
    empties = {key[-1][-1] for key in mha._repeats if key[-1] is not None}
    assert empties == {True, False}


def test_a_padded_cache_keeps_its_mask_on_a_remembered_step(monkeypatch):
    """A step without a mask on a cache that holds one (its prompt was padded) attends with
    it, also where another cache of the same shapes made the signature remembered."""
    planned, repeated = counting(monkeypatch)
    mha = module()
    x = torch.randn(2, 8, E, dtype=torch.float64)
    x[1, :3] = float("nan")  # row 1: three positions of left padding, never attended
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :3] = False
    with torch.no_grad():
        decode(mha, x.nan_to_num(), mha.new_cache(2, 8), prompt=5)  # remembers the step's signature
        before = len(repeated)
        cache = mha.new_cache(2, 8)
        mha(x[:, :5], mask[:, :5], cache=cache)
        got = torch.cat([mha(x[:, i:i + 1], cache=cache) for i in range(5, 8)], dim=1)
        want = mha(x, mask)[:, 5:]
    assert len(repeated) == before  # the padded cache took the full step
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_full_cache_refuses_a_remembered_step_and_changes_nothing():
    mha = module()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    with torch.no_grad():
        cache = mha.new_cache(1, 5)
        decode(mha, x[:, :5], cache, prompt=2)  # steps 3 and 4 remembered; the cache is full
        k, v = cache.k.clone(), cache.v.clone()
        with pytest.raises(ValueError, match=re.escape("the cache holds 5 of max_seq_len 5 positions and cannot "
                                                       "take 1 more")):
            mha(x[:, 5:6], cache=cache)
    assert len(cache) == 5
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_a_remembered_step_refused_by_its_kernel_is_undone(monkeypatch):
    original = registry.get_kernel("sdpa")
    fail = []

    def refusing(*args, **kwargs):
        if fail:
            raise RuntimeError("refused")
        return original.fn(*args, **kwargs)

    monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(original, fn=refusing))
    planned, repeated = counting(monkeypatch)
    mha = module()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    with torch.no_grad():
        cache = mha.new_cache(1, 6)
        decode(mha, x[:, :4], cache, prompt=2)
        k, v, before = cache.k.clone(), cache.v.clone(), len(repeated)
        fail.append(1)
        with pytest.raises(RuntimeError, match="refused"):
            mha(x[:, 4:5], cache=cache)
    assert len(repeated) == before + 1  # refused on the remembered way
    assert len(cache) == 4
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


@pytest.mark.parametrize("other", ["kv heads", "dtype", "batch"])
def test_a_cache_that_does_not_fit_is_refused_after_remembered_steps(other):
    mha = module(num_kv_heads=2)
    x = torch.randn(2, 4, E, dtype=torch.float64)
    with torch.no_grad():
        decode(mha, x, mha.new_cache(2, 8), prompt=1)
        if other == "kv heads":
            cache, match = module().new_cache(2, 8), "the cache holds kv_heads=4"
        elif other == "dtype":
            cache, match = module(num_kv_heads=2).float().new_cache(2, 8), "torch.float32 on cpu; this module needs"
        else:
            cache, match = mha.new_cache(3, 8), "the cache was made for batch_size 3, got a batch of 2"
        with pytest.raises(ValueError, match=re.escape(match)):
            mha(x[:, :1], cache=cache)
        assert len(cache) == 0


def test_hooks_and_weights_changed_after_remembered_steps_are_seen():
    """Projections are read afresh on every step: a hook registered later runs, and a weight
    written through ``.data`` (no version bump) is the one used."""
    mha = module()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    seen = []
    with torch.no_grad():
        cache = mha.new_cache(1, 6)
        decode(mha, x[:, :4], cache, prompt=2)
        handle = mha.out_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        mha.q_proj.weight.data.mul_(2.0)
        got = mha(x[:, 4:5], cache=cache)
        handle.remove()
        fresh = module()
        fresh.load_state_dict(mha.state_dict())
        want = fresh(x[:, :5])[:, 4:5]
    assert seen == [torch.Size([1, 1, E])]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_replaced_kernel_serves_the_next_remembered_step(monkeypatch):
    mha = module()
    x = torch.randn(1, 6, E, dtype=torch.float64)
    calls = []
    with torch.no_grad():
        cache = mha.new_cache(1, 6)
        decode(mha, x[:, :4], cache, prompt=2)
        original = registry.get_kernel("sdpa")
        monkeypatch.setitem(registry._KERNELS, "sdpa",
                            dataclasses.replace(original, fn=lambda *a, **kw: calls.append(1) or original.fn(*a, **kw)))
        got = torch.cat([mha(x[:, i:i + 1], cache=cache) for i in (4, 5)], dim=1)
        want = mha(x)[:, 4:]
    assert len(calls) >= 2
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_dropout_in_training_mode_is_drawn_afresh_on_every_step():
    """Without gradients a step may run in training mode: its dropout is the call's own (no
    remembered call holds a mask or a generator state), on the remembered steps too."""
    mha = module()
    mha.dropout = 0.5
    plain = module()
    plain.load_state_dict(mha.state_dict())
    mha.train()
    x = torch.randn(1, 2, E, dtype=torch.float64)
    with torch.no_grad():
        cache, ref = mha.new_cache(1, 40), plain.new_cache(1, 40)
        mha(x[:, :1], cache=cache)
        plain(x[:, :1], cache=ref)
        outs = [mha(x[:, 1:2], cache=cache) for _ in range(20)]  # the same token: each step its own draw
        wants = [plain(x[:, 1:2], cache=ref) for _ in range(20)]
    assert len({tuple(o.flatten().tolist()) for o in outs}) == 20
    assert not any(torch.allclose(o, w) for o, w in zip(outs, wants, strict=True))


def test_a_named_kernel_is_asked_again_as_the_cache_grows(monkeypatch):
    """A named backend's checks read the full shapes: a step is prepared afresh for each
    length (here a kernel that refuses more than 4 keys refuses the fifth step)."""
    chunked = registry.get_kernel("chunked")
    monkeypatch.setitem(registry._KERNELS, "short", dataclasses.replace(
        chunked, name="short", refuses=lambda r: f"Sk = {r.k_len} > 4" if r.k_len > 4 else None))
    mha = module(backend="short")
    x = torch.randn(1, 5, E, dtype=torch.float64)
    with torch.no_grad():
        cache = mha.new_cache(1, 5)
        decode(mha, x[:, :4], cache, prompt=2)  # steps at Sk = 3 and 4
        with pytest.raises(ValueError, match=re.escape("Sk = 5 > 4")):
            mha(x[:, 4:5], cache=cache)
    assert len(cache) == 4


@pytest.mark.parametrize("kwargs", [dict(window=3, sink_tokens=1), dict(window=4), dict(window=3, alibi=True)],
                         ids=["window + sink", "window", "window + alibi"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_an_evicting_cache_after_a_padded_prompt_equals_the_full_forward(kwargs, side):
    """Eviction moves the recent positions' padding up to the sinks; the slots it frees are
    written by later steps without a mask and must count as real tokens (they held the
    moved positions' padding: a new token was hidden from its own query)."""
    mha = module(**kwargs)
    x = torch.randn(2, 12, E, dtype=torch.float64)
    prompt = torch.ones(2, 5, dtype=torch.bool)
    prompt[1, 3:] = False if side == "right" else prompt[1, 3:]
    prompt[1, :2] = False if side == "left" else prompt[1, :2]
    with torch.no_grad():
        want = mha(x, torch.cat([prompt, torch.ones(2, 7, dtype=torch.bool)], dim=1))
        cache = mha.new_cache(2, 12, evict=True)
        got = [mha(x[:, :5], prompt, cache=cache)] + [mha(x[:, i:i + 1], cache=cache) for i in range(5, 9)]
        got = torch.cat(got + [mha(x[:, 9:], cache=cache)], dim=1)  # T = 3 after eviction
    assert cache.evicted > 0
    keep = torch.cat([prompt, torch.ones(2, 7, dtype=torch.bool)], dim=1)  # padded positions output zeros
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-12)


@pytest.mark.parametrize(("kwargs", "cache_kwargs", "want"), [
    (dict(rope=True), dict(static=True), [
        ("input", (1, 1, E), "x: (B, S, E)"),
        ("rotary positions", (1, H, 1, 8), "rotate q and k pairs (i, i + D/2) by position x 10000^(-2i/D), positions "
                                           "from the cache's position tensor"),
        ("kv cache", (1, H, 8, 8), "static: write 1 positions at the position tensor (index_copy_); attend to all 8 "
                                   "slots through a mask of the written ones")]),
    (dict(window=2, sink_tokens=1), dict(evict=True), [
        ("input", (1, 1, E), "x: (B, S, E)"),
        ("kv cache", (1, H, 3, 8), "append 1 positions; attend to all 3 cached (evicted 2 of 5: kept the 1 sink "
                                   "positions and the window's last ones, ruled by their true positions)")]),
    ({}, {}, [
        ("input", (1, 1, E), "x: (B, S, E)"),
        ("kv cache", (1, H, 5, 8), "append 1 positions; attend to all 5 cached")]),
], ids=["static + rope", "evicting", "dynamic"])
def test_a_traced_step_records_what_the_cache_did(kwargs, cache_kwargs, want):
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, **kwargs).eval()
    cache = mha.new_cache(1, 8, **cache_kwargs)
    with torch.no_grad():
        mha(torch.randn(1, 4, E), cache=cache)
        with headwise.trace() as t:
            mha(torch.randn(1, 1, E), cache=cache)
    got = [(s.name, s.shape, s.note) for s in t.stages if s.name in ("input", "rotary positions", "kv cache")]
    assert got == want
    assert t.names()[-2:] == ["merge heads", "output projection"]


def test_an_empty_step_on_an_empty_cache_is_remembered_and_empty():
    mha = module()
    with torch.no_grad():
        for _ in range(3):  # no keys at all: the full path's empty result, also once remembered
            cache = mha.new_cache(2, 4)
            out = mha(torch.randn(2, 0, E, dtype=torch.float64), cache=cache)
            assert out.shape == (2, 0, E) and len(cache) == 0
            torch.testing.assert_close(mha(torch.ones(2, 1, E, dtype=torch.float64), cache=cache),
                                       module()(torch.ones(2, 1, E, dtype=torch.float64)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["dynamic", "static", "evicting"])
def test_a_cache_step_under_autocast_writes_and_attends_in_the_cache_dtype(kind):
    """Under torch.autocast the projections give bfloat16, while the cache keeps the module's
    float32: each step casts its q, k, v to the cache's dtype (it failed with "q, k, v dtypes
    differ" or index_copy_'s dtype error), and the steps equal a float64 full forward within
    bfloat16's error; dispatch reports the request forward makes."""
    kwargs = dict(window=4, alibi=True) if kind == "evicting" else dict(rope=True, num_kv_heads=2)
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, **kwargs).eval()
    ref = headwise.MultiHeadAttention(E, H, is_causal=True, dtype=torch.float64, **kwargs).eval()
    ref.load_state_dict(mha.state_dict())
    cache = mha.new_cache(2, 12, static=kind == "static", evict=kind == "evicting")
    x = torch.randn(2, 12, E)
    with torch.no_grad():
        want = ref(x.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            steps = [mha(x[:, :5], cache=cache)]
            for t in range(5, 12):
                said = mha.dispatch(x[:, t:t + 1], cache=cache)
                assert said.request.dtype == torch.float32
                steps.append(mha(x[:, t:t + 1], cache=cache))
    got = torch.cat(steps, dim=1)
    assert got.dtype == torch.bfloat16 and cache.k.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [None, [0, 2]], ids=["all rows", "rows 0 and 2"])
def test_a_padded_cache_step_zeroes_its_padded_queries_outputs_and_weights(rows):
    """A step's (B, T) mask marks padded new positions: whatever x holds there (NaN here), their
    outputs and their rows of weights are zeros, and the real queries equal the full forward."""
    mha = module()
    cache = mha.new_cache(2, 8)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    step = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)  # (B, T): row 1's last two are padding
    dirty = x.clone()
    dirty[1, 4:] = float("nan")
    with torch.no_grad():
        mha(x[:, :3], cache=cache)
        out, w = mha(dirty[:, 3:], step, cache=cache, need_weights=True, weights_rows=rows)
        full = mha(x, torch.cat([torch.ones(2, 3, dtype=torch.bool), step], dim=1))  # (B, S, E), causal
    picked = [0, 1, 2] if rows is None else rows
    assert w.shape == (2, H, len(picked), 6) and out.isfinite().all() and w.isfinite().all()
    assert out[1, 1:].eq(0).all()
    for i, t in enumerate(picked):
        assert w[1, :, i].eq(0).all() == (t > 0), t  # a padded query's row of weights is zeros
    torch.testing.assert_close(out[0], full[0, 3:], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1, 0], full[1, 3], rtol=0, atol=1e-12)


def test_a_decoding_loop_remembers_its_prepared_attention_call(monkeypatch):
    """The remembered step reuses the attention call prepared on its signature's first step
    (functional.prepare): the memo holds it, and later steps prepare nothing new."""
    from headwise import functional

    prepared = []
    real = functional.prepare
    monkeypatch.setattr(functional, "prepare", lambda *a, **kw: prepared.append(real(*a, **kw)) or prepared[-1])
    mha = module()
    cache = mha.new_cache(2, 12)
    x = torch.randn(2, 12, E, dtype=torch.float64)
    with torch.no_grad():
        mha(x[:, :4], cache=cache)
        mha(x[:, 4:5], cache=cache)
        first = len(prepared)
        got = torch.cat([mha(x[:, t:t + 1], cache=cache) for t in range(5, 12)], dim=1)
    assert first == 2 and all(p is not None for p in prepared) and len(prepared) == first
    assert {r.attention for r in mha._repeats.values()} == set(prepared)
    torch.testing.assert_close(got, mha(x)[:, 5:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["static", "evicting"])
def test_a_cache_that_cannot_repeat_plans_once_per_signature_and_drops_no_dropout_in_eval(kind, monkeypatch):
    """A static or evicting cache's steps take the full step, yet remember their plan: one plan
    per call signature. A module with dropout in eval mode applies none (the steps equal the
    full forward)."""
    planned, _ = counting(monkeypatch)
    mha = module(window=4, dropout=0.5)
    cache = mha.new_cache(2, 12, static=kind == "static", evict=kind == "evicting")
    x = torch.randn(2, 12, E, dtype=torch.float64)
    with torch.no_grad():
        got = decode(mha, x, cache, prompt=4)
        assert len(planned) <= 3  # the prompt, the first step, and where the cache starts to evict
        torch.testing.assert_close(got, mha(x), rtol=0, atol=1e-12)


def test_the_way_a_compiled_step_takes_equals_the_eager_step(monkeypatch):
    """Under torch.compile a step takes neither the memo nor the savepoint (cached.forward's
    compiled branch). Run eagerly with ``is_compiling`` true, a padded prompt, a masked step
    with weights and a step without a mask equal the eager module's, and the cache holds the
    same keys and values."""
    mha = module(num_kv_heads=2, rope=True)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    prompt = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    caches, results = [], []
    for compiling in (False, True):
        cache = mha.new_cache(2, 8)
        with monkeypatch.context() as patched, torch.no_grad():
            if compiling:
                patched.setattr(torch.compiler, "is_compiling", lambda: True)
            results.append([mha(x[:, :4], prompt, cache=cache),
                            *mha(x[:, 4:5], torch.tensor([[1], [1]]), cache=cache, need_weights=True),
                            mha(x[:, 5:], cache=cache)])
        caches.append(cache)
    assert results[1][2].shape == (2, H, 1, 5)  # the weights over the five cached positions
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert len(caches[1]) == len(caches[0]) == 6
    for got, want in ((caches[1].k, caches[0].k), (caches[1].v, caches[0].v)):  # (one GEMM or three: the last bit)
        torch.testing.assert_close(got[:, :, :6], want[:, :, :6], rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["static", "evicting"])
def test_remembered_steps_of_several_positions_stay_causal(kind):
    """A static or evicting cache remembers its steps' plan, causal flag included: steps of two
    and three positions, repeated, equal the full causal forward (the first of a step's queries
    never sees the second)."""
    mha = module(window=6) if kind == "evicting" else module()
    cache = mha.new_cache(2, 16, static=kind == "static", evict=kind == "evicting")
    x = torch.randn(2, 16, E, dtype=torch.float64)
    with torch.no_grad():
        got = decode(mha, x, cache, prompt=3, chunks=(2, 2, 3))
        torch.testing.assert_close(got, mha(x), rtol=0, atol=1e-12)
    assert len(mha._repeats) < 5  # the steps of one size were remembered (the prompt, then 2 and 3)


# ---------------------------------------------------------------- gradients on
# A step with gradients on writes the buffers out of place (autograd records it, and what an
# earlier step saved for backward is never written), so decoding without torch.no_grad()
# runs forward, as with transformers' caches, and backward through every step is exact.

GRAD_CACHES = {
    "dynamic": ({}, {}),
    "static": ({}, {"static": True}),
    "evicting": ({"window": 3, "sink_tokens": 1}, {"evict": True}),
    "dynamic, rope + GQA": ({"rope": True, "num_kv_heads": 2}, {}),
    "static, rope + GQA": ({"rope": True, "num_kv_heads": 2}, {"static": True}),
}


def grads_of(mha, x, loss_of):
    """The loss's gradients for x and every parameter (x (B, S, E) a leaf)."""
    mha.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    loss_of(x).backward()
    return {"x": x.grad, **{n: p.grad for n, p in mha.named_parameters()}}


@pytest.mark.parametrize("name", list(GRAD_CACHES))
def test_decoding_with_gradients_on_equals_the_full_forward_and_its_gradients(name):
    kwargs, cache_kwargs = GRAD_CACHES[name]
    mha = module(**kwargs)
    x = torch.randn(2, 7, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weight = torch.randn(2, 7, E, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = mha(x)  # the full causal forward (with the module's window, if any)
    caches = []

    def decoded(x):
        caches.append(mha.new_cache(2, 8, **cache_kwargs))
        return decode(mha, x, caches[-1], prompt=3, chunks=(1, 2))

    torch.testing.assert_close(decoded(x), want, atol=1e-12, rtol=0)
    got = grads_of(mha, x, lambda x: (decoded(x) * weight).sum())
    full = grads_of(mha, x, lambda x: (mha(x) * weight).sum())
    for key in full:
        torch.testing.assert_close(got[key], full[key], atol=1e-10, rtol=0, msg=key)
    with torch.no_grad():  # the cache decodes on, without gradients
        more = mha(x[:, :1], cache=caches[0])
    assert not more.requires_grad and caches[0].k.requires_grad is False


def test_backward_after_later_steps_and_a_refused_step_is_exact():
    mha = module()
    x = torch.randn(2, 6, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cache = mha.new_cache(2, 6)
    first = mha(x[:, :3], cache=cache)  # with gradients
    with torch.no_grad():
        mha(x[:, 3:5], cache=cache)  # later steps write the buffers the first one read
    with pytest.raises(ValueError, match="cannot take 2 more"):
        mha(x[:, :2], cache=cache)  # refused: changes nothing
    mha(x[:, 5:], cache=cache)
    cache.reset()
    mha(x[:, :2], cache=cache)
    got = grads_of(mha, x, lambda _: first.square().sum())
    full = grads_of(mha, x, lambda x: mha(x[:, :3]).square().sum())
    for key in full:
        if key != "x":  # x was a leaf of the first call only
            torch.testing.assert_close(got[key], full[key], atol=1e-10, rtol=0, msg=key)


@pytest.mark.parametrize("name", ["dynamic", "static", "evicting"])
def test_nan_at_a_padded_position_of_a_step_with_gradients_reaches_no_gradient(name):
    kwargs, cache_kwargs = GRAD_CACHES[name]
    mha = module(**kwargs)
    x = torch.randn(2, 5, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x[1, 0] = float("nan")  # padded: excluded for every query
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])

    def decoded(x):
        cache = mha.new_cache(2, 8, **cache_kwargs)
        prompt = mha(x[:, :3], mask[:, :3], cache=cache)
        return torch.cat([prompt, mha(x[:, 3:4], cache=cache), mha(x[:, 4:], cache=cache)], dim=1)

    got = grads_of(mha, x, lambda x: decoded(x).square().sum())
    full = grads_of(mha, x, lambda x: mha(x, mask).square().sum())
    for key in full:
        if key != "x":
            assert got[key].isfinite().all(), key
            torch.testing.assert_close(got[key], full[key], atol=1e-10, rtol=0, msg=key)
    torch.testing.assert_close(got["x"][:, 1:], full["x"][:, 1:], atol=1e-10, rtol=0)
    torch.testing.assert_close(got["x"][0], full["x"][0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("kwargs", [{}, dict(softcap=2.0), dict(num_kv_heads=2, window=3)])
def test_a_static_cache_with_alibi_and_a_score_mod_equals_the_full_forward(kwargs):
    # the score_mod reads the scores after ALiBi and before the mask: a static step must not
    # carry ALiBi in its mask, which is added after the score_mod
    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5 + (q_idx - kv_idx) * 0.01

    mha = module(alibi=True, score_mod=halve, **kwargs)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    full = mha(x)
    for static in (True, False):
        cache = mha.new_cache(2, 9, static=static)
        with torch.no_grad():
            steps = [mha(x[:, :3], cache=cache), mha(x[:, 3:5], cache=cache), mha(x[:, 5:6], cache=cache),
                     mha(x[:, 6:], cache=cache)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12, msg=f"static={static}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_remembered_steps_take_the_kernels_bound_call_and_give_its_bits(dtype, monkeypatch):
    """A decoding step's attention runs the sdpa kernel's bound call (Kernel.bind), with the
    same bits as the kernel's function: the steps of a module whose kernel binds nothing."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2, dtype=dtype).eval()
    x = torch.randn(2, 9, E, dtype=dtype)
    calls = []
    original = registry.get_kernel("sdpa")
    with torch.no_grad():
        bound = decode(mha, x, mha.new_cache(2, 9), prompt=3)
        monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(
            original, bind=None, fn=lambda *a, **kw: calls.append(1) or original.fn(*a, **kw)))
        unbound = decode(mha, x, mha.new_cache(2, 9), prompt=3)
    assert len(calls) == 7  # the prompt and every step ran the kernel's function there
    assert torch.equal(bound, unbound)
    bound_calls = []

    def counted(fn, *args):
        call = original.bind(fn, *args)
        return None if call is None else (lambda *a: bound_calls.append(1) or call(*a))

    monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(original, bind=counted))
    with torch.no_grad():
        again = decode(mha, x, mha.new_cache(2, 9), prompt=3)
    assert len(bound_calls) == 7 and torch.equal(again, bound)  # the prompt and every step took the bound call

"""Fuzz torch.func and torch.compile over headwise: grad, jvp (forward AD), vmap where served
and functional_call of the module, each against autograd or float64 finite differences; and
``torch.compile(fullgraph=True)`` of a sample of calls, equal to eager, within two graphs
across sequence lengths.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length, D head dim.
"""

from __future__ import annotations

import torch
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad, jvp, vmap

import headwise
from fuzz.fuzz_kit import TOL, assert_close, budget, mask_mod_pool, score_mod_pool
from headwise.testing import reference_attention


def draw_options(draw, H: int, S: int, Sk: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    window = draw(st.sampled_from([None, 2]))
    rule = draw(st.sampled_from([None, "causal", "sliding_window(2)", "stripes"]))
    score = draw(st.sampled_from([None, "arithmetic", "relative_position_bias"]))
    return dict(is_causal=draw(st.booleans()), window=window, sink_tokens=draw(st.integers(0, 1)) if window else 0,
                softcap=draw(st.sampled_from([None, 2.0])), mask_mod=mask_mod_pool(1, H, S, Sk, gen).get(rule or ""),
                score_mod=score_mod_pool(1, H, S, Sk, gen).get(score or ""),
                backend=draw(st.sampled_from(["auto", "matmul", "chunked", "sdpa"])))


def _inputs(draw, dtype=torch.float64):
    H, S, Sk = draw(st.sampled_from([1, 2])), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(2, H, n, 4, generator=gen, dtype=dtype) for n in (S, Sk, Sk))
    mask = torch.rand(2, Sk, generator=gen) > 0.3
    return q, k, v, mask, draw_options(draw, H, S, Sk)


def _served(fn, *args):
    """fn(*args), or None where the call is refused with its reason (a kernel that does not serve it)."""
    try:
        return fn(*args)
    except ValueError as refusal:
        assert str(refusal).startswith("backend "), refusal
        return None


def assert_transform_refusal(refusal: ValueError, backend: str) -> None:
    """Inside torch.func transforms "auto" serves every call; a named backend may refuse, by name and why."""
    assert backend != "auto", f"auto refused inside a torch.func transform: {refusal}"
    assert f"backend {backend!r}" in str(refusal), refusal
    assert "torch.func transform" in str(refusal) or "forward-mode derivative" in str(refusal), refusal


@budget(40)
@given(st.data())
def test_torch_func_grad_and_jvp_equal_autograd_and_finite_differences(data):
    q, k, v, mask, options = _inputs(data.draw)
    note(f"options: {options}")

    def f(q, k, v):
        return headwise.attention(q, k, v, mask, **options)

    out = _served(f, q, k, v)
    if out is None:
        return
    assert_close("out", out, reference_attention(q, k, v, mask, **{n: o for n, o in options.items()
                                                                   if n != "backend"}).out, 1e-9)
    try:
        g = grad(lambda q, k, v: f(q, k, v).square().sum(), argnums=(0, 1, 2))(q, k, v)
        tangents = tuple(torch.randn_like(t) for t in (q, k, v))
        _, tangent_out = jvp(f, (q, k, v), tangents)
    except ValueError as refusal:  # a named backend that cannot run inside the transform says so; auto never
        assert_transform_refusal(refusal, options.get("backend", "auto"))
        return
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*leaves).square().sum().backward()
    for name, got, leaf in zip("qkv", g, leaves, strict=True):
        assert_close(f"torch.func.grad d{name}", got, leaf.grad, 1e-9)
    eps = 1e-6
    plus = f(*(t + eps * d for t, d in zip((q, k, v), tangents, strict=True)))
    minus = f(*(t - eps * d for t, d in zip((q, k, v), tangents, strict=True)))
    assert_close("jvp against finite differences", tangent_out, (plus - minus) / (2 * eps), 1e-5)


@budget(30)
@given(st.data())
def test_vmap_where_served_equals_a_loop(data):
    q, k, v, mask, options = _inputs(data.draw)
    note(f"options: {options}")
    stack = [torch.stack([t, t.flip(0)]) for t in (q, k, v)]  # (2, B, H, S|Sk, D)
    try:
        got = vmap(lambda q, k, v: headwise.attention(q, k, v, mask, **options))(*stack)
    except Exception as refusal:  # noqa: BLE001 - vmap is served where it runs; a refusal must say why
        assert str(refusal).strip()
        return
    for n in range(2):
        one = _served(lambda *t: headwise.attention(*t, mask, **options), *(s[n] for s in stack))
        if one is not None:
            assert_close(f"vmap slice {n}", got[n], one, 1e-9)


@budget(25)
@given(st.data())
def test_functional_call_of_the_module_under_grad_and_jvp(data):
    draw = data.draw
    H = draw(st.sampled_from([1, 2]))
    kwargs = dict(is_causal=draw(st.booleans()), window=draw(st.sampled_from([None, 2])),
                  softcap=draw(st.sampled_from([None, 2.0])), sinks=draw(st.booleans()),
                  backend=draw(st.sampled_from(["auto", "matmul", "chunked"])))
    note(f"module: {kwargs}")
    torch.manual_seed(draw(st.integers(0, 2**16)))
    mha = headwise.MultiHeadAttention(4 * H, H, dtype=torch.float64, **kwargs)
    x = torch.randn(2, draw(st.integers(1, 5)), 4 * H, dtype=torch.float64)
    params = {n: p.detach() for n, p in mha.named_parameters()}

    def loss(params, x):
        return functional_call(mha, params, (x,)).square().sum()

    try:
        got = grad(loss)(params, x)
    except ValueError as refusal:  # a module with a named backend that cannot run inside the transform
        assert_transform_refusal(refusal, kwargs["backend"])
        return
    loss(dict(mha.named_parameters()), x).backward()
    for n, p in mha.named_parameters():
        assert_close(f"functional_call grad {n}", got[n], p.grad, 1e-9)
    tangent = torch.randn_like(x)
    _, out_t = jvp(lambda x: functional_call(mha, params, (x,)), (x,), (tangent,))
    eps = 1e-6
    fd = (functional_call(mha, params, (x + eps * tangent,)) - functional_call(mha, params, (x - eps * tangent,)))
    assert_close("module jvp against finite differences", out_t, fd / (2 * eps), 1e-5)


# compiling is slow (seconds an example): no shrinking, and 60 examples in the long run (3,000 would take hours)
@settings(budget(3, long=60), phases=[Phase.explicit, Phase.generate])
@given(st.data())
def test_compiled_calls_equal_eager_within_two_graphs(data):
    from torch._dynamo.testing import CompileCounter

    H = data.draw(st.sampled_from([1, 2]))
    options = draw_options(data.draw, H, 4, 4)
    options.pop("score_mod") if data.draw(st.booleans()) else None
    note(f"options: {options}")
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, m: headwise.attention(q, k, v, m, **options), backend=counter,
                             fullgraph=True)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    for S in (4, 6, 9):
        q = torch.randn(1, H, S, 4, generator=gen)
        mask = torch.rand(1, S, generator=gen) > 0.2
        eager = _served(lambda q, m: headwise.attention(q, q, q, m, **options), q, mask)
        if eager is None:
            return
        assert_close(f"compiled S={S}", compiled(q, q, q, mask), eager, TOL[torch.float32])
    assert counter.frame_count <= 2, f"{counter.frame_count} graphs for three sequence lengths"

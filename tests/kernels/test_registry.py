"""The registry: one explicit list of built-in kernels, and register() for your own."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import kernels
from headwise.kernels import registry
from headwise.rules import Rules


def test_builtin_lists_every_kernel_under_its_own_name_in_registry_order():
    assert list(kernels.BUILTIN) == list(kernels.kernels())
    for name, kernel in kernels.BUILTIN.items():
        assert kernel.name == name and kernels.get_kernel(name) is kernel


def test_register_adds_a_backend_users_can_call_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))  # restored after the test

    @kernels.register("plus_one", summary="q + 1, to see the call arrive")
    def plus_one(q, k, v, **kwargs):
        return q + 1, None

    q = torch.zeros(1, 2, 3, 4)
    assert torch.equal(headwise.attention(q, q, q, backend="plus_one"), q + 1)
    assert "plus_one" in headwise.available_backends()
    with pytest.raises(ValueError, match="a kernel named 'sdpa' is already registered"):
        kernels.register("sdpa", summary="again")(plus_one)


def test_a_kernel_written_for_the_first_signature_serves_plain_calls_and_refuses_the_newer_options(monkeypatch, ref):
    """softcap, sinks and sink_tokens came after the first kernel signature: such a kernel still
    serves every call without them, and is refused (with the reason) for a call with one."""
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
    seen = []

    @kernels.register("first_signature", summary="the textbook kernel behind the first signature")
    def first(q, k, v, *, attention_mask, is_causal, dropout_p, scale, need_weights, window, alibi_slopes):
        seen.append(1)
        rules = Rules(is_causal=is_causal, window=window, alibi_slopes=alibi_slopes)
        return registry.get_kernel("matmul").fn(q, k, v, attention_mask=attention_mask, rules=rules,
                                                dropout_p=dropout_p, scale=scale, need_weights=need_weights)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    out = headwise.attention(q, k, v, is_causal=True, window=2, backend="first_signature")
    torch.testing.assert_close(out, ref(q, k, v, is_causal=True, window=2)[0], atol=1e-10, rtol=1e-10)
    assert seen == [1]
    for kwargs, names in (({"softcap": 5.0}, "softcap="), ({"sinks": torch.zeros(2, dtype=torch.float64)}, "sinks="),
                          ({"window": 2, "sink_tokens": 1}, "sink_tokens=")):
        with pytest.raises(ValueError, match=f"backend 'first_signature' its function takes no {names} keyword"):
            headwise.attention(q, k, v, backend="first_signature", **kwargs)
        assert headwise.choose_backend(q, k, v, **kwargs).passed_over["first_signature"].startswith(
            f"its function takes no {names} keyword")
    for kwargs in ({"mask_mod": headwise.masks.causal}, {"score_mod": lambda s, b, h, i, j: s * 2}):
        with pytest.raises(ValueError, match="backend 'first_signature' its function takes no rules= keyword .* "
                                             "cannot run a mask_mod or score_mod"):
            headwise.attention(q, k, v, backend="first_signature", **kwargs)


def test_a_compiled_call_reads_kernel_signatures_without_dynamo_warnings():
    """`takes` memoises signatures with lru_cache, which Dynamo traces through with a UserWarning
    ("Dynamo detected a call to a functools.lru_cache-wrapped function at registry.py"): under
    compilation the plain function runs instead. In a process of its own, since Dynamo warns once
    a process."""
    import fresh_process  # python -c, forked from a process that imported only torch

    code = (
        "import warnings, torch, headwise\n"
        "warnings.simplefilter('error')\n"
        "f = torch.compile(lambda q: headwise.attention(q, q, q, is_causal=True), fullgraph=True, backend='eager')\n"
        "print(tuple(f(torch.randn(1, 2, 4, 8)).shape))\n"
    )
    run = fresh_process.run(code=code, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "(1, 2, 4, 8)", run.stderr[-3000:]
    assert registry.takes(lambda q, k, v: q, "rules") is False  # eager calls still read signatures
    assert registry.takes(lambda q, **kw: q, "rules") is True


def _direct_inputs():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 5, 8, dtype=torch.float64, generator=gen)  # (B, H, S, D)
    k = torch.randn(2, 2, 7, 8, dtype=torch.float64, generator=gen)  # (B, Hkv, Sk, D): GQA
    v = torch.randn(2, 2, 7, 6, dtype=torch.float64, generator=gen)  # (B, Hkv, Sk, Dv)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 5:] = False  # (B, 1, 1, Sk) key padding
    return q, k, v, mask


@pytest.mark.parametrize("name", list(kernels.BUILTIN))
def test_every_builtin_kernel_returns_one_kernel_result_with_lse_only_when_asked(name, monkeypatch):
    """Issue 38: a kernel returns one KernelResult (out, weights, lse), read by name, whatever it was asked."""
    from headwise import testing

    if name == "triton" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter
    kernel = kernels.BUILTIN[name]
    if kernel.available() is not None:
        pytest.skip(f"{name} cannot run here: {kernel.available()}")
    if kernel.compiles:  # float16/32 only, and a graph per call here: its own file checks its KernelResult
        pytest.skip(f"{name} compiles per rule and shape: tests/kernels/test_{name}.py checks its results")
    q, k, v, mask = _direct_inputs()
    if name == "triton":  # fp32 and Dv == D only
        q, k, v = q.float(), k.float(), k.float()
    if kernel.invariant:  # fp32 / bf16 only
        q, k, v = q.float(), k.float(), v.float()
    want = testing.reference_attention(q, k, v, mask, is_causal=True)
    args = dict(attention_mask=mask, rules=Rules(is_causal=True), dropout_p=0.0, scale=q.shape[-1] ** -0.5)
    tol = dict(atol=1e-10, rtol=1e-10) if q.dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    result = kernel.fn(q, k, v, need_weights=kernel.supports_weights, **args)
    assert type(result) is registry.KernelResult and result.lse is None
    torch.testing.assert_close(result.out, want.out.to(q.dtype), **tol)
    if kernel.supports_weights:
        torch.testing.assert_close(result.weights, want.weights.to(q.dtype), **tol)
    else:
        assert result.weights is None
    with_lse = kernel.fn(q, k, v, need_weights=False, return_lse=True, **args)
    assert type(with_lse) is registry.KernelResult and with_lse.weights is None
    torch.testing.assert_close(with_lse.out, want.out.to(q.dtype), **tol)
    torch.testing.assert_close(with_lse.lse, want.lse.to(with_lse.lse.dtype), **tol)


def test_a_kernel_of_your_own_may_return_a_plain_tuple_and_is_read_by_name(monkeypatch, ref):
    """A registered kernel that returns (out, weights) or, with return_lse, (out, weights, lse) still
    serves every path: call_kernel reads it as a KernelResult."""
    from headwise import testing

    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
    matmul = registry.get_kernel("matmul").fn

    @kernels.register("plain_tuple", summary="matmul, returning plain tuples", supports_weights=True)
    def plain(q, k, v, *, return_lse=False, **kwargs):
        result = matmul(q, k, v, return_lse=return_lse, **kwargs)
        return (result.out, result.weights, result.lse) if return_lse else [result.out, result.weights]

    q, k, v, mask = _direct_inputs()
    want = testing.reference_attention(q, k, v, mask, window=3)
    tol = dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(headwise.attention(q, k, v, mask, backend="plain_tuple"),
                               testing.reference_attention(q, k, v, mask).out, **tol)  # the remembered path
    out, weights, lse = headwise.attention(q, k, v, mask, window=3, backend="plain_tuple", need_weights=True,
                                           return_lse=True)
    for got, expected in ((out, want.out), (weights, want.weights), (lse, want.lse)):
        torch.testing.assert_close(got, expected, **tol)
    direct = registry.call_kernel(plain, q, k, v, mask, Rules(window=3, is_causal=True),
                                  dict(dropout_p=0.0, scale=8 ** -0.5, need_weights=True))
    assert type(direct) is registry.KernelResult and direct.lse is None
    torch.testing.assert_close(direct.weights, want.weights, **tol)


def test_a_kernel_that_returns_anything_else_is_named_in_a_type_error(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))

    @kernels.register("bare_tensor", summary="returns the output alone")
    def bare(q, k, v, **kwargs):
        return q

    @kernels.register("no_lse", summary="never returns the lse it is asked for")
    def no_lse(q, k, v, *, return_lse=False, **kwargs):
        return q, None

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"kernel .*bare returned Tensor; a kernel returns "
                                        r"headwise.kernels.KernelResult\(out, weights, lse\) or a plain"):
        headwise.attention(q, q, q, backend="bare_tensor")
    with pytest.raises(TypeError, match=r"kernel .*<lambda> returned a 1-tuple"):
        registry.run_kernel(lambda q, k, v, **kw: (q,), q, q, q, None, {})
    with pytest.raises(TypeError, match=r"kernel .*no_lse was asked for the log-sum-exp \(return_lse=True\) but "
                                        r"returned none; return KernelResult\(out, weights, lse\)"):
        headwise.attention(q, q, q, backend="no_lse", return_lse=True)

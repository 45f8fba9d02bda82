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
    compilation the plain function runs instead. In a fresh interpreter, since Dynamo warns once
    a process."""
    import subprocess
    import sys

    code = (
        "import warnings, torch, headwise\n"
        "warnings.simplefilter('error')\n"
        "f = torch.compile(lambda q: headwise.attention(q, q, q, is_causal=True), fullgraph=True, backend='eager')\n"
        "print(tuple(f(torch.randn(1, 2, 4, 8)).shape))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "(1, 2, 4, 8)", run.stderr[-3000:]
    assert registry.takes(lambda q, k, v: q, "rules") is False  # eager calls still read signatures
    assert registry.takes(lambda q, **kw: q, "rules") is True

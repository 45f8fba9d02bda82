"""``MultiHeadAttention(softcap=..., sinks=True)``: the module against the float64 reference,
on the dense and packed paths, with its state dict, trace, dispatch and refusals.

(The cache and torch.compile cases live in tests/test_cache.py and tests/test_compile.py.)

Legend: B batch, H query heads, Hkv key/value heads, S sequence length, D head dim,
E embed dim.
"""

from __future__ import annotations

import re

import pytest
import torch

import headwise
import headwise.distributed as hwd
from conftest import reference_attention
from headwise import MultiHeadAttention

B, S, E, H = 3, 6, 32, 4
PAD = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [0] + [1] * 5], dtype=torch.bool)  # right and left padding


def _module(**kwargs) -> MultiHeadAttention:
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, num_kv_heads=2, softcap=1.5, sinks=True, **kwargs).double()
    with torch.no_grad():
        mha.sinks.normal_(std=2.0)  # learned-looking sinks, not the zeros they start from
    return mha


def _expected(mha: MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """The module written out with the float64 reference: project, attend, merge, project."""
    D, Hkv = mha.head_dim, mha.num_kv_heads
    q = mha.q_proj(x).reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    k = mha.k_proj(x).reshape(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
    v = mha.v_proj(x).reshape(B, S, Hkv, D).transpose(1, 2)
    out, _ = reference_attention(q, k, v, mask, is_causal=is_causal, softcap=mha.softcap, sinks=mha.sinks)
    out = mha.out_proj(out.transpose(1, 2).reshape(B, S, E))  # (B, S, E)
    return out.masked_fill(~mask[..., None], 0.0)  # padded queries output zeros


@pytest.mark.parametrize("packing", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("backend", ["auto", "matmul", "chunked"])
def test_module_matches_the_reference_with_gradients(backend, packing):
    mha = _module(backend=backend, packing=packing, is_causal=True)
    x = torch.randn(B, S, E, dtype=torch.float64, requires_grad=True)
    assert mha.plan(x, PAD).path == ("packed" if packing else "dense")
    got = mha(x, PAD)
    leaves = (x, mha.sinks, mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    want = _expected(mha, x, PAD, is_causal=True)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    for name, a, w in zip(("dx", "dsinks", "dq", "dk", "dv"), got_grads, want_grads, strict=True):
        assert a.abs().sum() > 0, name
        torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10, msg=name)


def test_sinks_without_softcap_run_on_sdpa_and_match():
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, sinks=True, packing=False).double()
    with torch.no_grad():
        mha.sinks.normal_(std=2.0)
    x = torch.randn(B, S, E, dtype=torch.float64)
    assert mha.dispatch(x, PAD).backend == "sdpa"
    D = mha.head_dim
    q, k, v = (p(x).reshape(B, S, H, D).transpose(1, 2) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    out, _ = reference_attention(q, k, v, PAD, sinks=mha.sinks)
    want = mha.out_proj(out.transpose(1, 2).reshape(B, S, E)).masked_fill(~PAD[..., None], 0.0)
    torch.testing.assert_close(mha(x, PAD), want, atol=1e-10, rtol=1e-10)


def test_sinks_parameter_state_dict_and_initial_zeros():
    mha = MultiHeadAttention(E, H, sinks=True)
    assert isinstance(mha.sinks, torch.nn.Parameter) and mha.sinks.shape == (H,)
    assert torch.equal(mha.sinks, torch.zeros(H))
    state = mha.state_dict()
    assert state["sinks"].shape == (H,)
    assert "sinks" in dict(mha.named_parameters())
    other = MultiHeadAttention(E, H, sinks=True)
    other.load_state_dict({**state, "sinks": torch.arange(H, dtype=torch.float32)})
    assert torch.equal(other.sinks, torch.arange(H, dtype=torch.float32))
    plain = MultiHeadAttention(E, H)
    assert plain.sinks is None and "sinks" not in plain.state_dict()
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "sinks"'):
        plain.load_state_dict(state)


def test_explain_trace_shows_softcap_and_sinks_stage_by_stage():
    mha = _module(backend="matmul", packing=False)
    x = torch.randn(B, S, E, dtype=torch.float64)
    with headwise.trace() as t:
        mha(x, PAD)
    names = t.names()
    i = names.index("scores")
    assert names[i:i + 6] == ["scores", "softcap", "mask", "sinks", "softmax", "dropout"]
    stages = {s.name: s for s in t.stages}
    assert stages["sinks"].shape == (B, H, S, S + 1)
    assert stages["softcap"].note.startswith("softcap * tanh(scores / softcap), softcap = 1.5")
    with headwise.trace() as fused:
        _module(packing=False)(x, PAD)
    (chunked,) = [s for s in fused.stages if s.fused]
    assert chunked.name == "chunked" and "softcap 1.5, mask, sinks, softmax" in chunked.note


def test_dispatch_routes_softcap_around_sdpa():
    mha = _module(packing=False)
    d = mha.dispatch(torch.randn(B, S, E, dtype=torch.float64), PAD)
    assert d.backend == "chunked"
    assert d.passed_over["sdpa"].startswith("cannot soft-cap the scores (softcap)")
    assert d.request.softcap and d.request.sinks


def test_extra_repr_names_softcap_and_sinks():
    assert MultiHeadAttention(16, 4, softcap=50.0, sinks=True).extra_repr() == (
        "embed_dim=16, num_heads=4, head_dim=4, dropout=0.0, is_causal=False, backend='auto', softcap=50, sinks=True")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"softcap": 0.0}, ValueError, "softcap must be a finite number > 0 (Gemma 2 uses 50.0), got 0.0"),
        ({"softcap": -3}, ValueError, "softcap must be a finite number > 0 (Gemma 2 uses 50.0), got -3"),
        ({"softcap": "50"}, TypeError, "softcap must be a float or None, got str ('50')"),
        ({"sinks": 1}, TypeError, "sinks must be True or False (a learnable sink logit per head), got int (1)"),
        ({"sinks": True, "context_parallel": hwd.ContextParallel()}, ValueError,
         "context_parallel has no logit soft-capping or attention sinks"),
        ({"softcap": 30.0, "context_parallel": hwd.ContextParallel()}, ValueError,
         "build the module without softcap/sinks, or without context_parallel"),
    ],
)
def test_constructor_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MultiHeadAttention(E, H, **kwargs)


@pytest.mark.parametrize("kwargs, name", [({"softcap": 30.0}, "softcap"), ({"sinks": True}, "sinks")])
def test_to_torch_refuses_what_torch_cannot_hold(kwargs, name):
    with pytest.raises(ValueError, match=re.escape(f"torch.nn.MultiheadAttention has no {name}; build this module "
                                                   "without them to convert it")):
        MultiHeadAttention(E, H, **kwargs).to_torch()

"""Logit soft-capping (``softcap=``) and attention sinks (``sinks=``) on every kernel.

Each kernel that accepts a feature matches the float64 reference (outputs and the
gradients of q, k, v and the sink logits); each that cannot refuses it with a reason, and
"auto" routes around the refusal.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import headwise
from conftest import contract_backends, reference_attention
from headwise import policy
from headwise.kernels import get_kernel

BACKENDS = contract_backends()
B, H, D = 3, 4, 8
FEATURES = {"softcap": {"softcap": 2.0}, "sinks": {"sinks": True}, "both": {"softcap": 2.0, "sinks": True}}
# (S, Sk, Hkv, mask form, causal, window, alibi): every mask holds a row with nothing to attend
CASES = {
    "padded-gqa-causal": (3, 7, 2, "padding", True, None, False),
    "float4d-mqa-alibi": (5, 5, 1, "float 4-D", False, None, True),
    "bool3d-window": (6, 4, 4, "bool 3-D", True, 2, False),
}


@pytest.fixture(params=[*BACKENDS, "chunked-tiled"])
def backend(request, monkeypatch):
    """Each backend; 'chunked-tiled' runs chunked with tiny tiles, so the sinks meet a
    log-sum-exp merged over several key blocks."""
    if request.param == "chunked-tiled":
        monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 2)
        monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 3)
        return "chunked"
    return request.param


def _mask(form: str, S: int, Sk: int, gen: torch.Generator) -> torch.Tensor:
    if form == "padding":
        return headwise.masks.key_padding_mask([Sk, 2, 0], Sk)  # (B, Sk): row 2 is all padding
    if form == "float 4-D":
        m = torch.randn(B, 1, S, Sk, generator=gen, dtype=torch.float64)
        m[1, 0, 2] = float("-inf")  # a dead row
        return m
    m = torch.rand(B, S, Sk, generator=gen) > 0.3  # bool 3-D
    m[0, 1] = False
    return m


def _call(case: str, feature: str, dtype=torch.float64, seed=0):
    """q, k, v, sinks (or None) as leaves, the mask, and attention()'s keyword arguments."""
    S, Sk, Hkv, form, causal, window, alibi = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=dtype).requires_grad_()
    kwargs = {"is_causal": causal, "window": window, "softcap": FEATURES[feature].get("softcap")}
    if alibi:
        kwargs["alibi_slopes"] = headwise.masks.alibi_slopes(H).to(dtype)
    sinks = None
    if "sinks" in FEATURES[feature]:
        sinks = (2 * torch.randn(H, generator=gen, dtype=dtype)).requires_grad_()
    kwargs["sinks"] = sinks
    return q, k, v, sinks, _mask(form, S, Sk, gen), kwargs


def _refusal(backend: str, q, k, v, mask, kwargs) -> str | None:
    try:
        headwise.choose_backend(q, k, v, mask, backend=backend, **kwargs)
    except ValueError as refusal:
        return str(refusal)
    return None


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("feature", FEATURES)
def test_matches_float64_reference_with_gradients(backend, feature, case):
    q, k, v, sinks, mask, kwargs = _call(case, feature)
    refusal = _refusal(backend, q, k, v, mask, kwargs)
    if refusal is not None:  # only where the kernel says it cannot: checked in the refusal test
        assert backend in ("sdpa", "varlen") and "softcap" in feature + refusal, refusal
        return
    out = headwise.attention(q, k, v, mask, backend=backend, **kwargs)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    got = torch.autograd.grad(out, leaves, g)
    expected, weights = reference_attention(q, k, v, mask, **kwargs)
    want = torch.autograd.grad(expected, leaves, g)
    for name, a, w in zip(("out", "dq", "dk", "dv", "dsinks")[:1 + len(got)], (out, *got), (expected, *want),
                          strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-10, msg=name)
    if sinks is not None:  # the sink holds the rest of every row's probability
        assert (weights.sum(-1) < 1).all()
    dead = weights.sum(-1) == 0  # (B, H, S): nothing to attend (without sinks)
    assert (out.detach()[dead] == 0).all()


@pytest.mark.parametrize("feature", FEATURES)
def test_float32_within_float32_rounding(backend, feature):
    """The float32 path (chunked accumulates as it is given, sdpa appends its sink column in
    float32) stays within 1e-5 of float64."""
    q, k, v, sinks, mask, kwargs = _call("padded-gqa-causal", feature, dtype=torch.float32)
    if _refusal(backend, q, k, v, mask, kwargs) is not None:
        return
    out = headwise.attention(q, k, v, mask, backend=backend, **kwargs)
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    got = torch.autograd.grad(out.sum(), leaves)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    kw64 = {**kwargs, "sinks": exact[3] if sinks is not None else None}
    expected, _ = reference_attention(*exact[:3], mask, **kw64)
    want = torch.autograd.grad(expected.sum(), exact)
    for a, w in zip((out, *got), (expected, *want), strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), w, atol=1e-5, rtol=1e-5)


def test_refusals_name_the_feature_and_auto_routes_around_them(monkeypatch):
    q, k, v, sinks, mask, kwargs = _call("padded-gqa-causal", "both")
    for name in ("sdpa", "varlen"):
        with pytest.raises(ValueError, match=re.escape(f"backend {name!r} cannot soft-cap the scores (softcap)")):
            headwise.choose_backend(q, k, v, mask, backend=name, **kwargs)
        with pytest.raises(ValueError, match="cannot soft-cap the scores"):
            headwise.attention(q, k, v, mask, backend=name, **kwargs)
    dispatch = headwise.choose_backend(q, k, v, mask, **kwargs)
    assert dispatch.backend == "chunked"
    assert "cannot soft-cap the scores" in dispatch.passed_over["sdpa"]
    sinks_only = {**kwargs, "softcap": None}
    assert headwise.choose_backend(q, k, v, mask, **sinks_only).backend == "sdpa"  # exact with one zero key
    weights = headwise.choose_backend(q, k, v, mask, need_weights=True, **kwargs)
    assert weights.backend == "chunked" and "log-sum-exp" in weights.reason  # soft-capping skips sdpa
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU request is then one triton could serve
    request = dataclasses.replace(dispatch.request, dtype=torch.float32)
    assert get_kernel("triton").refuses(request) is None  # triton takes both (tests/kernels/test_triton.py)
    cuda = dataclasses.replace(request, device=torch.device("cuda"), dtype=torch.float16)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        d = headwise.dispatch.select(cuda)
    assert d.backend == "triton"  # CUDA half precision with a mask: the fused kernel, softcap and sinks included
    maskless = dataclasses.replace(cuda, mask_kind="none", mask_shape=None, is_causal=False, key_padding=None)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        assert headwise.dispatch.select(maskless).backend == "triton"  # not chunked: softcap alone routes there
        assert headwise.dispatch.select(dataclasses.replace(maskless, softcap=False)).backend == "triton"  # sinks
        assert headwise.dispatch.select(dataclasses.replace(maskless, softcap=False, sinks=False)).backend == "sdpa"


@pytest.mark.parametrize("backend", [n for n in BACKENDS if get_kernel(n).supports_weights])
def test_weights_with_sinks_sum_below_one(backend):
    q, k, v, sinks, mask, kwargs = _call("float4d-mqa-alibi", "both")
    out, weights = headwise.attention(q, k, v, mask, backend=backend, need_weights=True, **kwargs)
    expected, expected_weights = reference_attention(q, k, v, mask, **kwargs)
    torch.testing.assert_close(weights, expected_weights, atol=1e-12, rtol=1e-12)
    live = weights.sum(-1) > 0
    assert (weights.sum(-1)[live] < 1).all()
    # the missing mass is the sink's: 1 - sum = exp(sink) / (sum_j exp(s_j) + exp(sink))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_gradcheck_chunked_softcap_and_sinks(monkeypatch):
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 2)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 2)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 1, 1, 5, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sinks, bias):
        return headwise.attention(q, k, v, bias, is_causal=True, softcap=1.5, sinks=sinks, backend="chunked")

    assert torch.autograd.gradcheck(f, (q, k, v, sinks, bias))


def test_chunked_dropout_with_softcap_and_sinks_replays_its_mask():
    """With the seed reset before each call, dropout is a fixed function: gradcheck proves
    the backward (softcap's 1 - t^2, the sinks' gradient) uses forward's dropout mask."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sinks):
        torch.manual_seed(0)
        return headwise.attention(q, k, v, dropout_p=0.4, softcap=1.5, sinks=sinks, backend="chunked")

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_chunked_and_sdpa_stay_close(dtype):
    """fp16/bf16: within a few of the dtype's own rounding steps of float64, no NaN."""
    q, k, v, sinks, mask, kwargs = _call("padded-gqa-causal", "sinks", dtype=torch.float32)
    eps = torch.finfo(dtype).eps
    for name, extra in (("chunked", {"softcap": 2.0}), ("sdpa", {})):
        low = {**kwargs, **extra, "sinks": sinks.detach().to(dtype)}
        got = headwise.attention(q.detach().to(dtype), k.detach().to(dtype), v.detach().to(dtype), mask,
                                 backend=name, **low)
        want, _ = reference_attention(q, k, v, mask, **{**kwargs, **extra})
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert (got.double() - want).abs().max() < 8 * eps, name


def test_no_keys_with_sinks_gives_zeros_and_zero_gradients(backend):
    q = torch.randn(2, H, 3, D, requires_grad=True)
    k = v = torch.randn(2, 2, 0, D, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)
    kwargs = {"sinks": sinks}
    if _refusal(backend, q, k, v, None, kwargs) is not None:
        return
    out = headwise.attention(q, k, v, backend=backend, **kwargs)
    assert (out == 0).all()
    dq, dsinks = torch.autograd.grad(out.sum(), (q, sinks))
    assert (dq == 0).all() and (dsinks == 0).all()


# --- the checks in headwise.attention --------------------------------------------------


def test_softcap_must_be_a_positive_number():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=re.escape("softcap must be a float or None, got str ('50')")):
        headwise.attention(q, q, q, softcap="50")
    with pytest.raises(TypeError, match=re.escape("softcap must be a float or None, got bool (True)")):
        headwise.attention(q, q, q, softcap=True)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=re.escape(f"softcap must be a finite number > 0 (Gemma 2 uses 50.0), "
                                                       f"got {bad}")):
            headwise.attention(q, q, q, softcap=bad)


def test_sinks_must_be_one_floating_logit_per_head_on_q_device():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=re.escape("sinks must be a floating tensor of shape (H,), one logit per "
                                                  "query head, got torch.int64; e.g. torch.zeros(num_heads)")):
        headwise.attention(q, q, q, sinks=torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="got list"):
        headwise.attention(q, q, q, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match=re.escape("sinks must have shape (H,) = (2,), one logit per query head, "
                                                   "got (1, 2)")):
        headwise.attention(q, q, q, sinks=torch.zeros(1, 2))
    with pytest.raises(ValueError, match=re.escape("sinks is on meta but the queries are on cpu; move it with "
                                                   "sinks.to(q.device)")):
        headwise.attention(q, q, q, sinks=torch.zeros(2, device="meta"))


def test_the_repeated_call_memo_never_serves_softcap_or_sinks():
    """A maskless call is memoised by its signature, which holds no softcap or sinks: the
    same shapes with them must still be computed with them."""
    q = k = v = torch.randn(1, 2, 4, 8)
    plain = headwise.attention(q, k, v)
    assert torch.equal(headwise.attention(q, k, v), plain)  # the memo's hit
    capped = headwise.attention(q, k, v, softcap=0.1)
    sunk = headwise.attention(q, k, v, sinks=torch.full((2,), 3.0))
    torch.testing.assert_close(capped, reference_attention(q, k, v, softcap=0.1)[0].float())
    torch.testing.assert_close(sunk, reference_attention(q, k, v, sinks=torch.full((2,), 3.0))[0].float())
    assert not torch.allclose(capped, plain) and not torch.allclose(sunk, plain)


def test_auto_sends_large_sink_calls_on_cpu_to_chunked(monkeypatch):
    """SDPA with sinks needs an explicit float mask: from SINKS_CHUNKED_MIN_SCORES scores per
    head, with gradients or a per-query mask, "auto" ranks chunked first (policy.py has the
    measurements)."""
    monkeypatch.setattr(policy, "SINKS_CHUNKED_MIN_SCORES", 6 * 6)
    sinks = torch.zeros(H)
    q, k = torch.randn(1, H, 6, D), torch.randn(1, 2, 6, D)
    assert headwise.choose_backend(q, k, k, sinks=sinks).backend == "sdpa"  # forward only, no mask
    causal = headwise.choose_backend(q, k, k, sinks=sinks, is_causal=True)
    assert causal.backend == "chunked"
    assert causal.reason.startswith("sinks on CPU with S x Sk = 36 >= SINKS_CHUNKED_MIN_SCORES 36 and a per-query mask")
    training = headwise.choose_backend(q.requires_grad_(), k, k, sinks=sinks)
    assert training.backend == "chunked" and "and gradients:" in training.reason
    assert headwise.choose_backend(q[:, :, :5], k, k, sinks=sinks).backend == "sdpa"  # 30 scores: below
    assert headwise.choose_backend(q, k, k, is_causal=True).backend == "sdpa"  # no sinks: the rule is silent

"""Tests for ``headwise.functional``: input checks, masks end to end, backend listing.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import headwise
from conftest import assert_served, contract_backends, reference_attention
from headwise import attention, available_backends, choose_backend
from headwise.kernels.registry import get_kernel, kernels

B, H, Hkv, S, Sk, D = 2, 4, 2, 3, 5, 8
BACKENDS = contract_backends()
WEIGHT_BACKENDS = [n for n in BACKENDS if get_kernel(n).supports_weights]


def qkv(heads=H, kv_heads=Hkv, q_len=S, k_len=Sk, dtype=torch.float32, requires_grad=False):
    q = torch.randn(B, heads, q_len, D, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(B, kv_heads, k_len, D, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(B, kv_heads, k_len, D, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


def close(a, b):
    torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


# --- input errors -------------------------------------------------------------------------


def test_non_tensor_inputs():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got NoneType"):
        attention(q, None, v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got str"):
        attention(q, k, "v")


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_inputs_must_be_4d(which):
    t = dict(zip("qkv", qkv(), strict=True))
    t[which] = t[which][0]
    shape = tuple(t[which].shape)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{which} must be 4-D (B, H, S, D), got shape {shape}; "
            "split heads first, e.g. x.reshape(B, S, H, D).transpose(1, 2)"
        ),
    ):
        attention(t["q"], t["k"], t["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_inputs_must_be_floating(which):
    t = dict(zip("qkv", qkv(), strict=True))
    t[which] = t[which].long()
    with pytest.raises(TypeError, match=f"{which} must be floating point, got torch.int64"):
        attention(t["q"], t["k"], t["v"])


def test_dtypes_must_agree():
    q, k, v = qkv()
    with pytest.raises(
        TypeError,
        match=re.escape(
            "q, k, v dtypes differ (torch.float32, torch.float64, torch.float32); "
            "cast them to one dtype"
        ),
    ):
        attention(q, k.double(), v)


def test_devices_must_agree():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "q, k, v are on different devices (cpu, cpu, meta); move them to one device"
        ),
    ):
        attention(q, k, v.to("meta"))


def test_k_and_v_shapes_must_agree():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "k (2, 2, 5, 8) and v (2, 2, 4, 8) must agree on (B, Hkv, Sk): k is (B, Hkv, Sk, D), "
            "v (B, Hkv, Sk, Dv); only the last dimension (the head dim) may differ"
        ),
    ):
        attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match=re.escape("k (2, 2, 5, 8) and v (2, 1, 5, 8) must agree on (B, Hkv, Sk)")):
        attention(q, k, v[:, :1])


def test_v_may_have_its_own_head_dim():
    q, k, _ = qkv()
    v = torch.randn(B, Hkv, Sk, 5)
    out = attention(q, k, v, is_causal=True)
    assert out.shape == (B, H, S, 5)
    assert choose_backend(q, k, v).request.value_dim == 5
    assert choose_backend(q, k, k).request.value_dim is None  # Dv == D: the usual request


def test_repeated_calls_tell_value_head_dims_apart():
    """The repeated-call memo keys on Dv too: the same q, k with a v of another width is a new signature."""
    q, k, _ = qkv()
    for Dv in (8, 5, 8, 3):
        v = torch.randn(B, Hkv, Sk, Dv)
        close(attention(q, k, v), attention(q, k, v, backend="matmul"))


@pytest.mark.parametrize("value, error, message", [
    (2, ValueError, "sink_tokens=2 keeps the first keys visible under a sliding window; give window=W too"),
    (-1, ValueError, "sink_tokens must be >= 0 (the first keys kept visible under the window), got -1"),
    (True, TypeError, "sink_tokens must be an int, got bool (True)"),
    (1.0, TypeError, "sink_tokens must be an int, got float (1.0)"),
])
def test_sink_tokens_are_checked(value, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=re.escape(message)):
        attention(q, k, v, sink_tokens=value, window=None if value == 2 else 2)


def test_sink_tokens_reach_the_kernel_and_the_trace():
    q, k, v = qkv(q_len=6, k_len=6)
    with headwise.trace() as t:
        out = attention(q, k, v, window=2, sink_tokens=1, backend="matmul")
    mask_note = next(s.note for s in t.stages if s.name == "mask")
    assert "causal window 2: i - 2 < j <= i, or j < 1 (sink tokens) and j <= i" in mask_note
    plain = attention(q, k, v, window=2, backend="matmul")
    assert not torch.allclose(out[:, :, -1], plain[:, :, -1])


def test_batches_must_agree():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q has batch 1 but k and v have batch 2"):
        attention(q[:1], k, v)


def test_head_dims_must_agree():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=re.escape(
            "q head dim (6) differs from k head dim (8); "
            "project q and k to the same head_dim (v may have its own)"
        ),
    ):
        attention(q[..., :6], k, v)


@pytest.mark.parametrize("kv_heads", [3, 0])
def test_heads_must_be_a_multiple_of_kv_heads(kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"q has 4 heads, which is not a multiple of k/v's {kv_heads} heads; "
            "grouped-query attention needs num_heads % num_kv_heads == 0"
        ),
    ):
        attention(q, k, v)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_range(p):
    with pytest.raises(ValueError, match=re.escape(f"dropout_p must be in [0, 1), got {p}")):
        attention(*qkv(), dropout_p=p)


def test_unknown_backend_lists_known_ones():
    known = ", ".join(repr(n) for n in ["auto", *kernels()])
    with pytest.raises(
        ValueError, match=re.escape(f"unknown backend 'flash9'; choose one of {known}")
    ):
        attention(*qkv(), backend="flash9")
    assert "'matmul'" in known and "'sdpa'" in known


def test_a_backend_without_the_log_sum_exp_here_cannot_return_weights():
    with pytest.raises(ValueError, match=re.escape("backend 'sdpa' returns the log-sum-exp only from torch's CPU flash "
                                                   "kernel, without dropout (device cpu, dropout_p=0.5)")):
        attention(*qkv(), backend="sdpa", need_weights=True, dropout_p=0.5)


def test_mask_errors_reach_the_caller():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape("attention_mask of shape (2, 3) does not fit")):
        attention(q, k, v, torch.ones(B, S, dtype=torch.bool))  # (B, S) instead of (B, Sk)
    with pytest.raises(TypeError, match="attention_mask has dtype torch.complex64"):
        attention(q, k, v, torch.ones(B, Sk, dtype=torch.complex64))
    with pytest.raises(ValueError, match="attention_mask is on meta but the queries are on cpu"):
        attention(q, k, v, torch.ones(B, Sk, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor or None, got list"):
        attention(q, k, v, [[1] * Sk] * B)


def test_choose_backend_checks_inputs_too():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape("dropout_p must be in [0, 1), got 2")):
        choose_backend(q, k, v, dropout_p=2)


# --- results ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [H, Hkv, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("q_len", [S, Sk, 7], ids=["S<Sk", "S==Sk", "S>Sk"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_matches_float64_reference(ref, backend, kv_heads, q_len, is_causal):
    q, k, v = qkv(kv_heads=kv_heads, q_len=q_len)
    mask = torch.rand(B, q_len, Sk) > 0.3
    mask[1, 0] = False  # one dead row regardless of causality
    assert_served(backend, q, k, v, mask)
    out = attention(q, k, v, mask, is_causal=is_causal, backend=backend)
    close(out, ref(q, k, v, mask, is_causal=is_causal)[0])
    assert out.shape == (B, H, q_len, D) and out.dtype == q.dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_is_additive_and_scale_applies(ref, backend):
    q, k, v = qkv()
    bias = torch.randn(B, H, S, Sk)
    bias[0, :, :, 1] = float("-inf")
    assert_served(backend, q, k, v, bias)
    out = attention(q, k, v, bias, scale=0.3, backend=backend)
    close(out, ref(q, k, v, bias, scale=0.3)[0])


@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
@pytest.mark.parametrize("kv_heads", [H, Hkv, 1], ids=["mha", "gqa", "mqa"])
def test_need_weights_shapes_and_values(ref, backend, kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    keep = torch.ones(B, Sk, dtype=torch.bool)
    keep[1] = False  # batch 1 attends nothing
    out, weights = attention(q, k, v, keep, backend=backend, need_weights=True)
    assert out.shape == (B, H, S, D)
    assert weights.shape == (B, H, S, Sk)
    close(weights, ref(q, k, v, keep)[1])
    close(weights.sum(-1), torch.tensor([1.0, 0.0])[:, None, None].expand(B, H, S))


def test_need_weights_false_returns_a_tensor():
    out = attention(*qkv())
    assert isinstance(out, torch.Tensor) and out.shape == (B, H, S, D)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_keys_gives_zeros(backend):
    q, k, v = qkv(k_len=0)
    out = attention(q, k, v, backend=backend)
    assert out.shape == (B, H, S, D)
    assert torch.equal(out, torch.zeros_like(out))


def _tilted(score, b, h, q_idx, kv_idx):
    """A general score_mod (not a bias)."""
    return score * 0.5 + 0.1 * (kv_idx - q_idx)


EMPTY_RULES = {
    "score_mod": {"score_mod": _tilted},
    "mask_mod": {"mask_mod": headwise.masks.sliding_window(2)},
    "both": {"mask_mod": headwise.masks.sliding_window(2), "score_mod": _tilted},
}


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("rules", list(EMPTY_RULES))
@pytest.mark.parametrize("sizes", [(B, 0, Sk), (B, S, 0), (0, S, Sk)], ids=["S=0", "Sk=0", "B=0"])
def test_empty_sizes_with_rules_give_zeros_and_zero_gradients(backend, rules, sizes):
    """No queries, no keys or no batch rows with a mask_mod or score_mod: every backend that takes
    the rules returns what matmul returns (zeros where rows attend nothing), with gradients."""
    batch, q_len, k_len = sizes
    q = torch.randn(batch, H, q_len, D, requires_grad=True)
    k, v = (torch.randn(batch, Hkv, k_len, D, requires_grad=True) for _ in range(2))
    kwargs = EMPTY_RULES[rules]
    try:
        choose_backend(q, k, v, backend=backend, **kwargs)
    except ValueError as refusal:  # only a kernel that cannot run the rules may say so, by name
        assert backend not in ("auto", "matmul", "chunked") and f"backend {backend!r}" in str(refusal), refusal
        return
    out = attention(q, k, v, backend=backend, **kwargs)
    assert torch.equal(out, torch.zeros(batch, H, q_len, D))
    torch.testing.assert_close(out, attention(q, k, v, backend="matmul", **kwargs))
    out.mul(2.0).sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_no_keys_gives_zero_weights():
    q, k, v = qkv(k_len=0)
    out, weights = attention(q, k, v, torch.ones(B, 0, dtype=torch.bool), need_weights=True)
    assert torch.equal(out, torch.zeros(B, H, S, D))
    assert weights.shape == (B, H, S, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_dead_rows_give_zeros_and_zero_gradients(backend, mask_kind):
    q, k, v = qkv(q_len=7, requires_grad=True)  # causal with S > Sk: rows 0 and 1 are dead
    keep = torch.ones(B, Sk, dtype=torch.bool)
    keep[1] = False  # and all of batch 1
    mask = keep if mask_kind == "bool" else torch.zeros(B, Sk).masked_fill(~keep, float("-inf"))
    assert_served(backend, q, k, v, mask)
    out = attention(q, k, v, mask, is_causal=True, backend=backend)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :, :2], torch.zeros_like(out[0, :, :2]))
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    assert torch.equal(q.grad[0, :, :2], torch.zeros_like(q.grad[0, :, :2]))
    assert torch.equal(k.grad[1], torch.zeros_like(k.grad[1]))
    assert torch.equal(v.grad[1], torch.zeros_like(v.grad[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_and_bool_masks_agree(backend):
    q, k, v = qkv()
    keep = torch.rand(B, S, Sk) > 0.4
    assert_served(backend, q, k, v, keep)
    out_bool = attention(q, k, v, keep, backend=backend)
    for dtype in (torch.int64, torch.int32, torch.uint8):
        assert torch.equal(attention(q, k, v, keep.to(dtype), backend=backend), out_bool)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    layout=st.sampled_from([(B, Sk), (B, S, Sk), (B, H, S, Sk), (1, 1, S, Sk), (B, 1, 1, Sk)]),
    is_causal=st.booleans(),
)
def test_property_integer_mask_equals_bool_mask(seed, layout, is_causal):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (S, Sk, Sk))
    ints = torch.randint(-2, 3, layout, generator=gen)
    out_int = attention(q, k, v, ints, is_causal=is_causal)
    out_bool = attention(q, k, v, ints != 0, is_causal=is_causal)
    assert torch.equal(out_int, out_bool)
    assert torch.isfinite(out_int).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_expanded_4d_mask_equals_2d_form(ref, backend):
    # The documents build (B, H, S, S) int masks: mask.unsqueeze(1).unsqueeze(2).expand(...)
    q, k, v = qkv(kv_heads=H, q_len=2, k_len=2)
    mask = torch.tensor([[1, 1], [1, 0]])
    expanded = mask.unsqueeze(1).unsqueeze(2).expand(B, H, 2, 2)
    assert_served(backend, q, k, v, expanded)
    out_4d = attention(q, k, v, expanded, backend=backend)
    close(out_4d, attention(q, k, v, mask, backend=backend))
    close(out_4d, ref(q, k, v, expanded)[0])


# --- backends -----------------------------------------------------------------------------


def test_available_backends():
    names = available_backends()
    assert {"sdpa", "matmul", "einsum", "einops", "bmm", "chunked"} <= set(names)
    assert "auto" not in names
    assert set(names) <= set(kernels())
    for name in names:
        assert get_kernel(name).available() is None
    assert headwise.available_backends is available_backends


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_available_backend_runs(ref, backend):
    q, k, v = qkv()
    close(attention(q, k, v, backend=backend), ref(q, k, v)[0])


def test_choose_backend_prints_readably():
    d = choose_backend(*qkv())
    assert isinstance(d, headwise.Dispatch)
    text = str(d)
    lines = text.splitlines()
    assert lines[0] == f"backend {d.backend!r}: {d.reason}"
    assert len(lines) == len(kernels())  # the choice, then one line per kernel passed over
    for name, why in d.passed_over.items():
        assert f"  passed over {name!r}: {why}" in lines


def test_choose_backend_runs_nothing_and_agrees_with_attention():
    q, k, v = qkv()
    d = choose_backend(q, k, v, need_weights=True)
    assert d.backend == "sdpa"  # the weights come from its log-sum-exp
    assert d.request.return_lse and d.request.q_len == S and d.request.k_len == Sk
    assert choose_backend(q, k, v, backend="einsum").backend == "einsum"


def test_choose_backend_takes_return_lse_as_attention_does():
    q, k, v = qkv()
    assert choose_backend(q, k, v, return_lse=True).request.return_lse
    with pytest.raises(ValueError, match="backend 'sdpa' returns the log-sum-exp only from torch's CPU flash kernel, "
                                         r"without dropout \(device cpu, dropout_p=0.1\)"):
        choose_backend(q, k, v, dropout_p=0.1, backend="sdpa", return_lse=True)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "varlen"])  # varlen reads the mask's values
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_tensor_is_made_on_the_inputs_device_and_dtype(backend, dtype):
    """On the meta device (no data), a helper tensor created on the default device instead of
    the inputs' device raises; the output keeps the inputs' device and dtype."""
    q = torch.empty(2, 4, 3, 8, device="meta", dtype=dtype)
    k = torch.empty(2, 2, 5, 8, device="meta", dtype=dtype)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).to("meta")
    masks = [None, torch.ones(2, 5, dtype=torch.bool, device="meta"), torch.zeros(2, 1, 3, 5, device="meta")]
    for kwargs in ({}, {"is_causal": True}, {"window": 2}, {"alibi_slopes": slopes}, {"dropout_p": 0.1}):
        if backend == "chunked" and "dropout_p" in kwargs:
            continue  # its per-tile dropout generators need a device with data
        for mask in masks:
            out = attention(q, k, k, mask, backend=backend, **kwargs)
            assert (out.device.type, out.dtype, out.shape) == ("meta", dtype, (2, 4, 3, 8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}], ids=["full", "causal"])
def test_scale_applies_without_a_mask(ref, backend, kwargs):
    q, k, v = qkv(kv_heads=H, q_len=Sk)  # S == Sk: SDPA's own causal path
    out = attention(q, k, v, scale=0.3, backend=backend, **kwargs)
    close(out, ref(q, k, v, scale=0.3, **kwargs)[0])


@pytest.mark.parametrize("kwargs, error, message", [
    ({"window": True}, TypeError, "window must be an int or None, got bool (True)"),
    ({"window": 2.0}, TypeError, "window must be an int or None, got float (2.0)"),
    ({"window": 0}, ValueError, "window must be >= 1 (keys per query, its own included), got 0"),
    ({"alibi_slopes": [0.5] * H}, TypeError, "alibi_slopes must be a floating tensor of shape (H,); "
                                             "headwise.masks.alibi_slopes(num_heads) gives the paper's"),
    ({"alibi_slopes": torch.ones(H, dtype=torch.long)}, TypeError, "alibi_slopes must be a floating tensor"),
    ({"alibi_slopes": torch.ones(H + 1)}, ValueError, f"alibi_slopes must have shape (H,) = ({H},), got ({H + 1},)"),
    ({"alibi_slopes": torch.ones(H, device="meta")}, ValueError, "alibi_slopes is on meta but the queries are on cpu"),
])
def test_window_and_alibi_errors(kwargs, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=re.escape(message)):
        attention(q, k, v, **kwargs)


def test_the_request_describes_the_call():
    q, k, v = qkv()
    k.requires_grad_()
    pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)  # 3 of 10 keys: 30% padding
    r = choose_backend(q, k, v, pad, window=3, alibi_slopes=torch.ones(H)).request
    assert (r.mask_kind, r.mask_shape, r.key_padding, r.window, r.alibi, r.is_causal, r.requires_grad) == (
        "bool", (B, 1, 1, Sk), 0.3, 3, True, True, True)
    r = choose_backend(q, k, v, torch.zeros(B, Sk)).request
    assert (r.mask_kind, r.key_padding, r.alibi, r.window, r.requires_grad) == ("float", None, False, None, True)
    with torch.no_grad():
        assert not choose_backend(q, k, v).request.requires_grad
    full = torch.rand(B, H, S, Sk, generator=torch.Generator().manual_seed(0)) > 0.5
    assert choose_backend(q, k, v, full).request.key_padding is None  # not a key padding mask
    one = qkv(q_len=1)[0]
    assert not choose_backend(one, k, v, is_causal=True).request.is_causal  # the last query sees every key
    assert choose_backend(q, k, v, is_causal=True).request.is_causal
    assert choose_backend(q, k, v).request.mask_kind == "none"


def test_trace_names_the_mask_layout_and_the_kernel():
    q, k, v = qkv()
    with headwise.trace() as t:
        attention(q, k, v, torch.tensor([[1, 1, 1, 0, 0], [1] * 5]), backend="sdpa")
    stages = {s.name: s for s in t.stages}
    assert stages["mask layout"].shape == (B, 1, 1, Sk)
    assert stages["mask layout"].note == (f"2-D ({B}, {Sk}) int64 -> ({B}, 1, 1, {Sk}): broadcasts over (B, H, S, Sk), "
                                          "no copy")
    assert stages["kernel"].shape == (B, H, S, D)
    assert stages["kernel"].note == "backend 'sdpa': requested explicitly"


# --- a repeated call reuses its checked decision ------------------------------------------------


def test_a_repeated_maskless_call_skips_validation_and_dispatch(monkeypatch):
    import headwise.functional as functional

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=gen) for _ in range(3))
    first = headwise.attention(q, k, v)
    calls = []
    real = functional._prepare
    monkeypatch.setattr(functional, "_prepare", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    torch.testing.assert_close(headwise.attention(q, k, v), first, rtol=0, atol=0)
    assert calls == []  # the same signature: no checks, no dispatch
    # decoding: Sk grows by one per step and still repeats for "auto" without dropout
    for Sk in range(3, 7):
        kk, vv = torch.randn(2, 1, 4, Sk, 8, generator=gen)
        want = headwise.attention(q[:, :, :1], kk, vv, backend="matmul")
        torch.testing.assert_close(headwise.attention(q[:, :, :1], kk, vv), want, atol=1e-6, rtol=1e-6)
    assert len(calls) == 4 + 1  # four explicit matmul signatures, then one "auto" signature for all steps
    # what the checks read is in the signature: a bad call is checked again and still refused
    with pytest.raises(ValueError, match=r"k \(1, 4, 5, 8\) and v \(1, 4, 6, 8\) must agree on \(B, Hkv, Sk\)"):
        headwise.attention(q, torch.randn(1, 4, 5, 8), torch.randn(1, 4, 6, 8))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        headwise.attention(q, k, v, dropout_p=1.5)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float64])
def test_a_repeated_masked_call_reuses_the_decision_for_each_new_mask(monkeypatch, ref, dtype):
    """The mask's values change from call to call: each is the call's own, only the checks
    and the decision (which read its shape, dtype, device and key counts) are reused."""
    import headwise.functional as functional

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 4, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    calls = []
    real = functional._prepare
    monkeypatch.setattr(functional, "_prepare", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    masks = [torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]),
             torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]]),  # the same key counts, other keys
             torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])]  # other key counts
    if dtype == torch.float64:
        masks = [torch.zeros(m.shape, dtype=dtype).masked_fill(m == 0, float("-inf")) for m in masks]
    for mask in masks:
        want, _ = ref(q, k, v, mask.to(dtype))  # (B, H, S, D)
        torch.testing.assert_close(headwise.attention(q, k, v, mask.to(dtype)), want, atol=1e-10, rtol=1e-10)
    # bool and integer masks are read for their key counts: the third mask is a new decision;
    # a float mask is not a key padding mask to the decision: one signature for all three
    assert len(calls) == (1 if dtype == torch.float64 else 2)
    # a mask of another shape is checked again, and refused
    with pytest.raises(ValueError, match=r"attention_mask of shape \(3, 5\) does not fit"):
        headwise.attention(q, k, v, torch.ones(3, 5, dtype=dtype))


def test_a_repeated_call_follows_a_replaced_kernel(monkeypatch):
    from headwise.kernels import registry

    q = torch.randn(1, 2, 3, 4)
    headwise.attention(q, q, q, backend="einsum")
    seen = []
    original = registry.get_kernel("einsum")
    replaced = dataclasses.replace(original, fn=lambda *a, **kw: seen.append(1) or original.fn(*a, **kw))
    monkeypatch.setitem(registry._KERNELS, "einsum", replaced)
    headwise.attention(q, q, q, backend="einsum")
    assert seen == [1]  # the memo holds the old kernel object, so the call went through dispatch again


def _prepared(q, mask, **kwargs):
    import headwise.functional as functional
    from headwise.masks import _canonical

    return functional.prepare(q, q, q, mask, _canonical(mask), **kwargs)


def test_the_sdpa_kernel_skips_its_dead_row_guard_only_where_the_key_counts_say_every_row_lives(monkeypatch):
    """"auto" read the key counts (they are in the signature): none zero and no causal rule
    means every query row has a key, so sdpa is told ``known_live`` and skips its guard. A
    named kernel (counts not read), a causal rule, a zero count, a float mask or a kernel
    taking only ``**kwargs`` are not told."""
    from headwise.kernels import registry, sdpa

    q = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    live = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    dead = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert _prepared(q, live).args.get("known_live") is True
    assert "known_live" not in _prepared(q, live, backend="sdpa").args
    assert "known_live" not in _prepared(q, live, is_causal=True).args
    assert "known_live" not in _prepared(q, dead).args
    floats = torch.zeros(2, 4, dtype=torch.float64).masked_fill(~live, float("-inf"))
    assert "known_live" not in _prepared(q, floats).args
    guarded = []
    real_guard = sdpa.row_is_dead
    monkeypatch.setattr(sdpa, "row_is_dead", lambda m: guarded.append(1) or real_guard(m))
    for mask, guards in ((live, 0), (dead, 1)):
        want = attention(q, q, q, mask, backend="matmul")
        for _ in range(2):  # the first call and the remembered one
            torch.testing.assert_close(attention(q, q, q, mask), want, atol=1e-12, rtol=1e-12)
        assert len(guarded) == 2 * guards
        guarded.clear()
    seen = []

    def forwarding(q, k, v, **kwargs):  # hands **kwargs on: a hint would reach sdpa_attention uninvited
        seen.append(sorted(kwargs))
        return sdpa.sdpa_attention(q, k, v, **{n: kwargs[n] for n in kwargs if n != "known_live"})

    monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(registry.get_kernel("sdpa"), fn=forwarding))
    attention(q, q, q, live)
    attention(q, q, q, live)
    assert seen and all("known_live" not in names for names in seen)


EMPTY_OPTIONS = {
    "causal+lse": dict(is_causal=True, return_lse=True),
    "lse": dict(return_lse=True),
    "weights": dict(need_weights=True),
    "sinks+lse": dict(sinks=torch.tensor([0.5, -1.0, 0.0, 2.0]), return_lse=True),
    "window+weights+lse": dict(window=2, need_weights=True, return_lse=True),
}


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("options", list(EMPTY_OPTIONS))
@pytest.mark.parametrize("sizes", [(B, 0, Sk), (B, S, 0), (0, S, Sk)], ids=["S=0", "Sk=0", "B=0"])
def test_empty_sizes_with_lse_or_weights_give_the_empty_results_of_matmul(backend, options, sizes):
    """No queries, no keys or no batch rows with the lse or the weights asked for: torch's CPU flash kernel
    divides by zero on zero queries (the process died with SIGFPE); every backend returns what the float64
    formula gives: zero rows, lse -inf (the sink's logit where sinks join the softmax), zero weights."""
    batch, q_len, k_len = sizes
    q = torch.randn(batch, H, q_len, D, requires_grad=True)
    k, v = (torch.randn(batch, Hkv, k_len, D, requires_grad=True) for _ in range(2))
    kwargs = EMPTY_OPTIONS[options]
    try:
        choose_backend(q, k, v, backend=backend, **{n: a for n, a in kwargs.items() if n != "return_lse"})
    except ValueError as refusal:
        assert backend != "auto" and f"backend {backend!r}" in str(refusal), refusal
        return
    got = attention(q, k, v, backend=backend, **kwargs)
    want = attention(q.double(), k.double(), v.double(), backend="matmul",
                     **{n: a.double() if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w)
    if kwargs.get("sinks") is not None and q_len and batch:
        assert torch.equal(got[-1], kwargs["sinks"].reshape(1, H, 1).expand(batch, H, q_len))
    got[0].sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


TRANSFORM_OPTIONS = {"plain": {}, "causal": dict(is_causal=True), "padding": "mask", "lse": dict(return_lse=True)}


def _transform_call(backend, options):
    """(f, q, kwargs): ``f(q)`` is the call's output (the first result where there are several)."""
    q, k, v = (t.double() for t in qkv(q_len=Sk))
    kwargs = dict(TRANSFORM_OPTIONS[options]) if options != "padding" else {}
    if options == "padding":
        kwargs["attention_mask"] = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)

    def f(x):
        result = attention(x, k, v, backend=backend, **kwargs)
        return result[0] if isinstance(result, tuple) else result

    def reference(x):  # the float64 formula, independent of the kernels
        mask = kwargs.get("attention_mask")
        return reference_attention(x, k, v, None if mask is None else mask[:, None, None, :],
                                   is_causal=kwargs.get("is_causal", False))[0]

    return f, reference, q


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("options", list(TRANSFORM_OPTIONS))
def test_torch_func_transforms_and_forward_ad_are_exact_or_refused_by_name(backend, options):
    """Forward AD (a dual level, torch.func.jvp), torch.func.grad and torch.func.vmap over attention: "auto"
    serves every one exactly (it passed SDPA, whose CPU kernel has no forward derivative, and an
    autograd.Function that functorch cannot run); a named backend that cannot is refused with the reason."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, jvp, vmap

    f, reference, q = _transform_call(backend, options)
    tangent = torch.randn_like(q)
    _, want_tangent = jvp(reference, (q,), (tangent,))
    want_grad = grad(lambda x: reference(x).square().sum())(q)
    want_vmap = torch.stack([reference(q * s) for s in (1.0, 0.5, -2.0)])
    named = backend != "auto"
    for transform in ("dual level", "jvp", "grad", "vmap"):
        try:
            if transform == "dual level":
                with fwAD.dual_level():
                    got = fwAD.unpack_dual(f(fwAD.make_dual(q, tangent))).tangent
                want = want_tangent
            elif transform == "jvp":
                got, want = jvp(f, (q,), (tangent,))[1], want_tangent
            elif transform == "grad":
                got, want = grad(lambda x: f(x).square().sum())(q), want_grad
            else:
                got, want = vmap(f)(torch.stack([q * s for s in (1.0, 0.5, -2.0)])), want_vmap
        except ValueError as refusal:
            assert named and f"backend {backend!r}" in str(refusal), (transform, refusal)
            assert re.search("forward-mode derivative|torch.func transform|autograd.Function that torch.func",
                             str(refusal)), refusal
            continue
        assert got is not None, transform
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=lambda m, t=transform: f"{t}: {m}")

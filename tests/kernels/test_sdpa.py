"""The sdpa kernel (and varlen, which shares its calls) on q, k, v of any strides, with and
without the log-sum-exp, against a float64 reference: outputs, lse and dq, dk, dv.

torch's private ``_scaled_dot_product_flash_attention_for_cpu``, which gives the lse, reads
an operand whose last dimension has stride != 1 wrongly (vLLM keeps values as
``(N, Hkv, D, P).transpose(-1, -2)``); the public ``F.scaled_dot_product_attention`` does not.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import pytest
import torch

import headwise

B, H, S, Sk, D = 2, 4, 5, 7, 8


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A differentiable function of ``t`` (B, H|Hkv, S|Sk, D) with the strides of ``kind``."""
    if kind == "contiguous":
        return t
    if kind == "(B, S, H, D) memory":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "last dim transposed":  # vLLM's value layout
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "every other element":  # last stride 2
        return torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., ::2]
    if kind == "storage offset":
        return torch.cat([t.new_zeros(3), t.flatten()])[3:].view(t.shape)
    if kind == "expanded heads":  # stride 0 along heads: every head the first's
        return t[:, :1].expand(t.shape)
    if kind == "expanded last dim":  # stride 0 along the head dim
        return t[..., :1].expand(t.shape)
    raise AssertionError(kind)


LAYOUTS = ["contiguous", "(B, S, H, D) memory", "last dim transposed", "every other element", "storage offset",
           "expanded heads", "expanded last dim"]


def _reference(q, k, v, allowed):
    """softmax(q k^T / sqrt(D)) v and its lse in float64 where ``allowed`` (B, H, S, Sk);
    a row with nothing to attend: zeros and -inf."""
    q, k, v = (t.double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)  # (B, H, Sk, D|Dv)
    s = (q @ k.transpose(-2, -1) / D ** 0.5).masked_fill(~allowed, float("-inf"))  # (B, H, S, Sk)
    live = allowed.any(-1, keepdim=True)  # (B, H, S, 1)
    p = torch.softmax(s.masked_fill(~live, 0.0), -1) * live
    return p @ v, torch.logsumexp(s, -1)  # (B, H, S, Dv), (B, H, S)


def _masks():
    """(attention_mask, is_causal, allowed (B, H, S, Sk)) per case."""
    pad = torch.tensor([[True] * Sk, [True] * 3 + [False] * (Sk - 3)])  # (B, Sk)
    causal = torch.arange(Sk)[None, :] <= torch.arange(S)[:, None] + (Sk - S)  # (S, Sk) bottom-right
    every = torch.ones(B, H, S, Sk, dtype=torch.bool)
    return {"no mask": (None, False, every), "key padding": (pad, False, every & pad[:, None, None, :]),
            "causal": (None, True, every & causal)}


@pytest.mark.parametrize("mask", ["no mask", "key padding", "causal"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("which", ["q", "k", "v", "q, k, v"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("Dv", [D, 6], ids=["Dv=D", "Dv<D"])
@pytest.mark.parametrize("Hkv", [H, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_any_strides_give_the_reference(backend, Hkv, Dv, layout, which, return_lse, mask):
    attention_mask, is_causal, allowed = _masks()[mask]
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(B, heads, n, d, generator=gen, dtype=torch.float64, requires_grad=True)
              for heads, n, d in ((H, S, D), (Hkv, Sk, D), (Hkv, Sk, Dv))]
    q, k, v = (_layout(t, layout) if n in which else t for n, t in zip("qkv", leaves, strict=True))
    result = headwise.attention(q, k, v, attention_mask, is_causal=is_causal, backend=backend, return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    want, want_lse = _reference(q, k, v, allowed)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    loss, want_loss = (out * g).sum(), (want * g).sum()
    if lse is not None:
        torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)
        gl = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
        loss = loss + (lse.masked_fill(torch.isneginf(lse), 0.0) * gl).sum()
        want_loss = want_loss + (want_lse.masked_fill(torch.isneginf(want_lse), 0.0) * gl).sum()
    for got, expected in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(want_loss, leaves), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


# --- the bound call (Kernel.bind): a remembered signature's later calls, branches taken once ---


def _bound_case(Hkv: int, masked: bool, scale: float | None):
    """q, k, v in a transformer's (B, S, H, D) memory, the mask (every row with a key) and the
    kernel's keywords as headwise.functional.prepare makes them."""
    from headwise.rules import Rules

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=gen).transpose(1, 2)  # (B, H, S, D), strided
    k = torch.randn(B, Sk, Hkv, D, generator=gen).transpose(1, 2)  # (B, Hkv, Sk, D)
    v = torch.randn(B, Sk, Hkv, D, generator=gen).transpose(1, 2)
    mask = torch.tensor([[True] * Sk, [True] * 3 + [False] * (Sk - 3)])[:, None, None, :] if masked else None
    args = {"rules": Rules(), "dropout_p": 0.0, "scale": D ** -0.5 if scale is None else scale, "need_weights": False}
    if masked:
        args["known_live"] = True
    return q, k, v, mask, args


@pytest.mark.parametrize("scale", [None, 0.3], ids=["default scale", "scale 0.3"])
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("Hkv", [H, 2], ids=["MHA", "GQA"])
def test_the_bound_call_gives_the_kernels_bits_and_the_reference(Hkv, masked, scale):
    from headwise.kernels.sdpa import KERNEL, sdpa_attention

    q, k, v, mask, args = _bound_case(Hkv, masked, scale)
    bound = KERNEL.bind(KERNEL.fn, args["rules"], args, q, k, masked)
    assert bound is not None
    out = bound(q, k, v, mask)  # (B, H, S, D)
    assert torch.equal(out, sdpa_attention(q, k, v, attention_mask=mask, **args).out)
    allowed = torch.ones(B, H, S, Sk, dtype=torch.bool) if mask is None else mask.expand(B, H, S, Sk)
    s = q.double() @ k.double().repeat_interleave(H // Hkv, 1).transpose(-2, -1) * args["scale"]  # (B, H, S, Sk)
    expected = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.double().repeat_interleave(H // Hkv, 1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_bound_call_keeps_a_nan_querys_row_nan():
    from headwise.kernels.sdpa import KERNEL

    q, k, v, _, args = _bound_case(H, False, None)
    q = q.clone()
    q[1, 2, 3, 0] = float("nan")  # one query row: torch's CPU flash kernel alone returns zeros there
    out = KERNEL.bind(KERNEL.fn, args["rules"], args, q, k, False)(q, k, v, None)
    assert out[1, 2, 3].isnan().all()
    rows = torch.ones(B, H, S, dtype=torch.bool)
    rows[1, 2, 3] = False
    assert out[rows].isfinite().all()


@pytest.mark.parametrize("case", ["causal", "a rule", "weights", "lse", "a mask with a dead row", "another fn"])
def test_the_kernel_binds_nothing_it_would_not_run_the_same(case):
    import dataclasses

    from headwise.kernels.sdpa import KERNEL
    from headwise.rules import Rules

    q, k, v, _, args = _bound_case(H, case == "a mask with a dead row", None)
    fn, masked = KERNEL.fn, False
    if case == "causal":
        args["rules"] = Rules(is_causal=True)
    elif case == "a rule":
        args["rules"] = Rules(window=2, is_causal=True)
    elif case == "weights":
        args["need_weights"] = True
    elif case == "lse":
        args["return_lse"] = True
    elif case == "a mask with a dead row":
        del args["known_live"]  # the mask was not read: a row may have no key
        masked = True
    else:  # a kernel copied with another function keeps its bind, which must not stand in for that function
        fn = dataclasses.replace(KERNEL, fn=lambda *a, **kw: KERNEL.fn(*a, **kw)).fn
    assert KERNEL.bind(fn, args["rules"], args, q, k, masked) is None

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

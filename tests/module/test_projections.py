"""The module's projections and head split (src/headwise/module/projections.py), where the
other test files do not reach: a cross-attention context's padding, read from each kind of
2-D mask, hides what the context holds there.

Each output is compared with a float64 plain-math reference (never with the module itself).

Legend: B batch, H heads, S query length, Sk context length, D head dim, E embed dim.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from conftest import reference_attention

E, H = 16, 2
D = E // H


def reference(mha, x, context, keys):
    """Cross-attention by hand in float64 over the keys ``keys`` (B, Sk) marks True (the
    attention itself: ``conftest.reference_attention``, the mask contract written out)."""
    w = {name: getattr(mha, name) for name in ("q_proj", "k_proj", "v_proj", "out_proj")}
    lin = lambda name, t: t.double() @ w[name].weight.double().T + w[name].bias.double()  # noqa: E731
    B, S, Sk = x.shape[0], x.shape[1], context.shape[1]
    q = lin("q_proj", x).view(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    safe = context.masked_fill(~keys[..., None], 0)  # what a hidden key holds never reaches a result
    k = lin("k_proj", safe).view(B, Sk, H, D).transpose(1, 2)  # (B, H, Sk, D)
    v = lin("v_proj", safe).view(B, Sk, H, D).transpose(1, 2)
    out, _ = reference_attention(q, k, v, keys)  # (B, H, S, D)
    return lin("out_proj", out.transpose(1, 2).reshape(B, S, E))


@pytest.mark.parametrize("kind", ["bool", "integer", "float"])
def test_a_context_s_padding_hides_nan_there_for_every_mask_kind(kind):
    """A 2-D mask of the context's keys: bool/integer False or float -inf mark padding, and a
    NaN or inf the context holds there reaches no output (the float mask's finite values are
    a bias, as in torch's additive masks)."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, context = torch.randn(2, 3, E), torch.randn(2, 5, E)
    keys = torch.tensor([[True] * 5, [True, True, False, False, False]])  # (B, Sk)
    context[1, 2:] = torch.tensor([float("nan"), float("inf"), -float("inf")])[:, None]
    mask = {"bool": keys, "integer": keys.long(),
            "float": torch.zeros(2, 5).masked_fill(~keys, float("-inf"))}[kind]
    with torch.no_grad():
        out = mha(x, mask, context=context)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), reference(mha, x, context, keys), rtol=1e-5, atol=1e-5)

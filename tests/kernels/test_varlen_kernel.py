"""The varlen kernel: dense (B, H, S, D) inputs, padded keys dropped per row."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import policy


def check_float64(ref, q, k, v, mask, window):
    """varlen's output and gradients equal the float64 reference to 1e-10: plain, causal,
    with a ``window`` and with ALiBi."""
    for kwargs in ({}, {"is_causal": True}, {"window": window}, {"alibi_slopes": headwise.masks.alibi_slopes(4)}):
        out = headwise.attention(q, k, v, mask, backend="varlen", **kwargs)
        expected, _ = ref(q, k, v, mask, **kwargs)
        torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.fixture(params=[10_000, 1], ids=["bucketed", "every-row-alone"])
def direct(request, monkeypatch):
    """Run a test with short rows stacked in buckets, and again with every row alone on views."""
    monkeypatch.setattr(policy, "DIRECT_MIN_LENGTH", request.param)
    return request.param


def test_trims_keys_but_keeps_every_query(ref, direct):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 6, 8, generator=gen)
    k, v = torch.randn(2, 4, 2, 10, 8, generator=gen)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, 3:7] = True  # left and right padding
    mask[2, ::3] = True  # holes
    # row 3: nothing to attend
    for kwargs in ({}, {"is_causal": True}, {"window": 3}, {"alibi_slopes": headwise.masks.alibi_slopes(4)}):
        out = headwise.attention(q, k, v, mask, backend="varlen", **kwargs)
        expected, _ = ref(q, k, v, mask, **kwargs)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        assert (out[3] == 0).all()


@pytest.mark.parametrize("lengths", [[10, 10, 9], [10, 6, 3, 1, 0]], ids=["one-bucket", "buckets"])
def test_right_padding_reads_key_prefixes(ref, lengths, direct):
    gen = torch.Generator().manual_seed(1)
    B = len(lengths)
    q = torch.randn(B, 4, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, 10, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = headwise.masks.key_padding_mask(lengths, 10)  # real keys first: no gather
    check_float64(ref, q, k, v, mask, window=3)


@pytest.mark.parametrize("layout", ["3d_bool", "4d_bool", "4d_int_bcast_batch", "float_pad", "float_4d"])
@pytest.mark.parametrize("padding", ["right", "holes"])
def test_every_mask_drops_the_keys_nobody_attends_and_keeps_the_rest(ref, direct, layout, padding):
    """Any mask of the contract: keys no query of any head may attend are dropped; the rest
    of the mask (per query, per head, additive) is applied to the kept keys' columns."""
    gen = torch.Generator().manual_seed(2)
    B, H, S, Sk = 4, 4, 5, 12
    q = torch.randn(B, H, S, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, 2, Sk, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lengths = torch.tensor([12, 7, 3, 0])
    j = torch.arange(Sk)[None, :]
    keys = j < lengths[:, None] if padding == "right" else (j % 3 != 1) & (j < lengths[:, None] + 2)  # (B, Sk)
    if layout == "3d_bool":
        mask = (torch.rand(B, S, Sk, generator=gen) > 0.3) & keys[:, None]
    elif layout == "4d_bool":
        mask = (torch.rand(B, H, S, Sk, generator=gen) > 0.3) & keys[:, None, None]
    elif layout == "4d_int_bcast_batch":  # (1, 1, S, Sk): one pattern for every row, no key padding at all
        mask = (torch.rand(1, 1, S, Sk, generator=gen) > 0.5).int()
    elif layout == "float_pad":  # an additive (B, Sk) bias with -inf at the padding
        mask = torch.randn(B, Sk, generator=gen, dtype=torch.float64).masked_fill(~keys, float("-inf"))
    else:
        mask = torch.randn(B, 1, S, Sk, generator=gen, dtype=torch.float64).masked_fill(~keys[:, None, None],
                                                                                         float("-inf"))
    check_float64(ref, q, k, v, mask, window=4)


def test_dropout_reaches_buckets_that_need_no_mask(ref):
    """Rows of equal length form a bucket with no mask at all; dropout must still apply there."""
    gen = torch.Generator().manual_seed(3)
    q1, k1, v1 = (torch.randn(1, 2, 3, 4, generator=gen) for _ in range(3))
    n = 3000
    q, k, v = (t.expand(n, -1, -1, -1) for t in (q1, k1, v1))
    mask = torch.ones(n, 3, dtype=torch.bool)
    mask[0, 2] = False  # one padded key, so the kernel has key padding to drop
    out = headwise.attention(q, k, v, mask, dropout_p=0.5, backend="varlen")
    assert not torch.allclose(out[1], out[2])  # dropout drew different masks in the unmasked bucket
    expected, _ = ref(q1, k1, v1)
    torch.testing.assert_close(out[1:].double().mean(0, keepdim=True), expected, atol=0.08, rtol=0)


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_documents_with_values_of_vllm_layout_give_the_reference(ref, return_lse):
    """A document rule splits into packed documents; values whose last dim has stride != 1
    ((B, Hkv, Dv, Sk).transpose(-1, -2)) give the float64 reference, lse and gradients too."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 4, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v_t = torch.randn(2, 4, 8, 9, generator=gen, dtype=torch.float64, requires_grad=True)  # (B, Hkv, Dv, Sk)
    v = v_t.transpose(-1, -2)  # (B, Hkv, Sk, Dv), last stride Sk
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2])
    rule = headwise.masks.and_masks(headwise.masks.causal, headwise.masks.document(ids))
    result = headwise.attention(q, k, v, backend="varlen", mask_mod=rule, return_lse=return_lse)
    out, lse = result if return_lse else (result, None)
    allowed = rule(None, None, torch.arange(9)[:, None], torch.arange(9)[None, :])  # (S, Sk)
    want, _ = ref(q, k, v, allowed[None, None])
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    loss, want_loss = out.sum(), want.sum()
    if lse is not None:
        scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))  # (B, H, S, Sk)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-10, rtol=1e-10)
        loss, want_loss = loss + lse.sum(), want_loss + torch.logsumexp(scores, -1).sum()
    for got, expected in zip(torch.autograd.grad(loss, (q, k, v_t)), torch.autograd.grad(want_loss, (q, k, v_t)),
                             strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("rule", [{}, {"window": 3}, {"alibi": True}, {"sinks": True}, {"dropout_p": 0.3}],
                         ids=["causal", "window", "alibi", "sinks", "dropout"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
def test_documents_run_the_packed_path_bit_for_bit(rule, return_lse, direct):
    """The kernel attends a document rule's documents in the packed path's length buckets
    (headwise.kernels.buckets) with no call back up into headwise.attention: the same bits as
    headwise.packing.attend_packed per row with the same rule, dropout's draws included."""
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, S, D = 2, 4, 2, 30, 8
    q = torch.randn(B, H, S, D, generator=gen)
    k, v = torch.randn(2, B, Hkv, S, D, generator=gen)
    lengths = (6, 5, 12, 1, 6)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask_mod = headwise.masks.and_masks(headwise.masks.causal, headwise.masks.document(ids))
    sinks = torch.randn(H, generator=gen) if rule.get("sinks") else None
    slopes = headwise.masks.alibi_slopes(H) if rule.get("alibi") else None
    window, dropout_p = rule.get("window"), rule.get("dropout_p", 0.0)
    torch.manual_seed(11)
    got = headwise.attention(q, k, v, backend="varlen", mask_mod=mask_mod, window=window, alibi_slopes=slopes,
                             sinks=sinks, dropout_p=dropout_p, return_lse=return_lse)
    torch.manual_seed(11)
    backend = "chunked" if return_lse and dropout_p else "sdpa"
    rows = [headwise.packing.attend_packed(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1), lengths,
                                           lengths, is_causal=True, window=window, alibi_slopes=slopes, sinks=sinks,
                                           dropout_p=dropout_p, scale=D ** -0.5, backend=backend,
                                           return_lse=return_lse) for b in range(B)]
    if return_lse:
        assert torch.equal(got[0], torch.stack([out.transpose(0, 1) for out, _ in rows]))  # (B, H, S, D)
        assert torch.equal(got[-1], torch.stack([lse.transpose(0, 1) for _, lse in rows]))  # (B, H, S)
    else:
        assert torch.equal(got, torch.stack([out.transpose(0, 1) for out in rows]))  # (B, H, S, D)

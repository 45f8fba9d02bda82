"""headwise.testing: the float64 oracle from its definitions, and check_kernel on every kernel.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length, D head dim.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import headwise.testing as hwt
from headwise.kernels import kernels
from headwise.masks import masked_scores, safe_softmax
from headwise.testing import check_kernel, reference_attention


def _qkv(B=2, H=2, Hkv=2, S=3, Sk=4, D=4, Dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64),
            torch.randn(B, Hkv, Sk, D, generator=gen, dtype=torch.float64),
            torch.randn(B, Hkv, Sk, Dv or D, generator=gen, dtype=torch.float64))


def _by_hand(q, k, v, allowed, bias=0.0, scale=None):
    """softmax over allowed keys, written one row at a time with Python floats."""
    B, H, S, D = q.shape
    Sk = k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    bias = torch.as_tensor(bias, dtype=torch.float64).expand(B, H, S, Sk)
    out = torch.zeros(B, H, S, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(S):
                s = [float(q[b, h, i] @ k[b, h, j]) * scale + float(bias[b, h, i, j])
                     if allowed[b, h, i, j] else -math.inf for j in range(Sk)]
                top = max(s)
                if top == -math.inf:
                    continue
                e = [math.exp(x - top) for x in s]
                out[b, h, i] = sum(w / sum(e) * v[b, h, j] for j, w in enumerate(e))
    return out


def test_reference_follows_the_mask_contract_by_hand():
    q, k, v = _qkv(S=3, Sk=5)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]])  # int: nonzero attends; row 1 attends nothing
    ref = reference_attention(q, k, v, mask, is_causal=True)
    i = torch.arange(3)[:, None] + 2  # bottom-right: query i at key position i + Sk - S
    allowed = (mask[:, None, None, :] != 0) & (torch.arange(5)[None, :] <= i)  # (B, 1, S, Sk)
    torch.testing.assert_close(ref.out, _by_hand(q, k, v, allowed.expand(2, 2, 3, 5)), rtol=0, atol=1e-12)
    assert ref.lse[1].eq(-math.inf).all() and ref.out[1].eq(0).all()
    assert torch.isfinite(ref.lse[0]).all()


def test_reference_window_sinks_alibi_softcap_in_their_order():
    q, k, v = _qkv(H=2, S=4, Sk=6)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    sinks = torch.tensor([0.3, -1.0], dtype=torch.float64)
    ref = reference_attention(q, k, v, window=2, sink_tokens=1, alibi_slopes=slopes, softcap=0.7, sinks=sinks)
    i = torch.arange(4)[:, None] + 2
    j = torch.arange(6)[None, :]
    allowed = (j <= i) & ((j > i - 2) | (j < 1))
    s = 0.7 * torch.tanh(q @ k.transpose(-2, -1) / 2 / 0.7) - slopes[:, None, None] * (i - j).abs()
    s = torch.cat([s.masked_fill(~allowed, -math.inf), sinks[:, None, None].expand(2, 2, 4, 1)], -1)
    p = torch.softmax(s, -1)[..., :6]
    torch.testing.assert_close(ref.out, p @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(ref.weights, p, rtol=0, atol=1e-12)
    torch.testing.assert_close(ref.lse, torch.logsumexp(s, -1), rtol=0, atol=1e-12)


def test_reference_rules_pair_by_pair_equal_their_broadcast_and_a_chained_index(monkeypatch):
    q, k, v = _qkv(S=4, Sk=5)
    table = torch.randn(2, 4, dtype=torch.float64)

    def chained(score, b, h, q_idx, kv_idx):  # Flex's scalar indexing: only defined pair by pair
        return score + table[b][q_idx] * (kv_idx % 2)

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx != q_idx) | (h == 0)

    pairwise = reference_attention(q, k, v, mask_mod=mask, score_mod=chained)
    bias = table[:, None, :, None] * (torch.arange(5) % 2)  # (B, 1, S, Sk)
    allowed = mask(*hwt._indices(2, 2, 4, 5)).expand(2, 2, 4, 5)
    torch.testing.assert_close(pairwise.out, _by_hand(q, k, v, allowed, bias), rtol=0, atol=1e-12)
    monkeypatch.setattr(hwt, "PAIRWISE_LIMIT", 0)  # the broadcast evaluation of a broadcasting rule
    broadcast = reference_attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(broadcast.out, reference_attention(q, k, v, mask_mod=mask).out)
    torch.testing.assert_close(broadcast.out, _by_hand(q, k, v, allowed), rtol=0, atol=1e-12)


def test_reference_refuses_a_mask_mod_that_returns_no_bool():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="must return one bool per pair, got NoneType"):
        reference_attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: None)


def test_reference_reads_a_block_mask_by_its_blocks_and_its_mask_mod():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = _qkv(B=1, H=1, Hkv=1, S=6, Sk=6)

    def even(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    made = flex.create_block_mask(even, 1, 1, 6, 6, device="cpu", BLOCK_SIZE=2)
    torch.testing.assert_close(reference_attention(q, k, v, made).out, reference_attention(q, k, v, mask_mod=even).out)
    # blocks alone (no mask_mod): query blocks 0 and 1 attend key blocks 0 and 1, query block 2 key blocks 0 and 2
    num = torch.tensor([[[2, 2, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1, 2], [1, 0, 2], [2, 0, 1]]]], dtype=torch.int32)  # (B, H, nq, nk)
    blocks = flex.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=2, seq_lengths=(6, 6))
    allowed = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    allowed = allowed.repeat_interleave(2, 0).repeat_interleave(2, 1)  # blocks of 2 x 2
    torch.testing.assert_close(reference_attention(q, k, v, blocks).out,
                               _by_hand(q, k, v, allowed.expand(1, 1, 6, 6)), rtol=0, atol=1e-12)


def test_reference_gradients_are_zero_at_what_no_query_attends():
    q, k, v = (t.requires_grad_() for t in _qkv(S=2, Sk=3))
    mask = torch.tensor([[True, True, False], [False, False, False]])
    sinks = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    reference_attention(q, k, v, mask, sinks=sinks).out.sum().backward()
    assert k.grad[0, :, 2].eq(0).all() and v.grad[0, :, 2].eq(0).all() and q.grad[1].eq(0).all()
    assert torch.isfinite(sinks.grad).all()


# ---------------------------------------------------------------- check_kernel

TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def interpreter(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("name", sorted(kernels()))
def test_every_builtin_kernel_meets_the_contract(name, interpreter):
    from headwise.kernels import get_kernel

    if name == "triton" and not TRITON:
        pytest.skip("triton is not installed; pip install 'headwise[triton]'")
    if get_kernel(name).compiles:  # a graph per item: seconds each, so one file runs it (on CPU and GPU)
        pytest.skip(f"{name} compiles per rule and shape: tests/kernels/test_{name}.py runs check_kernel({name!r})")
    if get_kernel(name).invariant:  # padding and causal masks only, by design
        pytest.skip(f"{name} serves padding and causal masks only: tests/kernels/test_{name}.py runs check_kernel")
    device = "cuda" if name == "triton" and torch.cuda.is_available() else "cpu"
    if get_kernel(name).available() is not None:
        pytest.skip(f"{name}: {get_kernel(name).available()}")
    report = check_kernel(name, device=device)
    assert report.ok, str(report)
    assert len(report.items) >= 19 and sum(1 for i in report.items if i.passed) >= 12, str(report)


def _naive(q, k, v, *, attention_mask, rules, dropout_p, scale, need_weights, return_lse=False, ignore_mask=False,
           lse_shift=0.0):
    """The documents' masked_fill + softmax: NaN in rows that attend nothing."""
    H = q.shape[1]
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    s = q @ k.transpose(-2, -1) * scale  # (B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)
    s = rules.scored(s, s.shape[2], s.shape[3], (0, s.shape[2]), (0, s.shape[3]))
    if not ignore_mask:
        s = masked_scores(s, attention_mask)
        allowed = rules.allowed(s.shape[0], H, s.shape[2], s.shape[3], (0, s.shape[2]), (0, s.shape[3]), s.device)
        s = masked_scores(s, allowed)
    p = torch.softmax(s, -1)
    out = p @ v  # (B, H, S, Sk) x (B, H, Sk, Dv) -> (B, H, S, Dv)
    return (out, None, torch.logsumexp(s, -1) + lse_shift) if return_lse else (out, None)


def test_a_kernel_with_nan_rows_fails_the_empty_row_and_nan_items():
    report = check_kernel(_naive)
    failed = {i.name for i in report.failures}
    assert not report.ok
    assert {"empty rows: zeros, zero gradients", "NaN and inf at excluded positions",
            "causal, S > Sk (rows with no key)"} <= failed, str(report)
    assert "no mask" not in failed and "FAIL" in str(report)
    assert not any(name.startswith("check_kernel:") for name in kernels())  # registered for the check only


def test_a_kernel_that_ignores_the_mask_fails_every_masked_item():
    def ignores(q, k, v, **kwargs):
        return _naive(q, k, v, **kwargs, ignore_mask=True)

    failed = {i.name for i in check_kernel(ignores).failures}
    assert {"bool mask (B, H, S, Sk)", "key padding (B, Sk)", "float mask (additive, -inf blocks)"} <= failed
    assert "no mask" not in failed and "softcap" not in failed


def test_a_kernel_with_a_wrong_lse_fails_on_the_lse_only():
    def shifted(q, k, v, **kwargs):
        return safe(q, k, v, **kwargs, lse_shift=1.0)

    def safe(q, k, v, *, attention_mask, rules, dropout_p, scale, need_weights, return_lse=False, lse_shift=0.0):
        from headwise.kernels.matmul import matmul_attention

        result = matmul_attention(q, k, v, attention_mask=attention_mask, rules=rules, dropout_p=dropout_p,
                                  scale=scale, need_weights=need_weights, return_lse=return_lse)
        return result._replace(lse=result.lse + lse_shift) if return_lse else result

    report = check_kernel(shifted)
    assert report.failures and all("lse off by" in i.detail and "output" not in i.detail for i in report.failures)
    assert check_kernel(safe).ok


def test_a_kernel_without_lse_is_checked_without_it_and_says_so():
    def no_lse(q, k, v, *, attention_mask, rules, dropout_p, scale, need_weights):
        from headwise.kernels.matmul import matmul_attention

        return matmul_attention(q, k, v, attention_mask=attention_mask, rules=rules, dropout_p=dropout_p,
                                scale=scale, need_weights=need_weights)

    report = check_kernel(no_lse)
    assert report.ok and report.items[-1] == hwt.Item("log-sum-exp", None, "its function takes no return_lse= keyword")


def test_a_kernel_that_serves_only_inference_and_no_lse_is_checked_on_what_it_serves():
    """flex on the CPU refuses gradients and the log-sum-exp but serves the rest: each item is
    checked without them, says so, and the lse is reported refused (not every item refused)."""
    from headwise.kernels.registry import Kernel, get_kernel

    def refuses(r):
        return "no gradients here" if r.requires_grad else "no lse here" if r.return_lse else None

    kernel = Kernel(name="inference_only_demo", fn=get_kernel("matmul").fn, summary="matmul without gradients or lse",
                    refuses=refuses)
    report = check_kernel(kernel)
    served = [i for i in report.items if i.passed]
    assert report.ok and len(served) >= 12, str(report)
    assert all(i.detail.endswith("; inference only (refused with gradients); its log-sum-exp refused")
               for i in served), str(report)
    assert report.items[-1] == hwt.Item("log-sum-exp", None,
                                        "refused for every item here (device, dtype, gradients)")


def test_refusals_are_reported_not_failed():
    report = check_kernel("sdpa")
    refused = {i.name: i.detail for i in report.refused}
    assert "softcap" in refused and "soft" in refused["softcap"]


def test_check_kernel_takes_names_kernels_and_functions_only():
    with pytest.raises(TypeError, match="check_kernel takes a backend name, a Kernel or a kernel function, got int"):
        check_kernel(3)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        check_kernel("nope")


def test_safe_softmax_is_what_the_naive_kernel_lacks():  # the broken kernel differs from the contract only there
    s = torch.full((1, 1, 1, 2), -math.inf)
    assert torch.isnan(torch.softmax(s, -1)).all() and safe_softmax(s).eq(0).all()

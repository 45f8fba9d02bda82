"""backend 'invariant': the float64 reference's answer (forward and gradients), and a row's
bits, forward and input gradients, whatever the batch, padding and query count around it
(torch.equal, never a tolerance)."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import attention, native
from headwise.kernels.invariant import placement

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"the native kernel is not built: {native.unavailable()}")

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
H, HKV, D, DV = 4, 2, 24, 40  # GQA, v with its own head dim, D not a multiple of the kernel's 16 lanes


def _qkv(B, S, Sk, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen).to(dtype)
    k = torch.randn(B, HKV, Sk, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, Sk, DV, generator=gen).to(dtype)
    return q, k, v


def _run(q, k, v, mask=None, causal=False, grad=None):
    """out, and with ``grad`` (the output's gradient) (dq, dk, dv), from backend 'invariant'."""
    q, k, v = (t.detach().requires_grad_(grad is not None) for t in (q, k, v))
    out = attention(q, k, v, mask, is_causal=causal, backend="invariant")
    if grad is None:
        return out, None
    out.backward(grad)
    return out, (q.grad, k.grad, v.grad)


# --- the answer ---------------------------------------------------------------------------

MASKS = ["none", "right", "left", "empty row", "per query"]


def _mask(kind, B, S, Sk):
    j = torch.arange(Sk)
    if kind == "none":
        return None
    if kind == "right":
        return j[None] < torch.tensor([Sk, Sk - 5, 3])[:B, None]  # (B, Sk)
    if kind == "left":
        return j[None] >= torch.tensor([0, 7, Sk - 2])[:B, None]
    if kind == "empty row":
        return j[None] < torch.tensor([Sk, 0, 9])[:B, None]
    # a static cache's mask: the first 50 slots written, query i at position 50 - S + i
    written = j[None, None, None] < 50  # (1, 1, 1, Sk)
    return written & (j <= torch.arange(50 - S, 50)[:, None])  # (1, 1, S, Sk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_float64_reference_forward_and_gradients(dtype, kind, causal):
    B, S, Sk = 3, 37, 70
    q, k, v = _qkv(B, S, Sk, dtype)
    mask = _mask(kind, B, S, Sk)
    grad = torch.randn(B, H, S, DV).to(dtype)
    out, grads = _run(q, k, v, mask, causal, grad)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = attention(q64, k64, v64, mask, is_causal=causal, backend="matmul")
    ref.backward(grad.double())
    scale = max(1.0, ref.abs().max().item())
    assert (out.double() - ref).abs().max().item() <= TOL[dtype] * scale
    for got, want in zip(grads, (q64.grad, k64.grad, v64.grad), strict=True):
        assert (got.double() - want).abs().max().item() <= TOL[dtype] * max(1.0, want.abs().max().item()) * 4


def test_return_lse_and_its_gradient_match_the_reference():
    q, k, v = _qkv(2, 9, 40, torch.float32)
    mask = _mask("right", 2, 9, 40)
    q.requires_grad_()
    out, lse = attention(q, k, v, mask, is_causal=True, backend="invariant", return_lse=True)
    (out.sum() + lse.sum()).backward()
    q64 = q.detach().double().requires_grad_()
    ref, ref_lse = attention(q64, k.double(), v.double(), mask, is_causal=True, backend="matmul", return_lse=True)
    (ref.sum() + ref_lse.sum()).backward()
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    torch.testing.assert_close(q.grad.double(), q64.grad, atol=5e-5, rtol=0)


def test_no_keys_or_no_queries_give_the_contracts_zeros():
    q, k, v = _qkv(2, 5, 0, torch.float32)
    q.requires_grad_()
    out = attention(q, k, v, backend="invariant")
    assert out.shape == (2, H, 5, DV) and not out.any()
    out.sum().backward()
    assert not q.grad.any()
    q, k, v = _qkv(2, 0, 6, torch.float32)
    assert attention(q, k, v, backend="invariant").shape == (2, H, 0, DV)


# --- the bits -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_keeps_its_bits_alone_or_at_any_place_in_any_batch(dtype):
    n, S = 45, 64  # the sequence: 45 tokens; the batch pads to 64
    q, k, v = _qkv(6, S, S, dtype, seed=1)
    grad = torch.randn(6, H, S, DV).to(dtype)
    grad[:, :, n:] = 0  # the loss reads the sequence's own rows only
    alone, (dq, dk, dv) = _run(q[3:4, :, :n], k[3:4, :, :n], v[3:4, :, :n], None, True, grad[3:4, :, :n])
    for B, at in ((2, 0), (6, 3), (4, 1)):
        rows = list(range(B))
        rows[at] = 3
        lens = torch.full((B,), S)
        lens[at] = n
        mask = torch.arange(S)[None] < lens[:, None]  # (B, S): right padding
        out, grads = _run(q[rows], k[rows], v[rows], mask, True, grad[rows])
        assert torch.equal(out[at, :, :n], alone[0]), (B, at)
        assert torch.equal(grads[0][at, :, :n], dq[0])
        assert torch.equal(grads[1][at, :, :n], dk[0]) and torch.equal(grads[2][at, :, :n], dv[0])
        assert not grads[1][at, :, n:].any()  # padded keys: zero gradients


@pytest.mark.parametrize("dtype", DTYPES)
def test_left_padding_gives_the_bits_of_right_padding(dtype):
    n, S = 40, 71
    q, k, v = _qkv(1, n, n, dtype, seed=2)
    grad = torch.randn(1, H, n, DV).to(dtype)
    right, rg = _run(*(torch.nn.functional.pad(t, (0, 0, 0, S - n)) for t in (q, k, v)),
                     torch.arange(S)[None] < n, True, torch.nn.functional.pad(grad, (0, 0, 0, S - n)))
    left, lg = _run(*(torch.nn.functional.pad(t, (0, 0, S - n, 0)) for t in (q, k, v)),
                    torch.arange(S)[None] >= S - n, True, torch.nn.functional.pad(grad, (0, 0, S - n, 0)))
    assert torch.equal(right[..., :n, :], left[..., S - n:, :])
    for r, l_ in zip(rg, lg, strict=True):
        assert torch.equal(r[..., :n, :], l_[..., S - n:, :])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_n_rows_of_a_causal_call_are_a_call_of_n_rows(dtype):
    q, k, v = _qkv(2, 150, 150, dtype, seed=3)
    full, _ = _run(q, k, v, None, True)
    for n in (1, 31, 32, 33, 64, 100):
        part, _ = _run(q[:, :, :n], k[:, :, :n], v[:, :, :n], None, True)
        assert torch.equal(part, full[:, :, :n]), n


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_and_single_steps_give_the_bits_of_one_prefill(dtype):
    L = 90
    q, k, v = _qkv(1, L, L, dtype, seed=4)
    full, _ = _run(q, k, v, None, True)
    steps = []
    for a, b in ((0, 20), (20, 53), *((t, t + 1) for t in range(53, L))):
        steps.append(_run(q[:, :, a:b], k[:, :, :b], v[:, :, :b], None, True)[0])  # bottom-right causal
    assert torch.equal(torch.cat(steps, 2), full)


def test_a_per_query_mask_gives_the_bits_of_its_causal_and_padding_form():
    S, Sk = 12, 64
    q, k, v = _qkv(2, S, Sk, torch.float32, seed=5)
    j = torch.arange(Sk)
    written = j[None] < torch.tensor([50, 30])[:, None]  # (B, Sk)
    last = torch.arange(S)[:, None] + torch.tensor([38, 18])[:, None, None]  # (B, S, 1): query i's last key
    per_query = written[:, None, None, :] & (j <= last)[:, None]  # (B, 1, S, Sk)
    a, _ = _run(q, k, v, per_query, False)
    b_, _ = _run(q[:1], k[:1, :, :50], v[:1, :, :50], None, True)  # row 0: 50 keys, its 12 queries last
    assert torch.equal(a[:1], b_)


# --- what it refuses ----------------------------------------------------------------------


def test_a_hole_in_the_padding_is_refused_with_the_row():
    q, k, v = _qkv(2, 4, 10, torch.float32)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 4] = False
    with pytest.raises(ValueError, match=r"row 1, query 0 may attend 9 keys over positions 0\.\.9"):
        attention(q, k, v, mask, backend="invariant")


def test_what_the_kernel_cannot_apply_is_refused_by_name():
    q, k, v = _qkv(1, 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"backend 'invariant' applies no window, soft-capping"):
        attention(q, k, v, window=2, softcap=30.0, backend="invariant")
    with pytest.raises(ValueError, match="takes fp32 or bf16, not torch.float64"):
        attention(q.double(), k.double(), v.double(), backend="invariant")
    with pytest.raises(ValueError, match="not a float mask"):
        attention(q, k, v, torch.zeros(1, 4), backend="invariant")


def test_placement_reads_right_and_left_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)[:, None, None]
    place = placement(mask, 3, 2, 5, causal=True)
    assert place.lens.tolist() == [3, 3, 0] and place.offset.tolist() == [0, 2, 0]
    assert place.query_pos.tolist() == [3, 1, 3] and place.row_end is None


def test_inside_the_mode_auto_picks_it_and_says_why():
    q, k, v = _qkv(2, 6, 6, torch.float32)
    with headwise.batch_invariant():
        chosen = headwise.choose_backend(q, k, v, is_causal=True)
    assert chosen.backend == "invariant" and "fixed by key positions alone" in chosen.reason
    assert "cannot keep headwise.batch_invariant()'s promise" in chosen.passed_over["sdpa"]
    assert headwise.choose_backend(q, k, v, is_causal=True).backend == "sdpa"  # outside: as fast as before


def test_the_contract_holds_wherever_it_serves_and_it_refuses_only_masks_beyond_runs():
    from headwise.testing import check_kernel

    report = check_kernel("invariant")
    assert not [i for i in report.items if not i.passed and not i.detail.startswith("backend")], str(report)
    served = {i.name for i in report.items if i.passed}
    assert {"no mask", "key padding (B, Sk)"} <= served, str(report)
    for item in report.items:
        if item.name not in served:  # refused: a mask or rule the kernel says it does not apply
            assert "backend 'invariant'" in item.detail, str(report)

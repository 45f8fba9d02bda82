"""Attention in pieces (headwise.pieces and return_lse): each kernel's log-sum-exp against the
float64 formula, forward and backward, and merging partial attentions exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

import headwise
from headwise import masks

BACKENDS = ["matmul", "einsum", "bmm", "einops", "sdpa", "chunked", "varlen", "auto"]
B, H, Hkv, S, Sk, D = 2, 4, 2, 6, 9, 8


def inputs(seed=0, Dv=D + 2, S=S, Sk=Sk):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, Dv, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


def formula_lse(q, k, allowed, sinks=None):
    """log sum_j exp(q k_j / sqrt(D)) over the allowed keys (and the sink), -inf where none: (B, H, S)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    return torch.logsumexp(s, -1)


PAD = torch.tensor([[True] * 7 + [False] * 2, [True] * 9])
CASES = {
    "plain": (dict(), torch.ones(S, Sk, dtype=torch.bool)),
    "causal": (dict(is_causal=True), torch.ones(S, Sk, dtype=torch.bool).tril(Sk - S)),
    "padding": (dict(attention_mask=PAD), PAD[:, None, None, :]),
    "empty-rows": (dict(mask_mod=lambda b, h, i, j: (i % 2 == 1) & (j < 5)),
                   ((torch.arange(S)[:, None] % 2 == 1) & (torch.arange(Sk)[None, :] < 5))),
    "sinks": (dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
              torch.ones(S, Sk, dtype=torch.bool)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_returns_the_log_sum_exp_with_its_gradients(backend, case):
    kwargs, allowed = CASES[case]
    q, k, v = inputs()
    out, lse = headwise.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    want = formula_lse(q, k, allowed, kwargs.get("sinks"))
    assert lse.shape == (B, H, S) and lse.dtype == torch.float64
    torch.testing.assert_close(lse, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, headwise.attention(q, k, v, backend="matmul", **kwargs), atol=1e-10, rtol=1e-10)
    live = torch.isfinite(want)
    if not live.all():
        assert (out[~live] == 0).all()  # a row that attends nothing: zeros, lse -inf
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * g_out).sum() + torch.where(live, lse * g_lse, 0.0).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    ref = (headwise.attention(q, k, v, backend="matmul", **kwargs) * g_out).sum() + torch.where(live, want * g_lse,
                                                                                                 0.0).sum()
    for a, b in zip(got, torch.autograd.grad(ref, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        assert torch.isfinite(a).all()


def test_a_float32_call_returns_a_float32_lse_and_packed_attention_returns_its_rows():
    q, k, v = (t.detach().float() for t in inputs())
    assert headwise.attention(q, k, v, return_lse=True)[1].dtype == torch.float32
    out, weights, lse = headwise.attention(q, k, v, need_weights=True, return_lse=True)
    assert weights.shape == (B, H, S, Sk) and lse.shape == (B, H, S)
    qp, kp, vp = (t[0].transpose(0, 1).double() for t in (q, k, v))  # one sequence: (S, H, D), (Sk, Hkv, D)
    cu_q, cu_k = torch.tensor([0, 2, S]), torch.tensor([0, 4, Sk])
    out, lse = headwise.packed_attention(qp, kp, vp, cu_q, cu_k, is_causal=True, return_lse=True)
    assert out.shape == (S, H, v.shape[-1]) and lse.shape == (S, H)
    first = headwise.attention(qp[None, :2].transpose(1, 2), kp[None, :4].transpose(1, 2), vp[None, :4].transpose(1, 2),
                               is_causal=True, return_lse=True)[1]  # (1, H, 2)
    torch.testing.assert_close(lse[:2], first[0].T, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", ["matmul", "sdpa", "chunked"])
@pytest.mark.parametrize("cuts", [(4,), (2, 3), (0, 9)], ids=["two", "three", "one-empty"])
def test_merging_parts_over_disjoint_keys_is_attention_over_all_of_them(backend, cuts):
    q, k, v = inputs(1)
    bounds = [0, *cuts, Sk] if cuts != (0, 9) else [0, 0, 9]
    rule = masks.causal  # with S < Sk raw positions: late keys are empty for early rows, a part may be all empty
    outs, lses = [], []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        part = lambda b, h, i, j, lo=lo: rule(b, h, i, j + lo)  # noqa: E731 - the part's keys at their positions
        o, s = headwise.attention(q, k[:, :, lo:hi], v[:, :, lo:hi], backend=backend, mask_mod=part, return_lse=True)
        outs.append(o)
        lses.append(s)
    out, lse = headwise.merge_attentions(outs, lses)
    want, want_lse = headwise.attention(q, k, v, backend="matmul", mask_mod=rule, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(out)
    live = torch.isfinite(want_lse)
    got = torch.autograd.grad((out * g).sum() + torch.where(live, lse, 0.0).sum(), (q, k, v))
    ref = torch.autograd.grad((want * g).sum() + torch.where(live, want_lse, 0.0).sum(), (q, k, v))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_row_empty_in_every_part_merges_to_zeros_and_minus_inf_without_nan():
    outs = [torch.zeros(1, 2, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    lses = [torch.full((1, 2, 3), float("-inf"), dtype=torch.float64, requires_grad=True) for _ in range(2)]
    out, lse = headwise.merge_attentions(outs, lses)
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum(), [*outs, *lses])
    assert all(torch.isfinite(g).all() for g in grads)


def test_merge_attentions_refuses_parts_that_do_not_fit():
    o, s = torch.zeros(2, 3, 4), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="needs one lse per output and at least one part, got 2 outputs and 1 lses"):
        headwise.merge_attentions([o, o], [s])
    with pytest.raises(ValueError, match=r"part 1: out \(2, 3, 5\) and lse \(2, 3\) must be"):
        headwise.merge_attentions([o, torch.zeros(2, 3, 5)], [s, s])
    with pytest.raises(TypeError, match="outs and lses must be tensors"):
        headwise.merge_attentions([o], [0.0])


def test_the_ring_merges_with_the_public_function():
    import headwise.distributed.ring as ring
    import headwise.pieces as pieces

    assert ring.merge_into is pieces.merge_into
    assert not hasattr(ring, "merge")  # one home per name: no old name kept before a release


def _triton_skip_reason() -> str | None:
    """Why the triton kernel cannot run here (None: it can, on a GPU or Triton's interpreter)."""
    try:
        import triton
    except ImportError:
        return "triton is not installed; pip install 'headwise[triton]'"
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    if not torch.cuda.is_available() and (major, minor) < (3, 7):
        return f"triton {triton.__version__}'s interpreter cannot run the kernel's loops (fixed in 3.7)"
    return None


@pytest.mark.skipif(_triton_skip_reason() is not None, reason=str(_triton_skip_reason()))
@pytest.mark.parametrize("case", CASES)
def test_triton_returns_the_log_sum_exp_with_its_gradients(monkeypatch, case):
    """The fused kernel in float32 (Triton's interpreter on a CPU, set for this test only)
    against the float64 formula; tests/kernels/test_triton.py covers its tiles and rules."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    kwargs, allowed = CASES[case]
    exact = list(inputs(Dv=D))  # the kernel takes v with q's head dim only
    if "sinks" in kwargs:
        exact.append(kwargs["sinks"].clone().requires_grad_())
    leaves = [t.detach().float().to(device).requires_grad_() for t in exact]

    def keywords(sinks: list) -> dict:
        moved = {name: value.to(device) for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        return {**kwargs, **moved, **({"sinks": sinks[0]} if sinks else {})}

    out, lse = headwise.attention(*leaves[:3], backend="triton", return_lse=True, **keywords(leaves[3:]))
    want_out = headwise.attention(*exact[:3], backend="matmul", **{**kwargs, **({"sinks": exact[3]} if exact[3:]
                                                                                   else {})})
    want = formula_lse(*exact[:2], allowed, exact[3] if exact[3:] else None)
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32
    live = torch.isfinite(want)
    assert torch.equal(torch.isneginf(lse).cpu(), ~live)
    torch.testing.assert_close(torch.where(live, lse.cpu().double(), 0.0), torch.where(live, want, 0.0),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.detach().cpu().double(), want_out, atol=1e-5, rtol=1e-5)
    g_out, g_lse = torch.randn(out.shape, dtype=torch.float64), torch.randn(lse.shape, dtype=torch.float64)
    loss = ((out * g_out.float().to(device)).sum()
            + torch.where(live.to(device), lse * g_lse.float().to(device), 0.0).sum())
    ref = (want_out * g_out).sum() + torch.where(live, want * g_lse, 0.0).sum()
    for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, exact), strict=True):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-5, rtol=1e-5)


def _parts(P=3, shape=(2, 3, 5), Dv=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    outs = [torch.randn(*shape, Dv, generator=gen, dtype=torch.float64) for _ in range(P)]
    lses = [torch.randn(*shape, generator=gen, dtype=torch.float64) * 3 for _ in range(P)]
    return outs, lses


def _merge_formula(outs, lses):
    """The merge in float64 over the parts that carry weight only (lse > -inf), row by row:
    a part whose lse is -inf is left out, whatever its out holds."""
    out = torch.zeros_like(outs[0])
    lse = torch.full_like(lses[0], float("-inf"))
    for idx in itertools.product(*(range(n) for n in lses[0].shape)):
        live = [n for n in range(len(lses)) if not torch.isneginf(lses[n][idx])]
        if not live:
            continue
        row = torch.stack([lses[n][idx] for n in live])
        lse[idx] = torch.logsumexp(row, 0)
        out[idx] = sum(torch.exp(lses[n][idx] - lse[idx]) * outs[n][idx] for n in live)
    return out, lse


def test_merge_attentions_refuses_a_plus_inf_lse_naming_the_part_and_position():
    outs, lses = _parts()
    lses[1][1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match=r"merge_attentions: part 1's lse holds \+inf at 1 position\(s\), the first "
                                         r"at \(1, 2, 3\)"):
        headwise.merge_attentions(outs, lses)
    meta_out, meta_lse = headwise.merge_attentions([o.to("meta") for o in outs], [s.to("meta") for s in lses])
    assert meta_out.shape == outs[0].shape and meta_lse.shape == lses[0].shape  # no values to check on meta


def test_a_nan_lse_propagates_to_its_row_of_out_and_lse():
    outs, lses = _parts()
    lses[2][0, 1, 4] = float("nan")
    out, lse = headwise.merge_attentions(outs, lses)
    assert torch.isnan(lse[0, 1, 4]) and torch.isnan(out[0, 1, 4]).all()
    nan_row = torch.zeros(lse.shape, dtype=torch.bool)
    nan_row[0, 1, 4] = True
    assert not torch.isnan(lse[~nan_row]).any() and not torch.isnan(out[~nan_row]).any()
    want_out, want_lse = _merge_formula(outs, lses)
    torch.testing.assert_close(out[~nan_row], want_out[~nan_row], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[~nan_row], want_lse[~nan_row], atol=1e-12, rtol=1e-12)


def test_a_part_whose_lse_is_minus_inf_contributes_nothing_even_nan_with_exact_gradients():
    outs, lses = _parts()
    lses[0][0, 0, :] = float("-inf")  # part 0 attends nothing in these rows ...
    outs[0][0, 0, :, 0] = float("nan")  # ... and holds NaN and inf there
    outs[0][0, 0, :, 1] = float("inf")
    for n in range(3):  # a row no part attends: zeros, lse -inf
        lses[n][1, 2, 0] = float("-inf")
    leaves = [t.clone().requires_grad_(True) for t in (*outs, *lses)]
    out, lse = headwise.merge_attentions(leaves[:3], leaves[3:])
    want_out, want_lse = _merge_formula(outs, lses)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=1e-12)
    assert (out[1, 2, 0] == 0).all() and torch.isneginf(lse[1, 2, 0])
    gen = torch.Generator().manual_seed(1)
    g_out, g_lse = torch.randn(out.shape, generator=gen, dtype=torch.float64), torch.randn(lse.shape, generator=gen,
                                                                                             dtype=torch.float64)
    live = torch.isfinite(want_lse)
    got = torch.autograd.grad((out * g_out).sum() + torch.where(live, lse * g_lse, 0.0).sum(), leaves)
    ref_leaves = [t.clone().requires_grad_(True) for t in (*outs, *lses)]
    ref_out, ref_lse = _merge_formula(ref_leaves[:3], ref_leaves[3:])
    expected = torch.autograd.grad((ref_out * g_out).sum() + torch.where(live, ref_lse * g_lse, 0.0).sum(), ref_leaves,
                                   allow_unused=True, materialize_grads=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert (got[0][0, 0] == 0).all() and (got[3][0, 0] == 0).all()  # the weightless part: zero gradients


@pytest.mark.parametrize("trailing", [False, True], ids=["lse (S,)", "lse (S, 1)"])
def test_merge_into_takes_nothing_from_a_part_whose_lse_is_minus_inf(trailing):
    """The ring's running merge: a part that attends nothing (lse -inf) may hold NaN or inf in its out (a
    kernel's excluded rows); it adds nothing, on either side of the merge."""
    torch.manual_seed(0)
    out, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    out_b, lse_b = torch.randn(2, 3, 4), torch.randn(2, 3)
    lse_b[0, 1], out_b[0, 1] = float("-inf"), float("nan")  # the new part is empty in one row
    lse[1, 2], out[1, 2] = float("-inf"), float("inf")  # the running part is empty in another
    lse[0, 0] = lse_b[0, 0] = float("-inf")  # both empty: zeros and -inf
    out[0, 0], out_b[0, 0] = float("nan"), float("nan")
    want, want_lse = headwise.merge_attentions([out.double(), out_b.double()], [lse.double(), lse_b.double()])
    if trailing:
        lse, lse_b = lse.unsqueeze(-1), lse_b.unsqueeze(-1)
    headwise.pieces.merge_into(out, lse, out_b, lse_b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.reshape(2, 3).double(), want_lse, atol=1e-6, rtol=1e-6)

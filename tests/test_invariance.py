"""headwise.invariance: the batch-invariant mode's switch and its projections, whose rows
keep their bits whatever the other rows (torch.equal, never a tolerance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headwise import invariance
from headwise.invariance import batch_invariant, is_batch_invariant

E, N = 96, 72
DTYPES = [torch.float32, torch.bfloat16]


def _rows(dtype, M=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, E, generator=gen).to(dtype)
    w = (torch.randn(N, E, generator=gen) / E**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    return x, w, b


def test_the_switch_nests_and_restores():
    assert not is_batch_invariant()
    with batch_invariant():
        assert is_batch_invariant()
        with batch_invariant(False):
            assert not is_batch_invariant()
        assert is_batch_invariant()
    assert not is_batch_invariant()


def test_the_switch_decorates_a_function_and_survives_an_exception():
    @batch_invariant()
    def inside():
        return is_batch_invariant()

    assert inside() and not is_batch_invariant()
    with pytest.raises(RuntimeError, match="boom"), batch_invariant():
        raise RuntimeError("boom")
    assert not is_batch_invariant()


def test_the_switch_takes_a_bool_only():
    with pytest.raises(TypeError, match=r"batch_invariant\(enabled\) takes a bool, got str 'yes'"):
        batch_invariant("yes")


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_f_linear_is_not_invariant_here_or_the_test_would_prove_nothing(dtype):
    """The premise: some M changes a row's bits under F.linear on this machine (fp32 at
    least; bf16 may happen to agree), which the tiled linear must not."""
    x, w, b = _rows(dtype)
    one = F.linear(x[7:8], w, b)[0]
    differs = [M for M in (8, 9, 16, 33, 64, 129, 300) if not torch.equal(F.linear(x[:M], w, b)[7], one)]
    if dtype == torch.float32:
        assert differs, "F.linear kept row 7's bits at every M: the premise of the mode does not hold here"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [1, 8, 16])
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype, tile, monkeypatch):
    monkeypatch.setattr(invariance, "ROW_TILE", tile)
    x, w, b = _rows(dtype)
    alone = invariance.linear(x[7:8], w, b)[0]
    for M, at in ((1, 0), (3, 1), (8, 7), (9, 5), (40, 17), (300, 7), (129, 100)):
        other = torch.randn(M, E).to(dtype)
        other[at] = x[7]
        assert torch.equal(invariance.linear(other, w, b)[at], alone), (M, at)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_input_gradient_does_not_depend_on_the_other_rows(dtype):
    x, w, b = _rows(dtype)
    g = torch.randn(N).to(dtype)

    def grad_of_row(rows, at):
        rows = rows.clone().requires_grad_()
        upstream = torch.randn(rows.shape[0], N).to(dtype)
        upstream[at] = g
        (invariance.linear(rows, w, b) * upstream).sum().backward()
        return rows.grad[at]

    alone = grad_of_row(x[7:8], 0)
    for M, at in ((5, 2), (40, 17), (300, 7)):
        other = torch.randn(M, E).to(dtype)
        other[at] = x[7]
        assert torch.equal(grad_of_row(other, at), alone), (M, at)


def test_the_tiled_linear_is_f_linear_with_its_gradients():
    x, w, b = _rows(torch.float32, M=37)
    args64 = [t.double().requires_grad_() for t in (x, w, b)]
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = F.linear(*args64)
    out = invariance.linear(args[0].reshape(37, 1, E), args[1], args[2])  # any leading dims
    assert out.shape == (37, 1, N)
    torch.testing.assert_close(out.reshape(37, N).double(), ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(37, N, dtype=torch.float64)
    (ref * upstream).sum().backward()
    (out.reshape(37, N) * upstream.float()).sum().backward()
    for a, r in zip(args, args64, strict=True):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-4, rtol=1e-4)
    assert invariance.linear(x, w).shape == (37, N)  # without a bias


def test_an_empty_batch_gives_an_empty_result():
    x, w, b = _rows(torch.float32, M=0)
    assert invariance.linear(x, w, b).shape == (0, N)


def test_the_module_outside_and_then_inside_the_mode_takes_the_modes_path():
    """A signature remembered outside the mode (the fused op, one GEMM over the q, k, v rows)
    is not reused inside it: the memo keys on the mode."""
    import headwise

    mha = headwise.MultiHeadAttention(64, 4).eval()
    x = torch.randn(5, 9, 64)
    with torch.no_grad():
        mha(x)
        mha(x)  # remembered: the fused path
        with batch_invariant():
            assert mha.plan(x).path == "dense"
            assert torch.equal(mha(x)[2], mha(x[2:3])[0])

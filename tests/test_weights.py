"""Attention weights from any backend (headwise.weights): exp(s - lse) for the heads and rows
asked for equals the textbook softmax, forward and backward, on every backend."""

from __future__ import annotations

import re

import pytest
import torch

import headwise
from headwise import masks
from headwise.kernels import registry

BACKENDS = ["matmul", "einsum", "sdpa", "chunked", "varlen", "auto"]
B, H, Hkv, S, Sk, D = 2, 4, 2, 5, 7, 8
PAD = torch.tensor([[True] * 5 + [False] * 2, [True] * 7])
CASES = {
    "plain": dict(),
    "causal-padding": dict(is_causal=True, attention_mask=PAD),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
    "alibi": dict(alibi_slopes=headwise.masks.alibi_slopes(H).double()),
    "softcap": dict(softcap=1.5),
    "score-mod": dict(score_mod=masks.relative_position_bias(torch.randn(8, H, dtype=torch.float64))),
    "empty-rows": dict(mask_mod=lambda b, h, i, j: (i != 2) & (j <= i + 1)),
}
SELECTIONS = {"all": (None, None), "one-head": ([2], None), "rows": (None, slice(1, 4)), "both": (-1, [0, 4])}


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.randn(B, Hkv, Sk, D, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.randn(B, Hkv, Sk, D, generator=gen, dtype=torch.float64, requires_grad=True))


def _picked(w, heads, rows):
    heads = list(range(H))[heads] if isinstance(heads, slice) else ([heads] if isinstance(heads, int) else heads)
    rows = list(range(S))[rows] if isinstance(rows, slice) else ([rows] if isinstance(rows, int) else rows)
    w = w if heads is None else w[:, [h % H for h in heads]]
    return w if rows is None else w[:, :, [r % S for r in rows]]


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_of_any_backend_equal_the_textbook_softmax(backend, case, selection):
    kwargs = dict(CASES[case])
    if backend in ("sdpa", "varlen") and "softcap" in kwargs:
        pytest.skip("SDPA cannot soft-cap (refused by the kernel, tested elsewhere)")
    heads, rows = SELECTIONS[selection]
    q, k, v = inputs()
    mask = kwargs.pop("attention_mask", None)
    out, weights = headwise.attention(q, k, v, mask, backend=backend, need_weights=True, weights_heads=heads,
                                      weights_rows=rows, **kwargs)
    want_out, want = headwise.attention(q, k, v, mask, backend="matmul", need_weights=True, **kwargs)
    want = _picked(want, heads, rows)
    torch.testing.assert_close(weights, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(weights)
    for a, b in zip(torch.autograd.grad((weights * g).sum(), (q, k)), torch.autograd.grad((want * g).sum(), (q, k)),
                    strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_only_the_weights_asked_for_are_computed_and_the_kernel_keeps_none(monkeypatch):
    seen = []
    sdpa = registry.get_kernel("sdpa")

    def spy(q, k, v, **kwargs):
        seen.append((kwargs["need_weights"], kwargs.get("return_lse")))
        return sdpa.fn(q, k, v, **kwargs)

    import dataclasses

    monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(sdpa, fn=spy))
    q, k, v = (t.detach() for t in inputs())
    _, weights = headwise.attention(q, k, v, need_weights=True, weights_heads=1, weights_rows=[3])
    assert weights.shape == (B, 1, 1, Sk) and seen == [(False, True)]
    with headwise.trace() as t:
        headwise.attention(q, k, v, need_weights=True, weights_heads=[0, 1])
    assert any("exp(scores - lse) for the heads and rows asked for, (2, 2, 5, 7)" in s.note for s in t.stages)


def test_the_module_returns_the_weights_asked_for_with_padded_queries_zeroed():
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(16, 4, is_causal=True).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.tensor([[1] * 4 + [0] * 2, [1] * 6])
    _, full = mha(x, mask, need_weights=True)
    out, some = mha(x, mask, need_weights=True, weights_heads=[3, 0], weights_rows=[5, 1])
    torch.testing.assert_close(some, full[:, [3, 0]][:, :, [5, 1]], atol=1e-12, rtol=1e-12)
    assert (some[0, :, 0] == 0).all()  # row 5 of the first sequence is padding
    plain = headwise.MultiHeadAttention(16, 4, is_causal=True, backend="matmul").double()
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(full, plain(x, mask, need_weights=True)[1], atol=1e-12, rtol=1e-12)


def test_the_modules_row_selection_counts_from_the_end_of_x_s_rows():
    """Negative rows and slices resolve against S (x's query rows), not the embed dim."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    _, full = mha(x, need_weights=True)
    for rows, want in (([-1], [5]), (slice(-2, None), [4, 5]), (-6, [0])):
        _, some = mha(x, need_weights=True, weights_rows=rows)
        torch.testing.assert_close(some, full[:, :, want], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=re.escape("weights_rows [6] must name at least one of the 6 query rows "
                                                   "(0..5, or negative from the end); out of range: [6]")):
        mha(x, need_weights=True, weights_rows=[6])


def test_weights_selections_that_cannot_be_served_are_refused():
    q, k, v = (t.detach() for t in inputs())
    with pytest.raises(ValueError, match="weights_heads / weights_rows choose which attention weights to return; "
                                         "pass need_weights=True too"):
        headwise.attention(q, k, v, weights_heads=[0])
    with pytest.raises(ValueError, match=r"weights_heads \[4\] must name at least one of the 4 query heads .* out of "
                                         r"range: \[4\]"):
        headwise.attention(q, k, v, need_weights=True, weights_heads=[4])
    for nothing in ([], slice(3, 3)):
        with pytest.raises(ValueError, match=r"weights_rows \[\] must name at least one of the 5 query rows"):
            headwise.attention(q, k, v, need_weights=True, weights_rows=nothing)
    with pytest.raises(TypeError, match="weights_rows must be an int, a sequence of ints, a slice or an integer"):
        headwise.attention(q, k, v, need_weights=True, weights_rows=[0.5])


@pytest.mark.parametrize("case", CASES)
def test_without_gradients_the_weights_are_computed_in_place_and_equal(case):
    kwargs = dict(CASES[case])
    mask = kwargs.pop("attention_mask", None)
    q, k, v = (t.detach() for t in inputs(3))
    with torch.no_grad():
        _, weights = headwise.attention(q, k, v, mask, need_weights=True, weights_rows=[0, 2, 4], **kwargs)
        _, want = headwise.attention(q, k, v, mask, backend="matmul", need_weights=True, **kwargs)
    torch.testing.assert_close(weights, want[:, :, [0, 2, 4]], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", ["per-key result", "the caller's tensor"])
def test_without_gradients_a_score_mods_own_result_is_never_written_in_place(kind):
    # the in-place weights wrote into the score_mod's result: a result that only broadcasts
    # (expanded, one element per key) raised "more than one element of the written-to tensor
    # refers to a single memory location"; a full-size tensor the caller holds was overwritten
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    held = torch.randn(1, 2, 3, 3, generator=gen, dtype=torch.float64)
    kept = held.clone()
    rules = {"per-key result": lambda s, b, h, i, j: (j * 0.25).to(s.dtype),
             "the caller's tensor": lambda s, b, h, i, j: held}
    scores = (torch.arange(3, dtype=torch.float64) * 0.25).expand(1, 2, 3, 3) if kind == "per-key result" else kept
    want = torch.softmax(scores, -1)
    with torch.no_grad():
        _, weights = headwise.attention(q, k, v, score_mod=rules[kind], need_weights=True, backend="chunked")
    torch.testing.assert_close(weights, want, atol=1e-12, rtol=1e-12)
    assert torch.equal(held, kept)

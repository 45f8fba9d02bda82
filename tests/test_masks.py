"""Tests for ``headwise.masks``: the one mask contract, rule by rule.

Legend: B batch, H query heads, S query length, Sk key length.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise.masks import (
    alibi_bias,
    alibi_slopes,
    causal_mask,
    combined_mask,
    from_torch_masks,
    key_padding_mask,
    masked_scores,
    normalize_mask,
    row_is_dead,
    safe_softmax,
)

B, H, S, Sk = 2, 4, 3, 5
CPU = torch.device("cpu")
NEG_INF = float("-inf")


def norm(mask, dtype=torch.float32, device=CPU):
    """normalize_mask with the file's standard sizes (B, H, S, Sk) = (2, 4, 3, 5)."""
    return normalize_mask(mask, batch=B, heads=H, q_len=S, k_len=Sk, device=device, dtype=dtype)


# --- normalize_mask: layouts -------------------------------------------------------------


def test_none_passes_through():
    assert norm(None) is None


def test_2d_is_key_padding_mask():
    m = torch.rand(B, Sk) > 0.5
    out = norm(m)
    assert out.shape == (B, 1, 1, Sk)
    assert torch.equal(out[:, 0, 0], m)


def test_3d_is_per_query():
    m = torch.rand(B, S, Sk) > 0.5
    out = norm(m)
    assert out.shape == (B, 1, S, Sk)
    assert torch.equal(out[:, 0], m)


def test_4d_keeps_its_shape():
    m = torch.rand(B, H, S, Sk) > 0.5
    out = norm(m)
    assert out.shape == (B, H, S, Sk)
    assert torch.equal(out, m)


@pytest.mark.parametrize(
    "shape, want",
    [
        ((1, Sk), (1, 1, 1, Sk)),
        ((B, 1), (B, 1, 1, 1)),
        ((1, 1, Sk), (1, 1, 1, Sk)),
        ((B, 1, Sk), (B, 1, 1, Sk)),
        ((1, S, Sk), (1, 1, S, Sk)),
        ((1, 1, 1, Sk), (1, 1, 1, Sk)),
        ((1, H, 1, Sk), (1, H, 1, Sk)),
        ((B, 1, S, 1), (B, 1, S, 1)),
        ((1, 1, 1, 1), (1, 1, 1, 1)),
    ],
)
def test_every_dimension_may_be_one(shape, want):
    out = norm(torch.ones(shape, dtype=torch.bool))
    assert out.shape == want
    # the normalised mask must still broadcast against (B, H, S, Sk) scores
    assert torch.broadcast_shapes(out.shape, (B, H, S, Sk)) == (B, H, S, Sk)


def test_bool_mask_is_not_copied():
    m = torch.rand(B, H, S, Sk) > 0.5
    assert norm(m).data_ptr() == m.data_ptr()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_integer_mask_becomes_bool_nonzero_attends(dtype):
    m = torch.tensor([[1, 0, 2, 0, 1], [0, 0, 0, 0, 1]], dtype=dtype)
    out = norm(m)
    assert out.dtype == torch.bool
    assert out[:, 0, 0].tolist() == [[True, False, True, False, True], [False] * 4 + [True]]


def test_negative_integers_attend():
    out = norm(torch.tensor([[-1, 0, 1, 0, -3], [1] * 5]))
    assert out[0, 0, 0].tolist() == [True, False, True, False, True]


@pytest.mark.parametrize("mask_dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_mask_is_cast_to_query_dtype(mask_dtype, query_dtype):
    m = torch.tensor([[0.0, -1.0, NEG_INF, 2.0, 0.5]] * B, dtype=mask_dtype)
    out = norm(m, dtype=query_dtype)
    assert out.dtype == query_dtype
    assert out.shape == (B, 1, 1, Sk)
    assert torch.equal(out[:, 0, 0], m.to(query_dtype))


# --- normalize_mask: errors ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (Sk,), (B, H, S, Sk, 1)])
def test_wrong_number_of_dimensions(shape):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "attention_mask must be 2-D (B, Sk) key padding mask (2, 5), "
            "3-D (B, S, Sk) (2, 3, 5) or 4-D (B, H, S, Sk) (2, 4, 3, 5); "
            f"got {len(shape)}-D with shape {shape}"
        ),
    ):
        norm(torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize(
    "shape, layout",
    [
        ((B, Sk + 1), "2-D layout (B, Sk) key padding mask = (2, 5)"),
        ((B + 1, Sk), "2-D layout (B, Sk) key padding mask = (2, 5)"),
        ((B, S, S), "3-D layout (B, S, Sk) = (2, 3, 5)"),
        ((B, Sk, Sk), "3-D layout (B, S, Sk) = (2, 3, 5)"),
        ((B, 2, S, Sk), "4-D layout (B, H, S, Sk) = (2, 4, 3, 5)"),
        ((B, H, S, Sk + 2), "4-D layout (B, H, S, Sk) = (2, 4, 3, 5)"),
    ],
)
def test_wrong_sizes(shape, layout):
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"attention_mask of shape {shape} does not fit {layout} "
            "(each dimension must match or be 1)"
        ),
    ):
        norm(torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_dtype_is_a_type_error(dtype):
    with pytest.raises(
        TypeError,
        match=rf"attention_mask has dtype {dtype}; use bool/integer \(True = attend\) or a "
        "real floating additive bias",
    ):
        norm(torch.ones(B, Sk, dtype=dtype))


@pytest.mark.parametrize("mask, name", [([[1, 0]], "list"), (1, "int"), ("mask", "str")])
def test_non_tensor_is_a_type_error(mask, name):
    with pytest.raises(
        TypeError,
        match=rf"attention_mask must be a torch.Tensor or None, got {name}; "
        r"wrap it with torch.as_tensor\(...\)",
    ):
        norm(mask)


def test_a_block_mask_where_only_tensors_are_taken_names_its_remedy():
    """headwise.attention takes a FlexAttention BlockMask as the mask; where only tensors are
    taken (the module's attention_mask), the message says how to pass its rule instead."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask = flex.create_block_mask(lambda b, h, q, kv: kv <= q, None, None, 4, 4, device="cpu", BLOCK_SIZE=2)
    with pytest.raises(TypeError, match=r"attention_mask is a FlexAttention BlockMask, which headwise.attention "
                                        r"takes but this call does not; pass its rule as "
                                        r"mask_mod=headwise.rules.from_block_mask\(block_mask, S, Sk\)"):
        norm(block_mask)


def test_wrong_device():
    mask = torch.ones(B, Sk, dtype=torch.bool, device="meta")
    with pytest.raises(
        ValueError,
        match=r"attention_mask is on meta but the queries are on cpu; "
        r"move it with attention_mask.to\('cpu'\)",
    ):
        norm(mask)


# --- causal_mask ------------------------------------------------------------------------


def test_causal_square_is_lower_triangular():
    assert torch.equal(causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())


def test_causal_fewer_queries_than_keys_is_bottom_right():
    # decoding with a cache: the last query sees every key
    assert causal_mask(2, 4).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert causal_mask(1, 5).all()


def test_causal_more_queries_than_keys_has_dead_rows():
    # query i may attend key j iff j <= i + (Sk - S) = i - 2: rows 0 and 1 see nothing
    assert causal_mask(4, 2).int().tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]


@pytest.mark.parametrize("q_len, k_len", [(1, 1), (3, 3), (2, 5), (5, 2), (4, 0), (0, 3)])
def test_causal_rule_elementwise(q_len, k_len):
    m = causal_mask(q_len, k_len)
    assert m.shape == (q_len, k_len) and m.dtype == torch.bool
    for i in range(q_len):
        for j in range(k_len):
            assert bool(m[i, j]) == (j <= i + (k_len - q_len))


def test_causal_mask_device():
    assert causal_mask(2, 3, device=torch.device("meta")).device.type == "meta"


@pytest.mark.parametrize("q_len, k_len", [(6, 6), (2, 7), (7, 3)])
@pytest.mark.parametrize("window, sinks", [(1, 1), (2, 2), (3, 5), (2, 0)])
def test_sink_tokens_keep_the_first_keys_under_the_window(q_len, k_len, window, sinks):
    """StreamingLLM: key j is visible iff it is in the window or one of the first n keys, never after the query."""
    m = causal_mask(q_len, k_len, window=window, sink_tokens=sinks)
    for i in range(q_len):
        p = i + k_len - q_len  # the query's position among the keys
        for j in range(k_len):
            assert bool(m[i, j]) == ((p - window < j <= p) or (j < sinks and j <= p)), (i, j)


def test_sink_tokens_need_a_window_to_mean_anything():
    assert torch.equal(causal_mask(4, 4, sink_tokens=2), causal_mask(4, 4))


def test_combined_mask_carries_the_sink_tokens():
    m = torch.rand(B, 1, 6, 6) > 0.3
    out = combined_mask(m, True, 6, 6, CPU, window=2, sink_tokens=1)
    assert torch.equal(out, m & causal_mask(6, 6, window=2, sink_tokens=1))
    assert out[..., 5, 0].eq(m[..., 5, 0]).all()  # key 0 is a sink: the last query still sees it where m allows


# --- combined_mask and masked_scores ----------------------------------------------------


def test_combined_without_causal_returns_the_mask_unchanged():
    m = torch.rand(B, 1, S, Sk) > 0.5
    assert combined_mask(m, False, S, Sk, CPU) is m
    assert combined_mask(None, False, S, Sk, CPU) is None


def test_combined_causal_only():
    out = combined_mask(None, True, S, Sk, CPU)
    assert out.shape == (1, 1, S, Sk)
    assert torch.equal(out[0, 0], causal_mask(S, Sk))


def test_combined_bool_is_and():
    m = torch.rand(B, 1, S, Sk) > 0.5
    out = combined_mask(m, True, S, Sk, CPU)
    assert out.dtype == torch.bool
    assert torch.equal(out, m & causal_mask(S, Sk))


def test_combined_float_gets_minus_inf_where_causal_blocks():
    m = torch.randn(B, 1, S, Sk)
    out = combined_mask(m, True, S, Sk, CPU)
    c = causal_mask(S, Sk).expand_as(out)
    assert out.dtype == m.dtype
    assert torch.isneginf(out[~c]).all()
    assert torch.equal(out[c], m.expand_as(out)[c])


def test_masked_scores():
    scores = torch.randn(1, 1, S, Sk)
    assert masked_scores(scores, None) is scores
    keep = torch.rand(1, 1, S, Sk) > 0.5
    blocked = masked_scores(scores, keep)
    assert torch.isneginf(blocked[~keep]).all()
    assert torch.equal(blocked[keep], scores[keep])
    bias = torch.randn(1, 1, 1, Sk)
    assert torch.equal(masked_scores(scores, bias), scores + bias)


# --- safe_softmax and row_is_dead -------------------------------------------------------


def test_safe_softmax_matches_softmax_on_live_rows():
    x = torch.randn(2, 3, 7, dtype=torch.float64)
    torch.testing.assert_close(safe_softmax(x), torch.softmax(x, dim=-1))
    torch.testing.assert_close(safe_softmax(x, dim=1), torch.softmax(x, dim=1))


def test_safe_softmax_is_stable_for_large_scores():
    x = torch.tensor([[1e4, 1e4 - 1.0, -1e4]])
    out = safe_softmax(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(x.double(), dim=-1).float())


def test_safe_softmax_dead_rows_are_zero_with_zero_finite_gradients():
    scores = torch.randn(2, 3, 4, requires_grad=True)
    keep = torch.ones(2, 3, 4, dtype=torch.bool)
    keep[0, 1] = False  # a dead row
    keep[1, 2, :3] = False  # a live row with one key
    probs = safe_softmax(masked_scores(scores, keep))
    assert torch.equal(probs[0, 1], torch.zeros(4))
    torch.testing.assert_close(probs[1, 2], torch.tensor([0.0, 0.0, 0.0, 1.0]))
    # plain softmax gives NaN there: the bug this function exists for
    assert torch.isnan(torch.softmax(masked_scores(scores, keep), dim=-1)[0, 1]).all()
    (probs * torch.randn_like(probs)).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.equal(scores.grad[0, 1], torch.zeros(4))
    assert torch.equal(scores.grad[1, 2, :3], torch.zeros(3))


def test_safe_softmax_float_mask_dead_row_gradients():
    scores = torch.randn(3, 4, requires_grad=True)
    bias = torch.zeros(3, 4)
    bias[1] = NEG_INF
    probs = safe_softmax(scores + bias)
    assert torch.equal(probs[1], torch.zeros(4))
    probs.sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.equal(scores.grad[1], torch.zeros(4))


def test_row_is_dead_bool_and_float():
    keep = torch.tensor([[True, False], [False, False], [False, True]])
    assert row_is_dead(keep).tolist() == [[False], [True], [False]]
    bias = torch.tensor([[0.0, NEG_INF], [NEG_INF, NEG_INF], [-1e9, NEG_INF]])
    assert row_is_dead(bias).tolist() == [[False], [True], [False]]


def test_row_is_dead_shape():
    assert row_is_dead(torch.ones(B, H, S, Sk, dtype=torch.bool)).shape == (B, H, S, 1)


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    data=st.data(),
)
def test_property_safe_softmax_rows_sum_to_one_or_zero(rows, cols, data):
    bits = data.draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    keep = torch.tensor(bits, dtype=torch.bool).reshape(rows, cols)
    scores = torch.randn(rows, cols, dtype=torch.float64) * 10
    probs = safe_softmax(masked_scores(scores, keep))
    assert torch.isfinite(probs).all()
    assert (probs[~keep] == 0).all()
    want = keep.any(dim=-1).double()  # 1 for live rows, 0 for dead ones
    torch.testing.assert_close(probs.sum(dim=-1), want)
    assert torch.equal(row_is_dead(keep)[:, 0], ~keep.any(dim=-1))


# --- key_padding_mask ------------------------------------------------------------------


def test_key_padding_mask_from_lengths():
    assert key_padding_mask([2, 1]).tolist() == [[True, True], [True, False]]
    assert key_padding_mask(torch.tensor([0, 3]), max_len=4).tolist() == [
        [False, False, False, False],
        [True, True, True, False],
    ]


def test_key_padding_mask_feeds_normalize_mask():
    m = key_padding_mask([5, 2])
    assert norm(m)[:, 0, 0].sum(dim=-1).tolist() == [5, 2]


def test_key_padding_mask_errors():
    with pytest.raises(ValueError, match=r"lengths must be 1-D \(B,\), got shape \(1, 2\)"):
        key_padding_mask([[1, 2]])
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got \[-1, 2\]"):
        key_padding_mask([-1, 2])
    with pytest.raises(
        ValueError, match=r"max_len \(2\) is shorter than the longest length \(3\)"
    ):
        key_padding_mask([3, 1], max_len=2)


# --- from_torch_masks --------------------------------------------------------------------


def test_from_torch_none():
    assert from_torch_masks() is None


def test_from_torch_bool_key_padding_is_inverted():
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # torch: True = ignore
    assert torch.equal(from_torch_masks(kpm), ~kpm)


def test_from_torch_float_passes_through():
    kpm = torch.tensor([[0.0, NEG_INF, -2.0]])
    assert torch.equal(from_torch_masks(kpm), kpm)
    am = torch.randn(S, Sk)
    out = from_torch_masks(attn_mask=am)
    assert out.shape == (1, 1, S, Sk)
    assert torch.equal(out[0, 0], am)


def test_from_torch_2d_attn_mask():
    am = torch.ones(S, Sk, dtype=torch.bool).triu(1)  # torch: True above the diagonal = ignore
    out = from_torch_masks(attn_mask=am)
    assert out.shape == (1, 1, S, Sk)
    assert torch.equal(out[0, 0], ~am)


def test_from_torch_3d_attn_mask_is_split_by_num_heads():
    am = torch.rand(B * H, S, Sk) > 0.5  # torch's layout: batch-major, (B * H, S, Sk)
    out = from_torch_masks(attn_mask=am, num_heads=H)
    assert out.shape == (B, H, S, Sk)
    for b in range(B):
        for h in range(H):
            assert torch.equal(out[b, h], ~am[b * H + h])


def test_from_torch_combines_bool_masks_with_and():
    kpm = torch.rand(B, Sk) > 0.5
    am = torch.rand(S, Sk) > 0.5
    out = from_torch_masks(kpm, am)
    assert out.dtype == torch.bool and out.shape == (B, 1, S, Sk)
    want = ~kpm[:, None, None, :] & ~am[None, None]
    assert torch.equal(out, want)


def test_from_torch_combines_bool_and_float_as_bias():
    kpm = torch.tensor([[False, True, False, False, False], [False] * 5])
    am = torch.randn(S, Sk, dtype=torch.float64)
    out = from_torch_masks(kpm, am)
    assert out.dtype == torch.float64 and out.shape == (B, 1, S, Sk)
    assert torch.isneginf(out[0, 0, :, 1]).all()
    torch.testing.assert_close(out[1, 0], am)
    # and the other way round: a float key padding mask with a bool attn_mask
    out = from_torch_masks(torch.zeros(B, Sk, dtype=torch.float16), torch.eye(S, Sk).bool())
    assert out.dtype == torch.float16
    assert torch.isneginf(out[:, 0].diagonal(dim1=-2, dim2=-1)).all()
    assert (out[:, 0][~torch.eye(S, Sk).bool().expand(B, S, Sk)] == 0).all()


def test_from_torch_errors():
    with pytest.raises(
        TypeError,
        match=r"torch.nn.MultiheadAttention masks are bool or float, got torch.int64; "
        r"convert with .bool\(\) \(True = ignore\)",
    ):
        from_torch_masks(torch.zeros(B, Sk, dtype=torch.int64))
    with pytest.raises(
        ValueError,
        match=r"a 3-D attn_mask \(8, 3, 5\) is \(B \* num_heads, S, Sk\); "
        "pass num_heads= to split it",
    ):
        from_torch_masks(attn_mask=torch.zeros(B * H, S, Sk, dtype=torch.bool))
    with pytest.raises(
        ValueError,
        match=r"attn_mask's first dimension \(8\) is not a multiple of num_heads \(3\)",
    ):
        from_torch_masks(attn_mask=torch.zeros(B * H, S, Sk, dtype=torch.bool), num_heads=3)
    with pytest.raises(
        ValueError,
        match=r"attn_mask must be \(S, Sk\) or \(B \* num_heads, S, Sk\), "
        r"got shape \(2, 4, 3, 5\)",
    ):
        from_torch_masks(attn_mask=torch.zeros(B, H, S, Sk, dtype=torch.bool), num_heads=H)
    with pytest.raises(ValueError, match=r"got shape \(5,\)"):
        from_torch_masks(attn_mask=torch.zeros(Sk, dtype=torch.bool))


def test_slopes_are_float32_whatever_the_default_dtype():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert alibi_slopes(8).dtype == torch.float32
    finally:
        torch.set_default_dtype(before)


def test_alibi_bias_is_made_where_the_slopes_are():
    bias = alibi_bias(torch.ones(2, device="meta"), 3, 5)
    assert (bias.device.type, bias.shape) == ("meta", (1, 2, 3, 5))


def test_no_lengths_give_an_empty_padding_mask():
    assert key_padding_mask([]).shape == (0, 0)


def test_torch_masks_combine_in_the_float_masks_dtype_and_device():
    attn = torch.zeros(3, 4, dtype=torch.float16)  # (S, Sk) additive
    pad = torch.tensor([[False, False, True, False]])  # torch's True = ignore
    out = from_torch_masks(pad, attn)
    assert out.dtype == torch.float16 and torch.isneginf(out[0, 0, :, 2]).all()
    assert from_torch_masks(torch.zeros(1, 4, dtype=torch.float64), torch.zeros(3, 4)).dtype == torch.float32
    meta = from_torch_masks(pad.to("meta"), attn.to("meta"))
    assert (meta.device.type, meta.dtype, meta.shape) == ("meta", torch.float16, (1, 1, 3, 4))

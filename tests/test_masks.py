"""Tests for ``headwise.masks``: the one mask contract, rule by rule.

Legend: B batch, H query heads, S query length, Sk key length.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import masks
from headwise.evaluate import evaluated_tile_states, grid, mask_tile_states
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
from headwise.rules import Shifted
from headwise.tiles import PARTIAL, Bounds

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


# --- rules as functions: each helper equals its formula, and the tiles it claims empty or full
# are exactly that when every pair is evaluated ---------------------------------------------


def on_grid(mod, S, Sk):
    b, h, q, kv = grid(B, H, (0, S), (0, Sk), None)
    return mod(b, h, q, kv).expand(B, H, S, Sk)


def test_each_helper_equals_its_formula():
    S, Sk = 7, 9
    i = torch.arange(S)[:, None]
    j = torch.arange(Sk)[None, :]
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 3], [0, 1, 1, 1, 1, 1, 1, 2, 2]])
    prefix = torch.tensor([2, 5])
    cases = [
        (masks.causal, (j <= i).expand(B, H, S, Sk)),
        (masks.sliding_window(3), ((j <= i) & (j > i - 3)).expand(B, H, S, Sk)),
        (masks.document(ids[0]), (ids[0][:S, None] == ids[0][None, :Sk]).expand(B, H, S, Sk)),
        (masks.document(ids), (ids[:, :S, None] == ids[:, None, :Sk])[:, None].expand(B, H, S, Sk)),
        (masks.prefix_lm(3), ((j < 3) | (j <= i)).expand(B, H, S, Sk)),
        (masks.prefix_lm(prefix), ((j < prefix[:, None, None]) | (j <= i))[:, None].expand(B, H, S, Sk)),
        (masks.and_masks(masks.causal, masks.document(ids)),
         ((j <= i) & (ids[:, :S, None] == ids[:, None, :Sk]))[:, None].expand(B, H, S, Sk)),
        (masks.or_masks(masks.sliding_window(2), masks.prefix_lm(1)), (((j <= i) & (j > i - 2)) | (j < 1) | (j <= i))
         .expand(B, H, S, Sk)),
        (masks.causal & masks.prefix_lm(4), ((j <= i) & ((j < 4) | (j <= i))).expand(B, H, S, Sk)),
        (masks.causal | masks.sliding_window(2), (j <= i).expand(B, H, S, Sk)),
        (masks.AlignedCausal(Sk - S, 2, 1), ((j <= i + 2) & ((j > i + 2 - 2) | (j < 1))).expand(B, H, S, Sk)),
        (Shifted(masks.causal, 2), (j <= i + 2).expand(B, H, S, Sk)),
    ]
    for mod, want in cases:
        assert torch.equal(on_grid(mod, S, Sk), want), repr(mod)


def _plain(mod):
    """The same rule as a plain function, so tile states come from evaluating every pair."""
    return lambda b, h, q, kv: mod(b, h, q, kv)


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 40), extra=st.integers(0, 12), bq=st.integers(1, 9), bk=st.integers(1, 9),
       window=st.integers(1, 6), sinks=st.integers(0, 3), prefix=st.integers(0, 20), seed=st.integers(0, 99))
def test_tiles_a_helper_calls_empty_or_full_are_so_pair_by_pair(S, extra, bq, bk, window, sinks, prefix, seed):
    Sk = S + extra
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, 4, (B, Sk), generator=gen), dim=1).values
    shuffled = torch.randint(0, 3, (Sk,), generator=gen)  # ids that come back: not contiguous documents
    helpers = [masks.causal, masks.sliding_window(window), masks.AlignedCausal(extra, window, sinks),
               masks.document(ids), masks.document(shuffled), masks.prefix_lm(prefix),
               masks.prefix_lm(torch.tensor([prefix, 2])), masks.and_masks(masks.causal, masks.document(ids)),
               masks.or_masks(masks.sliding_window(window), masks.prefix_lm(prefix)),
               masks.and_masks(masks.prefix_lm(prefix), _plain(masks.sliding_window(window)))]
    exact = helpers[:2] + helpers[3:4] + helpers[5:7]  # no sink tokens, no ids that come back, no combination
    bounds = Bounds(S, Sk, bq, bk)
    for mod in helpers:
        claimed, exact_states = torch.broadcast_tensors(mask_tile_states(mod, bounds, B, H),
                                                        evaluated_tile_states(_plain(mod), bounds, B, H))
        wrong = (claimed != PARTIAL) & (claimed != exact_states)
        assert not bool(wrong.any()), repr(mod)
        if mod in exact:  # these helpers are exact, not only safe
            assert torch.equal(claimed, exact_states), repr(mod)


def test_document_segments_are_the_runs_of_contiguous_ids():
    assert masks.document(torch.tensor([0, 0, 1, 1, 1, 5])).segments(6, 6) == [[2, 3, 1]]
    assert masks.document(torch.tensor([[0, 0, 1], [0, 1, 2]])).segments(3, 3) == [[2, 1], [1, 1, 1]]
    assert masks.document(torch.tensor([0, 1, 0])).segments(3, 3) is None  # document 0 comes back
    assert masks.document(torch.tensor([0, 0, 1])).segments(2, 3) is None  # S != Sk


def test_t5_buckets_equal_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 300)[None, :]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 16)):
            want = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets,
                                                            max_distance=distance)
            assert torch.equal(masks.t5_bucket(rel, buckets, distance, bidirectional), want)


def test_relative_position_bias_reads_its_table_at_the_bucket_and_head():
    table = torch.randn(8, H, dtype=torch.float64)
    rule = masks.relative_position_bias(table, max_distance=16)
    b, h, q, kv = grid(1, H, (0, 5), (0, 6), None)
    bias = rule.bias(b, h, q, kv)  # (1, H, 5, 6)
    bucket = masks.t5_bucket(kv - q, 8, 16, True)[0, 0]  # (5, 6)
    assert torch.equal(bias[0], table[bucket].permute(2, 0, 1))
    score = torch.randn(1, H, 5, 6, dtype=torch.float64)
    assert torch.equal(rule(score, b, h, q, kv), score + bias)
    embedding = torch.nn.Embedding(8, H)
    assert masks.relative_position_bias(embedding).weight is embedding.weight  # T5's module: its parameter


def test_helpers_refuse_what_cannot_be_a_rule():
    with pytest.raises(ValueError, match="sliding_window needs an int window >= 1, got 0"):
        masks.sliding_window(0)
    with pytest.raises(ValueError, match=r"doc_ids must be an integer tensor \(S,\) or \(B, S\), got torch.float32"):
        masks.document(torch.zeros(4))
    with pytest.raises(ValueError, match="prefix_lengths must be an int or an integer tensor"):
        masks.prefix_lm(torch.zeros(2))
    with pytest.raises(ValueError, match="and_masks needs at least one mask_mod"):
        masks.and_masks()
    with pytest.raises(TypeError, match="or_masks takes mask_mod functions"):
        masks.or_masks(masks.causal, 3)
    with pytest.raises(ValueError, match=r"relative_position_bias needs a float \(num_buckets, H\) table"):
        masks.relative_position_bias(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"doc_ids \(1, 4\) must cover B = 1 rows \(or 1\) and max\(S, Sk\) = 6"):
        masks.document(torch.zeros(4, dtype=torch.long)).check(6, 6, 1)


@pytest.mark.parametrize("lengths", [-3, torch.tensor([2, -1]), [4, -2]], ids=["int", "tensor", "list"])
def test_prefix_lm_refuses_a_negative_prefix_length(lengths):
    with pytest.raises(ValueError, match=r"prefix_lm's prefix_lengths must be >= 0, got -\d at row \d"):
        masks.prefix_lm(lengths)
    assert masks.prefix_lm(0)(0, 0, torch.tensor(1), torch.tensor(2)).item() is False  # 0: causal, still accepted


def test_the_public_helpers_are_masks_own_code():
    """headwise.masks holds its own code: no public name is re-exported from another module."""
    elsewhere = {name: getattr(masks, name).__module__ for name in masks.__all__
                 if getattr(getattr(masks, name), "__module__", "headwise.masks") != "headwise.masks"}
    assert elsewhere == {}

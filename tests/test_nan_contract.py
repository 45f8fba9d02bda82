"""The NaN and inf contract, on every backend, forward and backward.

* What the mask excludes for every query never influences a result, even when it is NaN
  or inf: keys and values no query may attend, and queries that may attend nothing (their
  rows output zeros and get zero gradients). Checked against the same call with zeros
  there: outputs and dq, dk, dv (and the sinks' gradient) must be equal.
* NaN in a live input gives NaN in the rows that attend it, never zeros.
* ``+inf`` in a float mask or in ``sinks`` is a ValueError where values can be read.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from conftest import contract_backends
from headwise import attention, packed_attention
from headwise.kernels.triton import support

NAN, INF = float("nan"), float("inf")
BACKENDS = contract_backends() + ["auto"]
TEXTBOOK = ["matmul", "einsum", "einops", "bmm"]
B, H, Hkv, S, Sk, D = 2, 4, 2, 5, 6, 8


def _inputs(s=S, sk=Sk, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, s, D, generator=gen, dtype=dtype)
    k = torch.randn(B, Hkv, sk, D, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, sk, D, generator=gen, dtype=dtype)
    return q, k, v


def _run(q, k, v, mask=None, *, sinks=None, **kw):
    """Output and gradients (dq, dk, dv[, dsinks]) of one call, with a fixed upstream gradient."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.clone().requires_grad_())
        kw["sinks"] = leaves[-1]
    out = attention(*leaves[:3], mask, **kw)
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out.detach(), grads


def _assert_same(got, want):
    """Equal results, NaN nowhere (the planted values must not show)."""
    (out, grads), (out0, grads0) = got, want
    for a, b in zip((out, *grads), (out0, *grads0), strict=True):
        assert not a.isnan().any() and not a.isinf().any()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _plant(t: torch.Tensor, where: torch.Tensor, value: float) -> torch.Tensor:
    """``t`` with ``value`` at the rows (..., n, D) that ``where`` (broadcastable to (..., n, 1)) marks."""
    return t.masked_fill(where, value)


@pytest.fixture
def interpreter(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _backends_with_triton():
    names = list(BACKENDS)
    if support._triton_installed():
        names.append("triton")
    return names


# --- excluded keys and values -------------------------------------------------------------


def _key_masks():
    """Masks (as callers pass them) and the (B, Hkv, Sk, 1) keys they exclude for every query."""
    lengths = torch.tensor([4, 6])
    pad = torch.arange(Sk)[None, :] < lengths[:, None]  # (B, Sk): row 0's last two keys are padding
    excluded = (~pad)[:, None, :, None].expand(B, Hkv, Sk, 1)  # (B, Hkv, Sk, 1)
    hole = pad.clone()
    hole[1, 2] = False  # a padded key in the middle of row 1 too
    holed = (~hole)[:, None, :, None].expand(B, Hkv, Sk, 1)
    float_pad = torch.zeros(B, Sk, dtype=torch.float64).masked_fill(~pad, -INF)
    float_pad[:, 0] = 0.5  # a real bias on a live key
    per_head = torch.ones(B, H, S, Sk, dtype=torch.bool)
    per_head[0, :2, :, 1] = False  # kv head 0's two query heads never see key 1 of row 0
    per_head[1, 2:, :, 5] = False  # kv head 1's never see key 5 of row 1
    per_head_excluded = torch.zeros(B, Hkv, Sk, 1, dtype=torch.bool)
    per_head_excluded[0, 0, 1] = per_head_excluded[1, 1, 5] = True
    return {"bool_pad": (pad, excluded), "int_hole": (hole.long(), holed), "float_pad": (float_pad, excluded),
            "per_kv_head": (per_head, per_head_excluded)}


KEY_MASKS = _key_masks()


@pytest.mark.parametrize("kind", list(KEY_MASKS))
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_excluded_keys_and_values_never_reach_a_result(backend, kind, value):
    mask, excluded = KEY_MASKS[kind]
    q, k, v = _inputs()
    want = _run(q, k, v, mask, backend=backend)
    got = _run(q, _plant(k, excluded, value), _plant(v, excluded, value), mask, backend=backend)
    _assert_same(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_excluded_keys_under_a_window_never_reach_a_result(backend):
    # S = 2 queries at positions 4, 5 of Sk = 6 with window 2: keys 0..2 are outside every window
    q, k, v = _inputs(s=2)
    excluded = (torch.arange(Sk) < 3)[None, None, :, None]  # (1, 1, Sk, 1)
    want = _run(q, k, v, backend=backend, window=2)
    got = _run(q, _plant(k, excluded, NAN), _plant(v, excluded, INF), backend=backend, window=2)
    _assert_same(got, want)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "matmul", "auto"])
def test_excluded_keys_with_sinks_never_reach_a_result_or_the_sinks_gradient(backend):
    mask, excluded = KEY_MASKS["bool_pad"]
    q, k, v = _inputs()
    sinks = torch.linspace(-1, 1, H, dtype=torch.float64)
    want = _run(q, k, v, mask, backend=backend, sinks=sinks)
    got = _run(q, _plant(k, excluded, NAN), _plant(v, excluded, NAN), mask, backend=backend, sinks=sinks)
    _assert_same(got, want)


@pytest.mark.parametrize("backend", _backends_with_triton())
def test_padded_keys_never_reach_a_result_on_every_kernel(backend, interpreter):
    """The key padding case every backend takes, triton included (in fp32, as it runs)."""
    mask, excluded = KEY_MASKS["bool_pad"]
    q, k, v = (t.float() for t in _inputs())
    want = _run(q, k, v, mask, backend=backend)
    got = _run(q, _plant(k, excluded, NAN), _plant(v, excluded, NAN), mask, backend=backend)
    (out, grads), (out0, grads0) = got, want
    for a, b in zip((out, *grads), (out0, *grads0), strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _block_masks():
    """FlexAttention BlockMasks (S = 5, Sk = 6, 2 x 2 blocks), the pairs they allow (1, 1, S, Sk)
    and what they exclude for every query: keys and values (1, 1, Sk, 1), queries (1, 1, S, 1)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def rule(b, h, q_idx, kv_idx):  # keys 1 and 4 for no query, query 2 attends nothing
        return (kv_idx != 1) & (kv_idx != 4) & (q_idx != 2)

    keys = (torch.arange(Sk) == 1) | (torch.arange(Sk) == 4)
    built = flex.create_block_mask(rule, None, None, S, Sk, device="cpu", BLOCK_SIZE=2)
    # every query block attends key blocks 0 and 2 and no mask_mod: keys 2, 3 for no query
    num, index = torch.tensor([[[2, 2, 2]]], dtype=torch.int32), torch.tensor([[[[0, 2, 1]] * 3]], dtype=torch.int32)
    blocks = flex.BlockMask.from_kv_blocks(num, index, BLOCK_SIZE=2, seq_lengths=(S, Sk))
    none = torch.zeros(1, 1, S, 1, dtype=torch.bool)
    i, j = torch.arange(S).view(1, 1, S, 1), torch.arange(Sk).view(1, 1, 1, Sk)
    return {"create_block_mask": (built, rule(0, 0, i, j), keys.view(1, 1, Sk, 1), (i == 2)),
            "from_kv_blocks": (blocks, (j // 2 != 1).expand(1, 1, S, Sk), (j // 2 == 1).view(1, 1, Sk, 1), none)}


def _results(q, k, v, mask, backend):
    """Output, weights, lse and the gradients of q, k, v through all three."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights, lse = attention(*leaves, mask, backend=backend, need_weights=True, return_lse=True)
    loss = ((out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum() + weights.sum()
            + lse.masked_fill(torch.isneginf(lse), 0.0).sum())
    return (out, weights, lse), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("kind", ["create_block_mask", "from_kv_blocks"])
@pytest.mark.parametrize("backend", _backends_with_triton())
def test_what_a_block_mask_excludes_never_reaches_a_result(backend, kind, interpreter, ref):
    """As the same rule given as mask_mod: NaN or inf at keys, values and queries a BlockMask
    excludes for every query reach no output, weight, lse or gradient (in fp32, as triton runs)."""
    block_mask, allowed, keys, queries = _block_masks()[kind]
    q, k, v = (t.float() for t in _inputs())
    want = _results(q, k, v, block_mask, backend)
    torch.testing.assert_close(want[0][0], ref(q, k, v, allowed)[0].float(), atol=1e-5, rtol=1e-5)
    got = _results(_plant(q, queries, NAN), _plant(k, keys, NAN), _plant(v, keys, INF), block_mask, backend)
    for a, b in zip((*got[0], *got[1]), (*want[0], *want[1]), strict=True):
        assert not a.isnan().any() and not a.isposinf().any()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- dead query rows ----------------------------------------------------------------------


def _dead_row_cases():
    mask3 = torch.ones(B, S, Sk, dtype=torch.bool)
    mask3[0, 1] = False  # query 1 of row 0 may attend nothing
    dead3 = torch.zeros(B, 1, S, 1, dtype=torch.bool)
    dead3[0, 0, 1] = True
    pad = torch.tensor([[True] * Sk, [False] * Sk])  # row 1 has no key at all
    dead_pad = torch.tensor([False, True])[:, None, None, None]  # (B, 1, 1, 1)
    return {"3d_row": (mask3, {}, dead3, S), "empty_batch_row": (pad, {}, dead_pad, S),
            # S = 8 > Sk = 6 under causal: queries 0, 1 sit before every key
            "causal_s_gt_sk": (None, {"is_causal": True}, (torch.arange(8) < 2)[None, None, :, None], 8)}


DEAD = _dead_row_cases()


@pytest.mark.parametrize("kind", list(DEAD))
@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_query_rows_never_reach_a_result(backend, kind):
    mask, kw, dead, s = DEAD[kind]
    q, k, v = _inputs(s=s)
    want = _run(q, k, v, mask, backend=backend, **kw)
    got = _run(_plant(q, dead, NAN), k, v, mask, backend=backend, **kw)
    _assert_same(got, want)
    out, (dq, _, _) = got
    assert (out.masked_select(dead.expand_as(out)) == 0).all()
    assert (dq.masked_select(dead.expand_as(dq)) == 0).all()


def test_packed_dead_rows_and_keyless_sequences_never_reach_a_result():
    # sequence 0: 3 queries, 1 key under causal (queries 0, 1 dead); sequence 1: 2 queries, no key
    q = torch.randn(5, H, D, dtype=torch.float64)
    k, v = torch.randn(1, Hkv, D, dtype=torch.float64), torch.randn(1, Hkv, D, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 3, 5]), torch.tensor([0, 1, 1])
    dead = torch.tensor([True, True, False, True, True])[:, None, None]  # (Tq, 1, 1)

    def run(q):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = packed_attention(*leaves, cu_q, cu_k, is_causal=True)
        return out.detach(), torch.autograd.grad(out, leaves, torch.ones_like(out))

    got, want = run(q.masked_fill(dead, NAN)), run(q)
    _assert_same(got, want)
    assert (got[0][dead.expand_as(got[0])] == 0).all()


# --- NaN in a live input ------------------------------------------------------------------


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "key_padding"])
@pytest.mark.parametrize("backend", _backends_with_triton())
def test_nan_in_a_live_query_gives_a_nan_row(backend, masked, interpreter):
    q, k, v = (t.float() for t in _inputs())
    mask = torch.tensor([[True] * Sk, [True] * 3 + [False] * 3]) if masked else None
    q[1, 2, 3, 0] = NAN  # batch row 1, head 2, query 3
    out = attention(q, k, v, mask, backend=backend)
    assert out[1, 2, 3].isnan().all(), f"{backend}: a NaN query was turned into {out[1, 2, 3]}"
    rest = torch.ones(out.shape[:3], dtype=torch.bool)
    rest[1, 2, 3] = False
    assert not out[rest].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_live_value_reaches_the_rows_that_attend_it(backend):
    mask, _ = KEY_MASKS["bool_pad"]
    q, k, v = (t.float() for t in _inputs())
    v[0, 1, 2, 0] = NAN  # a real key of row 0, kv head 1 (query heads 2, 3)
    out = attention(q, k, v, mask, backend=backend)
    assert out[0, 2:].isnan().any(-1).all()
    assert not out[0, :2].isnan().any() and not out[1].isnan().any()


# --- +inf is refused ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_positive_inf_in_a_float_mask_is_refused(backend):
    q, k, v = _inputs()
    mask = torch.zeros(B, Sk, dtype=torch.float64)
    attention(q, k, v, mask, backend=backend)  # a finite mask of the same signature first: it is remembered
    mask[1, 2] = INF
    with pytest.raises(ValueError, match=re.escape("attention_mask holds +inf at 1 position(s), the first at "
                                                   "(1, 2); use -inf to exclude a key, or a finite bias")):
        attention(q, k, v, mask, backend=backend)


def test_positive_inf_beside_nan_in_a_float_mask_is_still_refused():
    q, k, v = _inputs()
    mask = torch.zeros(B, Sk, dtype=torch.float64)
    mask[0, 0], mask[1, 2] = float("nan"), INF  # a NaN makes the mask's min and max NaN: +inf is looked for
    with pytest.raises(ValueError, match=re.escape("attention_mask holds +inf at 1 position(s), the first at (1, 2)")):
        attention(q, k, v, mask)


def test_negative_inf_in_a_float_mask_still_excludes():
    q, k, v = _inputs()
    mask = torch.zeros(B, Sk, dtype=torch.float64)
    mask[:, -2:] = -INF
    out = attention(q, k, v, mask, backend="matmul")
    torch.testing.assert_close(out, attention(q, k, v, mask == 0, backend="matmul"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_positive_inf_sinks_are_refused(backend):
    q, k, v = _inputs()
    sinks = torch.tensor([0.0, INF, 0.0, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape("sinks holds +inf (head 1)")):
        attention(q, k, v, sinks=sinks, backend=backend)


def test_positive_inf_sinks_are_refused_by_packed_attention():
    q = k = v = torch.randn(5, 2, 4)
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=re.escape("sinks holds +inf (head 0)")):
        packed_attention(q, k, v, cu, cu, sinks=torch.tensor([INF, 0.0]))


# --- the property -------------------------------------------------------------------------


@given(
    seed=st.integers(0, 2**16),
    layout=st.sampled_from(["2d", "3d", "4d"]),
    is_causal=st.booleans(),
    value=st.sampled_from([NAN, INF, -INF]),
    backend=st.sampled_from(["matmul", "sdpa", "chunked", "auto", "varlen", "einsum"]),
    s=st.integers(1, 7),
)
def test_property_planted_values_at_excluded_positions_change_nothing(seed, layout, is_causal, value, backend, s):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _inputs(s=s, seed=seed)
    shape = {"2d": (B, Sk), "3d": (B, s, Sk), "4d": (B, H, s, Sk)}[layout]
    mask = torch.rand(shape, generator=gen) < 0.6  # True = attend
    m4 = mask.reshape(B, 1, 1, Sk) if layout == "2d" else mask.reshape(B, 1, s, Sk) if layout == "3d" else mask
    allowed = m4.expand(B, H, s, Sk)
    if is_causal:
        allowed = allowed & headwise.masks.causal_mask(s, Sk)[None, None]
    rows_dead = ~allowed.any(-1, keepdim=True)  # (B, H, s, 1)
    keys_dead = ~allowed.reshape(B, Hkv, H // Hkv, s, Sk).any(2).any(2)[..., None]  # (B, Hkv, Sk, 1)
    want = _run(q, k, v, mask, backend=backend, is_causal=is_causal)
    got = _run(_plant(q, rows_dead, value), _plant(k, keys_dead, value), _plant(v, keys_dead, value), mask,
               backend=backend, is_causal=is_causal)
    _assert_same(got, want)


# --- argument checks ----------------------------------------------------------------------


def test_head_dim_zero_is_a_clear_error():
    q = k = v = torch.randn(1, 2, 3, 0)
    with pytest.raises(ValueError, match=re.escape("head dim D must be >= 1, got q of shape (1, 2, 3, 0)")):
        attention(q, k, v)


def test_head_dim_zero_is_a_clear_error_in_packed_attention():
    q = k = v = torch.randn(5, 2, 0)
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=re.escape("head dim D must be >= 1, got q of shape (5, 2, 0)")):
        packed_attention(q, k, v, cu, cu)


@pytest.mark.parametrize("fn", ["attention", "packed_attention"])
@pytest.mark.parametrize("name, value, message", [
    ("dropout_p", "0.1", "dropout_p must be a float in [0, 1), got str ('0.1')"),
    ("dropout_p", True, "dropout_p must be a float in [0, 1), got bool (True)"),
    ("scale", "0.5", "scale must be a float or None (None: 1 / sqrt(D)), got str ('0.5')"),
    ("scale", torch.tensor(0.5), "scale must be a float or None (None: 1 / sqrt(D)), got Tensor"),
])
def test_number_arguments_must_be_numbers(fn, name, value, message):
    if fn == "attention":
        q = k = v = torch.randn(1, 2, 3, 4)
        call = lambda: attention(q, k, v, **{name: value})  # noqa: E731
    else:
        q = k = v = torch.randn(5, 2, 4)
        cu = torch.tensor([0, 2, 5])
        call = lambda: packed_attention(q, k, v, cu, cu, **{name: value})  # noqa: E731
    with pytest.raises(TypeError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("value", [INF, NAN])
def test_scale_must_be_finite(value):
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=re.escape(f"scale must be finite, got {value}")):
        attention(q, k, v, scale=value)


def test_numpy_and_int_numbers_are_still_accepted():
    np = pytest.importorskip("numpy")
    q = k = v = torch.randn(1, 2, 3, 4)
    want = attention(q, k, v, scale=0.5)
    torch.testing.assert_close(attention(q, k, v, scale=np.float32(0.5), dropout_p=0), want)
    torch.testing.assert_close(attention(q, k, v, scale=1, dropout_p=np.float64(0.0)),
                               attention(q, k, v, scale=1.0))


# --- the soft-capping refusal -------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_soft_capping_refusal_gives_its_advice_once(backend):
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=re.escape(f"backend {backend!r} cannot soft-cap the scores")) as err:
        attention(q, k, v, softcap=5.0, backend=backend)
    assert str(err.value).count("use backend") == 1, str(err.value)

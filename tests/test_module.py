"""Tests for ``headwise.MultiHeadAttention``: checks, shapes, dropout, and parity with
``torch.nn.MultiheadAttention`` and the documents' reference classes on every backend.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.
"""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

from conftest import contract_backends
from headwise import MultiHeadAttention, policy
from headwise import trace as headwise_trace
from headwise.kernels.registry import get_kernel
from headwise.masks import from_torch_masks
from headwise.module import plan as planning
from headwise.reference import MHSA, MultiHeadAttentionFormal, to_headwise_state_dict

B, S, Sk, E, H = 2, 5, 3, 16, 4
# Kernel names for the module: there backend="varlen" is still the deprecated name of packing=True
# (see test_backend_varlen_is_the_deprecated_name_of_packing_true); the varlen kernel is tested in tests/kernels.
BACKENDS = [name for name in contract_backends() if name != "varlen"]
WEIGHT_BACKENDS = [n for n in BACKENDS if get_kernel(n).supports_weights]
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def close(a, b):
    torch.testing.assert_close(a, b, **TOL)


# --- constructor errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((100, 8), {}, ValueError,
         "num_heads (8) must divide embed_dim (100); try num_heads=5 or 10"),
        ((64, 7), {}, ValueError, "num_heads (7) must divide embed_dim (64); try num_heads=4 or 8"),
        ((64, 8), {"num_kv_heads": 3}, ValueError,
         "num_kv_heads (3) must divide num_heads (8); try num_kv_heads=2 or 4"),
        ((64, 8), {"num_kv_heads": 16}, ValueError,
         "num_kv_heads (16) must divide num_heads (8); try num_kv_heads=8"),
        ((64, 8, 1.0), {}, ValueError, "dropout must be in [0, 1), got 1.0"),
        ((64, 8, -0.1), {}, ValueError, "dropout must be in [0, 1), got -0.1"),
        ((64, 8), {"backend": "flash"}, ValueError,
         "unknown backend 'flash'; choose one of 'auto', "),
        ((64.0, 8), {}, TypeError, "embed_dim must be an int, got float (64.0)"),
        ((64, True), {}, TypeError, "num_heads must be an int, got bool (True)"),
        ((64, 8), {"num_kv_heads": "2"}, TypeError, "num_kv_heads must be an int, got str ('2')"),
        ((0, 8), {}, ValueError, "embed_dim must be positive, got 0"),
        ((64, -8), {}, ValueError, "num_heads must be positive, got -8"),
        ((64, 8), {"num_kv_heads": 0}, ValueError, "num_kv_heads must be positive, got 0"),
        ((64, 8), {"sink_tokens": 2}, ValueError,
         "sink_tokens=2 keeps the first positions visible under a sliding window; give window=W too"),
        ((64, 8), {"sink_tokens": -1, "window": 4}, ValueError, "sink_tokens must be an int >= 0, got -1"),
        ((64, 8), {"v_head_dim": 0}, ValueError, "v_head_dim must be a positive int or None (None: head_dim), got 0"),
        ((64, 8), {"v_head_dim": 4.0}, ValueError,
         "v_head_dim must be a positive int or None (None: head_dim), got 4.0"),
    ],
)
def test_constructor_errors(args, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        MultiHeadAttention(*args, **kwargs)


def test_unknown_backend_lists_every_known_one():
    with pytest.raises(ValueError) as info:
        MultiHeadAttention(E, H, backend="flash")
    for name in ["auto", *BACKENDS]:
        assert repr(name) in str(info.value)


# --- forward errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.randn(S, E), f"x must be (B, S, E) with E = embed_dim = {E}, got shape ({S}, {E}); "
                            "add a batch dimension with x.unsqueeze(0)"),
        (torch.randn(B, S, E + 1), f"x must be (B, S, E) with E = embed_dim = {E}, got shape "
                                   f"({B}, {S}, {E + 1})"),
        (torch.randn(1, B, S, E), f"x must be (B, S, E) with E = embed_dim = {E}, got shape "
                                  f"(1, {B}, {S}, {E})"),
    ],
)
def test_x_shape_errors(x, message):
    with pytest.raises(ValueError, match=re.escape(message) + "$"):
        MultiHeadAttention(E, H)(x)


def test_x_type_error():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        MultiHeadAttention(E, H)([[0.0] * E])


def test_context_errors():
    mha = MultiHeadAttention(E, H)
    x = torch.randn(B, S, E)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"context must be (B, Sk, E) with E = embed_dim = {E}, got shape (2, 3, 8)"
        ),
    ):
        mha(x, context=torch.randn(B, Sk, 8))
    with pytest.raises(ValueError, match=re.escape(f"got shape ({Sk}, {E})")):
        mha(x, context=torch.randn(Sk, E))
    with pytest.raises(ValueError, match=re.escape("context batch (3) differs from x batch (2)")):
        mha(x, context=torch.randn(3, Sk, E))
    with pytest.raises(TypeError, match="context must be a torch.Tensor or None, got str"):
        mha(x, context="memory")


def test_mask_errors():
    mha = MultiHeadAttention(E, H)
    x = torch.randn(B, S, E)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "attention_mask of shape (2, 3) does not fit 2-D layout (B, Sk) key padding mask "
            "= (2, 5) (each dimension must match or be 1)"
        ),
    ):
        mha(x, torch.ones(B, Sk, dtype=torch.bool))
    with pytest.raises(ValueError, match=re.escape("got 1-D with shape (5,)")):
        mha(x, torch.ones(S, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask has dtype torch.complex64"):
        mha(x, torch.ones(B, S, dtype=torch.complex64))
    with pytest.raises(
        ValueError,
        match=re.escape("attention_mask is on meta but the queries are on cpu; "
                        "move it with attention_mask.to('cpu')"),
    ):
        mha(x, torch.ones(B, S, dtype=torch.bool, device="meta"))


def test_a_fused_backend_returns_weights_from_its_log_sum_exp_and_refuses_them_where_it_has_none(monkeypatch):
    x = torch.randn(B, S, E, dtype=torch.float64)
    mha = MultiHeadAttention(E, H, backend="sdpa").double()
    _, weights = mha(x, need_weights=True)  # sdpa returns the lse: the weights come from it
    plain = MultiHeadAttention(E, H, backend="matmul").double()
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(weights, plain(x, need_weights=True)[1], atol=1e-12, rtol=1e-12)
    mha.train()
    mha.dropout = 0.5  # the CPU flash kernel has no dropout: no lse, so no weights from sdpa
    with pytest.raises(ValueError, match=re.escape("backend 'sdpa' returns the log-sum-exp only from torch's CPU "
                                                   "flash kernel, without dropout (device cpu, dropout_p=0.5)")):
        mha(x, need_weights=True)


# --- shapes and state -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_output_shapes_self_and_cross(backend, num_kv_heads):
    mha = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, backend=backend)
    x = torch.randn(B, S, E)
    context = torch.randn(B, Sk, E)
    assert mha(x).shape == (B, S, E)
    assert mha(x, context=context).shape == (B, S, E)
    assert mha(x, torch.ones(B, Sk, dtype=torch.bool), context=context).shape == (B, S, E)
    assert mha(x, context=context, is_causal=True).shape == (B, S, E)


@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_weights_shapes(backend, num_kv_heads):
    mha = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, backend=backend)
    out, weights = mha(torch.randn(B, S, E), context=torch.randn(B, Sk, E), need_weights=True)
    assert out.shape == (B, S, E)
    assert weights.shape == (B, H, S, Sk)


@pytest.mark.parametrize("num_kv_heads, kv_dim", [(None, E), (2, E // 2), (1, E // 4)])
def test_state_dict_keys_and_shapes(num_kv_heads, kv_dim):
    mha = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads)
    shapes = {k: tuple(v.shape) for k, v in mha.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (E, E), "q_proj.bias": (E,),
        "k_proj.weight": (kv_dim, E), "k_proj.bias": (kv_dim,),
        "v_proj.weight": (kv_dim, E), "v_proj.bias": (kv_dim,),
        "out_proj.weight": (E, E), "out_proj.bias": (E,),
    }
    assert mha.head_dim == E // H
    assert mha.num_kv_heads == (num_kv_heads or H)


def test_state_dict_without_bias():
    keys = list(MultiHeadAttention(E, H, bias=False).state_dict())
    assert keys == ["q_proj.weight", "k_proj.weight", "v_proj.weight", "out_proj.weight"]


def test_factory_dtype():
    mha = MultiHeadAttention(E, H, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in mha.parameters())
    assert mha(torch.randn(B, S, E, dtype=torch.float64)).dtype == torch.float64


def test_without_qk_norm_both_norms_are_none():
    mha = MultiHeadAttention(E, H)
    assert mha.q_norm is None and mha.k_norm is None
    normed = MultiHeadAttention(E, H, qk_norm="rms")
    assert type(normed.q_norm) is nn.RMSNorm and type(normed.k_norm) is nn.RMSNorm


def test_repr_names_the_settings():
    text = repr(MultiHeadAttention(E, H, num_kv_heads=2, is_causal=True, backend="einsum"))
    assert "embed_dim=16, num_heads=4, num_kv_heads=2, head_dim=4" in text
    assert "is_causal=True, backend='einsum'" in text
    assert "num_kv_heads" not in repr(MultiHeadAttention(E, H))


def test_extra_repr_in_full():
    full = MultiHeadAttention(16, 4, 0.25, num_kv_heads=2, is_causal=True, backend="einsum", rope_base=500.0,
                              alibi=True, window=3)
    assert full.extra_repr() == ("embed_dim=16, num_heads=4, num_kv_heads=2, head_dim=4, dropout=0.25, "
                                 "is_causal=True, backend='einsum', rope_base=500, alibi=True, window=3")
    assert MultiHeadAttention(16, 4).extra_repr() == (
        "embed_dim=16, num_heads=4, head_dim=4, dropout=0.0, is_causal=False, backend='auto'")
    for packing in (True, False):  # named where it is not the default
        assert MultiHeadAttention(16, 4, packing=packing).extra_repr().endswith(
            f"backend='auto', packing={packing}")
    from headwise.distributed import ContextParallel

    assert MultiHeadAttention(16, 4, context_parallel=ContextParallel(method="ring")).extra_repr().endswith(
        "backend='auto', context_parallel=ContextParallel(group=None, method='ring', layout='zigzag')")


def repeat_kv(gqa: MultiHeadAttention) -> MultiHeadAttention:
    """The plain multi-head module that grouped-query ``gqa`` is equivalent to."""
    mha = MultiHeadAttention(gqa.embed_dim, gqa.num_heads, backend="matmul")
    G, D = gqa.num_heads // gqa.num_kv_heads, gqa.head_dim
    state = dict(gqa.state_dict())
    for name in ("k_proj", "v_proj"):
        w = state[f"{name}.weight"].reshape(gqa.num_kv_heads, D, -1)  # (Hkv*D, E) -> (Hkv, D, E)
        state[f"{name}.weight"] = w.repeat_interleave(G, dim=0).reshape(-1, gqa.embed_dim)
        b = state[f"{name}.bias"].reshape(gqa.num_kv_heads, D)  # (Hkv*D,) -> (Hkv, D)
        state[f"{name}.bias"] = b.repeat_interleave(G, dim=0).reshape(-1)
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_equals_repeated_kv_heads(backend, num_kv_heads):
    gqa = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, backend=backend)
    x, context = torch.randn(B, S, E), torch.randn(B, Sk, E)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    close(gqa(x, mask, context=context), repeat_kv(gqa)(x, mask, context=context))


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_causal_default_and_override(backend):
    causal = MultiHeadAttention(E, H, is_causal=True, backend=backend)
    plain = MultiHeadAttention(E, H, backend=backend)
    plain.load_state_dict(causal.state_dict())
    x = torch.randn(B, S, E)
    close(causal(x), plain(x, is_causal=True))
    close(causal(x, is_causal=False), plain(x))
    assert not torch.allclose(causal(x), plain(x))


def test_dispatch_method():
    mha = MultiHeadAttention(E, H, dropout=0.1)
    x = torch.randn(B, S, E)
    assert mha.dispatch(x).backend == "sdpa"
    assert mha.dispatch(x).request.dropout_p == 0.1
    weighed = mha.dispatch(x, need_weights=True)  # dropout on the CPU: chunked returns the lse, the weights from it
    assert weighed.backend == "chunked" and "computed from its log-sum-exp" in weighed.reason
    assert mha.eval().dispatch(x).request.dropout_p == 0.0
    assert MultiHeadAttention(E, H, backend="bmm").dispatch(x).backend == "bmm"


# --- dropout and weights ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_is_deterministic_and_train_drops(backend):
    mha = MultiHeadAttention(E, H, dropout=0.5, backend=backend)
    no_dropout = MultiHeadAttention(E, H, backend=backend)
    no_dropout.load_state_dict(mha.state_dict())
    x = torch.randn(B, S, E)
    mha.eval()
    first = mha(x)
    assert torch.equal(first, mha(x))
    close(first, no_dropout(x))
    mha.train()
    dropped = mha(x)
    assert torch.isfinite(dropped).all()
    assert not torch.allclose(dropped, first)
    assert not torch.allclose(dropped, mha(x))  # a fresh dropout mask each call


@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_weights_rows_sum_to_one_or_zero(backend, training):
    mha = MultiHeadAttention(E, H, dropout=0.3, backend=backend).train(training)
    # causal cross-attention with S > Sk: query i sees keys j <= i - 2, so rows 0, 1 are dead
    _, weights = mha(torch.randn(B, S, E), context=torch.randn(B, Sk, E), is_causal=True,
                     need_weights=True)
    sums = weights.sum(dim=-1)  # (B, H, S)
    want = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]).expand(B, H, S)
    close(sums, want)  # probabilities before dropout, so 1 even in training
    assert torch.equal(weights[:, :, :2], torch.zeros(B, H, 2, Sk))
    assert (weights >= 0).all()


# --- parity with torch.nn.MultiheadAttention ------------------------------------------------


def torch_masks(kind: str, num_heads: int = H):
    """(key_padding_mask, attn_mask) in torch's convention (bool True = ignore)."""
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -2:] = True  # batch 1: the last two keys are padding
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)  # above the diagonal: ignore
    if kind == "none":
        return None, None
    if kind == "kpm":
        return kpm, None
    if kind == "attn":
        return None, causal
    if kind == "both":
        return kpm, causal
    if kind == "float":
        bias = torch.randn(S, S).masked_fill(causal, float("-inf"))
        return torch.zeros(B, S).masked_fill(kpm, float("-inf")), bias
    if kind == "3d":
        per_head = torch.rand(B * num_heads, S, S) > 0.5
        per_head &= ~torch.eye(S, dtype=torch.bool)  # the diagonal stays visible
        return kpm, per_head
    raise AssertionError(kind)


def run_torch(m: nn.MultiheadAttention, x, kpm, am, **kwargs):
    """torch's module on batch-first x (B, S, E), transposing when it is sequence-first."""
    xt = x if m.batch_first else x.transpose(0, 1)  # (B, S, E) -> (S, B, E)
    out, weights = m(xt, xt, xt, key_padding_mask=kpm, attn_mask=am, **kwargs)
    return (out if m.batch_first else out.transpose(0, 1)), weights  # -> (B, S, E)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "kpm", "attn", "both", "float", "3d"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_from_torch_parity(backend, kind, batch_first):
    m = nn.MultiheadAttention(E, H, batch_first=batch_first).eval()
    nn.init.normal_(m.in_proj_bias)
    nn.init.normal_(m.out_proj.bias)
    ours = MultiHeadAttention.from_torch(m, backend=backend)
    assert not ours.training and ours.backend == backend
    x = torch.randn(B, S, E)
    kpm, am = torch_masks(kind)
    want, _ = run_torch(m, x, kpm, am, need_weights=False)
    mask = from_torch_masks(kpm, am, num_heads=H)
    got = ours(x, mask)
    if mask is not None and mask.dim() == 2 and not mask.is_floating_point():
        # A (B, S) self-attention mask also marks padded queries: ours outputs zeros there
        # (what the packed path gives); torch outputs values nobody should read.
        assert (got[~mask] == 0).all()
        got, want = got[mask], want[mask]
    close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_from_torch_parity_without_bias(backend, batch_first):
    m = nn.MultiheadAttention(E, H, bias=False, batch_first=batch_first)
    ours = MultiHeadAttention.from_torch(m, backend=backend)
    assert ours.q_proj.bias is None and ours.out_proj.bias is None
    x = torch.randn(B, S, E)
    kpm, am = torch_masks("both")
    close(ours(x, from_torch_masks(kpm, am)), run_torch(m, x, kpm, am, need_weights=False)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_torch_gradients_match(backend):
    m = nn.MultiheadAttention(E, H, batch_first=True)
    nn.init.normal_(m.in_proj_bias)
    ours = MultiHeadAttention.from_torch(m, backend=backend)
    x = torch.randn(B, S, E)
    kpm, am = torch_masks("both")
    grad_out = torch.randn(B, S, E)
    (run_torch(m, x, kpm, am, need_weights=False)[0] * grad_out).sum().backward()
    (ours(x, from_torch_masks(kpm, am)) * grad_out).sum().backward()
    projections = (ours.q_proj, ours.k_proj, ours.v_proj)
    in_w = torch.cat([p.weight.grad for p in projections])  # (3E, E): q, k, v rows stacked, as torch's in_proj
    in_b = torch.cat([p.bias.grad for p in projections])
    close(in_w, m.in_proj_weight.grad)
    close(in_b, m.in_proj_bias.grad)
    close(ours.out_proj.weight.grad, m.out_proj.weight.grad)
    close(ours.out_proj.bias.grad, m.out_proj.bias.grad)


@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
def test_from_torch_weights_match_per_head(backend):
    m = nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(m, backend=backend)
    x = torch.randn(B, S, E)
    kpm, am = torch_masks("both")
    _, want = run_torch(m, x, kpm, am, need_weights=True, average_attn_weights=False)
    _, got = ours(x, from_torch_masks(kpm, am), need_weights=True)
    close(got, want)


def test_from_torch_copies_settings():
    m = nn.MultiheadAttention(E, H, dropout=0.25, dtype=torch.float64)
    ours = MultiHeadAttention.from_torch(m, is_causal=True)
    assert ours.dropout == 0.25 and ours.training and ours.is_causal
    assert ours.q_proj.weight.dtype == torch.float64
    assert ours.backend == "auto"


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("bias", [True, False])
def test_to_torch_round_trip(batch_first, bias):
    ours = MultiHeadAttention(E, H, dropout=0.1, bias=bias).eval()
    m = ours.to_torch(batch_first=batch_first)
    assert isinstance(m, nn.MultiheadAttention)
    assert m.batch_first == batch_first and m.dropout == 0.1 and not m.training
    assert (m.in_proj_bias is not None) == bias
    x = torch.randn(B, S, E)
    kpm, am = torch_masks("both")
    close(run_torch(m, x, kpm, am, need_weights=False)[0], ours(x, from_torch_masks(kpm, am)))
    back = MultiHeadAttention.from_torch(m)
    assert back.state_dict().keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert ours.train().to_torch().training


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_to_torch_refuses_grouped_query(num_kv_heads):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "torch.nn.MultiheadAttention has no grouped-query attention; this module has "
            f"num_kv_heads={num_kv_heads} < num_heads={H}"
        ),
    ):
        MultiHeadAttention(E, H, num_kv_heads=num_kv_heads).to_torch()


def test_from_torch_errors():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "kdim (8) and vdim (12) must equal embed_dim (16); "
            "headwise projects keys and values from embed_dim-wide inputs"
        ),
    ):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, kdim=8, vdim=12))
    for kwargs in ({"add_bias_kv": True}, {"add_zero_attn": True}):
        with pytest.raises(
            ValueError,
            match=re.escape(
                "add_bias_kv=True and add_zero_attn=True are not supported; "
                "append the extra key/value position to the inputs instead"
            ),
        ):
            MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, **kwargs))
    with pytest.raises(
        TypeError, match="from_torch expects torch.nn.MultiheadAttention, got MultiHeadAttention"
    ):
        MultiHeadAttention.from_torch(MultiHeadAttention(E, H))


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_padded_batch_row_torch_nan_ours_zero(backend):
    m = nn.MultiheadAttention(E, H, batch_first=True)
    ours = MultiHeadAttention.from_torch(m, backend=backend)
    assert torch.equal(ours.out_proj.bias, torch.zeros(E))  # torch initialises it to zero
    x = torch.randn(B, S, E)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True  # batch 1 is all padding

    want, _ = m(x, x, x, key_padding_mask=kpm)  # torch's default call (need_weights=True)
    assert torch.isnan(want[1]).all()  # torch: NaN for the whole padded batch row

    x_ours = x.clone().requires_grad_(True)
    got = ours(x_ours, from_torch_masks(kpm))
    assert torch.equal(got[1], torch.zeros(S, E))  # ours: out_proj(0) = 0
    close(got[0], want[0])
    got.square().sum().backward()
    for name, p in ours.named_parameters():
        assert torch.isfinite(p.grad).all(), name
    assert torch.isfinite(x_ours.grad).all()
    assert torch.equal(x_ours.grad[1], torch.zeros(S, E))


# --- parity with the documents' classes ----------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_with_multi_head_attention_formal(backend):
    ref = MultiHeadAttentionFormal(128, 8).eval()
    ours = MultiHeadAttention(128, 8, backend=backend).eval()
    ours.load_state_dict(to_headwise_state_dict(ref))
    X = torch.rand(3, 2, 128)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    expanded = mask.unsqueeze(1).unsqueeze(2).expand(3, 8, 2, 2)  # as the document does
    want = ref(X, expanded)
    close(ours(X, expanded), want)  # a 4-D mask describes keys only: every position as the document
    real = mask.bool()
    for form in (mask, mask.bool()):  # a (B, S) mask also marks padded queries: zeros there
        got = ours(X, form)
        close(got[real], want[real])
        assert (got[~real] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_with_mhsa(backend):
    ref = MHSA(512, 8)
    ours = MultiHeadAttention(512, 8, backend=backend)
    ours.load_state_dict(to_headwise_state_dict(ref))
    x = torch.rand(4, 10, 512)
    close(ours(x), ref(x))


# --- positions, ALiBi and windows on the module ----------------------------------------


def test_module_window_and_alibi_reach_the_kernel():
    mha = MultiHeadAttention(16, 2, alibi=True, window=2, backend="matmul").eval()
    x = torch.randn(1, 4, 16)
    _, w = mha(x, need_weights=True)
    assert (w[0, :, 3, :2] == 0).all() and (w[0, :, 3, 2:] > 0).all()  # keys (3 - 2, 3]
    assert mha.dispatch(x).request.window == 2 and mha.dispatch(x).request.alibi
    assert not any("alibi" in key for key in mha.state_dict())
    assert "alibi=True" in repr(mha) and "window=2" in repr(mha)


def test_module_option_errors():
    with pytest.raises(ValueError, match=r"window must be a positive int .* got 0"):
        MultiHeadAttention(16, 2, window=0)
    for kwargs, name in (({"rope": True}, "rope"), ({"alibi": True}, "alibi"), ({"window": 3}, "window"),
                         ({"qk_norm": "rms"}, "qk_norm")):
        with pytest.raises(ValueError, match=rf"has no {name}"):
            MultiHeadAttention(16, 2, **kwargs).to_torch()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"qk_norm": "layer"}, r"qk_norm must be None or 'rms' \(RMSNorm of each head's q and k\), got 'layer'"),
    ({"qk_norm": "rms", "qk_norm_eps": 0}, r"qk_norm_eps must be a positive number, got 0"),
    ({"qk_norm": "rms", "qk_norm_eps": True}, r"qk_norm_eps must be a positive number, got True"),
    ({"rope_parameters": {"rope_type": "su"}}, r"rope_type 'su' is not supported; choose one of 'default'"),
    ({"rope_base": 500.0, "rope_parameters": {"rope_theta": 10000.0}},
     r"rope_base \(500\) and rope_parameters\['rope_theta'\] \(10000\) disagree; give one of them"),
    ({"rotary_dim": 9}, r"rotary_dim must be an int in \[1, head_dim = 8\], got 9"),
])
def test_rope_parameters_and_qk_norm_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(16, 2, **kwargs)


def test_rope_parameters_rotary_dim_and_qk_norm_turn_on_and_show():
    mha = MultiHeadAttention(16, 2, rotary_dim=4, qk_norm="rms", qk_norm_eps=1e-5, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    assert (mha.rope.rotary_dim, mha.rope.base, mha.rope.rope_type) == (4, 500.0, "linear")
    assert mha.extra_repr().endswith("rope_base=500, rope_type='linear', rotary_dim=4, qk_norm='rms'")
    assert "(q_norm): RMSNorm((8,), eps=1e-05" in repr(mha)
    assert [k for k in mha.state_dict() if "norm" in k] == ["q_norm.weight", "k_norm.weight"]
    assert mha.q_norm.weight.shape == (8,) and torch.equal(mha.k_norm.weight, torch.ones(8))
    assert MultiHeadAttention(16, 2, rotary_dim=8).rope is not None
    assert MultiHeadAttention(16, 2, rope_parameters={"rope_type": "default"}).rope.base == 10000.0
    plain = MultiHeadAttention(16, 2, rope=True)
    assert (plain.q_norm, plain.qk_norm) == (None, None) and "norm" not in "".join(plain.state_dict())
    assert MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 2)).q_norm is None


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize("sizes", [(0, 4), (2, 0)], ids=["B=0", "S=0"])
def test_empty_batch_or_sequence_forward_and_backward(backend, sizes):
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, backend=backend)
    x = torch.randn(*sizes, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()
    for mask in (None, torch.ones(sizes, dtype=torch.bool)):
        out = mha(x, mask, is_causal=True)
        assert out.shape == (*sizes, 32)
        (gx,) = torch.autograd.grad(out.sum(), x)
        assert gx.shape == x.shape


@pytest.mark.parametrize("sizes", [(0, 4), (2, 0)], ids=["B=0", "S=0"])
def test_empty_batch_or_sequence_without_gradients(sizes):
    """Without gradients the q, k, v projection is one GEMM over adjacent rows (module/qkv.py),
    the fused path and the cache's steps take their own ways: empty inputs still work."""
    for kwargs in ({}, {"num_kv_heads": 2}):
        mha = MultiHeadAttention(32, 4, **kwargs).eval()
        x = torch.randn(*sizes, 32)
        with torch.no_grad():
            for mask in (None, torch.ones(sizes, dtype=torch.bool)):
                assert mha(x, mask).shape == (*sizes, 32)
            if sizes[0]:  # a cache holds at least one sequence
                cache = mha.new_cache(sizes[0], 8)
                for _ in range(2):
                    assert mha(x, cache=cache).shape == (*sizes, 32)


# --- dispatch names what forward would run ----------------------------------------------------


def test_dispatch_of_the_packed_path_in_full(cheap_packing):
    mha = MultiHeadAttention(E, H)
    x = torch.randn(3, 4, E)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])  # 2 of 12 tokens: 17% padding
    d = mha.dispatch(x, mask)
    assert (d.path, d.backend, dict(d.passed_over)) == ("packed", "sdpa", {"dense path": "pays for 2 padded positions"})
    estimate = policy.estimate_packing(3, 4, E, H, H, [(2, 4, 4, 8), (1, 2, 2, 2)], training=True)
    assert d.path_reason == (f"17% of the batch is padding; forward + backward {estimate}; unit costs built in "
                             "(HEADWISE_TUNE=off)")
    assert d.reason == ("attention per length bucket (sequences x length): 2 x 4 -> 'sdpa', 1 x 2 -> 'sdpa'; "
                        "projections and the output projection run on the 10 real tokens of 3 x 4")
    assert d.request.batch == 2 and d.request.q_len == d.request.k_len == 4  # the bucket with the most tokens
    assert str(d).splitlines()[:2] == ["path 'packed': " + d.path_reason, "backend 'sdpa': " + d.reason]
    assert str(d).splitlines()[2] == "  passed over 'dense path': pays for 2 padded positions"
    forced = MultiHeadAttention(E, H, packing=True).dispatch(x, torch.ones(3, 4, dtype=torch.bool))
    assert (forced.path, forced.path_reason) == ("packed", "packing=True packs the real tokens")
    assert forced.reason.startswith("attention per length bucket (sequences x length): 3 x 4 -> 'sdpa';")
    assert mha.plan(x, mask).path == "packed" and mha.plan(x, mask).padding.sum() == 10


@pytest.mark.parametrize("kwargs, mask, path, why", [
    ({}, None, "dense", "no 2-D padding mask of x's own tokens (self-attention) to pack by"),
    ({}, "pad", "packed", "17% of the batch is padding; forward + backward estimated packed"),
    ({}, "full", "dense", "0% of the batch is padding (< PACK_MIN_PADDING 10%): nothing to save"),
    ({"packing": False}, "pad", "dense", "packing=False"),
    ({"packing": True}, "full", "packed", "packing=True packs the real tokens"),
    ({"backend": "matmul"}, "pad", "dense", "backend='matmul' runs on the (B, S) batch (packing=True packs for it)"),
    ({"window": 2}, "pad", "dense", "window / ALiBi count positions, which change for tokens after a hole once packed"),
])
def test_plan_names_the_path_and_forward_follows_it(kwargs, mask, path, why, cheap_packing):
    mha = MultiHeadAttention(E, H, **kwargs)
    x = torch.randn(3, 4, E)
    masks = {None: None, "pad": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]),
             "full": torch.ones(3, 4, dtype=torch.bool)}
    plan = mha.plan(x, masks[mask])
    assert plan.path == path and plan.why.startswith(why)
    assert mha.dispatch(x, masks[mask]).path == path
    with headwise_trace() as t:
        mha(x, masks[mask])
    assert ("pack" in t.names()) == (path == "packed")


def test_dispatch_runs_no_projection(monkeypatch):
    mha = MultiHeadAttention(E, H)
    calls = []
    for proj in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
        monkeypatch.setattr(proj, "forward", lambda *a: calls.append(a))
    x = torch.randn(3, 4, E)
    for mask in (None, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])):
        assert mha.dispatch(x, mask).backend == "sdpa"
    assert mha.dispatch(x, context=torch.randn(3, 6, E)).request.k_len == 6
    assert calls == []


def test_backend_varlen_is_the_kernel_whatever_packing_says():
    """backend= names a kernel, and "varlen" is the kernel that drops padded keys; the padding-free
    path is packing= (no old meaning of backend="varlen" is kept: it was never released)."""
    x = torch.randn(3, 4, E)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    new = MultiHeadAttention(E, H, packing=True)
    for packing in ("auto", False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kernel = MultiHeadAttention(E, H, backend="varlen", packing=packing)
        kernel.load_state_dict(new.state_dict())
        assert (kernel.backend, kernel.packing, kernel.dispatch(x, mask).backend) == ("varlen", packing, "varlen")
        torch.testing.assert_close(kernel(x, mask), new(x, mask))
    with pytest.raises(ValueError, match=r"packing must be 'auto', True or False, got 1"):
        MultiHeadAttention(E, H, packing=1)


def test_dispatch_checks_and_uses_context_and_cache_like_forward():
    mha = MultiHeadAttention(E, H).eval()
    x = torch.randn(B, 4, E)
    key_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])  # padding of the context, not of x
    cross = mha.dispatch(x, key_mask, context=torch.randn(B, 4, E))
    assert cross.backend != "varlen" and cross.request.mask_shape == (B, 1, 1, 4)
    assert mha.dispatch(x, context=torch.randn(B, 7, E)).request.k_len == 7  # keys from the context
    with pytest.raises(ValueError, match=r"context must be \(B, Sk, E\)"):
        mha.dispatch(x, context=torch.randn(B, 7, E + 1))
    cache = mha.new_cache(B, 8)
    with pytest.raises(ValueError, match=re.escape("the cache was made for batch_size 2, got a batch of 3; make one "
                                                   "with mha.new_cache(batch_size, max_seq_len) per batch size")):
        mha.dispatch(torch.randn(3, 1, E), cache=cache)
    with torch.no_grad():
        mha(x, cache=cache, is_causal=True)  # prefill 4 positions, no padding
    step_mask = torch.tensor([[0], [1]])  # the new position of row 0 is padding
    with torch.no_grad():  # a cache step runs without gradients; dispatch refuses what forward refuses
        d = mha.dispatch(x[:, :1], step_mask, cache=cache, is_causal=True)
    assert d.backend != "varlen" and d.request.k_len == 5 and d.request.mask_shape == (B, 1, 1, 5)
    assert len(cache) == 4 and not cache.padded  # dispatch computes, it does not append or remember


@pytest.mark.parametrize("n, around, hint", [(9, 2, "1 or 3"), (8, 1, "2"), (8, 4, "2 or 8"), (12, 12, "6")])
def test_divisor_hints_are_the_nearest_divisors_strictly_below_and_above(n, around, hint):
    from headwise.module.checks import divisors_near

    assert divisors_near(n, around) == hint


@pytest.mark.parametrize("x, got", [([[0.0] * E], "list"), (torch.randn(2, 3, E), "(2, 3, 16)"),
                                    (torch.randn(3, E + 1), "(3, 17)")])
def test_forward_packed_errors_name_what_they_got(x, got):
    with pytest.raises(ValueError, match=re.escape(f"packed x must be (T, E) with E = embed_dim = {E}, got {got}")):
        MultiHeadAttention(E, H).forward_packed(x, torch.tensor([0, 3]))


def test_torch_conversions_keep_device_dtype_and_batch_first_by_default():
    ours = MultiHeadAttention(E, H, device="meta", dtype=torch.float64)
    m = ours.to_torch()
    assert m.batch_first and (m.in_proj_weight.device.type, m.in_proj_weight.dtype) == ("meta", torch.float64)
    back = MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, device="meta", dtype=torch.float64))
    assert (back.q_proj.weight.device.type, back.q_proj.weight.dtype) == ("meta", torch.float64)


def test_to_torch_names_every_feature_torch_lacks():
    with pytest.raises(ValueError, match=re.escape("torch.nn.MultiheadAttention has no rope, alibi, window; "
                                                   "build this module without them to convert it")):
        MultiHeadAttention(E, H, rope=True, alibi=True, window=2).to_torch()


def test_dispatch_takes_the_modules_causal_flag_and_its_override():
    causal = MultiHeadAttention(E, H, is_causal=True)
    x = torch.randn(B, S, E)
    assert causal.dispatch(x).request.is_causal
    assert not causal.dispatch(x, is_causal=False).request.is_causal
    assert MultiHeadAttention(E, H).dispatch(x, is_causal=True).request.is_causal


def test_forward_packed_runs_the_modules_own_backend():
    mha = MultiHeadAttention(E, H, backend="matmul")
    with headwise_trace() as t:
        mha.forward_packed(torch.randn(5, E), torch.tensor([0, 3, 5]))
    kernels = [s.note for s in t.stages if s.name == "kernel"]
    assert kernels and all(note.startswith("backend 'matmul'") for note in kernels)


def test_a_cache_step_takes_a_3d_mask_over_every_position():
    mha = MultiHeadAttention(E, H).eval()
    x = torch.randn(B, 4, E)
    cache = mha.new_cache(B, 4)
    step_mask = torch.tensor([[[1, 0, 1, 1]], [[0, 1, 1, 1]]], dtype=torch.bool)  # (B, 1, L): one query's keys
    with torch.no_grad():
        mha(x[:, :3], cache=cache, is_causal=True)
        step = mha(x[:, 3:], step_mask, cache=cache, is_causal=True)
        full = mha(x, torch.cat([torch.ones(B, 3, 4, dtype=torch.bool), step_mask], dim=1), is_causal=True)
    close(step, full[:, 3:])


def test_a_float_padding_mask_cannot_be_remembered_by_a_cache():
    mha = MultiHeadAttention(E, H)
    with pytest.raises(TypeError, match=re.escape(
            "with a cache, give the 2-D padding mask as bool or integer (True / 1 = token); "
            "a floating (B, Sk) bias cannot be remembered across steps")):
        mha(torch.randn(B, 2, E), torch.zeros(B, 2), cache=mha.new_cache(B, 4))


# --- the projections are ordinary nn.Linear modules --------------------------------------------


def test_the_projections_are_ordinary_linear_modules():
    mha = MultiHeadAttention(E, H, num_kv_heads=2)
    kv = 2 * (E // H)
    assert [n for n, _ in mha.named_parameters()] == [
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
        "out_proj.weight", "out_proj.bias"]
    assert all(type(m) is nn.Linear for m in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj))
    assert (mha.q_proj.weight.shape, mha.k_proj.weight.shape, mha.v_proj.bias.shape) == ((E, E), (kv, E), (kv,))
    x = torch.randn(B, S, E)
    before = [p.weight.clone() for p in (mha.q_proj, mha.k_proj, mha.v_proj)]
    opt = torch.optim.SGD(mha.parameters(), lr=0.1)
    mha(x, is_causal=True).sum().backward()
    opt.step()
    assert all(not torch.equal(p.weight, b) for p, b in zip((mha.q_proj, mha.k_proj, mha.v_proj), before,
                                                             strict=True))
    assert "(q_proj): Linear(in_features=16, out_features=16, bias=True)" in repr(mha)


def test_state_dict_keeps_the_separate_names_and_loads_old_and_fused_checkpoints():
    import copy
    import pickle

    mha = MultiHeadAttention(E, H, num_kv_heads=2)
    sd = mha.state_dict()
    assert list(sd) == ["q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                        "v_proj.bias", "out_proj.weight", "out_proj.bias"]
    old = {k: v.clone() for k, v in sd.items()}
    fresh = MultiHeadAttention(E, H, num_kv_heads=2)
    assert not fresh.load_state_dict(old).missing_keys
    for name, value in old.items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0)
    projections = (mha.q_proj, mha.k_proj, mha.v_proj)
    fused = {"qkv_weight": torch.cat([p.weight.detach() for p in projections]),  # earlier versions' layout
             "qkv_bias": torch.cat([p.bias.detach() for p in projections]),
             "out_proj.weight": mha.out_proj.weight.detach(), "out_proj.bias": mha.out_proj.bias.detach()}
    again = MultiHeadAttention(E, H, num_kv_heads=2)
    assert not again.load_state_dict(fused).missing_keys
    for name, value in old.items():
        torch.testing.assert_close(again.state_dict()[name], value, rtol=0, atol=0)
    partial = {k: v for k, v in old.items() if k != "k_proj.weight"}
    result = MultiHeadAttention(E, H, num_kv_heads=2).load_state_dict(partial, strict=False)
    assert result.missing_keys == ["k_proj.weight"] and result.unexpected_keys == []
    for clone in (copy.deepcopy(mha), pickle.loads(pickle.dumps(mha))):
        torch.testing.assert_close(clone.q_proj.weight, mha.q_proj.weight, rtol=0, atol=0)
    nobias = MultiHeadAttention(E, H, bias=False)
    assert nobias.q_proj.bias is None and "q_proj.bias" not in nobias.state_dict()


def test_a_mask_without_padding_is_dropped_and_padded_rows_are_zeroed_in_place():
    """An all-True (B, S) mask attends as no mask (the maskless path, no zero fill); a padded
    row's output is exactly zero, with zero gradients, on the dense path."""
    torch.manual_seed(4)
    mha = MultiHeadAttention(E, H, packing=False)
    x = torch.randn(3, 5, E, requires_grad=True)
    full = torch.ones(3, 5, dtype=torch.bool)
    assert mha.plan(x, full).lengths == (5, 5, 5)
    torch.testing.assert_close(mha(x, full), mha(x), rtol=0, atol=0)
    with headwise_trace() as t:
        mha(x, full)
    assert "padding mask" in t.names() and "zero padding" not in t.names()
    mask = torch.tensor([[1] * 5, [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    out = mha(x, mask)
    assert (out[1, 2:] == 0).all() and (out[2, 1:] == 0).all() and (out[0] != 0).all()
    (gx,) = torch.autograd.grad(out.sum(), x)
    # padded positions are keys nobody attends and queries whose output is zeroed: no gradient
    assert (gx[1, 2:] == 0).all() and (gx[2, 1:] == 0).all()


# --- a value head dim of its own (v_head_dim) and sink tokens ------------------------------------

DV = 6  # against D = E // H = 4


def test_value_head_dim_sizes_the_v_and_output_projections():
    mha = MultiHeadAttention(E, H, num_kv_heads=2, v_head_dim=DV)
    D = E // H
    assert (mha.head_dim, mha.v_head_dim) == (D, DV)
    shapes = {k: tuple(v.shape) for k, v in mha.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (E, E), "k_proj.weight": (2 * D, E), "v_proj.weight": (2 * DV, E),
        "q_proj.bias": (E,), "k_proj.bias": (2 * D,), "v_proj.bias": (2 * DV,),
        "out_proj.weight": (E, H * DV), "out_proj.bias": (E,),
    }
    assert "v_head_dim=6" in repr(mha) and "Linear(in_features=16, out_features=12" in repr(mha.v_proj)
    projections = (mha.q_proj, mha.k_proj, mha.v_proj)
    fused = MultiHeadAttention(E, H, num_kv_heads=2, v_head_dim=DV)  # an earlier version's fused checkpoint
    fused.load_state_dict({"qkv_weight": torch.cat([p.weight.detach() for p in projections]),
                           "qkv_bias": torch.cat([p.bias.detach() for p in projections]),
                           **{k: v for k, v in mha.state_dict().items() if k.startswith("out_proj")}})
    for name, value in mha.state_dict().items():
        torch.testing.assert_close(fused.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["self", "cross", "window-sinks"])
def test_value_head_dim_and_sinks_match_the_float64_reference(backend, case, ref):
    """The module with v_head_dim (and sink tokens) equals its projections around the reference, gradients too."""
    kwargs = {"window": 3, "sink_tokens": 1} if case == "window-sinks" else {}
    mha = MultiHeadAttention(E, H, num_kv_heads=2, v_head_dim=DV, backend=backend, dtype=torch.float64, **kwargs)
    x = torch.randn(B, 7, E, dtype=torch.float64, requires_grad=True)
    context = torch.randn(B, Sk, E, dtype=torch.float64) if case == "cross" else None
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2]) if case != "cross" else torch.tensor([[1, 1, 1], [1, 0, 0]])
    out = mha(x, mask, context=context, is_causal=case != "cross")
    src = x if context is None else context
    q = mha.q_proj(x).unflatten(-1, (H, -1)).transpose(1, 2)  # (B, H, S, D)
    k = mha.k_proj(src).unflatten(-1, (2, -1)).transpose(1, 2)  # (B, Hkv, Sk, D)
    v = mha.v_proj(src).unflatten(-1, (2, -1)).transpose(1, 2)  # (B, Hkv, Sk, Dv)
    want, _ = ref(q, k, v, mask, is_causal=case != "cross", **kwargs)
    want = mha.out_proj(want.transpose(1, 2).flatten(2))  # (B, S, H*Dv) -> (B, S, E)
    if case != "cross":
        want = want.masked_fill(~mask.bool()[..., None], 0.0)  # padded queries output zeros
    assert out.shape == (B, 7, E)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, dtype=torch.float64)
    leaves = (x, mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight, mha.out_proj.weight)
    for got, exact in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(want, leaves, g), strict=True):
        torch.testing.assert_close(got, exact, atol=1e-10, rtol=1e-10)


def test_value_head_dim_on_the_packed_path_equals_the_dense_one():
    x, mask = torch.randn(3, 6, E), torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 4 + [0] * 2])
    dense = MultiHeadAttention(E, H, v_head_dim=DV, packing=False, is_causal=True)
    packed = MultiHeadAttention(E, H, v_head_dim=DV, packing=True, is_causal=True)
    packed.load_state_dict(dense.state_dict())
    assert packed.plan(x, mask).path == "packed"
    close(packed(x, mask), dense(x, mask))
    with headwise_trace() as t:
        packed(x, mask)
    merge = next(s for s in t.stages if s.name == "merge heads")
    assert merge.shape == (12, H * DV) and "(T, H, Dv) -> (T, H*Dv)" in merge.note


def test_the_trace_shows_the_value_head_dim():
    mha = MultiHeadAttention(E, H, num_kv_heads=2, v_head_dim=DV, backend="matmul")
    with headwise_trace() as t:
        mha(torch.randn(B, S, E))
    stages = {s.name: s for s in t.stages}
    assert stages["v projection"].shape == (B, S, 2 * DV)
    assert "(Hkv*Dv, E)^T + b, Hkv*Dv = 12" in stages["v projection"].note
    assert "v: (B, Hkv, Sk, Dv) = (2, 2, 5, 6)" in stages["split heads k, v"].note
    assert stages["weighted sum"].shape == (B, H, S, DV)
    assert stages["merge heads"].shape == (B, S, H * DV)
    assert stages["merge heads"].note.endswith("= transpose(1, 2).contiguous().view(B, S, H * Dv)")
    assert stages["output projection"].note == "out_proj: (B, S, H*Dv) x (E, H*Dv)^T + b"


def test_value_head_dim_and_sinks_with_a_static_cache_decode_as_forward():
    torch.manual_seed(7)
    mha = MultiHeadAttention(E, H, num_kv_heads=2, v_head_dim=DV, window=3, sink_tokens=2, rope=True).eval()
    x = torch.randn(B, 9, E)
    cache = mha.new_cache(B, 12, static=True)
    assert cache.v.shape == (B, 2, 12, DV) and cache.k.shape == (B, 2, 12, E // H)
    with torch.no_grad():
        full = mha(x, is_causal=True)
        steps = [mha(x[:, :4], cache=cache, is_causal=True)] + [mha(x[:, t:t + 1], cache=cache, is_causal=True)
                                                                for t in range(4, 9)]
    close(torch.cat(steps, 1), full)


def test_module_sink_tokens_reach_the_kernel():
    mha = MultiHeadAttention(16, 2, window=2, sink_tokens=1, backend="matmul").eval()
    x = torch.randn(1, 5, 16)
    _, w = mha(x, need_weights=True)
    assert (w[0, :, 4, 0] > 0).all() and (w[0, :, 4, 1:3] == 0).all() and (w[0, :, 4, 3:] > 0).all()
    assert mha.dispatch(x).request.sink_tokens == 1 and "sink_tokens=1" in repr(mha)


def test_torch_conversions_refuse_a_value_head_dim_of_its_own():
    with pytest.raises(ValueError, match=re.escape("torch.nn.MultiheadAttention's value heads are embed_dim // "
                                                   "num_heads = 4 wide; this module has v_head_dim=6 (torch's vdim "
                                                   "is the width of the value input, not of a head")):
        MultiHeadAttention(E, H, v_head_dim=DV).to_torch()
    with pytest.raises(ValueError, match=re.escape("v_head_dim=6: torch.nn.MultiheadAttention's value heads are "
                                                   "embed_dim // num_heads = 4 wide")):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H), v_head_dim=DV)
    assert MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H), v_head_dim=E // H).v_head_dim == E // H
    with pytest.raises(ValueError, match="has no window"):
        MultiHeadAttention(E, H, window=2, sink_tokens=1).to_torch()


def test_context_parallel_refuses_sinks_and_a_value_head_dim():
    from headwise.distributed import ContextParallel

    for kwargs in ({"v_head_dim": DV}, {"window": 2, "sink_tokens": 1}):
        with pytest.raises(ValueError, match=r"context_parallel has no sink tokens and no v_head_dim of its own"):
            MultiHeadAttention(E, H, context_parallel=ContextParallel(), **kwargs)


def test_masks_of_one_shape_and_other_lengths_each_get_their_own_result():
    """The dense path hands its read key counts to the functional memo: a later mask of the
    same shape but other counts is its own call (checked against the textbook kernel)."""
    torch.manual_seed(6)
    mha = MultiHeadAttention(E, H, packing=False).eval()
    plain = MultiHeadAttention(E, H, packing=False, backend="matmul").eval()
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(3, 6, E)
    with torch.no_grad():
        for lengths in ([6, 2, 1], [6, 2, 1], [6, 5, 4], [1, 1, 6]):
            mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
            torch.testing.assert_close(mha(x, mask), plain(x, mask), atol=1e-5, rtol=1e-5)


# --- a repeated call signature: the remembered plan and attention call ---------------------------


def _counting_plans(monkeypatch):
    planned = []
    real = planning.make_plan  # plan() and forward's planning
    monkeypatch.setattr(planning, "make_plan", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    return planned


def test_a_changed_setting_or_policy_plans_the_next_call_afresh(monkeypatch, cheap_packing):
    """The memo keys on the call, not the module's settings or the thresholds: assigning any
    attribute (packing, backend, dropout, train / eval) or any ``headwise.policy`` value
    forgets what was remembered, and the next call follows the new setting."""
    from headwise import packing

    planned = _counting_plans(monkeypatch)
    packed = []
    real_pack = packing.pack
    monkeypatch.setattr(packing, "pack", lambda *a, **kw: packed.append(1) or real_pack(*a, **kw))
    mha = MultiHeadAttention(E, H, packing=False).eval()
    plain = MultiHeadAttention(E, H, backend="matmul", packing=False).eval()
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(3, 6, E)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5])
    with torch.no_grad():
        want = plain(x, mask)
        for setting in (None, ("packing", "auto"), ("backend", "chunked"), ("dropout", 0.0), ("train", None)):
            if setting == ("train", None):
                mha.train().eval()
            elif setting is not None:
                setattr(mha, *setting)
            before = len(planned)
            for _ in range(3):
                close(mha(x, mask), want)
            assert len(planned) == before + 1, setting
        assert len(packed) == 3  # packing="auto" under cheap_packing packs, until backend="chunked"
        mha.backend = "auto"
        before = len(planned)
        close(mha(x, mask), want)
        assert (len(planned), len(packed)) == (before + 1, 4)
        monkeypatch.setattr(policy, "PACK_MIN_PADDING", 0.99)  # now nothing is priced: dense
        close(mha(x, mask), want)
        close(mha(x, mask), want)
        assert (len(planned), len(packed)) == (before + 2, 4)


def test_a_module_that_remembers_calls_pickles_and_copies_and_follows_a_replaced_kernel(monkeypatch):
    import copy
    import dataclasses
    import pickle

    from headwise.kernels import registry

    mha = MultiHeadAttention(E, H, packing=False).eval()
    x = torch.randn(2, 5, E)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])  # padding: the dense path, not the fused one
    with torch.no_grad():
        want = mha(x, mask)
        assert mha._repeats  # the signature is remembered
        for clone in (copy.deepcopy(mha), pickle.loads(pickle.dumps(mha))):
            assert not clone._repeats
            torch.testing.assert_close(clone(x, mask), want, rtol=0, atol=0)
        seen = []
        original = registry.get_kernel("sdpa")
        replaced = dataclasses.replace(original, fn=lambda *a, **kw: seen.append(1) or original.fn(*a, **kw))
        monkeypatch.setitem(registry._KERNELS, "sdpa", replaced)
        torch.testing.assert_close(mha(x, mask), want, rtol=0, atol=0)
    assert seen == [1]  # the remembered call held the old kernel object: planned and dispatched again


def test_deleting_an_attribute_forgets_the_remembered_calls(monkeypatch):
    planned = _counting_plans(monkeypatch)
    mha = MultiHeadAttention(E, H, packing=False).eval()
    x, mask = torch.randn(2, 5, E), torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    mha.tag = "a user's attribute"
    with torch.no_grad():
        want = mha(x, mask)
        mha(x, mask)
        assert mha._repeats and len(planned) == 1
        del mha.tag
        assert not mha._repeats
        torch.testing.assert_close(mha(x, mask), want, rtol=0, atol=0)
    assert len(planned) == 2


def test_while_auto_logs_its_choices_every_call_logs_one(caplog):
    """At DEBUG on "headwise.dispatch" each call goes through the dispatch to say its choice:
    nothing is remembered, before or after the level changes."""
    import logging

    mha = MultiHeadAttention(E, H, packing=False).eval()
    x, mask = torch.randn(2, 5, E), torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    with torch.no_grad():
        mha(x, mask)  # remembered at the default level
        caplog.set_level(logging.DEBUG, logger="headwise.dispatch")
        for _ in range(3):
            mha(x, mask)
    records = [r for r in caplog.records if r.name == "headwise.dispatch"]
    assert len(records) == 3 and all(r.getMessage().startswith("auto chose backend") for r in records)


def test_a_module_whose_attention_cannot_be_prepared_still_plans_once(monkeypatch):
    """A window (or ALiBi, soft-capping, sinks) keeps the attention call out of the memo, but
    the plan of a repeated signature is remembered all the same."""
    planned = _counting_plans(monkeypatch)
    mha = MultiHeadAttention(E, H, window=2, packing=False).eval()
    x, mask = torch.randn(2, 5, E), torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    with torch.no_grad():
        want = mha(x, mask)
        for _ in range(3):
            torch.testing.assert_close(mha(x, mask), want, rtol=0, atol=0)
    assert len(planned) == 1


def test_an_out_proj_hook_whose_result_autograd_saves_trains_with_padding():
    """A forward hook on out_proj may return a tensor autograd saves (tanh keeps its result):
    zeroing the padded positions must not write it in place, and the gradients equal those of
    the same computation by hand in float64."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, packing=False, dtype=torch.float64)
    mha.out_proj.register_forward_hook(lambda module, args, output: torch.tanh(output))
    x = torch.randn(2, 5, E, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]], dtype=torch.bool)
    out = mha(x, mask)
    out.sum().backward()
    w = {n: getattr(mha, n) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    xr = x.detach().clone().requires_grad_()
    q, k, v = (w[n](xr).view(2, 5, H, E // H).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
    a = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(E // H) + torch.zeros(2, 1, 1, 5, dtype=torch.float64)
                      .masked_fill(~mask[:, None, None, :], float("-inf")), -1) @ v
    want = w["out_proj"](a.transpose(1, 2).reshape(2, 5, E)) * mask[..., None]  # the hook ran inside out_proj
    want.sum().backward()
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-12)


def test_a_remembered_call_of_a_qk_norm_module_without_rope_still_normalises():
    """The repeated call's way (dense.forward_repeat) runs q/k norm whether or not rope is on:
    every call equals the float64 module's first."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, qk_norm="rms", packing=False, dtype=torch.float64).eval()
    with torch.no_grad():
        mha.q_norm.weight.uniform_(0.5, 2.0)  # a norm that changes the scores
        mha.k_norm.weight.uniform_(0.5, 2.0)
        x, mask = torch.randn(2, 5, E, dtype=torch.float64), torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
        want = MultiHeadAttention(E, H, qk_norm="rms", backend="matmul", dtype=torch.float64).eval()
        want.load_state_dict(mha.state_dict())
        want = want(x, mask)
        for _ in range(3):
            torch.testing.assert_close(mha(x, mask), want, rtol=0, atol=1e-12)


def test_a_module_pickled_before_the_memo_existed_gets_one():
    """An earlier version's pickle has no ``_repeats``: unpickling adds an empty memo, and the
    module then remembers its calls as a new one does."""
    from headwise.module.memo import Memo

    mha = MultiHeadAttention(E, H, packing=False).eval()
    state = dict(mha.__dict__)
    del state["_repeats"]
    old = MultiHeadAttention.__new__(MultiHeadAttention)
    old.__setstate__(state)
    assert type(old._repeats) is Memo and not old._repeats
    x, mask = torch.randn(2, 5, E), torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    with torch.no_grad():
        torch.testing.assert_close(old(x, mask), mha(x, mask), rtol=0, atol=0)
    assert old._repeats


def test_a_remembered_padded_call_skips_the_dead_row_guard_only_where_every_row_has_a_token():
    """The dense path prepares its attention call from the mask's real keys per row: with a
    token in every row the kernel is told so (``known_live``, no guard over the mask on each
    call); a row of padding alone keeps the guard, and its output is zeros."""
    mha = MultiHeadAttention(E, H, packing=False).eval()
    x = torch.randn(3, 5, E)
    live = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    dead = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [0] * 5])
    with torch.no_grad():
        mha(x, live)
        out = mha(x, dead)
    guards = {key[3][3]: repeat.attention.args.get("known_live") for key, repeat in mha._repeats.items()}
    assert guards == {(5, 3, 1): True, (5, 3, 0): None}
    assert out[2].eq(0).all() and out[:2].isfinite().all()


def test_the_memo_holds_at_most_its_limit_of_call_signatures():
    """A module called with ever new shapes starts its memo over when it is full: it never
    holds more than memo.LIMIT signatures, and the newest is among them."""
    from headwise.module import memo

    mha = MultiHeadAttention(E, H, packing=False).eval()
    with torch.no_grad():
        for S in range(1, memo.LIMIT + 2):
            mha(torch.randn(1, S, E))
            assert len(mha._repeats) <= memo.LIMIT
    assert len(mha._repeats) == 1 and next(iter(mha._repeats))[0] == (1, memo.LIMIT + 1, E)


def test_the_plan_of_a_call_with_rules_and_weights_says_why_it_is_dense():
    """With mask_mod, a call that the fused path would take reports the replacement; one that
    asks for weights was dense anyway, and its reason says so, not "was: fused"."""
    from headwise.masks import causal

    mha = MultiHeadAttention(E, H).eval()
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        assert mha.plan(x).path == "fused"
        ruled = mha.plan(x, mask_mod=causal)
        weights = mha.plan(x, need_weights=True, mask_mod=causal)
    assert ruled.path == weights.path == "dense"
    assert ruled.why.endswith("(was: fused)")
    assert "fused" not in weights.why and weights.why == mha.plan(x, need_weights=True).why


def test_reference_weight_is_out_projs_weight_also_where_out_proj_is_wrapped():
    """The weight the inputs' dtype and device are checked against is out_proj's, read through
    a wrapper that exposes ``.weight`` (as PEFT's layers do); the first parameter only where
    out_proj has no weight."""

    class Wrapped(nn.Module):
        def __init__(self, inner: nn.Linear) -> None:
            super().__init__()
            self.extra = nn.Parameter(torch.zeros(1, dtype=torch.float64))  # its first parameter, another dtype
            self.inner = inner

        @property
        def weight(self) -> torch.Tensor:
            return self.inner.weight

        def forward(self, x):
            return self.inner(x)

    mha = MultiHeadAttention(E, H)
    mha.out_proj = Wrapped(mha.out_proj)
    assert mha.reference_weight() is mha.out_proj.inner.weight
    mha.out_proj = nn.Identity()  # no weight: the module's first parameter
    assert mha.reference_weight() is mha.q_proj.weight


def test_calls_with_and_without_gradients_flowing_are_remembered_apart(monkeypatch):
    """A frozen module in grad mode: a call whose input takes no gradient is priced as a
    forward, one whose input does as forward + backward. Each is planned (and remembered)
    under its own key, and the gradient reaches x."""
    planned = _counting_plans(monkeypatch)
    mha = MultiHeadAttention(E, H, dtype=torch.float64).eval().requires_grad_(False)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]])
    want = mha(x, mask)
    xg = x.clone().requires_grad_()
    for _ in range(2):
        torch.testing.assert_close(mha(x, mask), want, rtol=0, atol=0)
        mha(xg, mask).sum().backward()
    assert len(planned) == 2
    assert sorted("forward + backward estimated" in r.why for r in mha._repeats.values()) == [False, True]
    assert xg.grad is not None and xg.grad[1, 3:].eq(0).all() and xg.grad[0].ne(0).any()


def test_traces_autocast_and_weights_are_not_remembered(monkeypatch):
    """Explain mode records every stage on every call, autocast changes q's dtype, and
    need_weights returns more: each takes the full path, also after a remembered call."""
    planned = _counting_plans(monkeypatch)
    mha = MultiHeadAttention(E, H).eval()
    x = torch.randn(2, 5, E)
    mask = torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])
    with torch.no_grad():
        mha(x, mask)
        mha(x, mask)
        assert len(planned) == 1
        with headwise_trace() as t:
            mha(x, mask)
        assert {"q projection", "kernel", "merge heads", "zero padding"} <= set(t.names())
        out, weights = mha(x, mask, need_weights=True)
        assert weights.shape == (2, H, 5, 5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert mha(x, mask).dtype == torch.bfloat16
            assert mha(x, mask).dtype == torch.bfloat16
        assert mha(x, mask).dtype == torch.float32
    assert len(planned) == 1 + 4  # one remembered signature, four full calls, and none after them


@pytest.mark.parametrize("change", [
    "gradients", "backend", "padding", "causal", "gqa", "rope", "bias", "hook", "size", "weights", "trace", "dropout",
    "weight-copy", "quantised", "wrapped",
])
def test_the_fused_path_is_only_for_plain_small_calls_without_gradients(change):
    """nn.MultiheadAttention's fused op cannot run a named kernel, a mask with padding, a
    causal rule, GQA or rope, lacks biases and hooks, returns no weights and no gradients,
    and loses beyond policy.FUSED_MAX_ELEMENTS: each such call keeps the dense path."""
    kwargs = {"backend": {"backend": "sdpa"}, "gqa": {"num_kv_heads": 2}, "rope": {"rope": True},
              "bias": {"bias": False}, "dropout": {"dropout": 0.1}}.get(change, {})
    mha = MultiHeadAttention(E, H, **kwargs).train(change == "dropout")
    x = torch.randn(2, 5, E) if change != "size" else torch.randn(2, policy.FUSED_MAX_ELEMENTS // (2 * E) + 1, E)
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]) if change == "padding" else None
    if change == "hook":
        mha.out_proj.register_forward_hook(lambda module, args, out: None)
    if change == "weight-copy":  # 3 E^2 weights copied per call for a call of 1 x 1 x E: too dear
        x = torch.randn(1, 1, E)
        assert 3 * E * E > policy.FUSED_MAX_WEIGHT_COPY * x.numel()
    if change == "quantised":  # a weight of a tensor subclass (torchao's, say): the op cannot read it
        class Subclass(torch.Tensor):
            pass

        mha.k_proj.weight = nn.Parameter(mha.k_proj.weight.detach().as_subclass(Subclass))
    if change == "wrapped":  # PEFT or a user's module in place of a projection: it must be called
        mha.q_proj = nn.Sequential(mha.q_proj)
    call = {"is_causal": True} if change == "causal" else {"need_weights": True} if change == "weights" else {}
    with torch.no_grad():
        assert MultiHeadAttention(E, H).eval().plan(torch.randn(2, 5, E)).path == "fused"  # without the change
    traced = headwise_trace() if change == "trace" else warnings.catch_warnings()
    with torch.set_grad_enabled(change == "gradients"), traced:
        plan = mha.plan(x, mask, **call)
        assert plan.path != "fused", plan.why

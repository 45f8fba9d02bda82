"""What the module refuses, and with which words (src/headwise/module/checks.py).

Each refusal is asserted on its message: the values the caller gave and the remedy. Each
limit is tested from both sides (the last accepted value and the first refused one), and an
accepted call is compared with a float64 plain-math reference of the module's weights.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length, D head
dim, E embed dim.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

import headwise
from headwise.distributed import ContextParallel
from headwise.module import checks

E, H = 32, 4
D = E // H


def reference(mha, x, context=None):
    """(B, S, E) float64: attention of ``mha``'s weights written out (MHA, no mask)."""
    w = {n: t.detach().double() for n, t in mha.state_dict().items()}
    x = x.double()
    context = x if context is None else context.double()
    B, S, _ = x.shape

    def linear(t, name):
        return t @ w[f"{name}.weight"].T + w[f"{name}.bias"]  # (B, S, in) x (in, out) -> (B, S, out)

    q = linear(x, "q_proj").reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    k = linear(context, "k_proj").reshape(B, -1, H, D).transpose(1, 2)  # (B, H, Sk, D)
    v = linear(context, "v_proj").reshape(B, -1, H, D).transpose(1, 2)  # (B, H, Sk, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, E)  # (B, H, S, D) -> (B, S, E)
    return linear(out, "out_proj")


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------- the sizes


@pytest.mark.parametrize("name", ["embed_dim", "num_heads", "num_kv_heads"])
@pytest.mark.parametrize("value, error, message", [
    (4.0, TypeError, "{name} must be an int, got float (4.0)"),
    (True, TypeError, "{name} must be an int, got bool (True)"),
    ("4", TypeError, "{name} must be an int, got str ('4')"),
    (0, ValueError, "{name} must be positive, got 0"),
    (-4, ValueError, "{name} must be positive, got -4"),
])
def test_each_size_must_be_a_positive_int(name, value, error, message):
    sizes = {"embed_dim": 32, "num_heads": 4, "num_kv_heads": 2, name: value}
    with pytest.raises(error, match="^" + re.escape(message.format(name=name)) + "$"):
        headwise.MultiHeadAttention(**sizes)


@pytest.mark.parametrize("sizes, message", [
    ((30, 4, None), "num_heads (4) must divide embed_dim (30); try num_heads=3 or 5"),
    ((7, 2, None), "num_heads (2) must divide embed_dim (7); try num_heads=1 or 7"),
    ((4, 8, None), "num_heads (8) must divide embed_dim (4); try num_heads=4"),
    ((32, 4, 3), "num_kv_heads (3) must divide num_heads (4); try num_kv_heads=2 or 4"),
    ((32, 4, 8), "num_kv_heads (8) must divide num_heads (4); try num_kv_heads=4"),
])
def test_sizes_that_do_not_divide_name_both_and_the_nearest_divisors(sizes, message):
    embed_dim, num_heads, num_kv_heads = sizes
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        headwise.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("sizes", [(1, 1, 1), (8, 8, 8), (32, 4, 1), (32, 4, 2), (32, 32, 4)])
def test_sizes_that_divide_are_taken(sizes):
    embed_dim, num_heads, num_kv_heads = sizes
    mha = headwise.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads)
    assert (mha.embed_dim, mha.num_heads, mha.num_kv_heads, mha.head_dim) == (*sizes, embed_dim // num_heads)


@pytest.mark.parametrize("v_head_dim", [0, -2, True, False, 4.0, "4"])
def test_v_head_dim_must_be_a_positive_int_or_none(v_head_dim):
    message = f"v_head_dim must be a positive int or None (None: head_dim), got {v_head_dim!r}"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        headwise.MultiHeadAttention(E, H, v_head_dim=v_head_dim)


@pytest.mark.parametrize("v_head_dim, Dv", [(None, D), (1, 1), (D, D), (2 * D, 2 * D)])
def test_v_head_dim_sizes_the_value_heads(v_head_dim, Dv):
    mha = headwise.MultiHeadAttention(E, H, v_head_dim=v_head_dim)
    assert mha.v_head_dim == Dv and mha.v_proj.weight.shape == (H * Dv, E) and mha.out_proj.weight.shape == (E, H * Dv)


# ---------------------------------------------------------------- the options


REFUSED_OPTIONS = [  # (kwargs, error, message)
    ({"dropout": True}, TypeError, "dropout must be a float in [0, 1), got bool (True)"),
    ({"dropout": "0.1"}, TypeError, "dropout must be a float in [0, 1), got str ('0.1')"),
    ({"dropout": None}, TypeError, "dropout must be a float in [0, 1), got NoneType (None)"),
    ({"dropout": 1}, ValueError, "dropout must be in [0, 1), got 1"),
    ({"dropout": -1e-9}, ValueError, "dropout must be in [0, 1), got -1e-09"),
    ({"dropout": float("nan")}, ValueError, "dropout must be in [0, 1), got nan"),
    ({"packing": 1}, ValueError, "packing must be 'auto', True or False, got 1"),
    ({"packing": 0}, ValueError, "packing must be 'auto', True or False, got 0"),
    ({"packing": None}, ValueError, "packing must be 'auto', True or False, got None"),
    ({"packing": "yes"}, ValueError, "packing must be 'auto', True or False, got 'yes'"),
    ({"window": 0}, ValueError, "window must be a positive int (keys per query, its own included), got 0"),
    ({"window": -2}, ValueError, "window must be a positive int (keys per query, its own included), got -2"),
    ({"window": True}, ValueError, "window must be a positive int (keys per query, its own included), got True"),
    ({"window": 2.0}, ValueError, "window must be a positive int (keys per query, its own included), got 2.0"),
    ({"qk_norm": "layer"}, ValueError, "qk_norm must be None or 'rms' (RMSNorm of each head's q and k), got 'layer'"),
    ({"qk_norm": "RMS"}, ValueError, "qk_norm must be None or 'rms' (RMSNorm of each head's q and k), got 'RMS'"),
    ({"qk_norm": True}, ValueError, "qk_norm must be None or 'rms' (RMSNorm of each head's q and k), got True"),
    ({"qk_norm_eps": 0}, ValueError, "qk_norm_eps must be a positive number, got 0"),
    ({"qk_norm_eps": -1e-6}, ValueError, "qk_norm_eps must be a positive number, got -1e-06"),
    ({"qk_norm_eps": True}, ValueError, "qk_norm_eps must be a positive number, got True"),
    ({"qk_norm_eps": "1e-6"}, ValueError, "qk_norm_eps must be a positive number, got '1e-6'"),
    ({"qk_norm_eps": float("nan")}, ValueError, "qk_norm_eps must be a positive number, got nan"),
    ({"softcap": True}, TypeError, "softcap must be a float or None, got bool (True)"),
    ({"softcap": "50"}, TypeError, "softcap must be a float or None, got str ('50')"),
    ({"softcap": 0}, ValueError, "softcap must be a finite number > 0 (Gemma 2 uses 50.0), got 0"),
    ({"softcap": -5.0}, ValueError, "softcap must be a finite number > 0 (Gemma 2 uses 50.0), got -5.0"),
    ({"softcap": math.inf}, ValueError, "softcap must be a finite number > 0 (Gemma 2 uses 50.0), got inf"),
    ({"softcap": math.nan}, ValueError, "softcap must be a finite number > 0 (Gemma 2 uses 50.0), got nan"),
    ({"sinks": 1}, TypeError, "sinks must be True or False (a learnable sink logit per head), got int (1)"),
    ({"sinks": None}, TypeError, "sinks must be True or False (a learnable sink logit per head), got NoneType (None)"),
    ({"sink_tokens": -1, "window": 4}, ValueError, "sink_tokens must be an int >= 0, got -1"),
    ({"sink_tokens": True, "window": 4}, ValueError, "sink_tokens must be an int >= 0, got True"),
    ({"sink_tokens": 1.0, "window": 4}, ValueError, "sink_tokens must be an int >= 0, got 1.0"),
    ({"sink_tokens": 1}, ValueError,
     "sink_tokens=1 keeps the first positions visible under a sliding window; give window=W too"),
]


@pytest.mark.parametrize("kwargs, error, message", REFUSED_OPTIONS, ids=lambda v: repr(v)[:40])
def test_each_option_out_of_range_is_refused_by_name_with_its_value(kwargs, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        headwise.MultiHeadAttention(E, H, **kwargs)


TAKEN_OPTIONS = [  # the last accepted values, at each limit
    {"dropout": 0}, {"dropout": 0.0}, {"dropout": 0.999}, {"packing": "auto"}, {"packing": True}, {"packing": False},
    {"window": 1}, {"qk_norm": "rms"}, {"qk_norm": None}, {"qk_norm_eps": 1}, {"qk_norm_eps": 1e-12},
    {"softcap": 50}, {"softcap": 1e-3}, {"sinks": True}, {"sinks": False}, {"sink_tokens": 0},
    {"sink_tokens": 1, "window": 2}, {"sink_tokens": 0, "window": 3},
]


@pytest.mark.parametrize("kwargs", TAKEN_OPTIONS, ids=repr)
def test_each_option_at_its_limit_is_taken_and_kept(kwargs):
    mha = headwise.MultiHeadAttention(E, H, **kwargs)
    for name, value in kwargs.items():
        if name == "sinks":  # a parameter, or None
            assert (mha.sinks is not None) == value
        elif name != "qk_norm_eps":  # the norms' eps
            assert getattr(mha, name) == value, name
    with torch.no_grad():
        out = mha(rand(2, 3, E))
    assert out.shape == (2, 3, E) and out.isfinite().all()


# ---------------------------------------------------------------- context parallelism


_NO_SOFTCAP = ("context_parallel has no logit soft-capping or attention sinks (its ring merges and Ulysses' kernels "
               "take neither); build the module without softcap/sinks, or without context_parallel")


def _no_sink_tokens(sink_tokens, v_head_dim):
    return (f"context_parallel has no sink tokens and no v_head_dim of its own (got sink_tokens={sink_tokens}, "
            f"v_head_dim={v_head_dim}); build the module without context_parallel")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"context_parallel": "ring"}, TypeError,
     "context_parallel must be a headwise.distributed.ContextParallel or None, got str"),
    ({"softcap": 30.0}, ValueError, _NO_SOFTCAP),
    ({"sinks": True}, ValueError, _NO_SOFTCAP),
    ({"sink_tokens": 1, "window": 4}, ValueError, _no_sink_tokens(1, None)),
    ({"v_head_dim": D - 2}, ValueError, _no_sink_tokens(0, D - 2)),
    ({"v_head_dim": D + 2}, ValueError, _no_sink_tokens(0, D + 2)),
])
def test_context_parallel_refuses_what_its_kernels_cannot_take(kwargs, error, message):
    kwargs = {"context_parallel": ContextParallel(), **kwargs}
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        headwise.MultiHeadAttention(E, H, **kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"v_head_dim": D}, {"window": 4}, {"softcap": None, "sinks": False}])
def test_context_parallel_takes_a_module_it_can_run(kwargs):
    cp = ContextParallel()
    mha = headwise.MultiHeadAttention(E, H, context_parallel=cp, **kwargs)
    assert mha.context_parallel is cp


# ---------------------------------------------------------------- x and context


@pytest.mark.parametrize("name", ["x", "context"])
def test_an_input_of_an_integer_dtype_names_it_and_the_cast(name):
    mha = headwise.MultiHeadAttention(E, H).double()
    bad = torch.ones(2, 3, E, dtype=torch.int32)
    x, context = (bad, None) if name == "x" else (rand(2, 3, E, dtype=torch.float64), bad)
    message = (f"{name} has dtype torch.int32; the module takes floating inputs (its parameters are torch.float64): "
               f"pass {name}.to(torch.float64)")
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        mha(x, context=context)


@pytest.mark.parametrize("name", ["x", "context"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_input_of_another_float_dtype_names_both_and_both_remedies(name, dtype):
    mha = headwise.MultiHeadAttention(E, H)
    bad = rand(2, 3, E, dtype=dtype)
    x, context = (bad, None) if name == "x" else (rand(2, 3, E), bad)
    message = (f"{name} has dtype {dtype} but the module's parameters are torch.float32; convert one to the "
               f"other: {name}.to(torch.float32) or mha.to({dtype}) (or run under torch.autocast)")
    with pytest.raises(TypeError, match="^" + re.escape(message) + "$"):
        mha(x, context=context)


def test_a_double_input_to_a_float_module_names_both_and_the_casts():
    with pytest.raises(TypeError, match="^" + re.escape("x has dtype torch.float64 but the module's parameters are "
                                                  "torch.float32; convert one to the other: x.to(torch.float32) or "
                                                  "mha.to(torch.float64)") + "$"):  # autocast would not help
        headwise.MultiHeadAttention(E, H)(rand(2, 3, E, dtype=torch.float64))


@pytest.mark.parametrize("name", ["x", "context"])
def test_an_input_on_another_device_names_both_devices_and_both_moves(name):
    mha = headwise.MultiHeadAttention(E, H)
    bad = torch.empty(2, 3, E, device="meta")
    x, context = (bad, None) if name == "x" else (rand(2, 3, E), bad)
    message = (f"{name} is on meta but the module's parameters are on cpu; move one to the other: "
               f"{name}.to('cpu') or mha.to('meta')")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        mha(x, context=context)
    meta = headwise.MultiHeadAttention(E, H, device="meta")
    message = ("x is on cpu but the module's parameters are on meta; move one to the other: x.to('meta') or "
               "mha.to('cpu')")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        meta(rand(2, 3, E))


def test_the_device_is_checked_before_the_dtype():
    mha = headwise.MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match="x is on meta"):
        mha(torch.empty(2, 3, E, device="meta", dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad", [False, True])
def test_under_autocast_an_input_of_another_half_dtype_runs(dtype, grad):
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = rand(2, 3, E, dtype=dtype)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        out = mha(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(mha, x), atol=0.05, rtol=0.05)


def test_under_autocast_a_double_input_to_a_float_module_is_a_clear_error():
    mha = headwise.MultiHeadAttention(E, H)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="^" + re.escape(
            "x has dtype torch.float64 but the module's parameters are torch.float32 under torch.autocast, which "
            "does not cast float64; convert one to the other: x.to(torch.float32) or mha.to(torch.float64)") + "$"):
        mha(rand(2, 3, E, dtype=torch.float64))


def test_under_autocast_a_float_input_to_a_double_module_is_a_clear_error():
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="^" + re.escape(
            "x has dtype torch.float32 but the module's parameters are torch.float64 under torch.autocast, which "
            "does not cast float64; convert one to the other: x.to(torch.float64) or mha.to(torch.float32)") + "$"):
        mha(rand(2, 3, E))


def test_autocast_is_off_for_a_device_type_autocast_does_not_know():
    assert checks.autocast_on(torch.device("meta")) is False
    assert checks.autocast_on(torch.device("cpu")) is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert checks.autocast_on(torch.device("cpu")) is True
        assert checks.autocast_on(torch.device("meta")) is False  # autocast is on, but not for this type


def test_a_module_whose_out_proj_has_no_weight_checks_against_its_other_parameters():
    mha = headwise.MultiHeadAttention(E, H).double()
    mha.out_proj = nn.Identity()  # (H*D == E): the reference weight is then the first parameter
    with pytest.raises(TypeError, match="^" + re.escape("x has dtype torch.float32 but the module's parameters are "
                                                  "torch.float64")):
        mha(rand(2, 3, E))
    wrapped = headwise.MultiHeadAttention(E, H).double()
    wrapped.out_proj = nn.Sequential(wrapped.out_proj)
    with pytest.raises(TypeError, match=re.escape("(its parameters are torch.float64): pass x.to(torch.float64)")):
        wrapped(torch.ones(2, 3, E, dtype=torch.int64))
    with torch.no_grad():
        assert wrapped(rand(2, 3, E, dtype=torch.float64)).dtype == torch.float64  # the dtypes agree: it runs


@pytest.mark.parametrize("x, error, message", [
    ([[0.0] * E], TypeError, "x must be a torch.Tensor, got list"),
    (np.zeros((2, 3, E), dtype=np.float32), TypeError, "x must be a torch.Tensor, got ndarray"),
    (torch.zeros(3, E), ValueError, f"x must be (B, S, E) with E = embed_dim = {E}, got shape (3, {E}); add a batch "
     "dimension with x.unsqueeze(0)"),
    (torch.zeros(2, 3, E - 1), ValueError, f"x must be (B, S, E) with E = embed_dim = {E}, got shape (2, 3, {E - 1})"),
    (torch.zeros(1, 2, 3, E), ValueError, f"x must be (B, S, E) with E = embed_dim = {E}, got shape (1, 2, 3, {E})"),
    (torch.zeros(E), ValueError, f"x must be (B, S, E) with E = embed_dim = {E}, got shape ({E},)"),
])
def test_x_of_another_type_or_shape_names_what_it_got(x, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        headwise.MultiHeadAttention(E, H)(x)


@pytest.mark.parametrize("context, error, message", [
    ("keys", TypeError, "context must be a torch.Tensor or None, got str"),
    (torch.zeros(5, E), ValueError, f"context must be (B, Sk, E) with E = embed_dim = {E}, got shape (5, {E})"),
    (torch.zeros(2, 5, E + 1), ValueError, f"context must be (B, Sk, E) with E = embed_dim = {E}, got shape "
     f"(2, 5, {E + 1})"),
    (torch.zeros(3, 5, E), ValueError, "context batch (3) differs from x batch (2)"),
])
def test_a_context_of_another_type_shape_or_batch_names_what_it_got(context, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        headwise.MultiHeadAttention(E, H)(torch.zeros(2, 3, E), context=context)


def test_a_context_of_its_own_length_is_attended():
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, context = rand(2, 3, E, seed=1), rand(2, 5, E, seed=2)
    with torch.no_grad():
        out = mha(x, context=context)
    torch.testing.assert_close(out.double(), reference(mha, x, context), atol=1e-5, rtol=0)


def test_rope_refuses_cross_attention_with_the_remedy():
    mha = headwise.MultiHeadAttention(E, H, rope=True)
    message = "rotary embeddings (rope) are for self-attention; drop context= or rope"
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        mha(torch.zeros(2, 3, E), context=torch.zeros(2, 5, E))
    assert mha(torch.zeros(2, 3, E)).shape == (2, 3, E)  # self-attention: taken


# ---------------------------------------------------------------- caches


def test_a_cache_that_is_not_a_kv_cache_is_refused_with_where_to_get_one():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    with torch.no_grad(), pytest.raises(TypeError, match="^" + re.escape("cache must come from mha.new_cache(...), got "
                                                                   "dict") + "$"):
        mha(torch.zeros(2, 1, E), cache={})


def test_a_cache_with_cross_attention_is_refused():
    mha = headwise.MultiHeadAttention(E, H)
    cache = mha.new_cache(2, 8)
    message = "cache is for self-attention; cross-attention (context=...) takes no cache"
    with torch.no_grad(), pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        mha(torch.zeros(2, 1, E), context=torch.zeros(2, 4, E), cache=cache)
    assert len(cache) == 0


@pytest.mark.parametrize("maker, held", [
    (lambda: headwise.MultiHeadAttention(E, H, num_kv_heads=2), "kv_heads=2, head_dim=8, value_dim=8, torch.float32 "
     "on cpu"),
    (lambda: headwise.MultiHeadAttention(E, 2, num_kv_heads=2), "kv_heads=2, head_dim=16, value_dim=16, "
     "torch.float32 on cpu"),
    (lambda: headwise.MultiHeadAttention(E, H, v_head_dim=6), "kv_heads=4, head_dim=8, value_dim=6, torch.float32 "
     "on cpu"),
    (lambda: headwise.MultiHeadAttention(E, H, dtype=torch.float64), "kv_heads=4, head_dim=8, value_dim=8, "
     "torch.float64 on cpu"),
    (lambda: headwise.MultiHeadAttention(E, H, device="meta"), "kv_heads=4, head_dim=8, value_dim=8, torch.float32 "
     "on meta"),
])
def test_a_cache_made_by_a_module_of_other_shapes_names_both_and_the_remedy(maker, held):
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = maker().new_cache(2, 8)
    message = (f"the cache holds {held}; this module needs kv_heads=4, head_dim=8, value_dim=8, torch.float32 on "
               "cpu: make the cache with this module's new_cache(batch_size, max_seq_len)")
    with torch.no_grad(), pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        mha(rand(2, 1, E), cache=cache)


def test_a_cache_made_by_a_module_of_the_same_shapes_is_taken():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    cache = headwise.MultiHeadAttention(E, H).new_cache(2, 8)
    x = rand(2, 3, E)
    with torch.no_grad():
        mha(x[:, :2], cache=cache)
        step = mha(x[:, 2:], cache=cache)  # (2, 1, E)
        whole = mha(x)
    torch.testing.assert_close(step, whole[:, 2:], atol=1e-5, rtol=0)


def test_a_cache_of_another_batch_or_without_room_is_refused_before_it_changes():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = mha.new_cache(2, 4)
    with torch.no_grad():
        mha(rand(2, 3, E), cache=cache)
        message = ("the cache was made for batch_size 2, got a batch of 3; make one with mha.new_cache(batch_size, "
                   "max_seq_len) per batch size")
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            mha(rand(3, 1, E), cache=cache)
        with pytest.raises(ValueError, match="^" + re.escape("the cache holds 3 of max_seq_len 4 positions and cannot "
                                                       "take 2 more")):
            mha(rand(2, 2, E), cache=cache)
        assert len(cache) == 3
        mha(rand(2, 1, E), cache=cache)  # the last slot: taken
    assert len(cache) == 4


@pytest.mark.parametrize("x, error, message", [
    ([[0.0] * E], TypeError, "x must be a torch.Tensor, got list"),
    (torch.zeros(5, E), ValueError, f"got shape (5, {E}); add a batch dimension with x.unsqueeze(0)"),
    (torch.zeros(1, 2, 1, E), ValueError, f"got shape (1, 2, 1, {E})"),
])
def test_with_a_cache_x_of_another_type_or_shape_still_names_x(x, error, message):
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = mha.new_cache(2, 8)
    with torch.no_grad(), pytest.raises(error, match=re.escape(message) + "$"):
        mha(x, cache=cache)


def test_a_cache_step_with_gradients_on_is_not_refused():
    # decoding without torch.no_grad() works, as with transformers' caches (tests/module/test_cached.py
    # checks its gradients); the module's parameters, x, or one parameter take gradients
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = mha.new_cache(2, 8)
    assert mha(rand(2, 3, E), cache=cache).requires_grad
    mha.requires_grad_(False)
    assert mha(rand(2, 1, E).requires_grad_(), cache=cache).requires_grad
    mha.out_proj.requires_grad_(True)
    assert mha(rand(2, 1, E), cache=cache).requires_grad
    assert len(cache) == 5


def test_a_cache_step_of_a_frozen_module_runs_with_gradients_on():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval().requires_grad_(False)
    x = rand(2, 3, E)
    cache = mha.new_cache(2, 8)
    with torch.enable_grad():
        out = mha(x, cache=cache)
    with torch.no_grad():
        want = mha(x)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    assert len(cache) == 3


def test_the_cache_is_checked_before_the_inputs():
    mha = headwise.MultiHeadAttention(E, H, rope=True)
    with torch.no_grad(), pytest.raises(TypeError, match="cache must come from mha.new_cache"):
        mha("x", context=torch.zeros(2, 3, E), cache=[])


# ---------------------------------------------------------------- masks


def test_a_cross_attention_mask_is_read_over_the_context():
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, context = rand(2, 3, E, seed=1), rand(2, 5, E, seed=2)
    keys = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        out = mha(x, keys, context=context)
        torch.testing.assert_close(out[0], mha(x[:1], context=context[:1])[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(out[1], mha(x[1:], context=context[1:, :3])[0], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=re.escape("(2, 3)")):
        mha(x, torch.ones(2, 3, dtype=torch.bool), context=context)  # x's length, not the context's


@pytest.mark.parametrize("held, T", [(4, 1), (3, 3)], ids=["one position", "several positions"])
@pytest.mark.parametrize("mask_of", [
    lambda held, T: torch.ones(2, T, dtype=torch.bool),  # the new positions' padding
    lambda held, T: torch.ones(2, held + T, dtype=torch.bool),  # every position's
    lambda held, T: torch.ones(2, T, held + T, dtype=torch.bool),  # (B, S, Sk): every key of the step
], ids=["(B, S)", "(B, len + S)", "(B, S, len + S)"])
def test_a_dynamic_cache_step_takes_each_mask_that_covers_its_keys(mask_of, held, T):
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    x = rand(2, held + T, E)
    cache = mha.new_cache(2, 8)
    with torch.no_grad():
        mha(x[:, :held], cache=cache)
        step = mha(x[:, held:], mask_of(held, T), cache=cache)  # (2, T, E)
        whole = mha(x)
    torch.testing.assert_close(step, whole[:, held:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask", [torch.ones(2, 1, 4, dtype=torch.bool), torch.ones(2, 1, 6, dtype=torch.bool)],
                         ids=["one key short", "one key over"])
def test_a_dynamic_cache_step_refuses_a_3d_mask_over_other_keys(mask):
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = mha.new_cache(2, 8)
    with torch.no_grad():
        mha(rand(2, 4, E), cache=cache)
        with pytest.raises(ValueError, match=re.escape(str(tuple(mask.shape)))):
            mha(rand(2, 1, E), mask, cache=cache)
    assert len(cache) == 4


def test_an_evicting_cache_step_takes_a_mask_of_the_new_positions_or_of_all_positions():
    mha = headwise.MultiHeadAttention(E, H, window=3, sink_tokens=1, is_causal=True).eval()
    x = rand(2, 7, E)
    with torch.no_grad():
        want = mha(x)
        for every in (False, True):
            cache = mha.new_cache(2, 8, evict=True)
            mha(x[:, :4], cache=cache)
            outs = []
            for t in range(4, 7):
                mask = torch.ones(2, t + 1 if every else 1, dtype=torch.bool)
                outs.append(mha(x[:, t:t + 1], mask, cache=cache))
            torch.testing.assert_close(torch.cat(outs, 1), want[:, 4:], atol=1e-5, rtol=0)


def test_a_static_cache_step_takes_a_mask_of_the_new_positions():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    x = rand(2, 5, E)
    cache = mha.new_cache(2, 8, static=True)
    with torch.no_grad():
        mha(x[:, :4], torch.ones(2, 4, dtype=torch.bool), cache=cache)
        step = mha(x[:, 4:], torch.ones(2, 1, dtype=torch.bool), cache=cache)
        torch.testing.assert_close(step, mha(x)[:, 4:], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match=re.escape("a static cache takes a (B, T) = (2, 1) padding mask")):
            mha(x[:, 4:], torch.ones(2, 6, dtype=torch.bool), cache=cache)


def test_a_context_parallel_module_leaves_its_shards_mask_to_the_ring():
    """x is this rank's shard (B, S_l, E); its mask may cover keys of every rank, so the
    module does not read it as the shard's own (the ring checks it)."""
    x, mask = rand(2, 3, E), torch.ones(3, 6, dtype=torch.bool)  # (S_l, S): the shard's rows, every key
    mha = headwise.MultiHeadAttention(E, H, context_parallel=ContextParallel())
    assert mha.plan(x, mask).path == "context parallel"
    with pytest.raises(ValueError, match=re.escape("attention_mask of shape (3, 6) does not fit")):
        headwise.MultiHeadAttention(E, H).plan(x, mask)


def test_a_cache_for_a_module_with_value_heads_of_their_own_names_both_head_dims():
    mha = headwise.MultiHeadAttention(E, H, v_head_dim=6, is_causal=True)
    cache = headwise.MultiHeadAttention(E, H).new_cache(2, 8)
    message = ("the cache holds kv_heads=4, head_dim=8, value_dim=8, torch.float32 on cpu; this module needs "
               "kv_heads=4, head_dim=8, value_dim=6, torch.float32 on cpu")
    with torch.no_grad(), pytest.raises(ValueError, match=re.escape(message)):
        mha(rand(2, 1, E), cache=cache)


def test_a_dynamic_cache_step_of_several_positions_refuses_a_mask_of_neither_them_nor_all():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    x = rand(2, 6, E)
    cache = mha.new_cache(2, 8)
    with torch.no_grad():
        mha(x, cache=cache)
        with pytest.raises(ValueError, match=re.escape("(2, 4)")):
            mha(x[:, 3:5], torch.ones(2, 4, dtype=torch.bool), cache=cache)  # neither 2 nor 6 + 2 positions
    assert len(cache) == 6


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_cache_step_inside_a_torch_func_transform_is_refused_with_the_remedy(transform, static):
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = mha.new_cache(2, 8, static=static)
    xs = rand(3, 2, 2, E)
    step = {"vmap": lambda: torch.func.vmap(lambda x: mha(x, cache=cache))(xs),
            "grad": lambda: torch.func.grad(lambda x: mha(x, cache=cache).sum())(xs[0]),
            "jvp": lambda: torch.func.jvp(lambda x: mha(x, cache=cache), (xs[0],), (xs[1],))}[transform]
    message = ("a cache step writes the cache's buffers, which live outside torch.func's transforms (vmap, grad, "
               "jvp, ...) and cannot hold their values; call the module without cache= inside the transform, or "
               "decode outside it")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        step()
    assert len(cache) == 0 and not cache.k.any()

"""The fused path (src/headwise/module/fused.py): ``torch._native_multi_head_attention`` for
small plain self-attention calls without gradients, and only where reading the projections'
weights in place of calling them changes nothing a user can see.

Which calls take it is asserted both ways: a plain small call takes it (the op runs, once),
and each condition that must keep it off keeps it off, alone. Every output is compared with
a float64 plain-math reference of the module's weights.

Legend: B batch, H query heads, S query length, D head dim, E embed dim.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import headwise
from headwise import policy
from headwise import trace as headwise_trace
from headwise.module import fused

E, H = 32, 4
D = E // H
SMALL = (2, 5)  # (B, S): B x S x E = 320, well inside the fused path's limits


def reference(mha, x, q_scale=1.0, causal=False):
    """(B, S, E) float64: self-attention of ``mha``'s current weights written out;
    ``q_scale`` multiplies the q projection's input (what a test's pre-hook does)."""
    w = {n: t.detach().double() for n, t in mha.state_dict().items()}
    x = x.double()
    B, S, _ = x.shape

    def linear(t, name):
        out = t @ w[f"{name}.weight"].T  # (B, S, in) x (in, out) -> (B, S, out)
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    q = linear(x * q_scale, "q_proj").reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    k = linear(x, "k_proj").reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    v = linear(x, "v_proj").reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, S, D) x (B, H, D, S) -> (B, H, S, S)
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, E)  # (B, H, S, D) -> (B, S, E)
    return linear(out, "out_proj")


def rand(shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.fixture
def op_calls(monkeypatch):
    """The fused op's calls: (qkv weight, qkv bias) of each, the op still run."""
    calls = []
    native = torch._native_multi_head_attention

    def spy(*args):
        calls.append((args[5], args[6]))
        return native(*args)

    monkeypatch.setattr(torch, "_native_multi_head_attention", spy)
    return calls


def plain(**kwargs):
    torch.manual_seed(0)
    return headwise.MultiHeadAttention(E, H, **kwargs).eval()


# ---------------------------------------------------------------- what it computes


@pytest.mark.parametrize("shape", [(1, 3), SMALL, (4, 8), (1, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_small_plain_call_runs_the_fused_op_and_equals_the_reference(shape, dtype, op_calls):
    mha = plain(dtype=dtype)
    x = rand(shape, dtype=dtype)
    with torch.no_grad():
        assert mha.plan(x).path == "fused"
        out = mha(x)
        again = mha(x)  # a remembered signature: the same path
    assert len(op_calls) == 2
    assert out.dtype == dtype and out.shape == (*shape, E)
    torch.testing.assert_close(out.double(), reference(mha, x), atol=1e-5 if dtype == torch.float32 else 1e-12,
                               rtol=0)
    torch.testing.assert_close(again, out, atol=0, rtol=0)


@pytest.mark.parametrize("setting", ["causal, one query", "train without dropout", "eval with dropout",
                                     "an all-token mask"])
def test_settings_that_change_nothing_for_the_call_keep_the_fused_path(setting, op_calls):
    S = 1 if setting == "causal, one query" else SMALL[1]
    mha = plain(is_causal=setting == "causal, one query", dropout=0.3 if setting == "eval with dropout" else 0.0)
    mha.train(setting == "train without dropout")
    x = rand((4, S))  # one query: 4 rows pay for the weight copy
    mask = torch.ones(4, S, dtype=torch.bool) if setting == "an all-token mask" else None
    with torch.no_grad():
        assert mha.plan(x, mask).path == "fused"
        out = mha(x, mask)
    assert len(op_calls) == 1
    torch.testing.assert_close(out.double(), reference(mha, x), atol=1e-5, rtol=0)


def test_the_op_takes_the_q_k_v_rows_as_they_lie_without_a_copy(op_calls):
    mha = plain()
    with torch.no_grad():
        mha(rand(SMALL))
    (weight, bias), = op_calls
    assert weight.data_ptr() == mha.q_proj.weight.data_ptr() and weight.shape == (3 * E, E)
    assert bias.data_ptr() == mha.q_proj.bias.data_ptr() and bias.shape == (3 * E,)


@pytest.mark.parametrize("change", ["weight given other memory", "weight replaced", "bias given other memory"])
def test_weights_out_of_the_rows_are_read_as_they_are_now(change, op_calls):
    mha = plain()
    x = rand(SMALL)
    with torch.no_grad():
        mha(x)
        if change == "weight given other memory":
            mha.k_proj.weight.data = torch.randn(E, E, dtype=torch.float64).float()
        elif change == "weight replaced":
            mha.v_proj.weight = nn.Parameter(torch.randn(E, E))
        else:
            mha.q_proj.bias.data = torch.randn(E)
        assert mha.plan(x).path == "fused"
        out = mha(x)
    assert len(op_calls) == 2
    weight, bias = op_calls[-1]
    torch.testing.assert_close(weight, torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]),
                               atol=0, rtol=0)
    torch.testing.assert_close(bias, torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias]), atol=0, rtol=0)
    torch.testing.assert_close(out.double(), reference(mha, x), atol=1e-5, rtol=0)


def test_the_reason_names_the_call_size_and_both_limits():
    mha = plain()
    with torch.no_grad():
        why = mha.plan(rand(SMALL)).why
    n = SMALL[0] * SMALL[1] * E
    assert why == (
        f"B x S x E = {n} <= FUSED_MAX_ELEMENTS {policy.FUSED_MAX_ELEMENTS} without gradients: nn.MultiheadAttention's "
        "fused inference op (torch._native_multi_head_attention) runs the projections, attention and output "
        "projection in one call, without the Python between them (and the q, k, v weights it copies, "
        f"3 E^2 = {3 * E * E}, are at most FUSED_MAX_WEIGHT_COPY {policy.FUSED_MAX_WEIGHT_COPY} x B x S x E)")


# ---------------------------------------------------------------- the size limits


@pytest.mark.parametrize("shape, taken", [
    ((1, policy.FUSED_MAX_ELEMENTS // E), True),  # B x S x E == FUSED_MAX_ELEMENTS
    ((1, policy.FUSED_MAX_ELEMENTS // E + 1), False),
    ((2, policy.FUSED_MAX_ELEMENTS // (2 * E)), True),
    ((2, policy.FUSED_MAX_ELEMENTS // (2 * E) + 1), False),
])
def test_calls_up_to_fused_max_elements_take_it_and_larger_ones_do_not(shape, taken):
    mha = plain()
    x = rand(shape)
    with torch.no_grad():
        assert (mha.plan(x).path == "fused") is taken
        torch.testing.assert_close(mha(x).double(), reference(mha, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape, taken", [((1, 3), True), ((3, 1), True), ((1, 2), False), ((2, 1), False),
                                          ((1, 1), False)])
def test_calls_too_small_to_pay_for_the_weight_copy_do_not_take_it(shape, taken):
    """3 E^2 = 3072 weights against FUSED_MAX_WEIGHT_COPY (32) x B x S x E: 3 positions of
    E = 32 are the first call it pays for."""
    assert 3 * E * E == policy.FUSED_MAX_WEIGHT_COPY * 3 * E
    mha = plain()
    x = rand(shape)
    with torch.no_grad():
        assert (mha.plan(x).path == "fused") is taken
        torch.testing.assert_close(mha(x).double(), reference(mha, x), atol=1e-5, rtol=0)


def test_the_limits_are_read_from_the_policy_at_each_call(monkeypatch):
    mha = plain()
    x = rand(SMALL)
    with torch.no_grad():
        assert mha.plan(x).path == "fused"
        monkeypatch.setattr(policy, "FUSED_MAX_ELEMENTS", SMALL[0] * SMALL[1] * E - 1)
        assert mha.plan(x).path != "fused"
        monkeypatch.setattr(policy, "FUSED_MAX_ELEMENTS", SMALL[0] * SMALL[1] * E)
        assert mha.plan(x).path == "fused"
        monkeypatch.setattr(policy, "FUSED_MAX_WEIGHT_COPY", 3 * E * E // (SMALL[0] * SMALL[1] * E))  # 9: 2880 < 3072
        assert mha.plan(x).path != "fused"


# ---------------------------------------------------------------- what keeps it off


def _hook(module, *args):
    return None


class _Linear(nn.Linear):
    pass


class _Subclass(torch.Tensor):
    pass


def _subclass(proj, kind):
    def change(mha, monkeypatch):
        p = getattr(getattr(mha, proj), kind)
        setattr(getattr(mha, proj), kind, nn.Parameter(p.detach().as_subclass(_Subclass)))
    return change


def _hooked(proj, register):
    return lambda mha, monkeypatch: getattr(getattr(mha, proj), register)(_hook)


def _linear_subclass(mha, monkeypatch):
    old = mha.k_proj
    mha.k_proj = _Linear(E, E)
    mha.k_proj.load_state_dict(old.state_dict())


# (name, constructor kwargs, change(mha, monkeypatch) or None, call kwargs): each alone keeps
# a small call without gradients off the fused path; a change may return a hook handle
KEPT_OFF = [
    ("backend", {"backend": "sdpa"}, None, {}),
    ("gqa", {"num_kv_heads": 2}, None, {}),
    ("mqa", {"num_kv_heads": 1}, None, {}),
    ("v_head_dim", {"v_head_dim": 2 * D}, None, {}),
    ("rope", {"rope": True}, None, {}),
    ("qk_norm", {"qk_norm": "rms"}, None, {}),
    ("window", {"window": 3}, None, {}),
    ("alibi", {"alibi": True}, None, {}),
    ("softcap", {"softcap": 20.0}, None, {}),
    ("sinks", {"sinks": True}, None, {}),
    ("biasless", {"bias": False}, None, {}),
    ("dropout in training", {"dropout": 0.3}, lambda mha, mp: mha.train(), {}),
    ("causal", {"is_causal": True}, None, {}),
    ("causal per call", {}, None, {"is_causal": True}),
    ("need_weights", {}, None, {"need_weights": True}),
    ("padding", {}, None, {"attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}),
    ("forward hook on the module", {}, lambda mha, mp: mha.register_forward_hook(_hook), {}),
    ("pre-hook on the module", {}, lambda mha, mp: mha.register_forward_pre_hook(_hook), {}),
    ("global forward hook", {}, lambda mha, mp: torch_module.register_module_forward_hook(_hook), {}),
    ("global pre-hook", {}, lambda mha, mp: torch_module.register_module_forward_pre_hook(_hook), {}),
    *[(f"{register} on {proj}", {}, _hooked(proj, register), {})
      for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
      for register in ("register_forward_hook", "register_forward_pre_hook")],
    ("backward hook on v_proj", {}, _hooked("v_proj", "register_full_backward_hook"), {}),
    ("backward pre-hook on out_proj", {}, _hooked("out_proj", "register_full_backward_pre_hook"), {}),
    ("out_proj without bias", {}, lambda mha, mp: setattr(mha.out_proj, "bias", None), {}),
    ("k_proj without bias", {}, lambda mha, mp: setattr(mha.k_proj, "bias", None), {}),
    ("a Linear subclass", {}, _linear_subclass, {}),
    ("a wrapped q_proj", {}, lambda mha, mp: setattr(mha, "q_proj", nn.Sequential(mha.q_proj)), {}),
    ("a subclass weight on out_proj", {}, _subclass("out_proj", "weight"), {}),
    ("a subclass bias on v_proj", {}, _subclass("v_proj", "bias"), {}),
    ("no fused op in this torch", {}, lambda mha, mp: mp.delattr(torch, "_native_multi_head_attention"), {}),
]


@pytest.mark.parametrize("name, kwargs, change, call", KEPT_OFF, ids=[row[0] for row in KEPT_OFF])
def test_each_condition_alone_keeps_a_small_call_off_the_fused_path(name, kwargs, change, call, monkeypatch,
                                                                    op_calls):
    mha = plain(**kwargs)
    handle = None if change is None else change(mha, monkeypatch)
    x = rand(SMALL)
    try:
        with torch.no_grad():
            plan = mha.plan(x, **call)
            assert plan.path != "fused", plan.why
            result = mha(x, **call)
    finally:
        if hasattr(handle, "remove"):
            handle.remove()
    assert op_calls == []
    out = result[0] if call.get("need_weights") else result
    assert out.shape == (*SMALL, E) and out.isfinite().all()


@pytest.mark.parametrize("condition", ["gradients", "trace", "compiling", "autocast", "cross-attention"])
def test_each_call_condition_alone_keeps_it_off(condition, monkeypatch, op_calls):
    mha = plain()
    x = rand(SMALL)
    call = {}
    if condition == "cross-attention":
        call["context"] = rand((2, 4), seed=2)
    if condition == "compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    scope = {"gradients": torch.enable_grad(), "trace": headwise_trace(),
             "autocast": torch.autocast("cpu", dtype=torch.bfloat16)}.get(condition, contextlib.nullcontext())
    with torch.no_grad(), scope:
        assert mha.plan(x, **call).path != "fused"
        if condition != "compiling":
            mha(x, **call)
    assert op_calls == []


def test_a_cache_step_keeps_it_off_and_appends(op_calls):
    """A one-token causal step of 4 rows is small and plain but for its cache: the op would
    not write the cache."""
    mha = plain(is_causal=True)
    x = rand((4, 4))
    cache = mha.new_cache(4, 8)
    with torch.no_grad():
        mha(x[:, :3], cache=cache)
        assert mha.plan(x[:, 3:], cache=cache).path != "fused"
        step = mha(x[:, 3:], cache=cache)  # (4, 1, E)
    assert op_calls == [] and len(cache) == 4
    torch.testing.assert_close(step.double(), reference(mha, x, causal=True)[:, 3:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_module_keeps_it_off(dtype, op_calls):
    mha = plain(dtype=dtype)
    x = rand(SMALL, dtype=dtype)
    with torch.no_grad():
        assert mha.plan(x).path != "fused"
        out = mha(x)
    assert op_calls == [] and out.dtype == dtype


def test_a_module_on_the_meta_device_keeps_it_off():
    mha = headwise.MultiHeadAttention(E, H, device="meta").eval()
    x = torch.empty(*SMALL, E, device="meta")
    with torch.no_grad():
        assert mha.plan(x).path != "fused"
        assert mha(x).shape == (*SMALL, E)


def test_why_is_none_for_an_input_of_another_dtype_than_the_weights():
    """forward refuses such an input before it plans; ``why`` itself still says no."""
    mha = plain()
    with torch.no_grad():
        assert fused.why(mha, rand(SMALL), False, None, None, False, False) is not None
        assert fused.why(mha, rand(SMALL, dtype=torch.float64), False, None, None, False, False) is None


# ---------------------------------------------------------------- changes after a remembered fused call


@pytest.mark.parametrize("when", ["before", "after a first call"])
def test_a_pre_hook_on_k_proj_changes_the_result_at_any_time(when):
    mha = plain()
    x = rand(SMALL)
    with torch.no_grad():
        if when != "before":
            mha(x)
            mha(x)
        handle = mha.q_proj.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,))
        got = mha(x)
        handle.remove()
        plain_again = mha(x)
    torch.testing.assert_close(got.double(), reference(mha, x, q_scale=2.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(plain_again.double(), reference(mha, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_a_global_hook_added_after_a_first_call_sees_every_projection(kind, op_calls):
    mha = plain()
    x = rand(SMALL)
    seen = []
    with torch.no_grad():
        mha(x)
        register = (torch_module.register_module_forward_hook if kind == "forward"
                    else torch_module.register_module_forward_pre_hook)
        handle = register(lambda module, *args: seen.append(module))
        try:
            out = mha(x)
        finally:
            handle.remove()
        mha(x)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert any(m is getattr(mha, name) for m in seen), name
    assert len(op_calls) == 2  # before the hook and after its removal
    torch.testing.assert_close(out.double(), reference(mha, x), atol=1e-5, rtol=0)


def test_a_bias_removed_after_a_first_call_is_not_read():
    mha = plain()
    x = rand(SMALL)
    with torch.no_grad():
        mha(x)
        mha.v_proj.bias = None
        out = mha(x)
    torch.testing.assert_close(out.double(), reference(mha, x), atol=1e-5, rtol=0)

"""The q, k, v weights in adjacent memory (src/headwise/module/qkv.py): one GEMM without
gradients, never a stale weight, and every tool still sees three ordinary weights.

Each output is compared with a float64 plain-math reference of the module's weights as they
are after the change under test (never with the module itself).

Legend: B batch, H query heads, Hkv key/value heads, S query length, D head dim, E embed dim.
"""

from __future__ import annotations

import copy
import io
import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import headwise
from headwise.module import qkv

E, H = 32, 4
D = E // H
SMALL = (2, 3)  # (B, S): the fused path (B x S x E <= policy.FUSED_MAX_ELEMENTS, no gradients)
LARGE = (4, 300)  # (B, S): past FUSED_MAX_ELEMENTS, the dense path


def reference(mha, x, padding=None, weights=None):
    """(B, S, E) float64: self-attention of ``mha``'s current weights written out, GQA and
    ``v_head_dim`` included; ``padding`` (B, S) bool, True at tokens: padded keys are not
    attended and padded positions output zeros. ``weights``: the state dict's tensors to use
    instead, as they are (not detached: the transforms' tests differentiate through them)."""
    w = {n: t.detach().double() for n, t in mha.state_dict().items()} if weights is None else weights
    x = x.double()  # not detached: the frozen-weights test takes its gradient
    B, S, _ = x.shape
    Hkv = mha.num_kv_heads

    def linear(t, name):
        out = t @ w[f"{name}.weight"].T  # (B, S, in) x (in, out) -> (B, S, out)
        return out + w[f"{name}.bias"] if f"{name}.bias" in w else out

    q = linear(x, "q_proj").reshape(B, S, H, -1).transpose(1, 2)  # (B, H, S, D)
    k = linear(x, "k_proj").reshape(B, S, Hkv, -1).transpose(1, 2).repeat_interleave(H // Hkv, 1)  # (B, H, S, D)
    v = linear(x, "v_proj").reshape(B, S, Hkv, -1).transpose(1, 2).repeat_interleave(H // Hkv, 1)  # (B, H, S, Dv)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, S, D) x (B, H, D, S) -> (B, H, S, S)
    if padding is not None:
        scores = scores.masked_fill(~padding[:, None, None, :], -math.inf)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, -1)  # (B, H, S, Dv) -> (B, S, H*Dv)
    out = linear(out, "out_proj")
    return out if padding is None else out * padding[..., None]


def inputs(shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def new_weight(like: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed), dtype=like.dtype) / math.sqrt(E)


def rows_of(mha) -> bool:
    """Whether q, k, v weights and biases lie one after another, each in a storage of its own."""
    names = ("q_proj", "k_proj", "v_proj")
    for kind in ("weight", "bias"):
        ts = [getattr(mha, n)._parameters[kind] for n in names]
        if ts[0] is None:  # bias=False
            continue
        for a, b in zip(ts, ts[1:], strict=False):
            if a.data_ptr() + a.numel() * a.element_size() != b.data_ptr():
                return False
    return qkv.packed(mha, False) is not None


def check(mha, shape, padding=None, atol=1e-5):
    x = inputs(shape, dtype=mha.out_proj.weight.dtype)
    with torch.no_grad():
        got = mha(x, padding)
    torch.testing.assert_close(got.double(), reference(mha, x, padding), atol=atol, rtol=0)


# ---------------------------------------------------------------- the layout


@pytest.mark.parametrize("kwargs", [{}, {"bias": False}, {"num_kv_heads": 2, "v_head_dim": 4}],
                         ids=["mha", "no bias", "gqa, v_head_dim"])
def test_the_weights_lie_in_rows_each_in_a_storage_of_exactly_itself(kwargs):
    mha = headwise.MultiHeadAttention(E, H, **kwargs)
    assert rows_of(mha)
    pack = qkv.packed(mha, False)
    assert pack.rows == (mha.q_proj.weight.shape[0], mha.k_proj.weight.shape[0], mha.v_proj.weight.shape[0])
    for p in mha.parameters():  # what safetensors asks of a tensor it saves: its storage is itself
        assert p.data_ptr() == p.untyped_storage().data_ptr()
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size()
        assert type(p) is nn.Parameter and p.is_leaf
    torch.testing.assert_close(pack.weight, torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]),
                               atol=0, rtol=0)
    check(mha, SMALL)
    check(mha, LARGE)


def test_gradients_reach_the_three_weights_as_separate_parameters():
    torch.manual_seed(3)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64)
    x = inputs(SMALL, dtype=torch.float64)
    mha(x).square().sum().backward()
    params = dict(mha.named_parameters())
    w = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    ref = headwise.MultiHeadAttention(E, H, dtype=torch.float64)
    out = torch.func.functional_call(ref, w, (x,))  # the same weights, each given other memory
    out.square().sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(p.grad, w[name].grad, atol=1e-12, rtol=0, msg=name)


def test_frozen_weights_and_an_input_that_takes_gradients_use_the_rows():
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64).requires_grad_(False)
    assert qkv.packed(mha, True) is not None  # no parameter takes a gradient
    x = inputs(LARGE, dtype=torch.float64).requires_grad_()
    (mha(x) * 3).sum().backward()
    xr = x.detach().clone().requires_grad_()
    (reference(mha, xr) * 3).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-10, rtol=0)


# ---------------------------------------------------------------- never stale


@pytest.mark.parametrize("proj", ["q_proj", "k_proj", "v_proj"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["fused", "dense"])
def test_a_write_in_place_through_data_is_seen_by_the_next_call(proj, shape):
    mha = headwise.MultiHeadAttention(E, H).eval()
    check(mha, shape)
    check(mha, shape)  # a remembered signature too
    w, b = getattr(mha, proj).weight, getattr(mha, proj).bias
    w.data.copy_(new_weight(w, 5))  # as merge_and_unload writes: no version bump
    b.data.mul_(-3)
    assert rows_of(mha)  # written in place: still the rows
    check(mha, shape)


@pytest.mark.parametrize("param", ["weight", "bias"])
@pytest.mark.parametrize("proj", ["q_proj", "v_proj"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["fused", "dense"])
def test_a_parameter_given_other_memory_leaves_the_rows_and_is_read(param, proj, shape):
    mha = headwise.MultiHeadAttention(E, H).eval()
    check(mha, shape)
    p = getattr(getattr(mha, proj), param)
    # other memory, the same shape: the rows no longer hold it
    p.data = new_weight(p, 6) if param == "weight" else torch.linspace(-1, 1, E)
    assert qkv.packed(mha, False) is None
    check(mha, shape)


def test_a_replaced_parameter_or_projection_leaves_the_rows_and_is_read():
    mha = headwise.MultiHeadAttention(E, H).eval()
    check(mha, LARGE)
    mha.k_proj.weight = nn.Parameter(new_weight(mha.k_proj.weight, 7))
    assert qkv.packed(mha, False) is None
    check(mha, LARGE)
    check(mha, SMALL)
    mha.v_proj = nn.Linear(E, E)
    check(mha, LARGE)


def test_a_bias_added_to_a_module_built_without_biases_is_read():
    mha = headwise.MultiHeadAttention(E, H, bias=False).eval()
    check(mha, LARGE)
    mha.q_proj.bias = nn.Parameter(torch.full((E,), 0.5))
    assert qkv.packed(mha, False) is None
    check(mha, LARGE)


def test_an_optimizer_step_writes_the_rows():
    torch.manual_seed(4)
    mha = headwise.MultiHeadAttention(E, H)
    opt = torch.optim.Adam(mha.parameters(), lr=0.1)
    mha(inputs(SMALL)).square().mean().backward()
    opt.step()
    assert rows_of(mha)
    check(mha.eval(), SMALL)
    check(mha, LARGE)


def test_a_tied_weight_is_read_and_never_moved():
    mha = headwise.MultiHeadAttention(E, H)
    mha.k_proj.weight = mha.q_proj.weight  # the same parameter twice
    mha.double()  # _apply: the weights are not the module's rows any more, nothing is repacked
    assert mha.k_proj.weight is mha.q_proj.weight and qkv.packed(mha, False) is None
    check(mha.eval(), LARGE, atol=1e-10)


def test_a_cache_step_reads_a_write_in_place():
    torch.manual_seed(5)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    x = inputs((2, 6))
    with torch.no_grad():
        cache = mha.new_cache(2, 8)
        mha(x[:, :5], cache=cache)
        mha.v_proj.weight.data.copy_(new_weight(mha.v_proj.weight, 8))
        cache = mha.new_cache(2, 8)
        mha(x[:, :5], cache=cache)
        got = mha(x[:, 5:], cache=cache)  # (2, 1, E)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    w = {n: t.double() for n, t in mha.state_dict().items()}
    xd = x.double()
    q, k, v = (xd @ w[f"{n}.weight"].T + w[f"{n}.bias"] for n in ("q_proj", "k_proj", "v_proj"))
    q, k, v = (t.reshape(2, 6, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(D)).masked_fill(~causal, -math.inf)  # (B, H, S, S)
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, E) @ w["out_proj.weight"].T + w["out_proj.bias"]
    torch.testing.assert_close(got.double(), out[:, 5:], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- conversions and copies


@pytest.mark.parametrize("convert", ["double", "to", "deepcopy", "pickle", "to_empty", "meta and back"])
def test_conversions_and_copies_put_the_weights_in_rows_again(convert):
    torch.manual_seed(6)
    if convert in ("to_empty", "meta and back"):
        if convert == "to_empty":
            mha = headwise.MultiHeadAttention(E, H, device="meta")
        else:
            mha = headwise.MultiHeadAttention(E, H).to("meta")
            assert "_qkv" not in mha.__dict__  # no rows kept alive for weights elsewhere
        mha.to_empty(device="cpu")
        mha.reset_parameters()
    else:
        mha = headwise.MultiHeadAttention(E, H)
        before = {n: t.clone() for n, t in mha.state_dict().items()}
        if convert == "double":
            mha = mha.double()
        elif convert == "to":
            mha = mha.to(torch.float64).to(torch.float32)
        elif convert == "deepcopy":
            original, mha = mha, copy.deepcopy(mha)
            original.q_proj.weight.data.zero_()  # the copy holds its own rows
        else:
            buffer = io.BytesIO()
            torch.save(mha, buffer)
            buffer.seek(0)
            mha = torch.load(buffer, weights_only=False)
        for name, t in mha.state_dict().items():
            torch.testing.assert_close(t.float(), before[name], atol=0, rtol=0, msg=name)
    assert rows_of(mha)
    check(mha.eval(), SMALL)
    check(mha, LARGE)


def test_a_copy_of_a_module_whose_weight_left_the_rows_is_read():
    mha = headwise.MultiHeadAttention(E, H).eval()
    mha.q_proj.weight.data = new_weight(mha.q_proj.weight, 9)
    twin = copy.deepcopy(mha)
    assert qkv.packed(twin, False) is None
    check(twin, LARGE)


def test_share_memory_keeps_the_weights_in_shared_memory():
    mha = headwise.MultiHeadAttention(E, H).eval().share_memory()
    assert all(p.is_shared() for p in mha.parameters())
    assert "_qkv" not in mha.__dict__
    check(mha, SMALL)
    check(mha, LARGE)


# ---------------------------------------------------------------- state dicts and files


def test_load_state_dict_copies_into_the_rows():
    mha = headwise.MultiHeadAttention(E, H).eval()
    state = {n: -t for n, t in mha.state_dict().items()}
    mha.load_state_dict(state)
    assert rows_of(mha)
    check(mha, SMALL)
    check(mha, LARGE)


def test_load_state_dict_assign_keeps_the_users_tensors_and_drops_the_rows():
    mha = headwise.MultiHeadAttention(E, H).eval()
    state = {n: -t for n, t in mha.state_dict().items()}
    mha.load_state_dict(state, assign=True)
    assert mha.q_proj.weight.data_ptr() == state["q_proj.weight"].data_ptr()  # the user's memory, not moved
    assert "_qkv" not in mha.__dict__  # the old rows are not kept alive
    check(mha, SMALL)
    check(mha, LARGE)
    mha.float()  # an _apply that changes nothing: still the user's memory
    assert mha.q_proj.weight.data_ptr() == state["q_proj.weight"].data_ptr()
    mha.double()  # a conversion makes new weights: they go in rows
    assert rows_of(mha)
    check(mha, LARGE, atol=1e-10)


def test_safetensors_save_file_of_the_state_dict_round_trips(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2)
    path = tmp_path / "attn.safetensors"
    st.save_file(mha.state_dict(), str(path))
    fresh = headwise.MultiHeadAttention(E, H, num_kv_heads=2).eval()
    fresh.load_state_dict(st.load_file(str(path)))
    assert rows_of(fresh)
    for name, t in mha.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    check(fresh, LARGE)


def test_torch_save_of_one_projection_writes_that_projection_only():
    mha = headwise.MultiHeadAttention(E, H)
    buffer = io.BytesIO()
    torch.save(mha.q_proj.state_dict(), buffer)
    assert len(buffer.getvalue()) < 2 * (E * E + E) * 4  # not the three weights' rows


# ---------------------------------------------------------------- outside eager mode

# torch.jit.trace is deprecated since torch 2.x (DeprecationWarning), but users still trace
# modules with it, so these tests check that a traced module reads its parameters. A trace
# records one example's shapes: the TracerWarnings say that the module's shape checks and
# dispatch read shapes as Python values, which is expected (the graph serves those shapes).
TRACE_DEPRECATED = pytest.mark.filterwarnings("ignore:`torch.jit.trace(_method)?` is deprecated:DeprecationWarning")
TRACER_WARNINGS = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


@TRACE_DEPRECATED
@TRACER_WARNINGS
def test_torch_jit_trace_reads_the_parameters():
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs(LARGE)
    with torch.no_grad():
        traced = torch.jit.trace(mha, (x,), check_trace=False)
        mha.k_proj.weight.data.copy_(new_weight(mha.k_proj.weight, 10))  # traced graphs read the parameters
        got = traced(x)
    torch.testing.assert_close(got.double(), reference(mha, x), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- what the rows must not hide


class Recording(torch.Tensor):
    """A weight of a tensor subclass over the same memory (as quantisation wrappers are): the
    torch functions it takes part in are recorded."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("proj, kind", [("k_proj", "weight"), ("v_proj", "bias")])
def test_a_parameter_of_a_tensor_subclass_over_the_same_memory_is_called_through_it(proj, kind):
    mha = headwise.MultiHeadAttention(E, H).eval()
    linear = getattr(mha, proj)
    old = getattr(linear, kind)
    setattr(linear, kind, nn.Parameter(old.detach().as_subclass(Recording)))
    assert getattr(linear, kind).data_ptr() == old.data_ptr()  # the rows' own memory, a type of its own
    Recording.seen = []
    x = inputs(LARGE)
    with torch.no_grad():
        got = mha(x).as_subclass(torch.Tensor)
    assert "linear" in Recording.seen  # the subclass took part in its projection
    torch.testing.assert_close(got.double(), reference(mha, x), atol=1e-5, rtol=0)


def test_a_square_weight_transposed_over_the_same_memory_is_read_transposed():
    mha = headwise.MultiHeadAttention(E, H).eval()
    w = mha.q_proj.weight
    ptr = w.data_ptr()
    w.data = w.data.t()  # (E, E): the same pointer, the same shape, other strides
    assert w.data_ptr() == ptr and not w.is_contiguous()
    assert qkv.packed(mha, False) is None
    check(mha, SMALL)
    check(mha, LARGE)


def test_a_weight_given_fewer_rows_over_the_same_memory_leaves_the_rows():
    """The same pointer, contiguous, another shape (the first E - 8 of its rows): the rows'
    GEMM would still read E rows, so the module calls the projection itself, as nn.Linear
    would: v gets E - 8 features, and a head split that no longer fits is refused."""
    mha = headwise.MultiHeadAttention(E, H).eval()
    w = mha.v_proj.weight
    ptr = w.data_ptr()
    w.data = w.data[:E - 8]  # (E - 8, E)
    assert w.data_ptr() == ptr and w.is_contiguous()
    assert qkv.packed(mha, False) is None
    with torch.no_grad(), pytest.raises(RuntimeError):
        mha(torch.randn(1, 3, E))


@pytest.mark.parametrize("frozen", ["weights", "biases"])
def test_gradients_reach_whichever_parameters_train(frozen):
    """BitFit trains the biases only; a frozen bias with trained weights is the converse: the
    rows (not autograd's leaves) must not stand in for either."""
    torch.manual_seed(7)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64)
    for name, p in mha.named_parameters():
        p.requires_grad_(not name.endswith(frozen[:-1]))
    x = inputs(LARGE, dtype=torch.float64)
    (mha(x) * torch.linspace(-1, 1, E, dtype=torch.float64)).sum().backward()
    w = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in mha.named_parameters()}
    ref = headwise.MultiHeadAttention(E, H, dtype=torch.float64)
    (torch.func.functional_call(ref, w, (x,)) * torch.linspace(-1, 1, E, dtype=torch.float64)).sum().backward()
    for name, p in mha.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, w[name].grad, atol=1e-10, rtol=0, msg=name)
        else:
            assert p.grad is None, name


def test_one_gemm_projects_q_k_and_v_while_they_lie_in_rows(monkeypatch):
    """The promise of the rows: a call without gradients projects x with one GEMM (plus the
    output projection's); a weight out of the rows takes the three calls again."""
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **kw: calls.append(a[1].shape) or linear(*a, **kw))
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2).eval()
    with torch.no_grad():
        mha(inputs(LARGE))
    assert calls == [(2 * E, E), (E, E)]  # (Nq + Nk + Nv, E), then out_proj
    calls.clear()
    mha.v_proj.weight.data = new_weight(mha.v_proj.weight, 11)
    with torch.no_grad():
        mha(inputs(LARGE))
    assert len(calls) == 4


@pytest.mark.parametrize("kwargs", [{"bias": False}, {"num_kv_heads": 1, "v_head_dim": 4}],
                         ids=["no bias", "mqa, v_head_dim"])
@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle"])
def test_copies_of_other_layouts_lie_in_rows_of_their_own(kwargs, copy_with):
    mha = headwise.MultiHeadAttention(E, H, **kwargs).eval()
    if copy_with == "deepcopy":
        twin = copy.deepcopy(mha)
    else:
        buffer = io.BytesIO()
        torch.save(mha, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    assert rows_of(twin)
    assert twin.q_proj.weight.data_ptr() != mha.q_proj.weight.data_ptr()
    for name, t in mha.state_dict().items():
        assert torch.equal(twin.state_dict()[name], t), name
    mha.k_proj.weight.data.zero_()  # the original's rows are not the copy's
    check(twin, SMALL)
    check(twin, LARGE)


def test_a_pickled_module_whose_weight_left_the_rows_is_read():
    mha = headwise.MultiHeadAttention(E, H).eval()
    mha.v_proj.weight.data = new_weight(mha.v_proj.weight, 12)
    buffer = io.BytesIO()
    torch.save(mha, buffer)
    buffer.seek(0)
    twin = torch.load(buffer, weights_only=False)
    assert qkv.packed(twin, False) is None
    for name, t in mha.state_dict().items():
        assert torch.equal(twin.state_dict()[name], t), name
    check(twin, SMALL)
    check(twin, LARGE)


def test_biases_given_to_all_three_projections_of_a_biasless_module_are_read_and_converted():
    mha = headwise.MultiHeadAttention(E, H, bias=False).eval()
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        getattr(mha, name).bias = nn.Parameter(torch.full((E,), 0.25 * (i + 1)))
    assert qkv.packed(mha, False) is None  # the rows hold no biases
    check(mha, SMALL)
    check(mha, LARGE)
    mha.double()  # a conversion: weights and biases go in rows together
    assert rows_of(mha) and qkv.packed(mha, False).bias is not None
    check(mha, SMALL, atol=1e-10)
    check(mha, LARGE, atol=1e-10)


def test_a_projection_converted_on_its_own_is_read_and_the_module_converts_back():
    mha = headwise.MultiHeadAttention(E, H).eval()
    mha.q_proj.double()  # the q weights leave the rows (another dtype)
    assert qkv.packed(mha, False) is None
    mha.float()  # q converted back on its own: nothing the user gave other memory is moved
    assert mha.k_proj.weight.dtype == mha.q_proj.weight.dtype == torch.float32
    check(mha, SMALL)
    check(mha, LARGE)
    mha.double()  # every weight converted: in rows again
    assert rows_of(mha)
    check(mha, LARGE, atol=1e-10)


@TRACE_DEPRECATED
@TRACER_WARNINGS
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["fused", "dense"])
def test_torch_jit_trace_reads_a_weight_given_other_memory_after_tracing(shape):
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs(shape)
    with torch.no_grad():
        traced = torch.jit.trace(mha, (x,), check_trace=False)
        mha.k_proj.weight.data = new_weight(mha.k_proj.weight, 13)  # other memory: the traced graph holds no rows
        got = traced(x)
    torch.testing.assert_close(got.double(), reference(mha, x), atol=1e-5, rtol=0)


def test_a_wrapped_projection_is_converted_with_the_module_and_read():
    """PEFT wraps a projection in a module of its own: a conversion after that moves every
    weight and never reads the wrapper as an nn.Linear."""
    mha = headwise.MultiHeadAttention(E, H).eval()
    mha.q_proj = nn.Sequential(mha.q_proj)
    mha.double()
    assert mha.q_proj[0].weight.dtype == mha.k_proj.weight.dtype == torch.float64
    twin = headwise.MultiHeadAttention(E, H, dtype=torch.float64).eval()
    twin.load_state_dict({n.replace("q_proj.0.", "q_proj."): t for n, t in mha.state_dict().items()})
    x = inputs(LARGE, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), reference(twin, x), atol=1e-10, rtol=0)


def test_a_parameter_of_a_tensor_subclass_stays_itself_through_a_conversion():
    mha = headwise.MultiHeadAttention(E, H).eval()
    mha.k_proj.weight = nn.Parameter(mha.k_proj.weight.detach().as_subclass(Recording))
    mha.double()
    assert isinstance(mha.k_proj.weight, Recording) and mha.k_proj.weight.dtype == torch.float64
    Recording.seen = []
    x = inputs(LARGE, dtype=torch.float64)
    with torch.no_grad():
        got = mha(x).as_subclass(torch.Tensor)
    assert "linear" in Recording.seen
    torch.testing.assert_close(got, reference(mha, x), atol=1e-10, rtol=0)


def test_to_empty_keeps_each_parameters_dtype():
    mha = headwise.MultiHeadAttention(E, H)
    mha.q_proj.double()  # one projection in a dtype of its own
    mha.to_empty(device="cpu")  # new memory for every parameter, of its own dtype
    assert mha.q_proj.weight.dtype == mha.q_proj.bias.dtype == torch.float64
    for name in ("k_proj", "v_proj", "out_proj"):
        assert getattr(mha, name).weight.dtype == getattr(mha, name).bias.dtype == torch.float32, name
    mha.reset_parameters()
    mha.half().double()  # conversions that give every parameter new memory: in rows again
    assert rows_of(mha)
    check(mha.eval(), LARGE, atol=1e-10)


def test_pack_says_whether_the_weights_lie_in_rows_now():
    mha = headwise.MultiHeadAttention(E, H).eval()
    assert qkv.pack(mha) is True and rows_of(mha)  # packed at construction: nothing moves
    ptr = mha.q_proj.weight.data_ptr()
    assert qkv.pack(mha) is True and mha.q_proj.weight.data_ptr() == ptr
    mha.k_proj.weight.data = new_weight(mha.k_proj.weight, 14)
    assert qkv.pack(mha) is True and rows_of(mha)  # the module's own weights: put in rows again
    check(mha, LARGE)
    tied = headwise.MultiHeadAttention(E, H)
    tied.k_proj.weight = tied.q_proj.weight
    assert qkv.pack(tied) is False and qkv.packed(tied, False) is None  # one parameter twice: left as it is
    some = headwise.MultiHeadAttention(E, H, bias=False)
    some.q_proj.bias = nn.Parameter(torch.zeros(E))
    assert qkv.pack(some) is False  # a bias on one projection of three
    check(some.eval(), LARGE)


# ---------------------------------------------------------------- torch.func and forward AD
# The rows are read through pointers; a functorch-wrapped weight has none, and a dual tensor
# (forward AD) has the pointer of the tensor it wraps but a tangent the rows do not carry.


def module64(**kwargs):
    torch.manual_seed(5)
    return headwise.MultiHeadAttention(E, H, dtype=torch.float64, **kwargs).eval()


def tangents_of(params, seed=7):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}


@pytest.mark.parametrize("grad_mode", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["fused", "dense"])
def test_forward_ad_carries_the_tangents_of_the_q_k_v_weights(shape, grad_mode):
    mha = module64()
    x = inputs(shape, dtype=torch.float64)
    params = {n: p.detach() for n, p in mha.named_parameters()}  # the rows' own memory
    tangents = tangents_of(params)
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), torch.set_grad_enabled(grad_mode):
        dual = {n: fwAD.make_dual(p, tangents[n]) for n, p in params.items()}
        out, tangent = fwAD.unpack_dual(torch.func.functional_call(mha, dual, (x,)))
    assert tangent is not None
    want, want_tangent = torch.func.jvp(lambda w: reference(mha, x, weights=w), (params,), (tangents,))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(tangent, want_tangent, atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
def test_torch_func_grad_and_jvp_over_functional_call_are_exact(shape):
    mha = module64(num_kv_heads=2)
    x = inputs(shape, dtype=torch.float64)
    mha(x)  # remembered outside the transforms: the remembered kernel call must not serve them
    with torch.no_grad():
        mha(x)
    params = {n: p.detach() for n, p in mha.named_parameters()}

    def loss(w, f):
        return f(w).square().sum()

    got = torch.func.grad(loss)(params, lambda w: torch.func.functional_call(mha, w, (x,)))
    want = torch.func.grad(loss)(params, lambda w: reference(mha, x, weights=w))
    for name in params:
        torch.testing.assert_close(got[name], want[name], atol=1e-9, rtol=0, msg=name)
    tangents = tangents_of(params)
    out, tangent = torch.func.jvp(lambda w: torch.func.functional_call(mha, w, (x,)), (params,), (tangents,))
    want_out, want_tangent = torch.func.jvp(lambda w: reference(mha, x, weights=w), (params,), (tangents,))
    torch.testing.assert_close(out, want_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(tangent, want_tangent, atol=1e-10, rtol=0)


@pytest.mark.parametrize("grad_mode", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
def test_vmap_over_an_ensemble_of_parameters_is_served_and_exact(shape, grad_mode):
    mha = module64()
    x = inputs(shape, dtype=torch.float64)
    own = {n: p.detach() for n, p in mha.named_parameters()}
    ensemble = {n: torch.stack([p, p + 0.1 * tangents_of(own, 1)[n], p - 0.1 * tangents_of(own, 2)[n]])
                for n, p in own.items()}  # (3, ...) per parameter; the first is the module's own
    with torch.set_grad_enabled(grad_mode):
        got = torch.func.vmap(lambda w: torch.func.functional_call(mha, w, (x,)))(ensemble)  # (3, B, S, E)
    for i in range(3):
        want = reference(mha, x, weights={n: t[i] for n, t in ensemble.items()})
        torch.testing.assert_close(got[i], want, atol=1e-10, rtol=0, msg=f"member {i}")


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("grad_mode", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
def test_vmap_over_a_batch_of_inputs_is_served_and_exact(shape, grad_mode, padded):
    mha = module64()
    xs = torch.stack([inputs(shape, seed=s, dtype=torch.float64) for s in range(3)])  # (3, B, S, E)
    masks = torch.ones(3, *shape, dtype=torch.bool)  # (3, B, S)
    if padded:
        masks[:, 0, -1] = False
        masks[1, 1, 1:] = False
    with torch.set_grad_enabled(grad_mode):
        got = torch.func.vmap(mha)(xs, masks if padded else None) if padded else torch.func.vmap(mha)(xs)
    for i in range(3):
        want = reference(mha, xs[i], masks[i] if padded else None)
        torch.testing.assert_close(got[i], want, atol=1e-10, rtol=0, msg=f"x {i}")


def test_per_sample_gradients_by_vmap_of_grad_are_exact():
    mha = module64()
    xs = inputs((3, 4), dtype=torch.float64)  # 3 samples of (S=4, E)
    params = {n: p.detach() for n, p in mha.named_parameters()}

    def loss(w, x, f):
        return f(w, x[None]).square().sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(
        params, xs, lambda w, x: torch.func.functional_call(mha, w, (x,)))
    for i in range(3):
        want = torch.func.grad(loss)(params, xs[i], lambda w, x: reference(mha, x, weights=w))
        for name in params:
            torch.testing.assert_close(got[name][i], want[name], atol=1e-9, rtol=0, msg=f"{name}, sample {i}")


# ---------------------------------------------------------------- parametrised projections
# weight_norm, prune and spectral_norm (old style) take "weight" out of the Linear's parameter
# dict and compute it in a forward pre-hook; the new-style parametrisations change its class.


def _old_weight_norm(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations.weight_norm
        return nn.utils.weight_norm(m)


PARAMETRISATIONS = {
    "weight_norm": _old_weight_norm,
    "prune.l1_unstructured": lambda m: prune.l1_unstructured(m, "weight", amount=0.3),
    "prune.random_unstructured": lambda m: prune.random_unstructured(m, "weight", amount=0.3),
    "spectral_norm": nn.utils.spectral_norm,
    "parametrizations.weight_norm": nn.utils.parametrizations.weight_norm,
    "parametrizations.spectral_norm": nn.utils.parametrizations.spectral_norm,
    "parametrizations.orthogonal": nn.utils.parametrizations.orthogonal,
}


def parametrised(kind, proj, seed=5):
    torch.manual_seed(seed)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64).eval()
    torch.manual_seed(seed)  # random_unstructured's mask
    PARAMETRISATIONS[kind](getattr(mha, proj))
    return mha


def effective(mha):
    """The weights the projections compute (read after a forward: the old-style hooks set them there)."""
    return {f"{n}.{kind}": getattr(getattr(mha, n), kind).detach().double()
            for n in ("q_proj", "k_proj", "v_proj", "out_proj") for kind in ("weight", "bias")}


def check_effective(mha, shape, atol=1e-10):
    x = inputs(shape, dtype=mha.q_proj.bias.dtype)
    for grad_mode in (False, True):
        with torch.set_grad_enabled(grad_mode):
            got = mha(x)
        torch.testing.assert_close(got.double(), reference(mha, x, weights=effective(mha)), atol=atol, rtol=0)


@pytest.mark.parametrize("proj", ["q_proj", "k_proj", "v_proj", "out_proj"])
@pytest.mark.parametrize("kind", list(PARAMETRISATIONS))
def test_a_parametrised_projection_converts_saves_and_loads_as_an_nn_linear_does(kind, proj):
    mha = parametrised(kind, proj)
    check_effective(mha, SMALL)
    check_effective(mha, LARGE)
    mha.float()
    assert mha.q_proj.bias.dtype == torch.float32
    check_effective(mha, SMALL, atol=1e-5)
    mha.double()
    check_effective(mha, LARGE)
    mha.half()
    assert all(p.dtype == torch.float16 for p in mha.parameters())
    mha.to(torch.float64)
    check_effective(mha, SMALL)
    state = {n: t.clone() for n, t in mha.state_dict().items()}
    other = parametrised(kind, proj, seed=6)
    other.load_state_dict(state)
    for name, t in other.state_dict().items():
        torch.testing.assert_close(t, state[name], atol=0, rtol=0, msg=name)
    x = inputs(LARGE, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(other(x), mha(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("proj", ["q_proj", "out_proj"])
@pytest.mark.parametrize("kind", list(PARAMETRISATIONS))
def test_a_refused_load_into_a_parametrised_module_changes_nothing(kind, proj):
    mha = parametrised(kind, proj)
    before = {n: t.clone() for n, t in mha.state_dict().items()}
    wrong = {n: t + 1 for n, t in before.items()}
    wrong["k_proj.bias"] = torch.zeros(E + 1, dtype=torch.float64) if "k_proj.bias" in wrong else None
    with pytest.raises(RuntimeError, match=re.escape("nothing of this module was loaded")):
        mha.load_state_dict(wrong)
    for name, t in mha.state_dict().items():
        assert torch.equal(t, before[name]), name


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
def test_fake_tensors_trace_the_module_without_reading_memory_or_values(shape, padded):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mha = module64()
    x = inputs(shape, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, -1] = False
    mode = FakeTensorMode()
    with torch.no_grad():
        params = {n: mode.from_tensor(p.detach()) for n, p in mha.named_parameters()}
    with mode, torch.no_grad():
        out = torch.func.functional_call(mha, params, (mode.from_tensor(x), mode.from_tensor(mask) if padded else None))
    assert isinstance(out, FakeTensor) and out.shape == (*shape, E) and out.dtype == torch.float64


@pytest.mark.parametrize("kind", [None, *PARAMETRISATIONS])
def test_a_strict_load_refused_for_missing_or_unexpected_keys_changes_nothing(kind):
    mha = parametrised(kind, "q_proj") if kind is not None else module64()
    before = {n: t.clone() for n, t in mha.state_dict().items()}
    plain = {n: t + 1 for n, t in module64().state_dict().items()}  # q_proj.weight, not its parametrisation's
    if kind is None:
        del plain["q_proj.weight"]  # missing
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        mha.load_state_dict(plain)
    for name, t in mha.state_dict().items():
        assert torch.equal(t, before[name]), name
    mha.load_state_dict(plain, strict=False)  # not refused: loads what it names, as torch does
    assert torch.equal(mha.k_proj.weight, plain["k_proj.weight"])

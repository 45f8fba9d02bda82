"""torch.compile: whole graphs (fullgraph=True, zero graph breaks) equal to eager, and no host reads.

Most cases compile with the "aot_eager" backend (traces forward and backward, compiles
nothing: fast); one runs through inductor. ``fullgraph=True`` makes any graph break raise (a second trace through
``torch._dynamo.explain`` to count them would double Dynamo's time, most of these tests' time).

Legend: B batch, H heads, S query length, Sk key length, E embed dim, T new positions.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch._dynamo as dynamo
import torch._dynamo.testing  # noqa: F401  (dynamo.testing.CompileCounter: not imported by torch._dynamo itself)
from torch import Tensor
from torch.overrides import TorchFunctionMode

import headwise
from headwise import policy

E, H, B, S = 32, 4, 2, 5
PAD = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    dynamo.reset()


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(B, S, E, generator=gen),
        "context": torch.randn(B, 7, E, generator=gen),
        "4d": torch.rand(B, 1, S, S, generator=gen) > 0.3,
        "bias": torch.randn(B, H, S, S, generator=gen),
    }


# name: (module kwargs, mask, forward kwargs)
MODULE_CASES = {
    "no-mask": ({}, None, {}),
    "pad-int": ({}, "pad", {}),
    "pad-bool": ({}, "pad-bool", {}),
    "4d-bool": ({}, "4d", {}),
    "float-bias": ({}, "bias", {}),
    "cross": ({}, "ctx-pad", {"context": True}),
    "causal-gqa-rope": ({"num_kv_heads": 2, "rope": True, "is_causal": True}, "pad", {}),
    "alibi-window": ({"alibi": True, "window": 3}, "pad", {}),
    "qk_norm-yarn-partial": ({"qk_norm": "rms", "rotary_dim": 4, "is_causal": True, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}}, "pad", {}),
    "value-dim-sinks": ({"v_head_dim": 6, "num_kv_heads": 2, "window": 3, "sink_tokens": 1, "rope": True}, "pad", {}),
    "need-weights": ({}, "pad", {"need_weights": True}),
    "sinks": ({"sinks": True, "num_kv_heads": 2}, "pad", {}),
    "softcap-sinks-causal": ({"softcap": 2.0, "sinks": True, "num_kv_heads": 2, "is_causal": True}, "pad", {}),
}


def _module_call(name):
    kwargs, mask_kind, fwd = MODULE_CASES[name]
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, **kwargs)
    t = _inputs()
    mask = {None: None, "pad": PAD, "pad-bool": PAD.bool(), "4d": t["4d"], "bias": t["bias"],
            "ctx-pad": torch.tensor([[1] * 7, [1] * 4 + [0] * 3])}[mask_kind]
    fwd = dict(fwd)
    if fwd.pop("context", False):
        fwd["context"] = t["context"]
    return mha, (t["x"].requires_grad_(), mask), fwd


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_module_compiles_whole_and_equals_eager(name):
    mha, args, kwargs = _module_call(name)
    compiled = torch.compile(mha, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break raises
    want, got = mha(*args, **kwargs), compiled(*args, **kwargs)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(got[0].sum(), args[0])
    (wx,) = torch.autograd.grad(want[0].sum(), args[0])
    torch.testing.assert_close(gx, wx, atol=1e-5, rtol=1e-5)


def test_dropout_in_training_compiles_whole():
    mha = headwise.MultiHeadAttention(E, H, dropout=0.2).train()
    x = _inputs()["x"].requires_grad_()
    out = torch.compile(mha, fullgraph=True, backend="aot_eager")(x, PAD)  # fullgraph: a graph break raises
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert (out[1, 3:] == 0).all()  # padded queries output zeros


def test_inductor_forward_and_backward_equal_eager():
    mha, (x, mask), _ = _module_call("causal-gqa-rope")
    compiled = torch.compile(mha, fullgraph=True)  # inductor
    got, want = compiled(x, mask), mha(x, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx, atol=1e-5, rtol=1e-5)


ATTENTION_CASES = {
    "plain": (None, {}),
    "key-padding": ("pad", {}),
    "4d-bool": ("4d", {}),
    "float-bias": ("bias", {}),
    "causal-longer-keys": (None, {"is_causal": True}),
    "window-alibi": ("pad", {"window": 2, "alibi_slopes": headwise.masks.alibi_slopes(H)}),
    "window-sinks": ("pad", {"window": 2, "sink_tokens": 1}),
    "weights": ("pad", {"need_weights": True}),
    "softcap-sinks": ("pad", {"softcap": 2.0, "sinks": torch.linspace(-1.0, 1.0, H)}),
    "sinks": ("4d", {"sinks": torch.linspace(-1.0, 1.0, H)}),
}


# Each case once, with H kv heads (MHA) and 2 (GQA) in turn: both groupings meet masks, biases,
# windows, sinks and weights, in 10 compiles instead of 20.
ATTENTION_GRID = [(name, H if i % 2 else 2) for i, name in enumerate(ATTENTION_CASES)]


@pytest.mark.parametrize(("name", "kv_heads"), ATTENTION_GRID, ids=[f"{kv}-{name}" for name, kv in ATTENTION_GRID])
def test_attention_compiles_whole_and_equals_eager(name, kv_heads):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, S, 8, generator=gen)
    k, v = torch.randn(2, B, kv_heads, S + 2, 8, generator=gen)
    kind, kwargs = ATTENTION_CASES[name]
    mask = {None: None, "pad": torch.tensor([[1] * 7, [1] * 4 + [0] * 3]).bool(),
            "4d": torch.rand(B, 1, S, S + 2, generator=gen) > 0.3,
            "bias": torch.randn(B, H, S, S + 2, generator=gen)}[kind]
    got = torch.compile(headwise.attention, fullgraph=True, backend="aot_eager")(q, k, v, mask, **kwargs)
    want = headwise.attention(q, k, v, mask, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


DYNAMIC_NTK = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}  # grows from step 3 below


@pytest.mark.parametrize("kwargs", [{}, {"rope": True, "num_kv_heads": 2}, {"alibi": True, "window": 3},
                                    {"rope_parameters": DYNAMIC_NTK, "qk_norm": "rms"},
                                    {"softcap": 1.0, "sinks": True, "num_kv_heads": 2},
                                    {"v_head_dim": 6, "window": 3, "sink_tokens": 2}])
def test_static_cache_decodes_every_step_on_one_graph(kwargs):
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, **kwargs).eval()
    static, dynamic = mha.new_cache(B, 16, static=True), mha.new_cache(B, 16)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randn(B, 5, E, generator=gen)
    counter = dynamo.testing.CompileCounter()
    step = torch.compile(mha, fullgraph=True, backend=counter)
    with torch.no_grad():
        mha(prompt, PAD, cache=static, is_causal=True)
        mha(prompt, PAD, cache=dynamic, is_causal=True)
        for t in range(6):
            x, keep = torch.randn(B, 1, E, generator=gen), torch.tensor([[1], [t % 2]])
            got = step(x, keep, cache=static, is_causal=True)
            torch.testing.assert_close(got, mha(x, keep, cache=dynamic, is_causal=True), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1  # one graph for every step
    assert len(static) == len(dynamic) == 11


def test_dynamic_cache_step_has_no_graph_break():
    mha = headwise.MultiHeadAttention(E, H, rope=True).eval()
    cache = mha.new_cache(B, 16)
    with torch.no_grad():
        mha(_inputs()["x"], cache=cache, is_causal=True)
        assert dynamo.explain(mha)(torch.randn(B, 1, E), cache=cache, is_causal=True).graph_break_count == 0


def test_under_compile_the_module_plans_the_dense_path(monkeypatch, cheap_packing):
    mha = headwise.MultiHeadAttention(E, H)
    x = _inputs()["x"]
    heavy = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])  # 70% padding: eager "auto" packs
    assert mha.plan(x, heavy).path == "packed"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    plan = mha.plan(x, heavy)
    assert (plan.path, plan.why) == (
        "dense", "under torch.compile: packing needs data-dependent shapes (packing=True packs anyway)")
    assert headwise.MultiHeadAttention(E, H, packing=True).plan(x, heavy).path == "packed"


def test_packed_module_and_function_run_compiled_with_breaks_allowed():
    """Packing reads the lengths on the host: compiled without fullgraph, it still equals eager."""
    mha = headwise.MultiHeadAttention(E, H, packing=True)
    x = _inputs()["x"]
    torch.testing.assert_close(torch.compile(mha, backend="aot_eager")(x, PAD), mha(x, PAD), atol=1e-5, rtol=1e-5)
    q = k = v = torch.randn(9, H, 8)
    cu = torch.tensor([0, 4, 9])
    packed = torch.compile(headwise.packed_attention, backend="aot_eager")
    torch.testing.assert_close(packed(q, k, v, cu, cu, is_causal=True),
                               headwise.packed_attention(q, k, v, cu, cu, is_causal=True))


# ------------------------------------------------------------------ no host reads


class NoHostReads(TorchFunctionMode):
    """Fails on every read of a tensor's values by Python: a host-device sync on a GPU."""

    READS = {Tensor.item, Tensor.__bool__, Tensor.__float__, Tensor.__int__, Tensor.__index__, Tensor.tolist,
             Tensor.nonzero, torch.nonzero}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"forward read tensor values on the host: {func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_no_host_read_in_forward_where_values_are_not_free(name, monkeypatch):
    """As on a GPU (policy.reads_values is False there), forward reads no tensor value."""
    mha, (x, mask), kwargs = _module_call(name)
    heavy = mask is not None and mask.dim() == 2 and "context" not in kwargs
    with NoHostReads():
        with pytest.raises(AssertionError, match="read tensor values on the host"):
            bool(x.sum() > 0)  # the mode catches a read
        monkeypatch.setattr(policy, "reads_values", lambda t: False)
        out = mha(x, mask, **kwargs)
    assert out is not None
    if heavy:
        assert mha.plan(x, mask).path == "dense"


@pytest.mark.parametrize("kwargs", [{"rope": True}, {"rope_parameters": DYNAMIC_NTK, "qk_norm": "rms"}])
def test_no_host_read_in_a_decoding_step(monkeypatch, kwargs):
    monkeypatch.setattr(policy, "reads_values", lambda t: False)
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2, **kwargs).eval()
    for static in (False, True):
        cache = mha.new_cache(B, 16, static=static)
        with torch.no_grad(), NoHostReads():
            mha(_inputs()["x"], PAD, cache=cache, is_causal=True)
            mha(torch.randn(B, 1, E), torch.tensor([[1], [0]]), cache=cache, is_causal=True)


# ------------------------------------------------------------------ rules, lengths, the memo


def _shifted(score, b, h, q_idx, kv_idx):
    """A general score_mod (not a bias): a pure function of its arguments."""
    return score * 0.5 + 0.1 * (kv_idx - q_idx)


# name: (module kwargs, forward kwargs)
RULES_CASES = {
    "sliding-window-mask_mod": ({"mask_mod": headwise.masks.sliding_window(3)}, {}),
    "causal-score_mod": ({"score_mod": _shifted, "is_causal": True}, {}),
    "sliding-window-mask_mod-chunked": ({"mask_mod": headwise.masks.sliding_window(3), "backend": "chunked"}, {}),
    "causal-mask_mod-score_mod-chunked": ({"mask_mod": headwise.masks.causal, "score_mod": _shifted,
                                           "backend": "chunked"}, {}),
}


@pytest.mark.parametrize("name", list(RULES_CASES))
def test_rules_compile_whole_and_equal_eager(name):
    """A mask_mod or score_mod neither reads a tile map on the host nor reads "auto"'s share
    of empty tiles as a number under torch.compile: the module compiles whole."""
    kwargs, fwd = RULES_CASES[name]
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, **kwargs)
    x = _inputs()["x"].requires_grad_()
    got = torch.compile(mha, fullgraph=True, backend="aot_eager")(x, **fwd)
    want = mha(x, **fwd)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (gx,) = torch.autograd.grad(got.sum(), x)
    (wx,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(gx, wx, atol=1e-5, rtol=1e-5)


# name: module kwargs of a call that runs the chunked kernel on the CPU
LENGTH_CASES = {
    "softcap": {"softcap": 2.0},
    "score_mod": {"score_mod": _shifted, "is_causal": True},
    "mask_mod-chunked": {"mask_mod": headwise.masks.sliding_window(3), "backend": "chunked"},
}


@pytest.mark.parametrize("name", list(LENGTH_CASES))
def test_compiled_calls_across_sequence_lengths_stay_within_two_graphs(name):
    """The first length compiles a static graph, the second a dynamic one that serves every
    later length (no guard on S): not one graph per length (the ninth failed under fullgraph)."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, **LENGTH_CASES[name])
    counter = dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    gen = torch.Generator().manual_seed(3)
    for S_ in (3, 4, 6, 9, 11):
        x = torch.randn(B, S_, E, generator=gen, requires_grad=True)
        got, want = compiled(x), mha(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        (gx,) = torch.autograd.grad(got.sum(), x)
        (wx,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(gx, wx, atol=1e-5, rtol=1e-5)
    assert counter.frame_count <= 2


def test_eager_calls_with_new_signatures_do_not_recompile_a_compiled_call():
    """The compiled call reads nothing of the module's eager memo: the memo growing (each new
    eager signature adds an entry) guards nothing of the compiled graph."""
    mha = headwise.MultiHeadAttention(E, H)
    counter = dynamo.testing.CompileCounter()
    compiled = torch.compile(mha, fullgraph=True, backend=counter)
    x = _inputs()["x"]
    compiled(x)
    compiled(x)
    assert counter.frame_count == 1
    for S_ in range(1, 5):
        mha(torch.randn(B, S_, E))  # a new eager signature: remembered
        mha(torch.randn(B, S_, E), PAD[:, :S_])
        torch.testing.assert_close(compiled(x), mha(x))
    assert len(mha._repeats) > 1
    assert counter.frame_count == 1

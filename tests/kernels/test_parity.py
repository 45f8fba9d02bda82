"""Every kernel against the float64 reference: outputs and gradients, every mask form.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from conftest import assert_served, contract_backends, reference_attention
from headwise import policy

BACKENDS = contract_backends()
B, D = 3, 8
SHAPES = [(5, 5), (3, 7), (7, 3)]  # (S, Sk): square, fewer queries (decode-like), more queries
HEADS = [(4, 4), (4, 2), (4, 1)]  # (H, Hkv): MHA, GQA, MQA
MASKS = [
    "none", "pad2d_bool", "pad2d_int", "pad2d_float", "full3d_bool", "bcast3d_int",
    "full4d_bool", "bcast4d_float", "doc_expanded",
]


def make_mask(form: str, H: int, S: int, Sk: int, gen: torch.Generator):
    """A mask in the given form; every form except 'none' contains a dead query row."""
    if form == "none":
        return None
    lengths = torch.tensor([Sk, max(Sk - 2, 1), 0])  # batch row 2 is fully padded
    pad = torch.arange(Sk)[None, :] < lengths[:, None]  # (B, Sk)
    if form == "pad2d_bool":
        return pad
    if form == "pad2d_int":
        return pad.long()
    if form == "pad2d_float":
        return torch.zeros(B, Sk).masked_fill(~pad, float("-inf")) + torch.randn(B, Sk, generator=gen)
    if form == "doc_expanded":  # the first document's unsqueeze(1).unsqueeze(2).expand
        return pad.int().unsqueeze(1).unsqueeze(2).expand(B, H, S, Sk)
    if form == "full3d_bool":
        m = torch.rand(B, S, Sk, generator=gen) > 0.3
        m[0, 1] = False  # a dead row
        return m
    if form == "bcast3d_int":
        m = (torch.rand(1, S, Sk, generator=gen) > 0.3).int()
        m[0, -1] = 0
        return m
    if form == "full4d_bool":
        m = torch.rand(B, H, S, Sk, generator=gen) > 0.4
        m[1, 2, 0] = False
        return m
    if form == "bcast4d_float":
        m = torch.randn(B, 1, S, Sk, generator=gen)
        m = m.masked_fill(torch.rand(B, 1, S, Sk, generator=gen) > 0.6, float("-inf"))
        m[2, 0, 1] = float("-inf")
        return m
    raise AssertionError(form)


def attend(q, k, v, mask=None, *, backend, **kwargs):
    """headwise.attention on ``backend``; the test fails if the kernel refuses the request."""
    served = ("is_causal", "dropout_p", "window", "alibi_slopes", "softcap", "sinks", "sink_tokens")
    assert_served(backend, q, k, v, mask, **{n: kwargs[n] for n in served if n in kwargs})
    return headwise.attention(q, k, v, mask, backend=backend, **kwargs)

@pytest.fixture(params=[*BACKENDS, "chunked-tiled"])
def backend(request, monkeypatch):
    """Each backend; 'chunked-tiled' runs chunked with tiny tiles so the online softmax
    really spans several key blocks and causal tiles get skipped."""
    if request.param == "chunked-tiled":
        monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 2)
        monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 3)
        return "chunked"
    return request.param


def _inputs(H, Hkv, S, Sk, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v, gen


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("shape", SHAPES, ids=["S=Sk", "S<Sk", "S>Sk"])
@pytest.mark.parametrize("form", MASKS)
def test_matches_float64_reference(backend, form, shape, heads, is_causal, ref):
    (S, Sk), (H, Hkv) = shape, heads
    q, k, v, gen = _inputs(H, Hkv, S, Sk)
    mask = make_mask(form, H, S, Sk, gen)
    out = attend(q, k, v, mask, is_causal=is_causal, backend=backend)
    grad_out = torch.randn(out.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected, weights = ref(qd, kd, vd, mask, is_causal=is_causal)
    edq, edk, edv = torch.autograd.grad(expected, (qd, kd, vd), grad_out.double())

    for got, want in ((out, expected), (dq, edq), (dk, edk), (dv, edv)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    dead = weights.sum(-1) == 0  # (B, H, S) rows that may attend nothing
    assert (out.detach()[dead] == 0).all()
    assert (dq[dead] == 0).all()


WEIGHT_BACKENDS = [n for n in BACKENDS if headwise.kernels.get_kernel(n).supports_weights]


@pytest.mark.parametrize("form", ["none", "pad2d_bool", "bcast4d_float"])
@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
def test_weights_match_reference(backend, form, ref):
    q, k, v, gen = _inputs(4, 2, 5, 6)
    mask = make_mask(form, 4, 5, 6, gen)
    out, weights = headwise.attention(q, k, v, mask, is_causal=True, backend=backend,
                                      need_weights=True)
    expected, expected_weights = ref(q, k, v, mask, is_causal=True)
    torch.testing.assert_close(weights.double(), expected_weights, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gradcheck_float64(backend, is_causal):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)

    def f(q, k, v):
        return headwise.attention(q, k, v, mask, is_causal=is_causal, backend=backend)

    attend(q, k, v, mask, is_causal=is_causal, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("layout", [(1, 1, 3, 4), (2, 1, 3, 4), (2, 2, 3, 4), (2, 2, 1, 4)],
                         ids=["shared", "per-batch", "full", "per-key"])
def test_gradcheck_float_mask_bias(backend, layout, ref):
    """A learnable additive bias of any broadcast layout receives its gradient through every
    kernel, to float64 precision."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(layout, generator=gen, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, bias, is_causal=True, backend=backend)
    want = ref(q, k, v, bias, is_causal=True)[0]
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for got, exact in zip(torch.autograd.grad(out, (q, k, v, bias), g),
                          torch.autograd.grad(want, (q, k, v, bias), g), strict=True):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, exact, atol=1e-10, rtol=1e-10)


    def f(q, k, v, bias):
        return headwise.attention(q, k, v, bias, is_causal=True, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


@pytest.mark.parametrize("mask_form", ["none", "pad2d_bool"])
def test_dropout_gradients_replay_the_forwards_dropout(backend, mask_form):
    """With the global seed reset before every call, dropout is a fixed function of q, k, v;
    gradcheck then proves backward applies exactly the dropout (and its 1 / (1 - p)) that
    forward drew."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 1, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = make_mask(mask_form, 2, 3, 5, gen)

    def f(q, k, v):
        torch.manual_seed(0)
        return headwise.attention(q, k, v, mask, dropout_p=0.4, is_causal=True, backend=backend)

    assert_served(backend, q, k, v, mask, dropout_p=0.4, is_causal=True)
    assert not torch.equal(f(q, k, v), headwise.attention(q, k, v, mask, is_causal=True, backend=backend))
    assert torch.autograd.gradcheck(f, (q, k, v))


def plain_low_precision(q, k, v, mask, *, is_causal=False):
    """Plain PyTorch attention computed in q's own dtype, flash-attn's yardstick for fp16/bf16.

    Written here, not taken from headwise, so no kernel is its own yardstick. Like
    flash-attn's ``attention_ref(upcast=False)`` it scales q before the product. ``mask``:
    (B, Sk) bool key padding or None.
    """
    H, Hkv, S, Sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # (B, H, Sk, D)
    scores = (q / q.shape[-1] ** 0.5) @ k.transpose(-2, -1)  # (B, H, S, Sk) in q's dtype
    allowed = torch.ones(S, Sk, dtype=torch.bool)
    if is_causal:
        allowed = torch.arange(Sk)[None, :] <= torch.arange(S)[:, None] + (Sk - S)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)  # dead rows: 0
    return p @ v  # (B, H, S, D)


@pytest.mark.parametrize("magnitude", [1.0, 40.0], ids=["unit", "large"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_within_twice_plain_torch_error(backend, dtype, magnitude, ref):
    """flash-attn's rule: output and gradient errors vs float64 at most 2x those of plain
    PyTorch in ``dtype`` (plus the dtype's own rounding of the reference).

    'large' inputs have |q . k| up to ~10^5, beyond fp16's 65504, while the scaled scores
    (q . k / 8 at D = 64) fit: every kernel must stay finite there.
    """
    gen = torch.Generator().manual_seed(3)
    q, k, v = (magnitude * (1 + 0.05 * torch.randn(B, h, n, 64, generator=gen))
               for h, n in ((4, 16), (2, 24), (2, 24)))
    v = torch.randn(B, 2, 24, 64, generator=gen)
    mask = make_mask("pad2d_bool", 4, 16, 24, gen)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    g = torch.randn(B, 4, 16, 64, generator=gen)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]  # float64 leaves: exact gradients
    expected, _ = ref(*exact, mask, is_causal=True)
    want = torch.autograd.grad(expected, exact, g.double())
    plain = plain_low_precision(q, k, v, mask, is_causal=True)
    plain_grads = torch.autograd.grad(plain, (q, k, v), g.to(dtype))
    got = attend(q, k, v, mask, is_causal=True, backend=backend)
    got_grads = torch.autograd.grad(got, (q, k, v), g.to(dtype))
    assert got.dtype == dtype
    for name, a, p, w in (("out", got, plain, expected), *zip(("dq", "dk", "dv"), got_grads, plain_grads, want,
                                                               strict=True)):
        assert torch.isfinite(a).all(), name
        rounding = (w.to(dtype).double() - w).abs().max().item()  # the dtype cannot do better than this
        err, plain_err = ((t.double() - w).abs().max().item() for t in (a, p))
        assert err <= 2 * plain_err + 2 * rounding, (name, err, plain_err, rounding)


def test_dropout_is_unbiased_and_keeps_dead_rows_zero(backend, ref):
    """Averaged over a large batch of identical inputs, dropout output -> no-dropout output."""
    n = 4000
    gen = torch.Generator().manual_seed(4)
    q1 = torch.randn(1, 2, 3, 4, generator=gen)
    k1, v1 = torch.randn(2, 1, 2, 4, 4, generator=gen)
    mask1 = torch.tensor([[[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]]], dtype=torch.bool)
    q, k, v = (t.expand(n, -1, -1, -1) for t in (q1, k1, v1))
    mask = mask1.expand(n, -1, -1)  # (B, S, Sk)
    torch.manual_seed(0)
    out = attend(q, k, v, mask, dropout_p=0.3, backend=backend)
    expected, _ = ref(q1, k1, v1, mask1)
    assert torch.isfinite(out).all()
    assert (out[:, :, 1] == 0).all()  # the dead query row
    torch.testing.assert_close(out.double().mean(0, keepdim=True), expected, atol=0.06, rtol=0)
    assert not torch.allclose(out[0], out[1])  # dropout really drew different masks


@st.composite
def _problem(draw):
    """Random shapes, grouping, mask layout and causality."""
    Bq = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    S, Sk, Dh = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.sampled_from([1, 4, 8]))
    layout = draw(st.sampled_from(["none", (Bq, Sk), (Bq, S, Sk), (1, S, Sk), (Bq, H, S, Sk),
                                   (Bq, 1, 1, Sk), (1, H, 1, Sk)]))
    kind = draw(st.sampled_from(["bool", "int", "float"]))
    return Bq, H, Hkv, S, Sk, Dh, layout, kind, draw(st.booleans()), draw(st.integers(0, 2**31))


@given(problem=_problem())
def test_property_every_backend_matches_reference(problem):
    Bq, H, Hkv, S, Sk, Dh, layout, kind, is_causal, seed = problem
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Bq, H, S, Dh, generator=gen, requires_grad=True)
    k = torch.randn(Bq, Hkv, Sk, Dh, generator=gen, requires_grad=True)
    v = torch.randn(Bq, Hkv, Sk, Dh, generator=gen, requires_grad=True)
    mask = None
    if layout != "none":
        allowed = torch.rand(layout, generator=gen) > 0.4
        if kind == "bool":
            mask = allowed
        elif kind == "int":
            mask = allowed.to(torch.int32) * torch.randint(1, 5, layout, generator=gen, dtype=torch.int32)
        else:
            mask = torch.randn(layout, generator=gen).masked_fill(~allowed, float("-inf"))
    expected, _ = reference_attention(q, k, v, mask, is_causal=is_causal)
    g = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(expected, (q, k, v), g)
    for name in BACKENDS:  # every listed backend serves every mask layout
        out = headwise.attention(q, k, v, mask, is_causal=is_causal, backend=name)
        got = torch.autograd.grad(out, (q, k, v), g.float())
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=name)
        for a, b in zip(got, want, strict=True):
            assert torch.isfinite(a).all(), name
            torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("shape", SHAPES, ids=["S=Sk", "S<Sk", "S>Sk"])
@pytest.mark.parametrize("form", ["none", "pad2d_bool", "bcast4d_float"])
def test_window_and_alibi_match_reference(backend, form, shape, heads, alibi, window, ref):
    (S, Sk), (H, Hkv) = shape, heads
    q, k, v, gen = _inputs(H, Hkv, S, Sk, seed=5)
    mask = make_mask(form, H, S, Sk, gen)
    slopes = headwise.masks.alibi_slopes(H) if alibi else None
    out = attend(q, k, v, mask, window=window, alibi_slopes=slopes, backend=backend)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), g)
    expected, _ = ref(q, k, v, mask, window=window, alibi_slopes=slopes)
    want = torch.autograd.grad(expected, (q, k, v), g.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


def test_alibi_without_causal_is_symmetric_distance(backend, ref):
    q, k, v, gen = _inputs(4, 2, 4, 6, seed=6)
    slopes = headwise.masks.alibi_slopes(4)
    out = attend(q, k, v, alibi_slopes=slopes, backend=backend)
    expected, _ = ref(q, k, v, alibi_slopes=slopes)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2], ids=["plain", "dropout"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", ["none", "pad2d_bool", "full4d_bool", "bcast4d_float"])
@pytest.mark.parametrize("sizes", [(0, 4, 5), (3, 0, 5), (3, 4, 0), (0, 0, 0)], ids=["B=0", "S=0", "Sk=0", "all=0"])
def test_empty_inputs_forward_and_backward(backend, sizes, form, is_causal, dropout_p):
    """B = 0, S = 0 or Sk = 0: an empty (B, H, S, D) result (zeros where S > 0 but no key)
    and gradients of the inputs' shapes."""
    Bn, S, Sk = sizes
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(Bn, 4, S, D, generator=gen).requires_grad_()
    k, v = (torch.randn(Bn, 2, Sk, D, generator=gen).requires_grad_() for _ in range(2))
    mask = {"none": None, "pad2d_bool": torch.ones(Bn, Sk, dtype=torch.bool),
            "full4d_bool": torch.ones(Bn, 4, S, Sk, dtype=torch.bool),
            "bcast4d_float": torch.zeros(Bn, 1, S, Sk)}[form]
    out = attend(q, k, v, mask, is_causal=is_causal, dropout_p=dropout_p, backend=backend)
    assert out.shape == (Bn, 4, S, D) and (out == 0).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and (g == 0).all()


def test_dropout_gradients_reach_a_float_bias(backend):
    """Dropout and a learnable additive bias together: the bias's gradient replays the dropout too."""
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 1, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(2, 1, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, bias):
        torch.manual_seed(0)
        return headwise.attention(q, k, v, bias, dropout_p=0.4, backend=backend)

    assert_served(backend, q, k, v, bias, dropout_p=0.4)
    assert torch.autograd.gradcheck(f, (q, k, v, bias))


def test_sdpa_without_native_grouped_query_repeats_kv_heads(monkeypatch, ref):
    """torch < 2.5 has no enable_gqa: the sdpa kernel then repeats the kv heads itself."""
    from headwise.kernels import sdpa

    monkeypatch.setattr(sdpa, "SDPA_HAS_GQA", False)
    q, k, v, gen = _inputs(4, 2, 5, 6)
    for mask in (None, make_mask("pad2d_bool", 4, 5, 6, gen)):
        out = headwise.attention(q, k, v, mask, backend="sdpa")
        torch.testing.assert_close(out.double(), ref(q, k, v, mask)[0], atol=1e-5, rtol=1e-5)


# --- v with its own head dim (Dv != D) and StreamingLLM sink tokens --------------------------

DV = 6  # v's head dim, against D = 8 for q and k


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=["S=Sk", "S<Sk", "S>Sk"])
@pytest.mark.parametrize("form", ["none", "pad2d_bool", "full3d_bool", "bcast4d_float"])
def test_own_value_head_dim_matches_reference(backend, form, shape, is_causal, ref):
    """v (B, Hkv, Sk, Dv) with Dv != D: output (B, H, S, Dv), gradients of q, k and v, on every kernel."""
    (S, Sk), (H, Hkv) = shape, (4, 2)
    q, k, _, gen = _inputs(H, Hkv, S, Sk, seed=11)
    v = torch.randn(B, Hkv, Sk, DV, generator=gen).requires_grad_()
    mask = make_mask(form, H, S, Sk, gen)
    out = attend(q, k, v, mask, is_causal=is_causal, backend=backend)
    assert out.shape == (B, H, S, DV)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), g)
    expected, _ = ref(q, k, v, mask, is_causal=is_causal)
    want = torch.autograd.grad(expected, (q, k, v), g.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, sinks", [(1, 1), (2, 3), (3, 1)], ids=["w1-n1", "w2-n3", "w3-n1"])
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("shape", [(5, 5), (3, 7), (7, 3), (9, 9)], ids=["S=Sk", "S<Sk", "S>Sk", "long"])
@pytest.mark.parametrize("form", ["none", "pad2d_bool", "bcast4d_float"])
def test_sink_tokens_match_reference(backend, form, shape, alibi, window, sinks, ref):
    """window=W, sink_tokens=n: query i sees (i + Sk - S - W, i + Sk - S] and the first n keys up
    to i + Sk - S; outputs and gradients on every kernel (chunked-tiled: sink tiles never skipped)."""
    (S, Sk), (H, Hkv) = shape, (4, 2)
    q, k, v, gen = _inputs(H, Hkv, S, Sk, seed=12)
    mask = make_mask(form, H, S, Sk, gen)
    slopes = headwise.masks.alibi_slopes(H) if alibi else None
    out = attend(q, k, v, mask, window=window, sink_tokens=sinks, alibi_slopes=slopes, backend=backend)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), g)
    expected, weights = ref(q, k, v, mask, window=window, sink_tokens=sinks, alibi_slopes=slopes)
    want = torch.autograd.grad(expected, (q, k, v), g.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)
    if Sk > window:  # the last query's window does not reach key 0: the sinks change its output
        plain, _ = ref(q, k, v, mask, window=window, alibi_slopes=slopes)
        assert not torch.allclose(plain[:, :, -1], expected[:, :, -1])


@pytest.mark.parametrize("case", ["Dv", "sinks", "both"])
def test_gradcheck_own_value_dim_and_sinks_float64(backend, case):
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, 6, 5 if case != "sinks" else 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    kwargs = {"is_causal": True} if case == "Dv" else {"window": 2, "sink_tokens": 2}

    def f(q, k, v):
        return headwise.attention(q, k, v, mask, backend=backend, **kwargs)

    attend(q, k, v, mask, backend=backend, **kwargs)
    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("sizes", [(0, 4, 5), (3, 0, 5), (3, 4, 0)], ids=["B=0", "S=0", "Sk=0"])
def test_empty_inputs_with_own_value_dim(backend, sizes):
    """An empty call returns (B, H, S, Dv) zeros and zero gradients of the inputs' shapes."""
    Bn, S, Sk = sizes
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(Bn, 4, S, D, generator=gen).requires_grad_()
    k = torch.randn(Bn, 2, Sk, D, generator=gen).requires_grad_()
    v = torch.randn(Bn, 2, Sk, DV, generator=gen).requires_grad_()
    out = attend(q, k, v, torch.ones(Bn, Sk, dtype=torch.bool), window=2, sink_tokens=1, backend=backend)
    assert out.shape == (Bn, 4, S, DV) and (out == 0).all()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g.shape == t.shape and (g == 0).all()


def test_own_value_dim_and_sink_tokens_with_softcap_and_sink_logits(backend, ref):
    """Dv != D and sink tokens together with learned sink logits (and soft-capping where the
    kernel takes it): the sink's extra key has v's own width; outputs and every gradient."""
    q, k, _, gen = _inputs(4, 2, 6, 9, seed=16)
    v = torch.randn(B, 2, 9, DV, generator=gen).requires_grad_()
    sinks = torch.randn(4, generator=gen).requires_grad_()
    mask = make_mask("pad2d_bool", 4, 6, 9, gen)
    kwargs = {"window": 2, "sink_tokens": 2, "sinks": sinks}
    if backend not in ("sdpa", "varlen"):  # the two that refuse soft-capping
        kwargs["softcap"] = 1.5
    out = attend(q, k, v, mask, backend=backend, **kwargs)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v, sinks), g)
    expected, _ = ref(q, k, v, mask, **kwargs)
    want = torch.autograd.grad(expected, (q, k, v, sinks), g.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)

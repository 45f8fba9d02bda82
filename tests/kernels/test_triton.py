"""The Triton flash kernel against the float64 reference: outputs and dq, dk, dv.

On a machine without a GPU the kernels run through Triton's interpreter
(``TRITON_INTERPRET=1``, set per test by the ``interpreter`` fixture), which executes
each tile as numpy arrays: slow, so shapes stay small (the interpreter's tiles are
16 x 16, so S and Sk of 20-45 still span several tiles and end in a partial one). On a
CUDA machine the same tests run the compiled kernels on the GPU. Everything that needs
triton is skipped, with the reason, where it is not installed.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import re

import pytest
import torch

import headwise
from conftest import reference_attention
from headwise.kernels import get_kernel
from headwise.kernels.registry import Request
from headwise.kernels.triton import configs, jit, launch, support, tile_maps
from headwise.rules import Rules

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _why_skip() -> str | None:
    if not support._triton_installed():
        return ("triton is not installed; pip install 'headwise[triton]' to run the Triton kernel tests "
                "(on a CPU they use Triton's interpreter)")
    version = importlib.metadata.version("triton")
    if DEVICE == "cpu" and tuple(int(p) for p in version.split(".")[:2]) < (3, 7):
        return (f"triton {version}'s interpreter cannot run loops with runtime bounds under recent numpy "
                "(fixed in 3.7); pip install 'triton>=3.7' to run these tests on a CPU")
    return None


SKIP_REASON = _why_skip()
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
TILE = configs.INTERPRET_CONFIG.block_n  # keys per tile in the interpreter
SHAPES = [(37, 37), (21, 45), (45, 21)]  # (S, Sk): square, fewer queries (decode-like), more queries
SHAPE_IDS = ["S=Sk", "S<Sk", "S>Sk"]
HEADS = [(2, 2), (4, 2), (2, 1)]  # (H, Hkv): MHA, GQA, MQA
MASKS = ["none", "right_pad", "left_pad", "hole", "float_pad", "broadcast"]


@pytest.fixture
def interpreter(monkeypatch):
    """Run on the GPU when there is one, else through Triton's interpreter."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def key_mask(kind: str, B: int, Sk: int, gen: torch.Generator, tile: int = TILE) -> torch.Tensor | None:
    """A key padding mask (B, Sk), or (1, 1, 1, Sk) for 'broadcast'.

    Every kind but 'none' and 'broadcast' pads the last batch row entirely (a row with
    nothing to attend) and, when Sk > 2 * tile, leaves a whole tile of padding in row 0.
    """
    if kind == "none":
        return None
    j = torch.arange(Sk)[None, :]  # (1, Sk)
    if kind == "broadcast":
        return (j % 5 != 3)[:, None, None, :]  # (1, 1, 1, Sk)
    if kind == "right_pad":  # variable lengths: row 0 keeps one tile and a bit
        mask = j < torch.tensor([[tile + 3], [Sk]] + [[Sk - 4]] * (B - 2))
    elif kind == "left_pad":  # generation-style: row 0's first tile and a bit are padding
        mask = j >= torch.tensor([[tile + 2], [0]] + [[3]] * (B - 2))
    elif kind == "hole":  # row 0: one whole tile of padding in the middle (or at the end)
        mask = ((j < tile) | (j >= 2 * tile)).expand(B, Sk).clone()
    elif kind == "float_pad":  # an additive float mask: random values, -inf on padding
        keep = j < torch.tensor([[tile + 1], [Sk]] + [[Sk - 2]] * (B - 2))
        mask = torch.randn(B, Sk, generator=gen).masked_fill(~keep, float("-inf"))
    else:
        raise AssertionError(kind)
    mask[-1] = float("-inf") if mask.is_floating_point() else False  # a fully padded row
    return mask


def make_inputs(B, H, Hkv, S, Sk, D, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen)
    k = torch.randn(B, Hkv, Sk, D, generator=gen)
    v = torch.randn(B, Hkv, Sk, D, generator=gen)
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, gen


def expected(q, k, v, mask, grad_out, **kw):
    """Output and (dq, dk, dv) of the float64 reference on the CPU."""
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    m = None if mask is None else mask.detach().cpu()
    out, weights = reference_attention(qd, kd, vd, m, **kw)
    grads = torch.autograd.grad(out, (qd, kd, vd), grad_out.detach().cpu().double())
    return out, grads, weights


def run_triton(q, k, v, mask, grad_out, **kw):
    m = None if mask is None else mask.to(DEVICE)
    out = headwise.attention(q, k, v, m, backend="triton", **kw)
    return out, torch.autograd.grad(out, (q, k, v), grad_out)


def assert_close(got, want, atol=1e-5, rtol=1e-5):
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.detach().cpu().double(), want, atol=atol, rtol=rtol)


def check_against_reference(q, k, v, mask, grad_out, **kw):
    """Triton's output and (dq, dk, dv) each within 1e-5 of the float64 reference.

    Returns the Triton output and grads and the reference weights, for further checks.
    """
    out, grads = run_triton(q, k, v, mask, grad_out, **kw)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = kw["alibi_slopes"].cpu()
    want, want_grads, weights = expected(q, k, v, mask, grad_out, **kw)
    assert_close(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert_close(got, ref)
    return out, grads, weights


# Every mask meets every shape; causal alternates, so each mask and each shape meets both values
# of it, and the grouping turns with them (every mask meets MHA, GQA and MQA): every pair of
# values of the four axes, in 18 cases through the interpreter instead of 36 (each a few seconds
# of CI). A GPU runs every combination.
MASK_GRID = [(form, shape, (MASKS.index(form) + SHAPES.index(shape)) % 2 == 1) for form in MASKS for shape in SHAPES]
if DEVICE == "cuda":
    MASK_GRID = [(form, shape, c) for form in MASKS for shape in SHAPES for c in (False, True)]


@needs_triton
@pytest.mark.parametrize(("form", "shape", "is_causal"), MASK_GRID,
                         ids=[f"{f}-{SHAPE_IDS[SHAPES.index(s)]}-{'causal' if c else 'full'}" for f, s, c in MASK_GRID])
def test_matches_float64_reference(interpreter, form, shape, is_causal):
    (S, Sk) = shape
    H, Hkv = HEADS[(MASKS.index(form) + SHAPES.index(shape)) % 3]  # every mask meets every grouping
    q, k, v, gen = make_inputs(2, H, Hkv, S, Sk, 16)
    mask = key_mask(form, 2, Sk, gen)
    grad_out = torch.randn(2, H, S, 16, generator=gen).to(DEVICE)
    out, grads, weights = check_against_reference(q, k, v, mask, grad_out, is_causal=is_causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    dead = (weights.sum(-1) == 0).to(DEVICE)  # (B, H, S) rows that may attend nothing
    if form not in ("none", "broadcast"):
        assert dead[-1].all()  # the fully padded batch row
    assert (out.detach()[dead] == 0).all()
    assert (grads[0][dead] == 0).all()


@needs_triton
@pytest.mark.parametrize("heads", [(8, 2), (4, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("shape", [(1, 40), (40, 40)], ids=["decode", "square"])
def test_grouped_query_heads_read_their_kv_head(interpreter, heads, shape):
    """Four query heads per kv head, a single query (decoding) or a square causal block,
    a right-padded batch: each group must read its own kv head and sum into its dk, dv."""
    (H, Hkv), (S, Sk) = heads, shape
    q, k, v, gen = make_inputs(2, H, Hkv, S, Sk, 32, seed=1)
    mask = torch.arange(Sk)[None, :] < torch.tensor([[Sk], [Sk - TILE - 5]])
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    check_against_reference(q, k, v, mask, grad_out, is_causal=True)


@needs_triton
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])
def test_head_dims(interpreter, head_dim):
    """The supported head dims, and one that is not a power of two (padded tiles)."""
    q, k, v, gen = make_inputs(1, 2, 1, 20, 27, head_dim, seed=2)
    mask = torch.arange(27)[None, :] < 19
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    check_against_reference(q, k, v, mask, grad_out, is_causal=True)


@needs_triton
@pytest.mark.parametrize("window, alibi, padded", [(1, False, False), (5, True, True), (20, False, True),
                                                   (20, True, False)],
                         ids=["diagonal", "5-alibi-padded", "20-padded", "20-alibi"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_window_and_alibi(interpreter, shape, window, alibi, padded):
    """Windows narrower than a tile, and wider (so some tiles need no position mask)."""
    (S, Sk) = shape
    q, k, v, gen = make_inputs(2, 4, 2, S, Sk, 16, seed=3)
    mask = key_mask("left_pad", 2, Sk, gen) if padded else None
    slopes = headwise.masks.alibi_slopes(4).to(DEVICE) if alibi else None
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    check_against_reference(q, k, v, mask, grad_out, window=window, alibi_slopes=slopes)


@needs_triton
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_alibi_is_a_symmetric_distance(interpreter, is_causal):
    q, k, v, gen = make_inputs(1, 4, 4, 21, 35, 16, seed=4)
    slopes = headwise.masks.alibi_slopes(4).to(DEVICE)
    mask = key_mask("float_pad", 2, 35, gen)[:1]
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    check_against_reference(q, k, v, mask, grad_out, is_causal=is_causal, alibi_slopes=slopes)


LOW_PRECISION_CASES = {
    "pad-causal-gqa": dict(heads=(4, 2), shape=(37, 37), form="right_pad", kw=dict(is_causal=True)),
    "leftpad-decode-mqa": dict(heads=(4, 1), shape=(21, 45), form="left_pad", kw=dict(is_causal=True)),
    "hole-full-mha": dict(heads=(2, 2), shape=(45, 21), form="hole", kw=dict()),
    "window-alibi": dict(heads=(4, 2), shape=(37, 37), form="none", kw=dict(window=9, alibi=True)),
}


@needs_triton
@pytest.mark.parametrize("case", LOW_PRECISION_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_within_twice_plain_torch_error(interpreter, dtype, case):
    """flash-attn's rule, forward and backward: the error against float64 is at most about
    twice the error of plain PyTorch (the matmul backend) in the same precision."""
    c = LOW_PRECISION_CASES[case]
    (H, Hkv), (S, Sk), kw = c["heads"], c["shape"], dict(c["kw"])
    q, k, v, gen = make_inputs(2, H, Hkv, S, Sk, 32, dtype=dtype, seed=5)
    mask = key_mask(c["form"], 2, Sk, gen)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = headwise.masks.alibi_slopes(H).to(DEVICE)
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    out, grads = run_triton(q, k, v, mask, grad_out, **kw)
    m = None if mask is None else mask.to(DEVICE)
    plain = headwise.attention(q, k, v, m, backend="matmul", **kw)
    plain_grads = torch.autograd.grad(plain, (q, k, v), grad_out)
    ref_kw = {**kw, "alibi_slopes": kw["alibi_slopes"].cpu()} if "alibi_slopes" in kw else kw
    want, want_grads, _ = expected(q, k, v, mask, grad_out, **ref_kw)
    assert out.dtype == dtype
    for name, got, base, ref in zip(["out", "dq", "dk", "dv"], (out, *grads), (plain, *plain_grads),
                                    (want, *want_grads), strict=True):
        assert torch.isfinite(got).all(), name
        err = (got.detach().cpu().double() - ref).abs().max().item()
        base_err = (base.detach().cpu().double() - ref).abs().max().item()
        assert err <= 2 * base_err + 1e-4, f"{name}: error {err:.3g} vs plain PyTorch {base_err:.3g}"


@needs_triton
@pytest.mark.parametrize("form", ["right_pad", "left_pad", "hole"])
def test_fully_padded_key_tiles_are_never_read(interpreter, form):
    """NaN in every fully padded key tile: a kernel that used one would spread it (the
    key bias adds -inf to NaN scores, giving NaN), one that skips them stays exact."""
    # The widest key tile of any kernel: a run of whole tiles of it is whole for all of them.
    tile = max(c.block_n for kind in ("forward", "dkdv", "dq")
               for c in configs._configs(kind, 16, torch.float32, DEVICE == "cpu"))
    S, Sk = 2 * tile - 2, 3 * tile - 3  # 30, 45 in the interpreter
    q, k, v, gen = make_inputs(2, 2, 1, S, Sk, 16, seed=6)
    mask = key_mask(form, 2, Sk, gen, tile)
    tiles = torch.nn.functional.pad(mask, (0, -Sk % tile)).reshape(2, -1, tile)  # (B, T, tile)
    dead = (~tiles.any(-1)).repeat_interleave(tile, dim=1)[:, :Sk]  # (B, Sk) keys in dead tiles
    assert dead[0].any(), "the mask must leave a whole tile of padding in row 0"
    with torch.no_grad():
        for t in (k, v):
            t.masked_fill_(dead[:, None, :, None].to(DEVICE), float("nan"))
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    out, (dq, dk, dv) = run_triton(q, k, v, mask, grad_out, is_causal=True)
    clean = [t.detach().masked_fill(dead[:, None, :, None].to(DEVICE), 0.0) for t in (k, v)]
    want, (edq, edk, edv), _ = expected(q, *clean, mask, grad_out, is_causal=True)
    assert_close(out, want)
    assert_close(dq, edq)
    assert_close(dk, edk)
    assert_close(dv, edv)


@needs_triton
@pytest.mark.parametrize("batch_rows", [2, 1], ids=["per-row", "broadcast"])
def test_float_key_mask_gets_its_gradient(interpreter, batch_rows):
    """A learnable additive key bias (B|1, Sk) receives the sum of dL/dscores over heads
    and queries (and batch rows, when it is broadcast)."""
    q, k, v, gen = make_inputs(2, 4, 2, 21, 37, 16, seed=7)
    bias = key_mask("float_pad", 2, 37, gen)[:batch_rows].clone().to(DEVICE).requires_grad_()
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    out = headwise.attention(q, k, v, bias, is_causal=True, backend="triton")
    got = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    bd = bias.detach().cpu().double().requires_grad_()
    want_out, _ = reference_attention(qd, kd, vd, bd, is_causal=True)
    want = torch.autograd.grad(want_out, (qd, kd, vd, bd), grad_out.cpu().double())
    assert_close(out, want_out)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@needs_triton
@pytest.mark.parametrize("softcap, sinks, form, window", [
    (0.5, False, "left_pad", None),  # a strong cap: every score saturates towards +-0.5
    (50.0, True, "float_pad", None),  # Gemma 2's cap, where the scores sit near tanh's linear part
    (None, True, "hole", 9),
    (2.0, True, "right_pad", None),
], ids=["softcap-strong", "softcap-gemma-sinks", "sinks-window", "softcap-sinks"])
def test_softcap_and_sinks_match_float64_reference(interpreter, softcap, sinks, form, window):
    """Outputs, dq, dk, dv and the sinks' gradient within 1e-5 of the float64 reference,
    with GQA, ALiBi, causal S < Sk, and a fully padded row (zeros with or without sinks)."""
    q, k, v, gen = make_inputs(2, 4, 2, 21, 37, 16, seed=11)
    mask = key_mask(form, 2, 37, gen)
    s = (2 * torch.randn(4, generator=gen)).to(DEVICE).requires_grad_() if sinks else None
    kw = dict(is_causal=True, window=window, softcap=softcap, sinks=s,
              alibi_slopes=headwise.masks.alibi_slopes(4).to(DEVICE))
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    out = headwise.attention(q, k, v, None if mask is None else mask.to(DEVICE), backend="triton", **kw)
    leaves = (q, k, v) + ((s,) if sinks else ())
    got = torch.autograd.grad(out, leaves, grad_out)
    exact = [t.detach().cpu().double().requires_grad_() for t in leaves]
    kw64 = {**kw, "alibi_slopes": kw["alibi_slopes"].cpu(), "sinks": exact[3] if sinks else None}
    want_out, weights = reference_attention(*exact[:3], mask, **kw64)
    want = torch.autograd.grad(want_out, exact, grad_out.cpu().double())
    assert_close(out, want_out)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    assert (out[-1].detach() == 0).all()  # the fully padded batch row


@needs_triton
def test_float_key_bias_gradient_with_softcap(interpreter):
    """The key bias is added after the cap: its gradient is the capped scores', not
    multiplied by 1 - tanh^2 (which only reaches q and k)."""
    q, k, v, gen = make_inputs(2, 4, 2, 21, 37, 16, seed=12)
    bias = key_mask("float_pad", 2, 37, gen).clone().to(DEVICE).requires_grad_()
    out = headwise.attention(q, k, v, bias, is_causal=True, softcap=1.0, backend="triton")
    got = torch.autograd.grad(out.sum(), (q, k, bias))
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    bd = bias.detach().cpu().double().requires_grad_()
    want_out, _ = reference_attention(qd, kd, vd, bd, is_causal=True, softcap=1.0)
    for a, b in zip(got, torch.autograd.grad(want_out.sum(), (qd, kd, bd)), strict=True):
        assert_close(a, b)


@needs_triton
def test_strided_inputs_and_expanded_grad(interpreter):
    """q, k, v as transposed (B, S, H, D) projections and a stride-0 gradient from .sum()."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 33, 3 * 2 * 16, generator=gen).to(DEVICE).requires_grad_()  # (B, S, 3*H*D)
    q, k, v = x.reshape(2, 33, 3, 2, 16).unbind(2)  # each (B, S, H, D), strided
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D), no copy
    assert not q.is_contiguous()
    mask = torch.arange(33)[None, :] < torch.tensor([[33], [20]])
    out = headwise.attention(q, k, v, mask.to(DEVICE), is_causal=True, backend="triton")
    (dx,) = torch.autograd.grad(out.sum(), x)
    xd = x.detach().cpu().double().requires_grad_()
    qd, kd, vd = (t.transpose(1, 2) for t in xd.reshape(2, 33, 3, 2, 16).unbind(2))
    want, _ = reference_attention(qd, kd, vd, mask, is_causal=True)
    (want_dx,) = torch.autograd.grad(want.sum(), xd)
    assert_close(out, want)
    assert_close(dx, want_dx)


@needs_triton
def test_torch_compile_traces_around_the_kernel(interpreter):
    """The custom op's fake implementations let dynamo and AOTAutograd trace forward and
    backward in one graph (aot_eager: the graph runs eagerly, no C++ compiler needed)."""
    q, k, v, gen = make_inputs(2, 4, 2, 19, 23, 16, seed=9)
    mask = key_mask("right_pad", 2, 23, gen).to(DEVICE)

    def loss(q, k, v):
        return headwise.attention(q, k, v, mask, is_causal=True, backend="triton").square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v))
    want = loss(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)


@needs_triton
def test_custom_op_registration_passes_opcheck(interpreter):
    q, k, v, gen = make_inputs(1, 2, 1, 17, 18, 16, seed=10)
    bias = torch.zeros(1, 18, device=DEVICE).masked_fill(torch.arange(18, device=DEVICE) > 12, float("-inf"))
    args = (q, k, v, bias.requires_grad_(), None, 0.25, True, None, None, None, [], [])
    torch.library.opcheck(launch._flash_forward, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    sinks = torch.randn(2, generator=gen).to(DEVICE).requires_grad_()
    torch.library.opcheck(launch._flash_forward, (*args[:8], 1.5, sinks, [], []),  # softcap and sinks
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    block = configs._rule_block(DEVICE == "cpu")
    tiles = tile_maps._rule_tiles(headwise.masks.prefix_lm(5), bias, 1, 2, 17, 18, block, q.device)
    torch.library.opcheck(launch._flash_forward, (*args[:6], False, None, None, None, tiles, list(block)),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@needs_triton
def test_trace_names_what_the_kernel_fused_and_never_materialised(interpreter):
    q, k, v, gen = make_inputs(2, 4, 2, 5, 21, 16)
    mask = key_mask("right_pad", 2, 21, gen).to(DEVICE)  # (B, Sk)
    with headwise.trace() as t:
        out = headwise.attention(q, k, v, mask, is_causal=True, backend="triton")
    assert t.names() == ["mask layout", "kernel", "triton"]
    stage = t.stages[-1]
    assert stage.fused and stage.shape == tuple(out.shape) and stage.dtype == out.dtype
    assert stage.note == (
        "scaling, scores, mask, softmax, weighted sum tile by tile in one Triton kernel (FlashAttention-2); "
        "the (2, 1, 1, 21) key mask read as one bias per key, key tiles that are all padding skipped; "
        "causal: key j <= i + 16, tiles it blocks entirely skipped; H = 4 query heads read Hkv = 2 kv heads, "
        "no copy; scores (2, 4, 5, 21) not materialised")


@needs_triton
def test_empty_query_and_single_query(interpreter):
    q, k, v, gen = make_inputs(1, 2, 2, 0, 9, 16)
    assert headwise.attention(q, k, v, backend="triton").shape == (1, 2, 0, 16)
    q, k, v, gen = make_inputs(1, 2, 2, 1, 9, 16)
    out = headwise.attention(q, k, v, is_causal=True, backend="triton")
    assert_close(out, reference_attention(q.cpu(), k.cpu(), v.cpu(), is_causal=True)[0])


@needs_triton
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sizes", [(0, 20, 21), (2, 0, 21), (2, 20, 0)], ids=["B=0", "S=0", "Sk=0"])
def test_empty_inputs_forward_and_backward(interpreter, sizes, is_causal):
    Bn, S, Sk = sizes
    q, k, v, gen = make_inputs(Bn, 4, 2, S, Sk, 16)
    for mask in (None, torch.ones(Bn, Sk, dtype=torch.bool, device=DEVICE)):
        out, grads = run_triton(q, k, v, mask, torch.ones(Bn, 4, S, 16, device=DEVICE), is_causal=is_causal)
        assert out.shape == (Bn, 4, S, 16) and (out == 0).all()
        assert all(g.shape == t.shape and (g == 0).all() for g, t in zip(grads, (q, k, v), strict=True))


# ---------------------------------------------------------------- refusals: no triton needed


def _request(**overrides) -> Request:
    fields = dict(device=torch.device(DEVICE), dtype=torch.float16, batch=2, heads=8, kv_heads=2,
                  q_len=128, k_len=128, head_dim=64, mask_kind="bool", mask_shape=(2, 1, 1, 128),
                  is_causal=True, dropout_p=0.0, need_weights=False, requires_grad=True)
    return Request(**{**fields, **overrides})


@pytest.mark.parametrize("overrides, reason", [
    (dict(mask_shape=(2, 1, 128, 128)), r"key padding masks \(B\|1, 1, 1, Sk\) only, got a mask of shape "
                                        r"\(2, 1, 128, 128\); use backend 'sdpa' or 'chunked'"),
    (dict(mask_kind="float", mask_shape=(1, 8, 1, 128)), r"got a mask of shape \(1, 8, 1, 128\)"),
    (dict(dropout_p=0.1), r"no dropout \(dropout_p=0.1\); use backend 'sdpa' or 'chunked'"),
    (dict(head_dim=256), r"head_dim <= 128, got 256; use backend 'sdpa' or 'chunked'"),
    (dict(dtype=torch.float64), r"float16, bfloat16 and float32, got torch.float64; cast q, k, v"),
    (dict(value_dim=96), r"one head-dim block \(BLOCK_D\), so v's head dim must be q's: got Dv = 96 != D = 64; "
                         r"use backend 'sdpa' or 'chunked'"),
    (dict(window=16, sink_tokens=4), r"has no sink tokens \(sink_tokens=4\); use backend 'sdpa' or 'chunked'"),
    (dict(score_mod="general"), r"one precompiled kernel, inside which a Python score_mod cannot run; use backend "
                                r"'chunked' \(any score_mod"),
    (dict(score_mod="general", score_mod_grad=True), r"cannot run, nor its gradient; use backend 'chunked'"),
    (dict(score_mod="additive"), r"no dense score bias, only a key padding mask \(one bias per key\), so an "
                                 r"additive score_mod .* cannot reach its scores; use backend 'sdpa' \(the bias as a "
                                 r"float mask\)"),
    (dict(score_mod="additive", score_mod_grad=True), r"cannot reach its scores and its table's gradient; use"),
])
def test_refusals_name_the_value_and_the_remedy(monkeypatch, overrides, reason):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so the device is not what gets refused on a CPU
    assert get_kernel("triton").refuses(_request()) is None
    why = get_kernel("triton").refuses(_request(**overrides))
    assert why is not None and re.search(reason, why), why


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = get_kernel("triton").refuses(_request(device=torch.device("cpu")))
    assert why is not None and "runs on CUDA tensors, got device 'cpu'" in why and "TRITON_INTERPRET=1" in why


def test_unavailable_without_triton_or_a_gpu(monkeypatch):
    monkeypatch.setattr(support, "_triton_installed", lambda: False)
    assert get_kernel("triton").available() == "triton is not installed (pip install 'headwise[triton]')"
    monkeypatch.setattr(support, "_triton_installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "needs a CUDA GPU" in get_kernel("triton").available()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_kernel("triton").available() is None


def double(score, b, h, q_idx, kv_idx):
    return 2 * score


def test_direct_calls_reject_what_dispatch_refuses():
    q = torch.zeros(1, 2, 3, 16)
    common = dict(rules=Rules(), scale=0.25, need_weights=False)
    with pytest.raises(ValueError, match=r"key padding masks \(B\|1, 1, 1, Sk\) only, got shape \(1, 1, 3, 3\)"):
        launch.triton_attention(q, q, q, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool),
                                dropout_p=0.0, **common)
    with pytest.raises(ValueError, match=r"no dropout \(dropout_p=0.5\)"):
        launch.triton_attention(q, q, q, attention_mask=None, dropout_p=0.5, **common)
    with pytest.raises(ValueError, match=r"v's head dim to be q's \(got Dv = 8, D = 16\) and takes no sink tokens"):
        launch.triton_attention(q, q, q[..., :8], attention_mask=None, dropout_p=0.0, **common)
    with pytest.raises(ValueError, match=r"takes no sink tokens \(got 2\)"):
        launch.triton_attention(q, q, q, attention_mask=None, dropout_p=0.0, scale=0.25, need_weights=False,
                                rules=Rules(is_causal=True, window=2, sink_tokens=2))
    with pytest.raises(ValueError, match=r"takes no score_mod \(score_mod double\): a Python function cannot run"):
        launch.triton_attention(q, q, q, attention_mask=None, dropout_p=0.0, scale=0.25, need_weights=False,
                                rules=Rules(score_mod=double))


@pytest.mark.parametrize("overrides", [dict(value_dim=96), dict(window=16, sink_tokens=4)], ids=["Dv", "sinks"])
def test_auto_routes_around_the_refusals(monkeypatch, overrides):
    """Where "auto" ranks triton first (CUDA, fp16, a mask), a value head dim of its own or
    sink tokens go to the next able kernel, and the trace of the choice says why."""
    from headwise.dispatch import select
    from headwise.kernels import registry

    kernel = get_kernel("triton")
    monkeypatch.setitem(registry._KERNELS, "triton", dataclasses.replace(kernel, available=lambda: None))
    assert select(_request(device=torch.device("cuda"))).backend == "triton"  # ranked first, and able
    d = select(_request(device=torch.device("cuda"), **overrides))
    assert d.backend == "sdpa" and "first able backend" in d.reason
    assert re.search(r"sink tokens|v's head dim must be q's", d.passed_over["triton"])


def test_live_key_tiles_lists_each_rows_real_tiles_in_order():
    bias = torch.zeros(3, 10)
    bias[0, 2:6] = float("-inf")  # tile 1 (keys 2, 3) and tile 2 (keys 4, 5) dead
    bias[1] = float("-inf")  # nothing
    tiles, cum = tile_maps._live_key_tiles(bias, block_n=2)  # 5 tiles per row
    assert tiles[0, :3].tolist() == [0, 3, 4] and cum[0].tolist() == [0, 1, 1, 1, 2, 3]
    assert cum[1].tolist() == [0] * 6
    assert tiles[2].tolist() == [0, 1, 2, 3, 4] and cum[2].tolist() == list(range(6))
    assert tiles.dtype == cum.dtype == torch.int32
    assert math.prod(tiles.shape) == 15


# ---------------------------------------------------------------- mask_mod: the tile map


def _per_head(b, h, q_idx, kv_idx):
    """Head h sees 4 * h keys past the diagonal: a mask_mod that depends on h."""
    return kv_idx <= q_idx + 4 * h


def _lonely_rows(b, h, q_idx, kv_idx):
    """Causal, except that queries 5 and 20 may attend nothing (rows of zeros)."""
    return (kv_idx <= q_idx) & (q_idx != 5) & (q_idx != 20)


def _rule_case(name: str, B: int, S: int, Sk: int):
    """(mask_mod, is_causal) of one case; documents and prefixes cover max(S, Sk) positions."""
    n = max(S, Sk)
    mm = headwise.masks
    if name == "document-causal":
        return mm.document(torch.arange(n) // 13), True  # 13-token documents straddle the 16 / 32 tiles
    if name == "document-per-row":
        ids = torch.stack([torch.arange(n) // 9, torch.arange(n) // 24])[:B]  # (B, n): each row its own documents
        return mm.document(ids), False
    if name == "prefix_lm":
        return mm.prefix_lm(torch.tensor([5, 20])[:B]), False
    if name == "sliding_window":
        return mm.sliding_window(7), False
    if name == "lambda":
        return (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() % 5 != 2), False
    if name == "or_masks":
        return mm.or_masks(mm.sliding_window(4), mm.prefix_lm(6)), False
    if name == "per-head":
        return _per_head, True
    if name == "empty-rows":
        return _lonely_rows, False
    raise AssertionError(name)


RULE_CASES = {  # name: (heads (H, Hkv), (S, Sk), key mask form)
    "document-causal": ((2, 2), (37, 37), "none"),
    "document-per-row": ((4, 2), (45, 21), "none"),
    "prefix_lm": ((2, 1), (21, 45), "none"),
    "sliding_window": ((4, 2), (37, 37), "none"),
    "lambda": ((2, 2), (21, 45), "none"),
    "or_masks": ((4, 1), (45, 45), "none"),
    "per-head": ((4, 2), (37, 45), "none"),
    "empty-rows": ((2, 2), (33, 33), "none"),
    "document-causal-padded": ((4, 2), (37, 45), "hole"),
    "prefix_lm-padded": ((2, 1), (21, 37), "left_pad"),
}


def rule_reference(q, k, v, mask, grad_out, **kw):
    """Output and (dq, dk, dv) of the matmul backend in float64: it evaluates the mask_mod on
    the whole (S, Sk) grid, the textbook way."""
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    out = headwise.attention(qd, kd, vd, None if mask is None else mask.cpu(), backend="matmul", **kw)
    return out, torch.autograd.grad(out, (qd, kd, vd), grad_out.detach().cpu().double())


@needs_triton
@pytest.mark.parametrize("case", RULE_CASES)
def test_mask_mod_matches_float64_reference(interpreter, case):
    """Forward and backward through the tile map, each case against the float64 textbook
    kernel: helpers that know their tiles, plain functions, or_masks, per-row documents, a
    per-head rule, GQA / MQA, S != Sk, rows that attend nothing, and key padding beside."""
    (H, Hkv), (S, Sk), form = RULE_CASES[case]
    q, k, v, gen = make_inputs(2, H, Hkv, S, Sk, 16, seed=13)
    mask = key_mask(form, 2, Sk, gen)
    mod, is_causal = _rule_case(case.removesuffix("-padded"), 2, S, Sk)
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    out, grads = run_triton(q, k, v, mask, grad_out, is_causal=is_causal, mask_mod=mod)
    want, want_grads = rule_reference(q, k, v, mask, grad_out, is_causal=is_causal, mask_mod=mod)
    assert_close(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert_close(got, ref)
    if case == "empty-rows":  # zeros, never NaN, forward and backward
        assert (out.detach()[:, :, [5, 20]] == 0).all() and (grads[0][:, :, [5, 20]] == 0).all()


@needs_triton
def test_mask_mod_with_alibi_softcap_sinks_and_window(interpreter):
    """The score rules the kernel runs itself compose with a mask_mod: the window folds into
    the tile map, ALiBi, softcap and the sinks' column act on the scores as before."""
    q, k, v, gen = make_inputs(2, 4, 2, 21, 37, 16, seed=14)
    s = (2 * torch.randn(4, generator=gen)).to(DEVICE).requires_grad_()
    kw = dict(window=9, softcap=2.0, sinks=s, alibi_slopes=headwise.masks.alibi_slopes(4).to(DEVICE),
              mask_mod=headwise.masks.document(torch.arange(37) // 11))
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    out = headwise.attention(q, k, v, backend="triton", **kw)
    got = torch.autograd.grad(out, (q, k, v, s), grad_out)
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, s)]
    want = headwise.attention(*exact[:3], backend="matmul", **{**kw, "sinks": exact[3],
                                                                 "alibi_slopes": kw["alibi_slopes"].cpu().double()})
    assert_close(out, want)
    for a, b in zip(got, torch.autograd.grad(want, exact, grad_out.cpu().double()), strict=True):
        assert_close(a, b)


@needs_triton
def test_a_users_tile_map_is_read_as_is(interpreter, monkeypatch):
    """A TileMap of the call's shape at the kernel's map block serves as the mask_mod; its
    states are used, never rebuilt, and the plain function behind it is evaluated on the rows
    of map tiles that hold partial tiles only, for their bits."""
    B, H, S, Sk = 2, 2, 37, 37
    block = configs._rule_block(DEVICE == "cpu")
    evaluated = []

    def stripes(b, h, q_idx, kv_idx):
        evaluated.append((q_idx.shape[2], kv_idx.shape[3]))
        return ((kv_idx // 8) % 2 == (q_idx // 8) % 2) | (q_idx >= 32)  # rows 32.. attend all: full tiles

    rule = headwise.masks.tile_map(stripes, B, H, S, Sk, block=block)
    q, k, v, gen = make_inputs(B, H, H, S, Sk, 16, seed=15)
    grad_out = torch.randn(q.shape, generator=gen).to(DEVICE)
    out, grads = run_triton(q, k, v, None, grad_out, mask_mod=rule)
    want, want_grads = rule_reference(q, k, v, None, grad_out, mask_mod=stripes)
    assert_close(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert_close(got, ref)
    evaluated.clear()
    with monkeypatch.context() as m:
        m.setattr(headwise.rules, "evaluated_tile_states", None)  # a rebuild of the states would fail
        tiles = tile_maps._rule_tiles(rule, None, B, H, S, Sk, block, q.device)
    if block[0] == 32:  # map row 0 holds partial tiles; row 1 (rows 32..36) is full, but its
        # tile (1, 1) runs past Sk = 37, so it is partial and its 5 x 5 real pairs are read
        assert evaluated == [(32, 37), (5, 5)]
    assert tiles[1][..., 0].sum() > 0  # partial tiles listed


def test_rule_tiles_hold_the_bits_of_partial_tiles_only():
    """_rule_tiles' lists and bits against the dense mask: partial tiles first (with their
    bits), full ones after, empty ones never listed; a full tile past Sk becomes partial;
    a fully padded key tile is empty for its batch row; b and h broadcast where the rule does."""
    B, H, S, Sk, block = 2, 3, 70, 75, (32, 32)
    rule = headwise.masks.document(torch.arange(80) // 30)  # (1, L): states (1, 1, nq, nk)
    key_bias = torch.zeros(B, Sk)
    key_bias[1, 32:64] = float("-inf")  # row 1's second key tile is all padding
    row_lists, row_counts, col_lists, col_counts, words = tile_maps._rule_tiles(
        rule, key_bias, B, H, S, Sk, block, torch.device("cpu"))
    nq, nk = 3, 3
    assert row_lists.shape == (2, B, 1, nq, nk) and col_lists.shape == (2, B, 1, nk, nq)
    assert row_counts.shape == (B, 1, nq, 2) and words.dtype == torch.int32 and words.shape[1:] == (32, 1)
    dense = rule(0, 0, torch.arange(S)[:, None], torch.arange(Sk)[None, :])  # (S, Sk)
    bits = ((words[..., None] >> torch.arange(32)) & 1).bool().reshape(-1, 32, 32)  # (P, 32, 32)
    for b in range(B):
        for qi in range(nq):
            n_part, n_full = row_counts[b, 0, qi].tolist()
            listed = row_lists[0, b, 0, qi, :n_part + n_full].tolist()
            rows = slice(qi * 32, min(qi * 32 + 32, S))
            for pos, kj in enumerate(listed):
                cols = slice(kj * 32, min(kj * 32 + 32, Sk))
                tile = dense[rows, cols] & (key_bias[b, cols] == 0)
                assert tile.any()
                if pos < n_part:  # partial: its bits are the rule's pairs, False past S and Sk
                    slot = row_lists[1, b, 0, qi, pos]
                    got = bits[slot]
                    assert torch.equal(got[:tile.shape[0], :tile.shape[1]], dense[rows, cols])
                    assert not got[tile.shape[0]:].any() and not got[:, tile.shape[1]:].any()
                else:  # full: every pair allowed, inside Sk
                    assert dense[rows, cols].all() and cols.stop - cols.start == 32
            for kj in set(range(nk)) - set(listed):
                cols = slice(kj * 32, min(kj * 32 + 32, Sk))
                assert not (dense[rows, cols] & (key_bias[b, cols] == 0)).any()
    assert all(1 not in row_lists[0, 1, 0, qi, :row_counts[1, 0, qi].sum()].tolist() for qi in range(nq))
    # The columns (dkdv) list the same tiles, transposed.
    for b in range(B):
        for kj in range(nk):
            n_part, n_full = col_counts[b, 0, kj].tolist()
            got = {(qi, pos < n_part) for pos, qi in enumerate(col_lists[0, b, 0, kj, :n_part + n_full].tolist())}
            want = set()
            for qi in range(nq):
                n_p, n_f = row_counts[b, 0, qi].tolist()
                for pos, c in enumerate(row_lists[0, b, 0, qi, :n_p + n_f].tolist()):
                    if c == kj:
                        want.add((qi, pos < n_p))
            assert got == want


def test_every_kernel_tile_divides_the_map_tile():
    """One map serves forward, dq and dkdv only if each walks a map tile in whole tiles of its own."""
    tables = [configs.GPU_CONFIGS, configs.GPU_FP32_CONFIGS]
    every = [c for t in tables for by_dim in t.values() for cs in by_dim.values() for c in cs]
    for block, cs in ((configs.RULE_BLOCK, every),
                      (configs.INTERPRET_RULE_BLOCK, [configs.INTERPRET_CONFIG])):
        assert block[1] % 32 == 0  # whole int32 words of bits per row
        for c in cs:
            assert block[0] % c.block_m == 0 and block[1] % c.block_n == 0, (block, c)


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu", reason="counts the interpreter's scans of triton.language")
def test_the_interpreter_scans_triton_language_per_launch_not_per_helper_call(interpreter, monkeypatch):
    """Triton's interpreter re-points triton.language's builtins at every device-function call (a
    scan of the module, about a millisecond); inside a running kernel headwise's helpers skip it, so
    they scan never, and each kernel once, at its launch, however many tiles and helper calls its
    programs have (triton's own library functions, tl.sum and the like, still scan)."""
    from triton.runtime import interpreter as triton_interpreter

    scans = []
    original = triton_interpreter._patch_lang
    monkeypatch.setattr(triton_interpreter, "_patch_lang", lambda fn: scans.append(fn.__name__) or original(fn))
    q, k, v, gen = make_inputs(2, 2, 2, 40, 40, 16, seed=3)  # 3 x 3 tiles of 16 per head
    out = headwise.attention(q, k, v, key_mask("right_pad", 2, 40, gen), is_causal=True, backend="triton")
    torch.autograd.grad(out.square().sum(), (q, k, v))  # the results: every other test of this file
    ours = {fn.__name__ for fn in jit._DEVICE_CODE}
    assert sorted(name for name in scans if name in ours) == [
        "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_fwd_kernel"]


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu", reason="counts the interpreter's tile visits")
def test_empty_tiles_are_never_visited(interpreter):
    """Each kernel's per-tile step, counted: forward, dq and dkdv visit exactly the kernel
    tiles inside the map's partial and full tiles, fewer than the dense grid's."""
    B, H, S, Sk = 2, 2, 64, 64
    rule = headwise.masks.document(torch.tensor([0] * 30 + [1] * 34))  # 2 x 2 map tiles, (0, 1) empty
    ns = jit._compiled(True)._fwd_kernel.fn.__globals__  # where the kernels look their helpers up
    steps = ("_online_softmax", "_dq_step", "_dkdv_step")  # one call per kernel tile computed
    originals = {name: ns[name] for name in steps}
    counts = dict.fromkeys(steps, 0)

    def counter(name):
        def counted(*args, **kw):
            counts[name] += 1
            return originals[name](*args, **kw)
        return counted

    try:
        ns.update({name: counter(name) for name in steps})
        q, k, v, gen = make_inputs(B, H, H, S, Sk, 16, seed=16)
        out = headwise.attention(q, k, v, is_causal=True, mask_mod=rule, backend="triton")
        torch.autograd.grad(out.sum(), (q, k, v))
    finally:
        ns.update(originals)
    # Map tiles (32 x 32): (0, 0) and (1, 1) partial (document and causal), (1, 0) partial
    # (document 1 starts at 30), (0, 1) empty (causal): 3 of 4 map tiles, 2 x 2 kernel tiles each.
    visits = B * H * 3 * 4
    assert counts == {"_online_softmax": visits, "_dq_step": visits, "_dkdv_step": visits}
    assert visits < B * H * (S // 16) * (Sk // 16)


@needs_triton
def test_trace_names_the_tile_map_and_its_shares(interpreter):
    q, k, v, gen = make_inputs(2, 4, 2, 64, 64, 16)
    rule = headwise.masks.document(torch.tensor([0] * 30 + [1] * 34))
    with headwise.trace() as t:
        headwise.attention(q, k, v, is_causal=True, mask_mod=rule, backend="triton")
    note = t.stages[-1].note
    block = configs._rule_block(DEVICE == "cpu")
    nq = -(-64 // block[0])
    assert f"as a tile map of {nq} x {nq} tiles of {block[0]} x {block[1]} per (b, h)" in note
    assert "causal: key j <= i ANDed in" in note and "empty (skipped)" in note and "full (no mask)" in note
    if DEVICE == "cpu":
        assert "25% empty (skipped), 0% full (no mask), 75% partial" in note


def test_score_mods_are_refused_by_name(monkeypatch):
    """A named backend 'triton' with a score_mod fails with the kernel's reason, never
    dropping the score_mod (nor a learned table's gradient)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(support, "_triton_installed", lambda: True)
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"Python score_mod cannot run"):
        headwise.attention(q, q, q, score_mod=double, backend="triton")
    table = torch.zeros(32, 2, requires_grad=True)
    bias = headwise.masks.relative_position_bias(table)
    with pytest.raises(ValueError, match=r"additive score_mod .* cannot reach its scores and its table's gradient"):
        headwise.attention(q, q, q, score_mod=bias, backend="triton")


def test_auto_never_runs_a_mask_mod_through_the_interpreter(monkeypatch):
    """On a CPU the interpreter serves only a named backend: "auto" passes triton over."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.randn(1, 2, 8, 16)
    chosen = headwise.choose_backend(q, q, q, mask_mod=headwise.masks.causal)
    assert chosen.backend != "triton" and "runs on CUDA tensors" not in chosen.passed_over.get("triton", "")


# ---------------------------------------------------------------- return_lse: the forward's log-sum-exp


LSE_CASES = {  # name: (heads (H, Hkv), (S, Sk), key mask form, keywords); sinks as True: drawn per test
    "plain": ((2, 2), (37, 37), "none", dict()),
    "causal": ((2, 2), (21, 45), "none", dict(is_causal=True)),
    "key-padding": ((2, 2), (45, 21), "right_pad", dict()),  # the last batch row attends nothing
    "gqa-float-pad": ((4, 2), (37, 37), "float_pad", dict(is_causal=True)),
    "sinks": ((4, 2), (21, 37), "left_pad", dict(is_causal=True, sinks=True)),  # a padded row keeps its sink
    "softcap": ((4, 1), (37, 37), "hole", dict(softcap=2.0)),
    "alibi": ((4, 2), (21, 45), "none", dict(is_causal=True, alibi=True)),
    "window": ((2, 1), (37, 37), "left_pad", dict(window=5)),
    "mask_mod-empty-rows": ((2, 2), (33, 33), "none", dict(mask_mod=_lonely_rows)),
}


def _lse_loss(out, lse, g_out, g_lse, live):
    """A loss that reads both results: out against g_out, the live rows' lse against g_lse."""
    return (out * g_out).sum() + torch.where(live, lse * g_lse, 0.0).sum()


@needs_triton
@pytest.mark.parametrize("case", LSE_CASES)
def test_return_lse_matches_float64_reference(interpreter, case):
    """out, lse (B, H, S) fp32 and the gradients of a loss that reads both (q, k, v and the
    sinks) within 1e-5 of the matmul backend in float64; ``-inf`` exactly on the rows that
    attend nothing (whose outputs and gradients are zeros)."""
    (H, Hkv), (S, Sk), form, kw = LSE_CASES[case]
    q, k, v, gen = make_inputs(2, H, Hkv, S, Sk, 16, seed=17)
    mask = key_mask(form, 2, Sk, gen)
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = headwise.masks.alibi_slopes(H).to(DEVICE)
    leaves = [q, k, v]
    if kw.get("sinks"):
        kw["sinks"] = (2 * torch.randn(H, generator=gen)).to(DEVICE).requires_grad_()
        leaves.append(kw["sinks"])
    out, lse = headwise.attention(q, k, v, None if mask is None else mask.to(DEVICE), backend="triton",
                                  return_lse=True, **kw)
    exact = [t.detach().cpu().double().requires_grad_() for t in leaves]
    kw64 = {name: value.detach().cpu().double() if isinstance(value, torch.Tensor) else value
            for name, value in kw.items()}
    if "sinks" in kw:
        kw64["sinks"] = exact[3]
    want, want_lse = headwise.attention(*exact[:3], mask, backend="matmul", return_lse=True, **kw64)
    assert lse.shape == (2, H, S) and lse.dtype == torch.float32 and lse.device == q.device
    live = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse).cpu(), ~live) and not torch.isnan(lse).any()
    assert_close(out, want)
    assert_close(torch.where(live.to(DEVICE), lse, 0.0), torch.where(live, want_lse, 0.0))
    g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(_lse_loss(out, lse, g_out.float().to(DEVICE), g_lse.float().to(DEVICE),
                                        live.to(DEVICE)), leaves)
    ref = torch.autograd.grad(_lse_loss(want, want_lse, g_out, g_lse, live), exact)
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b)
    if not live.all():  # a row that attends nothing: zeros, and no gradient reaches its query
        assert (out.detach()[~live.to(DEVICE)] == 0).all() and (got[0][~live.to(DEVICE)] == 0).all()
    if case == "key-padding":
        assert not live[-1].any()
    if case == "sinks":
        assert live.all()  # the padded row attends its sink: lse = the sink logit, output zeros
        torch.testing.assert_close(lse[-1].detach().cpu(), kw["sinks"].detach().cpu()[:, None].expand(H, S))


@needs_triton
def test_a_loss_on_the_lse_alone_reaches_q_k_and_the_sinks(interpreter):
    """Only the lse read (out's gradient is None): dv is zero, dq, dk and the sinks' gradient
    come from the lse through delta alone."""
    q, k, v, gen = make_inputs(2, 4, 2, 21, 37, 16, seed=18)
    mask = key_mask("right_pad", 2, 37, gen)
    sinks = torch.randn(4, generator=gen).to(DEVICE).requires_grad_()
    _, lse = headwise.attention(q, k, v, mask.to(DEVICE), is_causal=True, sinks=sinks, backend="triton",
                                return_lse=True)
    got = torch.autograd.grad(lse.sum(), (q, k, v, sinks))
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, sinks)]
    _, want = headwise.attention(*exact[:3], mask, is_causal=True, sinks=exact[3], backend="matmul",
                                 return_lse=True)
    ref = torch.autograd.grad(want.sum(), exact, materialize_grads=True)
    for a, b in zip(got, ref, strict=True):
        assert_close(a, b)
    assert (got[2] == 0).all()


@needs_triton
def test_torch_compile_traces_the_lse_and_its_gradient(interpreter):
    """With return_lse the graph's backward hands the kernel the lse's gradient (a tangent,
    materialised): the same results as eager."""
    q, k, v, gen = make_inputs(2, 4, 2, 19, 23, 16, seed=19)
    mask = key_mask("left_pad", 2, 23, gen).to(DEVICE)

    def loss(q, k, v):
        out, lse = headwise.attention(q, k, v, mask, is_causal=True, backend="triton", return_lse=True)
        return out.square().sum() + torch.where(torch.isinf(lse), 0.0, lse).square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = compiled(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v))
    want = loss(q, k, v)
    for a, b in zip(got_grads, torch.autograd.grad(want, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("sizes", [(2, 0, 21), (2, 20, 0)], ids=["S=0", "Sk=0"])
def test_return_lse_of_empty_inputs(interpreter, sizes):
    Bn, S, Sk = sizes
    q, k, v, _ = make_inputs(Bn, 4, 2, S, Sk, 16)
    out, lse = headwise.attention(q, k, v, backend="triton", return_lse=True)
    assert lse.shape == (Bn, 4, S) and lse.dtype == torch.float32 and torch.isneginf(lse).all()
    direct = launch.triton_attention(q, k, v, attention_mask=None, rules=Rules(), dropout_p=0.0, scale=0.25,
                                     need_weights=False, return_lse=True)
    assert direct.weights is None and direct.lse.shape == (Bn, 4, S) and torch.isneginf(direct.lse).all()


@needs_triton
def test_backward_op_with_the_lse_gradient_passes_opcheck(interpreter):
    q, k, v, gen = make_inputs(1, 2, 1, 17, 18, 16, seed=20)
    sinks = torch.randn(2, generator=gen).to(DEVICE)
    out, lse = launch._flash_forward(q, k, v, None, None, 0.25, True, None, None, sinks, [], [])
    dlse = torch.randn(lse.shape, generator=gen).to(DEVICE)
    args = (torch.randn(out.shape, generator=gen).to(DEVICE), q.detach(), k.detach(), v.detach(), out.detach(),
            lse, dlse, None, None, 0.25, True, None, False, None, sinks, [], [])
    torch.library.opcheck(launch._flash_backward, args, test_utils=("test_schema", "test_faketensor"))

"""backend "flex": torch's compiled flex_attention held to headwise's contract.

Every call of a new rule or shape family compiles (seconds on a CPU), so the cases share a few
shapes: (B, H, S, Sk, D) = (2, 4, 5|7, 7|5, 8) as check_kernel's items, whose graphs the grid
reuses, and S = Sk = 300 (three 128-blocks a side) where the BlockMask has empty, full and
partial blocks. On a CPU the kernel serves inference only: the CPU cases run under
torch.no_grad(), and the gradients and the log-sum-exp are checked on a GPU.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length, D head dim.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask

import headwise
from headwise import masks
from headwise.kernels import flex, get_kernel
from headwise.kernels.registry import Request
from headwise.rules import Rules
from headwise.testing import check_kernel, reference_attention

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="Flex trains and returns its log-sum-exp on a CUDA GPU only")
if flex.KERNEL.available() is not None:  # pragma: no cover - torch without flex_attention, or compile disabled
    pytest.skip(f"flex cannot run here: {flex.KERNEL.available()}", allow_module_level=True)
if not GPU and flex._CPU_COMPILES is not None:  # pragma: no cover - no AVX2 or no C++ compiler
    pytest.skip(f"flex cannot run on this CPU: {flex._CPU_COMPILES}", allow_module_level=True)

B, H, D = 2, 4, 8


def inputs(heads: int, S: int, Sk: int, *, dtype=torch.float32, seed=0, batch=B, dim=D):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, H, S, dim, generator=gen)
    k = torch.randn(batch, heads, Sk, dim, generator=gen)
    v = torch.randn(batch, heads, Sk, dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def make_mask(kind: str, S: int, Sk: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "key padding":
        mask = torch.ones(B, Sk, dtype=torch.bool)
        mask[0, Sk - 2:] = False
        return mask  # (B, Sk)
    if kind == "bool 4-D":
        mask = torch.rand(B, H, S, Sk, generator=gen) > 0.4
        mask[0, 1, 0] = False  # a row with no key
        return mask  # (B, H, S, Sk)
    bias = torch.randn(B, S, Sk, generator=gen)
    return bias.masked_fill(torch.rand(B, S, Sk, generator=gen) > 0.7, -math.inf)  # (B, S, Sk) additive


def flex_attention(q, k, v, mask=None, **kwargs):
    with torch.no_grad():
        return headwise.attention(q, k, v, mask, backend="flex", **kwargs)


def close(got, want, atol=2e-5):
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-4)


# ---------------------------------------------------------------- the contract


def test_flex_meets_the_kernel_contract_on_what_it_serves():
    """Every item of check_kernel: on a GPU with gradients and the log-sum-exp; on a CPU the same
    items without them (inference only), the log-sum-exp reported refused."""
    report = check_kernel("flex", device="cuda" if GPU else "cpu")
    assert report.ok, str(report)
    assert sum(1 for i in report.items if i.passed) >= 19, str(report)
    if not GPU:
        assert report.items[-1].name == "log-sum-exp" and report.items[-1].passed is None, str(report)
        assert all("inference only" in i.detail for i in report.items if i.passed), str(report)


# (mask, causal, query heads per kv head, S == Sk). check_kernel's items hold every mask without
# causal for MHA at S != Sk, causal alone at S < Sk and S > Sk, and a bool mask with causal for
# GQA; these add every mask with causal, MQA, and S == Sk. Every value of each axis of masks x
# causal x (MHA, GQA, MQA) x (S == Sk, S != Sk) is covered, not every combination: 4 graphs, not 48
GRID = [("key padding", True, "MQA", True), ("bool 4-D", True, "GQA", False), ("float 3-D", True, "MHA", True),
        ("none", False, "GQA", True)]
HEADS = {"MHA": H, "GQA": 2, "MQA": 1}


@pytest.mark.parametrize(("kind", "causal", "heads", "square"), GRID,
                         ids=[f"{m}-{'causal' if c else 'full'}-{h}-{'S=Sk' if s else 'S!=Sk'}" for m, c, h, s in GRID])
def test_flex_matches_the_oracle_across_masks_causal_and_heads(kind, causal, heads, square):
    S, Sk = (7, 7) if square else (5, 7)
    q, k, v = inputs(HEADS[heads], S, Sk)
    mask = make_mask(kind, S, Sk)
    out = flex_attention(q, k, v, mask, is_causal=causal)
    close(out, reference_attention(q, k, v, mask, is_causal=causal).out)


def test_flex_in_bfloat16_within_twice_the_error_of_plain_torch():
    """STYLE.md's rule for low precision: at most about twice the error of plain PyTorch in bf16."""
    q, k, v = inputs(2, 5, 7, dtype=torch.bfloat16)
    want = reference_attention(q, k, v, is_causal=True).out
    plain = get_kernel("matmul").fn(q, k, v, attention_mask=None, rules=Rules(is_causal=True), dropout_p=0.0,
                                    scale=D ** -0.5, need_weights=False).out
    got = flex_attention(q, k, v, is_causal=True)
    rounding = (want.to(torch.bfloat16).double() - want).abs().max().item()
    err, plain_err = ((t.double() - want).abs().max().item() for t in (got, plain))
    assert got.dtype == torch.bfloat16 and err <= 2 * plain_err + 2 * rounding, (err, plain_err, rounding)


def test_nan_where_no_query_may_attend_never_reaches_a_result_inside_a_partial_block():
    """Flex multiplies p = 0 by v inside a partial block, so NaN and inf there would leak; headwise
    zeroes what no query may attend first. Key 3 is excluded for every query and row 2 attends
    nothing: both hold NaN / inf, the output is the oracle's on clean inputs, row 2 is zeros."""
    def rule(b, h, q_idx, kv_idx):  # a plain function: one partial block
        return (kv_idx != 3) & (q_idx != 2)

    q, k, v = inputs(2, 7, 7)
    want = reference_attention(q, k, v, mask_mod=rule).out
    q[:, :, 2], k[:, :, 3], v[:, :, 3] = math.nan, math.inf, math.nan
    out = flex_attention(q, k, v, mask_mod=rule)
    close(out, want)
    assert bool((out[:, :, 2] == 0).all())


# ---------------------------------------------------------------- rules and BlockMask, several blocks a side


def document_causal(doc):
    def rule(b, h, q_idx, kv_idx):  # as FlexAttention users write it: a plain function
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return rule


def _documents(n: int) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(4), torch.tensor([40, 150, 90, n - 280]))  # (n,) ids


RULES = {
    "helpers: document and causal, and a window": lambda n: dict(mask_mod=masks.and_masks(
        masks.document(_documents(n)), masks.causal), window=200),
    "a plain function": lambda n: dict(mask_mod=document_causal(_documents(n))),
    "score rules: relative bias, ALiBi, softcap, sinks": lambda n: dict(
        score_mod=masks.relative_position_bias(torch.randn(32, H, generator=torch.Generator().manual_seed(5))),
        alibi_slopes=masks.alibi_slopes(H), softcap=20.0, sinks=torch.linspace(-1, 1, H), is_causal=True),
}


@pytest.mark.parametrize("name", list(RULES))
def test_flex_runs_the_rules_over_empty_full_and_partial_blocks(name):
    n = 300  # three 128-blocks a side: the document rule leaves empty, full and partial blocks
    q, k, v = inputs(2, n, n, dim=16)
    options = RULES[name](n)
    close(flex_attention(q, k, v, **options), reference_attention(q, k, v, **options).out, atol=5e-5)


def test_a_flex_block_mask_given_as_the_mask_runs_as_flex_reads_it():
    n = 300
    q, k, v = inputs(2, n, n, dim=16)
    block_mask = create_block_mask(document_causal(_documents(n)), B, None, n, n, device="cpu")
    close(flex_attention(q, k, v, block_mask), reference_attention(q, k, v, block_mask).out, atol=5e-5)


def _dense(num: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The blocks a (num_blocks, indices) pair lists, bool (rows, cols)."""
    dense = torch.zeros(index.shape[-2:], dtype=torch.bool)
    for row in range(index.shape[-2]):
        dense[row, index[0, 0, row, :int(num[0, 0, row])].long()] = True
    return dense


@pytest.mark.parametrize("rule", ["causal", "document"])
def test_the_block_lists_from_headwise_tiles_list_create_block_masks_blocks(rule):
    """The BlockMask comes from headwise's tile states, not create_block_mask: the same blocks are
    visited, and a block full for every real pair is full (create_block_mask also counts the
    padding past S in the last row of blocks, and calls those partial)."""
    n = 300
    fn = document_causal(_documents(n)) if rule == "document" else (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    rules = Rules(mask_mod=fn) if rule == "document" else Rules(is_causal=True)
    lists = flex._blocks(None, rules, 1, 1, n, n, torch.device("cpu"), False, backward=True)
    want = create_block_mask(fn, 1, 1, n, n, device="cpu")
    assert lists is not None and all(t is not None for t in lists)
    partial, full, q_partial, q_full = (_dense(lists[i], lists[i + 1]) for i in (0, 2, 4, 6))
    their_partial = _dense(want.kv_num_blocks, want.kv_indices)
    their_full = _dense(want.full_kv_num_blocks, want.full_kv_indices)
    assert torch.equal(partial | full, their_partial | their_full)  # the blocks visited
    assert bool((full >= their_full).all()) and bool(full[:-1].eq(their_full[:-1]).all())
    assert torch.equal(q_partial, partial.T) and torch.equal(q_full, full.T)  # backward's lists, per column


def test_a_rules_block_states_are_kept_while_the_rule_lives_and_no_longer():
    rule = document_causal(_documents(300))
    rules = Rules(mask_mod=rule)
    cpu = torch.device("cpu")
    first = flex._rule_states(rules, 1, 1, 300, 300, cpu)
    assert flex._rule_states(rules, 1, 1, 300, 300, cpu) is first  # the same rule and shape: kept
    assert flex._rule_states(rules, 1, 1, 290, 300, cpu) is not first  # another shape: its own
    assert rule in flex._RULE_STATES
    alive = weakref.ref(rule)
    del rule, rules
    gc.collect()
    assert alive() is None  # the memo holds no rule alive, and its entry went with it


def test_a_new_size_in_the_same_shape_family_does_not_compile_again():
    q, k, v = inputs(2, 5, 7)
    flex_attention(q, k, v, is_causal=True)  # the grid's graph (GQA, causal, S != Sk)
    graphs = counters["stats"]["unique_graphs"]
    for S, Sk in ((9, 12), (3, 30)):
        q, k, v = inputs(2, S, Sk, seed=S)
        close(flex_attention(q, k, v, is_causal=True), reference_attention(q, k, v, is_causal=True).out)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_kernel_function_returns_one_kernel_result():
    q, k, v = inputs(2, 5, 7)
    with torch.no_grad():
        result = flex.KERNEL.fn(q, k, v, attention_mask=None, rules=Rules(is_causal=True), dropout_p=0.0,
                                scale=1 / math.sqrt(D), need_weights=False)  # headwise's default: the same graph
    assert type(result) is headwise.kernels.KernelResult and result.weights is None and result.lse is None
    close(result.out, reference_attention(q, k, v, is_causal=True).out)


def test_flex_runs_inside_a_graph_the_caller_compiles():
    """Under the caller's torch.compile the kernel calls flex_attention in that graph: the rules'
    numbers are plain numbers there and the mask is read as given (Flex's CPU template cannot read
    a tensor made inside the graph)."""
    q, k, v = inputs(2, 5, 7)
    mask = make_mask("float 3-D", 5, 7)
    options = dict(is_causal=True, sinks=torch.linspace(-1, 1, H), softcap=5.0)
    compiled = torch.compile(lambda q, k, v, mask: headwise.attention(q, k, v, mask, backend="flex", **options))
    with torch.no_grad():
        out = compiled(q, k, v, mask)
    close(out, reference_attention(q, k, v, mask, **options).out)


def test_explain_mode_shows_one_fused_flex_stage():
    q, k, v = inputs(2, 5, 7)
    with torch.no_grad(), headwise.trace() as t:
        out = headwise.attention(q, k, v, is_causal=True, backend="flex")
    (stage,) = [s for s in t.stages if s.fused]
    assert stage.name == "flex" and stage.shape == tuple(out.shape)
    assert "BlockMask of 128 x 128 blocks" in stage.note and "H = 4 query heads read Hkv = 2" in stage.note


# ---------------------------------------------------------------- refusals, each with its reason


def _request(**overrides) -> Request:
    fields = dict(device=torch.device("cpu"), dtype=torch.float32, batch=B, heads=H, kv_heads=H, q_len=5, k_len=7,
                  head_dim=D, mask_kind="none", mask_shape=None, is_causal=False, dropout_p=0.0,
                  need_weights=False, requires_grad=False)
    return Request(**{**fields, **overrides})


def test_gradients_and_the_lse_on_the_cpu_are_refused_with_the_reason():
    q, k, v = (t.requires_grad_() for t in inputs(H, 5, 7))
    with pytest.raises(ValueError, match=r"backend 'flex' serves only inference on the CPU: torch .* has no "
                                         r"backward.*torch.no_grad\(\)"):
        headwise.attention(q, k, v, backend="flex")
    with torch.no_grad():
        with pytest.raises(ValueError, match="backend 'flex' returns no log-sum-exp on the CPU"):
            headwise.attention(q, k, v, backend="flex", return_lse=True)
        with pytest.raises(ValueError, match="backend 'flex' returns no log-sum-exp on the CPU"):
            headwise.attention(q, k, v, backend="flex", need_weights=True)  # the weights come from the lse
    with pytest.raises(ValueError, match="the flex kernel serves only inference on the CPU"):  # called directly
        flex.KERNEL.fn(q, k, v, attention_mask=None, rules=Rules(), dropout_p=0.0, scale=1.0, need_weights=False)


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(dtype=torch.float64), "takes float16, bfloat16 and float32"),
    (dict(dropout_p=0.1), r"has no dropout \(dropout_p=0.1\)"),
    (dict(device=torch.device("meta")), "runs on CUDA GPUs and x86 CPUs through torch.compile, got device 'meta'"),
    (dict(score_mod="general", score_mod_grad=True), "serves only inference on the CPU"),
])
def test_what_flex_cannot_run_is_refused_with_the_reason(overrides, reason):
    import re

    assert re.search(reason, flex.KERNEL.why_not(_request(**overrides)) or "")


def test_a_gpu_request_needs_triton(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(flex, "_triton_installed", lambda: True)
    assert flex._refuses(_request(device=cuda, head_dim=8, value_dim=32)) is None  # narrow heads: padded to 16
    monkeypatch.setattr(flex, "_triton_installed", lambda: False)
    assert flex._refuses(_request(device=cuda)) == ("needs triton on a GPU (torch.compile writes Flex's kernel in "
                                                    "Triton), which is not installed")


def test_narrow_heads_widened_for_the_gpu_kernel_change_no_result():
    """Flex's Triton kernel needs head dims >= 16: narrower q, k, v get zero columns, which change
    no score, and v's extra output columns are dropped."""
    q, k, v = inputs(2, 5, 7)
    v = v[..., :6]  # Dv = 6 != D = 8
    wide = flex._widened(q, k, v, flex.GPU_MIN_HEAD_DIM, flex.GPU_MIN_HEAD_DIM)
    assert [t.shape[-1] for t in wide] == [16, 16, 16]
    got = reference_attention(*wide, is_causal=True, scale=D ** -0.5).out[..., :6]
    torch.testing.assert_close(got, reference_attention(q, k, v, is_causal=True).out)


@pytest.mark.parametrize("dim", [8, 16, 32])
def test_every_key_count_at_narrow_head_dims_matches_the_oracle(dim):
    """torch 2.13's C++ template on an AVX2 CPU computed head dims 8 and 16 wrong at 8, 24, 40, ...
    keys (an appended sink key counts): the kernel widens them (flex.CPU_WRONG_HEAD_DIMS). Every key
    count from 2 to 40, and 136, plain and with ALiBi and sinks; the key count is dynamic in the
    compiled graph, so these are two graphs per head dim (one where the dims are widened)."""
    rules = dict(alibi_slopes=torch.linspace(0.1, 1.0, H), sinks=torch.linspace(-1, 1, H))
    for Sk in [*range(2, 41), 136]:
        q, k, v = inputs(2, 3, Sk, dim=dim, seed=Sk)
        for options in ({}, rules):
            close(flex_attention(q, k, v, **options), reference_attention(q, k, v, **options).out)


def test_a_cpu_torch_compile_cannot_lower_for_is_named(monkeypatch):
    monkeypatch.setattr(flex.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "needs a C++ compiler on the CPU (g++ or clang++, or $CXX)" in (flex._cpu_compiles() or "")
    monkeypatch.setattr(flex, "_CPU_COMPILES", "no compiler today")
    assert flex.KERNEL.why_not(_request()) == "no compiler today"
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert "torch.compile is disabled (TORCHDYNAMO_DISABLE is set)" in (flex._available() or "")


def test_forward_ad_and_torch_func_are_refused():
    q, k, v = inputs(H, 5, 7)
    with fwad.dual_level(), pytest.raises(ValueError, match="backend 'flex' has no forward-mode derivative"):
        headwise.attention(fwad.make_dual(q, torch.ones_like(q)), k, v, backend="flex")
    with pytest.raises(ValueError, match="backend 'flex' cannot run inside a torch.func transform"):
        torch.func.vmap(lambda x: headwise.attention(x, k, v, backend="flex"))(q[None])


def test_auto_passes_flex_over_until_it_is_measured_and_says_why():
    q, k, v = inputs(H, 5, 7)
    with torch.no_grad():
        d = headwise.choose_backend(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert d.backend != "flex" and d.passed_over["flex"].startswith(f"ranked below {d.backend!r} (torch's compiled "
                                                                    "flex_attention: seconds to compile")
    assert get_kernel("flex").compiles and not get_kernel("sdpa").compiles


# ---------------------------------------------------------------- on a GPU: training and the log-sum-exp


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_trains_on_a_gpu_with_every_rule(dtype):
    """Gradients of q, k, v, the sinks and the lse against the float64 oracle's."""
    n, cuda = 300, torch.device("cuda")
    q, k, v = (t.to(cuda, dtype).requires_grad_() for t in inputs(2, n, n, dim=32))
    sinks = torch.linspace(-1, 1, H, device=cuda, dtype=dtype).requires_grad_()
    slopes = masks.alibi_slopes(H)
    out, lse = headwise.attention(q, k, v, backend="flex", sinks=sinks, return_lse=True, softcap=20.0,
                                  alibi_slopes=slopes.to(cuda), mask_mod=document_causal(_documents(n).to(cuda)))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = reference_attention(*exact[:3], sinks=exact[3], softcap=20.0, alibi_slopes=slopes,
                              mask_mod=document_causal(_documents(n)))
    g, g_lse = torch.randn_like(ref.out), torch.randn_like(ref.lse)
    want = torch.autograd.grad((ref.out * g).sum() + (ref.lse * g_lse).sum(), exact)
    got = torch.autograd.grad((out.double() * g).sum() + (lse.double() * g_lse).sum(), (q, k, v, sinks))
    tol = 2e-4 if dtype == torch.float32 else 6e-2
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *got), (ref.out, ref.lse, *want),
                          strict=True):
        assert (a.double() - w).abs().max().item() <= tol * max(1.0, w.abs().max().item()), name

"""Tests for ``headwise.dispatch``: what ``backend="auto"`` picks, and that it says why.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

import headwise
import headwise.dispatch
from headwise import attention, available_backends, choose_backend
from headwise.dispatch import select
from headwise.kernels import registry
from headwise.kernels.registry import Request, kernels
from headwise.kernels.varlen import call_shapes

B, H, S, Sk, D = 2, 4, 3, 5, 8


def qkv(kv_heads=H):
    return (
        torch.randn(B, H, S, D),
        torch.randn(B, kv_heads, Sk, D),
        torch.randn(B, kv_heads, Sk, D),
    )


def request(**changes) -> Request:
    """A Request described without tensors, so huge sizes cost nothing."""
    base = dict(
        device=torch.device("cpu"), dtype=torch.float32, batch=B, heads=H, kv_heads=H,
        q_len=S, k_len=Sk, head_dim=D, mask_kind="none", mask_shape=None, is_causal=False,
        dropout_p=0.0, need_weights=False, requires_grad=False,
    )
    return Request(**{**base, **changes})


def weight_backends() -> list[str]:
    return [n for n, k in kernels().items() if k.supports_weights]


def assert_covers_every_other_kernel(d: headwise.Dispatch) -> None:
    assert d.backend not in d.passed_over
    assert set(d.passed_over) == set(kernels()) - {d.backend}
    assert all(isinstance(why, str) and why for why in d.passed_over.values())


@pytest.fixture
def tiny_budget(monkeypatch):
    monkeypatch.setattr(headwise.policy, "SCORES_BUDGET_BYTES", 16)


def swap_kernel(monkeypatch, name, **changes):
    """Replace a registered kernel for one test (the registry is restored afterwards)."""
    kernel = dataclasses.replace(registry.get_kernel(name), **changes)
    monkeypatch.setitem(registry._KERNELS, name, kernel)
    return kernel


# --- the rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"attention_mask": torch.ones(B, Sk, dtype=torch.bool)},
        {"attention_mask": torch.zeros(B, S, Sk)},
        {"is_causal": True},
        {"dropout_p": 0.1},  # small scores: SDPA's fallback is cheap
    ],
    ids=["plain", "bool-mask", "float-mask", "causal", "dropout"],
)
def test_auto_picks_sdpa_by_default(kwargs):
    d = choose_backend(*qkv(), **kwargs)
    assert d.backend == "sdpa"
    assert d.reason == "PyTorch's fused kernel is the fastest dense path"
    assert_covers_every_other_kernel(d)


def test_auto_picks_sdpa_for_grouped_query_without_copy_note():
    d = choose_backend(*qkv(kv_heads=2))
    assert d.backend == "sdpa"
    if registry.get_kernel("sdpa").native_gqa:
        assert "copies k/v" not in d.reason


def test_need_weights_runs_the_fastest_kernel_that_returns_the_log_sum_exp():
    d = choose_backend(*qkv(), need_weights=True)
    assert d.backend == "sdpa" and d.request.return_lse and not d.request.need_weights
    assert d.reason.endswith("; the weights asked for are computed from its log-sum-exp, exp(scores - lse), only "
                             "for the heads and rows asked for")
    assert_covers_every_other_kernel(d)


def test_a_kernel_that_returns_weights_but_no_lse_still_serves_need_weights(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
    matmul = registry.get_kernel("matmul")

    def weights_only(q, k, v, *, attention_mask, rules, dropout_p, scale, need_weights):
        return matmul.fn(q, k, v, attention_mask=attention_mask, rules=rules, dropout_p=dropout_p, scale=scale,
                         need_weights=need_weights)

    registry.add(dataclasses.replace(matmul, name="weights_only", fn=weights_only))
    d = choose_backend(*qkv(kv_heads=1), need_weights=True, backend="weights_only")
    assert d.request.need_weights and not d.request.return_lse
    out, weights = headwise.attention(*qkv(), need_weights=True, backend="weights_only", weights_heads=[0])
    assert weights.shape[:3] == (B, 1, S) and torch.isfinite(weights).all()


def test_cpu_dropout_with_huge_scores_picks_chunked(tiny_budget):
    d = choose_backend(*qkv(), dropout_p=0.1)
    assert d.backend == "chunked"
    assert re.fullmatch(
        r"dropout on CPU keeps SDPA off its fused kernel, and its fallback would hold "
        r"0 MiB of scores \(budget 0 MiB\); chunked keeps O\(S\) memory",
        d.reason,
    )
    assert d.passed_over["sdpa"].startswith("ranked below 'chunked'")
    assert_covers_every_other_kernel(d)


def test_budget_is_read_when_deciding(monkeypatch):
    # The same request, asked before and after the budget changes: rule 3 must see the change.
    q, k, v = qkv()
    assert choose_backend(q, k, v, dropout_p=0.1).backend == "sdpa"
    monkeypatch.setattr(headwise.policy, "SCORES_BUDGET_BYTES", 16)
    assert choose_backend(q, k, v, dropout_p=0.1).backend == "chunked"


def test_huge_scores_without_dropout_stay_on_sdpa(tiny_budget):
    assert choose_backend(*qkv()).backend == "sdpa"


def test_huge_scores_with_need_weights_keep_o_s_memory(tiny_budget):
    assert choose_backend(*qkv(), dropout_p=0.1, need_weights=True).backend == "chunked"  # its lse has dropout


def test_default_budget_on_a_described_request():
    # (1, 16, 8192, 8192) fp32 scores are 4 GiB: far over the default 256 MiB budget
    huge = request(batch=1, heads=16, kv_heads=16, q_len=8192, k_len=8192, dropout_p=0.1)
    d = select(huge)
    assert d.backend == "chunked"
    assert "would hold 4096 MiB of scores (budget 256 MiB)" in d.reason
    assert select(dataclasses.replace(huge, dropout_p=0.0)).backend == "sdpa"
    # off the CPU SDPA has fused dropout, so the rule does not apply
    assert select(dataclasses.replace(huge, device=torch.device("cuda"))).backend == "sdpa"


def test_chosen_backend_is_the_one_that_runs(monkeypatch, tiny_budget):
    calls = []
    chunked = registry.get_kernel("chunked")

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return chunked.fn(*args, **kwargs)

    swap_kernel(monkeypatch, "chunked", fn=spy)
    out = attention(*qkv(), dropout_p=0.1)
    assert out.shape == (B, H, S, D)
    assert len(calls) == 1 and calls[0]["dropout_p"] == 0.1


# --- explicit backends -----------------------------------------------------------------------


def test_explicit_backend_that_cannot_return_weights_names_able_backends(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))
    sdpa = registry.get_kernel("sdpa")

    def no_lse(q, k, v, *, attention_mask, rules, dropout_p, scale, need_weights):
        return sdpa.fn(q, k, v, attention_mask=attention_mask, rules=rules, dropout_p=dropout_p, scale=scale,
                       need_weights=need_weights)

    registry.add(dataclasses.replace(sdpa, name="no_lse", fn=no_lse))
    with pytest.raises(ValueError, match=re.escape("backend 'no_lse' cannot return attention weights "
                                                   "(need_weights=True); use backend='auto' or one of")):
        choose_backend(*qkv(), need_weights=True, backend="no_lse")


@pytest.mark.parametrize("backend", available_backends())
def test_explicit_backend_is_used_and_explains_the_rest(backend):
    d = choose_backend(*qkv(), backend=backend)
    assert d.backend == backend
    assert d.reason == "requested explicitly"
    assert d.passed_over == {n: f"backend={backend!r} was requested" for n in kernels()
                             if n != backend}


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"unknown backend 'fast'; choose one of 'auto', "):
        select(request(), "fast")


def test_unavailable_kernel_is_passed_over_with_its_reason(monkeypatch):
    swap_kernel(monkeypatch, "sdpa", available=lambda: "needs a newer torch")
    assert "sdpa" not in available_backends()
    d = choose_backend(*qkv())
    assert d.backend == "chunked"
    assert d.reason.startswith("first able backend in the ranking (")
    assert d.passed_over["sdpa"] == "needs a newer torch"
    assert_covers_every_other_kernel(d)
    able = [n for n, k in kernels().items() if n != "sdpa" and k.available() is None]
    with pytest.raises(
        ValueError,
        match=re.escape(f"backend 'sdpa' needs a newer torch; use backend='auto' or one of {able}"),
    ):
        choose_backend(*qkv(), backend="sdpa")


def test_kernel_refusal_is_reported(monkeypatch):
    swap_kernel(monkeypatch, "sdpa", refuses=lambda r: "no causal today" if r.is_causal else None)
    assert choose_backend(*qkv()).backend == "sdpa"
    d = choose_backend(*qkv(), is_causal=True)
    assert d.backend != "sdpa"
    assert d.passed_over["sdpa"] == "no causal today"


def test_no_able_backend_is_a_runtime_error(monkeypatch):
    for name in kernels():
        swap_kernel(monkeypatch, name, refuses=lambda r: "refused")
    with pytest.raises(RuntimeError, match="no registered backend can serve"):
        select(request())


# --- observability ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{}, {"need_weights": True}, {"dropout_p": 0.2}, {"is_causal": True}]
)
def test_passed_over_covers_every_other_registered_kernel(kwargs):
    assert_covers_every_other_kernel(choose_backend(*qkv(), **kwargs))


def test_dispatch_prints_one_line_per_kernel():
    d = choose_backend(*qkv())
    lines = str(d).splitlines()
    assert lines[0] == "backend 'sdpa': PyTorch's fused kernel is the fastest dense path"
    assert sorted(lines[1:]) == sorted(
        f"  passed over {name!r}: {why}" for name, why in d.passed_over.items()
    )
    assert d.kernel is registry.get_kernel("sdpa")
    assert d.request == request(dtype=torch.float32)


def test_auto_logs_its_choice_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="headwise.dispatch")
    attention(*qkv())
    records = [r for r in caplog.records if r.name == "headwise.dispatch"]
    assert len(records) == 1
    assert records[0].levelno == logging.DEBUG
    assert records[0].getMessage().startswith(
        "auto chose backend 'sdpa': PyTorch's fused kernel is the fastest dense path"
    )
    assert "passed over 'matmul'" in records[0].getMessage()


def test_no_log_above_debug(caplog):
    caplog.set_level(logging.INFO, logger="headwise.dispatch")
    attention(*qkv())
    assert not [r for r in caplog.records if r.name == "headwise.dispatch"]


def test_heavy_key_padding_on_cpu_picks_varlen_when_priced_lower_and_says_why(monkeypatch):
    q, k, v = torch.randn(4, 8, 256, 64), torch.randn(4, 8, 1024, 64), torch.randn(4, 8, 1024, 64)
    keys = torch.ones(4, 1024, dtype=torch.bool)
    keys[1:, 256:] = False  # three rows of four keep a quarter of the keys: 56% padding
    with torch.no_grad():
        d = choose_backend(q, k, v, keys)
    calls = [(1, 1024), (1, 256), (1, 256), (1, 256)]  # rows of DIRECT_MIN_LENGTH keys attend alone
    assert call_shapes([1024, 256, 256, 256]) == calls
    estimate = headwise.policy.estimate_varlen(4, 8, 8, 256, 1024, 64, calls)
    assert estimate.drops
    assert (d.backend, d.reason) == ("varlen", f"56% of the keys are padding: varlen drops them per row, {estimate}; "
                                     "unit costs built in (HEADWISE_TUNE=off)")
    assert d.request.key_padding == pytest.approx(0.55) and d.request.key_lengths == (1024, 256, 256, 256)
    # the unit costs are read at each decision: a dear call makes the same keys stay with SDPA
    dear = dataclasses.replace(headwise.policy.INFERENCE_COSTS, bucket_us=1e6)
    monkeypatch.setattr(headwise.policy, "INFERENCE_COSTS", dear)
    with torch.no_grad():
        d = choose_backend(q, k, v, keys)
    assert d.backend == "sdpa" and d.reason.startswith("PyTorch's fused kernel is the fastest dense path; 56% of "
                                                       "the keys are padding, but estimated varlen")
    monkeypatch.setattr(headwise.policy, "VARLEN_MIN_PADDING", 0.99)  # not priced below it
    assert choose_backend(q, k, v, keys).reason == "PyTorch's fused kernel is the fastest dense path"
    assert choose_backend(q, k, v, keys, need_weights=True).backend == "sdpa"  # the weights from its lse
    assert choose_backend(q, k, v, torch.ones_like(keys)).backend == "sdpa"


def test_short_keys_need_more_padding_before_varlen_pays():
    """The fixed cost per call: at the same share of padding, few keys stay with SDPA."""
    q = torch.randn(8, 8, 64, 64)
    for Sk, expected in ((64, "sdpa"), (2048, "varlen")):
        k = torch.randn(8, 8, Sk, 64)
        keys = torch.ones(8, Sk, dtype=torch.bool)
        keys[1:, Sk // 2:] = False  # 44% padding
        with torch.no_grad():
            assert choose_backend(q, k, k, keys).backend == expected


def test_cuda_structured_requests_rank_triton_first():
    r = request(device=torch.device("cuda"), dtype=torch.float16, mask_kind="bool", mask_shape=(2, 1, 1, 5))
    d = select(r)
    triton = kernels()["triton"]
    if triton.available() is None:  # a CUDA machine with triton
        assert d.backend == "triton" and "flash kernel takes no mask" in d.reason
    else:
        assert d.passed_over["triton"] == triton.available()
        assert d.reason.startswith("first able backend in the ranking (SDPA's flash kernel takes no mask")
    plain = select(request(device=torch.device("cuda"), dtype=torch.float16))
    assert plain.backend == "sdpa"  # no mask, no window: SDPA's flash kernel stays


@pytest.mark.parametrize("b, s", [(0, 0), (1, 0), (0, 3)])
def test_a_document_mask_mod_on_empty_sizes_is_served_by_auto(b, s):
    # auto's reason took max() over the documents of every row: with no row (B = 0) or rows
    # with no document (S = 0) it raised "max() arg is an empty sequence", a ValueError that
    # read as a refusal of a call every kernel serves
    from headwise import masks

    q = torch.randn(b, 2, s, D, dtype=torch.float64)
    rule = masks.document(torch.tensor([0, 0, 1])[:s])
    choice = choose_backend(q, q, q, mask_mod=rule)
    assert choice.backend == "varlen" and "the longest 0 tokens" in choice.reason
    out = attention(q, q, q, mask_mod=rule)
    assert out.shape == (b, 2, s, D)
    torch.testing.assert_close(out, attention(q, q, q, mask_mod=rule, backend="matmul"), atol=0, rtol=0)

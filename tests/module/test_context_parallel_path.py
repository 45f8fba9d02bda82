"""The module's context-parallel path (src/headwise/module/context_parallel.py) in one process:
a gloo group of one rank, where the shard is the whole sequence, so each call must equal the
module without context_parallel in float64 (the multi-rank runs are tests/test_distributed.py).

Legend: B batch, S length, E embed dim, H heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import headwise
import headwise.distributed as hwd

E, H = 16, 4


@pytest.fixture
def world_of_one(tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method", ["ring", "ulysses"])
@pytest.mark.parametrize("module_causal", [False, True])
def test_the_calls_causal_flag_reaches_the_ranks(world_of_one, method, module_causal):
    """is_causal given per call overrides the module's, as on every other path."""
    torch.manual_seed(0)
    kwargs = dict(rope=True, num_kv_heads=2, dtype=torch.float64)
    mha = headwise.MultiHeadAttention(E, H, is_causal=module_causal, **kwargs,
                                      context_parallel=hwd.ContextParallel(method=method))
    plain = headwise.MultiHeadAttention(E, H, is_causal=module_causal, **kwargs)
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 6, E, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    for is_causal in (None, True, False):
        got = mha(x, mask, is_causal=is_causal)
        want = plain(x, mask, is_causal=is_causal)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        dx, = torch.autograd.grad(got.sum(), x)
        want_dx, = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(dx, want_dx, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_nan_at_padded_context_reaches_no_gradient(world_of_one, method):
    """Cross-attention: NaN / inf at the context's padded positions (a 2-D keep mask) reach no
    output and no gradient, k_proj's and v_proj's weights included, as in the module without
    context_parallel."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=2, dtype=torch.float64,
                                      context_parallel=hwd.ContextParallel(method=method))
    plain = headwise.MultiHeadAttention(E, H, num_kv_heads=2, dtype=torch.float64)
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, 3, E, dtype=torch.float64)
    context = torch.randn(2, 5, E, dtype=torch.float64)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
    context[~keep] = float("nan")
    context[1, 1, 0] = float("inf")
    results = []
    for module in (mha, plain):
        c = context.clone().requires_grad_()
        y = module(x, keep, context=c)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), c.grad, *(p.grad for p in module.parameters())])
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

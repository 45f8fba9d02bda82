"""The chunked kernel's own promises: exact dropout replay in backward, O(S) saved memory.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length,
Sk key length, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import policy
from headwise.kernels import chunked
from headwise.rules import Rules


def _keep_mask(seed, B, Hkv, G, S, Sk, block_q, block_k, p):
    """Rebuild the whole (B, H, S, Sk) keep mask from the per-tile seeds."""
    keep = torch.zeros(B, Hkv, G, S, Sk, dtype=torch.bool)
    k_blocks = range(0, Sk, block_k)
    for qi, i0 in enumerate(range(0, S, block_q)):
        i1 = min(i0 + block_q, S)
        for kj, j0 in enumerate(k_blocks):
            j1 = min(j0 + block_k, Sk)
            tile = qi * len(k_blocks) + kj
            shape = (B, Hkv, G, i1 - i0, j1 - j0)
            keep[..., i0:i1, j0:j1] = ~chunked._tile_drop(seed, tile, shape, p, torch.device("cpu"))
    return keep.reshape(B, Hkv * G, S, Sk)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_dropout_replayed_exactly_in_backward(monkeypatch, is_causal, ref):
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 3)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 4)
    B, H, Hkv, S, Sk, D, p = 2, 4, 2, 7, 9, 8, 0.4
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, generator=gen, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, generator=gen, requires_grad=True)
    mask = torch.tensor([[1] * Sk, [1] * 5 + [0] * 4])
    torch.manual_seed(123)
    out = headwise.attention(q, k, v, mask, is_causal=is_causal, dropout_p=p, backend="chunked")
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**62, ()).item())
    keep = _keep_mask(seed, B, Hkv, H // Hkv, S, Sk, 3, 4, p)
    assert 0.3 < 1 - keep.float().mean().item() < 0.5  # about p of the weights dropped
    expected, _ = ref(q, k, v, mask, is_causal=is_causal, keep=keep, dropout_p=p)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(expected, (q, k, v), g.double())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-5)


def _saved_bytes(backend, S):
    """Bytes autograd keeps for backward after one forward at sequence length S."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    q = torch.randn(1, 2, S, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        headwise.attention(q, q, q, torch.ones(1, S, dtype=torch.bool), dropout_p=0.1,
                           backend=backend)
    return total


def test_saved_memory_grows_linearly_with_sequence_length():
    """4x the sequence: chunked saves ~4x (O(S)); the textbook kernel ~16x (O(S^2))."""
    chunked_ratio = _saved_bytes("chunked", 1024) / _saved_bytes("chunked", 256)
    matmul_ratio = _saved_bytes("matmul", 1024) / _saved_bytes("matmul", 256)
    assert chunked_ratio < 4.5, chunked_ratio
    assert matmul_ratio > 12, matmul_ratio


def test_fully_blocked_query_blocks_are_zero(monkeypatch):
    """S > Sk with causal: the first S - Sk queries see no key; whole tiles are skipped."""
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 2)
    q = torch.randn(1, 1, 9, 4, requires_grad=True)
    kv = torch.randn(1, 1, 3, 4, requires_grad=True)
    out = headwise.attention(q, kv, kv, is_causal=True, backend="chunked")
    assert (out[0, 0, :6] == 0).all() and (out[0, 0, 6:] != 0).any()
    out.sum().backward()
    assert (q.grad[0, 0, :6] == 0).all() and torch.isfinite(kv.grad).all()


@pytest.mark.parametrize("window, sinks", [(2, 1), (2, 4), (3, 2)])
def test_sink_tiles_are_never_skipped_and_the_rest_still_are(monkeypatch, window, sinks, ref):
    """With a window, tiles wholly before it are skipped, except those holding a sink key; the
    tiles computed are exactly those with an allowed entry, and the result is the reference's."""
    from headwise.kernels.registry import Call
    from headwise.masks import causal_mask

    bq, bk, S = 2, 3, 14
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", bq)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", bk)
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(1, 2, S, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, S, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, S, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    out = headwise.attention(q, k, v, window=window, sink_tokens=sinks, backend="chunked")
    want, _ = ref(q, k, v, window=window, sink_tokens=sinks)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    allowed = causal_mask(S, S, window=window, sink_tokens=sinks)
    live = {(i0, j0) for i0 in range(0, S, bq) for j0 in range(0, S, bk) if allowed[i0:i0 + bq, j0:j0 + bk].any()}
    plan = chunked._Plan(q, k, None, Rules(is_causal=True, window=window, sink_tokens=sinks), bq, bk)
    assert {(i0, j0) for _, (i0, _), (j0, _), _ in plan.tiles()} == live
    assert len(live) < len(plan.q_blocks) * len(plan.k_blocks)  # some tiles are skipped still
    note = chunked.chunked_stages(Call(q, k, v, None, Rules(is_causal=True, window=window, sink_tokens=sinks), 0.0, 0.5,
                                       False))[0].note
    assert f"{len(live)} of {len(plan.q_blocks) * len(plan.k_blocks)} tiles" in note
    assert f"the tiles of the {sinks} sink keys are kept for every query" in note


def _counting():
    calls = []

    def counting(score, b, h, q_idx, kv_idx):  # a score_mod with state: each call tilts the scores more
        calls.append(1)
        return score + 0.5 * len(calls) * (kv_idx - q_idx)

    return counting


def _own_noise():
    gen = torch.Generator().manual_seed(0)

    def own_noise(score, b, h, q_idx, kv_idx):  # randomness from its own generator, which no one replays
        return score + torch.rand(score.shape, generator=gen)

    return own_noise


@pytest.mark.parametrize("make", [_counting, _own_noise], ids=["counting", "own-generator"])
def test_a_score_mod_that_is_not_a_pure_function_is_refused_in_backward(make):
    """chunked's backward recomputes each block's scores: a score_mod that answers otherwise the
    second time would give a wrong gradient, so backward says so instead."""
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(2))
    out = headwise.attention(q, k, v, score_mod=make(), backend="chunked")
    with pytest.raises(RuntimeError, match=r"score_mod (counting|own_noise) gave other scores when chunked's "
                                           r"backward recomputed them.*pure function.*backend='matmul'"):
        out.sum().backward()


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_a_pure_score_mod_passes_backward_with_the_gradient_of_matmul(dropout_p):
    """The check reads the recomputed block against forward's (dropout replayed): no false alarm."""
    def tilted(score, b, h, q_idx, kv_idx):
        return score * 0.5 + 0.1 * (kv_idx - q_idx) + torch.rand(()) * 0  # global RNG: checkpoint replays it

    q = torch.randn(2, 4, 9, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 7, 8, requires_grad=True) for _ in range(2))
    got = headwise.attention(q, k, v, score_mod=tilted, backend="chunked", dropout_p=dropout_p)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    if dropout_p == 0:
        want = headwise.attention(q, k, v, score_mod=tilted, backend="matmul")
        torch.testing.assert_close(got, want)
        for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(g, w)

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

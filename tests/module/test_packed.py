"""The padding-free path (module/packed.py): packed calls equal the dense path on the same
weights in float64, rotary positions counted within each sequence, and every refusal of
``forward_packed`` names the values and the remedy.

Legend: B sequences, S padded length, T packed tokens, E embed dim.
"""

from __future__ import annotations

import re

import pytest
import torch

import headwise

E, H = 32, 4
MODULES = {
    "rope": dict(rope=True),
    "rope + GQA + causal": dict(rope=True, num_kv_heads=2, is_causal=True),
    "qk norm + rope": dict(qk_norm="rms", rope=True),
    "value head dim": dict(v_head_dim=6, num_kv_heads=2),
    "sinks + softcap": dict(sinks=True, softcap=4.0),
}


def pair(**kwargs) -> tuple[headwise.MultiHeadAttention, headwise.MultiHeadAttention]:
    """The packed path and the dense path, one set of weights."""
    torch.manual_seed(0)
    packed = headwise.MultiHeadAttention(E, H, packing=True, dtype=torch.float64, **kwargs)
    dense = headwise.MultiHeadAttention(E, H, packing=False, dtype=torch.float64, **kwargs)
    if packed.sinks is not None:
        with torch.no_grad():
            packed.sinks.copy_(torch.linspace(-1.0, 1.0, H, dtype=torch.float64))
    dense.load_state_dict(packed.state_dict())
    return packed, dense


@pytest.mark.parametrize("name", list(MODULES))
def test_the_packed_path_equals_the_dense_path_forward_and_backward(name):
    packed, dense = pair(**MODULES[name])
    x = torch.randn(3, 6, E, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    assert packed.plan(x, mask).path == "packed"
    outs, grads = [], []
    for mha in (packed, dense):
        xg = x.clone().requires_grad_()
        out = mha(xg, mask)
        (out * torch.linspace(-1, 1, E, dtype=torch.float64)).sum().backward()
        outs.append(out)
        grads.append((xg.grad, mha.q_proj.weight.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_forward_packed_counts_positions_within_each_sequence():
    packed, dense = pair(rope=True, is_causal=True)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    tokens = torch.cat([x[0, :5], x[1, :3]])  # (T, E): lengths 5 and 3
    cu = torch.tensor([0, 5, 8])
    with torch.no_grad():
        want = dense(x, torch.tensor([[1] * 5, [1, 1, 1, 0, 0]], dtype=torch.bool))
        got = packed.forward_packed(tokens, cu)
        given = packed.forward_packed(tokens, cu, positions=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), lengths=(5, 3))
        spread = packed.forward_packed(tokens, cu, positions=torch.tensor([0, 1, 2, 3, 4, 0, 2, 4]))
        unmasked = packed.forward_packed(tokens, cu, is_causal=False)
    torch.testing.assert_close(got, torch.cat([want[0, :5], want[1, :3]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(given, got, rtol=0, atol=0)
    # rope is relative: only the distances matter; spread ones change the second sequence only
    assert not torch.allclose(spread[6:], got[6:])
    torch.testing.assert_close(spread[:5], got[:5], rtol=0, atol=0)
    assert not torch.allclose(unmasked[:4], got[:4])  # is_causal=False overrides the module's causal rule


def test_forward_packed_is_causal_true_makes_a_non_causal_module_causal():
    packed, dense = pair(rope=True)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    tokens = torch.cat([x[0, :5], x[1, :3]])  # (T, E): lengths 5 and 3
    with torch.no_grad():
        want = dense(x, torch.tensor([[1] * 5, [1, 1, 1, 0, 0]], dtype=torch.bool), is_causal=True)
        got = packed.forward_packed(tokens, torch.tensor([0, 5, 8]), is_causal=True)
    torch.testing.assert_close(got, torch.cat([want[0, :5], want[1, :3]]), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("args", "error", "message"), [
    ((torch.randn(4, E), [0, 4]), TypeError,
     "cu_seqlens must be a torch.Tensor of int32/int64 offsets, got list"),
    ((torch.randn(4, E), torch.tensor([0.0, 4.0])), TypeError,
     "cu_seqlens must be an integer tensor (int32 or int64 offsets), got torch.float32; pass cu_seqlens.long()"),
    ((torch.randn(4, E), torch.tensor([True, False])), TypeError,
     "cu_seqlens must be an integer tensor (int32 or int64 offsets), got torch.bool; pass cu_seqlens.long()"),
    ((torch.randn(4, E), torch.tensor([[0, 4]])), ValueError,
     "cu_seqlens must be 1-D (B + 1,) offsets, got shape (1, 2)"),
    ((torch.randn(4, E), torch.tensor([], dtype=torch.long)), ValueError,
     "cu_seqlens must be 1-D (B + 1,) offsets, got shape (0,)"),
    ((torch.randn(4, E), torch.tensor([1, 2, 3, 4, 4, 4])), ValueError,
     "cu_seqlens must start at 0 (sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]), got [1, 2, 3, 4] ..."),
    ((torch.randn(4, E), torch.tensor([1, 4])), ValueError,
     "cu_seqlens must start at 0 (sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]), got [1, 4]"),
    ((torch.randn(4, E), torch.tensor([1, 2, 3, 4])), ValueError,  # four offsets: all shown, no "..."
     "cu_seqlens must start at 0 (sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]), got [1, 2, 3, 4]"),
    ((torch.randn(4, E), torch.tensor([0, 3, 2, 4])), ValueError,
     "cu_seqlens must be non-decreasing, got [0, 3, 2, 4]"),
    ((torch.randn(4, E), torch.tensor([0, 3])), ValueError, "cu_seqlens must end at the 4 rows of x, got 3 ([0, 3])"),
    ((torch.randn(4, E), torch.tensor([0, 1, 4]), (2, 2)), ValueError,
     "lengths (2, 2) are not the differences of cu_seqlens [0, 1, 4] ((1, 3)); pass lengths=None to read them "
     "from cu_seqlens"),
    ((torch.randn(4, E), torch.tensor([0, 1, 4]), (4,)), ValueError,
     "lengths (4,) name 1 sequences but cu_seqlens (3,) holds 2"),
    ((torch.randn(4, 2, E), torch.tensor([0, 4])), ValueError,
     "packed x must be (T, E) with E = embed_dim = 32, got (4, 2, 32)"),
    ((torch.randn(4, E, dtype=torch.float64), torch.tensor([0, 4])), TypeError,
     "x has dtype torch.float64 but the module's parameters are torch.float32; convert one to the other: "
     "x.to(torch.float32) or mha.to(torch.float64)"),  # autocast casts no float64: not suggested
])
def test_forward_packed_refuses_with_the_values_and_the_remedy(args, error, message):
    mha = headwise.MultiHeadAttention(E, H)
    x, cu, *lengths = args
    with pytest.raises(error, match=re.escape(message) + "$"):
        mha.forward_packed(x, cu, lengths=lengths[0] if lengths else None)


def test_forward_packed_refuses_context_parallel():
    from headwise.distributed import ContextParallel

    mha = headwise.MultiHeadAttention(E, H, context_parallel=ContextParallel())
    with pytest.raises(ValueError, match=re.escape("forward_packed runs in one process; context_parallel takes "
                                                   "(B, S_l, E) shards in forward") + "$"):
        mha.forward_packed(torch.randn(4, E), torch.tensor([0, 4]))


def test_a_traced_packed_call_records_the_packing():
    mha = headwise.MultiHeadAttention(E, H, packing=True).eval()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad(), headwise.trace() as t:
        mha(torch.randn(2, 4, E), mask)
    got = [(s.name, s.shape, s.note) for s in t.stages if s.name in ("input", "pack", "unpack")]
    assert got == [
        ("input", (2, 4, E), "x: (B, S, E)"),
        ("pack", (6, E), "keep the 6 real tokens of 2 x 4 positions (drop 2 padded), 2 sequences end to end"),
        ("unpack", (2, 4, E), "scatter the tokens back to (B, S, E); padded positions output zeros"),
    ]


@pytest.mark.parametrize(("v_head_dim", "note"), [
    (None, "flatten(1): (T, H, D) -> (T, E), a view"),
    (6, "flatten(1): (T, H, Dv) -> (T, H*Dv), a view"),
])
def test_a_traced_packed_call_names_the_merge_of_its_value_heads(v_head_dim, note):
    mha = headwise.MultiHeadAttention(E, H, packing=True, v_head_dim=v_head_dim).eval()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad(), headwise.trace() as t:
        mha(torch.randn(2, 4, E), mask)
    merge = [s for s in t.stages if s.name == "merge heads"]
    assert [(s.shape, s.note) for s in merge] == [((6, H * (v_head_dim or E // H)), note)]


def test_a_traced_packed_call_notes_its_projections_and_head_split():
    mha = headwise.MultiHeadAttention(E, H, packing=True).eval()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    with torch.no_grad(), headwise.trace() as t:
        mha(torch.randn(2, 4, E), mask)
    notes = {s.name: s.note for s in t.stages}
    assert notes["k projection"] == "k_proj(x): (T, E) x (Hkv*D, E)^T + b"
    assert notes["split heads q"] == "unflatten(-1, (H, D)): packed rows need no transpose"
    assert notes["split heads k, v"] == "the same with H = Hkv"

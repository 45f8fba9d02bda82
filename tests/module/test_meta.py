"""Every path of the module on the ``meta`` device (shapes without storage, as a model is
sized before ``to_empty()``): each call returns a meta tensor of the right shape, so no
path reads a tensor's values or makes a tensor on another device.

Legend: B batch, S length, T packed tokens, E embed dim, H heads.
"""

from __future__ import annotations

import pytest
import torch

import headwise

E, H = 32, 4
META = torch.device("meta")
MODULES = {
    "plain": {},
    "rope + GQA": dict(rope=True, num_kv_heads=2),
    "window + sink tokens + alibi": dict(window=3, sink_tokens=1, alibi=True),
    "causal + qk norm": dict(is_causal=True, qk_norm="rms"),
}


def on_meta(out, *shape):
    out = out[0] if isinstance(out, tuple) else out
    assert out.device == META and tuple(out.shape) == shape


@pytest.mark.parametrize("name", list(MODULES))
def test_calls_without_a_cache_run_on_meta(name):
    mha = headwise.MultiHeadAttention(E, H, device=META, **MODULES[name]).eval()
    x = torch.empty(2, 5, E, device=META)
    mask = torch.empty(2, 5, dtype=torch.bool, device=META)
    with torch.no_grad():
        on_meta(mha(x), 2, 5, E)
        on_meta(mha(x, mask), 2, 5, E)
        on_meta(mha(x, mask, need_weights=True), 2, 5, E)
        on_meta(mha(x, mask_mod=headwise.masks.causal), 2, 5, E)
        on_meta(mha(x, mask, score_mod=lambda s, b, h, q_idx, kv_idx: s + 0.1 * (q_idx - kv_idx)), 2, 5, E)
        on_meta(mha(x, context=torch.empty(2, 3, E, device=META)) if "rope" not in name else mha(x), 2, 5, E)
        tokens, cu = torch.empty(5, E, device=META), torch.empty(3, dtype=torch.long, device=META)
        on_meta(mha.forward_packed(tokens, cu, lengths=(2, 3)), 5, E)
    on_meta(mha.train()(x.requires_grad_()), 2, 5, E)


@pytest.mark.parametrize("kind", ["dynamic", "static", "evicting"])
@pytest.mark.parametrize("name", list(MODULES))
def test_cache_steps_run_on_meta(name, kind):
    if kind == "evicting" and "window" not in name:
        pytest.skip("an evicting cache needs a window")
    mha = headwise.MultiHeadAttention(E, H, device=META, **MODULES[name]).eval()
    cache = mha.new_cache(2, 12, static=kind == "static", evict=kind == "evicting")
    assert cache.k.device == META
    with torch.no_grad():
        on_meta(mha(torch.empty(2, 5, E, device=META), cache=cache), 2, 5, E)
        for _ in range(3):  # the remembered step from the second on
            on_meta(mha(torch.empty(2, 1, E, device=META), cache=cache), 2, 1, E)
        if kind == "dynamic":  # (a static cache's rules read its position's value: int(cache.position))
            on_meta(mha(torch.empty(2, 1, E, device=META), cache=cache, mask_mod=headwise.masks.causal), 2, 1, E)


@pytest.mark.parametrize("packing", [True, "auto"])
def test_a_meta_mask_plans_the_dense_path_and_says_why(packing):
    """A meta mask holds no values to pack by: packing=True (and "auto") plan the dense path,
    which gives the packed path's shapes; forward and dispatch run (they failed in torch's
    nonzero and in a host copy of the lengths)."""
    mha = headwise.MultiHeadAttention(E, H, packing=packing, device=META)
    x = torch.empty(2, 5, E, device=META)
    mask = torch.empty(2, 5, dtype=torch.bool, device=META)
    plan = mha.plan(x, mask)
    assert plan.path == "dense" and "meta mask holds no values" in plan.why and f"packing={packing!r}" in plan.why
    assert mha.dispatch(x, mask).path == "dense"
    with torch.no_grad():
        on_meta(mha(x, mask), 2, 5, E)
    on_meta(mha(x.requires_grad_(), mask), 2, 5, E)
    real = headwise.MultiHeadAttention(E, H, packing=True)  # the same module with data packs
    assert real.plan(torch.randn(2, 5, E), torch.tensor([[1] * 5, [1, 1, 0, 0, 0]]).bool()).path == "packed"

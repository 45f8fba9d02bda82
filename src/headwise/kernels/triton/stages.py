"""Explain mode's words for the triton kernel: its one fused stage, and the tile map a
mask_mod becomes (with the shares of empty, full and partial tiles).

Legend: B batch, H query heads, S query length, Sk key length, D head dim, nq / nk the map
tiles along S / Sk.
"""

from __future__ import annotations

from typing import cast

from headwise.evaluate import MaskMod, mask_tile_states
from headwise.kernels import describe
from headwise.kernels.registry import Call, KernelStage
from headwise.kernels.triton.configs import _rule_block
from headwise.kernels.triton.support import _interpreted
from headwise.tiles import EMPTY, FULL, PARTIAL, Bounds


def _tile_map_note(call: Call) -> str:
    """Explain mode's words for a mask_mod: the tile map the kernels walk, with its shares."""
    B, H, _, S, Sk, _ = call.sizes
    bq, bk = _rule_block(_interpreted(call.q.device))
    rule = cast(MaskMod, call.rules.structure(S, Sk))  # not None: only called with a mask_mod
    states = mask_tile_states(rule, Bounds(S, Sk, bq, bk, call.q.device), B, H)  # (B|1, H|1, nq, nk)
    nq, nk = states.shape[-2:]
    share = {name: float((states == value).float().mean()) for name, value in
             (("empty", EMPTY), ("full", FULL), ("partial", PARTIAL))}
    causal = f" ({describe.causal_rule(call)} ANDed in)" if call.is_causal else ""
    name = getattr(call.rules.mask_mod, "__name__", None) or repr(call.rules.mask_mod)
    return (f"mask_mod {name}{causal} as a tile map of {nq} x {nk} tiles of {bq} x {bk} per "
            f"(b, h): {share['empty']:.0%} empty (skipped), {share['full']:.0%} full (no mask), "
            f"{share['partial']:.0%} partial (their {bq} x {bk} bits loaded, built for those tiles only)")


def triton_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`~headwise.kernels.triton.triton_attention` for one call: one fused stage."""
    B, H, _, S, Sk, D = call.sizes
    if S == 0 or Sk == 0:
        return [KernelStage("triton", (B, H, S, D), call.q.dtype, "nothing to compute: zeros", fused=True)]
    how = "tile by tile in one Triton kernel (FlashAttention-2)"
    if call.attention_mask is not None:
        how += (f"; the {tuple(call.attention_mask.shape)} key mask read as one bias per key, key tiles that "
                "are all padding skipped")
    if call.rules.mask_mod is not None:
        how += f"; {_tile_map_note(call)}"
    elif call.is_causal:
        how += f"; {describe.causal_rule(call)}, tiles it blocks entirely skipped"
    if call.softcap is not None:
        how += f"; each tile capped at {call.softcap:.4g} with tanh before the mask"
    if call.sinks is not None:
        how += "; the sink logits join the running max and sum after the key tiles"
    how += describe.shared_kv(call)
    return [describe.fused(call, "triton", how, f"scores {describe.scores_shape(call)} not materialised")]

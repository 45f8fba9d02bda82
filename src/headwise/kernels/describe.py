"""Explain mode's words for what a kernel does, built from one call's real values.

Kernels hold no trace hooks. Each declares a ``stages(call)`` function next to its
``KERNEL``, written with these helpers, and :func:`headwise.functional.attend` records
what it returns. Every note is computed from the call (the scale actually used, the
mask's real shape and how it broadcasts, the group size), so it says what this call did;
``tests/kernels/test_describe.py`` checks the textbook kernels' shapes and dtypes against
the tensors they really produce.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S query length,
Sk key length, D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import torch

from headwise.kernels.registry import Call, KernelStage

_DIMS = ("B", "H", "S", "Sk")


def scaling(call: Call) -> KernelStage:
    """``q * scale`` (B, H, S, D), with the scale actually used and where it came from."""
    B, H, _, S, _, D = call.sizes
    if call.scale_given:
        note = f"q x {call.scale:.4g} (given scale=), before the product"
    else:
        note = f"q x {call.scale:.4g} = 1 / sqrt(D), D = {D}, before the product"
    return KernelStage("scaling", (B, H, S, D), call.q.dtype, note)


def repeat_kv(call: Call, why: str) -> list[KernelStage]:
    """The copy of k and v to H heads of a kernel that cannot share kv heads; [] when Hkv == H."""
    B, H, Hkv, _, Sk, D = call.sizes
    if Hkv == H:
        return []
    note = (f"k, v.repeat_interleave({H // Hkv}, dim=1): (B, Hkv, Sk, D) -> (B, H, Sk, D), "
            f"{Hkv} -> {H} heads, {why}")
    return [KernelStage("repeat kv heads", (B, H, Sk, D), call.k.dtype, note)]


def _position(offset: int) -> str:
    """``i + offset`` as it reads best: ``i``, ``i + 2``, ``i - 1``."""
    return "i" if offset == 0 else f"i + {offset}" if offset > 0 else f"i - {-offset}"


def causal_rule(call: Call) -> str:
    """Which keys the causal rule (and window) leave to query ``i``, with the real offset Sk - S."""
    _, _, _, S, Sk, _ = call.sizes
    top = _position(Sk - S)
    if call.window is None:
        return f"causal: key j <= {top}"
    rule = f"causal window {call.window}: {_position(Sk - S - call.window)} < j <= {top}"
    if call.sink_tokens:
        rule += f", or j < {call.sink_tokens} (sink tokens) and j <= {top}"
    return rule


def mask_note(call: Call) -> str:
    """What the mask step does: the caller's mask, its real shape and how it broadcasts, and
    the causal rule."""
    B, H, _, S, Sk, _ = call.sizes
    target = (B, H, S, Sk)
    parts = []
    mask = call.attention_mask
    if mask is not None:
        shape = tuple(mask.shape)
        over = [name for name, m, t in zip(_DIMS, shape, target, strict=True) if m == 1 and t != 1]
        spread = f"broadcast over {', '.join(over)} to {target}" if over else "one entry per score"
        how = "masked_fill(~mask, -inf)" if mask.dtype == torch.bool else "+ float mask (-inf blocks)"
        parts.append(f"{how}, mask {shape} {spread}")
    if call.is_causal:
        parts.append(causal_rule(call))
    return "; ".join(parts) or "no mask: every key visible"


def alibi_note(call: Call) -> str:
    """ALiBi's bias with the call's real slopes."""
    if call.alibi_slopes is None:
        return "no ALiBi bias"
    slopes = call.alibi_slopes.tolist()
    _, H, _, S, Sk, _ = call.sizes
    if H == 1:
        which = f"slope {slopes[0]:.3g}"
    else:
        which = f"slopes {slopes[0]:.3g} (head 0) to {slopes[-1]:.3g} (head {H - 1})"
    return f"+ -slope_h * |{_position(Sk - S)} - j|, {which}: a (1, H, S, Sk) = {(1, H, S, Sk)} bias"


def softcap_note(call: Call) -> str:
    """Soft-capping with the call's real cap."""
    return (f"softcap * tanh(scores / softcap), softcap = {call.softcap:.4g}: every score squashed into "
            f"(-{call.softcap:.4g}, {call.softcap:.4g})")


def sinks_note(call: Call) -> str:
    """The sink column with the call's real sink logits."""
    sinks = call.sinks.tolist() if call.sinks is not None else []
    _, H, _, S, Sk, _ = call.sizes
    which = f"logit {sinks[0]:.3g}" if H == 1 else f"logits {sinks[0]:.3g} (head 0) to {sinks[-1]:.3g} (head {H - 1})"
    return f"one sink column per head appended as key {Sk}, sink {which}: (B, H, S, Sk + 1)"


def middle(call: Call) -> list[KernelStage]:
    """The stages of :func:`headwise.kernels.common.mask_softmax_dropout`, in its order:
    softcap, alibi (when given), mask, sinks (when given), softmax, dropout, each
    (B, H, S, Sk) but the sinks' (B, H, S, Sk + 1)."""
    B, H, _, S, Sk, _ = call.sizes
    shape, dtype = (B, H, S, Sk), call.q.dtype
    stages = []
    if call.softcap is not None:
        stages.append(KernelStage("softcap", shape, dtype, softcap_note(call)))
    if call.alibi_slopes is not None:
        stages.append(KernelStage("alibi", shape, dtype, alibi_note(call)))
    stages.append(KernelStage("mask", shape, dtype, mask_note(call)))
    if call.sinks is None:
        softmax = f"softmax over Sk = {Sk} keys; a row with nothing to attend -> zeros, not NaN"
    else:
        stages.append(KernelStage("sinks", (B, H, S, Sk + 1), dtype, sinks_note(call)))
        softmax = (f"softmax over Sk + 1 = {Sk + 1} columns, the sink column dropped after it: each row sums "
                   "to 1 - p(sink); a row with nothing else to attend -> zeros")
    stages.append(KernelStage("softmax", shape, dtype, softmax))
    p = call.dropout_p
    dropout = (f"p = {p}: zero weights at random, scale the rest by 1/(1-p) = {1 / (1 - p):.4g}" if p > 0
               else "p = 0: identity")
    stages.append(KernelStage("dropout", shape, dtype, dropout))
    return stages


def textbook(call: Call, *, scores: str, weighted_sum: str, copies_kv: str | None = None) -> list[KernelStage]:
    """Every stage of a kernel that materialises the scores, in the order it does them.

    Args:
        call: the call.
        scores: the note of the ``q k^T`` product (B, H, S, Sk).
        weighted_sum: the note of the product with v (B, H, S, Dv).
        copies_kv: None when grouped-query heads share their kv head; else why the kernel
            copies k and v to H heads first (a ``repeat kv heads`` stage when Hkv < H).

    Returns:
        [repeat kv heads], scaling, scores, [softcap], [alibi], mask, [sinks], softmax,
        dropout, weighted sum.
    """
    B, H, _, S, Sk, D = call.sizes
    dtype = call.q.dtype
    stages = [] if copies_kv is None else repeat_kv(call, copies_kv)
    stages.append(scaling(call))
    stages.append(KernelStage("scores", (B, H, S, Sk), dtype, scores))
    stages += middle(call)
    stages.append(KernelStage("weighted sum", (B, H, S, call.value_dim), dtype, weighted_sum))
    return stages


def fused_steps(call: Call) -> list[str]:
    """The textbook stages a fused kernel does for this call, by their names."""
    steps = ["scaling", "scores"]
    if call.softcap is not None:
        steps.append(f"softcap {call.softcap:.4g}")
    if call.alibi_slopes is not None:
        steps.append("alibi")
    if call.attention_mask is not None or call.is_causal:
        steps.append("mask")
    if call.sinks is not None:
        steps.append("sinks")
    steps.append("softmax")
    if call.dropout_p > 0:
        steps.append("dropout")
    return [*steps, "weighted sum"]


def value_dim_name(call: Call) -> str:
    """``"D"``, or ``"Dv"`` where v has a head dim of its own: how the notes name v's last dimension."""
    return "D" if call.value_dim == call.q.shape[-1] else "Dv"


def scores_shape(call: Call) -> tuple[int, int, int, int]:
    """(B, H, S, Sk): the score matrix a fused kernel does not materialise."""
    B, H, _, S, Sk, _ = call.sizes
    return B, H, S, Sk


def shared_kv(call: Call) -> str:
    """``; H = 8 query heads read Hkv = 2 kv heads, no copy`` for grouped-query calls, else ""."""
    _, H, Hkv, _, _, _ = call.sizes
    return "" if H == Hkv else f"; H = {H} query heads read Hkv = {Hkv} kv heads, no copy"


def fused(call: Call, name: str, how: str, unmaterialised: str) -> KernelStage:
    """One fused stage (B, H, S, Dv): ``"<steps> <how>; <unmaterialised>"``.

    Args:
        call: the call.
        name: the stage's name (the kernel's).
        how: where and how the steps run, e.g. ``"in one Triton kernel"``.
        unmaterialised: what never exists in memory, with its real shape.
    """
    B, H, _, S, _, _ = call.sizes
    note = f"{', '.join(fused_steps(call))} {how}; {unmaterialised}"
    return KernelStage(name, (B, H, S, call.value_dim), call.q.dtype, note, fused=True)

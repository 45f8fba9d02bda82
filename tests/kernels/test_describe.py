"""The kernels' stage descriptions against what the kernels really do.

Kernels hold no trace hooks: explain mode records the stages each kernel declares
(``Kernel.stages``). Here the textbook kernels run inside a trace and under a
``TorchFunctionMode`` that notes the shape and dtype of every tensor their torch calls
return; every described stage must be one of those tensors, each produced after the previous
stage's (a step that returns its input, like dropout with p = 0, shares its tensor), and
the last one must be the returned output. The notes must carry the call's real values.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

import headwise
from headwise import policy
from headwise.kernels import registry

TEXTBOOK = ["matmul", "einsum", "bmm", "einops"]
COPIES_KV = {"matmul", "bmm"}  # the kernels that repeat k, v to H heads for grouped-query attention
B, H, S, D = 2, 4, 5, 8

CASES = {
    "mha": {},
    "gqa": {"kv_heads": 2},
    "mqa-cross": {"kv_heads": 1, "Sk": 7},
    "key-padding": {"mask": "key padding"},
    "float-3d-cross": {"mask": "float 3-D", "Sk": 7},
    "bool-4d-gqa": {"mask": "bool 4-D", "kv_heads": 2},
    "causal-cross": {"causal": True, "Sk": 7},
    "window-gqa": {"window": 2, "Sk": 7, "kv_heads": 2},
    "alibi-padding-causal": {"alibi": True, "mask": "key padding", "causal": True},
    "dropout": {"dropout": 0.3},
    "given-scale": {"scale": 0.3},
    "value-dim-gqa": {"value_dim": 6, "kv_heads": 2, "mask": "key padding"},
    "sinks-cross": {"window": 2, "sink_tokens": 1, "Sk": 7, "value_dim": 3},
    "float64-everything": {"dtype": torch.float64, "kv_heads": 2, "Sk": 7, "mask": "key padding",
                           "causal": True, "alibi": True, "dropout": 0.2, "scale": 0.5, "window": 3},
    "softcap-sinks-gqa-padding": {"softcap": 2.0, "sinks": True, "kv_heads": 2, "mask": "key padding",
                                  "causal": True, "Sk": 7},
    "softcap-alibi-dropout": {"softcap": 0.5, "alibi": True, "dropout": 0.2},
    "sinks-float-3d": {"sinks": True, "mask": "float 3-D"},
}


class Produced(TorchFunctionMode):
    """Notes ``(shape, dtype)`` of every tensor a torch function returns while active, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        pending = [out]
        while pending:
            item = pending.pop(0)
            if isinstance(item, torch.Tensor):
                self.tensors.append((tuple(item.shape), item.dtype))
            elif isinstance(item, (tuple, list)):
                pending[:0] = list(item)
        return out


def capture(monkeypatch, name: str) -> dict:
    """Swap kernel ``name`` in the registry for one that runs it under :class:`Produced`."""
    kernel = registry.get_kernel(name)
    seen: dict = {}

    def fn(q, k, v, **kwargs):
        with Produced() as produced:
            result = kernel.fn(q, k, v, **kwargs)
        seen.update(tensors=produced.tensors, out=result.out)
        return result

    monkeypatch.setitem(registry._KERNELS, name, dataclasses.replace(kernel, fn=fn))
    return seen


def inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """q, k, v, the mask and attention()'s keyword arguments for one case."""
    gen = torch.Generator().manual_seed(0)
    dtype, Hkv, Sk = case.get("dtype", torch.float32), case.get("kv_heads", H), case.get("Sk", S)
    q = torch.randn(B, H, S, D, generator=gen, dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=dtype)
    v = torch.randn(B, Hkv, Sk, case.get("value_dim", D), generator=gen, dtype=dtype)
    mask = {
        None: None,
        "key padding": headwise.masks.key_padding_mask([Sk, 3], Sk),  # (B, Sk)
        "float 3-D": torch.randn(B, S, Sk, generator=gen, dtype=dtype),  # (B, S, Sk) additive
        "bool 4-D": torch.rand(1, H, S, Sk, generator=gen) > 0.3,  # (1, H, S, Sk)
    }[case.get("mask")]
    kwargs = {"is_causal": case.get("causal", False), "dropout_p": case.get("dropout", 0.0),
              "window": case.get("window"), "scale": case.get("scale"), "sink_tokens": case.get("sink_tokens", 0)}
    if case.get("alibi"):
        kwargs["alibi_slopes"] = headwise.masks.alibi_slopes(H).to(dtype)
    if case.get("softcap"):
        kwargs["softcap"] = case["softcap"]
    if case.get("sinks"):
        kwargs["sinks"] = torch.linspace(-1.0, 2.0, H, dtype=dtype)
    return q, k, v, mask, kwargs


def expected_names(name: str, case: dict) -> list[str]:
    """The textbook stage names, worked out from the case (not from the descriptions)."""
    copies = ["repeat kv heads"] if name in COPIES_KV and case.get("kv_heads", H) != H else []
    alibi = ["alibi"] if case.get("alibi") else []
    softcap = ["softcap"] if case.get("softcap") else []
    sinks = ["sinks"] if case.get("sinks") else []
    return [*copies, "scaling", "scores", *softcap, *alibi, "mask", *sinks, "softmax", "dropout", "weighted sum"]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("name", TEXTBOOK)
def test_every_described_stage_is_a_tensor_the_kernel_produced(monkeypatch, name, case):
    seen = capture(monkeypatch, name)
    q, k, v, mask, kwargs = inputs(case)
    with headwise.trace() as t:
        out = headwise.attention(q, k, v, mask, backend=name, **kwargs)
    stages = t.stages[t.names().index("kernel") + 1:]
    assert [s.name for s in stages] == expected_names(name, case)
    produced = seen["tensors"]
    # Steps that return their input: no mask and no causal rule, dropout p = 0.
    identities = {"mask"} if mask is None and not (kwargs["is_causal"] or kwargs["window"]) else set()
    identities |= {"dropout"} if kwargs["dropout_p"] == 0 else set()
    j = -1
    for s in stages:
        j += s.name not in identities  # each other stage is a tensor produced after the previous stage's
        while j < len(produced) and produced[j] != (s.shape, s.dtype):
            j += 1
        assert j < len(produced), (
            f"{name}: stage {s.name!r} {s.shape} {s.dtype} is no tensor the kernel produced after the "
            f"previous stage; it produced {produced}")
    assert seen["out"] is out
    assert (stages[-1].shape, stages[-1].dtype) == (tuple(out.shape), out.dtype) == (produced[-1])


@pytest.mark.parametrize("name", TEXTBOOK)
def test_the_capture_sees_a_wrong_description(monkeypatch, name):
    """The check above can fail: a stage with the key and query lengths swapped is caught."""
    seen = capture(monkeypatch, name)
    q, k, v, mask, kwargs = inputs(CASES["causal-cross"])
    with headwise.trace() as t:
        headwise.attention(q, k, v, mask, backend=name, **kwargs)
    scores = next(s for s in t.stages if s.name == "scores")
    swapped = (*scores.shape[:2], scores.shape[3], scores.shape[2])  # (B, H, Sk, S)
    assert (scores.shape, scores.dtype) in seen["tensors"]
    assert (swapped, scores.dtype) not in seen["tensors"]


def _notes(name: str, case: dict) -> dict[str, str]:
    q, k, v, mask, kwargs = inputs(case)
    with headwise.trace() as t:
        headwise.attention(q, k, v, mask, backend=name, **kwargs)
    return {s.name: s.note for s in t.stages}


@pytest.mark.parametrize("name", TEXTBOOK)
def test_the_scaling_note_is_the_scale_used_and_where_it_came_from(name):
    assert _notes(name, {})["scaling"] == f"q x {D ** -0.5:.4g} = 1 / sqrt(D), D = {D}, before the product"
    assert _notes(name, {"scale": 0.3})["scaling"] == "q x 0.3 (given scale=), before the product"


@pytest.mark.parametrize("name", TEXTBOOK)
def test_the_mask_note_names_the_real_mask_and_how_it_broadcasts(name):
    assert _notes(name, {})["mask"] == "no mask: every key visible"
    assert _notes(name, {"mask": "key padding"})["mask"] == (
        f"masked_fill(~mask, -inf), mask ({B}, 1, 1, {S}) broadcast over H, S to ({B}, {H}, {S}, {S})")
    assert _notes(name, {"mask": "float 3-D", "Sk": 7})["mask"] == (
        f"+ float mask (-inf blocks), mask ({B}, 1, {S}, 7) broadcast over H to ({B}, {H}, {S}, 7)")
    assert _notes(name, {"mask": "bool 4-D", "causal": True, "Sk": 7})["mask"] == (
        f"masked_fill(~mask, -inf), mask (1, {H}, {S}, 7) broadcast over B to ({B}, {H}, {S}, 7); "
        "causal: key j <= i + 2")
    assert _notes(name, {"window": 2, "Sk": 4})["mask"] == "causal window 2: i - 3 < j <= i - 1"


@pytest.mark.parametrize("name", TEXTBOOK)
def test_grouped_query_notes_say_who_copies(name):
    notes = _notes(name, {"kv_heads": 2})
    if name in COPIES_KV:
        assert notes["repeat kv heads"].startswith(
            "k, v.repeat_interleave(2, dim=1): (B, Hkv, Sk, D) -> (B, H, Sk, D), 2 -> 4 heads, a copy")
    else:
        assert "repeat kv heads" not in notes
    if name == "einsum":
        assert "G = H // Hkv = 2 query heads share each kv head, no copy" in notes["scores"]
    if name == "einops":
        assert "with g = 2," in notes["scores"]


def test_alibi_and_dropout_notes_carry_their_values():
    notes = _notes("matmul", {"alibi": True, "dropout": 0.25, "Sk": 7})
    assert notes["alibi"] == (f"+ -slope_h * |i + 2 - j|, slopes 0.25 (head 0) to 0.00391 (head 3): "
                              f"a (1, H, S, Sk) = (1, {H}, {S}, 7) bias")
    assert notes["dropout"] == "p = 0.25: zero weights at random, scale the rest by 1/(1-p) = 1.333"
    assert notes["softmax"] == "softmax over Sk = 7 keys; a row with nothing to attend -> zeros, not NaN"


def test_softcap_and_sinks_notes_carry_their_values():
    notes = _notes("matmul", {"softcap": 2.0, "sinks": True, "Sk": 7})
    assert notes["softcap"] == "softcap * tanh(scores / softcap), softcap = 2: every score squashed into (-2, 2)"
    assert notes["sinks"] == ("one sink column per head appended as key 7, sink logits -1 (head 0) to 2 (head 3): "
                              "(B, H, S, Sk + 1)")
    assert notes["softmax"] == ("softmax over Sk + 1 = 8 columns, the sink column dropped after it: each row sums "
                                "to 1 - p(sink); a row with nothing else to attend -> zeros")


# Fused kernels: one stage that names what it fused and what it never materialised.

def _fused(name: str, q, k, v, mask=None, **kwargs):
    with headwise.trace() as t:
        out = headwise.attention(q, k, v, mask, backend=name, **kwargs)
    (stage,) = [s for s in t.stages if s.fused]
    assert t.stages[-1] is stage and stage.shape == tuple(out.shape) and stage.dtype == out.dtype
    return stage


def test_chunked_names_its_real_tiles(monkeypatch):
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 2)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 2)
    q, k, v, _, _ = inputs({"kv_heads": 2, "Sk": S})
    stage = _fused("chunked", q.half(), k.half(), v.half(), is_causal=True)
    assert stage.name == "chunked" and stage.dtype == torch.float16
    assert stage.note == (
        "scaling, scores, mask, softmax, weighted sum tile by tile with a running max and sum: 6 of 9 tiles of up "
        "to 2 queries x 2 keys (tiles the rules block entirely are skipped); H = 4 query heads read "
        f"Hkv = 2 kv heads, no copy; accumulated in float32; scores ({B}, {H}, {S}, {S}) not materialised, "
        f"one (B, Hkv, G, bq, bk) = ({B}, 2, 2, 2, 2) tile at a time")


def test_chunked_lists_only_the_steps_it_did():
    q, k, v, _, _ = inputs({})
    note = _fused("chunked", q, k, v, dropout_p=0.1, alibi_slopes=headwise.masks.alibi_slopes(H)).note
    assert note.startswith("scaling, scores, alibi, softmax, dropout, weighted sum tile by tile")
    assert "1 of 1 tiles" in note and f"scores ({B}, {H}, {S}, {S}) not materialised" in note


def test_fused_kernels_name_softcap_and_sinks():
    q, k, v, _, _ = inputs({"kv_heads": 2})
    sinks = torch.zeros(H)
    chunked = _fused("chunked", q, k, v, is_causal=True, softcap=30.0, sinks=sinks).note
    assert chunked.startswith("scaling, scores, softcap 30, mask, sinks, softmax, weighted sum tile by tile")
    sdpa = _fused("sdpa", q, k, v, is_causal=True, sinks=sinks).note
    assert sdpa.startswith("scaling, scores, mask, sinks, softmax, weighted sum in F.scaled_dot_product_attention "
                           f"with one (1, {H}, {S}, {S + 1}) float32 mask")
    assert f"the sink logits as the column of one appended zero key and value, Sk + 1 = {S + 1}" in sdpa
    varlen = _fused("varlen", q, k, v, headwise.masks.key_padding_mask([5, 2], 5), sinks=sinks).note
    assert "mask, sinks, softmax" in varlen and "the sink logits as one appended zero key per call" in varlen


def test_varlen_names_its_groups_and_the_keys_it_kept():
    q, k, v, _, _ = inputs({"Sk": 7})
    stage = _fused("varlen", q, k, v, headwise.masks.key_padding_mask([7, 2], 7))
    assert stage.note == (
        "scaling, scores, mask, softmax, weighted sum per group of rows with similar real-key counts: "
        f"2 F.scaled_dot_product_attention calls on 9 of 14 keys, the widest 7 keys; "
        f"the dense scores ({B}, {H}, {S}, 7) never exist")
    nothing = _fused("varlen", q, k, v, torch.zeros(B, 7, dtype=torch.bool))
    assert nothing.note == "no real key in any row: zeros"
    assert _fused("varlen", q, k, v).name == "sdpa"  # without a mask varlen hands the call to sdpa

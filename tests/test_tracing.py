"""Explain mode's trace: every stage, for every backend and configuration."""

from __future__ import annotations

import threading

import pytest
import torch

import headwise
from headwise import tracing as trace_module

BACKENDS = headwise.available_backends()
MODULE_STAGES = ["input", "q projection", "k projection", "v projection", "split heads q",
                 "split heads k, v"]
TEXTBOOK_STAGES = ["scaling", "scores", "mask", "softmax", "dropout", "weighted sum"]
TAIL = ["merge heads", "output projection"]


def _run(backend, *, kv_heads=None, context=False, causal=False, mask=True, dropout=0.0):
    B, S, Sk, E, H = 3, 4, 6, 32, 4
    mha = headwise.MultiHeadAttention(E, H, dropout, num_kv_heads=kv_heads, backend=backend)
    x = torch.randn(B, S, E)
    ctx = torch.randn(B, Sk, E) if context else None
    keys = Sk if context else S
    m = headwise.masks.key_padding_mask([keys, 2, 1], keys) if mask else None
    with headwise.trace() as t:
        out = mha(x, m, context=ctx, is_causal=causal)
    return t, out


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "varlen"])  # varlen: test below
@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("context", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_stage_is_recorded_in_order(backend, kv_heads, context, causal):
    t, out = _run(backend, kv_heads=kv_heads, context=context, causal=causal)
    names = t.names()
    kernel = headwise.kernels.get_kernel(backend)
    middle = [backend] if kernel.fused else TEXTBOOK_STAGES
    copies = ["repeat kv heads"] if kv_heads and not kernel.native_gqa else []
    zeroed = [] if context else ["zero padding"]  # a (B, S) self-attention mask marks padded queries
    assert names == MODULE_STAGES + ["mask layout", "kernel"] + copies + middle + TAIL + zeroed
    fused = [s for s in t.stages if s.fused]
    assert [s.name for s in fused] == ([backend] if kernel.fused else [])
    assert t.stages[-1].shape == tuple(out.shape)
    assert all(isinstance(s.shape, tuple) and s.note for s in t.stages)


def test_shapes_and_notes_follow_the_document():
    t, _ = _run("matmul", context=True)
    by_name = {s.name: s for s in t.stages}
    assert by_name["input"].shape == (3, 4, 32)
    assert by_name["k projection"].shape == (3, 6, 32)  # keys come from the context
    assert by_name["k projection"].note == "k_proj(context): (B, Sk, E) x (Hkv*D, E)^T + b"
    assert by_name["v projection"].note == "v_proj(context): (B, Sk, E) x (Hkv*D, E)^T + b"
    assert by_name["q projection"].note == "q_proj(x): (B, S, E) x (E, E)^T + b"
    assert by_name["split heads q"].shape == (3, 4, 4, 8)  # (B, H, S, D)
    assert by_name["scores"].shape == (3, 4, 4, 6)  # (B, H, S, Sk)
    assert "(B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)" in by_name["scores"].note
    assert "0.3536" in by_name["scaling"].note and "1 / sqrt(D)" in by_name["scaling"].note  # 1 / sqrt(8)
    assert by_name["scaling"].shape == (3, 4, 4, 8)  # q, scaled before the product
    assert by_name["mask layout"].shape == (3, 1, 1, 6)
    assert by_name["weighted sum"].shape == (3, 4, 4, 8)
    assert by_name["merge heads"].shape == (3, 4, 32)
    assert all(s.dtype == torch.float32 for s in t.stages if s.name != "mask layout")


def test_scaling_note_names_a_given_scale():
    q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    with headwise.trace() as t:
        headwise.attention(q, q, q, scale=0.5, backend="matmul")
    note = {s.name: s for s in t.stages}["scaling"].note
    assert "0.5" in note and "given scale=" in note and "sqrt" not in note


def test_dropout_stage_names_its_probability():
    t, _ = _run("matmul", dropout=0.25)
    assert "p = 0.25" in next(s.note for s in t.stages if s.name == "dropout")


def test_functional_calls_are_numbered_and_table_renders():
    q = torch.randn(1, 2, 3, 4)
    with headwise.trace() as t:
        headwise.attention(q, q, q, backend="einsum")
        headwise.attention(q, q, q, is_causal=True, backend="sdpa")
    assert {s.call for s in t.stages} == {0, 1}
    text = str(t)
    assert "scores" in text and "sdpa (fused)" in text and "(1, 2, 3, 3)" in text


def test_no_recording_outside_a_block_and_blocks_nest():
    q = torch.randn(1, 2, 3, 4)
    assert trace_module.ACTIVE == 0
    headwise.attention(q, q, q)
    with headwise.trace() as outer:
        with headwise.trace() as inner:
            headwise.attention(q, q, q, backend="matmul")
        headwise.attention(q, q, q, backend="sdpa")
    assert trace_module.ACTIVE == 0
    assert "scores" in inner.names() and "scores" not in outer.names()
    assert outer.names() == ["kernel", "sdpa"]


def test_other_threads_do_not_write_into_this_trace():
    q = torch.randn(1, 2, 3, 4)
    seen = []

    def elsewhere():
        headwise.attention(q, q, q, backend="matmul")
        seen.append(True)

    with headwise.trace() as t:
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
    assert seen and t.stages == []


def test_hooks_only_read_the_active_counter_when_idle(monkeypatch):
    """Outside a block, no stage is built: record() is never called."""
    calls = []
    monkeypatch.setattr(trace_module, "record", lambda *a, **k: calls.append(a))
    mha = headwise.MultiHeadAttention(16, 2, backend="matmul")
    mha(torch.randn(2, 3, 16), torch.ones(2, 3, dtype=torch.bool))
    assert calls == []


@pytest.mark.parametrize("packing", [True, "auto"])
def test_packed_path_is_traced_as_such(packing):
    mha = headwise.MultiHeadAttention(32, 4, num_kv_heads=2, packing=packing)
    x = torch.randn(3, 6, 32)
    mask = headwise.masks.key_padding_mask([6, 2, 1], 6)  # half the batch is padding: auto packs
    with headwise.trace() as t:
        mha(x, mask)
    shapes = {s.name: s.shape for s in t.stages}
    assert t.names()[:2] == ["input", "pack"] and t.names()[-3:] == ["merge heads", "output projection", "unpack"]
    assert shapes["input"] == (3, 6, 32) and shapes["unpack"] == (3, 6, 32)
    T = 9  # 6 + 2 + 1 real tokens, no padding
    assert (shapes["pack"], shapes["q projection"], shapes["k projection"], shapes["v projection"]) == (
        (T, 32), (T, 32), (T, 16), (T, 16))
    assert (shapes["split heads q"], shapes["split heads k, v"]) == ((T, 4, 8), (T, 2, 8))
    assert shapes["merge heads"] == (T, 32) and shapes["output projection"] == (T, 32)
    assert "kernel" in t.names()
    assert mha.dispatch(x, mask).path == "packed"


def test_the_documents_example_traces_every_projection_under_default_settings():
    """The first document's batch (3 rows, S=2, E=128, H=8, mask [[1, 1], [1, 0], [1, 0]]: 33% padding)."""
    mha = headwise.MultiHeadAttention(128, 8)
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    with headwise.trace() as t:
        mha(torch.randn(3, 2, 128), mask)
    assert mha.plan(torch.randn(3, 2, 128), mask).path == "packed"
    projections = [s for s in t.stages if s.name.endswith("projection")]
    assert [s.name for s in projections] == ["q projection", "k projection", "v projection", "output projection"]
    assert all(s.shape == (4, 128) for s in projections)  # the 4 real tokens


def test_varlen_kernel_is_one_fused_stage():
    q = torch.randn(2, 2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    with headwise.trace() as t:
        headwise.attention(q, q, q, mask, backend="varlen")
    assert t.names() == ["mask layout", "kernel", "varlen"] and t.stages[-1].fused


def test_forward_packed_records_its_input_and_every_stage():
    mha = headwise.MultiHeadAttention(32, 4)
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))
    with headwise.trace() as t:
        mha.forward_packed(x, torch.tensor([0, 4, 6, 7]))
    by_name = {s.name: s for s in t.stages}
    assert (by_name["input (packed)"].shape, by_name["input (packed)"].note) == (
        (7, 32), "x: (T, E), 3 sequences end to end, no padding")
    assert (by_name["output projection"].shape, by_name["output projection"].note) == (
        (7, 32), "out_proj: (T, E) x (E, E)^T + b, on the real tokens only")
    assert by_name["q projection"].note == "q_proj(x): (T, E) x (E, E)^T + b"


def test_sdpa_notes_say_what_was_fused_and_with_which_mask():
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(2))
    fused = "scores, scaling, mask, softmax, dropout, weighted sum in F.scaled_dot_product_attention"
    notes = []
    for kwargs in ({}, {"is_causal": True}, {"attention_mask": torch.tensor([[1, 1, 0]])},
                   {"alibi_slopes": torch.tensor([0.5, 0.25])}):
        with headwise.trace() as t:
            out = headwise.attention(q, q, q, backend="sdpa", **kwargs)
        (stage,) = [s for s in t.stages if s.name == "sdpa"]
        assert stage.fused and stage.shape == tuple(out.shape)
        notes.append(stage.note)
    assert notes[:2] == [fused, fused + " (causal)"]
    assert notes[2] == (f"{fused} with a (1, 1, 1, 3) bool mask (causal, window, ALiBi folded in); rows with "
                        "nothing to attend zeroed")
    assert notes[3].startswith(f"{fused} with a (1, 2, 3, 3) float32 mask")


def test_rotary_stage_names_its_base_and_first_position():
    mha = headwise.MultiHeadAttention(32, 4, rope_base=500.0)
    with headwise.trace() as t:
        mha(torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(3)))
    (stage,) = [s for s in t.stages if s.name == "rotary positions"]
    assert stage.shape == (1, 4, 3, 8)
    assert stage.note == "rotate q and k pairs (i, i + D/2) by position x 500^(-2i/D), positions from 0"

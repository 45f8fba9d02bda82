"""Explain mode's trace: every stage, for every backend and configuration."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fresh_process
import headwise
from conftest import contract_backends
from headwise import tracing as trace_module
from headwise.kernels import registry

BACKENDS = contract_backends()
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
    assert by_name["input"].note == "x: (B, S, E); context: (B, Sk, E)"
    assert {s.name: s for s in _run("matmul")[0].stages}["input"].note == "x: (B, S, E)"
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


def test_each_thread_records_only_its_own_calls():
    """Two threads trace while a third calls attention untraced, all at the same time."""
    rounds = 5
    barrier = threading.Barrier(3, timeout=30)
    results, errors = {}, []
    gen = torch.Generator().manual_seed(4)
    shapes = {"matmul": (1, 2, 3, 4), "einsum": (2, 4, 5, 8), None: (3, 2, 7, 4)}  # None: the untraced thread
    inputs = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}

    def work(backend):
        try:
            q = inputs[backend]
            if backend is None:  # no trace open in this thread: its calls must land nowhere
                barrier.wait()
                for _ in range(rounds):
                    headwise.attention(q, q, q, backend="matmul")
                    results[None] = trace_module.recording()
                barrier.wait()
                return
            with headwise.trace() as t:
                barrier.wait()  # every thread is inside its block (or running untraced) from here ...
                for _ in range(rounds):
                    headwise.attention(q, q, q, backend=backend)
                barrier.wait()  # ... to here
            results[backend] = t
        except Exception as exc:  # surfaced below: an assertion in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(backend,)) for backend in shapes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert trace_module.ACTIVE == 0 and results[None] is False
    for backend in ("matmul", "einsum"):
        t, (b, h, s, d) = results[backend], shapes[backend]
        assert t.calls == rounds and {st.call for st in t.stages} == set(range(rounds))
        assert t.names() == ["kernel", *TEXTBOOK_STAGES] * rounds
        assert all(st.note == f"backend {backend!r}: requested explicitly" for st in t.stages if st.name == "kernel")
        assert {st.shape for st in t.stages} == {(b, h, s, d), (b, h, s, s)}  # no stage of another thread's shapes


def test_a_trace_entered_in_one_thread_ignores_another_threads_copy_of_its_context():
    """A context copied into a worker (asyncio.to_thread does this) still records nothing there."""
    import contextvars

    q = torch.randn(1, 2, 3, 4)
    with headwise.trace() as t:
        context = contextvars.copy_context()
        worker = threading.Thread(target=context.run, args=(headwise.attention, q, q, q))
        worker.start()
        worker.join()
        assert trace_module.recording()
    assert t.stages == [] and t.calls == 0
    assert not trace_module.recording()


def test_importing_headwise_loads_neither_rich_nor_matplotlib():
    code = ("import sys, torch, headwise; "
            "loaded = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'rich', 'matplotlib'}); "
            "print(loaded()); "
            "t = headwise.trace(); t.__enter__(); "
            "headwise.attention(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4)); "
            "t.__exit__(None, None, None); print(loaded()); "
            "text = str(t); print(loaded(), 'sdpa (fused)' in text)")
    done = fresh_process.run(code=code, timeout=120)  # python -c, forked from a process that imported only torch
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "[]", "['rich'] True"]  # rich only once a trace is printed


def test_a_registered_kernel_without_stages_is_one_opaque_stage(monkeypatch):
    def doubled(q, k, v, **kwargs):
        return 2 * q, None

    monkeypatch.setitem(registry._KERNELS, "doubled", registry.Kernel("doubled", doubled, "a test kernel"))
    q = torch.randn(1, 2, 3, 4)
    with headwise.trace() as t:
        headwise.attention(q, q, q, backend="doubled")
    assert t.names() == ["kernel", "doubled"]
    assert t.stages[-1].note == "backend 'doubled' describes no stages (Kernel.stages); its output"
    assert not t.stages[-1].fused and t.stages[-1].shape == (1, 2, 3, 4)

    def stages(call):
        return [registry.KernelStage("doubling", tuple(call.q.shape), call.q.dtype, f"2 x q, scale {call.scale}")]

    described = dataclasses.replace(registry.get_kernel("doubled"), stages=stages)
    monkeypatch.setitem(registry._KERNELS, "doubled", described)
    with headwise.trace() as t:
        headwise.attention(q, q, q, backend="doubled", scale=0.5)
    assert t.names() == ["kernel", "doubling"] and t.stages[-1].note == "2 x q, scale 0.5"
    assert t.stages[-1].dtype == torch.float32


def test_no_keys_is_recorded_and_no_kernel_runs():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4)
    with headwise.trace() as t:
        out = headwise.attention(q, k, k, backend="matmul")
    assert t.names() == ["kernel", "no keys"] and t.stages[-1].shape == tuple(out.shape)


def test_hooks_only_read_the_active_counter_when_idle(monkeypatch):
    """Outside a block, no stage is built: record() is never called."""
    calls = []
    monkeypatch.setattr(trace_module, "record", lambda *a, **k: calls.append(a))
    mha = headwise.MultiHeadAttention(16, 2, backend="matmul")
    mha(torch.randn(2, 3, 16), torch.ones(2, 3, dtype=torch.bool))
    assert calls == []


@pytest.mark.parametrize("packing", [True, "auto"])
def test_packed_path_is_traced_as_such(packing, cheap_packing):
    mha = headwise.MultiHeadAttention(32, 4, num_kv_heads=2, packing=packing)
    x = torch.randn(3, 6, 32)
    mask = headwise.masks.key_padding_mask([6, 2, 1], 6)  # half the batch is padding: auto packs at cheap costs
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
    plan = mha.plan(torch.randn(3, 2, 128), mask)
    assert plan.path == "dense" and "but forward + backward estimated packed" in plan.why  # 6 positions: too few
    projections = [s for s in t.stages if s.name.endswith("projection")]
    assert [s.name for s in projections] == ["q projection", "k projection", "v projection", "output projection"]
    assert all(s.shape == (3, 2, 128) for s in projections)


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


def test_sdpa_notes_say_what_was_fused_with_which_mask_and_what_never_existed():
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(2))
    sdpa = "in F.scaled_dot_product_attention"
    notes = []
    for kwargs in ({}, {"is_causal": True}, {"attention_mask": torch.tensor([[1, 1, 0]])},
                   {"alibi_slopes": torch.tensor([0.5, 0.25])},
                   {"attention_mask": torch.tensor([[0, 0, 0]]), "window": 2}):
        with headwise.trace() as t:
            out = headwise.attention(q, q, q, backend="sdpa", **kwargs)
        (stage,) = [s for s in t.stages if s.name == "sdpa"]
        assert stage.fused and stage.shape == tuple(out.shape)
        flash = "; scores (1, 2, 3, 3) not materialised (torch's flash attention backend)"
        assert stage.note.endswith(flash)
        notes.append(stage.note.removesuffix(flash))
    assert notes == [
        f"scaling, scores, softmax, weighted sum {sdpa}",
        f"scaling, scores, mask, softmax, weighted sum {sdpa}(is_causal=True)",
        f"scaling, scores, mask, softmax, weighted sum {sdpa} with one (1, 1, 1, 3) bool mask (the caller's mask)",
        f"scaling, scores, alibi, softmax, weighted sum {sdpa} with one (1, 2, 3, 3) float32 mask (ALiBi)",
        f"scaling, scores, mask, softmax, weighted sum {sdpa} with one (1, 1, 3, 3) bool mask (the caller's mask, "
        "causal window 2: i - 2 < j <= i); rows with nothing to attend unblocked for the call and zeroed after it",
    ]


def test_sdpa_note_follows_the_backend_torch_picks():
    q = torch.randn(2, 4, 3, 8, generator=torch.Generator().manual_seed(5))
    k = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(6))
    with headwise.trace() as t, sdpa_kernel(SDPBackend.MATH):
        headwise.attention(q, k, k, backend="sdpa", dropout_p=0.1)
    assert t.stages[-1].note == (
        "scaling, scores, softmax, dropout, weighted sum in F.scaled_dot_product_attention; H = 4 query heads read "
        "Hkv = 2 kv heads, no copy (enable_gqa); scores (2, 4, 3, 5) materialised inside torch's math backend")


def test_varlen_note_without_a_mask_is_sdpas():
    q = torch.randn(1, 2, 3, 4)
    with headwise.trace() as t:
        headwise.attention(q, q, q, backend="varlen", is_causal=True)
    assert t.names() == ["kernel", "sdpa"] and "(is_causal=True)" in t.stages[-1].note


def test_rotary_stage_names_its_base_and_first_position():
    mha = headwise.MultiHeadAttention(32, 4, rope_base=500.0)
    with headwise.trace() as t:
        mha(torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(3)))
    (stage,) = [s for s in t.stages if s.name == "rotary positions"]
    assert stage.shape == (1, 4, 3, 8)
    assert stage.note == "rotate q and k pairs (i, i + D/2) by position x 500^(-2i/D), positions from 0"


def test_q_k_norm_stage_and_the_rotary_stage_naming_its_scaling():
    mha = headwise.MultiHeadAttention(32, 4, qk_norm="rms", rotary_dim=4, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 500.0})
    x = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(3))
    for packing in (False, True):
        mha.packing = packing
        with headwise.trace() as t:
            mha(x, torch.tensor([[1, 1, 0]]))
        names = t.names()
        assert names.index("split heads k, v") + 1 == names.index("q/k norm") == names.index("rotary positions") - 1
        (norm,) = [s for s in t.stages if s.name == "q/k norm"]
        assert norm.shape == ((2, 4, 8) if packing else (1, 4, 3, 8))  # packed: the 2 real tokens
        assert norm.note == ("RMSNorm of each head's q and k over D = 8 (x / sqrt(mean(x^2) + 1e-06) x "
                             "q_norm.weight / k_norm.weight), before rotary")
        (rotary,) = [s for s in t.stages if s.name == "rotary positions"]
        assert rotary.note.startswith(
            "rotate the first 4 of 8 dims of q and k, pairs (i, i + 2), by position x 500^(-2i/4); dims 4..8 pass "
            "through; yarn scaling (factor=4, original_max_position_embeddings=16); cos and sin x attention factor "
            "1.13863, ")

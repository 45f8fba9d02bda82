"""Tests for ``headwise.recognise``: a plain mask_mod is read as the helpers it equals only where
that is proven on the call's grid, and then runs (forward and backward) on every backend as the
float64 reference says; near misses run as given.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import headwise
from headwise import masks, policy
from headwise.evaluate import evaluate_mask
from headwise.masks import AlignedCausal, Document
from headwise.recognise import Recognised, recognise

B, H, Hkv, D = 2, 4, 2, 8
CPU = torch.device("cpu")
DOC = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2])
ROWS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])

PROVEN = {  # name: (rule, the helpers' types, their windows)
    "document-causal": (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv), (Document, AlignedCausal), None),
    "document": (lambda b, h, q, kv: DOC[q] == DOC[kv], (Document,), None),
    "document-window": (lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (kv <= q) & (q - kv < 3),
                        (Document, AlignedCausal), 3),
    "per-row documents": (lambda b, h, q, kv: (ROWS[b, q] == ROWS[b, kv]) & (kv <= q), (Document, AlignedCausal), None),
    "causal": (lambda b, h, q, kv: kv <= q, (AlignedCausal,), None),
    "sliding window": (lambda b, h, q, kv: torch.logical_and(q >= kv, q - kv <= 1), (AlignedCausal,), 2),
    "helper and lambda": (masks.and_masks(masks.causal, lambda b, h, q, kv: DOC[q] == DOC[kv]),
                          (Document, AlignedCausal), None),
}


@pytest.mark.parametrize("name", PROVEN)
def test_a_plain_rule_is_read_as_the_helpers_it_equals(name):
    mod, kinds, window = PROVEN[name]
    read = recognise(mod, B, H, 12, 12, CPU)
    assert isinstance(read, Recognised)
    assert sorted(type(p).__name__ for p in read.mods) == sorted(k.__name__ for k in kinds)
    assert all(p.window == window for p in read.mods if isinstance(p, AlignedCausal))
    want = evaluate_mask(mod, B, H, (0, 12), (0, 12), None).expand(B, H, 12, 12)
    assert torch.equal(evaluate_mask(read, B, H, (0, 12), (0, 12), None).expand(B, H, 12, 12), want)
    assert "proven equal to" in repr(read)


def _flip(b, h, q, kv):
    """Document-causal but for one pair: a near miss the probes cannot see."""
    return ((DOC[q] == DOC[kv]) & (q >= kv)) ^ ((q == 10) & (kv == 8))


NOT_PROVEN = {
    "one pair differs": _flip,
    "a document comes back": lambda b, h, q, kv: torch.tensor([0, 0, 1, 1, 0, 0, 2, 2, 2, 0, 0, 0])[q] ==
    torch.tensor([0, 0, 1, 1, 0, 0, 2, 2, 2, 0, 0, 0])[kv],
    "per head": lambda b, h, q, kv: (kv <= q) & (q - kv <= h),
    "prefix-lm": lambda b, h, q, kv: (kv < 4) | (kv <= q),
    "a row that attends nothing": lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (kv < q),
    "opaque": lambda b, h, q, kv: DOC[q].float() == DOC[kv].float(),
    "a window per document end": lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (kv <= q) & (q - kv < 1 + DOC[q]),
}


@pytest.mark.parametrize("name", NOT_PROVEN)
def test_what_is_not_proven_is_left_as_given(name):
    assert recognise(NOT_PROVEN[name], B, H, 12, 12, CPU) is None


def test_a_tile_map_of_a_plain_rule_is_read_as_its_helpers():
    from headwise.masks import tile_map
    from headwise.recognise import read

    mod = PROVEN["document-causal"][0]
    assert isinstance(read(tile_map(mod, 1, 1, 12, 12, block=(4, 4)), 1, 1, 12, 12, CPU), Recognised)
    assert read(tile_map(NOT_PROVEN["prefix-lm"], 1, 1, 12, 12), 1, 1, 12, 12, CPU) is None  # the map stays


def test_cross_attention_lengths_and_helpers_are_left_as_given():
    assert recognise(PROVEN["causal"][0], B, H, 12, 14, CPU) is None  # S != Sk
    assert recognise(masks.and_masks(masks.causal, masks.document(DOC)), B, H, 12, 12, CPU) is None


def test_auto_runs_a_plain_document_rule_where_it_runs_the_helpers():
    q, k, v = (torch.randn(1, H, 12, D) for _ in range(3))
    helper = headwise.choose_backend(q, k, v, mask_mod=masks.and_masks(masks.causal, masks.document(DOC)))
    plain = headwise.choose_backend(q, k, v, mask_mod=PROVEN["document-causal"][0])
    assert plain.backend == helper.backend == "varlen"
    assert plain.reason == helper.reason


def test_a_document_edited_in_place_is_read_anew():
    doc = DOC.clone()
    mod = lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)  # noqa: E731
    first = recognise(mod, 1, 1, 12, 12, CPU)
    doc[3:7] = 0  # documents 0 and 1 merge
    second = recognise(mod, 1, 1, 12, 12, CPU)
    ids = next(p for p in second.mods if isinstance(p, Document)).ids
    assert torch.equal(ids[0], torch.tensor([0] * 7 + [1] * 5))
    assert not torch.equal(ids, next(p for p in first.mods if isinstance(p, Document)).ids)


PLAIN = {
    "document-causal": lambda b, h, q, kv: (ROWS[b, q] == ROWS[b, kv]) & (q >= kv),
    "document": lambda b, h, q, kv: DOC[q] == DOC[kv],
    "sliding window": lambda b, h, q, kv: (kv <= q) & (q - kv < 3),
    "prefix-lm": lambda b, h, q, kv: (kv < torch.tensor([3, 6])[b]) | (kv <= q),
}
BACKENDS = ["matmul", "einsum", "bmm", "einops", "sdpa", "chunked", "varlen", "auto"]


@pytest.fixture
def small_tiles(monkeypatch):
    """4 x 4 tiles, so the 12 x 12 grids have empty, full and partial ones."""
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 4)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 4)


@pytest.mark.parametrize("case", PLAIN)
@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_rules_on_every_backend_equal_the_reference(backend, case, small_tiles, ref):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, 12, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, Hkv, 12, D, generator=gen, requires_grad=True) for _ in range(2))
    out = headwise.attention(q, k, v, mask_mod=PLAIN[case], backend=backend)
    want, _ = ref(q, k, v, mask_mod=PLAIN[case])
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    g = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), g)
    expected = torch.autograd.grad(want, (q, k, v), g.double())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["varlen", "auto"])
def test_on_the_document_path_another_documents_nan_reaches_nothing(backend, small_tiles):
    """Read as documents, the rule attends each on its own: NaN in the keys and values of
    document 2 reaches neither the rows of documents 0 and 1 nor their gradients (more than
    the contract asks, which is only for keys no query attends; tests/test_rules.py checks that
    one with plain rules)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, H, 12, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, H, 12, D, generator=gen) for _ in range(2))
    k[:, :, 7:], v[:, :, 7:] = float("nan"), float("inf")
    k.requires_grad_(True)
    v.requires_grad_(True)
    rule = PROVEN["document-causal"][0]
    out = headwise.attention(q, k, v, mask_mod=rule, backend=backend)
    assert torch.isfinite(out[:, :, :7]).all()
    gq, gk, gv = torch.autograd.grad(out[:, :, :7].sum(), (q, k, v))
    assert all(torch.isfinite(g[:, :, :7]).all() for g in (gq, gk, gv))
    clean = headwise.attention(q, k.detach()[:, :, :7], v.detach()[:, :, :7], mask_mod=rule, backend="matmul")
    torch.testing.assert_close(out[:, :, :7], clean[:, :, :7])


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 40), docs=st.integers(1, 6), seed=st.integers(0, 999), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 12)), sort=st.booleans(), flip=st.booleans(),
       per_row=st.booleans())
def test_random_document_rules_are_read_only_as_what_they_are(S, docs, seed, causal, window, sort, flip, per_row):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, docs, (2, S), generator=gen)
    ids = torch.sort(ids, dim=1).values if sort else ids
    at = torch.randint(0, S, (2,), generator=gen).tolist()
    window = window if causal else None

    def mod(b, h, q, kv):
        same = (ids[b, q] == ids[b, kv]) if per_row else (ids[0][q] == ids[0][kv])
        if causal:
            same = same & (kv <= q)
        if window is not None:
            same = same & (q - kv < window)
        return same ^ ((q == at[0]) & (kv == at[1])) if flip else same

    read = recognise(mod, 2, 1, S, S, CPU)
    want = evaluate_mask(mod, 2, 1, (0, S), (0, S), None).expand(2, 1, S, S)
    if read is not None:  # sound: read as helpers only where they are equal on every pair
        assert torch.equal(evaluate_mask(read, 2, 1, (0, S), (0, S), None).expand(2, 1, S, S), want)
    rows = ids[: 2 if per_row else 1]
    some_rule = causal or any(row.unique().numel() > 1 for row in rows)  # everything allowed: no helper to read
    if sort and not flip and some_rule:  # complete: the plain forms of the helpers are read
        assert read is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_a_plain_rule_hides_from_every_query_reaches_nothing(backend, small_tiles, ref):
    """A plain rule that is traced but not read as helpers (prefix-LM with a hidden key): NaN and
    inf at the key no query may attend reach neither the output nor the gradients."""
    gen = torch.Generator().manual_seed(5)
    rule = lambda b, h, q, kv: ((kv < 4) | (kv <= q)) & (kv != 6)  # noqa: E731
    q = torch.randn(B, H, 12, D, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, Hkv, 12, D, generator=gen) for _ in range(2))
    k[:, :, 6], v[:, :, 6] = float("nan"), float("inf")
    k.requires_grad_(True)
    v.requires_grad_(True)
    out = headwise.attention(q, k, v, mask_mod=rule, backend=backend)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    clean_k, clean_v = k.detach().clone(), v.detach().clone()
    clean_k[:, :, 6], clean_v[:, :, 6] = 0.0, 0.0
    want, _ = ref(q, clean_k, clean_v, mask_mod=rule)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)

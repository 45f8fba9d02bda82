"""Tests for ``headwise.intervals``: the tiles of a traced plain mask_mod, classified from their
bounds, equal the tiles of evaluating every pair; opaque rules are left to that evaluation;
the cache never serves a map whose captured tensors changed.

Legend: B batch, H query heads, S query length, Sk key length, bq / bk the tile.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headwise import intervals, symbolic
from headwise.evaluate import evaluated_tile_states, mask_tile_states
from headwise.tiles import Bounds


def _ids(draw_seed: int, n: int, docs: int, sort: bool) -> torch.Tensor:
    ids = torch.randint(0, docs, (n,), generator=torch.Generator().manual_seed(draw_seed))
    return torch.sort(ids).values if sort else ids


@st.composite
def integers(draw, depth: int, tensors: dict):
    """A random integer expression of the supported ops, as a function of (b, h, q, kv)."""
    leaf = st.sampled_from(["b", "h", "q", "kv", "const"])
    if depth == 0 or draw(st.booleans()):
        name = draw(leaf)
        if name == "const":
            c = draw(st.integers(-20, 40))
            return lambda b, h, q, kv: c
        return lambda b, h, q, kv, n=name: {"b": b, "h": h, "q": q, "kv": kv}[n]
    op = draw(st.sampled_from(["add", "sub", "mul", "floordiv", "mod", "abs", "min", "max", "doc", "rows",
                               "where", "clamp"]))
    x = draw(integers(depth - 1, tensors))
    if op in ("doc", "rows"):  # a captured tensor at a position kept in range by clamping
        t = tensors[op]
        at = lambda b, h, q, kv: torch.clamp(torch.as_tensor(x(b, h, q, kv)), min=0, max=t.shape[-1] - 1)  # noqa: E731
        if op == "doc":
            return lambda b, h, q, kv: t[at(b, h, q, kv)]
        return lambda b, h, q, kv: t[torch.clamp(b, max=t.shape[0] - 1), at(b, h, q, kv)]
    if op in ("floordiv", "mod"):
        c = draw(st.integers(1, 7)) * (draw(st.sampled_from([1, -1])) if op == "floordiv" else 1)
        if op == "floordiv":
            return lambda b, h, q, kv: x(b, h, q, kv) // c
        return lambda b, h, q, kv: x(b, h, q, kv) % c
    if op == "abs":
        return lambda b, h, q, kv: torch.abs(torch.as_tensor(x(b, h, q, kv)))
    if op == "clamp":
        lo = draw(st.integers(-5, 10))
        return lambda b, h, q, kv: torch.clamp(torch.as_tensor(x(b, h, q, kv)), min=lo, max=lo + 6)
    y = draw(integers(depth - 1, tensors))
    if op == "where":
        c = draw(booleans(depth - 1, tensors))
        return lambda b, h, q, kv: torch.where(c(b, h, q, kv), torch.as_tensor(x(b, h, q, kv)), y(b, h, q, kv))
    fn = {"add": lambda a, b_: a + b_, "sub": lambda a, b_: a - b_, "mul": lambda a, b_: a * b_,
          "min": lambda a, b_: torch.minimum(torch.as_tensor(a), torch.as_tensor(b_)),
          "max": lambda a, b_: torch.maximum(torch.as_tensor(a), torch.as_tensor(b_))}[op]
    return lambda b, h, q, kv: fn(x(b, h, q, kv), y(b, h, q, kv))


@st.composite
def booleans(draw, depth: int, tensors: dict):
    """A random bool expression: comparisons of integer expressions, composed with & | ^ ~."""
    if depth == 0 or draw(st.booleans()):
        cmp = draw(st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"]))
        x, y = draw(integers(depth, tensors)), draw(integers(depth, tensors))
        op = getattr(torch, cmp)
        return lambda b, h, q, kv: op(torch.as_tensor(x(b, h, q, kv)), y(b, h, q, kv))
    how = draw(st.sampled_from(["and", "or", "xor", "not"]))
    x = draw(booleans(depth - 1, tensors))
    if how == "not":
        return lambda b, h, q, kv: ~x(b, h, q, kv)
    y = draw(booleans(depth - 1, tensors))
    return {"and": lambda b, h, q, kv: x(b, h, q, kv) & y(b, h, q, kv),
            "or": lambda b, h, q, kv: x(b, h, q, kv) | y(b, h, q, kv),
            "xor": lambda b, h, q, kv: x(b, h, q, kv) ^ y(b, h, q, kv)}[how]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), S=st.integers(1, 70), Sk=st.integers(1, 70), bq=st.integers(1, 40), bk=st.integers(1, 40),
       B=st.integers(1, 3), H=st.integers(1, 3), seed=st.integers(0, 99), sort=st.booleans())
def test_random_plain_rules_get_the_tiles_of_evaluating_every_pair(data, S, Sk, bq, bk, B, H, seed, sort):
    tensors = {"doc": _ids(seed, max(S, Sk), 1 + seed % 5, sort),
               "rows": torch.stack([_ids(seed + r, max(S, Sk), 1 + seed % 5, sort) for r in range(B)])}
    mod = data.draw(booleans(3, tensors))
    bounds = Bounds(S, Sk, bq, bk)
    got = intervals.tile_states(mod, bounds, B, H)
    want = evaluated_tile_states(mod, bounds, B, H)
    assert got is not None  # every op drawn is one the tracer reads
    assert torch.equal(got.expand(B, H, *got.shape[2:]), want.expand(B, H, *want.shape[2:]))


def _doc_causal(doc):
    return lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)


@pytest.mark.parametrize("S", [1, 100, 1000, 1037])
@pytest.mark.parametrize("docs", [1, 3, 16])
def test_document_causal_tiles_are_exact_at_any_length(S, docs):
    doc = torch.sort(torch.randint(0, docs, (S,), generator=torch.Generator().manual_seed(S))).values
    bounds = Bounds(S, S, 128, 64)
    got = intervals.tile_states(_doc_causal(doc), bounds, 2, 4)
    assert torch.equal(got, evaluated_tile_states(_doc_causal(doc), bounds, 2, 4))


@pytest.mark.parametrize("large", [False, True], ids=["compared-by-value", "compared-by-version"])
def test_a_captured_tensor_changed_in_place_is_a_cache_miss(large, monkeypatch):
    if large:  # every captured tensor counts as large: identity and version counter, not a copy
        monkeypatch.setattr(symbolic, "COPY_MAX", 0)
    doc = torch.tensor([0] * 40 + [1] * 40 + [2] * 48)
    mod, bounds = _doc_causal(doc), Bounds(128, 128, 16, 16)
    first = intervals.tile_states(mod, bounds, 1, 1)
    assert intervals.tile_states(mod, bounds, 1, 1) is first  # the cache serves it
    doc[40:80] = 0  # documents 0 and 1 merge
    second = intervals.tile_states(mod, bounds, 1, 1)
    assert second is not first
    assert torch.equal(second, evaluated_tile_states(mod, bounds, 1, 1))
    assert not torch.equal(second, first)


def test_a_changed_python_number_is_a_new_graph():
    window = [4]
    mod = lambda b, h, q, kv: (kv <= q) & (q - kv < window[0])  # noqa: E731
    bounds = Bounds(64, 64, 8, 8)
    first = intervals.tile_states(mod, bounds, 1, 1)
    window[0] = 20
    assert torch.equal(intervals.tile_states(mod, bounds, 1, 1), evaluated_tile_states(mod, bounds, 1, 1))
    assert not torch.equal(first, evaluated_tile_states(mod, bounds, 1, 1))


def test_opaque_rules_are_evaluated_every_pair():
    mod = lambda b, h, q, kv: (q.float() * 0.5).floor() <= kv  # noqa: E731 - a float: the tracer does not read it
    bounds = Bounds(30, 30, 8, 8)
    assert intervals.tile_states(mod, bounds, 1, 1) is None
    assert torch.equal(mask_tile_states(mod, bounds, 1, 1), evaluated_tile_states(mod, bounds, 1, 1))


def test_an_index_past_the_captured_tensor_raises_as_the_function_does():
    doc = torch.zeros(20, dtype=torch.long)  # shorter than S
    mod = lambda b, h, q, kv: doc[q] == doc[kv]  # noqa: E731
    bounds = Bounds(30, 30, 8, 8)
    assert intervals.tile_states(mod, bounds, 1, 1) is None  # the bounds would leave the tensor: not classified
    with pytest.raises(IndexError):
        mask_tile_states(mod, bounds, 1, 1)


def test_a_negative_index_wraps_as_the_function_does():
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    mod = lambda b, h, q, kv: doc[q - 1] == doc[kv]  # noqa: E731 - doc[-1] is the last id, as in torch
    bounds = Bounds(6, 6, 2, 2)
    assert torch.equal(mask_tile_states(mod, bounds, 1, 1), evaluated_tile_states(mod, bounds, 1, 1))


_DOC = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 5, 5] * 3)
_ROWS = torch.stack([_DOC, torch.sort(_DOC.flip(0) % 4).values])
EDGES = {  # each op where its bounds are tight: a bound one off is a wrong tile
    "mod": lambda b, h, q, kv: (q - kv) % 5 == 4,
    "mod-low": lambda b, h, q, kv: (q + kv) % 3 == 0,
    "floordiv": lambda b, h, q, kv: q // 7 == kv // 7,
    "floordiv-negative": lambda b, h, q, kv: q // -3 == kv // -3 + 1,
    "abs": lambda b, h, q, kv: torch.abs(q - kv) == 7,
    "abs-zero": lambda b, h, q, kv: torch.abs(q - kv) < 1,
    "mul": lambda b, h, q, kv: (q - 10) * (kv - 12) == 0,
    "mul-signs": lambda b, h, q, kv: (q - 30) * (kv - 30) < -50,
    "where": lambda b, h, q, kv: torch.where(q > kv, q - kv, kv - q) == 3,
    "clamp": lambda b, h, q, kv: torch.clamp(q - kv, min=0, max=5) == 5,
    "minimum": lambda b, h, q, kv: torch.minimum(q, kv) == 9,
    "maximum": lambda b, h, q, kv: torch.maximum(q, kv) == 9,
    "ne": lambda b, h, q, kv: _DOC[q] != _DOC[kv],
    "lt-gt": lambda b, h, q, kv: (_DOC[q] < _DOC[kv]) | (q > kv + 20),
    "rows": lambda b, h, q, kv: (_ROWS[b, q] == _ROWS[b, kv]) & (kv <= q),
    "rows-by-a-range": lambda b, h, q, kv: _ROWS[q % 2, kv] == 2,
    "xor": lambda b, h, q, kv: (_DOC[q] == _DOC[kv]) ^ (kv > 20),
    "not": lambda b, h, q, kv: ~((kv <= q) & (q - kv < 5)),
    "head": lambda b, h, q, kv: (q - kv).abs() <= h * 3,
}


@pytest.mark.parametrize("block", [(1, 1), (3, 5), (8, 8), (16, 7), (60, 60)])
@pytest.mark.parametrize("name", EDGES)
def test_each_op_gets_the_exact_tiles(name, block):
    bounds = Bounds(60, 57, *block)
    got = intervals.tile_states(EDGES[name], bounds, 2, 3)
    want = evaluated_tile_states(EDGES[name], bounds, 2, 3)
    assert got is not None
    assert torch.equal(got.expand(2, 3, *got.shape[2:]), want.expand(2, 3, *want.shape[2:]))


@pytest.mark.parametrize("name", EDGES)
def test_a_proven_tile_holds_for_every_pair(name):
    """The intervals alone (no splitting): a tile called full has every pair allowed, a tile
    called empty none."""
    from headwise.symbolic import trace

    root = trace(EDGES[name])
    S, Sk, bq, bk = 60, 57, 8, 6
    bounds = Bounds(S, Sk, bq, bk)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(3).view(1, 3, 1, 1)
    lo, hi = intervals.classify(root, {0: (b, b), 1: (h, h), 2: (bounds.q_lo[None, None], bounds.q_hi[None, None]),
                                       3: (bounds.k_lo[None, None], bounds.k_hi[None, None])},
                                intervals._Tables(torch.device("cpu")))
    exact = evaluated_tile_states(EDGES[name], bounds, 2, 3).expand(2, 3, -1, -1)
    lo, hi = lo.expand_as(exact), hi.expand_as(exact)
    assert (exact[lo == 1] == 2).all() and (exact[hi == 0] == 0).all()


def test_values_past_the_int32_range_are_left_to_the_function():
    mod = lambda b, h, q, kv: (q * 100_000) * (kv * 100_000) > 5  # noqa: E731 - products past 2^31
    bounds = Bounds(40, 40, 8, 8)
    assert intervals.tile_states(mod, bounds, 1, 1) is None
    assert torch.equal(mask_tile_states(mod, bounds, 1, 1), evaluated_tile_states(mod, bounds, 1, 1))


def test_an_int32_captured_tensor_keeps_its_meaning():
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3] * 4, dtype=torch.int32)
    mod = lambda b, h, q, kv: (doc[q] + 1 == doc[kv] + 1) & (kv <= q)  # noqa: E731
    bounds = Bounds(32, 32, 4, 8)
    assert torch.equal(intervals.tile_states(mod, bounds, 1, 1), evaluated_tile_states(mod, bounds, 1, 1))

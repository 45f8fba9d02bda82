"""What every fuzz test shares: the hypothesis profiles, tensor layouts, the rule pools, NaN
planting at excluded positions, comparison with the float64 oracle, and the invariant
checker that a refused call changed no state.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from torch import Tensor

from headwise import masks
from headwise.paged_cache import PagedKVCache
from headwise.testing import reference_attention

LONG = os.environ.get("HEADWISE_FUZZ", "") == "long"
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
           HealthCheck.function_scoped_fixture]
# CI: fixed examples, no shrinking (a failure prints its drawn call, unminimised, in a bounded time)
settings.register_profile("fuzz-ci", max_examples=40, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_HEALTH, print_blob=True,
                          phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False)
settings.register_profile("fuzz-long", max_examples=3000, deadline=None, derandomize=False,
                          suppress_health_check=_HEALTH, print_blob=True)
FUZZ = settings.get_profile("fuzz-long" if LONG else "fuzz-ci")


def budget(ci: int, long: int | None = None) -> settings:
    """The profile with ``ci`` examples in CI, and in the long run its thousands (``long``:
    fewer, for a test whose example takes seconds)."""
    return settings(FUZZ, max_examples=(long or FUZZ.max_examples) if LONG else ci)


REFUSALS = (ValueError, TypeError)  # the only exceptions a caller's mistake may raise
TOL = {torch.float64: 1e-9, torch.float32: 3e-4}
# Layouts of q, k, v: how users build tensors (views of projections, broadcasts, slices).
LAYOUTS = ["contiguous", "transposed", "strided", "offset", "expanded", "heads-expanded"]


# ---------------------------------------------------------------- layouts


def make_leaf(kind: str, values: Tensor) -> Tensor:
    """The storage ``view(kind, leaf)`` reads: the tensor a caller's gradients land on."""
    if kind == "transposed":
        return values.transpose(1, 2).contiguous()  # (B, S, H, D) in memory
    if kind == "strided":
        return torch.stack([values, torch.zeros_like(values)], -1).flatten(-2)  # (..., 2 D): every other column
    if kind == "offset":
        return torch.cat([values.new_zeros(3), values.flatten()])  # a storage offset of 3
    if kind == "expanded":
        return values[:1].clone() if values.shape[0] else values.clone()
    if kind == "heads-expanded":
        return values[:, :1].clone() if values.shape[1] else values.clone()
    return values.clone()


def view(kind: str, leaf: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The tensor passed to headwise, of ``shape``, in the layout ``kind``, differentiable in ``leaf``."""
    if kind == "transposed":
        return leaf.transpose(1, 2)
    if kind == "strided":
        return leaf[..., ::2]
    if kind == "offset":
        return leaf[3:].view(shape)
    if kind in ("expanded", "heads-expanded"):
        return leaf.expand(shape)
    return leaf


def spread(kind: str, values: Tensor) -> Tensor:
    """The values the layout actually holds (an expanded layout repeats its first row or head)."""
    return view(kind, make_leaf(kind, values), tuple(values.shape)).clone()


class Inputs:
    """q, k, v (and sinks) in chosen layouts and dtype, with float64 twins for the oracle."""

    def __init__(self, values: dict[str, Tensor], kinds: dict[str, str], dtype: torch.dtype, grad: bool,
                 planted: dict[str, Tensor] | None = None):
        self.shapes = {n: tuple(t.shape) for n, t in values.items()}
        self.kinds = kinds
        planted = planted or {}
        self.leaves = {n: make_leaf(kinds.get(n, "contiguous"), planted.get(n, t)).to(dtype).requires_grad_(grad)
                       for n, t in values.items()}
        self.ref_leaves = {n: make_leaf(kinds.get(n, "contiguous"), t).requires_grad_(grad)
                           for n, t in values.items()}

    def tensors(self) -> dict[str, Tensor]:
        return {n: view(self.kinds.get(n, "contiguous"), leaf, self.shapes[n]) for n, leaf in self.leaves.items()}

    def ref_tensors(self) -> dict[str, Tensor]:
        return {n: view(self.kinds.get(n, "contiguous"), leaf, self.shapes[n]) for n, leaf in self.ref_leaves.items()}


# ---------------------------------------------------------------- rules


def mask_mod_pool(B: int, H: int, S: int, Sk: int, gen: torch.Generator) -> dict[str, Callable]:
    """mask_mods as users write them: the helpers, their compositions and plain functions."""
    ids = torch.sort(torch.randint(0, 3, (max(S, Sk, 1),), generator=gen)).values
    table = torch.rand(max(B, 1), max(S, 1), generator=gen) > 0.3  # (B, S)

    def stripes(b, h, q_idx, kv_idx):
        return ((kv_idx + h) % 2 == 0) | (kv_idx == q_idx)

    def chained(b, h, q_idx, kv_idx):  # Flex's scalar indexing
        return table[b][q_idx] | (kv_idx == 0)

    def two_d(b, h, q_idx, kv_idx):  # a result that only broadcasts to the scores: (S, Sk)
        return (q_idx >= kv_idx - 1).reshape(q_idx.shape[-2:-1] + kv_idx.shape[-1:]) if q_idx.dim() == 4 \
            else q_idx >= kv_idx - 1

    pool = {
        "causal": masks.causal,
        "sliding_window(2)": masks.sliding_window(2),
        "document": masks.document(ids[:Sk] if S == Sk else ids[:max(S, Sk)]),
        "prefix_lm(2)": masks.prefix_lm(2),
        "and(causal, stripes)": masks.and_masks(masks.causal, stripes),
        "or(window(1), stripes)": masks.or_masks(masks.sliding_window(1), stripes),
        "stripes": stripes,
        "chained": chained,
        "two_d": two_d,
    }
    if S != Sk:
        del pool["document"]
    return pool


def score_mod_pool(B: int, H: int, S: int, Sk: int, gen: torch.Generator) -> dict[str, Callable]:
    """score_mods: a learned relative bias, plain arithmetic, chained indexing, a key-only bias."""
    table = torch.randn(32, H, generator=gen, dtype=torch.float64)
    per_row = torch.randn(max(B, 1), max(S, 1), generator=gen, dtype=torch.float64)

    def arithmetic(score, b, h, q_idx, kv_idx):
        return score * 0.5 + (q_idx - kv_idx) * 0.1 - h * 0.2

    def chained(score, b, h, q_idx, kv_idx):
        return score + per_row[b][q_idx].to(score.dtype)

    def key_bias(score, b, h, q_idx, kv_idx):  # only broadcasts to the scores: (1, 1, 1, Sk)
        return (kv_idx * 0.25).to(score.dtype) + 0 * score.sum() if kv_idx.dim() == 0 else (kv_idx * 0.25).to(
            score.dtype)

    return {
        "relative_position_bias": masks.relative_position_bias(table.float()),
        "arithmetic": arithmetic,
        "chained": chained,
        "key_bias": key_bias,
    }


# ---------------------------------------------------------------- the oracle and the comparison


def allowed_grid(q: Tensor, k: Tensor, v: Tensor, mask: Any, options: dict) -> Tensor:
    """(B, H, S, Sk) bool: the pairs the call lets attend (the oracle's weights on zero inputs)."""
    zero = {n: o.detach().double() if isinstance(o, Tensor) and n in ("alibi_slopes",) else o
            for n, o in options.items() if n != "sinks"}
    ref = reference_attention(torch.zeros(q.shape, dtype=torch.float64), torch.zeros(k.shape, dtype=torch.float64),
                              torch.zeros(v.shape, dtype=torch.float64), mask, **zero)
    return ref.weights > 0


def excluded(allowed: Tensor, Hkv: int) -> tuple[Tensor, Tensor]:
    """Query rows (B, H, S) that attend nothing, and keys (B, Hkv, Sk) that no query attends."""
    B, H, S, Sk = allowed.shape
    dead_rows = ~allowed.any(-1)
    if H == 0 or Hkv == 0:
        return dead_rows, torch.zeros(B, Hkv, Sk, dtype=torch.bool)
    dead_keys = ~allowed.reshape(B, Hkv, H // Hkv, S, Sk).any(3).any(2)  # (B, Hkv, Sk)
    return dead_rows, dead_keys


def plant(values: Tensor, where: Tensor, gen: torch.Generator) -> Tensor:
    """``values`` with NaN, +inf or -inf at the rows ``where`` (..., n) marks."""
    poison = torch.tensor([math.nan, math.inf, -math.inf], dtype=values.dtype)
    pick = poison[torch.randint(0, 3, where.shape, generator=gen)]
    return torch.where(where[..., None], pick[..., None], values)


def error(got: Tensor | None, want: Tensor) -> float:
    """Largest absolute difference, NaN-aware (NaN or inf on one side only: inf)."""
    if got is None:
        return math.inf
    got = got.detach().cpu().double()
    want = want.detach().cpu().double()
    if got.shape != want.shape:
        return math.inf
    same = ((got == want) & torch.isinf(want)) | (torch.isnan(got) & torch.isnan(want))
    diff = torch.where(same, 0.0, (got - want).abs()).nan_to_num(nan=math.inf)
    return float(diff.max()) if diff.numel() else 0.0


def assert_close(name: str, got: Tensor | None, want: Tensor, tol: float) -> None:
    err = error(got, want)
    scale = 1.0 + (float(want.detach().abs().nan_to_num(posinf=0, neginf=0).max()) if want.numel() else 0.0)
    assert err <= tol * scale, f"{name}: off by {err:.3g} (tolerance {tol * scale:.3g}); got {got}, want {want}"


def assert_refusal(error_: BaseException) -> None:
    assert isinstance(error_, REFUSALS), f"refused with {type(error_).__name__}, not ValueError/TypeError: {error_}"
    assert str(error_).strip(), f"a {type(error_).__name__} without a message"


# ---------------------------------------------------------------- the invariant checker


def _freeze(value: Any, depth: int = 0) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().clone())
    if depth > 4:
        return ("id", id(value))
    if isinstance(value, dict):
        return ("dict", {k: _freeze(v, depth + 1) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_freeze(v, depth + 1) for v in value])
    if isinstance(value, (bytes, bytearray)):
        return ("bytes", bytes(value))
    if value is None or isinstance(value, (int, float, str, bool, torch.dtype, torch.device)):
        return value
    return ("id", id(value))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        if not (isinstance(b, tuple) and b and b[0] == "tensor" and a[1:3] == b[1:3]):
            return False
        x, y = a[3], b[3]
        return bool(((x == y) | (x.isnan() & y.isnan())).all()) if x.is_floating_point() else torch.equal(x, y)
    if isinstance(a, tuple) and a and a[0] in ("dict",):
        return isinstance(b, tuple) and b[0] == "dict" and a[1].keys() == b[1].keys() and all(
            _same(a[1][k], b[1][k]) for k in a[1])
    if isinstance(a, tuple) and a and a[0] in ("list", "tuple"):
        return isinstance(b, tuple) and b[0] == a[0] and len(a[1]) == len(b[1]) and all(
            _same(x, y) for x, y in zip(a[1], b[1], strict=True))
    return a == b


def state_of(obj: Any) -> Any:
    """Every piece of state a call could touch: a module's parameters, buffers, settings and memo,
    a cache's tensors and bookkeeping, a paged pool, the functional memo."""
    from headwise import functional

    if isinstance(obj, torch.nn.Module):
        plain = {k: v for k, v in obj.__dict__.items() if not k.startswith("_") and not isinstance(v, torch.nn.Module)}
        return _freeze({"params": dict(obj.named_parameters()), "buffers": dict(obj.named_buffers()),
                        "grads": {n: p.grad for n, p in obj.named_parameters()},
                        "memo": {k: id(v) for k, v in obj.__dict__.get("_repeats", {}).items()}, "settings": plain})
    if obj == "functional memo":
        return _freeze({k: id(v) for k, v in functional._REPEATS.items()})
    if isinstance(obj, PagedKVCache):
        return _freeze(_paged_state(obj))
    return _freeze(dict(vars(obj)))


def _paged_state(pool: PagedKVCache) -> dict:
    """A paged pool's bookkeeping and what each sequence reads (its keys and values up to its
    length), not the raw pages: a step refused after its append leaves what it wrote in pages
    that were free and in slots past the lengths, which no sequence reads (the rollback
    restores the bookkeeping only, as PagedKVCache.savepoint documents)."""
    plain = {k: v for k, v in vars(pool).items() if k not in ("_k", "_v", "k_pages", "v_pages")}
    live = {}
    for s in pool.sequences:
        idx, L = torch.tensor(pool.pages(s), dtype=torch.long), pool.length(s)
        k, v = pool.k_pages[idx].transpose(0, 1), pool.v_pages[idx].transpose(0, 1)  # (Hkv, n, P, D|Dv)
        live[s] = (k.flatten(1, 2)[:, :L], v.flatten(1, 2)[:, :L])  # (Hkv, L, D|Dv)
    return {"bookkeeping": plain, "sequences": live}


class Unchanged:
    """``with Unchanged(mha, cache):`` asserts, when the block raises a refusal, that nothing changed."""

    def __init__(self, *objs: Any):
        self.objs = [*objs, "functional memo"]

    def __enter__(self) -> Unchanged:
        self.before = [state_of(o) for o in self.objs]
        return self

    def __exit__(self, kind, error_, tb) -> bool:
        if error_ is None:
            return False
        assert_refusal(error_)
        for obj, before in zip(self.objs, self.before, strict=True):
            assert _same(before, state_of(obj)), f"a refused call ({error_}) changed {type(obj).__name__}"
        self.refused = error_
        return True  # a refusal that changed nothing is a fine outcome


def refused(outcome: Unchanged) -> bool:
    return getattr(outcome, "refused", None) is not None


def shapes(draw, *, max_b: int = 2, max_s: int = 6) -> dict:
    """B, H, Hkv, S, Sk, D, Dv, with empty sizes among them."""
    H = draw(st.sampled_from([1, 2, 4]))
    return dict(B=draw(st.integers(0, max_b)), H=H, Hkv=draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0])),
                S=draw(st.integers(0, max_s)), Sk=draw(st.integers(0, max_s + 1)), D=draw(st.sampled_from([4, 8])),
                Dv=draw(st.sampled_from([None, 3])))



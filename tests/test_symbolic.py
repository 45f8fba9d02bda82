"""Tests for ``headwise.symbolic``: a plain mask_mod traced on symbolic indices replays exactly
what the function computes, and anything the tracer does not model makes it opaque (None).

Legend: B batch, H query heads, S query length, Sk key length.
"""

from __future__ import annotations

import pytest
import torch

from headwise.evaluate import grid
from headwise.symbolic import captured, replay, signature, trace

DOC = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
ROWS = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3]])
KEEP = torch.tensor([True, False, True, True, False, True, True, True, False, True, True, True])
LIMIT = torch.tensor(5)

READ = {
    "document-causal": lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv),
    "per-row documents": lambda b, h, q, kv: ROWS[b, q] == ROWS[b, kv],
    "sliding window": lambda b, h, q, kv: (kv <= q) & (q - kv < 3),
    "prefix-lm": lambda b, h, q, kv: (kv < 4) | (kv <= q),
    "where, abs, min, max": lambda b, h, q, kv: torch.where(q > 5, torch.abs(q - kv) <= 2,
                                                            torch.minimum(q, kv) == torch.maximum(q // 2, kv % 3)),
    "clamp, xor, not": lambda b, h, q, kv: ~((torch.clamp(q - kv, min=0, max=3) == 3) ^ (h == 1)),
    "bool tensor, 0-d limit": lambda b, h, q, kv: KEEP[kv] & (kv < LIMIT + q) & (b >= 0),
    "casts and reversed ops": lambda b, h, q, kv: ((10 - q).long() * 2 > kv.int()) | (1 + q == kv).bool(),
    "a constant": lambda b, h, q, kv: True,
    "floor div": lambda b, h, q, kv: torch.div(q, 4, rounding_mode="floor") == torch.div(kv, 4, rounding_mode="floor"),
    "moved to the indices' device": lambda b, h, q, kv: DOC.to(q.device)[q] == DOC.to(kv.device)[kv],
}


@pytest.mark.parametrize("name", READ)
def test_a_traced_rule_replays_what_the_function_computes(name):
    mod = READ[name]
    root = trace(mod)
    assert root is not None, name
    b, h, q, kv = grid(2, 3, (0, 12), (0, 12), None)
    want = torch.as_tensor(mod(b, h, q, kv))
    got = replay(root, {0: b, 1: h, 2: q, 3: kv})
    assert got.dtype == torch.bool
    assert torch.equal(got.expand(2, 3, 12, 12), want.expand(2, 3, 12, 12))


def _catches(b, h, q, kv):
    try:
        return q.float() < kv
    except Exception:  # noqa: BLE001 - the rule hides its own errors; the tracer must not be fooled
        return q < kv


def _catches_all(b, h, q, kv):
    try:
        return q.float() < kv
    except BaseException:  # noqa: BLE001
        return q < kv


OPAQUE = {
    "float": lambda b, h, q, kv: q.float() < kv,
    "true division": lambda b, h, q, kv: q / 2 < kv,
    "python control flow": lambda b, h, q, kv: (q >= kv) if q > 3 else (q < kv),
    "reads a shape": lambda b, h, q, kv: kv < q.shape[-2],
    "item": lambda b, h, q, kv: kv < q.max().item(),
    "reduction": lambda b, h, q, kv: kv <= q.amax(),
    "bitwise on integers": lambda b, h, q, kv: (q & 1) == (kv & 1),
    "bool masking index": lambda b, h, q, kv: DOC[q > 2] == 0,
    "a reshape": lambda b, h, q, kv: q.view(-1, 1) < kv,
    "a 2-D tensor by one index": lambda b, h, q, kv: ROWS[b][q] == ROWS[b][kv],
    "modulo by an index": lambda b, h, q, kv: q % (kv + 1) == 0,
    "returns an integer": lambda b, h, q, kv: q - kv,
    "raises": lambda b, h, q, kv: DOC[q] == DOC[kv] + undefined_name,  # type: ignore[name-defined] # noqa: F821
    "catches Exception": _catches,
    "catches BaseException": _catches_all,
    "a float tensor indexed": lambda b, h, q, kv: torch.rand(12)[q] < 0.5,
}


@pytest.mark.parametrize("name", OPAQUE)
def test_what_the_tracer_does_not_model_is_opaque(name):
    assert trace(OPAQUE[name]) is None


def test_the_signature_holds_constants_and_the_captured_tensors_by_place():
    def window(w):
        return lambda b, h, q, kv: (kv <= q) & (q - kv < w)

    sig = [signature(r, captured(r)) for r in (trace(window(3)), trace(window(3)), trace(window(4)))]
    assert sig[0] == sig[1] and sig[0] != sig[2]
    root = trace(READ["document-causal"])
    assert captured(root) == [DOC] or captured(root)[0] is DOC

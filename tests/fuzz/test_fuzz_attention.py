"""Fuzz the functional entry points against the float64 oracle: ``attention`` (every kernel,
mask kind, rule, layout, dtype, empty size, NaN / inf at excluded positions, lse, weights,
gradients), ``merge_attentions``, ``packed_attention``, ``tile_map``, torch.func transforms
and ``torch.compile(fullgraph=True)``.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, note
from hypothesis import strategies as st

import headwise
from fuzz.fuzz_kit import (
    LAYOUTS,
    TOL,
    Inputs,
    Unchanged,
    allowed_grid,
    assert_close,
    budget,
    excluded,
    mask_mod_pool,
    plant,
    refused,
    score_mod_pool,
    shapes,
    spread,
)
from headwise import masks
from headwise.testing import reference_attention

BACKENDS = ["auto", "auto", "auto", "matmul", "einsum", "bmm", "einops", "sdpa", "chunked", "varlen"]
MASKS = [None, "bool2d", "int2d", "bool3d", "bool4d", "float4d", "blockmask", "blockmask-blocks"]


def draw_call(draw) -> dict:
    call = shapes(draw)
    window = draw(st.sampled_from([None, None, 1, 2, 3]))
    call.update(
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        backend=draw(st.sampled_from(BACKENDS)),
        kinds={n: draw(st.sampled_from(LAYOUTS)) for n in "qkv"},
        mask=draw(st.sampled_from(MASKS)),
        is_causal=draw(st.booleans()),
        window=window,
        sink_tokens=draw(st.integers(0, 2)) if window else 0,
        alibi=draw(st.booleans()),
        softcap=draw(st.sampled_from([None, None, 1.5])),
        sinks=draw(st.booleans()),
        mask_mod=draw(st.sampled_from([None, None, *mask_mod_pool(1, 1, 2, 2, torch.Generator())])),
        score_mod=draw(st.sampled_from([None, None, "relative_position_bias", "arithmetic", "chained",
                                        "key_bias"])),
        return_lse=draw(st.booleans()),
        need_weights=draw(st.booleans()),
        grad=draw(st.booleans()),
        nan=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    return call


def build_mask(kind, B, H, S, Sk, gen, rule):
    """The drawn mask (bool / int / float tensors in float64, or a BlockMask)."""
    if kind is None:
        return None
    if kind.startswith("blockmask"):
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        if kind == "blockmask":
            return create_block_mask(rule or masks.causal, B, H, S, Sk, device="cpu", BLOCK_SIZE=2)
        nq, nk = -(-S // 2), -(-Sk // 2)
        num = torch.randint(0, nk + 1, (B, H, nq), generator=gen, dtype=torch.int32)
        idx = torch.argsort(torch.rand(B, H, nq, nk, generator=gen), -1).to(torch.int32)  # (B, H, nq, nk)
        return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=2, seq_lengths=(S, Sk))
    keep = torch.rand(B, H, S, Sk, generator=gen) > 0.3
    if kind in ("bool2d", "int2d"):
        m = torch.rand(B, Sk, generator=gen) > 0.3
        return m.to(torch.int64) if kind == "int2d" else m
    if kind == "bool3d":
        return keep[:, 0]
    if kind == "bool4d":
        return keep[:, :1] if torch.rand((), generator=gen) > 0.5 else keep
    return torch.randn(B, 1, S, Sk, generator=gen, dtype=torch.float64).masked_fill(~keep[:, :1], -math.inf)


def build(call: dict):
    """The call's tensors, options and the oracle's twins."""
    B, H, Hkv, S, Sk, D = (call[n] for n in ("B", "H", "Hkv", "S", "Sk", "D"))
    gen = torch.Generator().manual_seed(call["seed"])
    values = {"q": torch.randn(B, H, S, D, generator=gen, dtype=torch.float64),
              "k": torch.randn(B, Hkv, Sk, D, generator=gen, dtype=torch.float64),
              "v": torch.randn(B, Hkv, Sk, call["Dv"] or D, generator=gen, dtype=torch.float64)}
    values = {n: spread(call["kinds"][n], t) for n, t in values.items()}
    pool = mask_mod_pool(B, H, S, Sk, gen)
    scores = score_mod_pool(B, H, S, Sk, gen)
    if call["mask"] is not None and call["mask"].startswith("blockmask") and 0 in (B, H, S, Sk):
        call["mask"] = "bool4d"
    rule = pool.get(call["mask_mod"]) if call["mask_mod"] else None
    mask = build_mask(call["mask"], B, H, S, Sk, gen, rule)
    options = dict(is_causal=call["is_causal"], window=call["window"], sink_tokens=call["sink_tokens"],
                   softcap=call["softcap"], mask_mod=rule, score_mod=scores.get(call["score_mod"]))
    if call["alibi"]:
        options["alibi_slopes"] = masks.alibi_slopes(H).double()
    if call["sinks"]:
        values["sinks"] = torch.randn(H, generator=gen, dtype=torch.float64)
    planted = {}
    if call["nan"]:
        dead_rows, dead_keys = excluded(allowed_grid(values["q"], values["k"], values["v"], mask, options), Hkv)
        for n, where in (("q", dead_rows), ("k", dead_keys), ("v", dead_keys)):
            if not call["kinds"][n].endswith("expanded"):
                planted[n] = plant(values[n], where, gen)
                values[n] = torch.where(where[..., None], 0.0, values[n])  # the oracle's input: zeros there
    return values, planted, mask, options, gen


def _cast(mask, dtype):
    return mask.to(dtype) if isinstance(mask, torch.Tensor) and mask.is_floating_point() else mask


def _loss(result, ref, call):
    """One scalar over out (and lse where asked), the same weights for the oracle: its gradients are compared."""
    out, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    dout = torch.randn(ref.out.shape, generator=torch.Generator().manual_seed(call["seed"] + 1), dtype=torch.float64)
    total, want = (out.double() * dout).sum(), (ref.out * dout).sum()
    if call["return_lse"]:
        lse, live = rest[-1].double(), torch.isfinite(ref.lse)
        total = total + torch.where(live, lse, 0.0).sum()
        want = want + torch.where(live, ref.lse, 0.0).sum()
    return total, want


def check_call(call: dict) -> None:
    values, planted, mask, options, gen = build(call)
    dtype, tol = call["dtype"], TOL[call["dtype"]]
    inputs = Inputs(values, {**call["kinds"], "sinks": "contiguous"}, dtype, call["grad"], planted)
    t, r = inputs.tensors(), inputs.ref_tensors()
    slopes = options.pop("alibi_slopes", None)
    with Unchanged() as outcome:
        result = headwise.attention(t["q"], t["k"], t["v"], _cast(mask, dtype), backend=call["backend"],
                                    return_lse=call["return_lse"], need_weights=call["need_weights"],
                                    sinks=t.get("sinks"), alibi_slopes=None if slopes is None else slopes.to(dtype),
                                    **options)
    if refused(outcome):
        assert call["backend"] != "auto", f"'auto' refused a call the contract serves: {outcome.refused}"
        assert str(outcome.refused).startswith(f"backend {call['backend']!r} "), outcome.refused
        return
    ref = reference_attention(r["q"], r["k"], r["v"], mask, sinks=r.get("sinks"), alibi_slopes=slopes, **options)
    parts = result if isinstance(result, tuple) else (result,)
    assert_close("out", parts[0], ref.out, tol)
    if call["need_weights"]:
        assert_close("weights", parts[1], ref.weights, tol)
    if call["return_lse"]:
        assert parts[-1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert_close("lse", parts[-1], ref.lse, tol)
    if call["grad"]:
        total, want = _loss(result, ref, call)
        want.backward()
        total.backward()
        for n, leaf in inputs.leaves.items():
            grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
            assert_close(f"d{n}", grad, inputs.ref_leaves[n].grad, tol * 30)


@budget(120)
@given(st.data())
def test_attention_equals_the_oracle(data):
    call = draw_call(data.draw)
    note(f"call: {call}")
    check_call(call)


# ---------------------------------------------------------------- merge_attentions


@budget(40)
@given(st.data())
def test_merged_parts_equal_one_attention(data):
    call = shapes(data.draw)
    B, H, Hkv, S, Sk, D = (call[n] for n in ("B", "H", "Hkv", "S", "Sk", "D"))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(B, h, n, D, generator=gen, dtype=torch.float64) for h, n in ((H, S), (Hkv, Sk), (Hkv, Sk)))
    mask = torch.rand(B, 1, S, Sk, generator=gen) > 0.4
    cuts = sorted(data.draw(st.lists(st.integers(0, Sk), min_size=1, max_size=3)))
    bounds = list(zip([0, *cuts], [*cuts, Sk], strict=True))
    outs, lses = [], []
    for lo, hi in bounds:
        out, lse = headwise.attention(q, k[:, :, lo:hi], v[:, :, lo:hi], mask[..., lo:hi], return_lse=True)
        outs.append(out)
        lses.append(lse)
    poison = data.draw(st.sampled_from([None, "nan-in-empty-part", "+inf-lse", "nan-lse"]))
    if poison == "nan-in-empty-part":
        outs.append(torch.full_like(outs[0], math.nan))
        lses.append(torch.full_like(lses[0], -math.inf))
    elif poison is not None and lses[0].numel():
        lses[0] = lses[0].clone()
        lses[0].view(-1)[0] = math.inf if poison == "+inf-lse" else math.nan
    with Unchanged() as outcome:
        out, lse = headwise.merge_attentions(outs, lses)
    if poison == "+inf-lse" and lses[0].numel():
        assert refused(outcome), f"merge_attentions took an lse of {poison}: out {out}"
        return
    assert not refused(outcome), outcome.refused
    ref = reference_attention(q, k, v, mask)
    want_out, want_lse = ref.out.clone(), ref.lse.clone()
    if poison == "nan-lse" and lses[0].numel():  # a NaN lse is never hidden: its row is NaN, out and lse
        want_out.view(-1, want_out.shape[-1])[0] = math.nan
        want_lse.view(-1)[0] = math.nan
    assert_close("merged out", out, want_out, 1e-9)
    assert_close("merged lse", lse, want_lse, 1e-9)


# ---------------------------------------------------------------- packed_attention


@budget(40)
@given(st.data())
def test_packed_attention_equals_each_sequence_alone(data):
    draw = data.draw
    H = draw(st.sampled_from([1, 2, 4]))
    Hkv = draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0]))
    lq = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    lk = [draw(st.integers(0, 6)) for _ in lq]
    D, dtype = 4, draw(st.sampled_from([torch.float32, torch.float64]))
    window = draw(st.sampled_from([None, 2]))
    options = dict(is_causal=draw(st.booleans()), window=window, softcap=draw(st.sampled_from([None, 2.0])),
                   sink_tokens=draw(st.integers(0, 1)) if window else 0)
    if draw(st.booleans()):
        options["alibi_slopes"] = masks.alibi_slopes(H).double()
    if draw(st.booleans()):
        options["sinks"] = torch.randn(H, dtype=torch.float64)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q = torch.randn(sum(lq), H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), Hkv, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), Hkv, D, generator=gen, dtype=torch.float64, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lq, dtype=torch.int64).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(lk, dtype=torch.int64).cumsum(0).tolist()])
    cast = {n: o.to(dtype) if isinstance(o, torch.Tensor) else o for n, o in options.items()}
    with Unchanged() as outcome:
        out = headwise.packed_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k,
                                        backend=draw(st.sampled_from(["auto", "chunked", "matmul", "sdpa"])), **cast)
    if refused(outcome):
        assert "backend" in str(outcome.refused), outcome.refused
        return
    for b in range(len(lq)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = reference_attention(q[rows].transpose(0, 1)[None], k[keys].transpose(0, 1)[None],
                                  v[keys].transpose(0, 1)[None], **options).out[0].transpose(0, 1)  # (Lq, H, D)
        assert_close(f"sequence {b}", out[rows], one, TOL[dtype])


# ---------------------------------------------------------------- tile_map


@budget(30)
@given(st.data())
def test_tile_maps_say_the_truth_and_run_as_their_rule(data):
    call = shapes(data.draw)
    B, H, S, Sk = (max(1, call[n]) for n in ("B", "H", "S", "Sk"))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    pool = mask_mod_pool(B, H, S, Sk, gen)
    name = data.draw(st.sampled_from(sorted(pool)))
    block = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4)))
    with Unchanged() as outcome:
        tiles = masks.tile_map(pool[name], B, H, S, Sk, block=block)
    assert not refused(outcome), outcome.refused
    allowed = allowed_grid(torch.zeros(B, H, S, 4), torch.zeros(B, H, Sk, 4), torch.zeros(B, H, Sk, 4), None,
                           {"mask_mod": pool[name]})
    states = tiles.states
    for i in range(0, S, block[0]):
        for j in range(0, Sk, block[1]):
            state = states.expand(B, H, -1, -1)[..., i // block[0], j // block[1]]  # (B, H)
            tile = allowed[..., i:i + block[0], j:j + block[1]]
            assert not (tile.flatten(2).any(-1) & (state == 0)).any(), f"{name}: an empty tile holds a pair"
            assert tile.flatten(2).all(-1)[state == 2].all(), f"{name}: a full tile misses a pair"
    q = torch.randn(B, H, S, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(headwise.attention(q, q, q, mask_mod=tiles),
                               reference_attention(q, q, q, mask_mod=pool[name]).out, rtol=0, atol=1e-9)

"""Rules as functions (headwise.rules): mask_mod and score_mod on every backend, forward and
backward, against a float64 formula that evaluates the user's functions on the full grid."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import headwise
from headwise import masks, policy
from headwise.evaluate import evaluate_mask, grid
from headwise.masks import TileMap, tile_map
from headwise.rules import Rules

BACKENDS = ["matmul", "einsum", "bmm", "einops", "sdpa", "chunked", "varlen", "auto"]
B, H, Hkv, D = 2, 4, 2, 8


def oracle(q, k, v, mask_mod=None, score_mod=None, attention_mask=None, is_causal=False):
    """softmax(score_mod(q k^T / sqrt(D)) masked by mask_mod, the mask and causal) v in float64, zero rows
    where nothing may be attended: the formula, written out without headwise's kernels."""
    q, k, v = (t.double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    S, Sk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, S, Sk)
    b, h, i, j = grid(q.shape[0], q.shape[1], (0, S), (0, Sk), q.device)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    allowed = torch.ones(S, Sk, dtype=torch.bool)
    if mask_mod is not None:
        allowed = allowed & mask_mod(b, h, i, j)
    if attention_mask is not None:
        allowed = allowed & attention_mask
    if is_causal:
        allowed = allowed & (j <= i + Sk - S)
    s = s.masked_fill(~allowed, float("-inf"))
    live = allowed.any(-1, keepdim=True)
    p = torch.softmax(torch.where(live, s, 0.0), -1) * live
    return p @ v


def inputs(S=12, Sk=12, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D + 2, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


IDS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
TABLE = torch.randn(8, H, dtype=torch.float64)

MASK_CASES = {
    "document-causal": dict(mask_mod=masks.and_masks(masks.causal, masks.document(IDS))),
    "document-is-causal": dict(mask_mod=masks.document(IDS[0]), is_causal=True),
    "prefix-lm": dict(mask_mod=masks.prefix_lm(torch.tensor([3, 6]))),
    "sliding-window": dict(mask_mod=masks.sliding_window(3)),
    "per-head-lambda": dict(mask_mod=lambda b, h, q, kv: (kv - q).abs() <= h + 1),
    "or-masks": dict(mask_mod=masks.or_masks(masks.sliding_window(2), masks.prefix_lm(2))),
    "with-padding": dict(mask_mod=masks.causal, attention_mask=torch.tensor([[True] * 10 + [False] * 2] * 2)),
    "empty-rows": dict(mask_mod=lambda b, h, q, kv: (q % 3 != 0) & (kv < q)),
}
SCORE_CASES = {
    "t5-bias": dict(score_mod=masks.relative_position_bias(TABLE, max_distance=16)),
    "general": dict(score_mod=lambda s, b, h, q, kv: s * torch.tanh(s) + 0.1 * h - 0.01 * (q - kv).abs()),
    "general-with-mask": dict(score_mod=lambda s, b, h, q, kv: torch.tanh(s / 2) * 2,
                              mask_mod=masks.and_masks(masks.causal, masks.document(IDS))),
}


def _check(backend, case, S=12, Sk=12, monkeypatch=None):
    q, k, v = inputs(S, Sk)
    kwargs = dict(case)
    mask = kwargs.pop("attention_mask", None)
    want = oracle(q, k, v, mask_mod=kwargs.get("mask_mod"), score_mod=kwargs.get("score_mod"),
                  attention_mask=None if mask is None else mask[:, None, None, :], is_causal=kwargs.get("is_causal"))
    out = headwise.attention(q, k, v, mask, backend=backend, **kwargs)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g)
    expected = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.fixture
def small_tiles(monkeypatch):
    """4 x 4 tiles, so the 12 x 12 grids have empty, full and partial ones."""
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 4)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 4)


@pytest.mark.parametrize("case", MASK_CASES, ids=list(MASK_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_mod_on_every_backend_equals_the_formula(backend, case, small_tiles):
    _check(backend, MASK_CASES[case])


@pytest.mark.parametrize("case", SCORE_CASES, ids=list(SCORE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_score_mod_on_every_backend_that_serves_it_equals_the_formula(backend, case, small_tiles):
    general = case.startswith("general")
    if general and backend in ("sdpa", "varlen"):
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot run a general score_mod"):
            headwise.attention(*inputs(), backend=backend, **SCORE_CASES[case])
        return
    _check(backend, SCORE_CASES[case])


@pytest.mark.parametrize("backend", ["matmul", "chunked", "sdpa", "varlen", "auto"])
def test_rules_with_cross_attention_lengths_use_raw_positions(backend, small_tiles):
    _check(backend, dict(mask_mod=lambda b, h, q, kv: kv <= q + 2, score_mod=masks.relative_position_bias(TABLE)),
           S=6, Sk=11)


@pytest.mark.parametrize("backend", ["matmul", "chunked", "sdpa", "varlen"])
def test_a_learned_bias_table_gets_exact_gradients(backend, small_tiles):
    q, k, v = inputs()
    table = TABLE.clone().requires_grad_(True)
    rule = masks.relative_position_bias(table, max_distance=16)
    out = headwise.attention(q, k, v, backend=backend, score_mod=rule, mask_mod=masks.causal)
    (got,) = torch.autograd.grad(out.square().sum(), table)
    want_table = TABLE.clone().requires_grad_(True)
    want = oracle(q, k, v, mask_mod=masks.causal, score_mod=masks.relative_position_bias(want_table, max_distance=16))
    (expected,) = torch.autograd.grad(want.square().sum(), want_table)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    assert got.abs().sum() > 0


@pytest.mark.parametrize("backend", ["matmul", "sdpa", "chunked", "varlen", "einsum"])
def test_a_row_the_rules_leave_empty_is_zeros_and_excluded_nan_reaches_nothing(backend, small_tiles):
    q, k, v = inputs()
    dead_key = 11  # attended by no query under the rule
    rule = masks.and_masks(masks.causal, lambda b, h, qi, kv: (qi % 4 != 0) & (kv != dead_key))
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, dead_key] = float("nan")
    v2[:, :, dead_key] = float("inf")
    k2.requires_grad_(True)
    v2.requires_grad_(True)
    out = headwise.attention(q, k2, v2, backend=backend, mask_mod=rule)
    assert torch.isfinite(out).all()
    assert (out[:, :, ::4] == 0).all()  # rows 0, 4, 8 attend nothing
    grads = torch.autograd.grad(out.sum(), (q, k2, v2))
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out, oracle(q, k, v, mask_mod=rule), atol=1e-10, rtol=1e-10)


@settings(max_examples=25, deadline=None)
@given(parts=st.lists(st.sampled_from(["causal", "window", "document", "prefix", "lambda"]), min_size=1, max_size=3),
       combine=st.sampled_from(["and", "or"]), backend=st.sampled_from(["chunked", "sdpa", "varlen", "matmul"]),
       S=st.integers(1, 13), seed=st.integers(0, 9))
def test_random_combinations_of_the_helpers_equal_the_formula(parts, combine, backend, S, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, 3, (B, S), generator=gen), dim=1).values
    made = {"causal": masks.causal, "window": masks.sliding_window(1 + seed % 4), "document": masks.document(ids),
            "prefix": masks.prefix_lm(seed % 5), "lambda": lambda b, h, q, kv: (q + kv + h) % 3 != 0}
    rule = (masks.and_masks if combine == "and" else masks.or_masks)(*[made[p] for p in parts])
    q, k, v = inputs(S, S, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy, "CHUNKED_BLOCK_Q", 3)
        patch.setattr(policy, "CHUNKED_BLOCK_K", 2)
        out = headwise.attention(q, k, v, backend=backend, mask_mod=rule)
    want = oracle(q, k, v, mask_mod=rule)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_the_builtin_keywords_and_mask_mod_combine_with_and():
    q, k, v = inputs()
    out = headwise.attention(q, k, v, is_causal=True, window=4, mask_mod=masks.prefix_lm(0) | masks.document(IDS[0]),
                             backend="chunked")
    want = oracle(q, k, v, mask_mod=masks.and_masks(masks.sliding_window(4), masks.or_masks(masks.prefix_lm(0),
                                                                                   masks.document(IDS[0]))))
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)


def test_chunked_skips_the_empty_tiles_and_masks_only_the_partial_ones(monkeypatch, small_tiles):
    import headwise.kernels.chunked as chunked

    evaluated = []
    real = chunked.evaluate_mask
    monkeypatch.setattr(chunked, "evaluate_mask", lambda *a, **kw: evaluated.append(a[3:5]) or real(*a, **kw))
    q, k, v = inputs()
    ids = torch.tensor([0] * 4 + [1] * 8)
    rule = masks.and_masks(masks.causal, masks.document(ids))
    states = tile_map(rule, B, H, 12, 12, block=(4, 4)).states[0, 0]
    assert states.tolist() == [[1, 0, 0], [0, 1, 0], [0, 2, 1]]  # empty 0, partial 1, full 2
    with headwise.trace() as t:
        headwise.attention(q, k, v, mask_mod=rule, backend="chunked")
    assert sorted(evaluated) == [((0, 4), (0, 4)), ((4, 8), (4, 8)), ((8, 12), (8, 12))]  # the partial tiles only
    note = " ".join(s.note for s in t.stages)
    assert "4 of 9 tiles" in note and "mask_mod and_masks(causal, document" in note


def test_a_tile_map_is_reused_as_built_and_says_its_shares(monkeypatch):
    rule = masks.and_masks(masks.causal, masks.document(torch.tensor([0] * 4 + [1] * 8)))
    tm = tile_map(rule, 1, 1, 12, 12, block=(4, 4))
    assert isinstance(tm, TileMap) and tm.shares() == {"empty": 5 / 9, "partial": 3 / 9, "full": 1 / 9}
    assert "3 x 3 tiles of 4 x 4, 56% empty, 11% full, 33% partial" in tm.describe()
    index, bits = tm.partial_masks()
    for (_, _, qi, kj), tile in zip(index.tolist(), bits, strict=True):
        want = evaluate_mask(rule, 1, 1, (qi * 4, qi * 4 + 4), (kj * 4, kj * 4 + 4), None)[0, 0]
        assert torch.equal(tile, want)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_Q", 4)
    monkeypatch.setattr(policy, "CHUNKED_BLOCK_K", 4)
    monkeypatch.setattr(masks.Document, "tile_states", lambda *a: pytest.fail("the map's states were rebuilt"))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 12, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    out = headwise.attention(q, k, v, mask_mod=tm, backend="chunked")
    torch.testing.assert_close(out, oracle(q, k, v, mask_mod=rule), atol=1e-10, rtol=1e-10)


def test_a_flex_block_mask_is_accepted_as_the_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = inputs()

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (IDS[0][q_idx] == IDS[0][kv_idx])

    block_mask = flex.create_block_mask(doc_causal, None, None, 12, 12, device="cpu", BLOCK_SIZE=4)
    out = headwise.attention(q, k, v, block_mask)
    torch.testing.assert_close(out, oracle(q, k, v, mask_mod=doc_causal), atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match=r"BlockMask was built for \(Q_LEN, KV_LEN\) = \(12, 12\), but the call has"):
        headwise.attention(*inputs(6, 6), block_mask)


def _block_rule(block_mask, B, H, S, Sk):
    """Flex's rule of a BlockMask, written out with its public API: a pair in one of the full
    blocks may attend, a pair in one of the partial blocks where the mask_mod allows it, any
    other pair not: bool (B, H, S, Sk)."""
    flex = torch.nn.attention.flex_attention
    bq, bk = block_mask.BLOCK_SIZE

    def pairs(num, index):  # the blocks' pairs: (B|1, H|1, nq, nk) -> (B, H, S, Sk)
        blocks = flex.BlockMask.from_kv_blocks(num, index, BLOCK_SIZE=(bq, bk)).to_dense().bool()
        return blocks.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :S, :Sk].expand(B, H, S, Sk)

    b, h, i, j = grid(B, H, (0, S), (0, Sk), None)
    allowed = pairs(block_mask.kv_num_blocks, block_mask.kv_indices) & block_mask.mask_mod(b, h, i, j)
    if block_mask.full_kv_num_blocks is not None:
        allowed = allowed | pairs(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return allowed


def _kv_blocks(rows, nk=3):
    """(kv_num_blocks, kv_indices) int32 of per (b, h) lists of key blocks per query block, of nk in all."""
    num = torch.tensor([[[len(blocks) for blocks in bh] for bh in b] for b in rows], dtype=torch.int32)
    index = torch.tensor([[[blocks + [j for j in range(nk) if j not in blocks] for blocks in bh] for bh in b]
                          for b in rows], dtype=torch.int32)
    return num, index


def _block_masks():
    """BlockMasks built from their blocks, as Flex users build them (B = 2, H = 4, 4 x 4 blocks)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    # per batch row and head, per query block, its key blocks: no block is every block
    rows = [[[[1], [0, 2], [2]], [[0], [1], [1, 2]], [[2], [], [0]], [[0, 1], [1], [0]]],
            [[[0], [0, 1], [2]], [[2], [2], [2]], [[1], [0], [0, 1]], [[0], [2], [1]]]]
    num, index = _kv_blocks(rows)
    even = lambda b, h, q_idx, kv_idx: (q_idx + kv_idx + h) % 2 == 0  # noqa: E731
    full_num, full_index = _kv_blocks([[[[0], [], [1]]] * 4] * 2)  # (2, 4, 3): full blocks beside partial ones
    return {
        "pattern only": flex.BlockMask.from_kv_blocks(num, index, BLOCK_SIZE=4),
        "one pattern for every row and head": flex.BlockMask.from_kv_blocks(num[:1, :1], index[:1, :1], BLOCK_SIZE=4),
        "partial and full blocks": flex.BlockMask.from_kv_blocks(num, index, full_num, full_index, BLOCK_SIZE=4),
        "mask_mod on partial blocks only": flex.BlockMask.from_kv_blocks(num, index, full_num, full_index,
                                                                         BLOCK_SIZE=4, mask_mod=even),
        "lengths past the blocks' end": flex.BlockMask.from_kv_blocks(num, index, BLOCK_SIZE=(4, 4), mask_mod=even,
                                                                      seq_lengths=(11, 10)),
    }


@pytest.mark.parametrize("case", ["pattern only", "one pattern for every row and head", "partial and full blocks",
                                  "mask_mod on partial blocks only", "lengths past the blocks' end"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_block_mask_is_attended_as_its_blocks(backend, case, small_tiles):
    block_mask = _block_masks()[case]
    S, Sk = block_mask.seq_lengths
    q, k, v = inputs(S, Sk)
    allowed = _block_rule(block_mask, B, H, S, Sk)
    assert not allowed.all() and allowed.any()
    want = oracle(q, k, v, attention_mask=allowed)
    scores = q @ k.repeat_interleave(H // Hkv, 1).transpose(-2, -1) / D ** 0.5  # (B, H, S, Sk)
    want_lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)  # (B, H, S), -inf: no key
    out, lse = headwise.attention(q, k, v, block_mask, backend=backend, return_lse=True)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_block_mask_and_a_mask_mod_combine_with_and():
    block_mask = _block_masks()["mask_mod on partial blocks only"]
    q, k, v = inputs()
    allowed = _block_rule(block_mask, B, H, 12, 12) & masks.causal(None, None, *grid(1, 1, (0, 12), (0, 12), None)[2:])
    out = headwise.attention(q, k, v, block_mask, mask_mod=masks.causal, backend="chunked")
    torch.testing.assert_close(out, oracle(q, k, v, attention_mask=allowed), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("block", [(4, 4), (2, 4), (8, 8), (3, 5)], ids=str)
def test_a_block_masks_tiles_are_never_called_full_or_empty_wrongly(block):
    from headwise.rules import from_block_mask

    for case, block_mask in _block_masks().items():
        S, Sk = block_mask.seq_lengths
        rule = from_block_mask(block_mask, S, Sk, B=B, H=H)
        allowed = evaluate_mask(rule, B, H, (0, S), (0, Sk), None).expand(B, H, S, Sk)
        assert torch.equal(allowed, _block_rule(block_mask, B, H, S, Sk)), case
        states = tile_map(rule, B, H, S, Sk, block=block).states.expand(B, H, -1, -1)  # (B, H, nq, nk)
        for qi, kj in ((qi, kj) for qi in range(states.shape[2]) for kj in range(states.shape[3])):
            tile = allowed[:, :, qi * block[0]:(qi + 1) * block[0], kj * block[1]:(kj + 1) * block[1]]
            full, empty = tile.flatten(2).all(-1), ~tile.flatten(2).any(-1)  # (B, H)
            assert not ((states[:, :, qi, kj] == 2) & ~full).any(), (case, qi, kj)
            assert not ((states[:, :, qi, kj] == 0) & ~empty).any(), (case, qi, kj)
        if block == (4, 4) and case == "pattern only":  # its own blocks, no mask_mod: no pair to evaluate
            assert not (states == 1).any()


def test_a_block_mask_that_does_not_fit_the_call_is_refused():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    block_mask = _block_masks()["pattern only"]  # B = 2, H = 4
    with pytest.raises(ValueError, match=r"BlockMask has batch size 2 and 4 heads \(kv_num_blocks \(2, 4, 3\)\), "
                                         r"but the call has B = 1 and H = 4; each must match or be 1"):
        headwise.attention(*(t[:1] for t in inputs()), block_mask)
    with pytest.raises(ValueError, match=r"BlockMask covers 3 query blocks of 4 \(12 queries\), but its "
                                         r"seq_lengths say 13"):
        headwise.attention(*inputs(13, 12), flex.BlockMask.from_kv_blocks(
            block_mask.kv_num_blocks, block_mask.kv_indices, BLOCK_SIZE=4, seq_lengths=(13, 12)))
    with pytest.raises(ValueError, match=r"this BlockMask was sliced \(block_mask\[...\]\), which drops its "
                                         r"mask_mod"):
        headwise.attention(*(t[:1] for t in inputs()), block_mask[:1])


def test_auto_picks_by_the_rule_and_says_why(monkeypatch):
    q, k, v = (torch.randn(1, 2, 2048, 16) for _ in range(3))
    ids = torch.arange(2048) // 256
    d = headwise.choose_backend(q, k, v, mask_mod=masks.and_masks(masks.causal, masks.document(ids)))
    assert d.backend == "varlen" and "8 in 1 row, the longest 256 tokens" in d.reason
    d = headwise.choose_backend(q, k, v, score_mod=lambda s, b, h, i, j: s * 2)
    assert d.backend == "chunked" and "a general score_mod" in d.reason
    d = headwise.choose_backend(q, k, v, mask_mod=masks.sliding_window(64))
    assert d.backend == "chunked" and "of the mask rule's tiles are empty" in d.reason
    d = headwise.choose_backend(q[:, :, :64], k[:, :, :64], v[:, :, :64], mask_mod=masks.prefix_lm(3))
    assert d.backend == "sdpa" and "SDPA with the rules materialised as one mask" in d.reason


def test_rules_refuse_what_cannot_be_a_rule():
    q, k, v = inputs()
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        headwise.attention(q, k, v, mask_mod=3)
    with pytest.raises(TypeError, match=r"mask_mod <lambda> must return a bool tensor .* got torch.int64"):
        headwise.attention(q, k, v, mask_mod=lambda b, h, qi, kv: kv - qi)
    with pytest.raises(ValueError, match=r"mask_mod <lambda> returned shape \(1, 1, 5, 1\), which does not broadcast"):
        headwise.attention(q, k, v, mask_mod=lambda b, h, qi, kv: torch.ones(1, 1, 5, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"score_mod <lambda> returned shape \(5,\), which does not broadcast"):
        headwise.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s.new_ones(5), backend="matmul")
    with pytest.raises(ValueError, match=r"document's doc_ids \(1, 4\) must cover"):
        headwise.attention(q, k, v, mask_mod=masks.document(torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="backend 'triton'"):
        headwise.attention(q, k, v, mask_mod=masks.causal, score_mod=lambda s, *a: s, backend="triton")


def test_rules_describe_and_the_legacy_keywords():
    rules = Rules(is_causal=True, window=3, mask_mod=masks.causal, score_mod=masks.relative_position_bias(TABLE))
    assert rules.describe() == "mask_mod causal, score_mod relative_position_bias((8, 4) table)"
    assert rules.keywords() == dict(is_causal=True, window=3, alibi_slopes=None, softcap=None, sinks=None,
                                    sink_tokens=0)
    assert not Rules(softcap=2.0).additive and Rules(score_mod=rules.score_mod).additive
    assert masks.and_masks is masks.and_masks and masks.tile_map is tile_map


def test_the_module_takes_rules_per_call_and_in_its_constructor():
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(16, 4, num_kv_heads=2, is_causal=True).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    dense = (IDS[:, :, None] == IDS[:, None, :])[:, None]  # (B, 1, S, S)
    torch.testing.assert_close(mha(x, mask_mod=masks.document(IDS)), mha(x, dense), atol=1e-12, rtol=1e-12)
    windowed = headwise.MultiHeadAttention(16, 4, num_kv_heads=2, is_causal=True, mask_mod=masks.sliding_window(3))
    windowed.double()
    windowed.load_state_dict(mha.state_dict())
    both = windowed(x, mask_mod=masks.document(IDS))  # the constructor's and the call's, ANDed
    band = torch.ones(12, 12, dtype=torch.bool).tril() & ~torch.ones(12, 12, dtype=torch.bool).tril(-3)
    torch.testing.assert_close(both, mha(x, dense & band), atol=1e-12, rtol=1e-12)
    cache = windowed.new_cache(2, 12)
    with torch.no_grad():  # decoding: the rules see each query at its position
        steps = [windowed(x[:, :5], cache=cache)] + [windowed(x[:, i:i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), windowed(x), atol=1e-12, rtol=1e-12)
    table = TABLE.clone().requires_grad_(True)
    mha(x, score_mod=masks.relative_position_bias(table)).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    sliding = headwise.MultiHeadAttention(16, 4, window=3, mask_mod=masks.causal).double()
    evicting = sliding.new_cache(2, 12, evict=True)
    refused = pytest.raises(ValueError, match="mask_mod / score_mod with an evicting cache whose step would drop 1")
    with torch.no_grad(), refused:
        for i in range(6):
            sliding(x[:, i:i + 1], cache=evicting)
    assert evicting.evicted == 0 and len(evicting) == 3  # refused at the first step that would evict, before it


def test_the_modules_plan_and_dispatch_say_what_a_call_with_rules_runs():
    mha = headwise.MultiHeadAttention(32, 4, is_causal=True, packing=True, mask_mod=masks.prefix_lm(2))
    x = torch.randn(8, 64, 32)
    padding = torch.ones(8, 64, dtype=torch.bool)
    padding[:, 20:] = False
    assert headwise.MultiHeadAttention(32, 4, is_causal=True, packing=True).plan(x, padding).path == "packed"
    plan = mha.plan(x, padding)
    assert plan.path == "dense" and "mask_mod / score_mod: the dense path" in plan.why
    ids = torch.arange(2048) // 256
    wide = headwise.MultiHeadAttention(32, 4, is_causal=True)
    d = wide.dispatch(torch.randn(1, 2048, 32), mask_mod=masks.document(ids))
    assert d.path == "dense" and d.backend == "varlen" and "a document mask over contiguous documents" in d.reason
    assert d.request.mask_mod and mha.dispatch(x, padding, score_mod=lambda s, *a: s * 2).backend == "chunked"


# --- results that broadcast, and functions written for Flex (one scalar index at a time) ---------


def loop_oracle(q, k, v, mask_mod=None, score_mod=None, attention_mask=None):
    """FlexAttention's semantics as explicit loops, in float64: each function called once per
    (b, h, i, j) with 0-d int64 indices and a 0-d score, as Flex's vmap calls it; zero rows where
    nothing may be attended. Differentiable in q, k, v and whatever the functions read."""
    q, k, v = (t.double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    Bq, Hq, S, _ = q.shape
    Sk = k.shape[2]
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, S, Sk)
    rows = []
    for b in range(Bq):
        for h in range(Hq):
            for i in range(S):
                scores, keep = [], []
                for j in range(Sk):
                    idx = [torch.tensor(n) for n in (b, h, i, j)]
                    score = s[b, h, i, j]
                    if score_mod is not None:
                        score = torch.as_tensor(score_mod(score, *idx)).to(s.dtype)
                    allowed = True if mask_mod is None else bool(mask_mod(*idx))
                    if attention_mask is not None:
                        allowed = allowed and bool(attention_mask[b, j])
                    scores.append(score)
                    keep.append(allowed)
                row, live = torch.stack(scores), torch.tensor(keep)
                p = torch.softmax(row.masked_fill(~live, float("-inf")), -1) if live.any() else torch.zeros_like(row)
                rows.append(p @ v[b, h])
    return torch.stack(rows).reshape(Bq, Hq, S, v.shape[-1])


class _Bias(masks.ScoreRule):
    """An additive score_mod (it has ``bias``) whose bias broadcasts: SDPA and varlen fold it into the mask."""

    additive = True

    def __init__(self, fn):
        self.fn = fn

    def bias(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.fn(b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return "_Bias()"


BROADCAST_SCORES = {  # each result broadcasts to (B, H, S, Sk) without being that shape
    "per-key": lambda s, b, h, i, j: j * 0.3,
    "per-head": lambda s, b, h, i, j: h * 0.5,
    "per-query": lambda s, b, h, i, j: i * 0.25 - 1,
    "per-batch-row": lambda s, b, h, i, j: b * 0.75,
    "a 0-d tensor": lambda s, b, h, i, j: torch.tensor(1.5),
    "a python float": lambda s, b, h, i, j: 2.0,
    "another dtype": lambda s, b, h, i, j: (s * 2).float() + j,
}
BROADCAST_BIASES = {
    "per-key": lambda b, h, i, j: j * 0.3,
    "per-head": lambda b, h, i, j: h * 0.5,
    "per-query": lambda b, h, i, j: i * 0.25 - 1,
    "a 0-d tensor": lambda b, h, i, j: torch.tensor(1.5),
    "another dtype": lambda b, h, i, j: (j * 0.3).float(),
}
BROADCAST_MASKS = {  # each result broadcasts to (B, H, S, Sk) without being that shape
    "python True": lambda b, h, i, j: True,
    "python False": lambda b, h, i, j: False,
    "a 0-d tensor": lambda b, h, i, j: torch.tensor(True),
    "per-head": lambda b, h, i, j: h == 0,
    "per-query": lambda b, h, i, j: i % 3 != 1,
    "per-batch-and-key": lambda b, h, i, j: (b == 0) | (j < 6),
}
PAD = torch.tensor([[True] * 12, [True] * 9 + [False] * 3])


def _check_against_loops(backend, mask_mod=None, score_mod=None, attention_mask=None, q_k_v=None, leaves=()):
    q, k, v = inputs() if q_k_v is None else q_k_v
    out = headwise.attention(q, k, v, attention_mask, backend=backend, mask_mod=mask_mod, score_mod=score_mod)
    want = loop_oracle(q, k, v, mask_mod, score_mod, attention_mask)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(out.shape, dtype=torch.float64)
    wrt = (q, k, v, *leaves)
    got = torch.autograd.grad(out, wrt, g, allow_unused=True, materialize_grads=True)
    expected = torch.autograd.grad(want, wrt, g, allow_unused=True, materialize_grads=True)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("case", BROADCAST_SCORES)
@pytest.mark.parametrize("backend", ["matmul", "einsum", "bmm", "einops", "chunked", "auto"])
def test_a_score_mod_result_that_broadcasts_is_expanded_to_the_scores(backend, case, small_tiles):
    _check_against_loops(backend, score_mod=BROADCAST_SCORES[case])


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding"])
@pytest.mark.parametrize("case", BROADCAST_BIASES)
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "matmul", "chunked", "auto"])
def test_a_bias_score_mod_whose_bias_broadcasts_is_expanded_on_the_mask_kernels(backend, case, padded, small_tiles):
    _check_against_loops(backend, score_mod=_Bias(BROADCAST_BIASES[case]), attention_mask=PAD if padded else None)


@pytest.mark.parametrize("case", BROADCAST_MASKS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_mod_result_that_broadcasts_is_expanded_to_the_grid(backend, case, small_tiles):
    _check_against_loops(backend, mask_mod=BROADCAST_MASKS[case], attention_mask=PAD)


def test_the_module_expands_a_score_mod_result_that_broadcasts():
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(16, 2, score_mod=lambda s, b, h, i, j: j * 0.3).double()
    full = headwise.MultiHeadAttention(16, 2, score_mod=lambda s, b, h, i, j: s * 0 + j * 0.3).double()
    full.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    out = mha(x)
    assert out.shape == (2, 5, 16)
    torch.testing.assert_close(out, full(x), atol=1e-12, rtol=1e-12)
    call = headwise.MultiHeadAttention(16, 2).double()
    call.load_state_dict(mha.state_dict())
    torch.testing.assert_close(call(x, score_mod=lambda s, b, h, i, j: h * 0.5 + i),
                               call(x, score_mod=lambda s, b, h, i, j: s * 0 + h * 0.5 + i), atol=1e-12, rtol=1e-12)


def test_a_rule_result_that_cannot_broadcast_is_refused_with_its_shapes():
    q, k, v = inputs()
    with pytest.raises(ValueError, match=r"score_mod <lambda> returned shape \(5,\), which does not broadcast to the "
                                         r"scores' shape \(B, H, S, Sk\) = \(2, 4, 12, 12\)"):
        headwise.attention(q, k, v, score_mod=lambda s, b, h, i, j: s.new_ones(5), backend="matmul")
    with pytest.raises(ValueError, match=r"score_mod <lambda> returned shape \(5,\), which does not broadcast"):
        headwise.attention(q, k, v, score_mod=lambda s, b, h, i, j: s.new_ones(5), backend="chunked")
    with pytest.raises(ValueError, match=r"mask_mod <lambda> returned shape \(3, 1, 1, 1\), which does not broadcast "
                                         r"to \(B, H, S, Sk\) = \(2, 4, 12, 12\)"):
        headwise.attention(q, k, v, mask_mod=lambda b, h, i, j: torch.ones(3, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"score_mod _Bias\(\) returned shape \(7,\) from bias\(b, h, q_idx, kv_idx\), "
                                         r"which does not broadcast to \(B, H, S, Sk\) = \(2, 4, 12, 12\)"):
        headwise.attention(q, k, v, score_mod=_Bias(lambda b, h, i, j: torch.zeros(7)), backend="sdpa")


def test_a_rule_that_returns_none_is_a_type_error_naming_it():
    q, k, v = inputs()

    def no_return(b, h, q_idx, kv_idx):
        kv_idx <= q_idx  # noqa: B015 - the bug: the comparison is not returned

    for backend in ("matmul", "sdpa", "chunked"):
        with pytest.raises(TypeError, match=r"mask_mod no_return must return a bool tensor \(True = may attend\), "
                                            r"got None"):
            headwise.attention(q, k, v, mask_mod=no_return, backend=backend)
    with pytest.raises(TypeError, match=r"score_mod <lambda> must return the new scores as a tensor, got None"):
        headwise.attention(q, k, v, score_mod=lambda s, b, h, i, j: None, backend="matmul")


FLEX_B, FLEX_S = 2, 12
KEEP = torch.rand(4, 12, generator=torch.Generator().manual_seed(5)) > 0.3  # (B, Sk) per batch row
ROW_BIAS = torch.randn(4, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)  # (B, S)
HEAD_BIAS = torch.randn(H, 12, 12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)  # (H, S, Sk)
ALLOWED = torch.rand(H, 12, 12, generator=torch.Generator().manual_seed(8)) > 0.4  # (H, S, Sk)


def _flex_cases(table):
    """Rules written for Flex: chained, python-style indexing, one scalar index at a time."""
    return {
        "mask keep[b][kv]": dict(mask_mod=lambda b, h, q_idx, kv_idx: KEEP[b][kv_idx]),
        "mask allowed[h][q][kv]": dict(mask_mod=lambda b, h, q_idx, kv_idx: ALLOWED[h][q_idx][kv_idx]),
        "score s + bias[b][q]": dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + table[b][q_idx]),
        "score s + bias[h][q][kv]": dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + HEAD_BIAS[h][q_idx][kv_idx]),
        "both, anded with causal": dict(mask_mod=masks.and_masks(masks.causal,
                                                                 lambda b, h, q_idx, kv_idx: KEEP[b][kv_idx]),
                                        score_mod=lambda s, b, h, q_idx, kv_idx: s + table[b][q_idx]),
    }


def flex_inputs(Bn, S, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Bn, H, S, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(Bn, Hkv, S, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(Bn, Hkv, S, D + 2, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("sizes", [(2, 12), (4, 4)], ids=["B<S", "B==S"])
@pytest.mark.parametrize("case", list(_flex_cases(None)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flex_function_with_chained_indexing_runs_unchanged(backend, case, sizes, small_tiles):
    Bn, S = sizes
    table = ROW_BIAS[:Bn, :S].clone().requires_grad_(True)
    kwargs = _flex_cases(table)[case]
    if backend in ("sdpa", "varlen") and "score_mod" in kwargs:  # a general score_mod: refused, as any other
        with pytest.raises(ValueError, match=f"backend '{backend}' cannot run a general score_mod"):
            headwise.attention(*flex_inputs(Bn, S), backend=backend, **kwargs)
        return
    _check_against_loops(backend, q_k_v=flex_inputs(Bn, S), leaves=(table,), **kwargs)


def test_a_broadcast_safe_function_keeps_the_fast_evaluation():
    seen = []

    def rule(b, h, q_idx, kv_idx):
        seen.append(q_idx.dim())
        return kv_idx <= q_idx

    headwise.attention(*inputs(), mask_mod=rule, score_mod=lambda s, b, h, i, j: s + 0 * i, backend="matmul")
    assert seen == [4]  # one call on the broadcast (1, 1, S, 1) indices, never per scalar

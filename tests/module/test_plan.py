"""``module/plan.py``: which path one call takes, and why, before any arithmetic.

Each branch of ``choose_packing`` and ``make_plan`` is pinned by the path it picks and the
key facts of its reason; ``query_padding`` by which masks describe x's own tokens (and so
may be packed by, and zero the padded queries' outputs); the thresholds and the unit costs
that ``"auto"`` prices packing with take effect when changed. Where outputs are involved,
the module's forward is compared with a float64 computation from its weights.

Legend: B batch, S query length, Sk key length, E embed dim, H heads, Hkv key/value heads.
"""

from __future__ import annotations

import pytest
import torch

import headwise
import headwise.distributed as hwd
from headwise import packing, policy
from headwise.module import plan as planning

E, H = 32, 4
NOTHING_TO_PACK = "no 2-D padding mask of x's own tokens (self-attention) to pack by"

BUILT_IN = "unit costs built in (HEADWISE_TUNE=off)"  # tests/conftest.py: the costs of headwise.policy


def padding(lengths: list[int], S: int) -> torch.Tensor:
    return torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # (B, S) True = token


def expected(mha, x, mask=None, *, context=None, zero_padded=True, ref):
    """The module's forward in float64 from its weights: (B, S, E)."""
    w = {name: p.detach().double() for name, p in mha.state_dict().items()}
    x = x.double()
    src = x if context is None else context.double()
    B, S, _ = x.shape
    Sk, D = src.shape[1], mha.head_dim

    def heads(t, name, n, L):
        return (t @ w[f"{name}.weight"].T + w[f"{name}.bias"]).reshape(B, L, n, D).transpose(1, 2)  # (B, n, L, D)

    q, k, v = heads(x, "q_proj", mha.num_heads, S), heads(src, "k_proj", mha.num_kv_heads, Sk), heads(
        src, "v_proj", mha.num_kv_heads, Sk)
    out, _ = ref(q, k, v, mask, is_causal=mha.is_causal)  # (B, H, S, D)
    out = out.transpose(1, 2).reshape(B, S, E) @ w["out_proj.weight"].T + w["out_proj.bias"]  # (B, S, E)
    if zero_padded and mask is not None:
        out = out * (mask != 0)[..., None]  # padded queries output zeros
    return out


def close(got, want):
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


# --- query_padding and all_tokens: which masks describe x's own tokens -----------------------


def test_an_integer_mask_marks_every_nonzero_value_as_a_token(ref):
    """An integer mask counts any nonzero value as a token, not only 1: the plan reads the
    real tokens per row from it, and forward zeroes exactly the zero positions."""
    mha = headwise.MultiHeadAttention(E, H, packing=True)
    x = torch.randn(3, 4, E)
    mask = torch.tensor([[2, 2, 2, 2], [1, 1, 0, 0], [3, 0, 0, 0]])
    plan = mha.plan(x, mask)
    assert plan.padding.dtype == torch.bool
    assert plan.padding.tolist() == (mask != 0).tolist()
    assert (plan.path, plan.lengths) == ("packed", (4, 2, 1))
    close(mha(x, mask), expected(mha, x, mask, ref=ref))


@pytest.mark.parametrize("kind", ["float", "3-D", "broadcast batch", "cross-attention"])
def test_a_2d_mask_that_is_not_xs_padding_is_not_packed_by(kind, ref):
    """A float bias, a 3-D mask, a (1, S) mask broadcast over the batch and a cross-attention
    key mask (here of x's length) do not say which of x's positions are tokens: no padding,
    the dense path even with packing=True, and no query's output is zeroed."""
    mha = headwise.MultiHeadAttention(E, H, packing=True)
    x, context = torch.randn(3, 4, E), None
    keys = padding([4, 2, 1], 4)
    mask = {"float": torch.zeros(3, 4).masked_fill(~keys, float("-inf")),
            "3-D": keys[:, None, :].expand(3, 4, 4),
            "broadcast batch": keys[1:2],
            "cross-attention": keys}[kind]
    if kind == "cross-attention":
        context = torch.randn(3, 4, E)
    plan = mha.plan(x, mask, context=context)
    assert (plan.path, plan.why, plan.padding, plan.lengths) == ("dense", NOTHING_TO_PACK, None, None)
    ref_mask = mask.expand(3, 4) if kind == "broadcast batch" else mask
    close(mha(x, mask, context=context), expected(mha, x, ref_mask, context=context, zero_padded=False, ref=ref))


def test_query_padding_of_a_mask_that_does_not_describe_xs_tokens_is_none():
    x = torch.randn(2, 3, E)
    tokens = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert planning.query_padding(x, tokens, None, None).tolist() == [[True, True, False], [True, False, False]]
    assert planning.query_padding(x, None, None, None) is None
    assert planning.query_padding(x, tokens.tolist(), None, None) is None  # not a tensor: the checks name it
    assert planning.query_padding(x, tokens.to(torch.complex64), None, None) is None
    assert planning.query_padding(x, tokens.to("meta"), None, None) is None  # another device than x's
    assert planning.query_padding(x, tokens, torch.randn(2, 3, E), None) is None  # cross-attention
    assert planning.query_padding(x, tokens[:, :2], None, None) is None  # (B, Sk) of another length


def test_a_cache_steps_padding_is_the_masks_last_s_columns():
    """A cache step's 2-D mask covers the new positions or every position: either way the
    plan's padding is the new positions' (the last S columns)."""
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    cache = mha.new_cache(3, 10)
    x = torch.randn(3, 6, E)
    with torch.no_grad():
        mha(x[:, :4], cache=cache)
        new = torch.tensor([[1, 1], [1, 0], [0, 1]])
        plan = mha.plan(x[:, 4:], new, cache=cache)
        assert plan.padding.tolist() == [[True, True], [True, False], [False, True]]
        assert (plan.lengths, plan.path) == ((2, 1, 1), "dense")
        assert plan.why == "decoding with a cache keeps the (B, S) layout"
        every = torch.ones(3, 6, dtype=torch.long)
        every[1, 4] = every[2, 0] = 0  # a padded new position and a padded old one
        plan = mha.plan(x[:, 4:], every, cache=cache)
        assert plan.padding.tolist() == [[True, True], [False, True], [True, True]]
        assert plan.lengths == (2, 1, 2)
        assert mha.plan(x[:, 4:5], cache=cache).padding is None
    assert planning.query_padding(x[:, 4:], torch.ones(1, 6, dtype=torch.bool), None, cache) is None  # batch 1 of 3


def test_all_tokens_needs_read_lengths_that_all_fill_the_rows():
    assert planning.all_tokens((4, 4, 4), 4)
    assert not planning.all_tokens((4, 3, 4), 4)
    assert not planning.all_tokens((4, 4), 5)
    assert not planning.all_tokens(None, 4)  # not read: nothing says there is no padding


def test_a_mask_without_padding_leaves_the_small_call_on_the_fused_path(ref):
    """Without gradients a small call takes the fused path when the mask has no padding (an
    all-True bool mask, an all-ones integer mask), not when it has some or is not read."""
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = torch.randn(3, 4, E)
    with torch.no_grad():
        for full in (torch.ones(3, 4, dtype=torch.bool), torch.ones(3, 4, dtype=torch.long)):
            plan = mha.plan(x, full)
            assert (plan.path, plan.lengths, plan.is_causal) == ("fused", (4, 4, 4), False)
            assert plan.padding.tolist() == [[True] * 4] * 3
            assert plan.why.startswith(f"B x S x E = 384 <= FUSED_MAX_ELEMENTS {policy.FUSED_MAX_ELEMENTS} without "
                                       "gradients: nn.MultiheadAttention's fused inference op")
            close(mha(x, full), expected(mha, x, ref=ref))
        padded = padding([4, 3, 4], 4)
        assert mha.plan(x, padded).path == "dense"
        close(mha(x, padded), expected(mha, x, padded, ref=ref))
        assert mha.plan(x, torch.zeros(3, 4)).path == "dense"  # a float bias: its values are not read
        assert mha.plan(x, torch.ones(3, 4, 4, dtype=torch.bool)).path == "dense"


# --- make_plan ---------------------------------------------------------------------------------


def test_the_call_s_causal_flag_overrides_the_constructor_s():
    causal = headwise.MultiHeadAttention(E, H, is_causal=True)
    plain = headwise.MultiHeadAttention(E, H)
    x = torch.randn(2, 3, E)
    assert causal.plan(x).is_causal is True
    assert causal.plan(x, is_causal=False).is_causal is False
    assert plain.plan(x).is_causal is False
    assert plain.plan(x, is_causal=1).is_causal is True  # any truthy value, as a bool


def test_plan_refuses_what_forward_refuses():
    mha = headwise.MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"attention_mask"):
        mha.plan(torch.randn(2, 3, E), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask"):
        mha(torch.randn(2, 3, E), torch.ones(2, 5, dtype=torch.bool))


def test_a_context_parallel_module_plans_its_shard_and_reports_the_method():
    mha = headwise.MultiHeadAttention(16, 4, is_causal=True, context_parallel=hwd.ContextParallel())
    x = torch.randn(1, 5, 16)
    plan = mha.plan(x, torch.ones(1, 5, dtype=torch.bool))
    assert (plan.path, plan.is_causal, plan.padding, plan.lengths) == ("context parallel", True, None, None)
    assert plan.why == ("context_parallel=ContextParallel(group=None, method='ring', layout='zigzag'): x is this "
                        "rank's shard of the sequence, attention runs across the ranks")
    said = mha.dispatch(x)
    assert (said.path, said.path_reason, said.backend, said.reason, dict(said.passed_over), said.request) == (
        "context parallel", plan.why, "ring", "method='ring' was requested", {}, None)


# --- choose_packing: each branch -------------------------------------------------------------


CHOICES = {  # module, call -> path, why
    "no mask": ({"packing": True}, {}, "dense", NOTHING_TO_PACK),
    "need_weights": ({"packing": True}, {"need_weights": True}, "dense",
                     "need_weights=True returns (B, H, S, Sk) weights over the padded layout"),
    "window": ({"packing": True, "window": 2}, {}, "dense",
               "window / ALiBi count positions, which change for tokens after a hole once packed"),
    "alibi": ({"packing": True, "alibi": True}, {}, "dense",
              "window / ALiBi count positions, which change for tokens after a hole once packed"),
    "packing=True": ({"packing": True}, {}, "packed", "packing=True packs the real tokens"),
    "packing=False": ({"packing": False}, {}, "dense", "packing=False"),
    "named kernel": ({"backend": "chunked"}, {}, "dense",
                     "backend='chunked' runs on the (B, S) batch (packing=True packs for it)"),
    "named kernel, packing=True": ({"backend": "chunked", "packing": True}, {}, "packed",
                                   "packing=True packs the real tokens"),
}


@pytest.mark.parametrize("case", list(CHOICES))
def test_each_packing_choice_names_its_reason_and_forward_follows_it(case, cheap_packing, ref):
    """Under costs that make packing pay for any padding, every reason to stay dense (or to pack
    regardless) is the one reported, and forward's output is the same either way."""
    kwargs, call, path, why = CHOICES[case]
    mha = headwise.MultiHeadAttention(E, H, **kwargs)
    x = torch.randn(3, 4, E)
    mask = None if case == "no mask" else padding([4, 2, 1], 4)
    plan = mha.plan(x, mask, **call)
    assert (plan.path, plan.why) == (path, why)
    assert mha.dispatch(x, mask, **call).path == path
    if kwargs.get("window") is None and not kwargs.get("alibi"):
        out = mha(x, mask, **call)
        close(out[0] if call.get("need_weights") else out, expected(mha, x, mask, ref=ref))


def test_a_cache_step_with_a_padding_mask_stays_dense_even_with_packing_true():
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, packing=True).eval()
    cache = mha.new_cache(2, 8)
    with torch.no_grad():
        plan = mha.plan(torch.randn(2, 3, E), padding([3, 1], 3), cache=cache)
    assert (plan.path, plan.why) == ("dense", "decoding with a cache keeps the (B, S) layout")
    assert plan.lengths == (3, 1)


def test_a_mask_whose_values_are_not_read_is_not_priced(monkeypatch):
    """On an accelerator reading the mask would sync the host (``policy.reads_values`` False, as
    there): "auto" stays dense and says so, naming the device; packing=True still packs."""
    monkeypatch.setattr(policy, "reads_values", lambda t: False)
    x, mask = torch.randn(3, 4, E), padding([4, 1, 1], 4)
    plan = headwise.MultiHeadAttention(E, H).plan(x, mask)
    assert (plan.path, plan.lengths) == ("dense", None)
    assert plan.why == ("the padding share of a cpu mask is not read: it would sync the host with the device on "
                        "every call (packing=True packs anyway)")
    assert headwise.MultiHeadAttention(E, H, packing=True).plan(x, mask).path == "packed"


def test_a_meta_mask_is_not_packed_by_request_either():
    """A meta mask has no values at all: the dense path, whatever ``packing`` says (the shapes are the same)."""
    x = torch.randn(3, 4, E, device="meta")
    mask = torch.ones(3, 4, dtype=torch.bool, device="meta")
    for requested in ("auto", True, False):
        plan = headwise.MultiHeadAttention(E, H, device="meta", packing=requested).plan(x, mask)
        assert (plan.path, plan.lengths) == ("dense", None)
        assert plan.why == ("a meta mask holds no values to pack by: the dense path gives the same shapes "
                            f"(packing={requested!r} applies on a device with data)")


def test_under_torch_compile_auto_does_not_pack(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    mha = headwise.MultiHeadAttention(E, H)
    plan = mha.plan(torch.randn(3, 4, E), padding([4, 1, 1], 4))
    assert (plan.path, plan.lengths) == ("dense", None)
    assert plan.why == "under torch.compile: packing needs data-dependent shapes (packing=True packs anyway)"


EXPENSIVE = policy.Costs(call_us=1e6, pack_us=1e6, bucket_us=1e6, gemm_ps=1.0, attn_ps=1.0, copy_ps=1.0)
CHEAP = policy.Costs(call_us=0.0, pack_us=0.0, bucket_us=0.0, gemm_ps=1.0, attn_ps=1.0, copy_ps=0.0)


@pytest.mark.parametrize("grad_mode, x_grad, frozen, training", [
    (True, False, False, True),  # the module's parameters take gradients
    (True, True, True, True),  # only x does
    (True, False, True, False),  # nothing would take a gradient
    (False, True, False, False),  # no grad mode
])
def test_auto_prices_forward_and_backward_only_where_gradients_flow(grad_mode, x_grad, frozen, training,
                                                                     monkeypatch):
    """Training is priced with TRAINING_COSTS, inference with INFERENCE_COSTS: with one set
    cheap and the other dear, the path says which set was read."""
    monkeypatch.setattr(policy, "TRAINING_COSTS", CHEAP if training else EXPENSIVE)
    monkeypatch.setattr(policy, "INFERENCE_COSTS", EXPENSIVE if training else CHEAP)
    mha = headwise.MultiHeadAttention(E, H).requires_grad_(not frozen)
    x = torch.randn(3, 4, E, requires_grad=x_grad)
    lengths = (4, 2, 1)
    with torch.set_grad_enabled(grad_mode):
        plan = mha.plan(x, padding(list(lengths), 4))
    kind = "forward + backward" if training else "forward"
    estimate = policy.estimate_packing(3, 4, E, H, H, packing.bucket_shapes(lengths, lengths), training=training,
                                       costs=CHEAP)
    assert (plan.path, plan.why) == ("packed", f"42% of the batch is padding; {kind} {estimate}; {BUILT_IN}")


ATTENTION_ONLY = policy.Costs(call_us=0.0, pack_us=0.0, bucket_us=0.0, gemm_ps=0.0, attn_ps=1e3, copy_ps=0.0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_estimate_prices_the_modules_own_shape(is_causal, monkeypatch):
    """The estimate quoted is the one for this module's E, H, Hkv, the causal flag in effect
    (causal attention computes half the scores) and the batch's lengths and S."""
    monkeypatch.setattr(policy, "INFERENCE_COSTS", ATTENTION_ONLY)
    mha = headwise.MultiHeadAttention(64, 8, num_kv_heads=2)
    lengths = (6, 3, 1, 6)
    with torch.no_grad():
        plan = mha.plan(torch.randn(4, 6, 64), padding(list(lengths), 6), is_causal=is_causal)
    estimate = policy.estimate_packing(4, 6, 64, 8, 2, packing.bucket_shapes(lengths, lengths), is_causal=is_causal,
                                       costs=ATTENTION_ONLY)
    assert estimate.dense_us == pytest.approx(18.432 * (0.5 if is_causal else 1))  # 4 x 6 x 6 x 64 x 2 at 1 ns
    assert (plan.path, plan.why) == ("packed", f"33% of the batch is padding; forward {estimate}; {BUILT_IN}")


def test_below_pack_min_padding_nothing_is_priced_and_at_it_packing_is(monkeypatch, cheap_packing):
    """PACK_MIN_PADDING is read on every call: below it "auto" stays dense without pricing;
    a batch with exactly that share of padding is priced (and, cheap, packed)."""
    mha = headwise.MultiHeadAttention(E, H)
    x, mask = torch.randn(4, 4, E), padding([4, 4, 2, 2], 4)  # 4 of 16 positions: 25%
    with torch.no_grad():
        monkeypatch.setattr(policy, "PACK_MIN_PADDING", 0.25)
        plan = mha.plan(x, mask)
        assert (plan.path, plan.why[:54]) == ("packed", "25% of the batch is padding; forward estimated packed ")
        monkeypatch.setattr(policy, "PACK_MIN_PADDING", 0.26)
        plan = mha.plan(x, mask)
    assert (plan.path, plan.why) == ("dense", "25% of the batch is padding (< PACK_MIN_PADDING 26%): nothing to save")


def test_a_share_of_padding_equal_to_pack_min_padding_is_priced(cheap_packing):
    mha = headwise.MultiHeadAttention(E, H)
    with torch.no_grad():
        plan = mha.plan(torch.randn(4, 5, E), padding([5, 5, 5, 3], 5))  # 2 of 20 positions: 10%
    assert plan.path == "packed", plan.why


def test_a_changed_bucketing_policy_is_priced_afresh(monkeypatch, cheap_packing):
    """The packing price of a batch shape is remembered, but not past a change of the
    bucketing policy: the attention calls quoted are those of the current BUCKET_SLACK."""
    mha = headwise.MultiHeadAttention(E, H)
    x, mask = torch.randn(3, 8, E), padding([8, 7, 2], 8)
    with torch.no_grad():
        assert "(2 attention calls)" in mha.plan(x, mask).why  # 8 and 7 share a bucket
        monkeypatch.setattr(policy, "BUCKET_SLACK", 0.0)
        assert "(3 attention calls)" in mha.plan(x, mask).why
        monkeypatch.setattr(policy, "BUCKET_SLACK", 0.15)
        monkeypatch.setattr(policy, "DIRECT_MIN_LENGTH", 7)  # from 7 tokens on a sequence attends alone
        assert "(3 attention calls)" in mha.plan(x, mask).why


def test_changed_unit_costs_are_priced_afresh(monkeypatch):
    mha = headwise.MultiHeadAttention(E, H)
    x, mask = torch.randn(3, 4, E), padding([4, 2, 1], 4)
    with torch.no_grad():
        monkeypatch.setattr(policy, "INFERENCE_COSTS", EXPENSIVE)
        assert mha.plan(x, mask).path == "dense"
        monkeypatch.setattr(policy, "INFERENCE_COSTS", CHEAP)
        assert mha.plan(x, mask).path == "packed"


def test_price_packing_reports_the_share_and_the_estimate():
    buckets = packing.bucket_shapes((4, 2, 1), (4, 2, 1))
    args = (4, E, H, H, False, False)
    estimate = policy.estimate_packing(3, 4, E, H, H, buckets, costs=CHEAP)
    assert planning.price_packing((4, 2, 1), *args, CHEAP, 0.1, (0.15, 128)) == (
        "packed", f"42% of the batch is padding; forward {estimate}")
    dear = policy.estimate_packing(3, 4, E, H, H, buckets, training=True, costs=EXPENSIVE)
    assert planning.price_packing((4, 2, 1), 4, E, H, H, False, True, EXPENSIVE, 0.1, (0.15, 128)) == (
        "dense", f"42% of the batch is padding, but forward + backward {dear}")
    assert planning.price_packing((4, 2, 1), *args, CHEAP, 0.5, (0.15, 128)) == (
        "dense", "42% of the batch is padding (< PACK_MIN_PADDING 50%): nothing to save")
    assert planning.price_packing((), *args, CHEAP, 0.1, (0.15, 128))[0] == "dense"  # B = 0: no padding


def test_a_small_cross_attention_call_without_gradients_is_not_fused(ref):
    """The fused op attends x to itself: a small call with a context, even without gradients
    or a mask, stays on the dense path and attends to the context."""
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, context = torch.randn(2, 3, E), torch.randn(2, 5, E)
    with torch.no_grad():
        assert mha.plan(x).path == "fused"  # the same call without a context
        plan = mha.plan(x, context=context)
        assert (plan.path, plan.why) == ("dense", NOTHING_TO_PACK)
        close(mha(x, context=context), expected(mha, x, context=context, ref=ref))


def test_a_single_position_of_a_causal_module_is_fused_and_stays_causal():
    """One query sees every key under the causal rule: the fused op may run it, and the plan
    keeps the module's causal flag."""
    mha = headwise.MultiHeadAttention(E, H, is_causal=True).eval()
    with torch.no_grad():
        plan = mha.plan(torch.randn(4, 1, E))  # 4 x 1 x 32 elements: enough to pay for the weight copy
        assert (plan.path, plan.is_causal) == ("fused", True)
        assert mha.plan(torch.randn(4, 3, E)).path == "dense"


# auto_grid's B=32 S=32 E=128 row with 48% padding: priced packed 4,910 us vs dense 4,936 us in
# training with the unit costs of this stop, where packed ran 1.12-1.18x the dense path
CLOSE_LENGTHS = (2, 2, 3, 3, 3, 4, 8, 9, 11, 13, 13, 14, 15, 15, 16, 16, 17, 18, 19, 20, 21, 21, 21, 24, 25, 25, 26,
                 28, 28, 28, 29, 32)
CLOSE_COSTS = policy.Costs(call_us=181.2, pack_us=72.6, bucket_us=176.0, gemm_ps=56.7, attn_ps=79.1, copy_ps=1091.0)


def test_a_close_packing_price_stays_dense_under_the_margin():
    args = (CLOSE_LENGTHS, 32, 128, 2, 2, False, True, CLOSE_COSTS, 0.1, (0.15, 128))
    estimate = policy.estimate_packing(32, 32, 128, 2, 2, packing.bucket_shapes(CLOSE_LENGTHS, CLOSE_LENGTHS),
                                       is_causal=False, training=True, costs=CLOSE_COSTS)
    assert 0.9 * estimate.dense_us < estimate.packed_us < estimate.dense_us  # packing priced lower, but close
    assert planning.price_packing(*args, margin=1.0)[0] == "packed"
    assert planning.price_packing(*args, margin=0.9) == (
        "dense", f"48% of the batch is padding, but forward + backward {estimate} (packing pays under PACK_MARGIN "
                 "90% of dense)")
    far = planning.price_packing(*args[:7], policy.Costs(call_us=181.2, pack_us=1.0, bucket_us=1.0, gemm_ps=56.7,
                                                         attn_ps=79.1, copy_ps=1.0), *args[8:], margin=0.9)
    assert far[0] == "packed"  # cheap packing clears the margin


def test_the_module_reads_pack_margin_from_the_policy(monkeypatch):
    mha = headwise.MultiHeadAttention(128, 2)
    x = torch.randn(32, 32, 128, requires_grad=True)
    mask = torch.arange(32)[None, :] < torch.tensor(CLOSE_LENGTHS)[:, None]  # (B, S)
    monkeypatch.setattr(policy, "TRAINING_COSTS", CLOSE_COSTS)
    assert mha.plan(x, mask).path == "dense"  # PACK_MARGIN 0.9: too close to pack
    monkeypatch.setattr(policy, "PACK_MARGIN", 1.0)
    assert mha.plan(x, mask).path == "packed"

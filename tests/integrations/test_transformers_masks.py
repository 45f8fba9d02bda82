"""headwise's entry in transformers' AttentionMaskInterface: rules instead of a dense mask.

Legend: B batch, H query heads, S query length, Sk key length, V vocabulary.

The builder is checked against transformers' own ``sdpa_mask`` pair by pair; the models
(small random-weight Llama, Gemma 3 with sliding-window layers, Llama 4 with chunked
layers) against eager attention, float32 at 1e-5 on the rows that have a key to attend
(a padded query row attends nothing: zeros in headwise, eager's uniform average there).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5", reason="the hf extra is not installed: pip install -e '.[hf]'"
)

from transformers import masking_utils as mu  # noqa: E402

import headwise.integrations.transformers as hw_hf  # noqa: E402
from headwise.evaluate import evaluated_tile_states, mask_tile_states  # noqa: E402
from headwise.integrations.transformers import register  # noqa: E402
from headwise.integrations.transformers_masks import TransformersMask, headwise_mask  # noqa: E402
from headwise.masks import AlignedCausal, Document  # noqa: E402
from headwise.tiles import Bounds  # noqa: E402

ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()


def test_register_maps_the_mask_interface_to_headwise_mask():
    assert mu.AttentionMaskInterface._global_mapping["headwise"] is headwise_mask


# ---------------------------------------------------------------- the builder, pair by pair


def _dense(mask, B: int, S: int, Sk: int) -> torch.Tensor:
    """A mask_mod on the whole grid: bool (B, 1, S, Sk)."""
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long)
    q, kv = torch.arange(S).view(1, 1, S, 1), torch.arange(Sk).view(1, 1, 1, Sk)
    return mask(b, h, q, kv).expand(B, 1, S, Sk)


_PADDED = torch.ones(2, 10, dtype=torch.bool)
_PADDED[1, :3] = False  # row 1 left-padded
_PACKED = torch.tensor([[5, 6, 7, 0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])  # (B, S) position_ids


def _packed(rule):
    """transformers' packed-sequence composition (create_causal_mask's, without a cache)."""
    ids = mu.find_packed_sequence_indices(_PACKED)
    return mu.and_masks(mu.remap_positions_for_packed_sequence(rule, _PACKED), mu.packed_sequence_mask_function(ids))


CASES = {
    "causal, padding, a cache": dict(q_length=4, kv_length=10, q_offset=6, mask_function=mu.causal_mask_function,
                                     attention_mask=_PADDED),
    "decode step, keys past the 2-D mask": dict(q_length=1, kv_length=12, q_offset=9,
                                                mask_function=mu.causal_mask_function, attention_mask=_PADDED),
    "static cache prefill": dict(q_length=5, kv_length=10, mask_function=mu.causal_mask_function,
                                 attention_mask=_PADDED[:, :5]),
    "sliding window cache": dict(q_length=4, kv_length=7, q_offset=6, kv_offset=3,
                                 mask_function=mu.sliding_window_causal_mask_function(4), attention_mask=_PADDED),
    "sliding window, padding": dict(q_length=10, kv_length=10, mask_function=mu.sliding_window_causal_mask_function(3),
                                    attention_mask=_PADDED),
    "chunked, left padding": dict(q_length=10, kv_length=10, attention_mask=_PADDED,
                                  mask_function=mu.chunked_causal_mask_function(3, torch.tensor([0, 3]))),
    "chunked, a cache": dict(q_length=3, kv_length=10, q_offset=7, attention_mask=_PADDED,
                             mask_function=mu.chunked_causal_mask_function(4, torch.tensor([0, 3]))),
    "packed causal": dict(q_length=10, kv_length=10, mask_function=_packed(mu.causal_mask_function)),
    "packed sliding window": dict(q_length=10, kv_length=10,
                                  mask_function=_packed(mu.sliding_window_causal_mask_function(2))),
    "packed chunked": dict(q_length=10, kv_length=10,
                           mask_function=_packed(mu.chunked_causal_mask_function(2, torch.tensor([0, 0])))),
    "bidirectional, padding": dict(q_length=10, kv_length=10, mask_function=mu.bidirectional_mask_function,
                                   attention_mask=_PADDED),
    "a model's own part": dict(q_length=6, kv_length=10, q_offset=4, attention_mask=_PADDED,
                               mask_function=mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv % 3 == 0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_builder_equals_sdpa_mask(case):
    args = dict(batch_size=2, **CASES[case])
    ours = headwise_mask(**args, allow_is_causal_skip=False)
    theirs = mu.sdpa_mask(**args, allow_is_causal_skip=False)  # (B, 1, S, Sk) bool
    assert isinstance(ours, TransformersMask)
    assert torch.equal(_dense(ours, 2, args["q_length"], args["kv_length"]), theirs)
    kwargs = ours.attention_kwargs(2, args["q_length"], args["kv_length"])  # the same rule, as headwise's arguments
    allowed = torch.ones_like(theirs)
    if kwargs["attention_mask"] is not None:
        assert kwargs["attention_mask"].shape == (2, 1, 1, args["kv_length"])  # key padding only: never dense
        allowed = allowed & kwargs["attention_mask"]
    if kwargs["is_causal"]:
        Sk, S = args["kv_length"], args["q_length"]
        allowed = allowed & _dense(AlignedCausal(Sk - S, kwargs["window"]), 2, S, Sk)
    if kwargs["mask_mod"] is not None:
        allowed = allowed & _dense(kwargs["mask_mod"], 2, args["q_length"], args["kv_length"])
    assert torch.equal(allowed, theirs)


@pytest.mark.parametrize("case", list(CASES))
def test_builder_tiles_are_its_pairs(case):
    args = dict(batch_size=2, **CASES[case])
    ours = headwise_mask(**args, allow_is_causal_skip=False)
    bounds = Bounds(args["q_length"], args["kv_length"], 2, 3)
    known = mask_tile_states(ours, bounds, 2, 1)  # from block bounds
    evaluated = evaluated_tile_states(ours.__call__, bounds, 2, 1)  # pair by pair
    assert torch.equal(known.expand_as(evaluated), evaluated)


def test_builder_recognises_parts_and_falls_back_pair_by_pair():
    kw = headwise_mask(batch_size=2, **CASES["sliding window cache"]).attention_kwargs(2, 4, 7)
    assert (kw["is_causal"], kw["window"], kw["mask_mod"], kw["attention_mask"]) == (True, 4, None, None)
    kw = headwise_mask(batch_size=2, **CASES["static cache prefill"]).attention_kwargs(2, 5, 10)
    assert isinstance(kw["mask_mod"], AlignedCausal) and kw["mask_mod"].offset == 0 and not kw["is_causal"]
    kw = headwise_mask(batch_size=2, **CASES["packed causal"]).attention_kwargs(2, 10, 10)
    assert kw["is_causal"] and isinstance(kw["mask_mod"], Document)
    assert kw["mask_mod"].segments(10, 10) == [[3, 2, 5], [6, 4]]
    own = headwise_mask(batch_size=2, **CASES["a model's own part"])
    assert "transformers or_masks" in repr(own)


def test_builder_returns_none_where_is_causal_does_it():
    assert headwise_mask(2, 7, 7) is None  # plain causal, no padding: the attention function's is_causal
    assert headwise_mask(2, 1, 9, q_offset=8) is None  # one query after its cache: every key
    assert headwise_mask(2, 7, 7, mask_function=mu.sliding_window_causal_mask_function(7)) is None  # window >= Sk
    assert headwise_mask(2, 7, 7, allow_is_causal_skip=False) is not None
    assert headwise_mask(2, 3, 9, q_offset=6) is not None  # S < Sk: None would read as an empty static cache
    assert headwise_mask(2, 7, 7, mask_function=mu.sliding_window_causal_mask_function(3)) is not None
    assert headwise_mask(2, 7, 7, mask_function=mu.bidirectional_mask_function, allow_is_causal_skip=False,
                         allow_is_bidirectional_skip=True) is None


def test_builder_builds_dense_for_vmap_functions():
    args = dict(batch_size=2, q_length=4, kv_length=4, mask_function=mu.causal_mask_function,
                allow_is_causal_skip=False)
    ours = headwise_mask(**args, use_vmap=True)
    assert torch.equal(ours, mu.sdpa_mask(**args, use_vmap=True))  # the model's own vmap parts: as sdpa builds them


def test_a_prepared_mask_passes_through_the_builder():
    mask = headwise_mask(2, 4, 10, q_offset=6, attention_mask=_PADDED)
    assert (mask.shape, mask.ndim) == ((2, 1, 4, 10), 4)  # the dense mask's it stands for
    assert headwise_mask(2, 4, 10, q_offset=6, attention_mask=mask) is mask  # generate's masks prepared ahead


def test_mask_refuses_another_shape():
    mask = headwise_mask(2, 4, 10, q_offset=6, attention_mask=_PADDED)
    with pytest.raises(ValueError, match=r"built for \(B, S, Sk\) = \(2, 4, 10\), but attention got \(2, 4, 8\)"):
        mask.attention_kwargs(2, 4, 8)


# ---------------------------------------------------------------- models against eager


def _model(config, impl):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same random weights for every implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gemma3_config():
    from transformers import Gemma3TextConfig

    # sliding_window=4 on layer 0, full attention on layer 1; sequences of 12 and more
    return Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama4_config():
    from transformers import Llama4TextConfig

    # attention_chunk_size=4: layer 0 chunked (with RoPE), layer 1 full (without)
    return Llama4TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1,
                            attention_chunk_size=4, no_rope_layers=[1, 0], max_position_embeddings=64,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2)


CONFIGS = {"llama": _llama_config, "gemma3": _gemma3_config, "llama4": _llama4_config}


@pytest.fixture(scope="module")
def padded_batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 12))  # (B, S)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as generation uses
    return ids, mask


@pytest.mark.parametrize("family", list(CONFIGS))
def test_padded_batch_logits_equal_eager(family, padded_batch):
    ids, mask = padded_batch
    config = CONFIGS[family]()
    with torch.no_grad():
        ours = _model(config, "headwise")(input_ids=ids, attention_mask=mask).logits  # (B, S, V)
        eager = _model(config, "eager")(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours[real], eager[real], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_output_attentions_equal_eager(family, padded_batch):
    ids, mask = padded_batch
    config = CONFIGS[family]()
    with torch.no_grad():
        ours = _model(config, "headwise")(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        eager = _model(config, "eager")(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    real = mask.bool()
    for a, b in zip(ours, eager, strict=True):  # (B, H, S, Sk) per layer
        torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=ATOL, rtol=ATOL)


def test_the_attention_function_gets_rules_not_a_dense_mask(padded_batch, monkeypatch):
    seen = []
    headwise_attention = hw_hf.attention

    def spy(q, k, v, mask, **kwargs):
        seen.append((None if mask is None else tuple(mask.shape), kwargs["is_causal"], kwargs["window"],
                     type(kwargs["mask_mod"]).__name__))
        return headwise_attention(q, k, v, mask, **kwargs)

    received = []
    forward = hw_hf.headwise_attention_forward

    def forward_spy(module, q, k, v, attention_mask, *args, **kwargs):
        received.append(type(attention_mask).__name__)
        return forward(module, q, k, v, attention_mask, *args, **kwargs)

    monkeypatch.setattr(hw_hf, "attention", spy)
    monkeypatch.setattr(hw_hf, "headwise_attention_forward", forward_spy)
    ids, mask = padded_batch
    with torch.no_grad():
        _model(_gemma3_config(), "headwise")(input_ids=ids, attention_mask=mask)
        _model(_llama4_config(), "headwise")(input_ids=ids, attention_mask=mask)
    assert received == ["TransformersMask"] * 4
    assert seen == [((2, 1, 1, 12), True, 4, "NoneType"), ((2, 1, 1, 12), True, None, "NoneType"),  # Gemma 3
                    ((2, 1, 1, 12), True, None, "Chunks"), ((2, 1, 1, 12), True, None, "NoneType")]  # Llama 4


def _documents(S: int = 12):
    """One row holding 3 documents (4, 3 and 5 tokens): position_ids restart at 0."""
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (1, S))  # (1, S)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    return ids, position_ids, [(0, 4), (4, 7), (7, 12)]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_packed_row_equals_eager_and_each_document_alone(family, monkeypatch):
    ids, position_ids, spans = _documents()
    config = CONFIGS[family]()
    mods = []
    headwise_attention = hw_hf.attention

    def spy(q, k, v, mask, **kwargs):
        mods.append(kwargs["mask_mod"])
        return headwise_attention(q, k, v, mask, **kwargs)

    monkeypatch.setattr(hw_hf, "attention", spy)
    with torch.no_grad():  # without a cache: transformers looks for packing only then
        ours = _model(config, "headwise")(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        eager_model = _model(config, "eager")
        eager = eager_model(input_ids=ids, position_ids=position_ids, use_cache=False).logits  # (1, S, V)
        alone = torch.cat([eager_model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in spans], dim=1)
    torch.testing.assert_close(eager, alone, atol=ATOL, rtol=ATOL)  # eager 5.x detects the packing itself
    torch.testing.assert_close(ours, eager, atol=ATOL, rtol=ATOL)
    assert all(isinstance(m, Document) and m.segments(12, 12) == [[4, 3, 5]] for m in mods)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_decoding_with_a_cache_equals_eager(family, padded_batch):
    ids, mask = padded_batch
    config = CONFIGS[family]()
    out = {}
    for impl in ("headwise", "eager"):
        out[impl] = _model(config, impl).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                                   do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out["headwise"].sequences, out["eager"].sequences)
    for a, b in zip(out["headwise"].logits, out["eager"].logits, strict=True):  # (B, V) per step
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_decoding_with_a_static_cache_equals_eager(padded_batch):
    ids, mask = padded_batch
    out = {}
    for impl in ("headwise", "eager"):
        out[impl] = _model(_llama_config(), impl).generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
            output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out["headwise"].sequences, out["eager"].sequences)
    for a, b in zip(out["headwise"].logits, out["eager"].logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)

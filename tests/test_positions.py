"""Rotary embeddings against a direct float64 rotation of each pair (i, i + D/2)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise
from headwise.positions import RotaryEmbedding, apply_rotary


def rotate_pairs_float64(x, start, base):
    """The rotation formula itself: pair (i, i + D/2) at position p turns by p * base^(-2i/D)."""
    x = x.double()
    B, H, S, D = x.shape
    out = torch.empty_like(x)
    half = D // 2
    for p in range(S):
        for i in range(half):
            angle = (start + p) * base ** (-2 * i / D)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, :, p, i], x[:, :, p, i + half]
            out[:, :, p, i] = a * c - b * s
            out[:, :, p, i + half] = a * s + b * c
    return out


@pytest.mark.parametrize("start", [0, 7, 300])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_matches_the_rotation_formula(start, base):
    x = torch.randn(2, 3, 5, 8)
    got = RotaryEmbedding(8, base)(x, start=start)
    torch.testing.assert_close(got.double(), rotate_pairs_float64(x, start, base), atol=1e-5, rtol=1e-5)
    got64 = RotaryEmbedding(8, base)(x.double(), start=start)
    torch.testing.assert_close(got64, rotate_pairs_float64(x, start, base), atol=1e-12, rtol=1e-12)


@given(shift=st.integers(0, 1000), i=st.integers(0, 5), j=st.integers(0, 5))
def test_scores_depend_only_on_relative_position(shift, i, j):
    """<R(p) q, R(p') k> depends on p - p' only: the reason RoPE exists."""
    rope = RotaryEmbedding(16)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, generator=gen, dtype=torch.float64)
    qs = rope(q.expand(1, 1, 6, 16), start=0)
    ks = rope(k.expand(1, 1, 6, 16), start=0)
    qs2 = rope(q.expand(1, 1, 6, 16), start=shift)
    ks2 = rope(k.expand(1, 1, 6, 16), start=shift)
    a = (qs[0, 0, i] * ks[0, 0, j]).sum()
    b = (qs2[0, 0, i] * ks2[0, 0, j]).sum()
    torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_module_applies_rope_to_q_and_k():
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(16, 2, rope=True, backend="matmul").eval()
    x = torch.randn(1, 4, 16)
    with headwise.trace() as t:
        mha(x)
    assert "rotary positions" in t.names()
    # by hand: project, split, rotate, attend
    q = mha.q_proj(x).reshape(1, 4, 2, 8).transpose(1, 2)
    k = mha.k_proj(x).reshape(1, 4, 2, 8).transpose(1, 2)
    v = mha.v_proj(x).reshape(1, 4, 2, 8).transpose(1, 2)
    q, k = rotate_pairs_float64(q, 0, 10000.0).float(), rotate_pairs_float64(k, 0, 10000.0).float()
    out = headwise.attention(q, k, v).transpose(1, 2).reshape(1, 4, 16)
    torch.testing.assert_close(mha(x), mha.out_proj(out), atol=1e-5, rtol=1e-5)


def test_errors():
    with pytest.raises(ValueError, match=r"even head_dim, got 5"):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match=r"rope_base must be positive, got -1"):
        headwise.MultiHeadAttention(16, 2, rope_base=-1)
    with pytest.raises(ValueError, match=r"rotary embeddings \(rope\) are for self-attention"):
        headwise.MultiHeadAttention(16, 2, rope=True)(torch.randn(1, 2, 16), context=torch.randn(1, 3, 16))


def test_the_default_base_is_ropes_10000():
    assert RotaryEmbedding(8).base == 10000.0 and headwise.MultiHeadAttention(16, 2, rope=True).rope.base == 10000.0


def test_base_must_be_positive_but_may_be_below_one():
    with pytest.raises(ValueError, match="rope_base must be positive, got 0"):
        RotaryEmbedding(8, base=0)
    assert RotaryEmbedding(8, base=0.5).base == 0.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_rotation_keeps_the_inputs_dtype_and_device(dtype):
    rope = RotaryEmbedding(8)
    for device in ("cpu", "meta"):  # on meta, a table built on the default device would raise
        out = rope(torch.ones(1, 2, 3, 8, dtype=dtype, device=device), start=2)
        assert (out.dtype, out.device.type) == (dtype, device)
    packed = rope.at(torch.ones(4, 2, 8, dtype=dtype), torch.tensor([0, 1, 2, 0]))  # reads the positions' values
    assert packed.dtype == dtype


def test_no_packed_tokens_rotate_to_nothing():
    out = RotaryEmbedding(8).at(torch.empty(0, 2, 8), torch.empty(0, dtype=torch.long))
    assert out.shape == (0, 2, 8)


def test_positions_start_at_zero_by_default():
    x = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(4))
    rope = RotaryEmbedding(8)
    assert torch.equal(rope(x), rope(x, start=0)) and not torch.allclose(rope(x), rope(x, start=1))


# --- scaling and partial rotary against Hugging Face transformers ----------------------------

HEAD_DIM, MAX_POS, ORIGINAL = 32, 256, 64  # small lengths, so scaled and unscaled frequencies both occur
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 0.9},
}


def _hf_config(scaling, fraction=1.0, theta=1000.0):
    from transformers import LlamaConfig

    params = dict(scaling, rope_theta=theta, partial_rotary_factor=fraction)
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                       max_position_embeddings=MAX_POS, rope_parameters=params)


def _ours(scaling, fraction=1.0, theta=1000.0):
    params = dict(scaling, rope_theta=theta, partial_rotary_factor=fraction)
    if scaling["rope_type"] == "dynamic":
        params["max_position_embeddings"] = MAX_POS  # the config field dynamic NTK reads beside the dict
    return RotaryEmbedding(HEAD_DIM, scaling=params)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_and_attention_scaling_equal_transformers(name, fraction):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding  # its default reads partial_rotary_factor

    scaling = SCALINGS[name]
    config = _hf_config(scaling, fraction)
    init = ROPE_INIT_FUNCTIONS.get(scaling["rope_type"], PhiRotaryEmbedding.compute_default_rope_parameters)
    hf_inv, hf_scaling = init(config, device=None)
    rope = _ours(scaling, fraction)
    ours = rope.inv_freq(dtype=torch.float64)
    assert ours.shape == hf_inv.shape == (int(HEAD_DIM * fraction) // 2,)
    # transformers computes in float32: equal to its precision
    torch.testing.assert_close(ours, hf_inv.double(), rtol=2e-7, atol=0)
    assert rope.attention_scaling == pytest.approx(hf_scaling, rel=1e-12)
    if name != "default":  # the scaling really changes something (dynamic: beyond the original length)
        scaled = rope.inv_freq(seq_len=2 * MAX_POS) if name == "dynamic" else ours
        assert not torch.allclose(scaled, _ours(SCALINGS["default"], fraction).inv_freq(), rtol=1e-3)


def _hf_rotary(cls_path, config):
    module, cls = cls_path.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)(config)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn-mscale"])
def test_cos_sin_and_rotated_q_k_equal_llamas_rotary_embedding(name):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = LlamaRotaryEmbedding(_hf_config(SCALINGS[name]))
    rope = _ours(SCALINGS[name])
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 1, 3, 40, HEAD_DIM, generator=gen)  # (B, H, S, D) each
    positions = torch.arange(7, 47)  # (S,)
    cos, sin = hf(q, positions[None])  # (1, S, D)
    ours_cos, ours_sin = rope.cos_sin(positions, torch.float32)
    torch.testing.assert_close(ours_cos, cos[0], atol=2e-6, rtol=0)
    torch.testing.assert_close(ours_sin, sin[0], atol=2e-6, rtol=0)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rotary(q, ours_cos, ours_sin), hf_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope(k, start=7), hf_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["gpt_neox", "phi"])
def test_partial_rotary_equals_gpt_neox_and_phi(model):
    pytest.importorskip("transformers")
    from transformers import GPTNeoXConfig, PhiConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

    if model == "gpt_neox":  # rotary_pct 0.25 of a 32-dim head: 8 dims rotate
        config = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25, rotary_emb_base=500)
        hf, R = GPTNeoXRotaryEmbedding(config), 8
    else:  # Phi-2's factor 0.4 of an 80-dim head: 32 dims rotate
        from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

        config = PhiConfig(hidden_size=160, num_attention_heads=2, partial_rotary_factor=0.4)
        hf, R = PhiRotaryEmbedding(config), 32
    D = config.hidden_size // config.num_attention_heads
    rope = RotaryEmbedding(D, scaling=config.rope_parameters)
    assert rope.rotary_dim == R and rope.base == config.rope_parameters["rope_theta"]
    q = torch.randn(1, 2, 9, D, generator=torch.Generator().manual_seed(6))
    cos, sin = hf(q, torch.arange(9)[None])  # (1, S, R)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)  # GPT-NeoX's: rotates [..., :R], passes the rest
    got = rope(q)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[..., R:], q[..., R:])
    assert torch.equal(RotaryEmbedding(D, rotary_dim=R, base=rope.base)(q), got)  # rotary_dim= is the same


def test_partial_rotary_matches_the_rotation_formula_on_its_dims():
    x = torch.randn(2, 3, 5, 12, dtype=torch.float64)
    got = RotaryEmbedding(12, 500.0, rotary_dim=8)(x, start=3)
    torch.testing.assert_close(got[..., :8], rotate_pairs_float64(x[..., :8], 3, 500.0), atol=1e-12, rtol=1e-12)
    assert torch.equal(got[..., 8:], x[..., 8:])


@pytest.mark.parametrize("length", [40, 64, 100, 300])  # below, at and above max_position_embeddings (64 here)
def test_dynamic_ntk_at_lengths_below_and_above_the_original(length):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=64,
                         rope_parameters=dict(params))
    hf = LlamaRotaryEmbedding(config)
    rope = RotaryEmbedding(32, scaling={**params, "max_position_embeddings": 64})
    x = torch.empty(1, length, 32)
    cos, sin = hf(x, torch.arange(length)[None])  # (1, L, D): frequencies for this length
    ours_cos, ours_sin = rope.angles(0, length, torch.float32)
    torch.testing.assert_close(ours_cos, cos[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(ours_sin, sin[0], atol=2e-5, rtol=0)
    plain_cos, _ = RotaryEmbedding(32, 1000.0).angles(0, length, torch.float32)
    assert torch.equal(ours_cos, plain_cos) == (length <= 64)  # the base grows only beyond the original length


def test_dynamic_ntk_decoding_steps_follow_transformers():
    """Step t of a decode (position t, length t + 1) uses the frequencies of length t + 1, as
    transformers' rotary embedding recomputes them while generating; earlier keys keep theirs."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1000.0}
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=8,
                                          rope_parameters=dict(params)))
    rope = RotaryEmbedding(16, scaling={**params, "max_position_embeddings": 8})
    x = torch.empty(1, 1, 16)
    for t in range(16):
        cos, _ = hf(x, torch.tensor([[t]]))
        ours, _ = rope.angles(t, 1, torch.float32)
        torch.testing.assert_close(ours, cos[0], atol=2e-6, rtol=0)
        tensor_len, _ = rope.cos_sin(torch.tensor([t]), torch.float32, seq_len=torch.tensor(t + 1))  # static cache
        torch.testing.assert_close(tensor_len, ours, atol=1e-6, rtol=0)


def test_yarn_factor_none_comes_from_the_config_lengths_and_type_is_rope_type():
    rope = RotaryEmbedding(16, scaling={"type": "yarn", "factor": None, "original_max_position_embeddings": 64,
                                        "max_position_embeddings": 256})
    assert rope.rope_type == "yarn" and rope.scaling["factor"] == 4.0
    assert rope.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    assert "yarn scaling (factor=4" in rope.describe() and "attention factor 1.13863" in rope.describe()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"scaling": {"rope_type": "longrope"}}, ValueError,
     r"rope_type 'longrope' is not supported; choose one of 'default', 'linear', 'dynamic', 'llama3', 'yarn'"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0}}, ValueError,
     r"rope_parameters for rope_type 'llama3' lack the keys \['high_freq_factor', 'low_freq_factor', "
     r"'original_max_position_embeddings'\]"),
    ({"scaling": {"rope_type": "dynamic", "factor": 2.0}}, ValueError,
     r"lack the keys \['max_position_embeddings'\]; add the model config's max_position_embeddings"),
    ({"scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0, "fctor": 3}}, ValueError,
     r"rope_parameters keys \['fctor', 'low_freq_factor'\] are not used by rope_type 'linear' \(it reads "
     r"\['factor', 'partial_rotary_factor', 'rope_theta', 'rope_type'\]\); remove them"),
    ({"scaling": {"rope_type": "linear", "factor": "2"}}, ValueError,
     r"rope_parameters\['factor'\] must be a number for rope_type 'linear', got '2'"),
    ({"scaling": {"rope_type": "linear", "factor": None}}, ValueError, r"\['factor'\] must be a number"),
    ({"scaling": {"rope_theta": "1e4"}}, ValueError,
     r"rope_parameters\['rope_theta'\] must be a number for rope_type 'default', got '1e4'"),
    ({"scaling": {"rope_type": "linear", "factor": 0.0}}, ValueError, r"\['factor'\] must be positive, got 0"),
    ({"scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                  "original_max_position_embeddings": 64}}, ValueError,
     r"llama3 rope needs high_freq_factor \(1\) > low_freq_factor \(4\)"),
    ({"scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}}, ValueError,
     r"yarn rope with factor None takes it as max_position_embeddings / original_max_position_embeddings; "
     r"add the key 'max_position_embeddings'"),
    ({"base": 500.0, "scaling": {"rope_theta": 1000.0}}, ValueError,
     r"rope_base \(500\) and rope_parameters\['rope_theta'\] \(1000\) disagree; give one of them"),
    ({"rotary_dim": 8, "scaling": {"partial_rotary_factor": 0.5}}, ValueError,
     r"rotary_dim \(8\) and partial_rotary_factor \(0.5\) x head_dim \(32\) = 16 disagree"),
    ({"scaling": {"partial_rotary_factor": 1.5}}, ValueError,
     r"rope_parameters\['partial_rotary_factor'\] must be in \(0, 1\], got 1.5"),
    ({"rotary_dim": 33}, ValueError, r"rotary_dim must be an int in \[1, head_dim = 32\], got 33"),
    ({"rotary_dim": 0}, ValueError, r"rotary_dim must be an int in \[1, head_dim = 32\], got 0"),
    ({"rotary_dim": 2, "scaling": {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 8}},
     ValueError, r"rotary_dim must exceed 2, got 2"),
    ({"scaling": [("rope_type", "linear")]}, TypeError, r"rope_parameters must be a dict .* got list"),
])
def test_scaling_errors_name_the_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        RotaryEmbedding(32, **kwargs)


def test_an_odd_rotary_dim_rotates_one_more_dim_as_transformers_does():
    rope = RotaryEmbedding(7, rotary_dim=5)
    cos, _ = rope.angles(0, 2, torch.float32)
    assert cos.shape == (2, 6) and rope.inv_freq().shape == (3,)
    with pytest.raises(ValueError, match=r"an odd rotary_dim \(7\) rotates rotary_dim \+ 1 dims, more than "
                                         r"head_dim \(7\); use an even rotary_dim"):
        RotaryEmbedding(7, rotary_dim=7)

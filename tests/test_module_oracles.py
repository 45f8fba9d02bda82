"""The module against formulas written here, in float64: every feature, by value.

Other module tests compare one headwise path with another (decoding with a full forward,
GQA with repeated heads), so a bug shared by both passes them. Here each expectation is
computed from the module's weights with a formula written out in this file: the
projections, the head split, rotary positions, the paper's ALiBi slopes, the window, the
masks and the zero rows. Nothing the checks depend on comes from a headwise helper.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.
"""

from __future__ import annotations

import math

import pytest
import torch

import headwise
from headwise.module import plan as planning

E, H = 48, 8
BACKENDS = ["auto", "matmul", "sdpa", "chunked"]

# The ALiBi paper's slopes, written out: 8 heads take 2^-1 ... 2^-8; 12 heads (not a power
# of two) take those 8, then every other slope of 16 heads (2^-0.5, 2^-1.5, ...).
PAPER_SLOPES = {
    8: [2.0 ** -i for i in range(1, 9)],
    12: [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5],
}


def rotate(x, positions, base):
    """Rotary embedding of x (B, h, L, D) at integer positions (L,), "rotate half" pairs (i, i + D/2)."""
    D = x.shape[-1]
    half = D // 2
    inv_freq = torch.tensor([base ** (-2.0 * i / D) for i in range(half)], dtype=torch.float64)  # (D/2,)
    angle = positions.double()[:, None] * inv_freq[None, :]  # (L, D/2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def scaled_inv_freq(params, R, L):
    """Hugging Face's rope_parameters written out in float64 (transformers.modeling_rope_utils):
    the ceil(R/2) inverse frequencies for a call of length L, and the cos/sin factor."""
    kind, base = params.get("rope_type", "default"), params.get("rope_theta", 10000.0)
    factor = params.get("factor", 1.0)
    if kind == "dynamic":  # the base grows once the call is longer than max_position_embeddings
        longest = params["max_position_embeddings"]
        base = base * (factor * max(L, longest) / longest - (factor - 1)) ** (R / (R - 2))
    inv = [base ** (-2 * i / R) for i in range((R + 1) // 2)]
    if kind == "linear":
        inv = [f / factor for f in inv]
    if kind == "llama3":
        old = params["original_max_position_embeddings"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        out = []
        for f in inv:
            wavelength = 2 * math.pi / f
            if wavelength < old / high:
                out.append(f)
            elif wavelength > old / low:
                out.append(f / factor)
            else:
                smooth = (old / wavelength - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = out
    scale = 1.0
    if kind == "yarn":
        old = params["original_max_position_embeddings"]

        def dim_of(rotations):
            return R * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = math.floor(dim_of(params.get("beta_fast", 32))), math.ceil(dim_of(params.get("beta_slow", 1)))
        lo, hi = max(lo, 0), min(hi, R - 1)
        hi = hi + 0.001 if lo == hi else hi
        keep = [1 - min(max((i - lo) / (hi - lo), 0.0), 1.0) for i in range(len(inv))]  # 1: extrapolate
        inv = [f / factor * (1 - e) + f * e for f, e in zip(inv, keep, strict=True)]
        scale = params.get("attention_factor") or (0.1 * math.log(factor) + 1 if factor > 1 else 1.0)
    return inv, scale


def rotate_scaled(x, positions, lengths, params, R):
    """x (B, h, L, D) at positions (L,), each rotated with the frequencies of its call's length
    ``lengths`` (L,): the first R dims in pairs (i, i + R/2), the rest passed through."""
    half = (R + 1) // 2
    rows = []
    for p, n in zip(positions.tolist(), lengths.tolist(), strict=True):
        inv, scale = scaled_inv_freq(params, R, n)
        rows.append([(p * f, scale) for f in inv])
    angle = torch.tensor([[a for a, _ in r] for r in rows], dtype=torch.float64)  # (L, R/2)
    scale = torch.tensor([r[0][1] for r in rows], dtype=torch.float64)[:, None]  # (L, 1)
    cos, sin = angle.cos() * scale, angle.sin() * scale
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def rms_norm(x, weight, eps):
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight."""
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight


def oracle(mha, x, mask=None, *, context=None, is_causal=False, window=None, slopes=None, rope_base=None,
           zero_padded_queries=True, start=0, rope=None, rope_lengths=None, qk_eps=None):
    """The module's forward in float64 from its weights: (out (B, S, E), weights (B, H, S, Sk)).

    ``mask`` follows the contract: 2-D (B, Sk) key padding, 3-D (B, S, Sk), 4-D (B|1, H|1, S, Sk);
    bool/int True = attend, float additive. ``start`` is the position of x's first token
    (with a cache: the keys are then the whole sequence, x its last S rows). ``rope``:
    (rope_parameters, R) for scaled / partial rotary, each position rotated with the call
    length in ``rope_lengths`` (Sk,) (None: Sk for all). ``qk_eps``: RMSNorm each head's q and k.
    """
    w = {name: p.detach().double() for name, p in mha.state_dict().items()}  # q, k, v projections apart
    x = x.double()
    src = x if context is None else context.double()
    B, S, E = x.shape
    H, Hkv, D = mha.num_heads, mha.num_kv_heads, mha.head_dim
    Sk = src.shape[1]
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).reshape(B, S, H, D).permute(0, 2, 1, 3)
    k = (src @ w["k_proj.weight"].T + w["k_proj.bias"]).reshape(B, Sk, Hkv, D).permute(0, 2, 1, 3)
    v = (src @ w["v_proj.weight"].T + w["v_proj.bias"]).reshape(B, Sk, Hkv, D).permute(0, 2, 1, 3)
    if qk_eps is not None:
        q, k = rms_norm(q, w["q_norm.weight"], qk_eps), rms_norm(k, w["k_norm.weight"], qk_eps)
    if rope is not None:
        params, R = rope
        lengths = torch.full((Sk,), Sk) if rope_lengths is None else rope_lengths
        q = rotate_scaled(q, torch.arange(start, start + S), lengths[Sk - S:], params, R)
        k = rotate_scaled(k, torch.arange(Sk), lengths, params, R)
    if rope_base is not None:
        q = rotate(q, torch.arange(start, start + S), rope_base)
        k = rotate(k, torch.arange(Sk), rope_base)
    kv_head = [h * Hkv // H for h in range(H)]  # query head h reads kv head h // (H / Hkv)
    k, v = k[:, kv_head], v[:, kv_head]  # (B, H, Sk, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, S, Sk)
    allowed = torch.ones(B, H, S, Sk, dtype=torch.bool)
    if mask is not None:
        m = {2: lambda t: t[:, None, None, :], 3: lambda t: t[:, None], 4: lambda t: t}[mask.dim()](mask)
        m = m.expand(B, H, S, Sk)
        if m.is_floating_point():
            allowed &= m != -math.inf
            scores = scores + torch.where(allowed, m.double(), 0.0)
        else:
            allowed &= m != 0
    i = torch.arange(S)[:, None] + (Sk - S)  # each query's position among the keys (bottom-right)
    j = torch.arange(Sk)[None, :]
    if is_causal or window is not None:
        allowed &= j <= i
    if window is not None:
        allowed &= j > i - window
    if slopes is not None:
        scores = scores - torch.tensor(slopes, dtype=torch.float64)[None, :, None, None] * (i - j).abs()
    scores = scores.masked_fill(~allowed, -math.inf)
    live = allowed.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~live, 0.0), dim=-1) * live  # dead rows: zeros
    out = (weights @ v).permute(0, 2, 1, 3).reshape(B, S, E)  # (B, S, H, D) -> (B, S, E)
    out = out @ w["out_proj.weight"].T + w["out_proj.bias"]
    if zero_padded_queries and mask is not None and mask.dim() == 2 and context is None:
        out = out * (mask[:, -S:] != 0)[..., None]  # padded tokens output zeros (the module's contract)
    return out, weights


def _x(B, S, seed):
    return torch.randn(B, S, E, generator=torch.Generator().manual_seed(seed))


def _module(seed, **kwargs):
    torch.manual_seed(seed)
    return headwise.MultiHeadAttention(E, H, **kwargs).eval()


def _close(got, want, atol=2e-5):
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=1e-4)


# --- ALiBi --------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [8, 12])
def test_alibi_slopes_are_the_papers(heads):
    assert headwise.masks.alibi_slopes(heads).double().tolist() == pytest.approx(PAPER_SLOPES[heads], rel=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [8, 12])
def test_module_alibi_matches_the_formula(backend, heads):
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(heads * 4, heads, alibi=True, backend=backend).eval()
    x = torch.randn(2, 7, heads * 4, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    for causal in (False, True):
        want, _ = oracle(mha, x, mask, is_causal=causal, slopes=PAPER_SLOPES[heads])
        with torch.no_grad():
            _close(mha(x, mask, is_causal=causal), want)


# --- window, rope, GQA in self-attention ------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_module_window_matches_the_formula(backend, window, padded):
    mha = _module(2, window=window, num_kv_heads=2, backend=backend)
    x = _x(3, 9, seed=3)
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [0] * 2 + [1] * 7]) if padded else None
    want, _ = oracle(mha, x, mask, window=window)
    with torch.no_grad():
        _close(mha(x, mask), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa", "mqa"])
def test_module_self_attention_with_rope_matches_the_formula(backend, kv_heads):
    mha = _module(4, num_kv_heads=kv_heads, rope_base=500.0, backend=backend)
    x = _x(3, 6, seed=5)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [0] * 6])  # the last row is all padding
    for causal in (False, True):
        want, _ = oracle(mha, x, mask, is_causal=causal, rope_base=500.0)
        with torch.no_grad():
            _close(mha(x, mask, is_causal=causal), want)


# --- cross-attention -----------------------------------------------------------------------

def _cross_mask(form, B, S, Sk, gen):
    if form == "none":
        return None
    if form == "keys2d":  # padding of the context; must never be read as a query mask
        return torch.arange(Sk)[None, :] < torch.tensor([Sk, Sk - 2, 1])[:, None]
    if form == "int3d":
        m = (torch.rand(B, S, Sk, generator=gen) > 0.3).int()
        m[1, 0] = 0  # a query with nothing to attend
        return m
    if form == "float4d":
        return torch.randn(B, 1, S, Sk, generator=gen).masked_fill(torch.rand(B, 1, S, Sk, generator=gen) > 0.7,
                                                                   -math.inf)
    raise AssertionError(form)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["none", "keys2d", "int3d", "float4d"])
@pytest.mark.parametrize("Sk", [5, 8], ids=["S=Sk", "S!=Sk"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_attention_matches_the_formula(backend, form, Sk, causal):
    mha = _module(6, num_kv_heads=4, backend=backend)
    gen = torch.Generator().manual_seed(7)
    x, context = _x(3, 5, seed=8), _x(3, Sk, seed=9)
    mask = _cross_mask(form, 3, 5, Sk, gen)
    want, weights = oracle(mha, x, mask, context=context, is_causal=causal)
    with torch.no_grad():
        _close(mha(x, mask, context=context, is_causal=causal), want)
        if backend in ("auto", "matmul"):
            _, got_weights = mha(x, mask, context=context, is_causal=causal, need_weights=True)
            _close(got_weights, weights, atol=1e-6)


def test_cross_attention_gradients_match_the_formula():
    mha = _module(10, num_kv_heads=2)
    x, context = _x(3, 4, seed=11).requires_grad_(), _x(3, 4, seed=12).requires_grad_()
    mask = _cross_mask("keys2d", 3, 4, 4, None)
    out = mha(x, mask, context=context)
    want, _ = oracle(mha, x, mask, context=context)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(13))
    got = torch.autograd.grad(out, (x, context, mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight), g)
    expected = torch.autograd.grad(want, (x, context), g.double())
    for a, b in zip(got[:2], expected, strict=True):
        _close(a, b.double())
    assert all(w.abs().sum() > 0 for w in got[2:])  # q (from x), k and v (from the context) all learn


# --- decoding with a cache (the README pattern) ----------------------------------------------

PROMPTS = {  # (B, T) prompt masks: rows of 6, 4 and 2 real tokens
    "left": torch.tensor([[1] * 6, [0] * 2 + [1] * 4, [0] * 4 + [1] * 2]),
    "right": torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4]),
}
FEATURES = {
    "plain": {},
    "gqa+rope": {"num_kv_heads": 2, "rope": True},
    "alibi": {"alibi": True},
    "window": {"window": 3, "num_kv_heads": 4},
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding", list(PROMPTS))
@pytest.mark.parametrize("feature", list(FEATURES))
def test_decoding_after_a_padded_prompt_matches_the_formula(backend, padding, feature):
    """Prefill a padded prompt with its mask, then decode steps with no mask: the cache must
    keep applying the prompt's padding, at every step and for need_weights."""
    kwargs = FEATURES[feature]
    mha = _module(14, backend=backend, **kwargs)
    prompt_mask = PROMPTS[padding]
    T, steps = prompt_mask.shape[1], 4
    x = _x(3, T + steps, seed=15)
    full_mask = torch.cat([prompt_mask, torch.ones(3, steps, dtype=prompt_mask.dtype)], dim=1)  # (B, T + steps)
    rope_base = 10000.0 if kwargs.get("rope") else None
    slopes = PAPER_SLOPES[8] if kwargs.get("alibi") else None
    window = kwargs.get("window")
    cache = mha.new_cache(batch_size=3, max_seq_len=T + steps)
    with torch.no_grad():
        got = mha(x[:, :T], prompt_mask, cache=cache, is_causal=True)
        want, _ = oracle(mha, x[:, :T], prompt_mask, is_causal=True, rope_base=rope_base, slopes=slopes,
                         window=window)
        _close(got, want)
        for t in range(T, T + steps):
            weights_too = backend in ("auto", "matmul") and t == T + steps - 1
            got = mha(x[:, t:t + 1], cache=cache, is_causal=True, need_weights=weights_too)
            # the whole sequence so far as keys; this step's token is the last query
            want, weights = oracle(mha, x[:, :t + 1], full_mask[:, :t + 1], is_causal=True, rope_base=rope_base,
                                   slopes=slopes, window=window)
            if weights_too:
                got, got_weights = got
                _close(got_weights, weights[:, :, -1:], atol=1e-6)
            _close(got, want[:, -1:])


def test_a_later_step_mask_covering_every_position_replaces_the_remembered_one():
    mha = _module(16)
    prompt_mask = PROMPTS["left"]
    x = _x(3, 7, seed=17)
    cache = mha.new_cache(3, 7)
    every = torch.ones(3, 7, dtype=torch.bool)
    every[2, :1] = False  # now only one padded position in row 2
    with torch.no_grad():
        mha(x[:, :6], prompt_mask, cache=cache, is_causal=True)
        got = mha(x[:, 6:], every, cache=cache, is_causal=True)
    want, _ = oracle(mha, x, every, is_causal=True)
    _close(got, want[:, -1:])


# --- the packed path ------------------------------------------------------------------------

@pytest.mark.parametrize("feature", ["plain", "causal+rope+gqa", "window", "alibi"])
def test_forward_packed_matches_the_formula_per_sequence(feature):
    """forward_packed on packed tokens (positions and lengths left to it): each sequence's rows
    equal the formula on that sequence alone."""
    kwargs = {"plain": {}, "causal+rope+gqa": {"is_causal": True, "rope_base": 500.0, "num_kv_heads": 2},
              "window": {"window": 2}, "alibi": {"alibi": True}}[feature]
    mha = _module(18, **kwargs)
    lengths = [5, 3, 0, 1]
    x = _x(1, sum(lengths), seed=19)[0]  # (T, E)
    cu_seqlens = torch.tensor([0, 5, 8, 8, 9])
    with torch.no_grad():
        out = mha.forward_packed(x, cu_seqlens)  # is_causal=None: the module's own flag
    assert out.shape == (9, E)
    for start, n in zip(cu_seqlens.tolist(), lengths, strict=False):
        if n:
            want, _ = oracle(mha, x[None, start:start + n], is_causal=kwargs.get("is_causal", False),
                             window=kwargs.get("window"), slopes=PAPER_SLOPES[8] if "alibi" in kwargs else None,
                             rope_base=kwargs.get("rope_base"))
            _close(out[start:start + n], want[0])


def test_forward_packed_dropout_only_in_training():
    mha = _module(20, dropout=0.5)
    x, cu_seqlens = _x(1, 6, seed=21)[0], torch.tensor([0, 4, 6])
    want = torch.cat([oracle(mha, x[None, :4])[0][0], oracle(mha, x[None, 4:])[0][0]])
    with torch.no_grad():
        _close(mha.forward_packed(x, cu_seqlens), want)  # eval: no dropout
        assert not torch.allclose(mha.train().forward_packed(x, cu_seqlens).double(), want, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_need_weights_with_a_padding_mask_matches_the_formula(backend):
    """Weights over the padded layout: the module takes the dense path even where it would pack."""
    mha = _module(22, backend=backend)
    x = _x(3, 5, seed=23)
    mask = torch.tensor([[1] * 5, [1] * 2 + [0] * 3, [0] * 5])  # 53% padding: "auto" would pack
    want, weights = oracle(mha, x, mask, is_causal=True)  # every backend: the weights from its log-sum-exp
    with torch.no_grad():
        out, got_weights = mha(x, mask, is_causal=True, need_weights=True)
    _close(out, want)
    padded_queries = ~mask.bool()[:, None, :, None]  # (B, 1, S, 1): a padded query's weights are zeros
    _close(got_weights, weights.masked_fill(padded_queries, 0.0), atol=1e-6)


# --- scaled and partial rotary, q/k norm ------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 4}  # active beyond 4 positions
SCALED = {  # name: (module kwargs, (rope_parameters, R) for the oracle)
    "llama3+qk_norm": ({"rope_parameters": LLAMA3, "qk_norm": "rms"}, (LLAMA3, 6)),
    "yarn+partial+gqa": ({"rope_parameters": YARN, "rotary_dim": 4, "num_kv_heads": 2}, (YARN, 4)),
    "dynamic+qk_norm": ({"rope_parameters": DYNAMIC, "qk_norm": "rms", "num_kv_heads": 4}, (DYNAMIC, 6)),
    "linear+partial": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
                       ({"rope_type": "linear", "factor": 2.0}, 3)),  # int(6 * 0.5) = 3: rotates 4 dims
}


def _scaled_module(seed, feature, **kwargs):
    mha = _module(seed, **SCALED[feature][0], **kwargs).double()
    if mha.q_norm is not None:  # learned weights, not the initial ones
        with torch.no_grad():
            mha.q_norm.weight.uniform_(0.5, 1.5)
            mha.k_norm.weight.uniform_(0.5, 1.5)
    return mha


@pytest.mark.parametrize("packing", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", list(SCALED))
def test_module_scaled_rope_and_qk_norm_match_the_formula(feature, backend, packing):
    """float64 to 1e-10, forward and the input's gradient, on the dense and the packed path."""
    mha = _scaled_module(24, feature, backend=backend, packing=packing)
    eps = 1e-6 if mha.qk_norm else None
    x = _x(3, 7, seed=25).double().requires_grad_()
    mask = torch.tensor([[1] * 6 + [0], [1] * 5 + [0] * 2, [1] * 2 + [0] * 5])  # dynamic NTK: by S = 7, not 6
    assert mha.plan(x, mask).path == ("packed" if packing else "dense")
    want, _ = oracle(mha, x, mask, is_causal=True, rope=SCALED[feature][1], qk_eps=eps)
    got = mha(x, mask, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(26), dtype=torch.float64)
    (dx,) = torch.autograd.grad(got, x, g)
    (want_dx,) = torch.autograd.grad(want, x, g)
    torch.testing.assert_close(dx, want_dx, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("feature", list(SCALED))
def test_decoding_with_scaled_rope_and_qk_norm_matches_the_formula(feature, static):
    """Prefill 4 tokens, then decode 4. Dynamic NTK (beyond 4 positions here) rotates each
    step's q and k with the frequencies of the length so far and the cached keys keep theirs,
    as transformers does; every other scaling equals one forward over the whole sequence."""
    mha = _scaled_module(27, feature).eval()
    eps = 1e-6 if mha.qk_norm else None
    T, steps = 4, 4
    x = _x(3, T + steps, seed=28).double()
    prompt_mask = torch.tensor([[1] * 4, [0] + [1] * 3, [1] * 2 + [0] * 2])
    full_mask = torch.cat([prompt_mask, torch.ones(3, steps, dtype=prompt_mask.dtype)], dim=1)
    lengths = torch.tensor([T] * T + list(range(T + 1, T + steps + 1)))  # the length of the call each position was in
    cache = mha.new_cache(3, T + steps, static=static)
    with torch.no_grad():
        mha(x[:, :T], prompt_mask, cache=cache, is_causal=True)
        for t in range(T, T + steps):
            got = mha(x[:, t:t + 1], cache=cache, is_causal=True)
            want, _ = oracle(mha, x[:, :t + 1], full_mask[:, :t + 1], is_causal=True, rope=SCALED[feature][1],
                             rope_lengths=lengths[:t + 1], qk_eps=eps)
            torch.testing.assert_close(got, want[:, -1:], atol=1e-10, rtol=1e-10)
        whole = mha(x, full_mask, is_causal=True)
    stepped_equals_whole = torch.allclose(got, whole[:, -1:], atol=1e-10)
    assert stepped_equals_whole == (feature != "dynamic+qk_norm")


# --- a repeated call signature: the remembered plan and attention call ---------------------------

REPEATS = {  # module options, forward's is_causal, whether gradients flow
    "plain": ({}, False, False),
    "causal": ({}, True, False),
    "gqa+rope+qk_norm": ({"num_kv_heads": 2, "rope": True, "qk_norm": "rms"}, False, False),
    "training": ({}, False, True),
    "causal training": ({"num_kv_heads": 4}, True, True),
}


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64], ids=["bool mask", "int mask"])
@pytest.mark.parametrize("case", list(REPEATS))
def test_repeated_calls_skip_the_plan_and_still_match_the_formula(case, dtype, monkeypatch):
    """A call signature (x's shape, the mask's shape and real tokens per row, flags) is planned
    and dispatched once; every later call of it takes the remembered path and its own values.
    Each output (and gradient) equals the float64 formula to 1e-10: masks with the same counts
    but other tokens, no mask, an all-True mask, other counts, and a row with no token."""
    options, causal, grad = REPEATS[case]
    mha = _module(30, packing=False, **options).double()
    if mha.q_norm is not None:
        with torch.no_grad():
            mha.q_norm.weight.uniform_(0.5, 1.5)
            mha.k_norm.weight.uniform_(0.5, 1.5)
    eps = 1e-6 if mha.qk_norm else None
    planned = []
    real_plan = planning.make_plan  # plan() and forward's planning
    monkeypatch.setattr(planning, "make_plan", lambda *a, **kw: planned.append(1) or real_plan(*a, **kw))
    masks = [  # (mask, a new signature?)
        ([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], True),
        ([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], False),
        ([[1] * 6, [0] * 2 + [1] * 4, [0] * 4 + [1] * 2], False),  # the same counts, left padded
        (None, True),
        (None, False),
        ([[1] * 6] * 3, True),  # every position a token: attends as no mask
        ([[1] * 6] * 3, False),
        ([[1] * 6, [1] * 5 + [0], [1] * 3 + [0] * 3], True),
        ([[1] * 6, [0] * 6, [1] * 3 + [0] * 3], True),  # a row with no token: zeros, never NaN
        ([[1] * 6, [0] * 6, [1] * 3 + [0] * 3], False),
    ]
    for seed, (rows, new) in enumerate(masks):
        x = _x(3, 6, seed=31 + seed).double().requires_grad_(grad)
        mask = None if rows is None else torch.tensor(rows, dtype=dtype)
        before = len(planned)
        with torch.set_grad_enabled(grad):
            got = mha(x, mask, is_causal=causal)
        assert len(planned) == before + new, f"mask {rows}: planned {len(planned) - before} times"
        rope = ({}, mha.head_dim) if options.get("rope") else None
        want, _ = oracle(mha, x, mask, is_causal=causal, rope=rope, qk_eps=eps)
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
        if grad:
            g = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            (dx,) = torch.autograd.grad(got, x, g)
            (want_dx,) = torch.autograd.grad(want, x, g)
            torch.testing.assert_close(dx, want_dx, atol=1e-10, rtol=1e-10)


# --- the fused path: small calls without gradients, one op -------------------------------------


@pytest.mark.parametrize("mask", [None, "all tokens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_calls_without_gradients_take_the_fused_path_and_match_the_formula(dtype, mask):
    mha = _module(40).to(dtype)
    x = _x(2, 5, seed=41).to(dtype)
    m = None if mask is None else torch.ones(2, 5, dtype=torch.int64)
    with torch.no_grad():
        assert mha.plan(x, m).path == "fused"
        assert mha.dispatch(x, m).backend == "native_mha"
        for _ in range(2):  # planned, then remembered
            got = mha(x, m)
    want, _ = oracle(mha, x, m)
    tol = 1e-10 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)

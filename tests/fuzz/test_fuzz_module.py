"""Fuzz MultiHeadAttention on every path (dense, packed, fused, cached, static, evicting, paged)
against the float64 oracle: the projections written out with F.linear around
``headwise.testing.reference_attention``. A refused call must change no parameter, cache,
pool or memo. NaN / inf at padded positions of x must not reach the output or a gradient.

Legend: B batch, S sequence length, T new positions of a step, E embed dim, H heads,
Hkv kv heads, D head dim, Dv value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, note
from hypothesis import strategies as st

import headwise
from fuzz.fuzz_kit import TOL, Unchanged, assert_close, budget, mask_mod_pool, refused, score_mod_pool
from headwise.testing import reference_attention

PATHS = ["dense", "packed", "fused", "cached", "static", "evicting", "paged"]
RULES = [None, None, "causal", "sliding_window(2)", "prefix_lm(2)", "stripes", "and(causal, stripes)", "chained",
         "two_d"]
SCORES = [None, None, "relative_position_bias", "arithmetic", "chained", "key_bias"]


def draw_module(draw) -> dict:
    H = draw(st.sampled_from([1, 2, 4]))
    path = draw(st.sampled_from(PATHS))
    window = draw(st.sampled_from([None, 2, 3])) if path != "evicting" else draw(st.sampled_from([2, 3]))
    extras = path != "fused" and draw(st.booleans())
    return dict(
        path=path, E=4 * H, H=H, Hkv=draw(st.sampled_from([d for d in (1, 2, 4) if H % d == 0])),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        backend=draw(st.sampled_from(["auto", "auto", "matmul", "chunked", "sdpa"])),
        B=draw(st.integers(0 if path in ("dense", "packed") else 1, 3)), S=draw(st.integers(1, 7)),
        T=draw(st.integers(1, 3)), pad=path in ("dense", "packed") and draw(st.booleans()),
        window=window if extras or path == "evicting" else None,
        sink_tokens=draw(st.integers(0, 1)) if window and (extras or path == "evicting") else 0,
        alibi=extras and draw(st.booleans()), softcap=draw(st.sampled_from([None, 2.0])) if extras else None,
        sinks=extras and draw(st.booleans()), v_head_dim=draw(st.sampled_from([None, 3])) if extras else None,
        mask_mod=draw(st.sampled_from(RULES)) if extras else None,
        score_mod=draw(st.sampled_from(SCORES)) if extras else None,
        grad=path in ("dense", "packed", "cached") and draw(st.booleans()),
        nan=draw(st.booleans()), room=draw(st.integers(-2, 2)), seed=draw(st.integers(0, 2**16)),
    )


def make(cfg: dict):
    gen = torch.Generator().manual_seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    L = cfg["S"] + 2 * cfg["T"]
    pool, scores = mask_mod_pool(max(cfg["B"], 1), cfg["H"], L, L, gen), score_mod_pool(cfg["B"], cfg["H"], L, L, gen)
    mha = headwise.MultiHeadAttention(
        cfg["E"], cfg["H"], num_kv_heads=cfg["Hkv"], is_causal=cfg["path"] in ("cached", "static", "evicting", "paged"),
        backend=cfg["backend"], packing=cfg["path"] == "packed" or ("auto" if cfg["path"] == "fused" else False),
        window=cfg["window"], sink_tokens=cfg["sink_tokens"], alibi=cfg["alibi"], softcap=cfg["softcap"],
        sinks=cfg["sinks"], v_head_dim=cfg["v_head_dim"], mask_mod=pool.get(cfg["mask_mod"] or ""),
        score_mod=scores.get(cfg["score_mod"] or ""), dtype=cfg["dtype"]).eval()
    if mha.sinks is not None:
        with torch.no_grad():
            mha.sinks.copy_(torch.randn(cfg["H"], generator=gen))
    x = torch.randn(cfg["B"], L, cfg["E"], generator=gen, dtype=torch.float64)
    keep = torch.rand(cfg["B"], L, generator=gen) > 0.3 if cfg["pad"] else None
    return mha, x, keep, gen


def oracle(mha, x: torch.Tensor, keep, is_causal: bool) -> torch.Tensor:
    """The module in float64 from its parameters: projections, the oracle, the output projection."""
    p = {n: t.detach().double() for n, t in mha.named_parameters()}
    B, S, _ = x.shape
    H, Hkv, D, Dv = mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.v_head_dim
    xz = x if keep is None else torch.where(keep[..., None], x, 0.0)

    def proj(name, heads, dim):  # (B, S, E) -> (B, heads, S, dim)
        return F.linear(xz, p[f"{name}.weight"], p.get(f"{name}.bias")).reshape(B, S, heads, dim).transpose(1, 2)

    ref = reference_attention(proj("q_proj", H, D), proj("k_proj", Hkv, D), proj("v_proj", Hkv, Dv), keep,
                              is_causal=is_causal, window=mha.window, sink_tokens=mha.sink_tokens,
                              alibi_slopes=mha.alibi_slopes, softcap=mha.softcap, sinks=p.get("sinks"),
                              mask_mod=mha.mask_mod, score_mod=mha.score_mod)
    y = F.linear(ref.out.transpose(1, 2).reshape(B, S, H * Dv), p["out_proj.weight"], p.get("out_proj.bias"))
    return y if keep is None else torch.where(keep[..., None], y, 0.0)  # (B, S, E)


def _expected_refusal(cfg: dict, error: BaseException) -> bool:
    """The refusals the README documents: a kernel that cannot serve the call, rules on a paged
    or an evicting cache's step that evicts (or follows eviction)."""
    text = str(error)
    return (text.startswith(f"backend {cfg['backend']!r}") or "evicting cache that has dropped" in text
            or "evicting cache whose step would drop" in text
            or "paged cache step does not take mask_mod" in text)


def _out_of_room(error: BaseException) -> bool:
    text = str(error)
    return "cache" in text and any(word in text for word in ("room", "hold", "pages", "max_seq_len", "full"))


def run_dense(cfg, mha, x, keep):
    """dense / packed / fused: one call, twice (the second is remembered), against the oracle."""
    xs = x.to(cfg["dtype"])
    if cfg["nan"] and keep is not None:
        xs = torch.where(keep[..., None], xs, torch.tensor(float("nan"), dtype=cfg["dtype"]))
    xs.requires_grad_(cfg["grad"])
    mha.train(cfg["grad"]).requires_grad_(cfg["grad"])
    want = oracle(mha, x, keep, False)
    for _ in range(2):
        with Unchanged(mha) as outcome, torch.set_grad_enabled(cfg["grad"]):
            y = mha(xs, keep)
        if refused(outcome):
            assert _expected_refusal(cfg, outcome.refused), outcome.refused
            return
        assert_close("module output", y, want, TOL[cfg["dtype"]] * 10)
    if cfg["grad"]:
        y.sum().backward()
        assert torch.isfinite(xs.grad).all(), "a NaN at a padded position reached dx"
        for n, p in mha.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), f"a NaN at a padded position reached d{n}"


def _cache(cfg, mha):
    L = x_len = cfg["S"] + 2 * cfg["T"]
    if cfg["path"] == "paged":
        return headwise.PagedKVCache.for_module(mha, num_pages=max(1, cfg["B"] * (-(-x_len // 2)) + cfg["room"]),
                                                page_size=2)
    if cfg["path"] == "evicting":
        L = cfg["sink_tokens"] + cfg["window"] - 1 + max(cfg["S"], cfg["T"])
    return mha.new_cache(cfg["B"], max(1, L + cfg["room"]), static=cfg["path"] == "static",
                         evict=cfg["path"] == "evicting")


def run_cached(cfg, mha, x):
    """A prefill of S and two steps of T through the cache equal one causal forward."""
    cache = _cache(cfg, mha)
    want = oracle(mha, x, None, True)
    batch = None
    if cfg["path"] == "paged":
        seqs = [cache.add() for _ in range(cfg["B"])]
        batch = cache.batch(seqs)
    xs = x.to(cfg["dtype"])
    mha.requires_grad_(cfg["grad"])
    bounds = [(0, cfg["S"]), (cfg["S"], cfg["S"] + cfg["T"]), (cfg["S"] + cfg["T"], x.shape[1])]
    for lo, hi in bounds:
        step = batch if batch is not None else cache
        with Unchanged(mha, cache) as outcome:  # plan() and dispatch() refuse what forward refuses, changing nothing
            mha.dispatch(xs[:, lo:hi], cache=step, is_causal=True)
        with Unchanged(mha, cache) as outcome, torch.set_grad_enabled(cfg["grad"]):
            y = mha(xs[:, lo:hi], cache=step, is_causal=True)
        if refused(outcome):
            if not _expected_refusal(cfg, outcome.refused):
                assert _out_of_room(outcome.refused), outcome.refused
                assert cfg["room"] < 0, f"refused with room to spare: {outcome.refused}"
            return
        assert_close(f"step {lo}:{hi}", y, want[:, lo:hi], TOL[cfg["dtype"]] * 10)


@budget(60)
@given(st.data())
def test_module_equals_the_oracle_on_every_path(data):
    cfg = draw_module(data.draw)
    note(f"module: {cfg}")
    mha, x, keep, _ = make(cfg)
    if cfg["path"] in ("dense", "packed", "fused"):
        if cfg["path"] == "fused":
            with torch.no_grad():
                want = oracle(mha, x, None, False)
                with Unchanged(mha) as outcome:
                    y = mha(x.to(cfg["dtype"]))
            assert not refused(outcome), outcome.refused
            assert_close("fused output", y, want, TOL[cfg["dtype"]] * 10)
            return
        run_dense(cfg, mha, x, keep)
    else:
        run_cached(cfg, mha, x)

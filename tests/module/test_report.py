"""``MultiHeadAttention.dispatch`` (module/report.py) says what ``forward`` runs: for every path
(dense, packed, fused, a cache step of each kind, cross-attention) the kernel it names and
the request it decided on are the ones forward's own selection makes on the same call.

Legend: B batch, S query length, E embed dim, H heads.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import functional, policy
from headwise.masks import document

E, H = 32, 4


def selections(monkeypatch) -> list:
    """The Dispatch of every kernel selection forward makes, in order."""
    made = []
    monkeypatch.setattr(functional, "prepare", lambda *a, **kw: None)  # no remembered call: each one selects
    real = functional.select
    monkeypatch.setattr(functional, "select", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    return made


def padding(B: int, S: int, lengths: list[int]) -> torch.Tensor:
    return torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]  # (B, S) True = token


MODULES = {
    "plain": {},
    "causal GQA": dict(is_causal=True, num_kv_heads=2),
    "alibi": dict(alibi=True),
    "window + sink tokens": dict(window=3, sink_tokens=1),
    "softcap + sinks": dict(softcap=5.0, sinks=True),
    "value head dim": dict(v_head_dim=6),
    "named kernel": dict(backend="chunked"),
    "dropout": dict(dropout=0.25),
    "packing": dict(packing=True),
    "packing + softcap + sinks": dict(packing=True, softcap=5.0, sinks=True),
    "packing + causal GQA + dropout": dict(packing=True, is_causal=True, num_kv_heads=2, dropout=0.25),
}
CALLS = {
    "no mask": lambda x: dict(),
    "padding": lambda x: dict(attention_mask=padding(3, 7, [7, 4, 2])),
    "bucketed padding": lambda x: dict(attention_mask=padding(3, 7, [7, 6, 1])),
    "all tokens": lambda x: dict(attention_mask=torch.ones(3, 7, dtype=torch.bool)),
    "3-D mask": lambda x: dict(attention_mask=torch.rand(3, 7, 7) > 0.3),
    "float mask": lambda x: dict(attention_mask=torch.randn(3, 1, 7, 7)),
    "weights": lambda x: dict(attention_mask=padding(3, 7, [7, 4, 2]), need_weights=True),
    "causal call": lambda x: dict(is_causal=True),
    "cross-attention": lambda x: dict(context=torch.randn(3, 5, E), attention_mask=padding(3, 5, [5, 3, 1])),
    "document rule": lambda x: dict(mask_mod=document(torch.tensor([0, 0, 0, 1, 1, 2, 2]))),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("name", list(MODULES))
def test_dispatch_names_the_kernel_and_request_forward_selects(name, call, train, monkeypatch):
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, **MODULES[name]).train(train)
    x = torch.randn(3, 7, E, requires_grad=train)
    kwargs = CALLS[call](x)
    with torch.set_grad_enabled(train):
        said = mha.dispatch(x, **kwargs)
        assert said.path == mha.plan(x, **kwargs).path
        made = selections(monkeypatch)
        mha(x, **kwargs)
    if said.path == "fused":
        assert (said.backend, made) == ("native_mha", [])
        return
    assert made, "forward selected no kernel"
    if said.path == "packed":  # one selection per length bucket: dispatch names the one with the most tokens
        assert said.backend in {d.backend for d in made}
        assert said.request in [d.request for d in made]
        assert said.reason.count("->") == len(made)  # a selection per bucket
        return
    assert (said.backend, said.request) == (made[0].backend, made[0].request)


CACHES = {
    "dynamic": dict(),
    "static": dict(static=True),
    "evicting": dict(evict=True),
}


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "padded prompt"])
@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("module", ["window + sink tokens", "alibi window", "plain"])
def test_dispatch_of_a_cache_step_is_forwards_selection(module, kind, masked, monkeypatch):
    kwargs = {"window + sink tokens": dict(window=3, sink_tokens=1), "alibi window": dict(window=4, alibi=True),
              "plain": {}}[module]
    if kind == "evicting" and "window" not in kwargs:
        pytest.skip("an evicting cache needs a window")
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, **kwargs).eval()
    cache = mha.new_cache(2, 12, **CACHES[kind])
    x = torch.randn(2, 12, E)
    prompt = padding(2, 5, [5, 3]) if masked else None
    with torch.no_grad():
        mha(x[:, :5], prompt, cache=cache)
        for step in range(5, 9):  # past the window: the evicting cache has dropped positions
            said = mha.dispatch(x[:, step:step + 1], cache=cache)
            made = selections(monkeypatch)
            mha(x[:, step:step + 1], cache=cache)
            monkeypatch.undo()
            assert (said.backend, said.request) == (made[0].backend, made[0].request), step
            assert said.path == "dense"


def test_a_batch_without_tokens_dispatches_nothing_on_the_packed_path():
    mha = headwise.MultiHeadAttention(E, H, packing=True)
    said = mha.dispatch(torch.randn(2, 4, E), torch.zeros(2, 4, dtype=torch.bool))
    assert (said.backend, said.path) == ("none", "packed")
    assert said.reason == "no real token: nothing to attend"


def test_the_packed_reason_lists_each_bucket_and_the_padding_it_saves(monkeypatch):
    monkeypatch.setattr(policy, "BUCKET_SLACK", 0.0)  # a bucket per distinct length
    mha = headwise.MultiHeadAttention(E, H, packing=True).eval()
    with torch.no_grad():
        said = mha.dispatch(torch.randn(3, 8, E), padding(3, 8, [8, 5, 5]))
    assert said.reason.startswith("attention per length bucket (sequences x length): ")
    assert "1 x 8 -> " in said.reason and "2 x 5 -> " in said.reason
    assert said.reason.endswith("projections and the output projection run on the 18 real tokens of 3 x 8")
    assert dict(said.passed_over) == {"dense path": "pays for 6 padded positions"}
    assert said.request.batch == 2 and said.request.q_len == 5 or said.request.batch == 1  # the most tokens


def test_the_packed_path_reports_its_largest_bucket_with_its_padding(monkeypatch):
    """Buckets of several sequences pad the shorter ones: the bucket's key mask is part of
    what "auto" decides on, and the bucket named is the one with the most tokens (not the
    one with the most sequences)."""
    mha = headwise.MultiHeadAttention(E, H, packing=True).eval()
    lengths = [8, 7, 2, 2, 2, 1]
    x = torch.randn(len(lengths), 8, E)
    with torch.no_grad():
        said = mha.dispatch(x, padding(len(lengths), 8, lengths))
        made = selections(monkeypatch)
        mha(x, padding(len(lengths), 8, lengths))
    largest = max(made, key=lambda d: d.request.batch * d.request.q_len)
    assert said.request == largest.request and said.backend == largest.backend
    assert (said.request.batch, said.request.q_len, said.request.key_lengths) == (2, 8, (8, 7))
    assert [(d.request.batch, d.request.q_len) for d in made] == [(2, 8), (3, 2), (1, 1)]
    assert said.reason == ("attention per length bucket (sequences x length): 2 x 8 -> 'sdpa', 3 x 2 -> 'sdpa', "
                           "1 x 1 -> 'sdpa'; projections and the output projection run on the 22 real tokens of 6 x 8")


def test_the_fused_path_is_reported_in_full():
    mha = headwise.MultiHeadAttention(E, H).eval()
    with torch.no_grad():
        x = torch.randn(1, 4, E)
        said, plan = mha.dispatch(x), mha.plan(x)
    assert (said.backend, said.path, said.path_reason, dict(said.passed_over), said.request) == (
        "native_mha", "fused", plan.why, {}, None)
    assert said.reason == ("torch._native_multi_head_attention: the qkv GEMM, SDPA and the output projection in one "
                           "op")


@pytest.mark.parametrize("kind", ["static", "evicting"])
def test_dispatch_of_a_masked_multi_position_step_is_forwards_selection(kind, monkeypatch):
    """T = 2 new positions with their own padding: the causal rule within the step and the
    step's mask both shape the mask that forward builds and dispatch reports."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, window=3, sink_tokens=1, alibi=kind == "static").eval()
    cache = mha.new_cache(2, 16, static=kind == "static", evict=kind == "evicting")
    x = torch.randn(2, 12, E)
    with torch.no_grad():
        mha(x[:, :5], padding(2, 5, [5, 3]), cache=cache)
        for step in (5, 7, 9):
            mask = padding(2, 2, [2, 1])
            said = mha.dispatch(x[:, step:step + 2], mask, cache=cache)
            made = selections(monkeypatch)
            mha(x[:, step:step + 2], mask, cache=cache)
            monkeypatch.undo()
            assert (said.backend, said.request) == (made[0].backend, made[0].request), step


DTYPES = {  # module kwargs, x dtype, autocast dtype (None: off), grad mode, x requires grad, frozen module
    "float64 module": (dict(dtype=torch.float64), torch.float64, None, True, False, False),
    "bfloat16 autocast": ({}, torch.float32, torch.bfloat16, True, False, False),
    "frozen module, x takes gradients": ({}, torch.float32, None, True, True, True),
    "frozen module, x takes none": ({}, torch.float32, None, True, False, True),
    "no grad mode": ({}, torch.float32, None, False, True, False),
}


@pytest.mark.parametrize("case", list(DTYPES))
def test_dispatch_asks_for_the_dtype_and_gradients_forward_attends_with(case, monkeypatch):
    """The request dispatch names carries q's dtype (the weights', or autocast's) and whether
    gradients flow (through x or the parameters), as forward's own selection does."""
    kwargs, dtype, autocast, grad_mode, x_grad, frozen = DTYPES[case]
    mha = headwise.MultiHeadAttention(E, H, **kwargs).requires_grad_(not frozen)
    x = torch.randn(3, 7, E, dtype=dtype, requires_grad=x_grad)
    mask = padding(3, 7, [7, 4, 2])
    with torch.set_grad_enabled(grad_mode), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None):
        said = mha.dispatch(x, mask)
        made = selections(monkeypatch)
        mha(x, mask)
    assert said.path == "dense" and (said.backend, said.request) == (made[0].backend, made[0].request)
    assert said.request.dtype == (autocast or dtype)
    assert said.request.requires_grad == (grad_mode and (x_grad or not frozen))


def test_dispatch_names_the_score_rule_forward_attends_with(monkeypatch):
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = torch.randn(2, 6, E)

    def tilt(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx).abs()

    with torch.no_grad():
        said = mha.dispatch(x, score_mod=tilt)
        made = selections(monkeypatch)
        mha(x, score_mod=tilt)
    assert said.path == "dense" and said.request.score_mod == "general"
    assert (said.backend, said.request) == (made[0].backend, made[0].request)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_the_packed_path_asks_for_dropout_only_in_training(train, monkeypatch):
    mha = headwise.MultiHeadAttention(E, H, packing=True, dropout=0.25).train(train)
    x, mask = torch.randn(3, 7, E), padding(3, 7, [7, 4, 2])
    said = mha.dispatch(x, mask)
    assert said.path == "packed" and said.request.dropout_p == (0.25 if train else 0.0)
    assert dict(said.passed_over) == {"dense path": "pays for 8 padded positions"}


def test_dispatch_before_an_evicting_cache_has_dropped_anything_is_forwards_selection(monkeypatch):
    """A window longer than what the cache holds evicts nothing yet: forward attends over the
    held positions with the window rule, and dispatch names that request, not the evicting
    layout's masked one."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, window=6).eval()
    cache = mha.new_cache(2, 12, evict=True)
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        mha(x[:, :3], cache=cache)
        assert (cache.evicted, sum(cache.kept())) == (0, cache.held)
        said = mha.dispatch(x[:, 3:4], cache=cache)
        made = selections(monkeypatch)
        mha(x[:, 3:4], cache=cache)
    assert (said.backend, said.request) == (made[0].backend, made[0].request)
    assert (said.request.k_len, said.request.window, said.request.mask_kind) == (4, 6, "none")


def test_the_packed_path_asks_for_the_value_head_dim(monkeypatch):
    mha = headwise.MultiHeadAttention(E, H, packing=True, v_head_dim=6).eval()
    x, mask = torch.randn(3, 7, E), padding(3, 7, [7, 4, 2])
    with torch.no_grad():
        said = mha.dispatch(x, mask)
        made = selections(monkeypatch)
        mha(x, mask)
    assert said.path == "packed" and said.request.value_dim == 6
    assert said.request in [d.request for d in made]


def test_a_batch_without_tokens_is_reported_in_full():
    mha = headwise.MultiHeadAttention(E, H, packing=True)
    x, mask = torch.randn(2, 4, E), torch.zeros(2, 4, dtype=torch.bool)
    said = mha.dispatch(x, mask)
    assert (said.backend, dict(said.passed_over), said.request, said.path, said.path_reason) == (
        "none", {}, None, "packed", "packing=True packs the real tokens")
    assert str(said) == ("path 'packed': packing=True packs the real tokens\n"
                         "backend 'none': no real token: nothing to attend")


def test_of_buckets_with_as_many_tokens_the_first_listed_is_named():
    mha = headwise.MultiHeadAttention(E, H, packing=True).eval()
    with torch.no_grad():
        said = mha.dispatch(torch.randn(3, 8, E), padding(3, 8, [8, 4, 4]))
    assert said.reason.startswith("attention per length bucket (sequences x length): 1 x 8 -> 'sdpa', 2 x 4 -> 'sdpa';")
    assert (said.request.batch, said.request.q_len) == (1, 8)


def test_dispatch_on_the_meta_device_asks_for_it():
    mha = headwise.MultiHeadAttention(E, H, device="meta")
    x = torch.randn(2, 3, E, device="meta")
    said = mha.dispatch(x, torch.ones(2, 3, dtype=torch.bool, device="meta"))
    assert (said.path, said.request.device.type) == ("dense", "meta")
    assert said.path_reason.startswith("a meta mask holds no values to pack by")


def test_context_parallel_auto_hears_of_a_dense_mask(monkeypatch):
    """On 2 ranks "auto" splits heads with Ulysses, unless the call's mask is per query (it
    would be gathered whole on every rank): the mask reaches the method's choice."""
    import torch.distributed as dist

    import headwise.distributed as hwd

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    mha = headwise.MultiHeadAttention(16, 4, context_parallel=hwd.ContextParallel(method="auto"))
    x = torch.randn(1, 5, 16)
    assert mha.dispatch(x).backend == "ulysses"
    said = mha.dispatch(x, torch.ones(1, 5, 5, dtype=torch.bool))
    assert (said.backend, said.path) == ("ring", "context parallel")
    assert said.reason.startswith("a (.., S_l, Sk) mask would be gathered whole on every rank by ulysses")


@pytest.mark.parametrize("kind", ["static", "evicting"])
def test_dispatch_of_a_single_position_step_with_its_own_padding_is_forwards_selection(kind, monkeypatch):
    """A step of one position per row, one row padded there (a sequence that has ended): the
    keys "auto" reads as real are those forward attends (the step's padding included)."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, window=3 if kind == "evicting" else None).eval()
    cache = mha.new_cache(2, 16, static=kind == "static", evict=kind == "evicting")
    x = torch.randn(2, 9, E)
    with torch.no_grad():
        mha(x[:, :5], padding(2, 5, [5, 3]), cache=cache)
        for step in (5, 6):
            ended = torch.tensor([[True], [False]])
            said = mha.dispatch(x[:, step:step + 1], ended, cache=cache)
            made = selections(monkeypatch)
            mha(x[:, step:step + 1], ended, cache=cache)
            monkeypatch.undo()
            assert said.request.key_lengths is not None and said.request.mask_shape[0] == 2
            assert (said.backend, said.request) == (made[0].backend, made[0].request), step


def test_dispatch_of_a_float64_alibi_static_step_is_forwards_selection(monkeypatch):
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, is_causal=True, alibi=True, dtype=torch.float64).eval()
    cache = mha.new_cache(2, 8, static=True)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    with torch.no_grad():
        mha(x[:, :4], cache=cache)
        said = mha.dispatch(x[:, 4:6], cache=cache)
        made = selections(monkeypatch)
        mha(x[:, 4:6], cache=cache)
    assert (said.request.dtype, said.request.mask_kind) == (torch.float64, "float")
    assert (said.backend, said.request) == (made[0].backend, made[0].request)


def test_a_named_kernel_runs_every_bucket_of_the_packed_path(monkeypatch):
    mha = headwise.MultiHeadAttention(E, H, packing=True, backend="chunked").eval()
    x, mask = torch.randn(3, 7, E), padding(3, 7, [7, 4, 2])
    with torch.no_grad():
        said = mha.dispatch(x, mask)
        made = selections(monkeypatch)
        mha(x, mask)
    assert (said.path, said.backend) == ("packed", "chunked")
    assert {d.backend for d in made} == {"chunked"} and said.reason.count("-> 'chunked'") == len(made)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_packed_path_on_a_gpu_reports_forwards_selection(monkeypatch):
    """A bucket's key mask lives on x's device: the request dispatch names is the one forward's
    own selection makes there."""
    mha = headwise.MultiHeadAttention(E, H, packing=True).cuda().eval()
    lengths = [8, 7, 2, 2, 2, 1]
    x, mask = torch.randn(len(lengths), 8, E, device="cuda"), padding(len(lengths), 8, lengths).cuda()
    with torch.no_grad():
        said = mha.dispatch(x, mask)
        made = selections(monkeypatch)
        mha(x, mask)
    assert (said.path, said.request.device.type) == ("packed", "cuda")
    assert said.request in [d.request for d in made]

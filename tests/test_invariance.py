"""headwise.invariance: the batch-invariant mode's switch and its projections, whose rows
keep their bits whatever the other rows (torch.equal, never a tolerance)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headwise import invariance
from headwise.invariance import batch_invariant, is_batch_invariant

E, N = 96, 72
DTYPES = [torch.float32, torch.bfloat16]


def _rows(dtype, M=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, E, generator=gen).to(dtype)
    w = (torch.randn(N, E, generator=gen) / E**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    return x, w, b


def test_the_switch_nests_and_restores():
    assert not is_batch_invariant()
    with batch_invariant():
        assert is_batch_invariant()
        with batch_invariant(False):
            assert not is_batch_invariant()
        assert is_batch_invariant()
    assert not is_batch_invariant()


def test_the_switch_decorates_a_function_and_survives_an_exception():
    @batch_invariant()
    def inside():
        return is_batch_invariant()

    assert inside() and not is_batch_invariant()
    with pytest.raises(RuntimeError, match="boom"), batch_invariant():
        raise RuntimeError("boom")
    assert not is_batch_invariant()


def test_the_switch_takes_a_bool_only():
    with pytest.raises(TypeError, match=r"batch_invariant\(enabled\) takes a bool, got str 'yes'"):
        batch_invariant("yes")


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_f_linear_is_not_invariant_here_or_the_test_would_prove_nothing(dtype):
    """The premise: some M changes a row's bits under F.linear on this machine (fp32 at
    least; bf16 may happen to agree), which the tiled linear must not."""
    x, w, b = _rows(dtype)
    one = F.linear(x[7:8], w, b)[0]
    differs = [M for M in (8, 9, 16, 33, 64, 129, 300) if not torch.equal(F.linear(x[:M], w, b)[7], one)]
    if dtype == torch.float32:
        assert differs, "F.linear kept row 7's bits at every M: the premise of the mode does not hold here"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [1, 8, 16])
def test_a_rows_bits_do_not_depend_on_the_other_rows(dtype, tile, monkeypatch):
    monkeypatch.setitem(invariance.ROW_TILE, dtype, tile)
    x, w, b = _rows(dtype)
    alone = invariance.linear(x[7:8], w, b)[0]
    for M, at in ((1, 0), (3, 1), (8, 7), (9, 5), (40, 17), (300, 7), (129, 100)):
        other = torch.randn(M, E).to(dtype)
        other[at] = x[7]
        assert torch.equal(invariance.linear(other, w, b)[at], alone), (M, at)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_input_gradient_does_not_depend_on_the_other_rows(dtype):
    x, w, b = _rows(dtype)
    g = torch.randn(N).to(dtype)

    def grad_of_row(rows, at):
        rows = rows.clone().requires_grad_()
        upstream = torch.randn(rows.shape[0], N).to(dtype)
        upstream[at] = g
        (invariance.linear(rows, w, b) * upstream).sum().backward()
        return rows.grad[at]

    alone = grad_of_row(x[7:8], 0)
    for M, at in ((5, 2), (40, 17), (300, 7)):
        other = torch.randn(M, E).to(dtype)
        other[at] = x[7]
        assert torch.equal(grad_of_row(other, at), alone), (M, at)


def test_the_tiled_linear_is_f_linear_with_its_gradients():
    x, w, b = _rows(torch.float32, M=37)
    args64 = [t.double().requires_grad_() for t in (x, w, b)]
    args = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = F.linear(*args64)
    out = invariance.linear(args[0].reshape(37, 1, E), args[1], args[2])  # any leading dims
    assert out.shape == (37, 1, N)
    torch.testing.assert_close(out.reshape(37, N).double(), ref, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(37, N, dtype=torch.float64)
    (ref * upstream).sum().backward()
    (out.reshape(37, N) * upstream.float()).sum().backward()
    for a, r in zip(args, args64, strict=True):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-4, rtol=1e-4)
    assert invariance.linear(x, w).shape == (37, N)  # without a bias


def test_an_empty_batch_gives_an_empty_result():
    x, w, b = _rows(torch.float32, M=0)
    assert invariance.linear(x, w, b).shape == (0, N)


def test_the_module_outside_and_then_inside_the_mode_takes_the_modes_path():
    """A signature remembered outside the mode (the fused op, one GEMM over the q, k, v rows)
    is not reused inside it: the memo keys on the mode."""
    import headwise

    mha = headwise.MultiHeadAttention(64, 4).eval()
    x = torch.randn(5, 9, 64)
    with torch.no_grad():
        mha(x)
        mha(x)  # remembered: the fused path
        with batch_invariant():
            assert mha.plan(x).path == "dense"
            assert torch.equal(mha(x)[2], mha(x[2:3])[0])


# --- the module and the functional API inside the mode --------------------------------------
# Each sequence's rows, forward and input gradients, compared with torch.equal against the
# sequence run alone: the mode's promise, across the layouts the issue names.

EMB, HEADS, KV_HEADS = 64, 4, 2


def _module(dtype, **kwargs):
    import headwise

    torch.manual_seed(0)
    return headwise.MultiHeadAttention(EMB, HEADS, num_kv_heads=KV_HEADS, is_causal=True, **kwargs).to(dtype).eval()


def _forward_and_grad(mha, x, mask, upstream):
    """(out, x's gradient) for the loss ``(out * upstream).sum()``."""
    x = x.detach().clone().requires_grad_()
    out = mha(x) if mask is None else mha(x, attention_mask=mask)
    (out * upstream).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sequence_keeps_its_bits_however_the_module_batches_and_pads_it(dtype):
    import headwise

    S, n, at = 24, 13, 2
    xs = torch.randn(4, S, EMB).to(dtype)
    lens = torch.tensor([S, 20, n, 5])
    right = torch.arange(S)[None] < lens[:, None]  # (B, S) right padding
    left_x = torch.zeros_like(xs)
    for b, m in enumerate(lens.tolist()):
        left_x[b, S - m:] = xs[b, :m]
    left = torch.arange(S)[None] >= (S - lens)[:, None]
    g = torch.randn(n, EMB).to(dtype)  # the loss's gradient at the sequence's outputs; zero elsewhere
    g_right, g_left = torch.zeros_like(xs), torch.zeros_like(xs)
    g_right[at, :n], g_left[at, S - n:] = g, g
    results = {}
    with headwise.batch_invariant():
        for packing in (False, True):
            mha = _module(dtype, packing=packing)
            out, grad = _forward_and_grad(mha, xs[at:at + 1, :n], None, g[None])
            results[f"batch of 1, packing={packing}"] = (out[0], grad[0])
            out, grad = _forward_and_grad(mha, xs, right, g_right)
            results[f"right, packing={packing}"] = (out[at, :n], grad[at, :n])
            out, grad = _forward_and_grad(mha, left_x, left, g_left)
            results[f"left, packing={packing}"] = (out[at, S - n:], grad[at, S - n:])
    want_out, want_grad = results["batch of 1, packing=False"]
    for layout, (out, grad) in results.items():
        assert torch.equal(out, want_out), layout
        assert torch.equal(grad, want_grad), layout


def test_outside_the_mode_some_layout_changes_a_bit_or_the_test_above_would_prove_nothing():
    S, n, at = 24, 13, 2
    xs = torch.randn(4, S, EMB)
    lens = torch.tensor([S, 20, n, 5])
    right = torch.arange(S)[None] < lens[:, None]
    with torch.no_grad():
        mha = _module(torch.float32, packing=False)
        alone = mha(xs[at:at + 1, :n])[0]
        batched = mha(xs, attention_mask=right)[at, :n]
        mha.packing = True
        packed = mha(xs, attention_mask=right)[at, :n]
    assert not (torch.equal(alone, batched) and torch.equal(alone, packed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_generation_gives_the_bits_of_one_prefill(dtype):
    """Dynamic and static caches, prefilled in one call or in chunks, then decoded a token at
    a time, alone or in a batch of three: every step's rows equal the teacher-forced prefill's."""
    import headwise

    mha = _module(dtype)
    x = torch.randn(3, 40, EMB).to(dtype)
    with headwise.batch_invariant(), torch.no_grad():
        full = mha(x[:1])  # (1, 40, E)
        for static in (False, True):
            for B in (1, 3):
                cache = mha.new_cache(B, 48, static=static)
                steps = [mha(x[:B, :10], cache=cache), mha(x[:B, 10:23], cache=cache)]
                steps += [mha(x[:B, t:t + 1], cache=cache) for t in range(23, 40)]
                assert torch.equal(torch.cat(steps, 1)[:1], full), (static, B)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_trainers_forward_gives_the_samplers_bits_wherever_the_weights_lie(dtype):
    """RL's match: cached generation without gradients (the sampler) equals the forward pass
    with gradients taken (the trainer), also once the q, k, v weights no longer lie in one
    tensor (an assignment gave one other memory), and so does the input gradient."""
    import headwise

    mha = _module(dtype)
    x = torch.randn(2, 19, EMB).to(dtype)
    g = torch.randn(2, 19, EMB).to(dtype)
    with headwise.batch_invariant():
        with torch.no_grad():
            cache = mha.new_cache(2, 24)
            steps = [mha(x[:, :7], cache=cache)] + [mha(x[:, t:t + 1], cache=cache) for t in range(7, 19)]
            sampled = torch.cat(steps, 1)
        trained, grad = _forward_and_grad(mha, x, None, g)
        mha.k_proj.weight.data = mha.k_proj.weight.data.clone()  # out of the shared rows
        moved, moved_grad = _forward_and_grad(mha, x, None, g)
    assert torch.equal(trained, sampled)
    assert torch.equal(moved, sampled)
    assert torch.equal(moved_grad, grad)


def _churned_pool(mha, dtype):
    """A PagedKVCache after requests came and went: its free pages out of order."""
    import headwise

    cache = headwise.PagedKVCache.for_module(mha, num_pages=96, page_size=4)
    cache.k_pages.normal_(), cache.v_pages.normal_()  # stale values in the free pages
    others = [cache.add() for _ in range(5)]
    with torch.no_grad():
        for _ in range(6):  # interleaved appends: each sequence's pages alternate with the others'
            mha(torch.randn(5, 3, EMB).to(dtype), cache=cache.batch(others))
    for seq in others[::2]:
        cache.free(seq)
    return cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_generation_gives_the_bits_of_one_prefill_wherever_the_pages_lie(dtype):
    """Shuffled pages, a batch of three, and a shared prefix (forks of one prompt): each
    sequence's steps equal its own teacher-forced prefill."""
    import headwise

    mha = _module(dtype)
    x = torch.randn(3, 36, EMB).to(dtype)
    with headwise.batch_invariant(), torch.no_grad():
        full = mha(x)  # (3, 36, E): each row alone in the mode (the batch changes no bit)
        cache = _churned_pool(mha, dtype)
        seqs = [cache.add() for _ in range(2)]
        steps = [mha(x[:2, :9], cache=cache.batch(seqs))]
        steps += [mha(x[:2, t:t + 1], cache=cache.batch(seqs)) for t in range(9, 36)]
        assert torch.equal(torch.cat(steps, 1), full[:2])
        # a shared prompt: seqs[0]'s first 12 tokens forked, each fork continued with its own tokens
        cache = _churned_pool(mha, dtype)
        root = cache.add()
        mha(x[:1, :12], cache=cache.batch([root]))
        forks = [root, cache.fork(root)]
        own = torch.stack([x[0, 12:], x[2, 12:]])  # (2, 24, E)
        steps = [mha(own[:, t:t + 1], cache=cache.batch(forks)) for t in range(24)]
        second = torch.cat([x[:1, :12], own[1:]], 1)
        assert torch.equal(torch.cat(steps, 1)[0], full[0, 12:])
        assert torch.equal(torch.cat(steps, 1)[1], mha(second)[0, 12:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_attention_gives_the_bits_of_padded_attention(dtype):
    import headwise

    gen = torch.Generator().manual_seed(1)
    lens = [7, 33, 20]
    q = torch.randn(sum(lens), 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lens), 2, 16, generator=gen).to(dtype) for _ in range(2))
    cu = torch.tensor([0, 7, 40, 60])
    with headwise.batch_invariant():
        packed = headwise.packed_attention(q, k, v, cu, cu, is_causal=True)
        for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            alone = headwise.attention(*(t[a:e].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)
            assert torch.equal(packed[a:e], alone[0].transpose(0, 1)), b


def test_inside_the_mode_what_cannot_keep_the_promise_is_refused_with_the_remedy():
    import headwise

    q = k = v = torch.randn(1, 2, 6, 8)
    with headwise.batch_invariant():
        with pytest.raises(ValueError, match=r"backend 'sdpa' cannot keep headwise.batch_invariant\(\)'s promise"):
            headwise.attention(q, k, v, backend="sdpa")
        with pytest.raises(ValueError, match=r"no kernel keeps the promise for this call: backend 'invariant' applies "
                                             r"no window.*batch_invariant\(False\)"):
            headwise.attention(q, k, v, window=3)
        pages = torch.randn(4, 2, 4, 8)
        with pytest.raises(ValueError, match=r"paged attention runs only through the native kernel.*backend='sdpa' "
                                             "was asked for by name"):
            headwise.paged_attention(q[:, :, :1], pages, pages, torch.tensor([[0, 1]]), torch.tensor([6]),
                                     backend="sdpa")
    assert headwise.attention(q, k, v, window=3).shape == (1, 2, 6, 8)  # outside the mode: served


def test_a_call_remembered_outside_the_mode_is_not_reused_inside_it():
    import headwise

    q = k = v = torch.randn(1, 2, 6, 8)
    headwise.attention(q, k, v)
    headwise.attention(q, k, v)  # remembered: sdpa
    with headwise.batch_invariant(), headwise.trace() as t:
        headwise.attention(q, k, v)
    assert any("backend 'invariant'" in stage.note for stage in t.stages)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_gives_the_bits_of_contiguous_attention_whatever_the_pages_order_and_size(dtype):
    import headwise

    gen = torch.Generator().manual_seed(2)
    lens, T = [45, 70, 9], 3
    keys = [torch.randn(2, n, 16, generator=gen).to(dtype) for n in lens]  # (Hkv, L, D) per sequence
    values = [torch.randn(2, n, 16, generator=gen).to(dtype) for n in lens]
    q = torch.randn(3, 4, T, 16, generator=gen).to(dtype)
    with headwise.batch_invariant():
        want = [headwise.attention(q[b:b + 1], keys[b][None], values[b][None], is_causal=True) for b in range(3)]
        for P in (1, 4, 16):
            W = max(-(-n // P) for n in lens)
            N = 3 * W + 5
            order = torch.randperm(N, generator=gen)  # pages handed out in a shuffled order
            k_pages, v_pages = torch.randn(N, 2, P, 16).to(dtype), torch.randn(N, 2, P, 16).to(dtype)  # stale values
            table = torch.zeros(3, W, dtype=torch.int64)
            for b, n in enumerate(lens):
                for i in range(-(-n // P)):
                    page = int(order[b * W + i])
                    table[b, i] = page
                    rows = slice(i * P, min(n, (i + 1) * P))
                    k_pages[page, :, :rows.stop - rows.start] = keys[b][:, rows]
                    v_pages[page, :, :rows.stop - rows.start] = values[b][:, rows]
            out = headwise.paged_attention(q, k_pages, v_pages, table, torch.tensor(lens))
            for b in range(3):
                assert torch.equal(out[b:b + 1], want[b]), (P, b)


def test_the_linear_layer_is_nn_linear_outside_the_mode_and_tiled_inside():
    torch.manual_seed(0)
    plain = torch.nn.Linear(E, N)
    layer = invariance.Linear(E, N)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(300, E)
    assert torch.equal(layer(x), plain(x))
    with batch_invariant():
        assert torch.equal(layer(x), invariance.linear(x, plain.weight, plain.bias))
        assert all(torch.equal(layer(x[:M])[7], layer(x[7:8])[0]) for M in (8, 9, 64, 300))


def test_context_parallelism_is_refused_inside_the_mode_with_the_remedy():
    import headwise
    from headwise.distributed import ContextParallel

    mha = headwise.MultiHeadAttention(EMB, HEADS, context_parallel=ContextParallel())
    with headwise.batch_invariant(), pytest.raises(ValueError, match=r"context_parallel=.* cannot keep "
                                                   r"headwise.batch_invariant\(\)'s promise.*batch_invariant\(False\)"):
        mha(torch.randn(1, 8, EMB))


def test_a_paged_steps_report_inside_the_mode_names_the_folded_prefix():
    import headwise

    mha = _module(torch.float32)
    from headwise.paged import SHARED_PREFIX_MIN_KEYS

    cache = headwise.PagedKVCache.for_module(mha, num_pages=SHARED_PREFIX_MIN_KEYS // 8 + 8, page_size=8)
    root = cache.add()
    with torch.no_grad():
        mha(torch.randn(1, SHARED_PREFIX_MIN_KEYS + 8, EMB), cache=cache.batch([root]))
    seqs = [root, cache.fork(root)]
    with headwise.batch_invariant():
        report = str(mha.dispatch(torch.randn(2, 1, EMB), cache=cache.batch(seqs)))
    assert "one pass folded into each member's state" in report and "native_paged" in report


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_prefix_gives_the_bits_of_private_pages(dtype):
    """Two sequences whose first five pages are one shared prompt (share_prefix=True attends it
    once, folded into each member's state) against each on private pages, and against
    contiguous attention."""
    import headwise

    gen = torch.Generator().manual_seed(3)
    P, T = 8, 2
    k_pages = torch.randn(24, 2, P, 16, generator=gen).to(dtype)
    v_pages = torch.randn(24, 2, P, 16, generator=gen).to(dtype)
    table = torch.tensor([[9, 3, 17, 5, 11, 0, 2], [9, 3, 17, 5, 11, 20, 7], [1, 4, 6, 8, 10, 12, 13]])
    lens = torch.tensor([53, 49, 50])
    q = torch.randn(3, 4, T, 16, generator=gen).to(dtype)
    private_k, private_v = k_pages.clone(), v_pages.clone()  # sequence 1 on copies of the shared pages
    private = table.clone()
    private[1, :5] = torch.tensor([14, 15, 16, 18, 19])
    private_k[[14, 15, 16, 18, 19]], private_v[[14, 15, 16, 18, 19]] = k_pages[table[0, :5]], v_pages[table[0, :5]]
    with headwise.batch_invariant():
        with headwise.trace() as traced:
            shared = headwise.paged_attention(q, k_pages, v_pages, table, lens, share_prefix=True)
        assert any(stage.name == "shared prefix" for stage in traced.stages)  # attended once, folded
        apart = headwise.paged_attention(q, private_k, private_v, private, lens, share_prefix=False)
        for b in range(3):
            keys = torch.cat([k_pages[p] for p in table[b].tolist()], 1)[:, :lens[b]]  # (Hkv, L, D)
            values = torch.cat([v_pages[p] for p in table[b].tolist()], 1)[:, :lens[b]]
            want = headwise.attention(q[b:b + 1], keys[None], values[None], is_causal=True)
            assert torch.equal(shared[b:b + 1], want) and torch.equal(apart[b:b + 1], want), b


def test_every_test_the_modes_page_cites_exists():
    """docs/invariance.md names the test behind each promise: each must exist (and so run)."""
    import re
    from pathlib import Path

    tests = Path(__file__).parent
    page = (tests.parent / "docs" / "invariance.md").read_text()
    cited, current = [], None
    for path, name in re.findall(r"`(?:([\w/]+\.py))?::(test_\w+)`", page):
        current = path or current
        cited.append((current, name))
    assert len(cited) >= 10
    for path, name in cited:
        assert f"def {name}(" in (tests / path).read_text(), f"docs/invariance.md cites {path}::{name}"

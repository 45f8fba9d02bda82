"""``module/measured.py``: a packing choice the estimates cannot make is measured.

Where the packed and the dense path are priced within ``policy.PACK_MEASURE_BAND`` of each
other, the second call of a shape without gradients runs both in turns, returns the faster
one's output and remembers the choice for the shape; its first call runs the estimates' path.
The clock is replaced here by one that each path's run advances by a known amount, so which
path is faster is the test's to say; outputs are compared with a float64 computation from the
module's weights.

Legend: B batch, S query length, E embed dim, H heads.
"""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import calibration, policy
from headwise.module import dense, packed
from headwise.module import measured as measuring
from headwise.module import plan as planning

# tests/module/test_plan.py's close case: B=32 S=32 E=128, 48% padding, priced packed 4,910 us
# against dense 4,936 us with these unit costs (auto_grid's row where packed ran 1.12-1.18x dense)
LENGTHS = (2, 2, 3, 3, 3, 4, 8, 9, 11, 13, 13, 14, 15, 15, 16, 16, 17, 18, 19, 20, 21, 21, 21, 24, 25, 25, 26, 28,
           28, 28, 29, 32)
CLOSE = policy.Costs(call_us=181.2, pack_us=72.6, bucket_us=176.0, gemm_ps=56.7, attn_ps=79.1, copy_ps=1091.0)
B, S, E, H = 32, 32, 128, 2
TURNS = [path for turn in range(measuring.TURNS) for path in (("dense", "packed"), ("packed", "dense"))[turn % 2]]


@pytest.fixture
def measuring_on(monkeypatch, tmp_path):
    """HEADWISE_TUNE=cache (no calibration is measured, nothing stored is found), the close
    unit costs, a record of measured shapes of the test's own, and a clock that only the
    paths' runs advance: dense by ``speeds["dense"]`` seconds a run, packed by ``speeds["packed"]``.
    Yields (speeds, runs): ``runs`` lists the paths in the order they ran."""
    monkeypatch.setenv("HEADWISE_TUNE", "cache")
    monkeypatch.setenv("HEADWISE_CACHE_DIR", str(tmp_path))
    calibration.forget()
    calibration.current()  # loaded before the costs are assigned, so that loading keeps them
    monkeypatch.setattr(policy, "INFERENCE_COSTS", CLOSE)
    monkeypatch.setattr(planning, "_MEASURED", {})
    monkeypatch.setattr(planning, "_SIGHTED", set())
    now = [0.0]
    speeds = {"dense": 1.0, "packed": 2.0}
    runs: list[str] = []

    def timed(path, forward):
        def run(*args, **kwargs):
            runs.append(path)
            now[0] += speeds[path]
            return forward(*args, **kwargs)
        return run

    monkeypatch.setattr(measuring, "_clock", lambda: now[0])
    monkeypatch.setattr(dense, "forward", timed("dense", dense.forward))
    monkeypatch.setattr(dense, "forward_repeat", timed("dense", dense.forward_repeat))  # the memo's repeats
    monkeypatch.setattr(packed, "forward", timed("packed", packed.forward))
    yield speeds, runs
    calibration.forget()


def batch():
    x = torch.randn(B, S, E)
    mask = torch.arange(S)[None, :] < torch.tensor(LENGTHS)[:, None]  # (B, S) True = token
    return x, mask


def expected(mha, x, mask, ref):
    """The module's forward in float64 from its weights, padded queries zero: (B, S, E)."""
    w = {name: p.detach().double() for name, p in mha.state_dict().items()}
    x = x.double()
    D = E // H

    def heads(name):
        return (x @ w[f"{name}.weight"].T + w[f"{name}.bias"]).reshape(B, S, H, D).transpose(1, 2)  # (B, H, S, D)

    out, _ = ref(heads("q_proj"), heads("k_proj"), heads("v_proj"), mask)  # (B, H, S, D)
    out = out.transpose(1, 2).reshape(B, S, E) @ w["out_proj.weight"].T + w["out_proj.bias"]  # (B, S, E)
    return out * mask[..., None]


@pytest.mark.parametrize("faster", ["dense", "packed"])
def test_a_recurring_close_call_runs_both_paths_and_its_shape_keeps_the_faster(measuring_on, faster, ref):
    speeds, runs = measuring_on
    speeds[faster] = 0.5
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, mask = batch()
    with torch.no_grad():
        first = mha.plan(x, mask)
        assert first.measure is not None and "the shape's second call runs both paths" in first.why
        assert first.path == "dense"  # the estimates' choice: PACK_MARGIN keeps the close case dense
        out = mha(x, mask)
        assert runs == ["dense"]  # the shape's first call: the estimates' path alone
        torch.testing.assert_close(out.double(), expected(mha, x, mask, ref), atol=2e-5, rtol=1e-4)
        assert mha.plan(x, mask).measure is not None  # plan() reads the record, it adds no call to it
        runs.clear()
        out = mha(x, mask)
        assert runs == TURNS  # in turns, each path first in every other one
        torch.testing.assert_close(out.double(), expected(mha, x, mask, ref), atol=2e-5, rtol=1e-4)
        later = mha.plan(x, mask)
        slower = "packed" if faster == "dense" else "dense"
        assert later.path == faster and later.measure is None
        assert (f"measured on this machine: packed {speeds['packed'] * 1e6:,.0f} us vs dense "
                f"{speeds['dense'] * 1e6:,.0f} us" in later.why), later.why
        runs.clear()
        again = mha(x, mask)
        assert runs == [faster]  # measured once: the shape's later calls run one path
        torch.testing.assert_close(again, out, atol=1e-6, rtol=1e-5)
        assert slower not in runs


def test_another_batch_of_the_same_shape_takes_the_measured_path(measuring_on):
    """The choice is kept per shape (B, S, E, heads, dtype, padding in steps of 5%, attention
    calls), not per lengths: a batch with the lengths in another order is the same shape."""
    speeds, runs = measuring_on
    speeds["packed"] = 0.5
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, mask = batch()
    with torch.no_grad():
        mha(x, mask)
        mha(x, mask)  # measured
        runs.clear()
        shuffled = mask[torch.randperm(B)]
        assert mha.plan(x, shuffled).path == "packed"
        mha(x, shuffled)
        assert runs == ["packed"]


def test_a_changed_policy_measures_again(measuring_on, monkeypatch):
    _, runs = measuring_on
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, mask = batch()
    with torch.no_grad():
        mha(x, mask)
        mha(x, mask)  # measured
        monkeypatch.setattr(policy, "BUCKET_SLACK", policy.BUCKET_SLACK)  # any assignment: a new GENERATION
        runs.clear()
        mha(x, mask)
        mha(x, mask)
        assert runs == ["dense", *TURNS]


@pytest.mark.parametrize("band, path", [((0.1, 0.5), "dense"), ((1.5, 2.0), "packed")])
def test_prices_outside_the_band_decide_without_measuring(measuring_on, monkeypatch, band, path):
    """Below the band the module packs, above it stays dense, on the estimate alone (the close
    case is priced 0.995: PACK_MARGIN keeps it dense; a band above it packs at the margin 1)."""
    _, runs = measuring_on
    monkeypatch.setattr(policy, "PACK_MEASURE_BAND", band)
    if path == "packed":
        monkeypatch.setattr(policy, "PACK_MARGIN", 1.0)
    mha = headwise.MultiHeadAttention(E, H).eval()
    x, mask = batch()
    with torch.no_grad():
        plan = mha.plan(x, mask)
        assert (plan.path, plan.measure) == (path, None)
        mha(x, mask)
        mha(x, mask)  # the shape recurs: still the estimates' path, once a call
    assert runs == [path, path]


def _hooked(mha):
    mha.q_proj.register_forward_hook(lambda module, args, out: None)


@pytest.mark.parametrize("case", ["gradients", "dropout", "hooked projection", "HEADWISE_TUNE=off", "trace",
                                  "batch invariant"])
def test_no_call_measures_where_running_twice_would_show(measuring_on, monkeypatch, case):
    """A call that trains, draws dropout from the caller's RNG, calls a hook, is traced (headwise.trace), runs
    in the batch-invariant mode, or runs with HEADWISE_TUNE=off takes the estimates' path, once."""
    _, runs = measuring_on
    mha = headwise.MultiHeadAttention(E, H, dropout=0.1 if case == "dropout" else 0.0)
    mha.train(case == "dropout")
    x, mask = batch()
    if case == "hooked projection":
        _hooked(mha)
    if case == "HEADWISE_TUNE=off":
        monkeypatch.setenv("HEADWISE_TUNE", "off")
    grad = case == "gradients"
    if grad:
        monkeypatch.setattr(policy, "TRAINING_COSTS", CLOSE)
    with torch.set_grad_enabled(grad):
        if case == "trace":
            with headwise.trace():
                mha(x, mask)
        elif case == "batch invariant":
            with headwise.batch_invariant():
                mha(x, mask)
        else:
            assert mha.plan(x, mask).measure is None
            mha(x, mask)
            mha(x, mask)  # the shape recurs
    assert len(runs) in (1, 2) and len(set(runs)) == 1


def test_shapes_that_never_recur_are_never_measured(measuring_on):
    """Padding each batch to its longest sequence gives every call a new length: each runs the
    estimates' path once, and only a length that comes back is measured."""
    _, runs = measuring_on
    mha = headwise.MultiHeadAttention(E, H).eval()
    calls = []
    with torch.no_grad():
        for longest in (32, 33, 34, 35, 32):
            x = torch.randn(B, longest, E)
            mask = torch.arange(longest)[None, :] < torch.tensor(LENGTHS)[:, None]  # (B, longest)
            assert mha.plan(x, mask).measure is not None  # each priced within the band
            runs.clear()
            mha(x, mask)
            calls.append(list(runs))
    assert calls[:4] == [["dense"]] * 4  # each new length: the estimates' path alone
    assert calls[4] == TURNS  # the length that came back is measured

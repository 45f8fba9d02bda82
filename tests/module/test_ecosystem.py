"""MultiHeadAttention as an ordinary nn.Module (issue 24): the tools users reach for work on it.

PEFT LoRA, safetensors, hooks at any time, the meta device, activation checkpointing,
torch.export, DDP over gloo, torchao quantisation, state-dict loading and conversion, and
the clear errors. Every output is compared with a float64 plain-math reference written here
(or with the plain run of the same module), never with itself.

The file is also DDP's worker: ``python tests/module/test_ecosystem.py ddp-worker RANK WORLD PORT OUT``.

Legend: B batch, H query heads, Hkv key/value heads, S query length, D head dim, E embed dim.
"""

from __future__ import annotations

import copy
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import headwise

E, H = 32, 4
D = E // H
B, S = 2, 3  # small: the fused inference path takes calls of B x S x E <= policy.FUSED_MAX_ELEMENTS
HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
DDP_TIMEOUT_S = 120  # a deadlock fails the test instead of hanging CI


# ---------------------------------------------------------------- the float64 oracle

def reference(x, weights: dict, *, padding=None, is_causal=False, q_scale=1.0):
    """Multi-head self-attention written out in float64 from a state dict's projections.

    ``weights``: ``q_proj.weight`` (E, E), ``k_proj.weight`` / ``v_proj.weight`` (Hkv*D, E),
    ``out_proj.weight`` (E, E), and the biases where present. ``padding`` (B, S) bool, True at
    real tokens: padded keys are not attended and padded positions output zeros. Causal is
    bottom-right. ``q_scale`` multiplies the q projection (what a hook or wrapper does in tests).
    Returns (B, S, E) float64.
    """
    w = {name: t.detach().double() for name, t in weights.items()}
    x = x.detach().double()
    Bx, Sx, _ = x.shape

    def linear(t, name):
        out = t @ w[f"{name}.weight"].T  # (B, S, E) x (E, out) -> (B, S, out)
        bias = w.get(f"{name}.bias")
        return out if bias is None else out + bias

    q = q_scale * linear(x, "q_proj")
    k, v = linear(x, "k_proj"), linear(x, "v_proj")
    Hkv = k.shape[-1] // D
    q = q.reshape(Bx, Sx, H, D).transpose(1, 2)  # (B, H, S, D)
    k = k.reshape(Bx, Sx, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, S, D)
    v = v.reshape(Bx, Sx, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)  # (B, H, S, D)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, S, D) x (B, H, D, S) -> (B, H, S, S)
    allowed = torch.ones(Bx, 1, Sx, Sx, dtype=torch.bool)
    if padding is not None:
        allowed = allowed & padding[:, None, None, :]
    if is_causal:
        allowed = allowed & torch.ones(Sx, Sx, dtype=torch.bool).tril()
    scores = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key outputs zeros
    out = (probs @ v).transpose(1, 2).reshape(Bx, Sx, E)  # (B, H, S, S) x (B, H, S, D) -> (B, S, E)
    out = linear(out, "out_proj")
    if padding is not None:
        out = out * padding[..., None]
    return out


def weights_of(mha: nn.Module) -> dict:
    return {name: t for name, t in mha.state_dict().items() if name.endswith(("weight", "bias"))}


def inputs(dtype=torch.float32, Bx=B, Sx=S, seed=1):
    return torch.randn(Bx, Sx, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


class Wrapper(nn.Module):
    """The smallest model around the module (PEFT, quantize_ and safetensors take models)."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attn = headwise.MultiHeadAttention(E, H, **kwargs)

    def forward(self, x, attention_mask=None):
        return self.attn(x, attention_mask)


# ---------------------------------------------------------------- 1, 12: PEFT LoRA

def test_peft_lora_on_q_v_out_trains_only_adapters_and_merges_to_the_trained_model():
    # issue 24: PEFT LoRA on q_proj, v_proj, out_proj; gradients reach only the LoRA parameters;
    # merge_and_unload() equals the trained model and the plain-math reference of its merged weights
    peft = pytest.importorskip("peft")
    model = Wrapper().eval()
    x = inputs()
    with torch.no_grad():  # a first call (small, no gradients: the fused path) builds any internal weight cache
        before = model(x)
    config = peft.LoraConfig(target_modules=["q_proj", "v_proj", "out_proj"], r=4, lora_alpha=8)
    lora = peft.get_peft_model(model, config)
    names = [n for n, _ in lora.named_parameters() if "lora_" in n]
    for target in ("q_proj", "v_proj", "out_proj"):
        assert any(f"{target}.lora_A" in n for n in names), (target, names)
    assert not any("k_proj.lora_" in n for n in names)

    lora.train()
    opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.5)
    target = inputs(seed=2)
    for step in range(3):
        opt.zero_grad()
        loss = (lora(x) - target).square().mean()
        loss.backward()
        for name, p in lora.named_parameters():
            if "lora_" in name:
                assert p.requires_grad, name
            else:
                assert p.grad is None, f"a base parameter got a gradient: {name}"
        if step == 0:  # lora_B starts at zero: it gets the first gradients
            assert all(p.grad is not None for n, p in lora.named_parameters() if "lora_B" in n)
        opt.step()

    lora.eval()
    with torch.no_grad():
        trained = lora(x)
    assert (trained - before).abs().max() > 1e-3, "a few SGD steps on the adapters must change the output"
    merged = lora.merge_and_unload()  # writes the merged weights through .data (no version bump)
    assert type(merged.attn.q_proj) is nn.Linear and type(merged.attn.out_proj) is nn.Linear
    with torch.no_grad():  # the small-call inference path again, after the merge
        got = merged(x)
    torch.testing.assert_close(got, trained, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.double(), reference(x, weights_of(merged.attn)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("proj", ["q_proj", "out_proj"])
@pytest.mark.parametrize("write", ["inplace", "assign"])
def test_a_write_through_data_after_a_first_call_is_seen(proj, write):
    # issue 24 item 1 (the trap): a weight written through .data (as merge_and_unload does) bumps no
    # version counter; the next small no-grad call must still read the new weight
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    with torch.no_grad():
        mha(x)
        mha(x)  # a remembered signature too
    w = getattr(mha, proj).weight
    new = torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) / math.sqrt(E)
    if write == "inplace":
        w.data.copy_(new)
    else:
        w.data = new.clone()
    assert torch.equal(getattr(mha, proj).weight.detach(), new), "the write must reach the module's weight"
    with torch.no_grad():
        got = mha(x)
    torch.testing.assert_close(got.double(), reference(x, weights_of(mha)), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- 2: safetensors

@pytest.mark.parametrize("extras", [{}, {"qk_norm": "rms", "sinks": True, "num_kv_heads": 2}], ids=["plain", "extras"])
def test_safetensors_save_model_load_model_round_trip(tmp_path, extras):
    # issue 24: safetensors save_model / load_model into a freshly built module
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(1)
    saved = Wrapper(**extras).eval()
    with torch.no_grad():
        for p in saved.parameters():  # norms and sinks start at ones / zeros: make every value count
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path / "model.safetensors"
    st.save_model(saved, str(path))
    torch.manual_seed(2)
    fresh = Wrapper(**extras).eval()
    missing, unexpected = st.load_model(fresh, str(path))
    assert (sorted(missing), sorted(unexpected)) == ([], [])
    a, b = saved.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), saved(x), atol=0, rtol=0)


# ---------------------------------------------------------------- 3: hooks, at any time

def _first_call(mha, x):
    with torch.no_grad():  # a small call without gradients: today's fused inference path
        mha(x)
        mha(x)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_forward_hooks_registered_after_a_first_call_run(grad):
    # issue 24: hooks registered at any time on any submodule run on the next call
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    _first_call(mha, x)
    calls = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "out_proj": 0}

    def counter(name):
        def hook(module, args, output):
            calls[name] += 1
        return hook

    handles = [getattr(mha, name).register_forward_hook(counter(name)) for name in calls]
    with torch.set_grad_enabled(grad):
        mha(x)
    for h in handles:
        h.remove()
    assert calls == {"q_proj": 1, "k_proj": 1, "v_proj": 1, "out_proj": 1}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_hooks_that_change_outputs_after_a_first_call_change_the_result(grad):
    # issue 24: a forward hook that modifies a submodule's output changes the module's result
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    _first_call(mha, x)
    h_out = mha.out_proj.register_forward_hook(lambda m, a, out: out + 1.0)
    with torch.set_grad_enabled(grad):
        got = mha(x)
    h_out.remove()
    torch.testing.assert_close(got.detach().double(), reference(x, weights_of(mha)) + 1.0, atol=1e-5, rtol=0)
    h_q = mha.q_proj.register_forward_hook(lambda m, a, out: 2.0 * out)
    with torch.set_grad_enabled(grad):
        got = mha(x)
    h_q.remove()
    torch.testing.assert_close(got.detach().double(), reference(x, weights_of(mha), q_scale=2.0), atol=1e-5, rtol=0)


def test_a_global_module_hook_added_after_a_first_call_sees_the_linears():
    # issue 24: global module hooks (register_module_forward_hook) see the Linear submodules
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    _first_call(mha, x)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(m))
    try:
        with torch.no_grad():
            mha(x)
    finally:
        handle.remove()
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert any(m is getattr(mha, name) for m in seen), f"the global hook never saw {name}"


@pytest.mark.parametrize("kind", ["module backward", "module backward pre", "global backward", "global backward pre"])
def test_backward_hooks_added_after_a_first_call_see_every_projection(kind):
    # issue 24: full backward hooks (and pre-hooks), on a projection or global, registered after
    # the first call, run in the next backward for each of the four Linears
    mha = headwise.MultiHeadAttention(E, H)
    x = inputs().requires_grad_()
    mha(x).sum().backward()  # a first call and backward, without hooks
    seen = []

    def hook(module, *grads):
        seen.append(module)

    if kind.startswith("module"):
        register = "register_full_backward_hook" if kind == "module backward" else "register_full_backward_pre_hook"
        handles = [getattr(getattr(mha, name), register)(hook) for name in ("q_proj", "k_proj", "v_proj", "out_proj")]
    else:
        register = (torch.nn.modules.module.register_module_full_backward_hook if kind == "global backward"
                    else torch.nn.modules.module.register_module_full_backward_pre_hook)
        handles = [register(hook)]
    try:
        mha(x).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert any(m is getattr(mha, name) for m in seen), f"the {kind} hook never saw {name}"
    seen.clear()
    mha(x).sum().backward()
    assert seen == []  # removed: not called again


def test_out_proj_bias_none_after_a_first_call():
    # issue 24: out_proj.bias = None after the first call works (equal to a reference without it)
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    _first_call(mha, x)
    mha.out_proj.bias = None
    with torch.no_grad():
        got = mha(x)
    expected = reference(x, weights_of(mha))  # the state dict holds no out_proj.bias now
    assert "out_proj.bias" not in weights_of(mha)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


class Doubling(nn.Module):
    """A user's module in place of a projection: calls the original, doubles, counts."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return 2.0 * self.inner(x)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_replaced_projection_is_called(grad):
    # issue 24: mha.q_proj = SomeWrapper(mha.q_proj) is called (a user module replacing a projection)
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    _first_call(mha, x)
    expected = reference(x, weights_of(mha), q_scale=2.0)
    mha.q_proj = Doubling(mha.q_proj)
    with torch.set_grad_enabled(grad):
        got = mha(x)
    assert mha.q_proj.calls == 1
    torch.testing.assert_close(got.detach().double(), expected, atol=1e-5, rtol=0)


def test_an_out_proj_replaced_by_a_module_without_a_weight_still_runs():
    # issue 24: the module's checks read a reference weight; a replaced out_proj need not have one
    mha = headwise.MultiHeadAttention(E, H).eval()
    x = inputs()
    with torch.no_grad():
        before = mha(x)
        mha.out_proj = nn.Sequential(mha.out_proj)
        after = mha(x, torch.ones(B, S, dtype=torch.bool))
        cache = mha.new_cache(B, S + 1)
        mha(x, cache=cache)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- 4: the meta device

def test_meta_device_construction_and_forward():
    # issue 24: construction on the meta device, and a forward on meta tensors, as nn.MultiheadAttention
    mha = headwise.MultiHeadAttention(E, H, device="meta")
    assert all(p.device.type == "meta" for p in mha.parameters())
    out = mha(torch.empty(B, S, E, device="meta"))
    assert out.device.type == "meta" and out.shape == (B, S, E)
    meta_x = torch.empty(B, S, E, device="meta")
    torch_out, _ = nn.MultiheadAttention(E, H, batch_first=True, device="meta")(meta_x, meta_x, meta_x)
    assert torch_out.shape == out.shape


@pytest.mark.parametrize("extras", [{}, {"qk_norm": "rms", "sinks": True}], ids=["plain", "extras"])
def test_meta_to_empty_then_reset_parameters(extras):
    # issue 24: to_empty(device="cpu") then reset_parameters() gives finite parameters and a working forward
    mha = headwise.MultiHeadAttention(E, H, device="meta", **extras)
    mha.to_empty(device="cpu")
    mha.reset_parameters()
    for name, p in mha.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
    bound = 1 / math.sqrt(E)  # nn.Linear's initialisation: |w| and |b| <= 1 / sqrt(fan_in)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        proj = getattr(mha, name)
        assert proj.weight.abs().max() <= bound and proj.bias.abs().max() <= bound, name
    if extras:  # the norms start at ones and the sinks at zeros, as at construction
        assert torch.equal(mha.q_norm.weight, torch.ones(D)) and torch.equal(mha.k_norm.weight, torch.ones(D))
        assert torch.equal(mha.sinks, torch.zeros(H))
    x = inputs()
    with torch.no_grad():
        out = mha(x)
    assert torch.isfinite(out).all()
    if not extras:
        torch.testing.assert_close(out.double(), reference(x, weights_of(mha)), atol=1e-5, rtol=0)


def test_reset_parameters_restores_alibi_slopes_after_to_empty():
    """ALiBi's slopes are a buffer to_empty() leaves uninitialised: reset_parameters() writes the
    paper's slopes again, and the module equals one built on the CPU with the same weights."""
    mha = headwise.MultiHeadAttention(E, H, alibi=True, device="meta").to_empty(device="cpu")
    mha.reset_parameters()
    fresh = headwise.MultiHeadAttention(E, H, alibi=True)
    torch.testing.assert_close(mha.alibi_slopes, fresh.alibi_slopes, rtol=0, atol=0)
    fresh.load_state_dict(mha.state_dict())
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(mha(x), fresh(x), rtol=0, atol=0)


def test_reset_parameters_skips_a_projection_a_user_replaced_with_one_that_has_none():
    """A projection replaced by a module without reset_parameters (a wrapper of the user's) is left
    as it is; the other parts are initialised."""
    mha = headwise.MultiHeadAttention(E, H)
    wrapper = nn.Sequential(nn.Linear(E, E))  # Sequential has no reset_parameters of its own
    mha.q_proj = wrapper
    kept = wrapper[0].weight.detach().clone()
    before = mha.out_proj.weight.detach().clone()
    mha.reset_parameters()
    assert torch.equal(wrapper[0].weight, kept) and not torch.equal(mha.out_proj.weight, before)


def test_reset_parameters_reinitialises_every_parameter():
    # issue 24: reset_parameters() exists and re-initialises every parameter
    mha = headwise.MultiHeadAttention(E, H)
    torch.manual_seed(11)
    mha.reset_parameters()
    first = {n: p.detach().clone() for n, p in mha.named_parameters()}
    torch.manual_seed(12)
    mha.reset_parameters()
    for name, p in mha.named_parameters():
        assert not torch.equal(p, first[name]), f"reset_parameters left {name} as it was"
    torch.manual_seed(11)
    mha.reset_parameters()
    for name, p in mha.named_parameters():
        assert torch.equal(p, first[name]), f"reset_parameters is not a function of the seed for {name}"


# ---------------------------------------------------------------- 5: activation checkpointing

@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_checkpoint_non_reentrant_equals_the_plain_run(is_causal):
    # issue 24: torch.utils.checkpoint (use_reentrant=False): outputs and every gradient equal the plain run
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    plain = headwise.MultiHeadAttention(E, H, dtype=torch.float64)
    ckpt = copy.deepcopy(plain)
    x = inputs(torch.float64, Sx=5)
    padding = torch.tensor([[True] * 5, [True, True, True, False, False]])  # right padding
    grad_out = torch.randn(B, 5, E, dtype=torch.float64)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out_plain = plain(xs[0], padding, is_causal=is_causal)
    out_ckpt = checkpoint(ckpt, xs[1], padding, is_causal=is_causal, use_reentrant=False)
    expected = reference(x, weights_of(plain), padding=padding, is_causal=is_causal)
    torch.testing.assert_close(out_plain.detach(), expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(out_ckpt, out_plain, atol=1e-12, rtol=0)
    (out_plain * grad_out).sum().backward()
    (out_ckpt * grad_out).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, atol=1e-12, rtol=0)
    grads = dict(plain.named_parameters())
    for name, p in ckpt.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-12, rtol=0, msg=name)


# ---------------------------------------------------------------- 6: torch.export

def test_torch_export_with_a_padding_mask():
    # issue 24: torch.export.export of the module with a (B, S) bool padding mask equals eager
    torch.manual_seed(4)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64).eval()
    x = inputs(torch.float64, Sx=4)
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    program = torch.export.export(mha, (x, mask))
    with torch.no_grad():
        got = program.module()(x, mask)
        eager = mha(x, mask)
    torch.testing.assert_close(got, eager, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, reference(x, weights_of(mha), padding=mask), atol=1e-12, rtol=0)
    other = torch.tensor([[True, False, False, False], [True, True, True, True]])  # the mask's values are inputs
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x, other), reference(x, weights_of(mha), padding=other),
                                   atol=1e-12, rtol=0)


# ---------------------------------------------------------------- 7: DDP over gloo

def _ddp_setup(seed: int = 7):
    """The module, the global batch and its targets, the same in every process."""
    torch.manual_seed(seed)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64, is_causal=True)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, S, E, generator=gen, dtype=torch.float64)  # (B, S, E), B = 4: 2 rows per rank
    target = torch.randn(4, S, E, generator=gen, dtype=torch.float64)
    return mha, x, target


def _ddp_step(model, x, target) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    (model(x) - target).square().mean().backward()  # the mean: DDP's average over equal halves is the global mean
    opt.step()


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        mha, x, target = _ddp_setup()
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
        _ddp_step(DistributedDataParallel(mha), x[rows], target[rows])
        if rank == 0:
            torch.save(mha.state_dict(), out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gloo_two_ranks_equals_one_process(tmp_path):
    # issue 24: DDP over gloo on 2 ranks, each with half the batch, equals one process on the whole batch
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out, world, port = tmp_path / "ddp.pt", 2, _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    import fresh_process  # tests/: `python tests/module/test_ecosystem.py ddp-worker ...` per rank, torch imported

    procs = [fresh_process.start(script=HERE, args=("ddp-worker", str(r), str(world), str(port), str(out)),
                                 env=env, stderr_to_stdout=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            p.wait(timeout=DDP_TIMEOUT_S)
            logs.append(p.output()[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"DDP ranks did not finish within {DDP_TIMEOUT_S} s (a deadlock?)")
    finally:
        for p in procs:
            p.kill()  # nothing where it has exited
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    mha, x, target = _ddp_setup()
    _ddp_step(mha, x, target)
    got = torch.load(out)
    expected = mha.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-12, rtol=0, msg=name)


# ---------------------------------------------------------------- 8: torchao

def test_torchao_int8_weight_only_quantises_every_projection():
    # issue 24: torchao int8 weight-only quantisation of the Linear layers; output within 2e-2 of float
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(5)
    model = Wrapper().eval()
    x = inputs(Sx=8)
    with torch.no_grad():
        expected = model(x)
    quantize_(model, Int8WeightOnlyConfig())
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        w = getattr(model.attn, name).weight
        assert type(w) not in (torch.Tensor, nn.Parameter), f"{name} was not quantised ({type(w).__name__})"
    with torch.no_grad():
        got = model(x)
    ratio = ((got - expected).norm() / expected.norm()).item()
    assert ratio < 2e-2, f"int8 weight-only output is {ratio:.3g} (relative) from the float output"


# ---------------------------------------------------------------- 9: state dicts

def test_state_dict_wrong_split_is_an_error_naming_the_key_and_nothing_loads():
    # issue 24: a wrong shape names the user-facing key and both shapes; nothing loads partially
    mha = headwise.MultiHeadAttention(E, H)
    before = {n: t.clone() for n, t in mha.state_dict().items()}
    torch.manual_seed(9)
    sd = {n: torch.randn_like(t) for n, t in mha.state_dict().items()}  # every value differs from the module's
    sd["q_proj.weight"] = torch.randn(24, E)  # the sum of q and k rows fits a fused (3E, E); the parts do not
    sd["k_proj.weight"] = torch.randn(40, E)
    with pytest.raises((RuntimeError, ValueError)) as info:
        mha.load_state_dict(sd)
    message = str(info.value)
    assert re.search(r"q_proj\.weight.*24, 32.*32, 32", message), message
    assert "qkv_weight" not in message, message
    for name, t in mha.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} loaded from a checkpoint that was refused"


def test_a_wrong_shape_in_a_nested_module_names_its_full_key_and_nothing_of_it_loads():
    # issue 24: inside a model (a prefix before every key), a wrong shape names the model's key
    # and both shapes, and loads nothing of the attention module
    model = nn.Sequential(nn.Linear(E, E), headwise.MultiHeadAttention(E, H))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    torch.manual_seed(9)
    sd = {n: torch.randn_like(t) for n, t in model.state_dict().items()}
    sd["1.v_proj.weight"] = torch.randn(E + 8, E)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(sd)
    message = str(info.value)
    assert re.search(r"1\.v_proj\.weight.*40, 32.*32, 32", message), message
    for name, t in model.state_dict().items():
        if name.startswith("1."):
            assert torch.equal(t, before[name]), f"{name} loaded from a checkpoint that was refused"


def test_state_dict_strict_false_reports_exactly_the_users_keys():
    # issue 24: with strict=False, an extra key and a missing one are reported as given
    mha = headwise.MultiHeadAttention(E, H)
    before = {n: t.clone() for n, t in mha.state_dict().items()}
    torch.manual_seed(9)
    sd = {n: torch.randn_like(t) for n, t in mha.state_dict().items()}
    del sd["k_proj.bias"]
    sd["foo"] = torch.ones(1)
    result = mha.load_state_dict(sd, strict=False)
    assert result.unexpected_keys == ["foo"]
    assert result.missing_keys == ["k_proj.bias"]
    now = mha.state_dict()
    assert torch.equal(now["k_proj.bias"], before["k_proj.bias"])
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.bias", "out_proj.weight"):
        assert torch.equal(now[name], sd[name]), name
    del sd["foo"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "k_proj\.bias"') as info:
        mha.load_state_dict(sd)
    assert "qkv" not in str(info.value), str(info.value)


@pytest.mark.parametrize("num_kv_heads", [H, 2], ids=["mha", "gqa"])
def test_an_old_fused_checkpoint_loads_as_the_separate_keys(num_kv_heads):
    # issue 24: checkpoints saved with the fused qkv_weight / qkv_bias still load
    torch.manual_seed(6)
    source = headwise.MultiHeadAttention(E, H, num_kv_heads=num_kv_heads)
    sd = source.state_dict()
    old = {
        "qkv_weight": torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),  # (E + 2*Hkv*D, E)
        "qkv_bias": torch.cat([sd["q_proj.bias"], sd["k_proj.bias"], sd["v_proj.bias"]]),
        "out_proj.weight": sd["out_proj.weight"], "out_proj.bias": sd["out_proj.bias"],
    }
    torch.manual_seed(7)
    from_old = headwise.MultiHeadAttention(E, H, num_kv_heads=num_kv_heads)
    from_new = copy.deepcopy(from_old)
    result = from_old.load_state_dict(old)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    from_new.load_state_dict(sd)
    a, b = from_old.state_dict(), from_new.state_dict()
    assert a.keys() == b.keys() == sd.keys()
    for name in a:
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], sd[name]), name
    x = inputs()
    with torch.no_grad():
        torch.testing.assert_close(from_old(x), from_new(x), atol=0, rtol=0)
        torch.testing.assert_close(from_old(x).double(), reference(x, sd), atol=1e-5, rtol=0)


def test_an_old_fused_checkpoint_of_the_wrong_size_is_an_error_naming_it():
    # issue 24: a fused qkv_weight of the wrong size is an error naming qkv_weight and the expected sizes
    mha = headwise.MultiHeadAttention(E, H)
    before = {n: t.clone() for n, t in mha.state_dict().items()}
    old = {"qkv_weight": torch.randn(3 * E - 1, E), "qkv_bias": torch.randn(3 * E - 1),
           "out_proj.weight": torch.randn(E, E), "out_proj.bias": torch.randn(E)}
    with pytest.raises((RuntimeError, ValueError)) as info:
        mha.load_state_dict(old)
    message = str(info.value)
    assert "qkv_weight" in message and re.search(r"\b95\b", message) and re.search(r"\b96\b", message), message
    for name, t in mha.state_dict().items():
        assert torch.equal(t, before[name]), f"{name} loaded from a checkpoint that was refused"


def test_an_old_fused_weight_and_bias_both_of_the_wrong_size_are_both_named():
    # issue 24: each fused key of the wrong size is named with its sizes; neither is "unexpected"
    mha = headwise.MultiHeadAttention(E, H)
    old = {"qkv_weight": torch.randn(3 * E - 1, E), "qkv_bias": torch.randn(3 * E + 1),
           "out_proj.weight": torch.randn(E, E), "out_proj.bias": torch.randn(E)}
    with pytest.raises(RuntimeError) as info:
        mha.load_state_dict(old)
    message = str(info.value)
    assert re.search(r"qkv_weight.*\(95, 32\)", message) and re.search(r"qkv_bias.*\(97,\)", message), message
    assert "Unexpected" not in message, message


# ---------------------------------------------------------------- 10: to_torch

def test_to_torch_refuses_a_causal_module_with_the_remedy():
    # issue 24: to_torch() of a causal module raises ValueError naming causal and the remedy
    with pytest.raises(ValueError, match=r"causal") as info:
        headwise.MultiHeadAttention(E, H, is_causal=True).to_torch()
    assert re.search(r"attn_mask|is_causal=True", str(info.value)), str(info.value)


def test_to_torch_of_a_non_causal_module_gives_equal_outputs():
    # issue 24: a non-causal module still converts, with equal outputs
    torch.manual_seed(8)
    mha = headwise.MultiHeadAttention(E, H, dtype=torch.float64).eval()
    m = mha.to_torch()
    x = inputs(torch.float64)
    with torch.no_grad():
        got = m(x, x, x, need_weights=False)[0]
        expected = mha(x)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(got, reference(x, weights_of(mha)), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- 11: clear errors

@pytest.mark.parametrize("other", [{"num_heads": 2}, {"num_kv_heads": 2}, {"v_head_dim": 4}],
                         ids=["head_dim", "num_kv_heads", "v_head_dim"])
def test_a_cache_from_a_differently_shaped_module_is_a_clear_error(other):
    # issue 24: a cache made by a differently shaped module -> ValueError naming both shapes
    kwargs = {"num_heads": H, **other}
    maker = headwise.MultiHeadAttention(E, kwargs.pop("num_heads"), **kwargs)
    cache = maker.new_cache(1, 8)
    mha = headwise.MultiHeadAttention(E, H)
    theirs = (maker.num_kv_heads, maker.head_dim, maker.v_head_dim)
    ours = (mha.num_kv_heads, mha.head_dim, mha.v_head_dim)
    with torch.no_grad(), pytest.raises(ValueError, match=r"new_cache") as info:
        mha(inputs(Bx=1, Sx=2), cache=cache)
    message = str(info.value)
    for values in (theirs, ours):  # each module's (Hkv, D, Dv), in that order, somewhere in the message
        assert re.search(r"\D" + r"\D+".join(str(v) for v in values) + r"\D", message), (values, message)
    assert len(cache) == 0


def test_a_cache_step_with_gradients_runs_and_its_backward_is_exact():
    # issue 24: backward through cache steps failed with "modified by an inplace operation"; issue 35:
    # refusing the step broke decoding without torch.no_grad(). Now the steps write out of place.
    mha = headwise.MultiHeadAttention(E, H, is_causal=True)
    cache = mha.new_cache(1, 8)
    x = torch.cat([inputs(Bx=1, Sx=2), inputs(Bx=1, Sx=1, seed=2)], dim=1)  # (1, 3, E)
    first = mha(x[:, :2], cache=cache)
    second = mha(x[:, 2:], cache=cache)
    (first.sum() + second.sum()).backward()
    got = {n: p.grad.clone() for n, p in mha.named_parameters()}
    mha.zero_grad()
    mha(x).sum().backward()
    for name, p in mha.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_a_double_input_to_a_float_module_names_both_dtypes():
    # issue 24: double input to a float module -> TypeError naming both dtypes and the remedy
    mha = headwise.MultiHeadAttention(E, H)
    with pytest.raises(TypeError, match=r"torch\.float64.*torch\.float32.*\.to\("):
        mha(inputs(torch.float64))


def test_a_device_mismatch_names_both_devices():
    # issue 24: a module/input device mismatch -> ValueError naming both devices and the remedy
    mha = headwise.MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"meta.*cpu.*\.to\("):
        mha(torch.empty(B, S, E, device="meta"))


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "ddp-worker":
    _ddp_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

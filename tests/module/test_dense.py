"""The dense path's remembered call (module/dense.py): a padded batch whose signature repeats
runs the sdpa kernel's bound call (Kernel.bind) for its attention, with the bits of the
kernel's own function, and agrees with the module in float64.

Legend: B batch, S sequence length, E embed dim.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

import headwise
from headwise.kernels import registry

E, H = 32, 4


def test_a_repeated_padded_batch_takes_the_bound_call_with_the_kernels_bits(monkeypatch):
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H, packing=False).eval()
    reference = copy.deepcopy(mha).double()
    x = torch.randn(3, 8, E)
    x[1, 5:] = float("nan")  # what a padded position holds reaches no output
    mask = torch.arange(8)[None, :] < torch.tensor([8, 5, 2])[:, None]  # (B, S)
    original = registry.get_kernel("sdpa")
    bound_calls = []

    def counted(fn, *args):
        call = original.bind(fn, *args)
        return None if call is None else (lambda *a: bound_calls.append(1) or call(*a))

    with torch.no_grad():
        monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(original, bind=counted))
        outs = [mha(x, mask) for _ in range(3)]  # the first call prepares, the others repeat
        monkeypatch.setitem(registry._KERNELS, "sdpa", dataclasses.replace(original, bind=None))
        unbound = mha(x, mask)
        expected = reference(x.double().nan_to_num(), mask)
    assert len(bound_calls) == 3  # every call's attention, the first's too
    assert all(torch.equal(out, unbound) for out in outs)
    assert not outs[0][~mask].any()  # padded positions output zeros
    torch.testing.assert_close(outs[0].double(), expected, atol=1e-5, rtol=1e-5)

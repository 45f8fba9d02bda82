"""The registry: one explicit list of built-in kernels, and register() for your own."""

from __future__ import annotations

import pytest
import torch

import headwise
from headwise import kernels
from headwise.kernels import registry


def test_builtin_lists_every_kernel_under_its_own_name_in_registry_order():
    assert list(kernels.BUILTIN) == list(kernels.kernels())
    for name, kernel in kernels.BUILTIN.items():
        assert kernel.name == name and kernels.get_kernel(name) is kernel


def test_register_adds_a_backend_users_can_call_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", dict(registry._KERNELS))  # restored after the test

    @kernels.register("plus_one", summary="q + 1, to see the call arrive")
    def plus_one(q, k, v, **kwargs):
        return q + 1, None

    q = torch.zeros(1, 2, 3, 4)
    assert torch.equal(headwise.attention(q, q, q, backend="plus_one"), q + 1)
    assert "plus_one" in headwise.available_backends()
    with pytest.raises(ValueError, match="a kernel named 'sdpa' is already registered"):
        kernels.register("sdpa", summary="again")(plus_one)

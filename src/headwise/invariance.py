"""Batch-invariant mode: a sequence's results do not depend on what else is in the batch.

Inside :func:`batch_invariant`, a row's bits are a function of that row's own inputs (its
tokens, its keys by position) and nothing else: not the batch size, not its position in the
batch, not the padding around it, not the number of query rows in the call. The field's
lesson (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025) is that
kernels change their reduction order with the shapes around a row: a GEMM whose blocking
follows M, a split-KV decode whose split count follows the batch, a tile that follows the
query length. So inside the mode:

- the projections run in fixed tiles of :data:`ROW_TILE` rows (:func:`linear`), each tile
  one GEMM of the same shape, whatever M is: a row's bits never depend on M;
- attention reduces each row over its keys in blocks of a fixed number of keys at fixed
  absolute offsets, merged in key order (the native kernel, ``csrc/paged_attention.cpp``).

Legend: M rows, E input features, N output features, R rows a tile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ROW_TILE", "Linear", "batch_invariant", "is_batch_invariant", "linear"]

# Rows of one GEMM of the mode's projections, per dtype. Every tile is one GEMM of R x E by
# E x N, so a row computes with the same blocking whatever M is; a call of fewer rows pads
# its tile. A row's bits depend on R, so R is fixed, never derived from M: a larger R runs a
# prefill's GEMMs closer to full speed, a smaller one wastes less on a decode step's few rows.
# fp32's tiles run as one torch.bmm over the tiles (each GEMM of the batch keeps the tile's
# shape); bf16's as one matrix product each (LOOPED), since torch.bmm over bf16 tiles falls to
# a slow path on the CPU (5-30x F.linear, AMD EPYC, torch 2.13). Measured there, 2 threads,
# E = N = 512, against F.linear: fp32 bmm of 16-row tiles 1.2-1.4x at M = 1,024-4,096 and
# 1.6x at M = 8 (32 rows: 1.05-1.17x and 2.1x); bf16 128-row products 1.24-1.37x and 3.8x.
# Bitwise checks, fp32 and bf16, R from 1 to 16: tests/test_invariance.py; the module's cost:
# benchmarks/invariance.py.
ROW_TILE: dict[torch.dtype, int] = {torch.float32: 16, torch.bfloat16: 128, torch.float64: 8}
LOOPED: frozenset[torch.dtype] = frozenset({torch.bfloat16})

_F = TypeVar("_F", bound=Callable[..., Any])
_enabled: list[bool] = [False]


def is_batch_invariant() -> bool:
    """Whether the batch-invariant mode is on (:func:`batch_invariant`).

    >>> is_batch_invariant()
    False
    """
    return _enabled[-1]


class batch_invariant(contextlib.ContextDecorator):  # noqa: N801 (a context manager named as torch names them)
    """Turn the batch-invariant mode on (or, ``enabled=False``, off) inside a ``with`` block
    or a decorated function; the mode before it is restored on the way out.

    Args:
        enabled: the mode inside the block.

    >>> with batch_invariant():
    ...     is_batch_invariant()
    True
    """

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"batch_invariant(enabled) takes a bool, got {type(enabled).__name__} {enabled!r}")
        self.enabled = enabled

    def __enter__(self) -> batch_invariant:
        _enabled.append(self.enabled)
        return self

    def __exit__(self, *exc: object) -> None:
        _enabled.pop()


class _TiledLinear(torch.autograd.Function):
    """``F.linear`` over fixed row tiles: each tile's rows, forward and input gradient, from
    one GEMM of the tile's shape. The weight's gradient (a sum over every row) is one plain
    GEMM: the mode promises a row's outputs and input gradients, not the weights' sum."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # (M, E) -> (M, N)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = _tiled(x, weight.t())  # (M, E) x (E, N), a tile at a time
        return out if bias is None else out + bias  # the bias added per element: a row's own sum

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # (M, N) x (N, E) per tile: a row's gradient from its own tile
            dx = _tiled(grad, weight)
        if ctx.needs_input_grad[1]:
            dw = grad.t() @ x  # (N, M) x (M, E) -> (N, E)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.sum(0)  # (N,)
        return dx, dw, db


def _tiled(rows: Tensor, matrix: Tensor) -> Tensor:
    """``rows @ matrix``, (M, K) x (K, N) -> (M, N), in tiles of ROW_TILE[dtype] rows (the last
    one padded with zeros, which change no other row): each tile one GEMM of the same shape."""
    M, K = rows.shape
    R = ROW_TILE.get(rows.dtype, 8)
    n = -(-M // R)
    if n * R != M:
        rows = torch.cat([rows, rows.new_zeros(n * R - M, K)])  # (n R, K)
    N = matrix.shape[1]
    if rows.dtype in LOOPED and n:
        out = torch.cat([tile @ matrix for tile in rows.split(R)])  # n x (R, K) x (K, N)
    else:
        out = torch.bmm(rows.reshape(n, R, K), matrix.expand(n, K, N))  # (n, R, K) x (n, K, N)
    return out.reshape(n * R, N)[:M]  # (M, N)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` whose every row has the same bits whatever the other
    rows: (.., E) -> (.., N), in tiles of :data:`ROW_TILE` rows (per dtype).

    >>> x, w = torch.randn(5, 16), torch.randn(8, 16)
    >>> torch.equal(linear(x, w)[2], linear(x[2:3], w)[0])
    True
    """
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        return F.linear(x, weight, bias)  # only the CPU's GEMMs are measured to keep a tile's bits
    lead = x.shape[:-1]
    out = _TiledLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)  # (M, E) -> (M, N)
    return out.reshape(*lead, weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` whose rows keep their bits inside :func:`batch_invariant` (:func:`linear`);
    outside it, exactly ``nn.Linear``. The same parameters and state dict: a drop-in for the
    layers of a model around headwise's attention (an MLP, the output layer), so that the
    whole model keeps a sequence's bits whatever the batch.

    >>> layer = Linear(16, 8)
    >>> x = torch.randn(5, 16)
    >>> with batch_invariant():
    ...     torch.equal(layer(x)[2], layer(x[2:3])[0])
    True
    """

    def forward(self, x: Tensor) -> Tensor:
        if is_batch_invariant():
            return linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

"""Ulysses: trade the sequence split for a head split with two all-to-alls, attend locally.

``all_to_all_single`` turns every rank's (B, H, S_l, D) sequence shard into (B, H/N, S, D):
all positions, H/N heads. The shards are put back in natural global order (the layout may
interleave them), any local kernel (``"auto"``) attends with the whole mask contract, and
a second all-to-all returns the output to the sequence split. The all-to-all is an
autograd function whose backward is the reverse all-to-all.

H and Hkv must divide by N; where Hkv < N (and N % Hkv == 0) each rank receives the one kv
head its query heads read, so kv heads are replicated over N / Hkv ranks.

Legend: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S / Sk global lengths,
S_l this rank's length, D head dim, N world size, h the heads one rank attends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from headwise.distributed.layout import layout_order

__all__ = ["check_heads", "seq_to_heads", "heads_to_seq", "kv_head_index"]


def check_heads(H: int, Hkv: int, N: int) -> None:
    """Raise ValueError when ``method="ulysses"`` cannot split these heads over N ranks."""
    if H % N:
        raise ValueError(f"method='ulysses' splits the {H} query heads over {N} ranks, and {N} does not divide {H}; "
                         "use method='ring' (any head count) or a world size that divides num_heads")
    if Hkv % N and N % Hkv:
        raise ValueError(f"method='ulysses' needs num_kv_heads ({Hkv}) to divide by the world size ({N}), or the "
                         f"world size to divide by num_kv_heads to replicate them; use method='ring'")


def kv_head_index(H: int, Hkv: int, N: int, device: torch.device) -> Tensor | None:
    """Which kv heads go to each rank, as one index (N * h_kv,), or None for a plain split."""
    if Hkv % N == 0:
        return None
    G, h = H // Hkv, H // N
    return torch.tensor([(j * h) // G for j in range(N)], device=device)  # one kv head per rank


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` on flat tensors with uneven splits; backward runs it in reverse."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.args = (send_splits, recv_splits, group)
        out = x.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits, group = ctx.args
        out = grad.new_empty(sum(send_splits))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=group)
        return out, None, None, None


def _natural(x: Tensor, lengths: list[int], layout: str, dim: int) -> Tensor:
    """Reorder a tensor gathered rank after rank along ``dim`` into natural global order."""
    if layout == "contiguous":
        return x
    order = layout_order(sum(lengths), len(lengths), layout, x.device)
    return x.index_select(dim, torch.argsort(order))


def seq_to_heads(x: Tensor, lengths: list[int], layout: str, group, index: Tensor | None = None) -> Tensor:
    """(B, Hx, S_l, D) sequence shard -> (B, h, S, D): this rank's heads, every position, in order.

    Args:
        x: this rank's shard.
        lengths: every rank's S_l.
        layout: the sequence layout.
        group: the process group.
        index: heads to send, rank after rank (None: rank j gets heads j*h .. (j+1)*h - 1).
    """
    N = len(lengths)
    if index is not None:
        x = x.index_select(1, index)  # (B, N * h, S_l, D): replicated kv heads
    B, Hx, S_l, D = x.shape
    h = Hx // N
    send = x.reshape(B, N, h, S_l, D).transpose(0, 1).reshape(-1)  # (N, B, h, S_l, D) flat, rank j's part j-th
    recv = _AllToAll.apply(send, [B * h * S_l * D] * N, [B * h * n * D for n in lengths], group)
    parts = [p.reshape(B, h, n, D) for p, n in zip(recv.split([B * h * n * D for n in lengths]), lengths,
                                                     strict=True)]
    return _natural(torch.cat(parts, dim=2), lengths, layout, dim=2)  # (B, h, S, D)


def heads_to_seq(y: Tensor, lengths: list[int], rank: int, layout: str, group) -> Tensor:
    """(B, h, S, D) in natural order -> (B, N * h, S_l, D): every head, this rank's positions."""
    N = len(lengths)
    B, h, S, D = y.shape
    if layout != "contiguous":
        y = y.index_select(2, layout_order(S, N, layout, y.device))  # natural -> rank after rank
    send = torch.cat([p.reshape(-1) for p in y.split(lengths, dim=2)])  # rank j's positions j-th
    S_l = lengths[rank]
    recv = _AllToAll.apply(send, [B * h * n * D for n in lengths], [B * h * S_l * D] * N, group)
    return recv.reshape(N, B, h, S_l, D).transpose(0, 1).reshape(B, N * h, S_l, D)  # (B, H, S_l, D)

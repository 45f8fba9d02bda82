"""Rotary position embeddings (RoPE), applied to q and k inside attention.

Convention: the GPT-NeoX / Llama "rotate half" layout, so Hugging Face Llama weights
work unchanged: dimension ``i`` of the first half is paired with dimension ``i + D/2``,
and the pair at position ``p`` is rotated by the angle ``p * base ** (-2i / D)``:

    (x_i, x_{i+D/2}) -> (x_i cos a - x_{i+D/2} sin a,  x_i sin a + x_{i+D/2} cos a)

Legend: B batch, H heads, S positions, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RotaryEmbedding", "apply_rotary"]


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat((-second, first), dim=-1)  # (..., D)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, H, S, D) by angles whose cos/sin are (S, D)."""
    return x * cos + _rotate_half(x) * sin  # (B, H, S, D)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for one head dim; no parameters.

    Args:
        head_dim: D, even.
        base: the frequency base (10000 in RoPE and Llama).

    Raises:
        ValueError: odd ``head_dim`` or a non-positive base.

    >>> rope = RotaryEmbedding(8)
    >>> q = torch.randn(1, 2, 3, 8)
    >>> rope(q, start=0).shape
    torch.Size([1, 2, 3, 8])
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        if base <= 0:
            raise ValueError(f"rope_base must be positive, got {base}")
        self.head_dim = head_dim
        self.base = float(base)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"

    def angles(self, start: int, length: int, dtype: torch.dtype,
               device: torch.device | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin (S, D) for positions ``start .. start + length - 1``.

        Angles are computed in float32 (float64 for float64 inputs), then cast.
        """
        calc = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, device=device, dtype=calc)
                                 / self.head_dim)  # (D/2,)
        positions = torch.arange(start, start + length, device=device, dtype=calc)  # (S,)
        freqs = torch.outer(positions, inv_freq)  # (S, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (S, D): pair i with i + D/2
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def at(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate packed ``x`` (T, H, D) whose tokens sit at ``positions`` (T,)."""
        longest = int(positions.max()) + 1 if positions.numel() else 0
        cos, sin = self.angles(0, longest, x.dtype, x.device)  # (P, D)
        cos, sin = cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]  # (T, 1, D)
        return apply_rotary(x, cos, sin)  # (T, H, D)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """Rotate ``x`` (B, H, S, D) as if its positions were ``start .. start + S - 1``."""
        cos, sin = self.angles(start, x.shape[-2], x.dtype, x.device)
        return apply_rotary(x, cos, sin)

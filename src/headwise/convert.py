"""Conversion between :class:`headwise.MultiHeadAttention` and ``torch.nn.MultiheadAttention``.

torch keeps q, k and v in one ``in_proj_weight`` (3E, E); headwise keeps three
projections, as the documents and Hugging Face models do. Both ways copy the weights.
Masks translate with :func:`headwise.masks.from_torch_masks` (torch's bool True means
*ignore*). The code lives with the module (``headwise.module.torch_mha``); this is its
public face.

Legend: E embed dim.
"""

from __future__ import annotations

from torch import nn

from headwise.module import MultiHeadAttention, torch_mha

__all__ = ["from_torch", "to_torch"]


def from_torch(m: nn.MultiheadAttention, *, module_class: type | None = None, **kwargs) -> MultiHeadAttention:
    """A batch-first :class:`~headwise.MultiHeadAttention` with ``m``'s weights (either ``batch_first``).

    Args:
        m: the torch module.
        module_class: the class to build (None: :class:`~headwise.MultiHeadAttention`).
        **kwargs: other constructor arguments for the new module (``is_causal``, ``backend``, ...).

    Returns:
        The new module, in ``m``'s training mode, on its device and dtype; inputs (B, S, E).

    Raises:
        TypeError / ValueError: see :meth:`headwise.MultiHeadAttention.from_torch`.

    >>> from_torch(nn.MultiheadAttention(32, 4, batch_first=True)).num_heads
    4
    """
    return torch_mha.from_torch(module_class or MultiHeadAttention, m, **kwargs)


def to_torch(mha: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """The equivalent ``torch.nn.MultiheadAttention``, weights copied; see
    :meth:`headwise.MultiHeadAttention.to_torch`."""
    return torch_mha.to_torch(mha, batch_first=batch_first)

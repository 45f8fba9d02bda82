"""A key/value cache for incremental decoding: preallocated buffers, no parameters.

Legend: B batch, Hkv key/value heads, T new positions, L cached positions, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer.

    Made by :meth:`headwise.MultiHeadAttention.new_cache`; pass it as ``cache=`` to
    ``forward`` with the next positions. Buffers are allocated once, at full
    ``max_seq_len``; the cache is not part of any state dict.

    Attributes:
        k, v: (B, Hkv, max_seq_len, D) buffers; the first ``len(cache)`` positions are valid.
        key_mask: (B, max_seq_len) bool, True where a cached position is a real token
            (from the padding masks given with each step; True when none was given).

    >>> import headwise
    >>> mha = headwise.MultiHeadAttention(32, 4)
    >>> cache = mha.new_cache(batch_size=2, max_seq_len=16)
    >>> _ = mha(torch.rand(2, 5, 32), cache=cache, is_causal=True)  # prefill 5
    >>> _ = mha(torch.rand(2, 1, 32), cache=cache, is_causal=True)  # one more step
    >>> len(cache)
    6
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        shape = (batch_size, kv_heads, max_seq_len, head_dim)  # (B, Hkv, L_max, D)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.key_mask = torch.ones(batch_size, max_seq_len, dtype=torch.bool, device=device)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self._length = 0
        self.padded = False  # True once a padding mask was given: masks are passed on

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        B, Hkv, L, D = self.k.shape
        return f"KVCache(length={self._length}, max_seq_len={L}, batch_size={B}, kv_heads={Hkv}, head_dim={D})"

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for reuse)."""
        self._length = 0
        self.key_mask.fill_(True)
        self.padded = False

    def check(self, batch: int, new: int) -> None:
        """Raise ValueError if ``new`` positions of batch ``batch`` cannot be appended."""
        if batch != self.batch_size:
            raise ValueError(
                f"the cache was made for batch_size {self.batch_size}, got a batch of {batch}; "
                "make one with mha.new_cache(batch_size, max_seq_len) per batch size"
            )
        if self._length + new > self.max_seq_len:
            raise ValueError(
                f"the cache holds {self._length} of max_seq_len {self.max_seq_len} positions and "
                f"cannot take {new} more; make a larger one or call cache.reset()"
            )

    def mask_for(self, mask: Tensor | None, new: int) -> Tensor | None:
        """The mask over every cached position for a step of ``new`` positions (changes nothing).

        Args:
            mask: the step's mask: a 2-D bool/integer padding mask over the ``new`` positions
                or over all ``len(cache) + new``; a 3-D / 4-D mask (passed on as it is); or None.
            new: T, the positions this step appends.

        Returns:
            (B, L) bool, True = real token, once any step gave a padding mask (earlier
            padding is remembered); the 3-D / 4-D mask as given; else None.

        Raises:
            TypeError: a floating 2-D mask (an additive bias cannot be remembered).
            ValueError: a 2-D mask whose batch differs from the cache's.
        """
        start, total = self._length, self._length + new
        if mask is None:
            return self.key_mask[:, :total] if self.padded else None  # (B, L)
        if mask.dim() != 2 or mask.shape[-1] not in (new, total):
            return mask  # 3-D / 4-D masks already cover (S, Sk); normalize_mask checks them
        if mask.is_floating_point():
            raise TypeError(
                "with a cache, give the 2-D padding mask as bool or integer (True / 1 = token); "
                "a floating (B, Sk) bias cannot be remembered across steps"
            )
        if mask.shape[0] != self.batch_size:
            raise ValueError(f"attention_mask batch ({mask.shape[0]}) differs from the cache's "
                             f"batch_size ({self.batch_size})")
        mask = mask.to(self.key_mask.device) != 0
        if mask.shape[-1] == new:
            mask = torch.cat([self.key_mask[:, :start], mask], dim=1)  # (B, L)
        return mask

    def update(self, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Append T new positions with their mask; return every cached key, value and the mask.

        Args:
            k, v: (B, Hkv, T, D) new keys and values.
            mask: the step's mask, as :meth:`mask_for` takes it; a 2-D padding mask is
                remembered for later steps.

        Returns:
            ``(k, v, mask)``: (B, Hkv, L, D) views of the buffers (L = len(cache) after
            appending) and the mask over all L positions (see :meth:`mask_for`).
        """
        B, _, T, _ = k.shape
        self.check(B, T)
        given, mask = mask, self.mask_for(mask, T)
        total = self._length + T
        if given is not None and mask.dim() == 2 and mask.shape[-1] == total:  # a padding mask: remember it
            self.key_mask[:, :total] = mask
            self.padded = True
        k, v = self.append(k, v)
        return k, v, mask

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``T`` new positions and return every cached key and value (no mask bookkeeping).

        Args:
            k, v: (B, Hkv, T, D) new keys and values.

        Returns:
            ``(k, v)``, each (B, Hkv, L, D) with L = len(cache) after appending: views
            of the buffers, not copies.
        """
        B, _, T, _ = k.shape
        self.check(B, T)
        start, end = self._length, self._length + T
        self.k[:, :, start:end] = k  # (B, Hkv, T, D) into (B, Hkv, L_max, D)
        self.v[:, :, start:end] = v
        self._length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, L, D)

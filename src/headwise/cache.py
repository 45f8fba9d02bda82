"""A key/value cache for incremental decoding: preallocated buffers, no parameters.

Legend: B batch, Hkv key/value heads, T new positions, L cached positions, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwise import policy

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of the positions seen so far, for one attention layer.

    Made by :meth:`headwise.MultiHeadAttention.new_cache`; pass it as ``cache=`` to
    ``forward`` with the next positions. Buffers are allocated once, at full
    ``max_seq_len``; the cache is not part of any state dict.

    With ``static=True`` (``mha.new_cache(B, L, static=True)``), every step has the same
    shapes, as gpt-fast's cache: the new keys and values go in with ``index_copy_`` at a
    position tensor, and attention reads all ``max_seq_len`` positions through a mask of
    the written ones. That is what ``torch.compile`` needs to run every decoding step on one
    graph (``mode="reduce-overhead"`` can then replay it); each step then costs
    ``max_seq_len`` keys rather than ``len(cache)``. Without it a compiled model still has
    no graph break, but recompiles once the length becomes dynamic.

    Attributes:
        k, v: (B, Hkv, max_seq_len, D) buffers; the first ``len(cache)`` positions are valid.
        key_mask: (B, max_seq_len) bool, True where a cached position is a real token
            (from the padding masks given with each step; True when none was given).
        static: whether steps keep static shapes (see above).
        position: () int64 tensor, the length as a tensor (static caches read it; reading
            ``len(cache)`` of a static cache on a GPU syncs).

    >>> import headwise
    >>> mha = headwise.MultiHeadAttention(32, 4)
    >>> cache = mha.new_cache(batch_size=2, max_seq_len=16)
    >>> _ = mha(torch.rand(2, 5, 32), cache=cache, is_causal=True)  # prefill 5
    >>> _ = mha(torch.rand(2, 1, 32), cache=cache, is_causal=True)  # one more step
    >>> len(cache)
    6
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 static: bool = False):
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
        self.static = bool(static)
        self.position = torch.zeros((), dtype=torch.int64, device=self.key_mask.device)

    def __len__(self) -> int:
        return int(self.position) if self.static else self._length

    def __repr__(self) -> str:
        B, Hkv, L, D = self.k.shape
        static = ", static=True" if self.static else ""
        return (f"KVCache(length={len(self)}, max_seq_len={L}, batch_size={B}, kv_heads={Hkv}, head_dim={D}"
                f"{static})")

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for reuse)."""
        self._length = 0
        self.position.zero_()
        self.key_mask.fill_(True)
        self.padded = False

    def check(self, batch: int, new: int) -> None:
        """Raise ValueError if ``new`` positions of batch ``batch`` cannot be appended."""
        if batch != self.batch_size:
            raise ValueError(
                f"the cache was made for batch_size {self.batch_size}, got a batch of {batch}; "
                "make one with mha.new_cache(batch_size, max_seq_len) per batch size"
            )
        if self.static and not policy.reads_values(self.position):
            return  # the length is a device tensor (or traced): index_copy_ refuses an overflow itself
        length = len(self)
        if length + new > self.max_seq_len:
            raise ValueError(
                f"the cache holds {length} of max_seq_len {self.max_seq_len} positions and "
                f"cannot take {new} more; make a larger one or call cache.reset()"
            )

    def _dynamic(self, method: str) -> None:
        if self.static:
            raise ValueError(f"cache.{method} grows a dynamic cache; this one is static (new_cache(..., static=True)): "
                             "step it with cache.update_static(k, v, mask)")

    def update_static(self, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """A static cache's step: write T new positions at ``position`` with the same shapes every step.

        Args:
            k, v: (B, Hkv, T, D) new keys and values.
            mask: None, or a (B, T) bool/integer padding mask of the new positions (remembered).

        Returns:
            ``(k, v, positions)``: the whole (B, Hkv, max_seq_len, D) buffers and the (T,)
            positions just written; :meth:`headwise.MultiHeadAttention.forward` masks the
            positions not written yet (``key_mask`` and ``position`` say which).

        Raises:
            ValueError / TypeError: a mask that is not a (B, T) bool or integer mask.
        """
        B, _, T, _ = k.shape
        self.check(B, T)
        if mask is not None:
            if mask.dim() != 2 or tuple(mask.shape) != (self.batch_size, T):
                raise ValueError(f"a static cache takes a (B, T) = ({self.batch_size}, {T}) padding mask of the new "
                                 f"positions, got shape {tuple(mask.shape)}; earlier positions are remembered")
            if mask.is_floating_point():
                raise TypeError("with a cache, give the 2-D padding mask as bool or integer (True / 1 = token)")
        positions = self.position + torch.arange(T, device=self.position.device)  # (T,)
        self.k.index_copy_(2, positions, k)  # (B, Hkv, T, D) into (B, Hkv, L_max, D)
        self.v.index_copy_(2, positions, v)
        if mask is not None:
            self.key_mask.index_copy_(1, positions, mask.to(self.key_mask.device) != 0)
        self.position.add_(T)
        return self.k, self.v, positions

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
        start, total = self._length, self._length + new  # the dynamic cache's (update_static masks itself)
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
        self._dynamic("update")
        B, _, T, _ = k.shape
        self.check(B, T)
        given, mask = mask, self.mask_for(mask, T)
        total = self._length + T
        if given is not None and mask is not None and mask.dim() == 2 and mask.shape[-1] == total:  # remember it
            self.key_mask[:, :total] = mask
            self.padded = True
        k, v = self._write(k, v)  # checked above
        return k, v, mask

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``T`` new positions and return every cached key and value (no mask bookkeeping).

        Args:
            k, v: (B, Hkv, T, D) new keys and values.

        Returns:
            ``(k, v)``, each (B, Hkv, L, D) with L = len(cache) after appending: views
            of the buffers, not copies.
        """
        self._dynamic("append")
        self.check(k.shape[0], k.shape[2])
        return self._write(k, v)

    def _write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """append() after its checks: (B, Hkv, T, D) into the buffers at len(cache)."""
        start, end = self._length, self._length + k.shape[2]
        self.k[:, :, start:end] = k  # (B, Hkv, T, D) into (B, Hkv, L_max, D)
        self.v[:, :, start:end] = v
        self._length = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, L, D)

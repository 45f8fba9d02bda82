"""A key/value cache for incremental decoding: preallocated buffers, no parameters.

Legend: B batch, Hkv key/value heads, T new positions, L cached positions, D head dim of
the keys, Dv head dim of the values.
"""

from __future__ import annotations

import torch
from torch import Tensor

from headwise import policy
from headwise.masks import _refuse_complex

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

    With ``window=W`` (``mha.new_cache(B, L, evict=True)`` on a module with a window), the
    cache evicts what no later query can see: each :meth:`update` first keeps the first
    ``sink_tokens`` positions (StreamingLLM's sinks) and the last ``W - 1``, drops the
    middle, then appends. It then holds at most ``sink_tokens + W - 1 + T`` positions
    whatever the length of the sequence, so ``max_seq_len`` only has to cover that, and
    ``len(cache)`` (the positions seen, where the next one goes) may exceed it. The buffers
    no longer hold position ``p`` at slot ``p``: :meth:`key_positions` says which positions
    the slots hold (rotary keys stay rotated at their true positions). Eviction is opt-in:
    it changes what ``k``, ``v`` and ``key_mask`` hold, and a static cache refuses it
    (moving keys between slots would take data-dependent shapes).

    With gradients on (decoding without ``torch.no_grad()``, as transformers' caches allow),
    a step whose keys or values take gradients writes new buffers out of place rather than
    into these (``slice_scatter`` / ``index_copy``), so backward through every step is exact:
    what an earlier step saved for backward is never written. Each such step copies the
    buffers; decode under ``torch.no_grad()`` where no gradient is wanted.

    Attributes:
        k, v: (B, Hkv, max_seq_len, D) and (B, Hkv, max_seq_len, Dv) buffers; the first
            :attr:`held` slots are valid.
        key_mask: (B, max_seq_len) bool, True where a cached position is a real token
            (from the padding masks given with each step; True when none was given).
        static: whether steps keep static shapes (see above).
        position: () int64 tensor, the length as a tensor (static caches read it; reading
            ``len(cache)`` of a static cache on a GPU syncs).
        window, sink_tokens: the eviction rule (window None: nothing is evicted).
        evicted: how many positions eviction has dropped so far.

    >>> import headwise
    >>> mha = headwise.MultiHeadAttention(32, 4)
    >>> cache = mha.new_cache(batch_size=2, max_seq_len=16)
    >>> with torch.no_grad():  # faster: with gradients on, a step writes new buffers (out of place)
    ...     _ = mha(torch.rand(2, 5, 32), cache=cache, is_causal=True)  # prefill 5
    ...     _ = mha(torch.rand(2, 1, 32), cache=cache, is_causal=True)  # one more step
    >>> len(cache)
    6
    """

    _written = 1 << 62  # a cache pickled before the attribute existed: every slot may hold data

    def __init__(self, batch_size: int, max_seq_len: int, kv_heads: int, head_dim: int, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 static: bool = False,
                 value_dim: int | None = None,  # None: head_dim
                 window: int | None = None,  # None: evict nothing; W: evict what a window of W keys cannot see
                 sink_tokens: int = 0):  # positions eviction always keeps (with a window)
        for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
        if sink_tokens and window is None:
            raise ValueError(f"sink_tokens={sink_tokens} are what eviction keeps besides the window; give window=W")
        if static and window is not None:
            raise ValueError("a static cache keeps every position at its own slot (one graph for every step); "
                             "eviction moves keys between slots, which takes data-dependent shapes: use "
                             "static=False for an evicting cache")
        value_dim = head_dim if value_dim is None else value_dim
        self.k = torch.zeros(batch_size, kv_heads, max_seq_len, head_dim, device=device,
                             dtype=dtype)  # (B, Hkv, L_max, D)
        self.v = torch.zeros(batch_size, kv_heads, max_seq_len, value_dim, device=device,
                             dtype=dtype)  # (B, Hkv, L_max, Dv)
        self.key_mask = torch.ones(batch_size, max_seq_len, dtype=torch.bool, device=device)
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self._length = 0
        self._written = 0  # dynamic: the buffers' slots from here on hold zeros (never written by a step)
        self.padded = False  # True once a padding mask was given: masks are passed on
        self.static = bool(static)
        self.position = torch.zeros((), dtype=torch.int64, device=self.key_mask.device)
        self.window = window
        self.sink_tokens = sink_tokens
        self.evicted = 0  # positions dropped by eviction; slots past the sinks hold position slot + evicted

    def __len__(self) -> int:
        """The positions seen so far (where the next one goes); :attr:`held` of them are in the buffers."""
        if not self.static:
            return self._length + self.evicted
        position = int(self.position)
        if not 0 <= position <= self.max_seq_len:
            raise ValueError(self._bad_position(position))
        return position

    def _bad_position(self, position: int) -> str:
        return (f"the static cache's position {position} is outside 0..max_seq_len = 0..{self.max_seq_len} (it "
                "is the length written so far); call cache.reset() to start over")

    @property
    def held(self) -> int:
        """The positions the buffers hold: ``len(cache)`` less what eviction dropped."""
        return len(self) - self.evicted

    @property
    def evicts(self) -> bool:
        """Whether :meth:`update` evicts what the window can no longer see."""
        return self.window is not None

    def __repr__(self) -> str:
        B, Hkv, L, D = self.k.shape
        static = ", static=True" if self.static else ""
        value = f", value_dim={self.v.shape[-1]}" if self.v.shape[-1] != D else ""
        evict = ""
        if self.evicts:
            evict = f", window={self.window}, sink_tokens={self.sink_tokens}, held={self.held}"
        return (f"KVCache(length={len(self)}, max_seq_len={L}, batch_size={B}, kv_heads={Hkv}, head_dim={D}"
                f"{value}{static}{evict})")

    def reset(self) -> None:
        """Forget every cached position (the buffers are kept for reuse)."""
        self._length = 0
        self.evicted = 0
        self.position.zero_()
        self.key_mask.fill_(True)
        self.padded = False

    def key_positions(self) -> Tensor:
        """The (held,) int64 positions of the keys in the buffers' first :attr:`held` slots:
        ``0, 1, ...`` until eviction drops the middle, then the sinks and the recent ones.

        >>> cache = KVCache(1, 8, 1, 4, window=3, sink_tokens=1)
        >>> for _ in range(6):
        ...     _ = cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
        >>> cache.key_positions().tolist(), len(cache)
        ([0, 3, 4, 5], 6)
        """
        slots = torch.arange(self.held, device=self.key_mask.device)  # (held,)
        return slots + self.evicted * (slots >= self.sink_tokens) if self.evicted else slots

    def kept(self) -> tuple[int, int]:
        """``(sinks, recent)``: what the next :meth:`update` keeps before appending (changes
        nothing): the first ``sinks`` slots and the last ``recent`` held ones. Without
        eviction, every held slot: ``(held, 0)``."""
        held, window = self.held, self.window
        if window is None:
            return held, 0
        seen = len(self)
        sinks = min(self.sink_tokens, held)
        # A later query at position p >= seen sees keys > p - W >= seen - W: the last W - 1.
        recent = max(0, seen - max(self.sink_tokens, seen - window + 1))
        return sinks, min(recent, held - sinks)

    def _out_of_place(self, k: Tensor, v: Tensor) -> bool:
        """Whether a step writing ``k``, ``v`` leaves the buffers as they are and makes new ones:
        where autograd records it (the values take gradients). Then every write of the step is
        out of place: what an earlier step saved for backward is never written, and
        :meth:`rollback` puts the old buffers back. A step that autograd does not record, on
        buffers that hold a graph (an earlier step's), writes in place into plain copies of them
        (made outside inference mode, so that later steps may write them in place too)."""
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            return True
        if self.k.requires_grad or self.v.requires_grad:
            with torch.inference_mode(False), torch.no_grad():
                self.k, self.v = self.k.clone(), self.v.clone()
        return False

    def _evict(self, out_of_place: bool = False) -> None:
        """Keep :meth:`kept`'s slots, moving the recent ones up to the sinks (a copy of at most W - 1)."""
        sinks, recent = self.kept()
        held = self.held
        if sinks + recent == held:
            return
        src = slice(held - recent, held)
        dst = slice(sinks, sinks + recent)
        if out_of_place:  # new buffers (see _out_of_place)
            self.k = self.k.slice_scatter(self.k[:, :, src], 2, sinks, sinks + recent)  # (B, Hkv, L_max, D)
            self.v = self.v.slice_scatter(self.v[:, :, src], 2, sinks, sinks + recent)  # (B, Hkv, L_max, Dv)
        else:
            self.k[:, :, dst] = self.k[:, :, src].clone()  # (B, Hkv, recent, D): the ranges may overlap
            self.v[:, :, dst] = self.v[:, :, src].clone()
        self.key_mask[:, dst] = self.key_mask[:, src].clone()
        # the freed slots hold the moved positions' padding: a later step without a mask writes
        # real tokens there and must not read it
        self.key_mask[:, sinks + recent:held] = True
        self.evicted += held - sinks - recent
        self._length = sinks + recent

    def check(self, batch: int, new: int) -> None:
        """Raise ValueError if ``new`` positions of batch ``batch`` cannot be appended."""
        if batch != self.batch_size:
            raise ValueError(
                f"the cache was made for batch_size {self.batch_size}, got a batch of {batch}; "
                "make one with mha.new_cache(batch_size, max_seq_len) per batch size"
            )
        if self.static and not policy.reads_values(self.position):
            return  # the length is a device tensor (or traced): index_copy_ refuses an overflow itself
        if self.static and not 0 <= int(self.position) <= self.max_seq_len:
            raise ValueError(self._bad_position(int(self.position)))
        if self.window is not None:
            kept = sum(self.kept())
            if kept + new > self.max_seq_len:
                raise ValueError(
                    f"the evicting cache keeps {kept} positions (sink_tokens {self.sink_tokens} and the last "
                    f"window - 1 = {self.window - 1}) of max_seq_len {self.max_seq_len} slots and cannot take "
                    f"{new} more; make one with max_seq_len >= sink_tokens + window - 1 + {new} = "
                    f"{self.sink_tokens + self.window - 1 + new}"
                )
            return
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

    def check_mask(self, mask: Tensor | None, new: int) -> None:
        """Raise what a step of ``new`` positions with this mask would raise, changing nothing.

        :meth:`update` and :meth:`update_static` call it before they write, so a refused mask
        leaves the cache as it was; :func:`~headwise.masks.normalize_mask` then checks what
        every mask must be (a tensor, not complex, a shape that fits).

        Raises:
            TypeError: a complex mask; a floating 2-D padding mask (a bias cannot be remembered).
            ValueError: a static cache's mask that is not (B, T); an evicting cache's 3-D /
                4-D mask; a 2-D mask of another batch, or covering neither the ``new``
                positions nor all ``len(cache) + new``.
        """
        if not isinstance(mask, Tensor):
            return  # None, or not a tensor: normalize_mask names the type
        _refuse_complex(mask)  # normalize_mask's check, so a cache step refuses it as a call without one
        if self.static:
            if mask.dim() != 2 or tuple(mask.shape) != (self.batch_size, new):
                raise ValueError(f"a static cache takes a (B, T) = ({self.batch_size}, {new}) padding mask of the new "
                                 f"positions (batch {self.batch_size}, {new} new), got a {mask.dim()}-D mask of "
                                 f"shape {tuple(mask.shape)}; earlier positions are remembered")
        elif self.evicts and mask.dim() != 2:
            raise ValueError(f"an evicting cache takes a 2-D (B, T) or (B, len(cache) + T) padding mask, got a "
                             f"{mask.dim()}-D mask of shape {tuple(mask.shape)}: after eviction its keys are not "
                             "positions 0..Sk-1, so a (S, Sk) mask cannot name them")
        if mask.dim() != 2:
            return  # 3-D / 4-D masks cover (S, Sk): normalize_mask checks them
        if mask.is_floating_point():
            raise TypeError(
                "with a cache, give the 2-D padding mask as bool or integer (True / 1 = token); "
                "a floating (B, Sk) bias cannot be remembered across steps"
            )
        if mask.shape[0] != self.batch_size:
            raise ValueError(f"attention_mask batch ({mask.shape[0]}) differs from the cache's "
                             f"batch_size ({self.batch_size})")
        if self.static:
            return  # (B, T), checked above (len(self) of a static cache would read its position)
        seen = len(self) + new
        if mask.shape[-1] not in (new, seen):
            raise ValueError(f"a cache step's 2-D mask covers the {new} new positions, (B, T) = "
                             f"({self.batch_size}, {new}), or all of them, (B, len(cache) + T) = "
                             f"({self.batch_size}, {seen}); got shape {tuple(mask.shape)}")

    def savepoint(self, new: int, masked: bool = True) -> tuple:
        """What a step of ``new`` positions may change, copied, for :meth:`rollback`: the
        lengths and flags, the key mask and the slots the step (and its eviction) may write.
        Cheap: ``new`` slots, or ``window - 1 + new`` for an evicting cache; none where a
        dynamic cache's step writes only slots no step has written (they hold zeros: the
        usual decoding step; slots written around the cache's methods are not tracked).
        ``masked=False``: the step gives no mask, so only eviction could change the key
        mask (it is not copied otherwise)."""
        keep_mask = masked or self.window is not None  # evicts
        if self.static:
            slots = (self.position + torch.arange(new, device=self.position.device)).clamp(0, self.max_seq_len - 1)
            return (self.position.clone(), self.key_mask.clone() if keep_mask else None, slots,
                    self.k.index_select(2, slots), self.v.index_select(2, slots), self.k, self.v)
        lo = self.kept()[0] if self.window is not None else self._length  # eviction moves the recent slots to the sinks
        hi = min(self._length + new, self.max_seq_len)
        k = v = None  # zeros: slots lo..hi were never written
        if lo < self._written:
            k, v = self.k[:, :, lo:hi].clone(), self.v[:, :, lo:hi].clone()
        return (self._length, self._written, self.evicted, self.padded,
                self.key_mask[:, :hi].clone() if keep_mask else None, lo, hi, k, v, self.k, self.v)

    def rollback(self, saved: tuple) -> None:
        """Undo a step: back to what :meth:`savepoint` copied (after a refused call). A step
        that wrote out of place left the old buffers as they were: they are put back."""
        replaced = self.k is not saved[-2] or self.v is not saved[-1]
        self.k, self.v = saved[-2], saved[-1]
        if self.static:
            position, key_mask, slots, k, v = saved[:-2]
            self.position.copy_(position)
            if key_mask is not None:
                self.key_mask.copy_(key_mask)
            if not replaced:
                self.k.index_copy_(2, slots, k)
                self.v.index_copy_(2, slots, v)
            return
        self._length, self._written, self.evicted, self.padded, key_mask, lo, hi, k, v = saved[:-2]
        if key_mask is not None:
            self.key_mask[:, :key_mask.shape[1]] = key_mask
        if replaced:
            return
        if k is None:  # the slots held zeros
            self.k[:, :, lo:hi].zero_()
            self.v[:, :, lo:hi].zero_()
        else:
            self.k[:, :, lo:hi] = k
            self.v[:, :, lo:hi] = v

    def update_static(self, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """A static cache's step: write T new positions at ``position`` with the same shapes every step.

        Args:
            k, v: (B, Hkv, T, D) new keys and (B, Hkv, T, Dv) values.
            mask: None, or a (B, T) bool/integer padding mask of the new positions (remembered).

        Returns:
            ``(k, v, positions)``: the whole (B, Hkv, max_seq_len, D|Dv) buffers and the (T,)
            positions just written; :meth:`headwise.MultiHeadAttention.forward` masks the
            positions not written yet (``key_mask`` and ``position`` say which).

        Raises:
            ValueError / TypeError: a mask that is not a (B, T) bool or integer mask.
        """
        B, _, T, _ = k.shape
        self.check(B, T)
        self.check_mask(mask, T)
        if mask is not None and not isinstance(mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(mask).__name__}")
        positions = self.position + torch.arange(T, device=self.position.device)  # (T,)
        if self._out_of_place(k, v):  # new buffers (see _out_of_place)
            self.k = self.k.index_copy(2, positions, k.to(self.k.dtype))  # (B, Hkv, L_max, D)
            self.v = self.v.index_copy(2, positions, v.to(self.v.dtype))  # (B, Hkv, L_max, Dv)
        else:
            self.k.index_copy_(2, positions, k)  # (B, Hkv, T, D) into (B, Hkv, L_max, D); v the same with Dv
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
            (B, L) bool over the held and new positions (L = held + new), True = real token,
            once any step gave a padding mask (earlier padding is remembered); the 3-D / 4-D
            mask as given; else None.

        Raises:
            TypeError / ValueError: what :meth:`check_mask` refuses.
        """
        self.check_mask(mask, new)
        return self._mask_for(mask, new)

    def _mask_for(self, mask: Tensor | None, new: int) -> Tensor | None:
        """:meth:`mask_for` of a mask :meth:`check_mask` has passed."""
        start, total = self._length, self._length + new  # the dynamic cache's (update_static masks itself)
        seen = len(self) + new  # = total until eviction drops positions
        if mask is None:
            return self.key_mask[:, :total] if self.padded else None  # (B, L)
        if mask.dim() != 2:
            return mask  # 3-D / 4-D masks already cover (S, Sk); normalize_mask checks them
        mask = mask.to(self.key_mask.device) != 0
        if mask.shape[-1] == new:
            mask = torch.cat([self.key_mask[:, :start], mask], dim=1)  # (B, L)
        elif self.evicted:  # over every position seen: keep the held ones' columns and the new ones
            cols = torch.cat([self.key_positions(), torch.arange(seen - new, seen, device=mask.device)])  # (L,)
            mask = mask.index_select(1, cols)  # (B, seen) -> (B, L)
        return mask

    def update(self, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Append T new positions with their mask; return every cached key, value and the mask.

        An evicting cache first drops what no later query can see (see the class docstring).

        Args:
            k, v: (B, Hkv, T, D) new keys and (B, Hkv, T, Dv) values.
            mask: the step's mask, as :meth:`mask_for` takes it; a 2-D padding mask is
                remembered for later steps.

        Returns:
            ``(k, v, mask)``: (B, Hkv, L, D) and (B, Hkv, L, Dv) views of the buffers (L =
            :attr:`held` after appending: ``len(cache)`` unless eviction dropped positions,
            :meth:`key_positions` says which) and the mask over those L (see :meth:`mask_for`).
        """
        self._dynamic("update")
        B, _, T, _ = k.shape
        self.check(B, T)
        self.check_mask(mask, T)  # before eviction and the write: a refused mask changes nothing
        self._evict(self._out_of_place(k, v))
        given, mask = mask, self._mask_for(mask, T)
        total = self._length + T
        if given is not None and mask is not None and mask.dim() == 2 and mask.shape[-1] == total:  # remember it
            self.key_mask[:, :total] = mask
            self.padded = True
        k, v = self._write(k, v)  # checked above
        return k, v, mask

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``T`` new positions and return every cached key and value (no mask bookkeeping).

        Args:
            k, v: (B, Hkv, T, D) new keys and (B, Hkv, T, Dv) values.

        Returns:
            ``(k, v)``, (B, Hkv, L, D) and (B, Hkv, L, Dv) with L = :attr:`held` after
            appending (after eviction, for an evicting cache): views of the buffers, not copies.
        """
        B, T = k.shape[0], k.shape[2]
        if (self.static or self.window is not None or B != self.batch_size or self._length + T > self.max_seq_len
                or self._out_of_place(k, v)):  # the general way, which names what does not fit
            self._dynamic("append")
            self.check(B, T)
            self._evict(self._out_of_place(k, v))
            return self._write(k, v)
        # a decoding step on a dynamic cache that keeps every position (nothing evicted: its
        # length is len(self)), written in place: the checks above and the write, inline
        start = self._length
        end = start + T
        self.k.narrow(2, start, T).copy_(k)  # (B, Hkv, T, D) into (B, Hkv, L_max, D)
        self.v.narrow(2, start, T).copy_(v)
        self._length = end
        if end > self._written:
            self._written = end
        return self.k.narrow(2, 0, end), self.v.narrow(2, 0, end)  # (B, Hkv, L, D), (B, Hkv, L, Dv)

    def _write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """append() after its checks: (B, Hkv, T, D|Dv) into the buffers at the held length."""
        start, end = self._length, self._length + k.shape[2]
        if self._out_of_place(k, v):  # new buffers (see _out_of_place)
            self.k = self.k.slice_scatter(k.to(self.k.dtype), 2, start, end)  # (B, Hkv, L_max, D)
            self.v = self.v.slice_scatter(v.to(self.v.dtype), 2, start, end)  # (B, Hkv, L_max, Dv)
        else:
            self.k[:, :, start:end] = k  # (B, Hkv, T, D) into (B, Hkv, L_max, D)
            self.v[:, :, start:end] = v
        self._length = end
        self._written = max(self._written, end)
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, L, D), (B, Hkv, L, Dv)

"""A paged key/value cache: one pool of fixed-size pages that many sequences share.

Each sequence holds a list of page ids (its block table row) and a length; its key ``i``
lives in slot ``i % P`` of page ``pages[i // P]``. Pages are reference-counted: a fork
shares every page of its source, and the first write into a shared partial last page
copies that page first (copy on write), so a prompt's pages are stored once however many
continuations fork from it. Freed pages and slots past a length may hold anything.

The pool is laid out (Hkv, N, P, D) in memory and exposed as the (N, Hkv, P, D) views
:attr:`PagedKVCache.k_pages` / :attr:`PagedKVCache.v_pages` that
:func:`headwise.paged_attention` takes: a run of consecutive pages of one head is then one
contiguous block, which attention reads as a view, without a copy. The allocator keeps
sequences in runs: a growing sequence takes the page after its last one when it is free,
and a new run starts in the middle of the largest free gap (at its start when the gap
opens the pool), leaving room on both sides.

Legend: B sequences in a step, Hkv key/value heads, T new tokens per sequence, N pages,
P page size, D head dim of the keys, Dv of the values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # a type only: importing headwise.module at run time would import this file back
    from headwise.module.layer_protocol import Layer

__all__ = ["PagedBatch", "PagedKVCache"]


@dataclass(frozen=True)
class PagedBatch:
    """Some sequences of a :class:`PagedKVCache`, in the order of a step's batch rows:
    what ``MultiHeadAttention.forward(x, cache=...)`` takes (``cache.batch([a, b])``)."""

    cache: PagedKVCache
    seqs: tuple[int, ...]


class PagedKVCache:
    """Keys and values of many sequences in one pool of pages, for one attention layer.

    Args:
        num_pages: N, the pages of the pool.
        page_size: P, the keys a page holds.
        kv_heads, head_dim: Hkv and D of the keys.
        value_dim: Dv of the values (None: head_dim).
        device, dtype: of the pool.

    Attributes:
        k_pages, v_pages: (N, Hkv, P, D) and (N, Hkv, P, Dv) views of the pool, as
            :func:`headwise.paged_attention` takes them.

    Raises:
        ValueError: sizes that are not positive ints.

    >>> import torch, headwise
    >>> cache = headwise.PagedKVCache(num_pages=8, page_size=4, kv_heads=2, head_dim=16)
    >>> a = cache.add()
    >>> cache.append([a], torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16))  # 6 keys: 2 pages
    >>> b = cache.fork(a)  # shares both pages; the partial one is copied on b's first write
    >>> cache.seq_lens([a, b]).tolist(), cache.pages_in_use
    ([6, 6], 2)
    """

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, *,
                 value_dim: int | None = None,  # None: head_dim
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        value_dim = head_dim if value_dim is None else value_dim
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("value_dim", value_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        # (Hkv, N, P, D): one head's consecutive pages are adjacent, so a run of them is a view
        self._k = torch.zeros(kv_heads, num_pages, page_size, head_dim, device=device, dtype=dtype)
        self._v = torch.zeros(kv_heads, num_pages, page_size, value_dim, device=device, dtype=dtype)
        self.k_pages = self._k.transpose(0, 1)  # (N, Hkv, P, D)
        self.v_pages = self._v.transpose(0, 1)  # (N, Hkv, P, Dv)
        self.num_pages, self.page_size = num_pages, page_size
        self._free = bytearray(b"\x01") * num_pages  # 1: page p is free
        self._free_count = num_pages
        self._refs = [0] * num_pages  # sequences holding page p
        self._pages: dict[int, list[int]] = {}  # sequence -> its pages, in order
        self._lens: dict[int, int] = {}  # sequence -> its keys
        self._next = 0
        self._layout = 0  # counts changes of any sequence's pages: what a memo of block tables reads
        self._table_memo: tuple[tuple[int, ...], int, Tensor] | None = None

    @classmethod
    def for_module(cls, mha: Layer, num_pages: int, page_size: int = 16) -> PagedKVCache:
        """A pool for ``mha``'s keys and values (its kv heads, head dims, dtype and device).

        >>> import headwise
        >>> mha = headwise.MultiHeadAttention(64, 8, num_kv_heads=2)
        >>> headwise.PagedKVCache.for_module(mha, num_pages=32).k_pages.shape
        torch.Size([32, 2, 16, 8])
        """
        w = mha.reference_weight()
        return cls(num_pages, page_size, mha.num_kv_heads, mha.head_dim, value_dim=mha.v_head_dim,
                   device=w.device, dtype=w.dtype)

    def __repr__(self) -> str:
        Hkv, N, P, D = self._k.shape
        value = f", value_dim={self._v.shape[-1]}" if self._v.shape[-1] != D else ""
        return (f"PagedKVCache(num_pages={N}, page_size={P}, kv_heads={Hkv}, head_dim={D}{value}, "
                f"sequences={len(self._lens)}, pages_in_use={self.pages_in_use})")

    @property
    def sequences(self) -> list[int]:
        """The live sequences' ids, in the order they were added (or forked)."""
        return list(self._lens)

    @property
    def pages_in_use(self) -> int:
        """Pages some sequence holds (a page shared by forks counts once)."""
        return self.num_pages - self._free_count

    @property
    def free_pages(self) -> int:
        return self._free_count

    def length(self, seq: int) -> int:
        """The keys sequence ``seq`` holds."""
        return self._lens[self._known(seq)]

    def pages(self, seq: int) -> list[int]:
        """The page ids of sequence ``seq``, in order (a copy)."""
        return list(self._pages[self._known(seq)])

    def _known(self, seq: int) -> int:
        if seq not in self._lens:
            raise ValueError(f"sequence {seq!r} is not in the cache (live: {self.sequences}); add one with "
                             "cache.add() or cache.fork(seq)")
        return seq

    def add(self) -> int:
        """A new, empty sequence; returns its id (its pages come with its first keys)."""
        seq, self._next = self._next, self._next + 1
        self._pages[seq], self._lens[seq] = [], 0
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (nothing is copied now; a write into
        the shared partial last page copies that page first, for the writer). Returns its id."""
        pages = self._pages[self._known(seq)]
        for p in pages:
            self._refs[p] += 1
        new = self.add()
        self._pages[new], self._lens[new] = list(pages), self._lens[seq]
        self._layout += 1
        return new

    def free(self, seq: int) -> None:
        """Forget sequence ``seq``; its pages no other sequence holds become free."""
        for p in self._pages.pop(self._known(seq)):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[p] = 1
                self._free_count += 1
        del self._lens[seq]
        self._layout += 1

    def block_table(self, seqs: list[int] | tuple[int, ...]) -> Tensor:
        """(B, max_pages) int64 page ids of ``seqs`` on the host, -1 past each one's pages.

        A decode step takes a new page once in P steps: the table of the last ``seqs`` is kept
        until a page of any sequence changes, and each call returns a copy of it."""
        key = tuple(seqs)
        memo = self._table_memo
        if memo is not None and memo[0] == key and memo[1] == self._layout:
            return memo[2].clone()
        rows = [self._pages[self._known(s)] for s in seqs]
        width = max((len(r) for r in rows), default=0)
        table = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)
        self._table_memo = (key, self._layout, table)
        return table.clone()

    def seq_lens(self, seqs: list[int] | tuple[int, ...]) -> Tensor:
        """(B,) int64 lengths of ``seqs`` on the host."""
        return torch.tensor([self.length(s) for s in seqs], dtype=torch.int64)

    def batch(self, seqs: list[int] | tuple[int, ...]) -> PagedBatch:
        """These sequences as one step's batch, for ``MultiHeadAttention.forward(..., cache=...)``."""
        if not isinstance(seqs, (list, tuple)):
            raise TypeError(f"seqs must be a list or tuple of sequence ids, got {type(seqs).__name__}; pass [seq] "
                            "for one sequence")
        seqs = tuple(self._known(s) for s in seqs)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a batch names each sequence once, got {list(seqs)}; fork(seq) gives a second copy")
        return PagedBatch(self, seqs)

    def savepoint(self, seqs: list[int] | tuple[int, ...]) -> tuple:
        """What an :meth:`append` to ``seqs`` may change, for :meth:`rollback`: their pages and
        lengths, and the pool's free pages and reference counts (page contents need no copy: a
        step writes only into slots past the lengths and into pages that were free)."""
        return ({s: list(self._pages[s]) for s in seqs}, {s: self._lens[s] for s in seqs}, bytes(self._free),
                self._free_count, list(self._refs))

    def rollback(self, saved: tuple) -> None:
        """Back to what :meth:`savepoint` saved (after a refused step)."""
        pages, lens, free, self._free_count, self._refs = saved
        self._free[:] = free
        self._pages.update({s: list(p) for s, p in pages.items()})
        self._lens.update(lens)
        self._layout += 1

    def append(self, seqs: list[int] | tuple[int, ...], k: Tensor, v: Tensor) -> None:
        """Append T keys and values to each of ``seqs`` (T = 0, or no sequence: nothing changes).

        Args:
            seqs: B distinct sequence ids, in the order of the batch rows.
            k, v: (B, Hkv, T, D) keys and (B, Hkv, T, Dv) values.

        Raises:
            ValueError: unknown or repeated sequences, shapes that do not fit, or too few free
                pages (checked before anything changes: a refused append changes nothing).
            TypeError: seqs not a list or tuple, k or v of another dtype than the pool's.
        """
        seqs = self.batch(seqs).seqs
        self._check_step(seqs, k, v)
        T = k.shape[2]
        self.check_room(seqs, T)
        if T == 0 or not seqs:  # nothing to store: no page is taken, copied or written
            return
        slots = []
        for s in seqs:
            self._copy_on_write(s)
            L, pages = self._lens[s], self._pages[s]
            while len(pages) * self.page_size < L + T:
                pages.append(self._take(pages[-1] if pages else None))
            slots += [pages[i // self.page_size] * self.page_size + i % self.page_size for i in range(L, L + T)]
            self._lens[s] = L + T
        index = torch.tensor(slots, dtype=torch.int64, device=self._k.device)  # (B*T,) flat slots, sequence-major
        for pool, new in ((self._k, k), (self._v, v)):
            Hkv, N, P, D = pool.shape
            rows = new.transpose(0, 1).reshape(Hkv, len(slots), D)  # (B, Hkv, T, D) -> (Hkv, B*T, D)
            pool.view(Hkv, N * P, D).index_copy_(1, index, rows)  # into (Hkv, N*P, D)

    def pages_needed(self, seqs: list[int] | tuple[int, ...], T: int) -> int:
        """Free pages an :meth:`append` of T keys to each of ``seqs`` takes: their new pages,
        and a copy of each shared partial last page that another holder still needs (the
        last holder to write writes in place), exactly as the same appends one at a time.

        >>> import torch, headwise
        >>> cache = headwise.PagedKVCache(num_pages=3, page_size=4, kv_heads=1, head_dim=2)
        >>> a = cache.add()
        >>> cache.append([a], torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2))
        >>> b = cache.fork(a)  # both hold a partial page: the first writer copies it
        >>> cache.pages_needed([a, b], 1), cache.free_pages
        (1, 1)
        """
        seqs = self.batch(seqs).seqs
        if isinstance(T, bool) or not isinstance(T, int):
            raise TypeError(f"T must be an int, the new keys of each sequence, got {type(T).__name__}")
        if T < 0:
            raise ValueError(f"T must be >= 0, the new keys of each sequence, got {T}")
        if T == 0:
            return 0
        P, need = self.page_size, 0
        holders: dict[int, int] = {}  # a shared tail page -> its holders left after this step's copies
        for s in seqs:
            L, pages = self._lens[s], self._pages[s]
            need += max(0, -(-(L + T) // P) - len(pages))
            if L % P:
                tail = pages[-1]
                held = holders.get(tail, self._refs[tail])
                if held > 1:  # another sequence still reads it: this one writes into a copy
                    need += 1
                    holders[tail] = held - 1
        return need

    def check_room(self, seqs: list[int] | tuple[int, ...], T: int) -> int:
        """:meth:`pages_needed`, refused with a ValueError where the pool has fewer free pages."""
        need = self.pages_needed(seqs, T)
        if need > self._free_count:
            raise ValueError(
                f"the paged cache needs {need} free pages for this step ({T} new keys each for sequences "
                f"{list(seqs)}, pages of {self.page_size}) but has {self._free_count} of {self.num_pages}; free "
                "finished sequences (cache.free(seq)) or make a larger pool (num_pages=...); nothing was written")
        return need

    def _check_step(self, seqs: tuple[int, ...], k: Tensor, v: Tensor) -> None:
        Hkv, _, _, D = self._k.shape
        Dv = self._v.shape[-1]
        for name, t, dim in (("k", k, D), ("v", v, Dv)):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[0] != len(seqs) or t.shape[1] != Hkv \
                    or t.shape[3] != dim:
                shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name} must be (B, Hkv, T, {'D' if name == 'k' else 'Dv'}) = ({len(seqs)}, {Hkv}, "
                                 f"T, {dim}) for {len(seqs)} sequences, got {shape}")
            if t.dtype != self._k.dtype or t.device != self._k.device:
                raise TypeError(f"{name} is {t.dtype} on {t.device}; the pool is {self._k.dtype} on "
                                f"{self._k.device}: pass {name}.to(cache.k_pages)")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must hold the same T new positions, got {k.shape[2]} and {v.shape[2]}")

    def _copy_on_write(self, seq: int) -> None:
        """Give ``seq`` its own copy of its last page if it is partial and shared."""
        L, pages = self._lens[seq], self._pages[seq]
        if L % self.page_size == 0 or self._refs[pages[-1]] == 1:
            return
        old = pages[-1]
        new = self._take(pages[-2] if len(pages) > 1 else None)
        self._k[:, new] = self._k[:, old]  # (Hkv, P, D)
        self._v[:, new] = self._v[:, old]
        self._refs[old] -= 1
        pages[-1] = new

    def _take(self, after: int | None) -> int:
        """One free page (there is one: the caller counted): the one after ``after`` if free,
        else the start of a new run (see the module docstring); held once."""
        p = after + 1 if after is not None and after + 1 < self.num_pages and self._free[after + 1] else None
        if p is None:
            start, size = self._largest_gap()
            if size == 0:  # a miscount would overwrite a page some sequence holds
                raise RuntimeError("internal error: the paged cache took a page with none free; please report it")
            p = start if start == 0 else start + size // 2
        self._free[p] = 0
        self._free_count -= 1
        self._refs[p] = 1
        self._layout += 1  # a sequence's pages are about to change (a new page, or a copy on write)
        return p

    def _largest_gap(self) -> tuple[int, int]:
        """``(start, size)`` of the longest run of free pages (the first of equal ones)."""
        best, i, free = (0, 0), 0, self._free
        while (start := free.find(1, i)) >= 0:
            end = free.find(0, start)
            end = len(free) if end < 0 else end
            if end - start > best[1]:
                best = (start, end - start)
            i = end
        return best

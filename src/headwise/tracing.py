"""Explain mode: record every stage of attention, its shape, dtype and formula.

``with headwise.trace() as t:`` records each stage of every attention call made inside
the block, in this thread, into ``t.stages``; ``print(t)`` shows them as one table, like
the documents' ``stage1 ... stage4`` prints.

Who records what:

* the module (projections, heads, merge, output projection) and the functional layer
  (mask layout, which kernel ran) record their own stages;
* kernels hold no hooks: :func:`headwise.functional.attend` records the stages inside a
  kernel from the description the kernel declares (``Kernel.stages``), computed from the
  call's real shapes, scale and mask.

Outside a trace block the hooks cost one global lookup each: every hook is guarded by
``if trace.ACTIVE:`` so no string, shape or object is built
(``benchmarks/trace_overhead.py`` measures it). ``ACTIVE`` counts the blocks open in any
thread; which trace a stage goes to is this thread's own (a ``ContextVar``, and the trace
checks the thread), so a thread without a block records nothing while another has one.

rich, which draws the table, is imported only when a trace is printed.
"""

from __future__ import annotations

import io
import threading
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Stage", "Trace", "trace", "record", "begin_call", "recording", "ACTIVE"]

# Number of trace blocks open in any thread: the hooks' cheap guard, changed under
# _ACTIVE_LOCK (`+= 1` is a read and a write; two threads may interleave them).
ACTIVE = 0
_ACTIVE_LOCK = threading.Lock()
_CURRENT: ContextVar[Trace | None] = ContextVar("headwise_trace", default=None)


@dataclass(frozen=True)
class Stage:
    """One recorded stage.

    Attributes:
        call: which attention call in the block (0, 1, ...).
        name: the stage, e.g. ``"scores"``.
        shape: the tensor's shape as a tuple of ints.
        dtype: the tensor's dtype.
        note: the formula or operation, e.g. ``"(B, H, S, D) x (B, H, D, Sk) -> (B, H, S, Sk)"``.
        fused: True when this one stage stands for several that a fused kernel does at once.
    """

    call: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    note: str
    fused: bool = False


@dataclass
class Trace:
    """The stages recorded inside one ``with headwise.trace()`` block, in the thread that opened it."""

    stages: list[Stage] = field(default_factory=list)
    calls: int = 0
    _tokens: list[Token] = field(default_factory=list, init=False, repr=False, compare=False)
    _thread: int | None = field(default=None, init=False, repr=False, compare=False)

    def __enter__(self) -> Trace:
        global ACTIVE
        self._thread = threading.get_ident()
        self._tokens.append(_CURRENT.set(self))
        with _ACTIVE_LOCK:
            ACTIVE += 1
        return self

    def __exit__(self, *exc) -> None:
        global ACTIVE
        with _ACTIVE_LOCK:
            ACTIVE -= 1
        _CURRENT.reset(self._tokens.pop())

    def names(self, call: int | None = None) -> list[str]:
        """Stage names, for one call or all."""
        return [s.name for s in self.stages if call is None or s.call == call]

    def table(self, title: str | None = None) -> Table:
        """The stages as a rich table."""
        from rich.table import Table
        from rich.text import Text

        table = Table(title=title or "attention, stage by stage")
        table.add_column("call", justify="right")
        for column in ("stage", "shape", "dtype", "what happens"):  # fold a long word, never cut it
            table.add_column(column, justify="left", overflow="fold")
        for s in self.stages:
            name = f"{s.name} (fused)" if s.fused else s.name
            dtype = str(s.dtype).removeprefix("torch.") if s.dtype is not None else ""
            # Text(), not markup: notes hold brackets and slices that rich would parse.
            table.add_row(*(Text(cell) for cell in (str(s.call), name, str(s.shape), dtype, s.note)))
        return table

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None).print(self.table())
        return buffer.getvalue()

    def _begin_call(self) -> int:
        self.calls += 1
        return self.calls - 1


def trace() -> Trace:
    """Record the stages of every attention call this thread makes in a ``with`` block.

    >>> import headwise
    >>> mha = headwise.MultiHeadAttention(32, 4, backend="matmul")
    >>> with headwise.trace() as t:
    ...     _ = mha(torch.rand(2, 3, 32))
    >>> t.stages[-1].name, t.stages[-1].shape
    ('output projection', (2, 3, 32))
    """
    return Trace()


def _current() -> Trace | None:
    """This thread's open trace, or None."""
    current = _CURRENT.get()
    if current is None or current._thread != threading.get_ident():
        return None  # a context copied into another thread does not record into this trace
    return current


def recording() -> bool:
    """True when this thread has a trace open (``ACTIVE`` may count other threads' blocks)."""
    return _current() is not None


def begin_call() -> None:
    """Mark the start of one attention call (the module or the function calls this)."""
    current = _current()
    if current is not None:
        current._begin_call()


def record(name: str, value: Tensor | tuple[int, ...], note: str, *, fused: bool = False,
           dtype: torch.dtype | None = None) -> None:
    """Add a stage to this thread's trace, if any. Call it only under ``if trace.ACTIVE:``.

    Args:
        name: the stage.
        value: the tensor the stage produced, or its shape.
        note: what happens.
        fused: the stage stands for several done at once.
        dtype: the dtype when ``value`` is a shape (a tensor gives its own).
    """
    current = _current()
    if current is None:
        return
    if isinstance(value, Tensor):
        shape, dtype = tuple(value.shape), value.dtype
    else:
        shape = tuple(value)
    call = max(current.calls - 1, 0)
    current.stages.append(Stage(call, name, shape, dtype, note, fused))

"""Explain mode: record every stage of attention, its shape, dtype and formula.

``with headwise.trace() as t:`` records each stage of every attention call made inside
the block, by the module and by the kernels, into ``t.stages``; ``print(t)`` shows them
as one table, like the documents' ``stage1 ... stage4`` prints.

Outside a trace block the hooks cost one global lookup each: the module and the kernels
guard every hook with ``if trace.ACTIVE:`` so no string, shape or object is built
(``benchmarks/trace_overhead.py`` measures it).
"""

from __future__ import annotations

import io
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text
from torch import Tensor

__all__ = ["Stage", "Trace", "trace", "record", "ACTIVE"]

# Number of trace blocks open in any thread: the hooks' cheap guard. Which trace a stage
# goes to is per-context (thread / task), through _CURRENT.
ACTIVE = 0
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
    """The stages recorded inside one ``with headwise.trace()`` block."""

    stages: list[Stage] = field(default_factory=list)
    calls: int = 0

    def __enter__(self) -> Trace:
        global ACTIVE
        self._token = _CURRENT.set(self)
        ACTIVE += 1
        return self

    def __exit__(self, *exc) -> None:
        global ACTIVE
        ACTIVE -= 1
        _CURRENT.reset(self._token)

    def names(self, call: int | None = None) -> list[str]:
        """Stage names, for one call or all."""
        return [s.name for s in self.stages if call is None or s.call == call]

    def table(self, title: str | None = None) -> Table:
        """The stages as a rich table."""
        table = Table(title=title or "attention, stage by stage")
        for column, justify in (("call", "right"), ("stage", "left"), ("shape", "left"),
                                ("dtype", "left"), ("what happens", "left")):
            table.add_column(column, justify=justify)
        for s in self.stages:
            name = f"{s.name} (fused)" if s.fused else s.name
            dtype = str(s.dtype).removeprefix("torch.") if s.dtype is not None else ""
            # Text(), not markup: notes hold brackets and slices that rich would parse.
            table.add_row(*(Text(cell) for cell in (str(s.call), name, str(s.shape), dtype, s.note)))
        return table

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(file=buffer, width=140, color_system=None).print(self.table())
        return buffer.getvalue()

    def _begin_call(self) -> int:
        self.calls += 1
        return self.calls - 1


def trace() -> Trace:
    """Record the stages of every attention call in a ``with`` block.

    >>> import headwise
    >>> mha = headwise.MultiHeadAttention(32, 4, backend="matmul")
    >>> with headwise.trace() as t:
    ...     _ = mha(torch.rand(2, 3, 32))
    >>> t.stages[-1].name, t.stages[-1].shape
    ('output projection', (2, 3, 32))
    """
    return Trace()


def begin_call() -> None:
    """Mark the start of one attention call (the module or the function calls this)."""
    current = _CURRENT.get()
    if current is not None:
        current._begin_call()


def record(name: str, value: Tensor | tuple[int, ...], note: str, *, fused: bool = False) -> None:
    """Add a stage to the current trace, if any. Call it only under ``if trace.ACTIVE:``."""
    current = _CURRENT.get()
    if current is None:
        return
    if isinstance(value, Tensor):
        shape, dtype = tuple(value.shape), value.dtype
    else:
        shape, dtype = tuple(value), None
    call = max(current.calls - 1, 0)
    current.stages.append(Stage(call, name, shape, dtype, note, fused))

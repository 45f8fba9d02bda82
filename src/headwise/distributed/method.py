"""Which method moves the sequence between the ranks: ``"ring"``, ``"ulysses"`` or ``"auto"``
(:func:`choose_method`, whose choice says why), and :class:`ContextParallel`, the module's
setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headwise.distributed import ulysses
from headwise.distributed.layout import check_layout

__all__ = ["METHODS", "ContextParallel", "MethodChoice", "choose_method"]

METHODS = ("ring", "ulysses", "auto")


@dataclass(frozen=True)
class ContextParallel:
    """How :class:`headwise.MultiHeadAttention` splits its sequence across processes.

    Args:
        group: the process group (None: the default group).
        method: ``"ring"``, ``"ulysses"`` or ``"auto"``.
        layout: ``"zigzag"`` or ``"contiguous"``; inputs must be sharded with the same one.

    Raises:
        ValueError: an unknown method or layout.
    """

    group: Any = None
    method: str = "ring"
    layout: str = "zigzag"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        check_layout(self.layout)


@dataclass(frozen=True)
class MethodChoice:
    """The method ``"auto"`` picks, and why."""

    method: str
    reason: str

    def __str__(self) -> str:
        return f"{self.method}: {self.reason}"


def choose_method(num_heads: int, num_kv_heads: int, world_size: int, *, dense_mask: bool = False) -> MethodChoice:
    """What ``method="auto"`` runs for these head counts, and why.

    Ulysses moves each tensor once in 1/N pieces (two all-to-alls) and then runs the best
    local kernel on whole sequences; ring moves every K/V block N - 1 times, but takes any
    head count and never holds a whole sequence or a gathered dense mask.

    >>> print(choose_method(8, 2, 4))
    ulysses: 8 query and 2 kv heads split over 4 ranks (kv heads replicated); two all-to-alls move 1/N of each \
tensor, then the local 'auto' kernel attends whole sequences
    """
    if world_size == 1:
        return MethodChoice("ring", "one rank: headwise.attention runs directly")
    try:
        ulysses.check_heads(num_heads, num_kv_heads, world_size)
    except ValueError:
        return MethodChoice("ring", f"{num_heads} query / {num_kv_heads} kv heads do not split over {world_size} "
                                    "ranks, which ulysses needs; ring takes any head count")
    if dense_mask:
        return MethodChoice("ring", "a (.., S_l, Sk) mask would be gathered whole on every rank by ulysses; "
                                    "ring reads only its columns of each block")
    replicated = " (kv heads replicated)" if num_kv_heads % world_size else ""
    return MethodChoice("ulysses", f"{num_heads} query and {num_kv_heads} kv heads split over {world_size} "
                                   f"ranks{replicated}; two all-to-alls move 1/N of each tensor, then the local "
                                   "'auto' kernel attends whole sequences")

"""How the ranks agree before any data moves: one small all-gather of metadata, and a refusal
raised on every rank.

Every rank checks its own inputs, then the ranks exchange a few numbers each (a metadata
row). A rank whose own check refused sends zeros and raises its own error; the others raise
one naming it and its message (:func:`_refused`), so a mistake never leaves a rank waiting in
a collective for the others. :func:`_agree_tensors` is the exchange of
:func:`headwise.distributed.shard` and :func:`headwise.distributed.unshard`; the one of
:func:`headwise.distributed.attention` is in :mod:`headwise.distributed.arguments`.

Legend: N world size, S_l this rank's shard length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from headwise.distributed.layout import LAYOUTS, check_layout, local_length

_T = TypeVar("_T")


def _group_info(group) -> tuple[int, int]:
    """(rank, world size) of this process in ``group``; RuntimeError if there is none."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; "
                           "use headwise.attention in a single process")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group('gloo') "
            "(CPU) or ('nccl') (one GPU per rank) in every process first, e.g. under torchrun; "
            "in a single process use headwise.attention"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the given process group")
    return rank, dist.get_world_size(group)


def _comm_device(group, like: Tensor | torch.device | None) -> torch.device:
    """Where metadata travels: this process's GPU under NCCL (whatever ``like``'s device), else like's device."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(like, Tensor):
        return like.device
    return torch.device("cpu") if like is None else like


def _all_gather(mine: Tensor, group, world: int) -> list[Tensor]:
    """One all-gather of a small tensor, the same shape on every rank."""
    every = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(every, mine, group=group)
    except RuntimeError as error:
        raise RuntimeError(f"context parallel: rank {dist.get_rank(group)} of {world} could not exchange metadata "
                           f"with the other ranks; a rank has died or stopped calling, or the group's timeout "
                           f"passed. Cause: {error}") from error
    return every


def _all_gather_rows(values: list[float], group, world: int, device: torch.device) -> list[list[float]]:
    """One all-gather of a few numbers per rank (float64: integers up to 2**53 stay exact)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    return torch.stack(_all_gather(mine, group, world)).cpu().tolist()


_MESSAGE_BYTES = 4096  # of a refusing rank's message that reaches the others (UTF-8, cut beyond)


def _refused(ok: list[bool], error: Exception | None, group, world: int, device: torch.device) -> None:
    """After an exchange in which every rank said whether its own checks passed (``ok``, rank by
    rank): when one refused, raise on every rank, so every rank stops at the same point and none
    waits in a collective for the others.

    The refusing ranks' messages travel in one more all-gather; a refusing rank raises its own
    ``error``, the others the first refusing rank's kind (TypeError or ValueError) naming the ranks
    and their messages.
    """
    bad = [r for r, good in enumerate(ok) if not good]
    if not bad:
        return
    text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device)
    mine[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    every = [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in _all_gather(mine, group, world)]
    if error is not None:
        raise error
    kind = TypeError if every[bad[0]].startswith("TypeError:") else ValueError
    raise kind(f"rank(s) {bad} of {world} rejected their inputs, so every rank stops before any data moves; "
               + "; ".join(f"rank {r}: {every[r]}" for r in bad))


def _checked_rows(local, width: int, group, world: int, device: torch.device) -> list[list[float]]:
    """Every rank's metadata row (``local()``, ``width`` numbers), gathered whatever a rank's own check says.

    A rank whose ``local`` raised sends zeros and re-raises its own error; the others raise an
    error naming it and its message (:func:`_refused`), so every rank stops at the same point and
    no data moves.
    """
    error: Exception | None = None
    try:
        row = [1.0, *local()]
    except (TypeError, ValueError) as caught:
        error, row = caught, [0.0] * (width + 1)
    rows = _all_gather_rows(row, group, world, device)
    _refused([every[0] == 1 for every in rows], error, group, world, device)
    return [every[1:] for every in rows]


def _checked_together(check: Callable[[], _T], group=None, like: Tensor | torch.device | None = None) -> _T:
    """``check()`` on this rank, then one small all-gather: its result where every rank's check
    passed, else an error on every rank (:func:`_refused`). For a caller whose own checks run
    before it reaches :func:`attention` (the module): a refusal on one rank must not leave the
    others waiting in the next collective.

    Raises:
        RuntimeError: torch.distributed is not initialised (after a check that passed).
        ValueError / TypeError: a check refused on some rank (on every rank).
    """
    error: Exception | None = None
    try:
        result = check()
    except (TypeError, ValueError) as caught:
        error = caught
    try:
        _, world = _group_info(group)
    except RuntimeError:
        if error is not None:
            raise error from None
        raise
    if world > 1:
        device = _comm_device(group, like)
        ok = _all_gather_rows([float(error is None)], group, world, device)
        _refused([row[0] == 1 for row in ok], error, group, world, device)
    if error is not None:
        raise error
    return result


_DTYPE_NAMES = tuple(sorted({str(d).removeprefix("torch.") for d in vars(torch).values()
                             if isinstance(d, torch.dtype)}))  # the same order on every rank of one torch
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "xla", "meta")
_SHAPE_SLOTS = 8  # dims sent with the first exchange; a tensor of more dims sends its shape in a second


def _tensor_row(what: str, t: Tensor, dim: int, layout: str) -> list[float]:
    """This rank's (ndim, dtype, device type, layout, dim, needs grad, shape[:8] padded with -1)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{what} takes a tensor, got {type(t).__name__}")
    check_layout(layout)
    if not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for a {t.dim()}-D tensor; pass a dim in "
                         f"[{-t.dim()}, {t.dim() - 1}]")
    dtype = str(t.dtype).removeprefix("torch.")
    device = _DEVICE_TYPES.index(t.device.type) if t.device.type in _DEVICE_TYPES else len(_DEVICE_TYPES)
    shape = list(t.shape[:_SHAPE_SLOTS]) + [-1] * (_SHAPE_SLOTS - min(t.dim(), _SHAPE_SLOTS))
    grad = what == "unshard" and torch.is_grad_enabled() and t.requires_grad  # its backward is collective
    return [t.dim(), _DTYPE_NAMES.index(dtype), device, LAYOUTS.index(layout), dim % t.dim(), int(grad), *shape]


def _agree_tensors(what: str, t: Tensor, dim: int, layout: str, group, world: int, *,
                   whole: bool) -> list[list[int]]:
    """Check that every rank passes a tensor of one ndim, dtype, device type, layout and dim, and one
    shape (``whole``) or one shape outside ``dim`` (a shard); the same ValueError on every rank.

    Returns every rank's shape.
    """
    device = _comm_device(group, t if isinstance(t, Tensor) else None)
    rows = _checked_rows(lambda: _tensor_row(what, t, dim, layout), 6 + _SHAPE_SLOTS, group, world, device)
    remedy = ("every rank must pass the same whole tensor, with the same dim and layout" if whole else
              "every rank must pass its own shard of one tensor, with the same dim and layout (hwd.shard(x, dim, "
              "layout) makes them)")
    fields: tuple[tuple[str, Callable[[float], object]], ...] = (
        ("the number of dims", int), ("the dtype", lambda c: _DTYPE_NAMES[int(c)]),
        ("the device type", lambda c: (*_DEVICE_TYPES, "other")[int(c)]), ("the layout", lambda c: LAYOUTS[int(c)]),
        ("the sequence dim", int), ("needs grad", bool))
    for i, (name, show) in enumerate(fields):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            why = remedy if name != "needs grad" else ("its backward is collective: every rank's shard must "
                                                       "require grad (under grad mode), or none")
            raise ValueError(f"{what}: the ranks disagree on {name}: {[show(v) for v in values]} on ranks "
                             f"0..{world - 1}; {why}")
    ndim, seq = int(rows[0][0]), int(rows[0][4])
    if ndim <= _SHAPE_SLOTS:
        shapes = [[int(x) for x in row[6:6 + ndim]] for row in rows]
    else:  # every rank has the same ndim: one more exchange of the whole shape
        shapes = [[int(x) for x in row] for row in _all_gather_rows(list(t.shape), group, world, device)]
    # a shard's length along dim is checked against the layout by the caller: shown as *
    shown = ["(" + ", ".join("*" if i == seq and not whole else str(x) for i, x in enumerate(s)) + ")"
             for s in shapes]
    if len(set(shown)) > 1:
        where = "shape" if whole else f"shape outside dim {seq}"
        raise ValueError(f"{what}: the ranks disagree on the {where}: [{', '.join(shown)}] on ranks "
                         f"0..{world - 1}; {remedy}")
    return shapes


def _lengths(local: list[int], world: int, layout: str, what: str, dim: int = 2) -> list[int]:
    total = sum(local)
    expected = [local_length(total, world, r, layout) for r in range(world)]
    if local != expected:
        raise ValueError(f"{what} shards hold {local} positions on ranks 0..{world - 1}, but layout {layout!r} "
                         f"splits {total} positions as {expected}; shard with hwd.shard(x, dim={dim}, "
                         f"layout={layout!r})")
    return local

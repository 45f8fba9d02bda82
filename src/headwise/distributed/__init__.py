"""Attention across processes (context parallelism) over ``torch.distributed``: exact, every mask.

Each rank holds a shard of the sequence; :func:`attention` computes exact attention of
its queries over every rank's keys, by one of two methods:

* ``"ring"``: K/V blocks (with their Hkv heads) travel around the ranks while each rank
  computes; partial results merge by log-sum-exp (:mod:`headwise.distributed.ring`).
* ``"ulysses"``: two all-to-alls trade the sequence split for a head split, and any
  local kernel attends (:mod:`headwise.distributed.ulysses`).

In every process, after ``torch.distributed.init_process_group(...)``::

    import headwise.distributed as hwd
    x_local = hwd.shard(x, dim=1, layout="zigzag")              # (B, S_l, E)
    y = hwd.attention(q, k, v, is_causal=True, method="ring")   # (B, H, S_l, D)
    full = hwd.unshard(y, dim=2)                                # (B, H, S, D) on every rank

Every rank validates its inputs, then one small all-gather of metadata checks that the
ranks agree (shapes, dtype, layout, flags, ALiBi slopes, shard lengths) in ``attention``,
``shard``, ``unshard`` and ``global_positions``; any problem raises on every rank before any
data moves (a rank that refused its own inputs raises its error, the others an error naming
it and its message), so a mistake never hangs the group.

Legend: B batch, H query heads, Hkv key/value heads, S / Sk global query / key length,
S_l / Sk_l this rank's lengths, D head dim, N world size.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

import headwise
from headwise.distributed import ring as _ring
from headwise.distributed import ulysses as _ulysses
from headwise.distributed.layout import LAYOUTS, check_layout, local_length, positions_of, segments
from headwise.functional import _check_inputs, _check_structure
from headwise.mask_contract import check_mask_values
from headwise.masks import normalize_mask

__all__ = ["ContextParallel", "MethodChoice", "METHODS", "LAYOUTS", "attention", "choose_method",
           "global_length", "global_positions", "positions", "shard", "unshard"]

logger = logging.getLogger(__name__)

METHODS = ("ring", "ulysses", "auto")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_T = TypeVar("_T")


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


def global_length(local_len: int, group=None, device: torch.device | str | None = None) -> int:
    """The sequence length summed over the ranks of ``group`` (one all-gather).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    _, world = _group_info(group)
    device = _comm_device(group, torch.device(device) if device is not None else None)
    return int(sum(row[0] for row in _all_gather_rows([local_len], group, world, device)))


def positions(seq_len: int, layout: str = "zigzag", group=None,
              device: torch.device | str | None = None) -> Tensor:
    """The global positions of this rank's shard of a ``seq_len`` sequence.

    Args:
        seq_len: the global length S.
        layout: ``"zigzag"`` or ``"contiguous"``.
        group: the process group (None: the default group).
        device: where to build the result.

    Returns:
        (S_l,) int64 positions, in the shard's order (use them for rotary embeddings).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout.
    """
    check_layout(layout)
    rank, world = _group_info(group)
    return positions_of(seq_len, world, rank, layout, device)


def global_positions(local_len: int, layout: str = "zigzag", group=None,
                     device: torch.device | str | None = None) -> tuple[int, Tensor]:
    """The global length and this rank's global positions, from this rank's shard length (one all-gather).

    Unlike :func:`~headwise.distributed.global_length` then
    :func:`~headwise.distributed.positions`, it checks that the ranks' lengths are
    the layout's split of their sum, so a shard made some other way is the same ValueError on
    every rank, not a size mismatch on some and a hang on the others.

    Args:
        local_len: S_l, this rank's shard length.
        layout: ``"zigzag"`` or ``"contiguous"``, as the shards were made.
        group: the process group (None: the default group).
        device: where to build the positions (and, with gloo, where the metadata travels).

    Returns:
        The global length S and this rank's (S_l,) int64 positions, in the shard's order.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout, or lengths that are not the layout's split (on every rank).

    >>> S, pos = global_positions(x_local.shape[1], "zigzag")  # doctest: +SKIP
    """
    rank, world = _group_info(group)
    device = torch.device(device) if device is not None else None
    comm = _comm_device(group, device)

    def local() -> list[float]:
        check_layout(layout)
        if isinstance(local_len, bool) or not isinstance(local_len, int) or local_len < 0:
            raise ValueError(f"local_len must be a shard length (an int >= 0), got {local_len!r}")
        return [local_len]

    lengths = _lengths([int(row[0]) for row in _checked_rows(local, 1, group, world, comm)], world, layout, "x",
                       dim=1)
    return sum(lengths), positions_of(sum(lengths), world, rank, layout, device)


def shard(x: Tensor, dim: int = 1, layout: str = "zigzag", group=None) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (a view for ``"contiguous"``, a copy for ``"zigzag"``).

    Every rank of ``group`` calls it with the same whole tensor: one small all-gather of
    metadata checks its shape, dtype, device type, dim and layout on every rank.

    Args:
        x: the whole tensor, the same on every rank, e.g. (B, S, E) with ``dim=1`` or
            (B, H, S, D) with ``dim=2``; a (B, Sk) key padding mask with ``dim=1``.
        dim: the sequence dimension.
        layout: ``"zigzag"`` (rank r holds chunks r and 2N-1-r of 2N) or ``"contiguous"``.
        group: the process group (None: the default group).

    Returns:
        The shard, S_l = S // C or S // C + 1 positions per chunk (C chunks); nothing is
        dropped whatever S is.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout, a dim out of range, or ranks that pass tensors of another
            shape, dtype or device type, or another dim or layout (on every rank: one small
            all-gather of metadata checks).
    """
    rank, world = _group_info(group)
    if world == 1:
        _tensor_row("shard", x, dim, layout)
    else:
        _agree_tensors("shard", x, dim, layout, group, world, whole=True)
    parts = [x.narrow(dim, a, b - a) for a, b in segments(x.shape[dim], world, rank, layout)]
    if not parts:
        return x.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gather_seq(t: Tensor, dim: int, lengths: list[int], layout: str, group) -> Tensor:
    """All-gather shards of uneven length along ``dim`` into the whole tensor, natural order."""
    world = len(lengths)
    dim = dim % t.dim()
    wire = t.view(torch.uint8) if t.dtype == torch.bool else t  # bool travels as bytes
    shape = list(wire.shape)
    shape[dim] = max(lengths)
    padded = wire.new_zeros(shape)
    padded.narrow(dim, 0, wire.shape[dim]).copy_(wire)
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    shape[dim] = sum(lengths)
    full = wire.new_empty(shape)
    for r, part in enumerate(every):
        local = 0
        for a, b in segments(sum(lengths), world, r, layout):
            full.narrow(dim, a, b - a).copy_(part.narrow(dim, local, b - a))
            local += b - a
    return full.view(torch.bool) if t.dtype == torch.bool else full


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dim, lengths, layout, group, rank):
        ctx.args = (dim, lengths, layout, group, rank)
        return _gather_seq(y, dim, lengths, layout, group)

    @staticmethod
    def backward(ctx, grad):
        dim, lengths, layout, group, rank = ctx.args
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)  # every rank's use of the whole tensor reaches each shard
        parts = [grad.narrow(dim, a, b - a) for a, b in segments(sum(lengths), len(lengths), rank, layout)]
        local = torch.cat(parts, dim=dim) if parts else grad.narrow(dim, 0, 0)
        return local, None, None, None, None, None


def unshard(y: Tensor, dim: int = 2, layout: str = "zigzag", group=None) -> Tensor:
    """The whole tensor on every rank, from each rank's shard along ``dim`` (inverse of :func:`shard`).

    Differentiable: the gradient of a shard is the sum of every rank's gradient of the
    whole tensor at its positions.

    Args:
        y: this rank's shard, e.g. the (B, H, S_l, D) output of :func:`attention`.
        dim: the sequence dimension.
        layout: the layout the shards were made with.
        group: the process group (None: the default group).

    Returns:
        The whole tensor, S = sum of the shards' lengths along ``dim``.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: an unknown layout, a dim out of range, shards whose lengths do not fit the
            layout, or ranks whose shards differ in ndim, dtype, device type, dim, layout or
            shape outside ``dim`` (on every rank: one small all-gather of metadata checks).
    """
    rank, world = _group_info(group)
    if world == 1:
        _tensor_row("unshard", y, dim, layout)
    shapes = _agree_tensors("unshard", y, dim, layout, group, world, whole=False) if world > 1 else [list(y.shape)]
    dim = dim % y.dim()
    lengths = [shape[dim] for shape in shapes]
    expected = [local_length(sum(lengths), world, r, layout) for r in range(world)]
    if lengths != expected:
        raise ValueError(f"unshard got shards of lengths {lengths} along dim {dim}, but layout {layout!r} splits "
                         f"{sum(lengths)} positions as {expected}; shard with hwd.shard(x, dim, layout={layout!r})")
    return _Unshard.apply(y, dim, lengths, layout, group, rank)


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
        _ulysses.check_heads(num_heads, num_kv_heads, world_size)
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


_FIELDS = ("inputs valid", "batch B", "num_heads H", "num_kv_heads Hkv", "head_dim D", "dtype", "is_causal",
           "window", "alibi_slopes", "scale", "mask kind", "mask batch", "mask heads", "mask key length", "method",
           "layout", "dropout_p", "device type", "needs grad")
_MASK_KINDS = ("none", "bool (B, Sk_l) key padding", "float (B, Sk_l) key padding", "bool (.., S_l, Sk)",
               "float (.., S_l, Sk)")


def _same_value_dim(k: Tensor, v: Tensor) -> None:
    """Context parallelism moves k and v as one (2, B, Hkv, Sk_l, D) block: v's head dim must be k's."""
    if isinstance(k, Tensor) and isinstance(v, Tensor) and k.dim() == v.dim() == 4 and k.shape[-1] != v.shape[-1]:
        raise ValueError(f"context-parallel attention needs v's head dim to be k's (the ring sends k and v as one "
                         f"block): got D = {k.shape[-1]}, Dv = {v.shape[-1]}; use headwise.attention on one process "
                         "for a value head dim of its own")


def _unexpected(unexpected: dict) -> None:
    """A keyword attention does not take: TypeError (on every rank: a rank alone raising would hang the others)."""
    if unexpected:
        raise TypeError(f"hwd.attention() got an unexpected keyword argument {next(iter(unexpected))!r}; it takes "
                        "attention_mask, is_causal, window, alibi_slopes, scale, dropout_p, method, layout and group")


def _slopes_print(slopes: Tensor | None) -> float:
    """-1 for no ALiBi, else a CRC-32 of the slopes' float64 values: ranks that pass other slopes differ."""
    if slopes is None:
        return -1.0
    raw = slopes.detach().to("cpu", torch.float64).contiguous().view(torch.uint8)  # (8 H,) bytes
    return float(zlib.crc32(bytes(raw.tolist())))


def _local_check(q, k, v, attention_mask, is_causal, window, alibi_slopes, scale, dropout_p, method, layout,
                 unexpected):
    """Validate this rank's arguments; returns (normalised masks, metadata row, q/k lengths, dense mask rows)."""
    _unexpected(unexpected)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_layout(layout)
    _check_inputs(q, k, v, dropout_p, "auto")
    _check_structure(q, window, alibi_slopes)
    _same_value_dim(k, v)
    if dropout_p > 0:
        raise ValueError(f"context-parallel attention has no dropout (got dropout_p={dropout_p}); "
                         "use dropout_p=0 (the module: dropout=0.0 or .eval())")
    B, H, S_l, D = q.shape
    Sk_l = k.shape[2]
    pad = dense = None
    mask_kind, mask_b, mask_h, mask_rows, mask_sk = 0, 0, 0, -1, -1
    m = attention_mask
    if isinstance(m, Tensor):  # +inf makes a softmax NaN: refused here, before the ranks exchange anything
        check_mask_values(m)
    if m is not None:
        if isinstance(m, Tensor) and m.dim() == 2:
            pad4 = cast(Tensor, normalize_mask(m, batch=B, heads=H, q_len=S_l, k_len=Sk_l, device=q.device,
                                               dtype=q.dtype))  # a tensor for a tensor
            pad = pad4[:, 0, 0, :]  # (B|1, 1, 1, Sk_l) -> (B|1, Sk_l)
            mask_kind = 1 if pad.dtype == torch.bool else 2
            mask_b = pad.shape[0]
        else:
            k_len = m.shape[-1] if isinstance(m, Tensor) and m.dim() in (3, 4) else -1
            dense = cast(Tensor, normalize_mask(m, batch=B, heads=H, q_len=S_l, k_len=k_len, device=q.device,
                                                dtype=q.dtype))  # a tensor for a tensor
            mask_kind = 3 if dense.dtype == torch.bool else 4
            mask_b, mask_h, mask_rows, mask_sk = dense.shape[0], dense.shape[1], dense.shape[2], k_len
    row = [1, B, H, k.shape[1], D, _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1, int(bool(is_causal)),
           -1 if window is None else window, _slopes_print(alibi_slopes), -1.0 if scale is None else float(scale),
           mask_kind, mask_b, mask_h, mask_sk, METHODS.index(method), LAYOUTS.index(layout),
           float(dropout_p), 0 if q.device.type == "cpu" else 1,
           int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))]  # backward is collective
    return pad, dense, row, S_l, Sk_l, mask_rows


def _agree(rows: list[list[float]], world: int, alibi_slopes: Tensor | None):
    """Raise the same error on every rank when the ranks' metadata disagree."""
    for i, name in enumerate(_FIELDS):
        values = [row[i] for row in rows]
        if len(set(values)) > 1 and name == "alibi_slopes":
            groups = [[r for r, x in enumerate(values) if x == value] for value in dict.fromkeys(values)]
            mine = None if alibi_slopes is None else alibi_slopes.tolist()
            raise ValueError(f"the ranks disagree on alibi_slopes: the groups of ranks {groups} pass different ones "
                             f"(this rank's: {mine}); every rank must pass the same (H,) slopes, or none")
        if len(set(values)) > 1:
            shown = [_MASK_KINDS[int(x)] if name == "mask kind" else x for x in values]
            why = ("every rank must pass tensors of the same batch, heads, head dim and dtype, and the same flags"
                   if name != "needs grad" else "the backward is collective: q, k or v must require grad (under "
                   "grad mode) on every rank, or on none")
            raise ValueError(f"the ranks disagree on {name}: {shown} on ranks 0..{world - 1}; {why}")


def _lengths(local: list[int], world: int, layout: str, what: str, dim: int = 2) -> list[int]:
    total = sum(local)
    expected = [local_length(total, world, r, layout) for r in range(world)]
    if local != expected:
        raise ValueError(f"{what} shards hold {local} positions on ranks 0..{world - 1}, but layout {layout!r} "
                         f"splits {total} positions as {expected}; shard with hwd.shard(x, dim={dim}, "
                         f"layout={layout!r})")
    return local


def _rows_broadcast(rows: list[int], q_lens: list[int]) -> bool:
    """Whether a dense mask is one (.., 1, Sk) row for every query (True) or each rank's own rows.

    A rank that holds one query reads its one-row mask the same way under both, so the
    rows are each rank's own whenever every rank's row count is its query count.
    """
    if rows == q_lens:
        return False
    if all(n == 1 for n in rows):
        return True
    raise ValueError(f"attention_mask has {rows} rows on ranks 0..{len(rows) - 1} for {q_lens} queries; pass every "
                     "rank the rows of its own queries (.., S_l, Sk), or every rank the same (.., 1, Sk) row")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attention_mask: Tensor | None = None,
    *,
    is_causal: bool = False,
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
    scale: float | None = None,  # None: 1 / sqrt(D)
    dropout_p: float = 0.0,  # only 0: context-parallel attention raises ValueError for dropout
    method: str = "ring",
    layout: str = "zigzag",
    group=None,  # None: the default process group
    **unexpected: Any,  # none: TypeError on every rank (one rank alone raising would hang the others)
) -> Tensor:
    """Exact attention of this rank's queries over the keys of every rank in ``group``.

    Same results, forward and backward, as :func:`headwise.attention` on the whole
    sequences, with the same mask contract (zero rows, never NaN). Causal alignment is
    bottom-right on global positions; window and ALiBi use global positions too.

    Args:
        q: this rank's queries (B, H, S_l, D), sharded with ``layout``.
        k: this rank's keys (B, Hkv, Sk_l, D), sharded with ``layout`` (Sk may differ from S).
        v: this rank's values (B, Hkv, Sk_l, D) (no head dim of its own: ValueError).
        attention_mask: None; a 2-D (B, Sk_l) key padding shard (bool/integer True = token
            or float additive), which travels with its K/V block; or a bool/integer/float
            (B|1, H|1, S_l, Sk) mask (3-D (B, S_l, Sk) too) of the local queries over all
            keys in natural order. Masks get no gradient.
        is_causal: query ``i`` may attend key ``j`` iff ``j <= i + Sk - S`` (global positions).
        window: sliding window over global positions (implies causal).
        alibi_slopes: (H,) ALiBi slopes; distances are global.
        scale: multiplier of ``q k^T`` (None: 1 / sqrt(D)).
        dropout_p: must be 0; there is no context-parallel dropout.
        method: ``"ring"``, ``"ulysses"`` or ``"auto"`` (see :func:`choose_method`).
        layout: ``"zigzag"`` or ``"contiguous"``, as the shards were made.
        group: the process group (None: the default group).

    Returns:
        (B, H, S_l, D): the output for this rank's queries, in q's dtype.

    Raises:
        RuntimeError: torch.distributed is not initialised, or a rank died / timed out.
        ValueError / TypeError: bad input on any rank (raised on every rank: the refusing rank
            raises its own error, the others one naming it and its message), an unknown keyword,
            ``+inf`` in a float mask, ranks that disagree on shapes, flags, ALiBi slopes or shard
            lengths, dropout, or heads ulysses cannot split.
    """
    rank, world = _group_info(group)
    if world == 1:
        _unexpected(unexpected)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        check_layout(layout)
        _same_value_dim(k, v)  # the same contract at every world size
        return cast(Tensor, headwise.attention(q, k, v, attention_mask, is_causal=is_causal, dropout_p=dropout_p,
                                               scale=scale, window=window, alibi_slopes=alibi_slopes))  # no weights
    error, pad, dense, row, S_l, Sk_l, mask_rows = None, None, None, [0] * len(_FIELDS), -1, -1, -1
    try:
        pad, dense, row, S_l, Sk_l, mask_rows = _local_check(q, k, v, attention_mask, is_causal, window,
                                                             alibi_slopes, scale, dropout_p, method, layout,
                                                             unexpected)
    except (TypeError, ValueError) as caught:
        error = caught
    device = _comm_device(group, q)
    rows = _all_gather_rows([*row, S_l, Sk_l, mask_rows], group, world, device)
    _refused([r[0] == 1 for r in rows], error, group, world, device)
    _agree([r[:len(_FIELDS)] for r in rows], world, alibi_slopes)
    q_lens = _lengths([int(r[-3]) for r in rows], world, layout, "q")
    k_lens = _lengths([int(r[-2]) for r in rows], world, layout, "k/v")
    # each rank's rows are its queries' unless every rank passes one row to broadcast
    broadcast = dense is not None and _rows_broadcast([int(r[-1]) for r in rows], q_lens)
    S, Sk = sum(q_lens), sum(k_lens)
    if dense is not None and dense.shape[-1] != Sk:
        raise ValueError(f"attention_mask covers {dense.shape[-1]} keys, but the k shards hold Sk = {Sk}; "
                         "a (.., S_l, Sk) mask spans every key in natural order")
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    scale = D ** -0.5 if scale is None else float(scale)
    if method == "auto":
        choice = choose_method(H, Hkv, world, dense_mask=dense is not None)
        logger.debug("hwd.attention method='auto' -> %s", choice)
        method = choice.method
    if method == "ulysses":
        _ulysses.check_heads(H, Hkv, world)
        return _ulysses_attention(q, k, v, pad, dense, broadcast, q_lens, k_lens, rank, layout, group,
                                  is_causal=is_causal, window=window, alibi_slopes=alibi_slopes, scale=scale)
    plan = _ring.RingPlan(q, k, S=S, Sk=Sk, rank=rank, world=world, layout=layout, dense=dense,
                          is_causal=is_causal, window=window, slopes=alibi_slopes, scale=scale)
    if pad is not None:  # bool stored inverted (True = blocked), ready for masked_fill
        pad = ~pad.contiguous() if pad.dtype == torch.bool else pad.contiguous()
    return _ring.ring_attention(q, k, v, pad, plan, _ring.Ring(group, rank, world))


def _ulysses_attention(q, k, v, pad, dense, broadcast, q_lens, k_lens, rank, layout, group, *, is_causal, window,
                       alibi_slopes, scale):
    world = len(q_lens)
    B, H, _, D = q.shape
    Hkv = k.shape[1]
    h = H // world
    index = _ulysses.kv_head_index(H, Hkv, world, q.device)
    qh = _ulysses.seq_to_heads(q, q_lens, layout, group)  # (B, h, S, D)
    kh = _ulysses.seq_to_heads(k, k_lens, layout, group, index)  # (B, h_kv, Sk, D)
    vh = _ulysses.seq_to_heads(v, k_lens, layout, group, index)
    mask = None
    if pad is not None:
        mask = _gather_seq(pad, -1, k_lens, layout, group)  # (B|1, Sk)
    elif dense is not None:
        # (B|1, H|1, 1, Sk) broadcast, or every rank's rows gathered: (B|1, H|1, S, Sk)
        mask = dense if broadcast else _gather_seq(dense, 2, q_lens, layout, group)
        if mask.shape[1] == H:
            mask = mask[:, rank * h:(rank + 1) * h]  # this rank's heads
    slopes = None if alibi_slopes is None else alibi_slopes[rank * h:(rank + 1) * h]
    out = cast(Tensor, headwise.attention(qh, kh, vh, mask, is_causal=is_causal, scale=scale, window=window,
                                          alibi_slopes=slopes))  # (B, h, S, D); no weights asked
    return _ulysses.heads_to_seq(out, q_lens, rank, layout, group)  # (B, H, S_l, D)

"""Padding-free attention: pack the real tokens, attend per length bucket, scatter back.

A padded batch costs dense attention as much as a full one. Here the valid tokens of a
(B, S) batch are packed into (T, ...) with T = the real token count, so projections and
feed-forward layers run on T rows, and attention runs per *length bucket*: sequences of
similar query and key lengths are gathered into a small padded batch (at most
``policy.BUCKET_SLACK`` of each side padding), or a long one attends on its own, and handed to
:func:`headwise.functional.attend`, so every mask rule, causal, dropout and GQA work as
everywhere else. The buckets themselves are :mod:`headwise.kernels.buckets`, below the
kernels, which the varlen kernel shares.

:func:`packed_attention` is the public entry (flash-attn's ``flash_attn_varlen_func``:
offsets tensors for queries and keys); :func:`attend_packed` takes the lengths as Python
ints (the module knows them) and reads no offsets.

Packed sequences: sequence ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``
of ``q``, its keys and values rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` and
``v``; it attends only to its own keys. Self-attention passes the same offsets twice.
Positions count within each sequence, with :func:`headwise.attention`'s bottom-right
alignment: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys sits at key
position ``i + Lk - Lq``. Sequences may be empty on either side: no queries, no rows; no
keys, zero rows for its queries (and zero gradients), never NaN.

Legend: B sequences, S padded length, T real tokens (Tq queries, Tk keys), H query heads,
Hkv key/value heads, D head dim, E embed dim, n sequences in a bucket, Lq / Lk a bucket's
query / key length.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from headwise import tracing as trace
from headwise.functional import _check_numbers, _check_structure, attend
from headwise.kernels.buckets import attend_buckets, bucket_groups
from headwise.kernels.registry import get_kernel

__all__ = ["Packed", "pack", "unpack", "packed_attention", "attend_packed", "bucket_shapes"]


@dataclass(frozen=True)
class Packed:
    """Where the real tokens of a padded batch went.

    Attributes:
        index: (T,) positions of the real tokens in the flattened (B * S) batch.
        cu_seqlens: (B + 1,) int64 offsets: sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1].
        positions: (T,) each token's position in its padded sequence (for rotary angles).
        lengths: the B lengths as Python ints.
        batch, seq: B and S of the padded batch.
    """

    index: Tensor
    cu_seqlens: Tensor
    positions: Tensor
    lengths: tuple[int, ...]
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def pack(x: Tensor, mask: Tensor) -> tuple[Tensor, Packed]:
    """Keep the rows of ``x`` (B, S, ...) where ``mask`` (B, S) is True / nonzero.

    Returns:
        ``(packed (T, ...), Packed)``; sequence order and token order are kept.

    >>> x = torch.arange(6.).reshape(2, 3, 1)
    >>> packed, info = pack(x, torch.tensor([[1, 1, 0], [1, 0, 0]]))
    >>> packed.flatten().tolist(), info.lengths
    ([0.0, 1.0, 3.0], (2, 1))
    """
    B, S = mask.shape
    keep = mask.reshape(-1) != 0  # (B * S,)
    index = keep.nonzero().squeeze(1)  # (T,)
    lengths = (mask != 0).sum(1)  # (B,)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=mask.device)
    cu[1:] = lengths.cumsum(0)
    info = Packed(index, cu, index % S, tuple(lengths.tolist()), B, S)
    packed = x.reshape(B * S, *x.shape[2:]).index_select(0, index)  # (T, ...)
    return packed, info


def unpack(packed: Tensor, info: Packed) -> Tensor:
    """Scatter packed rows (T, ...) back to (B, S, ...), zeros at the padding.

    >>> x = torch.arange(6.).reshape(2, 3, 1)
    >>> packed, info = pack(x, torch.tensor([[1, 1, 0], [1, 0, 0]]))
    >>> unpack(packed, info).flatten().tolist()
    [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]
    """
    out = packed.new_zeros(info.batch * info.seq, *packed.shape[1:])
    out = out.index_copy(0, info.index, packed)  # differentiable scatter
    return out.reshape(info.batch, info.seq, *packed.shape[1:])


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,  # None: not given (the offsets say it)
    max_seqlen_k: int | None = None,
    *,
    is_causal: bool = False,
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
    dropout_p: float = 0.0,
    scale: float | None = None,  # None: 1 / sqrt(D)
    backend: str = "auto",
    softcap: float | None = None,  # None: no logit soft-capping
    sinks: Tensor | None = None,  # None: no attention sinks
    sink_tokens: int = 0,  # 0: none; n: each sequence's first n keys stay visible under the window
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention within each of B packed sequences, without padding: the CPU/GPU
    counterpart of flash-attn's ``flash_attn_varlen_func``. Each sequence attends only its
    own keys, at positions counted within it; an empty one gives no rows or zero rows (the
    module docstring's "Packed sequences" says exactly how).

    Args:
        q: (Tq, H, D) packed queries, Tq = ``cu_seqlens_q[-1]``.
        k: (Tk, Hkv, D) packed keys, Tk = ``cu_seqlens_k[-1]``; ``H % Hkv == 0`` (Hkv < H:
            grouped-query attention, query head ``h`` reads kv head ``h // (H // Hkv)``).
        v: (Tk, Hkv, Dv) packed values (Dv may differ from D).
        cu_seqlens_q: (B + 1,) integer offsets of the query sequences: 0, then the
            cumulative lengths (``F.pad(lengths.cumsum(0), (1, 0))``).
        cu_seqlens_k: (B + 1,) integer offsets of the key/value sequences.
        max_seqlen_q, max_seqlen_k: optional bounds on the query and key lengths, as
            flash-attn takes them; checked.
        is_causal: query ``i`` may attend key ``j`` of its sequence iff ``j <= i + Lk - Lq``.
        window: sliding window: only keys ``j`` with ``i + Lk - Lq - window < j <=
            i + Lk - Lq`` (implies causal).
        alibi_slopes: (H,) slopes; adds ``-slope_h * |i + Lk - Lq - j|`` to the scores.
        dropout_p: dropout on the attention probabilities (always applied when > 0).
        scale: multiplier of ``q k^T``.
        backend: ``"auto"`` or a name from :func:`headwise.available_backends`; it runs
            each length bucket.
        softcap: logit soft-capping ``softcap * tanh(s / softcap)`` of the scaled scores,
            before ALiBi and the mask (as in :func:`headwise.attention`).
        sinks: (H,) sink logits, one per query head: an extra softmax column that adds
            nothing to the output (as in :func:`headwise.attention`); a sequence without
            keys still outputs zeros.
        sink_tokens: with a window, each sequence's first ``sink_tokens`` keys stay visible
            too (``j < sink_tokens and j <= i + Lk - Lq``): StreamingLLM's attention sinks.
        return_lse: also return each query row's log-sum-exp (Tq, H), in the packed order
            (``-inf`` for a query whose sequence has no key), as :func:`headwise.attention`.

    Returns:
        (Tq, H, Dv) outputs, in the packed order of ``q``; with ``return_lse``,
        ``(out, lse)``.

    Raises:
        TypeError: non-tensor or non-floating q/k/v, dtypes that differ, offsets that are
            not integer tensors, a ``max_seqlen_*`` that is not an int.
        ValueError: ranks, heads, head dims or devices that do not fit; offsets that do not
            start at 0, decrease, end elsewhere than the rows of q / k, or count different
            numbers of sequences; a ``max_seqlen_*`` below the longest sequence; dropout
            outside [0, 1); sink tokens without a window; an unknown backend.

    >>> q = torch.randn(5, 4, 8)  # sequences of 2 and 3 queries
    >>> k = v = torch.randn(7, 2, 8)  # ... of 4 and 3 keys (GQA: 2 kv heads)
    >>> cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 7])
    >>> packed_attention(q, k, v, cu_q, cu_k, is_causal=True).shape
    torch.Size([5, 4, 8])
    """
    if trace.ACTIVE:
        trace.begin_call()
    _check_inputs(q, k, v, dropout_p, backend, window, alibi_slopes, softcap, sinks, sink_tokens, scale)
    lengths_q, lengths_k = _offset_lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return attend_buckets(q, k, v, lengths_q, lengths_k, attend, is_causal=is_causal, window=window,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, scale=scale, backend=backend,
                          softcap=softcap, sinks=sinks, sink_tokens=sink_tokens, return_lse=return_lse)


def attend_packed(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths_q: tuple[int, ...],
    lengths_k: tuple[int, ...],
    *,
    is_causal: bool = False,
    window: int | None = None,  # None: unlimited
    alibi_slopes: Tensor | None = None,  # None: no ALiBi bias
    dropout_p: float = 0.0,
    scale: float | None = None,  # None: 1 / sqrt(D)
    backend: str = "auto",
    softcap: float | None = None,  # None: no logit soft-capping
    sinks: Tensor | None = None,  # None: no attention sinks
    sink_tokens: int = 0,  # 0: none
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`packed_attention` with the sequence lengths as Python ints: reads no offsets
    and opens no new call in an active trace (the module's packed path opens it).

    Args:
        q: (Tq, H, D) packed queries, Tq = ``sum(lengths_q)``.
        k, v: (Tk, Hkv, D) and (Tk, Hkv, Dv) packed keys and values, Tk = ``sum(lengths_k)``.
        lengths_q, lengths_k: the B query and key lengths (self-attention: the same twice).
        is_causal, window, alibi_slopes, dropout_p, scale, backend, softcap, sinks, sink_tokens, return_lse:
            as in :func:`packed_attention`.

    Returns:
        (Tq, H, Dv) outputs; with ``return_lse``, ``(out, lse (Tq, H))``.

    Raises:
        ValueError / TypeError: as :func:`packed_attention`, with lengths whose counts
        differ or whose sums are not the rows of q / k in place of bad offsets.

    >>> q = k = v = torch.randn(5, 2, 4)
    >>> attend_packed(q, k, v, (2, 3), (2, 3), is_causal=True).shape
    torch.Size([5, 2, 4])
    """
    _check_inputs(q, k, v, dropout_p, backend, window, alibi_slopes, softcap, sinks, sink_tokens, scale)
    lengths_q, lengths_k = tuple(lengths_q), tuple(lengths_k)
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"lengths_q has {len(lengths_q)} sequences but lengths_k has {len(lengths_k)}; "
                         "give both sides the same sequences, an empty one as length 0")
    for name, lengths, t in (("lengths_q", lengths_q, "q"), ("lengths_k", lengths_k, "k")):
        rows = (q if t == "q" else k).shape[0]
        if sum(lengths) != rows or any(n < 0 for n in lengths):
            raise ValueError(f"{name} {lengths} must be >= 0 and sum to the {rows} packed rows of {t} "
                             f"(they sum to {sum(lengths)})")
    return attend_buckets(q, k, v, lengths_q, lengths_k, attend, is_causal=is_causal, window=window,
                          alibi_slopes=alibi_slopes, dropout_p=dropout_p, scale=scale, backend=backend,
                          softcap=softcap, sinks=sinks, sink_tokens=sink_tokens, return_lse=return_lse)


# --- validation ---------------------------------------------------------------------------


def _check_inputs(q, k, v, dropout_p, backend, window, alibi_slopes, softcap=None, sinks=None,
                  sink_tokens=0, scale=None) -> None:
    """What attend would check per bucket, checked once up front (and also where no bucket runs)."""
    for name, t, shape in (("q", q, "(Tq, H, D)"), ("k", k, "(Tk, Hkv, D)"), ("v", v, "(Tk, Hkv, Dv)")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"packed {name} must be 3-D {shape}, got shape {tuple(t.shape)}; pack a padded (B, S, H, D) "
                "batch with headwise.packing.pack(x, mask)"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); "
                         "move them to one device")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (Tk, Hkv): k is (Tk, Hkv, D), "
                         "v (Tk, Hkv, Dv); only the head dim may differ")
    H, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    if D == 0:
        raise ValueError(f"head dim D must be >= 1, got q of shape {tuple(q.shape)}; "
                         "give q and k at least one feature per head")
    if k.shape[2] != D:
        raise ValueError(f"q head dim ({D}) differs from k head dim ({k.shape[2]}); "
                         "project q and k to the same head_dim (v may have its own)")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q has {H} heads, which is not a multiple of k/v's {Hkv} heads; "
                         "grouped-query attention needs num_heads % num_kv_heads == 0")
    _check_numbers(dropout_p, scale)
    if backend != "auto":
        get_kernel(backend)  # raises ValueError listing the known names
    # q.shape[1] is H in (T, H, D) as in (B, H, S, D)
    _check_structure(q, window, alibi_slopes, softcap, sinks, sink_tokens)


_REMEDY = "offsets are 0 then the cumulative lengths: F.pad(lengths.cumsum(0), (1, 0))"


def _offset_lengths(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int | None,
                    max_seqlen_k: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The B query and key lengths that :func:`packed_attention`'s offsets give, checked: each
    side's offsets against its packed rows, the two counts of sequences, the ``max_seqlen_*`` bounds."""
    lengths_q = _lengths(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q")
    if cu_seqlens_k is cu_seqlens_q and k.shape[0] == q.shape[0]:
        lengths_k = lengths_q  # self-attention passes one tensor twice: read it once (a device sync)
    else:
        lengths_k = _lengths(cu_seqlens_k, "cu_seqlens_k", k.shape[0], "k")
    if len(lengths_q) != len(lengths_k):
        raise ValueError(
            f"cu_seqlens_q has {len(lengths_q) + 1} offsets ({len(lengths_q)} sequences) but cu_seqlens_k has "
            f"{len(lengths_k) + 1} ({len(lengths_k)} sequences); give both the same B + 1 offsets, an empty "
            "sequence as a repeated offset"
        )
    _check_longest(max_seqlen_q, "max_seqlen_q", lengths_q, "query")
    _check_longest(max_seqlen_k, "max_seqlen_k", lengths_k, "key")
    return lengths_q, lengths_k


def _lengths(cu: Tensor, name: str, rows: int, side: str) -> tuple[int, ...]:
    """The B lengths that offsets ``cu`` (B + 1,) give ``rows`` packed rows, checked."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor of B + 1 offsets, got {type(cu).__name__}; "
                        f"wrap it: torch.tensor({name}, dtype=torch.int32)")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D with B + 1 >= 1 offsets, got shape {tuple(cu.shape)}; "
                         f"{_REMEDY}")
    if cu.dtype == torch.bool or cu.is_floating_point() or cu.is_complex():
        raise TypeError(f"{name} must hold integers, got {cu.dtype}; cast it: {name}.to(torch.int32)")
    offsets = cu.tolist()  # the one read of the offsets (a device sync on an accelerator)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}; {_REMEDY}")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise ValueError(f"{name} must not decrease, but {name}[{b + 1}] = {offsets[b + 1]} < "
                             f"{name}[{b}] = {offsets[b]}; {_REMEDY}")
    if offsets[-1] != rows:
        raise ValueError(f"{name} ends at {offsets[-1]} but {side} has {rows} rows; the last offset must be "
                         f"the number of packed rows ({side}.shape[0])")
    return tuple(b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True))


def _check_longest(hint, name: str, lengths: tuple[int, ...], side: str) -> None:
    """A ``max_seqlen_*`` hint, when given, must bound every sequence (flash-attn trusts it)."""
    if hint is None:
        return
    try:
        if isinstance(hint, bool):
            raise TypeError
        value = operator.index(hint)
    except TypeError:
        raise TypeError(f"{name} must be an int or None, got {type(hint).__name__} ({hint!r})") from None
    longest = max(lengths, default=0)
    if value < longest:
        b = lengths.index(longest)
        raise ValueError(f"{name} ({value}) is less than the longest {side} sequence ({longest}, sequence {b}); "
                         f"pass {name}={longest} or None")


# --- the buckets (the core lives in headwise.kernels.buckets) --------------------------------


def bucket_shapes(lengths_q: tuple[int, ...], lengths_k: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """The attention calls the packed path makes for these lengths, without making them.

    Args:
        lengths_q, lengths_k: the B query and key lengths.

    Returns:
        ``(n, Lq, Lk, keys)`` per call: n sequences padded to Lq queries and Lk keys, of
        which ``keys`` are real; ``keys < n * Lk`` means the call carries an (n, Lk) key
        mask. :meth:`headwise.MultiHeadAttention.dispatch` asks ``"auto"`` about each.

    >>> bucket_shapes((200, 7, 6, 1), (200, 7, 6, 1))
    [(1, 200, 200, 200), (2, 7, 7, 13), (1, 1, 1, 1)]
    """
    shapes = []
    for group in bucket_groups(tuple(lengths_q), tuple(lengths_k)):
        Lq, Lk = max(lengths_q[b] for b in group), max(lengths_k[b] for b in group)
        shapes.append((len(group), Lq, Lk, sum(lengths_k[b] for b in group)))
    return shapes

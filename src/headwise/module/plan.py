"""Which path one call of the module takes, and why: decided before any arithmetic.

:meth:`~headwise.MultiHeadAttention.forward` follows the :class:`Plan`, and
:meth:`~headwise.MultiHeadAttention.dispatch` reports it, so the two cannot disagree.

Legend: B batch, H query heads, Hkv key/value heads, S query length, E embed dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from headwise import calibration, invariance, packing, policy
from headwise import tracing as trace
from headwise.cache import KVCache
from headwise.module import checks, fused, projections
from headwise.module.layer_protocol import Layer


@dataclass(frozen=True)
class Plan:
    """How one call of the module runs, decided before any arithmetic.

    Attributes:
        path: ``"dense"`` (the (B, S) batch, padding included), ``"packed"`` (only the real
            tokens: projections on (T, E), attention per length bucket), ``"fused"`` (a small
            call without gradients: ``nn.MultiheadAttention``'s fused inference op runs the
            projections, attention and output projection in one call),
            ``"context parallel"`` (this rank's shard of the sequence) or ``"paged"`` (a
            :class:`~headwise.PagedKVCache` step: :func:`headwise.paged_attention`).
        why: why this path, in one sentence.
        is_causal: the causal flag in effect (the call's, else the constructor's).
        padding: (B, S) bool, True where x holds a real token, when a 2-D mask describes
            x's tokens; else None.
        lengths: the real tokens of each row of ``padding``, where its values were read
            (on the CPU, outside torch.compile); else None.
        measure: where the estimates cannot tell the dense and the packed path apart
            (``policy.PACK_MEASURE_BAND``) and nothing was measured yet, the shape's key:
            where the shape came before (:func:`recurs`), forward runs both paths in turns,
            keeps the faster for the key (:func:`measured`) and returns its output; on its
            first call ``path``, the estimates' choice, runs. None: ``path`` runs.
    """

    path: str
    why: str
    is_causal: bool
    padding: Tensor | None
    lengths: tuple[int, ...] | None = None
    measure: tuple | None = None


@dataclass(frozen=True)
class Measured:
    """Both paths timed on one call of a shape (microseconds, the least of the turns), and the
    faster one, which later calls of the shape take."""

    path: str
    dense_us: float
    packed_us: float

    def __str__(self) -> str:
        return (f"measured on this machine: packed {self.packed_us:,.0f} us vs dense {self.dense_us:,.0f} us "
                "(a call of this shape ran both)")


_MEASURED: dict[tuple, Measured] = {}
_SIGHTED: set[tuple] = set()  # shapes called once, on the estimates' path: the next call of each measures
MEASURED_LIMIT = 1024  # shapes remembered (measured, or called once); each record starts over when full


def measured(key: tuple) -> Measured | None:
    """What the call measured under ``key`` (:attr:`Plan.measure`) found, or None."""
    return _MEASURED.get(key)


def remember_measured(key: tuple, result: Measured) -> None:
    """Keep what a measured call found for its shape: the shape's later calls take ``result.path``."""
    if len(_MEASURED) >= MEASURED_LIMIT:
        _MEASURED.clear()
    _MEASURED[key] = result
    _SIGHTED.discard(key)


def recurs(key: tuple) -> bool:
    """Whether a call of this shape (:attr:`Plan.measure`) came before; records this one.

    Only a shape that recurs is measured: its second call runs both paths. A loop whose shapes
    never repeat (padding to each batch's longest sequence) would otherwise pay a measurement
    on nearly every call, and keep nothing it could reuse."""
    if key in _SIGHTED:
        return True
    if len(_SIGHTED) >= MEASURED_LIMIT:
        _SIGHTED.clear()
    _SIGHTED.add(key)
    return False


def forget_measured() -> None:
    """Drop every measured choice and every shape called once: each shape is measured anew
    at its second call."""
    _MEASURED.clear()
    _SIGHTED.clear()


def all_tokens(lengths: tuple[int, ...] | None, S: int) -> bool:
    """Whether read real-token counts say every one of the S positions is a token (no padding)."""
    return lengths is not None and all(n == S for n in lengths)


def real_tokens(padding: Tensor) -> tuple[int, ...]:
    """The real tokens of each row of a (B, S) bool padding mask on the CPU, read (the
    memo's signature reads them on every masked call). Counted by numpy over the mask's
    own memory: 4.1 us a call at B=8, S=64 on an Intel Xeon, against 5.9 us for torch's
    int32 sum and its tolist (torch's op dispatch is most of a sum this small)."""
    try:
        counts = padding.numpy().sum(1)  # (B,) int64, no copy of the mask
    except (RuntimeError, TypeError):  # a tensor numpy cannot view (a subclass, no numpy): torch counts
        counts = padding.sum(1, dtype=torch.int32)
    return tuple(counts.tolist())  # (B,)


def query_padding(x: Tensor, mask: Tensor | None, context: Tensor | None, cache: KVCache | None) -> Tensor | None:
    """(B, S) bool marking x's real tokens, when a 2-D mask also describes the queries.

    That is self-attention with a bool/integer (B, S) padding mask, or a cache step whose
    2-D mask covers the new positions (or all of them).
    """
    if (context is not None or not isinstance(mask, Tensor) or mask.dim() != 2
            or mask.is_floating_point() or mask.is_complex() or mask.device != x.device):
        return None  # not a padding mask of x's tokens (normalize_mask reports any error)
    S = x.shape[1]
    if mask.dtype != torch.bool:
        mask = mask != 0  # integer: nonzero = a token
    if cache is None:
        return mask if mask.shape == x.shape[:2] else None
    return mask[:, -S:] if mask.shape[0] == x.shape[0] else None


def make_plan(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
              is_causal: bool | None, need_weights: bool, cache: KVCache | None,
              read: tuple | None = None) -> Plan:
    """Check the call, then choose its path. ``read``: (x's padding, its real tokens per row)
    where the memo's signature has read them from this mask already."""
    checks.check_inputs(mha, x, context, cache)
    checks.check_mask(mha, x, attention_mask, context, cache)
    causal = mha.is_causal if is_causal is None else bool(is_causal)
    if mha.context_parallel is not None:
        if invariance.is_batch_invariant():
            raise ValueError(f"context_parallel={mha.context_parallel} cannot keep headwise.batch_invariant()'s "
                             "promise: its ring merges partial results in an order that follows the ranks; attend "
                             "outside the mode (with headwise.batch_invariant(False): ...) or build the module without "
                             "context_parallel")
        return Plan("context parallel", f"context_parallel={mha.context_parallel}: x is this rank's shard of "
                    "the sequence, attention runs across the ranks", causal, None)
    if read is not None:
        padding, lengths = read
    else:
        padding = query_padding(x, attention_mask, context, cache)  # (B, S) or None
        lengths = None
        if padding is not None and policy.reads_values(padding):  # a free read on the CPU, once per call
            lengths = real_tokens(padding)  # (B,) real tokens per row
    why = fused.why(mha, x, attention_mask is not None and not all_tokens(lengths, x.shape[1]), context, cache,
                    need_weights, causal)
    if why is not None:
        return Plan("fused", why, causal, padding, lengths)
    path, why, measure = choose_packing(mha, x, padding, lengths, cache, need_weights, causal)
    return Plan(path, why, causal, padding, lengths, measure)


def choose_packing(mha: Layer, x: Tensor, padding: Tensor | None, lengths: tuple[int, ...] | None,
                   cache: KVCache | None, need_weights: bool, causal: bool) -> tuple[str, str, tuple | None]:
    """("packed" or "dense", why, the key to measure under or None): by request, or where
    "auto" prices packing below the dense path (:func:`headwise.policy.estimate_packing`), or
    where a call without gradients measured both (:data:`headwise.policy.PACK_MEASURE_BAND`)."""
    if padding is None:
        return "dense", "no 2-D padding mask of x's own tokens (self-attention) to pack by", None
    fixed = _fixed(mha, padding, cache, need_weights)
    if fixed is not None:
        return fixed[0], fixed[1], None
    if lengths is None:
        return "dense", (f"the padding share of a {padding.device.type} mask is not read: it would sync the host "
                         "with the device on every call (packing=True packs anyway)"), None
    training = torch.is_grad_enabled() and (x.requires_grad or mha.trains())
    calibration.current()  # this machine's unit costs: measured at first use, then read from disk
    costs = policy.TRAINING_COSTS if training else policy.INFERENCE_COSTS
    S, E, H, Hkv = padding.shape[1], mha.embed_dim, mha.num_heads, mha.num_kv_heads
    bucketing = (policy.BUCKET_SLACK, policy.DIRECT_MIN_LENGTH)
    path, why = price_packing(lengths, S, E, H, Hkv, causal, training, costs, policy.PACK_MIN_PADDING, bucketing,
                              margin=policy.PACK_MARGIN)
    share, estimate = _priced(lengths, S, E, H, Hkv, causal, training, costs, policy.PACK_MIN_PADDING, bucketing)
    if estimate is None:  # too little padding to price
        return path, why, None
    why = f"{why}; {calibration.describe()}"
    low, high = policy.PACK_MEASURE_BAND
    if not low <= estimate.packed_us / max(estimate.dense_us, 1e-9) < high or not measurable(mha, training):
        return path, why, None
    key = (len(lengths), S, E, H, Hkv, causal, x.dtype, round(share * 20), estimate.buckets,
           torch.get_num_threads(), policy.GENERATION)  # padding in steps of 5%, and the attention calls
    found = measured(key)
    if found is not None:
        return found.path, f"{why}; within PACK_MEASURE_BAND {low:g}-{high:g}: {found}", None
    return path, (f"{why}; within PACK_MEASURE_BAND {low:g}-{high:g} of each other, so the shape's second call runs "
                  "both paths and its later calls take the faster"), key


def measurable(mha: Layer, training: bool) -> bool:
    """Whether a call may run both paths to time them: a forward without gradients on plain
    projections (a hook or wrapper would see the call twice), without dropout (it would draw
    from the caller's RNG), outside headwise.trace() and headwise.batch_invariant(), and not with
    ``HEADWISE_TUNE=off`` (no measurement at all)."""
    return (not training and not (mha.training and mha.dropout) and not trace.ACTIVE
            and not invariance.is_batch_invariant() and calibration.mode() != "off"
            and projections.plain_linears(mha))


def _fixed(mha: Layer, padding: Tensor, cache: KVCache | None, need_weights: bool) -> tuple[str, str] | None:
    """The path a padded self-attention call takes whatever the prices (the call or a setting
    decides it), else None."""
    if cache is not None:
        return "dense", "decoding with a cache keeps the (B, S) layout"
    if need_weights:
        return "dense", "need_weights=True returns (B, H, S, Sk) weights over the padded layout"
    if mha.window is not None or checks.slopes(mha) is not None:
        return "dense", "window / ALiBi count positions, which change for tokens after a hole once packed"
    if padding.device.type == "meta":
        return "dense", ("a meta mask holds no values to pack by: the dense path gives the same shapes "
                         f"(packing={mha.packing!r} applies on a device with data)")
    if mha.packing is True:
        return "packed", "packing=True packs the real tokens"
    if mha.packing is False:
        return "dense", "packing=False"
    if mha.backend != "auto":
        return "dense", f"backend={mha.backend!r} runs on the (B, S) batch (packing=True packs for it)"
    if torch.compiler.is_compiling():
        return "dense", "under torch.compile: packing needs data-dependent shapes (packing=True packs anyway)"
    return None


@functools.lru_cache(maxsize=1024)
def price_packing(lengths: tuple[int, ...], S: int, E: int, H: int, Hkv: int, causal: bool, training: bool,
                  costs: policy.Costs, limit: float, bucketing: tuple[float, int],
                  margin: float = 1.0) -> tuple[str, str]:
    """"auto"'s packing choice for a (B, S) batch of these real lengths: ("packed" or "dense", why).

    A pure function of its arguments (the unit costs, the threshold and the bucketing
    policy ``bucketing`` that ``packing.bucket_shapes`` reads are among them), so a training
    loop over recurring batch shapes pays a look-up, not the bucketing and pricing.
    ``margin``: packs only where the packed price is under this share of the dense one
    (``policy.PACK_MARGIN``; 1.0: wherever it is lower).
    """
    share, estimate = _priced(lengths, S, E, H, Hkv, causal, training, costs, limit, bucketing)
    if estimate is None:
        return "dense", f"{share:.0%} of the batch is padding (< PACK_MIN_PADDING {limit:.0%}): nothing to save"
    kind = "forward + backward" if training else "forward"
    if estimate.packed_us < margin * estimate.dense_us:
        return "packed", f"{share:.0%} of the batch is padding; {kind} {estimate}"
    close = f" (packing pays under PACK_MARGIN {margin:.0%} of dense)" if estimate.packs else ""
    return "dense", f"{share:.0%} of the batch is padding, but {kind} {estimate}{close}"


@functools.lru_cache(maxsize=1024)
def _priced(lengths: tuple[int, ...], S: int, E: int, H: int, Hkv: int, causal: bool, training: bool,
            costs: policy.Costs, limit: float,
            bucketing: tuple[float, int]) -> tuple[float, policy.PackingEstimate | None]:
    """(the batch's padding share, :func:`headwise.policy.estimate_packing`'s prices or None
    below ``limit``): :func:`price_packing`'s arguments but the margin, cached as it is."""
    B = len(lengths)
    share = (B * S - sum(lengths)) / max(B * S, 1)  # padded / all: 2 of 20 is exactly 0.1 (1 - 18 / 20 is not)
    if share < limit:
        return share, None
    buckets = packing.bucket_shapes(lengths, lengths)
    return share, policy.estimate_packing(B, S, E, H, Hkv, buckets, is_causal=causal, training=training, costs=costs)

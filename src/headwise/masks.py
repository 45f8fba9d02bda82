"""The one mask contract, in code.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.

Rules (the README repeats them):

* bool or integer mask: True / nonzero = may attend, False / 0 = masked.
* floating mask: an additive bias added to the scaled scores; ``-inf`` blocks.
* 2-D ``(B, Sk)`` is a key padding mask; 3-D is ``(B, S, Sk)``; 4-D broadcasts to
  ``(B, H, S, Sk)``. Every dimension may also be 1 (broadcast).
* causal: query ``i`` may attend key ``j`` iff ``j <= i + (Sk - S)`` (bottom-right
  alignment, so decoding with a cache works). Causal and a mask combine with AND.
* sliding window ``W``: additionally ``j > i + (Sk - S) - W``; a window implies causal.
* sink tokens ``n`` (StreamingLLM, with a window only): the first ``n`` keys stay visible
  under the window: query ``i`` attends key ``j`` iff ``i + Sk - S - W < j <= i + Sk - S``
  or ``j < n and j <= i + Sk - S``.
* a query row that may attend nothing outputs zeros and gets zero gradients.
* rules as functions (FlexAttention's): ``mask_mod(b, h, q_idx, kv_idx)`` ANDs with all of
  the above; ``score_mod`` acts on the scaled score. Their helpers (``causal``,
  ``sliding_window``, ``document``, ``prefix_lm``, ``and_masks``, ``or_masks``,
  ``relative_position_bias``) and :func:`tile_map` live in :mod:`headwise.mask_mods` and
  :mod:`headwise.rules` and are importable from here.

Every kernel receives the mask already normalised by :func:`normalize_mask`: ``None``
or a 4-D tensor of shape ``(B|1, H|1, S|1, Sk)`` that is either bool (True = attend)
or floating in the query dtype (additive).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from headwise import policy
from headwise.mask_mods import (
    AlignedCausal,
    and_masks,
    causal,
    document,
    or_masks,
    prefix_lm,
    relative_position_bias,
    sliding_window,
)
from headwise.rules import TileMap, is_block_mask, tile_map

__all__ = [
    "normalize_mask",
    "causal_mask",
    "alibi_slopes",
    "alibi_bias",
    "combined_mask",
    "masked_scores",
    "safe_softmax",
    "row_is_dead",
    "hide_excluded",
    "check_mask_values",
    "from_torch_masks",
    "key_padding_mask",
    "and_masks",
    "or_masks",
    "causal",
    "sliding_window",
    "document",
    "prefix_lm",
    "relative_position_bias",
    "tile_map",
    "TileMap",
]

_LAYOUTS = {
    2: "(B, Sk) key padding mask",
    3: "(B, S, Sk)",
    4: "(B, H, S, Sk)",
}


def normalize_mask(
    attention_mask: Tensor | None,
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor | None:
    """Validate a user mask and bring it to the canonical 4-D form kernels expect.

    Args:
        attention_mask: ``None``, or a bool / integer / floating tensor of shape
            ``(B, Sk)``, ``(B, S, Sk)`` or ``(B, H, S, Sk)`` (any dimension may be 1).
        batch, heads, q_len, k_len: the expected B, H, S and Sk.
        device: the device of the queries; the mask must already be there.
        dtype: the query dtype; floating masks are cast to it.

    Returns:
        ``None`` or a tensor of shape ``(B|1, H|1, S|1, Sk)``: bool (True = attend) for
        bool and integer masks, ``dtype`` for floating masks. No data is copied for
        bool masks; integer masks become bool.

    Raises:
        TypeError: the mask is not a tensor (a FlexAttention ``BlockMask`` included: only
            :func:`headwise.attention` takes one), or has a complex dtype.
        ValueError: the mask has the wrong number of dimensions, a wrong size, or lives
            on another device.

    >>> normalize_mask(torch.tensor([[1, 0]]), batch=1, heads=8, q_len=2, k_len=2,
    ...                device=torch.device("cpu"), dtype=torch.float32).shape
    torch.Size([1, 1, 1, 2])
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        if is_block_mask(attention_mask):
            raise TypeError(
                "attention_mask is a FlexAttention BlockMask, which headwise.attention takes but this call does "
                "not; pass its rule as mask_mod=headwise.rules.from_block_mask(block_mask, S, Sk)"
            )
        raise TypeError(
            f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}; "
            "wrap it with torch.as_tensor(...)"
        )
    m = attention_mask
    _refuse_complex(m)
    if m.device != device:
        raise ValueError(
            f"attention_mask is on {m.device} but the queries are on {device}; "
            f"move it with attention_mask.to({str(device)!r})"
        )
    expected = {
        2: (batch, k_len),
        3: (batch, q_len, k_len),
        4: (batch, heads, q_len, k_len),
    }
    if m.dim() not in expected:
        raise ValueError(
            f"attention_mask must be 2-D {_LAYOUTS[2]} {expected[2]}, 3-D {_LAYOUTS[3]} "
            f"{expected[3]} or 4-D {_LAYOUTS[4]} {expected[4]}; got {m.dim()}-D with shape "
            f"{tuple(m.shape)}"
        )
    want = expected[m.dim()]
    if any(got not in (exp, 1) for got, exp in zip(m.shape, want, strict=True)):
        raise ValueError(
            f"attention_mask of shape {tuple(m.shape)} does not fit {m.dim()}-D layout "
            f"{_LAYOUTS[m.dim()]} = {want} (each dimension must match or be 1)"
        )
    return _canonical(m, dtype)


def _refuse_complex(mask: Tensor) -> None:
    """Raise TypeError for a complex mask: a mask is bool/integer (True = attend) or a real bias."""
    if mask.is_complex():
        raise TypeError(
            f"attention_mask has dtype {mask.dtype}; use bool/integer (True = attend) or a "
            "real floating additive bias"
        )


def _canonical(mask: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An accepted mask in the 4-D form kernels expect, without checking it:
    :func:`normalize_mask`'s last step, also taken alone for a repeated call's mask (of the
    shape, dtype and device the checks passed).

    Args:
        mask: 2-D (B, Sk), 3-D (B, S, Sk) or 4-D bool / integer / floating mask.
        dtype: the dtype floating masks are cast to (None: they keep theirs).

    Returns:
        ``(B|1, H|1, S|1, Sk)`` views: bool as is, integer as ``!= 0``, floating in ``dtype``.
    """
    if mask.dim() == 2:
        B, Sk = mask.shape
        mask = mask.view(B, 1, 1, Sk)  # (B, Sk) -> (B, 1, 1, Sk); half the time of [:, None, None, :]
    elif mask.dim() == 3:
        mask = mask.unsqueeze(1)  # (B, S, Sk) -> (B, 1, S, Sk)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask if dtype is None else mask.to(dtype)
    return mask != 0  # integer: nonzero = may attend


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None,
                window: int | None = None, sink_tokens: int = 0) -> Tensor:
    """Bottom-right aligned causal mask: query ``i`` may attend key ``j`` iff ``j <= i + Sk - S``.

    Args:
        q_len: S, the number of queries.
        k_len: Sk, the number of keys.
        device: where to build it.
        window: also require ``j > i + Sk - S - window`` (a sliding window of ``window``
            keys ending at the query's own position); None: unlimited.
        sink_tokens: with a window, keys ``j < sink_tokens`` stay visible too (still only
            where ``j <= i + Sk - S``): StreamingLLM's attention sinks.

    Returns:
        Bool tensor ``(S, Sk)``, True = may attend.

    >>> causal_mask(2, 3).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    >>> causal_mask(3, 3, window=2).int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    >>> causal_mask(4, 4, window=2, sink_tokens=1).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]]
    """
    rule = AlignedCausal(k_len - q_len, window, sink_tokens)  # the rule every kernel reads (headwise.rules)
    return rule(None, None, torch.arange(q_len, device=device)[:, None], torch.arange(k_len, device=device)[None, :])


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's head slopes: a geometric sequence starting at ``2 ** (-8 / H)``.

    For a head count that is not a power of two, the paper's recipe interleaves the
    slopes of the next power of two.

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: Tensor, q_len: int, k_len: int) -> Tensor:
    """ALiBi's additive bias ``-slope_h * |i + Sk - S - j|`` as a float ``(1, H, S, Sk)``.

    Positions are aligned bottom-right like the causal rule, so the last query sits at
    the last key and a cache keeps distances right.
    """
    i = torch.arange(q_len, device=slopes.device)[:, None] + (k_len - q_len)  # (S, 1)
    j = torch.arange(k_len, device=slopes.device)[None, :]  # (1, Sk)
    distance = (i - j).abs().to(slopes.dtype)  # (S, Sk)
    return -slopes[None, :, None, None] * distance  # (1, H, S, Sk)


def combined_mask(mask: Tensor | None, is_causal: bool, q_len: int, k_len: int,
                  device: torch.device, window: int | None = None, sink_tokens: int = 0) -> Tensor | None:
    """AND a normalised mask with the causal (and window) rule, as one ``(B|1, H|1, S|1, Sk)``.

    A bool mask stays bool; a floating mask gets ``-inf`` where causality blocks. A
    ``window`` implies the causal upper bound; ``sink_tokens`` keeps the window's first
    keys visible (see :func:`causal_mask`).
    """
    if not is_causal and window is None:
        return mask
    c = causal_mask(q_len, k_len, device, window, sink_tokens)[None, None]  # (1, 1, S, Sk)
    if mask is None:
        return c
    if mask.dtype == torch.bool:
        return mask & c
    return mask.masked_fill(~c, float("-inf"))


def masked_scores(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Apply a combined mask to scores ``(..., S, Sk)``: bool blocks with ``-inf``, float adds."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def safe_softmax(scores: Tensor, dim: int = -1) -> Tensor:
    """Softmax that returns zeros, with zero gradients, for rows that are all ``-inf``.

    ``torch.softmax`` returns NaN there (0 / 0), and its backward spreads the NaN. Dead
    rows are set to 0 before the softmax (any finite row would do) and their output is
    zeroed after it, so nothing flows back into them. The softmax itself is torch's fused
    one, which accumulates fp16/bf16 rows in fp32, as plain PyTorch does.

    >>> safe_softmax(torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]]))
    tensor([[1., 0.],
            [0., 0.]])
    """
    dead = torch.isneginf(scores.detach().amax(dim=dim, keepdim=True))  # (..., 1) rows with nothing to attend
    return torch.softmax(scores.masked_fill(dead, 0.0), dim=dim).masked_fill(dead, 0.0)


def row_is_dead(mask: Tensor) -> Tensor:
    """For a combined mask ``(..., S, Sk)``, True where a query row may attend no key.

    Returns a bool tensor ``(..., S, 1)``.
    """
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1, keepdim=True)
    return torch.isneginf(mask).all(dim=-1, keepdim=True)


def hide_excluded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool,
                  window: int | None = None, sink_tokens: int = 0,
                  mask_mod: Any = None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with zeros where the mask (and the causal / window rule) excludes them for
    every query: the NaN and inf contract's first rule.

    A key and value that no query may attend, and a query row that may attend nothing,
    must not reach any output or gradient even when they hold NaN or inf. A product with
    zero keeps NaN (``0 * nan = nan``), so they are replaced with ``torch.where``, whose
    backward gives them zero gradients. Where the mask's values can be read
    (:func:`headwise.policy.reads_values`) and it excludes nothing, q, k, v come back as
    they are: no copy on the common paths. A key hidden from only some queries is a live
    input and is kept.

    Args:
        q: queries (B, H, S, D).
        k: keys (B, Hkv, Sk, D).
        v: values (B, Hkv, Sk, Dv).
        mask: normalised mask (B|1, H|1, S|1, Sk), bool (True = attend) or additive float, or None.
        is_causal: the bottom-right causal rule applies.
        window: causal sliding window (None: unlimited).
        sink_tokens: keys kept visible under the window.
        mask_mod: the call's mask rules as one mask_mod (the causal / window rule included),
            or None. It is evaluated on the whole grid only when q, k or v holds NaN or inf
            (one sum each says so where values can be read): finite inputs need no hiding.

    Returns:
        ``(q, k, v)``, zeroed at dead query rows and at keys and values no query may attend.

    >>> q = k = v = torch.ones(1, 1, 2, 1)
    >>> _, k2, _ = hide_excluded(q, k * float("nan"), v, torch.tensor([[[[True, False]]]]), is_causal=False)
    >>> k2.flatten().tolist()[1]
    0.0
    """
    S, Sk = q.shape[-2], k.shape[-2]
    if mask_mod is not None:
        if all(policy.reads_values(t) and math.isfinite(t.detach().sum()) for t in (q, k, v)):
            return q, k, v  # nothing to hide: every value is finite
        from headwise.rules import evaluate_mask  # rules build on the mask helpers

        rule = evaluate_mask(mask_mod, q.shape[0], q.shape[1], (0, S), (0, Sk), q.device)  # (B|1, H|1, S, Sk)
        mask = rule if mask is None else (mask & rule if mask.dtype == torch.bool
                                          else mask.masked_fill(~rule, float("-inf")))
        is_causal, window, sink_tokens = False, None, 0  # the rule holds them
    if mask is None and window is None and (not is_causal or S <= Sk):
        return q, k, v  # causal with S <= Sk: every query sees key 0, and the last query sees every key
    allowed = combined_mask(mask, is_causal, S, Sk, q.device, window, sink_tokens)  # (B|1, H|1, S|1, Sk)
    if allowed is None:  # pragma: no cover - combined_mask returns None only without mask and rule
        return q, k, v
    if allowed.dtype != torch.bool:
        allowed = ~torch.isneginf(allowed)  # (B|1, H|1, S|1, Sk) True = may attend
    read = policy.reads_values(allowed)
    if read and bool(allowed.all()):
        return q, k, v
    b, h, s, _ = allowed.shape
    Hkv = k.shape[1]
    rows = allowed.any(-1, keepdim=True)  # (B|1, H|1, S|1, 1) True = may attend a key
    if h == 1:
        keys = allowed.any(-2, keepdim=True) if s > 1 else allowed  # (B|1, 1, 1, Sk)
    else:  # per head: a kv head's key is live when one of its G query heads may attend it
        keys = allowed.reshape(b, Hkv, h // Hkv, s, Sk).any(3).any(2)[:, :, None]  # (B|1, Hkv, 1, Sk)
    keys = keys.transpose(-1, -2)  # (B|1, Hkv|1, 1, Sk) -> (B|1, Hkv|1, Sk, 1)
    if not (read and bool(rows.all())):
        q = torch.where(rows, q, 0.0)  # (B, H, S, D)
    if not (read and bool(keys.all())):
        k = torch.where(keys, k, 0.0)  # (B, Hkv, Sk, D)
        v = torch.where(keys, v, 0.0)  # (B, Hkv, Sk, Dv)
    return q, k, v


_WARNED_BINARY = False  # the 0/1 float mask warning, once per process


def check_mask_values(mask: Tensor) -> None:
    """Check a floating mask's values where they can be read (a CPU tensor, outside
    torch.compile); elsewhere the caller's promise stands, as documented.

    ``+inf`` would make a row's softmax inf / inf = NaN: refused. A mask of only 0s and
    1s is almost always a keep/pad mask given the wrong dtype; it is still read as an
    additive bias (the contract), with one warning per process.

    Raises:
        ValueError: the mask holds ``+inf``.
    """
    global _WARNED_BINARY
    if not mask.is_floating_point() or not policy.reads_values(mask) or mask.numel() == 0:
        return
    low, high = torch.aminmax(mask)  # one pass; a NaN anywhere makes both NaN, then +inf is looked for
    positive = torch.isposinf(mask) if not bool(high < math.inf) else None
    if positive is not None and bool(positive.any()):
        first = tuple(positive.nonzero()[0].tolist())
        raise ValueError(
            f"attention_mask holds +inf at {int(positive.sum())} position(s), the first at {first}; use -inf "
            "to exclude a key, or a finite bias (a float mask is added to the scores, and +inf makes the "
            "softmax NaN)"
        )
    if (not _WARNED_BINARY and bool(low >= 0) and bool(high == 1)  # the exact check only where it may hold
            and bool(((mask == 0) | (mask == 1)).all())):
        _WARNED_BINARY = True
        warnings.warn(
            "attention_mask is floating and holds only 0s and 1s, so it is read as an additive bias (1 adds 1 "
            "to a score, 0 excludes nothing); for a keep/pad mask pass it as bool or int: "
            "attention_mask.bool(); for a bias, ignore this (it is said once)",
            UserWarning, stacklevel=4,
        )


def key_padding_mask(lengths: Tensor | list[int], max_len: int | None = None) -> Tensor:
    """Build a ``(B, Sk)`` bool key padding mask (True = real token) from lengths.

    >>> key_padding_mask([2, 1]).tolist()
    [[True, True], [True, False]]
    """
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    max_len = longest if max_len is None else max_len
    if max_len < longest:
        raise ValueError(f"max_len ({max_len}) is shorter than the longest length ({longest})")
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, Sk)


def from_torch_masks(
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> Tensor | None:
    """Translate ``torch.nn.MultiheadAttention`` masks into headwise's contract.

    Torch's bool masks mean True = *ignore*; ours mean True = *attend*, so bool masks are
    inverted. Floating masks are additive in both and pass through.

    Args:
        key_padding_mask: torch's ``(B, Sk)`` mask (bool True = padding, or float).
        attn_mask: torch's ``(S, Sk)`` or ``(B * num_heads, S, Sk)`` mask.
        num_heads: required when ``attn_mask`` is 3-D, to split ``B * num_heads``.

    Returns:
        ``None``, a ``(B, Sk)`` mask, a ``(1, 1, S, Sk)`` mask or a ``(B, H, S, Sk)`` mask
        in headwise's contract (bool True = attend, or float additive).

    >>> from_torch_masks(torch.tensor([[False, True]])).tolist()
    [[True, False]]
    """

    def ours(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return ~m
        if m.is_floating_point():
            return m
        raise TypeError(
            f"torch.nn.MultiheadAttention masks are bool or float, got {m.dtype}; "
            "convert with .bool() (True = ignore)"
        )

    kpm = None if key_padding_mask is None else ours(key_padding_mask)
    am = None
    if attn_mask is not None:
        am = ours(attn_mask)
        if am.dim() == 2:
            am = am[None, None]  # (S, Sk) -> (1, 1, S, Sk)
        elif am.dim() == 3:
            if num_heads is None:
                raise ValueError(
                    f"a 3-D attn_mask {tuple(am.shape)} is (B * num_heads, S, Sk); "
                    "pass num_heads= to split it"
                )
            if am.shape[0] % num_heads:
                raise ValueError(
                    f"attn_mask's first dimension ({am.shape[0]}) is not a multiple of "
                    f"num_heads ({num_heads})"
                )
            am = am.reshape(-1, num_heads, *am.shape[1:])  # (B*H, S, Sk) -> (B, H, S, Sk)
        else:
            raise ValueError(
                f"attn_mask must be (S, Sk) or (B * num_heads, S, Sk), got shape "
                f"{tuple(attn_mask.shape)}"
            )
    if am is None:
        return kpm
    if kpm is None:
        return am
    k4 = kpm[:, None, None, :]  # (B, Sk) -> (B, 1, 1, Sk)
    if am.dtype == torch.bool and k4.dtype == torch.bool:
        return am & k4
    dtype = am.dtype if am.is_floating_point() else k4.dtype
    return _as_bias(am, dtype) + _as_bias(k4, dtype)


def _as_bias(m: Tensor, dtype: torch.dtype) -> Tensor:
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
    return m.to(dtype)

"""The mask contract on a call's inputs: which values a float mask may hold, and that what no
query may attend never reaches a result (README "The mask contract" and "NaN and inf").

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, Dv value head dim.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from headwise import policy
from headwise.evaluate import evaluate_mask
from headwise.masks import combined_mask

__all__ = ["hide_excluded", "check_mask_values"]

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

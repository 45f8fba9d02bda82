"""The module's memo: what a repeated call signature of ``forward`` may reuse.

A training or serving loop calls the module with the same shapes again and again; the
checks, the plan and "auto"'s kernel choice then give the same answers. The memo keeps them
per call signature, so a repeated call runs the projections, the remembered kernel call and
the output projection, with nothing between them.

It never outlives what it read:

- the key holds everything the checks, the plan and the choice read from the call (x's
  shape, dtype and device, the mask's shape, dtype, device and real tokens per row, the
  causal flag, the grad state, the training flag, ``policy.GENERATION``);
- assigning or deleting any attribute of the module (a setting, a parameter, a replaced
  projection) clears it, and so does pickling or copying;
- an entry is stored only once its call ran: a refused call leaves the memo as it was;
- the projections are called as modules every time, so hooks and wrappers added later run;
  the fused path checks that nothing hooks or wraps them on every call.

Legend: B batch, S query length, E embed dim.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass

import torch
from torch import Tensor

from headwise import functional, invariance, policy
from headwise import tracing as trace
from headwise.cache import KVCache
from headwise.functional import Prepared
from headwise.kernels.registry import find_kernel
from headwise.module import checks, plan
from headwise.module.layer_protocol import Layer

LIMIT = 64  # call signatures a module remembers; it starts over when full


@dataclass(frozen=True)
class Repeat:
    """What a repeated call signature reuses: its plan but the tensors, and on the dense path
    the attention call that :func:`headwise.functional.prepare` checked and dispatched (None:
    ``attend`` runs in full)."""

    path: str
    why: str
    is_causal: bool
    attention: Prepared | None
    padded: bool  # the mask has padding (False: every position is a token, the mask is dropped)

    def current(self) -> bool:
        """Whether the remembered attention call's kernel is still the registered one."""
        attention = self.attention  # attention.current(), inlined: read on every remembered call
        return attention is None or find_kernel(attention.kernel.name) is attention.kernel


def signature(mha: Layer, x: Tensor, attention_mask: Tensor | None, context: Tensor | None,
              is_causal: bool | None, need_weights: bool,
              cache: KVCache | None) -> tuple[tuple, Tensor | None, tuple | None] | None:
    """The key a self-attention call is remembered under, with x's padding (B, S) and its real
    tokens per row; None where every call plans afresh.

    Not remembered: cross-attention, weights, context parallelism, 3-D / 4-D / float masks,
    masks whose values are not read (on an accelerator), a cache step with a mask, a trace,
    torch.compile, autocast, and "auto" logging its choices. A cache step without a mask is
    (a decoding loop): its key holds what the checks read of the cache (its batch, heads,
    head dims, dtype and device); the step's own checks (room, batch) run on every call.
    """
    if (context is not None or need_weights or mha.context_parallel is not None
            or trace.ACTIVE or torch.compiler.is_compiling() or functional.logs_choices()):
        return None
    if cache is not None and (attention_mask is not None or type(cache) is not KVCache):
        return None
    try:
        device = x.device
        if checks.autocast_on(device):  # q's dtype is autocast's, not x's
            return None
        padding, lengths, masked = None, None, None
        if attention_mask is not None:
            padding = plan.query_padding(x, attention_mask, None, None)  # (B, S) or None, on x's device
            if padding is None or not policy.reads_values(padding):  # on the CPU only (the one switch)
                return None
            lengths = plan.real_tokens(padding)  # (B,) real tokens per row
            masked = (attention_mask.shape, attention_mask.dtype, device, lengths)
        causal = mha.is_causal if is_causal is None else bool(is_causal)
        # 0: no grad mode (the fused path may run); 1: grad mode, none flows; 2: gradients flow
        grads = 0 if not torch.is_grad_enabled() else 1 + (x.requires_grad or mha.trains())
        # what the checks read of a cache, and whether it is empty (then S == Sk: "auto" may choose otherwise)
        fits = None if cache is None else (cache.k.shape, cache.v.shape[-1], cache.k.dtype, cache.k.device,
                                           cache._length == 0)
        # the batch-invariant mode changes the path (no fused op) and the kernels
        key = (x.shape, x.dtype, device, masked, causal, grads, mha.training, policy.GENERATION,
               invariance.is_batch_invariant(), fits)
        return key, padding, lengths
    except (AttributeError, TypeError):  # not tensors: the plan's checks name the error
        return None


def preparable(mha: Layer) -> bool:
    """Whether :func:`headwise.functional.prepare` can remember this module's attention call
    (it takes no window, ALiBi, soft-capping or sinks)."""
    return mha.window is None and checks.slopes(mha) is None and mha.softcap is None and checks.sinks(mha) is None


class Memo:
    """Repeat per call signature, at most :data:`LIMIT` (it starts over when full).

    A mapping, but not a ``dict``: torch.compile guards on the keys of a ``dict`` that a traced
    call touches (the traced ``remember`` of a call it does not remember), so each new eager
    signature would recompile an unchanged compiled call. An object's own dict is not guarded
    unless it is read, and a compiled call reads none of it.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, Repeat] = {}

    def remember(self, key: tuple | None, repeat: Repeat) -> None:
        if key is None:
            return
        if len(self._entries) >= LIMIT:
            self._entries.clear()
        self._entries[key] = repeat

    def get(self, key: tuple) -> Repeat | None:
        return self._entries.get(key)

    def clear(self) -> None:
        self._entries.clear()

    def keys(self) -> KeysView[tuple]:
        return self._entries.keys()

    def values(self) -> ValuesView[Repeat]:
        return self._entries.values()

    def items(self) -> ItemsView[tuple, Repeat]:
        return self._entries.items()

    def __getitem__(self, key: tuple) -> Repeat:
        return self._entries[key]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        entries = other._entries if isinstance(other, Memo) else other
        return isinstance(entries, Mapping) and self._entries == dict(entries)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dict

    def __repr__(self) -> str:
        return f"Memo({self._entries!r})"

    def __reduce__(self):  # pickled and copied empty: the remembered kernels are this process's
        return (Memo, ())

    def __deepcopy__(self, memo: dict) -> Memo:
        return Memo()

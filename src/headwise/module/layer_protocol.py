"""What the paths read of the layer: :class:`Layer`, a Protocol that
:class:`~headwise.MultiHeadAttention` satisfies by its shape.

``layer.py`` imports every path file (``dense``, ``packed``, ``cached``, ...) and hands each
one the module; the paths annotate it with :class:`Layer`, which sits below them all, so
no path imports the layer back, not even for a type (STYLE.md, "Imports that run one
way"). It names only what the paths and :class:`~headwise.PagedKVCache` read: the sizes,
the settings, the parts (``q_proj``, ..., ``rope``, ``sinks``), the two questions
(:meth:`Layer.reference_weight`, :meth:`Layer.trains`) and the ``nn.Module`` dicts the
fast paths read directly (as ``nn.Module`` lays them out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor, nn

from headwise.evaluate import MaskMod, ScoreMod
from headwise.positions import RotaryEmbedding


class Remembers(Protocol):
    """The layer's memo as the paths use it (:class:`headwise.module.memo.Memo`)."""

    def remember(self, key: tuple | None, repeat: Any) -> None: ...

    def get(self, key: tuple) -> Any: ...


class Planned(Protocol):
    """What a caller of :meth:`Layer.plan` reads of the plan (:class:`headwise.module.plan.Plan`)."""

    @property
    def is_causal(self) -> bool: ...


class Layer(Protocol):
    """:class:`~headwise.MultiHeadAttention` as its paths see it (see the module docstring)."""

    # sizes (E, H, Hkv, D, Dv)
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    # settings, as the constructor stored them
    is_causal: bool
    dropout: float
    window: int | None
    sink_tokens: int
    softcap: float | None
    backend: str
    packing: bool | str
    qk_norm: str | None
    mask_mod: MaskMod | None
    score_mod: ScoreMod | None
    context_parallel: Any  # None or a headwise.distributed.ContextParallel
    training: bool
    # parts
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Linear
    q_norm: nn.RMSNorm | None
    k_norm: nn.RMSNorm | None
    rope: RotaryEmbedding | None
    alibi_slopes: Tensor | None
    sinks: nn.Parameter | None

    @property
    def _repeats(self) -> Remembers: ...

    # nn.Module's own dicts, read where __getattr__ would cost too much or hide a wrapper
    @property
    def _modules(self) -> dict[str, nn.Module | None]: ...

    @property
    def _parameters(self) -> dict[str, nn.Parameter | None]: ...

    @property
    def _buffers(self) -> dict[str, Tensor | None]: ...

    @property
    def _forward_hooks(self) -> dict[int, Callable]: ...

    @property
    def _forward_pre_hooks(self) -> dict[int, Callable]: ...

    def reference_weight(self) -> Tensor: ...

    def trains(self) -> bool: ...

    def plan(self, x: Tensor, attention_mask: Tensor | None = None, *, context: Tensor | None = None,
             is_causal: bool | None = None, mask_mod: MaskMod | None = None,
             score_mod: ScoreMod | None = None) -> Planned: ...

    def train(self, mode: bool = True) -> Any: ...

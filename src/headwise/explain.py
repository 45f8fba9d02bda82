"""Explain one attention configuration: run it under a trace and keep what teaching needs.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim, E embed dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from headwise.evaluate import MaskMod, evaluate_mask
from headwise.masks import (
    TileMap,
    and_masks,
    causal,
    causal_mask,
    document,
    key_padding_mask,
    prefix_lm,
    sliding_window,
    tile_map,
)
from headwise.module import MultiHeadAttention
from headwise.tracing import Trace, trace

__all__ = ["MEMORY_LIMIT_GIB", "ExplainConfig", "Explained", "command", "explain", "markdown_page",
           "memory_estimate_gib"]


# explain keeps whole (B, H, S, S) tensors (the traced scores and probabilities, and the
# weights of its second pass): a limit on their estimated size turns --seq 10000000 (80 GB)
# into a one-line error instead of an allocation that fails, or swaps, after minutes.
MEMORY_LIMIT_GIB = 2.0
_SCORE_COPIES = 4  # (B, H, S, S) float32 tensors alive at the peak: 3.5 measured (S = 1500), rounded up
_TOKEN_COPIES = 16  # (B, S, E) float32 tensors: x, q, k, v, their head views, outputs


def memory_estimate_gib(batch: int, seq: int, dim: int, heads: int) -> float:
    """The peak memory an explain run of this size needs, roughly, in GiB.

    >>> round(memory_estimate_gib(4, 3000, 512, 8), 1)
    4.7
    """
    return (_SCORE_COPIES * batch * heads * seq * seq + _TOKEN_COPIES * batch * seq * dim) * 4 / 2**30


def _longest_seq(batch: int, dim: int, heads: int, limit_gib: float) -> int:
    """The largest S whose :func:`memory_estimate_gib` is within ``limit_gib``."""
    a, b = _SCORE_COPIES * batch * heads * 4, _TOKEN_COPIES * batch * dim * 4  # bytes per S^2, per S
    seq = int((-b + math.sqrt(b * b + 4 * a * limit_gib * 2**30)) / (2 * a))
    return seq if memory_estimate_gib(batch, seq, dim, heads) <= limit_gib else seq - 1


@dataclass(frozen=True)
class ExplainConfig:
    """One configuration to explain; the defaults are the second document's example.

    Attributes:
        batch, seq, dim, heads: B, S, E, H.
        lengths: real lengths per batch row (a key padding mask), or None for no mask.
        causal: causal masking.
        kv_heads: Hkv for grouped-query attention (None: H).
        backend: the kernel to trace ("matmul" shows every stage; fused ones show one).
        seed: random seed for weights and inputs.
        softcap: logit soft-capping (None: none).
        sinks: attention sinks, with random sink logits (standard normal, from ``seed``).
    """

    batch: int = 4
    seq: int = 10
    dim: int = 512
    heads: int = 8
    lengths: tuple[int, ...] | None = None
    causal: bool = False
    kv_heads: int | None = None
    backend: str = "matmul"
    seed: int = 0
    softcap: float | None = None  # None: no soft-capping
    sinks: bool = False
    rule: str | None = None  # None: no mask_mod; "document:4,6", "prefix:3" or "window:4"
    tile: int = 4  # the tile map's (tile, tile) tiles, with a rule

    def validate(self) -> None:
        """Raise ValueError with the values and the remedy for a configuration that cannot run."""
        for name in ("batch", "seq", "dim", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.lengths is not None:
            if len(self.lengths) != self.batch:
                raise ValueError(
                    f"--mask lengths gives {len(self.lengths)} lengths for --batch {self.batch}; "
                    "give one length per batch row"
                )
            bad = [n for n in self.lengths if not 0 <= n <= self.seq]
            if bad:
                raise ValueError(f"mask lengths {bad} are outside [0, --seq {self.seq}]")
        if self.rule is not None:
            self.mask_mod()  # raises on a rule that cannot be read
        if self.tile < 1:
            raise ValueError(f"--tile must be >= 1 (rows and keys of one tile), got {self.tile}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"--softcap must be > 0 (Gemma 2 uses 50), got {self.softcap}")
        need = memory_estimate_gib(self.batch, self.seq, self.dim, self.heads)
        if need > MEMORY_LIMIT_GIB:
            longest = _longest_seq(self.batch, self.dim, self.heads, MEMORY_LIMIT_GIB)
            raise ValueError(
                f"explain keeps whole (B, H, S, S) scores and weights: B={self.batch} H={self.heads} S={self.seq} "
                f"needs about {need:.1f} GiB, over the {MEMORY_LIMIT_GIB:g} GiB limit; lower --seq (at most "
                f"{longest} at B={self.batch} H={self.heads} E={self.dim}), --batch or --heads"
            )


    def mask_mod(self) -> MaskMod | None:
        """The ``rule`` as a mask_mod (None: no rule).

        Raises:
            ValueError: a rule that is not ``document:L1,L2,...`` (lengths summing to --seq),
                ``prefix:N`` or ``window:W``.
        """
        if self.rule is None:
            return None
        kind, _, spec = self.rule.partition(":")
        try:
            numbers = [int(n) for n in spec.split(",")]
        except ValueError:
            numbers = []
        if kind == "document" and numbers and sum(numbers) == self.seq and min(numbers) > 0:
            return document(torch.repeat_interleave(torch.arange(len(numbers)), torch.tensor(numbers)))
        if kind == "prefix" and len(numbers) == 1 and 0 <= numbers[0] <= self.seq:
            return prefix_lm(numbers[0])
        if kind == "window" and len(numbers) == 1 and numbers[0] >= 1:
            return sliding_window(numbers[0])
        raise ValueError(f"--rule {self.rule!r} is not a rule explain knows: give document:L1,L2,... (document "
                         f"lengths summing to --seq {self.seq}), prefix:N (0 <= N <= {self.seq}) or window:W (W >= 1)")


@dataclass(frozen=True)
class Explained:
    """What :func:`explain` found.

    Attributes:
        config: the configuration.
        trace: the recorded stages of the traced forward.
        weights: (B, H, S, S) attention probabilities (from an untraced second pass).
        allowed: (B, S, S) bool, True where a query may attend a key (padding, causal, the rule).
        output: (B, S, E) the traced forward's output.
        tiles: with a rule, the tile map of the rule (causal included) at (tile, tile) tiles.
    """

    config: ExplainConfig
    trace: Trace
    weights: Tensor
    allowed: Tensor
    output: Tensor
    tiles: TileMap | None = None


def explain(config: ExplainConfig) -> Explained:
    """Run ``config`` once under :func:`headwise.trace` and once more for its weights.

    Raises:
        ValueError: the configuration cannot run (the message says why).

    >>> e = explain(ExplainConfig(batch=2, seq=3, dim=16, heads=2, lengths=(3, 2)))
    >>> e.weights.shape, e.trace.stages[-1].name
    (torch.Size([2, 2, 3, 3]), 'zero padding')
    >>> "sinks" in explain(ExplainConfig(batch=1, seq=3, dim=16, heads=2, softcap=5.0, sinks=True)).trace.names()
    True
    """
    config.validate()
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    mha = MultiHeadAttention(config.dim, config.heads, num_kv_heads=config.kv_heads,
                             is_causal=config.causal, backend=config.backend, softcap=config.softcap,
                             sinks=config.sinks).eval()
    x = torch.randn(config.batch, config.seq, config.dim, generator=gen)  # (B, S, E)
    if mha.sinks is not None:  # random sink logits, as a trained model's would be, from the seed
        with torch.no_grad():
            mha.sinks.copy_(torch.randn(config.heads, generator=gen))  # (H,)
    mask = None if config.lengths is None else key_padding_mask(list(config.lengths), config.seq)
    rule = config.mask_mod()
    with torch.no_grad():
        with trace() as t:
            output = mha(x, mask, mask_mod=rule)
        # the weights from the same backend: exp(scores - lse), from its log-sum-exp (headwise.weights)
        _, weights = mha(x, mask, need_weights=True, mask_mod=rule)  # (B, H, S, S)
    allowed = torch.ones(config.batch, config.seq, config.seq, dtype=torch.bool)  # (B, S, Sk)
    if mask is not None:
        allowed = allowed & mask[:, None, :]  # the documents' unsqueeze + expand
    if config.causal:
        allowed = allowed & causal_mask(config.seq, config.seq)
    tiles = None
    if rule is not None:
        S = config.seq
        allowed = allowed & evaluate_mask(rule, config.batch, 1, (0, S), (0, S), None)[:, 0]  # (B|1, S, S)
        structure = and_masks(causal, rule) if config.causal else rule
        tiles = tile_map(structure, config.batch, config.heads, S, S, block=(config.tile, config.tile))
    return Explained(config, t, weights, allowed, output, tiles)


def command(config: ExplainConfig) -> str:
    """The ``headwise explain`` command line that reproduces ``config``."""
    default = ExplainConfig()
    parts = ["headwise explain"]
    for name in ("batch", "seq", "dim", "heads", "kv_heads", "backend", "seed"):
        value = getattr(config, name)
        if value != getattr(default, name):
            parts.append(f"--{name.replace('_', '-')} {value}")
    if config.lengths is not None:
        parts.append("--mask lengths " + ",".join(map(str, config.lengths)))
    if config.causal:
        parts.append("--causal")
    if config.softcap is not None:
        parts.append(f"--softcap {config.softcap:g}")
    if config.sinks:
        parts.append("--sinks")
    if config.rule is not None:
        parts.append(f"--rule {config.rule}")
    if config.tile != default.tile:
        parts.append(f"--tile {config.tile}")
    return " ".join(parts)


def markdown_page(explained: Explained) -> str:
    """The "How multi-head attention works" page, its table generated from the trace."""
    c = explained.config
    head_dim = c.dim // c.heads
    rows = "\n".join(
        f"| {s.name} | `{s.shape}` | {s.note.replace('|', '/')} |" for s in explained.trace.stages
    )
    return f"""# How multi-head attention works

This page is generated from a traced run by
`{command(c)} --markdown > docs/how-attention-works.md`
(the test suite regenerates it and fails if this file differs). The module's stages are
recorded from the tensors themselves, the kernel's from the stages the kernel declares,
which the tests check against every tensor the kernel produces: the shapes below are the
shapes the code really produces.

The example is the second teaching document's: a batch of B = {c.batch} sequences of
S = {c.seq} tokens, embed dim E = {c.dim}, H = {c.heads} heads of D = E / H = {head_dim}
dimensions each, traced on the `{c.backend}` backend, which shows every stage.

1. **Projections.** Three linear layers turn each token into a query, a key and a
   value: `(B, S, E) -> (B, S, E)`.
2. **Split into heads.** The last dimension is cut into H pieces of D and the head axis
   moves forward: `(B, S, E) -> (B, S, H, D) -> (B, H, S, D)`.
3. **Scaling** by `1 / sqrt(D)` keeps the scores' spread independent of D. headwise
   scales q before the product, which gives the documents' `(q @ k^T) / sqrt(D)` but
   cannot overflow fp16 where the scaled scores fit.
4. **Scores.** Every query meets every key: `q @ k^T` is
   `(B, H, S, D) x (B, H, D, S) -> (B, H, S, S)`.
5. **Mask.** A `(B, S)` padding mask broadcasts to `(B, H, S, S)` (the documents'
   `unsqueeze(1).unsqueeze(2).expand(...)`); masked scores become `-inf`.
6. **Softmax** over the keys turns each row into probabilities; a row with nothing to
   attend becomes zeros in headwise (the plain formula gives NaN there).
7. **Dropout** zeroes probabilities at random while training.
8. **Weighted sum** of the values: `(B, H, S, S) x (B, H, S, D) -> (B, H, S, D)`.
9. **Merge heads**: `(B, H, S, D) -> (B, S, H, D) -> (B, S, E)`.
10. **Output projection**: one more linear layer, `(B, S, E) -> (B, S, E)`.

| stage | shape | what happens |
|---|---|---|
{rows}
"""

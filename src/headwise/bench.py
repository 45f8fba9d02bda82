"""``headwise bench``: headwise against PyTorch's best, measured side by side in one run.

Every row times the same inputs through each implementation: headwise (``auto`` and
named backends), the first document's class, ``torch.nn.MultiheadAttention``
(``need_weights=False``) and a plain module built on ``scaled_dot_product_attention``.
Times are medians of repeats after warm-up, the implementations of a case taking turns
in every repeat (the long-sequence cases: one run, timed in the memory subprocess); the
attention core's FLOP rate is compared with an fp32 matmul timed in the same rounds.
Rounds go on until every median is stable (its ~95% confidence interval within
``TOLERANCE`` of it) or a cap is reached; a median still unstable at the cap is reported
in ``report["unstable"]`` (the command line warns on stderr), never published silently.
Peak memory is how far the resident set of a fresh subprocess rises above its level
before one run of the case (the kernel's peak mark is reset first; CPU torch has no
allocator statistics), with predicted out-of-memory cases reported instead of run.

Legend: B batch, S sequence length, E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import headwise
from headwise.reference import MultiHeadAttentionFormal

__all__ = ["TOLERANCE", "Case", "Result", "SDPAModule", "Timing", "attention_core", "build", "headwise_module",
           "median_spread", "round_robin", "round_robin_ms", "run"]

# A median counts as stable when its ~95% confidence interval (the boxplot notch,
# 1.58 IQR / sqrt(n)) lies within +-5% of it: a ratio of two such medians is then good to
# about 10%, where a busy machine's outliers move a median of 3 by 100x.
TOLERANCE = 0.05


class SDPAModule(nn.Module):
    """The plain module people write on ``F.scaled_dot_product_attention``: fused qkv."""

    def __init__(self, E: int, H: int, dropout: float = 0.0):
        super().__init__()
        self.H, self.dropout = H, dropout
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, S, E = x.shape
        q, k, v = self.qkv(x).reshape(B, S, 3, self.H, E // self.H).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, D)
        attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, S), True = attend
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(o.transpose(1, 2).reshape(B, S, E))  # (B, S, E)


class SDPALinearsModule(nn.Module):
    """The plain module people write with separate projections, as transformers and torchtune
    lay them out: ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` ``nn.Linear``, then
    ``F.scaled_dot_product_attention``. :meth:`like` gives it a headwise module's weights."""

    def __init__(self, E: int, H: int):
        super().__init__()
        self.H = H
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B, S, E = x.shape
        q, k, v = (p(x).unflatten(-1, (self.H, -1)).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # 3 x (B, S, E) -> (B, H, S, D)
        attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, S), True = attend
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, S, D)
        return self.out_proj(o.transpose(1, 2).reshape(B, S, E))  # (B, S, E)

    @classmethod
    def like(cls, mha: headwise.MultiHeadAttention) -> SDPALinearsModule:
        """One with ``mha``'s four projections (the same names, so its state dict loads as is)."""
        out = cls(mha.embed_dim, mha.num_heads)
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                getattr(out, name).load_state_dict(getattr(mha, name).state_dict())
        return out


def copy_weights(target: SDPAModule | SDPADecoder, mha: headwise.MultiHeadAttention) -> None:
    """Copy ``mha``'s weights into a minimal module with one fused ``qkv`` and an ``out``
    ``nn.Linear``: q, k and v stacked as (3E, E) rows."""
    projections = (mha.q_proj, mha.k_proj, mha.v_proj)
    with torch.no_grad():
        target.qkv.weight.copy_(torch.cat([p.weight for p in projections]))  # (3E, E)
        if target.qkv.bias is not None:
            target.qkv.bias.copy_(torch.cat([p.bias for p in projections]))
        target.out.load_state_dict(mha.out_proj.state_dict())


class SDPADecoder(nn.Module):
    """The plain decoder people write: fused qkv, SDPA on a preallocated (B, H, L, D) cache, out."""

    def __init__(self, E: int, H: int, B: int, max_len: int):
        super().__init__()
        self.H, self.D = H, E // H
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)
        self.k = torch.zeros(B, H, max_len, self.D)
        self.v = torch.zeros(B, H, max_len, self.D)
        self.length = 0

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).unflatten(-1, (3, self.H, self.D)).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        end = self.length + T
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        o = F.scaled_dot_product_attention(q, self.k[:, :, :end], self.v[:, :, :end], is_causal=T > 1)
        return self.out(o.transpose(1, 2).flatten(2))  # (B, T, E)

    @classmethod
    def like(cls, mha: headwise.MultiHeadAttention, B: int, max_len: int) -> SDPADecoder:
        """One with ``mha``'s weights (q, k, v stacked into qkv)."""
        out = cls(mha.embed_dim, mha.num_heads, B, max_len)
        copy_weights(out, mha)
        return out


def decode_steps_us(E: int, H: int, prompt: int, steps: int, repeats: int, B: int = 1,
                    max_repeats: int | None = None, tolerance: float = TOLERANCE,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float]]:
    """Microseconds per decoding step after a ``prompt``-token prefill: the headwise module with
    its cache and :class:`SDPADecoder`, each repeat timing ``steps`` steps of both in turns.

    At least ``repeats`` repeats, and more (up to ``max_repeats``) while the median of the
    per-repeat ratio is not stable within ``tolerance`` (see :func:`median_spread`).
    ``clock``: ``time.process_time`` counts only this process's work (one thread: a busy
    machine disturbs it less)."""
    torch.manual_seed(0)
    mha = headwise.MultiHeadAttention(E, H).eval()
    ref = SDPADecoder.like(mha, B, prompt + steps).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, prompt, E, generator=gen)
    tokens = torch.randn(steps, B, 1, E, generator=gen)

    def ours() -> float:
        cache = mha.new_cache(B, prompt + steps)
        mha(x, cache=cache, is_causal=True)  # the prompt, not timed
        start = clock()
        for t in range(steps):
            mha(tokens[t], cache=cache, is_causal=True)
        return (clock() - start) / steps * 1e6

    def theirs() -> float:
        ref.length = 0
        ref(x)
        start = clock()
        for t in range(steps):
            ref(tokens[t])
        return (clock() - start) / steps * 1e6

    with torch.no_grad():
        ours(), theirs()  # warm up
        a: list[float] = []
        b: list[float] = []
        while len(a) < max(repeats, max_repeats or repeats):
            a.append(ours())
            b.append(theirs())
            if len(a) >= repeats and median_spread([o / t for o, t in zip(a, b, strict=True)]) <= tolerance:
                break
    return a, b


@dataclass(frozen=True)
class Case:
    """One benchmark configuration."""

    group: str  # "dense", "padded", "long"
    B: int
    S: int
    E: int
    H: int
    lengths: tuple[int, ...] | None = None  # real lengths per row (a padding mask), None: dense
    dropout: float = 0.0
    backward: bool = True

    @property
    def padding(self) -> float:
        return 0.0 if self.lengths is None else 1.0 - sum(self.lengths) / (self.B * self.S)

    def label(self) -> str:
        pad = f", {self.padding:.0%} padding" if self.lengths is not None else ""
        drop = f", dropout {self.dropout}" if self.dropout else ""
        return f"B={self.B} S={self.S} E={self.E} H={self.H}{pad}{drop}"


@dataclass
class Result:
    case: Case
    impl: str
    forward_ms: float | None = None
    train_ms: float | None = None  # forward + backward
    forward_peak_mib: float | None = None
    train_peak_mib: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


IMPLS = ("headwise auto", "SDPA module", "torch MHA", "reference")


def headwise_module(case: Case, backend: str = "auto", packing: bool | str = "auto") -> headwise.MultiHeadAttention:
    """The case's headwise module; its weights, seeded, are the ones every implementation uses."""
    torch.manual_seed(0)
    return headwise.MultiHeadAttention(case.E, case.H, case.dropout, backend=backend, packing=packing)


def build(impl: str, case: Case) -> Callable[[Tensor, Tensor | None], Tensor]:
    """The implementation as ``f(x, mask) -> (B, S, E)``, mask (B, S) bool True = token.

    Every implementation carries the same weights (those of :func:`headwise_module`), so
    they compute the same function: the tests check that, and the timings compare like
    with like.
    """
    E, H = case.E, case.H
    if impl == "headwise packed":  # the padding-free path, whatever the padding share
        m = headwise_module(case, packing=True)
        return lambda x, mask: m(x, mask)
    if impl.startswith("headwise"):
        m = headwise_module(case, impl.split()[1])
        return lambda x, mask: m(x, mask)
    ours = headwise_module(case)
    if impl == "SDPA module":
        sdpa = SDPAModule(E, H, case.dropout)
        copy_weights(sdpa, ours)
        return lambda x, mask: sdpa(x, mask)
    if impl == "torch MHA":
        torch_mha = ours.to_torch(batch_first=True)
        return lambda x, mask: torch_mha(x, x, x, key_padding_mask=None if mask is None else ~mask,
                                         need_weights=False)[0]
    if impl == "reference":
        ref = MultiHeadAttentionFormal(E, H, case.dropout)
        ref.load_state_dict({key.replace("out_proj", "output"): value for key, value in ours.state_dict().items()})
        return lambda x, mask: ref(x, None if mask is None else mask[:, None, None, :])
    raise ValueError(f"unknown implementation {impl!r}; choose one of {IMPLS} or 'headwise <backend>'")


def inputs(case: Case, requires_grad: bool) -> tuple[Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.B, case.S, case.E, generator=gen).requires_grad_(requires_grad)
    mask = None
    if case.lengths is not None:
        mask = torch.arange(case.S)[None, :] < torch.tensor(case.lengths)[:, None]  # (B, S)
    return x, mask


def predicted_peak_gib(impl: str, case: Case) -> float:
    """A lower bound on the (B, H, S, S) memory an implementation that materialises scores needs."""
    if impl == "headwise auto" or impl in ("headwise chunked", "headwise packed"):
        return 0.0
    scores = case.B * case.H * case.S * case.S * 4 / 2**30
    if impl == "SDPA module" and case.dropout == 0 and case.lengths is None:
        return 0.0  # fused flash kernel on CPU
    return scores * (3 if case.backward else 2)


def time_cases(impls: list[str], case: Case, repeats: int, max_repeats: int | None = None,
               tolerance: float = TOLERANCE) -> list[Result]:
    """Median forward and forward + backward times of each implementation on one case.

    The implementations take turns within every repeat (round robin), so a machine that
    slows down or speeds up during the run affects them all alike; the rounds go on until
    the medians are stable (:func:`round_robin`). Each result's ``extra`` holds the spread
    of its medians (``forward_spread``, ``train_spread``) and the number of ``rounds``.
    """
    fns = {impl: build(impl, case) for impl in impls}
    x, mask = inputs(case, requires_grad=False)
    xg, _ = inputs(case, requires_grad=True)

    def forward(fn):
        with torch.no_grad():
            fn(x, mask)

    def train(fn):
        fn(xg, mask).float().sum().backward()

    runs = [(impl, "forward", lambda fn=fn: forward(fn)) for impl, fn in fns.items()]
    if case.backward:
        runs += [(impl, "train", lambda fn=fn: train(fn)) for impl, fn in fns.items()]
    timing = round_robin([run for _, _, run in runs], repeats, max_repeats, tolerance)
    results = {impl: Result(case, impl, extra={"rounds": timing.rounds}) for impl in impls}
    for (impl, kind, _), ms, spread in zip(runs, timing.ms, timing.spread, strict=True):
        setattr(results[impl], f"{kind}_ms", ms)
        results[impl].extra[f"{kind}_spread"] = spread
    return list(results.values())


def median_spread(samples: list[float]) -> float:
    """How far the median of ``samples`` may be off, relative to it: the half-width of its ~95%
    confidence interval, 1.58 IQR / sqrt(n) / median (the boxplot notch of McGill, Tukey and
    Larsen). Infinite below 3 samples, where nothing can be judged.

    >>> median_spread([1.0, 1.0, 1.0, 1.0])
    0.0
    >>> round(median_spread([1.0, 1.0, 9.0, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0]), 2)
    0.0
    >>> median_spread([1.0, 2.0])
    inf
    """
    if len(samples) < 3:
        return float("inf")
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    median = statistics.median(samples)
    return 1.58 * (q3 - q1) / len(samples) ** 0.5 / median if median > 0 else float("inf")


def spread_text(spread: float) -> str:
    """A spread for people: ``+-12%``, or why there is none.

    >>> spread_text(0.123), spread_text(float("inf"))
    ('+-12%', 'of unknown spread (fewer than 3 repeats)')
    """
    return "of unknown spread (fewer than 3 repeats)" if spread == float("inf") else f"+-{spread:.0%}"


@dataclass(frozen=True)
class Timing:
    """What :func:`round_robin` measured.

    Attributes:
        ms: median milliseconds of each function.
        spread: each median's relative uncertainty (:func:`median_spread`).
        rounds: how many timed rounds ran.
        tolerance: the spread a stable median stays within.
    """

    ms: list[float]
    spread: list[float]
    rounds: int
    tolerance: float

    @property
    def stable(self) -> bool:
        return max(self.spread, default=0.0) <= self.tolerance


def round_robin(fns: list[Callable[[], object]], repeats: int, max_repeats: int | None = None,
                tolerance: float = TOLERANCE) -> Timing:
    """Time the functions in turns after one warm-up call each, until their medians are stable.

    Args:
        fns: the functions, called without arguments.
        repeats: rounds to run at least.
        max_repeats: rounds to run at most (None: ``repeats``, no extra rounds); more rounds run
            while some median's spread (:func:`median_spread`) exceeds ``tolerance``.
        tolerance: the relative spread a median must come within.

    Returns:
        A :class:`Timing`; ``stable`` is False when the cap came first.

    Raises:
        ValueError: ``repeats`` below 1 or ``max_repeats`` below ``repeats``.
    """
    max_repeats = repeats if max_repeats is None else max_repeats
    if repeats < 1 or max_repeats < repeats:
        raise ValueError(f"repeats ({repeats}) must be >= 1 and max_repeats ({max_repeats}) >= repeats; "
                         "e.g. repeats=3, max_repeats=15")
    for fn in fns:
        fn()  # warm-up (allocator, dispatch caches, thread pool)
    times: list[list[float]] = [[] for _ in fns]
    spread = [float("inf")] * len(fns)
    for rounds in range(1, max_repeats + 1):
        for fn, mine in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            mine.append(time.perf_counter() - start)
        if rounds >= repeats:
            spread = [median_spread(t) for t in times]
            if max(spread, default=0.0) <= tolerance:
                break
    return Timing([statistics.median(t) * 1e3 for t in times], spread, rounds, tolerance)


def round_robin_ms(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median milliseconds of each function over exactly ``repeats`` rounds (:func:`round_robin`)."""
    return round_robin(fns, repeats).ms


def measure_in_child(impl: str, case: Case, limit_gib: float, train_only: bool = False) -> dict:
    """One forward (no grad) and one forward + backward in a fresh subprocess.

    Returns ``forward_ms``, ``train_ms``, ``forward_peak_mib``, ``train_peak_mib`` (peak
    resident set rise of each run over the level before it) and ``note``; values are None
    with the reason in ``note`` when the case cannot run in ``limit_gib``. The training
    run may reuse memory the forward run freed, which can only lower its figure:
    ``train_only`` skips the forward run for a training peak from a fresh process.
    """
    need = predicted_peak_gib(impl, case)
    empty = {"forward_ms": None, "train_ms": None, "forward_peak_mib": None, "train_peak_mib": None}
    if need > limit_gib:
        return {**empty, "note": f"out of memory: needs >= {need:.1f} GiB of scores (limit {limit_gib:.0f} GiB)"}
    spec = json.dumps({"impl": impl, "case": asdict(case), "limit_gib": limit_gib, "train_only": train_only})
    proc = subprocess.run([sys.executable, "-m", "headwise.bench", "--memory-child", spec],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        oom = "alloc" in tail.lower() or "memory" in tail.lower()
        return {**empty, "note": "out of memory" if oom else tail[:80]}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "note": ""}


def _memory_child(spec: str) -> dict:
    """Subprocess side of :func:`measure_in_child`: the measurements of one case."""
    args = json.loads(spec)
    limit = int(args["limit_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))  # fail with an error, not the OOM killer
    case_fields = args["case"]
    case_fields["lengths"] = tuple(case_fields["lengths"]) if case_fields["lengths"] else None
    case = Case(**case_fields)
    fn = build(args["impl"], case)
    report: dict[str, float | str | None] = {}
    if args.get("train_only"):
        report["forward_ms"] = report["forward_peak_mib"] = None
    else:
        x, mask = inputs(case, requires_grad=False)
        before = _reset_peak_rss_kib()
        start = time.perf_counter()
        with torch.no_grad():
            fn(x, mask)
        report["forward_ms"] = (time.perf_counter() - start) * 1e3
        report["forward_peak_mib"] = (_peak_rss_kib() - before) / 1024
        del x, mask
    x, mask = inputs(case, requires_grad=True)
    before = _reset_peak_rss_kib()
    start = time.perf_counter()
    fn(x, mask).float().sum().backward()
    report["train_ms"] = (time.perf_counter() - start) * 1e3
    report["train_peak_mib"] = (_peak_rss_kib() - before) / 1024
    return report


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss_kib() -> int:
    """Reset the kernel's peak-RSS mark to the current RSS and return it (KiB).

    Without /proc (not Linux) the process-lifetime peak is the baseline instead, which
    can hide a rise smaller than an earlier transient peak.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
        return _status_kib("VmRSS") or 0
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss_kib() -> int:
    return _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# For a child that measures peaks: glibc's mmap threshold fixed at 64 KiB, so every buffer of
# a tensor is mapped and unmapped on its own and the resident set follows the live memory
# (glibc otherwise raises the threshold after the first large free and keeps later buffers in
# a heap whose freed pages stay resident, so the first large call's peak counts its cache).
PEAK_CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_rise_mib(fn: Callable[[], object]) -> float:
    """How far the process's resident set peaks above its level before ``fn()`` (MiB). Run it in
    a fresh process per measurement, with :data:`PEAK_CHILD_ENV` in its environment: memory an
    earlier run freed to the allocator hides a rise, and glibc's own cache adds one."""
    base = _reset_peak_rss_kib()
    fn()
    return (_peak_rss_kib() - base) / 1024


def attention_core(S: int, backends: list[str], repeats: int, causal: bool = False,
                   B: int = 1, H: int = 8, D: int = 64, matmul_n: int = 2048, max_repeats: int | None = None,
                   tolerance: float = TOLERANCE) -> list[dict]:
    """FLOP rate of the attention core alone (q, k, v given), forward, per backend and SDPA.

    A (matmul_n x matmul_n) fp32 matmul takes its turn in the same rounds, so each row's
    ``of_matmul`` compares rates measured under the same load. Each row's ``spread`` is its
    median's and the matmul's, the larger (:func:`round_robin`).
    """
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(3))
    m1, m2 = (torch.randn(matmul_n, matmul_n, generator=gen) for _ in range(2))  # the matmul's operands
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    runs: list[tuple[str, Callable[[], object]]] = [
        ("torch sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))]
    runs += [(f"headwise {name}", partial(headwise.attention, q, k, v, is_causal=causal, backend=name))
             for name in backends
             if not (name in ("matmul", "einsum", "bmm", "einops") and S > 4096)]  # (B, H, S, S) scores: too big
    with torch.no_grad():
        timing = round_robin([lambda: m1 @ m2] + [fn for _, fn in runs], repeats, max_repeats, tolerance)
    ms = timing.ms
    rate = 2 * matmul_n**3 / (ms[0] / 1e3) / 1e9
    rows = []
    for (name, _), t, spread in zip(runs, ms[1:], timing.spread[1:], strict=True):
        gflops = flops / (t / 1e3) / 1e9
        rows.append({"impl": name, "S": S, "causal": causal, "ms": t, "gflops": gflops,
                     "matmul_gflops": rate, "of_matmul": gflops / rate, "rounds": timing.rounds,
                     "spread": max(spread, timing.spread[0])})
    return rows


def cases(quick: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(3)
    if quick:  # a small dense sweep over S (what plot draws), then a padded batch
        lengths = tuple(torch.randint(16, 129, (8,), generator=gen).tolist())
        return [*(Case("dense", 4, s, 128, 4) for s in (64, 128, 256)), Case("padded", 8, 128, 128, 4, lengths=lengths)]
    padded_lengths = tuple(torch.randint(64, 513, (32,), generator=gen).tolist())  # uniform in 64..512
    long_pad = 0.1  # 10% padding on the long sequences
    out = [Case("dense", 32, 128, 512, 8), Case("dense", 8, 512, 768, 12), Case("dense", 1, 4096, 512, 8)]
    out += [Case("dense", 8, s, 512, 8) for s in (64, 256, 1024)]
    out += [Case("padded", 32, 512, 512, 8, lengths=padded_lengths)]
    for frac in (0.25, 0.5, 0.75):
        lens = tuple(max(1, round(512 * (1 - frac * 2 * u))) for u in torch.rand(32, generator=gen).tolist())
        out.append(Case("padded", 32, 512, 512, 8, lengths=lens))
    for s in (16384, 32768):
        n = s - int(s * long_pad)
        out.append(Case("long", 1, s, 512, 8, lengths=(n,), dropout=0.1))
    return out


def run(quick: bool = False, repeats: int | None = None, memory: bool = True, limit_gib: float = 16.0,
        progress: Callable[[str], None] | None = None, max_repeats: int | None = None,
        tolerance: float = TOLERANCE) -> dict:
    """Measure everything; returns a JSON-ready dict.

    Args:
        quick: small shapes, no memory subprocesses (seconds).
        repeats: timed rounds per case at least (None: 5, quick 3).
        memory: measure peak memory in subprocesses.
        limit_gib: GiB a case may use before it is reported out of memory.
        progress: called with a short message before each step.
        max_repeats: rounds per case at most (None: 5 x ``repeats``); rounds go on while a
            median's spread exceeds ``tolerance``.
        tolerance: the relative spread of a stable median (:func:`median_spread`).

    Returns:
        ``machine``, ``results``, ``core``, ``decode``, ``matmul_gflops``, and ``unstable``:
        one line per median still unstable after ``max_repeats`` rounds (empty when all are).

    Raises:
        ValueError: ``repeats`` or ``max_repeats`` below 1, ``max_repeats`` below ``repeats``,
            or ``limit_gib`` not positive.
    """
    repeats = (3 if quick else 5) if repeats is None else repeats
    max_repeats = 5 * repeats if max_repeats is None else max_repeats
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}; e.g. --repeats 3")
    if max_repeats < repeats:
        raise ValueError(f"max_repeats ({max_repeats}) must be >= repeats ({repeats}); e.g. --max-repeats "
                         f"{5 * repeats}")
    if not limit_gib > 0:
        raise ValueError(f"limit_gib must be > 0, got {limit_gib}; e.g. --memory-limit 16")
    say = progress or (lambda message: None)
    unstable: list[str] = []  # one line per median still unstable after max_repeats rounds
    results = [result for case in cases(quick)
               for result in _case_results(case, repeats, max_repeats, tolerance, memory and not quick, limit_gib,
                                           say, unstable)]
    say("decode steps")
    decode = [_decode_row(E, H, prompt, 32 if quick else 64, repeats, max_repeats, tolerance, unstable)
              for E, H, prompt in (((512, 8, 512),) if quick else ((512, 8, 512), (1024, 16, 2048)))]
    say("attention core")
    backends = [b for b in headwise.available_backends() if b != "varlen"]
    core = []
    for S in ((256,) if quick else (1024, 4096)):
        core += attention_core(S, backends if S <= 1024 else ["sdpa", "chunked"], repeats,
                               matmul_n=1024 if quick else 2048, max_repeats=max_repeats, tolerance=tolerance)
    unstable += [f"core {r['impl']} S={r['S']}: median {spread_text(r['spread'])} after {r['rounds']} repeats"
                 for r in core if r["spread"] > tolerance]
    return _finite({
        "machine": {"threads": torch.get_num_threads(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "matmul_gflops": statistics.median(r["matmul_gflops"] for r in core),
        "results": [{**asdict(r), "case": {**asdict(r.case), "label": r.case.label(),
                                            "padding": r.case.padding}} for r in results],
        "core": core,
        "decode": decode,
        "repeats": repeats,
        "max_repeats": max_repeats,
        "tolerance": tolerance,
        "unstable": unstable,
    })


def _case_results(case: Case, repeats: int, max_repeats: int, tolerance: float, memory: bool, limit_gib: float,
                  say: Callable[[str], None], unstable: list[str]) -> list[Result]:
    """One case's results, one per implementation: out of memory where predicted, one run in a
    child for the long cases, the rest timed side by side in turns (and their peak memory in
    children with ``memory``). Unstable medians are appended to ``unstable``."""
    impls = list(IMPLS) + (["headwise sdpa", "headwise chunked"] if case.group != "long" else [])
    if case.group == "padded":
        impls.append("headwise packed")
    if case.group == "long":
        impls = ["headwise auto", "SDPA module", "reference"]
    done: dict[str, Result] = {}
    for impl in impls:
        need = predicted_peak_gib(impl, case)
        if need > limit_gib:
            done[impl] = Result(case, impl, note=f"out of memory: needs >= {need:.1f} GiB")
        elif case.group == "long":  # one run of each, in the child: minutes per run at these lengths
            say(f"{case.label()}: {impl}")
            done[impl] = Result(case, impl, **measure_in_child(impl, case, limit_gib))
    timed = [impl for impl in impls if impl not in done]  # side by side, in turns
    if timed:
        say(f"{case.label()}: timing {len(timed)} implementations in turns")
        for result in time_cases(timed, case, repeats, max_repeats, tolerance):
            for kind in ("forward", "train"):
                spread = result.extra.get(f"{kind}_spread", 0.0)
                if spread > tolerance:
                    unstable.append(f"{case.label()} {result.impl} {kind}: median {spread_text(spread)} after "
                                    f"{result.extra['rounds']} repeats")
            if memory:
                say(f"{case.label()}: {result.impl}, peak memory")
                measured = measure_in_child(result.impl, case, limit_gib)
                result.forward_peak_mib = measured["forward_peak_mib"]
                result.train_peak_mib = measured["train_peak_mib"]
                result.note = measured["note"]
            done[result.impl] = result
    return [done[impl] for impl in impls]


def _decode_row(E: int, H: int, prompt: int, steps: int, repeats: int, max_repeats: int, tolerance: float,
                unstable: list[str]) -> dict:
    """The decode table's row for one shape; an unstable ratio median is appended to ``unstable``."""
    ours, theirs = decode_steps_us(E, H, prompt, steps=steps, repeats=repeats, max_repeats=max_repeats,
                                   tolerance=tolerance)
    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    spread = median_spread(ratios)
    if spread > tolerance:
        unstable.append(f"decode E={E} H={H} prompt={prompt}: ratio median {spread_text(spread)} after "
                        f"{len(ratios)} repeats")
    return {"E": E, "H": H, "prompt": prompt, "ours_us": statistics.median(ours),
            "sdpa_us": statistics.median(theirs), "ratio": statistics.median(ratios),
            "rounds": len(ratios), "spread": spread}


def _finite(obj):
    """``obj`` with every infinite float (a spread of fewer than 3 repeats) as None: strict JSON."""
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_finite(value) for value in obj]
    return None if isinstance(obj, float) and obj == float("inf") else obj


def ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f"{a / b:.2f}x"


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return ""
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def fmt_mib(mib: float | None) -> str:
    return "" if mib is None else (f"{mib:.0f} MiB" if mib < 1024 else f"{mib / 1024:.2f} GiB")


def flops(case: dict, train: bool) -> float:
    """Attention FLOPs of a case: 4 B H S Sk D forward, x 3.5 for forward + backward."""
    D = case["E"] // case["H"]
    return 4 * case["B"] * case["H"] * case["S"] ** 2 * D * (3.5 if train else 1.0)


def sweep(report: dict) -> list[dict]:
    """The rows :func:`plot` draws: the dense cases that differ only in S (the longest such series;
    B=8 E=512 H=8 in the full run, B=4 E=128 H=4 in the quick one)."""
    series: dict[tuple[int, int, int], list[dict]] = {}
    for r in report["results"]:
        if r["case"]["group"] == "dense":
            series.setdefault((r["case"]["B"], r["case"]["E"], r["case"]["H"]), []).append(r)
    return max(series.values(), key=lambda rows: len({r["case"]["S"] for r in rows}), default=[])


def plot(report: dict, path: str) -> None:
    """Forward time and peak memory against sequence length (the dense sweep; forward + backward
    time instead of memory when memory was not measured, as in ``--quick``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep(report)
    memory = any(r["train_peak_mib"] for r in rows)
    right = ("train_peak_mib", "forward + backward peak memory", "MiB") if memory else (
        "train_ms", "forward + backward time", "ms")
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    for impl in sorted({r["impl"] for r in rows}):
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["case"]["S"])
        for ax, key in ((ax_t, "forward_ms"), (ax_r, right[0])):
            points = [(r["case"]["S"], r[key]) for r in mine if r[key]]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=impl)
    shape = "B={B}, E={E}, H={H}".format(**rows[0]["case"]) if rows else "no dense case"
    for ax, title, unit in ((ax_t, "forward time", "ms"), (ax_r, right[1], right[2])):
        if not ax.lines:
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes)
        else:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_xlabel(f"sequence length S ({shape})")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    if ax_t.lines:
        ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--memory-child":
    # The child's one line of JSON on stdout is how measure_in_child hears back.
    sys.stdout.write(json.dumps(_memory_child(sys.argv[2])) + "\n")

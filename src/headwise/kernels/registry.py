"""One registry for every attention kernel.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v (Dv == D unless the caller gives v its own).

A kernel is a function with one keyword-only signature::

    kernel(q, k, v, *, attention_mask, rules, dropout_p, scale, need_weights[, return_lse]) -> KernelResult

* ``q`` (B, H, S, D), ``k`` (B, Hkv, Sk, D) and ``v`` (B, Hkv, Sk, Dv) with ``H % Hkv == 0``
  (``Dv != D``, as multi-head latent attention has, is ``Request.value_dim``);
* ``attention_mask`` is ``None`` or already normalised by
  :func:`headwise.masks.normalize_mask` (4-D, bool True = attend, or float additive);
* ``rules`` is one :class:`headwise.rules.Rules`: the causal rule (``rules.is_causal``, True
  also with a window), ``window`` (query ``i`` attends keys ``j`` with
  ``i + Sk - S - window < j <= i + Sk - S``), ``sink_tokens`` (StreamingLLM: keys
  ``j < sink_tokens`` stay visible under the window where ``j <= i + Sk - S``),
  ``alibi_slopes`` ((H,): add ``-slope_h * |i + Sk - S - j|``), ``softcap`` (Gemma 2's
  ``s = softcap * tanh(s / softcap)``), ``sinks`` ((H,) logits: one more softmax column per
  row that adds nothing to the output, gpt-oss), and the user's ``mask_mod`` /
  ``score_mod`` (FlexAttention's functions, see :mod:`headwise.evaluate`);
* the order of operations is ``s = q k^T * scale``; softcap; ALiBi; score_mod; the mask
  (the caller's, the causal / window rule and mask_mod, ANDed); softmax over
  ``[s, sink_h]`` with the sink column dropped; dropout; ``@ v``;
* it returns one :class:`KernelResult` ``(out, weights, lse)``, read by name: ``out`` is
  (B, H, S, Dv); ``weights`` is the (B, H, S, Sk) softmax before dropout when
  ``need_weights`` is True (only kernels that declare ``supports_weights``), else None
  (with sinks its rows sum to less than 1: the sink holds the rest); ``lse`` is each row's
  (B, H, S) log-sum-exp when ``return_lse=True`` is passed (only to a function that takes
  the keyword), else None. A kernel of your own may return a plain ``(out, weights)`` or
  ``(out, weights, lse)`` tuple instead: :func:`call_kernel` reads it as a ``KernelResult``.

A kernel refuses in its ``refuses`` what it cannot run (``Request.softcap``,
``Request.mask_mod``, ``Request.score_mod``, ...), so "auto" routes around it.

A kernel written before rules, with the keywords ``is_causal, window, alibi_slopes,
softcap, sinks, sink_tokens`` in place of ``rules``, still serves: it is called with those
keywords (:meth:`headwise.rules.Rules.keywords`; ``softcap``, ``sinks`` and ``sink_tokens``
only when set, as the first signature had none of them), and :meth:`Kernel.why_not`
refuses a call with a ``mask_mod`` or ``score_mod`` for it, or with a keyword its function
does not take.

One more keyword is a hint, not an option: ``known_live=True`` tells a kernel that the
caller has read the mask's key counts and every query row may attend at least one key, so
a guard for rows that may attend nothing (the contract's zero rows) can be skipped. It is
passed only as True, only to a function that names it (``takes(fn, "known_live",
by_name=True)``), and never changes the result; ``sdpa`` takes it.

Kernels never own parameters and never validate caller input: :func:`headwise.attention`
has done that. The built-in kernels are listed in one place, ``headwise.kernels.BUILTIN``;
:func:`register` adds your own.

Kernels hold no explain-mode hooks either. Each declares, next to its ``KERNEL``, a
``stages`` function: given one :class:`Call` (the real tensors, scale, mask and flags the
kernel was handed) it returns the :class:`KernelStage` list that explain mode shows, and
:func:`headwise.functional.attend` records that list when a trace is open. A test runs the
textbook kernels under a capture of every tensor they produce and checks each described
shape and dtype against it, so a description cannot drift from its kernel.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from headwise.rules import Rules


class KernelResult(NamedTuple):
    """What a kernel returns, read by name (as ``torch.return_types`` are).

    Attributes:
        out: the output (B, H, S, Dv).
        weights: the (B, H, S, Sk) probabilities before dropout, with ``need_weights``; else None.
        lse: each row's log-sum-exp (B, H, S), natural log, with ``return_lse``; else None.
    """

    out: Tensor
    weights: Tensor | None = None
    lse: Tensor | None = None


KernelFn = Callable[..., Any]  # returns a KernelResult (one of your own may return a plain (out, weights[, lse]))
BoundFn = Callable[[Tensor, Tensor, Tensor, "Tensor | None"], Tensor]  # Kernel.bind's shortcut: (q, k, v, mask) -> out


@dataclass(frozen=True)
class Request:
    """What one attention call asks for: everything a kernel may refuse on."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    mask_kind: str  # "none", "bool" or "float"
    mask_shape: tuple[int, ...] | None
    is_causal: bool  # True also when a window is set (a window implies causal)
    dropout_p: float
    need_weights: bool
    requires_grad: bool
    window: int | None = None  # None: unlimited
    alibi: bool = False  # ALiBi slopes given
    key_padding: float | None = None  # share of padded keys (to 0.05) for a key padding mask on CPU
    key_lengths: tuple[int, ...] | None = None  # real keys per batch row, known where key_padding is
    softcap: bool = False  # logit soft-capping asked for
    sinks: bool = False  # per-head sink logits given
    value_dim: int | None = None  # Dv, v's head dim when it differs from head_dim; None: head_dim
    sink_tokens: int = 0  # keys kept visible under the window (StreamingLLM)
    mask_mod: bool = False  # a mask_mod rule given
    score_mod: str | None = None  # None: none; "additive": a bias (it has .bias); "general": any function
    score_mod_grad: bool = False  # a tensor the score_mod reads requires grad (a learned bias table)
    empty_tiles: float | None = None  # share of empty 128 x 128 tiles (to 0.05) where the mask rule knows them
    documents: tuple[tuple[int, ...], ...] | None = None  # per row, its documents' lengths: a document rule
    return_lse: bool = False  # the log-sum-exp per row is asked for
    forward_ad: bool = False  # forward-mode AD is active (a dual level, torch.func.jvp): tangents must pass
    functorch: bool = False  # a torch.func transform is active (grad, vmap, jvp, ...): wrapped tensors
    batch_invariant: bool = False  # inside headwise.batch_invariant(): only kernels that keep a row's bits serve

    @property
    def is_gqa(self) -> bool:
        return self.kv_heads != self.heads

    @property
    def key_padding_only(self) -> bool:
        """True when the mask is a pure key padding mask ``(B|1, 1, 1, Sk)``."""
        return self.mask_shape is not None and self.mask_shape[1:3] == (1, 1)

    @property
    def own_value_dim(self) -> bool:
        """True when v's head dim differs from q's and k's (``value_dim != head_dim``)."""
        return self.value_dim is not None and self.value_dim != self.head_dim


@dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class Call:
    """One kernel call, as :func:`headwise.functional.attend` made it: what ``stages`` describe.

    The fields are the kernel's own arguments (same names, same values), plus
    ``scale_given``; the rules' parts read as properties (``call.is_causal``, ``call.window``, ...).

    Attributes:
        q: queries (B, H, S, D).
        k: keys (B, Hkv, Sk, D).
        v: values (B, Hkv, Sk, Dv).
        attention_mask: the normalised mask (B|1, H|1, S|1, Sk), bool or additive float, or None.
        rules: the call's :class:`headwise.rules.Rules`.
        dropout_p: dropout probability on the weights.
        scale: the multiplier of ``q k^T`` actually used.
        need_weights: the probabilities are returned too.
        scale_given: True when the caller passed ``scale=``; False when it is ``1 / sqrt(D)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    attention_mask: Tensor | None
    rules: Rules
    dropout_p: float
    scale: float
    need_weights: bool
    scale_given: bool = False

    @property
    def is_causal(self) -> bool:
        return self.rules.is_causal or self.rules.window is not None

    @property
    def window(self) -> int | None:
        return self.rules.window

    @property
    def alibi_slopes(self) -> Tensor | None:
        return self.rules.alibi_slopes

    @property
    def softcap(self) -> float | None:
        return self.rules.softcap

    @property
    def sinks(self) -> Tensor | None:
        return self.rules.sinks

    @property
    def sink_tokens(self) -> int:
        return self.rules.sink_tokens

    @property
    def sizes(self) -> tuple[int, int, int, int, int, int]:
        """``(B, H, Hkv, S, Sk, D)``."""
        B, H, S, D = self.q.shape
        return B, H, self.k.shape[1], S, self.k.shape[2], D

    @property
    def value_dim(self) -> int:
        """Dv, v's head dim: the output's last dimension."""
        return self.v.shape[-1]


@dataclass(frozen=True)
class KernelStage:
    """One stage a kernel does, as explain mode shows it (see ``headwise.tracing.Stage``).

    Attributes:
        name: the stage, e.g. ``"scores"``.
        shape: the shape of the tensor the stage produces.
        dtype: its dtype.
        note: what happens, with the call's real values.
        fused: True when the stage stands for several done at once, without materialising them.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    note: str
    fused: bool = False


StagesFn = Callable[[Call], list[KernelStage]]


@dataclass(frozen=True, eq=False)  # identity equality and hash: one object per registration
class Kernel:
    """A registered kernel and what it can do.

    Attributes:
        name: the backend name users pass as ``backend=``.
        fn: the kernel function (signature in the module docstring).
        summary: one line for listings.
        supports_weights: can return the (B, H, S, Sk) probabilities.
        native_gqa: handles Hkv < H without copying k/v to H heads.
        fused: computes scores, mask, softmax and weighted sum in one opaque step
            (explain mode shows those stages as one).
        available: returns None when usable on this machine, else the reason it is not.
        refuses: returns None when the kernel can serve a request, else the reason.
        stages: explain mode's description of one call, in the order the kernel does the
            stages (None: the trace shows the kernel's output as one opaque stage).
        forward_ad: its function carries forward-mode tangents (``torch.autograd.forward_ad``,
            ``torch.func.jvp``); False for one built on an op or ``autograd.Function`` without
            a forward derivative, which "auto" then passes over.
        functorch: its function runs inside ``torch.func`` transforms (``grad``, ``vmap``);
            False for one built on an ``autograd.Function`` without ``setup_context`` or on
            reads of values.
        compiles: its first call for a new rule or shape family compiles (torch.compile: seconds),
            later calls reuse the graph: a measurement of its speed must call it once first, and
            it pays off only where calls repeat.
        invariant: a row's outputs and input gradients have the same bits whatever the batch,
            the padding and the query count around it: the only kind that serves inside
            :func:`headwise.batch_invariant`.
        bind: a repeated call's shortcut, or None (``fn`` always runs). Called once per
            remembered call signature (:func:`headwise.functional.prepare`) with ``fn``, the
            call's rules, its keywords (:func:`kernel_arguments`), its first q and k, and
            whether a mask comes; returns a function ``(q, k, v, mask) -> out`` (B, H, S, Dv)
            that gives ``fn``'s output bit for bit on every later call of the signature, with
            the branches that read only the signature taken once; or None where ``fn`` must
            run, and always where ``fn`` is not the function it was written for (a kernel
            copied with ``dataclasses.replace(kernel, fn=...)`` keeps its ``bind``). A masked
            call takes it only where the caller has hidden what the mask excludes.
    """

    name: str
    fn: KernelFn
    summary: str
    supports_weights: bool = False
    native_gqa: bool = False
    fused: bool = False
    available: Callable[[], str | None] = field(default=lambda: None)
    refuses: Callable[[Request], str | None] = field(default=lambda request: None)
    stages: StagesFn | None = None
    forward_ad: bool = True
    functorch: bool = True
    compiles: bool = False
    invariant: bool = False
    bind: Callable[[KernelFn, Rules, dict, Tensor, Tensor, bool], BoundFn | None] | None = None

    def why_not(self, request: Request) -> str | None:
        """None if this kernel can serve ``request``, else a short reason."""
        reason = self.available()
        if reason is not None:
            return reason
        if request.batch_invariant and not self.invariant:
            return ("cannot keep headwise.batch_invariant()'s promise: its reduction order follows the batch and the "
                    "shapes; backend 'invariant' keeps it")
        if request.need_weights and not self.supports_weights:
            return "cannot return attention weights (need_weights=True)"
        if request.functorch and not self.functorch:
            return ("cannot run inside a torch.func transform (grad, vmap, jvp); matmul, einsum, bmm and einops "
                    "can")
        if request.forward_ad and not self.forward_ad:
            return ("has no forward-mode derivative, and forward AD is active (a dual level or torch.func.jvp); "
                    "matmul, einsum, bmm and einops carry tangents")
        if request.return_lse and not takes(self.fn, "return_lse"):
            return "its function takes no return_lse= keyword: it cannot return the log-sum-exp"
        if not takes_rules(self.fn):  # a kernel written for the keywords before rules
            if request.mask_mod or request.score_mod:
                return ("its function takes no rules= keyword (a kernel written for the signature before rules), "
                        "so it cannot run a mask_mod or score_mod; take rules= and read them")
            asked = [name for name, given in (("softcap", request.softcap), ("sinks", request.sinks),
                                              ("sink_tokens", request.sink_tokens)) if given]
            missing = [name for name in asked if not takes(self.fn, name)]
            if missing:
                return (f"its function takes no {', '.join(f'{m}=' for m in missing)} keyword (a kernel written "
                        "for the signature before it); add it to the function and refuse what it cannot do in "
                        "refuses()")
        return self.refuses(request)


def takes(fn: KernelFn, keyword: str, *, by_name: bool = False) -> bool:
    """Whether ``fn`` accepts ``keyword``: by name or through ``**kwargs`` (``by_name``: by name
    only, as a hint is given, since ``**kwargs`` may be handed on to a function without it)."""
    if torch.compiler.is_compiling():  # Dynamo would trace through the memo's lru_cache, and warn
        return _takes(fn, keyword, by_name)
    return _takes_memo(fn, keyword, by_name)


def _takes(fn: KernelFn, keyword: str, by_name: bool) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): assume it does, unless by name
        return not by_name
    if keyword in parameters:
        return True
    return not by_name and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


_takes_memo = functools.lru_cache(maxsize=256)(_takes)  # eager calls read a signature once


def takes_rules(fn: KernelFn) -> bool:
    """Whether ``fn`` takes ``rules=``: a kernel of the current signature (or a wrapper that hands
    ``**kwargs`` on to one)."""
    return takes(fn, "rules")


def kernel_arguments(fn: KernelFn, rules: Rules, args: dict) -> dict:
    """The keywords ``fn`` takes besides q, k, v and the mask: ``rules=rules`` and ``args``, or for
    a kernel written before rules their keywords (``softcap``, ``sinks``, ``sink_tokens`` only
    where set) and ``args``."""
    if takes_rules(fn):
        return {"rules": rules, **args}
    old = rules.keywords()
    for name, unset in (("softcap", None), ("sinks", None), ("sink_tokens", 0)):
        if old[name] == unset:
            del old[name]
    return {**old, **args}


def call_kernel(fn: KernelFn, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rules: Rules,
                args: dict) -> KernelResult:
    """``fn(q, k, v, attention_mask=mask, **kernel_arguments(fn, rules, args))``, as a :class:`KernelResult`."""
    return run_kernel(fn, q, k, v, mask, kernel_arguments(fn, rules, args))


def run_kernel(fn: KernelFn, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, kwargs: dict) -> KernelResult:
    """``fn(q, k, v, attention_mask=mask, **kwargs)`` (``kwargs``: :func:`kernel_arguments`' keywords)
    as a :class:`KernelResult`: the one place a kernel's result is read.

    A kernel of your own may return a plain ``(out, weights)`` or ``(out, weights, lse)`` tuple;
    anything else, or no lse where ``return_lse=True`` asked for one, is a TypeError naming the kernel.
    """
    result = fn(q, k, v, attention_mask=mask, **kwargs)
    if not isinstance(result, KernelResult):
        result = _as_result(fn, result)
    if result.lse is None and kwargs.get("return_lse"):
        raise TypeError(f"kernel {_name(fn)} was asked for the log-sum-exp (return_lse=True) but returned none; "
                        "return KernelResult(out, weights, lse) with lse (B, H, S) when return_lse is True")
    return result


def _as_result(fn: KernelFn, result: Any) -> KernelResult:
    """A plain ``(out, weights)`` or ``(out, weights, lse)`` from a kernel of your own, as a :class:`KernelResult`."""
    if isinstance(result, (tuple, list)) and len(result) in (2, 3):
        return KernelResult(*result)
    got = f"a {len(result)}-{type(result).__name__}" if isinstance(result, (tuple, list)) else type(result).__name__
    raise TypeError(f"kernel {_name(fn)} returned {got}; a kernel returns headwise.kernels.KernelResult(out, "
                    "weights, lse) or a plain (out, weights) / (out, weights, lse) tuple")


def _name(fn: KernelFn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


_KERNELS: dict[str, Kernel] = {}


def add(kernel: Kernel) -> Kernel:
    """Make ``kernel`` available as ``backend=kernel.name``; ValueError if the name is taken."""
    if kernel.name in _KERNELS:
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    _KERNELS[kernel.name] = kernel
    return kernel


def register(
    name: str,
    *,
    summary: str,
    supports_weights: bool = False,
    native_gqa: bool = False,
    fused: bool = False,
    available: Callable[[], str | None] | None = None,
    refuses: Callable[[Request], str | None] | None = None,
    stages: StagesFn | None = None,
    forward_ad: bool = True,
    functorch: bool = True,
    compiles: bool = False,
    invariant: bool = False,
) -> Callable[[KernelFn], KernelFn]:
    """Decorator: register your own ``fn`` as backend ``name`` (the arguments are :class:`Kernel`'s).

    >>> @register("doubled_sdpa_demo", summary="an example")
    ... def doubled(q, k, v, **kwargs):
    ...     return KernelResult(2 * q)
    >>> "doubled_sdpa_demo" in kernels()
    True
    >>> _ = _KERNELS.pop("doubled_sdpa_demo")
    """

    def wrap(fn: KernelFn) -> KernelFn:
        add(Kernel(
            name=name,
            fn=fn,
            summary=summary,
            supports_weights=supports_weights,
            native_gqa=native_gqa,
            fused=fused,
            available=available or (lambda: None),
            refuses=refuses or (lambda request: None),
            stages=stages,
            forward_ad=forward_ad,
            functorch=functorch,
            compiles=compiles,
            invariant=invariant,
        ))
        return fn

    return wrap


def get_kernel(name: str) -> Kernel:
    """The registered kernel ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _KERNELS[name]
    except KeyError:
        known = ", ".join(repr(n) for n in ["auto", *_KERNELS])
        raise ValueError(f"unknown backend {name!r}; choose one of {known}") from None


def find_kernel(name: str) -> Kernel | None:
    """The kernel registered as ``name``, or None: a look-up for hot paths, no error."""
    return _KERNELS.get(name)


def kernels() -> dict[str, Kernel]:
    """All registered kernels by name, in registration order."""
    return dict(_KERNELS)

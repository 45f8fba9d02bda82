"""A small public kit for testing attention: the float64 oracle and the kernel contract.

- :func:`reference_attention` computes attention in float64 from the definitions (the mask
  contract, bottom-right causal alignment, window and sink tokens, ALiBi, soft-capping,
  sinks, ``mask_mod`` / ``score_mod`` and FlexAttention's ``BlockMask``), without any of
  headwise's kernels or rule helpers: the one oracle every result is checked against.
- :func:`check_kernel` runs the kernel contract (masks, rules, empty rows, NaN at excluded
  positions, GQA, the log-sum-exp, gradients) on a registered kernel or on your own
  function of the kernel signature, and returns a :class:`KernelReport` of which items it
  meets.

>>> import torch, headwise
>>> from headwise.testing import check_kernel, reference_attention
>>> q = k = v = torch.randn(1, 2, 3, 4)
>>> ref = reference_attention(q, k, v, is_causal=True)
>>> torch.allclose(headwise.attention(q, k, v, is_causal=True).double(), ref.out, atol=1e-6)
True
>>> check_kernel("matmul").ok
True

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v, N pairs (B * H * S * Sk).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["Reference", "reference_attention", "Item", "KernelReport", "check_kernel", "PAIRWISE_LIMIT"]

#: Up to this many (b, h, q_idx, kv_idx) pairs, ``mask_mod`` and ``score_mod`` are called once per
#: pair with 0-d index tensors (FlexAttention's definition); above it, once on broadcasting indices.
PAIRWISE_LIMIT = 4096


class Reference(NamedTuple):
    """The oracle's result, all float64.

    Attributes:
        out: (B, H, S, Dv) the output (after dropout, where ``keep`` is given).
        weights: (B, H, S, Sk) the softmax probabilities before dropout (with sinks a row
            sums to less than 1).
        lse: (B, H, S) each row's log-sum-exp, sinks counted; ``-inf`` where a row attends nothing.
    """

    out: Tensor
    weights: Tensor
    lse: Tensor


def _index(n: int) -> list[Tensor]:
    return [torch.tensor(i) for i in range(n)]


def _pairwise_mask(mod: Callable, B: int, H: int, S: int, Sk: int) -> Tensor:
    """``mod`` called once per pair with 0-d int64 tensors: bool (B, H, S, Sk)."""
    bs, hs, qs, ks = _index(B), _index(H), _index(S), _index(Sk)
    values = []
    for b in bs:
        for h in hs:
            for i in qs:
                for j in ks:
                    values.append(_one_bool(mod(b, h, i, j), mod))
    return torch.tensor(values, dtype=torch.bool).reshape(B, H, S, Sk)


def _one_bool(value: Any, mod: Callable) -> bool:
    if not isinstance(value, Tensor) or value.dtype != torch.bool or value.numel() != 1:
        got = type(value).__name__ if not isinstance(value, Tensor) else f"{value.dtype} {tuple(value.shape)}"
        raise TypeError(f"mask_mod {getattr(mod, '__name__', mod)!r} must return one bool per pair, got {got}")
    return bool(value)


def _indices(B: int, H: int, S: int, Sk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(S).view(1, 1, S, 1), torch.arange(Sk).view(1, 1, 1, Sk))


def evaluate_mask_mod(mod: Callable, B: int, H: int, S: int, Sk: int) -> Tensor:
    """A ``mask_mod`` on the whole (B, H, S, Sk) grid, bool, True = may attend: pair by pair up
    to :data:`PAIRWISE_LIMIT` pairs, else once on broadcasting index tensors."""
    if B * H * S * Sk == 0:
        return torch.zeros(B, H, S, Sk, dtype=torch.bool)
    if B * H * S * Sk <= PAIRWISE_LIMIT:
        return _pairwise_mask(mod, B, H, S, Sk)
    allowed = mod(*_indices(B, H, S, Sk))
    if not isinstance(allowed, Tensor) or allowed.dtype != torch.bool:
        raise TypeError(f"mask_mod {getattr(mod, '__name__', mod)!r} must return a bool tensor")
    return torch.broadcast_to(allowed, (B, H, S, Sk))


def evaluate_score_mod(mod: Callable, scores: Tensor) -> Tensor:
    """A ``score_mod`` on scores (B, H, S, Sk), in float64, differentiable: pair by pair (0-d
    scores and indices) up to :data:`PAIRWISE_LIMIT` pairs, else once on broadcasting indices."""
    B, H, S, Sk = scores.shape
    if scores.numel() == 0:
        return scores
    if scores.numel() > PAIRWISE_LIMIT:
        return torch.broadcast_to(mod(scores, *_indices(B, H, S, Sk)).double(), scores.shape)
    flat = scores.reshape(-1).unbind()  # N 0-d views, one autograd op
    bs, hs, qs, ks = _index(B), _index(H), _index(S), _index(Sk)
    out, n = [], 0
    for b in bs:
        for h in hs:
            for i in qs:
                for j in ks:
                    value = mod(flat[n], b, h, i, j)
                    if not isinstance(value, Tensor) or value.numel() != 1:
                        raise TypeError(f"score_mod {getattr(mod, '__name__', mod)!r} must return one score per "
                                        f"pair, got {type(value).__name__}")
                    out.append(value.reshape(()).double())
                    n += 1
    return torch.stack(out).reshape(B, H, S, Sk)


def _block_mask(block_mask: Any, B: int, H: int, S: int, Sk: int) -> Tensor:
    """A FlexAttention ``BlockMask`` in its dense form: partial blocks through its mask_mod,
    full blocks whole, other blocks excluded. bool (B, H, S, Sk)."""
    from torch.nn.attention.flex_attention import _ordered_to_dense

    bq, bk = block_mask.BLOCK_SIZE

    def spread(blocks: Tensor) -> Tensor:  # (B|1, H|1, nq, nk) -> (B, H, S, Sk)
        dense = blocks.bool().repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :S, :Sk]
        return dense.cpu().expand(B, H, S, Sk)

    partial = spread(_ordered_to_dense(block_mask.kv_num_blocks, block_mask.kv_indices,
                                       block_mask.kv_indices.shape[-1]))
    allowed = partial & evaluate_mask_mod(block_mask.mask_mod, B, H, S, Sk)
    if block_mask.full_kv_num_blocks is not None:
        allowed = allowed | spread(_ordered_to_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                                                     block_mask.full_kv_indices.shape[-1]))
    return allowed


def _mask_parts(mask: Any, B: int, H: int, S: int, Sk: int) -> tuple[Tensor, Tensor]:
    """The caller's mask as (allowed bool, bias float64), both (B, H, S, Sk)."""
    allowed = torch.ones(B, H, S, Sk, dtype=torch.bool)
    bias = torch.zeros(B, H, S, Sk, dtype=torch.float64)
    if mask is None:
        return allowed, bias
    if not isinstance(mask, Tensor):  # a BlockMask
        return _block_mask(mask, B, H, S, Sk), bias
    m = mask.cpu()
    m = m[:, None, None, :] if m.dim() == 2 else m[:, None] if m.dim() == 3 else m
    m = m.expand(B, H, S, Sk)
    if m.is_floating_point():
        m = m.double()
        allowed = ~torch.isneginf(m)
        bias = torch.where(allowed, m, 0.0)
    else:
        allowed = m != 0
    return allowed, bias


def reference_attention(q: Tensor, k: Tensor, v: Tensor, attention_mask: Any = None, *, is_causal: bool = False,
                        scale: float | None = None, window: int | None = None, sink_tokens: int = 0,
                        alibi_slopes: Tensor | None = None, softcap: float | None = None,
                        sinks: Tensor | None = None, mask_mod: Callable | None = None,
                        score_mod: Callable | None = None, dropout_p: float = 0.0,
                        keep: Tensor | None = None) -> Reference:
    """Attention in float64 from the definitions: the oracle for every option and rule.

    ``s = q k^T * scale``; ``s = softcap * tanh(s / softcap)``; ``s -= slope_h * |i + Sk - S - j|``;
    ``s = score_mod(s, b, h, i, j)``; ``s += attention_mask`` (float); keys are excluded by
    the mask (False, 0 or ``-inf``), the causal rule (``j <= i + Sk - S``, also with a
    window), the window (``j > i + Sk - S - window`` or ``j < sink_tokens``) and
    ``mask_mod``; softmax over ``[s, sink_h]`` without the sink column; dropout; ``@ v``.
    A row with no key outputs zeros with ``lse = -inf``. Query head ``h`` reads kv head
    ``h // (H // Hkv)``. Rules are evaluated pair by pair (up to :data:`PAIRWISE_LIMIT` pairs).

    Args:
        q: (B, H, S, D); k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv) likewise. Any dtype, device
            or strides.
        attention_mask: None, a bool / integer (True = attend) or float (additive) tensor,
            2-D (B, Sk), 3-D (B, S, Sk) or 4-D broadcasting to (B, H, S, Sk), or a
            FlexAttention ``BlockMask``.
        is_causal: as :func:`headwise.attention` takes it; so do ``scale``, ``window``,
            ``sink_tokens``, ``alibi_slopes``, ``softcap``, ``sinks``, ``mask_mod`` and ``score_mod``.
        dropout_p, keep: with ``keep`` (B, H, S, Sk) bool, the dropout keep mask to apply.

    Returns:
        :class:`Reference` ``(out, weights, lse)`` in float64 on q's device (computed on the CPU), differentiable in
        q, k, v, sinks, the slopes and whatever ``score_mod`` reads.

    >>> q = k = v = torch.ones(1, 1, 2, 1)
    >>> reference_attention(q, k, v, torch.tensor([[False, False]])).lse.tolist()
    [[[-inf, -inf]]]
    """
    device = q.device
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    B, H, S, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, D) -> (B, H, Sk, D)
    v = v.repeat_interleave(H // Hkv, dim=1)  # (B, Hkv, Sk, Dv) -> (B, H, Sk, Dv)
    allowed, bias = _mask_parts(attention_mask, B, H, S, Sk)
    pos = torch.arange(S)[:, None] + (Sk - S)  # (S, 1): each query's position among the keys
    key = torch.arange(Sk)[None, :]  # (1, Sk)
    if is_causal or window is not None:
        allowed = allowed & (key <= pos)
    if window is not None:
        allowed = allowed & ((key > pos - window) | (key < sink_tokens))
    if mask_mod is not None:
        allowed = allowed & evaluate_mask_mod(mask_mod, B, H, S, Sk)
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(D) if scale is None else scale)  # (B, H, S, Sk)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s - alibi_slopes.cpu().double()[None, :, None, None] * (pos - key).abs().double()
    if score_mod is not None:
        s = evaluate_score_mod(score_mod, s)
    s = torch.where(allowed, s + bias, -math.inf)  # (B, H, S, Sk)
    columns = s if sinks is None else torch.cat(
        [s, sinks.cpu().double()[None, :, None, None].expand(B, H, S, 1)], dim=-1)  # (B, H, S, Sk [+ 1])
    top = columns.detach().amax(-1, keepdim=True) if Sk or sinks is not None else s.new_zeros(B, H, S, 1)
    top = torch.where(torch.isfinite(top), top, 0.0)
    e = torch.exp(columns - top)  # exactly 0 where excluded
    total = e.sum(-1, keepdim=True)  # (B, H, S, 1)
    live = total > 0
    weights = (e / torch.where(live, total, 1.0))[..., :Sk]  # (B, H, S, Sk)
    lse = torch.where(live, top + torch.log(torch.where(live, total, 1.0)), -math.inf).squeeze(-1)  # (B, H, S)
    p = weights if keep is None else weights * keep.cpu() / (1 - dropout_p)
    out = p @ v  # (B, H, S, Sk) x (B, H, Sk, Dv) -> (B, H, S, Dv)
    return Reference(out.to(device), weights.to(device), lse.to(device))


# ---------------------------------------------------------------- the kernel contract


class Item(NamedTuple):
    """One item of the kernel contract: ``passed`` is True, False, or None where the kernel
    refuses the request (with its reason in ``detail``; "auto" then takes another kernel)."""

    name: str
    passed: bool | None
    detail: str


@dataclass
class KernelReport:
    """Which items of the kernel contract a kernel meets (:func:`check_kernel`)."""

    kernel: str
    items: list[Item] = field(default_factory=list)

    @property
    def failures(self) -> list[Item]:
        return [i for i in self.items if i.passed is False]

    @property
    def refused(self) -> list[Item]:
        return [i for i in self.items if i.passed is None]

    @property
    def ok(self) -> bool:
        """No item failed, and at least one ran."""
        return not self.failures and any(i.passed for i in self.items)

    def __str__(self) -> str:
        served = sum(1 for i in self.items if i.passed)
        head = (f"kernel {self.kernel!r}: {served} passed, {len(self.failures)} failed, "
                f"{len(self.refused)} refused")
        width = max((len(i.name) for i in self.items), default=0)
        marks = {True: "pass", False: "FAIL", None: "refused"}
        return "\n".join([head] + [f"  {marks[i.passed]:<7} {i.name:<{width}}  {i.detail}" for i in self.items])


@dataclass
class _Case:
    """One item's call: the inputs (float64 masters) and the keywords of headwise.attention."""

    name: str
    q: Tensor
    k: Tensor
    v: Tensor
    mask: Any = None
    options: dict = field(default_factory=dict)
    planted: tuple[Tensor, Tensor, Tensor] | None = None  # q, k, v with NaN / inf at excluded positions
    dead: Tensor | None = None  # (B, H, S) rows that must be exactly zero, gradients too


def _times(qkv: tuple[Tensor, Tensor, Tensor], factor: float) -> tuple[Tensor, Tensor, Tensor]:
    return qkv[0] * factor, qkv[1] * factor, qkv[2] * factor


def _cases(gen: torch.Generator) -> list[_Case]:
    """The contract's items, on small shapes (tiles of the Triton interpreter included)."""
    B, H, Hkv, S, Sk, D = 2, 4, 2, 5, 7, 8

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def qkv(h: int = H, hkv: int = H, s: int = S, sk: int = Sk, dv: int = D,
            b: int = B) -> tuple[Tensor, Tensor, Tensor]:
        return randn(b, h, s, D), randn(b, hkv, sk, D), randn(b, hkv, sk, dv)

    pad = torch.ones(B, Sk, dtype=torch.bool)
    pad[0, 4:] = False
    pad[1, :] = False  # batch row 1 attends nothing
    dense = torch.rand(B, H, S, Sk, generator=gen) > 0.4
    dense[0, 1, 2] = False  # one row with no key
    bias = randn(B, 1, S, Sk).masked_fill(torch.rand(B, 1, S, Sk, generator=gen) > 0.6, -math.inf)
    table = randn(2 * Sk)

    def rel(score, b, h, q_idx, kv_idx):  # a learned-looking relative bias, read by index
        return score + table[q_idx - kv_idx + Sk] * (h + 1)

    def stripes(b, h, q_idx, kv_idx):  # a plain function: even keys for even heads, and the diagonal band
        return ((kv_idx + h) % 2 == 0) | (kv_idx == q_idx + b)

    cases = [
        _Case("no mask", *qkv()),
        _Case("bool mask (B, H, S, Sk)", *qkv(), mask=dense),
        _Case("key padding (B, Sk)", *qkv(), mask=pad),
        _Case("float mask (additive, -inf blocks)", *qkv(), mask=bias),
        _Case("causal, S < Sk (bottom-right)", *qkv(), options={"is_causal": True}),
        _Case("causal, S > Sk (rows with no key)", *qkv(s=Sk, sk=S), options={"is_causal": True}),
        _Case("window and sink tokens", *qkv(), options={"window": 2, "sink_tokens": 1}),
        _Case("ALiBi", *qkv(), options={"alibi_slopes": 0.5 ** torch.arange(1.0, H + 1, dtype=torch.float64),
                                        "is_causal": True}),
        _Case("softcap", *_times(qkv(), 4.0), options={"softcap": 2.0}),
        _Case("sinks", *qkv(), mask=pad, options={"sinks": randn(H)}),
        _Case("mask_mod (a plain function)", *qkv(), options={"mask_mod": stripes}),
        _Case("score_mod (a plain function)", *qkv(), options={"score_mod": rel}),
        _Case("GQA (Hkv < H)", *qkv(hkv=Hkv), mask=dense, options={"is_causal": True}),
        _Case("Dv != D", *qkv(dv=D + 3), mask=pad),
        _Case("empty sizes (B, S, Sk = 0)", *qkv(b=0), options={"is_causal": True}),
        _Case("no keys (Sk = 0)", *qkv(sk=0)),
        _Case("no queries (S = 0)", *qkv(s=0), mask=pad),
    ]
    q, k, v = qkv(hkv=Hkv, s=Sk, sk=S)
    dead = torch.zeros(B, H, Sk, dtype=torch.bool)
    dead[1] = True  # batch row 1: every key padded
    dead[0, :, :2] = True  # causal S > Sk: the first S - Sk rows see no key
    cases.append(_Case("empty rows: zeros, zero gradients", q, k, v, mask=pad[:, :S],
                       options={"is_causal": True}, dead=dead))
    nq, nk, nv = q.clone(), k.clone(), v.clone()
    nk[0, :, 4:], nv[0, :, 4:] = math.nan, math.inf  # padded keys of row 0
    nk[1], nv[1] = -math.inf, math.nan  # every key of row 1
    nq[1], nq[0, :, :2] = math.nan, math.inf  # the rows that attend nothing
    cases.append(_Case("NaN and inf at excluded positions", q, k, v, mask=pad[:, :S], options={"is_causal": True},
                       planted=(nq, nk, nv), dead=dead))
    return cases


def _error(got: Tensor | None, want: Tensor) -> float:
    if got is None:
        return math.inf
    got = got.detach().cpu().double()
    if got.shape != want.shape:
        return math.inf
    same = ((got == want) & torch.isinf(want)) | (torch.isnan(got) & torch.isnan(want))
    diff = torch.where(same, 0.0, (got - want).abs()).nan_to_num(nan=math.inf)  # a NaN on one side only: inf
    return float(diff.max().detach()) if diff.numel() else 0.0


def _gradient_problems(leaves: list[Tensor], masters: list[Tensor], sinks: tuple[Tensor, Tensor] | None,
                       tol: float) -> list[str]:
    """dq, dk, dv (and the sinks') against the oracle's, after both backward passes ran."""
    names = ["dq", "dk", "dv"] + ([] if sinks is None else ["dsinks"])
    got = [t.grad for t in leaves] + ([] if sinks is None else [sinks[0].grad])
    want = [t.grad for t in masters] + ([] if sinks is None else [sinks[1].grad])
    problems = []
    for n, g, w in zip(names, got, want, strict=True):
        if w is None:
            continue
        err = _error(g if g is not None else torch.zeros_like(w), w)
        if err > tol * 10:
            problems.append(f"{n} off by {err:.2g}")
    return problems


def _admit(name: str, q: Tensor, k: Tensor, v: Tensor, mask: Any, options: dict,
           with_lse: bool) -> tuple[str | None, bool, bool, str]:
    """Whether backend ``name`` serves a case: ``(refusal, with_lse, gradients, note)``.

    A kernel that refuses the case with gradients but serves it without (one that runs only
    inference there) is checked without them, and one that serves the case but not its
    log-sum-exp is checked without the lse; ``note`` says which."""
    import headwise

    def refusal(lse: bool, grad: bool) -> str | None:
        with torch.set_grad_enabled(grad):
            try:
                headwise.choose_backend(q, k, v, mask, backend=name, return_lse=lse, **options)
            except ValueError as error:
                return str(error).split("\n")[0][:160]
        return None

    why, grad, note = refusal(False, True), True, ""
    if why is not None:
        if refusal(False, False) is not None:
            return why, with_lse, True, ""
        grad, note = False, "; inference only (refused with gradients)"
    if with_lse and refusal(True, grad) is not None:
        with_lse, note = False, note + "; its log-sum-exp refused"
    return None, with_lse, grad, note


def _run_case(name: str, case: _Case, dtype: torch.dtype, device: torch.device, with_lse: bool,
              gen: torch.Generator) -> tuple[Item, bool]:
    """One item: the call through headwise.attention against the oracle, outputs and gradients;
    and whether its log-sum-exp was checked."""
    import headwise

    tol = {torch.float64: 1e-8, torch.float32: 2e-4}.get(dtype, 3e-2)
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (case.planted or (case.q, case.k, case.v)))
    options: dict[str, Any] = {n: (o.to(device, dtype).requires_grad_() if n == "sinks" else
                                   o.to(device, dtype) if isinstance(o, Tensor) else o)
                               for n, o in case.options.items()}
    mask = case.mask
    if isinstance(mask, Tensor):
        mask = mask.to(device, dtype) if mask.is_floating_point() else mask.to(device)
    refusal, with_lse, grad, note = _admit(name, q, k, v, mask, options, with_lse)
    if refusal is not None:
        return Item(case.name, None, refusal), False
    try:
        with torch.set_grad_enabled(grad):
            result: Any = headwise.attention(q, k, v, mask, backend=name, return_lse=with_lse, **options)
    except Exception as error:  # noqa: BLE001 - the report says what the kernel raised
        return Item(case.name, False, f"raised {type(error).__name__}: {error}"[:200]), with_lse
    out, lse = result if with_lse else (result, None)
    masters = [t.clone().requires_grad_() for t in (case.q, case.k, case.v)]
    sinks = case.options.get("sinks")
    ref_sinks = None if sinks is None else sinks.clone().requires_grad_()
    ref = reference_attention(masters[0], masters[1], masters[2], case.mask, **{**case.options, "sinks": ref_sinks})
    problems = []
    if _error(out, ref.out) > tol:
        problems.append(f"output off by {_error(out, ref.out):.2g}")
    if with_lse and _error(lse, ref.lse) > tol:
        problems.append(f"lse off by {_error(lse, ref.lse):.2g}")
    if out.requires_grad and ref.out.requires_grad:
        dout = torch.randn(ref.out.shape, generator=gen, dtype=torch.float64)
        ref.out.backward(dout)
        try:
            out.backward(dout.to(device, out.dtype))
        except Exception as error:  # noqa: BLE001
            return Item(case.name, False, f"backward raised {type(error).__name__}: {error}"[:200]), with_lse
        pair = None if ref_sinks is None else (options["sinks"], ref_sinks)
        problems += _gradient_problems([q, k, v], masters, pair, tol)
    if case.dead is not None and bool(out[case.dead.to(device)].ne(0).any()):
        problems.append("a row that attends nothing is not zeros")
    detail = "; ".join(problems) or f"within {tol:g} of the float64 oracle"
    return Item(case.name, not problems, detail + note), with_lse


def check_kernel(kernel: str | Callable | Any, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> KernelReport:
    """Run the kernel contract on a kernel and report which items it meets.

    Each item is a small call through :func:`headwise.attention` with ``backend`` set to the
    kernel (so it sees its inputs as headwise hands them: the mask normalised, excluded
    positions made finite), compared with :func:`reference_attention`: the output, the
    log-sum-exp where the kernel returns it, and dq, dk, dv (and the sinks' gradient).
    An item the kernel refuses in its ``refuses`` is reported as refused, not failed.

    Args:
        kernel: a registered backend name, a :class:`headwise.kernels.Kernel`, or your own
            function of the kernel signature (``fn(q, k, v, *, attention_mask, rules,
            dropout_p, scale, need_weights[, return_lse])``), registered for the check only.
        dtype: the inputs' dtype (float32 by default; the tolerance follows it).
        device: where the inputs live (a GPU kernel: ``"cuda"``).
        seed: the inputs' seed.

    Returns:
        A :class:`KernelReport`; ``print`` it for the table, ``.ok`` is True when nothing failed.

    >>> print(check_kernel("einsum").items[0])
    Item(name='no mask', passed=True, detail='within 0.0002 of the float64 oracle')
    """
    from headwise.kernels.registry import _KERNELS, Kernel, add, get_kernel, takes

    added = None
    if isinstance(kernel, str):
        name = get_kernel(kernel).name
    else:
        if not isinstance(kernel, Kernel):
            if not callable(kernel):
                raise TypeError(f"check_kernel takes a backend name, a Kernel or a kernel function, got "
                                f"{type(kernel).__name__}")
            kernel = Kernel(name=f"check_kernel:{getattr(kernel, '__name__', 'kernel')}:{id(kernel)}", fn=kernel,
                            summary="under check_kernel")
        name = kernel.name
        if _KERNELS.get(name) is not kernel:
            added = add(kernel)
    try:
        with_lse = takes(get_kernel(name).fn, "return_lse")
        gen = torch.Generator().manual_seed(seed)
        report = KernelReport(name)
        checked = 0  # items whose log-sum-exp was checked
        for case in _cases(gen):
            item, lse = _run_case(name, case, dtype, torch.device(device), with_lse, gen)
            report.items.append(item)
            checked += lse
        if not with_lse:
            report.items.append(Item("log-sum-exp", None, "its function takes no return_lse= keyword"))
        elif not checked:
            report.items.append(Item("log-sum-exp", None, "refused for every item here (device, dtype, gradients)"))
        return report
    finally:
        if added is not None:
            _KERNELS.pop(added.name, None)

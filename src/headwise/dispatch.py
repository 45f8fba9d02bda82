"""Which kernel runs, and why: the readable rules behind ``backend="auto"``.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.

The rules, measured on a 2-core CPU with torch 2.13 (see ``headwise bench``); every
threshold they read lives in :mod:`headwise.policy` with the benchmark that sets it:

1. ``need_weights=True``: only kernels that materialise the probabilities can serve;
   ``matmul`` is the plainest of them and as fast as the other textbook forms.
2. Otherwise ``sdpa``: PyTorch's fused kernel, the fastest dense path on CPU and GPU.
3. On CUDA in fp16/bf16 with a mask, a window, ALiBi, causal with S != Sk or attention
   sinks (where SDPA's flash kernel cannot run), or logit soft-capping (which SDPA cannot
   do at all): ``triton``, which keeps them fused.
4. With a key padding mask whose key counts can be read without a device sync (on the
   CPU) and that pads at least ``VARLEN_MIN_PADDING`` of the keys: ``varlen``, which drops
   the padded keys per batch row, where :func:`headwise.policy.estimate_varlen` prices it
   under SDPA (the multiply-adds it saves against its fixed cost per call); the reason
   gives both estimates.
5. Attention sinks on CPU: SDPA takes them as one zero key whose float mask column is
   the sink logit, and an explicit mask keeps it off its fused kernel. From
   ``SINKS_CHUNKED_MIN_SCORES`` scores per head (S x Sk), when gradients are needed or
   the mask is per query (causal, window, ALiBi, a 3-D/4-D mask): ``chunked``, which
   applies the sinks from its log-sum-exp.
6. Except when SDPA cannot use a fused kernel (dropout on CPU) and its fallback would
   materialise a large (B, H, S, Sk) score matrix: then ``chunked``, whose memory grows
   as O(S), runs instead.

Logit soft-capping is refused by ``sdpa`` and ``varlen`` (SDPA cannot cap), so "auto"
runs the next kernel of the ranking that can.

Inside :func:`headwise.batch_invariant`, before every other rule:

0. ``invariant``, the one kernel whose reduction order is fixed by key positions alone; a
   request it cannot serve is refused with its reason, and a backend asked for by name that
   cannot keep the promise is refused too.

With rules as functions (``mask_mod`` / ``score_mod``), before rules 2-6:

7. A document mask over contiguous documents (with or without causal or a window):
   ``varlen``, which attends each document on its own, as ``packed_attention`` does.
8. A general ``score_mod`` (not a bias): ``chunked``, which runs it a block of rows at a
   time under autograd (O(S) memory; SDPA and varlen cannot apply a function).
9. A mask rule that knows its tiles, with at least ``RULES_CHUNKED_MIN_EMPTY`` of them
   empty and ``RULES_CHUNKED_MIN_SCORES`` scores per head: ``chunked``, which skips them;
   otherwise ``sdpa`` with the rules materialised as one mask (a bias score_mod added).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from headwise import calibration, policy
from headwise.kernels.registry import Kernel, Request, find_kernel, get_kernel, kernels
from headwise.kernels.varlen import call_shapes as varlen_calls

logger = logging.getLogger(__name__)

_WEIGHT_ORDER = ("matmul", "einsum", "einops", "bmm")
_DEFAULT_ORDER = ("sdpa", "chunked", "matmul", "einsum", "einops", "bmm")
_LOW_MEMORY_ORDER = ("chunked", "sdpa", "matmul", "einsum", "einops", "bmm")
_CUDA_STRUCTURED_ORDER = ("triton", "sdpa", "chunked", "matmul", "einsum", "einops", "bmm")
_VARLEN_ORDER = ("varlen", "sdpa", "chunked", "matmul", "einsum", "einops", "bmm")
_INVARIANT_ORDER = ("invariant",)
_COST = {
    "varlen": "attends per row or per length bucket: pays off only when many keys are padding",
    "triton": "fused on CUDA for masks, windows and ALiBi; SDPA's flash kernel is kept for the plain cases",
    "sdpa": "PyTorch's fused kernel, unfused when it cannot fuse the request",
    "chunked": "a Python loop over tiles: slower than a fused kernel, its gain is O(S) memory",
    "invariant": "keeps a row's bits whatever the batch (fixed key blocks): for headwise.batch_invariant()",
    "flex": "torch's compiled flex_attention: seconds to compile per rule and shape family, not ranked until measured",
    "matmul": "materialises the (B, H, S, Sk) scores: slower than a fused kernel",
    "einsum": "materialises the (B, H, S, Sk) scores: slower than a fused kernel",
    "einops": "materialises the (B, H, S, Sk) scores: slower than a fused kernel",
    "bmm": "materialises the (B, H, S, Sk) scores and copies grouped k/v heads",
}


@dataclass(frozen=True)
class Dispatch:
    """The outcome of backend selection for one request.

    Attributes:
        backend: the kernel that runs (for the module's context-parallel path: the method,
            ``"ring"`` or ``"ulysses"``; for its fused path ``"native_mha"``, torch's op).
        reason: why it was chosen.
        passed_over: every other registered kernel with the reason it was not chosen.
        request: what was asked for.
        path: for :meth:`headwise.MultiHeadAttention.dispatch`, the module's path around
            the kernel: ``"dense"``, ``"packed"``, ``"fused"``, ``"context parallel"`` or ``"paged"`` (see
            :class:`headwise.module.Plan`); ``"dense"`` for the function.
        path_reason: why that path ("" for the function).
    """

    backend: str
    reason: str
    passed_over: Mapping[str, str] = field(default_factory=dict)
    request: Request | None = None
    path: str = "dense"
    path_reason: str = ""

    @property
    def kernel(self) -> Kernel | None:
        """The registered kernel that runs; None where ``backend`` names no kernel (a
        context-parallel method)."""
        return find_kernel(self.backend)

    def __str__(self) -> str:
        lines = [f"path {self.path!r}: {self.path_reason}"] if self.path_reason else []
        lines += [f"backend {self.backend!r}: {self.reason}"]
        lines += [f"  passed over {name!r}: {why}" for name, why in self.passed_over.items()]
        return "\n".join(lines)


def _scores_bytes(r: Request) -> int:
    return r.batch * r.heads * r.q_len * r.k_len * r.dtype.itemsize


def _ranking(r: Request, budget: int, varlen: tuple[float, policy.Costs, policy.Costs],
             sinks_min: int = 0) -> tuple[tuple[str, ...], str]:
    """Preference order for a request, and the sentence that explains it."""
    if r.batch_invariant:
        return _INVARIANT_ORDER, ("inside headwise.batch_invariant(): the one kernel whose reduction order is fixed by "
                                  "key positions alone (blocks of 32 keys at fixed offsets from each row's first "
                                  "key), so a row's bits do not depend on the batch, the padding or the query count")
    if r.need_weights:
        return _WEIGHT_ORDER, "need_weights=True: it returns the probabilities and is the plainest"
    structured = r.mask_kind != "none" or r.window is not None or r.alibi or (r.is_causal and r.q_len != r.k_len)
    if r.device.type == "cuda" and (r.return_lse or r.dtype in (torch.float16, torch.bfloat16) and (
            structured or r.softcap or r.sinks)):
        if r.return_lse:
            return _CUDA_STRUCTURED_ORDER, ("the log-sum-exp on CUDA: triton returns it from its fused kernel (SDPA "
                                            "returns it only on the CPU here)")
        return _CUDA_STRUCTURED_ORDER, (
            "SDPA's flash kernel takes no mask, window, ALiBi, bottom-right causal with S != Sk or sinks and "
            "falls back to slower kernels (and cannot soft-cap); triton keeps them fused and skips padded key tiles"
        )
    if r.mask_mod or r.score_mod:
        return _rules_ranking(r, budget)
    min_padding, inference, training = varlen
    if r.key_lengths is not None and r.key_padding is not None and r.key_padding >= min_padding and r.batch > 1:
        estimate = policy.estimate_varlen(
            r.batch, r.heads, r.kv_heads, r.q_len, r.k_len, r.head_dim,
            varlen_calls(list(r.key_lengths) * (r.batch // len(r.key_lengths))),
            is_causal=r.is_causal, training=r.requires_grad, costs=training if r.requires_grad else inference)
        # the exact share for the words: key_padding is rounded to 0.05 (a memo key), and the
        # module's path reason says the exact share of the same mask
        share = 1.0 - sum(r.key_lengths) / (len(r.key_lengths) * r.k_len)
        if estimate.drops:
            return _VARLEN_ORDER, (
                f"{share:.0%} of the keys are padding: varlen drops them per row, {estimate}; "
                f"{calibration.describe()}"
            )
        priced = f"; {share:.0%} of the keys are padding, but {estimate}; {calibration.describe()}"
    else:
        priced = ""
    per_query = r.is_causal or r.alibi or (r.mask_shape is not None and r.mask_shape[2] != 1)
    if (r.sinks and r.device.type == "cpu" and r.q_len * r.k_len >= sinks_min
            and (r.requires_grad or per_query)):
        return _LOW_MEMORY_ORDER, (
            f"sinks on CPU with S x Sk = {r.q_len * r.k_len} >= SINKS_CHUNKED_MIN_SCORES {sinks_min} and "
            f"{'gradients' if r.requires_grad else 'a per-query mask'}: SDPA's sink column needs an explicit "
            "float mask, which keeps it off its fused kernel; chunked applies the sinks from its log-sum-exp"
        )
    size = _scores_bytes(r)
    if r.device.type == "cpu" and r.dropout_p > 0 and size > budget:
        return _LOW_MEMORY_ORDER, (
            f"dropout on CPU keeps SDPA off its fused kernel, and its fallback would hold "
            f"{size / 2**20:.0f} MiB of scores (budget {budget / 2**20:.0f} MiB); "
            "chunked keeps O(S) memory"
        )
    return _DEFAULT_ORDER, "PyTorch's fused kernel is the fastest dense path" + priced


def _rules_ranking(r: Request, budget: int) -> tuple[tuple[str, ...], str]:
    """Preference order for a call with a mask_mod or score_mod (rules 7-9 of the module docstring)."""
    if r.documents is not None:
        counts = [len(row) for row in r.documents]
        longest = max((max(row, default=0) for row in r.documents), default=0)  # B = 0 or S = 0: 0
        return _VARLEN_ORDER, (f"a document mask over contiguous documents ({sum(counts)} in {len(counts)} "
                               f"row{'s' if len(counts) > 1 else ''}, the longest {longest} tokens): varlen attends "
                               "each document on its own, as packed_attention does")
    if r.score_mod == "general":
        return _LOW_MEMORY_ORDER, ("a general score_mod: chunked runs it a block of rows at a time under autograd "
                                   "(O(S) memory); SDPA takes only an additive mask")
    scores = r.q_len * r.k_len
    if r.empty_tiles is not None and r.empty_tiles >= policy.RULES_CHUNKED_MIN_EMPTY and (
            scores >= policy.RULES_CHUNKED_MIN_SCORES):
        return _LOW_MEMORY_ORDER, (f"{r.empty_tiles:.0%} of the mask rule's tiles are empty (>= "
                                   f"RULES_CHUNKED_MIN_EMPTY {policy.RULES_CHUNKED_MIN_EMPTY:.0%}, S x Sk = {scores}): "
                                   "chunked skips them")
    size = _scores_bytes(r)
    if size > budget:
        return _LOW_MEMORY_ORDER, (f"the rules materialised would hold {size / 2**20:.0f} MiB (budget "
                                   f"{budget / 2**20:.0f} MiB); chunked evaluates them tile by tile")
    known = "" if r.empty_tiles is None else f" ({r.empty_tiles:.0%} of its tiles empty)"
    return _DEFAULT_ORDER, f"SDPA with the rules materialised as one mask{known}"


def select(request: Request, backend: str = "auto") -> Dispatch:
    """Pick the kernel for ``request``.

    The decision depends only on the request and the registry, so it is memoised: a
    forward in a training loop pays a dictionary look-up, not the ranking.

    Args:
        request: the validated call description.
        backend: ``"auto"`` or a registered name.

    Returns:
        The :class:`Dispatch`, with reasons for every kernel passed over.

    Raises:
        ValueError: unknown backend, or a named backend that cannot serve the request
            (the message says why and which backends can).
    """
    compiling = torch.compiler.is_compiling()
    if request.key_lengths is not None:  # varlen is priced with this machine's unit costs
        calibration.current()
    # Under torch.compile the decision is traced once per graph: no memo, no logging (neither traces).
    select_ = _select.__wrapped__ if compiling else _select
    dispatch = select_(request, backend, tuple(kernels().values()), policy.SCORES_BUDGET_BYTES,
                       (policy.VARLEN_MIN_PADDING, policy.INFERENCE_COSTS, policy.TRAINING_COSTS),
                       (policy.BUCKET_SLACK, policy.DIRECT_MIN_LENGTH), policy.SINKS_CHUNKED_MIN_SCORES)
    if backend == "auto" and not compiling and logger.isEnabledFor(logging.DEBUG):
        logger.debug("auto chose %s", dispatch)
    return dispatch


@functools.lru_cache(maxsize=1024)
def _select(request: Request, backend: str, registered: tuple[Kernel, ...], budget: int,
            varlen: tuple[float, policy.Costs, policy.Costs], bucketing: tuple[float, int],
            sinks_min: int = 0) -> Dispatch:
    # The cache key holds everything the decision reads: the request, the registered
    # kernel objects (identity-hashed, so re-registering or replacing one invalidates
    # earlier decisions), the thresholds and unit costs, and the bucketing policy that
    # varlen_calls reads. A kernel's ``available()`` is taken to be fixed for the life
    # of the process.
    registry = {kernel.name: kernel for kernel in registered}
    if backend != "auto":
        kernel = get_kernel(backend)
        why = kernel.why_not(request)
        if why is not None:
            able = [n for n, k in registry.items() if k.why_not(request) is None]
            raise ValueError(
                f"backend {backend!r} {why}; use backend='auto' or one of {able}"
            )
        others = {n: f"backend={backend!r} was requested" for n in registry if n != backend}
        return Dispatch(backend, "requested explicitly", MappingProxyType(others), request)
    ranking, because = _ranking(request, budget, varlen, sinks_min)
    order = [n for n in ranking if n in registry] + [n for n in registry if n not in ranking]
    passed: dict[str, str] = {}
    chosen = None
    for name in order:
        why = registry[name].why_not(request)
        if chosen is None and why is None:
            chosen = name
        elif why is not None:
            passed[name] = why
        else:
            cost = _COST.get(name)
            passed[name] = f"ranked below {chosen!r}" + (f" ({cost})" if cost else "")
    if chosen is None and request.batch_invariant:
        raise ValueError(f"inside headwise.batch_invariant() no kernel keeps the promise for this call: backend "
                         f"'invariant' {passed.get('invariant', 'is not registered')}; attend outside the mode "
                         "(with headwise.batch_invariant(False): ...) or drop what it refuses")
    if chosen is None:  # matmul serves everything; only a broken registry gets here
        raise RuntimeError(f"no registered backend can serve {request}: {passed}")
    reason = because if order[0] == chosen else f"first able backend in the ranking ({because})"
    if request.is_gqa and not registry[chosen].native_gqa:
        reason += "; it copies k/v to all query heads for grouped-query attention"
    return Dispatch(chosen, reason, MappingProxyType(passed), request)

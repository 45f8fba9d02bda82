"""PyTorch's ``scaled_dot_product_attention``, held to headwise's mask contract.

Three things differ between torch's SDPA and our contract, and are handled here:

* ``is_causal=True`` in SDPA is top-left aligned; ours is bottom-right. They agree only
  when S == Sk, so that is the only case handed to SDPA's own causal path; otherwise the
  causal rule is folded into an explicit mask.
* SDPA cannot take a mask and ``is_causal`` together: they are combined into one mask,
  with the sliding window and the ALiBi bias when asked for.
* A query row that may attend nothing must give zeros and zero gradients on every torch
  version: such rows are unblocked before the call (so no 0/0 arises inside SDPA) and
  zeroed after it (so no gradient leaves them).

Attention sinks are exact through SDPA's own arguments: one zero key and one zero value
are appended, and the additive mask's column for that key is the head's sink logit, so
``q . 0 * scale + sink_h = sink_h`` joins the softmax's denominator and adds nothing to
the output (gradients reach the sinks through the mask). It costs a copy of k and v one
key longer and an explicit float mask. Logit soft-capping cannot be expressed: SDPA
applies no function to the scores between the product and the softmax, so the kernel
refuses ``softcap``.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from headwise import policy
from headwise.kernels import describe
from headwise.kernels.common import fold_rules, lse_dtype
from headwise.kernels.registry import BoundFn, Call, Kernel, KernelFn, KernelResult, KernelStage, Request
from headwise.masks import row_is_dead
from headwise.rules import Rules

# enable_gqa arrived in torch 2.5; before it, kv heads are repeated (a copy).
_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float, scale: float) -> Tensor:
    """SDPA with one explicit mask (B|1, H|1, S|1, Sk), dead rows made safe: (B, H, S, Dv).

    Rows that may attend nothing are unblocked before the call (no 0/0 inside SDPA) and
    zeroed after it (no gradient leaves them). ``mask=None``: every key visible. Shared
    with the ``varlen`` kernel.
    """
    k, v, extra = _grouped(q, k, v)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, **extra)  # (B, H, S, Dv)
        return keep_nan_rows(out, q)
    dead = row_is_dead(mask)  # (B|1, H|1, S|1, 1)
    if policy.reads_values(dead) and not bool(dead.any()):  # known live (a free read on the CPU):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                              **extra)  # (B, H, S, Dv), no passes over mask and output
    mask = mask | dead if mask.dtype == torch.bool else mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                         **extra)  # (B, H, S, Dv)
    return out.masked_fill(dead, 0.0)


_FLASH_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _FlashWithLse(torch.autograd.Function):
    """SDPA's CPU flash kernel with its log-sum-exp as a second differentiable output.

    ``d lse_i / d s_ij = p_ij``, so the lse's gradient ``g`` joins the kernel's
    ``delta_i = rowsum(dO_i * O_i)`` as ``delta_i - g_i``. The kernel computes delta from the
    ``out`` it is handed, so backward hands it one more value column: zero values, output
    ``-g`` and output gradient 1, which adds nothing to dp and exactly ``-g`` to delta.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        ctx.set_materialize_grads(False)
        out, lse = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)  # (B, H, S, Dv), (B, H, S)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.args = (is_causal, scale)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        is_causal, scale = ctx.args
        D = v.shape[-1]  # the kernel's one head dim (sdpa_lse pads to it)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        if dlse is not None:  # the extra value column: values 0, output -dlse, output gradient 1
            q, k, v = (F.pad(t, (0, 1)) for t in (q, k, v))  # (B, H, S|Sk, D + 1): a zero column changes no score
            out = torch.cat([out, -dlse.to(out.dtype).unsqueeze(-1)], dim=-1)  # (B, H, S, D + 1)
            dout = torch.cat([dout, torch.ones_like(dout[..., :1])], dim=-1)  # (B, H, S, D + 1)
        dq, dk, dv = _FLASH_CPU_BACKWARD(dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale)
        return dq[..., :D], dk[..., :D], dv[..., :D], None, None, None


def sdpa_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool,
             scale: float) -> tuple[Tensor, Tensor]:
    """SDPA's CPU flash kernel with the log-sum-exp: ``(out (B, H, S, Dv), lse (B, H, S))``.

    ``mask`` (B|1, H|1, S|1, Sk) bool or float, without gradients (the kernel's backward
    returns none for it); rows that may attend nothing are zeros with ``lse = -inf``. k and
    v are repeated to H heads for grouped-query attention, and the narrower of the head
    dims is padded with zeros to the wider (the kernel takes equal head counts and head
    dims; zero columns change no score and no output). An operand whose last dimension has
    stride != 1 is copied first, as the kernel misreads it (:func:`_unit_last_stride`).
    """
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        raise ValueError("sdpa_lse: the CPU flash kernel returns no gradient for the mask, and this mask requires "
                         "one (learned sinks or bias); run the textbook formula instead")
    H, D, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    if Dv != D:
        width = max(D, Dv)
        q, k = (F.pad(t, (0, width - D)) for t in (q, k))  # (B, H|Hkv, S|Sk, width)
        v = F.pad(v, (0, width - Dv))  # (B, Hkv, Sk, width)
    if k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, Hkv, Sk, D) -> (B, H, Sk, D)
        v = v.repeat_interleave(H // v.shape[1], dim=1)  # (B, Hkv, Sk, Dv) -> (B, H, Sk, Dv)
    dead = None
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        dead = row_is_dead(mask)  # (B|1, H|1, S|1, 1)
        mask = mask.to(q.dtype).masked_fill(dead, 0.0)  # a dead row attends everything, then is zeroed
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    out, lse = _FlashWithLse.apply(q, k, v, mask, is_causal, scale)  # (B, H, S, width), (B, H, S)
    out, lse = out[..., :Dv], lse.to(lse_dtype(q.dtype))  # (B, H, S, Dv)
    if dead is not None:
        out = out.masked_fill(dead, 0.0)
        lse = lse.masked_fill(dead[..., 0], float("-inf"))
    return out, lse


def _unit_last_stride(t: Tensor) -> Tensor:
    """``t`` where its last dimension has stride 1, else a contiguous copy of it.

    torch's CPU flash kernel (``_FLASH_CPU``, torch 2.13) reads an operand whose last stride
    is not 1 wrongly (vLLM's value layout ``(N, Hkv, D, P).transpose(-1, -2)``, a slice
    ``x[..., ::2]``, a head dim expanded from one element): output and lse off by about 2.
    Every other stride, storage offset and expansion it reads right, so only these are copied.
    """
    return t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)


def keep_nan_rows(out: Tensor, q: Tensor) -> Tensor:
    """``out`` (B, H, S, Dv) with NaN in the rows whose query (B, H, S, D) holds NaN or inf.

    Without a mask, torch's CPU flash kernel returns a zero row for such a query (its row
    maximum skips NaN, so the row looks as if it attended nothing), which would turn a
    live NaN into zeros; ``out + 0 * rowsum(q)`` is NaN exactly there. Its backward is
    already NaN, so the sum is taken outside autograd. Where q's values can be read, one
    sum over q says whether any row needs it (the common case: none).
    """
    if not q.is_cpu:
        return out
    if q.requires_grad:
        q = q.detach()
    if policy.reads_values(q) and math.isfinite(q.sum()):  # one reduction, no pass over out:
        return out  # finite unless a query holds NaN or inf (an overflow only takes the longer way)
    return torch.add(out, q.sum(-1, keepdim=True), alpha=0)  # (B, H, S, Dv) + 0 * (B, H, S, 1)


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, dict]:
    """k, v and SDPA's extra arguments for grouped-query heads."""
    if k.shape[1] == q.shape[1]:
        return k, v, {}
    if SDPA_HAS_GQA:
        return k, v, {"enable_gqa": True}
    G = q.shape[1] // k.shape[1]
    # (B, Hkv, Sk, D) -> (B, H, Sk, D): a copy, only on torch < 2.5
    return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), {}


def _own_arguments(attention_mask: Tensor | None, rules: Rules, S: int, Sk: int) -> bool:
    """True when SDPA's own arguments express the call: no mask, no rule but plain causal,
    and causal only where S == Sk (SDPA's causal is top-left aligned, ours bottom-right)."""
    return attention_mask is None and rules.plain and (not rules.is_causal or S == Sk)


def with_sink(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
              sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """k, v and the mask with one more key, the sink: a zero key and value whose mask
    column is the head's sink logit. Shared with the ``varlen`` kernel.

    Args:
        q: queries (B, H, S, D).
        k: keys (B, Hkv, Sk, D).
        v: values (B, Hkv, Sk, Dv).
        mask: (B|1, H|1, S|1, Sk) bool (True = attend) or additive float, or None.
        sinks: (H,) sink logits.

    Returns:
        ``(k, v, mask)``: (B, Hkv, Sk + 1, D), (B, Hkv, Sk + 1, Dv) and a float mask
        (B|1, H, S|1, Sk + 1).
    """
    B, H, S, _ = q.shape
    Sk = k.shape[2]
    k = torch.cat([k, k.new_zeros(B, k.shape[1], 1, k.shape[3])], dim=2)  # (B, Hkv, Sk + 1, D)
    v = torch.cat([v, v.new_zeros(B, v.shape[1], 1, v.shape[3])], dim=2)  # (B, Hkv, Sk + 1, Dv)
    if mask is None:
        mask = q.new_zeros(1, 1, 1, Sk)  # (1, 1, 1, Sk): every key visible
    elif mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    b, s = mask.shape[0], mask.shape[2]
    column = sinks.to(q.dtype).reshape(1, H, 1, 1).expand(b, H, s, 1)  # (H,) -> (B|1, H, S|1, 1)
    mask = torch.cat([mask.expand(b, H, s, Sk), column], dim=-1)  # (B|1, H, S|1, Sk + 1)
    return k, v, mask


def _folded_mask(q: Tensor, k: Tensor, attention_mask: Tensor | None, rules: Rules) -> Tensor | None:
    """The one mask SDPA gets (B|1, H|1, S|1, Sk): the caller's, with the mask rules (causal,
    window, sink tokens, mask_mod) and the additive score rules (ALiBi, a bias score_mod) folded in."""
    B, H, S, _ = q.shape
    return fold_rules(attention_mask, rules, B, H, S, k.shape[-2], q.device, q.dtype)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    rules: Rules,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    known_live: bool = False,  # the caller read the mask: every query row may attend a key
    return_lse: bool = False,  # True: the result's lse (B, H, S) too; CPU only, no dropout
) -> KernelResult:
    if return_lse:
        return _with_lse(q, k, v, attention_mask, rules, dropout_p, scale)
    if _own_arguments(attention_mask, rules, q.shape[-2], k.shape[-2]):
        k, v, extra = _grouped(q, k, v)
        # only the arguments that differ from SDPA's defaults: each keyword costs its parser
        # about half a microsecond, a visible share of a decoding step's attention
        if dropout_p:
            extra["dropout_p"] = dropout_p
        if rules.is_causal:
            extra["is_causal"] = True
        D = q.shape[-1]  # a tensor under torch.jit.trace: the scale is then always passed
        if not isinstance(D, int) or scale != 1.0 / math.sqrt(D):  # SDPA's own default, the same double
            extra["scale"] = scale
        out = F.scaled_dot_product_attention(q, k, v, **extra)  # (B, H, S, Dv)
        return KernelResult(keep_nan_rows(out, q))
    if not rules.additive:
        raise ValueError(f"the sdpa kernel cannot apply softcap={rules.softcap} or a general score_mod "
                         f"({rules.describe() or 'none'}): F.scaled_dot_product_attention takes only an additive "
                         "mask; use backend 'chunked' or 'matmul'")
    if known_live and rules.plain and not rules.is_causal:
        # the mask alone, every row with a key: SDPA as is, without the dead-row guard's reduction
        # over the mask (~4 us a call on the CPU); with a rule folded in, the guard runs
        k, v, extra = _grouped(q, k, v)
        return KernelResult(F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=dropout_p,
                                                           scale=scale, **extra))  # (B, H, S, Dv)
    mask = _folded_mask(q, k, attention_mask, rules)  # (B|1, H|1, S|1, Sk)
    if rules.sinks is not None:
        k, v, mask = with_sink(q, k, v, mask, rules.sinks)  # one more key: (.., Sk + 1, ..)
    return KernelResult(sdpa_masked(q, k, v, mask, dropout_p=dropout_p, scale=scale))  # (B, H, S, Dv)


def _bind(fn: KernelFn, rules: Rules, kwargs: dict, q: Tensor, k: Tensor, masked: bool) -> BoundFn | None:
    """The ``bind`` of this kernel (see :class:`~headwise.kernels.registry.Kernel`): what
    :func:`sdpa_attention` runs for a remembered signature's later calls, its branches taken
    once. A decoding step's attention is a few dozen microseconds on the CPU; the Python
    around one SDPA call is a visible part of it.

    Only the two common forms: no mask and no rule (SDPA as is, then :func:`keep_nan_rows`),
    and a mask whose every query row has a key (``known_live``, no rule). None for the rest
    (causal, rules, weights, the lse, grouped heads where SDPA takes none)."""
    if (fn is not sdpa_attention or not rules.plain or rules.is_causal or kwargs.get("need_weights")
            or kwargs.get("return_lse") or set(kwargs) - _BOUND_KEYWORDS):
        return None
    extra: dict[str, Any] = {}
    if k.shape[1] != q.shape[1]:
        if not SDPA_HAS_GQA:
            return None
        extra["enable_gqa"] = True
    dropout_p, scale = kwargs["dropout_p"], kwargs["scale"]
    if masked:
        if not kwargs.get("known_live"):
            return None
        extra.update(dropout_p=dropout_p, scale=scale)

        def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)  # (B, H, S, Dv)

        return masked_sdpa
    if dropout_p:
        extra["dropout_p"] = dropout_p
    if scale != 1.0 / math.sqrt(q.shape[-1]):  # as sdpa_attention passes it: only where not SDPA's default
        extra["scale"] = scale

    def plain_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        return keep_nan_rows(F.scaled_dot_product_attention(q, k, v, **extra), q)  # (B, H, S, Dv)

    return plain_sdpa


_BOUND_KEYWORDS = {"rules", "dropout_p", "scale", "need_weights", "known_live", "return_lse"}


def _with_lse(q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None, rules: Rules, dropout_p: float,
              scale: float) -> KernelResult:
    """:func:`sdpa_attention` with ``return_lse``: ``(out, None, lse)`` from the CPU flash kernel."""
    if not rules.additive:
        raise ValueError(f"the sdpa kernel cannot apply softcap={rules.softcap} or a general score_mod "
                         f"({rules.describe() or 'none'}); use backend 'chunked' or 'matmul'")
    if q.device.type != "cpu" or _FLASH_CPU is None or dropout_p > 0:
        raise ValueError(f"the sdpa kernel returns the log-sum-exp only on the CPU without dropout (device "
                         f"{q.device.type}, dropout_p={dropout_p}); use backend 'chunked'")
    S, Sk = q.shape[-2], k.shape[-2]
    own = _own_arguments(attention_mask, rules, S, Sk)
    mask = None if own else _folded_mask(q, k, attention_mask, rules)  # (B|1, H|1, S|1, Sk)
    learns = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (mask, rules.sinks))
    if learns:
        # A mask that learns (sink logits, a bias table) needs the probabilities for its gradient, which
        # the flash kernel's backward does not give: the textbook formula runs, with the caller's arguments.
        from headwise.kernels.matmul import matmul_attention  # the oracle kernel, imported where it is needed

        return matmul_attention(q, k, v, attention_mask=attention_mask, rules=rules, dropout_p=0.0, scale=scale,
                                need_weights=False, return_lse=True)
    if rules.sinks is not None:
        k, v, mask = with_sink(q, k, v, mask, rules.sinks)  # one more key: (.., Sk + 1, ..)
    out, lse = sdpa_lse(q, k, v, mask, is_causal=own and rules.is_causal, scale=scale)
    return KernelResult(out, None, lse)


def _refuses(r: Request) -> str | None:
    # no advice here: a named backend's refusal ends with the backends that can serve it
    if r.softcap:
        return ("cannot soft-cap the scores (softcap): F.scaled_dot_product_attention applies no function "
                "between q k^T and the softmax")
    if r.return_lse and (r.device.type != "cpu" or r.dropout_p > 0):
        return (f"returns the log-sum-exp only from torch's CPU flash kernel, without dropout (device "
                f"{r.device.type}, dropout_p={r.dropout_p})")
    if r.score_mod == "general":
        return ("cannot run a general score_mod: F.scaled_dot_product_attention takes only an additive mask "
                "(a score_mod with a bias(b, h, q_idx, kv_idx) method, as relative_position_bias, is folded into it)")
    return None


_TORCH_BACKENDS = {0: "math", 1: "flash attention", 2: "memory-efficient", 3: "cuDNN", 4: "overrideable"}


def torch_backend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, dropout_p: float, is_causal: bool,
                  scale: float) -> str | None:
    """The backend ``F.scaled_dot_product_attention`` picks for these arguments, for explain mode.

    Asks torch's private ``torch._fused_sdp_choice`` (it honours ``sdpa_kernel`` contexts);
    None where torch lacks it or it fails.
    """
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return None
    k, v, extra = _grouped(q, k, v)
    try:
        choice = choose(q, k, v, mask, dropout_p, is_causal, scale=scale, **extra)
    except (RuntimeError, TypeError, ValueError):
        return None
    return _TORCH_BACKENDS.get(int(choice))


def unmaterialised(call: Call, backend: str | None, scores: str = "scores") -> str:
    """What SDPA's choice of backend means for the (B, H, S, Sk) scores of ``call``."""
    shape = describe.scores_shape(call)
    if backend == "math":
        return f"{scores} {shape} materialised inside torch's math backend"
    if backend is None:
        return f"{scores} {shape} not materialised where torch has a fused backend"
    return f"{scores} {shape} not materialised (torch's {backend} backend)"


def sdpa_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`sdpa_attention` for one call: one fused stage that names
    SDPA's arguments, the mask it was given and what it did not materialise."""
    q, k, v = call.q, call.k, call.v
    _, H, Hkv, S, Sk, _ = call.sizes
    grouped = ""
    if Hkv != H:
        grouped = (describe.shared_kv(call) + " (enable_gqa)" if SDPA_HAS_GQA
                   else f"; k, v repeated to H = {H} heads first (a copy; torch < 2.5 has no enable_gqa)")
    if _own_arguments(call.attention_mask, call.rules, S, Sk):
        mask = None
        how = "in F.scaled_dot_product_attention" + ("(is_causal=True)" if call.is_causal else "") + grouped
    else:
        mask = _folded_mask(q, k, call.attention_mask, call.rules)
        folded = ["the caller's mask"] if call.attention_mask is not None else []
        if call.is_causal:
            folded.append(describe.causal_rule(call))
        if call.alibi_slopes is not None:
            folded.append("ALiBi")
        if call.rules.describe():
            folded.append(call.rules.describe())
        if call.sinks is not None:
            k, v, mask = with_sink(q, k, v, mask, call.sinks)
            folded.append(f"the sink logits as the column of one appended zero key and value, Sk + 1 = {Sk + 1}")
        if mask is None:  # _own_arguments is False: something was folded
            raise RuntimeError("sdpa_stages: no folded mask where the call's own arguments do not suffice")
        kind = str(mask.dtype).removeprefix("torch.")
        how = (f"in F.scaled_dot_product_attention with one {tuple(mask.shape)} {kind} mask "
               f"({', '.join(folded)}){grouped}")
        if bool(row_is_dead(mask).any()):
            how += "; rows with nothing to attend unblocked for the call and zeroed after it"
    backend = torch_backend(q, k, v, mask, dropout_p=call.dropout_p, scale=call.scale,
                            is_causal=mask is None and call.is_causal)
    return [describe.fused(call, "sdpa", how, unmaterialised(call, backend))]


KERNEL = Kernel(
    name="sdpa",
    fn=sdpa_attention,
    summary="torch.nn.functional.scaled_dot_product_attention (fused where torch can)",
    native_gqa=SDPA_HAS_GQA,
    fused=True,
    refuses=_refuses,
    stages=sdpa_stages,
    forward_ad=False,  # an op or autograd.Function without a forward derivative
    functorch=False,  # the lse's autograd.Function has no setup_context; vmap has no batching rule for the op
    bind=_bind,
)
